//! The one door through which a graph runs. An [`Executable`] takes a
//! traced, transformed graph through the fixed list of passes
//! ([`super::passes::prepare`]), works out its planned peak once, checks it
//! against the memory limit before any kernel runs, carries the seed of
//! its random draws, and runs. Every entry point uses it: a transform's
//! call, `vjp` and its pullback, `linearize` and its linear map,
//! `Graph::run`, the planner's timing runs and the DP step.

use super::{malloc, mix, passes, run_inner, NodeTimes, RunStats};
use crate::error::{Error, Result};
use crate::ir::{Graph, Options};
use crate::kernels::{copies::Copies, Path};
use crate::rules::{facts, memory};
use candle_core::Tensor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The process-wide random stream: its seed and the draws taken from it.
static SEED: AtomicU64 = AtomicU64::new(0x5eed);
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// Seeds the process-wide random stream (see `crate::manual_seed`).
pub(crate) fn manual_seed(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    DRAWS.store(0, Ordering::Relaxed);
}

/// Below this planned peak a run does not read the machine's available
/// memory (a file read per call would cost more than a small program).
const UNCHECKED_BYTES: usize = 256 << 20;

/// A graph ready to run: prepared, planned and seeded.
#[derive(Debug)]
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
    /// The most bytes a run may hold (`None`: the machine's available
    /// memory).
    limit: Option<usize>,
    /// Whether it runs the crate's CPU kernels or candle's operations only.
    path: Path,
}

impl Executable {
    /// `g` through the passes that prepare a graph to run, its plan worked
    /// out; seeded from the process-wide stream, with no limit but the
    /// machine's memory.
    pub(crate) fn new(g: &Graph) -> Executable {
        Self::prepared(passes::prepare(g))
    }

