//! The graph IR: typed values, primitive equations, and a printer.
//!
//! A [`Graph`] is a list of nodes in topological order. Every value is a
//! node: inputs (`Prim::Input`), captured candle tensors (`Prim::Const`),
//! scalar literals (`Prim::Scalar`) and equations alike, so a [`VarId`] is
//! just an index into the node list. A node yields one tensor, but for the
//! primitives with bodies (map, scan, cond, while), which yield several
//! (JAX's `multiple_results`): their node is a tuple (its type is the bytes
//! of its results, [`tuple_type`]) and each result is read by a
//! `Prim::Get(k)` node after it, a view of that result, typed as it is
//! (tinygrad's `GEP`). Only a `Get` reads a tuple; a tuple is never an
//! input or an output of a graph.

pub(crate) mod conv;
mod geom;
pub(crate) mod ops;
pub(crate) mod options;
mod prim;
mod print;
pub(crate) mod views;

pub use geom::ConvGeom;
pub use options::{ConvRoute, Options, Randomness, Schedule};
pub use prim::CustomKernel;
pub(crate) use prim::{tuple_type, Cond, CustomGraphs, CustomOp, Fused, Map, Prim, Scan, While};

use candle_core::{DType, Tensor};

/// Index of a value (a node) inside a [`Graph`] or a graph under construction.
pub(crate) type VarId = usize;

/// Shape and dtype of a value: everything the transforms need to know
/// about a tensor without its data.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
}

impl TensorType {
    /// A type from a shape and a dtype.
    pub fn new(shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        TensorType {
            shape: shape.into(),
            dtype,
        }
    }

    /// The type of a concrete tensor.
    pub fn of(t: &Tensor) -> Self {
        TensorType::new(t.dims(), t.dtype())
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (saturating at `usize::MAX` rather than
    /// wrapping for a shape too large to exist).
    pub fn elem_count(&self) -> usize {
        self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// The same shape with another dtype.
    pub(crate) fn cast(mut self, dtype: DType) -> TensorType {
        self.dtype = dtype;
        self
    }

    /// The same dtype with another shape.
    pub fn with_shape(&self, shape: impl Into<Vec<usize>>) -> Self {
        TensorType::new(shape, self.dtype)
    }
}

/// One equation: a primitive applied to earlier values.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    /// What the node computes.
    pub(crate) prim: Prim,
    /// Operands, all earlier in the graph.
    pub(crate) args: Vec<VarId>,
    /// The type of the result (inferred and checked when the node was added).
    pub(crate) ty: TensorType,
}

/// A traced function: nodes in topological order, the input nodes in
/// argument order, and the output values. Transforms rewrite it; the
/// interpreter's passes prepare it to run (`interp::Prepared`, the graph
/// a user holds).
#[derive(Clone, Debug, Default)]
pub(crate) struct Graph {
    /// All values, topologically ordered.
    pub(crate) nodes: Vec<Node>,
    /// The `Prim::Input` nodes, in argument order.
    pub(crate) inputs: Vec<VarId>,
    /// The results, in output order (a value may appear more than once).
    pub(crate) outputs: Vec<VarId>,
    /// candle tensors captured while tracing, referenced by `Prim::Const`.
    pub(crate) consts: Vec<Tensor>,
}

/// A read-only view of one node of a graph ([`crate::graph::Graph`]).
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    index: usize,
    node: &'a Node,
}

impl NodeView<'_> {
    /// The node's index (the `%n` of the printout).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The primitive's name with its parameters, as the printout shows it
    /// (`conv2d[k=[3, 3],...]`, `matmul`, `input[0]`).
    pub fn name(&self) -> String {
        self.node.prim.name()
    }

    /// The indices of the operands.
    pub fn args(&self) -> &[usize] {
        &self.node.args
    }

    /// The result's shape and dtype.
    pub fn ty(&self) -> &TensorType {
        &self.node.ty
    }

    /// Whether the node is an input, a captured tensor or a literal rather
    /// than a computed value.
    pub fn is_leaf(&self) -> bool {
        self.node.prim.is_leaf()
    }
}

impl Graph {
    /// The type of a value.
    pub(crate) fn ty(&self, v: VarId) -> &TensorType {
        &self.nodes[v].ty
    }

    /// Appends a node (its operands already in the graph) and returns its
    /// index: what a pass that rebuilds a graph writes its nodes with.
    pub(crate) fn add_node(&mut self, prim: Prim, args: Vec<VarId>, ty: TensorType) -> VarId {
        self.nodes.push(Node { prim, args, ty });
        self.nodes.len() - 1
    }

