//! Process-wide defaults: what a transform uses for an option it was not
//! given (and its enclosing transform did not set). They are defaults only;
//! what they resolve to is part of every graph-cache key, so changing one
//! never reuses a graph traced under another. Also the process-wide random
//! stream and the once-per-cause warnings.

use crate::error::{Error, Result};
use crate::ir::options::{ConvRoute, Options, Opts};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use crate::env::ROUTE_ENV;

static STRICT: AtomicBool = AtomicBool::new(false);
static PROCESS_ROUTE: RwLock<Option<ConvRoute>> = RwLock::new(None);
static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
static CACHE_CAPACITY: AtomicUsize = AtomicUsize::new(DEFAULT_CACHE_CAPACITY);
static AUTO_CAPACITY: AtomicUsize = AtomicUsize::new(DEFAULT_AUTO_CAPACITY);

/// Input signatures each transformed function keeps traced graphs for, by
/// default (a graph is a few to a few hundred KiB).
pub const DEFAULT_CACHE_CAPACITY: usize = 64;
/// Decisions each of the process-wide `Auto` tables (routes, schedules)
/// keeps, by default.
pub const DEFAULT_AUTO_CAPACITY: usize = 1024;

/// How many input signatures each transformed function keeps traced
/// graphs for (at least 1); beyond it the least recently used is dropped
/// and traced again if it comes back. A varying batch size (Poisson
/// sampling) or sequence length otherwise grows the cache without bound.
pub fn set_cache_capacity(signatures: usize) {
    CACHE_CAPACITY.store(signatures.max(1), Ordering::Relaxed);
}

/// The current per-function graph-cache capacity (see
/// [`set_cache_capacity`]).
pub fn cache_capacity() -> usize {
    CACHE_CAPACITY.load(Ordering::Relaxed)
}

/// How many decisions each process-wide `Auto` table (conv routes,
/// `vmap` schedules) keeps (at least 1); beyond it the least recently used
/// is dropped and measured again if it comes back.
pub fn set_auto_capacity(decisions: usize) {
    AUTO_CAPACITY.store(decisions.max(1), Ordering::Relaxed);
}

/// The current `Auto` table capacity (see [`set_auto_capacity`]).
pub fn auto_capacity() -> usize {
    AUTO_CAPACITY.load(Ordering::Relaxed)
}

/// Process-wide strict mode: when on, `vmap` refuses to batch a primitive
/// with the per-example loop fallback and returns an error instead of a
/// warning. A transform's own `.strict(..)` wins.
pub fn set_strict(on: bool) {
    STRICT.store(on, Ordering::Relaxed);
}

/// Whether process-wide strict mode is on.
pub fn strict() -> bool {
    STRICT.load(Ordering::Relaxed)
}

/// Sets the process-wide route (`None` returns to the environment variable
/// or the default). A route given to a transform with `.conv_route(..)` wins.
pub fn set_conv_route(route: Option<ConvRoute>) {
    *PROCESS_ROUTE.write().unwrap_or_else(|e| e.into_inner()) = route;
}

/// The process-wide route: the setter's, else the environment variable's
/// (`CANDLE_FUNC_CONV_ROUTE=grouped|unfold|loop|auto`; an unknown value is
/// an error), else the default (`Unfold`).
pub fn conv_route() -> Result<ConvRoute> {
    if let Some(r) = *PROCESS_ROUTE.read().unwrap_or_else(|e| e.into_inner()) {
        return Ok(r);
    }
    match crate::env::route_var() {
        Some(Ok(v)) => v.parse().map_err(|e: Error| Error::Config {
            msg: format!("{ROUTE_ENV}: {e}"),
        }),
        None => Ok(ConvRoute::default()),
        Some(Err(msg)) => Err(Error::Config { msg }),
    }
}

/// Seeds the process-wide random stream (dropout masks of transforms
/// without a seed of their own): the runs after this call draw the same
/// sequence of values.
pub fn manual_seed(seed: u64) {
    crate::env::manual_seed(seed);
}

