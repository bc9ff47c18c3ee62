//! The convolution route: how a convolution whose input and weight are both
//! batched is lowered under `vmap`. Chosen per call (`Vmap::conv_route`),
//! process-wide ([`set_conv_route`]) or by the environment variable
//! `CANDLE_FUNC_CONV_ROUTE=grouped|unfold|loop|auto`; the per-call choice
//! wins, then the setter, then the variable, then the default (`Unfold`).
//!
//! `Auto` times every candidate lowering once per shape signature and
//! device, on random data, and keeps the fastest for the process
//! ([`auto_choices`] shows what it chose and why; [`save_auto_cache`] and
//! [`load_auto_cache`] keep the choices across runs).

use crate::error::{Error, Result};
use std::str::FromStr;
use std::sync::RwLock;

/// How a convolution with batched input and batched weight is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
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
    /// shape signature (see [`auto_choices`]).
    Auto,
}

/// Name of the environment variable that sets the process-wide route.
pub const ROUTE_ENV: &str = "CANDLE_FUNC_CONV_ROUTE";

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

static PROCESS_ROUTE: RwLock<Option<ConvRoute>> = RwLock::new(None);

/// Sets the process-wide route (`None` returns to the environment variable
/// or the default). A route given to a transform with `.conv_route(..)` wins.
pub fn set_conv_route(route: Option<ConvRoute>) {
    *PROCESS_ROUTE.write().unwrap_or_else(|e| e.into_inner()) = route;
}

/// The process-wide route: the setter's, else the environment variable's
/// (an unknown value is an error), else the default.
pub fn conv_route() -> Result<ConvRoute> {
    if let Some(r) = *PROCESS_ROUTE.read().unwrap_or_else(|e| e.into_inner()) {
        return Ok(r);
    }
    match std::env::var(ROUTE_ENV) {
        Ok(v) => v.parse().map_err(|e: Error| Error::Config {
            msg: format!("{ROUTE_ENV}: {e}"),
        }),
        Err(std::env::VarError::NotPresent) => Ok(ConvRoute::default()),
        Err(e) => Err(Error::Config {
            msg: format!("{ROUTE_ENV}: {e}"),
        }),
    }
}

/// The route a transform uses: its own if set, else the process-wide one.
pub(crate) fn resolve(per_call: Option<ConvRoute>) -> Result<ConvRoute> {
    match per_call {
        Some(r) => Ok(r),
        None => conv_route(),
    }
}

/// One choice of the `Auto` route: the lowered operation, its batched
/// operand shapes, the candidates' measured times and the winner.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoChoice {
    /// The batched operation (`conv2d[..]`, `conv2d_grad_weight[..]`, ...).
    pub op: String,
    /// The operands' shapes with the batch axis first, and the batch size.
    pub shapes: Vec<Vec<usize>>,
    /// Each candidate's time in milliseconds (best of five rounds in which
    /// the candidates take turns).
    pub timings_ms: Vec<(ConvRoute, f64)>,
    /// The fastest candidate.
    pub chosen: ConvRoute,
}

/// What `Auto` chose so far in this process (and what was loaded), in the
/// order the choices were made.
pub fn auto_choices() -> Vec<AutoChoice> {
    AUTO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(_, c)| c.clone())
        .collect()
}

type AutoKey = String;

static AUTO: std::sync::Mutex<Vec<(AutoKey, AutoChoice)>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn cached_choice(key: &str) -> Option<ConvRoute> {
    AUTO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, c)| c.chosen)
}

pub(crate) fn record_choice(key: AutoKey, choice: AutoChoice) {
    log::debug!(
        "conv route auto: {} on {:?} -> {:?} (timings {:?})",
        choice.op,
        choice.shapes,
        choice.chosen,
        choice.timings_ms
    );
    let mut table = AUTO.lock().unwrap_or_else(|e| e.into_inner());
    table.retain(|(k, _)| *k != key);
    table.push((key, choice));
}

/// Writes the `Auto` choices to a text file, one per line, to reload with
/// [`load_auto_cache`] so a later process skips the measurements.
pub fn save_auto_cache(path: impl AsRef<std::path::Path>) -> Result<()> {
    let table = AUTO.lock().unwrap_or_else(|e| e.into_inner());
    let mut text = String::new();
    for (key, c) in table.iter() {
        let times: Vec<String> = c.timings_ms.iter().map(|(r, t)| format!("{r:?}={t}")).collect();
        text.push_str(&format!(
            "{key}\t{:?}\t{}\t{}\t{:?}\n",
            c.chosen,
            times.join(","),
            c.op,
            c.shapes
        ));
    }
    std::fs::write(path.as_ref(), text).map_err(|e| Error::Config {
        msg: format!("save_auto_cache {}: {e}", path.as_ref().display()),
    })
}

/// Reads choices written by [`save_auto_cache`]; they take the place of
/// measurements for the same signatures. A malformed line is an error.
pub fn load_auto_cache(path: impl AsRef<std::path::Path>) -> Result<usize> {
    let text = std::fs::read_to_string(path.as_ref()).map_err(|e| Error::Config {
        msg: format!("load_auto_cache {}: {e}", path.as_ref().display()),
    })?;
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let parts: Vec<&str> = line.split('\t').collect();
        let bad = || Error::Config {
            msg: format!("load_auto_cache: malformed line {line:?}"),
        };
        if parts.len() != 5 {
            return Err(bad());
        }
        let chosen: ConvRoute = parts[1].parse().map_err(|_| bad())?;
        let mut timings_ms = Vec::new();
        for t in parts[2].split(',').filter(|t| !t.is_empty()) {
            let (r, ms) = t.split_once('=').ok_or_else(bad)?;
            timings_ms.push((r.parse().map_err(|_| bad())?, ms.parse().map_err(|_| bad())?));
        }
        let choice = AutoChoice {
            op: parts[3].to_string(),
            shapes: Vec::new(),
            timings_ms,
            chosen,
        };
        record_choice(parts[0].to_string(), choice);
        n += 1;
    }
    Ok(n)
}

thread_local! {
    static DEVICE: std::cell::RefCell<candle_core::Device> = const { std::cell::RefCell::new(candle_core::Device::Cpu) };
}

/// Runs `f` with `device` as the device `Auto` measures on (the device of the
/// call being traced).
pub(crate) fn with_device<T>(device: &candle_core::Device, f: impl FnOnce() -> T) -> T {
    let prev = DEVICE.with(|d| d.replace(device.clone()));
    let out = f();
    DEVICE.with(|d| *d.borrow_mut() = prev);
    out
}

/// The device of the call being traced.
pub(crate) fn current_device() -> candle_core::Device {
    DEVICE.with(|d| d.borrow().clone())
}
