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
//! * JVP: a loop carrying the carries and their tangents side by side.
//! * VJP: none, as in JAX: the trip count is data, so the carries to run
//!   back over are not known in advance. `fori_loop` (a `scan` of a fixed
//!   length) is the reverse-differentiable loop.

use super::{
    any_true, batched_graph, batched_outputs, body_facts, body_peak, example_mask, from_taking, graph_of, holds,
    run_graph, run_one, shape_error, tuple_rule,
};
use crate::error::{Error, Result};
use crate::ir::{Graph, Prim, TensorType, VarId, While};
use crate::rules::facts::{self, Facts, Workspace};
use crate::rules::{mix, walk, BVal, BatchCx, Builder, Cts, Many, RunCx, Tan};
use candle_core::Tensor;
use std::sync::Arc;

impl While {
    /// An error unless both graphs take the operands, the condition gives
    /// a scalar and the body gives the carries back, each of its type.
    fn check(&self, args: &[&TensorType]) -> Result<()> {
        let bad = |msg: String| shape_error("while_loop", args, msg);
        let nc = self.carries();
        if nc == 0 || args.len() < nc {
            return Err(bad("no carry".into()));
        }
        for (name, g) in [("cond_fun", &self.cond), ("body_fun", &self.body)] {
            let ins: Vec<&TensorType> = g.inputs.iter().map(|&i| g.ty(i)).collect();
            if ins != args {
                return Err(bad(format!("{name} does not take the operands")));
            }
        }
        if self.cond.outputs.len() != 1 || self.cond.ty(self.cond.outputs[0]).rank() != 0 {
            return Err(bad("cond_fun must give a scalar".into()));
        }
        for (k, next) in self.results().iter().enumerate() {
            if next != args[k] {
                return Err(bad(format!(
                    "the body changed carry {k} from {:?} {:?} to {:?} {:?}: a loop's carry keeps its shape and dtype",
                    args[k].dtype, args[k].shape, next.dtype, next.shape
                )));
            }
        }
        Ok(())
    }

    fn own_facts(&self) -> Facts {
        body_facts(&[&self.cond, &self.body])
    }

    fn own_workspace(&self) -> Workspace {
        let carries: usize = self.results().iter().map(facts::bytes).sum();
        Workspace::scratch(body_peak(&[&self.cond, &self.body]) + carries)
    }
}

tuple_rule!(While, "while_loop");

impl Many for While {
    /// The body while the condition holds, from the first operands.
    fn run_many(&self, args: &[&Tensor], cx: &RunCx) -> Result<Vec<Tensor>> {
        let nc = self.carries();
        let mut ops: Vec<Tensor> = args.iter().map(|t| (*t).clone()).collect();
        for i in 0u64.. {
            let p = run_one(cx, &self.cond, &ops, mix(cx.seed, 2 * i), "while_loop")?;
            if !holds(&p, "while_loop")? {
                break;
            }
            let next = run_graph(cx, &self.body, &ops, mix(cx.seed, 2 * i + 1))?;
            for (o, n) in ops.iter_mut().zip(next) {
                *o = n;
            }
        }
        ops.truncate(nc);
        Ok(ops)
    }

