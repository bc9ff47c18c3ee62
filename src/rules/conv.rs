//! Convolutions (1D, 2D, 3D; stride, padding, dilation, groups) and unfold
//! (im2col), with the convolution batching rule and its routes.
//!
//! Under `vmap`, a convolution whose input *and* weight are batched (per-sample
//! gradients, ensembles with their own data) takes the [`ConvRoute`]:
//! `Grouped` folds the batch into the channels and groups, `Unfold` runs
//! im2col and one batched matmul per group (as Opacus does), `Loop` runs the
//! unbatched convolution once per example.

use super::reduce::sum_axes;
use super::{arity, fallback, same_dtype, BVal, BatchCx, Cts, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::kernels::unfold::{self, ConvGeom};
use crate::kernels::{bmm, has_cpu_kernel, rows, shift, transpose};
use crate::route::ConvRoute;
use crate::trace::Builder;
use candle_core::Tensor;

/// Convolution-family primitives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConvOp {
    /// `conv(x [N, Cin, *S], w [Cout, Cin/groups, *k]) -> [N, Cout, *O]`
    /// (PyTorch semantics, no bias; `geom.kernel` equals w's spatial dims).
    Conv {
        /// Window geometry; its length is the number of spatial dims.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
    },
    /// `unfold(x [N, C, *S]) -> [N, C * prod(k), L]` (PyTorch's `F.unfold`
    /// order: channel outermost, then kernel offsets).
    Unfold(ConvGeom),
    /// `unfold_rows(x [N, C, *S]) -> [N, L, C * prod(k)]`: unfold with one
    /// row per output position, so a batch of convolutions is one GEMM
    /// with a contiguous operand (`kernels::rows`).
    UnfoldRows(ConvGeom),
    /// col2im, the adjoint of unfold: `[N, C * prod(k), L] -> [N, C, *spatial]`.
    Fold {
        /// Window geometry.
        geom: ConvGeom,
        /// Spatial size of the result.
        spatial: Vec<usize>,
    },
    /// The gradient of `conv` with respect to its input, a transposed
    /// convolution: `(ct [N, Cout, *O], w [Cout, Cin/groups, *k]) -> [N, Cin, *spatial]`.
    GradInput {
        /// Window geometry of the forward convolution.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
        /// Spatial size of the forward input.
        spatial: Vec<usize>,
    },
    /// The gradient of `conv` with respect to its weight:
    /// `(x [N, Cin, *S], ct [N, Cout, *O]) -> [Cout, Cin/groups, *k]`,
    /// summed over the `N` examples.
    GradWeight {
        /// Window geometry of the forward convolution.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
    },
    /// The weight gradient of an ungrouped `conv` for each example, not
    /// summed: `(x [E, Cin, *S], ct [E, Cout, *O]) -> [E, Cout, Cin, *k]`.
    /// The `Unfold` route's per-sample weight gradient.
    GradWeightEach(ConvGeom),
}

impl ConvOp {
    pub(crate) fn name(&self) -> String {
        match self {
            ConvOp::Conv { geom, groups } => {
                format!("conv{}d[{}{}]", geom.kernel.len(), geom_str(geom), groups_str(*groups))
            }
            ConvOp::Unfold(geom) => format!("unfold{}d[{}]", geom.kernel.len(), geom_str(geom)),
            ConvOp::UnfoldRows(geom) => format!("unfold_rows{}d[{}]", geom.kernel.len(), geom_str(geom)),
            ConvOp::Fold { geom, spatial } => {
                format!("fold{}d[{},size={spatial:?}]", geom.kernel.len(), geom_str(geom))
            }
            ConvOp::GradInput { geom, groups, spatial } => format!(
                "conv{}d_grad_input[{}{},size={spatial:?}]",
                geom.kernel.len(),
                geom_str(geom),
                groups_str(*groups)
            ),
            ConvOp::GradWeightEach(geom) => {
                format!("conv{}d_grad_weight_each[{}]", geom.kernel.len(), geom_str(geom))
            }
            ConvOp::GradWeight { geom, groups } => {
                format!(
                    "conv{}d_grad_weight[{}{}]",
                    geom.kernel.len(),
                    geom_str(geom),
                    groups_str(*groups)
                )
            }
        }
    }
}

fn geom_str(g: &ConvGeom) -> String {
    format!("k={:?},s={:?},p={:?},d={:?}", g.kernel, g.stride, g.padding, g.dilation)
}

fn groups_str(groups: usize) -> String {
    if groups == 1 {
        String::new()
    } else {
        format!(",g={groups}")
    }
}

fn out_spatial(op: &'static str, geom: &ConvGeom, x: &[usize]) -> Result<Vec<usize>> {
    let nd = geom.kernel.len();
    if !(1..=3).contains(&nd) || x.len() != nd + 2 {
        return Err(Error::shape(
            op,
            &[x],
            format!("a {nd}-D window needs an input of rank {}", nd + 2),
        ));
    }
    geom.out_spatial(&x[2..])
        .map_err(|e| Error::shape(op, &[x], e.to_string()))
}

