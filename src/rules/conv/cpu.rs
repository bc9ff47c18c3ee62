//! How the convolution family runs on candle tensors: on the CPU (f32,
//! f64) through the crate's kernels (shifted GEMMs, row im2col, batched
//! GEMMs), elsewhere through candle's convolutions or unfold + matmul.

use crate::error::{CandleContext, Result};
use crate::ir::conv::ConvOp;
use crate::ir::ConvGeom;
use crate::kernels::copies::{Copies, Relayout};
use crate::kernels::unfold;
use crate::kernels::{bmm, has_cpu_kernel, rows, shift, transpose, Kx, Path};
use crate::rules::reduce::sum_axes;
use candle_core::Tensor;

/// Computes `op(args)`, counting operands copied to another layout in `c`.
pub(super) fn run(op: &ConvOp, args: &[&Tensor], c: &Copies, p: Path) -> Result<Tensor> {
    let name = op.name();
    match op {
        ConvOp::Conv { geom, groups } => run_conv(args[0], args[1], geom, *groups, (c, p)).op(&name),
        ConvOp::Unfold(geom) => unfold::unfold(args[0], geom, p).op(&name),
        ConvOp::UnfoldRows(geom) => rows::unfold_rows(args[0], geom, p).op(&name),
        ConvOp::Fold { geom, spatial } => unfold::fold(&args[0].relayout(c).op(&name)?, geom, spatial, p).op(&name),
        ConvOp::GradInput { geom, groups, spatial } => {
            run_grad_input(args[0], args[1], (geom, *groups, spatial), (c, p)).op(&name)
        }
        ConvOp::GradWeight { geom, groups } => run_grad_weight(args[0], args[1], (geom, *groups), (c, p)).op(&name),
        ConvOp::GradWeightEach(geom) => run_grad_weight_each(args[0], args[1], geom, (c, p)).op(&name),
        ConvOp::GradWeightSqNorms(geom) => run_grad_weight_sq_norms(args[0], args[1], geom, (c, p)).op(&name),
    }
}

/// Output planes at least this long take one GEMM per example
/// (`conv_cols`); shorter ones make GEMMs too small to run well, and take
/// one GEMM over the whole batch (`conv_rows`). On the Opacus CNN's second
/// convolution (5x5 outputs) the per-example GEMMs were 8% slower; on the
/// tutorial CNN's first (26x26, one input channel) they were 6x faster.
pub(super) const MIN_COLS_LEN: usize = 64;

/// Weight gradients of ungrouped convolutions with output planes at least
/// this long take one product per example on the column layout, then the
/// sum; shorter ones one GEMM over the whole batch on the row layout (which
/// needs the cotangent transposed). The conv3d net's first layer (2744
/// outputs per plane) took 0.34 ms the first way and 0.74 the second; the
/// Opacus CNN's (196 and 25) 0.40-0.45 and 0.28-0.36.
pub(super) const PER_EXAMPLE_GRAD_LEN: usize = 1024;

/// Runs an unbatched convolution. On the CPU (f32/f64): stride 1 with
/// enough input channels by shifted GEMMs (`kernels::shift`, no im2col),
/// other ungrouped ones by im2col and a GEMM (per example for long output
/// planes, over the whole batch for short ones), grouped ones by
/// unfold + one batched matmul per group; all measured faster than
/// candle's conv2d on this crate's workloads (`cargo run --release
/// --example conv_routes`). Elsewhere candle's own 1D/2D convolution, and
/// unfold + matmul for 3D (candle has none).
/// candle's convolutions read a strided kernel as if it were contiguous, so
/// operands are made contiguous first.
pub(crate) fn run_conv(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize, (c, p): Kx) -> candle_core::Result<Tensor> {
    let (n, cout, out) = (x.dims()[0], w.dims()[0], g.out_spatial(&x.dims()[2..])?);
    let shape = [&[n, cout], &out[..]].concat();
    if n == 0 || cout == 0 || out.contains(&0) {
        return Tensor::zeros(shape, x.dtype(), x.device());
    }
    let (x, w) = (&x.relayout(c)?, &w.relayout(c)?);
    let uniform = |v: &[usize]| v.iter().all(|&e| e == v[0]);
    let candle_2d = g.kernel.len() == 2 && uniform(&g.padding) && uniform(&g.stride) && uniform(&g.dilation);
    match g.kernel.len() {
        _ if has_cpu_kernel(x, p) && shift::applies(g, groups, x.dims()[1]) => shift::conv(x, w, g),
        _ if groups == 1 && has_cpu_kernel(x, p) && out.iter().product::<usize>() >= MIN_COLS_LEN => {
            conv_cols(x, w, g, &shape, c)
        }
        _ if groups == 1 && has_cpu_kernel(x, p) => conv_rows(x, w, g, &shape, c),
        _ if p == Path::Fast && x.device().is_cpu() => unfold::conv_unfold(x, w, g, groups, p),
        1 => x.conv1d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        2 if candle_2d => x.conv2d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        _ => unfold::conv_unfold(x, w, g, groups, p),
    }
}

