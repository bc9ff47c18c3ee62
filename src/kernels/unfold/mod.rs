//! im2col / col2im ("unfold" / "fold") for 1-, 2- and 3-d convolutions, and a
//! convolution built from them.
//!
//! Per-sample gradients of a convolution need the unfolded input explicitly
//! (the weight gradient of sample `n` is `grad_out[n] @ unfold(x)[n]^T`), so
//! the unfold is a first-class, fast operation here rather than a hidden step
//! inside a convolution kernel.
//!
//! Layouts follow PyTorch's `F.unfold` / `F.fold`, generalised to N-d:
//! `x: [N, C, *S]` unfolds to `[N, C * prod(kernel), L]` where
//! `L = prod(out_spatial)`; the row index is `(c, k0, k1, ..)` with `c`
//! outermost and the column index is the output position in row-major order.
//!
//! On the CPU, f32 and f64 go through hand-written kernels ([`CustomOp1`]s)
//! that are multi-threaded over the `N * C` planes. Every other device/dtype
//! goes through [`unfold_generic`] / [`fold_generic`], built from ordinary
//! candle ops, which give identical results. Both paths are differentiable:
//! the backward of `unfold` is `fold` and vice versa.

mod cpu;
mod generic;
mod plan;
#[cfg(test)]
mod tests;

use super::{contiguous_slice, has_cpu_kernel, Elem, Path};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use cpu::{fold_cpu, unfold_cpu};
use plan::Plan3;

// The geometry is part of the IR; re-exported so that
// `kernels::unfold::ConvGeom` keeps working.
pub use crate::ir::ConvGeom;
pub use generic::{fold_generic, unfold_generic};

// ---------------------------------------------------------------------------
// Input checks (`ConvGeom` itself is in `crate::ir`)
// ---------------------------------------------------------------------------

/// Checks `x: [N, C, *S]` against `g`; returns the output spatial size.
pub(crate) fn check_input(op: &str, x: &Tensor, g: &ConvGeom) -> Result<Vec<usize>> {
    g.validate(op)?;
    if x.rank() != g.ndim() + 2 {
        bail!(
            "{op}: a {}-d geometry needs an input of rank {} ([N, C, *spatial]), got shape {:?}",
            g.ndim(),
            g.ndim() + 2,
            x.dims()
        )
    }
    g.out_spatial_for(op, &x.dims()[2..])
}

