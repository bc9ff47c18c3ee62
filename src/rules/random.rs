//! Random number primitives (dropout masks). They take no operands; under
//! `vmap` the transform's `randomness` setting decides whether every example
//! draws its own values (`Different`), all share one draw (`Same`), or the
//! trace is refused (`Error`, the default, as in `torch.func`).

use super::{BVal, BatchCx, Cts, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{TensorType, VarId};
use crate::trace::Builder;
use candle_core::{DType, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

static SEED: AtomicU64 = AtomicU64::new(0x5eed);
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// Seeds the random primitives (dropout masks) of this process: runs after
/// the call draw the same sequence of values.
pub fn manual_seed(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    DRAWS.store(0, Ordering::Relaxed);
}

/// Values uniform in `[0, 1)` of a fixed shape and dtype, drawn anew at
/// every run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uniform {
    /// Result type.
    pub ty: TensorType,
}

impl Uniform {
    pub(crate) fn name(&self) -> String {
        format!("uniform[{:?}]", self.ty.shape)
    }
}

impl Rule for Uniform {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        if !args.is_empty() || !matches!(self.ty.dtype, DType::F32 | DType::F64) {
            return Err(Error::shape(
                "uniform",
                &[],
                "takes no operands and makes f32 or f64 values",
            ));
        }
        Ok(self.ty.clone())
    }

    fn run(&self, _args: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        // One generator per draw, seeded from the process seed and a draw
        // counter: reproducible after `manual_seed`, fresh at every run.
        let draw = DRAWS.fetch_add(1, Ordering::Relaxed);
        let mut rng = crate::dp::rng::Rng::new(SEED.load(Ordering::Relaxed) ^ draw.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let v: Vec<f64> = (0..out.elem_count()).map(|_| rng.uniform()).collect();
        Tensor::from_vec(v, out.shape.as_slice(), &candle_core::Device::Cpu)
            .and_then(|t| t.to_dtype(out.dtype))
            .op("uniform")
    }

    fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        // Handled by the vmap driver, which knows the randomness setting.
        Ok(None)
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(Some(vec![]))
    }
}
