//! 2D max-pooling over `[N, C, H, W]` without padding, any kernel and
//! stride: the forward, its gradient (each window's cotangent added at the
//! window's first maximum) and that gradient's adjoint (a tensor read at
//! each window's first maximum).
//!
//! On the CPU, f32/f64 run one pass per `(n, c)` plane, planes spread over
//! threads. The generic path (other devices and dtypes) lays the windows out
//! with unfold and uses candle's argmax, scatter and gather: the same
//! results, several times slower (the gradient of a `[256, 16, 14, 14]`
//! pooling took 15 ms that way).

use super::unfold::{fold, unfold, ConvGeom};
use super::{contiguous_slice, has_cpu_kernel, output, par_blocks_mut, zeroed, Elem, Path};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// Window size and step, each (height, width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Window (height, width).
    pub kernel: (usize, usize),
    /// Step (height, width).
    pub stride: (usize, usize),
}

impl Window {
    /// The pooled size of an `h x w` plane, or `None` when the window does
    /// not fit or a size is zero.
    pub fn out_size(&self, (h, w): (usize, usize)) -> Option<(usize, usize)> {
        let ((kh, kw), (sh, sw)) = (self.kernel, self.stride);
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 || h < kh || w < kw {
            return None;
        }
        Some(((h - kh) / sh + 1, (w - kw) / sw + 1))
    }

    fn geom(&self) -> ConvGeom {
        ConvGeom {
            kernel: vec![self.kernel.0, self.kernel.1],
            stride: vec![self.stride.0, self.stride.1],
            padding: vec![0, 0],
            dilation: vec![1, 1],
        }
    }
}

/// One plane's geometry: input `h x w`, output `ho x wo`.
#[derive(Clone, Copy)]
struct Plane {
    win: Window,
    w: usize,
    ho: usize,
    wo: usize,
}

impl Plane {
    fn new(op: &str, win: Window, dims: &[usize]) -> Result<Self> {
        let &[_, _, h, w] = dims else {
            bail!("{op}: expected [N, C, H, W], got {dims:?}")
        };
        let Some((ho, wo)) = win.out_size((h, w)) else {
            bail!("{op}: window {win:?} does not fit an input of shape {dims:?}")
        };
        Ok(Plane { win, w, ho, wo })
    }

    /// Index in the plane of the first maximum of output window `(i, j)`,
    /// and that maximum, for a `kh x kw` window.
    #[inline(always)]
    fn argmax<T: Elem>(&self, x: &[T], i: usize, j: usize, (kh, kw): (usize, usize)) -> (usize, T) {
        let (sh, sw) = self.win.stride;
        let start = (i * sh) * self.w + j * sw;
        let (mut bi, mut bv, mut nan) = (start, x[start], false);
        for r in 0..kh {
            let row = &x[start + r * self.w..start + r * self.w + kw];
            for (c, &v) in row.iter().enumerate() {
                // Strictly greater: ties keep the first, as PyTorch does.
                // Written as selects, not a branch: on data like
                // activations the branch is mispredicted half the time.
                let gt = v > bv;
                bv = if gt { v } else { bv };
                bi = if gt { start + r * self.w + c } else { bi };
                // a value is NaN where it differs from itself
                #[allow(clippy::eq_op)]
                let is_nan = v != v;
                nan |= is_nan;
            }
        }
        if nan {
            return self.first_nan(x, start, (kh, kw));
        }
        (bi, bv)
    }

    /// The first NaN of the window at `start` (PyTorch's max-pool returns
    /// it, and its gradient goes there); rare, so it is a second pass.
    #[cold]
    fn first_nan<T: Elem>(&self, x: &[T], start: usize, (kh, kw): (usize, usize)) -> (usize, T) {
        for r in 0..kh {
            for c in 0..kw {
                let at = start + r * self.w + c;
                #[allow(clippy::eq_op)]
                if x[at] != x[at] {
                    return (at, x[at]);
                }
            }
        }
        (start, x[start])
    }

    /// [`Self::each`] for one window size; with a constant size the
    /// window loops unroll (2x2, the common case, ran 2x faster so).
    #[inline(always)]
    fn each_sized<T: Elem>(&self, x: &[T], k: (usize, usize), f: &mut impl FnMut(usize, usize, T)) {
        for i in 0..self.ho {
            for j in 0..self.wo {
                let (a, v) = self.argmax(x, i, j, k);
                f(i * self.wo + j, a, v);
            }
        }
    }

    /// Calls `f(output index, argmax index, maximum)` for every window.
    fn each<T: Elem>(&self, x: &[T], mut f: impl FnMut(usize, usize, T)) {
        match self.win.kernel {
            (2, 2) => self.each_sized(x, (2, 2), &mut f),
            (3, 3) => self.each_sized(x, (3, 3), &mut f),
            k => self.each_sized(x, k, &mut f),
        }
    }
}

