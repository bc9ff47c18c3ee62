//! `while_loop`: a body run while a condition of the carry holds (the
//! interpreter runs both).
//!
//! * batch: with one condition for the whole batch (it reads nothing
//!   batched), the same loop over the body batched; with a condition per
//!   example, the loop runs while any example's holds, and an example
//!   whose condition fails keeps its carry and no longer feeds the body
//!   its own values: its rows of the body's inputs are copies of a running
//!   example's, so the body only ever runs on values some example really
//!   steps with (a finished example's `table[i]` with `i` past the table
//!   is never read), as under `Schedule::PerExample`, where each example
//!   runs its own number of steps.
//! * JVP: a loop carrying the carry and its tangent side by side.
//! * VJP: none, as in JAX: the trip count is data, so the carries to run
//!   back over are not known in advance. `fori_loop` (a `scan` of a fixed
//!   length) is the reverse-differentiable loop.

use super::{
    any_true, batched_graph, body_facts, body_peak, example_mask, flat, from_taking, holds, piece, run_one, shape_error,
};
use crate::error::{Error, Result};
use crate::ir::{Graph, Prim, TensorType, VarId, While};
use crate::rules::facts::{self, Arg, Facts, Workspace};
use crate::rules::{mix, walk, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use candle_core::Tensor;
use std::sync::Arc;

impl Rule for While {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let bad = |msg: String| shape_error("while_loop", args, msg);
        let Some(carry) = args.first() else {
            return Err(bad("no carry".into()));
        };
        for (name, g) in [("cond_fun", &self.cond), ("body_fun", &self.body)] {
            let ins: Vec<&TensorType> = g.inputs.iter().map(|&i| g.ty(i)).collect();
            if ins != args || g.outputs.len() != 1 {
                return Err(bad(format!("{name} does not take the operands")));
            }
        }
        if self.cond.ty(self.cond.outputs[0]).rank() != 0 {
            return Err(bad("cond_fun must give a scalar".into()));
        }
        let next = self.body.ty(self.body.outputs[0]);
        if next != *carry {
            return Err(bad(format!(
                "the body changed the carry from {:?} {:?} to {:?} {:?}: a loop's carry keeps its shape and dtype",
                carry.dtype, carry.shape, next.dtype, next.shape
            )));
        }
        Ok((*carry).clone())
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        body_facts(&[&self.cond, &self.body])
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        let carry = facts::bytes(self.body.ty(self.body.outputs[0]));
        Workspace::scratch(body_peak(&[&self.cond, &self.body]) + carry)
    }

    /// The body while the condition holds, from the first operand.
    fn run(&self, args: &[&Tensor], _out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let mut ops: Vec<Tensor> = args.iter().map(|t| (*t).clone()).collect();
        for i in 0u64.. {
            let p = run_one(cx, &self.cond, &ops, mix(cx.seed, 2 * i), "while_loop")?;
            if !holds(&p, "while_loop")? {
                break;
            }
            ops[0] = run_one(cx, &self.body, &ops, mix(cx.seed, 2 * i + 1), "while_loop")?;
        }
        Ok(ops.swap_remove(0))
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
        if args.iter().all(|a| a.1.is_none()) {
            return Ok(Some((cx.b.emit(Prim::While(Box::new(self.clone())), &ids)?, None)));
        }
        // the carry batched whatever its start (the steps make it so)
        let mut operands = vec![cx.materialize(args[0])?];
        for &(v, bd) in &args[1..] {
            operands.push(match bd {
                Some(_) => cx.front((v, bd))?,
                None => v,
            });
        }
        // the graphs' inputs batched as the operands now are
        let batched: Vec<bool> = args.iter().enumerate().map(|(k, a)| k == 0 || a.1.is_some()).collect();
        // the condition, batched: one for all, or one per example
        let mut per_example = false;
        let cond = batched_graph(cx, &self.cond, &batched, |icx, ins| {
            let (p, bd) = walk::batch_graph(&self.cond, icx, ins)?[0];
            per_example = bd.is_some();
            match bd {
                None => Ok(p),
                Some(_) => any_true(icx.b, p),
            }
        })?;
        let body = batched_graph(cx, &self.body, &batched, |icx, ins| {
            if !per_example {
                let next = walk::batch_graph(&self.body, icx, ins)?[0];
                return icx.materialize(next);
            }
            let p = walk::batch_graph(&self.cond, icx, ins)?[0];
            let p = icx.materialize(p)?;
            // a finished example's rows: a running example's values
            let fed = from_taking(icx.b, p, icx.size, ins)?;
            let next = walk::batch_graph(&self.body, icx, &fed)?[0];
            let next = icx.materialize(next)?;
            // and keeps its own carry
            let rank = icx.b.ty(next).rank();
            let go = example_mask(icx.b, p, icx.size, rank)?;
            icx.b.select(go, next, ins[0].0)
        })?;
        let w = While {
            cond: Arc::new(cond),
            body: Arc::new(body),
        };
        Ok(Some((cx.b.emit(Prim::While(Box::new(w)), &operands)?, Some(0))))
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Err(Error::unsupported(
            "while_loop",
            "grad",
            "a while loop's trip count is data, so it is forward-differentiable only (jvp); \
             write a loop of a fixed trip count with fori_loop (a scan) to take its gradient",
        ))
    }

    /// A loop of `(c, tc)` flattened side by side: the condition reads `c`,
    /// the body is the step's JVP. The operands' tangents, where they have
    /// one, follow the operands.
    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        if tans.iter().all(Option::is_none) {
            return Ok(Some(None));
        }
        super::deterministic("while_loop", "jvp", &[&self.cond, &self.body])?;
        let carry_ty = b.ty(args[0]).clone();
        let ncf = carry_ty.elem_count();
        let present: Vec<usize> = (1..args.len()).filter(|&k| tans[k].is_some()).collect();
        let graph = |g: &Graph, body: bool| -> Result<Graph> {
            let s = Builder::scratch(b.given, b.ctx.clone());
            let mut sb = s.borrow_mut();
            let state = sb.input(TensorType::new(vec![2 * ncf], carry_ty.dtype));
            let mut ins = vec![piece(&mut sb, state, 0, 0, &carry_ty.shape)?];
            let mut all_ts: Vec<Tan> = vec![Some(piece(&mut sb, state, 0, ncf, &carry_ty.shape)?)];
            for k in 1..args.len() {
                ins.push(sb.input(g.ty(g.inputs[k]).clone()));
                all_ts.push(None);
            }
            for &k in &present {
                all_ts[k] = Some(sb.input(g.ty(g.inputs[k]).clone()));
            }
            let out = match body {
                false => walk::forward(g, &mut sb, &ins)?[g.outputs[0]],
                true => {
                    let (outs, touts) = walk::jvp_graph(g, &mut sb, &ins, &all_ts)?;
                    let t = sb.or_zeros(touts[0], outs[0])?;
                    let (c, t) = (flat(&mut sb, outs[0])?, flat(&mut sb, t)?);
                    sb.concat(&[c, t], 0)?
                }
            };
            Ok(sb.finish(vec![out]).0.eliminate_dead_code())
        };
        let w = While {
            cond: Arc::new(graph(&self.cond, false)?),
            body: Arc::new(graph(&self.body, true)?),
        };
        let c = flat(b, args[0])?;
        let tc = b.or_zeros(tans[0], args[0])?;
        let tc = flat(b, tc)?;
        let mut operands = vec![b.concat(&[c, tc], 0)?];
        operands.extend_from_slice(&args[1..]);
        operands.extend(present.iter().filter_map(|&k| tans[k]));
        let state = b.emit(Prim::While(Box::new(w)), &operands)?;
        Ok(Some(Some(piece(b, state, 0, ncf, &carry_ty.shape)?)))
    }
}
