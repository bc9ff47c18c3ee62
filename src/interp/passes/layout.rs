//! Products in the layouts the batching rules leave them, as three rule
//! tables: a product whose result is read transposed is computed
//! transposed (`transpose_product`); a transpose before an elementwise map
//! with a small broadcast operand (a bias, a ReLU) moves after it
//! (`sink_permute`), so that a product of two transposed operands can be
//! computed as the transpose of the reversed product, reading both in the
//! layout they are stored in (`untranspose_product`).

use super::rewrite::{Arg, Rewrite, Rule, View};
use crate::ir::ops::ShapeOp;
use crate::ir::views::{self, Step};
use crate::ir::{Prim, TensorType, VarId};

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

/// The permutation swapping the last two of `rank` axes.
fn swap_last_two(rank: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..rank).collect();
    p.swap(rank - 2, rank - 1);
    p
}

/// `ty` with its last two axes swapped.
fn swapped(ty: &TensorType) -> TensorType {
    let mut shape = ty.shape.clone();
    let r = shape.len();
    shape.swap(r - 2, r - 1);
    ty.with_shape(shape)
}

/// Whether `v` is a transpose (a permute swapping the last two axes).
fn is_transpose(g: &View, v: VarId) -> bool {
    matches!(g.prim(v), Prim::Shape(ShapeOp::Permute(p)) if swaps_last_two(p))
}

/// The transpose of `a` (an operand of a rule's emitted node) of type `ty`.
fn transpose(a: Arg, ty: &TensorType) -> (Prim, Vec<Arg>, TensorType) {
    let p = swap_last_two(ty.rank());
    (Prim::Shape(ShapeOp::Permute(p)), vec![a], swapped(ty))
}

/// At a transpose `v` of a product nothing else reads: the product and,
/// where a reshape splits the product's folded rows back out between
/// them, that reshape.
fn transposed_product(g: &View, v: VarId) -> Option<(VarId, Option<VarId>)> {
    if !is_transpose(g, v) {
        return None;
    }
    // `[M, N] -> [*lead, M2, N]`: a batching rule's folded rows split
    // back out, the columns kept
    let c = views::follow_views(&g.g.nodes, g.args(v)[0], 1, |r, step, _| {
        let (from, to) = (&g.ty(g.args(r)[0]).shape, &g.ty(r).shape);
        matches!(step, Step::Reshape(_))
            && g.uses(r) == 1
            && from.len() == 2
            && to.len() >= 3
            && to.last() == from.last()
    });
    let (m, split) = (c.source, c.links.first().copied());
    if *g.prim(m) != Prim::Matmul || g.uses(m) != 1 {
        return None;
    }
    let (a, b) = (g.ty(g.args(m)[0]), g.ty(g.args(m)[1]));
    // Equal ranks: `[.., m, k] @ [k, n]` runs as one GEMM over the folded
    // leading axes, which the swapped form would not. Split rows make the
    // swapped form a batch of products, each as bound by its writes as
    // the whole.
    let ranks = match split {
        Some(_) => a.rank() == 2 && b.rank() == 2,
        None => a.rank() == b.rank(),
    };
    (ranks && a.shape[a.rank() - 1] <= MAX_WRITE_BOUND_K).then_some((m, split))
}

/// Every `(a @ b)^T` (a permute swapping the last two axes of a product
/// nothing else reads) as `b^T @ a^T`, so the product is written in the
/// layout it is read in: a linear layer's per-sample weight gradient
/// comes out of its VJP as `(x^T @ ct)^T`, `[B, in, out]` then
/// permuted, and `[16, 27648, 1] @ [16, 1, 10]` took twice as long as
/// `[16, 10, 1] @ [16, 1, 27648]` (the permutes of the operands are
/// views, and undo the permutes that made them). Products of operands
/// of equal rank and a short inner dimension only.
fn transpose_product(g: &View, v: VarId) -> Option<Rewrite> {
    let (m, split) = transposed_product(g, v)?;
    let (a, b) = (g.args(m)[0], g.args(m)[1]);
    let mut nodes = Vec::new();
    let (mut a_arg, mut a_ty) = (Arg::Old(a), g.ty(a).clone());
    if let Some(r) = split {
        // a: [M, K] -> [*lead, M2, K], its rows split as the product's were
        let mut shape = g.ty(r).shape.clone();
        *shape.last_mut()? = a_ty.shape[1];
        a_ty = a_ty.with_shape(shape.clone());
        nodes.push((Prim::Shape(ShapeOp::Reshape(shape)), vec![a_arg], a_ty.clone()));
        a_arg = Arg::New(0);
    }
    // b^T [N, K] @ a^T [*lead, K, M2] = [*lead, N, M2]
    let k = nodes.len();
    nodes.push(transpose(Arg::Old(b), g.ty(b)));
    nodes.push(transpose(a_arg, &a_ty));
    nodes.push((Prim::Matmul, vec![Arg::New(k), Arg::New(k + 1)], g.ty(v).clone()));
    Some(Rewrite::emit(nodes))
}

