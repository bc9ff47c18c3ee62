//! `vmap`: traces the function on per-example shapes, then re-emits every
//! node through its primitive's batching rule into the enclosing trace.

use super::dims::Dims;
use super::schedule::emit_batch;
use super::settings;
use super::transformed::{Transform, Transformed};
use super::tree::{ArgList, SymTree, TreeDef};
use super::{innermost, trace_inner, Function};
use crate::error::{Error, Result};
use crate::ir::options::{Options, Randomness, Schedule};
use crate::ir::TensorType;
use crate::rules::{BVal, BuilderRef};
use crate::trace::Tracer;

/// What [`vmap`] does: batches `f` over the axes `in_dims` of its
/// arguments, placing the batch axis of its results at `out_dims`.
pub struct VmapOf<F> {
    f: F,
    in_dims: Dims,
    out_dims: Dims,
}

/// The vectorising map of `f` (see [`vmap`]).
pub type Vmap<F> = Transformed<VmapOf<F>>;

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
    Transformed::new(VmapOf {
        f,
        in_dims: Dims::All(Some(0)),
        out_dims: Dims::All(Some(0)),
    })
}

impl<F> Vmap<F> {
    /// The batch axis of each top-level argument (default: 0 for all).
    pub fn in_dims(self, dims: impl Into<Dims>) -> Self {
        self.edit(|k| k.in_dims = dims.into())
    }

    /// Where the batch axis goes in each top-level output (default: 0).
    /// `None` asks for an unbatched output, an error if it depends on the
    /// batch.
    pub fn out_dims(self, dims: impl Into<Dims>) -> Self {
        self.edit(|k| k.out_dims = dims.into())
    }

    /// Runs the batch in chunks of `k` examples and concatenates, bounding
    /// peak memory as the batch grows.
    pub fn chunk_size(self, k: usize) -> Self {
        self.with_options(|o| o.chunk_size(k))
    }

    /// What random operations (dropout) do: an error (default), one draw
    /// for all examples, or a draw per example.
    pub fn randomness(self, r: Randomness) -> Self {
        self.with_options(|o| o.randomness(r))
    }

    /// How the batch runs as a whole: batched, once per example, or the
    /// faster of the two for a large program (the default; see
    /// [`Schedule`]).
    pub fn schedule(self, s: Schedule) -> Self {
        self.with_options(|o| o.schedule(s))
    }
}

/// Batched inputs of the inner graph: ids in `outer`, batch axes, and the
/// per-example types; plus the batch size.
struct Inputs {
    vals: Vec<BVal>,
    types: Vec<Vec<TensorType>>,
    size: usize,
}

fn batched_inputs(
    outer: &BuilderRef,
    (leaves, defs): (&[Vec<Tracer>], &[TreeDef]),
    dims: &[Vec<Option<isize>>],
) -> Result<Inputs> {
    let mut ob = outer.borrow_mut();
    let (mut vals, mut types, mut sizes, mut names) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (arg, (arg_leaves, arg_dims)) in leaves.iter().zip(dims).enumerate() {
        let mut arg_types = Vec::new();
        let paths = defs.get(arg).map(TreeDef::leaf_paths).unwrap_or_default();
        for (k, (t, dim)) in arg_leaves.iter().zip(arg_dims).enumerate() {
            let id = ob.lift(&t.outer())?;
            let mut ty = t.ty.clone();
            let bdim = match *dim {
                None => None,
                Some(d) => {
                    let r = ty.rank() as isize;
                    let a = if d < 0 { d + r } else { d };
                    if a < 0 || a >= r {
                        let at = match paths.get(k) {
                            Some(p) if !p.is_empty() => format!(" `{p}`"),
                            _ => String::new(),
                        };
                        return Err(Error::InDims {
                            arg,
                            msg: format!("axis {d} is out of range for the leaf{at} of shape {:?}", ty.shape),
                        });
                    }
                    let a = a as usize;
                    sizes.push((arg, a, ty.shape.remove(a)));
                    names.push(paths.get(k).cloned().unwrap_or_default());
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
        return Err(Error::BatchSize { sizes, leaves: names });
    }
    Ok(Inputs { vals, types, size })
}

/// The out_dims entry of every output leaf (one entry per top-level output:
/// the elements of a returned tuple, else the whole result).
fn leaf_out_dims(dims: &Dims, def: &TreeDef) -> Result<Vec<Option<isize>>> {
    let tops: Vec<&TreeDef> = match def {
        TreeDef::Tuple(c) => c.iter().collect(),
        d => vec![d],
    };
    let per_top = dims.per_leaf(&tops, "outputs").map_err(|(output, msg)| match output {
        Some(output) => Error::OutDims { output, msg },
        None => Error::Tree {
            msg: format!("vmap: out_dims: {msg}"),
        },
    })?;
    Ok(per_top.into_iter().flatten().collect())
}

impl<S: ArgList, F: Function<S>> Transform<S> for VmapOf<F> {
    type Output = F::Output;

    fn apply(&self, options: &Options, args: S) -> Result<F::Output> {
        let (leaves, defs) = args.flatten_args();
        let dims = self
            .in_dims
            .per_leaf(&defs.iter().collect::<Vec<_>>(), "arguments")
            .map_err(|(arg, msg)| match arg {
                Some(arg) => Error::InDims { arg, msg },
                // a count that does not match is the tree's shape, not an argument's
                None => Error::Tree {
                    msg: format!("vmap: in_dims: {msg}"),
                },
            })?;
        let outer = innermost(&leaves).ok_or_else(|| Error::Tree {
            msg: "vmap: the function has no tensor argument to map over".into(),
        })?;
        let ins = batched_inputs(&outer, (&leaves, &defs), &dims)?;
        let given = options.inherit(&outer.borrow().given);
        let mut opts = settings::resolve(&given)?;
        // a map's examples run side by side on the CPU's threads only
        if !outer.borrow().ctx.device.is_cpu() {
            opts.width = 1;
        }
        outer.borrow().ctx.offer_seed(options.seed);
        let (g, captures, out_def) = trace_inner(&self.f, &outer, (given, false, true), &defs, &ins.types)?;
        // Prune first, so dead work (an unused input gradient) is neither
        // batched nor timed by the Auto route.
        let g = g.eliminate_dead_code();
        let out_dims = leaf_out_dims(&self.out_dims, &out_def)?;
        let ids = {
            let mut ob = outer.borrow_mut();
            let mut vals = ins.vals.clone();
            for c in &captures {
                vals.push((ob.lift(c)?, None));
            }
            emit_batch(&g, &mut ob, &vals, ins.size, &opts, &out_dims)?
        };
        let tracers: Vec<Tracer> = ids.into_iter().map(|id| Tracer::new(&outer, id)).collect();
        F::Output::unflatten_from(&out_def, &mut tracers.into_iter())
    }
}
