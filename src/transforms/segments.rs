//! A schedule per segment: a batched program cut in two, its convolutional
//! front once per example and the rest (a linear head, a loss) batched.
//! The front is where ten models' batched activations overflow the cache
//! and one model's do not; the head is a few products that batch well.
//!
//! The cut falls after the last batched convolution, where the fewest
//! bytes cross it before the head's first product (after the pooling and
//! the flatten that shrink the activations, not between the convolution
//! and its ReLU). The values crossing it are the front's outputs and the
//! head's extra inputs.

use crate::ir::{Graph, Node, Prim, VarId};

/// What runs per example under `Schedule::ConvsPerExample`.
pub(crate) enum Front {
    /// Nothing: the program has no batched convolution.
    Nothing,
    /// All of it: nothing batched follows its last convolution.
    All,
    /// The part before the cut.
    Part(Box<Split>),
}

/// A program cut in two: `front` maps the program's inputs to the values
/// crossing the cut, `head` maps the program's inputs followed by those
/// values to the program's outputs.
pub(crate) struct Split {
    /// The segment that runs once per example.
    pub(crate) front: Graph,
    /// The segment that runs batched.
    pub(crate) head: Graph,
}

/// `g` cut after its last batched convolution.
pub(crate) fn split_after_convs(g: &Graph, batched: &[bool]) -> Front {
    let n = g.nodes.len();
    let computed = |v: usize| batched[v] && !g.nodes[v].prim.is_leaf();
    let Some(last_conv) = (0..n)
        .rev()
        .find(|&v| computed(v) && matches!(g.nodes[v].prim, Prim::Conv(_)))
    else {
        return Front::Nothing;
    };
    let first_product = (last_conv + 1..n)
        .find(|&v| computed(v) && g.nodes[v].prim == Prim::Matmul)
        .unwrap_or(n);
    // The last node that reads each value (n for an output).
    let mut last_read = vec![0usize; n];
    for (v, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            last_read[a] = last_read[a].max(v);
        }
    }
    for &o in &g.outputs {
        last_read[o] = n;
    }
    let crossing = |cut: usize| -> Vec<VarId> { (0..cut).filter(|&v| computed(v) && last_read[v] >= cut).collect() };
    let bytes = |vs: &[VarId]| -> usize {
        vs.iter()
            .map(|&v| g.ty(v).elem_count().saturating_mul(g.ty(v).dtype.size_in_bytes()))
            .fold(0, usize::saturating_add)
    };
    // Fewest bytes; among equals the later cut, which leaves less to the head.
    // Never between a tuple and its results: only a `get` reads a tuple.
    let cut = (last_conv + 1..=first_product)
        .filter(|&c| crossing(c).iter().all(|&v| !g.nodes[v].prim.is_tuple()))
        .min_by_key(|&c| (bytes(&crossing(c)), std::cmp::Reverse(c)))
        .unwrap_or(n);
    if !(cut..n).any(computed) {
        return Front::All;
    }
    let across = crossing(cut);
    let front = Graph {
        outputs: across.clone(),
        ..g.clone()
    }
    .eliminate_dead_code();
    // The head: the same nodes, with each crossing value an input of its own.
    let mut head = g.clone();
    for &v in &across {
        let k = head.inputs.len();
        head.nodes[v] = Node {
            prim: Prim::Input(k),
            args: Vec::new(),
            ty: g.ty(v).clone(),
        };
        head.inputs.push(v);
    }
    Front::Part(Box::new(Split {
        front,
        head: head.eliminate_dead_code(),
    }))
}
