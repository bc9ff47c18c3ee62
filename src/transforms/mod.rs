//! Transforms and what they share: the [`Function`] trait (a traceable
//! function: a closure or another transform), the per-signature graph cache,
//! and calling a traced function on concrete tensors.

pub(crate) mod dims;
pub(crate) mod grad;
pub(crate) mod jacobian;
pub(crate) mod jvp;
pub(crate) mod planner;
mod remat;
pub(crate) mod schedule;
mod segments;
pub(crate) mod settings;
pub(crate) mod tree;
pub(crate) mod vmap;

use crate::error::{Error, Result};
use crate::interp::{self, NodeTimes, RunStats};
use crate::ir::options::{ConvRoute, Options};
use crate::ir::{Graph, TensorType};
use crate::rules::{Builder, BuilderRef, Outer, TraceCtx};
use crate::trace::Tracer;
use candle_core::{Device, DeviceLocation, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tree::{ArgList, CallArgs, SymTree, TreeDef};

/// A function that can be traced: given symbolic arguments (a tuple with
/// one tree per parameter) it records its computation and returns a tree of
/// symbolic results. Implemented for closures of one to four parameters
/// returning `Result<tree>`, and for every transform, so transforms nest:
/// `vmap(vmap(f))`, `vmap(jit(f))`. A transform of a `Send + Sync` function
/// is itself `Send + Sync`; closures that capture symbolic tensors of an
/// enclosing trace are not, and need not be.
pub trait Function<S: ArgList> {
    /// The symbolic result tree.
    type Output: SymTree;
    /// Records the function applied to `args`.
    fn apply(&self, args: S) -> Result<Self::Output>;

    /// The options this function sets for the transforms it nests, when it
    /// is the one called on tensors (none for a plain closure).
    fn own_options(&self) -> Options {
        Options::new()
    }
}

macro_rules! closure_functions {
    ($($a:ident),+) => {
        impl<F, R, $($a),+> Function<($($a,)+)> for F
        where
            F: Fn($($a),+) -> Result<R>,
            R: SymTree,
            $($a: SymTree),+
        {
            type Output = R;
            #[allow(non_snake_case)]
            fn apply(&self, ($($a,)+): ($($a,)+)) -> Result<R> {
                self($($a),+)
            }
        }
    };
}

/// Borrows a function as a function (transforms take theirs by value): what
/// a transform builds around a function it holds, anew at each trace.
pub(crate) struct ByRef<'a, F>(pub(crate) &'a F);

impl<S: ArgList, F: Function<S>> Function<S> for ByRef<'_, F> {
    type Output = F::Output;
    fn apply(&self, args: S) -> Result<F::Output> {
        self.0.apply(args)
    }

    fn own_options(&self) -> Options {
        self.0.own_options()
    }
}

closure_functions!(A);
closure_functions!(A, B);
closure_functions!(A, B, C);
closure_functions!(A, B, C, D);

/// What a concrete call is cached under: argument structure and types, the
/// device, the outermost transform's options, and the process-wide
/// settings a nested transform may fall back on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    defs: Vec<TreeDef>,
    types: Vec<TensorType>,
    device: DeviceLocation,
    given: Options,
    /// The process-wide route, `None` when the environment names none that
    /// parses (a transform with its own route does not need it).
    route: Option<ConvRoute>,
    strict: bool,
}

/// A traced, transformed and pruned function, ready to run, with the
/// train/eval flags its trace read (and their values then).
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) graph: Graph,
    pub(crate) out_def: TreeDef,
    mode_deps: Vec<(Arc<AtomicBool>, bool)>,
    /// The seed of the outermost transform that has one, if any.
    pub(crate) seed: Option<u64>,
    /// The bytes `graph` holds at its peak by its plan
    /// (`interp::planned_peak`), worked out once rather than per call.
    peak: usize,
}

impl Compiled {
    /// The graph with its epilogues fused (`Graph::fuse_epilogues`) and
    /// cheap values recomputed where that lowers its peak
    /// (`remat::rematerialise`), for running: only once no transform will
    /// rewrite it, since fused nodes have no transform rules (and the
    /// simplifier would merge a recomputed value with its original).
    fn fused(self) -> Self {
        let graph = remat::rematerialise(self.graph.fuse_epilogues());
        Compiled {
            peak: interp::planned_peak(&graph),
            graph,
            ..self
        }
    }

