//! The `map` primitive: a per-example sub-graph run once per example and
//! stacked. It is the generic batching fallback (a primitive without a
//! rule, JAX's and functorch's loop) and the conv `Loop` route, so `vmap`
//! never gives a wrong answer for want of a rule. Its run rule runs the
//! body through the interpreter's runner once per example; its batching
//! rule batches the body; its VJP is a map of the body's per-example VJP.
//! Each output of the body is a result of its own.

use super::{batched_outputs, body_facts, graph_of, keep_outputs, lanes_graph, renumber, run_graph, tuple_rule, Rows};
use crate::error::{CandleContext, Error, Result};
use crate::ir::options::Opts;
use crate::ir::{Graph, Map, Prim, TensorType, VarId};
use crate::rules::facts::{self, Facts, Workspace};
use crate::rules::{memory, mix, walk, BVal, BatchCx, Builder, Cts, Many, RunCx, Tan};
use candle_core::Tensor;
use std::sync::Arc;

/// `t` without its batch axis.
fn unbatched(t: &TensorType, bdim: Option<usize>) -> TensorType {
    let mut t = t.clone();
    if let Some(d) = bdim {
        if d < t.shape.len() {
            t.shape.remove(d);
        }
    }
    t
}

/// Emits `prim` mapped over the examples (batch axis first in the result).
pub(crate) fn emit_map(cx: &mut BatchCx, prim: &Prim, args: &[BVal]) -> Result<BVal> {
    let scratch = Builder::scratch(cx.b.given, cx.b.ctx.clone());
    let body = {
        let mut sb = scratch.borrow_mut();
        let ids: Vec<VarId> = args
            .iter()
            .map(|&(v, bd)| sb.input(unbatched(cx.b.ty(v), bd)))
            .collect();
        let out = sb.emit(prim.clone(), &ids)?;
        sb.finish(vec![out]).0
    };
    let out = emit_maps(cx.b, body, args, cx.size, *cx.opts)?;
    Ok((out[0], Some(0)))
}

/// Emits `body` (a per-example graph with any number of outputs) mapped
/// over `operands`: one map, each output a result of its own with the
/// batch axis first (`B out..`).
pub(crate) fn emit_maps(
    b: &mut Builder,
    body: Graph,
    operands: &[BVal],
    size: usize,
    opts: Opts,
) -> Result<Vec<VarId>> {
    let m = Map {
        body: Arc::new(body),
        bdims: operands.iter().map(|a| a.1).collect(),
        size,
        opts,
    };
    let ids: Vec<VarId> = operands.iter().map(|a| a.0).collect();
    b.emit_many(Prim::Map(Box::new(m)), &ids)
}

/// How many of a map's examples run at once: its options' width (at least
/// one, at most its size), or one where its body has effects (a user's
/// custom operation, called from several threads at once, may not be
/// reentrant or may count its calls).
pub(crate) fn width(m: &Map) -> usize {
    match facts::effect_of(&m.body) {
        facts::Effect::Pure => m.opts.width.clamp(1, m.size.max(1)),
        _ => 1,
    }
}

