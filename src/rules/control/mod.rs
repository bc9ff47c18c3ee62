//! Control flow: primitives with sub-graph bodies that the interpreter
//! runs, one node of the graph each (`scan`, `cond`, `while_loop`), and
//! their rules, which rewrite the bodies (batched, differentiated) into
//! new nodes of the same kinds.

mod cond;
mod scan;
mod scan_vjp;
mod while_loop;

use crate::error::{Error, Result};
use crate::ir::{Graph, TensorType, VarId};
use crate::rules::facts::{self, Effect};
use crate::rules::Builder;

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
