//! Writes in place: the primitives a concatenation is lowered to by the
//! executable's passes (`interp::passes`), a buffer of the result type and
//! one write per piece, each right after its piece is made. They mutate
//! their buffer, so they are never merged or recomputed, and they exist
//! only in graphs about to run: no transform rules.

use super::facts::{bytes, Arg, Effect, Facts, Storage, Workspace};
use super::{arity, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::PlaceOp;
use crate::ir::{TensorType, VarId};
use candle_core::Tensor;

impl Rule for PlaceOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        match self {
            PlaceOp::Empty(t) => {
                arity("empty", args, 0)?;
                Ok(t.clone())
            }
            PlaceOp::Write { axis, offset } => {
                arity("write", args, 2)?;
                same_dtype("write", args)?;
                let (dst, src) = (&args[0].shape, &args[1].shape);
                let fits = dst.len() == src.len()
                    && *axis < dst.len()
                    && offset.checked_add(src[*axis]).is_some_and(|end| end <= dst[*axis])
                    && (0..dst.len()).all(|i| i == *axis || dst[i] == src[i]);
                if !fits {
                    return Err(Error::shape(
                        "write",
                        &[dst, src],
                        format!("the piece does not fit at {offset} along axis {axis}"),
                    ));
                }
                Ok(args[0].clone())
            }
        }
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            storage: match self {
                PlaceOp::Empty(_) => Storage::Fresh,
                PlaceOp::Write { .. } => Storage::View { contiguous: true },
            },
            // a buffer that is written into: never two of it
            effect: Effect::Opaque,
            cheap: false,
            epilogue: false,
            measurable: true,
        }
    }

    fn workspace(&self, args: &[Arg], _out: &TensorType) -> Workspace {
        match self {
            PlaceOp::Empty(_) => Workspace::NONE,
            // a strided piece is made contiguous to be copied in
            PlaceOp::Write { .. } => Workspace::copies(args[1].copy_if_strided()),
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        match self {
            PlaceOp::Empty(t) => Tensor::zeros(t.shape.as_slice(), t.dtype, cx.device).op("empty"),
            PlaceOp::Write { axis, offset } => {
                let (dst, src) = (args[0], args[1]);
                if bytes(out) == 0 || src.elem_count() == 0 {
                    return Ok(dst.clone());
                }
                // `dst` is the buffer an `Empty` made and only this chain
                // of writes reads, each write its last reader
                dst.slice_set(&src.contiguous().op("write")?, *axis, *offset)
                    .op("write")?;
                Ok(dst.clone())
            }
        }
    }

    fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        Err(Error::internal(
            self.name(),
            "writes in place are made after every transform",
        ))
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Err(Error::internal(
            self.name(),
            "writes in place are made after every transform",
        ))
    }

    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Err(Error::internal(
            self.name(),
            "writes in place are made after every transform",
        ))
    }
}
