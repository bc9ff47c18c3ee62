//! `cond`: one `cond` node, its branches traced apart on the operands.

use super::{align, emit, enclosing, one_dtype, pack, trace_nested, unpack};
use crate::error::{Error, Result};
use crate::ir::{Cond, Prim, TensorType};
use crate::trace::Tracer;
use std::sync::Arc;

/// `cond`: `on_true(operands)` where `pred` (a scalar; nonzero: true)
/// holds, else `on_false(operands)`, as JAX's `lax.cond`. The branch not
/// taken does not run. Both branches give values of the same shapes and
/// dtypes (one dtype among them). Under `vmap` with a predicate per
/// example, each example's result and gradient are those of its own
/// branch under every schedule: batched, each branch some example takes
/// runs once on all rows, those of the examples not taking it replaced by
/// a taking example's (so a guard such as `i < 5` before `table[i]` holds
/// on every row it sees, and the branch not taken never puts a NaN in a
/// gradient, unlike JAX's `select`), a branch no example takes does not
/// run, and each example keeps its own result; under
/// `Schedule::PerExample` each example runs only its own branch. Pass
/// what the branches compute on as `operands`: an operation a branch
/// applies to a tracer it reads from outside is traced before the `cond`
/// and runs whatever the predicate.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::cond;
/// use candle_func::{vmap, Tracer};
/// let f = |x: Tracer| {
///     let neg = x.lt(0.0)?;
///     let out = cond(&neg, |o: &[Tracer]| Ok(vec![o[0].neg()?]), |o: &[Tracer]| Ok(vec![o[0].sqr()?]), &[x])?;
///     Ok(out[0].clone())
/// };
/// let y = vmap(f).call(&Tensor::new(&[-2f32, 3.0], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [2.0, 9.0]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn cond(
    pred: &Tracer,
    on_true: impl FnOnce(&[Tracer]) -> Result<Vec<Tracer>>,
    on_false: impl FnOnce(&[Tracer]) -> Result<Vec<Tracer>>,
    operands: &[Tracer],
) -> Result<Vec<Tracer>> {
    if pred.rank() != 0 {
        return Err(Error::shape("cond", &[pred.dims()], "the predicate must be a scalar"));
    }
    let all: Vec<Tracer> = std::iter::once(pred.clone()).chain(operands.iter().cloned()).collect();
    let outer = enclosing(&all).ok_or_else(|| Error::internal("cond", "no trace"))?;
    let types: Vec<TensorType> = operands.iter().map(|t| t.ty.clone()).collect();
    let branch = |f: Box<Branch<'_>>| {
        let mut outs = Vec::new();
        let (g, caps) = trace_nested(&outer, &types, |ins| {
            let got = f(ins)?;
            let dtype = one_dtype("cond", &got, "a branch's values")?
                .ok_or_else(|| Error::shape("cond", &[], "a branch gives no value"))?;
            outs = got.iter().map(|t| t.ty.clone()).collect();
            pack(&got, dtype, &got[0])
        })?;
        Ok::<_, Error>((g, caps, outs))
    };
    let (gt, ct, tt) = branch(Box::new(on_true))?;
    let (gf, cf, tf) = branch(Box::new(on_false))?;
    if tt != tf {
        let shapes: Vec<&[usize]> = tt.iter().chain(&tf).map(|t| t.shape.as_slice()).collect();
        return Err(Error::shape(
            "cond",
            &shapes,
            format!("the branches give {tt:?} and {tf:?}: both must give the same shapes and dtypes"),
        ));
    }
    let n = operands.len();
    let c = Cond {
        on_true: Arc::new(align(gt, n, &[], &cf)),
        on_false: Arc::new(align(gf, n, &ct, &[])),
    };
    let mut ops = vec![pred.clone()];
    ops.extend_from_slice(operands);
    let out = emit(&outer, Prim::Cond(Box::new(c)), &ops, &[ct, cf])?;
    unpack(&out, tt.iter().map(|t| t.shape.clone()))
}

/// A branch of a `cond`: its operands to its values.
type Branch<'a> = dyn FnOnce(&[Tracer]) -> Result<Vec<Tracer>> + 'a;
