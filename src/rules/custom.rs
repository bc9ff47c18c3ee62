//! User-supplied candle functions as primitives (JAX's `pure_callback`): an
//! escape hatch for operations the crate lacks. They have no batching rule,
//! so `vmap` runs them once per example through the generic loop.

use super::{BVal, BatchCx, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::TensorType;
use candle_core::Tensor;
use std::fmt;
use std::sync::Arc;

/// The function type of a custom primitive.
pub type CustomKernel = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync;

/// A candle function with declared operand and result types.
#[derive(Clone)]
pub struct CustomOp {
    pub(crate) name: String,
    pub(crate) f: Arc<CustomKernel>,
    pub(crate) ins: Vec<TensorType>,
    pub(crate) out: TensorType,
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({})", self.name)
    }
}

impl PartialEq for CustomOp {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.f, &other.f) && self.ins == other.ins && self.out == other.out
    }
}

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

    fn run(&self, args: &[&Tensor], out: &TensorType) -> Result<Tensor> {
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
