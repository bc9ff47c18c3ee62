//! The primitives that hold sub-graphs, one node of the graph each
//! (`map`, `scan`, `cond`, `while_loop`), and all their rules: each runs
//! its bodies through the runner the interpreter hands it in [`RunCx`],
//! and its batching and derivative rules rewrite the bodies into new
//! nodes of the same kinds.

mod cond;
pub(crate) mod map;
mod scan;
mod scan_vjp;
mod while_loop;

use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Compare, IndexOp, Lookup, Reduce, Unary};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::rules::facts::{self, Effect, Facts};
use crate::rules::memory;
use crate::rules::{BVal, BatchCx, Builder, RunCx};
use candle_core::DType;
use candle_core::Tensor;

/// An error where a body of `op` draws random numbers: its derivative
/// runs the body again, which would draw anew, so the derivative would be
/// another function's (a dropout mask the forward pass did not use).
fn deterministic(op: &'static str, transform: &'static str, bodies: &[&Graph]) -> Result<()> {
    match bodies.iter().any(|g| facts::effect_of(g) == Effect::Random) {
        true => Err(Error::unsupported(
            op,
            transform,
            "its body draws random numbers, and its derivative would run the body again with other draws; \
             draw them outside the loop and pass them in",
        )),
        false => Ok(()),
    }
}

/// The strongest effect of the graphs.
fn effect(gs: &[&Graph]) -> Effect {
    let effects: Vec<Effect> = gs.iter().map(|g| facts::effect_of(g)).collect();
    [Effect::Random, Effect::Opaque]
        .into_iter()
        .find(|e| effects.contains(e))
        .unwrap_or(Effect::Pure)
}

/// The largest peak of the graphs, less their inputs (views of operands
/// the plan holds already).
fn body_peak(gs: &[&Graph]) -> usize {
    gs.iter()
        .map(|g| {
            let inputs: usize = g.inputs.iter().map(|&i| facts::bytes(g.ty(i))).sum();
            memory::planned_peak(g).saturating_sub(inputs)
        })
        .max()
        .unwrap_or(0)
}

/// The facts of a primitive with the bodies `gs`: the strongest effect
/// among them, measurable where all are, never cheap to recompute.
fn body_facts(gs: &[&Graph]) -> Facts {
    Facts {
        effect: effect(gs),
        cheap: false,
        measurable: gs.iter().all(|g| facts::measurable(g)),
        ..Facts::costly()
    }
}

/// A shape error of `op` naming its operands' shapes.
fn shape_error(op: &'static str, args: &[&TensorType], msg: String) -> Error {
    let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
    Error::shape(op, &shapes, msg)
}

/// `g` batched into a graph of its own, as a control-flow node's new body:
/// input `k` batched at axis 0 where `batched[k]` (`X -> B X`), and the
/// output `out` makes from the batching context and those inputs (say,
/// `g` batched and materialised, batch first).
fn batched_graph(
    cx: &BatchCx,
    g: &Graph,
    batched: &[bool],
    out: impl FnOnce(&mut BatchCx, &[BVal]) -> Result<VarId>,
) -> Result<Graph> {
    let types: Vec<(TensorType, bool)> = g
        .inputs
        .iter()
        .zip(batched)
        .map(|(&i, &on)| (g.ty(i).clone(), on))
        .collect();
    lanes_graph(cx, &types, out)
}

/// A graph of inputs of the per-example types `types` (batched at axis 0
/// where flagged: `X -> B X`) and the one output `out` makes of them.
fn lanes_graph(
    cx: &BatchCx,
    types: &[(TensorType, bool)],
    out: impl FnOnce(&mut BatchCx, &[BVal]) -> Result<VarId>,
) -> Result<Graph> {
    let scratch = Builder::scratch(cx.b.given, cx.b.ctx.clone());
    let mut sb = scratch.borrow_mut();
    let ins: Vec<BVal> = types
        .iter()
        .map(|(ty, on)| {
            let mut ty = ty.clone();
            if *on {
                ty.shape.insert(0, cx.size);
            }
            (sb.input(ty), on.then_some(0))
        })
        .collect();
    let mut icx = BatchCx {
        b: &mut sb,
        size: cx.size,
        opts: cx.opts,
        plan: cx.plan,
    };
    let o = out(&mut icx, &ins)?;
    Ok(sb.finish(vec![o]).0.eliminate_dead_code())
}

/// Where each example's predicate `p` `[B]` holds (nonzero), shaped
/// `B 1..` to select between values of rank `rank` (batch first).
fn example_mask(b: &mut Builder, p: VarId, size: usize, rank: usize) -> Result<VarId> {
    let zero = b.scalar_as(0.0, p);
    let mask = b.cmp(Compare::Ne, p, zero)?;
    rows_mask(b, mask, size, rank)
}

/// A mask `m` `[B]` (a comparison's result) shaped `B 1..` to select
/// between values of rank `rank` (batch first).
fn rows_mask(b: &mut Builder, m: VarId, size: usize, rank: usize) -> Result<VarId> {
    let mut shape = vec![size];
    shape.resize(rank, 1);
    b.reshape(m, shape)
}