    /// Whether every flag the trace read still has the value it had.
    fn current(&self) -> bool {
        self.mode_deps.iter().all(|(f, on)| f.load(Ordering::Relaxed) == *on)
    }
}

/// Traced graphs of one transformed function, per input signature; shared
/// safely between threads. It also counts the function's calls, the
/// stream of a transform with its own seed.
#[derive(Default, Debug)]
pub(crate) struct GraphCache {
    /// Each signature's graph and when it was last used (a `tick`).
    map: Mutex<HashMap<CacheKey, (Arc<Compiled>, u64)>>,
    calls: AtomicU64,
    tick: AtomicU64,
}

impl GraphCache {
    /// Number of signatures cached (at most `settings::cache_capacity()`).
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The graph cached for `key`, marked as used now.
    fn get(&self, key: &CacheKey) -> Option<Arc<Compiled>> {
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get_mut(key).map(|(c, used)| {
            *used = now;
            c.clone()
        })
    }

    /// Caches `c` for `key`, dropping the least recently used signatures
    /// beyond the capacity (a scan: it runs only after a trace, which costs
    /// far more).
    fn insert(&self, key: CacheKey, c: Arc<Compiled>) {
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(key, (c, now));
        while map.len() > settings::cache_capacity() {
            let Some(oldest) = map.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone()) else {
                break;
            };
            map.remove(&oldest);
        }
    }
}

/// A process-unique id for a new trace's builder (0 is left to the
/// rules' scratch builders).
pub(crate) fn next_builder_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The innermost builder among the leaves (all must belong to one chain of
/// nested traces).
pub(crate) fn innermost(leaves: &[Vec<Tracer>]) -> Option<BuilderRef> {
    leaves
        .iter()
        .flatten()
        .max_by_key(|t| t.b.borrow().ancestors.len())
        .map(|t| t.b.clone())
}

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
    let tracers = types
        .iter()
        .map(|arg| {
            arg.iter()
                .map(|ty| {
                    let id = b.borrow_mut().input(ty.clone());
                    Tracer::new(b, id)
                })
                .collect()
        })
        .collect();
    let out = f.apply(S::unflatten_args(defs, tracers)?)?;
    let mut leaves = Vec::new();
    let out_def = out.flatten_into(&mut leaves);
    let mut bb = b.borrow_mut();
    let ids = leaves.iter().map(|t| bb.lift(&t.outer())).collect::<Result<Vec<_>>>()?;
    let (g, captures) = bb.finish(ids);
    Ok((g, captures, out_def))
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
    let b = Builder::child(outer, next_builder_id(), given);
    b.borrow_mut().differentiated |= differentiated;
    b.borrow_mut().batched |= batched;
    trace_into(f, &b, defs, types)
}

