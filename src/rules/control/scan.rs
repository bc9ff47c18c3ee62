//! The `scan` primitive: a loop over a sub-graph carrying a state, one
//! node whatever the trip count (`crate::ir::Scan` says what its operands
//! and results are). The interpreter runs the body step by step; the rules
//! here only rewrite it:
//!
//! * batch: the same scan over the body batched, every carry batched
//!   whatever its initial value (the steps make it so, as in JAX);
//! * VJP: a scan the other way over the carries each step read (a result
//!   of the forward scan), whose body is the step's VJP
//!   ([`super::scan_vjp`]);
//! * JVP: a scan whose carries are the carries and the float carries'
//!   tangents side by side;
//! * prune: an output nothing reads leaves the body, and the carries read
//!   leave the results where no VJP reads them (JAX's dead-code rule for
//!   `scan`), so a loop run forward keeps its last carry only.
//!
//! Every carry, scanned operand and output is a value of its own type: a
//! mix of dtypes (an f32 state beside an i64 counter) needs no packing.

use super::{
    batched_graph, batched_outputs, body_facts, graph_of, keep_outputs, renumber, run_graph, shape_error, tuple_rule,
    Rows,
};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Options, Prim, Scan, TensorType, VarId};
use crate::rules::facts::{self, Facts, Workspace};
use crate::rules::{memory, mix, walk, BVal, BatchCx, Builder, Cts, Many, RunCx, Tan, TraceCtx};
use candle_core::Tensor;
use std::rc::Rc;
use std::sync::Arc;

fn bad(args: &[&TensorType], msg: String) -> Error {
    shape_error("scan", args, msg)
}

impl Scan {
    /// The body's input types: the carries, one step of each scanned
    /// operand, the whole operands.
    pub(super) fn input_ty(&self, k: usize) -> &TensorType {
        self.body.ty(self.body.inputs[k])
    }

    /// Where the results start: the final carries at 0, the stacked
    /// outputs, then the carries read.
    pub(super) fn ys_at(&self) -> usize {
        self.carries
    }

    /// Where the carries read start among the results.
    pub(super) fn reads_at(&self) -> usize {
        self.carries + self.outputs()
    }

    /// An error unless the operands and the body's outputs fit the body.
    fn check(&self, args: &[&TensorType]) -> Result<()> {
        let body = &self.body;
        let nc = self.carries;
        if body.inputs.len() != args.len() || nc + self.scanned > args.len() || body.outputs.len() < nc {
            return Err(bad(
                args,
                format!("the loop's body takes {} operands", body.inputs.len()),
            ));
        }
        if self.length == 0 {
            return Err(bad(args, "a loop of no steps".into()));
        }
        for (k, t) in args.iter().enumerate() {
            let mut step = (*t).clone();
            let scanned = k >= nc && k < nc + self.scanned;
            if scanned {
                if step.shape.first() != Some(&self.length) {
                    return Err(bad(
                        args,
                        format!("operand {k} is not scanned over {} steps", self.length),
                    ));
                }
                step.shape.remove(0);
            }
            if step != *self.input_ty(k) {
                return Err(bad(
                    args,
                    format!("operand {k} does not fit the body's {:?}", self.input_ty(k).shape),
                ));
            }
        }
        for k in 0..nc {
            let next = body.ty(body.outputs[k]);
            if next != self.input_ty(k) {
                return Err(bad(
                    args,
                    format!(
                        "the body gives carry {k} as {:?} {:?}, where it takes {:?} {:?}",
                        next.dtype,
                        next.shape,
                        self.input_ty(k).dtype,
                        self.input_ty(k).shape
                    ),
                ));
            }
        }
        Ok(())
    }

    fn own_facts(&self) -> Facts {
        body_facts(&[&self.body])
    }

    fn own_workspace(&self) -> Workspace {
        // one step's body at its own peak while the loop runs; its inputs
        // are the carries (held beside the results) and views of the
        // operands
        let inputs: usize = self.body.inputs.iter().map(|&i| facts::bytes(self.body.ty(i))).sum();
        let carries: usize = (0..self.carries).map(|k| facts::bytes(self.input_ty(k))).sum();
        Workspace::scratch(memory::planned_peak(&self.body).saturating_sub(inputs) + carries)
    }