    /// A graph the passes have already prepared, as it is.
    pub(crate) fn prepared(graph: Graph) -> Executable {
        Executable {
            op: "call",
            peak: memory::planned_peak(&graph),
            floor: memory::floor(&graph),
            random: facts::draws_random(&graph),
            graph,
            seed: None,
            calls: Arc::default(),
            limit: None,
            path: portable_path(None),
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

    /// Refuses to run where the plan needs more than `limit` bytes (`None`:
    /// the machine's available memory).
    pub(crate) fn limit(mut self, limit: Option<usize>) -> Executable {
        self.limit = limit;
        self
    }

    /// Runs candle's operations only where `portable` says so (`None`:
    /// as the `CANDLE_FUNC_PORTABLE` variable said when it was made).
    pub(crate) fn portable(mut self, portable: Option<bool>) -> Executable {
        if portable.is_some() {
            self.path = portable_path(portable);
        }
        self
    }

    /// The memory limit and path a transform's options set.
    pub(crate) fn options(self, o: &Options) -> Executable {
        self.limit(o.memory_limit).portable(o.portable)
    }

    /// The prepared graph, taken out.
    pub(crate) fn into_prepared(self) -> super::Prepared {
        super::Prepared::of_prepared(self.graph)
    }

    /// The bytes the graph holds at its peak by its plan.
    pub(crate) fn peak(&self) -> usize {
        self.peak
    }

    /// An [`Error::Memory`] where the plan needs more than the limit.
    pub(crate) fn check(&self) -> Result<()> {
        if fits(self.peak, self.limit) {
            return Ok(());
        }
        Err(Error::Memory {
            op: self.op,
            needed: self.peak,
            limit: effective_limit(self.limit).unwrap_or(usize::MAX),
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
            Some(seed) => mix(seed, self.calls.fetch_add(1, Ordering::Relaxed)),
            None => mix(SEED.load(Ordering::Relaxed), DRAWS.fetch_add(1, Ordering::Relaxed)),
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
        malloc::keep(self.peak);
        run_inner(
            &self.graph,
            inputs,
            self.next_seed(),
            None,
            (&Copies::default(), self.path),
        )
    }

    /// [`Executable::run`], also returning the time each node took.
    pub(crate) fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        self.check()?;
        malloc::keep(self.peak);
        let mut times = Vec::new();
        let seed = self.next_seed();
        let (outs, _) = run_inner(
            &self.graph,
            inputs,
            seed,
            Some(&mut times),
            (&Copies::default(), self.path),
        )?;
        Ok((outs, times))
    }
}

/// The variable that makes the CPU take candle's operations only (the path
/// every other device takes) when set to `1` or `true`, for a function
/// whose options do not say ([`Options::portable`](crate::Options::portable));
/// read when a function is compiled for a signature.
pub const PORTABLE_ENV: &str = "CANDLE_FUNC_PORTABLE";

/// The path a run takes: `portable` where given, else the variable's.
pub(crate) fn portable_path(portable: Option<bool>) -> Path {
    let env = || {
        std::env::var(PORTABLE_ENV)
            .map(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"))
            .unwrap_or(false)
    };
    match portable.unwrap_or_else(env) {
        true => Path::Portable,
        false => Path::Fast,
    }
}

/// Whether a plan needing `needed` bytes fits `limit` (`None`: the
/// machine's available memory, read only for a plan above
/// `UNCHECKED_BYTES`, and no limit where it cannot be read).
pub(crate) fn fits(needed: usize, limit: Option<usize>) -> bool {
    match limit {
        Some(l) => needed <= l,
        None if needed < UNCHECKED_BYTES => true,
        None => available_memory().is_none_or(|l| needed <= l),
    }
}

/// The limit a plan is checked against: `limit`, else the machine's
/// available memory (`None` where it cannot be read).
pub(crate) fn effective_limit(limit: Option<usize>) -> Option<usize> {
    limit.or_else(available_memory)
}

/// The memory a graph's structure is planned for while it is traced:
/// `limit`, else the machine's total memory, read once per process. Not
/// what is free: a traced graph is cached, and must not depend on how
/// busy the machine was when it was first traced; the run checks its
/// plan against what is available then.
pub(crate) fn trace_limit(limit: Option<usize>) -> Option<usize> {
    static TOTAL: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    limit.or_else(|| *TOTAL.get_or_init(|| kib_field("/proc/meminfo", "MemTotal:")))
}

/// An error naming `op`, `what` and the size unless `elems` elements of
/// `elem_bytes` bytes fit in usize and in the machine's available memory:
/// the check before a host allocation sized from user input (a config
/// field, a loop's trip count), which would otherwise abort the process
/// where it fails.
pub(crate) fn check_host_alloc(op: &str, what: &str, elems: usize, elem_bytes: usize) -> Result<()> {
    let Some(bytes) = elems.checked_mul(elem_bytes) else {
        return Err(Error::Config {
            msg: format!("{op}: {what} of {elems} elements of {elem_bytes} bytes overflows usize"),
        });
    };
    match available_memory() {
        Some(avail) if bytes > avail => Err(Error::Config {
            msg: format!(
                "{op}: {what} of {elems} elements would take {bytes} bytes, more than the {avail} bytes this machine has available"
            ),
        }),
        _ => Ok(()),
    }
}

/// [`checked_elems`] then [`check_host_alloc`]: `shape` of `elem_bytes`
/// each fits in usize and in the machine's memory.
pub(crate) fn check_host_shape(op: &str, what: &str, shape: &[usize], elem_bytes: usize) -> Result<()> {
    let n = checked_elems(op, what, shape)?;
    check_host_alloc(op, what, n, elem_bytes)
}

/// A vector with room for `n` values, or an error naming `op` and `what`
/// where the allocator refuses it (the portable backstop of
/// [`check_host_alloc`], which reads the available memory on Linux only).
pub(crate) fn host_vec<T>(op: &str, what: &str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| Error::Config {
        msg: format!("{op}: {what} of {n} elements cannot be allocated: {e}"),
    })?;
    Ok(v)
}

/// The element count of `shape`, or an error naming `op` and `what` where
/// it overflows usize.
pub(crate) fn checked_elems(op: &str, what: &str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Config {
            msg: format!("{op}: {what} of shape {shape:?} has more elements than usize holds"),
        })
}

/// `MemAvailable` from `/proc/meminfo` (Linux), in bytes.
fn available_memory() -> Option<usize> {
    kib_field("/proc/meminfo", "MemAvailable:")
}

/// The process's resident memory now (`VmRSS` of `/proc/self/status`,
/// Linux), in bytes, once the heap's free pages are returned.
pub(crate) fn resident_memory() -> Option<usize> {
    malloc::trim();
    kib_field("/proc/self/status", "VmRSS:")
}

/// The kibibytes a `/proc` file states on the line starting `key`, in bytes.
fn kib_field(file: &str, key: &str) -> Option<usize> {
    let info = std::fs::read_to_string(file).ok()?;
    let line = info.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
