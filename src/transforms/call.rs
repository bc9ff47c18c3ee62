//! Tracing a function and calling it on concrete tensors: the trace of a
//! call's signature, the cached run, the planned peak, [`make_graph`].

use super::tree::{ArgList, CallArgs, SymTree, TreeDef};
use super::{settings, CacheKey, Function, GraphCache, Traced};
use crate::error::{Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::Options;
use crate::ir::{Graph, TensorType};
use crate::trace::{nested_builder, top_builder, trace_in, BuilderRef, Outer};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// Traces `f` into the fresh builder `b` on symbolic inputs of the given
/// types: the graph, the outer values it captured, and the result's
/// structure.
fn trace_into<S, F>(
    f: &F,
    b: &BuilderRef,
    defs: &[TreeDef],
    types: &[Vec<TensorType>],
) -> Result<(Graph, Vec<Outer>, TreeDef)>
where
    S: ArgList,
    F: Function<S> + ?Sized,
{
    let flat: Vec<TensorType> = types.iter().flatten().cloned().collect();
    trace_in(b, &flat, |ins| {
        // the flat inputs regrouped by argument
        let mut ins = ins.into_iter();
        let tracers = types.iter().map(|arg| (&mut ins).take(arg.len()).collect()).collect();
        let out = f.apply(S::unflatten_args(defs, tracers)?)?;
        let mut leaves = Vec::new();
        let out_def = out.flatten_into(&mut leaves);
        Ok((leaves, out_def))
    })
}

/// Traces `f` on symbolic inputs of the given types in a trace nested in
/// `outer`, by a transform with the options `given` (and whether it
/// differentiates or batches what it traces): the graph, the outer values
/// it captured, and the result's structure.
pub(crate) fn trace_inner<S, F>(
    f: &F,
    outer: &BuilderRef,
    (given, differentiated, batched): (Options, bool, bool),
    defs: &[TreeDef],
    types: &[Vec<TensorType>],
) -> Result<(Graph, Vec<Outer>, TreeDef)>
where
    S: ArgList,
    F: Function<S>,
{
    let b = nested_builder(outer, given, (differentiated, batched));
    trace_into(f, &b, defs, types)
}

/// Flattened concrete arguments with their device.
pub(crate) fn flatten_call<S: ArgList, C: CallArgs<S>>(args: &C) -> Result<(Vec<Vec<Tensor>>, Vec<TreeDef>, Device)> {
    let (leaves, defs) = args.flatten_args();
    let flat: Vec<&Tensor> = leaves.iter().flatten().collect();
    let device = flat.first().map(|t| t.device().clone()).unwrap_or(Device::Cpu);
    if let Some(t) = flat.iter().find(|t| !t.device().same_device(&device)) {
        return Err(Error::Device {
            op: "call",
            msg: format!("arguments on {:?} and {:?}", device.location(), t.device().location()),
        });
    }
    Ok((leaves, defs, device))
}

/// Traces `f` on symbolic stand-ins for `leaves` in a fresh top-level trace
/// on `device` (where the planner measures), with the outermost
/// transform's options `given`; then warns once for each primitive that
/// fell back to a per-example loop.
fn trace_top<S: ArgList, F: Function<S> + ?Sized>(
    f: &F,
    (given, differentiated): (Options, bool),
    defs: &[TreeDef],
    leaves: &[Vec<Tensor>],
    device: &Device,
) -> Result<Traced> {
    let types: Vec<Vec<TensorType>> = leaves.iter().map(|a| a.iter().map(TensorType::of).collect()).collect();
    let (root, ctx) = top_builder(device, given, differentiated, crate::rules::infer);
    let (graph, _, out_def) = trace_into(f, &root, defs, &types)?;
    for kind in ctx.fallbacks.borrow().iter() {
        settings::warn_once(
            format!("loop-{kind}"),
            format!("vmap: no batching rule for {kind} in this case; running it once per example (performance drop)"),
        );
    }
    let mode_deps = ctx.mode_deps.borrow().clone();
    Ok(Traced {
        graph,
        out_def,
        mode_deps,
        seed: ctx.seed.get(),
    })
}

/// Calls `f` on concrete arguments: traces once per signature (cached in
/// `cache`), then runs the graph. The options of `f` (if it is a
/// transform) are inherited by the transforms inside it, and its seed
/// seeds the run.
pub(crate) fn call_concrete<S, F, C>(f: &F, cache: &GraphCache, args: &C) -> Result<<F::Output as SymTree>::Concrete>
where
    S: ArgList,
    F: Function<S> + ?Sized,
    C: CallArgs<S>,
{
    let call = Call::of(f, args)?;
    let key = CacheKey {
        types: call.leaves.iter().flatten().map(TensorType::of).collect(),
        defs: call.defs.clone(),
        device: call.device.location(),
        given: call.given,
        route: settings::conv_route().ok(),
        strict: settings::strict(),
    };
    let compiled = match cache.get(&key) {
        Some(c) if c.current() => c,
        _ => {
            let c = Arc::new(call.trace(f)?.compile(&call.given, cache.calls.clone()));
            cache.insert(key, c.clone());
            c
        }
    };
    let flat: Vec<Tensor> = call.leaves.into_iter().flatten().collect();
    let outs = compiled.exe.run(&flat)?;
    F::Output::concrete_from(&compiled.out_def, &mut outs.into_iter())
}

/// What every call on tensors starts from: the function's own options and
/// its arguments flattened (leaves, tree structures, device).
pub(crate) struct Call {
    pub(crate) given: Options,
    pub(crate) leaves: Vec<Vec<Tensor>>,
    pub(crate) defs: Vec<TreeDef>,
    pub(crate) device: Device,
}

impl Call {
    pub(crate) fn of<S: ArgList, F: Function<S> + ?Sized, C: CallArgs<S>>(f: &F, args: &C) -> Result<Call> {
        let (leaves, defs, device) = flatten_call(args)?;
        Ok(Call {
            given: f.own_options(),
            leaves,
            defs,
            device,
        })
    }

    /// `f` traced on these arguments at the top (not differentiated).
    fn trace<S: ArgList, F: Function<S> + ?Sized>(&self, f: &F) -> Result<Traced> {
        self.trace_as(f, false)
    }

    /// `f` traced on these arguments at the top, for a derivative taken
    /// of it where `differentiated` (`vjp`, `jvp`, `linearize`).
    pub(crate) fn trace_as<S: ArgList, F: Function<S> + ?Sized>(&self, f: &F, differentiated: bool) -> Result<Traced> {
        trace_top(f, (self.given, differentiated), &self.defs, &self.leaves, &self.device)
    }
}

/// The planned peak of calling `f` on `args`, as [`call_concrete`] would
/// trace and compile it, without caching or running it.
pub(crate) fn planned_peak_of<S, F, C>(f: &F, args: &C) -> Result<usize>
where
    S: ArgList,
    F: Function<S> + ?Sized,
    C: CallArgs<S>,
{
    let call = Call::of(f, args)?;
    Ok(call.trace(f)?.compile(&call.given, Arc::default()).exe.peak())
}

/// The graph that calling `f` on `args` runs (traced, transformed and
/// prepared), for inspection; it prints like a jaxpr. It runs as the call
/// would: on the kernel path and under the memory limit of `f`'s options,
/// its draws from `f`'s seed where it has one.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{make_graph, vmap, Tracer};
/// let xs = Tensor::zeros((8, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let g = make_graph(&vmap(|x: Tracer| x.exp()?.sum(0)), &xs)?;
/// assert!(g.to_string().contains("exp"));
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn make_graph<S, F, C>(f: &F, args: C) -> Result<crate::interp::Prepared>
where
    S: ArgList,
    F: Function<S>,
    C: CallArgs<S>,
{
    let call = Call::of(f, &args)?;
    let traced = call.trace(f)?;
    let exe = Executable::new(&traced.graph, call.given.machine()).named("Graph::run");
    Ok(exe.seeded(traced.seed, Arc::default()).into_prepared())
}
