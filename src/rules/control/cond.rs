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
//!   cotangents, each a result of its own type) and JVPs, on the same
//!   index.

use super::{
    any_true, batched_graph, batched_outputs, body_facts, body_peak, from_taking, graph_of, keep_outputs, lanes_graph,
    renumber, rows_mask, run_graph, scalar_value, shape_error, tuple_rule,
};
use crate::error::Result;
use crate::ir::ops::Compare;
use crate::ir::{Cond, Graph, Prim, TensorType, VarId};
use crate::rules::facts::{Facts, Workspace};
use crate::rules::{walk, BVal, BatchCx, Builder, Cts, Many, RunCx, Tan};
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

    /// An error unless the index is a scalar and every branch takes the
    /// operands and gives the same types.
    fn check(&self, args: &[&TensorType]) -> Result<()> {
        let bad = |msg: String| shape_error("cond", args, msg);
        let Some(index) = args.first() else {
            return Err(bad("no index".into()));
        };
        if index.rank() != 0 {
            return Err(bad(format!("the index must be a scalar, got {:?}", index.shape)));
        }
        if self.branches.is_empty() {
            return Err(bad("no branch".into()));
        }
        let first = self.results();
        for (k, g) in self.branches().into_iter().enumerate() {
            let ins: Vec<&TensorType> = g.inputs.iter().map(|&i| g.ty(i)).collect();
            if ins != args[1..] {
                return Err(bad(format!("branch {k} does not take the operands {:?}", &args[1..])));
            }
            let outs = g.output_types();
            if outs != first {
                return Err(bad(format!(
                    "the branches give {first:?} and {outs:?}: every branch must give the same types"
                )));
            }
        }
        Ok(())
    }

    fn own_facts(&self) -> Facts {
        body_facts(&self.branches())
    }

    fn own_workspace(&self) -> Workspace {
        Workspace::scratch(body_peak(&self.branches()))
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
    /// that does; then each example's results.
    fn per_example(&self, cx: &mut BatchCx, p: VarId, ops: &[BVal]) -> Result<Vec<BVal>> {
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
        let mut outs: Vec<Vec<VarId>> = Vec::with_capacity(self.branches.len());
        for (g, &taking) in self.branches().into_iter().zip(&takes) {
            let run = lanes_graph(cx, &types, |icx, ins| {
                let fed = from_taking(icx.b, ins[0].0, icx.size, &ins[1..])?;
                batched_outputs(g, icx, &fed)
            })?;
            let tys = run.output_types();
            // taken by no example: skipped, its (discarded) results zeros
            let skip = lanes_graph(cx, &types, |icx, _| {
                tys.iter().map(|t| icx.b.zeros(t.shape.clone(), t.dtype)).collect()
            })?;
            // index 1 (some example takes it): run; 0: skip
            let c = Cond {
                branches: vec![Arc::new(skip), Arc::new(run)],
            };
            let mut args = vec![any_true(cx.b, taking)?, taking];
            args.extend_from_slice(&operands);
            outs.push(cx.b.emit_many(Prim::Cond(Box::new(c)), &args)?);
        }
        // each example's own branch's results: B -> B 1..
        let mut results = outs[0].clone();
        for (k, os) in outs.iter().enumerate().skip(1) {
            for (r, &o) in results.iter_mut().zip(os) {
                let rank = cx.b.ty(o).rank();
                let mask = rows_mask(cx.b, takes[k], cx.size, rank)?;
                *r = cx.b.select(mask, o, *r)?;
            }
        }
        Ok(results.into_iter().map(|r| (r, Some(0))).collect())
    }
}

tuple_rule!(Cond, "cond");

impl Many for Cond {
    /// The branch the index (the first operand) names, on the rest; the
    /// others are not run.
    fn run_many(&self, args: &[&Tensor], cx: &RunCx) -> Result<Vec<Tensor>> {
        let branch = &self.branches[branch_of(args[0], self.branches.len())?];
        let ops: Vec<Tensor> = args[1..].iter().map(|t| (*t).clone()).collect();
        run_graph(cx, branch, &ops, cx.seed)
    }

