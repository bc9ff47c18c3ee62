//! User-supplied candle functions as primitives (JAX's `pure_callback`): an
//! escape hatch for operations the crate lacks. Without rules of the
//! user's, `vmap` maps them over the examples and `grad` / `jvp` report
//! them by name; with them (`custom_op_with_rules`, like JAX's
//! `custom_vjp` / `custom_jvp` / `custom_vmap`), the rules' traced graphs
//! are inlined where the transforms need them.

use super::facts::{Arg, Effect, Facts, Workspace};
use super::{walk, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{CustomOp, Graph, TensorType, VarId};
use candle_core::Tensor;

/// `g` inlined into `b` on `inputs`; its outputs.
fn inline(g: &Graph, b: &mut Builder, inputs: &[VarId]) -> Result<Vec<VarId>> {
    let env = walk::forward(g, b, inputs)?;
    Ok(g.outputs.iter().map(|&o| env[o]).collect())
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

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            effect: Effect::Opaque,
            cheap: false,
            measurable: false,
            ..Facts::costly()
        }
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        // what a user's kernel allocates is its own; the plan counts its
        // result only
        Workspace::NONE
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

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let Some(make) = &self.rules.batch else { return Ok(None) };
        // every operand batched, batch axis first, as the rule was promised
        let mut ins = Vec::with_capacity(args.len());
        for &a in args {
            ins.push(cx.materialize(a)?);
        }
        let types: Vec<TensorType> = ins.iter().map(|&v| cx.b.ty(v).clone()).collect();
        let g = make(&types)?;
        let mut want = self.out.shape.clone();
        want.insert(0, cx.size);
        let out = inline(&g, cx.b, &ins)?;
        match out.as_slice() {
            [y] if cx.b.dims(*y) == want && cx.b.ty(*y).dtype == self.out.dtype => Ok(Some((*y, Some(0)))),
            _ => Err(Error::shape(
                "custom",
                &[&want],
                format!(
                    "{}: the batching rule must return one tensor of this shape and {:?}",
                    self.name, self.out.dtype
                ),
            )),
        }
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let Some(g) = &self.rules.vjp else { return Ok(None) };
        let mut ins = args.to_vec();
        ins.extend([out, ct]);
        Ok(Some(inline(g, b, &ins)?.into_iter().map(Some).collect()))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        let Some(g) = &self.rules.jvp else { return Ok(None) };
        let mut ins = args.to_vec();
        for (&a, &t) in args.iter().zip(tans) {
            ins.push(b.or_zeros(t, a)?);
        }
        Ok(Some(inline(g, b, &ins)?.first().copied()))
    }
}
