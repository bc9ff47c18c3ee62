//! The passes that prepare a graph to run, after every transform has
//! rewritten it (their products have no transform rules), in the one
//! order of [`PIPELINE`]; `prepare` is the only place a graph is
//! simplified. Every pass goes through one driver (`rewrite`): a plan of
//! what takes some nodes' places, then one rebuild. Local rewrites are
//! tables of pattern rules the driver sweeps to a fixed point; whole-graph
//! analyses hand it a plan of their own. Each reads the facts of the
//! primitives (`rules::facts`), never a list of its own.

mod fuse;
mod layout;
mod pair;
mod remat;
mod results;
mod rewrite;
mod simplify;
mod slices;
mod stream;

use crate::ir::Graph;
use rewrite::{rebuild, rewrite, Arg, Plan, Rewrite, Rule};

/// What a pass is: a table of local rules, swept to a fixed point, or a
/// whole-graph analysis that plans its rebuild itself.
enum Pass {
    Rules(&'static [Rule]),
    Whole(fn(Graph) -> Graph),
}

/// The passes, in order.
const PIPELINE: &[(&str, Pass)] = &[
    // the slices of one cotangent placed side by side (`slices`)
    ("place slices", Pass::Whole(slices::place_slices)),
    // products in the layouts their operands and readers have
    ("transpose products", Pass::Rules(layout::TRANSPOSE)),
    ("sink permutes", Pass::Rules(layout::SINK)),
    ("untranspose products", Pass::Rules(layout::UNTRANSPOSE)),
    // reshapes of reshapes, identities, units
    ("simplify", Pass::Rules(simplify::RULES)),
    // a node computed twice computed once, dead code removed
    ("merge common", Pass::Whole(simplify::merge_common)),
    // a loop's or a branch's results nothing reads, by its own rule
    ("dead results", Pass::Whole(results::prune_results)),
    // every body through this same pipeline
    ("bodies", Pass::Whole(prepare_bodies)),
    // a product's bias add and ReLU fused into it
    ("fuse epilogues", Pass::Rules(fuse::RULES)),
    // concatenations written in place as their pieces come
    ("stream concatenations", Pass::Whole(stream::stream_concats)),
    // cheap values recomputed before late readers where that lowers the peak
    ("rematerialise", Pass::Whole(remat::rematerialise)),
    // independent loops made neighbours, to run at once
    ("pair loops", Pass::Whole(pair::pair_loops)),
];

/// `g` prepared to run: every pass of [`PIPELINE`] in order.
pub(crate) fn prepare(g: &Graph) -> Graph {
    PIPELINE.iter().fold(g.clone(), |g, (_, pass)| run(pass, g))
}

fn run(pass: &Pass, g: Graph) -> Graph {
    match pass {
        Pass::Rules(rules) => rewrite(&g, rules),
        Pass::Whole(f) => f(g),
    }
}

/// `g` through the pipeline up to and including the pass named `last`
/// (for a pass's tests, which start from a graph as the passes before it
/// leave it).
#[cfg(test)]
fn prepare_through(g: &Graph, last: &str) -> Graph {
    let mut g = g.clone();
    for (name, pass) in PIPELINE {
        g = run(pass, g);
        if *name == last {
            break;
        }
    }
    g
}

/// `g` with the body of every primitive that holds one
/// (`Prim::with_bodies`) prepared: the one recursion into sub-graphs, so
/// every pass reaches them. It comes after the outer graph's
/// simplification, which merges nodes that share a body before the
/// bodies are rebuilt apart.
fn prepare_bodies(g: Graph) -> Graph {
    let mut plan = Plan::new(g.nodes.len());
    for (v, node) in g.nodes.iter().enumerate() {
        if let Some(prim) = node.prim.with_bodies(prepare) {
            let args = node.args.iter().map(|&a| Arg::Old(a)).collect();
            plan.set(v, Rewrite::node(prim, args, node.ty.clone()));
        }
    }
    match plan.is_empty() {
        true => g,
        false => rebuild(&g, plan),
    }
}
