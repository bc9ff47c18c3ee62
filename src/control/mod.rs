//! Control flow inside a traced function, one node of the graph each
//! and under every transform: [`scan`] (JAX's `lax.scan`), [`fori_loop`]
//! (a scan of a fixed trip count), [`while_loop`], [`cond`] and [`switch`]. These are
//! the binders: they trace the bodies and emit the node; the primitives
//! and every rule of theirs (run, batch, VJP, JVP, facts) are in
//! `rules::control`, one file each beside `map`.
//!
//! Carries, scanned operands, outputs and branch operands are trees
//! ([`SymTree`]: a tracer, tuples, vectors, maps), as in JAX. A body is
//! traced once, in a trace nested in the caller's: its carry's and
//! outputs' leaves are packed into one vector per step (of one dtype that
//! holds each leaf exactly, `carrier`), and the values it reads from the
//! enclosing trace (weights) become operands every step reads whole.

mod cond;
mod scan;
mod while_loop;

pub use cond::{cond, switch, Branch};
pub use scan::{fori_loop, scan, scan_with, ScanOptions};
pub use while_loop::while_loop;

use crate::error::{Error, Result};
use crate::ir::{Graph, Node, Prim, TensorType};
use crate::rules::{Builder, BuilderRef, Outer};
use crate::trace::{Operand, Tracer};
use crate::transforms::tree::{leaves_of, SymTree, TreeDef};
use crate::transforms::{innermost, innermost_active, next_builder_id, tracing};
use candle_core::DType;

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

/// The vector `packed` cut into pieces of the given types (each converted
/// back from the carrier's dtype to its own).
fn unpack(packed: &Tracer, types: impl Iterator<Item = TensorType>) -> Result<Vec<Tracer>> {
    let mut at = 0;
    types
        .map(|ty| {
            let n = ty.elem_count();
            let t = packed.narrow(0, at, n)?.reshape(ty.shape)?.to_dtype(ty.dtype)?;
            at += n;
            Ok(t)
        })
        .collect()
}

/// The types of `ts`.
fn types_of(ts: &[Tracer]) -> Vec<TensorType> {
    ts.iter().map(|t| t.ty.clone()).collect()
}

/// Whether every value of `leaf` is a value of `carrier`, exactly.
fn holds(carrier: DType, leaf: DType) -> bool {
    use DType::*;
    carrier == leaf
        || matches!(
            (carrier, leaf),
            (F64, F32 | F16 | BF16 | U8 | U32)
                | (F32, F16 | BF16 | U8)
                | (F16 | BF16, U8)
                | (U32, U8)
                | (I64, U8 | U32)
        )
}

