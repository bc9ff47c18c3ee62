//! The crate's error type: one enum whose variants a caller can match, each
//! naming the operation and the offending shapes.

use candle_core::DType;

/// The crate's `Result` alias.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong while tracing, transforming or running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Operand shapes do not fit the operation (reported while tracing,
    /// before any kernel runs).
    #[error("{op}: incompatible shapes {}: {msg}", fmt_shapes(.shapes))]
    Shape {
        /// The operation.
        op: &'static str,
        /// The operands' shapes, in argument order.
        shapes: Vec<Vec<usize>>,
        /// What is wrong.
        msg: String,
    },
    /// Operand dtypes do not fit the operation.
    #[error("{op}: dtype mismatch {dtypes:?}: {msg}")]
    DType {
        /// The operation.
        op: &'static str,
        /// The operands' dtypes, in argument order.
        dtypes: Vec<DType>,
        /// What is wrong.
        msg: String,
    },
    /// Tensors live on different devices.
    #[error("{op}: device mismatch: {msg}")]
    Device {
        /// The operation.
        op: &'static str,
        /// Which devices.
        msg: String,
    },
    /// An `in_dims` entry does not fit its argument.
    #[error("vmap: bad in_dims for argument {arg}: {msg}")]
    InDims {
        /// Top-level argument index.
        arg: usize,
        /// What is wrong.
        msg: String,
    },
    /// An `out_dims` entry does not fit its output.
    #[error("vmap: bad out_dims for output {output}: {msg}")]
    OutDims {
        /// Top-level output index.
        output: usize,
        /// What is wrong.
        msg: String,
    },
    /// Batched arguments disagree on the size of the mapped axis.
    #[error("vmap: inconsistent batch sizes: {}", fmt_sizes(.sizes, .leaves))]
    BatchSize {
        /// `(argument, axis, size)` for every batched leaf.
        sizes: Vec<(usize, usize, usize)>,
        /// Each entry's leaf within its argument (`fc1.weight`; empty for
        /// an argument that is one tensor).
        leaves: Vec<String>,
    },
    /// A call whose plan holds more memory at once than the limit
    /// ([`Options::memory_limit`](crate::Options::memory_limit), else the
    /// machine's available memory): refused before it runs, where it would
    /// otherwise abort the process when an allocation fails.
    #[error(
        "{op}: the graph needs {} at its peak (values alive at once), more than the limit of {}; {}",
        fmt_bytes(*.needed),
        fmt_bytes(*.limit),
        memory_remedy(*.floor, *.limit)
    )]
    Memory {
        /// What was about to run (`call`, `vjp pullback`, `linearize`, ...).
        op: &'static str,
        /// Bytes the interpreter's plan holds at its peak.
        needed: usize,
        /// The limit it was checked against.
        limit: usize,
        /// Bytes no schedule can do without: the graph's arguments,
        /// captured tensors and results.
        floor: usize,
    },
    /// A private trainer whose step would hold more than the memory limit
    /// (a limit on the `PrivacyEngine` bounds the whole process while it
    /// trains: weights, optimiser state, gradient sums, data and a pass's
    /// graph), or a step whose pass did not fit the machine's memory:
    /// refused before it runs, naming the parts and what to change (the
    /// physical batch, the limit, what trains).
    #[error(
        "{op}: a step would hold {} at its peak ({parts}), more than the {} it may plan for; {remedy}",
        fmt_bytes(*.needed),
        fmt_bytes(*.limit)
    )]
    TrainerMemory {
        /// What was refused (`make_private`, `PrivateTrainer::step`).
        op: &'static str,
        /// Bytes the step's plan holds at its peak.
        needed: usize,
        /// The bytes the plan may hold: fifteen sixteenths of the engine's
        /// memory limit (the rest is left to the allocator), or the
        /// machine's available memory.
        limit: usize,
        /// The plan's parts, in words.
        parts: String,
        /// What would make it fit.
        remedy: String,
    },
    /// A primitive or case that a transform cannot handle (for example a
    /// missing batching rule in strict mode).
    #[error("{op}: unsupported under {transform}: {msg}")]
    Unsupported {
        /// The primitive or operation.
        op: String,
        /// The transform (`vmap`, `grad`, `run`, ...).
        transform: &'static str,
        /// Why.
        msg: String,
    },
    /// Arguments do not have the tree structure a function was traced with.
    #[error("tree structure mismatch: {msg}")]
    Tree {
        /// What differs.
        msg: String,
    },
    /// A bad setting (route name, environment variable, option value).
    #[error("configuration: {msg}")]
    Config {
        /// What is wrong.
        msg: String,
    },
    /// A differential-privacy setting out of its range (a noise multiplier,
    /// clipping bound, sample rate, δ, target ε, learning rate, batch size,
    /// clipping group), refused before anything is trained or accounted.
    #[error("{op}: {setting} must be {expected}, got {value}")]
    PrivacyConfig {
        /// The function or method given it (`make_private`, `accountant`).
        op: &'static str,
        /// The setting, as the function's argument or field is named
        /// (`max_grad_norm`, `delta`, `parameter "fc1.weight"`).
        setting: String,
        /// What it must be (`finite and > 0`, `in (0, 1)`).
        expected: String,
        /// What it was.
        value: String,
    },
    /// The privacy analysis cannot answer for these settings: a target ε
    /// no noise multiplier reaches, a δ below the accountant's resolution,
    /// a PRV grid too large, steps the mechanism cannot compose.
    #[error("{op}: {mechanism} accountant: {msg}")]
    Accounting {
        /// The function or method (`epsilon`, `noise_multiplier`).
        op: &'static str,
        /// The analysis (`prv`, `rdp`, `gdp`).
        mechanism: &'static str,
        /// Why, with the settings that caused it.
        msg: String,
    },
    /// The data or model given to a DP trainer does not fit it (no
    /// variables to train, a batch larger than the data set, a parameter
    /// dtype the ranks cannot all-reduce).
    #[error("{op}: {msg}")]
    Data {
        /// The function or method given it.
        op: &'static str,
        /// What does not fit, with its sizes, names or dtypes.
        msg: String,
    },
    /// A distributed DP step failed across ranks: a collective that timed
    /// out, another rank that failed, parameters that drifted apart.
    #[error("distributed step on rank {rank} of {ranks}: {failure}")]
    Collective {
        /// This rank.
        rank: usize,
        /// The number of ranks.
        ranks: usize,
        /// What failed.
        failure: CollectiveFailure,
    },
    /// Saved state (an accountant's JSON, `Auto`'s decisions file) that
    /// cannot be written or restored; nothing of a state that fails to
    /// restore is loaded.
    #[error("{what}: {msg}")]
    Checkpoint {
        /// What was saving or restoring (`Accountant::from_json`,
        /// `load_auto_cache`).
        what: &'static str,
        /// Why, naming the offending field or line.
        msg: String,
    },
    /// A pretrained model's folder that cannot be used: `config.json`
    /// missing, a field missing, of the wrong type or asking for what the
    /// crate does not implement; a weight missing or of another shape than
    /// the configuration implies.
    #[error("{what}: {msg}")]
    Model {
        /// The file and field, or the weight (`bert config.json field
        /// "hidden_act"`, `weight "bert.pooler.dense.weight"`).
        what: String,
        /// What is wrong, with the values found and expected.
        msg: String,
    },
    /// A symbolic tensor was used outside the trace that made it.
    #[error("trace: {msg}")]
    Trace {
        /// What happened.
        msg: String,
    },
    /// A bug in this crate: a rule computed another shape than it inferred,
    /// or a graph broke an invariant the crate keeps. Please report it.
    #[error("{op}: internal error: {msg}")]
    Internal {
        /// The primitive or operation.
        op: String,
        /// What went wrong.
        msg: String,
    },
    /// candle itself failed while running an operation.
    #[error("{op}: candle error: {source}")]
    Candle {
        /// The operation candle was running.
        op: String,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
}

