//! Local simplifications the transforms leave room for: slices of one
//! cotangent placed side by side (`slices`), reshapes of
//! reshapes, permutes of permutes, multiplications by broadcast ones or
//! additions of broadcast zeros (the seed of a gradient, an unused bias),
//! transposed products computed in the layout they are read in, and a
//! node computed twice (common subexpressions: a transform re-emits the
//! forward pass, JVP and VJP rules each take an `exp` of one value). The
//! first of the passes that prepare a graph to run; dead code goes last.
//! Which nodes may never be merged (inputs, random draws, user code) is
//! each primitive's fact (`rules::facts`).

use super::slices::place_slices;
use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::{Graph, Node, Prim};
use crate::rules::facts;
use std::collections::HashMap;

/// Inner dimensions up to this make a product bound by writing its output
/// (about `k / 2` flops per byte written, where this machine's balance is
/// near 8), so the output's layout decides its speed; above, the GEMM's
/// preferred orientation does (`[32, 64] @ [64, 512]` took 1.7x as long as
/// `[512, 64] @ [64, 32]`), and the product is left as written.
const MAX_WRITE_BOUND_K: usize = 8;

/// Whether `p` swaps the last two axes and keeps the others.
fn swaps_last_two(p: &[usize]) -> bool {
    let r = p.len();
    r >= 2 && p[r - 2] == r - 1 && p[r - 1] == r - 2 && p[..r - 2].iter().enumerate().all(|(i, &j)| i == j)
}

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

/// Every `(a @ b)^T` (a permute swapping the last two axes of a product
/// nothing else reads) as `b^T @ a^T`, so the product is written in the
/// layout it is read in: a linear layer's per-sample weight gradient
/// comes out of its VJP as `(x^T @ ct)^T`, `[B, in, out]` then
/// permuted, and `[16, 27648, 1] @ [16, 1, 10]` took twice as long as
/// `[16, 10, 1] @ [16, 1, 27648]` (the permutes of the operands are
/// views, and undo the permutes that made them). Products of operands
/// of equal rank and a short inner dimension only.
fn transpose_products(old: &Graph) -> Graph {
    let mut readers = vec![0usize; old.nodes.len()];
    for n in &old.nodes {
        for &a in &n.args {
            readers[a] += 1;
        }
    }
    for &o in &old.outputs {
        readers[o] += 1;
    }
    let swapped = |n: &Node| match &n.prim {
        Prim::Shape(ShapeOp::Permute(p)) if swaps_last_two(p) => {
            let (mut m, mut split) = (n.args[0], None);
            if let Prim::Shape(ShapeOp::Reshape(_)) = old.nodes[m].prim {
                // `[M, N] -> [*lead, M2, N]`: a batching rule's folded
                // rows split back out, the columns kept
                let src = old.nodes[m].args[0];
                let (from, to) = (&old.nodes[src].ty.shape, &old.nodes[m].ty.shape);
                if readers[m] != 1 || from.len() != 2 || to.len() < 3 || to.last() != from.last() {
                    return None;
                }
                (m, split) = (src, Some(m));
            }
            if old.nodes[m].prim != Prim::Matmul || readers[m] != 1 {
                return None;
            }
            let (a, b) = (&old.nodes[old.nodes[m].args[0]].ty, &old.nodes[old.nodes[m].args[1]].ty);
            // Equal ranks: `[.., m, k] @ [k, n]` runs as one GEMM over
            // the folded leading axes, which the swapped form would not.
            // Split rows make the swapped form a batch of products, each
            // as bound by its writes as the whole.
            let ranks = match split {
                Some(_) => a.rank() == 2 && b.rank() == 2,
                None => a.rank() == b.rank(),
            };
            (ranks && a.shape[a.rank() - 1] <= MAX_WRITE_BOUND_K).then_some((m, split))
        }
        _ => None,
    };
    let deferred: std::collections::HashSet<usize> = old
        .nodes
        .iter()
        .filter_map(swapped)
        .flat_map(|(m, split)| std::iter::once(m).chain(split))
        .collect();
    if deferred.is_empty() {
        return old.clone();
    }
    let mut g = Graph {
        consts: old.consts.clone(),
        ..Graph::default()
    };
    let mut remap = vec![usize::MAX; old.nodes.len()];
    let transposed = |g: &mut Graph, v: usize| {
        let mut shape = g.nodes[v].ty.shape.clone();
        let r = shape.len();
        shape.swap(r - 2, r - 1);
        let mut p: Vec<usize> = (0..r).collect();
        p.swap(r - 2, r - 1);
        g.nodes.push(Node {
            prim: Prim::Shape(ShapeOp::Permute(p)),
            args: vec![v],
            ty: g.nodes[v].ty.with_shape(shape),
        });
        g.nodes.len() - 1
    };
    for (v, n) in old.nodes.iter().enumerate() {
        if deferred.contains(&v) {
            continue;
        }
        let node = match swapped(n) {
            Some((m, split)) => {
                let (mut a, b) = (remap[old.nodes[m].args[0]], remap[old.nodes[m].args[1]]);
                if let Some(r) = split {
                    // a: [M, K] -> [*lead, M2, K], its rows split as the product's were
                    let mut shape = old.nodes[r].ty.shape.clone();
                    *shape.last_mut().expect("rank 3 or more") = g.nodes[a].ty.shape[1];
                    g.nodes.push(Node {
                        prim: Prim::Shape(ShapeOp::Reshape(shape.clone())),
                        args: vec![a],
                        ty: g.nodes[a].ty.with_shape(shape),
                    });
                    a = g.nodes.len() - 1;
                }
                // b^T [N, K] @ a^T [*lead, K, M2] = [*lead, N, M2]
                let args = vec![transposed(&mut g, b), transposed(&mut g, a)];
                Node {
                    prim: Prim::Matmul,
                    args,
                    ty: n.ty.clone(),
                }
            }
            None => Node {
                args: n.args.iter().map(|&a| remap[a]).collect(),
                ..n.clone()
            },
        };
        g.nodes.push(node);
        remap[v] = g.nodes.len() - 1;
    }
    g.inputs = old.inputs.iter().map(|&v| remap[v]).collect();
    g.outputs = old.outputs.iter().map(|&v| remap[v]).collect();
    g
}

/// The same computation with local redundancies removed (then dead code).
pub(crate) fn simplify(old: &Graph) -> Graph {
    let mut g = transpose_products(&place_slices(old));
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
