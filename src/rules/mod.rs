//! Primitive rules, one file (or folder) per family, and the graph walkers
//! that apply them. Every primitive implements [`Rule`]: how its result
//! type follows from its operands (checked while tracing), how it runs on
//! candle, how it batches under `vmap`, its VJP and its JVP, and the facts
//! the passes read about it ([`facts`]: is it a view, does it draw random
//! numbers, is it cheap to recompute, what does its run allocate). The
//! walkers ([`walk`]) re-emit a whole graph through the batching, VJP or
//! JVP rules; the transforms drive them. The memory plan of a graph
//! ([`memory`]) is worked out from the facts.
//!
//! Batching rules follow functorch: a pure function from `(value, Option<batch
//! axis>)` operands to a `(value, Option<batch axis>)` result, emitting the
//! batched computation into the builder of the enclosing trace. Rules are
//! pure: no timing, no global state, no running of graphs. Where a
//! primitive has several lowerings (the conv routes) the rule asks the
//! [`plan::Planner`] in its context, which the transforms supply.

pub(crate) mod attention;
pub(crate) mod control;
pub(crate) mod conv;
pub(crate) mod custom;
pub(crate) mod elementwise;
pub(crate) mod facts;
pub(crate) mod fused;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod memory;
pub(crate) mod place;
pub(crate) mod plan;
pub(crate) mod pool;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod shape;
pub(crate) mod walk;

// the builder the rules emit into: the trace room's
pub(crate) use crate::trace::{Builder, BuilderRef, Outer, TraceCtx};

use crate::error::{Error, Result};
use crate::ir::options::{ConvRoute, Opts};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::kernels::copies::Copies;
use crate::kernels::{widen, Path};
use candle_core::{Device, Tensor};
use facts::{Arg, Facts, Workspace};

/// A value under `vmap`: its id in the output builder and the axis that
/// carries the batch, if any.
pub(crate) type BVal = (VarId, Option<usize>);

/// What a batching rule works with: the builder it emits into, the size of
/// the mapped axis, the options, and the planner that picks among
/// lowerings.
pub(crate) struct BatchCx<'a> {
    pub(crate) b: &'a mut Builder,
    pub(crate) size: usize,
    pub(crate) opts: &'a Opts,
    pub(crate) plan: &'a dyn plan::Planner,
}

/// What a run rule may need besides its operands: the device of the run
/// (for primitives without operands), the seed of this node's draws, the
/// run's tally of operands copied to another layout, whether it takes
/// the crate's CPU kernels or candle's operations only, and the runner of
/// sub-graphs for a primitive that holds bodies.
pub(crate) struct RunCx<'a> {
    pub(crate) device: &'a Device,
    pub(crate) seed: u64,
    pub(crate) copies: &'a Copies,
    pub(crate) path: Path,
    pub(crate) graphs: &'a dyn Graphs,
}

/// Runs a sub-graph on tensors. The interpreter hands one to every rule
/// in its [`RunCx`], so a primitive with a body (`map`, `scan`, `cond`,
/// `while_loop`) runs it from its own `run` without owning an
/// interpreter: rules stay pure, and the interpreter has no primitive of
/// its own to special-case.
pub(crate) trait Graphs: Sync {
    /// The outputs of `g` on `inputs`, its draws seeded by `seed`.
    fn run(&self, g: &Graph, inputs: &[Tensor], seed: u64) -> Result<Vec<Tensor>>;
}

/// The runner of a context that has no sub-graphs to run (a rule's unit
/// test): every call is an internal error.
#[cfg(test)]
pub(crate) struct NoGraphs;

#[cfg(test)]
impl Graphs for NoGraphs {
    fn run(&self, _g: &Graph, _inputs: &[Tensor], _seed: u64) -> Result<Vec<Tensor>> {
        Err(Error::internal("run", "no sub-graph runner in this context"))
    }
}

pub(crate) use crate::env::mix;

