//! The `scan` primitive: a loop over a sub-graph carrying a state, one
//! node whatever the trip count (`crate::ir::Scan` says what its operands
//! and result are). The interpreter runs the body step by step; the rules
//! here only rewrite it:
//!
//! * batch: the same scan over the body batched, the carry batched
//!   whatever the initial value (the steps make it so, as in JAX);
//! * VJP: a scan the other way over the saved carries (the rows of the
//!   result), whose body is the step's VJP: it recomputes the step's
//!   insides from its saved carry (one step's activations live at a time)
//!   and carries the carry's cotangent and the sums of the cotangents of
//!   the operands every step reads;
//! * JVP: a scan whose carry is the carry and its tangent side by side.
//!
//! The derived scans flatten their carry into one vector (no batch axes
//! in front), so a rule never needs to know which axes of an operand the
//! batching rule put there.

use super::{batched_graph, body_facts, flat, piece, run_one, shape_error, Rows};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Graph, Options, Prim, Scan, TensorType, VarId};
use crate::rules::facts::{self, Arg, Facts, Workspace};
use crate::rules::{memory, mix, walk, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan, TraceCtx};
use candle_core::Tensor;
use std::rc::Rc;
use std::sync::Arc;

fn bad(args: &[&TensorType], msg: String) -> Error {
    shape_error("scan", args, msg)
}

impl Scan {
    /// Transforms see scans with every carry: the last-carry-only form is
    /// made after them, when a graph is prepared to run.
    fn transformable(&self, what: &str) -> Result<()> {
        match self.every_carry {
            true => Ok(()),
            false => Err(Error::internal(
                "scan",
                format!("{what} of a scan prepared to keep its last carry only"),
            )),
        }
    }

    pub(super) fn emit(self, b: &mut Builder, operands: &[VarId]) -> Result<VarId> {
        b.emit(Prim::Scan(Box::new(self)), operands)
    }

    /// The body's input types: the carry, one step of each scanned
    /// operand, the whole operands.
    pub(super) fn input_ty(&self, k: usize) -> &TensorType {
        self.body.ty(self.body.inputs[k])
    }

    /// The carry each step read, stacked in row order (`T L.. nc`): the
    /// initial carry, then every step's but the last, from the result.
    pub(super) fn carries_in(&self, b: &mut Builder, init: VarId, out: VarId) -> Result<VarId> {
        let rank = b.ty(out).rank();
        let carries = b.narrow(out, rank - 1, 0, self.carry)?;
        let mut first = b.dims(init);
        first.insert(0, 1);
        let init = b.reshape(init, first)?;
        if self.length == 1 {
            return Ok(init);
        }
        let parts = match self.reverse {
            false => [init, b.narrow(carries, 0, 0, self.length - 1)?],
            true => [b.narrow(carries, 0, 1, self.length - 1)?, init],
        };
        b.concat(&parts, 0)
    }
}

impl Scan {
    /// This loop (carry a vector `[nc]`) as a loop over `segments`
    /// segments of `k` steps each, whose body is this loop over one
    /// segment (scanned operands `T .. -> S k ..`): row `s` of its result
    /// is the carry after segment `s`, then the segment's `k` outputs
    /// (`[nc + k ny]`). The same values; but its VJP saves one carry per
    /// segment and recomputes a segment's others from it while going back
    /// over it (checkpointing: `S + k` carries held instead of `T`, for
    /// one more forward pass of the body).
    pub(crate) fn segmented(&self, k: usize, segments: usize, given: Options, ctx: Rc<TraceCtx>) -> Result<Scan> {
        if self.input_ty(0).rank() != 1 || k == 0 || segments == 0 {
            return Err(Error::internal(
                "scan",
                "segments of a loop whose carry is not a vector",
            ));
        }
        let scratch = Builder::scratch(given, ctx);
        let mut sb = scratch.borrow_mut();
        let mut ins = Vec::with_capacity(self.body.inputs.len());
        for j in 0..self.body.inputs.len() {
            let mut ty = self.input_ty(j).clone();
            if j >= 1 && j <= self.scanned {
                ty.shape.insert(0, k);
            }
            ins.push(sb.input(ty));
        }
        let inner = Scan {
            length: k,
            ..self.clone()
        };
        let rows = inner.emit(&mut sb, &ins)?; // k P
        let p = sb.dims(rows)[1];
        let last = if self.reverse { 0 } else { k - 1 };
        let row = sb.narrow(rows, 0, last, 1)?;
        let mut out = sb.narrow(row, 1, 0, self.carry)?;
        out = flat(&mut sb, out)?;
        if p > self.carry {
            // k ny -> (k ny)
            let ys = sb.narrow(rows, 1, self.carry, p - self.carry)?;
            let ys = flat(&mut sb, ys)?;
            out = sb.concat(&[out, ys], 0)?;
        }
        Ok(Scan {
            body: Arc::new(sb.finish(vec![out]).0),
            length: segments,
            ..self.clone()
        })
    }
}

