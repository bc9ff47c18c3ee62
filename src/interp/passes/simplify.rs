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

use super::rewrite::{rebuild, Arg, Plan, Rewrite, Rule, View};
use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::views::{self, Step};
use crate::ir::{Graph, Prim, VarId};
use crate::rules::facts;
use std::collections::HashMap;

/// Whether `v` is the scalar `value`, possibly reshaped or broadcast.
fn is_literal(g: &View, v: VarId, value: f64) -> bool {
    views::is_literal(&g.g.nodes, v, value, |s| {
        matches!(s, Step::Reshape(_) | Step::Broadcast(_))
    })
}

/// `reshape(x)` to `x`'s own type is `x`; `reshape(reshape(x))` is
/// `reshape(x)`, or `x` itself.
fn reshape(g: &View, v: VarId) -> Option<Rewrite> {
    let Prim::Shape(ShapeOp::Reshape(_)) = g.prim(v) else {
        return None;
    };
    let a = g.args(v)[0];
    if g.ty(a) == g.ty(v) {
        return Some(Rewrite::alias(a));
    }
    let Prim::Shape(ShapeOp::Reshape(_)) = g.prim(a) else {
        return None;
    };
    let x = g.args(a)[0];
    Some(match g.ty(x) == g.ty(v) {
        true => Rewrite::alias(x),
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
        true => Rewrite::alias(x),
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
        Some(Rewrite::alias(b))
    } else if is_literal(g, b, unit) && keeps(a) {
        Some(Rewrite::alias(a))
    } else {
        None
    }
}

/// `1 * x + 0` is `x`.
fn identity_affine(g: &View, v: VarId) -> Option<Rewrite> {
    matches!(g.prim(v), Prim::Unary(Unary::Affine(m, a)) if *m == 1.0 && *a == 0.0)
        .then(|| Rewrite::alias(g.args(v)[0]))
}

/// The local simplifications, as rules.
pub(super) const RULES: &[Rule] = &[reshape, permute, unit_operand, identity_affine];

/// The nodes met so far, by primitive name and arguments: where an equal
/// node (same primitive, arguments and type) was computed before.
#[derive(Default)]
struct Seen {
    by_key: HashMap<(String, Vec<usize>), Vec<usize>>,
}

impl Seen {
    /// An earlier node equal to `v` whose operands are `args` (its own,
    /// merged), else `None` (and `v` is remembered). Inputs, random draws
    /// (each is a fresh sample) and user kernels (which may not be pure)
    /// are never merged.
    fn first_equal(&mut self, g: &Graph, v: usize, args: Vec<usize>) -> Option<usize> {
        let n = &g.nodes[v];
        if facts::unmergeable(g, v) {
            return None;
        }
        let same = self.by_key.entry((n.prim.name(), args)).or_default();
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
/// before it is looked up, and a merged node reads as the first. Dead
/// code goes after it (so the passes after see only what is read).
pub(super) fn merge_common(g: Graph) -> Graph {
    let mut same: Vec<usize> = (0..g.nodes.len()).collect();
    let mut seen = Seen::default();
    let mut plan = Plan::new(g.nodes.len());
    for v in 0..g.nodes.len() {
        let args: Vec<usize> = g.nodes[v].args.iter().map(|&a| same[a]).collect();
        if let Some(u) = seen.first_equal(&g, v, args) {
            same[v] = u;
            plan.set(v, Rewrite::alias(u));
        }
    }
    match plan.is_empty() {
        true => g.eliminate_dead_code(),
        false => rebuild(&g, plan).eliminate_dead_code(),
    }
}
