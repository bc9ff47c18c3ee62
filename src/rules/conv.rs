//! Convolutions (1D, 2D, 3D; stride, padding, dilation, groups) and unfold
//! (im2col), with the convolution batching rule and its routes.
//!
//! Under `vmap`, a convolution whose input *and* weight are batched (per-sample
//! gradients, ensembles with their own data) takes the [`ConvRoute`]:
//! `Grouped` folds the batch into the channels and groups, `Unfold` runs
//! im2col and one batched matmul per group (as Opacus does), `Loop` runs the
//! unbatched convolution once per example.

use super::{arity, fallback, same_dtype, BVal, BatchCx, Rule};
use crate::config::warn_once;
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType};
use crate::kernels::unfold::{self, ConvGeom};
use crate::route::ConvRoute;
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
}

impl ConvOp {
    pub(crate) fn name(&self) -> String {
        match self {
            ConvOp::Conv { geom, groups } => {
                format!("conv{}d[{}{}]", geom.kernel.len(), geom_str(geom), groups_str(*groups))
            }
            ConvOp::Unfold(geom) => format!("unfold{}d[{}]", geom.kernel.len(), geom_str(geom)),
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
        }
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let op = self.name();
        match self {
            ConvOp::Conv { geom, groups } => run_conv(args[0], args[1], geom, *groups).op(&op),
            ConvOp::Unfold(geom) => unfold::unfold(args[0], geom).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        match self {
            ConvOp::Unfold(_) => {
                let x = fold_into_n(cx, args[0])?;
                let y = cx.b.emit(Prim::Conv(self.clone()), &[x])?;
                Ok(Some((split_n(cx, y)?, Some(0))))
            }
            ConvOp::Conv { geom, groups } => batch_conv(cx, geom, *groups, args).map(Some),
        }
    }
}

/// Runs an unbatched convolution. On the CPU, unfold + matmul: measured
/// 1.2x to 6.7x faster than candle's conv2d on this crate's workloads
/// (`cargo run --release --example conv_routes`). Elsewhere candle's own
/// 1D/2D convolution, and unfold + matmul for 3D (candle has none).
/// candle's convolutions read a strided kernel as if it were contiguous, so
/// operands are made contiguous first.
pub(crate) fn run_conv(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> candle_core::Result<Tensor> {
    let (x, w) = (&x.contiguous()?, &w.contiguous()?);
    let uniform = |v: &[usize]| v.iter().all(|&e| e == v[0]);
    let candle_2d = g.kernel.len() == 2 && uniform(&g.padding) && uniform(&g.stride) && uniform(&g.dilation);
    match g.kernel.len() {
        _ if x.device().is_cpu() => unfold::conv_unfold(x, w, g, groups),
        1 => x.conv1d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        2 if candle_2d => x.conv2d(w, g.padding[0], g.stride[0], g.dilation[0], groups),
        _ => unfold::conv_unfold(x, w, g, groups),
    }
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
            let route = effective_route(cx.opts.route, geom);
            match route {
                ConvRoute::Grouped => batch_grouped(cx, geom, groups, x, w),
                ConvRoute::Unfold => batch_unfold(cx, geom, groups, x, w),
                ConvRoute::Loop => fallback::emit_loop(cx, conv(groups), args),
            }
        }
    }
}

/// The route that applies: 5D inputs (conv3d) have no grouped or unfold
/// lowering yet, so any other request falls back to the loop, warning once.
fn effective_route(asked: ConvRoute, geom: &ConvGeom) -> ConvRoute {
    if geom.kernel.len() == 3 && asked != ConvRoute::Loop {
        warn_once(
            format!("conv3d-route-{asked:?}"),
            format!("vmap: the {asked:?} conv route does not apply to 5D inputs (conv3d); using the Loop route"),
        );
        return ConvRoute::Loop;
    }
    asked
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