/// How a distributed DP step failed (see [`Error::Collective`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveFailure {
    /// A collective waited past its timeout for the other ranks: one has
    /// died or hung. The job is aborted after this is printed, since MPI
    /// cannot cancel a collective.
    #[error("{op} waited more than {waited:?} for the other ranks (one has died or hung); aborting the job")]
    Timeout {
        /// The collective (`all-reduce`, `broadcast`).
        op: String,
        /// The timeout it ran past.
        waited: std::time::Duration,
    },
    /// Other ranks failed this step (their own errors say why); every rank
    /// fails it together so none is left waiting in a collective.
    #[error("{failed} other rank(s) failed this step; see their errors")]
    RankFailed {
        /// How many other ranks failed.
        failed: usize,
    },
    /// Ranks hold other parameters than rank 0, bit for bit.
    #[error(
        "the parameters of ranks {ranks:?} differ from rank 0's {when} (hashes {hashes:x?}): changed outside \
         the step, or computed with other arithmetic (another build or CPU)"
    )]
    Drift {
        /// The ranks that differ from rank 0.
        ranks: Vec<usize>,
        /// When the check ran (`after a step`).
        when: String,
        /// Every rank's parameter hash.
        hashes: Vec<u64>,
    },
    /// Ranks built the trainer from other data or parameter shapes.
    #[error(
        "ranks {ranks:?} have another data set or other parameter names, shapes or dtypes than rank 0 \
         ({here}); every rank must build the same trainer"
    )]
    Setup {
        /// The ranks that differ from rank 0.
        ranks: Vec<usize>,
        /// This rank's data and parameters, in brief.
        here: String,
    },
    /// A collective returned something no rank sent (a rank outside the
    /// communicator, a length or index that does not fit).
    #[error("{msg}")]
    Invalid {
        /// What was wrong.
        msg: String,
    },
}

