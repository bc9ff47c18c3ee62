//! Comparisons and `where`: their outputs carry no gradient to the
//! compared values, and `where` routes its cotangent to the chosen side.

use super::batch_broadcasting;
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::Compare;
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::compare;
use crate::rules::facts::{Arg, Facts, Workspace};
use crate::rules::{arity, broadcast_shapes, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use candle_core::{DType, Tensor};

impl Compare {
    /// Which orderings of `a` against `b` make the comparison true.
    fn accept(self) -> compare::Accept {
        let (less, equal, greater) = match self {
            Compare::Eq => (false, true, false),
            Compare::Ne => (true, false, true),
            Compare::Lt => (true, false, false),
            Compare::Le => (true, true, false),
            Compare::Gt => (false, false, true),
            Compare::Ge => (false, true, true),
        };
        compare::Accept {
            unordered: self == Compare::Ne,
            less,
            equal,
            greater,
        }
    }
}

impl Rule for Compare {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity(self.name(), args, 2)?;
        same_dtype(self.name(), args)?;
        let shape = broadcast_shapes(self.name(), &args[0].shape, &args[1].shape)?;
        Ok(TensorType::new(shape, DType::U8))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::cheap_map()
    }

    fn workspace(&self, args: &[Arg], _out: &TensorType) -> Workspace {
        // against a scalar, the CPU kernel reads a contiguous operand
        Workspace::copies(args[0].copy_if_strided())
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let (a, b) = (args[0], args[1]);
        if let Some(m) = compare::with_scalar(a, b, self.accept(), cx.path).op(self.name())? {
            return m.reshape(out.shape.as_slice()).op(self.name());
        }
        let r = match self {
            Compare::Eq => a.broadcast_eq(b),
            Compare::Ne => a.broadcast_ne(b),
            Compare::Lt => a.broadcast_lt(b),
            Compare::Le => a.broadcast_le(b),
            Compare::Gt => a.broadcast_gt(b),
            Compare::Ge => a.broadcast_ge(b),
        };
        r.op(self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Compare(*self), args).map(Some)
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(Some(vec![None, None]))
    }

    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Ok(Some(None)) // an integer mask
    }
}

/// `where(mask, on_true, on_false)`, all three broadcast together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Where;

impl Rule for Where {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("where", args, 3)?;
        let dt = same_dtype("where", &args[1..])?;
        if !matches!(args[0].dtype, DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::DType {
                op: "where",
                dtypes: vec![args[0].dtype],
                msg: "the mask must be an integer tensor (a comparison's u8 result)".into(),
            });
        }
        let s = broadcast_shapes("where", &args[0].shape, &args[1].shape)?;
        Ok(TensorType::new(broadcast_shapes("where", &s, &args[2].shape)?, dt))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::cheap_map()
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        Workspace::NONE // candle selects through broadcast views in place
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, _cx: &RunCx) -> Result<Tensor> {
        let shape = out.shape.as_slice();
        let m = args[0].broadcast_as(shape).op("where")?;
        let t = args[1].broadcast_as(shape).op("where")?;
        let f = args[2].broadcast_as(shape).op("where")?;
        m.where_cond(&t, &f).op("where")
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Where, args).map(Some)
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let (m, t, f) = (args[0], args[1], args[2]);
        let zero = b.scalar_as(0.0, ct);
        let gt = b.select(m, ct, zero)?;
        let gf = b.select(m, zero, ct)?;
        let (st, sf) = (b.dims(t), b.dims(f));
        Ok(Some(vec![None, Some(b.sum_to(gt, &st)?), Some(b.sum_to(gf, &sf)?)]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        if tans[1].is_none() && tans[2].is_none() {
            return Ok(Some(None));
        }
        let zero = b.scalar_as(0.0, out);
        let (tt, tf) = (tans[1].unwrap_or(zero), tans[2].unwrap_or(zero));
        Ok(Some(Some(b.select(args[0], tt, tf)?)))
    }
}
