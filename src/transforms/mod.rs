//! Transforms and what they share: the [`Function`] trait (a traceable
//! function: a closure or another transform), the per-signature graph cache,
//! and calling a traced function on concrete tensors.

pub(crate) mod grad;
pub(crate) mod tree;
pub(crate) mod vmap;

use crate::error::{Error, Result};
use crate::interp;
use crate::ir::{Graph, TensorType};
use crate::route::{conv_route, ConvRoute};
use crate::trace::{Builder, BuilderRef, Tracer};
use candle_core::{DeviceLocation, Tensor};
use std::collections::HashMap;
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

closure_functions!(A);
closure_functions!(A, B);
closure_functions!(A, B, C);
closure_functions!(A, B, C, D);

/// What a concrete call is cached under: argument structure and types, the
/// device, and the process-wide settings that change the traced graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    defs: Vec<TreeDef>,
    types: Vec<TensorType>,
    device: DeviceLocation,
    /// The process-wide route, `None` when the environment names none that
    /// parses (a transform with its own route does not need it).
    route: Option<ConvRoute>,
    strict: bool,
    mode_epoch: u64,
}

/// A traced, transformed and pruned function, ready to run.
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) graph: Graph,
    pub(crate) out_def: TreeDef,
}

/// Traced graphs of one transformed function, per input signature; shared
/// safely between threads.
#[derive(Default, Debug)]
pub(crate) struct GraphCache {
    map: Mutex<HashMap<CacheKey, Arc<Compiled>>>,
}

impl GraphCache {
    /// Number of signatures traced so far.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
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
) -> Result<(Graph, Vec<Tracer>, TreeDef)>
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
    let ids = leaves.iter().map(|t| bb.lift(t)).collect::<Result<Vec<_>>>()?;
    let (g, captures) = bb.finish(ids);
    Ok((g, captures, out_def))
}

/// Traces `f` on symbolic inputs of the given types in a trace nested in
/// `outer`: the graph, the outer values it captured, and the result's structure.
pub(crate) fn trace_inner<S, F>(
    f: &F,
    outer: &BuilderRef,
    defs: &[TreeDef],
    types: &[Vec<TensorType>],
) -> Result<(Graph, Vec<Tracer>, TreeDef)>
where
    S: ArgList,
    F: Function<S>,
{
    trace_into(f, &Builder::child(outer), defs, types)
}

/// Flattened concrete arguments with their device.
fn flatten_call<S: ArgList, C: CallArgs<S>>(args: &C) -> Result<(Vec<Vec<Tensor>>, Vec<TreeDef>, DeviceLocation)> {
    let (leaves, defs) = args.flatten_args();
    let flat: Vec<&Tensor> = leaves.iter().flatten().collect();
    let device = flat
        .first()
        .map(|t| t.device().location())
        .unwrap_or(DeviceLocation::Cpu);
    if let Some(t) = flat.iter().find(|t| t.device().location() != device) {
        return Err(Error::Device {
            op: "call",
            msg: format!("arguments on {device:?} and {:?}", t.device().location()),
        });
    }
    Ok((leaves, defs, device))
}

/// Traces `f` on symbolic stand-ins for `leaves` in a fresh top-level trace
/// (the leaves' device is where the `Auto` conv route measures).
fn trace_top<S: ArgList, F: Function<S> + ?Sized>(f: &F, defs: &[TreeDef], leaves: &[Vec<Tensor>]) -> Result<Compiled> {
    let types: Vec<Vec<TensorType>> = leaves.iter().map(|a| a.iter().map(TensorType::of).collect()).collect();
    let device = leaves
        .iter()
        .flatten()
        .next()
        .map(|t| t.device().clone())
        .unwrap_or(candle_core::Device::Cpu);
    // A top-level trace has no enclosing one, so nothing can be captured.
    let (graph, _, out_def) = crate::route::with_device(&device, || trace_into(f, &Builder::root(), defs, &types))?;
    Ok(Compiled {
        graph: graph.simplify(),
        out_def,
    })
}

/// Calls `f` on concrete arguments: traces once per signature (cached in
/// `cache`), then runs the graph.
pub(crate) fn call_concrete<S, F, C>(f: &F, cache: &GraphCache, args: &C) -> Result<<F::Output as SymTree>::Concrete>
where
    S: ArgList,
    F: Function<S> + ?Sized,
    C: CallArgs<S>,
{
    let (leaves, defs, device) = flatten_call(args)?;
    let key = CacheKey {
        types: leaves.iter().flatten().map(TensorType::of).collect(),
        defs,
        device,
        route: conv_route().ok(),
        strict: crate::config::strict(),
        mode_epoch: crate::config::mode_epoch(),
    };
    let cached = cache.map.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
    let compiled = match cached {
        Some(c) => c,
        None => {
            let c = Arc::new(trace_top(f, &key.defs, &leaves)?);
            cache
                .map
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, c.clone());
            c
        }
    };
    let flat: Vec<Tensor> = leaves.into_iter().flatten().collect();
    let outs = interp::run(&compiled.graph, &flat)?;
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
    let (leaves, defs, _) = flatten_call(&args)?;
    Ok(trace_top(f, &defs, &leaves)?.graph)
}

/// The function traced once per input signature and run by the interpreter,
/// with no transform (JAX's `jit`): a way to run a traced model on concrete
/// tensors, and the per-example oracle that `vmap` is tested against.
pub struct Jit<F> {
    f: F,
    cache: GraphCache,
}

/// Wraps `f` so it can be called on concrete tensors (see [`Jit`]).
pub fn jit<F>(f: F) -> Jit<F> {
    Jit {
        f,
        cache: GraphCache::default(),
    }
}

impl<F> Jit<F> {
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
        self.f.apply(args)
    }
}
