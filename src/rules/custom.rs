//! User-supplied candle functions as primitives (JAX's `pure_callback`): an
//! escape hatch for operations the crate lacks. They have no batching rule,
//! so `vmap` maps them over the examples, and no VJP rule, so `grad`
//! reports them by name.

use super::{BVal, BatchCx, Rule, RunCx};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{CustomOp, TensorType};
use candle_core::Tensor;

impl Rule for CustomOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let same = args.len() == self.ins.len() && args.iter().zip(&self.ins).all(|(a, b)| *a == b);
        if !same {
            let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
            return Err(Error::shape(
                "custom",
                &shapes,
                format!("{} was declared for {:?}", self.name, self.ins),
            ));
        }
        Ok(self.out.clone())
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, _cx: &RunCx) -> Result<Tensor> {
        let xs: Vec<Tensor> = args.iter().map(|t| (*t).clone()).collect();
        let y = (self.f)(&xs).op(&self.name)?;
        if y.dims() != out.shape.as_slice() || y.dtype() != out.dtype {
            return Err(Error::shape(
                "custom",
                &[y.dims(), &out.shape],
                format!("{} returned a tensor other than the declared one", self.name),
            ));
        }
        Ok(y)
    }

    fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        Ok(None)
    }
}
