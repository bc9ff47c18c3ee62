//! Options as values: what a transform was asked for ([`Options`], every
//! field optional) and what it resolved to ([`Opts`], read by the rules and
//! carried by `Map` nodes). Process-wide defaults live in
//! `crate::transforms::settings`; here are only the types.

use crate::env::Machine;
use crate::error::{Error, Result};
use std::str::FromStr;

/// How a convolution with batched input and batched weight is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ConvRoute {
    /// Fold the batch into the channels and call a grouped convolution with
    /// `groups = B * groups` (what `torch.func` and JAX do).
    Grouped,
    /// Opacus's formulation: im2col, then one GEMM per model (ungrouped) or
    /// one batched matmul per group; each example's weight gradient by one
    /// primitive (shifted GEMMs for stride 1 on the CPU).
    #[default]
    Unfold,
    /// The unbatched convolution once per example, stacked: the correctness
    /// oracle, and the way to turn the convolution batching rule off.
    Loop,
    /// The fastest of the above for the shape and device, measured once per
    /// shape signature (see [`auto_choices`](crate::auto_choices)).
    Auto,
}

impl FromStr for ConvRoute {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "grouped" => Ok(ConvRoute::Grouped),
            "unfold" => Ok(ConvRoute::Unfold),
            "loop" => Ok(ConvRoute::Loop),
            "auto" => Ok(ConvRoute::Auto),
            other => Err(Error::Config {
                msg: format!("unknown conv route {other:?}; expected grouped, unfold, loop or auto"),
            }),
        }
    }
}

/// What random operations (dropout) do under `vmap`, as `torch.func.vmap`'s
/// `randomness` option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Randomness {
    /// Refuse to trace a random operation (the default).
    #[default]
    Error,
    /// One draw shared by every example.
    Same,
    /// An independent draw per example.
    Different,
}

/// How a `vmap` runs its batch, as a whole: the batched graph (every
/// primitive through its batching rule), or the unbatched graph once per
/// example (its own kernels, one example's data in cache at a time, the
/// results stacked), or per segment (the convolutions per example, a
/// linear head batched), or whichever measures fastest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Schedule {
    /// The batched graph for a small program; for a large one (many
    /// megabytes of batched values) the fastest schedule, measured once per
    /// program, batch size (to the next power of two) and device (see
    /// [`schedule_choices`](crate::schedule_choices)).
    #[default]
    Auto,
    /// The batched graph.
    Batched,
    /// The unbatched graph once per example. A program that draws random
    /// numbers, or with an output that does not depend on the batch, runs
    /// batched instead. Differentiating the vmapped function runs each
    /// example's forward again for every operand's gradient (the map's
    /// VJP is a map per operand), which `Auto` accounts for by batching
    /// inside a differentiated trace. On the CPU the examples run as many
    /// at once as rayon's pool has threads (where the transform is
    /// called), each with its own seed and row, so the results are those
    /// of one at a time; the memory plan counts one example per thread.
    PerExample,
    /// A schedule per segment: the program up to and including its last
    /// batched convolution (and the pooling and reshapes after it, up to
    /// where the fewest bytes cross) once per example, the rest (a linear
    /// head, a loss) batched. A program without a batched convolution runs
    /// batched, one with nothing batched after its convolutions runs as
    /// `PerExample`, and one that cannot run per example (see there) runs
    /// batched.
    ConvsPerExample,
}

/// The options of one transform, each unset by default. An unset route,
/// strict mode or seed is taken from the enclosing transform (when the
/// transform runs inside another's trace), else from the process-wide
/// setting ([`set_conv_route`](crate::set_conv_route), the
/// `CANDLE_FUNC_CONV_ROUTE` variable, [`set_strict`](crate::set_strict),
/// [`manual_seed`](crate::manual_seed)). `randomness` and `chunk_size`
/// belong to one `vmap` and are not inherited.
///
/// Each setting is a public field (`None`: unset) with a builder method of
/// the same name.
///
/// ```
/// use candle_func::{ConvRoute, Options};
/// let opts = Options::new().conv_route(ConvRoute::Loop).strict(true).seed(7);
/// assert_eq!(opts.conv_route, Some(ConvRoute::Loop));
/// assert_eq!(opts.memory_limit, None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Options {
    /// How a convolution with batched input and weight is lowered.
    pub conv_route: Option<ConvRoute>,
    /// Whether a primitive without a batching rule is an error.
    pub strict: Option<bool>,
    /// What random operations do under `vmap`.
    pub randomness: Option<Randomness>,
    /// A `vmap`'s batch in chunks of this many examples.
    pub chunk_size: Option<usize>,
    /// The seed of the random draws.
    pub seed: Option<u64>,
    /// How a `vmap` runs its batch.
    pub schedule: Option<Schedule>,
    /// The most bytes a call may hold at once.
    pub memory_limit: Option<usize>,
    /// Whether the CPU runs candle's operations only, as every other
    /// device does, instead of the crate's own kernels.
    pub portable: Option<bool>,
}

impl Options {
    /// Nothing set.
    pub fn new() -> Self {
        Self::default()
    }

    /// The convolution route.
    pub fn conv_route(mut self, route: ConvRoute) -> Self {
        self.conv_route = Some(route);
        self
    }

