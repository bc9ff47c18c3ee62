//! Products in the layouts the batching rules leave them: a product
//! whose result is read transposed is computed transposed
//! (`transpose_products`); a transpose before an elementwise map with a
//! small broadcast operand (a bias, a ReLU) moves after it
//! (`sink_permutes`), so that a product of two transposed operands can be
//! computed as the transpose of the reversed product, reading both in the
//! layout they are stored in (`untranspose_products`).

use crate::ir::ops::ShapeOp;
use crate::ir::{Graph, Node, Prim, VarId};

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

/// [`transpose_products`], then [`sink_permutes`] and
/// [`untranspose_products`].
pub(super) fn products_in_place(old: &Graph) -> Graph {
    untranspose_products(&sink_permutes(&transpose_products(old)))
}

/// A graph under reconstruction: the new nodes and where each old node went.
struct Rebuild<'a> {
    old: &'a Graph,
    g: Graph,
    remap: Vec<VarId>,
}

impl<'a> Rebuild<'a> {
    fn new(old: &'a Graph) -> Rebuild<'a> {
        Rebuild {
            old,
            g: Graph {
                consts: old.consts.clone(),
                ..Graph::default()
            },
            remap: vec![usize::MAX; old.nodes.len()],
        }
    }

    fn push(&mut self, prim: Prim, args: Vec<VarId>, ty: crate::ir::TensorType) -> VarId {
        self.g.nodes.push(Node { prim, args, ty });
        self.g.nodes.len() - 1
    }

    /// Node `v` as it was, its operands remapped.
    fn copy(&mut self, v: VarId) -> VarId {
        let n = &self.old.nodes[v];
        let args = n.args.iter().map(|&a| self.remap[a]).collect();
        self.push(n.prim.clone(), args, n.ty.clone())
    }

    fn finish(mut self) -> Graph {
        self.g.inputs = self.old.inputs.iter().map(|&v| self.remap[v]).collect();
        self.g.outputs = self.old.outputs.iter().map(|&v| self.remap[v]).collect();
        self.g
    }
}

/// Whether node `v` is an elementwise map a transpose can move across:
/// a unary map, or a binary map whose other operands are of the full
/// rank and smaller than the result (a bias: read strided, cheaply) or
/// scalars.
fn commutes(g: &Graph, v: VarId, through: VarId) -> bool {
    let n = &g.nodes[v];
    let elementwise = matches!(
        n.prim,
        Prim::Unary(_) | Prim::Binary(_) | Prim::Compare(_) | Prim::Where
    );
    elementwise
        && n.args.iter().all(|&a| {
            let t = g.ty(a);
            a == through || t.rank() == 0 || (t.rank() == n.ty.rank() && t.elem_count() < n.ty.elem_count())
        })
        && n.args.iter().filter(|&&a| a == through).count() == 1
}

/// Every transpose (a permute swapping the last two axes) read only by an
/// elementwise map it commutes with, moved after the map: `relu(t(y) + b)`
/// as `t(relu(y + t(b)))`, repeated down a chain of such maps.
fn sink_permutes(old: &Graph) -> Graph {
    let n = old.nodes.len();
    let mut readers = vec![Vec::new(); n];
    for (v, node) in old.nodes.iter().enumerate() {
        for &a in &node.args {
            readers[a].push(v);
        }
    }
    let mut output = vec![false; n];
    for &o in &old.outputs {
        output[o] = true;
    }
    // whether the transpose that `v` is (or becomes) moves into its reader
    let sinks = |v: VarId| match readers[v].as_slice() {
        [r] => !output[v] && commutes(old, *r, v),
        _ => false,
    };
    let transpose = |v: VarId| matches!(&old.nodes[v].prim, Prim::Shape(ShapeOp::Permute(p)) if swaps_last_two(p));
    if !(0..n).any(|v| transpose(v) && sinks(v)) {
        return old.clone();
    }
    let mut rb = Rebuild::new(old);
    // for an old node that is a transpose moving into its reader: the new
    // untransposed value behind it
    let mut behind: Vec<Option<VarId>> = vec![None; n];
    for v in 0..n {
        let node = &old.nodes[v];
        let Some(t) = node.args.iter().copied().find(|&a| behind[a].is_some()) else {
            rb.remap[v] = rb.copy(v);
            if transpose(v) && sinks(v) {
                behind[v] = Some(rb.remap[node.args[0]]);
            }
            continue;
        };
        // op(.., t(x), ..) as t(op(.., x, t(other), ..))
        let r = node.ty.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let swapped = |ty: &crate::ir::TensorType| ty.with_shape(perm.iter().map(|&i| ty.shape[i]).collect::<Vec<_>>());
        let mut args = Vec::with_capacity(node.args.len());
        for &a in &node.args {
            args.push(match behind[a] {
                Some(x) if a == t => x,
                _ if old.ty(a).rank() == 0 => rb.remap[a],
                _ => rb.push(
                    Prim::Shape(ShapeOp::Permute(perm.clone())),
                    vec![rb.remap[a]],
                    swapped(old.ty(a)),
                ),
            });
        }
        let y = rb.push(node.prim.clone(), args, swapped(&node.ty));
        rb.remap[v] = rb.push(Prim::Shape(ShapeOp::Permute(perm)), vec![y], node.ty.clone());
        if sinks(v) {
            behind[v] = Some(y);
        }
    }
    rb.finish().eliminate_dead_code()
}

/// Every product of two transposed operands, `a^T @ b^T`, as `(b @ a)^T`:
/// both operands read in the layout they are stored in, and the result a
/// transposed view for its readers (a fused epilogue applies it in the
/// product's own layout). A stacked ensemble's linear layers on a shared
/// batch compute their activations transposed (`(B out) in @ in N`), so
/// each next layer's product had both operands transposed:
/// `[10, 128, 128] @ [10, 128, 64]` took 0.068 ms where its transposed
/// form took 0.10. Left as written where a reader would copy the
/// transposed result (a reshape).
fn untranspose_products(old: &Graph) -> Graph {
    let n = old.nodes.len();
    let mut copies = vec![false; n];
    for node in &old.nodes {
        if let Prim::Shape(ShapeOp::Reshape(_)) = node.prim {
            copies[node.args[0]] = true;
        }
    }
    let transpose = |v: usize| matches!(&old.nodes[v].prim, Prim::Shape(ShapeOp::Permute(p)) if swaps_last_two(p));
    // a transposed view of a value stored as it is (the transpose of a
    // transpose is the value's own layout)
    let source = |v: usize| (transpose(v) && !transpose(old.nodes[v].args[0])).then(|| old.nodes[v].args[0]);
    let target = |v: usize| -> Option<(usize, usize)> {
        let node = &old.nodes[v];
        if node.prim != Prim::Matmul || copies[v] {
            return None;
        }
        Some((source(node.args[0])?, source(node.args[1])?))
    };
    if !(0..n).any(|v| target(v).is_some()) {
        return old.clone();
    }
    let mut rb = Rebuild::new(old);
    for (v, node) in old.nodes.iter().enumerate() {
        rb.remap[v] = match target(v) {
            Some((a, b)) => {
                // (b @ a) [.., n, m], then its last two axes swapped
                let mut shape = node.ty.shape.clone();
                let r = shape.len();
                shape.swap(r - 2, r - 1);
                let args = vec![rb.remap[b], rb.remap[a]];
                let y = rb.push(Prim::Matmul, args, node.ty.with_shape(shape));
                let mut p: Vec<usize> = (0..r).collect();
                p.swap(r - 2, r - 1);
                rb.push(Prim::Shape(ShapeOp::Permute(p)), vec![y], node.ty.clone())
            }
            None => rb.copy(v),
        };
    }
    rb.finish().eliminate_dead_code()
}