    /// Every node, in topological order.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = NodeView<'_>> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(index, node)| NodeView { index, node })
    }

    /// The node with index `v`, if there is one.
    pub(crate) fn node(&self, v: usize) -> Option<NodeView<'_>> {
        self.nodes.get(v).map(|node| NodeView { index: v, node })
    }

    /// The indices of the output values, in output order.
    pub(crate) fn outputs(&self) -> &[usize] {
        &self.outputs
    }

    /// The types of the inputs, in argument order.
    pub(crate) fn input_types(&self) -> Vec<TensorType> {
        self.inputs.iter().map(|&v| self.nodes[v].ty.clone()).collect()
    }

    /// The types of the outputs, in output order.
    pub(crate) fn output_types(&self) -> Vec<TensorType> {
        self.outputs.iter().map(|&v| self.nodes[v].ty.clone()).collect()
    }

    /// Number of equations (nodes that are not inputs, constants or literals).
    pub(crate) fn equation_count(&self) -> usize {
        self.nodes.iter().filter(|n| !n.prim.is_leaf()).count()
    }

    /// Removes every node that no output depends on, keeping inputs (so the
    /// calling convention is unchanged) and renumbering the rest.
    pub(crate) fn eliminate_dead_code(&self) -> Graph {
        let mut live = vec![false; self.nodes.len()];
        for &o in &self.outputs {
            live[o] = true;
        }
        for &i in &self.inputs {
            live[i] = true;
        }
        for v in (0..self.nodes.len()).rev() {
            if live[v] {
                for &a in &self.nodes[v].args {
                    live[a] = true;
                }
            }
        }
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut g = Graph {
            consts: self.consts.clone(),
            ..Graph::default()
        };
        for (v, node) in self.nodes.iter().enumerate() {
            if !live[v] {
                continue;
            }
            remap[v] = g.nodes.len();
            let mut node = node.clone();
            for a in node.args.iter_mut() {
                *a = remap[*a];
            }
            g.nodes.push(node);
        }
        g.inputs = self.inputs.iter().map(|&v| remap[v]).collect();
        g.outputs = self.outputs.iter().map(|&v| remap[v]).collect();
        g
    }

    /// Which values depend on a flagged input (`flagged[k]` for the k-th
    /// input; missing flags are false): the batched values of a `vmap`,
    /// the values a gradient flows through.
    pub(crate) fn downstream_of(&self, flagged: &[bool]) -> Vec<bool> {
        let mut dep = vec![false; self.nodes.len()];
        for (k, &v) in self.inputs.iter().enumerate() {
            dep[v] = flagged.get(k).copied().unwrap_or(false);
        }
        for (v, n) in self.nodes.iter().enumerate() {
            if !n.prim.is_leaf() {
                dep[v] = n.args.iter().any(|&a| dep[a]);
            }
        }
        dep
    }

    /// For each node, the later node that may run beside it: a pair of
    /// loops (maps, scans, while loops: long, and sequential inside) that
    /// `ok` accepts, where the later one reads only values computed before
    /// the first, so neither reads the other (the two directions of a
    /// bidirectional LSTM, and their gradients). Each loop pairs at most
    /// once, with the first such loop after it. `rules::memory::partners`
    /// says which loops may run beside another; the interpreter runs its
    /// pairs at once on the CPU and the memory plan counts the partner from
    /// the first's start, both from that one answer.
    pub(crate) fn partners_where(&self, ok: impl Fn(usize) -> bool) -> Vec<Option<usize>> {
        let loops: Vec<usize> = (0..self.nodes.len()).filter(|&v| ok(v)).collect();
        let mut partner = vec![None; self.nodes.len()];
        let mut taken = vec![false; self.nodes.len()];
        for (k, &v) in loops.iter().enumerate() {
            if taken[v] {
                continue;
            }
            let ready = |u: usize| !taken[u] && self.nodes[u].args.iter().all(|&a| a < v);
            if let Some(&u) = loops[k + 1..].iter().find(|&&u| ready(u)) {
                partner[v] = Some(u);
                taken[u] = true;
            }
        }
        partner
    }

    /// The values that die at node `v` (`last` is [`Graph::last_uses`]):
    /// its operands read there for the last time, and `v` itself where
    /// nothing reads it (an unused input), each once. What the interpreter
    /// frees after `v` and the memory plan stops counting.
    pub(crate) fn dead_at(&self, v: VarId, last: &[usize]) -> Vec<VarId> {
        let mut dead: Vec<VarId> = self.nodes[v].args.iter().copied().filter(|&a| last[a] == v).collect();
        if last[v] == 0 {
            dead.push(v);
        }
        dead.sort_unstable();
        dead.dedup();
        dead
    }

    /// For each value, the index of the last node that reads it (outputs
    /// count as read at the very end): the interpreter frees a value there.
    pub(crate) fn last_uses(&self) -> Vec<usize> {
        let mut last = vec![0usize; self.nodes.len()];
        for (v, node) in self.nodes.iter().enumerate() {
            for &a in &node.args {
                last[a] = v;
            }
        }
        for &o in &self.outputs {
            last[o] = usize::MAX;
        }
        last
    }
}
