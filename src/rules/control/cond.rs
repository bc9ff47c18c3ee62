//! `cond`: one of several branches, chosen by a scalar index when the
//! graph runs (only the branch taken runs). `cond` is two branches
//! indexed by its predicate, `switch` any number (JAX's `cond_p` serves
//! both the same way).
//!
//! * batch: with one index for the whole batch, the same `cond` over the
//!   branches batched. With an index per example, each branch runs
//!   batched inside a `cond` of its own that skips it when no example takes
//!   it, on operands whose rows for the examples not taking it are copies
//!   of a taking example's; `where`s then pick each example's result.
//!   So an example's result and gradient depend only on the branch it
//!   takes, as under `Schedule::PerExample` (where the unbatched graph runs
//!   per example): a branch's guard holds on every row it runs on, and
//!   the discarded rows are finite with zero cotangents (JAX runs both
//!   branches on every row, so a NaN of the branch not taken reaches the
//!   gradient through its `select`).
//! * VJP and JVP: a `cond` of the branches' VJPs (their operands'
//!   cotangents packed into one vector) and JVPs, on the same predicate.

use super::{
    any_true, batched_graph, body_facts, body_peak, flat, from_taking, lanes_graph, piece, rows_mask, run_one,
    scalar_value, shape_error,
};
use crate::error::Result;
use crate::ir::ops::Compare;
use crate::ir::{Cond, Graph, Prim, TensorType, VarId};
use crate::rules::facts::{Arg, Facts, Workspace};
use crate::rules::{walk, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use candle_core::Tensor;
use std::sync::Arc;

impl Cond {
    fn branches(&self) -> Vec<&Graph> {
        self.branches.iter().map(|g| &**g).collect()
    }

    /// The cond of the branches made from each of this one's.
    fn map(&self, mut f: impl FnMut(&Graph) -> Result<Graph>) -> Result<Cond> {
        let branches = self.branches.iter().map(|g| f(g).map(Arc::new));
        Ok(Cond {
            branches: branches.collect::<Result<_>>()?,
        })
    }
}

/// The branch an index picks: its value clamped into `0..n` (as JAX's
/// `switch`; the binders clamp already, this keeps a run in range).
fn branch_of(index: &Tensor, n: usize) -> Result<usize> {
    let v = scalar_value(index, "cond")?;
    Ok(match v.is_nan() {
        true => 0,
        false => v.clamp(0.0, n.saturating_sub(1) as f64) as usize,
    })
}

impl Cond {
    /// The batching rule for an index per example `p` `[B]` (see the
    /// module docs): each branch in a `cond` on whether any example takes
    /// it, fed the operands with the other examples' rows taken from one
    /// that does; then each example's result.
    fn per_example(&self, cx: &mut BatchCx, p: VarId, ops: &[BVal]) -> Result<BVal> {
        let mut takes = Vec::with_capacity(self.branches.len());
        for k in 0..self.branches.len() {
            let k = cx.b.scalar_as(k as f64, p);
            takes.push(cx.b.cmp(Compare::Eq, p, k)?);
        }
        // the inner conds' operands: whether each example takes the branch
        // (its rows are replaced inside, only when it runs), then the
        // operands, batched ones batch first
        let mut types = vec![(cx.b.ty(takes[0]).clone().with_shape(vec![]), true)];
        let mut operands = Vec::with_capacity(ops.len());
        for &(v, bd) in ops {
            let mut ty = cx.b.ty(v).clone();
            if let Some(d) = bd {
                ty.shape.remove(d);
            }
            types.push((ty, bd.is_some()));
            operands.push(match bd {
                Some(_) => cx.front((v, bd))?,
                None => v,
            });
        }
        let mut outs = Vec::with_capacity(2);
        for (g, &taking) in self.branches().into_iter().zip(&takes) {
            let run = lanes_graph(cx, &types, |icx, ins| {
                let fed = from_taking(icx.b, ins[0].0, icx.size, &ins[1..])?;
                let out = walk::batch_graph(g, icx, &fed)?[0];
                icx.materialize(out)
            })?;
            let ty = run.ty(run.outputs[0]).clone();
            // taken by no example: skipped, its (discarded) result zeros
            let skip = lanes_graph(cx, &types, |icx, _| icx.b.zeros(ty.shape, ty.dtype))?;
            // index 1 (some example takes it): run; 0: skip
            let c = Cond {
                branches: vec![Arc::new(skip), Arc::new(run)],
            };
            let mut args = vec![any_true(cx.b, taking)?, taking];
            args.extend_from_slice(&operands);
            outs.push(cx.b.emit(Prim::Cond(Box::new(c)), &args)?);
        }
        // each example's own branch's result: B -> B 1..
        let rank = cx.b.ty(outs[0]).rank();
        let mut out = outs[0];
        for (k, &o) in outs.iter().enumerate().skip(1) {
            let mask = rows_mask(cx.b, takes[k], cx.size, rank)?;
            out = cx.b.select(mask, o, out)?;
        }
        Ok((out, Some(0)))
    }
}

impl Rule for Cond {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let bad = |msg: String| shape_error("cond", args, msg);
        let Some(index) = args.first() else {
            return Err(bad("no index".into()));
        };
        if index.rank() != 0 {
            return Err(bad(format!("the index must be a scalar, got {:?}", index.shape)));
        }
        let mut out: Option<&TensorType> = None;
        for (k, g) in self.branches().into_iter().enumerate() {
            let ins: Vec<&TensorType> = g.inputs.iter().map(|&i| g.ty(i)).collect();
            if ins != args[1..] || g.outputs.len() != 1 {
                return Err(bad(format!("branch {k} does not take the operands {:?}", &args[1..])));
            }
            let ty = g.ty(g.outputs[0]);
            match out {
                Some(o) if o != ty => {
                    return Err(bad(format!(
                        "the branches give {:?} {:?} and {:?} {:?}: both must give one type",
                        o.dtype, o.shape, ty.dtype, ty.shape
                    )))
                }
                _ => out = Some(ty),
            }
        }
        out.cloned().ok_or_else(|| bad("no branch".into()))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        body_facts(&self.branches())
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        Workspace::scratch(body_peak(&self.branches()))
    }

    /// The branch the index (the first operand) names, on the rest; the
    /// others are not run.
    fn run(&self, args: &[&Tensor], _out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let branch = &self.branches[branch_of(args[0], self.branches.len())?];
        let ops: Vec<Tensor> = args[1..].iter().map(|t| (*t).clone()).collect();
        run_one(cx, branch, &ops, cx.seed, "cond")
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
        if args.iter().all(|a| a.1.is_none()) {
            return Ok(Some((cx.b.emit(Prim::Cond(Box::new(self.clone())), &ids)?, None)));
        }
        let ops = &args[1..];
        if let (p, Some(d)) = args[0] {
            let p = cx.front((p, Some(d)))?;
            return self.per_example(cx, p, ops).map(Some);
        }
        // one index for all: the same choice between batched branches
        let mut operands = vec![args[0].0];
        for &(v, bd) in ops {
            operands.push(match bd {
                Some(_) => cx.front((v, bd))?,
                None => v,
            });
        }
        let batched_ops: Vec<bool> = ops.iter().map(|a| a.1.is_some()).collect();
        let batched = self.map(|g| {
            batched_graph(cx, g, &batched_ops, |icx, ins| {
                let out = walk::batch_graph(g, icx, ins)?[0];
                icx.materialize(out)
            })
        })?;
        Ok(Some((cx.b.emit(Prim::Cond(Box::new(batched)), &operands)?, Some(0))))
    }

    /// A cond of the branches' VJPs, taking the operands and the result's
    /// cotangent and giving the float operands' cotangents packed.
    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        super::deterministic("cond", "grad", &self.branches())?;
        let floats: Vec<usize> = (1..args.len()).filter(|&k| b.ty(args[k]).dtype.is_float()).collect();
        // the float operands' cotangents go out packed in the result's
        // dtype (a carrier that holds each exactly), converted back after
        let dtype = b.ty(ct).dtype;
        if floats.is_empty() {
            return Ok(Some(vec![None; args.len()]));
        }
        let ct_ty = b.ty(ct).clone();
        let back = self.map(|g| {
            let scratch = Builder::scratch(b.given, b.ctx.clone());
            let mut sb = scratch.borrow_mut();
            let ins: Vec<VarId> = g.inputs.iter().map(|&i| sb.input(g.ty(i).clone())).collect();
            let c = sb.input(ct_ty.clone());
            let wrt: Vec<bool> = (1..args.len()).map(|k| floats.contains(&k)).collect();
            let (_, cts) = walk::vjp_graph(g, &mut sb, &ins, &wrt, &[(0, c)])?;
            let mut parts = Vec::with_capacity(floats.len());
            for &k in &floats {
                let v = sb.or_zeros(cts[k - 1], ins[k - 1])?;
                let v = flat(&mut sb, v)?;
                parts.push(sb.cast(v, dtype)?);
            }
            let out = sb.concat(&parts, 0)?;
            Ok(sb.finish(vec![out]).0.eliminate_dead_code())
        })?;
        let mut operands = args.to_vec();
        operands.push(ct);
        let packed = b.emit(Prim::Cond(Box::new(back)), &operands)?;
        let mut cts: Cts = vec![None; args.len()];
        let mut at = 0;
        for &k in &floats {
            let (shape, own) = (b.dims(args[k]), b.ty(args[k]).dtype);
            let c = piece(b, packed, 0, at, &shape)?;
            cts[k] = Some(b.cast(c, own)?);
            at += shape.iter().product::<usize>();
        }
        Ok(Some(cts))
    }

    /// A cond of the branches' JVPs: the operands, then the tangents of
    /// those that have one.
    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        let present: Vec<usize> = (1..args.len()).filter(|&k| tans[k].is_some()).collect();
        if present.is_empty() {
            return Ok(Some(None));
        }
        super::deterministic("cond", "jvp", &self.branches())?;
        let out_ty = b.ty(out).clone();
        let fwd = self.map(|g| {
            let scratch = Builder::scratch(b.given, b.ctx.clone());
            let mut sb = scratch.borrow_mut();
            let ins: Vec<VarId> = g.inputs.iter().map(|&i| sb.input(g.ty(i).clone())).collect();
            let mut ts: Vec<Tan> = vec![None; ins.len()];
            for &k in &present {
                ts[k - 1] = Some(sb.input(g.ty(g.inputs[k - 1]).clone()));
            }
            let (_, touts) = walk::jvp_graph(g, &mut sb, &ins, &ts)?;
            let t = match touts[0] {
                Some(t) => t,
                None => sb.zeros(out_ty.shape.clone(), out_ty.dtype)?,
            };
            Ok(sb.finish(vec![t]).0.eliminate_dead_code())
        })?;
        let mut operands = args.to_vec();
        operands.extend(present.iter().filter_map(|&k| tans[k]));
        Ok(Some(Some(b.emit(Prim::Cond(Box::new(fwd)), &operands)?)))
    }
}
