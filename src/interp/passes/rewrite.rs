//! The one driver of every pass: a plan, then one rebuild. A pass says
//! what takes the place of some nodes ([`Plan`] of [`Rewrite`]s, and the
//! order to visit the nodes in) and [`rebuild`] makes the new graph; no
//! pass builds a graph of its own. Local rewrites are tables of rules (as
//! tinygrad's `PatternMatcher`), each a few lines matching one pattern of
//! primitives at a node: [`rewrite`] sweeps the graph in order, planning
//! the first rule that matches each node, rebuilds, and sweeps again until
//! no rule matches (a rewrite may make its readers match: a transpose sunk
//! past one map meets the next), then drops what nothing reads. Rules see
//! the graph as it was at the start of their sweep, with its readers
//! counted. Whole-graph analyses (placed slices, streamed concatenations,
//! recomputation, pairing, dead results) hand the rebuild a plan of their
//! own. Bodies are reached by `prepare`'s one recursion.

use crate::ir::{Graph, Node, Prim, TensorType, VarId};

/// A graph as a rule sees it: its nodes and who reads each.
pub(super) struct View<'a> {
    /// The graph at the start of the sweep.
    pub(super) g: &'a Graph,
    readers: Vec<Vec<VarId>>,
    output: Vec<bool>,
}

impl<'a> View<'a> {
    pub(super) fn new(g: &'a Graph) -> View<'a> {
        let mut readers = vec![Vec::new(); g.nodes.len()];
        for (v, n) in g.nodes.iter().enumerate() {
            for &a in &n.args {
                readers[a].push(v);
            }
        }
        let mut output = vec![false; g.nodes.len()];
        for &o in &g.outputs {
            output[o] = true;
        }
        View { g, readers, output }
    }

    pub(super) fn prim(&self, v: VarId) -> &'a Prim {
        &self.g.nodes[v].prim
    }

    pub(super) fn args(&self, v: VarId) -> &'a [VarId] {
        &self.g.nodes[v].args
    }

    pub(super) fn ty(&self, v: VarId) -> &'a TensorType {
        &self.g.nodes[v].ty
    }

    /// The one reader of `v`, where `v` is not an output (a reader listed
    /// once per operand it reads).
    pub(super) fn sole(&self, v: VarId) -> Option<VarId> {
        match self.readers[v].as_slice() {
            [r] if !self.output[v] => Some(*r),
            _ => None,
        }
    }

    /// How many times `v` is read, as an operand or as an output.
    pub(super) fn uses(&self, v: VarId) -> usize {
        self.readers[v].len() + usize::from(self.output[v])
    }

    /// Whether a reshape reads `v` (a transposed `v` would be copied).
    pub(super) fn reshaped(&self, v: VarId) -> bool {
        self.readers[v]
            .iter()
            .any(|&r| matches!(self.g.nodes[r].prim, Prim::Shape(crate::ir::ops::ShapeOp::Reshape(_))))
    }
}

/// An operand of a node a rewrite emits: a node of the old graph (as
/// rebuilt), one this rewrite emitted before it, or one the rewrite of an
/// earlier node emitted.
#[derive(Clone, Copy, Debug)]
pub(super) enum Arg {
    /// The old graph's node, as the rebuild placed it.
    Old(VarId),
    /// The `k`-th node this rewrite emits.
    New(usize),
    /// The `k`-th node emitted by the rewrite of the earlier old node `v`.
    At(VarId, usize),
}

/// A node emitted by a rewrite: its primitive, operands and type.
pub(super) type Emitted = (Prim, Vec<Arg>, TensorType);

/// What takes an old node's place: the nodes emitted there, and which
/// value the node's readers read from then on.
#[derive(Debug)]
pub(super) struct Rewrite {
    pub(super) nodes: Vec<Emitted>,
    pub(super) place: Arg,
}

impl Rewrite {
    /// An earlier value of the old graph, as it is.
    pub(super) fn alias(v: VarId) -> Rewrite {
        Rewrite {
            nodes: Vec::new(),
            place: Arg::Old(v),
        }
    }

