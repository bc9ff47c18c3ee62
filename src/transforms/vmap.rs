//! `vmap`: traces the function on per-example shapes, then re-emits every
//! node through its primitive's batching rule into the enclosing trace.

use super::tree::{ArgList, CallArgs, SymTree, TreeDef};
use super::{call_concrete, innermost, trace_inner, Function, GraphCache};
use crate::error::{Error, Result};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::route::{self, ConvRoute};
use crate::rules::{fallback, BVal, BatchCx, BatchOpts};
use crate::trace::{Builder, BuilderRef, Tracer};

/// Batch axes, one entry per top-level argument (or output); `None` means
/// not batched, negative axes count from the end. Built from a single
/// integer (the same axis everywhere) or a list: `vmap(f).in_dims([None,
/// Some(0)])`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dims {
    /// The same axis for every argument.
    All(Option<isize>),
    /// One entry per top-level argument.
    Each(Vec<Option<isize>>),
}

impl Dims {
    fn for_count(&self, n: usize, what: &str) -> std::result::Result<Vec<Option<isize>>, String> {
        match self {
            Dims::All(d) => Ok(vec![*d; n]),
            Dims::Each(v) if v.len() == n => Ok(v.clone()),
            Dims::Each(v) => Err(format!("{} entries given for {n} {what}", v.len())),
        }
    }
}

macro_rules! dims_from_int {
    ($($t:ty),+) => {$(
        impl From<$t> for Dims {
            fn from(d: $t) -> Dims { Dims::All(Some(d as isize)) }
        }
        impl<const N: usize> From<[Option<$t>; N]> for Dims {
            fn from(d: [Option<$t>; N]) -> Dims { Dims::Each(d.iter().map(|x| x.map(|v| v as isize)).collect()) }
        }
        impl<const N: usize> From<[$t; N]> for Dims {
            fn from(d: [$t; N]) -> Dims { Dims::Each(d.iter().map(|&v| Some(v as isize)).collect()) }
        }
        impl From<Vec<Option<$t>>> for Dims {
            fn from(d: Vec<Option<$t>>) -> Dims { Dims::Each(d.iter().map(|x| x.map(|v| v as isize)).collect()) }
        }
    )+};
}

dims_from_int!(i32, i64, isize, usize);

/// What random operations (dropout) do under `vmap`, as `torch.func.vmap`'s
/// `randomness` option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Randomness {
    /// Refuse to trace a random operation (the default).
    #[default]
    Error,
    /// One draw shared by every example.
    Same,
    /// An independent draw per example.
    Different,
}

/// The vectorising map of `f` (see [`vmap`]).
pub struct Vmap<F> {
    f: F,
    in_dims: Dims,
    out_dims: Dims,
    chunk_size: Option<usize>,
    route: Option<ConvRoute>,
    strict: Option<bool>,
    randomness: Randomness,
    cache: GraphCache,
}

/// Vectorises `f` over a batch axis of its arguments, like `jax.vmap` and
/// `torch.func.vmap`: `vmap(f).call(xs)` equals stacking `f(x)` for every
/// `x` in `xs`, computed as one batched graph.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{vmap, Tracer};
/// let xs = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
/// let w = Tensor::new(&[1f32, 10., 100.], &Device::Cpu)?;
/// // a per-example dot product, batched over the rows of `xs`
/// let dot = vmap(|x: Tracer| x.mul(&w)?.sum(0));
/// let ys = dot.call(&xs)?;
/// assert_eq!(ys.to_vec1::<f32>()?, vec![210., 543.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn vmap<F>(f: F) -> Vmap<F> {
    Vmap {
        f,
        in_dims: Dims::All(Some(0)),
        out_dims: Dims::All(Some(0)),
        chunk_size: None,
        route: None,
        strict: None,
        randomness: Randomness::Error,
        cache: GraphCache::default(),
    }
}

impl<F> Vmap<F> {
    /// The batch axis of each top-level argument (default: 0 for all).
    pub fn in_dims(mut self, dims: impl Into<Dims>) -> Self {
        self.in_dims = dims.into();
        self
    }

    /// Where the batch axis goes in each top-level output (default: 0).
    /// `None` asks for an unbatched output, an error if it depends on the
    /// batch.
    pub fn out_dims(mut self, dims: impl Into<Dims>) -> Self {
        self.out_dims = dims.into();
        self
    }

    /// Runs the batch in chunks of `k` examples and concatenates, bounding
    /// peak memory as the batch grows.
    pub fn chunk_size(mut self, k: usize) -> Self {
        self.chunk_size = Some(k);
        self
    }