/// Whether node `v` is an elementwise map a transpose can move across:
/// a unary map, or a binary map whose other operands are of the full
/// rank and smaller than the result (a bias: read strided, cheaply) or
/// scalars.
fn commutes(g: &View, v: VarId, through: VarId) -> bool {
    let ty = g.ty(v);
    let elementwise = matches!(
        g.prim(v),
        Prim::Unary(_) | Prim::Binary(_) | Prim::Compare(_) | Prim::Where
    );
    elementwise
        && g.args(v).iter().all(|&a| {
            let t = g.ty(a);
            a == through || t.rank() == 0 || (t.rank() == ty.rank() && t.elem_count() < ty.elem_count())
        })
        && g.args(v).iter().filter(|&&a| a == through).count() == 1
}

/// A transpose read only by an elementwise map it commutes with, moved
/// after the map: `op(.., t(x), ..)` as `t(op(.., x, t(other), ..))`.
/// Down a chain of such maps (`relu(t(y) + b)` as `t(relu(y + t(b)))`)
/// the sweeps move it one map at a time.
fn sink_permute(g: &View, v: VarId) -> Option<Rewrite> {
    let t = g
        .args(v)
        .iter()
        .copied()
        .find(|&a| is_transpose(g, a) && g.sole(a) == Some(v) && commutes(g, v, a))?;
    let ty = g.ty(v);
    let mut nodes = Vec::new();
    let mut args = Vec::new();
    for &a in g.args(v) {
        args.push(if a == t {
            Arg::Old(g.args(t)[0])
        } else if g.ty(a).rank() == 0 {
            Arg::Old(a)
        } else {
            nodes.push(transpose(Arg::Old(a), g.ty(a)));
            Arg::New(nodes.len() - 1)
        });
    }
    nodes.push((g.prim(v).clone(), args, swapped(ty)));
    nodes.push(transpose(Arg::New(nodes.len() - 1), &swapped(ty)));
    Some(Rewrite::emit(nodes))
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
fn untranspose_product(g: &View, v: VarId) -> Option<Rewrite> {
    if *g.prim(v) != Prim::Matmul || g.reshaped(v) {
        return None;
    }
    // a transposed view of a value stored as it is (the transpose of a
    // transpose is the value's own layout)
    let source = |a: VarId| (is_transpose(g, a) && !is_transpose(g, g.args(a)[0])).then(|| g.args(a)[0]);
    let (a, b) = (source(g.args(v)[0])?, source(g.args(v)[1])?);
    // (b @ a) [.., n, m], then its last two axes swapped
    let y = swapped(g.ty(v));
    Some(Rewrite::emit(vec![
        (Prim::Matmul, vec![Arg::Old(b), Arg::Old(a)], y.clone()),
        transpose(Arg::New(0), &y),
    ]))
}

// The three layout passes, run in this order by the pipeline, each to its
// fixed point: products transposed to their readers' layout, transposes
// sunk past elementwise maps, and products of two transposes computed
// untransposed. They are three tables, not one: the first and the last
// undo each other on a product of plain operands.

/// Products transposed to their readers' layout.
pub(super) const TRANSPOSE: &[Rule] = &[transpose_product];

/// Transposes sunk past elementwise maps.
pub(super) const SINK: &[Rule] = &[sink_permute];

/// Products of two transposes computed untransposed.
pub(super) const UNTRANSPOSE: &[Rule] = &[untranspose_product];
