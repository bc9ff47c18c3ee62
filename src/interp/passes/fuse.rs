//! Epilogue fusion: a convolution or matrix product followed by a bias
//! add and/or a ReLU becomes one `fused` node, so the CPU kernels apply
//! the epilogue to the product's fresh output in place rather than
//! allocating and streaming two more tensors as large (on the tutorial
//! CNN's second convolution the add and the ReLU took a quarter of the
//! convolution's own time). Run on every graph about to run, after all
//! transforms: a fused node has no batching or VJP rule. Other devices
//! run the fused node as the ops it replaced. Which primitives take an
//! epilogue is each one's fact (`rules::facts`).

use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::{Fused, Graph, Prim, VarId};
use crate::rules::facts;

/// Whether adding a value of shape `b` to one of shape `y` keeps `y`'s
/// shape (right-aligned broadcasting that only widens `b`).
fn fits(b: &[usize], y: &[usize]) -> bool {
    b.len() <= y.len() && b.iter().rev().zip(y.iter().rev()).all(|(&d, &e)| d == 1 || d == e)
}

/// Each node's users (a user listed once per operand it reads).
fn users(g: &Graph) -> Vec<Vec<VarId>> {
    let mut users = vec![Vec::new(); g.nodes.len()];
    for (v, n) in g.nodes.iter().enumerate() {
        for &a in &n.args {
            users[a].push(v);
        }
    }
    users
}

/// The same computation with every
/// `relu?(permute?(reshape?(product)) + bias?)` chain (with a bias or a
/// ReLU) as one `fused` node (bodies are reached by `prepare`'s one
/// recursion).
/// A chain is fused only where each intermediate has that one user and
/// is not an output; the bias may be any operand the add broadcasts to
/// the product's shape.
pub(crate) fn fuse_epilogues(old: &Graph) -> Graph {
    let mut g = old.clone();
    let users = users(&g);
    let mut is_output = vec![false; g.nodes.len()];
    for &o in &g.outputs {
        is_output[o] = true;
    }
    // The one user of `v`, where `v` is not an output.
    let sole = |v: VarId| match users[v].as_slice() {
        [u] if !is_output[v] => Some(*u),
        _ => None,
    };
    for v in 0..g.nodes.len() {
        if !facts::of_node(&g, v).is_some_and(|f| f.epilogue) {
            continue;
        }
        let (mut end, mut view, mut perm, mut bias, mut relu) = (v, None, None, None, false);
        // the views a batching rule puts between a product and its
        // epilogue: `(B N) C -> B N C`, then a permute (`B N C -> B C N`);
        // the epilogue runs on the product's own layout
        if let Some(u) = sole(end) {
            if let Prim::Shape(ShapeOp::Reshape(shape)) = &g.nodes[u].prim {
                (end, view) = (u, Some(shape.clone()));
            }
        }
        if let Some(u) = sole(end) {
            if let Prim::Shape(ShapeOp::Permute(p)) = &g.nodes[u].prim {
                (end, perm) = (u, Some(p.clone()));
            }
        }
        if let Some(u) = sole(end) {
            let n = &g.nodes[u];
            if n.prim == Prim::Binary(Binary::Add) && n.ty == g.nodes[end].ty {
                let other = if n.args[0] == end { n.args[1] } else { n.args[0] };
                if other != end && fits(&g.nodes[other].ty.shape, &n.ty.shape) {
                    (end, bias) = (u, Some(other));
                }
            }
        }
        if let Some(u) = sole(end) {
            if g.nodes[u].prim == Prim::Unary(Unary::Relu) {
                (end, relu) = (u, true);
            }
        }
        if bias.is_none() && !relu {
            continue;
        }
        let mut args = g.nodes[v].args.clone();
        args.extend(bias);
        let base = g.nodes[v].prim.clone();
        g.nodes[end].prim = Prim::Fused(Box::new(Fused {
            base,
            view,
            perm,
            bias: bias.is_some(),
            relu,
        }));
        g.nodes[end].args = args;
    }
    g.eliminate_dead_code()
}