/// The dtype a loop packs leaves of `dtypes` in (`None` where there are
/// none), for `op`: their own where they share one, else the narrowest
/// that holds each of them exactly (JAX carries any mix). Floats widen to
/// the widest among them (f16 beside bf16 to f32) and take u8 as they
/// are and u32 in f64; integers alone widen to u32 or i64. No float
/// holds every i64, so i64 beside a float is an error.
fn carrier(op: &'static str, what: &str, dtypes: &[DType]) -> Result<Option<DType>> {
    let Some(&first) = dtypes.first() else { return Ok(None) };
    if dtypes.iter().all(|&d| d == first) {
        return Ok(Some(first));
    }
    let floats = dtypes.iter().any(|d| d.is_float());
    let candidates: &[DType] = match floats {
        true => &[DType::F16, DType::BF16, DType::F32, DType::F64],
        false => &[DType::U8, DType::U32, DType::I64],
    };
    match candidates.iter().find(|&&c| dtypes.iter().all(|&d| holds(c, d))) {
        Some(&c) => Ok(Some(c)),
        None => Err(Error::shape(
            op,
            &[],
            format!("{what} mix {dtypes:?}, which no one dtype holds exactly (i64 beside a float): convert them first"),
        )),
    }
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

/// Traces `f` on fresh inputs of `types` in a trace nested in `outer`:
/// its graph (one output) and the outer values it read.
fn trace_nested(
    outer: &BuilderRef,
    types: &[TensorType],
    f: impl FnOnce(&[Tracer]) -> Result<Tracer>,
) -> Result<(Graph, Vec<Outer>)> {
    let given = outer.borrow().given;
    let inner = Builder::child(outer, next_builder_id(), given);
    let ins: Vec<Tracer> = types
        .iter()
        .map(|t| {
            let id = inner.borrow_mut().input(t.clone());
            Tracer::new(&inner, id)
        })
        .collect();
    let out = tracing(&inner, || f(&ins))?;
    let mut bb = inner.borrow_mut();
    let id = bb.lift(&out.outer())?;
    Ok(bb.finish(vec![id]))
}

/// `ts` flattened into one vector of `dtype` (each converted to it; an
/// empty one beside `like`).
fn pack(ts: &[Tracer], dtype: DType, like: &Tracer) -> Result<Tracer> {
    if ts.is_empty() {
        return candle_core::Tensor::zeros(0, dtype, &like.device())?.to_tracer(like);
    }
    let flat: Vec<Tracer> = ts
        .iter()
        .map(|t| t.flatten_all()?.to_dtype(dtype))
        .collect::<Result<_>>()?;
    Tracer::cat(&flat.iter().collect::<Vec<_>>(), 0)
}

/// `g` with its first input (a packed carry) of `dtype`, converted on
/// entry to the dtype it was traced with: a scan's outputs can widen the
/// carrier its carry was traced in, and the carry goes round in the wider.
fn widen_first_input(g: Graph, dtype: DType) -> Graph {
    let first = g.inputs[0];
    let traced = g.nodes[first].ty.clone();
    if traced.dtype == dtype {
        return g;
    }
    let mut out = Graph {
        consts: g.consts.clone(),
        ..Graph::default()
    };
    let mut remap = Vec::with_capacity(g.nodes.len());
    for (v, n) in g.nodes.iter().enumerate() {
        let args = n.args.iter().map(|&a| remap[a]).collect();
        out.nodes.push(Node { args, ..n.clone() });
        if v == first {
            // `first` keeps its place as the input; its readers read the cast
            out.nodes[v].ty.dtype = dtype;
            out.add_node(
                Prim::Unary(crate::ir::ops::Unary::Cast(traced.dtype)),
                vec![v],
                traced.clone(),
            );
        }
        remap.push(out.nodes.len() - 1);
    }
    out.inputs = g
        .inputs
        .iter()
        .map(|&i| if i == first { i } else { remap[i] })
        .collect();
    out.outputs = g.outputs.iter().map(|&o| remap[o]).collect();
    out
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

/// Emits `prim` in `outer` on `operands` and then every capture list.
fn emit(outer: &BuilderRef, prim: Prim, operands: &[Tracer], caps: &[Vec<Outer>]) -> Result<Tracer> {
    let mut ob = outer.borrow_mut();
    let mut ids = Vec::new();
    for t in operands {
        ids.push(ob.lift(&t.outer())?);
    }
    for c in caps.iter().flatten() {
        ids.push(ob.lift(c)?);
    }
    let out = ob.emit(prim, &ids)?;
    drop(ob);
    Ok(Tracer::new(outer, out))
}

#[cfg(test)]
mod tests {
    use super::carrier;
    use candle_core::DType::{self, *};

    fn of(dtypes: &[DType]) -> Option<DType> {
        carrier("scan", "the leaves", dtypes).ok().flatten()
    }

    /// The narrowest dtype holding each leaf exactly, or none.
    #[test]
    fn a_carrier_holds_every_leaf_exactly() {
        assert_eq!(carrier("scan", "the leaves", &[]).unwrap(), None);
        assert_eq!(of(&[F32, F32]), Some(F32));
        assert_eq!(of(&[F32, F64]), Some(F64));
        assert_eq!(of(&[F16, BF16]), Some(F32), "neither half holds the other");
        assert_eq!(of(&[BF16, U8]), Some(BF16), "a byte fits bf16's 8-bit significand");
        assert_eq!(of(&[F32, U32]), Some(F64), "f32 holds integers to 2^24 only");
        assert_eq!(of(&[U8, U32]), Some(U32));
        assert_eq!(of(&[U32, I64, U8]), Some(I64));
        let e = carrier("scan", "the leaves", &[F64, I64]).unwrap_err().to_string();
        assert!(e.contains("scan") && e.contains("I64"), "{e}");
    }
}
