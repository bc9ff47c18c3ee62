//! Cotangent slices placed side by side. A value read by several `narrow`s
//! (a flat parameter vector cut into a model's parameters, an LSTM's four
//! gates cut from one product) gets from each narrow's VJP its cotangent
//! padded with zeros to the whole value, and the reverse pass adds them:
//! six full-size pads and adds for six parameters. Where the pieces of a
//! sum of such padded slices do not overlap, the sum is one concatenation
//! of the pieces with zeros in the gaps.
//!
//! A sum is the tree of `add`s of one type whose inner nodes have no other
//! reader; its terms that are concatenations of pieces and zero blocks
//! along one axis, disjoint, are merged into one concatenation, and the
//! other terms are added to it.

use super::rewrite::{rebuild, Arg, Emitted, Plan, Rewrite};
use crate::ir::ops::{Binary, ShapeOp};
use crate::ir::views::{self, Step};
use crate::ir::{Graph, Prim, TensorType, VarId};

/// A padded slice: `(start, len, piece)` for each non-zero operand of a
/// concatenation along `axis`.
struct Padded {
    axis: usize,
    pieces: Vec<(usize, usize, VarId)>,
}

/// Whether `v` is the scalar 0, possibly reshaped or broadcast.
fn is_zero(g: &Graph, v: VarId) -> bool {
    views::is_literal(&g.nodes, v, 0.0, |s| matches!(s, Step::Reshape(_) | Step::Broadcast(_)))
}

/// `v` as a padded slice, where it is a concatenation with a zero block.
fn padded(g: &Graph, v: VarId) -> Option<Padded> {
    let Prim::Shape(ShapeOp::Concat(axis)) = g.nodes[v].prim else {
        return None;
    };
    let (mut at, mut pieces, mut zeros) = (0, Vec::new(), false);
    for &a in &g.nodes[v].args {
        let len = g.ty(a).shape[axis];
        if is_zero(g, a) {
            zeros = true;
        } else {
            pieces.push((at, len, a));
        }
        at += len;
    }
    zeros.then_some(Padded { axis, pieces })
}

/// The terms of the sum rooted at `v`: through the `add`s of `v`'s type
/// whose only reader is the add above them.
fn terms(g: &Graph, v: VarId, readers: &[usize], out: &mut Vec<VarId>) {
    let n = &g.nodes[v];
    let inner = |a: VarId| readers[a] == 1 && g.nodes[a].prim == Prim::Binary(Binary::Add) && g.nodes[a].ty == n.ty;
    for &a in &n.args {
        if inner(a) {
            terms(g, a, readers, out);
        } else {
            out.push(a);
        }
    }
}

/// The rewrite of the sum at `v`, where at least two of its terms are
/// disjoint padded slices of one axis that nothing else reads: the merged
/// slices' pieces (sorted) and axis, and the other terms.
fn mergeable(g: &Graph, v: VarId, readers: &[usize]) -> Option<(Padded, Vec<VarId>)> {
    let mut all = Vec::new();
    terms(g, v, readers, &mut all);
    let mut merged: Option<Padded> = None;
    let mut count = 0;
    let mut rest = Vec::new();
    for t in all {
        let p = padded(g, t).filter(|_| readers[t] == 1 && g.ty(t) == g.ty(v));
        match (p, &mut merged) {
            (Some(p), None) => {
                merged = Some(p);
                count = 1;
            }
            (Some(p), Some(m)) if p.axis == m.axis && disjoint(&m.pieces, &p.pieces) => {
                m.pieces.extend(p.pieces);
                count += 1;
            }
            _ => rest.push(t),
        }
    }
    let mut m = merged.filter(|_| count >= 2)?;
    m.pieces.sort_by_key(|p| p.0);
    Some((m, rest))
}

/// Whether no piece of `a` overlaps one of `b`.
fn disjoint(a: &[(usize, usize, VarId)], b: &[(usize, usize, VarId)]) -> bool {
    a.iter()
        .all(|&(s, l, _)| b.iter().all(|&(t, m, _)| s + l <= t || t + m <= s))
}

/// `g` with every sum of disjoint padded slices as one concatenation.
pub(super) fn place_slices(g: Graph) -> Graph {
    let old = &g;
    let (mut readers, mut reader) = (vec![0usize; old.nodes.len()], vec![usize::MAX; old.nodes.len()]);
    for (v, n) in old.nodes.iter().enumerate() {
        for &a in &n.args {
            readers[a] += 1;
            reader[a] = v;
        }
    }
    for &o in &old.outputs {
        readers[o] += 1;
        reader[o] = usize::MAX; // read by the caller
    }
    let add = |v: VarId| old.nodes[v].prim == Prim::Binary(Binary::Add);
    // a sum's root: an add that is not a term of an add above it
    let root = |v: VarId| {
        let r = reader[v];
        add(v) && !(readers[v] == 1 && r != usize::MAX && add(r) && old.ty(r) == old.ty(v))
    };
    let rewrites: Vec<(VarId, Padded, Vec<VarId>)> = (0..old.nodes.len())
        .filter(|&v| root(v))
        .filter_map(|v| mergeable(old, v, &readers).map(|(p, rest)| (v, p, rest)))
        .collect();
    if rewrites.is_empty() {
        return g;
    }
    let mut plan = Plan::new(old.nodes.len());
    for (v, p, rest) in rewrites {
        let ty = &old.nodes[v].ty;
        let mut nodes = concat(ty, &p);
        for t in rest {
            let acc = Arg::New(nodes.len() - 1);
            nodes.push((Prim::Binary(Binary::Add), vec![acc, Arg::Old(t)], ty.clone()));
        }
        plan.set(v, Rewrite::emit(nodes));
    }
    rebuild(old, plan).eliminate_dead_code()
}

/// One concatenation of `p`'s pieces along its axis, zeros in the gaps.
fn concat(ty: &TensorType, p: &Padded) -> Vec<Emitted> {
    // the zero, then a broadcast of it per gap, then the concatenation
    let mut nodes: Vec<Emitted> = vec![(Prim::Scalar(0.0), vec![], ty.with_shape(vec![]))];
    let gap = |nodes: &mut Vec<Emitted>, len: usize| {
        let mut shape = ty.shape.clone();
        shape[p.axis] = len;
        nodes.push((
            Prim::Shape(ShapeOp::Broadcast(shape.clone())),
            vec![Arg::New(0)],
            ty.with_shape(shape),
        ));
        Arg::New(nodes.len() - 1)
    };
    let (mut parts, mut at) = (Vec::new(), 0);
    for &(start, len, piece) in &p.pieces {
        if start > at {
            parts.push(gap(&mut nodes, start - at));
        }
        parts.push(Arg::Old(piece));
        at = start + len;
    }
    if ty.shape[p.axis] > at {
        parts.push(gap(&mut nodes, ty.shape[p.axis] - at));
    }
    nodes.push((Prim::Shape(ShapeOp::Concat(p.axis)), parts, ty.clone()));
    nodes
}
