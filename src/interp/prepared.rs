//! A graph prepared to run, a type of its own: what `make_graph` returns.
//! It holds the executable the passes made, with its plan and the machine
//! its options resolved to, so holding one says the passes have run, and
//! running it neither prepares nor plans it again; the IR's graph carries
//! no such state.

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
    exe: Executable,
}

impl Prepared {
    /// An executable's graph, run by it.
    pub(crate) fn of(exe: Executable) -> Prepared {
        Prepared { exe }
    }

    fn graph(&self) -> &ir::Graph {
        self.exe.graph()
    }

    /// Every node, in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = NodeView<'_>> {
        self.graph().nodes()
    }

    /// The node with index `v`, if there is one.
    pub fn node(&self, v: usize) -> Option<NodeView<'_>> {
        self.graph().node(v)
    }

    /// The indices of the output values, in output order.
    pub fn outputs(&self) -> &[usize] {
        self.graph().outputs()
    }

    /// The types of the inputs, in argument order.
    pub fn input_types(&self) -> Vec<TensorType> {
        self.graph().input_types()
    }

    /// The types of the outputs, in output order.
    pub fn output_types(&self) -> Vec<TensorType> {
        self.graph().output_types()
    }

    /// Number of equations (nodes that are not inputs, constants or literals).
    pub fn equation_count(&self) -> usize {
        self.graph().equation_count()
    }

    /// Runs the graph on concrete tensors, in the order of the flattened
    /// arguments (as `make_graph` flattened them), and returns its outputs.
    /// Each run goes through the executable as a transform's call does:
    /// on the kernel path and under the memory limit of the options the
    /// function was made with, its plan checked first; random draws come
    /// from the process-wide stream.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.exe.run(inputs)
    }

    /// [`Graph::run`](Prepared::run), also reporting the peak number and
    /// size of values held at once.
    pub fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        self.exe.run_with_stats(inputs)
    }

    /// [`Graph::run`](Prepared::run), also returning the seconds each
    /// computed node took, as `(node index, seconds)`: where a graph spends
    /// its time.
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        self.exe.run_profiled(inputs)
    }

    /// The most bytes a run of the graph holds at once by its plan:
    /// every value alive at the same time (views sharing their operand's
    /// buffer, inputs and captured tensors included) and what the kernel
    /// running at that moment allocates besides its result. A call whose
    /// plan exceeds the memory limit is refused before it runs.
    pub fn planned_peak_bytes(&self) -> usize {
        self.exe.peak()
    }
}

impl fmt::Display for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.graph().fmt(f)
    }
}