/// `opts` resolved against the process defaults: the options a `vmap`
/// batches with. An unset route reads the setter and the environment (so a
/// bad `CANDLE_FUNC_CONV_ROUTE` fails only a transform that needs a route).
pub(crate) fn resolve(opts: &Options) -> Result<Opts> {
    if opts.chunk_size == Some(0) {
        return Err(Error::Config {
            msg: "vmap: chunk_size must be positive".into(),
        });
    }
    Ok(Opts {
        route: match opts.conv_route {
            Some(r) => r,
            None => conv_route()?,
        },
        strict: opts.strict.unwrap_or_else(strict),
        randomness: opts.randomness.unwrap_or_default(),
        chunk_size: opts.chunk_size,
        seed: opts.seed,
        schedule: opts.schedule.unwrap_or_default(),
        machine: opts.machine(),
        width: rayon::current_num_threads(),
    })
}

/// A warning the crate gave (a loop fallback, a route that cannot apply, a
/// seeded DP generator), as [`capture_warnings`] collects them.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Warning {
    /// What it is about, the same for every warning of one cause
    /// (`"loop-custom"`, `"ghost-mul"`, `"dp-seeded-rng"`).
    pub key: String,
    /// The message, as logged.
    pub message: String,
}

thread_local! {
    /// The warnings each active [`capture_warnings`] on this thread has
    /// collected, innermost last.
    static CAPTURES: std::cell::RefCell<Vec<Vec<Warning>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` and returns its result with every warning the crate gave on
/// this thread while it ran, each time its cause arose: the log says a
/// cause once per process, this says it once per occurrence, so a caller
/// (or a test) sees what its own call warned about whatever ran before.
/// Warnings are given while tracing, on the calling thread; a transform
/// called again with a signature it has traced gives none.
///
/// ```
/// use candle_func::{settings, vmap, Tracer};
/// let x = candle_core::Tensor::ones((3, 2), candle_core::DType::F32, &candle_core::Device::Cpu)?;
/// let (out, warnings) = settings::capture_warnings(|| vmap(|x: Tracer| x.exp()).call(&x));
/// assert_eq!(out?.dims(), &[3, 2]);
/// assert!(warnings.is_empty()); // exp has its own batching rule
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn capture_warnings<R>(f: impl FnOnce() -> R) -> (R, Vec<Warning>) {
    /// Pops this capture's list even when `f` unwinds.
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            CAPTURES.with(|c| c.borrow_mut().pop());
        }
    }
    CAPTURES.with(|c| c.borrow_mut().push(Vec::new()));
    let scope = Scope;
    let out = f();
    let got = CAPTURES.with(|c| c.borrow_mut().last_mut().map(std::mem::take).unwrap_or_default());
    drop(scope);
    (out, got)
}

/// Logs `msg` as a warning the first time `key` is seen in this process,
/// and hands it to every [`capture_warnings`] active on this thread each
/// time. Returns whether it was logged.
pub(crate) fn warn_once(key: String, msg: String) -> bool {
    CAPTURES.with(|c| {
        for list in c.borrow_mut().iter_mut() {
            list.push(Warning {
                key: key.clone(),
                message: msg.clone(),
            });
        }
    });
    let mut guard = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    let first = guard.get_or_insert_with(HashSet::new).insert(key);
    if first {
        log::warn!("{msg}");
    }
    first
}

/// Whether a warning with this key has been given in this process (a
/// test of one call's warnings should use [`capture_warnings`], which
/// another call cannot satisfy). A test hook, public by mistake: it goes
/// in the next release.
#[deprecated(
    since = "0.2.0",
    note = "use settings::capture_warnings, which sees one call's warnings"
)]
pub fn warned(key: &str) -> bool {
    let guard = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    guard.as_ref().is_some_and(|s| s.contains(key))
}