/// `run` on the first operand widened to f32 (the others as they are) and
/// the result type in f32, the result rounded to `out`'s dtype once: how a
/// half-precision operation that accumulates (a sum, a softmax, an
/// index-add, an average, a scale) computes, as PyTorch's do. bf16 on the
/// crate's CPU path widens and rounds across the threads
/// (`kernels::widen`, bit for bit candle's conversions).
pub(crate) fn in_f32(
    op: &str,
    args: &[&Tensor],
    out: &TensorType,
    path: Path,
    run: impl FnOnce(&[&Tensor], &TensorType) -> Result<Tensor>,
) -> Result<Tensor> {
    use crate::error::CandleContext;
    use candle_core::DType;
    let wide = match widen::widen_any(args[0], path).op(op)? {
        Some(w) => w,
        None => args[0].to_dtype(DType::F32).op(op)?,
    };
    let mut ops = args.to_vec();
    ops[0] = &wide;
    let y = run(&ops, &TensorType::new(out.shape.clone(), DType::F32))?;
    match out.dtype {
        DType::BF16 => widen::narrow_any(&y, path).op(op),
        dt => y.to_dtype(dt).op(op),
    }
}

/// [`in_f32`]'s workspace: the first operand's f32 copy, the f32 result,
/// and what the f32 run itself plans on them (`inner`).
pub(crate) fn in_f32_workspace(
    args: &[Arg],
    out: &TensorType,
    inner: impl FnOnce(&[Arg], &TensorType) -> Workspace,
) -> Workspace {
    let wide = TensorType::new(args[0].ty.shape.clone(), candle_core::DType::F32);
    let wide_out = TensorType::new(out.shape.clone(), candle_core::DType::F32);
    let mut ops = args.to_vec();
    ops[0] = Arg {
        ty: &wide,
        contiguous: true,
    };
    let own = inner(&ops, &wide_out).total();
    Workspace::scratch(
        facts::bytes(&wide)
            .saturating_add(facts::bytes(&wide_out))
            .saturating_add(own),
    )
}

/// The rules of one primitive.
pub(crate) trait Rule {
    /// The result type, or a shape/dtype error naming the operation.
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType>;
    /// What the passes need to know of it on these operands (see [`facts`]).
    fn facts(&self, args: &[Arg], out: &TensorType) -> Facts;
    /// What its run allocates besides its result, on operands of these
    /// types and layouts: what the memory plan adds while it runs.
    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace;
    /// Computes the primitive on candle tensors.
    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor>;
    /// Emits the batched computation; `Ok(None)` asks for the generic map.
    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>>;
    /// Emits the cotangent of each operand from the cotangent `ct` of the
    /// result (`out`); `None` for an operand without one (indices, masks).
    /// `Ok(None)`: the primitive has no VJP rule.
    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(None)
    }
    /// Emits the tangent of the result (`out`) from the operands' tangents
    /// (`None`: zero); the result's `None` is a zero tangent.
    /// `Ok(None)`: the primitive has no JVP rule.
    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Ok(None)
    }
    /// The rules of its several results, for a primitive that has them
    /// (its `infer` gives the tuple's type, [`crate::ir::tuple_type`]; its
    /// `run` and `batch` are never called: the interpreter and the walkers
    /// take these).
    fn many(&self) -> Option<&dyn Many> {
        None
    }
}