/// Flattened concrete arguments with their device.
fn flatten_call<S: ArgList, C: CallArgs<S>>(args: &C) -> Result<(Vec<Vec<Tensor>>, Vec<TreeDef>, Device)> {
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
) -> Result<Compiled> {
    let types: Vec<Vec<TensorType>> = leaves.iter().map(|a| a.iter().map(TensorType::of).collect()).collect();
    let ctx = TraceCtx::new(device.clone());
    ctx.offer_seed(given.get_seed());
    // A top-level trace has no enclosing one, so nothing can be captured.
    let root = Builder::root(next_builder_id(), given, ctx.clone());
    root.borrow_mut().differentiated = differentiated;
    let (graph, _, out_def) = trace_into(f, &root, defs, &types)?;
    for kind in ctx.fallbacks.borrow().iter() {
        settings::warn_once(
            format!("loop-{kind}"),
            format!("vmap: no batching rule for {kind} in this case; running it once per example (performance drop)"),
        );
    }
    let mode_deps = ctx.mode_deps.borrow().clone();
    let graph = graph.simplify();
    Ok(Compiled {
        peak: interp::planned_peak(&graph),
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
    let given = f.own_options();
    let (leaves, defs, device) = flatten_call(args)?;
    let key = CacheKey {
        types: leaves.iter().flatten().map(TensorType::of).collect(),
        defs,
        device: device.location(),
        given,
        route: settings::conv_route().ok(),
        strict: settings::strict(),
    };
    let compiled = match cache.get(&key) {
        Some(c) if c.current() => c,
        _ => {
            let c = Arc::new(trace_top(f, (given, false), &key.defs, &leaves, &device)?.fused());
            cache.insert(key, c.clone());
            c
        }
    };
    let flat: Vec<Tensor> = leaves.into_iter().flatten().collect();
    interp::check_peak(compiled.peak, given.get_memory_limit())?;
    let seed = settings::run_seed(&compiled.graph, compiled.seed, &cache.calls);
    let outs = interp::run(&compiled.graph, &flat, seed)?;
    F::Output::concrete_from(&compiled.out_def, &mut outs.into_iter())
}

/// The graph that calling `f` on `args` runs (traced and transformed, dead
/// code removed), for inspection; it prints like a jaxpr.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{make_graph, vmap, Tracer};
/// let xs = Tensor::zeros((8, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let g = make_graph(&vmap(|x: Tracer| x.exp()?.sum(0)), &xs)?;
/// assert!(g.to_string().contains("exp"));
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn make_graph<S, F, C>(f: &F, args: C) -> Result<Graph>
where
    S: ArgList,
    F: Function<S>,
    C: CallArgs<S>,
{
    let (leaves, defs, device) = flatten_call(&args)?;
    Ok(trace_top(f, (f.own_options(), false), &defs, &leaves, &device)?
        .fused()
        .graph)
}

/// [`make_graph`] before the passes that prepare a graph to run (fusion,
/// rematerialisation), for testing those passes.
#[cfg(test)]
pub(crate) fn make_graph_unfused<S, F, C>(f: &F, args: C) -> Result<Graph>
where
    S: ArgList,
    F: Function<S>,
    C: CallArgs<S>,
{
    let (leaves, defs, device) = flatten_call(&args)?;
    Ok(trace_top(f, (f.own_options(), false), &defs, &leaves, &device)?.graph)
}

/// Running a graph from [`make_graph`] on concrete tensors, in the order
/// of the flattened arguments (as `make_graph` flattened them). Random
/// draws come from the process-wide stream.
impl Graph {
    /// The seed of one run from the process-wide stream (none taken when
    /// the graph draws nothing).
    fn process_seed(&self) -> u64 {
        settings::run_seed(self, None, &AtomicU64::new(0))
    }

    /// Runs the graph and returns its outputs.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        interp::check_memory(self, None)?;
        interp::run(self, inputs, self.process_seed())
    }

    /// [`Graph::run`], also reporting the peak number and size of values
    /// held at once.
    pub fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        interp::check_memory(self, None)?;
        interp::run_with_stats(self, inputs, self.process_seed())
    }

    /// [`Graph::run`], also returning the seconds each computed node took,
    /// as `(node index, seconds)`: where a graph spends its time.
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        interp::check_memory(self, None)?;
        interp::run_profiled(self, inputs, self.process_seed())
    }
}

/// The function traced once per input signature and run by the interpreter,
/// with no transform (JAX's `jit`): a way to run a traced model on concrete
/// tensors, and the per-example oracle that `vmap` is tested against.
pub struct Jit<F> {
    f: F,
    options: Options,
    cache: GraphCache,
}

/// Wraps `f` so it can be called on concrete tensors (see [`Jit`]).
pub fn jit<F>(f: F) -> Jit<F> {
    Jit {
        f,
        options: Options::new(),
        cache: GraphCache::default(),
    }
}

impl<F> Jit<F> {
    /// Options inherited by the transforms inside `f` (route, strict mode)
    /// and the seed of its random draws, when this jit is called on tensors.
    pub fn options(mut self, options: Options) -> Self {
        self.cache = GraphCache::default(); // a changed transform traces anew
        self.options = options;
        self
    }

    /// Calls the function on concrete arguments.
    pub fn call<S, C>(&self, args: C) -> Result<<F::Output as SymTree>::Concrete>
    where
        S: ArgList,
        F: Function<S>,
        C: CallArgs<S>,
    {
        call_concrete(self, &self.cache, &args)
    }

    /// Number of input signatures traced so far.
    pub fn traced_signatures(&self) -> usize {
        self.cache.len()
    }
}

impl<S: ArgList, F: Function<S>> Function<S> for Jit<F> {
    type Output = F::Output;
    fn apply(&self, args: S) -> Result<F::Output> {
        // Inside another trace a jit is transparent; its options apply when
        // it is the function called on tensors.
        self.options.check_not_vmap("jit")?;
        self.f.apply(args)
    }

    fn own_options(&self) -> Options {
        self.options
    }
}
