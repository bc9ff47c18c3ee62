//! Local simplifications the transforms leave room for: slices of one
//! cotangent placed side by side (`slices`), products computed in the
//! layouts their operands and readers have (`layout`), reshapes of
//! reshapes, permutes of permutes, multiplications by broadcast ones or
//! additions of broadcast zeros (the seed of a gradient, an unused bias), and a
//! node computed twice (common subexpressions: a transform re-emits the
//! forward pass, JVP and VJP rules each take an `exp` of one value). The
//! first of the passes that prepare a graph to run; dead code goes last.
//! Which nodes may never be merged (inputs, random draws, user code) is
//! each primitive's fact (`rules::facts`).

use super::layout;
use super::rewrite::{rewrite, Arg, Rewrite, Rule, View};
use super::slices::place_slices;
use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::{Graph, Prim, VarId};
use crate::rules::facts;
use std::collections::HashMap;

/// Whether `v` is the scalar `value`, possibly reshaped or broadcast.
fn is_literal(g: &View, v: VarId, value: f64) -> bool {
    match g.prim(v) {
        Prim::Scalar(x) => *x == value,
        Prim::Shape(ShapeOp::Reshape(_) | ShapeOp::Broadcast(_)) => is_literal(g, g.args(v)[0], value),
        _ => false,
    }
}

/// `reshape(x)` to `x`'s own type is `x`; `reshape(reshape(x))` is
/// `reshape(x)`, or `x` itself.
fn reshape(g: &View, v: VarId) -> Option<Rewrite> {
    let Prim::Shape(ShapeOp::Reshape(_)) = g.prim(v) else {
        return None;
    };
    let a = g.args(v)[0];
    if g.ty(a) == g.ty(v) {
        return Some(Rewrite::Alias(a));
    }
    let Prim::Shape(ShapeOp::Reshape(_)) = g.prim(a) else {
        return None;
    };
    let x = g.args(a)[0];
    Some(match g.ty(x) == g.ty(v) {
        true => Rewrite::Alias(x),
        false => Rewrite::node(g.prim(v).clone(), vec![Arg::Old(x)], g.ty(v).clone()),
    })
}

/// `permute(permute(x, q), p)` is `permute(x, q[p[i]])`, or `x` itself.
fn permute(g: &View, v: VarId) -> Option<Rewrite> {
    let Prim::Shape(ShapeOp::Permute(p)) = g.prim(v) else {
        return None;
    };
    let a = g.args(v)[0];
    let Prim::Shape(ShapeOp::Permute(q)) = g.prim(a) else {
        return None;
    };
    let r: Vec<usize> = p.iter().map(|&i| q[i]).collect();
    let x = g.args(a)[0];
    Some(match r.iter().enumerate().all(|(i, &j)| i == j) {
        true => Rewrite::Alias(x),
        false => Rewrite::node(Prim::Shape(ShapeOp::Permute(r)), vec![Arg::Old(x)], g.ty(v).clone()),
    })
}

/// `x * 1` and `x + 0` (either side, the literal possibly broadcast) are
/// `x`, where `x` has the result's type.
fn unit_operand(g: &View, v: VarId) -> Option<Rewrite> {
    let unit = match g.prim(v) {
        Prim::Binary(Binary::Mul) => 1.0,
        Prim::Binary(Binary::Add) => 0.0,
        _ => return None,
    };
    let &[a, b] = g.args(v) else { return None };
    let keeps = |o: VarId| g.ty(o) == g.ty(v);
    if is_literal(g, a, unit) && keeps(b) {
        Some(Rewrite::Alias(b))
    } else if is_literal(g, b, unit) && keeps(a) {
        Some(Rewrite::Alias(a))
    } else {
        None
    }
}

/// `1 * x + 0` is `x`.
fn identity_affine(g: &View, v: VarId) -> Option<Rewrite> {
    matches!(g.prim(v), Prim::Unary(Unary::Affine(m, a)) if *m == 1.0 && *a == 0.0)
        .then(|| Rewrite::Alias(g.args(v)[0]))
}

/// The local simplifications, as rules.
const RULES: &[Rule] = &[reshape, permute, unit_operand, identity_affine];

/// The nodes met so far, by primitive name and arguments: where an equal
/// node (same primitive, arguments and type) was computed before.
#[derive(Default)]
struct Seen {
    by_key: HashMap<(String, Vec<usize>), Vec<usize>>,
}

impl Seen {
    /// An earlier node equal to `v`, else `None` (and `v` is remembered).
    /// Inputs, random draws (each is a fresh sample) and user kernels
    /// (which may not be pure) are never merged.
    fn first_equal(&mut self, g: &Graph, v: usize) -> Option<usize> {
        let n = &g.nodes[v];
        if facts::unmergeable(g, v) {
            return None;
        }
        let same = self.by_key.entry((n.prim.name(), n.args.clone())).or_default();
        let found = same
            .iter()
            .copied()
            .find(|&u| g.nodes[u].prim == n.prim && g.nodes[u].ty == n.ty);
        if found.is_none() {
            same.push(v);
        }
        found
    }
}

/// `g` with every node computed twice computed once (common
/// subexpressions), in one forward sweep: a node's operands are merged
/// before it is looked up.
fn merge_common(mut g: Graph) -> Graph {
    let mut same: Vec<usize> = (0..g.nodes.len()).collect();
    let mut seen = Seen::default();
    for v in 0..g.nodes.len() {
        let args: Vec<usize> = g.nodes[v].args.iter().map(|&a| same[a]).collect();
        g.nodes[v].args = args;
        if let Some(u) = seen.first_equal(&g, v) {
            same[v] = u;
        }
    }
    g.outputs = g.outputs.iter().map(|&o| same[o]).collect();
    g.eliminate_dead_code()
}

/// The same computation with local redundancies removed (then dead code).
pub(crate) fn simplify(old: &Graph) -> Graph {
    merge_common(rewrite(&layout::products_in_place(&place_slices(old)), RULES))
}
