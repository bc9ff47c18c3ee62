//! Attention as one primitive (`AttnOp`): `softmax(mask(q k^T * scale)) v`
//! and its gradient, fused so that no `T x T` matrix is kept for the
//! backward (the kernel recomputes a block's probabilities from its
//! scores; see `kernels::attention`).
//!
//! * batch: the batch axis folded into `N` (`B N H T D -> (B N) H T D`,
//!   `B N T -> (B N) T`): attention is independent per sequence.
//! * VJP of the attention: the fused gradient, split into `dq`, `dk`, `dv`.
//! * JVP of either, and VJP of the gradient (second derivatives): the
//!   same computation in ordinary primitives (products, softmax, `where`),
//!   differentiated by their rules. These hold the scores whole, as the
//!   unfused computation does.

use super::facts::{Arg, Facts, Workspace};
use super::{walk, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{AttnOp, Binary, Compare, Reduce, Unary};
use crate::ir::{Graph, Prim, TensorType, VarId};
use crate::kernels::attention as kernel;
use candle_core::{DType, Tensor};

pub(crate) use kernel::lowest;

fn bad(op: &AttnOp, args: &[&TensorType], msg: impl Into<String>) -> Error {
    let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
    Error::shape(if op.backward { "attention_grad" } else { "attention" }, &shapes, msg)
}

impl Rule for AttnOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let want = self.tensors() + usize::from(self.masked);
        if args.len() != want {
            return Err(bad(self, args, format!("takes {want} operands, got {}", args.len())));
        }
        let q = args[0];
        if q.rank() != 4 || !q.dtype.is_float() {
            return Err(bad(self, args, "q must be a float [N, H, T, D]"));
        }
        if args[..self.tensors()].iter().any(|a| *a != q) {
            return Err(bad(self, args, "q, k and v (and dout) must share one shape and dtype"));
        }
        let (n, t) = (q.shape[0], q.shape[2]);
        if self.masked && args[self.tensors()].shape != [n, t] {
            return Err(bad(self, args, "the mask must be [N, T], one flag per key"));
        }
        let mut out = q.clone();
        if self.backward {
            out.shape[3] = q.shape[3]
                .checked_mul(3)
                .ok_or_else(|| bad(self, args, "3 D overflows"))?;
        }
        Ok(out)
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::costly()
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        let copies: usize = args.iter().map(Arg::copy_if_strided).sum();
        let q = args[0].ty;
        let (heads, t, elem) = (q.shape[0] * q.shape[1], q.shape[2], q.dtype.size_in_bytes());
        let scratch = match q.dtype {
            // a block of scores (and their gradient) per thread, for as
            // many heads at once as a large machine runs
            DType::F32 | DType::F64 => kernel::kernel_scratch(t, elem, heads.min(64)),
            // the f32 kernel on widened operands, its result in f32 too
            DType::BF16 => {
                let wide: usize = args[..self.tensors()].iter().map(|a| a.ty.elem_count()).sum();
                let wide = wide.saturating_add(out.elem_count()).saturating_mul(4);
                kernel::kernel_scratch(t, 4, heads.min(64)).saturating_add(wide)
            }
            _ => kernel::generic_scratch(heads, t, elem),
        };
        // the mask is read to the host as flags (a byte each, twice)
        let flags = if self.masked {
            args[self.tensors()].ty.elem_count() * 2
        } else {
            0
        };
        Workspace {
            copies,
            scratch: scratch.saturating_add(flags),
        }
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let keep = self.masked.then(|| args[self.tensors()]);
        match self.backward {
            false => kernel::forward(args[0], args[1], args[2], keep, self.causal, self.scale, cx.path).op("attention"),
            true => kernel::backward(
                [args[0], args[1], args[2], args[3]],
                keep,
                self.causal,
                self.scale,
                cx.path,
            )
            .op("attention_grad"),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
        if args.iter().all(|a| a.1.is_none()) {
            return Ok(Some((cx.b.emit(Prim::Attention(self.clone()), &ids)?, None)));
        }
        // every operand batch first, the batch folded into N:
        // B N .. -> (B N) ..
        let mut folded = Vec::with_capacity(args.len());
        let mut n = 0;
        for &a in args {
            let v = cx.materialize(a)?;
            let mut d = cx.b.dims(v);
            n = d[1];
            let bn = d[0] * d[1];
            d.splice(0..2, [bn]);
            folded.push(cx.b.reshape(v, d)?);
        }
        let out = cx.b.emit(Prim::Attention(self.clone()), &folded)?;
        // (B N) H T X -> B N H T X
        let mut d = cx.b.dims(out);
        d.splice(0..1, [cx.size, n]);
        Ok(Some((cx.b.reshape(out, d)?, Some(0))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let tensors = self.tensors();
        let wrt: Vec<bool> = (0..args.len()).map(|k| k < tensors).collect();
        if self.backward {
            // second derivatives: the gradient in ordinary primitives
            let g = self.unfused(b, args)?;
            let (_, cts) = walk::vjp_graph(&g, b, args, &wrt, &[(0, ct)])?;
            return Ok(Some(cts));
        }
        let grad = AttnOp {
            backward: true,
            ..self.clone()
        };
        // the output is not an operand: the gradient needs q, k, v alone,
        // so the output need not be kept for it
        let mut operands = vec![args[0], args[1], args[2], ct];
        operands.extend(self.masked.then(|| args[3]));
        let packed = b.emit(Prim::Attention(grad), &operands)?;
        let d = b.dims(args[0])[3];
        let mut cts: Cts = (0..3)
            .map(|i| b.narrow(packed, 3, i * d, d).map(Some))
            .collect::<Result<_>>()?;
        cts.extend(self.masked.then_some(None));
        Ok(Some(cts))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        if tans.iter().all(Option::is_none) {
            return Ok(Some(None));
        }
        let g = self.unfused(b, args)?;
        let (_, touts) = walk::jvp_graph(&g, b, args, tans)?;
        Ok(Some(touts[0]))
    }
}

impl AttnOp {
    /// This primitive in ordinary ones, as a graph over operands of `args`'
    /// types (for the rules that differentiate it once more).
    fn unfused(&self, b: &Builder, args: &[VarId]) -> Result<Graph> {
        let scratch = Builder::scratch(b.given, b.ctx.clone());
        let mut sb = scratch.borrow_mut();
        let ins: Vec<VarId> = args.iter().map(|&a| sb.input(b.ty(a).clone())).collect();
        let keep = self.masked.then(|| ins[self.tensors()]);
        let out = match self.backward {
            false => {
                let p = self.probabilities(&mut sb, ins[0], ins[1], keep)?.0;
                sb.emit(Prim::Matmul, &[p, ins[2]])?
            }
            true => self.gradient(&mut sb, &ins, keep)?,
        };
        Ok(sb.finish(vec![out]).0.eliminate_dead_code())
    }

    /// `softmax(mask(q k^T * scale))` `[N, H, T, T]`, and each mask that
    /// applies as `u8` 1 where hidden (broadcasting against it).
    fn probabilities(&self, b: &mut Builder, q: VarId, k: VarId, keep: Option<VarId>) -> Result<(VarId, Vec<VarId>)> {
        let d = b.dims(q);
        let (n, t) = (d[0], d[2]);
        let kt = b.permute(k, vec![0, 1, 3, 2])?;
        let s = b.emit(Prim::Matmul, &[q, kt])?;
        let mut s = b.un(Unary::Affine(self.scale, 0.0), s)?;
        let mut hidden = Vec::new();
        if self.causal {
            // 1 T T: key j after query i
            let after: Vec<u8> = (0..t * t).map(|x| u8::from(x % t > x / t)).collect();
            let after = Tensor::from_vec(after, (1, 1, t, t), &b.ctx.device).op("attention")?;
            hidden.push(b.constant(&after));
        }
        if let Some(keep) = keep {
            let zero = b.scalar_as(0.0, keep);
            let pad = b.cmp(Compare::Eq, keep, zero)?;
            hidden.push(b.reshape(pad, vec![n, 1, 1, t])?);
        }
        let fill = b.scalar(lowest(b.ty(s).dtype), b.ty(s).dtype);
        for &h in &hidden {
            s = b.select(h, fill, s)?;
        }
        let p = b.emit(Prim::Reduce(Reduce::Softmax(3)), &[s])?;
        Ok((p, hidden))
    }

    /// `dq | dk | dv` from `q, k, v, dout` (see `kernels::attention`).
    fn gradient(&self, b: &mut Builder, ins: &[VarId], keep: Option<VarId>) -> Result<VarId> {
        let [q, k, v, dout] = [ins[0], ins[1], ins[2], ins[3]];
        let (p, hidden) = self.probabilities(b, q, k, keep)?;
        let t = |b: &mut Builder, x: VarId| b.permute(x, vec![0, 1, 3, 2]);
        let pt = t(b, p)?;
        let dv = b.emit(Prim::Matmul, &[pt, dout])?;
        let vt = t(b, v)?;
        let dp = b.emit(Prim::Matmul, &[dout, vt])?;
        let pdp = b.bin(Binary::Mul, p, dp)?;
        let dot = b.sum_axes(pdp, vec![3], true)?;
        let centred = b.bin(Binary::Sub, dp, dot)?;
        let mut ds = b.bin(Binary::Mul, p, centred)?;
        let zero = b.scalar_as(0.0, ds);
        for &h in &hidden {
            ds = b.select(h, zero, ds)?;
        }
        let ds = b.un(Unary::Affine(self.scale, 0.0), ds)?;
        let dq = b.emit(Prim::Matmul, &[ds, k])?;
        let dst = t(b, ds)?;
        let dk = b.emit(Prim::Matmul, &[dst, q])?;
        b.concat(&[dq, dk, dv], 3)
    }
}