/// The rules of a primitive with several results (every primitive with a
/// body, JAX's `multiple_results`): the same rules as [`Rule`]'s, each
/// giving or taking one value per result, in the order of
/// [`Prim::results`]. The walkers read results through `Prim::Get` nodes,
/// which the rules emit with [`Builder::get`].
pub(crate) trait Many {
    /// Computes every result on candle tensors.
    fn run_many(&self, args: &[&Tensor], cx: &RunCx) -> Result<Vec<Tensor>>;
    /// Emits the batched computation: each result with its batch axis.
    fn batch_many(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Vec<BVal>>;
    /// Emits the cotangent of each operand from the cotangents of the
    /// results (`None`: zero); `out` is the tuple, whose results the rule
    /// may read. `Ok(None)`: no VJP rule.
    fn vjp_many(&self, b: &mut Builder, args: &[VarId], out: VarId, cts: &[Option<VarId>]) -> Result<Option<Cts>>;
    /// Emits the tangent of each result from the operands' tangents
    /// (`None`: zero). `Ok(None)`: no JVP rule.
    fn jvp_many(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Vec<Tan>>>;
    /// The primitive without the results `used` does not flag (JAX's
    /// per-primitive dead-code rule), and where each old result went;
    /// `None` where none can go. The new primitive takes the same operands.
    fn prune(&self, used: &[bool]) -> Option<(Prim, Vec<Option<usize>>)>;
}

/// Cotangents of a primitive's operands, in operand order.
pub(crate) type Cts = Vec<Option<VarId>>;

/// A tangent: `None` for zero (an operand the JVP does not depend on).
pub(crate) type Tan = Option<VarId>;

/// The tangent of `prim(args)` for a primitive linear in each operand of
/// `linear` with the others fixed (a product or convolution in both, a
/// reshape or an index in its first): the sum over those operands of
/// `prim` with that operand replaced by its tangent. Tangents of the other
/// operands (indices, a max-pool's selecting input) do not contribute.
pub(crate) fn multilinear_jvp(
    b: &mut Builder,
    prim: &Prim,
    args: &[VarId],
    tans: &[Tan],
    linear: &[usize],
) -> Result<Tan> {
    let mut sum: Tan = None;
    for &i in linear {
        let Some(t) = tans.get(i).copied().flatten() else {
            continue;
        };
        let mut with = args.to_vec();
        with[i] = t;
        let term = b.emit(prim.clone(), &with)?;
        sum = Some(match sum {
            None => term,
            Some(s) => b.bin(crate::ir::ops::Binary::Add, s, term)?,
        });
    }
    Ok(sum)
}

/// The rules of a computed primitive (not of inputs, constants, literals).
pub(crate) fn rule(prim: &Prim) -> Result<&dyn Rule> {
    Ok(match prim {
        Prim::Unary(r) => r,
        Prim::Binary(r) => r,
        Prim::Compare(r) => r,
        Prim::Where => &elementwise::Where,
        Prim::Reduce(r) => r,
        Prim::Shape(r) => r,
        Prim::Index(r) => r,
        Prim::Matmul => &matmul::Matmul,
        Prim::Conv(r) => r,
        Prim::Pool(r) => r,
        Prim::Attention(r) => r,
        Prim::Get(_) => &control::Get,
        Prim::Map(r) => r.as_ref(),
        Prim::Scan(r) => r.as_ref(),
        Prim::Cond(r) => r.as_ref(),
        Prim::While(r) => r.as_ref(),
        Prim::Custom(r) => r,
        Prim::Random(r) => r,
        Prim::Fused(r) => r.as_ref(),
        Prim::Place(r) => r,
        Prim::Input(_) | Prim::Const(_) | Prim::Scalar(_) => {
            return Err(Error::internal(prim.name(), "a leaf has no rules"))
        }
    })
}

/// Result type of `prim(args)`. A result whose element count or byte size
/// overflows `usize` is a shape error for every primitive, whatever its
/// own rule checks (a broadcast to `[2^62, 6]` was accepted as a view).
pub(crate) fn infer(prim: &Prim, args: &[&TensorType]) -> Result<TensorType> {
    let ty = rule(prim)?.infer(args)?;
    let bytes = ty
        .shape
        .iter()
        .try_fold(ty.dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
    if bytes.is_none() {
        let shapes: Vec<&[usize]> = args.iter().map(|a| a.shape.as_slice()).collect();
        return Err(Error::shape(
            "trace",
            &shapes,
            format!(
                "{}: its result of shape {:?} overflows usize in bytes",
                prim.name(),
                ty.shape
            ),
        ));
    }
    Ok(ty)
}

/// Checks the operand count.
pub(crate) fn arity(op: &'static str, args: &[&TensorType], n: usize) -> Result<()> {
    if args.len() != n {
        let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
        return Err(Error::shape(
            op,
            &shapes,
            format!("expected {n} operands, got {}", args.len()),
        ));
    }
    Ok(())
}

/// The product of sizes computed from user input, or a shape error naming
/// the operation when it overflows.
pub(crate) fn checked_product(op: &'static str, shapes: &[&[usize]], sizes: &[usize]) -> Result<usize> {
    sizes
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::shape(op, shapes, format!("the size {sizes:?} overflows")))
}

/// Checks that all operands share one dtype and returns it.
pub(crate) fn same_dtype(op: &'static str, args: &[&TensorType]) -> Result<candle_core::DType> {
    let dt = args[0].dtype;
    if args.iter().any(|t| t.dtype != dt) {
        return Err(Error::DType {
            op,
            dtypes: args.iter().map(|t| t.dtype).collect(),
            msg: "operands must share one dtype".into(),
        });
    }
    Ok(dt)
}

/// Numpy broadcasting of two shapes (right-aligned).
pub(crate) fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::shape(op, &[a, b], "shapes do not broadcast")),
        };
    }
    Ok(out)
}