    fn batch_many(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Vec<BVal>> {
        let nc = self.carries();
        // the carries batched whatever their start (the steps make it so)
        let mut operands = Vec::with_capacity(args.len());
        for (k, &a) in args.iter().enumerate() {
            operands.push(match (k < nc, a.1) {
                (true, _) => cx.materialize(a)?,
                (false, Some(_)) => cx.front(a)?,
                (false, None) => a.0,
            });
        }
        // the graphs' inputs batched as the operands now are
        let batched: Vec<bool> = args.iter().enumerate().map(|(k, a)| k < nc || a.1.is_some()).collect();
        // the condition, batched: one for all, or one per example
        let mut per_example = false;
        let cond = batched_graph(cx, &self.cond, &batched, |icx, ins| {
            let (p, bd) = walk::batch_graph(&self.cond, icx, ins)?[0];
            per_example = bd.is_some();
            Ok(vec![match bd {
                None => p,
                Some(_) => any_true(icx.b, p)?,
            }])
        })?;
        let body = batched_graph(cx, &self.body, &batched, |icx, ins| {
            if !per_example {
                return batched_outputs(&self.body, icx, ins);
            }
            let p = walk::batch_graph(&self.cond, icx, ins)?[0];
            let p = icx.materialize(p)?;
            // a finished example's rows: a running example's values
            let fed = from_taking(icx.b, p, icx.size, ins)?;
            let next = batched_outputs(&self.body, icx, &fed)?;
            // and keeps its own carries
            let mut kept = Vec::with_capacity(next.len());
            for (k, n) in next.into_iter().enumerate() {
                let rank = icx.b.ty(n).rank();
                let go = example_mask(icx.b, p, icx.size, rank)?;
                kept.push(icx.b.select(go, n, ins[k].0)?);
            }
            Ok(kept)
        })?;
        let w = While {
            cond: Arc::new(cond),
            body: Arc::new(body),
        };
        let outs = cx.b.emit_many(Prim::While(Box::new(w)), &operands)?;
        Ok(outs.into_iter().map(|o| (o, Some(0))).collect())
    }

    fn vjp_many(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _cts: &[Option<VarId>]) -> Result<Option<Cts>> {
        Err(Error::unsupported(
            "while_loop",
            "grad",
            "a while loop's trip count is data, so it is forward-differentiable only (jvp); \
             write a loop of a fixed trip count with fori_loop (a scan) to take its gradient",
        ))
    }

    /// A loop carrying the carries and the float carries' tangents: the
    /// condition reads the carries, the body is the step's JVP. The
    /// operands' tangents, where they have one, follow the operands.
    fn jvp_many(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Vec<Tan>>> {
        let nc = self.carries();
        if tans.iter().all(Option::is_none) {
            return Ok(Some(vec![None; nc]));
        }
        super::deterministic("while_loop", "jvp", &[&self.cond, &self.body])?;
        let floats: Vec<usize> = (0..nc).filter(|&k| b.ty(args[k]).dtype.is_float()).collect();
        let present: Vec<usize> = (nc..args.len()).filter(|&k| tans[k].is_some()).collect();
        // inputs: carries, float carries' tangents, the rest, their tangents
        let graph = |g: &Graph, body: bool| -> Result<Graph> {
            let all = g.input_types();
            let mut types = all[..nc].to_vec();
            types.extend(floats.iter().map(|&k| all[k].clone()));
            types.extend_from_slice(&all[nc..]);
            types.extend(present.iter().map(|&k| all[k].clone()));
            let nf = floats.len();
            graph_of(b, &types, |sb, ins| {
                let mut xs: Vec<VarId> = ins[..nc].to_vec();
                xs.extend_from_slice(&ins[nc + nf..nc + nf + all.len() - nc]);
                if !body {
                    return Ok(vec![walk::forward(g, sb, &xs)?[g.outputs[0]]]);
                }
                let mut ts: Vec<Tan> = vec![None; all.len()];
                for (j, &k) in floats.iter().enumerate() {
                    ts[k] = Some(ins[nc + j]);
                }
                for (j, &k) in present.iter().enumerate() {
                    ts[k] = Some(ins[nc + nf + all.len() - nc + j]);
                }
                let (outs, touts) = walk::jvp_graph(g, sb, &xs, &ts)?;
                let mut next = outs.clone();
                for &k in &floats {
                    next.push(sb.or_zeros(touts[k], outs[k])?);
                }
                Ok(next)
            })
        };
        let w = While {
            cond: Arc::new(graph(&self.cond, false)?),
            body: Arc::new(graph(&self.body, true)?),
        };
        let mut operands = args[..nc].to_vec();
        for &k in &floats {
            operands.push(b.or_zeros(tans[k], args[k])?);
        }
        operands.extend_from_slice(&args[nc..]);
        operands.extend(present.iter().filter_map(|&k| tans[k]));
        let outs = b.emit_many(Prim::While(Box::new(w)), &operands)?;
        let mut out: Vec<Tan> = vec![None; nc];
        for (j, &k) in floats.iter().enumerate() {
            out[k] = Some(outs[nc + j]);
        }
        Ok(Some(out))
    }

    /// A carry feeds the next step, so none goes.
    fn prune(&self, _used: &[bool]) -> Option<(Prim, Vec<Option<usize>>)> {
        None
    }
}