/// An ungrouped convolution as one GEMM: `(N L) CK @ CK Cout`.
fn conv_rows(x: &Tensor, w: &Tensor, g: &ConvGeom, shape: &[usize], c: &Copies) -> candle_core::Result<Tensor> {
    let (n, cout) = (shape[0], shape[1]);
    let rows = rows::unfold_rows(x, g, Path::Fast)?; // N L CK
    let (l, ck) = (rows.dims()[1], rows.dims()[2]);
    let y = bmm::matmul(&rows.reshape((n * l, ck))?, &w.reshape((cout, ck))?.t()?, c, Path::Fast)?;
    // (N L) Cout -> N Cout L
    transpose::contiguous(&y.reshape((n, l, cout))?.transpose(1, 2)?, Path::Fast)?.reshape(shape)
}

/// An ungrouped convolution as one GEMM per example, `w [Cout, CK] @
/// cols[n] [CK, L]`, written straight in the `[N, Cout, L]` layout (the
/// row layout's single GEMM has the few input channels' taps as its
/// inner dimension, and its output needs a transposing copy).
fn conv_cols(x: &Tensor, w: &Tensor, g: &ConvGeom, shape: &[usize], c: &Copies) -> candle_core::Result<Tensor> {
    let cols = unfold::unfold(x, g, Path::Fast)?; // N CK L
    bmm::each_example(&w.reshape((shape[1], cols.dims()[1]))?, &cols, c, Path::Fast)?.reshape(shape)
}

/// `dx = fold(w^T @ ct)`. On the CPU: shifted GEMMs where they apply
/// (`kernels::shift`), else one GEMM per group over the whole batch in the
/// row layout (`grad_input_rows`). Elsewhere per group one
/// batched GEMM `w_g^T [CK, Cout/g] @ ct_g [N, Cout/g, L] -> [N, CK, L]`,
/// written straight in the layout fold reads (folding the examples into the
/// GEMM's columns instead needs two transposing copies of a tensor as
/// large as the columns, which took as long as the GEMM itself).
fn run_grad_input(
    ct: &Tensor,
    w: &Tensor,
    (g, groups, spatial): (&ConvGeom, usize, &[usize]),
    (c, p): Kx,
) -> candle_core::Result<Tensor> {
    let (n, cout) = (ct.dims()[0], ct.dims()[1]);
    let l: usize = ct.dims()[2..].iter().product();
    if n == 0 || cout == 0 {
        let cin = w.dims()[1] * groups;
        return Tensor::zeros([&[n, cin], spatial].concat(), ct.dtype(), ct.device());
    }
    let ck = w.elem_count() / cout; // Cin/g * K
    if has_cpu_kernel(ct, p) && shift::applies(g, groups, w.dims()[1]) {
        return shift::grad_input(ct, w, g, spatial);
    }
    if has_cpu_kernel(ct, p) {
        return grad_input_rows(ct, w, (g, groups, spatial), c);
    }
    let cpg = cout / groups;
    // Cout Cin/g k.. -> g Cout/g CK -> g CK Cout/g
    let wt = w.reshape((groups, cpg, ck))?.transpose(1, 2)?.relayout(c)?;
    // N Cout O.. -> N Cout L; group i reads its Cout/g rows in place.
    let ct = ct.relayout(c)?.reshape((n, cout, l))?;
    let cols = (0..groups)
        .map(|i| bmm::each_example(&wt.get(i)?, &ct.narrow(1, i * cpg, cpg)?, c, p))
        .collect::<candle_core::Result<Vec<_>>>()?;
    // g x [N, CK, L] -> N (g CK) L
    unfold::fold(&Tensor::cat(&cols, 1)?, g, spatial, p)
}