/// What a kernel computes per plane.
#[derive(Clone, Copy)]
enum Kind {
    /// `x -> max over each window`.
    Forward,
    /// `(x, ct) -> dx`.
    Grad,
    /// `(x, g) -> g at each window's argmax`.
    Select,
}

fn run_cpu<T: Elem>(kind: Kind, p: Plane, planes: usize, x: &[T], other: &[T]) -> candle_core::Result<Vec<T>> {
    let in_len = x.len() / planes.max(1);
    let out_len = p.ho * p.wo;
    let block = match kind {
        Kind::Grad => in_len,
        Kind::Forward | Kind::Select => out_len,
    };
    let mut dst = match kind {
        Kind::Grad => zeroed(planes * block)?,
        Kind::Forward | Kind::Select => output(planes * block)?,
    };
    let work = x.len() + other.len() + dst.len();
    par_blocks_mut(&mut dst, block, work, |n, d| {
        let xs = &x[n * in_len..(n + 1) * in_len];
        match kind {
            Kind::Forward => p.each(xs, |o, _, v| d[o] = v),
            Kind::Grad => {
                let ct = &other[n * out_len..(n + 1) * out_len];
                p.each(xs, |o, a, _| d[a] += ct[o])
            }
            Kind::Select => {
                let g = &other[n * in_len..(n + 1) * in_len];
                p.each(xs, |o, a, _| d[o] = g[a])
            }
        }
    });
    Ok(dst)
}

/// A max-pooling kernel as a candle op (one or two operands).
struct PoolOp {
    kind: Kind,
    win: Window,
}

impl PoolOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Forward => "max_pool2d",
            Kind::Grad => "max_pool2d_grad",
            Kind::Select => "max_pool2d_select",
        }
    }

    fn fwd(&self, x: &CpuStorage, lx: &Layout, other: Option<(&CpuStorage, &Layout)>) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let dims = lx.dims();
        let p = Plane::new(op, self.win, dims)?;
        let planes = dims[0] * dims[1];
        let shape = match self.kind {
            Kind::Grad => Shape::from(dims),
            Kind::Forward | Kind::Select => Shape::from((dims[0], dims[1], p.ho, p.wo)),
        };
        let storage = match (x, other) {
            (CpuStorage::F32(x), None) => {
                CpuStorage::F32(run_cpu(self.kind, p, planes, contiguous_slice(op, x, lx)?, &[])?)
            }
            (CpuStorage::F64(x), None) => {
                CpuStorage::F64(run_cpu(self.kind, p, planes, contiguous_slice(op, x, lx)?, &[])?)
            }
            (CpuStorage::F32(x), Some((CpuStorage::F32(o), lo))) => CpuStorage::F32(run_cpu(
                self.kind,
                p,
                planes,
                contiguous_slice(op, x, lx)?,
                contiguous_slice(op, o, lo)?,
            )?),
            (CpuStorage::F64(x), Some((CpuStorage::F64(o), lo))) => CpuStorage::F64(run_cpu(
                self.kind,
                p,
                planes,
                contiguous_slice(op, x, lx)?,
                contiguous_slice(op, o, lo)?,
            )?),
            _ => bail!("{op}: no CPU kernel for these dtypes"),
        };
        Ok((storage, shape))
    }
}

impl CustomOp1 for PoolOp {
    fn name(&self) -> &'static str {
        PoolOp::name(self)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s, l, None)
    }
}

impl CustomOp2 for PoolOp {
    fn name(&self) -> &'static str {
        PoolOp::name(self)
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd(s1, l1, Some((s2, l2)))
    }
}

/// Checks `x: [N, C, H, W]` against the window; returns the pooled shape.
fn check(op: &str, x: &Tensor, win: Window) -> Result<(usize, usize, usize, usize)> {
    let (n, c, h, w) = x.dims4()?;
    match win.out_size((h, w)) {
        Some((ho, wo)) => Ok((n, c, ho, wo)),
        None => bail!("{op}: window {win:?} does not fit an input of shape {:?}", x.dims()),
    }
}

fn check_same(op: &str, a: &Tensor, b: &[usize]) -> Result<()> {
    if a.dims() != b {
        bail!("{op}: expected an operand of shape {b:?}, got {:?}", a.dims())
    }
    Ok(())
}

fn cpu_pair(x: &Tensor, o: &Tensor, path: Path) -> bool {
    has_cpu_kernel(x, path) && x.dtype() == o.dtype() && o.device().is_cpu()
}

/// Maximum over each window: `[N, C, H, W] -> [N, C, H', W']`.
pub fn max_pool2d(x: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let op = PoolOp {
        kind: Kind::Forward,
        win,
    };
    check(op.name(), x, win)?;
    if has_cpu_kernel(x, path) {
        return x.contiguous()?.apply_op1_no_bwd(&op);
    }
    x.max_pool2d_with_stride(win.kernel, win.stride)
}