impl Rule for Scan {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let body = &self.body;
        if args.is_empty() || body.inputs.len() != args.len() || body.outputs.len() != 1 || self.scanned >= args.len() {
            return Err(bad(
                args,
                format!("the loop's body takes {} operands", body.inputs.len()),
            ));
        }
        if self.length == 0 {
            return Err(bad(args, "a loop of no steps".into()));
        }
        let carry = args[0];
        if carry != self.input_ty(0) || carry.shape.last() != Some(&self.carry) {
            return Err(bad(
                args,
                format!(
                    "the carry {:?} does not fit the body's {:?}",
                    carry.shape,
                    self.input_ty(0).shape
                ),
            ));
        }
        for (k, t) in args.iter().enumerate().skip(1) {
            let mut step = (*t).clone();
            if k <= self.scanned {
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
        let out = body.ty(body.outputs[0]);
        let lead = &carry.shape[..carry.rank() - 1];
        if out.dtype != carry.dtype
            || out.rank() != carry.rank()
            || out.shape[..out.rank() - 1] != *lead
            || out.shape[out.rank() - 1] < self.carry
        {
            return Err(bad(
                args,
                format!(
                    "the body gives {:?} {:?}, which does not start with the carry {:?}",
                    out.dtype, out.shape, carry.shape
                ),
            ));
        }
        let mut shape = vec![self.length];
        shape.extend_from_slice(&out.shape);
        if !self.every_carry {
            // T L.. ny, then L.. nc, as one vector
            let lead: usize = lead.iter().product();
            let ny = out.shape[out.rank() - 1] - self.carry;
            shape = vec![self.length * lead * ny + lead * self.carry];
        }
        Ok(TensorType::new(shape, out.dtype))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        body_facts(&[&self.body])
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        // one step's body at its own peak while the loop runs; its inputs
        // are the carry (held beside the result) and views of the operands
        let inputs: usize = self.body.inputs.iter().map(|&i| facts::bytes(self.body.ty(i))).sum();
        let carry = facts::bytes(self.input_ty(0));
        Workspace::scratch(memory::planned_peak(&self.body).saturating_sub(inputs) + carry)
    }

    /// The body once per step, each step's value written into its row as
    /// it comes and its carry (the first entries along the last axis)
    /// passed to the next step.
    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let rows = Rows::new(out, cx, "scan")?;
        let last = self.body.ty(self.body.outputs[0]).rank() - 1;
        // where only the last carry is kept: each step's outputs at its
        // row's offset (`L.. ny` entries a row), the carry at the end
        let row_len = (out.elem_count() - args[0].elem_count()) / self.length;
        let mut carry = args
            .first()
            .map(|c| (*c).clone())
            .ok_or_else(|| Error::internal("scan", "no carry"))?;
        for i in 0..self.length {
            let t = self.row(i);
            let mut xs = Vec::with_capacity(args.len());
            xs.push(carry);
            for (k, a) in args[1..].iter().enumerate() {
                xs.push(match k < self.scanned {
                    true => a.narrow(0, t, 1).and_then(|s| s.squeeze(0)).op("scan")?,
                    false => (*a).clone(),
                });
            }
            let y = run_one(cx, &self.body, &xs, mix(cx.seed, i as u64), "scan")?;
            carry = y.narrow(last, 0, self.carry).op("scan")?;
            match self.every_carry {
                true => rows.write(t, &y)?,
                false => {
                    let ys = y
                        .narrow(last, self.carry, y.dim(last).op("scan")? - self.carry)
                        .op("scan")?;
                    rows.write_flat(t * row_len, &ys)?;
                }
            }
        }
        if !self.every_carry {
            rows.write_flat(self.length * row_len, &carry)?;
        }
        Ok(rows.into_tensor())
    }