    /// This loop as a loop over `segments` segments of `k` steps each,
    /// whose body is this loop over one segment (scanned operands
    /// `T .. -> S k ..`): its results are the final carries, each output
    /// stacked `S k ..`, and the carries at the segments' starts. The same
    /// values; but its VJP saves one carry per segment and recomputes a
    /// segment's others from it while going back over it (checkpointing:
    /// `S + k` carries held instead of `T`, for one more forward pass of
    /// the body).
    pub(crate) fn segmented(&self, k: usize, segments: usize, given: Options, ctx: Rc<TraceCtx>) -> Result<Scan> {
        if k == 0 || segments == 0 {
            return Err(Error::internal("scan", "segments of no steps"));
        }
        let scratch = Builder::scratch(given, ctx);
        let mut sb = scratch.borrow_mut();
        let mut ins = Vec::with_capacity(self.body.inputs.len());
        for j in 0..self.body.inputs.len() {
            let mut ty = self.input_ty(j).clone();
            if j >= self.carries && j < self.carries + self.scanned {
                ty.shape.insert(0, k);
            }
            ins.push(sb.input(ty));
        }
        let inner = Scan {
            length: k,
            reads: true,
            ..self.clone()
        };
        let outs = sb.emit_many(Prim::Scan(Box::new(inner)), &ins)?;
        // the inner loop's final carries and its stacked outputs
        let kept = outs[..self.carries + self.outputs()].to_vec();
        Ok(Scan {
            body: Arc::new(sb.finish(kept).0.eliminate_dead_code()),
            length: segments,
            reads: true,
            ..self.clone()
        })
    }
}

tuple_rule!(Scan, "scan");

impl Many for Scan {
    /// The body once per step, each step's outputs (and, where kept, the
    /// carries it read) written into their rows as they come, and its
    /// carries passed to the next step.
    fn run_many(&self, args: &[&Tensor], cx: &RunCx) -> Result<Vec<Tensor>> {
        let nc = self.carries;
        let results = self.results();
        let ys = Rows::new(&results[self.ys_at()..self.reads_at()], cx, "scan")?;
        let reads = match self.reads {
            true => Some(Rows::new(&results[self.reads_at()..], cx, "scan")?),
            false => None,
        };
        let mut carries: Vec<Tensor> = args[..nc].iter().map(|c| (*c).clone()).collect();
        for i in 0..self.length {
            let t = self.row(i);
            let mut xs = carries.clone();
            for (k, a) in args[nc..].iter().enumerate() {
                xs.push(match k < self.scanned {
                    true => a.narrow(0, t, 1).and_then(|s| s.squeeze(0)).op("scan")?,
                    false => (*a).clone(),
                });
            }
            if let Some(r) = &reads {
                r.write(t, &carries)?;
            }
            let mut outs = run_graph(cx, &self.body, &xs, mix(cx.seed, i as u64))?;
            if outs.len() != nc + self.outputs() {
                return Err(Error::internal("scan", "a step gave another number of values"));
            }
            let step = outs.split_off(nc);
            ys.write(t, &step)?;
            carries = outs;
        }
        carries.extend(ys.into_tensors());
        if let Some(r) = reads {
            carries.extend(r.into_tensors());
        }
        Ok(carries)
    }

