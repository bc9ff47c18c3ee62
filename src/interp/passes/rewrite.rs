//! The one driver of the pattern passes (as tinygrad's `PatternMatcher`):
//! a pass is a table of rules, each a few lines matching one pattern of
//! primitives at a node and saying what takes its place. The driver
//! sweeps the graph in order, rebuilding it with the first rule that
//! matches each node, and sweeps again until no rule matches (a rewrite
//! may make its readers match: a transpose sunk past one map meets the
//! next), then drops what nothing reads. Rules see the graph as it was at
//! the start of their sweep, with its readers counted; bodies are reached
//! by `prepare`'s one recursion, which runs the passes on each body.

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

/// An operand of a node a rule emits: a node of the swept graph, or one
/// the rule emitted before it.
#[derive(Clone, Copy, Debug)]
pub(super) enum Arg {
    Old(VarId),
    New(usize),
}

/// What a rule puts in a node's place.
#[derive(Debug)]
pub(super) enum Rewrite {
    /// An earlier value of the swept graph, as it is.
    Alias(VarId),
    /// New nodes, the last of which takes the node's place.
    Emit(Vec<(Prim, Vec<Arg>, TensorType)>),
}

impl Rewrite {
    /// One new node in the matched node's place.
    pub(super) fn node(prim: Prim, args: Vec<Arg>, ty: TensorType) -> Rewrite {
        Rewrite::Emit(vec![(prim, args, ty)])
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
        match sweep(done.as_ref().unwrap_or(g), rules) {
            Some(next) => done = Some(next),
            None => break,
        }
    }
    match done {
        Some(g) => g.eliminate_dead_code(),
        None => g.clone(),
    }
}

/// One sweep of `rules` over `old`, or `None` where no rule matched (the
/// matches are found first, so a sweep that finds none builds nothing).
fn sweep(old: &Graph, rules: &[Rule]) -> Option<Graph> {
    let view = View::new(old);
    let found: Vec<Option<Rewrite>> = (0..old.nodes.len())
        .map(|v| match old.nodes[v].prim.is_leaf() {
            true => None,
            false => rules.iter().find_map(|rule| rule(&view, v)),
        })
        .collect();
    if found.iter().all(Option::is_none) {
        return None;
    }
    let mut g = Graph {
        consts: old.consts.clone(),
        ..Graph::default()
    };
    let mut remap: Vec<VarId> = Vec::with_capacity(old.nodes.len());
    for (n, found) in old.nodes.iter().zip(found) {
        let to = match found {
            Some(Rewrite::Alias(u)) => remap[u],
            Some(Rewrite::Emit(nodes)) => {
                let first = g.nodes.len();
                for (prim, args, ty) in nodes {
                    let args = args
                        .iter()
                        .map(|a| match *a {
                            Arg::Old(u) => remap[u],
                            Arg::New(k) => first + k,
                        })
                        .collect();
                    g.add_node(prim, args, ty);
                }
                g.nodes.len() - 1
            }
            None => {
                let args = n.args.iter().map(|&a| remap[a]).collect();
                g.nodes.push(Node { args, ..n.clone() });
                g.nodes.len() - 1
            }
        };
        remap.push(to);
    }
    g.inputs = old.inputs.iter().map(|&v| remap[v]).collect();
    g.outputs = old.outputs.iter().map(|&v| remap[v]).collect();
    Some(g)
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
        let b = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu));
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
        (neg(v) && neg(g.args(v)[0])).then(|| Rewrite::Alias(g.args(g.args(v)[0])[0]))
    }

    /// `neg(x)` as `x * -1` (emitted as a literal and a product).
    fn neg_as_affine(g: &View, v: VarId) -> Option<Rewrite> {
        (*g.prim(v) == Prim::Unary(Unary::Neg)).then(|| {
            let ty = g.ty(v).clone();
            Rewrite::Emit(vec![(
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