    /// The convolution route for this transform (wins over the process-wide
    /// setting and the environment variable).
    pub fn conv_route(mut self, route: ConvRoute) -> Self {
        self.route = Some(route);
        self
    }

    /// Strict mode for this transform: a primitive without a batching rule is
    /// an error instead of a warning and a per-example loop.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = Some(on);
        self
    }

    /// What random operations (dropout) do: an error (default), one draw
    /// for all examples, or a draw per example.
    pub fn randomness(mut self, r: Randomness) -> Self {
        self.randomness = r;
        self
    }

    /// Calls the vectorised function on concrete tensors. The traced graph is
    /// cached per input signature, so a repeated call does not trace again.
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

    fn opts(&self) -> Result<BatchOpts> {
        Ok(BatchOpts {
            route: route::resolve(self.route)?,
            strict: self.strict.unwrap_or_else(crate::config::strict),
            randomness: self.randomness,
        })
    }
}

/// Batched inputs of the inner graph: ids in `outer`, batch axes, and the
/// per-example types; plus the batch size.
struct Inputs {
    vals: Vec<BVal>,
    types: Vec<Vec<TensorType>>,
    size: usize,
}

fn batched_inputs(outer: &BuilderRef, leaves: &[Vec<Tracer>], dims: &[Option<isize>]) -> Result<Inputs> {
    let mut ob = outer.borrow_mut();
    let (mut vals, mut types, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
    for (arg, (arg_leaves, dim)) in leaves.iter().zip(dims).enumerate() {
        let mut arg_types = Vec::new();
        for t in arg_leaves {
            let id = ob.lift(t)?;
            let mut ty = t.ty.clone();
            let bdim = match *dim {
                None => None,
                Some(d) => {
                    let r = ty.rank() as isize;
                    let a = if d < 0 { d + r } else { d };
                    if a < 0 || a >= r {
                        return Err(Error::InDims {
                            arg,
                            msg: format!("axis {d} is out of range for a leaf of shape {:?}", ty.shape),
                        });
                    }
                    let a = a as usize;
                    sizes.push((arg, a, ty.shape.remove(a)));
                    Some(a)
                }
            };
            vals.push((id, bdim));
            arg_types.push(ty);
        }
        types.push(arg_types);
    }
    let size = match sizes.first() {
        None => {
            return Err(Error::InDims {
                arg: 0,
                msg: "vmap needs at least one batched tensor among its arguments".into(),
            })
        }
        Some(&(_, _, s)) => s,
    };
    if sizes.iter().any(|&(_, _, s)| s != size) {
        return Err(Error::BatchSize { sizes });
    }
    Ok(Inputs { vals, types, size })
}

/// Re-emits `g` into `cx.b` through the batching rules; `inputs` binds the
/// graph's inputs. Returns the batched outputs.
pub(crate) fn batch_graph(g: &Graph, cx: &mut BatchCx, inputs: &[BVal]) -> Result<Vec<BVal>> {
    batch_graph_shared(g, cx, inputs, &mut std::collections::HashMap::new())
}

/// [`batch_graph`], with `shared` holding values that must be the same in
/// every chunk of a chunked map (random draws under `Randomness::Same`).
fn batch_graph_shared(
    g: &Graph,
    cx: &mut BatchCx,
    inputs: &[BVal],
    shared: &mut std::collections::HashMap<usize, BVal>,
) -> Result<Vec<BVal>> {
    let mut env: Vec<BVal> = vec![(usize::MAX, None); g.nodes.len()];
    for (k, &v) in g.inputs.iter().enumerate() {
        env[v] = inputs[k];
    }
    for (v, node) in g.nodes.iter().enumerate() {
        env[v] = match &node.prim {
            Prim::Input(_) => env[v],
            Prim::Const(k) => (cx.b.constant(&g.consts[*k]), None),
            Prim::Scalar(x) => (cx.b.scalar(*x, node.ty.dtype), None),
            Prim::Random(r) => match shared.get(&v) {
                Some(&bv) => bv,
                None => {
                    let bv = batch_random(cx, r)?;
                    if bv.1.is_none() {
                        shared.insert(v, bv);
                    }
                    bv
                }
            },
            prim => {
                let args: Vec<BVal> = node.args.iter().map(|&a| env[a]).collect();
                if args.iter().all(|a| a.1.is_none()) {
                    let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
                    (cx.b.emit(prim.clone(), &ids)?, None)
                } else {
                    let out = fallback::batch(cx, prim, &args)?;
                    check_batched(prim, cx, out, &node.ty)?;
                    out
                }
            }
        };
    }
    Ok(g.outputs.iter().map(|&o| env[o]).collect())
}

/// A random primitive under `vmap`, as the `randomness` setting says.
fn batch_random(cx: &mut BatchCx, r: &crate::rules::random::Uniform) -> Result<BVal> {
    match cx.opts.randomness {
        Randomness::Error => Err(Error::unsupported(
            r.name(),
            "vmap",
            "random operations under vmap need .randomness(Randomness::Same) or (Randomness::Different)",
        )),
        Randomness::Same => Ok((cx.b.emit(Prim::Random(r.clone()), &[])?, None)),
        Randomness::Different => {
            let mut ty = r.ty.clone();
            ty.shape.insert(0, cx.size);
            Ok((
                cx.b.emit(Prim::Random(crate::rules::random::Uniform { ty }), &[])?,
                Some(0),
            ))
        }
    }
}

/// A batching rule must give the per-example type with the batch axis
/// inserted; anything else is a bug in the rule, reported as such.
fn check_batched(prim: &Prim, cx: &BatchCx, (v, bdim): BVal, per: &TensorType) -> Result<()> {
    let mut want = per.shape.clone();
    if let Some(d) = bdim {
        if d <= want.len() {
            want.insert(d, cx.size);
        }
    }
    let got = cx.b.ty(v);
    if got.shape != want || got.dtype != per.dtype {
        return Err(Error::unsupported(
            prim.name(),
            "vmap",
            format!(
                "internal error: batching rule gave {:?}{:?}, expected {:?}{want:?}",
                got.dtype, got.shape, per.dtype
            ),
        ));
    }
    Ok(())
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

/// The out_dims entry of every output leaf (one entry per top-level output:
/// the elements of a returned tuple, else the whole result).
fn leaf_out_dims(dims: &Dims, def: &TreeDef) -> Result<Vec<Option<isize>>> {
    let tops: Vec<&TreeDef> = match def {
        TreeDef::Tuple(c) => c.iter().collect(),
        d => vec![d],
    };
    let per_top = dims
        .for_count(tops.len(), "outputs")
        .map_err(|msg| Error::OutDims { output: 0, msg })?;
    Ok(tops
        .iter()
        .zip(per_top)
        .flat_map(|(t, d)| std::iter::repeat_n(d, t.leaf_count()))
        .collect())
}

impl<S: ArgList, F: Function<S>> Function<S> for Vmap<F> {
    type Output = F::Output;

    fn apply(&self, args: S) -> Result<F::Output> {
        let (leaves, defs) = args.flatten_args();
        let dims = self
            .in_dims
            .for_count(defs.len(), "arguments")
            .map_err(|msg| Error::InDims { arg: 0, msg })?;
        let outer = innermost(&leaves).ok_or_else(|| Error::InDims {
            arg: 0,
            msg: "vmap needs at least one tensor argument".into(),
        })?;
        let ins = batched_inputs(&outer, &leaves, &dims)?;
        let (g, captures, out_def) = trace_inner(&self.f, &outer, &defs, &ins.types)?;
        // Prune first, so dead work (an unused input gradient) is neither
        // batched nor timed by the Auto route.
        let g = g.eliminate_dead_code();
        let out_dims = leaf_out_dims(&self.out_dims, &out_def)?;
        let opts = self.opts()?;
        let ids = {
            let mut ob = outer.borrow_mut();
            let mut vals = ins.vals.clone();
            for c in &captures {
                vals.push((ob.lift(c)?, None));
            }
            run_chunks(&g, &mut ob, &vals, ins.size, self.chunk_size, &opts, &out_dims)?
        };
        let tracers: Vec<Tracer> = ids.into_iter().map(|id| Tracer::new(&outer, id)).collect();
        F::Output::unflatten_from(&out_def, &mut tracers.into_iter())
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

/// Batches `g` over the whole batch, or chunk by chunk (narrowing the
/// batched inputs and concatenating the outputs) when `chunk` is smaller.
fn run_chunks(
    g: &Graph,
    b: &mut Builder,
    vals: &[BVal],
    size: usize,
    chunk: Option<usize>,
    opts: &BatchOpts,
    out_dims: &[Option<isize>],
) -> Result<Vec<VarId>> {
    let k = match chunk {
        Some(0) => {
            return Err(Error::Config {
                msg: "vmap: chunk_size must be positive".into(),
            })
        }
        Some(k) => k.min(size),
        None => size,
    };
    if size == 0 {
        return empty_outputs(g, b, out_dims);
    }
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
        let mut cx = BatchCx { b, size: len, opts };
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
