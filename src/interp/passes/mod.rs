//! The passes that prepare a graph to run, in one fixed order, after every
//! transform has rewritten it (their products have no transform rules):
//!
//! 1. [`simplify`]: local rewrites (reshapes of reshapes, identities,
//!    transposed products, slices of one cotangent placed side by side),
//!    common subexpressions merged, dead code removed;
//! 2. `results`: the results of a loop or a branch that nothing reads
//!    dropped by its own rule (a scan run forward keeps its last carries
//!    only); `fuse`: a product's bias add and ReLU fused into it;
//! 3. `stream`: concatenations written in place as their pieces come;
//! 4. `remat`: cheap values recomputed before late readers where that
//!    lowers the planned peak;
//! 5. `pair`: independent loops made neighbours, to run at once.
//!
//! Each reads the facts of the primitives (`rules::facts`), never a list
//! of its own. The local rewrites (simplify's, the layout passes',
//! fusion's) are tables of pattern rules run by one driver (`rewrite`).

mod fuse;
mod layout;
mod pair;
mod remat;
mod results;
mod rewrite;
mod simplify;
mod slices;
mod stream;

pub(crate) use simplify::simplify;

use crate::ir::Graph;

/// `g` prepared to run: simplified, its unread results dropped, its
/// bodies prepared, fused, rematerialised where that lowers its peak, and
/// its independent loops paired.
pub(crate) fn prepare(g: &Graph) -> Graph {
    let fused = fuse::fuse_epilogues(&prepare_bodies(results::prune_results(simplify(g))));
    pair::pair_loops(remat::rematerialise(stream::stream_concats(&fused)))
}

/// `g` with the body of every primitive that holds one (`Prim::bodies`)
/// prepared: the one recursion into sub-graphs, so every pass reaches
/// them. It comes after the outer graph's simplification, which merges
/// nodes that share a body before the bodies are rebuilt apart.
fn prepare_bodies(mut g: Graph) -> Graph {
    for node in &mut g.nodes {
        if let Some(prim) = node.prim.with_bodies(prepare) {
            node.prim = prim;
        }
    }
    g
}
