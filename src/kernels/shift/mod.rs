//! Stride-1 convolutions without im2col ("shifted GEMMs").
//!
//! With stride 1, kernel tap `t` of output position `o` reads the input at
//! `o + shift[t]` on the input's own grid. So if outputs are laid out on
//! that grid too ("wide": row-major with the input's row lengths, the
//! columns past the output's edge unused), every tap is one GEMM with no
//! copy at all:
//!
//! ```text
//! y_wide[n] [Cout, span] += w[:, :, t] [Cout, Cin] @ x[n][:, shift[t] ..] [Cin, span]
//! ```
//!
//! and the two gradients are the same sum read the other ways. im2col
//! writes and reads `prod(kernel)` copies of the input instead (9x for a
//! 3x3 kernel, 27x for 3x3x3); on the tutorial CNN's second convolution the
//! im2col alone took longer than its GEMM.
//!
//! `span`, the wide length of one output plane, is `sum_d (O_d - 1) *
//! stride_d + 1` for the input's strides `stride_d`, so the last tap's reads
//! end exactly at the plane's last element: nothing is read out of bounds
//! and nothing is padded. Input padding is applied first (a copy).

mod lines;

use super::unfold::{check_input, ConvGeom};
use super::{contiguous_slice, has_cpu_kernel, max_threads, output, par_blocks_mut, product, zeroed, Elem, Mat, Path};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// Fewer input channels than this go through im2col: each tap's GEMM has
/// the channels as its inner dimension, too short to run well.
const MIN_CHANNELS: usize = 8;

/// Below this many input channels the taps of each kernel line are folded
/// into one GEMM (`lines`).
const FOLD_BELOW: usize = 64;

/// Whether an ungrouped convolution with this geometry and `cin` input
/// channels takes the shifted-GEMM kernels.
pub fn applies(g: &ConvGeom, groups: usize, cin: usize) -> bool {
    groups == 1 && cin >= MIN_CHANNELS && g.stride.iter().all(|&s| s == 1)
}

/// The geometry of one call, on the padded input grid.
#[derive(Clone, Debug)]
struct Plan {
    cin: usize,
    cout: usize,
    /// Padded input spatial size and its row-major strides.
    size: Vec<usize>,
    stride: Vec<usize>,
    /// Output spatial size.
    out: Vec<usize>,
    /// Offset of each kernel tap on the input grid.
    shifts: Vec<usize>,
    /// Taps of the last kernel axis folded into each GEMM (1: none).
    fold: usize,
    /// The last axis's dilation (the offset between folded taps).
    dil_last: usize,
}

impl Plan {
    fn new(g: &ConvGeom, cin: usize, cout: usize, size: &[usize]) -> Result<Self> {
        let out = g.out_spatial_for("conv_shift", size)?;
        let nd = size.len();
        let mut stride = vec![1; nd];
        for d in (0..nd.saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * size[d + 1];
        }
        let mut shifts = Vec::with_capacity(g.kernel_numel());
        for t in 0..g.kernel_numel() {
            let (mut rest, mut shift) = (t, 0);
            for d in (0..nd).rev() {
                shift += (rest % g.kernel[d]) * g.dilation[d] * stride[d];
                rest /= g.kernel[d];
            }
            shifts.push(shift);
        }
        let kw = g.kernel[nd - 1];
        let fold = if cin < FOLD_BELOW && kw > 1 { kw } else { 1 };
        Ok(Plan {
            cin,
            cout,
            size: size.to_vec(),
            stride,
            out,
            shifts,
            fold,
            dil_last: g.dilation[nd - 1],
        })
    }

    fn plane(&self) -> usize {
        self.size.iter().product()
    }

    fn out_len(&self) -> usize {
        self.out.iter().product()
    }

    fn taps(&self) -> usize {
        self.shifts.len()
    }

    /// GEMMs per example: one per kernel line.
    fn lines(&self) -> usize {
        self.taps() / self.fold
    }

    /// The offset of line `l`'s first tap.
    fn line_shift(&self, l: usize) -> usize {
        self.shifts[l * self.fold]
    }

    /// The GEMMs' folded dimension: input channels times folded taps.
    fn rk(&self) -> usize {
        self.cin * self.fold
    }

