//! The memory plan of a graph: the most bytes it holds at once when the
//! interpreter runs it, worked out from the primitives' facts without
//! running anything.
//!
//! A value lives from its node to its last reader; a view shares its
//! operand's buffer, which lives while any view of it does; a reshape of
//! a strided view is a copy; and while a node runs, the copies and
//! buffers its kernel allocates ([`super::Rule::workspace`]) are held
//! beside everything live. A map's body counts at its own peak while the
//! map runs (its workspace). Inputs and constants are counted as
//! contiguous buffers of their own, held for the whole run: the caller
//! holds its arguments, and the graph its captured tensors.

use super::facts::{self, bytes, Arg, Effect, Storage, Workspace};
use super::rule;
use crate::ir::{Graph, Prim};

/// The most bytes `g` holds at once by its plan.
pub(crate) fn planned_peak(g: &Graph) -> usize {
    planned_peak_at(g).0
}

/// [`planned_peak`] and the first node at which it is reached.
pub(crate) fn planned_peak_at(g: &Graph) -> (usize, usize) {
    planned_peak_with(g, &partners(g))
}

/// [`planned_peak_at`] with the loops that run side by side already
/// known ([`partners`] of `g`, as an executable keeps them).
pub(crate) fn planned_peak_with(g: &Graph, partners: &[Option<usize>]) -> (usize, usize) {
    let last = g.last_uses();
    let n = g.nodes.len();
    // The buffer each value lives in, how many live values view it, and
    // whether each value is contiguous.
    let mut buffer: Vec<usize> = (0..n).collect();
    let mut views = vec![0usize; n];
    let mut size = vec![0usize; n];
    let mut contiguous = vec![true; n];
    // A loop that runs beside an earlier one is counted from that one's
    // start: its workspace while they run, its result from then on.
    let mut early = vec![false; n];
    let (mut live, mut peak, mut at) = (0usize, 0usize, 0usize);
    for (v, node) in g.nodes.iter().enumerate() {
        let mut held = 0usize;
        if node.prim.is_leaf() {
            size[v] = bytes(&node.ty);
        } else {
            let (storage, ws) = effects(g, v, &contiguous);
            held = if early[v] { 0 } else { ws.total() };
            match storage {
                Storage::View { contiguous: keeps } => {
                    buffer[v] = buffer[node.args[0]];
                    contiguous[v] = keeps && contiguous[node.args[0]];
                }
                Storage::ViewOrCopy if contiguous[node.args[0]] => buffer[v] = buffer[node.args[0]],
                Storage::ViewOrCopy | Storage::Fresh => size[v] = bytes(&node.ty),
                Storage::Strided => {
                    size[v] = bytes(&node.ty);
                    contiguous[v] = false;
                }
            }
        }
        if let Some(u) = partners[v] {
            // a loop's result is a fresh buffer of its own
            early[u] = true;
            live = live.saturating_add(bytes(g.ty(u)));
            held = held.saturating_add(effects(g, u, &contiguous).1.total());
        }
        if buffer[v] == v && !early[v] {
            live = live.saturating_add(size[v]);
        }
        views[buffer[v]] += 1;
        if live.saturating_add(held) > peak {
            (peak, at) = (live.saturating_add(held), v);
        }
        for a in g.dead_at(v, &last) {
            let b = buffer[a];
            views[b] -= 1;
            if views[b] == 0 && !g.nodes[b].prim.is_leaf() {
                live = live.saturating_sub(size[b]);
            }
        }
    }
    (peak, at)
}

/// Whether node `v` is a loop that may run beside another: one without
/// effects (a user's custom operation may not be reentrant or may count
/// its calls; a random draw's seed is its node's).
pub(crate) fn pairable(g: &Graph, v: usize) -> bool {
    g.nodes[v].prim.is_loop() && facts::of_node(g, v).is_some_and(|f| f.effect == Effect::Pure)
}

/// The loops that run side by side ([`Graph::partners_where`] over the
/// [`pairable`] ones): what the interpreter runs at once and the plan
/// counts so.
pub(crate) fn partners(g: &Graph) -> Vec<Option<usize>> {
    g.partners_where(|v| pairable(g, v))
}

/// Node `v`'s storage and workspace on its operands' layouts.
fn effects(g: &Graph, v: usize, contiguous: &[bool]) -> (Storage, Workspace) {
    let node = &g.nodes[v];
    let args: Vec<Arg> = node
        .args
        .iter()
        .map(|&a| Arg {
            ty: g.ty(a),
            contiguous: contiguous[a],
        })
        .collect();
    match rule(&node.prim) {
        Ok(r) => (r.facts(&args, &node.ty).storage, r.workspace(&args, &node.ty)),
        // the interpreter reports a primitive without rules; the
        // plan counts it as a fresh value
        Err(_) => (Storage::Fresh, Workspace::NONE),
    }
}

/// The bytes any run of `g` holds whatever its schedule: its arguments,
/// its captured tensors and its results (each result's own bytes, where it
/// is computed).
pub(crate) fn floor(g: &Graph) -> usize {
    let leaves: usize = g
        .nodes
        .iter()
        .filter(|n| matches!(n.prim, Prim::Input(_) | Prim::Const(_)))
        .map(|n| bytes(&n.ty))
        .fold(0, usize::saturating_add);
    let mut outs: Vec<usize> = g
        .outputs
        .iter()
        .copied()
        .filter(|&o| !g.nodes[o].prim.is_leaf())
        .collect();
    outs.sort_unstable();
    outs.dedup();
    outs.iter().map(|&o| bytes(g.ty(o))).fold(leaves, usize::saturating_add)
}
