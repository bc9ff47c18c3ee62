//! Primitive rules, one file per family. Every primitive implements [`Rule`]:
//! how its result type follows from its operands (checked while tracing),
//! how it runs on candle, and how it batches under `vmap`. Transforms own the
//! driver loops; the families own the rules.
//!
//! Batching rules follow functorch: a pure function from `(value, Option<batch
//! axis>)` operands to a `(value, Option<batch axis>)` result, emitting the
//! batched computation into the builder of the enclosing trace.

pub(crate) mod conv;
pub(crate) mod custom;
pub(crate) mod elementwise;
pub(crate) mod fallback;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod pool;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod shape;

use crate::error::{Error, Result};
use crate::ir::{Prim, TensorType, VarId};
use crate::route::ConvRoute;
use crate::trace::Builder;
use candle_core::Tensor;

/// A value under `vmap`: its id in the output builder and the axis that
/// carries the batch, if any.
pub(crate) type BVal = (VarId, Option<usize>);

/// Options that batching rules read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BatchOpts {
    pub(crate) route: ConvRoute,
    pub(crate) strict: bool,
    pub(crate) randomness: crate::transforms::vmap::Randomness,
}

/// What a batching rule works with: the builder it emits into, the size of
/// the mapped axis, and the options.
pub(crate) struct BatchCx<'a> {
    pub(crate) b: &'a mut Builder,
    pub(crate) size: usize,
    pub(crate) opts: &'a BatchOpts,
}

/// The rules of one primitive.
pub(crate) trait Rule {
    /// The result type, or a shape/dtype error naming the operation.
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType>;
    /// Computes the primitive on candle tensors.
    fn run(&self, args: &[&Tensor], out: &TensorType) -> Result<Tensor>;
    /// Emits the batched computation; `Ok(None)` asks for the generic loop.
    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>>;
    /// Emits the cotangent of each operand from the cotangent `ct` of the
    /// result (`out`); `None` for an operand without one (indices, masks).
    /// `Ok(None)`: the primitive has no VJP rule.
    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(None)
    }
}

/// Cotangents of a primitive's operands, in operand order.
pub(crate) type Cts = Vec<Option<VarId>>;

/// The rules of a computed primitive (not of inputs, constants, literals).
pub(crate) fn rule(prim: &Prim) -> Result<&dyn Rule> {
    Ok(match prim {
        Prim::Unary(r) => r,
        Prim::Binary(r) => r,
        Prim::Compare(r) => r,
        Prim::Where => &elementwise::Where,
        Prim::Reduce(r) => r,
        Prim::Shape(r) => r,
        Prim::Index(r) => r,
        Prim::Matmul => &matmul::Matmul,
        Prim::Conv(r) => r,
        Prim::Pool(r) => r,
        Prim::Loop(r) => r.as_ref(),
        Prim::Custom(r) => r,
        Prim::Random(r) => r,
        Prim::Input(_) | Prim::Const(_) | Prim::Scalar(_) => {
            return Err(Error::unsupported(prim.name(), "rules", "a leaf has no rules"))
        }
    })
}

/// Result type of `prim(args)`.
pub(crate) fn infer(prim: &Prim, args: &[&TensorType]) -> Result<TensorType> {
    rule(prim)?.infer(args)
}

/// Checks the operand count.
pub(crate) fn arity(op: &'static str, args: &[&TensorType], n: usize) -> Result<()> {
    if args.len() != n {
        let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
        return Err(Error::shape(
            op,
            &shapes,
            format!("expected {n} operands, got {}", args.len()),
        ));
    }
    Ok(())
}

/// Checks that all operands share one dtype and returns it.
pub(crate) fn same_dtype(op: &'static str, args: &[&TensorType]) -> Result<candle_core::DType> {
    let dt = args[0].dtype;
    if args.iter().any(|t| t.dtype != dt) {
        return Err(Error::DType {
            op,
            dtypes: args.iter().map(|t| t.dtype).collect(),
            msg: "operands must share one dtype".into(),
        });
    }
    Ok(dt)
}

/// Numpy broadcasting of two shapes (right-aligned).
pub(crate) fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::shape(op, &[a, b], "shapes do not broadcast")),
        };
    }
    Ok(out)
}

/// Normalises a possibly negative axis for a tensor of rank `rank`.
pub(crate) fn norm_axis(op: &'static str, shape: &[usize], axis: isize) -> Result<usize> {
    let r = shape.len() as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(Error::shape(
            op,
            &[shape],
            format!("axis {axis} out of range for rank {r}"),
        ));
    }
    Ok(a as usize)
}

// Emitting helpers shared by the rules: each adds one shape node.
impl Builder {
    pub(crate) fn reshape(&mut self, v: VarId, shape: Vec<usize>) -> Result<VarId> {
        if self.dims(v) == shape {
            return Ok(v);
        }
        self.emit(Prim::Shape(shape::ShapeOp::Reshape(shape)), &[v])
    }