    /// One example's input rows for the line GEMMs: the input itself, or
    /// its folded copy (`lines::input`) held in `buf`.
    fn input_rows<'a, T: Elem>(&self, xs: &'a [T], buf: &'a mut Vec<T>) -> &'a [T] {
        if self.fold == 1 {
            return xs;
        }
        *buf = lines::input(xs, self);
        buf
    }

    /// Wide length of one output plane.
    fn span(&self) -> usize {
        self.out
            .iter()
            .zip(&self.stride)
            .map(|(o, s)| (o - 1) * s)
            .sum::<usize>()
            + 1
    }

    /// Calls `f(dense start, wide start, len)` for each output row (a run
    /// along the last axis), for moving between the dense and wide layouts.
    fn rows(&self, mut f: impl FnMut(usize, usize, usize)) {
        let nd = self.out.len();
        let len = self.out[nd - 1];
        for r in 0..self.out_len() / len {
            let (mut rest, mut wide) = (r, 0);
            for d in (0..nd - 1).rev() {
                wide += (rest % self.out[d]) * self.stride[d];
                rest /= self.out[d];
            }
            f(r * len, wide, len);
        }
    }
}

/// One accumulating GEMM `dst [m, n] += lhs [m, k] @ rhs [k, n]`.
struct Gemm<'a, T> {
    m: usize,
    n: usize,
    k: usize,
    lhs: Mat<'a, T>,
    rhs: Mat<'a, T>,
}

impl<T: Elem> Gemm<'_, T> {
    /// Runs the product into `dst` at row and column strides `ds`.
    fn run(&self, dst: &mut [T], ds: (usize, usize), one: T, par: gemm::Parallelism) {
        product(dst, ds, self.lhs, self.rhs, (self.m, self.n, self.k), true, one, par);
    }
}

/// Threads inside each GEMM when there are too few examples to give every
/// thread its own.
fn inner_par(n: usize) -> gemm::Parallelism {
    if n >= 2 * max_threads() {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(max_threads())
    }
}

/// Runs `f(i, block)` over the `block`-sized blocks of `dst`: spread over
/// threads when there are enough, otherwise in order (each GEMM then uses
/// every thread, see `inner_par`).
fn per_example<T: Elem>(dst: &mut [T], block: usize, n: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if n >= 2 * max_threads() {
        par_blocks_mut(dst, block, usize::MAX, f);
    } else {
        for (i, d) in dst.chunks_exact_mut(block).enumerate() {
            f(i, d)
        }
    }
}

/// `y[n] = sum_t w_t @ x[n] shifted by t`, cropped from the wide layout;
/// one GEMM per kernel line (`lines`).
fn conv_cpu<T: Elem>(x: &[T], w: &[T], p: &Plan, n: usize, one: T) -> candle_core::Result<Vec<T>> {
    let (plane, span, rk) = (p.plane(), p.span(), p.rk());
    let wf = lines::weight(w, p)?;
    let mut dst = output(n * p.cout * p.out_len())?;
    let par = inner_par(n);
    per_example(&mut dst, p.cout * p.out_len(), n, |i, y| {
        let mut buf = Vec::new();
        let rows = p.input_rows(&x[i * p.cin * plane..(i + 1) * p.cin * plane], &mut buf);
        // one example's scratch (the outputs are allocated fallibly)
        let mut wide = vec![T::default(); p.cout * span];
        for l in 0..p.lines() {
            let g = Gemm {
                m: p.cout,
                n: span,
                k: rk,
                lhs: Mat {
                    data: &wf[l * p.cout * rk..],
                    rs: rk,
                    cs: 1,
                },
                rhs: Mat {
                    data: &rows[p.line_shift(l)..],
                    rs: plane,
                    cs: 1,
                },
            };
            g.run(&mut wide, (span, 1), one, par);
        }
        for c in 0..p.cout {
            let (dense, wide) = (
                &mut y[c * p.out_len()..(c + 1) * p.out_len()],
                &wide[c * span..(c + 1) * span],
            );
            p.rows(|d, w, len| dense[d..d + len].copy_from_slice(&wide[w..w + len]));
        }
    });
    Ok(dst)
}

