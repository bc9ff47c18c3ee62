//! Indexing primitives: index-select and gather (picking a label's
//! log-probability is `gather` along the class axis).

use super::{arity, BVal, BatchCx, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType};
use candle_core::{DType, Tensor};

/// Indexing primitives; the index operand is an integer tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexOp {
    /// `x.index_select(idx, axis)`: `idx` is 1-D; the result takes
    /// `x[.., idx[k], ..]` along `axis`.
    IndexSelect(usize),
    /// `x.gather(idx, axis)`: `idx` has x's rank; `out[.., k, ..] = x[.., idx[.., k, ..], ..]`.
    Gather(usize),
}

impl IndexOp {
    pub(crate) fn name(&self) -> String {
        match self {
            IndexOp::IndexSelect(a) => format!("index_select[axis={a}]"),
            IndexOp::Gather(a) => format!("gather[axis={a}]"),
        }
    }
}

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

impl Rule for IndexOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("index", args, 2)?;
        let (x, idx) = (args[0], args[1]);
        let (xs, is) = (x.shape.as_slice(), idx.shape.as_slice());
        match *self {
            IndexOp::IndexSelect(axis) => {
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
            IndexOp::Gather(axis) => {
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
        }
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let (x, idx) = (args[0], args[1]);
        let op = self.name();
        match *self {
            IndexOp::IndexSelect(axis) => x
                .contiguous()
                .op(&op)?
                .index_select(&idx.contiguous().op(&op)?, axis)
                .op(&op),
            IndexOp::Gather(axis) => x.contiguous().op(&op)?.gather(&idx.contiguous().op(&op)?, axis).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let (x, idx) = (args[0], args[1]);
        let out = match (*self, idx.1) {
            // B x.. with a shared index: select along the shifted axis.
            (IndexOp::IndexSelect(axis), None) => {
                let xb = cx.front(x)?;
                cx.b.emit(Prim::Index(IndexOp::IndexSelect(axis + 1)), &[xb, idx.0])?
            }
            // A per-example index: B K -> B 1.. K 1.. -> B x..(K at axis), then gather.
            (IndexOp::IndexSelect(axis), Some(_)) => {
                let xb = cx.materialize(x)?;
                let ib = cx.front(idx)?;
                let mut target = cx.b.dims(xb);
                let k = cx.b.dims(ib)[1];
                target[axis + 1] = k;
                let mut unit = vec![1; target.len()];
                unit[0] = cx.size;
                unit[axis + 1] = k;
                let ib = cx.b.reshape(ib, unit)?;
                let ib = cx.b.broadcast(ib, target)?;
                cx.b.emit(Prim::Index(IndexOp::Gather(axis + 1)), &[xb, ib])?
            }
            (IndexOp::Gather(axis), _) => {
                let xb = cx.materialize(x)?;
                let ib = cx.materialize(idx)?;
                cx.b.emit(Prim::Index(IndexOp::Gather(axis + 1)), &[xb, ib])?
            }
        };
        Ok(Some((out, Some(0))))
    }
}
