//! Dead results: a primitive with several results keeps only those a
//! `get` reads, by its own rule (`rules::Many::prune`, JAX's per-primitive
//! dead-code rule). A scan run forward thus keeps its last carries only,
//! not the carries of every step that a VJP would read, and a loop or a
//! branch drops an output nothing reads from its body. The node keeps its
//! place (a random draw's seed is its index); its `get`s are renumbered.

use super::rewrite::{rebuild, Arg, Plan, Rewrite};
use crate::ir::{tuple_type, Graph, Prim};
use crate::rules::rule;

/// `g` with every tuple's unread results dropped.
pub(super) fn prune_results(g: Graph) -> Graph {
    let mut gets: Vec<Vec<usize>> = vec![Vec::new(); g.nodes.len()];
    for (v, n) in g.nodes.iter().enumerate() {
        if let Prim::Get(_) = n.prim {
            gets[n.args[0]].push(v);
        }
    }
    let mut plan = Plan::new(g.nodes.len());
    for (t, readers) in gets.iter().enumerate() {
        let Some(results) = g.nodes[t].prim.results() else {
            continue;
        };
        let mut used = vec![false; results.len()];
        for &v in readers {
            if let Prim::Get(k) = g.nodes[v].prim {
                used[k] = true;
            }
        }
        let Some((prim, to)) = rule(&g.nodes[t].prim)
            .ok()
            .and_then(|r| r.many())
            .and_then(|m| m.prune(&used))
        else {
            continue;
        };
        let results = prim.results().unwrap_or_default();
        let args = g.nodes[t].args.iter().map(|&a| Arg::Old(a)).collect();
        plan.set(t, Rewrite::node(prim, args, tuple_type(&results)));
        for &v in readers {
            if let Prim::Get(k) = g.nodes[v].prim {
                if let Some(new) = to[k] {
                    plan.set(
                        v,
                        Rewrite::node(Prim::Get(new), vec![Arg::Old(t)], g.nodes[v].ty.clone()),
                    );
                }
            }
        }
    }
    match plan.is_empty() {
        true => g,
        false => rebuild(&g, plan),
    }
}