    /// Strict mode: a primitive without a batching rule is an error instead
    /// of a warning and a per-example loop.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = Some(on);
        self
    }

    /// What random operations do under `vmap`.
    pub fn randomness(mut self, r: Randomness) -> Self {
        self.randomness = Some(r);
        self
    }

    /// Run a `vmap`'s batch in chunks of `k` examples (`k > 0`).
    pub fn chunk_size(mut self, k: usize) -> Self {
        self.chunk_size = Some(k);
        self
    }

    /// The seed of the random primitives this transform runs. A call on
    /// tensors draws from the seed of the outermost transform in it that
    /// has one, with a count of that function's calls (so each call draws
    /// anew, and a fresh transform repeats the sequence), else from the
    /// process-wide stream ([`manual_seed`](crate::manual_seed)).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// How a `vmap` runs its batch (see [`Schedule`]). A `chunk_size`
    /// bounds memory whatever the schedule: its chunks run batched.
    pub fn schedule(mut self, s: Schedule) -> Self {
        self.schedule = Some(s);
        self
    }

    /// The most bytes a call may hold at once, by the interpreter's plan
    /// (every value alive at the same time, inputs included); a call whose
    /// plan needs more is an [`Error::Memory`](crate::Error::Memory)
    /// before anything runs. Unset: the machine's memory, which means one
    /// thing while a function is traced (what was available when the
    /// process first asked, `MemAvailable` on Linux, so a cached graph
    /// does not change with the machine's load) and is checked against
    /// what is available when a plan runs; no limit where it cannot be
    /// read. Read from the outermost transform called on tensors.
    pub fn memory_limit(mut self, bytes: usize) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// Runs candle's operations only, bypassing the crate's CPU kernels:
    /// the path every device but the CPU takes (a GPU's), taken on the CPU
    /// so that it can be tested there. Slower, and the same numbers to
    /// rounding. Unset: the `CANDLE_FUNC_PORTABLE` variable (`1` turns it
    /// on), else off. Read from the outermost transform called on tensors.
    pub fn portable(mut self, on: bool) -> Self {
        self.portable = Some(on);
        self
    }

    /// The memory limit, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.memory_limit`")]
    pub fn get_memory_limit(&self) -> Option<usize> {
        self.memory_limit
    }

    /// The schedule, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.schedule`")]
    pub fn get_schedule(&self) -> Option<Schedule> {
        self.schedule
    }

    /// The route, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.conv_route`")]
    pub fn get_conv_route(&self) -> Option<ConvRoute> {
        self.conv_route
    }

    /// Strict mode, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.strict`")]
    pub fn get_strict(&self) -> Option<bool> {
        self.strict
    }

    /// The randomness setting, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.randomness`")]
    pub fn get_randomness(&self) -> Option<Randomness> {
        self.randomness
    }

    /// The chunk size, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.chunk_size`")]
    pub fn get_chunk_size(&self) -> Option<usize> {
        self.chunk_size
    }

    /// The seed, if set.
    #[deprecated(since = "0.2.0", note = "read the field: `options.seed`")]
    pub fn get_seed(&self) -> Option<u64> {
        self.seed
    }

    /// An error for options that only a `vmap` has (`randomness`,
    /// `chunk_size`, `schedule`) given to another transform, `op`: they would be
    /// ignored there, silently.
    pub(crate) fn check_not_vmap(&self, op: &str) -> Result<()> {
        if self.randomness.is_some() || self.chunk_size.is_some() || self.schedule.is_some() {
            return Err(Error::Config {
                msg: format!(
                    "{op}: randomness, chunk_size and schedule belong to a vmap (set them on the vmap inside), got {self:?}"
                ),
            });
        }
        Ok(())
    }

    /// The machine these options run on: their path and limit, resolved
    /// (an unset path read from the environment once per process).
    pub(crate) fn machine(&self) -> Machine {
        Machine::resolve(self.portable, self.memory_limit)
    }

    /// These options with every unset inherited field (route, strict
    /// mode, seed, memory limit) taken from `outer`, the enclosing
    /// transform's.
    pub(crate) fn inherit(&self, outer: &Options) -> Options {
        Options {
            conv_route: self.conv_route.or(outer.conv_route),
            strict: self.strict.or(outer.strict),
            seed: self.seed.or(outer.seed),
            memory_limit: self.memory_limit.or(outer.memory_limit),
            portable: self.portable.or(outer.portable),
            ..*self
        }
    }
}

/// Resolved options: what the rules read, what a `Map` node carries, and
/// part of every graph-cache key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Opts {
    pub(crate) route: ConvRoute,
    pub(crate) strict: bool,
    pub(crate) randomness: Randomness,
    pub(crate) chunk_size: Option<usize>,
    /// The transform's own seed; `None` draws from the process-wide stream.
    pub(crate) seed: Option<u64>,
    pub(crate) schedule: Schedule,
    /// The kernel path and the memory limit (`None`: the machine's
    /// memory, in `env`'s one meaning): a `vmap` that would exceed it runs
    /// in chunks that fit, and `Auto` measures no candidate that does not.
    pub(crate) machine: Machine,
    /// How many of a `Map`'s examples run at once on the CPU (the threads
    /// of the pool the transform was resolved in; 0 counts as 1). Each
    /// running example holds its own body's values, so the plan counts
    /// this many bodies, and a thread count that changes makes a new key.
    pub(crate) width: usize,
}
