//! The convolution batching rules, the heart of the crate. With only the
//! input batched the batch joins `N`; with only the weight batched
//! (ensembles on a shared batch) it joins the output channels; with both
//! batched (per-sample gradients, ensembles with their own data) the conv
//! route decides: `Grouped` folds the batch into the channels and groups,
//! `Unfold` runs im2col and one batched matmul (as Opacus does), `Loop`
//! maps the unbatched convolution over the examples. For `Auto` the
//! planner in the context chooses (`BatchCx::route`).

use super::grad_input;
use crate::error::{Error, Result};
use crate::ir::conv::ConvOp;
use crate::ir::options::ConvRoute;
use crate::ir::{ConvGeom, Prim, VarId};
use crate::rules::control::map;
use crate::rules::{BVal, BatchCx};

/// The routes a convolution with both operands batched can take.
const ROUTES: [ConvRoute; 3] = [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop];

/// Emits `op` batched over `args`.
pub(super) fn batch(op: &ConvOp, cx: &mut BatchCx, args: &[BVal]) -> Result<BVal> {
    match op {
        ConvOp::Unfold(_) | ConvOp::UnfoldRows(_) | ConvOp::Fold { .. } => {
            let x = fold_into_n(cx, args[0])?;
            let y = cx.b.emit(Prim::Conv(op.clone()), &[x])?;
            Ok((split_n(cx, y)?, Some(0)))
        }
        ConvOp::Conv { geom, groups } => batch_conv(cx, geom, *groups, args),
        ConvOp::GradInput { geom, groups, spatial } => batch_grad_input(cx, geom, *groups, spatial, args),
        ConvOp::GradWeight { geom, groups } => batch_grad_weight(cx, geom, *groups, args),
        ConvOp::GradWeightEach(_) | ConvOp::GradWeightSqNorms(_) => {
            // B E .. -> (B E) .. -> op -> B E ..
            let x = cx.materialize(args[0])?;
            let c = cx.materialize(args[1])?;
            let (x, c) = (merge_front(cx, x)?, merge_front(cx, c)?);
            let y = cx.b.emit(Prim::Conv(op.clone()), &[x, c])?;
            Ok((split_n(cx, y)?, Some(0)))
        }
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
            let op = ConvOp::Conv {
                geom: geom.clone(),
                groups,
            };
            match cx.route(&Prim::Conv(op), args, &ROUTES)? {
                ConvRoute::Grouped => batch_grouped(cx, geom, groups, x, w),
                ConvRoute::Unfold => batch_unfold(cx, geom, groups, x, w),
                ConvRoute::Loop | ConvRoute::Auto => map::emit_map(cx, &conv(groups), args),
            }
        }
    }
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
    let o = geom.fit(&xd[2..]).map_err(|why| Error::shape("conv", &[&xd], why))?;
    // B N g Cout/g L -> B N Cout O..
    let y = cx.b.reshape(y, [&[size, n, cout], &o[..]].concat())?;
    Ok((y, Some(0)))
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
    let o = geom.fit(&xd[2..]).map_err(|why| Error::shape("conv", &[&xd], why))?;
    Ok((cx.b.reshape(y, [&[size, n, cout], &o[..]].concat())?, Some(0)))
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
    let both = [(cb, Some(0)), (wb, Some(0))];
    match cx.route(&Prim::Conv(op), &both, &ROUTES)? {
        ConvRoute::Loop | ConvRoute::Auto => map::emit_map(cx, &grad_input(geom, groups, spatial.to_vec()), &both),
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
    let both = [(xb, Some(0)), (cb, Some(0))];
    match cx.route(&Prim::Conv(op), &both, &ROUTES)? {
        ConvRoute::Loop | ConvRoute::Auto => map::emit_map(cx, &gw(groups), &both),
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