    pub(crate) fn permute(&mut self, v: VarId, perm: Vec<usize>) -> Result<VarId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(v);
        }
        self.emit(Prim::Shape(shape::ShapeOp::Permute(perm)), &[v])
    }

    /// Moves axis `from` to position `to`, keeping the others in order.
    pub(crate) fn move_axis(&mut self, v: VarId, from: usize, to: usize) -> Result<VarId> {
        let mut perm: Vec<usize> = (0..self.ty(v).rank()).filter(|&i| i != from).collect();
        perm.insert(to, from);
        self.permute(v, perm)
    }

    pub(crate) fn broadcast(&mut self, v: VarId, shape: Vec<usize>) -> Result<VarId> {
        if self.dims(v) == shape {
            return Ok(v);
        }
        self.emit(Prim::Shape(shape::ShapeOp::Broadcast(shape)), &[v])
    }

    pub(crate) fn narrow(&mut self, v: VarId, axis: usize, start: usize, len: usize) -> Result<VarId> {
        if start == 0 && self.dims(v)[axis] == len {
            return Ok(v);
        }
        self.emit(Prim::Shape(shape::ShapeOp::Narrow { axis, start, len }), &[v])
    }

    pub(crate) fn concat(&mut self, vs: &[VarId], axis: usize) -> Result<VarId> {
        if vs.len() == 1 {
            return Ok(vs[0]);
        }
        self.emit(Prim::Shape(shape::ShapeOp::Concat(axis)), vs)
    }
}

// Emitting helpers for the VJP rules.
impl Builder {
    pub(crate) fn un(&mut self, u: elementwise::Unary, v: VarId) -> Result<VarId> {
        self.emit(Prim::Unary(u), &[v])
    }

    pub(crate) fn bin(&mut self, op: elementwise::Binary, a: VarId, b: VarId) -> Result<VarId> {
        self.emit(Prim::Binary(op), &[a, b])
    }

    pub(crate) fn cmp(&mut self, op: elementwise::Compare, a: VarId, b: VarId) -> Result<VarId> {
        self.emit(Prim::Compare(op), &[a, b])
    }

    /// `where(mask, t, f)`
    pub(crate) fn select(&mut self, mask: VarId, t: VarId, f: VarId) -> Result<VarId> {
        self.emit(Prim::Where, &[mask, t, f])
    }

    /// A scalar literal with `like`'s dtype.
    pub(crate) fn scalar_as(&mut self, value: f64, like: VarId) -> VarId {
        let dt = self.ty(like).dtype;
        self.scalar(value, dt)
    }

    /// Zeros of a shape and dtype (a broadcast literal).
    pub(crate) fn zeros(&mut self, shape: Vec<usize>, dtype: candle_core::DType) -> Result<VarId> {
        let z = self.scalar(0.0, dtype);
        self.broadcast(z, shape)
    }

    pub(crate) fn sum_axes(&mut self, v: VarId, axes: Vec<usize>, keepdim: bool) -> Result<VarId> {
        if axes.is_empty() {
            return Ok(v);
        }
        self.emit(Prim::Reduce(reduce::Reduce::Sum { axes, keepdim }), &[v])
    }

    /// Sums a broadcast result back to an operand's shape: over the leading
    /// axes the operand lacks and the axes where it has size 1.
    pub(crate) fn sum_to(&mut self, v: VarId, shape: &[usize]) -> Result<VarId> {
        let s = self.dims(v);
        if s == shape {
            return Ok(v);
        }
        let lead = s.len() - shape.len();
        let mut axes: Vec<usize> = (0..lead).collect();
        axes.extend(
            (0..shape.len())
                .filter(|&i| shape[i] == 1 && s[lead + i] != 1)
                .map(|i| i + lead),
        );
        let r = self.sum_axes(v, axes, true)?;
        self.reshape(r, shape.to_vec())
    }
}

impl BatchCx<'_> {
    /// The batched value with its batch axis first; unbatched values are
    /// returned as they are.
    pub(crate) fn front(&mut self, (v, bdim): BVal) -> Result<VarId> {
        match bdim {
            Some(d) if d != 0 => self.b.move_axis(v, d, 0),
            _ => Ok(v),
        }
    }

    /// The value with a batch axis first, broadcasting an unbatched value
    /// (`X -> B X`).
    pub(crate) fn materialize(&mut self, (v, bdim): BVal) -> Result<VarId> {
        match bdim {
            Some(_) => self.front((v, bdim)),
            None => {
                let mut d = self.b.dims(v);
                d.insert(0, self.size);
                self.b.broadcast(v, d)
            }
        }
    }

    /// Batch axis first, then unit axes so the per-example part has rank
    /// `rank` (`B x.. -> B 1.. x..`), for right-aligned broadcasting against
    /// operands of a higher per-example rank.
    pub(crate) fn front_padded(&mut self, v: BVal, rank: usize) -> Result<VarId> {
        let id = self.front(v)?;
        let mut d = self.b.dims(id);
        let logical = d.len() - 1;
        if logical < rank {
            for _ in logical..rank {
                d.insert(1, 1);
            }
            return self.b.reshape(id, d);
        }
        Ok(id)
    }

    /// Per-example rank of an operand.
    pub(crate) fn logical_rank(&self, (v, bdim): BVal) -> usize {
        self.b.ty(v).rank() - usize::from(bdim.is_some())
    }
}
