//! Control flow inside a traced function, one node of the graph each
//! and under every transform: [`scan`] (JAX's `lax.scan`), [`fori_loop`]
//! (a scan of a fixed trip count), [`while_loop`], [`cond`] and [`switch`]. These are
//! the binders: they trace the bodies and emit the node; the primitives
//! and every rule of theirs (run, batch, VJP, JVP, facts) are in
//! `rules::control`, one file each beside `map`.
//!
//! Carries, scanned operands, outputs and branch operands are trees
//! ([`SymTree`]: a tracer, tuples, vectors, maps), as in JAX. A body is
//! traced once, in a trace nested in the caller's: each leaf of its
//! carries and outputs is an input or an output of its own, of its own
//! type, and a result of the loop's node (read by a `get` node); the
//! values it reads from the enclosing trace (weights) become operands
//! every step reads whole.

mod cond;
mod scan;
mod while_loop;

pub use cond::{cond, switch, Branch};
pub use scan::{fori_loop, scan, scan_with, ScanOptions};
pub use while_loop::while_loop;

use crate::error::{Error, Result};
use crate::ir::{Graph, Node, Prim, TensorType};
use crate::trace::{innermost, innermost_active, nested_builder, trace_in, BuilderRef, Outer, Tracer};
use crate::transforms::tree::{leaves_of, SymTree, TreeDef};

/// The tree of structure `def` over `leaves`.
fn rebuild<T: SymTree>(def: &TreeDef, leaves: Vec<Tracer>) -> Result<T> {
    T::unflatten_from(def, &mut leaves.into_iter())
}

/// The leaves of the tree a body returned, an error naming `op` unless
/// it has the structure `want` (a loop's carry keeps its structure).
fn same_tree<T: SymTree>(op: &'static str, what: &str, t: &T, want: &TreeDef) -> Result<Vec<Tracer>> {
    let (got, def) = leaves_of(t);
    match &def == want {
        true => Ok(got),
        false => Err(Error::shape(
            op,
            &[],
            format!("{what} has the structure {def:?}, where {want:?} was given: a loop's carry keeps its structure"),
        )),
    }
}

/// The trace a loop over `operands` is emitted into: the innermost of
/// theirs and of the trace being traced now (the body may read a value of
/// any active trace, as a gradient's weights inside a `vmap` over data).
fn enclosing(operands: &[Tracer]) -> Option<BuilderRef> {
    let mine = innermost(&[operands.to_vec()]);
    let depth = |b: &BuilderRef| b.borrow().ancestors.len();
    match (mine, innermost_active()) {
        (Some(m), Some(a)) if depth(&a) > depth(&m) => Some(a),
        (Some(m), _) => Some(m),
        (None, a) => a,
    }
}

/// A tracer of the caller's trace, to make constants next to.
fn outer_tracer(outer: &crate::rules::BuilderRef, init: &[Tracer], xs: &[Tracer]) -> Result<Tracer> {
    let t = init
        .iter()
        .chain(xs)
        .next()
        .ok_or_else(|| Error::internal("scan", "no operand"))?;
    let id = outer.borrow_mut().lift(&t.outer())?;
    Ok(Tracer::new(outer, id))
}

/// The types of `ts`.
fn types_of(ts: &[Tracer]) -> Vec<TensorType> {
    ts.iter().map(|t| t.ty.clone()).collect()
}

/// The body's carry must be the one it was given, leaf for leaf.
fn check_carry(op: &'static str, init: &[Tracer], next: &[Tracer]) -> Result<()> {
    let shapes: Vec<&[usize]> = init.iter().chain(next).map(Tracer::dims).collect();
    if init.len() != next.len() {
        return Err(Error::shape(
            op,
            &shapes,
            format!("the body returned {} carries for {} given", next.len(), init.len()),
        ));
    }
    for (k, (a, b)) in init.iter().zip(next).enumerate() {
        if a.dims() != b.dims() || a.dtype() != b.dtype() {
            return Err(Error::shape(
                op,
                &shapes,
                format!(
                    "the body changed carry {k} from {:?} {:?} to {:?} {:?}: a loop's carry keeps its shape and dtype",
                    a.dtype(),
                    a.dims(),
                    b.dtype(),
                    b.dims()
                ),
            ));
        }
    }
    Ok(())
}

/// Traces `f` on fresh inputs of `types` in a trace nested in `outer`
/// (with its options and flags): its graph (an output per value `f`
/// gives) and the outer values it read.
fn trace_nested(
    outer: &BuilderRef,
    types: &[TensorType],
    f: impl FnOnce(&[Tracer]) -> Result<Vec<Tracer>>,
) -> Result<(Graph, Vec<Outer>)> {
    let given = outer.borrow().given;
    let inner = nested_builder(outer, given, (false, false));
    let (g, caps, ()) = trace_in(&inner, types, |ins| Ok((f(&ins)?, ())))?;
    Ok((g, caps))
}

/// A graph traced with its own captures after its first `lead` inputs,
/// taking the captures of the graphs traced `before` it and `after` it
/// too (unused inputs), so that all take one operand list: `lead`,
/// `before`'s, its own, `after`'s.
fn align(g: Graph, lead: usize, before: &[Outer], after: &[Outer]) -> Graph {
    let types = |c: &[Outer]| c.iter().map(|o| o.ty.clone()).collect::<Vec<_>>();
    let g = insert_inputs(g, lead, &types(before));
    let at = g.inputs.len();
    insert_inputs(g, at, &types(after))
}

/// `g` with unused inputs of `types` inserted at input position `at`.
fn insert_inputs(mut g: Graph, at: usize, types: &[TensorType]) -> Graph {
    let shift = types.len();
    for node in g.nodes.iter_mut() {
        if let Prim::Input(k) = &mut node.prim {
            if *k >= at {
                *k += shift;
            }
        }
    }
    let mut ids = Vec::with_capacity(shift);
    for (j, ty) in types.iter().enumerate() {
        g.nodes.push(Node {
            prim: Prim::Input(at + j),
            args: Vec::new(),
            ty: ty.clone(),
        });
        ids.push(g.nodes.len() - 1);
    }
    g.inputs.splice(at..at, ids);
    g
}

/// Emits `prim` (a primitive with several results) in `outer` on
/// `operands` and then every capture list: its results.
fn emit(outer: &BuilderRef, prim: Prim, operands: &[Tracer], caps: &[Vec<Outer>]) -> Result<Vec<Tracer>> {
    let mut ob = outer.borrow_mut();
    let mut ids = Vec::new();
    for t in operands {
        ids.push(ob.lift(&t.outer())?);
    }
    for c in caps.iter().flatten() {
        ids.push(ob.lift(c)?);
    }
    let outs = ob.emit_many(prim, &ids)?;
    drop(ob);
    Ok(outs.into_iter().map(|o| Tracer::new(outer, o)).collect())
}
