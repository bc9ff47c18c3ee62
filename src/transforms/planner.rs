//! The planner: where a batched program has several lowerings, it decides.
//! Rules describe a choice (`rules::plan::Choice`); this planner answers
//! the options' route, or for `Auto` times every candidate's lowered graph
//! once per shape signature and device on random data and keeps the
//! fastest for the process ([`auto_choices`] shows what it chose and why;
//! [`save_auto_cache`] / [`load_auto_cache`] keep the choices across runs).
//!
//! It also decides how a whole batched graph runs (`Planner::schedule`):
//! at once, or in chunks of examples. This is where a plan for a whole
//! graph or a segment of it (a per-example schedule, a measured choice
//! between them) belongs.

use crate::error::{CandleContext, Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::{ConvRoute, Schedule};
use crate::ir::{Graph, TensorType};
use crate::rules::plan::{lower, Choice, Planner, RunAs};
use candle_core::{Device, Tensor};
use std::sync::Mutex;

/// One choice of the `Auto` route: the lowered operation, its batched
/// operand shapes, the candidates' measured times and the winner.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
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

type AutoKey = String;

/// A process-wide table of decisions in the order they were made, holding
/// at most `settings::auto_capacity()`: the least recently used goes first
/// (a scan; tables are read while tracing, not per call).
struct Table<C> {
    rows: Vec<(String, C, u64)>,
    tick: u64,
}

impl<C: Clone> Table<C> {
    const fn new() -> Self {
        Table {
            rows: Vec::new(),
            tick: 0,
        }
    }

    fn get(&mut self, key: &str) -> Option<C> {
        self.tick += 1;
        let now = self.tick;
        self.rows.iter_mut().find(|r| r.0 == key).map(|r| {
            r.2 = now;
            r.1.clone()
        })
    }

    fn put(&mut self, key: String, c: C) {
        self.tick += 1;
        self.rows.retain(|r| r.0 != key);
        self.rows.push((key, c, self.tick));
        while self.rows.len() > super::settings::auto_capacity() {
            let oldest = (0..self.rows.len()).min_by_key(|&i| self.rows[i].2).unwrap_or(0);
            self.rows.remove(oldest);
        }
    }

    fn all(&self) -> Vec<C> {
        self.rows.iter().map(|r| r.1.clone()).collect()
    }
}

static AUTO: Mutex<Table<AutoChoice>> = Mutex::new(Table::new());

/// What `Auto` chose so far in this process (and what was loaded), in the
/// order the choices were made; at most [`auto_capacity`](crate::auto_capacity)
/// of them, the least recently used dropped first.
pub fn auto_choices() -> Vec<AutoChoice> {
    AUTO.lock().unwrap_or_else(|e| e.into_inner()).all()
}

fn cached_choice(key: &str) -> Option<ConvRoute> {
    AUTO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .map(|c| c.chosen)
}

fn record_choice(key: AutoKey, choice: AutoChoice) {
    log::debug!(
        "conv route auto: {} on {:?} -> {:?} (timings {:?})",
        choice.op,
        choice.shapes,
        choice.chosen,
        choice.timings_ms
    );
    AUTO.lock().unwrap_or_else(|e| e.into_inner()).put(key, choice);
}

/// Writes the `Auto` choices to a text file, one per line, to reload with
/// [`load_auto_cache`] so a later process skips the measurements.
pub fn save_auto_cache(path: impl AsRef<std::path::Path>) -> Result<()> {
    let table = AUTO.lock().unwrap_or_else(|e| e.into_inner());
    let mut text = String::new();
    for (key, c, _) in table.rows.iter() {
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
        // `Auto` is what is being decided, not a decision; an empty key or
        // operation name, or a time that is not a finite non-negative
        // number, is no measurement either.
        if chosen == ConvRoute::Auto || parts[0].trim().is_empty() || parts[3].trim().is_empty() {
            return Err(bad());
        }
        let mut timings_ms = Vec::new();
        for t in parts[2].split(',').filter(|t| !t.is_empty()) {
            let (r, ms) = t.split_once('=').ok_or_else(bad)?;
            let ms: f64 = ms.parse().map_err(|_| bad())?;
            if !(ms.is_finite() && ms >= 0.0) {
                return Err(bad());
            }
            timings_ms.push((r.parse().map_err(|_| bad())?, ms));
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

/// The planner of a transform's trace: answers `Auto` choices by
/// measurement, cached per signature and device.
pub(crate) struct Measured;

impl Planner for Measured {
    fn choose(&self, choice: &Choice) -> Result<ConvRoute> {
        let types: Vec<_> = choice.args.iter().map(|(t, bd)| (t, bd)).collect();
        let key = format!(
            "{}|{types:?}|{}|{:?}",
            choice.prim.name(),
            choice.size,
            choice.device.location()
        );
        if let Some(r) = cached_choice(&key) {
            return Ok(r);
        }
        let timings = match time_routes(choice) {
            Ok(t) => t,
            // No candidate fits the memory limit: the call's own check
            // reports it, with the default route's plan (no measurement,
            // nothing recorded).
            Err(Error::Memory { .. }) => {
                log::debug!(
                    "conv route auto: no candidate for {} fits the memory limit",
                    choice.prim.name()
                );
                return Ok(ConvRoute::default());
            }
            Err(e) => return Err(e),
        };
        let chosen = timings
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|t| t.0)
            .unwrap_or_default();
        let record = AutoChoice {
            op: choice.prim.name(),
            shapes: choice.batch_first_shapes(),
            timings_ms: timings,
            chosen,
        };
        record_choice(key, record);
        Ok(chosen)
    }
}

/// Rounds in which `Auto` times every candidate route once.
const AUTO_ROUNDS: usize = 5;

/// Rounds for whole-graph schedules: each candidate is a whole program,
/// so fewer rounds already take long enough to average out a burst.
const SCHEDULE_ROUNDS: usize = 3;

/// Milliseconds each candidate route takes for a choice, on random operands.
fn time_routes(choice: &Choice) -> Result<Vec<(ConvRoute, f64)>> {
    let graphs = choice
        .candidates
        .iter()
        .map(|&r| lower(choice, r))
        .collect::<Result<Vec<_>>>()?;
    let types: Vec<TensorType> = choice.args.iter().map(|(t, _)| t.clone()).collect();
    let best = time_graphs(&graphs, &types, choice.device, (AUTO_ROUNDS, choice.opts.memory_limit))?;
    // a candidate over the memory limit was not run
    Ok(choice
        .candidates
        .iter()
        .copied()
        .zip(best)
        .filter(|(_, t)| t.is_finite())
        .collect())
}

/// Inputs to time a graph on: standard normal floats, and zeros for
/// integer operands (labels, indices: a value every index accepts; the
/// schedule measures no program that divides integers).
fn timing_inputs(types: &[TensorType], device: &Device) -> Result<Vec<Tensor>> {
    types
        .iter()
        .map(|t| {
            let shape = t.shape.as_slice();
            if t.dtype.is_float() {
                Tensor::randn(0f32, 1., shape, device).and_then(|r| r.to_dtype(t.dtype))
            } else {
                Tensor::zeros(shape, t.dtype, device)
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()
        .op("auto timing")
}

/// Milliseconds each graph takes on random inputs of `types`: the best of
/// `rounds` after a warm-up, the graphs taking turns within each round, so
/// a burst of load on a shared machine does not fall on one of them only.
/// A graph whose plan exceeds the memory `limit` is not run (infinitely
/// slow); where none fits, the error of the first is returned before any
/// input is made.
fn time_graphs(
    graphs: &[Graph],
    types: &[TensorType],
    device: &Device,
    (rounds, limit): (usize, Option<usize>),
) -> Result<Vec<f64>> {
    // as a call would run them
    let exes: Vec<Executable> = graphs
        .iter()
        .map(|g| Executable::new(g).named("auto timing").limit(limit))
        .collect();
    let fit: Vec<bool> = exes.iter().map(|e| e.check().is_ok()).collect();
    if let Some(e) = exes.first().filter(|_| !fit.contains(&true)) {
        e.check()?;
    }
    let inputs = timing_inputs(types, device)?;
    for (e, _) in exes.iter().zip(&fit).filter(|(_, &f)| f) {
        e.run(&inputs)?;
    }
    let mut best = vec![f64::INFINITY; exes.len()];
    for _ in 0..rounds {
        for ((e, b), _) in exes.iter().zip(best.iter_mut()).zip(&fit).filter(|(_, &f)| f) {
            let start = std::time::Instant::now();
            e.run(&inputs)?;
            *b = b.min(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(best)
}

/// One choice of `Schedule::Auto` for a large program: the batch size, the
/// candidates' measured times and the winner.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ScheduleChoice {
    /// The batch size.
    pub size: usize,
    /// Equations in the per-example graph.
    pub equations: usize,
    /// Each candidate's time in milliseconds (best of three rounds in
    /// which the candidates take turns); empty where measuring failed and
    /// the program runs batched.
    pub timings_ms: Vec<(Schedule, f64)>,
    /// The fastest candidate.
    pub chosen: Schedule,
}

static SCHEDULES: Mutex<Table<ScheduleChoice>> = Mutex::new(Table::new());

/// What `Schedule::Auto` measured and chose so far in this process, in the
/// order the choices were made (small programs, run batched without
/// measuring, are not listed).
pub fn schedule_choices() -> Vec<ScheduleChoice> {
    SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).all()
}

fn public(r: RunAs) -> Schedule {
    match r {
        RunAs::PerExample => Schedule::PerExample,
        RunAs::ConvsPerExample => Schedule::ConvsPerExample,
        _ => Schedule::Batched,
    }
}

/// A decision measured before for `key`.
pub(crate) fn cached_schedule(key: &str) -> Option<RunAs> {
    SCHEDULES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .map(|c| match c.chosen {
            Schedule::PerExample => RunAs::PerExample,
            Schedule::ConvsPerExample => RunAs::ConvsPerExample,
            _ => RunAs::Whole,
        })
}

fn record_schedule(key: String, choice: ScheduleChoice) {
    log::debug!(
        "vmap schedule auto: batch of {} -> {:?} (timings {:?})",
        choice.size,
        choice.chosen,
        choice.timings_ms
    );
    SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).put(key, choice);
}

/// Remembers that measuring `key` failed: it runs batched, unmeasured.
pub(crate) fn record_unmeasured(key: String, size: usize) {
    let choice = ScheduleChoice {
        size,
        equations: 0,
        timings_ms: Vec::new(),
        chosen: Schedule::Batched,
    };
    record_schedule(key, choice);
}

/// The fastest of `candidates` (each a way to run the same batch, lowered
/// to a graph over inputs of `types`), measured and cached for the process
/// under `key`.
pub(crate) fn measured_schedule(
    key: &str,
    size: usize,
    candidates: &[(RunAs, Graph)],
    (types, device, limit): (&[TensorType], &Device, Option<usize>),
) -> Result<RunAs> {
    let graphs: Vec<Graph> = candidates.iter().map(|(_, g)| g.clone()).collect();
    let times = time_graphs(&graphs, types, device, (SCHEDULE_ROUNDS, limit))?;
    let (best, _) = candidates
        .iter()
        .zip(&times)
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|((r, _), t)| (*r, *t))
        .unwrap_or((RunAs::Whole, 0.0));
    let choice = ScheduleChoice {
        size,
        equations: candidates.first().map_or(0, |(_, g)| g.equation_count()),
        // a candidate over the memory limit was not run
        timings_ms: candidates
            .iter()
            .map(|(r, _)| public(*r))
            .zip(times)
            .filter(|(_, t)| t.is_finite())
            .collect(),
        chosen: public(best),
    };
    record_schedule(key.to_string(), choice);
    Ok(best)
}