/// A convolution's input gradient on the row layout, as ONE batched
/// product over the groups, `ct_g [(N L), Cout/g] @ w_g [Cout/g, CK] -> [g,
/// (N L), CK]`, then one copy into the rows fold reads (none for one group:
/// the transpose only moves a unit axis). One GEMM per group and example
/// instead ran 256 tiny GEMMs for a vmapped ensemble of 8 digits CNNs (2.3
/// ms where this takes a fraction).
fn grad_input_rows(
    ct: &Tensor,
    w: &Tensor,
    (g, groups, spatial): (&ConvGeom, usize, &[usize]),
    c: &Copies,
) -> candle_core::Result<Tensor> {
    let (n, cout) = (ct.dims()[0], ct.dims()[1]);
    let l: usize = ct.dims()[2..].iter().product();
    let (cpg, ck) = (cout / groups, w.elem_count() / cout);
    // N Cout O.. -> N L Cout -> (N L) g Cout/g -> g (N L) Cout/g, read in place
    let t = ct.reshape((n, cout, l))?.transpose(1, 2)?;
    c.note(&t);
    let t = transpose::contiguous(&t, Path::Fast)?
        .reshape((n * l, groups, cpg))?
        .transpose(0, 1)?;
    let rows = bmm::bmm(&t, &w.reshape((groups, cpg, ck))?, c, Path::Fast)?; // g (N L) CK
                                                                             // g (N L) CK -> (N L) g CK -> N L (g CK)
    let rows = transpose::contiguous(&rows.transpose(0, 1)?, Path::Fast)?.reshape((n, l, groups * ck))?;
    rows::fold_rows(&rows, g, spatial, Path::Fast)
}