/// Checks `cols: [N, C * prod(k), L]` against `g` and the target `spatial`
/// size; returns `(N, C, out_spatial)`.
fn check_cols(op: &str, cols: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<(usize, usize, Vec<usize>)> {
    let out = g.out_spatial_for(op, spatial)?;
    let (k, l) = (g.kernel_numel(), out.iter().product::<usize>());
    let &[n, ck, cl] = cols.dims() else {
        bail!(
            "{op}: expected columns of rank 3 [N, C*prod(kernel), L], got shape {:?}",
            cols.dims()
        )
    };
    if ck % k != 0 || cl != l {
        bail!(
            "{op}: columns of shape {:?} do not match kernel {:?} (prod {k}) and output spatial {out:?} \
             (L = {l}) for spatial size {spatial:?}",
            cols.dims(),
            g.kernel
        )
    }
    Ok((n, ck / k, out))
}

// ---------------------------------------------------------------------------
// CPU kernels (plans in `plan`, loops in `cpu`)
// ---------------------------------------------------------------------------

/// Runs `kernel` on the f32/f64 storage (anything else is an error: the
/// wrappers send other dtypes down the generic path).
fn dispatch(
    op: &str,
    storage: &CpuStorage,
    layout: &Layout,
    p: &Plan3,
    planes: usize,
    kernel: Kernel,
) -> Result<CpuStorage> {
    Ok(match storage {
        CpuStorage::F32(v) => CpuStorage::F32(kernel.run(contiguous_slice(op, v, layout)?, p, planes)?),
        CpuStorage::F64(v) => CpuStorage::F64(kernel.run(contiguous_slice(op, v, layout)?, p, planes)?),
        s => bail!("{op}: no CPU kernel for dtype {:?}", s.dtype()),
    })
}

/// Which of the two kernels to run (a fn pointer cannot be generic over `T`).
#[derive(Clone, Copy)]
enum Kernel {
    Unfold,
    Fold,
}

impl Kernel {
    fn run<T: Elem>(self, src: &[T], p: &Plan3, planes: usize) -> candle_core::Result<Vec<T>> {
        match self {
            Kernel::Unfold => unfold_cpu(src, p, planes),
            Kernel::Fold => fold_cpu(src, p, planes),
        }
    }
}

/// `unfold` as a candle op; its backward is `fold`.
struct UnfoldOp {
    geom: ConvGeom,
}

impl CustomOp1 for UnfoldOp {
    fn name(&self) -> &'static str {
        "unfold"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.dims();
        if dims.len() != self.geom.ndim() + 2 {
            bail!(
                "unfold: input of shape {dims:?} does not match geometry {:?}",
                self.geom
            )
        }
        let out = self.geom.out_spatial_for("unfold", &dims[2..])?;
        let p = Plan3::new(&self.geom, &dims[2..], &out);
        let (n, c) = (dims[0], dims[1]);
        let shape = Shape::from((n, c * self.geom.kernel_numel(), p.out_len()));
        Ok((dispatch("unfold", storage, layout, &p, n * c, Kernel::Unfold)?, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        fold(grad, &self.geom, &arg.dims()[2..], Path::Fast).map(Some)
    }
}

/// `fold` as a candle op; its backward is `unfold`.
struct FoldOp {
    geom: ConvGeom,
    spatial: Vec<usize>,
}

impl CustomOp1 for FoldOp {
    fn name(&self) -> &'static str {
        "fold"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.geom.out_spatial_for("fold", &self.spatial)?;
        let p = Plan3::new(&self.geom, &self.spatial, &out);
        let &[n, ck, l] = layout.dims() else {
            bail!("fold: expected columns of rank 3, got shape {:?}", layout.dims())
        };
        let k = self.geom.kernel_numel();
        if ck % k != 0 || l != p.out_len() {
            bail!(
                "fold: columns of shape {:?} do not match {:?}",
                layout.dims(),
                self.geom
            )
        }
        let c = ck / k;
        let mut shape = vec![n, c];
        shape.extend_from_slice(&self.spatial);
        Ok((
            dispatch("fold", storage, layout, &p, n * c, Kernel::Fold)?,
            Shape::from(shape),
        ))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        unfold(grad, &self.geom, Path::Fast).map(Some)
    }
}

// ---------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------

/// im2col, PyTorch `F.unfold` semantics generalised to 1D/2D/3D:
/// `x: [N, C, *S]` (S has N spatial dims) -> `[N, C * prod(kernel), L]` where
/// `L = prod(out_spatial)`.
///
/// The row index is `(c, k0, k1, ..)` with `c` outermost (exactly torch's
/// order), the column is the output position in row-major order. Zero
/// padding. Differentiable (the backward is [`fold`]).
pub fn unfold(x: &Tensor, g: &ConvGeom, path: Path) -> Result<Tensor> {
    check_input("unfold", x, g)?;
    if has_cpu_kernel(x, path) {
        x.contiguous()?.apply_op1(UnfoldOp { geom: g.clone() })
    } else {
        unfold_generic(x, g)
    }
}

/// col2im, the adjoint of [`unfold`] (PyTorch `F.fold`):
/// `cols: [N, C*prod(k), L]` -> `[N, C, *spatial]`, summing overlapping
/// contributions. Differentiable (the backward is [`unfold`]).
pub fn fold(cols: &Tensor, g: &ConvGeom, spatial: &[usize], path: Path) -> Result<Tensor> {
    check_cols("fold", cols, g, spatial)?;
    if has_cpu_kernel(cols, path) {
        let op = FoldOp {
            geom: g.clone(),
            spatial: spatial.to_vec(),
        };
        cols.contiguous()?.apply_op1(op)
    } else {
        fold_generic(cols, g, spatial)
    }
}

/// Convolution by unfold + matmul: `x: [N, Cin, *S]`,
/// `w: [Cout, Cin/groups, *kernel]` -> `[N, Cout, *out_spatial]`, any
/// `groups`, no bias.
///
/// Each group is ONE batched matmul `w_g [Cout/g, Cin/g*K] @ cols_g [N,
/// Cin/g*K, L]`, reading its rows of the shared unfold in place (no
/// block-diagonal weight, no per-group copy of the columns). On the CPU the
/// product is the crate's kernel, which candle's autodiff does not
/// differentiate (the crate's own VJP rules do).
pub fn conv_unfold(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize, path: Path) -> Result<Tensor> {
    let out = check_input("conv_unfold", x, g)?;
    let (n, cin) = (x.dim(0)?, x.dim(1)?);
    let cout = check_weight(x, w, g, groups)?;
    let k = g.kernel_numel();
    let (cin_g, cout_g) = (cin / groups, cout / groups);
    let cols = unfold(x, g, path)?;
    let w = w.reshape((cout, cin_g * k))?;
    // The weight is read at batch stride 0, with no copy.
    let outs = (0..groups)
        .map(|i| {
            let wg = w.narrow(0, i * cout_g, cout_g)?;
            // copies inside this lowering are its own, not an operand's relayout
            super::bmm::each_example(
                &wg,
                &cols.narrow(1, i * cin_g * k, cin_g * k)?,
                &Default::default(),
                path,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    // `cat` of a single tensor is free.
    Tensor::cat(&outs, 1)?.reshape([&[n, cout], out.as_slice()].concat())
}

/// Checks the weight of [`conv_unfold`]; returns `Cout`.
fn check_weight(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> Result<usize> {
    let cin = x.dim(1)?;
    let ok_rank = w.rank() == g.ndim() + 2 && w.dims()[2..] == g.kernel[..];
    if !ok_rank {
        bail!(
            "conv_unfold: weight of shape {:?} does not match [Cout, Cin/groups, *kernel] with kernel {:?}",
            w.dims(),
            g.kernel
        )
    }
    let (cout, cin_w) = (w.dim(0)?, w.dim(1)?);
    if groups == 0 || cin % groups != 0 || cout % groups != 0 || cin_w * groups != cin {
        bail!(
            "conv_unfold: input of shape {:?} and weight of shape {:?} do not fit groups = {groups} \
             (need Cin and Cout divisible by groups and weight dim 1 = Cin/groups)",
            x.dims(),
            w.dims()
        )
    }
    Ok(cout)
}
