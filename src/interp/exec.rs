//! The one door through which a graph runs. An [`Executable`] takes a
//! traced, transformed graph through the fixed list of passes
//! ([`super::passes::prepare`]), works out its planned peak once, checks it
//! against the memory limit before any kernel runs, carries the seed of
//! its random draws, and runs. Every entry point uses it: a transform's
//! call, `vjp` and its pullback, `linearize` and its linear map,
//! `Graph::run`, the planner's timing runs and the DP step.

use super::{passes, run_inner, NodeTimes, RunStats};
use crate::env::{self, Machine};
use crate::error::{Error, Result};
use crate::ir::Graph;
use crate::kernels::copies::Copies;
use crate::rules::{facts, memory};
use candle_core::Tensor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A graph ready to run: prepared, planned and seeded.
#[derive(Clone, Debug)]
pub(crate) struct Executable {
    graph: Graph,
    /// What runs it, for its errors (`call`, `vjp pullback`, ...).
    op: &'static str,
    /// The bytes `graph` holds at its peak by its plan.
    peak: usize,
    /// The bytes its arguments, captured tensors and results take.
    floor: usize,
    /// Whether running it draws random numbers.
    random: bool,
    /// The seed of the transform that made it, if it has one; `None`
    /// draws from the process-wide stream.
    seed: Option<u64>,
    /// The count of runs drawn from `seed` (shared by every graph of one
    /// transformed function, so each call draws anew).
    calls: Arc<AtomicU64>,
    /// The kernel path and the memory limit it runs under, resolved from
    /// the caller's options.
    machine: Machine,
    /// The loops that run side by side (`rules::memory::partners`), found
    /// once: the plan counts them so, and every run runs them so.
    partners: Vec<Option<usize>>,
}

impl Executable {
    /// `g` through the passes that prepare a graph to run, its plan worked
    /// out, to run on `machine`; seeded from the process-wide stream.
    pub(crate) fn new(g: &Graph, machine: Machine) -> Executable {
        Self::prepared(passes::prepare(g), machine)
    }

    /// A graph the passes have already prepared, as it is.
    pub(crate) fn prepared(graph: Graph, machine: Machine) -> Executable {
        let partners = memory::partners(&graph);
        Executable {
            op: "call",
            peak: memory::planned_peak_with(&graph, &partners).0,
            partners,
            floor: memory::floor(&graph),
            random: facts::draws_random(&graph),
            graph,
            seed: None,
            calls: Arc::default(),
            machine,
        }
    }

    /// Draws from `seed` (and the count of runs `calls`) instead of the
    /// process-wide stream, where `seed` is given.
    pub(crate) fn seeded(mut self, seed: Option<u64>, calls: Arc<AtomicU64>) -> Executable {
        self.seed = seed;
        self.calls = calls;
        self
    }

    /// Names what runs the graph in its errors.
    pub(crate) fn named(mut self, op: &'static str) -> Executable {
        self.op = op;
        self
    }

    /// The prepared graph, taken out.
    pub(crate) fn into_prepared(self) -> super::Prepared {
        super::Prepared::of(self)
    }

    /// The prepared graph.
    pub(crate) fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The bytes the graph holds at its peak by its plan.
    pub(crate) fn peak(&self) -> usize {
        self.peak
    }

    /// An [`Error::Memory`] where the plan needs more than the limit.
    pub(crate) fn check(&self) -> Result<()> {
        if self.machine.fits(self.peak) {
            return Ok(());
        }
        Err(Error::Memory {
            op: self.op,
            needed: self.peak,
            limit: self.machine.run_bound(),
            floor: self.floor,
        })
    }

    /// The seed of one run (none taken when the graph draws nothing, so
    /// both streams stay where they are).
    fn next_seed(&self) -> u64 {
        if !self.random {
            return 0;
        }
        match self.seed {
            Some(seed) => env::mix(seed, self.calls.fetch_add(1, Ordering::Relaxed)),
            None => env::process_seed(),
        }
    }

    /// Checks the plan, then runs the graph on `inputs`.
    pub(crate) fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.run_with_stats(inputs).map(|(outs, _)| outs)
    }

    /// [`Executable::run`], also reporting the peak number and size of live
    /// values.
    pub(crate) fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        self.check()?;
        env::keep_freed(self.peak);
        run_inner(
            (&self.graph, &self.partners),
            inputs,
            self.next_seed(),
            None,
            (&Copies::default(), self.machine.path),
        )
    }

    /// [`Executable::run`], also returning the time each node took.
    pub(crate) fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        self.check()?;
        env::keep_freed(self.peak);
        let mut times = Vec::new();
        let seed = self.next_seed();
        let (outs, _) = run_inner(
            (&self.graph, &self.partners),
            inputs,
            seed,
            Some(&mut times),
            (&Copies::default(), self.machine.path),
        )?;
        Ok((outs, times))
    }
}