/// `ct [N, Cout, O]` on the wide layout, zeros in the unused columns.
fn widen<T: Elem>(ct: &[T], p: &Plan, n: usize) -> candle_core::Result<Vec<T>> {
    let (span, len) = (p.span(), p.out_len());
    let mut wide = zeroed(n * p.cout * span)?;
    for (dense, wide) in ct.chunks_exact(len).zip(wide.chunks_exact_mut(span)) {
        p.rows(|d, w, l| wide[w..w + l].copy_from_slice(&dense[d..d + l]));
    }
    Ok(wide)
}

/// `dx[n] = sum_t (w_t^T @ ct[n]) shifted back by t`; one GEMM per kernel
/// line, into the folded rows first where lines are folded.
fn grad_input_cpu<T: Elem>(ct: &[T], w: &[T], p: &Plan, n: usize, one: T) -> candle_core::Result<Vec<T>> {
    let (plane, span, rk) = (p.plane(), p.span(), p.rk());
    let wf = lines::weight(w, p)?;
    let wide = widen(ct, p, n)?;
    let mut dst = zeroed(n * p.cin * plane)?;
    let par = inner_par(n);
    per_example(&mut dst, p.cin * plane, n, |i, dx| {
        let c = &wide[i * p.cout * span..(i + 1) * p.cout * span];
        let mut y3 = if p.fold > 1 {
            vec![T::default(); rk * plane]
        } else {
            Vec::new()
        };
        let target: &mut [T] = if p.fold > 1 { &mut y3 } else { dx };
        for l in 0..p.lines() {
            // the line's weight transposed: [Cin kw, Cout]
            let g = Gemm {
                m: rk,
                n: span,
                k: p.cout,
                lhs: Mat {
                    data: &wf[l * p.cout * rk..],
                    rs: 1,
                    cs: rk,
                },
                rhs: Mat {
                    data: c,
                    rs: span,
                    cs: 1,
                },
            };
            g.run(&mut target[p.line_shift(l)..], (plane, 1), one, par);
        }
        if p.fold > 1 {
            lines::add_folded(&y3, p, dx);
        }
    });
    Ok(dst)
}

/// Adds example `i`'s weight gradient into `dw [Cout, Cin, K]`:
/// `dw[:, :, t] += ct_wide[i] [Cout, span] @ (x[i] shifted by t)^T [span, Cin]`
/// for every tap `t` (`dw` at row stride `Cin K`, column stride `K`). Weight
/// gradients keep one GEMM per tap (see `weight_op`).
fn add_weight_grad<T: Elem>(dw: &mut [T], x: &[T], wide: &[T], p: &Plan, i: usize, one: T, par: gemm::Parallelism) {
    let (plane, span, kn) = (p.plane(), p.span(), p.taps());
    let xs = &x[i * p.cin * plane..];
    let c = &wide[i * p.cout * span..(i + 1) * p.cout * span];
    for (t, &shift) in p.shifts.iter().enumerate() {
        let g = Gemm {
            m: p.cout,
            n: p.cin,
            k: span,
            lhs: Mat {
                data: c,
                rs: span,
                cs: 1,
            },
            rhs: Mat {
                data: &xs[shift..],
                rs: 1,
                cs: plane,
            },
        };
        g.run(&mut dw[t..], (p.cin * kn, kn), one, par);
    }
}

/// `dw_t = sum_n ct[n] @ (x[n] shifted by t)^T`, one partial sum per
/// thread's share of the examples.
fn grad_weight_cpu<T: Elem>(x: &[T], ct: &[T], p: &Plan, n: usize, one: T) -> candle_core::Result<Vec<T>> {
    let wide = widen(ct, p, n)?;
    let size = p.cout * p.cin * p.taps();
    let parts = if n >= 2 * max_threads() { max_threads() } else { 1 };
    let per = n.div_ceil(parts);
    let par = inner_par(n);
    let mut partial = zeroed(parts * size)?;
    par_blocks_mut(&mut partial, size, usize::MAX, |j, dw| {
        for i in j * per..((j + 1) * per).min(n) {
            add_weight_grad(dw, x, &wide, p, i, one, par);
        }
    });
    let (first, rest) = partial.split_at_mut(size);
    for r in rest.chunks_exact(size) {
        for (a, b) in first.iter_mut().zip(r) {
            *a += *b;
        }
    }
    partial.truncate(size);
    Ok(partial)
}

