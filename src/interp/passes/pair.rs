//! Independent loops side by side. Where a later loop (a map, scan or while
//! loop) does not depend on an earlier one, the values it reads that lie
//! between the two are moved before the earlier one, so that the two become
//! partners (`Graph::partners`) and the interpreter runs them at once: the
//! two directions of a bidirectional recurrence and their gradients, whose
//! steps are too small to fill the cores one loop at a time.
//!
//! Moving those values earlier holds them longer; pairings are kept only
//! while the planned peak (which counts a partner's workspace and result
//! from the first loop's start) stays within an eighth above the graph's
//! own, the price of the loops' states beside a graph's peak in the cases
//! this is for. A graph that draws random numbers is left as it is (a
//! draw's seed is its node's index), and so is a loop with effects.

use super::rewrite::{rebuild, Plan};
use crate::ir::Graph;
use crate::rules::facts::draws_random;
use crate::rules::memory::{pairable, partners, planned_peak};

/// `g` with independent loops paired where that is worth its memory.
pub(super) fn pair_loops(mut g: Graph) -> Graph {
    // a random draw's seed is its node's index, which moving nodes changes
    if draws_random(&g) {
        return g;
    }
    // the peak before any pairing: every pairing together grows it by at
    // most an eighth (planned only where there is a candidate)
    let mut limit = None;
    let mut from = 0;
    while let Some((v, u)) = candidate(&g, from) {
        let (paired, at) = hoist(&g, v, u); // `at`: where v is now
        let limit = *limit.get_or_insert_with(|| {
            let p = planned_peak(&g);
            p.saturating_add(p / 8)
        });
        from = if partners(&paired)[at].is_some() && planned_peak(&paired) <= limit {
            g = paired;
            at + 1
        } else {
            v + 1
        };
    }
    g
}

/// The first loop at or after `from` without a partner, with the first
/// later loop that does not depend on it and has no partner either.
fn candidate(g: &Graph, from: usize) -> Option<(usize, usize)> {
    let mut taken = vec![false; g.nodes.len()];
    for (v, p) in partners(g).iter().enumerate() {
        if let Some(u) = *p {
            taken[v] = true;
            taken[u] = true;
        }
    }
    let loops: Vec<usize> = (from..g.nodes.len()).filter(|&v| pairable(g, v) && !taken[v]).collect();
    for (k, &v) in loops.iter().enumerate() {
        let after = depends_on(g, v);
        if let Some(&u) = loops[k + 1..].iter().find(|&&u| !after[u]) {
            return Some((v, u));
        }
    }
    None
}

/// Whether each value depends on node `v` (`v` included).
fn depends_on(g: &Graph, v: usize) -> Vec<bool> {
    let mut dep = vec![false; g.nodes.len()];
    dep[v] = true;
    for x in v + 1..g.nodes.len() {
        dep[x] = g.nodes[x].args.iter().any(|&a| dep[a]);
    }
    dep
}

/// The values between `v` and `u` that `u` reads, directly or not.
fn cone(g: &Graph, v: usize, u: usize) -> Vec<bool> {
    let mut need = vec![false; g.nodes.len()];
    need[u] = true;
    for x in (v + 1..=u).rev() {
        if need[x] {
            for &a in &g.nodes[x].args {
                if a > v {
                    need[a] = true;
                }
            }
        }
    }
    need[u] = false;
    need
}

/// `g` with `u`'s cone between `v` and `u` moved, in its order, to just
/// before `v` (`u` does not depend on `v`, so neither does its cone), and
/// where `v` is then.
fn hoist(g: &Graph, v: usize, u: usize) -> (Graph, usize) {
    let need = cone(g, v, u);
    let n = g.nodes.len();
    let order: Vec<usize> = (0..v)
        .chain((v + 1..u).filter(|&x| need[x]))
        .chain(std::iter::once(v))
        .chain((v + 1..n).filter(|&x| !need[x]))
        .collect();
    let at = order.iter().position(|&x| x == v).unwrap_or(v);
    (rebuild(g, Plan::new(n).reorder(order)), at)
}