fn infer_conv(geom: &ConvGeom, groups: usize, args: &[&TensorType]) -> Result<TensorType> {
    arity("conv", args, 2)?;
    let dt = same_dtype("conv", args)?;
    let (x, w) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    let nd = geom.kernel.len();
    let fits = w.len() == nd + 2
        && x.len() == nd + 2
        && groups > 0
        && w[2..] == geom.kernel[..]
        && x[1] == w[1] * groups
        && w[0] % groups == 0;
    if !fits {
        return Err(Error::shape(
            "conv",
            &[x, w],
            format!(
                "expected input [N, C, ..{nd} dims] and weight [Cout, C/{groups}, {:?}]",
                geom.kernel
            ),
        ));
    }
    let mut out = vec![x[0], w[0]];
    out.extend(out_spatial("conv", geom, x)?);
    Ok(TensorType::new(out, dt))
}

impl Rule for ConvOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        match self {
            ConvOp::Conv { geom, groups } => infer_conv(geom, *groups, args),
            ConvOp::Unfold(geom) => {
                arity("unfold", args, 1)?;
                let x = args[0].shape.as_slice();
                let l: usize = out_spatial("unfold", geom, x)?.iter().product();
                let k: usize = geom.kernel.iter().product();
                Ok(args[0].with_shape(vec![x[0], x[1] * k, l]))
            }
            ConvOp::UnfoldRows(geom) => {
                arity("unfold_rows", args, 1)?;
                let x = args[0].shape.as_slice();
                let l: usize = out_spatial("unfold_rows", geom, x)?.iter().product();
                Ok(args[0].with_shape(vec![x[0], l, x[1] * geom.kernel_numel()]))
            }
            ConvOp::Fold { geom, spatial } => infer_fold(geom, spatial, args),
            ConvOp::GradInput { geom, groups, spatial } => infer_grad_input(geom, *groups, spatial, args),
            ConvOp::GradWeight { geom, groups } => infer_grad_weight(geom, *groups, args),
            ConvOp::GradWeightEach(geom) => {
                let w = infer_grad_weight(geom, 1, args)?;
                Ok(w.with_shape([&[args[0].shape[0]], &w.shape[..]].concat()))
            }
        }
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let op = self.name();
        match self {
            ConvOp::Conv { geom, groups } => run_conv(args[0], args[1], geom, *groups).op(&op),
            ConvOp::Unfold(geom) => unfold::unfold(args[0], geom).op(&op),
            ConvOp::UnfoldRows(geom) => rows::unfold_rows(args[0], geom).op(&op),
            ConvOp::Fold { geom, spatial } => unfold::fold(&args[0].contiguous().op(&op)?, geom, spatial).op(&op),
            ConvOp::GradInput { geom, groups, spatial } => {
                run_grad_input(args[0], args[1], geom, *groups, spatial).op(&op)
            }
            ConvOp::GradWeight { geom, groups } => run_grad_weight(args[0], args[1], geom, *groups).op(&op),
            ConvOp::GradWeightEach(geom) => run_grad_weight_each(args[0], args[1], geom).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        match self {
            ConvOp::Unfold(_) | ConvOp::UnfoldRows(_) | ConvOp::Fold { .. } => {
                let x = fold_into_n(cx, args[0])?;
                let y = cx.b.emit(Prim::Conv(self.clone()), &[x])?;
                Ok(Some((split_n(cx, y)?, Some(0))))
            }
            ConvOp::Conv { geom, groups } => batch_conv(cx, geom, *groups, args).map(Some),
            ConvOp::GradInput { geom, groups, spatial } => batch_grad_input(cx, geom, *groups, spatial, args).map(Some),
            ConvOp::GradWeight { geom, groups } => batch_grad_weight(cx, geom, *groups, args).map(Some),
            ConvOp::GradWeightEach(_) => {
                // B E .. -> (B E) .. -> op -> B E ..
                let x = cx.materialize(args[0])?;
                let c = cx.materialize(args[1])?;
                let (x, c) = (merge_front(cx, x)?, merge_front(cx, c)?);
                let y = cx.b.emit(Prim::Conv(self.clone()), &[x, c])?;
                Ok(Some((split_n(cx, y)?, Some(0))))
            }
        }
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        // The family is closed under differentiation: conv, its two
        // gradients, unfold and fold are each other's adjoints.
        let cts = match self {
            ConvOp::Conv { geom, groups } => {
                let (x, w) = (args[0], args[1]);
                let spatial = b.dims(x)[2..].to_vec();
                let gi = grad_input(geom, *groups, spatial);
                let gw = Prim::Conv(ConvOp::GradWeight {
                    geom: geom.clone(),
                    groups: *groups,
                });
                vec![Some(b.emit(gi, &[ct, w])?), Some(b.emit(gw, &[x, ct])?)]
            }
            ConvOp::GradInput { geom, groups, .. } => {
                let (dy, w) = (args[0], args[1]);
                let conv = Prim::Conv(ConvOp::Conv {
                    geom: geom.clone(),
                    groups: *groups,
                });
                let gw = Prim::Conv(ConvOp::GradWeight {
                    geom: geom.clone(),
                    groups: *groups,
                });
                vec![Some(b.emit(conv, &[ct, w])?), Some(b.emit(gw, &[ct, dy])?)]
            }
            ConvOp::GradWeight { geom, groups } => {
                let (x, dy) = (args[0], args[1]);
                let spatial = b.dims(x)[2..].to_vec();
                let gi = grad_input(geom, *groups, spatial);
                let conv = Prim::Conv(ConvOp::Conv {
                    geom: geom.clone(),
                    groups: *groups,
                });
                vec![Some(b.emit(gi, &[dy, ct])?), Some(b.emit(conv, &[x, ct])?)]
            }
            ConvOp::Unfold(geom) => {
                let spatial = b.dims(args[0])[2..].to_vec();
                let fold = Prim::Conv(ConvOp::Fold {
                    geom: geom.clone(),
                    spatial,
                });
                vec![Some(b.emit(fold, &[ct])?)]
            }
            ConvOp::UnfoldRows(geom) => {
                // N L CK -> N CK L, then fold
                let spatial = b.dims(args[0])[2..].to_vec();
                let cols = b.permute(ct, vec![0, 2, 1])?;
                let fold = Prim::Conv(ConvOp::Fold {
                    geom: geom.clone(),
                    spatial,
                });
                vec![Some(b.emit(fold, &[cols])?)]
            }
            ConvOp::Fold { geom, .. } => vec![Some(b.emit(Prim::Conv(ConvOp::Unfold(geom.clone())), &[ct])?)],
            ConvOp::GradWeightEach(geom) => vjp_grad_weight_each(b, geom, args, ct)?,
        };
        Ok(Some(cts))
    }
}