/// The gradient of [`max_pool2d`]: `ct: [N, C, H', W']` added into a zero
/// `[N, C, H, W]` at each window's first maximum of `x`.
pub fn max_pool2d_grad(x: &Tensor, ct: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let op = PoolOp { kind: Kind::Grad, win };
    let (n, c, ho, wo) = check(op.name(), x, win)?;
    check_same(op.name(), ct, &[n, c, ho, wo])?;
    if cpu_pair(x, ct, path) {
        return x.contiguous()?.apply_op2_no_bwd(&ct.contiguous()?, &op);
    }
    grad_generic(x, ct, win, path)
}

fn grad_generic(x: &Tensor, ct: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let (ho, wo) = (ct.dims()[2], ct.dims()[3]);
    let idx = argmax_generic(x, win, path)?;
    let (kk, l) = (win.kernel.0 * win.kernel.1, ho * wo);
    let src = ct.contiguous()?.reshape((n * c, 1, l))?;
    let cols = Tensor::zeros((n * c, kk, l), ct.dtype(), ct.device())?.scatter_add(&idx, &src, 1)?;
    fold(&cols, &win.geom(), &[h, w], path)?.reshape((n, c, h, w))
}

/// The adjoint of [`max_pool2d_grad`] in its cotangent: `g: [N, C, H, W]`
/// read at each window's first maximum of `x` -> `[N, C, H', W']`.
pub fn max_pool2d_select(x: &Tensor, g: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let op = PoolOp {
        kind: Kind::Select,
        win,
    };
    check(op.name(), x, win)?;
    check_same(op.name(), g, x.dims())?;
    if cpu_pair(x, g, path) {
        return x.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &op);
    }
    select_generic(x, g, win, path)
}

fn select_generic(x: &Tensor, g: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let (n, c, ho, wo) = check("max_pool2d_select", x, win)?;
    let idx = argmax_generic(x, win, path)?;
    windows(g, win, path)?.gather(&idx, 1)?.reshape((n, c, ho, wo))
}

/// The windows of each plane: `N C H W -> (N C) (kh kw) L`.
fn windows(x: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    unfold(&x.contiguous()?.reshape((n * c, 1, h, w))?, &win.geom(), path)
}

/// Index of each window's first maximum: `(N C) 1 L`.
fn argmax_generic(x: &Tensor, win: Window, path: Path) -> Result<Tensor> {
    windows(x, win, path)?.argmax_keepdim(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::max_diff;
    use candle_core::{DType, Device};

    /// The CPU kernels against the generic path, on data with ties (ReLU
    /// output is half zeros, and first-maximum order matters there), for
    /// overlapping, tiling and gapped windows, f32 and f64.
    #[test]
    fn cpu_kernels_match_the_generic_path() -> Result<()> {
        let shapes = [
            ((2, 2), (2, 2)),
            ((2, 2), (1, 1)),
            ((3, 2), (2, 3)),
            ((1, 3), (1, 1)),
            ((3, 3), (4, 4)),
        ];
        for dt in [DType::F32, DType::F64] {
            for &(kernel, stride) in &shapes {
                let win = Window { kernel, stride };
                let x = Tensor::randn(0f32, 1., (2, 3, 9, 11), &Device::Cpu)?
                    .relu()?
                    .to_dtype(dt)?;
                let (ho, wo) = win.out_size((9, 11)).expect("window fits");
                let ct = Tensor::randn(0f32, 1., (2, 3, ho, wo), &Device::Cpu)?.to_dtype(dt)?;
                let g = Tensor::randn(0f32, 1., (2, 3, 9, 11), &Device::Cpu)?.to_dtype(dt)?;
                let pairs = [
                    (
                        max_pool2d(&x, win, Path::Fast)?,
                        x.max_pool2d_with_stride(kernel, stride)?,
                    ),
                    (
                        max_pool2d_grad(&x, &ct, win, Path::Fast)?,
                        grad_generic(&x, &ct, win, Path::Portable)?,
                    ),
                    (
                        max_pool2d_select(&x, &g, win, Path::Fast)?,
                        select_generic(&x, &g, win, Path::Portable)?,
                    ),
                ];
                for (fast, slow) in pairs {
                    // Overlapping windows add into one place in another order.
                    assert!(max_diff(&fast, &slow)? < 1e-5, "{win:?} {dt:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn windows_that_do_not_fit_are_errors() -> Result<()> {
        let x = Tensor::zeros((1, 1, 2, 2), DType::F32, &Device::Cpu)?;
        let win = Window {
            kernel: (3, 3),
            stride: (1, 1),
        };
        assert!(max_pool2d(&x, win, Path::Fast).is_err());
        let ct = Tensor::zeros((1, 1, 2, 2), DType::F32, &Device::Cpu)?;
        let ok = Window {
            kernel: (2, 2),
            stride: (1, 1),
        };
        assert!(max_pool2d_grad(&x, &ct, ok, Path::Fast).is_err()); // ct must be [1, 1, 1, 1]
        Ok(())
    }
}