fn fmt_shapes(shapes: &[Vec<usize>]) -> String {
    let parts: Vec<String> = shapes.iter().map(|s| format!("{s:?}")).collect();
    parts.join(" and ")
}

/// What to do about a plan over the limit: where the arguments and results
/// alone exceed it, nothing but a smaller batch or a higher limit helps.
fn memory_remedy(floor: usize, limit: usize) -> String {
    if floor > limit {
        return format!(
            "its arguments, captured tensors and results alone take {}, so no schedule fits: use a smaller batch or raise Options::memory_limit",
            fmt_bytes(floor)
        );
    }
    "run the batch in smaller chunks (vmap(..).chunk_size(k); a vmap that is not strict and has no chunk size chooses chunks that fit by itself), use a smaller batch, or raise Options::memory_limit".into()
}

fn fmt_bytes(b: usize) -> String {
    if b == usize::MAX {
        return "more than usize::MAX bytes".into();
    }
    let (mut v, mut unit) = (b as f64 / 1024.0, "KiB");
    for next in ["MiB", "GiB", "TiB"] {
        if v < 1024.0 {
            break;
        }
        (v, unit) = (v / 1024.0, next);
    }
    format!("{v:.1} {unit} ({b} bytes)")
}

/// Each distinct `(argument, axis, size)` once, with the leaves that have
/// it, and the usual cause's remedy.
fn fmt_sizes(sizes: &[(usize, usize, usize)], leaves: &[String]) -> String {
    type Group<'a> = ((usize, usize, usize), Vec<&'a str>);
    let mut groups: Vec<Group> = Vec::new();
    for (i, s) in sizes.iter().enumerate() {
        let leaf = leaves.get(i).map(String::as_str).unwrap_or("");
        match groups.iter_mut().find(|g| g.0 == *s) {
            Some(g) => g.1.push(leaf),
            None => groups.push((*s, vec![leaf])),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|((arg, axis, size), names)| {
            let named: Vec<&str> = names.iter().copied().filter(|n| !n.is_empty()).collect();
            let which = match named.len() {
                0 => String::new(),
                1..=4 => format!(" {named:?}"),
                n => format!(" {:?} and {} more", &named[..3], n - 3),
            };
            format!("argument {arg}{which} has size {size} on axis {axis}")
        })
        .collect();
    format!(
        "{}; an argument that is not batched (parameters shared by every example, say) takes None in in_dims, e.g. .in_dims([None, Some(0)])",
        parts.join("; ")
    )
}