    /// The same scan over the body batched (`B` first in the carry and in
    /// every step; a scanned operand `T .. B .. -> T B ..`). The result is
    /// `T B L.. P`: batched at axis 1.
    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        self.transformable("vmap")?;
        if args.iter().all(|a| a.1.is_none()) {
            let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
            return Ok(Some((self.clone().emit(cx.b, &ids)?, None)));
        }
        let mut operands = Vec::with_capacity(args.len());
        for (k, &(v, bd)) in args.iter().enumerate() {
            operands.push(match (k, bd) {
                (0, _) => cx.materialize((v, bd))?,
                (_, Some(d)) if k <= self.scanned => cx.b.move_axis(v, d, 1)?,
                (_, Some(_)) => cx.front((v, bd))?,
                (_, None) => v,
            });
        }
        // the carry batched whatever its start (the steps make it so)
        let batched: Vec<bool> = args.iter().enumerate().map(|(k, a)| k == 0 || a.1.is_some()).collect();
        let body = batched_graph(cx, &self.body, &batched, |icx, ins| {
            let out = walk::batch_graph(&self.body, icx, ins)?[0];
            icx.materialize(out)
        })?;
        let sc = Scan {
            body: Arc::new(body),
            ..self.clone()
        };
        Ok(Some((sc.emit(cx.b, &operands)?, Some(1))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        self.transformable("grad")?;
        super::deterministic("scan", "grad", &[&self.body])?;
        super::scan_vjp::emit(self, b, args, out, ct).map(Some)
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        self.transformable("jvp")?;
        if tans.iter().all(Option::is_none) {
            return Ok(Some(None));
        }
        super::deterministic("scan", "jvp", &[&self.body])?;
        let carry_ty = b.ty(args[0]).clone();
        let ncf = carry_ty.elem_count();
        let p = *self.body.ty(self.body.outputs[0]).shape.last().unwrap_or(&0);
        let lead = carry_ty.shape[..carry_ty.rank() - 1].to_vec();
        let nyf = lead.iter().product::<usize>() * (p - self.carry);
        let present: Vec<usize> = (1..args.len()).filter(|&k| tans[k].is_some()).collect();
        let graph = self.jvp_body(b, &carry_ty, &present)?;
        let init = flat(b, args[0])?;
        let t_init = b.or_zeros(tans[0], args[0])?;
        let t_init = flat(b, t_init)?;
        let mut operands = vec![b.concat(&[init, t_init], 0)?];
        let split = |ks: &[usize], scanned: bool| -> Vec<usize> {
            ks.iter().copied().filter(|&k| (k <= self.scanned) == scanned).collect()
        };
        let all: Vec<usize> = (1..args.len()).collect();
        for k in split(&all, true) {
            operands.push(args[k]);
        }
        for k in split(&present, true) {
            operands.push(tans[k].unwrap_or(args[k]));
        }
        for k in split(&all, false) {
            operands.push(args[k]);
        }
        for k in split(&present, false) {
            operands.push(tans[k].unwrap_or(args[k]));
        }
        let fwd = Scan {
            body: Arc::new(graph),
            carry: 2 * ncf,
            scanned: self.scanned + split(&present, true).len(),
            length: self.length,
            reverse: self.reverse,
            every_carry: true,
        };
        let rows = fwd.emit(b, &operands)?;
        // rows: T (c, tc, y, ty) -> T L.. (tc, ty)
        let mut c_shape = lead.clone();
        c_shape.push(self.carry);
        let mut y_shape = lead.clone();
        y_shape.push(p - self.carry);
        let tc = piece(b, rows, 1, ncf, &c_shape)?;
        let ty = piece(b, rows, 1, 2 * ncf + nyf, &y_shape)?;
        let axis = lead.len() + 1;
        Ok(Some(Some(match p > self.carry {
            true => b.concat(&[tc, ty], axis)?,
            false => tc,
        })))
    }
}

impl Scan {
    /// One forward step with tangents: `(c and tc packed, steps.., step
    /// tangents.., whole.., whole tangents..)` (tangents of the operands in
    /// `present` only) to `(c', tc', y, ty)` flattened.
    fn jvp_body(&self, b: &Builder, carry_ty: &TensorType, present: &[usize]) -> Result<Graph> {
        let scratch = Builder::scratch(b.given, b.ctx.clone());
        let mut sb = scratch.borrow_mut();
        let n = self.body.inputs.len();
        let ncf = carry_ty.elem_count();
        let state = sb.input(TensorType::new(vec![2 * ncf], carry_ty.dtype));
        let mut ins = vec![piece(&mut sb, state, 0, 0, &carry_ty.shape)?];
        let mut tans: Vec<Tan> = vec![Some(piece(&mut sb, state, 0, ncf, &carry_ty.shape)?)];
        ins.resize(n, 0);
        tans.resize(n, None);
        let (steps, whole): (Vec<usize>, Vec<usize>) = (1..n).partition(|&k| k <= self.scanned);
        for group in [steps, whole] {
            for &k in &group {
                ins[k] = sb.input(self.input_ty(k).clone());
            }
            for &k in group.iter().filter(|k| present.contains(k)) {
                tans[k] = Some(sb.input(self.input_ty(k).clone()));
            }
        }
        let (outs, touts) = walk::jvp_graph(&self.body, &mut sb, &ins, &tans)?;
        let o = outs[0];
        let to = sb.or_zeros(touts[0], o)?;
        let last = sb.ty(o).rank() - 1;
        let p = sb.dims(o)[last];
        let mut parts = Vec::with_capacity(4);
        for (start, len) in [(0, self.carry), (self.carry, p - self.carry)] {
            if len == 0 {
                continue;
            }
            for v in [o, to] {
                let part = sb.narrow(v, last, start, len)?;
                parts.push(flat(&mut sb, part)?);
            }
        }
        let out = sb.concat(&parts, 0)?;
        Ok(sb.finish(vec![out]).0.eliminate_dead_code())
    }
}