/// `dw[n]_t = ct[n] @ (x[n] shifted by t)^T` for each example, not summed.
fn grad_weight_each_cpu<T: Elem>(x: &[T], ct: &[T], p: &Plan, n: usize, one: T) -> candle_core::Result<Vec<T>> {
    let wide = widen(ct, p, n)?;
    let mut dst = zeroed(n * p.cout * p.cin * p.taps())?;
    let par = inner_par(n);
    per_example(&mut dst, p.cout * p.cin * p.taps(), n, |i, dw| {
        add_weight_grad(dw, x, &wide, p, i, one, par)
    });
    Ok(dst)
}

/// Which of the three products a [`ShiftOp`] computes.
#[derive(Clone, Copy)]
enum Kind {
    /// `(x, w) -> y`
    Conv,
    /// `(ct, w) -> dx` on the padded grid
    GradInput,
    /// `(x, ct) -> dw`
    GradWeight,
    /// `(x, ct) -> dw` per example
    GradWeightEach,
}

struct ShiftOp {
    kind: Kind,
    plan: Plan,
    n: usize,
}

impl ShiftOp {
    fn run<T: Elem>(&self, a: &[T], b: &[T], one: T) -> candle_core::Result<Vec<T>> {
        match self.kind {
            Kind::Conv => conv_cpu(a, b, &self.plan, self.n, one),
            Kind::GradInput => grad_input_cpu(a, b, &self.plan, self.n, one),
            Kind::GradWeight => grad_weight_cpu(a, b, &self.plan, self.n, one),
            Kind::GradWeightEach => grad_weight_each_cpu(a, b, &self.plan, self.n, one),
        }
    }

    /// The result's shape; the weight gradient comes with its taps on one
    /// axis, `[Cout, Cin, prod(k)]`, for the caller to reshape.
    fn shape(&self) -> Shape {
        let p = &self.plan;
        match self.kind {
            Kind::Conv => Shape::from([&[self.n, p.cout], &p.out[..]].concat()),
            Kind::GradInput => Shape::from([&[self.n, p.cin], &p.size[..]].concat()),
            Kind::GradWeight => Shape::from((p.cout, p.cin, p.taps())),
            Kind::GradWeightEach => Shape::from((self.n, p.cout, p.cin, p.taps())),
        }
    }
}

impl CustomOp2 for ShiftOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Conv => "conv_shift",
            Kind::GradInput => "conv_shift_grad_input",
            Kind::GradWeight => "conv_shift_grad_weight",
            Kind::GradWeightEach => "conv_shift_grad_weight_each",
        }
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32(self.run(contiguous_slice(op, a, l1)?, contiguous_slice(op, b, l2)?, 1.0)?)
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64(self.run(contiguous_slice(op, a, l1)?, contiguous_slice(op, b, l2)?, 1.0)?)
            }
            _ => bail!("{op}: no CPU kernel for these dtypes"),
        };
        Ok((out, self.shape()))
    }
}

/// `x` padded with zeros by `geom.padding` on every spatial axis.
fn pad(x: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let mut x = x.clone();
    for (d, &p) in g.padding.iter().enumerate() {
        if p > 0 {
            x = x.pad_with_zeros(d + 2, p, p)?;
        }
    }
    Ok(x)
}

fn padded_size(g: &ConvGeom, spatial: &[usize]) -> Vec<usize> {
    spatial.iter().zip(&g.padding).map(|(s, p)| s + 2 * p).collect()
}

/// The operands must suit the kernels: CPU f32/f64, same dtype, `applies`.
fn check(op: &str, a: &Tensor, b: &Tensor, g: &ConvGeom, cin: usize) -> Result<()> {
    if !has_cpu_kernel(a, Path::Fast) || a.dtype() != b.dtype() || !b.device().is_cpu() || !applies(g, 1, cin) {
        bail!("{op}: needs CPU f32/f64 operands, stride 1 and at least {MIN_CHANNELS} input channels")
    }
    Ok(())
}

