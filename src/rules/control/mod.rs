//! The primitives that hold sub-graphs, one node of the graph each
//! (`map`, `scan`, `cond`, `while_loop`), and all their rules: each runs
//! its bodies through the runner the interpreter hands it in [`RunCx`],
//! and its batching and derivative rules rewrite the bodies into new
//! nodes of the same kinds. Each has several results, one per leaf of its
//! carries and outputs, each of its own type (the [`Many`] rules), read
//! by `get` nodes ([`Get`]); an unused result goes by the primitive's own
//! `prune`.

mod cond;
pub(crate) mod map;
mod scan;
mod scan_vjp;
mod while_loop;

use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Compare, IndexOp, Lookup, Reduce, Unary};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::rules::facts::{self, Arg, Effect, Facts, Storage, Workspace};
use crate::rules::memory;
use crate::rules::{BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use candle_core::DType;
use candle_core::Tensor;

/// The rules of `get[k]`: result `k` of a primitive with several, a view
/// of what that primitive wrote. The walkers and the interpreter read it
/// themselves (its type is the tuple's `k`-th result's,
/// `Builder::get`); here are its facts.
pub(crate) struct Get;

impl Rule for Get {
    fn infer(&self, _args: &[&TensorType]) -> Result<TensorType> {
        Err(Error::internal("get", "typed by its tuple (Builder::get)"))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            storage: Storage::View { contiguous: true },
            ..Facts::costly()
        }
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        Workspace::NONE
    }

    fn run(&self, _args: &[&Tensor], _out: &TensorType, _cx: &RunCx) -> Result<Tensor> {
        Err(through_results("get"))
    }

    fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        Err(through_results("get"))
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Err(through_results("get"))
    }

    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Err(through_results("get"))
    }
}

/// The error of a one-result rule called on a primitive with several (or
/// on a `get`): the walkers and the interpreter take their `Many` rules.
fn through_results(op: &'static str) -> Error {
    Error::internal(op, "a primitive with several results runs through its Many rules")
}

/// The one-result rules of a primitive with several results: its check
/// and type (the tuple's), facts and workspace; the rest through
/// [`Many`](crate::rules::Many).
macro_rules! tuple_rule {
    ($t:ty, $op:literal) => {
        impl crate::rules::Rule for $t {
            fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
                self.check(args)?;
                Ok(crate::ir::tuple_type(&self.results()))
            }

            fn facts(&self, _args: &[crate::rules::facts::Arg], _out: &TensorType) -> crate::rules::facts::Facts {
                self.own_facts()
            }

            fn workspace(
                &self,
                _args: &[crate::rules::facts::Arg],
                _out: &TensorType,
            ) -> crate::rules::facts::Workspace {
                self.own_workspace()
            }

            fn run(&self, _args: &[&Tensor], _out: &TensorType, _cx: &RunCx) -> Result<Tensor> {
                Err(super::through_results($op))
            }

            fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
                Err(super::through_results($op))
            }

            fn many(&self) -> Option<&dyn crate::rules::Many> {
                Some(self)
            }
        }
    };
}
use tuple_rule;

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
/// outputs `out` makes from the batching context and those inputs (say,
/// `g` batched and materialised, batch first).
fn batched_graph(
    cx: &BatchCx,
    g: &Graph,
    batched: &[bool],
    out: impl FnOnce(&mut BatchCx, &[BVal]) -> Result<Vec<VarId>>,
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
/// where flagged: `X -> B X`) and the outputs `out` makes of them.
fn lanes_graph(
    cx: &BatchCx,
    types: &[(TensorType, bool)],
    out: impl FnOnce(&mut BatchCx, &[BVal]) -> Result<Vec<VarId>>,
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
    Ok(sb.finish(o).0.eliminate_dead_code())
}

/// `g` batched by `icx` on `ins`, every output materialised (batch first).
fn batched_outputs(g: &Graph, icx: &mut BatchCx, ins: &[BVal]) -> Result<Vec<VarId>> {
    let outs = crate::rules::walk::batch_graph(g, icx, ins)?;
    outs.into_iter().map(|o| icx.materialize(o)).collect()
}

/// A fresh graph (in the context of `b`) made by `f` on inputs of
/// `types`, its outputs what `f` returns (dead code removed).
fn graph_of(
    b: &Builder,
    types: &[TensorType],
    f: impl FnOnce(&mut Builder, &[VarId]) -> Result<Vec<VarId>>,
) -> Result<Graph> {
    let scratch = Builder::scratch(b.given, b.ctx.clone());
    let mut sb = scratch.borrow_mut();
    let ins: Vec<VarId> = types.iter().map(|t| sb.input(t.clone())).collect();
    let outs = f(&mut sb, &ins)?;
    Ok(sb.finish(outs).0.eliminate_dead_code())
}

/// `g` keeping only the outputs `keep` flags (dead code removed).
fn keep_outputs(g: &Graph, keep: &[bool]) -> Graph {
    Graph {
        outputs: g
            .outputs
            .iter()
            .zip(keep)
            .filter(|(_, &k)| k)
            .map(|(&o, _)| o)
            .collect(),
        ..g.clone()
    }
    .eliminate_dead_code()
}

/// Where each result goes when those `used` flags stay (`None`: dropped).
fn renumber(used: &[bool]) -> Vec<Option<usize>> {
    let mut at = 0;
    used.iter()
        .map(|&u| {
            let to = u.then_some(at);
            at += usize::from(u);
            to
        })
        .collect()
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

/// The outputs of `g` run on `inputs` by the context's runner.
fn run_graph(cx: &RunCx, g: &Graph, inputs: &[Tensor], seed: u64) -> Result<Vec<Tensor>> {
    cx.graphs.run(g, inputs, seed)
}

/// The one output of `g` (a condition) run on `inputs`.
fn run_one(cx: &RunCx, g: &Graph, inputs: &[Tensor], seed: u64, op: &'static str) -> Result<Tensor> {
    run_graph(cx, g, inputs, seed)?
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

/// Stacked results being filled one row (axis 0) at a time, as each
/// example or step comes: the rows are never held all at once beside
/// their stacks.
struct Rows {
    stacked: Vec<Tensor>,
    op: &'static str,
}

impl Rows {
    /// Fresh results of the types `outs` on the run's device.
    fn new(outs: &[TensorType], cx: &RunCx, op: &'static str) -> Result<Rows> {
        let stacked = outs
            .iter()
            .map(|t| Tensor::zeros(t.shape.as_slice(), t.dtype, cx.device))
            .collect::<candle_core::Result<Vec<_>>>()
            .op(op)?;
        Ok(Rows { stacked, op })
    }

    /// Writes each of `ys` (one row's shape of each result, in order) as
    /// row `i`. The buffers are this node's own and read by nothing before
    /// the node returns; rows written from several threads each write
    /// their own (candle locks the storage).
    fn write(&self, i: usize, ys: &[Tensor]) -> Result<()> {
        if ys.len() != self.stacked.len() {
            return Err(Error::internal(self.op, "a row of another number of results"));
        }
        for (s, y) in self.stacked.iter().zip(ys) {
            let row = y.unsqueeze(0).and_then(|r| r.contiguous()).op(self.op)?;
            s.slice_set(&row, 0, i).op(self.op)?;
        }
        Ok(())
    }

    fn into_tensors(self) -> Vec<Tensor> {
        self.stacked
    }
}
