//! Chains of views: the one walk back from a value through the shape
//! operations and casts between it and what it views, which epilogue
//! fusion, the layout passes, the scan VJP's products, ghost clipping and
//! the literal checks all take. Each says which links it follows; the
//! walk is the same.

use super::ops::{ShapeOp, Unary};
use super::{Node, Prim, VarId};
use candle_core::DType;

/// One link of a chain: a view of operand 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Step<'a> {
    /// A reshape to this shape.
    Reshape(&'a [usize]),
    /// A permutation of the axes.
    Permute(&'a [usize]),
    /// A broadcast to this shape.
    Broadcast(&'a [usize]),
    /// A conversion to this dtype.
    Cast(DType),
}

impl Prim {
    /// The view this primitive is, where it is one a chain may follow.
    pub(crate) fn view_step(&self) -> Option<Step<'_>> {
        Some(match self {
            Prim::Shape(ShapeOp::Reshape(s)) => Step::Reshape(s),
            Prim::Shape(ShapeOp::Permute(p)) => Step::Permute(p),
            Prim::Shape(ShapeOp::Broadcast(s)) => Step::Broadcast(s),
            Prim::Unary(Unary::Cast(dt)) => Step::Cast(*dt),
            _ => return None,
        })
    }
}

/// A chain from a value back to its source: the links followed, outermost
/// (the value itself) first, and the node they view.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Chain {
    /// The node the chain views.
    pub(crate) source: VarId,
    /// The views followed, from the value back towards the source.
    pub(crate) links: Vec<VarId>,
}

/// The chain from `end` back through operand 0 of each view that
/// `keep(link, step, links so far)` accepts, at most `max` links.
pub(crate) fn follow_views(
    nodes: &[Node],
    end: VarId,
    max: usize,
    mut keep: impl FnMut(VarId, Step<'_>, usize) -> bool,
) -> Chain {
    let mut links = Vec::new();
    let mut at = end;
    while links.len() < max {
        let node = &nodes[at];
        let Some(step) = node.prim.view_step() else { break };
        if node.args.len() != 1 || !keep(at, step, links.len()) {
            break;
        }
        links.push(at);
        at = node.args[0];
    }
    Chain { source: at, links }
}

/// Whether `v` is the literal `value` seen through the views `through`
/// accepts (a scalar reshaped or broadcast to a tensor of it).
pub(crate) fn is_literal(nodes: &[Node], v: VarId, value: f64, through: impl Fn(Step<'_>) -> bool) -> bool {
    let chain = follow_views(nodes, v, usize::MAX, |_, s, _| through(s));
    matches!(nodes[chain.source].prim, Prim::Scalar(x) if x == value)
}

/// The steps of `chain`'s links, from the source outwards.
pub(crate) fn steps<'a>(nodes: &'a [Node], chain: &'a Chain) -> impl Iterator<Item = Step<'a>> + 'a {
    chain.links.iter().rev().filter_map(move |&l| nodes[l].prim.view_step())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::TensorType;

    fn node(prim: Prim, args: Vec<VarId>, shape: &[usize]) -> Node {
        Node {
            prim,
            args,
            ty: TensorType::new(shape.to_vec(), DType::F32),
        }
    }

    /// `permute(reshape(broadcast(0)))`: followed as far as each walker
    /// says, the literal seen through it.
    #[test]
    fn a_chain_stops_where_its_walker_says() {
        let nodes = vec![
            node(Prim::Scalar(0.0), vec![], &[]),
            node(Prim::Shape(ShapeOp::Broadcast(vec![6])), vec![0], &[6]),
            node(Prim::Shape(ShapeOp::Reshape(vec![2, 3])), vec![1], &[2, 3]),
            node(Prim::Shape(ShapeOp::Permute(vec![1, 0])), vec![2], &[3, 2]),
        ];
        let all = follow_views(&nodes, 3, usize::MAX, |_, _, _| true);
        assert_eq!(
            all,
            Chain {
                source: 0,
                links: vec![3, 2, 1]
            }
        );
        let first_two = follow_views(&nodes, 3, 2, |_, _, _| true);
        assert_eq!(first_two.source, 1);
        let reshapes = follow_views(&nodes, 2, usize::MAX, |_, s, _| matches!(s, Step::Reshape(_)));
        assert_eq!(reshapes.source, 1);
        let order: Vec<Step> = steps(&nodes, &all).collect();
        assert_eq!(order[0], Step::Broadcast(&[6]));
        assert!(is_literal(&nodes, 3, 0.0, |_| true));
        assert!(!is_literal(&nodes, 3, 0.0, |s| !matches!(s, Step::Permute(_))));
        assert!(!is_literal(&nodes, 3, 1.0, |_| true));
    }
}