    /// New nodes, the last of which takes the node's place.
    pub(super) fn emit(nodes: Vec<Emitted>) -> Rewrite {
        let place = Arg::New(nodes.len().saturating_sub(1));
        Rewrite { nodes, place }
    }

    /// One new node in the matched node's place.
    pub(super) fn node(prim: Prim, args: Vec<Arg>, ty: TensorType) -> Rewrite {
        Rewrite::emit(vec![(prim, args, ty)])
    }

    /// The old node `v` of `g` as it is, its operands remapped: what a
    /// rewrite that adds nodes after a node emits first.
    pub(super) fn same(g: &Graph, v: VarId) -> Emitted {
        let n = &g.nodes[v];
        (
            n.prim.clone(),
            n.args.iter().map(|&a| Arg::Old(a)).collect(),
            n.ty.clone(),
        )
    }
}

/// A pass's plan for a graph: a rewrite for some of its nodes, and the
/// order the rebuild visits them in (a topological order of the old
/// nodes; their own where none is given). Whole-graph analyses (placed
/// slices, streamed concatenations, recomputation, pairing, dead results,
/// merged subexpressions) make one; the rule tables make one a sweep.
#[derive(Debug)]
pub(super) struct Plan {
    at: Vec<Option<Rewrite>>,
    order: Option<Vec<VarId>>,
}

impl Plan {
    /// No rewrite for a graph of `n` nodes.
    pub(super) fn new(n: usize) -> Plan {
        Plan {
            at: (0..n).map(|_| None).collect(),
            order: None,
        }
    }

    /// Puts `r` in node `v`'s place.
    pub(super) fn set(&mut self, v: VarId, r: Rewrite) {
        self.at[v] = Some(r);
    }

    /// Visits the old nodes in `order` (each once, operands first).
    pub(super) fn reorder(mut self, order: Vec<VarId>) -> Plan {
        self.order = Some(order);
        self
    }

    /// Whether it changes nothing.
    pub(super) fn is_empty(&self) -> bool {
        self.order.is_none() && self.at.iter().all(Option::is_none)
    }
}

/// `old` rebuilt by `plan`: every node visited in the plan's order,
/// rewritten where the plan says and copied with its operands remapped
/// elsewhere. The one place a pass builds a graph; it drops nothing (a
/// random draw's seed is its node's index), so a pass that leaves dead
/// nodes removes them itself.
pub(super) fn rebuild(old: &Graph, plan: Plan) -> Graph {
    let mut g = Graph {
        consts: old.consts.clone(),
        ..Graph::default()
    };
    let n = old.nodes.len();
    let mut remap = vec![usize::MAX; n];
    // the new indices of the nodes each old node's rewrite emitted
    let mut emitted: Vec<Vec<VarId>> = vec![Vec::new(); n];
    let Plan { mut at, order } = plan;
    let order = order.unwrap_or_else(|| (0..n).collect());
    for &v in &order {
        let Some(r) = at[v].take() else {
            let node = &old.nodes[v];
            let args = node.args.iter().map(|&a| remap[a]).collect();
            g.nodes.push(Node { args, ..node.clone() });
            remap[v] = g.nodes.len() - 1;
            continue;
        };
        let mut here = Vec::with_capacity(r.nodes.len());
        for (prim, args, ty) in r.nodes {
            let args = args.iter().map(|a| resolve(*a, &remap, &here, &emitted)).collect();
            here.push(g.add_node(prim, args, ty));
        }
        remap[v] = resolve(r.place, &remap, &here, &emitted);
        emitted[v] = here;
    }
    g.inputs = old.inputs.iter().map(|&v| remap[v]).collect();
    g.outputs = old.outputs.iter().map(|&v| remap[v]).collect();
    g
}

/// Where `a` is in the graph being rebuilt.
fn resolve(a: Arg, remap: &[VarId], here: &[VarId], emitted: &[Vec<VarId>]) -> VarId {
    match a {
        Arg::Old(u) => remap[u],
        Arg::New(k) => here[k],
        Arg::At(u, k) => emitted[u][k],
    }
}

/// A rewrite rule: what replaces node `v`, or `None` where its pattern
/// does not match.
pub(super) type Rule = fn(&View, VarId) -> Option<Rewrite>;

