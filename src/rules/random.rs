//! Random number primitives (dropout masks). They take no operands; under
//! `vmap` the options' `randomness` decides whether every example draws its
//! own values (`Different`), all share one draw (`Same`), or the trace is
//! refused (`Error`, the default, as in `torch.func`). Values are drawn from
//! the seed the interpreter hands each node (see `RunCx`), so a run is
//! reproducible from its transform's seed, and live on the run's device.

use super::facts::{Arg, Effect, Facts, Workspace};
use super::{BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::Uniform;
use crate::ir::options::Randomness;
use crate::ir::{Prim, TensorType, VarId};
use crate::rng::Rng;
use candle_core::{DType, Tensor};

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

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            effect: Effect::Random,
            cheap: false,
            ..Facts::costly()
        }
    }

    fn workspace(&self, _args: &[Arg], out: &TensorType) -> Workspace {
        // drawn as f64 on the host, then cast (and moved) to the result
        Workspace::scratch(8 * out.elem_count())
    }

    fn run(&self, _args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let mut rng = Rng::seeded(cx.seed);
        let v: Vec<f64> = (0..out.elem_count()).map(|_| rng.uniform()).collect();
        Tensor::from_vec(v, out.shape.as_slice(), &candle_core::Device::Cpu)
            .and_then(|t| t.to_dtype(out.dtype))
            .and_then(|t| t.to_device(cx.device))
            .op("uniform")
    }

    fn batch(&self, cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        match cx.opts.randomness {
            Randomness::Error => Err(Error::unsupported(
                self.name(),
                "vmap",
                "random operations under vmap need .randomness(Randomness::Same) or (Randomness::Different)",
            )),
            Randomness::Same => Ok(Some((cx.b.emit(Prim::Random(self.clone()), &[])?, None))),
            Randomness::Different => {
                // X -> B X: one draw per example.
                let mut ty = self.ty.clone();
                ty.shape.insert(0, cx.size);
                Ok(Some((cx.b.emit(Prim::Random(Uniform { ty }), &[])?, Some(0))))
            }
        }
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(Some(vec![]))
    }

    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Ok(Some(None)) // a draw does not depend on any operand
    }
}
