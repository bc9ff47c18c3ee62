//! How a `vmap` runs its batch as a whole: the batched graph over the
//! whole batch or in chunks (a memory bound), or the unbatched graph once
//! per example as one `map` node (each example's kernels on one example's
//! data, which stays in cache where ten models' batched activations do
//! not), or its convolutional front per example and the rest batched
//! (`segments`). For `Schedule::Auto` a large program is measured every
//! way that applies by the planner, once per program, batch size (to the
//! next power of two) and device.

use super::planner::{cached_schedule, measured_schedule, record_unmeasured, Candidate, Measured, PER_EXAMPLE_SAMPLE};
use super::segments::{split_after_convs, Front};
use crate::error::{Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::{Opts, Schedule};
use crate::ir::{Graph, TensorType, VarId};
use crate::rules::control::map::emit_maps;
use crate::rules::plan::{Planner, RunAs};
use crate::rules::walk::batch_graph_shared;
use crate::rules::{facts, memory};
use crate::rules::{BVal, BatchCx, Builder, TraceCtx};
use std::hash::{Hash, Hasher};

/// Below this many bytes of batched values in all, `Auto` runs the batched
/// graph without measuring: a small program's batched kernels beat a loop,
/// and measuring would cost more than it saves.
const AUTO_MIN_BYTES: usize = 32 << 20;

/// Emits `g` batched over `vals` (batch size `size`) into `b` as the
/// schedule says, with each output's batch axis where `out_dims` puts it.
pub(crate) fn emit_batch(
    g: &Graph,
    b: &mut Builder,
    vals: &[BVal],
    size: usize,
    opts: &Opts,
    out_dims: &[Option<isize>],
) -> Result<Vec<VarId>> {
    if size == 0 {
        return empty_outputs(g, b, out_dims);
    }
    let run_as = match Measured.schedule(opts, size) {
        RunAs::Whole if opts.schedule == Schedule::Auto => auto_schedule(g, b, vals, size, opts)?,
        r => r,
    };
    let run_as = fit_memory(g, b, vals, size, opts, run_as)?;
    match run_as {
        RunAs::PerExample if per_example_applies(g, vals) => {
            let outs = per_example(g, b, vals, size, opts)?;
            let mut cx = BatchCx {
                b,
                size,
                opts,
                plan: &Measured,
            };
            outs.into_iter()
                .zip(out_dims)
                .enumerate()
                .map(|(i, (o, &d))| place_output(&mut cx, o, d, i))
                .collect()
        }
        RunAs::ConvsPerExample if per_example_applies(g, vals) => match split(g, vals) {
            Front::Part(s) => {
                let mut all = vals.to_vec();
                all.extend(per_example(&s.front, b, vals, size, opts)?);
                run_chunks(&s.head, b, &all, (size, size), opts, out_dims)
            }
            Front::All => emit_batch(
                g,
                b,
                vals,
                size,
                &Opts {
                    schedule: Schedule::PerExample,
                    ..*opts
                },
                out_dims,
            ),
            Front::Nothing => run_chunks(g, b, vals, (size, size), opts, out_dims),
        },
        RunAs::Chunks(k) => run_chunks(g, b, vals, (size, k), opts, out_dims),
        _ => run_chunks(g, b, vals, (size, size), opts, out_dims),
    }
}

/// Whether `g` can run once per example: every output depends on a
/// batched input (an unbatched output stays unbatched only when batched),
/// and it draws no random numbers. A map's draws are seeded by the node's
/// place in the graph, and the maps a gradient or a second dtype adds sit
/// elsewhere, so they would draw other masks than the forward map did.
fn per_example_applies(g: &Graph, vals: &[BVal]) -> bool {
    if facts::draws_random(g) {
        return false;
    }
    let batched = g.downstream_of(&batched_inputs(vals));
    g.outputs.iter().all(|&o| batched[o])
}

fn batched_inputs(vals: &[BVal]) -> Vec<bool> {
    vals.iter().map(|v| v.1.is_some()).collect()
}

/// `g` cut after its convolutions (see `segments`), where it has any.
fn split(g: &Graph, vals: &[BVal]) -> Front {
    split_after_convs(g, &g.downstream_of(&batched_inputs(vals)))
}

/// The batch as one map of `g`, every output a result batched on axis 0.
fn per_example(g: &Graph, b: &mut Builder, vals: &[BVal], size: usize, opts: &Opts) -> Result<Vec<BVal>> {
    let outs = emit_maps(b, g.clone(), vals, size, *opts)?;
    Ok(outs.into_iter().map(|o| (o, Some(0))).collect())
}

/// `Auto`: the batched graph for a small program; for a large one the
/// fastest of the batched graph, the per-example map and the convolutions
/// per example, as the planner measures them on this program. Not measured, and batched: a program
/// inside a trace that will be differentiated (the decision would be made
/// on its forward pass alone, and a per-example map's gradient reruns its
/// forward per operand), one with custom ops or integer division (user
/// code, and inputs that could fail on the measurement's data), and one
/// whose measurement fails.
fn auto_schedule(g: &Graph, b: &Builder, vals: &[BVal], size: usize, opts: &Opts) -> Result<RunAs> {
    let bytes: usize = g
        .nodes
        .iter()
        .filter(|n| !n.prim.is_leaf())
        .map(|n| n.ty.elem_count().saturating_mul(n.ty.dtype.size_in_bytes()))
        .fold(0usize, usize::saturating_add)
        .saturating_mul(size);
    if bytes < AUTO_MIN_BYTES || b.differentiated || !per_example_applies(g, vals) || !facts::measurable(g) {
        return Ok(RunAs::Whole);
    }
    // The program, per-example types and the batch size to the next power
    // of two: a Poisson-sampled batch changes size every step, and which
    // schedule wins does not flip between neighbouring sizes.
    let per: Vec<(&TensorType, Option<usize>)> = g
        .inputs
        .iter()
        .map(|&i| g.ty(i))
        .zip(vals.iter().map(|v| v.1))
        .collect();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    g.to_string().hash(&mut h);
    let key = format!(
        "{:016x}|{per:?}|{}|{:?}|{:?}{}",
        h.finish(),
        size.next_power_of_two(),
        b.ctx.device.location(),
        opts.route,
        super::planner::path_key(opts.machine.path)
    );
    if let Some(r) = cached_schedule(&key) {
        return Ok(r);
    }
    let measured = lower_candidates(g, b, vals, size, opts)
        .and_then(|candidates| measured_schedule(&key, size, candidates, (&b.ctx.device, opts.machine)));
    match measured {
        Ok(r) => Ok(r),
        Err(e) => {
            log::debug!("vmap schedule auto: measuring failed ({e}); running batched");
            record_unmeasured(key, size);
            Ok(RunAs::Whole)
        }
    }
}

/// The schedules of `g` (batched, per example, and the convolutions per
/// example where `g` has any), each lowered in a builder of its own
/// context (so a loop fallback of the batched lowering is not warned about
/// when the per-example map runs); the per-example schedule on a few
/// examples, its times to be scaled to the batch.
fn lower_candidates(
    g: &Graph,
    b: &Builder,
    vals: &[BVal],
    size: usize,
    opts: &Opts,
) -> Result<Vec<(RunAs, Candidate)>> {
    let mut schedules = vec![RunAs::Whole, RunAs::PerExample];
    if matches!(split(g, vals), Front::Part(_)) {
        schedules.push(RunAs::ConvsPerExample);
    }
    schedules
        .into_iter()
        .map(|run_as| {
            let n = match run_as {
                RunAs::PerExample => size.min(PER_EXAMPLE_SAMPLE),
                _ => size,
            };
            let types = batch_types(b, vals, n);
            let graph = lower_as(g, b, (vals, &types), n, opts, run_as)?;
            let scale = size as f64 / n as f64;
            Ok((run_as, Candidate { graph, types, scale }))
        })
        .collect()
}

/// The types of the batched values `vals` with a batch of `n` examples.
fn batch_types(b: &Builder, vals: &[BVal], n: usize) -> Vec<TensorType> {
    vals.iter()
        .map(|&(v, bd)| {
            let mut t = b.ty(v).clone();
            if let Some(d) = bd {
                t.shape[d] = n;
            }
            t
        })
        .collect()
}

/// `g` batched over `size` examples as `run_as` says, in a builder of its
/// own on fresh inputs of `types`: what the planner measures or plans.
fn lower_as(
    g: &Graph,
    b: &Builder,
    (vals, types): (&[BVal], &[TensorType]),
    size: usize,
    opts: &Opts,
    run_as: RunAs,
) -> Result<Graph> {
    let scratch = Builder::scratch(b.given, TraceCtx::new(b.ctx.device.clone(), crate::rules::infer));
    let mut sb = scratch.borrow_mut();
    let ins: Vec<BVal> = types
        .iter()
        .zip(vals)
        .map(|(t, v)| (sb.input(t.clone()), v.1))
        .collect();
    // a chunk size (the whole batch where there are no chunks) marks the
    // schedule decided: no measuring or fitting again inside
    let (chunk, schedule) = match run_as {
        RunAs::Chunks(k) => (k, Schedule::Batched),
        RunAs::PerExample => (size, Schedule::PerExample),
        RunAs::ConvsPerExample => (size, Schedule::ConvsPerExample),
        RunAs::Whole => (size, Schedule::Batched),
    };
    let forced = Opts {
        chunk_size: Some(chunk),
        schedule,
        ..*opts
    };
    let outs = emit_batch(g, &mut sb, &ins, size, &forced, &vec![Some(0); g.outputs.len()])?;
    Ok(sb.finish(outs).0.eliminate_dead_code())
}

/// The memory the crate manages: a batch run whole (or its convolutions
/// per example) whose plan exceeds the memory limit, in a `vmap` with no
/// chunk size and not strict, runs in the largest chunks of examples whose
/// plan fits (said at debug level). Where even one example at a time does
/// not fit, the schedule is left as it was and the call's own check
/// reports the plan. Strict mode keeps the error.
fn fit_memory(g: &Graph, b: &Builder, vals: &[BVal], size: usize, opts: &Opts, run_as: RunAs) -> Result<RunAs> {
    if opts.strict || opts.chunk_size.is_some() || !matches!(run_as, RunAs::Whole | RunAs::ConvsPerExample) {
        return Ok(run_as);
    }
    // every value of one example's graph times the batch (inputs shared by
    // every example counted each time): where even that fits, no lowering
    // is planned
    let rough = memory::planned_peak(g).saturating_mul(size);
    let machine = opts.machine;
    if machine.plan_fits(rough) {
        return Ok(run_as);
    }
    let types = batch_types(b, vals, size);
    let peak = |run_as: RunAs| -> Result<usize> {
        Ok(Executable::new(&lower_as(g, b, (vals, &types), size, opts, run_as)?, machine).peak())
    };
    let whole = peak(run_as)?;
    if machine.plan_fits(whole) || size < 2 {
        return Ok(run_as);
    }
    // chunks planned to a little under the limit, leaving room for what an
    // enclosing graph holds beside this vmap
    let target = machine.trace_bytes().map(|l| l - l / 16);
    // the largest chunk that fits, by bisection: `lo` fits (0: none
    // known), `hi` does not
    let (mut lo, mut hi) = (0usize, size);
    while hi - lo > 1 {
        let k = lo + (hi - lo) / 2;
        let fits = match target {
            Some(t) => peak(RunAs::Chunks(k))? <= t,
            None => true,
        };
        if fits {
            lo = k;
        } else {
            hi = k;
        }
    }
    if lo == 0 {
        return Ok(run_as);
    }
    let limit = machine.trace_bytes().unwrap_or(usize::MAX);
    log::debug!(
        "vmap: a batch of {size} plans {whole} bytes at its peak, over the memory limit of {limit}; running it in chunks of {lo}"
    );
    Ok(RunAs::Chunks(lo))
}

/// Moves a batched output's batch axis to `out_dim` (materialising an
/// unbatched output when a batch axis is asked for).
fn place_output(cx: &mut BatchCx, out: BVal, out_dim: Option<isize>, index: usize) -> Result<VarId> {
    match out_dim {
        None if out.1.is_some() => Err(Error::OutDims {
            output: index,
            msg: "out_dims is None but the output depends on the batched inputs".into(),
        }),
        None => Ok(out.0),
        Some(d) => {
            let v = cx.materialize(out)?;
            let r = cx.b.ty(v).rank() as isize;
            let a = if d < 0 { d + r } else { d };
            if a < 0 || a >= r {
                return Err(Error::OutDims {
                    output: index,
                    msg: format!("axis {d} is out of range for an output of rank {r}"),
                });
            }
            cx.b.move_axis(v, 0, a as usize)
        }
    }
}

/// The outputs of a map over zero examples: empty along the batch axis (as
/// in JAX), with the per-example shapes the trace gave.
fn empty_outputs(g: &Graph, b: &mut Builder, out_dims: &[Option<isize>]) -> Result<Vec<VarId>> {
    let mut ids = Vec::with_capacity(g.outputs.len());
    for (i, (&o, d)) in g.outputs.iter().zip(out_dims).enumerate() {
        let mut shape = g.ty(o).shape.clone();
        if let Some(d) = d {
            let r = shape.len() as isize + 1;
            let a = if *d < 0 { d + r } else { *d };
            if a < 0 || a >= r {
                return Err(Error::OutDims {
                    output: i,
                    msg: format!("axis {d} is out of range for an output of rank {r}"),
                });
            }
            shape.insert(a as usize, 0);
        }
        ids.push(b.zeros(shape, g.ty(o).dtype)?);
    }
    Ok(ids)
}

/// Batches `g` over chunks of `k` examples (narrowing the batched inputs
/// and concatenating the outputs), or over the whole batch when `k` is the
/// batch size.
fn run_chunks(
    g: &Graph,
    b: &mut Builder,
    vals: &[BVal],
    (size, k): (usize, usize),
    opts: &Opts,
    out_dims: &[Option<isize>],
) -> Result<Vec<VarId>> {
    let mut pieces: Vec<Vec<VarId>> = vec![Vec::new(); g.outputs.len()];
    let mut shared = std::collections::HashMap::new();
    for start in (0..size).step_by(k) {
        let len = k.min(size - start);
        let mut chunk_vals = Vec::with_capacity(vals.len());
        for &(v, bd) in vals {
            chunk_vals.push(match bd {
                Some(d) => (b.narrow(v, d, start, len)?, Some(d)),
                None => (v, None),
            });
        }
        let mut cx = BatchCx {
            b,
            size: len,
            opts,
            plan: &Measured,
        };
        let outs = batch_graph_shared(g, &mut cx, &chunk_vals, &mut shared)?;
        for (i, (&o, &d)) in outs.iter().zip(out_dims).enumerate() {
            pieces[i].push(place_output(&mut cx, o, d, i)?);
        }
        if start == 0 && k == size {
            break;
        }
    }
    let mut ids = Vec::with_capacity(pieces.len());
    for (p, d) in pieces.iter().zip(out_dims) {
        ids.push(match d {
            None => p[0],
            Some(d) => {
                let r = b.ty(p[0]).rank() as isize;
                let axis = if *d < 0 { d + r } else { *d } as usize;
                b.concat(p, axis)?
            }
        });
    }
    Ok(ids)
}
