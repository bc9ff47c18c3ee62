//! Indexing primitives: index-select and gather (picking a label's
//! log-probability is `gather` along the class axis).

use super::facts::{bytes, Arg, Facts, Workspace};
use super::{arity, in_f32, in_f32_workspace, multilinear_jvp, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{IndexOp, Lookup};
use crate::ir::{Prim, TensorType, VarId};
use candle_core::{DType, Tensor};

fn check_index_dtype(op: &'static str, idx: &TensorType) -> Result<()> {
    if !matches!(idx.dtype, DType::U8 | DType::U32 | DType::I64) {
        return Err(Error::DType {
            op,
            dtypes: vec![idx.dtype],
            msg: "indices must be u8, u32 or i64".into(),
        });
    }
    Ok(())
}

/// Every index in `0..size`. candle reads the index dtype's maximum (u8
/// 255, `u32::MAX`) as padding and yields zeros for it, so a label of 255
/// would silently drop its example from a loss (PyTorch refuses it; an
/// ignore-index is an explicit option there).
fn in_range(idx: &Tensor, size: usize, op: &'static str) -> Result<()> {
    if idx.elem_count() == 0 {
        return Ok(());
    }
    // the least and greatest index in one read (on a GPU each read waits
    // for the queue)
    let ends = idx
        .flatten_all()
        .and_then(|v| v.to_dtype(DType::I64))
        .and_then(|v| Tensor::cat(&[v.min_keepdim(0)?, v.max_keepdim(0)?], 0))
        .and_then(|v| v.to_vec1::<i64>())
        .op(op)?;
    let (lo, hi) = (ends[0], ends[1]);
    if lo < 0 || hi >= size as i64 {
        let bad = if lo < 0 { lo } else { hi };
        let msg = if op == "embedding" {
            format!("token id {bad} is out of range for a table of {size} rows (valid ids 0..{size})")
        } else {
            format!("index {bad} is out of range for an axis of size {size}")
        };
        return Err(Error::Shape {
            op,
            shapes: vec![idx.dims().to_vec()],
            msg,
        });
    }
    Ok(())
}

impl IndexOp {
    /// Whether it runs in f32 on values of `dt` ([`super::in_f32`]): an
    /// index-add or scatter-add of half precision, which accumulates
    /// (49,152 rows of one id summed in bf16 stop at 256).
    fn in_f32(&self, dt: DType) -> bool {
        matches!(self, IndexOp::IndexAdd { .. } | IndexOp::ScatterAdd { .. }) && crate::kernels::is_half(dt)
    }
}

impl Rule for IndexOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("index", args, 2)?;
        let (x, idx) = (args[0], args[1]);
        let (xs, is) = (x.shape.as_slice(), idx.shape.as_slice());
        match *self {
            IndexOp::IndexSelect(axis, _) => {
                check_index_dtype("index_select", idx)?;
                if axis >= xs.len() || is.len() != 1 {
                    return Err(Error::shape(
                        "index_select",
                        &[xs, is],
                        "needs a 1-D index and an axis in range",
                    ));
                }
                let mut d = xs.to_vec();
                d[axis] = is[0];
                Ok(x.with_shape(d))
            }
            IndexOp::Gather(axis, _) => {
                check_index_dtype("gather", idx)?;
                let fits = axis < xs.len()
                    && is.len() == xs.len()
                    && is.iter().zip(xs).enumerate().all(|(i, (a, b))| i == axis || a <= b);
                if !fits {
                    return Err(Error::shape(
                        "gather",
                        &[xs, is],
                        "the index needs the operand's rank, and no larger size off the gathered axis",
                    ));
                }
                Ok(x.with_shape(is.to_vec()))
            }
            IndexOp::IndexAdd { axis, size } => {
                check_index_dtype("index_add", idx)?;
                if axis >= xs.len() || is.len() != 1 || is[0] != xs[axis] {
                    return Err(Error::shape(
                        "index_add",
                        &[xs, is],
                        "needs a 1-D index as long as the source's axis",
                    ));
                }
                let mut d = xs.to_vec();
                d[axis] = size;
                Ok(x.with_shape(d))
            }
            IndexOp::LookupSqNorms { .. } => {
                check_index_dtype("lookup_sq_norms", idx)?;
                if xs.len() != 3 || is != &xs[..2] || !x.dtype.is_float() {
                    return Err(Error::shape(
                        "lookup_sq_norms",
                        &[xs, is],
                        "takes float rows [B, T, D] and their ids [B, T]",
                    ));
                }
                Ok(x.with_shape(vec![xs[0]]))
            }
            IndexOp::ScatterAdd { axis, size } => {
                check_index_dtype("scatter_add", idx)?;
                if axis >= xs.len() || is != xs {
                    return Err(Error::shape(
                        "scatter_add",
                        &[xs, is],
                        "the index must have the source's shape",
                    ));
                }
                let mut d = xs.to_vec();
                d[axis] = size;
                Ok(x.with_shape(d))
            }
        }
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::costly()
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        if self.in_f32(out.dtype) {
            return in_f32_workspace(args, out, |a, o| self.workspace(a, o));
        }
        let (x, idx) = (args[0], args[1]);
        // contiguous operands, and the range check's i64 copy of the indices
        let copies = x.copy_if_strided() + idx.copy_if_strided() + 8 * idx.ty.elem_count();
        let scratch = match self {
            IndexOp::IndexSelect(..) | IndexOp::Gather(..) => 0,
            // each example's order of positions, a row of sums per thread
            IndexOp::LookupSqNorms { .. } => 8 * idx.ty.elem_count() + bytes(x.ty) / x.ty.shape[1].max(1),
            // the zeros added into, beside the result
            IndexOp::IndexAdd { .. } | IndexOp::ScatterAdd { .. } => bytes(out),
        };
        Workspace { copies, scratch }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let (x, idx) = (args[0], args[1]);
        let op = self.name();
        if let IndexOp::ScatterAdd { axis, size } = *self {
            // into zeros: only the source widens (`kernels::scatter`)
            if crate::kernels::is_half(x.dtype()) {
                in_range(idx, size, "scatter_add")?;
                if let Some(y) = crate::kernels::scatter::scatter_add_half(x, idx, axis, size, cx.path).op(&op)? {
                    return Ok(y);
                }
            }
        }
        if self.in_f32(x.dtype()) {
            return in_f32(&op, args, out, cx.path, |a, o| self.run(a, o, cx));
        }
        let (kind, size) = match *self {
            // the selected axis is the table's vocabulary wherever batching moved it
            IndexOp::IndexSelect(axis, Lookup::Embedding) | IndexOp::Gather(axis, Lookup::Embedding) => {
                ("embedding", x.dims()[axis])
            }
            IndexOp::IndexSelect(axis, _) => ("index_select", x.dims()[axis]),
            IndexOp::Gather(axis, _) => ("gather", x.dims()[axis]),
            IndexOp::IndexAdd { axis, .. } => ("index_add", out.shape[axis]),
            IndexOp::ScatterAdd { axis, .. } => ("scatter_add", out.shape[axis]),
            IndexOp::LookupSqNorms { size } => ("lookup_sq_norms", size),
        };
        in_range(idx, size, kind)?;
        match *self {
            IndexOp::IndexSelect(axis, _) => x
                .contiguous()
                .op(&op)?
                .index_select(&idx.contiguous().op(&op)?, axis)
                .op(&op),
            IndexOp::Gather(axis, _) => x.contiguous().op(&op)?.gather(&idx.contiguous().op(&op)?, axis).op(&op),
            IndexOp::IndexAdd { axis, .. } => {
                if axis == 0 {
                    let v = out.shape[0];
                    if let Some(y) = crate::kernels::segments::index_add_rows(x, idx, v, cx.path).op(&op)? {
                        return Ok(y);
                    }
                }
                Tensor::zeros(out.shape.as_slice(), x.dtype(), x.device())
                    .and_then(|z| z.index_add(&idx.contiguous()?, &x.contiguous()?, axis))
                    .op(&op)
            }
            IndexOp::ScatterAdd { axis, .. } => Tensor::zeros(out.shape.as_slice(), x.dtype(), x.device())
                .and_then(|z| z.scatter_add(&idx.contiguous()?, &x.contiguous()?, axis))
                .op(&op),
            IndexOp::LookupSqNorms { .. } => crate::kernels::segments::lookup_sq_norms(x, idx, cx.path).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let (x, idx) = (args[0], args[1]);
        let out = match (*self, idx.1) {
            // B x.. with a shared index: select along the shifted axis.
            (IndexOp::IndexSelect(axis, l), None) => {
                let xb = cx.front(x)?;
                cx.b.emit(Prim::Index(IndexOp::IndexSelect(axis + 1, l)), &[xb, idx.0])?
            }
            // A per-example index: B K -> B 1.. K 1.. -> B x..(K at axis), then gather.
            // A shared table and a per-example index (an embedding of each
            // example's ids): one selection of all the ids, `B K -> (B K)`,
            // then `x.. (B K) .. -> x.. B K .. -> B x.. K ..`. Gathering
            // from the table broadcast to every example instead copied it
            // once per example inside the kernel (1.5 GB at B=32 for a
            // 45 MiB vocabulary).
            (IndexOp::IndexSelect(axis, l), Some(_)) if x.1.is_none() => {
                let ib = cx.front(idx)?;
                let k = cx.b.dims(ib)[1];
                let flat = cx.b.reshape(ib, vec![cx.size * k])?;
                let y = cx.b.emit(Prim::Index(IndexOp::IndexSelect(axis, l)), &[x.0, flat])?;
                let mut split = cx.b.dims(y);
                split.splice(axis..=axis, [cx.size, k]);
                let y = cx.b.reshape(y, split)?;
                cx.b.move_axis(y, axis, 0)?
            }
            // Both per example: B K -> B 1.. K 1.. -> broadcast, then gather.
            (IndexOp::IndexSelect(axis, l), Some(_)) => {
                let xb = cx.front(x)?;
                let ib = cx.front(idx)?;
                let mut target = cx.b.dims(xb);
                let k = cx.b.dims(ib)[1];
                target[axis + 1] = k;
                let mut unit = vec![1; target.len()];
                unit[0] = cx.size;
                unit[axis + 1] = k;
                let ib = cx.b.reshape(ib, unit)?;
                let ib = cx.b.broadcast(ib, target)?;
                cx.b.emit(Prim::Index(IndexOp::Gather(axis + 1, l)), &[xb, ib])?
            }
            (IndexOp::Gather(axis, l), _) => {
                let xb = cx.materialize(x)?;
                let ib = cx.materialize(idx)?;
                cx.b.emit(Prim::Index(IndexOp::Gather(axis + 1, l)), &[xb, ib])?
            }
            (IndexOp::IndexAdd { axis, size }, None) => {
                let xb = cx.front(x)?;
                cx.b.emit(Prim::Index(IndexOp::IndexAdd { axis: axis + 1, size }), &[xb, idx.0])?
            }
            // A per-example index: B K -> B 1.. K 1.. -> the source's shape, then scatter-add.
            (IndexOp::IndexAdd { axis, size }, Some(_)) => {
                let xb = cx.materialize(x)?;
                let ib = cx.front(idx)?;
                let target = cx.b.dims(xb);
                let mut unit = vec![1; target.len()];
                unit[0] = cx.size;
                unit[axis + 1] = target[axis + 1];
                let ib = cx.b.reshape(ib, unit)?;
                let ib = cx.b.broadcast(ib, target)?;
                cx.b.emit(Prim::Index(IndexOp::ScatterAdd { axis: axis + 1, size }), &[xb, ib])?
            }
            (IndexOp::ScatterAdd { axis, size }, _) => {
                let xb = cx.materialize(x)?;
                let ib = cx.materialize(idx)?;
                cx.b.emit(Prim::Index(IndexOp::ScatterAdd { axis: axis + 1, size }), &[xb, ib])?
            }
            // independent per example: the outer batch folded into B,
            // B' B T D -> (B' B) T D, then (B' B) -> B' B
            (IndexOp::LookupSqNorms { .. }, _) => {
                let (xb, ib) = (cx.materialize(x)?, cx.materialize(idx)?);
                let (xd, id) = (cx.b.dims(xb), cx.b.dims(ib));
                let xf = cx.b.reshape(xb, vec![xd[0] * xd[1], xd[2], xd[3]])?;
                let iff = cx.b.reshape(ib, vec![id[0] * id[1], id[2]])?;
                let n = cx.b.emit(Prim::Index(*self), &[xf, iff])?;
                cx.b.reshape(n, vec![xd[0], xd[1]])?
            }
        };
        Ok(Some((out, Some(0))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let (x, idx) = (args[0], args[1]);
        let xs = b.dims(x);
        let g = match *self {
            IndexOp::IndexSelect(axis, _) => {
                let op = IndexOp::IndexAdd { axis, size: xs[axis] };
                b.emit(Prim::Index(op), &[ct, idx])?
            }
            IndexOp::Gather(axis, _) => {
                let op = IndexOp::ScatterAdd { axis, size: xs[axis] };
                let g = b.emit(Prim::Index(op), &[ct, idx])?;
                pad_to(b, g, &xs)?
            }
            IndexOp::IndexAdd { axis, .. } => {
                b.emit(Prim::Index(IndexOp::IndexSelect(axis, Lookup::Index)), &[ct, idx])?
            }
            IndexOp::ScatterAdd { axis, .. } => {
                b.emit(Prim::Index(IndexOp::Gather(axis, Lookup::Index)), &[ct, idx])?
            }
            IndexOp::LookupSqNorms { .. } => return Err(not_differentiable("grad")),
        };
        Ok(Some(vec![Some(g), None]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        if let IndexOp::LookupSqNorms { .. } = self {
            return Err(not_differentiable("jvp"));
        }
        // linear in the indexed values; the indices are integers
        multilinear_jvp(b, &Prim::Index(*self), args, tans, &[0]).map(Some)
    }
}

/// Ghost clipping's norms are computed, not differentiated: an error
/// naming them under a transform that would.
fn not_differentiable(transform: &'static str) -> Error {
    Error::unsupported(
        "lookup_sq_norms",
        transform,
        "ghost clipping's per-example norms of an embedding's gradient have no derivative here",
    )
}

/// Zero-pads `v` at the end of each axis up to `shape` (a gather's index may
/// be smaller than its operand off the gathered axis).
fn pad_to(b: &mut Builder, v: VarId, shape: &[usize]) -> Result<VarId> {
    let mut v = v;
    for (axis, &want) in shape.iter().enumerate() {
        let mut d = b.dims(v);
        if d[axis] < want {
            d[axis] = want - d[axis];
            let z = b.zeros(d, b.ty(v).dtype)?;
            v = b.concat(&[v, z], axis)?;
        }
    }
    Ok(v)
}
