//! Transforms and what they share: the [`Function`] trait (a traceable
//! function: a closure or another transform), the per-signature graph cache,
//! and calling a traced function on concrete tensors.

pub(crate) mod dims;
pub(crate) mod grad;
pub(crate) mod jacobian;
pub(crate) mod jvp;
pub(crate) mod loops;
pub(crate) mod planner;
pub(crate) mod schedule;
mod segments;
pub(crate) mod settings;
pub(crate) mod transformed;
pub(crate) mod tree;
pub(crate) mod vmap;

use crate::error::{Error, Result};
use crate::interp::exec::Executable;
use crate::interp::passes;
use crate::interp::{NodeTimes, RunStats};
use crate::ir::options::{ConvRoute, Options};
use crate::ir::{Graph, TensorType};
use crate::rules::{Builder, BuilderRef, Outer, TraceCtx};
use crate::trace::Tracer;
use candle_core::{Device, DeviceLocation, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use transformed::{Transform, Transformed};
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

/// A function traced and transformed (and simplified) on tensors of one
/// signature, with the train/eval flags its trace read (and their values
/// then) and the seed of the outermost transform in it that has one.
#[derive(Debug)]
pub(crate) struct Traced {
    pub(crate) graph: Graph,
    pub(crate) out_def: TreeDef,
    mode_deps: Vec<(Arc<AtomicBool>, bool)>,
    pub(crate) seed: Option<u64>,
}

impl Traced {
    /// Ready to run: the graph through the executable's passes, refused
    /// above `limit`, drawing from the trace's seed counted by `calls`.
    pub(crate) fn compile(self, given: &Options, calls: Arc<AtomicU64>) -> Compiled {
        Compiled {
            exe: Executable::new(&self.graph).seeded(self.seed, calls).options(given),
            out_def: self.out_def,
            mode_deps: self.mode_deps,
        }
    }
}

/// A traced function ready to run on tensors of its signature.
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) exe: Executable,
    pub(crate) out_def: TreeDef,
    mode_deps: Vec<(Arc<AtomicBool>, bool)>,
}

impl Compiled {
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
    calls: Arc<AtomicU64>,
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

thread_local! {
    /// The traces being traced on this thread, innermost last: where a
    /// loop's body is traced, so that it may read any of them (JAX's trace
    /// stack).
    static ACTIVE: std::cell::RefCell<Vec<BuilderRef>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` (which traces into `b`) with `b` the innermost active trace;
/// the stack is restored when `f` returns or unwinds.
pub(crate) fn tracing<T>(b: &BuilderRef, f: impl FnOnce() -> T) -> T {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            ACTIVE.with(|a| a.borrow_mut().pop());
        }
    }
    ACTIVE.with(|a| a.borrow_mut().push(b.clone()));
    let _pop = Pop;
    f()
}

/// The innermost trace being traced on this thread, if any.
pub(crate) fn innermost_active() -> Option<BuilderRef> {
    ACTIVE.with(|a| a.borrow().last().cloned())
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
    let out = tracing(b, || f.apply(S::unflatten_args(defs, tracers)?))?;
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
) -> Result<Traced> {
    let types: Vec<Vec<TensorType>> = leaves.iter().map(|a| a.iter().map(TensorType::of).collect()).collect();
    let ctx = TraceCtx::new(device.clone());
    ctx.offer_seed(given.seed);
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
    Ok(Traced {
        graph: passes::simplify(&graph),
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
            let traced = trace_top(f, (given, false), &key.defs, &leaves, &device)?;
            let c = Arc::new(traced.compile(&given, cache.calls.clone()));
            cache.insert(key, c.clone());
            c
        }
    };
    let flat: Vec<Tensor> = leaves.into_iter().flatten().collect();
    let outs = compiled.exe.run(&flat)?;
    F::Output::concrete_from(&compiled.out_def, &mut outs.into_iter())
}

/// The planned peak of calling `f` on `args`, as [`call_concrete`] would
/// trace and compile it, without caching or running it.
pub(crate) fn planned_peak_of<S, F, C>(f: &F, args: &C) -> Result<usize>
where
    S: ArgList,
    F: Function<S> + ?Sized,
    C: CallArgs<S>,
{
    let given = f.own_options();
    let (leaves, defs, device) = flatten_call(args)?;
    let traced = trace_top(f, (given, false), &defs, &leaves, &device)?;
    Ok(traced.compile(&given, Arc::default()).exe.peak())
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
    let traced = trace_top(f, (f.own_options(), false), &defs, &leaves, &device)?;
    Ok(Executable::new(&traced.graph).into_graph())
}

/// Running a graph from [`make_graph`] on concrete tensors, in the order
/// of the flattened arguments (as `make_graph` flattened them). Each run
/// goes through the executable as a transform's call does (the passes,
/// the memory check against the machine's available memory); random
/// draws come from the process-wide stream.
impl Graph {
    /// Runs the graph and returns its outputs.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        Executable::new(self).named("Graph::run").run(inputs)
    }

    /// [`Graph::run`], also reporting the peak number and size of values
    /// held at once.
    pub fn run_with_stats(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
        Executable::new(self).named("Graph::run").run_with_stats(inputs)
    }

    /// [`Graph::run`], also returning the seconds each computed node took,
    /// as `(node index, seconds)`: where a graph spends its time.
    pub fn run_profiled(&self, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
        Executable::new(self).named("Graph::run").run_profiled(inputs)
    }

    /// The most bytes a run of the graph holds at once by its plan:
    /// every value alive at the same time (views sharing their operand's
    /// buffer, inputs and captured tensors included) and what the kernel
    /// running at that moment allocates besides its result. A call whose
    /// plan exceeds the memory limit is refused before it runs.
    pub fn planned_peak_bytes(&self) -> usize {
        Executable::new(self).peak()
    }
}

/// What [`jit`] does: nothing to the function but trace it once per input
/// signature and run it.
pub struct JitOf<F> {
    f: F,
}

/// The function traced once per input signature and run by the interpreter,
/// with no transform (JAX's `jit`): a way to run a traced model on concrete
/// tensors, and the per-example oracle that `vmap` is tested against. Its
/// options (route, strict mode, seed, memory limit) are inherited by the
/// transforms inside.
pub type Jit<F> = Transformed<JitOf<F>>;

/// Wraps `f` so it can be called on concrete tensors (see [`Jit`]).
pub fn jit<F>(f: F) -> Jit<F> {
    Transformed::new(JitOf { f })
}

impl<S: ArgList, F: Function<S>> Transform<S> for JitOf<F> {
    type Output = F::Output;
    fn apply(&self, options: &Options, args: S) -> Result<F::Output> {
        // Inside another trace a jit is transparent; its options apply when
        // it is the function called on tensors.
        options.check_not_vmap("jit")?;
        self.f.apply(args)
    }
}