/// Sweeps beyond which the driver stops (each sweep's graph is correct,
/// only less rewritten): a chain of rewrites is as long as a chain of
/// views, a handful.
const MAX_SWEEPS: usize = 64;

/// `g` with `rules` applied until none matches, then dead code removed
/// (`g` as it is where none matched).
pub(super) fn rewrite(g: &Graph, rules: &[Rule]) -> Graph {
    let mut done: Option<Graph> = None;
    for _ in 0..MAX_SWEEPS {
        let now = done.as_ref().unwrap_or(g);
        let plan = sweep(now, rules);
        if plan.is_empty() {
            break;
        }
        done = Some(rebuild(now, plan));
    }
    match done {
        Some(g) => g.eliminate_dead_code(),
        None => g.clone(),
    }
}

/// The plan of one sweep of `rules` over `old`: the first rule that
/// matches each computed node, on the graph as the sweep found it.
fn sweep(old: &Graph, rules: &[Rule]) -> Plan {
    let view = View::new(old);
    let mut plan = Plan::new(old.nodes.len());
    for v in 0..old.nodes.len() {
        if old.nodes[v].prim.is_leaf() {
            continue;
        }
        if let Some(r) = rules.iter().find_map(|rule| rule(&view, v)) {
            plan.set(v, r);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ops::Unary;
    use crate::ir::Options;
    use crate::rules::{Builder, TraceCtx};
    use candle_core::{DType, Device};

    /// `exp(x)` then `n` negations, as built (no pass run on it).
    fn negations(n: usize) -> Graph {
        let b = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = b.borrow_mut();
        let x = b.input(TensorType::new(vec![3], DType::F32));
        let mut y = b.un(Unary::Exp, x).unwrap();
        for _ in 0..n {
            y = b.un(Unary::Neg, y).unwrap();
        }
        b.finish(vec![y]).0
    }

    /// `neg(neg(x))` is `x`.
    fn double_negation(g: &View, v: VarId) -> Option<Rewrite> {
        let neg = |v: VarId| *g.prim(v) == Prim::Unary(Unary::Neg);
        (neg(v) && neg(g.args(v)[0])).then(|| Rewrite::alias(g.args(g.args(v)[0])[0]))
    }

    /// `neg(x)` as `x * -1` (emitted as a literal and a product).
    fn neg_as_affine(g: &View, v: VarId) -> Option<Rewrite> {
        (*g.prim(v) == Prim::Unary(Unary::Neg)).then(|| {
            let ty = g.ty(v).clone();
            Rewrite::emit(vec![(
                Prim::Unary(Unary::Affine(-1.0, 0.0)),
                vec![Arg::Old(g.args(v)[0])],
                ty,
            )])
        })
    }

    fn count(g: &Graph, prim: &Prim) -> usize {
        g.nodes.iter().filter(|n| n.prim == *prim).count()
    }

    #[test]
    fn rules_run_to_a_fixed_point_and_dead_nodes_go() {
        let neg = Prim::Unary(Unary::Neg);
        // five negations: the pairs cancel, one negation stays
        let g = rewrite(&negations(5), &[double_negation]);
        assert_eq!(count(&g, &neg), 1);
        assert_eq!(g.nodes.len(), 3, "input, exp, one negation:\n{g}");
        let g = rewrite(&negations(4), &[double_negation]);
        assert_eq!(count(&g, &neg), 0);
        assert_eq!(g.outputs, vec![1], "the output is exp(x) itself");
        // an emitted node takes the matched node's place, operands remapped
        let g = rewrite(&negations(2), &[neg_as_affine]);
        assert_eq!(count(&g, &neg), 0);
        assert_eq!(count(&g, &Prim::Unary(Unary::Affine(-1.0, 0.0))), 2);
        assert_eq!(g.nodes[3].args, vec![2]);
    }

    #[test]
    fn a_graph_no_rule_matches_comes_back_as_it_was() {
        let g = negations(1);
        let r = rewrite(&g, &[double_negation]);
        assert_eq!(format!("{r}"), format!("{g}"));
    }
}
