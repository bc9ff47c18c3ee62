//! Local simplifications the transforms leave room for: reshapes of
//! reshapes, permutes of permutes, and multiplications by broadcast ones or
//! additions of broadcast zeros (the seed of a gradient, an unused bias).
//! Run before dead-code removal, on every graph a call runs.

use super::ops::{Binary, ShapeOp, Unary};
use super::{Graph, Prim};

/// Whether `v` is the scalar `value`, possibly reshaped or broadcast.
fn is_literal(g: &Graph, v: usize, value: f64) -> bool {
    match &g.nodes[v].prim {
        Prim::Scalar(x) => *x == value,
        Prim::Shape(ShapeOp::Reshape(_) | ShapeOp::Broadcast(_)) => is_literal(g, g.nodes[v].args[0], value),
        _ => false,
    }
}

impl Graph {
    /// The same computation with local redundancies removed (then dead code).
    pub(crate) fn simplify(&self) -> Graph {
        let mut g = self.clone();
        let mut same: Vec<usize> = (0..g.nodes.len()).collect();
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
            }
        }
        g.outputs = g.outputs.iter().map(|&o| same[o]).collect();
        g.eliminate_dead_code()
    }
}