/// Ungrouped stride-1 convolution `x [N, Cin, *S] * w [Cout, Cin, *k] ->
/// [N, Cout, *O]` by shifted GEMMs.
pub fn conv(x: &Tensor, w: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    check_input("conv_shift", x, g)?;
    let (n, cin, cout) = (x.dim(0)?, x.dim(1)?, w.dim(0)?);
    check("conv_shift", x, w, g, cin)?;
    if w.dims() != [&[cout, cin], &g.kernel[..]].concat() {
        bail!(
            "conv_shift: weight {:?} does not match input {:?} and {g:?}",
            w.dims(),
            x.dims()
        )
    }
    let size = padded_size(g, &x.dims()[2..]);
    let plan = Plan::new(&unpadded(g), cin, cout, &size)?;
    let op = ShiftOp {
        kind: Kind::Conv,
        plan,
        n,
    };
    pad(x, g)?.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)
}

/// The input gradient of [`conv`]: `ct [N, Cout, *O]`, `w` -> `[N, Cin, *spatial]`.
pub fn grad_input(ct: &Tensor, w: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<Tensor> {
    let (n, cout, cin) = (ct.dim(0)?, w.dim(0)?, w.dim(1)?);
    check("conv_shift_grad_input", ct, w, g, cin)?;
    let size = padded_size(g, spatial);
    let plan = Plan::new(&unpadded(g), cin, cout, &size)?;
    if ct.dims() != [&[n, cout], &plan.out[..]].concat() {
        bail!(
            "conv_shift_grad_input: cotangent {:?} does not match {g:?} on {spatial:?}",
            ct.dims()
        )
    }
    let op = ShiftOp {
        kind: Kind::GradInput,
        plan,
        n,
    };
    let mut dx = ct.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)?;
    for (d, (&p, &s)) in g.padding.iter().zip(spatial).enumerate() {
        if p > 0 {
            dx = dx.narrow(d + 2, p, s)?;
        }
    }
    dx.contiguous()
}

/// The weight gradient of [`conv`], summed over examples: `x`, `ct` ->
/// `[Cout, Cin, *k]`.
pub fn grad_weight(x: &Tensor, ct: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let (cout, cin) = (ct.dim(1)?, x.dim(1)?);
    let dw = weight_op(Kind::GradWeight, x, ct, g)?;
    dw.reshape([&[cout, cin], &g.kernel[..]].concat())
}

/// The weight gradient of [`conv`] for each example: `x [N, Cin, *S]`,
/// `ct [N, Cout, *O]` -> `[N, Cout, Cin, *k]`.
pub fn grad_weight_each(x: &Tensor, ct: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let (n, cout, cin) = (x.dim(0)?, ct.dim(1)?, x.dim(1)?);
    let dw = weight_op(Kind::GradWeightEach, x, ct, g)?;
    dw.reshape([&[n, cout, cin], &g.kernel[..]].concat())
}

fn weight_op(kind: Kind, x: &Tensor, ct: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let op = "conv_shift_grad_weight";
    check_input(op, x, g)?;
    let (n, cin, cout) = (x.dim(0)?, x.dim(1)?, ct.dim(1)?);
    check(op, x, ct, g, cin)?;
    let size = padded_size(g, &x.dims()[2..]);
    let plan = Plan::new(&unpadded(g), cin, cout, &size)?;
    if ct.dims() != [&[n, cout], &plan.out[..]].concat() {
        bail!("{op}: cotangent {:?} does not match input {:?}", ct.dims(), x.dims())
    }
    // Weight gradients keep one GEMM per tap: folded, their GEMMs read the
    // folded rows along the inner dimension and ran 2x slower (the conv3d
    // net's second layer, 0.95 -> 1.8 ms).
    let plan = Plan { fold: 1, ..plan };
    let op = ShiftOp { kind, plan, n };
    pad(x, g)?.contiguous()?.apply_op2_no_bwd(&ct.contiguous()?, &op)
}

/// The same geometry without padding (the kernels see padded inputs).
fn unpadded(g: &ConvGeom) -> ConvGeom {
    ConvGeom {
        padding: vec![0; g.ndim()],
        ..g.clone()
    }
}

#[cfg(test)]
mod tests;
