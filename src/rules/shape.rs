//! Shape primitives: reshape, permute, broadcast, narrow, concatenate.
//! (squeeze, unsqueeze, flatten, transpose and stack are built from these.)

use super::facts::{Arg, Facts, Storage, Workspace};
use super::{checked_product, multilinear_jvp, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::ShapeOp;
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::transpose;
use candle_core::Tensor;

/// Whether `from` broadcasts to `to` (numpy rules, right-aligned).
pub(crate) fn broadcasts_to(from: &[usize], to: &[usize]) -> bool {
    from.len() <= to.len() && from.iter().rev().zip(to.iter().rev()).all(|(&f, &t)| f == t || f == 1)
}

fn infer_one(op: &ShapeOp, x: &TensorType) -> Result<TensorType> {
    let s = x.shape.as_slice();
    match op {
        ShapeOp::Reshape(to) => {
            let (n, m) = (
                checked_product("reshape", &[s, to], to)?,
                checked_product("reshape", &[s, to], s)?,
            );
            if n != m {
                return Err(Error::shape("reshape", &[s, to], "element counts differ"));
            }
            Ok(x.with_shape(to.clone()))
        }
        ShapeOp::Permute(p) => {
            let mut seen = vec![false; s.len()];
            let ok = p.len() == s.len() && p.iter().all(|&i| i < s.len() && !std::mem::replace(&mut seen[i], true));
            if !ok {
                return Err(Error::shape(
                    "permute",
                    &[s],
                    format!("{p:?} is not a permutation of the axes"),
                ));
            }
            Ok(x.with_shape(p.iter().map(|&i| s[i]).collect::<Vec<_>>()))
        }
        ShapeOp::Broadcast(to) => {
            if !broadcasts_to(s, to) {
                return Err(Error::shape(
                    "broadcast",
                    &[s, to],
                    "shape does not broadcast to the target",
                ));
            }
            Ok(x.with_shape(to.clone()))
        }
        ShapeOp::Narrow { axis, start, len } => {
            if *axis >= s.len() || start.checked_add(*len).is_none_or(|end| end > s[*axis]) {
                return Err(Error::shape(
                    "narrow",
                    &[s],
                    format!("range of {len} from {start} out of bounds on axis {axis}"),
                ));
            }
            let mut d = s.to_vec();
            d[*axis] = *len;
            Ok(x.with_shape(d))
        }
        ShapeOp::Concat(_) => Err(Error::internal("concat", "an n-ary primitive inferred as unary")),
    }
}

fn infer_concat(axis: usize, args: &[&TensorType]) -> Result<TensorType> {
    let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
    if args.is_empty() {
        return Err(Error::shape("concat", &shapes, "needs at least one operand"));
    }
    let dt = same_dtype("concat", args)?;
    let first = shapes[0];
    if axis >= first.len() {
        return Err(Error::shape("concat", &shapes, format!("axis {axis} out of range")));
    }
    let mut out = first.to_vec();
    out[axis] = 0;
    for s in &shapes {
        let fits = s.len() == first.len() && s.iter().zip(first).enumerate().all(|(i, (a, b))| i == axis || a == b);
        if !fits {
            return Err(Error::shape(
                "concat",
                &shapes,
                format!("shapes differ off axis {axis}"),
            ));
        }
        out[axis] += s[axis];
    }
    Ok(TensorType::new(out, dt))
}

/// A value of shape `shape` holding each `(start, len, piece)` at
/// `start..start + len` along `axis` and zeros elsewhere, as one
/// concatenation (the pieces sorted and disjoint): the cotangent of the
/// `narrow`s that read those ranges.
pub(crate) fn embed_slices(
    b: &mut Builder,
    shape: &[usize],
    axis: usize,
    pieces: &[(usize, usize, VarId)],
) -> Result<VarId> {
    let dt = b.ty(pieces[0].2).dtype;
    let mut parts = Vec::with_capacity(2 * pieces.len() + 1);
    let mut at = 0;
    let gap = |b: &mut Builder, n: usize| {
        let mut s = shape.to_vec();
        s[axis] = n;
        b.zeros(s, dt)
    };
    for &(start, len, piece) in pieces {
        if start > at {
            parts.push(gap(b, start - at)?);
        }
        parts.push(piece);
        at = start + len;
    }
    if shape[axis] > at {
        parts.push(gap(b, shape[axis] - at)?);
    }
    match parts.as_slice() {
        [one] => Ok(*one),
        _ => b.concat(&parts, axis),
    }
}

impl Rule for ShapeOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        match self {
            ShapeOp::Concat(axis) => infer_concat(*axis, args),
            op => {
                super::arity("shape", args, 1)?;
                infer_one(op, args[0])
            }
        }
    }

    fn facts(&self, args: &[Arg], _out: &TensorType) -> Facts {
        let storage = match self {
            ShapeOp::Reshape(_) => Storage::ViewOrCopy,
            // a permute or a broadcast that changes nothing is never made
            ShapeOp::Permute(_) | ShapeOp::Broadcast(_) => Storage::View { contiguous: false },
            // rows of a contiguous value are contiguous
            ShapeOp::Narrow { axis, .. } => Storage::View {
                contiguous: args[0].ty.shape[..*axis].iter().all(|&d| d == 1),
            },
            // candle writes off-axis concatenations of strided operands
            // transposed
            ShapeOp::Concat(axis) if *axis > 0 && args.iter().any(|a| !a.contiguous) => Storage::Strided,
            ShapeOp::Concat(_) => Storage::Fresh,
        };
        Facts {
            storage,
            // a view costs nothing to hold; a concatenation is a copy
            cheap: false,
            ..Facts::costly()
        }
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        // a reshape's copy is its result; a concatenation writes its result
        // from strided operands in place
        Workspace::NONE
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let x = args[0];
        let op = self.name();
        match self {
            // A reshape of a strided view copies it; transposes copy fast.
            ShapeOp::Reshape(to) => transpose::contiguous(x, cx.path)
                .op(&op)?
                .reshape(to.as_slice())
                .op(&op),
            ShapeOp::Permute(p) => x.permute(p.as_slice()).op(&op),
            ShapeOp::Broadcast(_) => x.broadcast_as(out.shape.as_slice()).op(&op),
            ShapeOp::Narrow { axis, start, len } => x.narrow(*axis, *start, *len).op(&op),
            ShapeOp::Concat(axis) => Tensor::cat(args, *axis).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let size = cx.size;
        let with_b = |s: &[usize]| [&[size], s].concat();
        let out = match self {
            // x.. -> B x..: the batch axis leads, the per-example op follows.
            ShapeOp::Reshape(to) => {
                let x = cx.front(args[0])?;
                cx.b.reshape(x, with_b(to))?
            }
            ShapeOp::Permute(p) => {
                let x = cx.front(args[0])?;
                let perm = std::iter::once(0).chain(p.iter().map(|i| i + 1)).collect();
                cx.b.permute(x, perm)?
            }
            ShapeOp::Broadcast(to) => {
                let x = cx.front_padded(args[0], to.len())?;
                cx.b.broadcast(x, with_b(to))?
            }
            ShapeOp::Narrow { axis, start, len } => {
                let x = cx.front(args[0])?;
                cx.b.narrow(x, axis + 1, *start, *len)?
            }
            ShapeOp::Concat(axis) => {
                let mut xs = Vec::with_capacity(args.len());
                for &a in args {
                    xs.push(cx.materialize(a)?);
                }
                cx.b.emit(Prim::Shape(ShapeOp::Concat(axis + 1)), &xs)?
            }
        };
        Ok(Some((out, Some(0))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let xs = b.dims(args[0]);
        let g = match self {
            ShapeOp::Reshape(_) => vec![Some(b.reshape(ct, xs)?)],
            ShapeOp::Permute(p) => {
                let mut inv = vec![0; p.len()];
                for (i, &a) in p.iter().enumerate() {
                    inv[a] = i;
                }
                vec![Some(b.permute(ct, inv)?)]
            }
            ShapeOp::Broadcast(_) => vec![Some(b.sum_to(ct, &xs)?)],
            // Zeros around the narrowed range.
            ShapeOp::Narrow { axis, start, len } => vec![Some(embed_slices(b, &xs, *axis, &[(*start, *len, ct)])?)],
            ShapeOp::Concat(axis) => {
                let mut start = 0;
                let mut gs = Vec::with_capacity(args.len());
                for &a in args {
                    let len = b.dims(a)[*axis];
                    gs.push(Some(b.narrow(ct, *axis, start, len)?));
                    start += len;
                }
                gs
            }
        };
        Ok(Some(g))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        // linear; a concatenation jointly in all its operands (zeros for
        // those without a tangent)
        if let ShapeOp::Concat(_) = self {
            if tans.iter().all(Option::is_none) {
                return Ok(Some(None));
            }
            let mut ts = Vec::with_capacity(args.len());
            for (&a, &t) in args.iter().zip(tans) {
                ts.push(b.or_zeros(t, a)?);
            }
            return Ok(Some(Some(b.emit(Prim::Shape(self.clone()), &ts)?)));
        }
        multilinear_jvp(b, &Prim::Shape(self.clone()), args, tans, &[0]).map(Some)
    }
}