/// `dw = sum_n ct[n] @ unfold(x)[n]^T`. On the CPU: shifted GEMMs where
/// they apply, else for ungrouped convolutions with short output planes one
/// GEMM with the examples in its inner dimension, on the row layout.
/// Otherwise (grouped, or long planes: `PER_EXAMPLE_GRAD_LEN`) per group one
/// batched GEMM `[N, Cout/g, L] @ [N, L, CK]` reading the unfolded input in
/// place, then the sum over examples as one more GEMM (see `sum_axes`).
fn run_grad_weight(
    x: &Tensor,
    ct: &Tensor,
    (g, groups): (&ConvGeom, usize),
    (copies, p): Kx,
) -> candle_core::Result<Tensor> {
    let (n, cout) = (ct.dims()[0], ct.dims()[1]);
    let l: usize = ct.dims()[2..].iter().product();
    let w_shape = [&[cout, x.dims()[1] / groups], &g.kernel[..]].concat();
    if n == 0 || cout == 0 {
        return Tensor::zeros(w_shape, ct.dtype(), ct.device());
    }
    if has_cpu_kernel(x, p) && shift::applies(g, groups, x.dims()[1]) {
        return shift::grad_weight(x, ct, g);
    }
    if groups == 1 && has_cpu_kernel(x, p) && l < PER_EXAMPLE_GRAD_LEN {
        let rows = rows::unfold_rows(x, g, p)?; // N L CK
        let ck = rows.dims()[2];
        // N Cout O.. -> Cout N L -> Cout (N L); @ (N L) CK -> Cout CK
        let c = ct
            .reshape((n, cout, l))?
            .permute((1, 0, 2))?
            .relayout(copies)?
            .reshape((cout, n * l))?;
        return bmm::matmul(&c, &rows.reshape((n * l, ck))?, copies, p)?.reshape(w_shape);
    }
    let cpg = cout / groups;
    let cols = unfold::unfold(x, g, p)?; // N (Cin K) L
    let ck = cols.dims()[1] / groups;
    let ct = ct.relayout(copies)?.reshape((n, cout, l))?;
    let per_example = (0..groups)
        .map(|i| {
            let cols_t = cols.narrow(1, i * ck, ck)?.transpose(1, 2)?; // N L CK
            bmm::matmul(&ct.narrow(1, i * cpg, cpg)?, &cols_t, copies, p)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    // g x [N, Cout/g, CK] -> N Cout CK -> Cout CK
    sum_axes(&Tensor::cat(&per_example, 1)?, &[0])?.reshape(w_shape)
}

/// Each example's weight gradient: shifted GEMMs where they apply,
/// otherwise `ct[e] @ unfold_rows(x)[e]` as one batched product.
fn run_grad_weight_each(x: &Tensor, ct: &Tensor, g: &ConvGeom, (copies, p): Kx) -> candle_core::Result<Tensor> {
    let (e, cin, cout) = (x.dims()[0], x.dims()[1], ct.dims()[1]);
    let shape = [&[e, cout, cin], &g.kernel[..]].concat();
    if e == 0 || cout == 0 {
        return Tensor::zeros(shape, x.dtype(), x.device());
    }
    if has_cpu_kernel(x, p) && shift::applies(g, 1, cin) {
        return shift::grad_weight_each(x, ct, g);
    }
    let rows = rows::unfold_rows(x, g, p)?; // E L CK
    let l = rows.dims()[1];
    let c = ct.relayout(copies)?.reshape((e, cout, l))?;
    bmm::matmul(&c, &rows, copies, p)?.reshape(shape)
}

/// Entries of per-example weight gradients held at once by
/// `run_grad_weight_sq_norms` (4 MiB of f32): large enough that each
/// chunk's GEMMs run well, small next to the B copies it replaces.
pub(super) const SQ_NORM_CHUNK: usize = 1 << 20;

/// `||GradWeightEach[e]||²` for each example, a chunk of examples at a time.
fn run_grad_weight_sq_norms(x: &Tensor, ct: &Tensor, g: &ConvGeom, (copies, p): Kx) -> candle_core::Result<Tensor> {
    let e = x.dims()[0];
    let per: usize = [ct.dims()[1], x.dims()[1]].iter().chain(&g.kernel).product();
    let chunk = (SQ_NORM_CHUNK / per.max(1)).clamp(1, e.max(1));
    let mut parts = Vec::with_capacity(e.div_ceil(chunk));
    for start in (0..e).step_by(chunk) {
        let len = chunk.min(e - start);
        let each = run_grad_weight_each(&x.narrow(0, start, len)?, &ct.narrow(0, start, len)?, g, (copies, p))?;
        // each row's dot product with itself, [E, 1, R] @ [E, R, 1]: two
        // views of one buffer, no squared copy
        let each = each.relayout(copies)?;
        let (row, col) = (each.reshape((len, 1, per))?, each.reshape((len, per, 1))?);
        let dot = if has_cpu_kernel(&each, p) {
            bmm::matmul(&row, &col, copies, p)?
        } else {
            row.matmul(&col)?
        };
        parts.push(dot.reshape(len)?);
    }
    if parts.is_empty() {
        return Tensor::zeros(e, x.dtype(), x.device());
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Every CPU lowering of an unbatched convolution (shifted GEMMs, one
    /// GEMM per example, one over the batch, grouped) against candle's
    /// conv1d/conv2d, or for 3D the generic unfold + matmul, f32 and f64.
    #[test]
    fn lowerings_match_a_reference() -> candle_core::Result<()> {
        let d = Device::Cpu;
        // (input, weight, padding, stride, dilation, groups)
        type Case = (&'static [usize], &'static [usize], usize, usize, usize, usize);
        let cases: [Case; 8] = [
            (&[3, 1, 28, 28], &[4, 1, 3, 3], 0, 1, 1, 1),     // per example, 1 channel
            (&[2, 3, 20, 20], &[5, 3, 4, 4], 3, 2, 1, 1),     // per example, stride 2
            (&[3, 16, 13, 13], &[6, 16, 4, 4], 0, 2, 1, 1),   // short planes: one GEMM
            (&[2, 9, 10, 10], &[4, 9, 3, 3], 1, 1, 2, 1),     // shifted GEMMs, dilated
            (&[2, 4, 9, 9], &[6, 2, 3, 3], 1, 1, 1, 2),       // grouped
            (&[2, 2, 40], &[3, 2, 5], 2, 1, 1, 1),            // 1D
            (&[2, 1, 9, 9, 9], &[3, 1, 3, 3, 3], 1, 1, 1, 1), // 3D, per example
            (&[2, 3, 5, 5, 5], &[2, 3, 2, 2, 2], 0, 2, 1, 1), // 3D, short planes
        ];
        for dt in [DType::F32, DType::F64] {
            for (xs, ws, p, s, dil, groups) in cases {
                let x = Tensor::randn(0f32, 1., xs, &d)?.to_dtype(dt)?;
                let w = Tensor::randn(0f32, 1., ws, &d)?.to_dtype(dt)?;
                let g = ConvGeom::uniform(xs.len() - 2, ws[2], p, s, dil);
                let want = match xs.len() {
                    3 => x.conv1d(&w, p, s, dil, groups)?,
                    4 => x.conv2d(&w, p, s, dil, groups)?,
                    _ => unfold::conv_unfold(&x, &w, &g, groups, Path::Portable)?,
                };
                let got = run_conv(&x, &w, &g, groups, (&Copies::default(), Path::Fast))?;
                let diff = crate::kernels::max_diff(&got, &want)?;
                assert!(diff < 1e-4, "{xs:?} * {ws:?}: {diff}");
            }
        }
        // no output channels, or no examples: empty results, on every lowering
        let g = ConvGeom::uniform(2, 3, 0, 1, 1);
        for (xs, ws) in [
            ([2, 8, 6, 6], [0, 8, 3, 3]),
            ([2, 1, 6, 6], [0, 1, 3, 3]),
            ([0, 8, 6, 6], [4, 8, 3, 3]),
        ] {
            let x = Tensor::zeros(&xs, DType::F32, &d)?;
            let y = run_conv(
                &x,
                &Tensor::zeros(&ws, DType::F32, &d)?,
                &g,
                1,
                (&Copies::default(), Path::Fast),
            )?;
            assert_eq!(y.dims(), &[xs[0], ws[0], 4, 4]);
        }
        Ok(())
    }
}