    /// The same scan over the body batched (`B` first in the carries and in
    /// every step; a scanned operand `T .. B .. -> T B ..`). The final
    /// carries are `B ..`; the stacked results `T B ..`.
    fn batch_many(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Vec<BVal>> {
        let nc = self.carries;
        let mut operands = Vec::with_capacity(args.len());
        for (k, &(v, bd)) in args.iter().enumerate() {
            operands.push(match (k < nc, k < nc + self.scanned, bd) {
                (true, _, _) => cx.materialize((v, bd))?,
                (false, true, Some(d)) => cx.b.move_axis(v, d, 1)?,
                (false, false, Some(_)) => cx.front((v, bd))?,
                (false, _, None) => v,
            });
        }
        // the carries batched whatever their start (the steps make it so)
        let batched: Vec<bool> = args.iter().enumerate().map(|(k, a)| k < nc || a.1.is_some()).collect();
        let body = batched_graph(cx, &self.body, &batched, |icx, ins| {
            batched_outputs(&self.body, icx, ins)
        })?;
        let sc = Scan {
            body: Arc::new(body),
            ..self.clone()
        };
        let outs = cx.b.emit_many(Prim::Scan(Box::new(sc)), &operands)?;
        Ok(outs
            .into_iter()
            .enumerate()
            .map(|(k, o)| (o, Some(usize::from(k >= nc))))
            .collect())
    }

    fn vjp_many(&self, b: &mut Builder, args: &[VarId], out: VarId, cts: &[Option<VarId>]) -> Result<Option<Cts>> {
        super::deterministic("scan", "grad", &[&self.body])?;
        super::scan_vjp::emit(self, b, args, out, cts).map(Some)
    }

    /// A scan of the carries and the float carries' tangents: the body's
    /// inputs the carries, their tangents, the steps, the tangents of the
    /// scanned operands that have one, the whole operands and theirs; its
    /// outputs the carries, their tangents, the outputs and the float
    /// outputs' tangents.
    fn jvp_many(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Vec<Tan>>> {
        let results = self.results();
        if tans.iter().all(Option::is_none) {
            return Ok(Some(vec![None; results.len()]));
        }
        super::deterministic("scan", "jvp", &[&self.body])?;
        let (nc, ns) = (self.carries, self.scanned);
        let floats: Vec<usize> = (0..nc).filter(|&k| self.input_ty(k).dtype.is_float()).collect();
        let steps: Vec<usize> = (nc..nc + ns).filter(|&k| tans[k].is_some()).collect();
        let wholes: Vec<usize> = (nc + ns..args.len()).filter(|&k| tans[k].is_some()).collect();
        let outs_ty = self.body.output_types();
        let fys: Vec<usize> = (nc..outs_ty.len()).filter(|&j| outs_ty[j].dtype.is_float()).collect();
        let groups = [
            (0..nc).collect::<Vec<_>>(),
            floats.clone(),
            (nc..nc + ns).collect(),
            steps.clone(),
            (nc + ns..args.len()).collect(),
            wholes.clone(),
        ];
        let graph = self.jvp_body(b, &groups, &fys)?;
        let mut operands: Vec<VarId> = args[..nc].to_vec();
        for &k in &floats {
            operands.push(b.or_zeros(tans[k], args[k])?);
        }
        operands.extend_from_slice(&args[nc..nc + ns]);
        operands.extend(steps.iter().filter_map(|&k| tans[k]));
        operands.extend_from_slice(&args[nc + ns..]);
        operands.extend(wholes.iter().filter_map(|&k| tans[k]));
        let fwd = Scan {
            body: Arc::new(graph),
            carries: nc + floats.len(),
            scanned: ns + steps.len(),
            ..self.clone()
        };
        let got = b.emit_many(Prim::Scan(Box::new(fwd)), &operands)?;
        // the new results: carries and tangents, outputs and tangents,
        // then (where kept) the carries and tangents read
        let ny = self.outputs();
        let mut out: Vec<Tan> = vec![None; results.len()];
        for (j, &k) in floats.iter().enumerate() {
            out[k] = Some(got[nc + j]);
            if self.reads {
                let reads = nc + floats.len() + ny + fys.len();
                out[self.reads_at() + k] = Some(got[reads + nc + j]);
            }
        }
        for (j, &y) in fys.iter().enumerate() {
            out[y] = Some(got[nc + floats.len() + ny + j]);
        }
        Ok(Some(out))
    }

    /// The scan without the outputs nothing reads, and without the carries
    /// read where no VJP reads any of them.
    fn prune(&self, used: &[bool]) -> Option<(Prim, Vec<Option<usize>>)> {
        let nc = self.carries;
        let ys = &used[self.ys_at()..self.reads_at()];
        let reads = self.reads && used[self.reads_at()..].iter().any(|&u| u);
        if ys.iter().all(|&u| u) && reads == self.reads {
            return None;
        }
        let keep: Vec<bool> = std::iter::repeat_n(true, nc).chain(ys.iter().copied()).collect();
        let sc = Scan {
            body: Arc::new(keep_outputs(&self.body, &keep)),
            reads,
            ..self.clone()
        };
        // every final carry stays; the carries read all stay or all go
        let read_results = if self.reads { nc } else { 0 };
        let kept: Vec<bool> = keep
            .into_iter()
            .chain(std::iter::repeat_n(reads, read_results))
            .collect();
        Some((Prim::Scan(Box::new(sc)), renumber(&kept)))
    }
}

impl Scan {
    /// The body of a scan's JVP: its inputs the groups of the body's
    /// inputs `groups` lists (carries, float carries' tangents, steps,
    /// their tangents, whole operands, theirs), its outputs the carries,
    /// the float carries' tangents, the outputs and the tangents of the
    /// float outputs `fys`.
    fn jvp_body(&self, b: &Builder, groups: &[Vec<usize>; 6], fys: &[usize]) -> Result<crate::ir::Graph> {
        let nc = self.carries;
        let floats = &groups[1];
        let all = self.body.input_types();
        let types: Vec<TensorType> = groups.iter().flatten().map(|&k| all[k].clone()).collect();
        graph_of(b, &types, |sb, ins| {
            // where each group's inputs start
            let mut at = 0;
            let mut starts = Vec::with_capacity(groups.len());
            for g in groups {
                starts.push(at);
                at += g.len();
            }
            let mut xs = vec![0; all.len()];
            let mut ts: Vec<Tan> = vec![None; all.len()];
            for (gi, tangents) in [(0, 1), (2, 3), (4, 5)] {
                for (j, &k) in groups[gi].iter().enumerate() {
                    xs[k] = ins[starts[gi] + j];
                }
                for (j, &k) in groups[tangents].iter().enumerate() {
                    ts[k] = Some(ins[starts[tangents] + j]);
                }
            }
            let (outs, touts) = walk::jvp_graph(&self.body, sb, &xs, &ts)?;
            let mut next = outs[..nc].to_vec();
            for &k in floats {
                next.push(sb.or_zeros(touts[k], outs[k])?);
            }
            next.extend_from_slice(&outs[nc..]);
            for &j in fys {
                next.push(sb.or_zeros(touts[j], outs[j])?);
            }
            Ok(next)
        })
    }
}
