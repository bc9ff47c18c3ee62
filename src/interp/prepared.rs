//! A graph prepared to run, a type of its own: what `make_graph` returns.
//! Only an executable's passes make one, so holding one says the passes
//! have run, and running it does not prepare it again; the IR's
//! graph carries no such state.

use super::exec::Executable;
use super::{NodeTimes, RunStats};
use crate::error::Result;
use crate::ir::{self, NodeView, TensorType};
use candle_core::Tensor;
use std::fmt;

/// A traced function, as [`make_graph`](crate::make_graph) returns it,
/// prepared to run: nodes in topological order, the input nodes in
/// argument order, and the output values. It prints like a jaxpr, can be
/// inspected node by node ([`Graph::nodes`](Prepared::nodes)) and run
/// ([`Graph::run`](Prepared::run)); only the crate builds one, so every
/// graph a user holds is well formed.
#[derive(Clone, Debug)]
pub struct Prepared {
    graph: ir::Graph,
}

impl Prepared {
    /// A graph the passes have made already (an executable's), as it is.
    pub(crate) fn of_prepared(graph: ir::Graph) -> Prepared {
        Prepared { graph }
    }

    /// Every node, in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = NodeView<'_>> {
        self.graph.nodes()
    }

    /// The node with index `v`, if there is one.
    pub fn node(&self, v: usize) -> Option<NodeView<'_>> {
        self.graph.node(v)
    }

    /// The indices of the output values, in output order.
    pub fn outputs(&self) -> &[usize] {
        self.graph.outputs()
    }

    /// The types of the inputs, in argument order.
    pub fn input_types(&self) -> Vec<TensorType> {
        self.graph.input_types()
    }

    /// The types of the outputs, in output order.
    pub fn output_types(&self) -> Vec<TensorType> {
        self.graph.output_types()
    }

    /// Number of equations (nodes that are not inputs, constants or literals).
    pub fn equation_count(&self) -> usize {
        self.graph.equation_count()
    }

    /// Runs the graph on concrete tensors, in the order of the flattened
    /// arguments (as `make_graph` flattened them), and returns its outputs.
    /// Each run goes through the executable as a transform's call does
    /// (the memory check against the machine's available memory); random
    /// draws come from the process-wide stream.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.executable().run(inputs)
    }

    /// [`Graph::run`](Prepared::run), also reporting the peak number and
    /// size of values held at once.
    pub fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        self.executable().run_with_stats(inputs)
    }

    /// [`Graph::run`](Prepared::run), also returning the seconds each
    /// computed node took, as `(node index, seconds)`: where a graph spends
    /// its time.
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        self.executable().run_profiled(inputs)
    }

    /// The most bytes a run of the graph holds at once by its plan:
    /// every value alive at the same time (views sharing their operand's
    /// buffer, inputs and captured tensors included) and what the kernel
    /// running at that moment allocates besides its result. A call whose
    /// plan exceeds the memory limit is refused before it runs.
    pub fn planned_peak_bytes(&self) -> usize {
        self.executable().peak()
    }

    fn executable(&self) -> Executable {
        Executable::prepared(self.graph.clone()).named("Graph::run")
    }
}

impl fmt::Display for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.graph.fmt(f)
    }
}
