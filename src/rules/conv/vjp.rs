//! VJP rules of the convolution family. The family is closed under
//! differentiation: conv, its two gradients, unfold and fold are each
//! other's adjoints, so second derivatives stay inside it.

use super::grad_input;
use crate::error::{Error, Result};
use crate::ir::conv::ConvOp;
use crate::ir::{ConvGeom, Prim, VarId};
use crate::rules::{Builder, Cts};

/// The cotangents of `op`'s operands from the result's cotangent `ct`.
pub(super) fn vjp(op: &ConvOp, b: &mut Builder, args: &[VarId], ct: VarId) -> Result<Cts> {
    // The family is closed under differentiation: conv, its two
    // gradients, unfold and fold are each other's adjoints.
    let cts = match op {
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
        ConvOp::GradWeightSqNorms(_) => {
            return Err(Error::unsupported(
                op.name(),
                "grad",
                "the DP clipping step's norms are not differentiated (differentiate the loss instead)",
            ))
        }
    };
    Ok(cts)
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
