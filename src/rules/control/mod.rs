//! Control flow: primitives with sub-graph bodies that the interpreter
//! runs, one node of the graph each (`scan`, `cond`, `while_loop`), and
//! their rules, which rewrite the bodies (batched, differentiated) into
//! new nodes of the same kinds.

mod cond;
mod scan;
mod scan_vjp;
mod while_loop;

use crate::error::{Error, Result};
use crate::ir::ops::Compare;
use crate::ir::{Graph, TensorType, VarId};
use crate::rules::facts::{self, Effect};
use crate::rules::{BVal, BatchCx, Builder};

/// An error where a body of `op` draws random numbers: its derivative
/// runs the body again, which would draw anew, so the derivative would be
/// another function's (a dropout mask the forward pass did not use).
fn deterministic(op: &'static str, transform: &'static str, bodies: &[&Graph]) -> Result<()> {
    match bodies.iter().any(|g| facts::effect_of(g) == Effect::Random) {
        true => Err(Error::unsupported(
            op,
            transform,
            "its body draws random numbers, and its derivative would run the body again with other draws; \
             draw them outside the loop and pass them in",
        )),
        false => Ok(()),
    }
}

/// A shape error of `op` naming its operands' shapes.
fn shape_error(op: &'static str, args: &[&TensorType], msg: String) -> Error {
    let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
    Error::shape(op, &shapes, msg)
}

/// `g` batched into a graph of its own, as a control-flow node's new body:
/// input `k` batched at axis 0 where `batched[k]` (`X -> B X`), and the
/// output `out` makes from the batching context and those inputs (say,
/// `g` batched and materialised, batch first).
fn batched_graph(
    cx: &BatchCx,
    g: &Graph,
    batched: &[bool],
    out: impl FnOnce(&mut BatchCx, &[BVal]) -> Result<VarId>,
) -> Result<Graph> {
    let scratch = Builder::scratch(cx.b.given, cx.b.ctx.clone());
    let mut sb = scratch.borrow_mut();
    let ins: Vec<BVal> = g
        .inputs
        .iter()
        .zip(batched)
        .map(|(&i, &on)| {
            let mut ty = g.ty(i).clone();
            if on {
                ty.shape.insert(0, cx.size);
            }
            (sb.input(ty), on.then_some(0))
        })
        .collect();
    let mut icx = BatchCx {
        b: &mut sb,
        size: cx.size,
        opts: cx.opts,
        plan: cx.plan,
    };
    let o = out(&mut icx, &ins)?;
    Ok(sb.finish(vec![o]).0.eliminate_dead_code())
}

/// Where each example's predicate `p` `[B]` holds (nonzero), shaped
/// `B 1..` to select between values of rank `rank` (batch first).
fn example_mask(b: &mut Builder, p: VarId, size: usize, rank: usize) -> Result<VarId> {
    let zero = b.scalar_as(0.0, p);
    let mask = b.cmp(Compare::Ne, p, zero)?;
    let mut shape = vec![size];
    shape.resize(rank, 1);
    b.reshape(mask, shape)
}

/// `v` as one vector (`.. -> (..)`).
fn flat(b: &mut Builder, v: VarId) -> Result<VarId> {
    let n = b.ty(v).elem_count();
    b.reshape(v, vec![n])
}

/// Entries `[start, start + len)` of `v` along `axis`, shaped `shape` after
/// the axes before it.
fn piece(b: &mut Builder, v: VarId, axis: usize, start: usize, shape: &[usize]) -> Result<VarId> {
    let len = shape.iter().product();
    let mut want = b.dims(v)[..axis].to_vec();
    want.extend_from_slice(shape);
    let p = b.narrow(v, axis, start, len)?;
    b.reshape(p, want)
}
