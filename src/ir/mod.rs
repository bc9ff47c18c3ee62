//! The graph IR: typed values, primitive equations, and a printer.
//!
//! A [`Graph`] is a list of nodes in topological order. Every value is a
//! node: inputs (`Prim::Input`), captured candle tensors (`Prim::Const`),
//! scalar literals (`Prim::Scalar`) and equations alike, so a [`VarId`] is
//! just an index into the node list. One node yields one tensor; primitives
//! that would naturally yield two (max-pool with its argmax) are split into
//! two primitives instead, which keeps every transform rule single-output.

mod prim;
mod print;
mod simplify;

pub use prim::Prim;

use candle_core::{DType, Tensor};

/// Index of a value (a node) inside a [`Graph`] or a graph under construction.
pub type VarId = usize;

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

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The same dtype with another shape.
    pub fn with_shape(&self, shape: impl Into<Vec<usize>>) -> Self {
        TensorType::new(shape, self.dtype)
    }
}

/// One equation: a primitive applied to earlier values.
#[derive(Clone, Debug)]
pub struct Node {
    /// What the node computes.
    pub prim: Prim,
    /// Operands, all earlier in the graph.
    pub args: Vec<VarId>,
    /// The type of the result (inferred and checked when the node was added).
    pub ty: TensorType,
}

/// A traced function: nodes in topological order, the input nodes in
/// argument order, and the output values.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// All values, topologically ordered.
    pub nodes: Vec<Node>,
    /// The `Prim::Input` nodes, in argument order.
    pub inputs: Vec<VarId>,
    /// The results, in output order (a value may appear more than once).
    pub outputs: Vec<VarId>,
    /// candle tensors captured while tracing, referenced by `Prim::Const`.
    pub consts: Vec<Tensor>,
}

impl Graph {
    /// The type of a value.
    pub fn ty(&self, v: VarId) -> &TensorType {
        &self.nodes[v].ty
    }

    /// The types of the inputs, in argument order.
    pub fn input_types(&self) -> Vec<TensorType> {
        self.inputs.iter().map(|&v| self.nodes[v].ty.clone()).collect()
    }

    /// The types of the outputs, in output order.
    pub fn output_types(&self) -> Vec<TensorType> {
        self.outputs.iter().map(|&v| self.nodes[v].ty.clone()).collect()
    }

    /// Number of equations (nodes that are not inputs, constants or literals).
    pub fn equation_count(&self) -> usize {
        self.nodes.iter().filter(|n| !n.prim.is_leaf()).count()
    }

    /// Removes every node that no output depends on, keeping inputs (so the
    /// calling convention is unchanged) and renumbering the rest.
    pub fn eliminate_dead_code(&self) -> Graph {
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

    /// For each value, the index of the last node that reads it (outputs
    /// count as read at the very end): the interpreter frees a value there.
    pub fn last_uses(&self) -> Vec<usize> {
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
