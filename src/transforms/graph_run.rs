//! Running a graph from [`make_graph`](super::make_graph) on concrete tensors.

use crate::error::Result;
use crate::interp::exec::Executable;
use crate::interp::{NodeTimes, RunStats};
use crate::ir::Graph;
use candle_core::Tensor;

/// Running a graph from [`make_graph`](super::make_graph) on concrete tensors, in the order
/// of the flattened arguments (as `make_graph` flattened them). Each run
/// goes through the executable as a transform's call does (the passes,
/// the memory check against the machine's available memory); random
/// draws come from the process-wide stream.
impl Graph {
    /// Runs the graph and returns its outputs.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        Executable::new(self).named("Graph::run").run(inputs)
    }

    /// [`Graph::run`], also reporting the peak number and size of values
    /// held at once.
    pub fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        Executable::new(self).named("Graph::run").run_with_stats(inputs)
    }

    /// [`Graph::run`], also returning the seconds each computed node took,
    /// as `(node index, seconds)`: where a graph spends its time.
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        Executable::new(self).named("Graph::run").run_profiled(inputs)
    }

    /// The most bytes a run of the graph holds at once by its plan:
    /// every value alive at the same time (views sharing their operand's
    /// buffer, inputs and captured tensors included) and what the kernel
    /// running at that moment allocates besides its result. A call whose
    /// plan exceeds the memory limit is refused before it runs.
    pub fn planned_peak_bytes(&self) -> usize {
        Executable::new(self).peak()
    }
}
