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
use super::slices::place_slices;
use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::{Graph, Prim};
use crate::rules::facts;
use std::collections::HashMap;

/// Whether `v` is the scalar `value`, possibly reshaped or broadcast.
fn is_literal(g: &Graph, v: usize, value: f64) -> bool {
    match &g.nodes[v].prim {
        Prim::Scalar(x) => *x == value,
        Prim::Shape(ShapeOp::Reshape(_) | ShapeOp::Broadcast(_)) => is_literal(g, g.nodes[v].args[0], value),
        _ => false,
    }
}

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

/// The same computation with local redundancies removed (then dead code).
pub(crate) fn simplify(old: &Graph) -> Graph {
    let mut g = layout::products_in_place(&place_slices(old));
    let mut same: Vec<usize> = (0..g.nodes.len()).collect();
    let mut seen = Seen::default();
    for v in 0..g.nodes.len() {
        let args: Vec<usize> = g.nodes[v].args.iter().map(|&a| same[a]).collect();
        g.nodes[v].args = args.clone();
        let ty = g.nodes[v].ty.clone();
        let replacement = match g.nodes[v].prim.clone() {
            Prim::Shape(ShapeOp::Reshape(_)) => {
                let a = args[0];
                if g.nodes[a].ty == ty {
                    Some(a)
                } else {
                    // reshape(reshape(x)) = reshape(x), or x itself
                    match g.nodes[a].prim {
                        Prim::Shape(ShapeOp::Reshape(_)) => {
                            let x = g.nodes[a].args[0];
                            g.nodes[v].args = vec![x];
                            (g.nodes[x].ty == ty).then_some(x)
                        }
                        _ => None,
                    }
                }
            }
            Prim::Shape(ShapeOp::Permute(p)) => {
                let a = args[0];
                if let Prim::Shape(ShapeOp::Permute(q)) = g.nodes[a].prim.clone() {
                    // permute(permute(x, q), p) = permute(x, q[p[i]])
                    let r: Vec<usize> = p.iter().map(|&i| q[i]).collect();
                    let x = g.nodes[a].args[0];
                    if r.iter().enumerate().all(|(i, &j)| i == j) {
                        Some(x)
                    } else {
                        g.nodes[v].prim = Prim::Shape(ShapeOp::Permute(r));
                        g.nodes[v].args = vec![x];
                        None
                    }
                } else {
                    None
                }
            }
            Prim::Binary(op @ (Binary::Mul | Binary::Add)) => {
                let unit = if op == Binary::Mul { 1.0 } else { 0.0 };
                let keeps = |o: usize| g.nodes[o].ty == ty;
                if is_literal(&g, args[0], unit) && keeps(args[1]) {
                    Some(args[1])
                } else if is_literal(&g, args[1], unit) && keeps(args[0]) {
                    Some(args[0])
                } else {
                    None
                }
            }
            Prim::Unary(Unary::Affine(m, a)) if m == 1.0 && a == 0.0 => Some(args[0]),
            _ => None,
        };
        if let Some(r) = replacement {
            same[v] = r;
        } else if let Some(u) = seen.first_equal(&g, v) {
            same[v] = u;
        }
    }
    g.outputs = g.outputs.iter().map(|&o| same[o]).collect();
    g.eliminate_dead_code()
}
