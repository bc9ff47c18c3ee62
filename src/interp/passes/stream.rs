//! Concatenations lowered to writes in place. A concatenation holds every
//! piece until the last is made, then copies them all: a `vmap` run in
//! chunks held its result twice (the chunks' pieces and their
//! concatenation), so `chunk_size` raised the peak it was meant to lower.
//! Here a concatenation of pieces nothing else reads becomes a buffer of
//! its result and one write per piece, placed right after the piece is
//! made, so each piece is dropped as soon as it is written.

use super::rewrite::{rebuild, Arg, Plan, Rewrite};
use crate::ir::ops::{PlaceOp, ShapeOp};
use crate::ir::{Graph, Prim, VarId};
use crate::rules::facts::bytes;

/// Concatenations smaller than this stay as they are: their pieces are
/// small, and a write per piece costs a node each.
const MIN_BYTES: usize = 64 << 10;

/// Where each piece of a streamed concatenation goes: its concatenation,
/// the axis and offset, and whether it is the first piece made.
#[derive(Clone, Copy)]
struct Piece {
    concat: VarId,
    axis: usize,
    offset: usize,
    first: bool,
}

/// The pieces of every concatenation worth streaming, by node.
fn pieces(g: &Graph) -> Vec<Option<Piece>> {
    let n = g.nodes.len();
    let mut readers = vec![0usize; n];
    for node in &g.nodes {
        for &a in &node.args {
            readers[a] += 1;
        }
    }
    for &o in &g.outputs {
        readers[o] += 1;
    }
    let mut out = vec![None; n];
    for (c, node) in g.nodes.iter().enumerate() {
        let Prim::Shape(ShapeOp::Concat(axis)) = node.prim else {
            continue;
        };
        let own = |&a: &VarId| readers[a] == 1 && !g.nodes[a].prim.is_leaf();
        if node.args.len() < 2 || bytes(&node.ty) < MIN_BYTES || !node.args.iter().all(own) {
            continue;
        }
        let first = node.args.iter().copied().min();
        let mut offset = 0;
        for &a in &node.args {
            out[a] = Some(Piece {
                concat: c,
                axis,
                offset,
                first: Some(a) == first,
            });
            offset += g.ty(a).shape[axis];
        }
    }
    out
}

/// `g` with its concatenations of pieces it reads once written in place.
pub(super) fn stream_concats(g: Graph) -> Graph {
    let old = &g;
    let pieces = pieces(old);
    if pieces.iter().all(Option::is_none) {
        return g;
    }
    let mut streamed = vec![false; old.nodes.len()];
    for p in pieces.iter().flatten() {
        streamed[p.concat] = true;
    }
    let mut plan = Plan::new(old.nodes.len());
    // each streamed concatenation's buffer so far: the node that wrote it
    // last, and where among that node's rewrite
    let mut filled: Vec<Option<Arg>> = vec![None; old.nodes.len()];
    for v in 0..old.nodes.len() {
        // a streamed concatenation is its buffer, complete now (maybe a
        // piece of another concatenation itself)
        let (mut nodes, place) = match streamed[v] {
            true => (Vec::new(), filled[v].unwrap_or(Arg::Old(v))),
            false => (vec![Rewrite::same(old, v)], Arg::New(0)),
        };
        let Some(p) = pieces[v] else {
            if streamed[v] {
                plan.set(v, Rewrite { nodes, place });
            }
            continue;
        };
        let ty = old.ty(p.concat).clone();
        let mut buffer = filled[p.concat];
        if p.first {
            nodes.push((Prim::Place(PlaceOp::Empty(ty.clone())), vec![], ty.clone()));
            buffer = Some(Arg::New(nodes.len() - 1));
        }
        let write = Prim::Place(PlaceOp::Write {
            axis: p.axis,
            offset: p.offset,
        });
        let buffer = buffer.unwrap_or(Arg::Old(p.concat));
        nodes.push((write, vec![buffer, place], ty));
        filled[p.concat] = Some(Arg::At(v, nodes.len() - 1));
        plan.set(v, Rewrite { nodes, place });
    }
    rebuild(old, plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::exec::Executable;
    use crate::ir::{Options, TensorType};
    use crate::rules::{Builder, TraceCtx};
    use candle_core::{DType, Device, Tensor};

    /// A concatenation whose first piece is a concatenation (a carry's
    /// cotangent padded with zeros, then padded again): the inner one's
    /// buffer is written into the outer one's, and the values are those
    /// of the graph as it was.
    #[test]
    fn a_concatenation_of_a_concatenation_streams_both() {
        let b = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = b.borrow_mut();
        let x = b.input(TensorType::new(vec![64, 128], DType::F32));
        let y = b.un(crate::ir::ops::Unary::Exp, x).unwrap();
        let z1 = b.zeros(vec![64, 128], DType::F32).unwrap();
        let inner = b.concat(&[y, z1], 1).unwrap();
        let z2 = b.zeros(vec![64, 1024], DType::F32).unwrap();
        let outer = b.concat(&[inner, z2], 1).unwrap();
        let g = b.finish(vec![outer]).0;
        let s = stream_concats(g.clone());
        for (v, n) in s.nodes.iter().enumerate() {
            assert!(
                n.args.iter().all(|&a| a < v),
                "node {v} reads a value not made before it:\n{s}"
            );
        }
        let x = Tensor::randn(0f32, 1., (64, 128), &Device::Cpu).unwrap();
        let run = |g: Graph| {
            Executable::prepared(g, Default::default())
                .run(std::slice::from_ref(&x))
                .unwrap()
        };
        let (a, c) = (run(g), run(s));
        let d = (&a[0] - &c[0]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    }
}
