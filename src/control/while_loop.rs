//! `while_loop`: one `while` node, its condition and body traced apart.

use super::{align, check_carry, emit, enclosing, leaves_of, rebuild, same_tree, trace_nested, types_of};
use crate::error::{Error, Result};
use crate::ir::{Prim, While};
use crate::trace::Tracer;
use crate::transforms::tree::SymTree;
use std::sync::Arc;

/// `while_loop`: `carry = body_fun(carry)` while `cond_fun(&carry)` (a
/// scalar, nonzero: true) holds, as JAX's `lax.while_loop`, the carry a
/// tree (its leaves of any dtypes, each a value of its own);
/// one node of the graph. Under `vmap` with a condition per example each example runs
/// its own steps under every schedule: batched, the loop runs until every
/// example's condition fails, a finished example keeping its carry and no
/// longer feeding the body its own values (its rows are a running
/// example's, discarded), so the body never sees a finished carry. Forward-differentiable (`jvp`); its gradient is an error, as
/// in JAX, since the trip count is data: use [`fori_loop`](super::fori_loop).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::while_loop;
/// use candle_func::{vmap, Tracer};
/// // halve until below 1, each example its own number of times
/// let f = |x: Tracer| {
///     while_loop(|c: &Tracer| c.ge(1.0), |c: Tracer| c.affine(0.5, 0.0), x)
/// };
/// let y = vmap(f).call(&Tensor::new(&[5f32, 0.5, 12.0], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0.625, 0.5, 0.75]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn while_loop<C: SymTree>(
    cond_fun: impl FnOnce(&C) -> Result<Tracer>,
    body_fun: impl FnOnce(C) -> Result<C>,
    init: C,
) -> Result<C> {
    let (init, def) = leaves_of(&init);
    let init = &init[..];
    if init.is_empty() {
        return Err(Error::shape("while_loop", &[], "needs a carry"));
    }
    let outer = enclosing(init).ok_or_else(|| Error::shape("while_loop", &[], "needs a carry"))?;
    let types = types_of(init);
    let (gc, cc) = trace_nested(&outer, &types, |ins| {
        let p = cond_fun(&rebuild(&def, ins.to_vec())?)?;
        match p.rank() {
            0 => Ok(vec![p]),
            _ => Err(Error::shape("while_loop", &[p.dims()], "cond_fun must give a scalar")),
        }
    })?;
    let (gb, cb) = trace_nested(&outer, &types, |ins| {
        let next = body_fun(rebuild(&def, ins.to_vec())?)?;
        let next = same_tree("while_loop", "the body's carry", &next, &def)?;
        check_carry("while_loop", init, &next)?;
        Ok(next)
    })?;
    let n = init.len();
    let (gc, gb) = (align(gc, n, &[], &cb), align(gb, n, &cc, &[]));
    let w = While {
        cond: Arc::new(gc),
        body: Arc::new(gb),
    };
    let out = emit(&outer, Prim::While(Box::new(w)), init, &[cc, cb])?;
    rebuild(&def, out)
}
