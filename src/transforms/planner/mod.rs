//! The planner: where a batched program has several lowerings, it decides.
//! Rules describe a choice (`rules::plan::Choice`); this planner answers
//! the options' route, or for `Auto` times every candidate's lowered graph
//! once per shape signature and device on random data and keeps the
//! fastest ([`auto_choices`] shows what it chose and why; decisions are
//! kept across runs, see `tables`).
//!
//! It also decides how a whole batched graph runs (`Planner::schedule`):
//! at once, in chunks of examples, once per example or per segment.
//!
//! Measuring is kept short, since it happens on a function's first call:
//! candidates take turns, one clearly slower than the best is dropped
//! after each round, and a per-example schedule is timed on a few
//! examples and scaled to the batch (its time grows with the batch).

mod tables;

pub use tables::{auto_choices, load_auto_cache, save_auto_cache, schedule_choices, AutoChoice, ScheduleChoice};
pub(crate) use tables::{cached_schedule, record_unmeasured};

use crate::env::{Machine, Path};
use crate::error::{CandleContext, Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::ConvRoute;
use crate::ir::{Graph, TensorType};
use crate::rules::plan::{lower, Choice, Planner, RunAs};
use candle_core::{Device, Tensor};

/// The planner of a transform's trace: answers `Auto` choices by
/// measurement, cached per signature and device.
pub(crate) struct Measured;

impl Planner for Measured {
    fn choose(&self, choice: &Choice) -> Result<ConvRoute> {
        let types: Vec<_> = choice.args.iter().map(|(t, bd)| (t, bd)).collect();
        // the CPU's kernels and candle's operations are timed apart
        let key = format!(
            "{}|{types:?}|{}|{:?}{}",
            choice.prim.name(),
            choice.size,
            choice.device.location(),
            path_key(choice.opts.machine.path)
        );
        if let Some(r) = tables::cached_route(&key) {
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
        tables::record_route(key, record);
        Ok(chosen)
    }
}

/// What a decision's key adds for the path its runs take: nothing for the
/// crate's kernels (so keys saved before the path existed still hold).
pub(crate) fn path_key(path: Path) -> &'static str {
    match path {
        Path::Fast => "",
        Path::Portable => "|portable",
    }
}

/// Timed rounds at most for the routes of one operation (each cheap).
const AUTO_ROUNDS: usize = 5;

/// Timed rounds at most for whole-graph schedules: each candidate is a
/// whole program, so fewer rounds already take long enough to average out
/// a burst.
const SCHEDULE_ROUNDS: usize = 3;

/// After its first (cold) run, a candidate this many times slower than the
/// best is not run again.
const COLD_DROP: f64 = 3.0;

/// After a timed round, a candidate this many times slower than the best
/// is not run again.
const WARM_DROP: f64 = 1.5;

/// A per-example schedule is timed on this many examples (its time grows
/// with the batch, unlike a batched graph's), then scaled to the batch.
pub(crate) const PER_EXAMPLE_SAMPLE: usize = 4;

/// A candidate to time: a graph over inputs of `types`, its times
/// multiplied by `scale` (a per-example schedule timed on a few examples).
pub(crate) struct Candidate {
    pub(crate) graph: Graph,
    pub(crate) types: Vec<TensorType>,
    pub(crate) scale: f64,
}

/// Milliseconds each candidate route takes for a choice, on random
/// operands (routes over the memory limit not listed).
fn time_routes(choice: &Choice) -> Result<Vec<(ConvRoute, f64)>> {
    let types: Vec<TensorType> = choice.args.iter().map(|(t, _)| t.clone()).collect();
    let candidates = choice
        .candidates
        .iter()
        .map(|&r| {
            Ok(Candidate {
                graph: lower(choice, r)?,
                types: types.clone(),
                scale: 1.0,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let best = time_graphs(&candidates, choice.device, (AUTO_ROUNDS, choice.opts.machine))?;
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

/// Milliseconds (scaled) of one run of `exe` on `inputs`.
fn time_one(exe: &Executable, inputs: &[Tensor], scale: f64, device: &Device) -> Result<f64> {
    // a GPU runs its kernels after the calls that queue them return: the
    // queue is drained before the clock starts and stops
    device.synchronize().op("auto timing")?;
    let start = std::time::Instant::now();
    exe.run(inputs)?;
    device.synchronize().op("auto timing")?;
    Ok(start.elapsed().as_secs_f64() * 1e3 * scale)
}

/// Milliseconds each candidate takes on random inputs (infinite for one
/// over the memory limit, not run): a first, cold run each, then up to
/// `rounds` in which the
/// candidates still in the running take turns (so a burst of load on a
/// shared machine does not fall on one of them only), keeping each one's
/// best. A candidate clearly slower than the best (`COLD_DROP` after its
/// cold run, `WARM_DROP` after a round) runs no more, and the rounds end
/// when one is left. A candidate whose plan exceeds the memory `limit` is
/// not run; where none fits, the first one's error is returned before any
/// input is made.
fn time_graphs(candidates: &[Candidate], device: &Device, (rounds, machine): (usize, Machine)) -> Result<Vec<f64>> {
    // as a call would run them
    let exes: Vec<Executable> = candidates
        .iter()
        .map(|c| Executable::new(&c.graph, machine).named("auto timing"))
        .collect();
    let mut alive: Vec<bool> = exes.iter().map(|e| e.check().is_ok()).collect();
    if let Some(e) = exes.first().filter(|_| !alive.contains(&true)) {
        e.check()?;
    }
    let mut inputs = Vec::with_capacity(exes.len());
    for (c, &a) in candidates.iter().zip(&alive) {
        inputs.push(if a {
            timing_inputs(&c.types, device)?
        } else {
            Vec::new()
        });
    }
    let mut best = vec![f64::INFINITY; exes.len()];
    let mut cold = vec![f64::INFINITY; exes.len()];
    for i in (0..exes.len()).filter(|&i| alive[i]) {
        cold[i] = time_one(&exes[i], &inputs[i], candidates[i].scale, device)?;
    }
    drop_slow(&mut alive, &cold, COLD_DROP);
    for _ in 0..rounds {
        if alive.iter().filter(|&&a| a).count() < 2 {
            break;
        }
        for i in (0..exes.len()).filter(|&i| alive[i]) {
            best[i] = best[i].min(time_one(&exes[i], &inputs[i], candidates[i].scale, device)?);
        }
        drop_slow(&mut alive, &best, WARM_DROP);
    }
    // a candidate without timed rounds (the one left, or one dropped after
    // its cold run): its cold run is its time
    for i in 0..exes.len() {
        if !best[i].is_finite() {
            best[i] = cold[i];
        }
    }
    Ok(best)
}

/// Takes out of the running every candidate `factor` times slower than the
/// fastest of those in it.
fn drop_slow(alive: &mut [bool], times: &[f64], factor: f64) {
    let fastest = (0..alive.len())
        .filter(|&i| alive[i])
        .map(|i| times[i])
        .fold(f64::INFINITY, f64::min);
    for (a, &t) in alive.iter_mut().zip(times) {
        *a &= t <= factor * fastest;
    }
}

/// The fastest of `candidates` (each a way to run the same batch, lowered
/// to a graph), measured and cached under `key` (and kept across runs).
pub(crate) fn measured_schedule(
    key: &str,
    size: usize,
    candidates: Vec<(RunAs, Candidate)>,
    (device, machine): (&Device, Machine),
) -> Result<RunAs> {
    let equations = candidates.first().map_or(0, |(_, c)| c.graph.equation_count());
    let (kinds, graphs): (Vec<RunAs>, Vec<Candidate>) = candidates.into_iter().unzip();
    let times = time_graphs(&graphs, device, (SCHEDULE_ROUNDS, machine))?;
    let best = kinds
        .iter()
        .zip(&times)
        .min_by(|a, b| a.1.total_cmp(b.1))
        .map(|(r, _)| *r)
        .unwrap_or(RunAs::Whole);
    let choice = ScheduleChoice {
        size,
        equations,
        // a candidate over the memory limit, never run, is not listed
        timings_ms: kinds
            .iter()
            .map(|r| tables::public(*r))
            .zip(times)
            .filter(|(_, t)| t.is_finite())
            .collect(),
        chosen: tables::public(best),
    };
    tables::record_schedule(key.to_string(), choice);
    Ok(best)
}