/// Bilinear in `(x, dy)`, and per example: with the examples folded into
/// the channels, each example's cotangent weight `g[e]` is a group of its
/// own. `dx[e] = grad_input(dy[e], g[e])`, `d(dy)[e] = conv(x[e], g[e])`.
fn vjp_grad_weight_each(b: &mut Builder, geom: &ConvGeom, args: &[VarId], g: VarId) -> Result<Cts> {
    let (x, dy) = (args[0], args[1]);
    let (xd, yd, gd) = (b.dims(x), b.dims(dy), b.dims(g));
    let e = xd[0];
    // E Cin S.. -> 1 (E Cin) S..;  E Cout O.. -> 1 (E Cout) O..;  E Cout Cin k.. -> (E Cout) Cin k..
    let x1 = b.reshape(x, [&[1, e * xd[1]], &xd[2..]].concat())?;
    let dy1 = b.reshape(dy, [&[1, e * yd[1]], &yd[2..]].concat())?;
    let w = b.reshape(g, [&[e * gd[1]], &gd[2..]].concat())?;
    let gi = b.emit(grad_input(geom, e, xd[2..].to_vec()), &[dy1, w])?;
    let conv = Prim::Conv(ConvOp::Conv {
        geom: geom.clone(),
        groups: e,
    });
    let gc = b.emit(conv, &[x1, w])?;
    Ok(vec![Some(b.reshape(gi, xd)?), Some(b.reshape(gc, yd)?)])
}

fn grad_input(geom: &ConvGeom, groups: usize, spatial: Vec<usize>) -> Prim {
    Prim::Conv(ConvOp::GradInput {
        geom: geom.clone(),
        groups,
        spatial,
    })
}

fn infer_fold(geom: &ConvGeom, spatial: &[usize], args: &[&TensorType]) -> Result<TensorType> {
    arity("fold", args, 1)?;
    let c = args[0].shape.as_slice();
    let k: usize = geom.kernel.iter().product();
    let l: usize = geom
        .out_spatial(spatial)
        .map_err(|e| Error::shape("fold", &[c], e.to_string()))?
        .iter()
        .product();
    if c.len() != 3 || k == 0 || !c[1].is_multiple_of(k) || c[2] != l || spatial.len() != geom.kernel.len() {
        return Err(Error::shape(
            "fold",
            &[c],
            format!("expected [N, C*{k}, {l}] for size {spatial:?}"),
        ));
    }
    Ok(args[0].with_shape([&[c[0], c[1] / k], spatial].concat()))
}

fn infer_grad_input(geom: &ConvGeom, groups: usize, spatial: &[usize], args: &[&TensorType]) -> Result<TensorType> {
    arity("conv_grad_input", args, 2)?;
    let dt = same_dtype("conv_grad_input", args)?;
    let (ct, w) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    let x = [
        &[
            ct.first().copied().unwrap_or(0),
            w.get(1).copied().unwrap_or(0) * groups,
        ],
        spatial,
    ]
    .concat();
    let want = infer_conv(geom, groups, &[&TensorType::new(x.clone(), dt), args[1]])?;
    if want.shape != ct {
        return Err(Error::shape(
            "conv_grad_input",
            &[ct, w],
            format!("expected a cotangent of shape {:?}", want.shape),
        ));
    }
    Ok(TensorType::new(x, dt))
}

fn infer_grad_weight(geom: &ConvGeom, groups: usize, args: &[&TensorType]) -> Result<TensorType> {
    arity("conv_grad_weight", args, 2)?;
    let dt = same_dtype("conv_grad_weight", args)?;
    let (x, ct) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    if x.len() < 2 || ct.len() < 2 || groups == 0 || x[1] % groups != 0 {
        return Err(Error::shape(
            "conv_grad_weight",
            &[x, ct],
            format!("bad operands for {groups} groups"),
        ));
    }
    let w = [&[ct[1], x[1] / groups], &geom.kernel[..]].concat();
    let want = infer_conv(geom, groups, &[args[0], &TensorType::new(w.clone(), dt)])?;
    if want.shape != ct {
        return Err(Error::shape(
            "conv_grad_weight",
            &[x, ct],
            format!("expected a cotangent of shape {:?}", want.shape),
        ));
    }
    Ok(TensorType::new(w, dt))
}

