//! The generic batching rule: a primitive without a specialised rule is run
//! once per example by a single `loop` node (not `B` copies of the node), and
//! the results are stacked. `vmap` therefore never gives a wrong answer for
//! want of a rule; it warns once per primitive, and strict mode refuses.

use super::{rule, BVal, BatchCx, BatchOpts, Cts, Rule};
use crate::config::warn_once;
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType, VarId};
use crate::route::ConvRoute;
use crate::trace::Builder;
use candle_core::Tensor;

/// `inner` mapped over axis `bdims[i]` of each batched operand; the result
/// has the batch axis first.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopPrim {
    /// The per-example primitive.
    pub inner: Prim,
    /// The batch axis of each operand (`None`: shared by all examples).
    pub bdims: Vec<Option<usize>>,
    /// Number of examples.
    pub size: usize,
}

impl LoopPrim {
    pub(crate) fn name(&self) -> String {
        format!(
            "loop[size={},bdims={:?}]{{{}}}",
            self.size,
            self.bdims,
            self.inner.name()
        )
    }
}

fn unbatched(t: &TensorType, bdim: Option<usize>) -> TensorType {
    let mut t = t.clone();
    if let Some(d) = bdim {
        t.shape.remove(d);
    }
    t
}

impl Rule for LoopPrim {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        if args.len() != self.bdims.len() {
            return Err(Error::unsupported(
                self.name(),
                "vmap",
                "operand count differs from the loop's",
            ));
        }
        for (t, bd) in args.iter().zip(&self.bdims) {
            if let Some(d) = bd {
                if *d >= t.rank() || t.shape[*d] != self.size {
                    return Err(Error::shape(
                        "loop",
                        &[&t.shape],
                        format!("axis {d} is not a batch of {}", self.size),
                    ));
                }
            }
        }
        let per: Vec<TensorType> = args.iter().zip(&self.bdims).map(|(t, &bd)| unbatched(t, bd)).collect();
        let refs: Vec<&TensorType> = per.iter().collect();
        let mut out = rule(&self.inner)?.infer(&refs)?;
        out.shape.insert(0, self.size);
        Ok(out)
    }

    fn run(&self, args: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        let inner = rule(&self.inner)?;
        let per_out = unbatched(out, Some(0));
        let mut results = Vec::with_capacity(self.size);
        for i in 0..self.size {
            let mut xs = Vec::with_capacity(args.len());
            for (a, bd) in args.iter().zip(&self.bdims) {
                xs.push(match bd {
                    Some(d) => a.narrow(*d, i, 1).and_then(|t| t.squeeze(*d)).op("loop")?,
                    None => (*a).clone(),
                });
            }
            let refs: Vec<&Tensor> = xs.iter().collect();
            results.push(inner.run(&refs, &per_out)?);
        }
        Tensor::stack(&results, 0).op("loop")
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // A loop under another vmap is a loop of loops: no warning, the
        // inner loop was already reported.
        emit_loop(cx, Prim::Loop(Box::new(self.clone())), args).map(Some)
    }

    /// The VJP of a loop is the inner primitive's VJP, traced once on
    /// per-example types and batched over the same axes (as a loop again,
    /// so the user's choice of the `Loop` route holds).
    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let inner = rule(&self.inner)?;
        let scratch = Builder::root();
        let (graph, has) = {
            let mut sb = scratch.borrow_mut();
            let ids: Vec<VarId> = args
                .iter()
                .zip(&self.bdims)
                .map(|(&a, &bd)| sb.input(unbatched(b.ty(a), bd)))
                .collect();
            let o = sb.input(unbatched(b.ty(out), Some(0)));
            let c = sb.input(unbatched(b.ty(ct), Some(0)));
            let Some(cts) = inner.vjp(&mut sb, &ids, o, c)? else {
                return Ok(None);
            };
            let has: Vec<bool> = cts.iter().map(Option::is_some).collect();
            (sb.finish(cts.into_iter().flatten().collect()).0, has)
        };
        let opts = BatchOpts {
            route: ConvRoute::Loop,
            strict: false,
            randomness: crate::transforms::vmap::Randomness::Different,
        };
        let mut inputs: Vec<BVal> = args.iter().copied().zip(self.bdims.iter().copied()).collect();
        inputs.extend([(out, Some(0)), (ct, Some(0))]);
        let mut cx = BatchCx {
            b,
            size: self.size,
            opts: &opts,
        };
        let mut outs = crate::transforms::vmap::batch_graph(&graph, &mut cx, &inputs)?.into_iter();
        let mut cts = Vec::with_capacity(args.len());
        for (i, &a) in args.iter().enumerate() {
            cts.push(match has[i] {
                true => {
                    let g = outs
                        .next()
                        .ok_or_else(|| Error::unsupported(self.name(), "grad", "missing cotangent"))?;
                    Some(match_operand(&mut cx, g, (a, self.bdims[i]))?)
                }
                false => None,
            });
        }
        Ok(Some(cts))
    }
}

/// Gives a batched cotangent the layout of its operand: the operand's batch
/// axis, or summed over the batch for an operand shared by all examples.
fn match_operand(cx: &mut BatchCx, g: BVal, (_, bdim): BVal) -> Result<VarId> {
    match (g.1, bdim) {
        (None, None) => Ok(g.0),
        (Some(d), None) => cx.b.sum_axes(g.0, vec![d], false),
        (_, Some(d)) => {
            let v = cx.materialize(g)?;
            cx.b.move_axis(v, 0, d)
        }
    }
}

/// Emits `prim` as a loop over the examples.
pub(crate) fn emit_loop(cx: &mut BatchCx, prim: Prim, args: &[BVal]) -> Result<BVal> {
    let lp = LoopPrim {
        inner: prim,
        bdims: args.iter().map(|a| a.1).collect(),
        size: cx.size,
    };
    let ids: Vec<usize> = args.iter().map(|a| a.0).collect();
    Ok((cx.b.emit(Prim::Loop(Box::new(lp)), &ids)?, Some(0)))
}

/// Batches `prim` with its own rule, or with the loop when it has none
/// (warning once per primitive; an error in strict mode).
pub(crate) fn batch(cx: &mut BatchCx, prim: &Prim, args: &[BVal]) -> Result<BVal> {
    if let Some(out) = rule(prim)?.batch(cx, args)? {
        return Ok(out);
    }
    let kind = prim.kind();
    if cx.opts.strict {
        return Err(Error::unsupported(
            kind,
            "vmap",
            "no batching rule for this case, and strict mode forbids the per-example loop",
        ));
    }
    warn_once(
        format!("loop-{kind}"),
        format!("vmap: no batching rule for {kind} in this case; running it once per example (performance drop)"),
    );
    emit_loop(cx, prim.clone(), args)
}