/// Normalises a possibly negative axis for a tensor of rank `rank`.
pub(crate) fn norm_axis(op: &'static str, shape: &[usize], axis: isize) -> Result<usize> {
    let r = shape.len() as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(Error::shape(
            op,
            &[shape],
            format!("axis {axis} out of range for rank {r}"),
        ));
    }
    Ok(a as usize)
}

impl BatchCx<'_> {
    /// The lowering of a primitive with several (the conv routes): the
    /// options' route, or for `Auto` the planner's choice among
    /// `candidates` for these operands.
    pub(crate) fn route(&mut self, prim: &Prim, args: &[BVal], candidates: &[ConvRoute]) -> Result<ConvRoute> {
        if self.opts.route != ConvRoute::Auto {
            return Ok(self.opts.route);
        }
        let choice = plan::Choice {
            prim,
            args: args.iter().map(|&(v, bd)| (self.b.ty(v).clone(), bd)).collect(),
            size: self.size,
            candidates,
            opts: self.opts,
            device: &self.b.ctx.device,
        };
        self.plan.choose(&choice)
    }

    /// The batched value with its batch axis first; unbatched values are
    /// returned as they are.
    pub(crate) fn front(&mut self, (v, bdim): BVal) -> Result<VarId> {
        match bdim {
            Some(d) if d != 0 => self.b.move_axis(v, d, 0),
            _ => Ok(v),
        }
    }

    /// The value with a batch axis first, broadcasting an unbatched value
    /// (`X -> B X`).
    pub(crate) fn materialize(&mut self, (v, bdim): BVal) -> Result<VarId> {
        match bdim {
            Some(_) => self.front((v, bdim)),
            None => {
                let mut d = self.b.dims(v);
                d.insert(0, self.size);
                self.b.broadcast(v, d)
            }
        }
    }

    /// Batch axis first, then unit axes so the per-example part has rank
    /// `rank` (`B x.. -> B 1.. x..`), for right-aligned broadcasting against
    /// operands of a higher per-example rank.
    pub(crate) fn front_padded(&mut self, v: BVal, rank: usize) -> Result<VarId> {
        let id = self.front(v)?;
        let mut d = self.b.dims(id);
        let logical = d.len() - 1;
        if logical < rank {
            for _ in logical..rank {
                d.insert(1, 1);
            }
            return self.b.reshape(id, d);
        }
        Ok(id)
    }

    /// Per-example rank of an operand.
    pub(crate) fn logical_rank(&self, (v, bdim): BVal) -> usize {
        self.b.ty(v).rank() - usize::from(bdim.is_some())
    }
}