/// `dx = fold(w^T @ ct)`. On the CPU: shifted GEMMs where they apply
/// (`kernels::shift`), else for ungrouped convolutions one GEMM over the
/// whole batch in the row layout (`kernels::rows`). Otherwise per group one
/// batched GEMM `w_g^T [CK, Cout/g] @ ct_g [N, Cout/g, L] -> [N, CK, L]`,
/// written straight in the layout fold reads (folding the examples into the
/// GEMM's columns instead needs two transposing copies of a tensor as
/// large as the columns, which took as long as the GEMM itself).
fn run_grad_input(
    ct: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    groups: usize,
    spatial: &[usize],
) -> candle_core::Result<Tensor> {
    let (n, cout) = (ct.dims()[0], ct.dims()[1]);
    let l: usize = ct.dims()[2..].iter().product();
    if n == 0 || cout == 0 {
        let cin = w.dims()[1] * groups;
        return Tensor::zeros([&[n, cin], spatial].concat(), ct.dtype(), ct.device());
    }
    let ck = w.elem_count() / cout; // Cin/g * K
    if has_cpu_kernel(ct) && shift::applies(g, groups, w.dims()[1]) {
        return shift::grad_input(ct, w, g, spatial);
    }
    if groups == 1 && has_cpu_kernel(ct) {
        // N Cout O.. -> N L Cout -> (N L) Cout; (N L) Cout @ Cout CK -> N L CK
        let c = transpose::contiguous(&ct.reshape((n, cout, l))?.transpose(1, 2)?)?.reshape((n * l, cout))?;
        let rows = bmm::matmul(&c, &w.reshape((cout, ck))?)?.reshape((n, l, ck))?;
        return rows::fold_rows(&rows, g, spatial);
    }
    let cpg = cout / groups;
    // Cout Cin/g k.. -> g Cout/g CK -> g CK Cout/g
    let wt = w.reshape((groups, cpg, ck))?.transpose(1, 2)?.contiguous()?;
    // N Cout O.. -> N Cout L; group i reads its Cout/g rows in place.
    let ct = ct.contiguous()?.reshape((n, cout, l))?;
    let cols = (0..groups)
        .map(|i| wt.get(i)?.broadcast_matmul(&ct.narrow(1, i * cpg, cpg)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    // g x [N, CK, L] -> N (g CK) L
    unfold::fold(&Tensor::cat(&cols, 1)?, g, spatial)
}

/// `dw = sum_n ct[n] @ unfold(x)[n]^T`. On the CPU: shifted GEMMs where
/// they apply, else for ungrouped convolutions one GEMM with the examples
/// in its inner dimension, on the row layout. Otherwise per group one
/// batched GEMM `[N, Cout/g, L] @ [N, L, CK]` reading the unfolded input in
/// place, then the sum over examples as one more GEMM (see `sum_axes`).
fn run_grad_weight(x: &Tensor, ct: &Tensor, g: &ConvGeom, groups: usize) -> candle_core::Result<Tensor> {
    let (n, cout) = (ct.dims()[0], ct.dims()[1]);
    let l: usize = ct.dims()[2..].iter().product();
    let w_shape = [&[cout, x.dims()[1] / groups], &g.kernel[..]].concat();
    if n == 0 || cout == 0 {
        return Tensor::zeros(w_shape, ct.dtype(), ct.device());
    }
    if has_cpu_kernel(x) && shift::applies(g, groups, x.dims()[1]) {
        return shift::grad_weight(x, ct, g);
    }
    if groups == 1 && has_cpu_kernel(x) {
        let rows = rows::unfold_rows(x, g)?; // N L CK
        let ck = rows.dims()[2];
        // N Cout O.. -> Cout N L -> Cout (N L); @ (N L) CK -> Cout CK
        let c = ct
            .reshape((n, cout, l))?
            .permute((1, 0, 2))?
            .contiguous()?
            .reshape((cout, n * l))?;
        return bmm::matmul(&c, &rows.reshape((n * l, ck))?)?.reshape(w_shape);
    }
    let cpg = cout / groups;
    let cols = unfold::unfold(x, g)?; // N (Cin K) L
    let ck = cols.dims()[1] / groups;
    let ct = ct.contiguous()?.reshape((n, cout, l))?;
    let per_example = (0..groups)
        .map(|i| {
            let cols_t = cols.narrow(1, i * ck, ck)?.transpose(1, 2)?; // N L CK
            bmm::matmul(&ct.narrow(1, i * cpg, cpg)?, &cols_t)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    // g x [N, Cout/g, CK] -> N Cout CK -> Cout CK
    sum_axes(&Tensor::cat(&per_example, 1)?, &[0])?.reshape(w_shape)
}

/// Each example's weight gradient: shifted GEMMs where they apply,
/// otherwise `ct[e] @ unfold_rows(x)[e]` as one batched product.
fn run_grad_weight_each(x: &Tensor, ct: &Tensor, g: &ConvGeom) -> candle_core::Result<Tensor> {
    let (e, cin, cout) = (x.dims()[0], x.dims()[1], ct.dims()[1]);
    let shape = [&[e, cout, cin], &g.kernel[..]].concat();
    if e == 0 || cout == 0 {
        return Tensor::zeros(shape, x.dtype(), x.device());
    }
    if has_cpu_kernel(x) && shift::applies(g, 1, cin) {
        return shift::grad_weight_each(x, ct, g);
    }
    let rows = rows::unfold_rows(x, g)?; // E L CK
    let l = rows.dims()[1];
    let c = ct.contiguous()?.reshape((e, cout, l))?;
    bmm::matmul(&c, &rows)?.reshape(shape)
}

/// Runs an unbatched convolution. On the CPU (f32/f64): stride 1 with
/// enough input channels by shifted GEMMs (`kernels::shift`, no im2col),
/// other ungrouped ones as one GEMM on the row layout, grouped ones by
/// unfold + one batched matmul per group; all measured faster than
/// candle's conv2d on this crate's workloads (`cargo run --release
/// --example conv_routes`). Elsewhere candle's own 1D/2D convolution, and
/// unfold + matmul for 3D (candle has none).
/// candle's convolutions read a strided kernel as if it were contiguous, so
/// operands are made contiguous first.
pub(crate) fn run_conv(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> candle_core::Result<Tensor> {
    let (x, w) = (&x.contiguous()?, &w.contiguous()?);
    let uniform = |v: &[usize]| v.iter().all(|&e| e == v[0]);
    let candle_2d = g.kernel.len() == 2 && uniform(&g.padding) && uniform(&g.stride) && uniform(&g.dilation);
    match g.kernel.len() {
        _ if has_cpu_kernel(x) && shift::applies(g, groups, x.dims()[1]) => shift::conv(x, w, g),
        _ if groups == 1 && has_cpu_kernel(x) => conv_rows(x, w, g),
        _ if x.device().is_cpu() => unfold::conv_unfold(x, w, g, groups),
        1 => x.conv1d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        2 if candle_2d => x.conv2d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        _ => unfold::conv_unfold(x, w, g, groups),
    }
}

/// An ungrouped convolution as one GEMM: `(N L) CK @ CK Cout`.
fn conv_rows(x: &Tensor, w: &Tensor, g: &ConvGeom) -> candle_core::Result<Tensor> {
    let (n, cout) = (x.dims()[0], w.dims()[0]);
    let out = g.out_spatial(&x.dims()[2..])?;
    let shape = [&[n, cout], &out[..]].concat();
    let rows = rows::unfold_rows(x, g)?; // N L CK
    let (l, ck) = (rows.dims()[1], rows.dims()[2]);
    if n * l == 0 || cout == 0 {
        return Tensor::zeros(shape, x.dtype(), x.device());
    }
    let y = bmm::matmul(&rows.reshape((n * l, ck))?, &w.reshape((cout, ck))?.t()?)?;
    // (N L) Cout -> N Cout L
    transpose::contiguous(&y.reshape((n, l, cout))?.transpose(1, 2)?)?.reshape(shape)
}

/// Ungrouped `Unfold` route in the row layout: one GEMM per model,
/// `B (N L) CK @ B CK Cout`, where the column layout needs one per example.
fn batch_rows(cx: &mut BatchCx, geom: &ConvGeom, xf: VarId, w: BVal) -> Result<BVal> {
    let size = cx.size;
    let xd = cx.b.dims(xf);
    let n = xd[0] / size;
    let rows = cx.b.emit(Prim::Conv(ConvOp::UnfoldRows(geom.clone())), &[xf])?; // (B N) L CK
    let rd = cx.b.dims(rows);
    let (l, ck) = (rd[1], rd[2]);
    let rows = cx.b.reshape(rows, vec![size, n * l, ck])?;
    // B Cout Cin k.. -> B Cout CK -> B CK Cout
    let wb = cx.front(w)?;
    let cout = cx.b.dims(wb)[1];
    let wm = cx.b.reshape(wb, vec![size, cout, ck])?;
    let wt = cx.b.permute(wm, vec![0, 2, 1])?;
    let y = cx.b.emit(Prim::Matmul, &[rows, wt])?;
    // B (N L) Cout -> B N L Cout -> B N Cout L -> B N Cout O..
    let y = cx.b.reshape(y, vec![size, n, l, cout])?;
    let y = cx.b.permute(y, vec![0, 1, 3, 2])?;
    let o = geom
        .out_spatial(&xd[2..])
        .map_err(|e| Error::shape("conv", &[&xd], e.to_string()))?;
    Ok((cx.b.reshape(y, [&[size, n, cout], &o[..]].concat())?, Some(0)))
}

/// `B N C S.. -> (B N) C S..`
fn fold_into_n(cx: &mut BatchCx, x: BVal) -> Result<usize> {
    let xb = cx.front(x)?;
    let d = cx.b.dims(xb);
    cx.b.reshape(xb, [&[d[0] * d[1]], &d[2..]].concat())
}

/// `(B N) C.. -> B N C..`
fn split_n(cx: &mut BatchCx, y: usize) -> Result<usize> {
    let d = cx.b.dims(y);
    cx.b.reshape(y, [&[cx.size, d[0] / cx.size], &d[1..]].concat())
}

fn batch_conv(cx: &mut BatchCx, geom: &ConvGeom, groups: usize, args: &[BVal]) -> Result<BVal> {
    let conv = |groups| {
        Prim::Conv(ConvOp::Conv {
            geom: geom.clone(),
            groups,
        })
    };
    let (x, w) = (args[0], args[1]);
    match (x.1, w.1) {
        // Input only: one convolution over (B N) examples.
        (Some(_), None) => {
            let xf = fold_into_n(cx, x)?;
            let y = cx.b.emit(conv(groups), &[xf, w.0])?;
            Ok((split_n(cx, y)?, Some(0)))
        }
        (None, Some(_)) => batch_weight_only(cx, geom, groups, x.0, w),
        _ => {
            let op = ConvOp::Conv {
                geom: geom.clone(),
                groups,
            };
            match route_for(cx, &op, args)? {
                ConvRoute::Grouped => batch_grouped(cx, geom, groups, x, w),
                ConvRoute::Unfold => batch_unfold(cx, geom, groups, x, w),
                _ => fallback::emit_loop(cx, conv(groups), args),
            }
        }
    }
}

/// The route for a convolution-family operation with both operands batched:
/// the one asked for, or the measured fastest for `Auto`. Every route
/// lowers 1-, 2- and 3-d windows alike.
fn route_for(cx: &mut BatchCx, op: &ConvOp, args: &[BVal]) -> Result<ConvRoute> {
    match cx.opts.route {
        ConvRoute::Auto => {
            let types: Vec<(TensorType, Option<usize>)> =
                args.iter().map(|&(v, bd)| (cx.b.ty(v).clone(), bd)).collect();
            auto_route(op, &types, cx.size)
        }
        asked => Ok(asked),
    }
}

/// `Auto`: the fastest lowering of `op` for these batched operands on the
/// current device, timed once per signature on random data.
fn auto_route(op: &ConvOp, types: &[(TensorType, Option<usize>)], size: usize) -> Result<ConvRoute> {
    let device = crate::route::current_device();
    let key = format!("{}|{types:?}|{size}|{:?}", op.name(), device.location());
    if let Some(r) = crate::route::cached_choice(&key) {
        return Ok(r);
    }
    let timings = time_routes(op, types, size, &device)?;
    let chosen = timings
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|t| t.0)
        .unwrap_or_default();
    let shapes = types
        .iter()
        .map(|(t, bd)| {
            let mut s = t.shape.clone();
            if let Some(d) = bd {
                let b = s.remove(*d);
                s.insert(0, b);
            }
            s
        })
        .collect();
    let choice = crate::route::AutoChoice {
        op: op.name(),
        shapes,
        timings_ms: timings,
        chosen,
    };
    crate::route::record_choice(key, choice);
    Ok(chosen)
}

/// Rounds in which `Auto` times every candidate once.
const AUTO_ROUNDS: usize = 5;

/// Milliseconds each route takes for `op` on random operands: the best of
/// `AUTO_ROUNDS` after a warm-up, the candidates taking turns within each
/// round, so a burst of load on a shared machine does not fall on one of
/// them only.
fn time_routes(
    op: &ConvOp,
    types: &[(TensorType, Option<usize>)],
    size: usize,
    device: &candle_core::Device,
) -> Result<Vec<(ConvRoute, f64)>> {
    let routes = [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop];
    let graphs = routes
        .iter()
        .map(|&r| route_graph(op, types, size, r))
        .collect::<Result<Vec<_>>>()?;
    let inputs = types
        .iter()
        .map(|(t, _)| Tensor::randn(0f32, 1., t.shape.as_slice(), device).and_then(|r| r.to_dtype(t.dtype)))
        .collect::<candle_core::Result<Vec<_>>>()
        .op("conv route auto")?;
    for g in &graphs {
        crate::interp::run(g, &inputs)?;
    }
    let mut best = [f64::INFINITY; 3];
    for _ in 0..AUTO_ROUNDS {
        for (g, b) in graphs.iter().zip(best.iter_mut()) {
            let start = std::time::Instant::now();
            crate::interp::run(g, &inputs)?;
            *b = b.min(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(routes.into_iter().zip(best).collect())
}

/// The graph one route lowers `op` to, for timing.
fn route_graph(op: &ConvOp, types: &[(TensorType, Option<usize>)], size: usize, route: ConvRoute) -> Result<Graph> {
    let scratch = Builder::root();
    let mut b = scratch.borrow_mut();
    let vals: Vec<BVal> = types.iter().map(|(t, bd)| (b.input(t.clone()), *bd)).collect();
    let opts = super::BatchOpts {
        route,
        strict: false,
        randomness: crate::transforms::vmap::Randomness::Error,
    };
    let mut cx = BatchCx {
        b: &mut b,
        size,
        opts: &opts,
    };
    let out = op
        .batch(&mut cx, &vals)?
        .ok_or_else(|| Error::unsupported(op.name(), "vmap", "no lowering to time"))?;
    Ok(b.finish(vec![out.0]).0.eliminate_dead_code())
}

/// Weight only batched (ensembles on a shared batch): the models' filters
/// become extra output channels of one convolution.
fn batch_weight_only(cx: &mut BatchCx, geom: &ConvGeom, groups: usize, x: usize, w: BVal) -> Result<BVal> {
    let size = cx.size;
    let wb = cx.front(w)?;
    let wd = cx.b.dims(wb); // B Cout Cin/g k..
    let (cout, rest) = (wd[1], wd[2..].to_vec());
    let per = cout / groups;
    // B Cout Cin/g k.. -> B g Cout/g Cin/g k.. -> g B Cout/g Cin/g k.. -> (g B Cout/g) Cin/g k..
    let t = cx.b.reshape(wb, [&[size, groups, per], &rest[..]].concat())?;
    let t = cx.b.move_axis(t, 1, 0)?;
    let t = cx.b.reshape(t, [&[groups * size * per], &rest[..]].concat())?;
    let conv = Prim::Conv(ConvOp::Conv {
        geom: geom.clone(),
        groups,
    });
    let y = cx.b.emit(conv, &[x, t])?;
    let yd = cx.b.dims(y); // N (g B Cout/g) O..
    let (n, o) = (yd[0], yd[2..].to_vec());
    // N (g B Cout/g) O.. -> N g B Cout/g O.. -> N B g Cout/g O.. -> N B Cout O..
    let y = cx.b.reshape(y, [&[n, groups, size, per], &o[..]].concat())?;
    let y = cx.b.move_axis(y, 2, 1)?;
    let y = cx.b.reshape(y, [&[n, size, cout], &o[..]].concat())?;
    Ok((y, Some(1)))
}

/// Both batched, `Grouped`: the batch joins the channels and the groups.
fn batch_grouped(cx: &mut BatchCx, geom: &ConvGeom, groups: usize, x: BVal, w: BVal) -> Result<BVal> {
    let size = cx.size;
    let xb = cx.front(x)?;
    let xd = cx.b.dims(xb); // B N Cin S..
                            // B N Cin S.. -> N B Cin S.. -> N (B Cin) S..
    let t = cx.b.move_axis(xb, 1, 0)?;
    let xf = cx.b.reshape(t, [&[xd[1], size * xd[2]], &xd[3..]].concat())?;
    let wb = cx.front(w)?;
    let wd = cx.b.dims(wb);
    // B Cout Cin/g k.. -> (B Cout) Cin/g k..
    let wf = cx.b.reshape(wb, [&[size * wd[1]], &wd[2..]].concat())?;
    let conv = Prim::Conv(ConvOp::Conv {
        geom: geom.clone(),
        groups: groups * size,
    });
    let y = cx.b.emit(conv, &[xf, wf])?;
    let yd = cx.b.dims(y);
    // N (B Cout) O.. -> N B Cout O..
    let y = cx.b.reshape(y, [&[yd[0], size, wd[1]], &yd[2..]].concat())?;
    Ok((y, Some(1)))
}

/// Both batched, `Unfold`: im2col once, then per example and group one
/// matmul of the filters with the columns (one batched matmul in all).
fn batch_unfold(cx: &mut BatchCx, geom: &ConvGeom, groups: usize, x: BVal, w: BVal) -> Result<BVal> {
    let size = cx.size;
    let xf = fold_into_n(cx, x)?; // (B N) Cin S..
    let xd = cx.b.dims(xf);
    let n = xd[0] / size;
    if groups == 1 {
        return batch_rows(cx, geom, xf, w);
    }
    let cols = cx.b.emit(Prim::Conv(ConvOp::Unfold(geom.clone())), &[xf])?;
    let cd = cx.b.dims(cols); // (B N) (Cin K) L
    let (ck, l) = (cd[1] / groups, cd[2]);
    // (B N) (Cin K) L -> B N g (Cin/g K) L
    let cols = cx.b.reshape(cols, vec![size, n, groups, ck, l])?;
    let wb = cx.front(w)?;
    let wd = cx.b.dims(wb);
    let cout = wd[1];
    // B Cout Cin/g k.. -> B 1 g Cout/g (Cin/g K)
    let wm = cx.b.reshape(wb, vec![size, 1, groups, cout / groups, ck])?;
    let y = cx.b.emit(Prim::Matmul, &[wm, cols])?; // B N g Cout/g L
    let o = geom
        .out_spatial(&xd[2..])
        .map_err(|e| Error::shape("conv", &[&xd], e.to_string()))?;
    // B N g Cout/g L -> B N Cout O..
    let y = cx.b.reshape(y, [&[size, n, cout], &o[..]].concat())?;
    Ok((y, Some(0)))
}

/// `B N C S.. -> N (B C) S..`: the batch joins the channels.
fn batch_into_channels(cx: &mut BatchCx, v: VarId) -> Result<VarId> {
    let d = cx.b.dims(v);
    let t = cx.b.move_axis(v, 1, 0)?;
    cx.b.reshape(t, [&[d[1], d[0] * d[2]], &d[3..]].concat())
}

/// `B C.. -> (B C)..`: the batch joins the leading axis.
fn merge_front(cx: &mut BatchCx, v: VarId) -> Result<VarId> {
    let d = cx.b.dims(v);
    cx.b.reshape(v, [&[d[0] * d[1]], &d[2..]].concat())
}

/// Batches the input gradient (a transposed convolution). With only the
/// cotangent batched the batch joins `N`; otherwise the route decides.
fn batch_grad_input(
    cx: &mut BatchCx,
    geom: &ConvGeom,
    groups: usize,
    spatial: &[usize],
    args: &[BVal],
) -> Result<BVal> {
    let (ct, w) = (args[0], args[1]);
    if w.1.is_none() {
        let cf = fold_into_n(cx, ct)?;
        let y = cx.b.emit(grad_input(geom, groups, spatial.to_vec()), &[cf, w.0])?;
        return Ok((split_n(cx, y)?, Some(0)));
    }
    let size = cx.size;
    let cb = cx.materialize(ct)?; // B N Cout O..
    let wb = cx.materialize(w)?; // B Cout Cin/g k..
    let op = ConvOp::GradInput {
        geom: geom.clone(),
        groups,
        spatial: spatial.to_vec(),
    };
    match route_for(cx, &op, &[(cb, Some(0)), (wb, Some(0))])? {
        ConvRoute::Loop | ConvRoute::Auto => fallback::emit_loop(
            cx,
            grad_input(geom, groups, spatial.to_vec()),
            &[(cb, Some(0)), (wb, Some(0))],
        ),
        ConvRoute::Grouped => {
            let cf = batch_into_channels(cx, cb)?; // N (B Cout) O..
            let wf = merge_front(cx, wb)?; // (B Cout) Cin/g k..
            let y =
                cx.b.emit(grad_input(geom, groups * size, spatial.to_vec()), &[cf, wf])?;
            let yd = cx.b.dims(y); // N (B Cin) S..
            let y = cx.b.reshape(y, [&[yd[0], size, yd[1] / size], &yd[2..]].concat())?;
            Ok((y, Some(1)))
        }
        ConvRoute::Unfold => {
            let cd = cx.b.dims(cb);
            let (n, cout) = (cd[1], cd[2]);
            let l: usize = cd[3..].iter().product();
            let wd = cx.b.dims(wb);
            let ck: usize = wd[2..].iter().product(); // Cin/g K
                                                      // B N Cout O.. -> B N g Cout/g L
            let c = cx.b.reshape(cb, vec![size, n, groups, cout / groups, l])?;
            // B Cout Cin/g k.. -> B 1 g Cout/g CK -> B 1 g CK Cout/g
            let wm = cx.b.reshape(wb, vec![size, 1, groups, cout / groups, ck])?;
            let wt = cx.b.permute(wm, vec![0, 1, 2, 4, 3])?;
            let cols = cx.b.emit(Prim::Matmul, &[wt, c])?; // B N g CK L
                                                           // B N g CK L -> (B N) (g CK) L -> fold -> (B N) Cin S.. -> B N Cin S..
            let cols = cx.b.reshape(cols, vec![size * n, groups * ck, l])?;
            let fold = Prim::Conv(ConvOp::Fold {
                geom: geom.clone(),
                spatial: spatial.to_vec(),
            });
            let y = cx.b.emit(fold, &[cols])?;
            Ok((split_n(cx, y)?, Some(0)))
        }
    }
}

/// Batches the weight gradient: per-sample gradients of a convolution. The
/// `Unfold` route is Opacus's `grad_w[b] = ct[b] @ unfold(x[b])^T`, one
/// batched matmul per group.
fn batch_grad_weight(cx: &mut BatchCx, geom: &ConvGeom, groups: usize, args: &[BVal]) -> Result<BVal> {
    let gw = |groups| {
        Prim::Conv(ConvOp::GradWeight {
            geom: geom.clone(),
            groups,
        })
    };
    let size = cx.size;
    let xb = cx.materialize(args[0])?; // B N Cin S..
    let cb = cx.materialize(args[1])?; // B N Cout O..
    let op = ConvOp::GradWeight {
        geom: geom.clone(),
        groups,
    };
    match route_for(cx, &op, &[(xb, Some(0)), (cb, Some(0))])? {
        ConvRoute::Loop | ConvRoute::Auto => fallback::emit_loop(cx, gw(groups), &[(xb, Some(0)), (cb, Some(0))]),
        ConvRoute::Grouped => {
            let xf = batch_into_channels(cx, xb)?; // N (B Cin) S..
            let cf = batch_into_channels(cx, cb)?; // N (B Cout) O..
            let y = cx.b.emit(gw(groups * size), &[xf, cf])?; // (B Cout) Cin/g k..
            let yd = cx.b.dims(y);
            let y = cx.b.reshape(y, [&[size, yd[0] / size], &yd[1..]].concat())?;
            Ok((y, Some(0)))
        }
        ConvRoute::Unfold => {
            let xd = cx.b.dims(xb);
            let cd = cx.b.dims(cb);
            let (n, cout) = (xd[1], cd[2]);
            let l: usize = cd[3..].iter().product();
            let xf = merge_front(cx, xb)?; // (B N) Cin S..
            if groups == 1 {
                // Opacus's ct @ unfold(x)^T for each example, then summed
                // over each model's N: (B N) Cout Cin k.. -> B N .. -> B ..
                let cf = merge_front(cx, cb)?; // (B N) Cout O..
                let each = cx.b.emit(Prim::Conv(ConvOp::GradWeightEach(geom.clone())), &[xf, cf])?;
                let ed = cx.b.dims(each);
                let y = cx.b.reshape(each, [&[size, n], &ed[1..]].concat())?;
                let y = if n == 1 {
                    cx.b.reshape(y, [&[size], &ed[1..]].concat())?
                } else {
                    cx.b.sum_axes(y, vec![1], false)?
                };
                return Ok((y, Some(0)));
            }
            let cols = cx.b.emit(Prim::Conv(ConvOp::Unfold(geom.clone())), &[xf])?; // (B N) (Cin K) L
            let ck = cx.b.dims(cols)[1] / groups;
            // (B N) (g CK) L -> B N g CK L -> B g CK N L -> B g CK (N L)
            let cols = cx.b.reshape(cols, vec![size, n, groups, ck, l])?;
            let cols = cx.b.permute(cols, vec![0, 2, 3, 1, 4])?;
            let cols = cx.b.reshape(cols, vec![size, groups, ck, n * l])?;
            // B N Cout O.. -> B N g Cout/g L -> B g Cout/g N L -> B g Cout/g (N L)
            let c = cx.b.reshape(cb, vec![size, n, groups, cout / groups, l])?;
            let c = cx.b.permute(c, vec![0, 2, 3, 1, 4])?;
            let c = cx.b.reshape(c, vec![size, groups, cout / groups, n * l])?;
            // B g CK (N L) -> B g (N L) CK; the product is B g Cout/g CK
            let colst = cx.b.permute(cols, vec![0, 1, 3, 2])?;
            let y = cx.b.emit(Prim::Matmul, &[c, colst])?;
            let y =
                cx.b.reshape(y, [&[size, cout, xd[2] / groups], &geom.kernel[..]].concat())?;
            Ok((y, Some(0)))
        }
    }
}