impl Map {
    /// An error unless the operands fit the body along their batch axes.
    fn check(&self, args: &[&TensorType]) -> Result<()> {
        let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
        if args.len() != self.bdims.len() || self.body.inputs.len() != args.len() {
            return Err(Error::shape(
                "map",
                &shapes,
                format!("the map takes {} operands", self.bdims.len()),
            ));
        }
        for (k, (t, bd)) in args.iter().zip(&self.bdims).enumerate() {
            if let Some(d) = bd {
                if *d >= t.rank() || t.shape[*d] != self.size {
                    return Err(Error::shape(
                        "map",
                        &shapes,
                        format!("axis {d} of operand {k} is not a batch of {}", self.size),
                    ));
                }
            }
            if unbatched(t, *bd) != *self.body.ty(self.body.inputs[k]) {
                return Err(Error::shape(
                    "map",
                    &shapes,
                    format!(
                        "operand {k} does not fit the body's {:?}",
                        self.body.ty(self.body.inputs[k])
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
        // `width` examples' bodies at their own peaks while the map runs
        // (each result is written into the map's and dropped); their inputs
        // are views of the map's operands, which the plan holds already
        let inputs: usize = self.body.inputs.iter().map(|&i| facts::bytes(self.body.ty(i))).sum();
        let one = memory::planned_peak(&self.body).saturating_sub(inputs);
        Workspace::scratch(one.saturating_mul(width(self)))
    }

    /// The operands with their batch axes.
    fn operands(&self, args: &[VarId]) -> Vec<BVal> {
        args.iter().copied().zip(self.bdims.iter().copied()).collect()
    }
}

tuple_rule!(Map, "map");

impl Many for Map {
    /// The body once per example (each with its own seed), each example's
    /// results written into their rows as they come: the results are never
    /// held all at once beside their stacks. On the CPU the examples run in
    /// waves of the map's width on rayon's pool (one example's kernels are
    /// too small to fill the cores; the plan counts a wave's bodies); the
    /// rows and seeds are those of one at a time.
    fn run_many(&self, args: &[&Tensor], cx: &RunCx) -> Result<Vec<Tensor>> {
        use rayon::prelude::*;
        if self.size == 0 {
            return Err(Error::internal("map", "a map over zero examples"));
        }
        let rows = Rows::new(&self.results(), cx, "map")?;
        let example = |i: usize| -> Result<()> {
            let mut xs = Vec::with_capacity(args.len());
            for (a, bd) in args.iter().zip(&self.bdims) {
                xs.push(match bd {
                    Some(d) => a.narrow(*d, i, 1).and_then(|t| t.squeeze(*d)).op("map")?,
                    None => (*a).clone(),
                });
            }
            rows.write(i, &run_graph(cx, &self.body, &xs, mix(cx.seed, i as u64))?)
        };
        let width = match cx.device.is_cpu() {
            true => width(self),
            false => 1,
        };
        for start in (0..self.size).step_by(width) {
            let wave = start..(start + width).min(self.size);
            match width {
                1 => wave.into_iter().try_for_each(example)?,
                // every example of the wave finishes; the first error in
                // example order is the one reported
                _ => wave
                    .into_par_iter()
                    .map(example)
                    .collect::<Vec<Result<()>>>()
                    .into_iter()
                    .collect::<Result<()>>()?,
            }
        }
        Ok(rows.into_tensors())
    }

    /// A map under another `vmap`: the same map over a body batched by the
    /// new axis. Every operand the new `vmap` batches gets that axis first
    /// (`.. B2 .. -> B2 ..`), so the map's own axis moves one place back and
    /// each example of the map sees the new batch at axis 0; every result
    /// is `size B2 ..`.
    fn batch_many(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Vec<BVal>> {
        let mut operands = Vec::with_capacity(args.len());
        let mut bdims = Vec::with_capacity(args.len());
        let mut types = Vec::with_capacity(args.len());
        for (k, (&(v, bd2), &bd)) in args.iter().zip(&self.bdims).enumerate() {
            let per = self.body.ty(self.body.inputs[k]).clone();
            match bd2 {
                Some(_) => {
                    operands.push(cx.front((v, bd2))?);
                    bdims.push(bd.map(|d| d + 1));
                }
                None => {
                    operands.push(v);
                    bdims.push(bd);
                }
            }
            types.push((per, bd2.is_some()));
        }
        // The body is batched over the new vmap's axis: its route is the
        // map's (the caller's choice for what the map holds), strict if
        // either asks, and random draws as the new vmap says.
        let opts = Opts {
            strict: self.opts.strict || cx.opts.strict,
            randomness: cx.opts.randomness,
            ..self.opts
        };
        let inner = BatchCx {
            b: cx.b,
            size: cx.size,
            opts: &opts,
            plan: cx.plan,
        };
        let body = lanes_graph(&inner, &types, |icx, ins| batched_outputs(&self.body, icx, ins))?;
        let m = Map {
            body: Arc::new(body),
            bdims,
            size: self.size,
            opts: self.opts,
        };
        let outs = cx.b.emit_many(Prim::Map(Box::new(m)), &operands)?;
        Ok(outs.into_iter().map(|o| (o, Some(1))).collect())
    }

    /// A map of the body's per-example VJP: one map computing every
    /// operand's cotangent from one forward and backward pass per example,
    /// taking the primal operands and the results' cotangents. A shared
    /// operand's cotangent is the sum over the examples.
    fn vjp_many(&self, b: &mut Builder, args: &[VarId], _out: VarId, cts: &[Option<VarId>]) -> Result<Option<Cts>> {
        let with: Vec<usize> = (0..cts.len()).filter(|&k| cts[k].is_some()).collect();
        let mut has = Vec::new();
        let mut types = self.body.input_types();
        types.extend(with.iter().map(|&k| self.body.ty(self.body.outputs[k]).clone()));
        let n = self.body.inputs.len();
        let graph = graph_of(b, &types, |sb, ins| {
            let seeds: Vec<(usize, VarId)> = with.iter().enumerate().map(|(j, &k)| (k, ins[n + j])).collect();
            let wrt = vec![true; n];
            let (_, cts) = walk::vjp_graph(&self.body, sb, &ins[..n], &wrt, &seeds)?;
            has = cts.iter().map(Option::is_some).collect();
            Ok(cts.into_iter().flatten().collect())
        })?;
        let mut operands = self.operands(args);
        operands.extend(with.iter().filter_map(|&k| cts[k]).map(|c| (c, Some(0))));
        let mut per = emit_maps(b, graph, &operands, self.size, self.opts)?.into_iter();
        let mut out = Vec::with_capacity(args.len());
        for (k, &bd) in self.bdims.iter().enumerate() {
            if !has[k] {
                out.push(None);
                continue;
            }
            let g = per
                .next()
                .ok_or_else(|| Error::internal("map", "a cotangent without a map"))?;
            // size X.. -> the operand's layout: summed if shared, else the
            // batch axis back where the operand has it.
            out.push(Some(match bd {
                None => b.sum_axes(g, vec![0], false)?,
                Some(d) => b.move_axis(g, 0, d)?,
            }));
        }
        Ok(Some(out))
    }

    /// A map of the body's per-example JVP: the primal operands, then the
    /// tangent of each operand that has one (batched as its operand is),
    /// in; the tangent of each result that has one out.
    fn jvp_many(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Vec<Tan>>> {
        let present: Vec<usize> = (0..args.len()).filter(|&k| tans[k].is_some()).collect();
        let mut types = self.body.input_types();
        types.extend(present.iter().map(|&k| self.body.ty(self.body.inputs[k]).clone()));
        let n = self.body.inputs.len();
        let mut has = Vec::new();
        let graph = graph_of(b, &types, |sb, ins| {
            let mut body_tans: Vec<Tan> = vec![None; n];
            for (j, &k) in present.iter().enumerate() {
                body_tans[k] = Some(ins[n + j]);
            }
            let (_, out_tans) = walk::jvp_graph(&self.body, sb, &ins[..n], &body_tans)?;
            has = out_tans.iter().map(Option::is_some).collect();
            Ok(out_tans.into_iter().flatten().collect())
        })?;
        if !has.contains(&true) {
            return Ok(Some(vec![None; has.len()]));
        }
        let mut operands = self.operands(args);
        operands.extend(present.iter().filter_map(|&k| tans[k].map(|t| (t, self.bdims[k]))));
        let mut per = emit_maps(b, graph, &operands, self.size, self.opts)?.into_iter();
        Ok(Some(has.iter().map(|&h| if h { per.next() } else { None }).collect()))
    }

    /// The map without the outputs nothing reads.
    fn prune(&self, used: &[bool]) -> Option<(Prim, Vec<Option<usize>>)> {
        if used.iter().all(|&u| u) {
            return None;
        }
        let m = Map {
            body: Arc::new(keep_outputs(&self.body, used)),
            ..self.clone()
        };
        Some((Prim::Map(Box::new(m)), renumber(used)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ops::Unary;
    use crate::ir::options::{ConvRoute, Options};
    use crate::ir::CustomOp;
    use crate::rules::plan::Fixed;
    use crate::rules::TraceCtx;
    use candle_core::{DType, Device};

    fn body(prim: Prim) -> Graph {
        let sb = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut sb = sb.borrow_mut();
        let x = sb.input(TensorType::new(vec![2], DType::F32));
        let y = sb.emit(prim, &[x]).unwrap();
        sb.finish(vec![y]).0
    }

    fn custom() -> Prim {
        Prim::Custom(CustomOp {
            name: "opaque".into(),
            f: Arc::new(|xs: &[Tensor]| xs[0].exp()),
            ins: vec![TensorType::new(vec![2], DType::F32)],
            out: TensorType::new(vec![2], DType::F32),
            rules: Default::default(),
        })
    }

    /// A map over 4 examples of `prim`, carrying `opts`, batched again by a
    /// vmap of 3 with other options (not strict).
    fn batch_again(prim: Prim, opts: Opts) -> Result<(Vec<usize>, Option<usize>, Opts)> {
        let root = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = root.borrow_mut();
        let x = b.input(TensorType::new(vec![3, 4, 2], DType::F32));
        let m = Map {
            body: Arc::new(body(prim)),
            bdims: vec![Some(0)],
            size: 4,
            opts,
        };
        let outer = Opts::default();
        let mut cx = BatchCx {
            b: &mut b,
            size: 3,
            opts: &outer,
            plan: &Fixed,
        };
        let (v, bd) = m.batch_many(&mut cx, &[(x, Some(0))])?[0];
        let carried = match &b.nodes[b.nodes[v].args[0]].prim {
            Prim::Map(m) => m.opts,
            p => panic!("expected a map, got {}", p.name()),
        };
        Ok((b.dims(v), bd, carried))
    }

    #[test]
    fn a_batched_map_batches_its_body_with_its_own_options() {
        let strict = Opts {
            strict: true,
            ..Opts::default()
        };
        // The body's custom op has no batching rule: the map's own strict
        // mode refuses the loop, though the enclosing vmap is not strict.
        assert!(matches!(batch_again(custom(), strict), Err(Error::Unsupported { .. })));
        let lax = Opts {
            route: ConvRoute::Loop,
            ..Opts::default()
        };
        let (dims, bd, carried) = batch_again(custom(), lax).unwrap();
        assert_eq!(
            (dims, bd),
            (vec![4, 3, 2], Some(1)),
            "the map's axis first, the new batch second"
        );
        assert_eq!(carried, lax, "the batched map keeps the caller's options");
        let (dims, _, _) = batch_again(Prim::Unary(Unary::Exp), strict).unwrap();
        assert_eq!(dims, vec![4, 3, 2], "a body with rules batches in strict mode");
    }

    #[test]
    fn a_maps_vjp_is_a_map_with_the_same_options() {
        let opts = Opts {
            route: ConvRoute::Grouped,
            strict: true,
            ..Opts::default()
        };
        let root = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = root.borrow_mut();
        let x = b.input(TensorType::new(vec![4, 2], DType::F32));
        let m = Map {
            body: Arc::new(body(Prim::Unary(Unary::Exp))),
            bdims: vec![Some(0)],
            size: 4,
            opts,
        };
        let out = b.emit_tuple(Prim::Map(Box::new(m.clone())), &[x]).unwrap();
        let ct = b.input(TensorType::new(vec![4, 2], DType::F32));
        let cts = m.vjp_many(&mut b, &[x], out, &[Some(ct)]).unwrap().unwrap();
        let g = cts[0].unwrap();
        assert_eq!(b.dims(g), vec![4, 2]);
        let maps: Vec<Opts> = b.nodes[out + 1..]
            .iter()
            .filter_map(|n| match &n.prim {
                Prim::Map(m) => Some(m.opts),
                _ => None,
            })
            .collect();
        assert_eq!(
            maps,
            vec![opts],
            "one map for the one cotangent, with the caller's options"
        );
    }
}