impl Error {
    pub(crate) fn shape(op: &'static str, shapes: &[&[usize]], msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
            msg: msg.into(),
        }
    }

    pub(crate) fn privacy(
        op: &'static str,
        setting: impl Into<String>,
        expected: impl Into<String>,
        value: impl std::fmt::Display,
    ) -> Self {
        Error::PrivacyConfig {
            op,
            setting: setting.into(),
            expected: expected.into(),
            value: value.to_string(),
        }
    }

    pub(crate) fn data(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Data { op, msg: msg.into() }
    }

    pub(crate) fn internal(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Internal {
            op: op.into(),
            msg: msg.into(),
        }
    }

    pub(crate) fn unsupported(op: impl Into<String>, transform: &'static str, msg: impl Into<String>) -> Self {
        Error::Unsupported {
            op: op.into(),
            transform,
            msg: msg.into(),
        }
    }
}

/// Wraps candle's errors with the name of the operation that raised them.
pub(crate) trait CandleContext<T> {
    fn op(self, op: &str) -> Result<T>;
}

impl<T> CandleContext<T> for candle_core::Result<T> {
    fn op(self, op: &str) -> Result<T> {
        self.map_err(|source| Error::Candle {
            op: op.to_string(),
            source: without_backtrace(source),
        })
    }
}

impl From<candle_core::Error> for Error {
    fn from(source: candle_core::Error) -> Self {
        match without_backtrace(source) {
            // one of ours that crossed an API returning candle's errors (a
            // checkpoint's `VarBuilder` backend): returned as it was made
            candle_core::Error::WrappedContext { wrapped, context } => match wrapped.downcast::<Error>() {
                Ok(ours) if context.is_empty() => *ours,
                Ok(ours) => Error::Candle {
                    op: "candle".to_string(),
                    source: candle_core::Error::WrappedContext { wrapped: ours, context },
                },
                Err(wrapped) => Error::Candle {
                    op: "candle".to_string(),
                    source: candle_core::Error::WrappedContext { wrapped, context },
                },
            },
            source => Error::Candle {
                op: "candle".to_string(),
                source,
            },
        }
    }
}

/// candle's error with the backtraces it captures under `RUST_BACKTRACE`
/// removed: candle prints them in `Display`, so every message of ours that
/// wraps one would otherwise grow by 40 frames. (A panic's backtrace is
/// where a Rust user looks for one; an `Error` names its operation.)
pub(crate) fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    use candle_core::Error as C;
    match e {
        C::WithBacktrace { inner, .. } => without_backtrace(*inner),
        C::Context { inner, context } => C::Context {
            inner: Box::new(without_backtrace(*inner)),
            context,
        },
        C::WithPath { inner, path } => C::WithPath {
            inner: Box::new(without_backtrace(*inner)),
            path,
        },
        e => e,
    }
}

/// An error naming `op` and `what` unless `v` is finite and positive (or
/// zero, where `zero_ok`); the one check of every DP hyper-parameter: a negative clipping norm zeroes every gradient,
/// a NaN one makes them NaN, and an expected batch of 0 divides by zero.
pub(crate) fn positive(op: &'static str, what: &str, v: f64, zero_ok: bool) -> Result<()> {
    if v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0)) {
        return Ok(());
    }
    let want = if zero_ok { "finite and >= 0" } else { "finite and > 0" };
    Err(Error::privacy(op, what, want, v))
}