    fn batch_many(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Vec<BVal>> {
        let ops = &args[1..];
        if let (p, Some(d)) = args[0] {
            let p = cx.front((p, Some(d)))?;
            return self.per_example(cx, p, ops);
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
        let batched = self.map(|g| batched_graph(cx, g, &batched_ops, |icx, ins| batched_outputs(g, icx, ins)))?;
        let outs = cx.b.emit_many(Prim::Cond(Box::new(batched)), &operands)?;
        Ok(outs.into_iter().map(|o| (o, Some(0))).collect())
    }

    /// A cond of the branches' VJPs, taking the operands and the results'
    /// cotangents (those that have one) and giving the float operands'
    /// cotangents, each of its own type.
    fn vjp_many(&self, b: &mut Builder, args: &[VarId], _out: VarId, cts: &[Option<VarId>]) -> Result<Option<Cts>> {
        super::deterministic("cond", "grad", &self.branches())?;
        let floats: Vec<usize> = (1..args.len()).filter(|&k| b.ty(args[k]).dtype.is_float()).collect();
        let with: Vec<usize> = (0..cts.len()).filter(|&k| cts[k].is_some()).collect();
        if floats.is_empty() || with.is_empty() {
            return Ok(Some(vec![None; args.len()]));
        }
        let results = self.results();
        let back = self.map(|g| {
            let mut types = g.input_types();
            types.extend(with.iter().map(|&k| results[k].clone()));
            let n = g.inputs.len();
            graph_of(b, &types, |sb, ins| {
                let seeds: Vec<(usize, VarId)> = with.iter().enumerate().map(|(j, &k)| (k, ins[n + j])).collect();
                let wrt: Vec<bool> = (1..args.len()).map(|k| floats.contains(&k)).collect();
                let (_, cts) = walk::vjp_graph(g, sb, &ins[..n], &wrt, &seeds)?;
                floats.iter().map(|&k| sb.or_zeros(cts[k - 1], ins[k - 1])).collect()
            })
        })?;
        let mut operands = args.to_vec();
        operands.extend(with.iter().filter_map(|&k| cts[k]));
        let got = b.emit_many(Prim::Cond(Box::new(back)), &operands)?;
        let mut out: Cts = vec![None; args.len()];
        for (&k, g) in floats.iter().zip(got) {
            out[k] = Some(g);
        }
        Ok(Some(out))
    }

    /// A cond of the branches' JVPs: the operands, then the tangents of
    /// those that have one; the tangent of each float result out.
    fn jvp_many(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Vec<Tan>>> {
        let results = self.results();
        let present: Vec<usize> = (1..args.len()).filter(|&k| tans[k].is_some()).collect();
        let floats: Vec<usize> = (0..results.len()).filter(|&k| results[k].dtype.is_float()).collect();
        if present.is_empty() || floats.is_empty() {
            return Ok(Some(vec![None; results.len()]));
        }
        super::deterministic("cond", "jvp", &self.branches())?;
        let fwd = self.map(|g| {
            let mut types = g.input_types();
            types.extend(present.iter().map(|&k| g.ty(g.inputs[k - 1]).clone()));
            let n = g.inputs.len();
            graph_of(b, &types, |sb, ins| {
                let mut ts: Vec<Tan> = vec![None; n];
                for (j, &k) in present.iter().enumerate() {
                    ts[k - 1] = Some(ins[n + j]);
                }
                let (outs, touts) = walk::jvp_graph(g, sb, &ins[..n], &ts)?;
                floats.iter().map(|&k| sb.or_zeros(touts[k], outs[k])).collect()
            })
        })?;
        let mut operands = args.to_vec();
        operands.extend(present.iter().filter_map(|&k| tans[k]));
        let got = b.emit_many(Prim::Cond(Box::new(fwd)), &operands)?;
        let mut out: Vec<Tan> = vec![None; results.len()];
        for (&k, t) in floats.iter().zip(got) {
            out[k] = Some(t);
        }
        Ok(Some(out))
    }

    /// Every branch without the outputs nothing reads.
    fn prune(&self, used: &[bool]) -> Option<(Prim, Vec<Option<usize>>)> {
        if used.iter().all(|&u| u) {
            return None;
        }
        let c = self.map(|g| Ok(keep_outputs(g, used))).ok()?;
        Some((Prim::Cond(Box::new(c)), renumber(used)))
    }
}