/// Whether any entry of the mask `m` `[B]` (nonzero: true) holds: a
/// scalar `u8`, the predicate of a loop or a branch that some example is
/// still in.
fn any_true(b: &mut Builder, m: VarId) -> Result<VarId> {
    let zero = b.scalar_as(0.0, m);
    let on = b.cmp(Compare::Ne, m, zero)?;
    let on = b.un(Unary::Cast(DType::F32), on)?;
    let n = b.sum_axes(on, vec![0], false)?;
    let zero = b.scalar_as(0.0, n);
    b.cmp(Compare::Gt, n, zero)
}

/// The values `ins` (batched ones batch first, `B ..`) as a path that
/// only the examples where `taking` `[B]` holds take should see them: each
/// other example's row replaced by the first taking example's
/// (`where(taking, v, stop_gradient(v[first]))`). An example then runs a
/// branch or a loop step only on values some example really takes it
/// with, so a guard (`i < 5` before `table[i]`, `x > 0` before `sqrt(x)`)
/// holds on every row, and what it computes for the others (discarded by
/// the caller's select) gets a zero cotangent that reaches nothing: the
/// copy's gradient is stopped, or `0 f'(x)` at a point where `f'` is
/// infinite would put a NaN in the taking example's own gradient. With no
/// taking example the rows are row 0's: the caller skips the path then.
fn from_taking(b: &mut Builder, taking: VarId, size: usize, ins: &[BVal]) -> Result<Vec<BVal>> {
    let zero = b.scalar_as(0.0, taking);
    let on = b.cmp(Compare::Ne, taking, zero)?;
    let score = b.un(Unary::Cast(DType::F32), on)?;
    // B -> 1: the first example taking it (argmax's first of ties)
    let first = b.emit(
        Prim::Reduce(Reduce::Arg {
            axis: 0,
            keepdim: true,
            min: false,
        }),
        &[score],
    )?;
    ins.iter()
        .map(|&(v, bd)| {
            if bd.is_none() {
                return Ok((v, bd));
            }
            // B .. -> 1 ..: that example's row, broadcast against the rest
            let row = b.emit(Prim::Index(IndexOp::IndexSelect(0, Lookup::Index)), &[v, first])?;
            let row = match b.ty(v).dtype.is_float() {
                true => b.un(Unary::StopGradient, row)?,
                false => row,
            };
            let rank = b.ty(v).rank();
            let mut shape = vec![size];
            shape.resize(rank, 1);
            let keep = b.reshape(on, shape)?;
            Ok((b.select(keep, v, row)?, bd))
        })
        .collect()
}

/// `v` as one vector (`.. -> (..)`).
fn flat(b: &mut Builder, v: VarId) -> Result<VarId> {
    let n = b.ty(v).elem_count();
    b.reshape(v, vec![n])
}

/// Entries `[start, start + len)` of `v` along `axis`, shaped `shape` after
/// the axes before it.
fn piece(b: &mut Builder, v: VarId, axis: usize, start: usize, shape: &[usize]) -> Result<VarId> {
    let len = shape.iter().product();
    let mut want = b.dims(v)[..axis].to_vec();
    want.extend_from_slice(shape);
    let p = b.narrow(v, axis, start, len)?;
    b.reshape(p, want)
}

/// The one output of `g` run on `inputs` by the context's runner.
fn run_one(cx: &RunCx, g: &Graph, inputs: &[Tensor], seed: u64, op: &'static str) -> Result<Tensor> {
    cx.graphs
        .run(g, inputs, seed)?
        .pop()
        .ok_or_else(|| Error::internal(op, "a graph without output"))
}

/// The value of a scalar operand (a predicate, an index), read on the host.
fn scalar_value(t: &Tensor, op: &'static str) -> Result<f64> {
    t.to_dtype(DType::F64).and_then(|t| t.to_scalar::<f64>()).op(op)
}

/// Whether a scalar predicate holds (nonzero; NaN holds, as `bool(nan)`).
fn holds(p: &Tensor, op: &'static str) -> Result<bool> {
    Ok(scalar_value(p, op)? != 0.0)
}

/// A loop's result being filled one row (axis 0) at a time, as each
/// example or step comes: the rows are never held all at once beside
/// their stack.
struct Rows {
    stacked: Tensor,
    op: &'static str,
}

impl Rows {
    /// A fresh result of type `out` on the run's device.
    fn new(out: &TensorType, cx: &RunCx, op: &'static str) -> Result<Rows> {
        let stacked = Tensor::zeros(out.shape.as_slice(), out.dtype, cx.device).op(op)?;
        Ok(Rows { stacked, op })
    }

    /// Writes `y` (one row's shape) as row `i`. The buffer is this node's
    /// own and read by nothing before the node returns; rows written from
    /// several threads each write their own (candle locks the storage).
    fn write(&self, i: usize, y: &Tensor) -> Result<()> {
        let row = y.unsqueeze(0).and_then(|r| r.contiguous()).op(self.op)?;
        self.stacked.slice_set(&row, 0, i).op(self.op)
    }

    /// Writes `y`'s entries in row-major order at `offset` of a result
    /// that is one vector.
    fn write_flat(&self, offset: usize, y: &Tensor) -> Result<()> {
        let flat = y.flatten_all().and_then(|f| f.contiguous()).op(self.op)?;
        self.stacked.slice_set(&flat, 0, offset).op(self.op)
    }

    fn into_tensor(self) -> Tensor {
        self.stacked
    }
}
