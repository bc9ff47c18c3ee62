//! Epilogue fusion: a convolution or matrix product followed by a bias
//! add and/or a ReLU becomes one `fused` node, so the CPU kernels apply
//! the epilogue to the product's fresh output in place rather than
//! allocating and streaming two more tensors as large (on the tutorial
//! CNN's second convolution the add and the ReLU took a quarter of the
//! convolution's own time). Run on every graph about to run, after all
//! transforms: a fused node has no batching or VJP rule. Other devices
//! run the fused node as the ops it replaced. Which primitives take an
//! epilogue is each one's fact (`rules::facts`).

use super::rewrite::{Arg, Rewrite, Rule, View};
use crate::ir::ops::{Binary, Unary};
use crate::ir::views::{self, Step};
use crate::ir::{Fused, Prim, TensorType, VarId};
use crate::rules::facts;

/// Whether adding a value of shape `b` to one of shape `y` keeps `y`'s
/// shape (right-aligned broadcasting that only widens `b`).
fn fits(b: &[usize], y: &[usize]) -> bool {
    b.len() <= y.len() && b.iter().rev().zip(y.iter().rev()).all(|(&d, &e)| d == 1 || d == e)
}

/// A product seen through views: the product, the reshape's shape, the
/// permute.
type Chain = (VarId, Option<Vec<usize>>, Option<Vec<usize>>);

/// `end` as `permute?(reshape?(product))`, each link read only by the
/// next (and `end` only by `reader`), none an output: the views a
/// batching rule puts between a product and its epilogue (`(B N) C ->
/// B N C`, then `B N C -> B C N`), which the epilogue runs through on the
/// product's own layout.
fn chain(g: &View, end: VarId, reader: VarId) -> Option<Chain> {
    if g.sole(end) != Some(reader) {
        return None;
    }
    // a permute first (outermost) only, then a reshape; each link's
    // operand read by that link alone
    let mut permuted = false;
    let c = views::follow_views(&g.g.nodes, end, 2, |link, step, i| {
        let ok = match step {
            Step::Permute(_) if i == 0 => {
                permuted = true;
                true
            }
            Step::Reshape(_) => i == 0 || permuted,
            _ => false,
        };
        ok && g.sole(g.args(link)[0]) == Some(link)
    });
    let (mut view, mut perm) = (None, None);
    for step in views::steps(&g.g.nodes, &c) {
        match step {
            Step::Reshape(s) => view = Some(s.to_vec()),
            Step::Permute(p) => perm = Some(p.to_vec()),
            Step::Broadcast(_) | Step::Cast(_) => return None,
        }
    }
    facts::of_node(g.g, c.source)
        .is_some_and(|f| f.epilogue)
        .then_some((c.source, view, perm))
}

/// The fused node of `chain` with a bias and/or a ReLU, of type `ty`.
fn fused(g: &View, (product, view, perm): Chain, bias: Option<VarId>, relu: bool, ty: &TensorType) -> Rewrite {
    let mut args: Vec<Arg> = g.args(product).iter().map(|&a| Arg::Old(a)).collect();
    args.extend(bias.map(Arg::Old));
    let base = g.prim(product).clone();
    let fused = Fused {
        base,
        view,
        perm,
        bias: bias.is_some(),
        relu,
    };
    Rewrite::node(Prim::Fused(Box::new(fused)), args, ty.clone())
}

/// `chain(product) + bias`, the bias any operand the add broadcasts to
/// the product's shape (of the two products an add may read, the
/// earlier).
fn bias_epilogue(g: &View, v: VarId) -> Option<Rewrite> {
    if *g.prim(v) != Prim::Binary(Binary::Add) {
        return None;
    }
    let [x, y] = g.args(v) else { return None };
    let ty = g.ty(v);
    let with = |end: VarId, bias: VarId| {
        let c = chain(g, end, v)?;
        (bias != end && g.ty(end) == ty && fits(&g.ty(bias).shape, &ty.shape)).then_some((c, bias))
    };
    let (c, bias) = match (with(*x, *y), with(*y, *x)) {
        (Some(a), Some(b)) => std::cmp::min_by_key(a, b, |(c, _)| c.0),
        (a, b) => a.or(b)?,
    };
    Some(fused(g, c, Some(bias), false, ty))
}

/// `relu(chain(product))`, or the ReLU of a fused node with a bias and no
/// ReLU yet that nothing else reads.
fn relu_epilogue(g: &View, v: VarId) -> Option<Rewrite> {
    if *g.prim(v) != Prim::Unary(Unary::Relu) {
        return None;
    }
    let x = g.args(v)[0];
    if let Prim::Fused(f) = g.prim(x) {
        if f.relu || g.sole(x) != Some(v) {
            return None;
        }
        let fused = Fused {
            relu: true,
            ..(**f).clone()
        };
        let args = g.args(x).iter().map(|&a| Arg::Old(a)).collect();
        return Some(Rewrite::node(Prim::Fused(Box::new(fused)), args, g.ty(v).clone()));
    }
    Some(fused(g, chain(g, x, v)?, None, true, g.ty(v)))
}

/// Every `relu?(permute?(reshape?(product)) + bias?)` chain (with a bias
/// or a ReLU) as one `fused` node (bodies are reached by `prepare`'s one
/// recursion). A chain is fused only where each intermediate has that
/// one reader and is not an output.
pub(super) const RULES: &[Rule] = &[bias_epilogue, relu_epilogue];
