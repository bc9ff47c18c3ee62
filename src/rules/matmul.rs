//! Matrix product with broadcast leading (batch) axes:
//! `[.., m, k] @ [.., k, n] -> [.., m, n]`, both operands of rank >= 2.

use super::facts::{Arg, Facts, Workspace};
use super::{arity, broadcast_shapes, multilinear_jvp, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::copies::Relayout;
use crate::kernels::outer::outer;
use crate::kernels::Kx;
use crate::kernels::{bmm, widen};
use candle_core::{DType, Tensor};

/// The matrix product primitive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matmul;

impl Rule for Matmul {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("matmul", args, 2)?;
        let dt = same_dtype("matmul", args)?;
        if !dt.is_float() {
            // candle's integer products overflow with a panic in debug builds
            return Err(Error::DType {
                op: "matmul",
                dtypes: vec![dt],
                msg: "matrix products need floating-point operands".into(),
            });
        }
        let (a, b) = (args[0].shape.as_slice(), args[1].shape.as_slice());
        if a.len() < 2 || b.len() < 2 {
            return Err(Error::shape("matmul", &[a, b], "both operands need rank >= 2"));
        }
        let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
        let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
        if k != k2 {
            return Err(Error::shape(
                "matmul",
                &[a, b],
                format!("inner dimensions differ ({k} vs {k2})"),
            ));
        }
        let mut out = broadcast_shapes("matmul", &a[..a.len() - 2], &b[..b.len() - 2])?;
        out.extend([m, n]);
        Ok(TensorType::new(out, dt))
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            epilogue: true,
            ..Facts::costly()
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        // As `run` lays its operands out: the left operand folded into one
        // GEMM is made contiguous; equal batch axes are read in place (up
        // to rank 3, merged by a copy above it); broadcast batch axes are
        // materialised on both sides. Then the product's own copies and
        // packing (`kernels::bmm::scratch`; a strided operand is taken for
        // a transposed one).
        let (a, b) = (args[0], args[1]);
        let (ra, rb) = (a.ty.rank(), b.ty.rank());
        let batch: usize = out.shape[..out.rank() - 2].iter().product();
        let (m, k, n) = (a.ty.shape[ra - 2], a.ty.shape[ra - 1], b.ty.shape[rb - 1]);
        let copies = if rb == 2 && ra > 2 {
            a.copy_if_strided()
        } else if ra == rb && a.ty.shape[..ra - 2] == b.ty.shape[..rb - 2] {
            if ra > 3 {
                a.copy_if_strided() + b.copy_if_strided()
            } else {
                0
            }
        } else {
            let whole = |t: &TensorType| {
                let mat: usize = t.shape[t.rank() - 2..].iter().product();
                batch.saturating_mul(mat).saturating_mul(t.dtype.size_in_bytes())
            };
            whole(a.ty).saturating_add(whole(b.ty))
        };
        let (nb, m) = if rb == 2 && ra > 2 { (1, batch * m) } else { (batch, m) };
        let scratch = bmm::scratch((nb, m, k, n), !a.contiguous, !b.contiguous);
        // bf16 multiplies in f32 (here and in candle alike): both operands
        // and the product widened, the product's own scratch in f32
        let (copies, elem) = match out.dtype {
            DType::BF16 => (copies.saturating_add(bf16_widened(a.ty, b.ty, out)), 4),
            dt => (copies, dt.size_in_bytes()),
        };
        Workspace {
            copies,
            scratch: scratch.saturating_mul(elem),
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let (a, b, c) = (args[0], args[1], (cx.copies, cx.path));
        let (ad, bd) = (a.dims(), b.dims());
        let r = if bd.len() == 2 && ad.len() > 2 {
            // [.., m, k] @ [k, n]: fold the leading axes into m, one GEMM.
            let k = ad[ad.len() - 1];
            let a2 = a.relayout(c.0).op("matmul")?.reshape(((), k)).op("matmul")?;
            mm(&a2, b, c)?.reshape(out.shape.as_slice()).op("matmul")?
        } else if ad.len() == bd.len() && ad[..ad.len() - 2] == bd[..bd.len() - 2] {
            mm(a, b, c)?
        } else {
            let a = a
                .broadcast_as([&out.shape[..out.shape.len() - 2], &ad[ad.len() - 2..]].concat())
                .op("matmul")?;
            let b = b
                .broadcast_as([&out.shape[..out.shape.len() - 2], &bd[bd.len() - 2..]].concat())
                .op("matmul")?;
            mm(&a.relayout(c.0).op("matmul")?, &b.relayout(c.0).op("matmul")?, c)?
        };
        Ok(r)
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        let (a, b) = (args[0], args[1]);
        let (ra, rb) = (cx.logical_rank(a), cx.logical_rank(b));
        let rank = ra.max(rb);
        let out = match (a.1, b.1) {
            // x.. m k @ k n with only the left batched: B x.. m k @ k n, which
            // `run` folds into a single GEMM.
            (Some(_), None) if rb == 2 => {
                let ab = cx.front(a)?;
                (cx.b.emit(Prim::Matmul, &[ab, b.0])?, Some(0))
            }
            // m k @ B k n as one GEMM over the batched operand's stored
            // layout: stacked linear weights `[B, out, in]` enter as the
            // view `B in out` (k n), so `B k n -> B n k` is that storage
            // again and `(B n) k` costs nothing; (B n) k @ k m -> (B n) m
            // -> B n m -> B m n. Only the small shared `a` is transposed.
            (None, Some(_)) if ra == 2 && rb == 2 => {
                let bb = cx.front(b)?;
                let [_, k, n] = cx.b.dims(bb)[..] else {
                    return Err(Error::internal("matmul", "a batched matrix of rank other than 3"));
                };
                let bt = transpose_last(cx.b, bb)?;
                let bt = cx.b.reshape(bt, vec![cx.size * n, k])?;
                let at = transpose_last(cx.b, a.0)?;
                let y = cx.b.emit(Prim::Matmul, &[bt, at])?;
                let m = cx.b.dims(a.0)[0];
                let y = cx.b.reshape(y, vec![cx.size, n, m])?;
                (transpose_last(cx.b, y)?, Some(0))
            }
            // Otherwise: batch axis first, unit axes up to the common rank,
            // and let the leading axes broadcast.
            _ => {
                let ab = if a.1.is_some() { cx.front_padded(a, rank)? } else { a.0 };
                let bb = if b.1.is_some() { cx.front_padded(b, rank)? } else { b.0 };
                (cx.b.emit(Prim::Matmul, &[ab, bb])?, Some(0))
            }
        };
        Ok(Some(out))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        // da = ct @ b^T, db = a^T @ ct, summed back over broadcast batch axes.
        let (x, y) = (args[0], args[1]);
        let yt = transpose_last(b, y)?;
        let gx = b.emit(Prim::Matmul, &[ct, yt])?;
        let (sx, sy) = (b.dims(x), b.dims(y));
        let gy = if sy.len() == 2 && sx.len() > 2 {
            // a shared matrix (a linear weight) under a batch of rows: one
            // product over all of them, `.. m k -> (.. m) k`, instead of a
            // product per leading index summed after (which wrote
            // [B, k, n] and ran at a fraction of the GEMM's speed)
            let k = sx[sx.len() - 1];
            let n = sy[1];
            let x2 = b.reshape(x, vec![sx.iter().product::<usize>() / k.max(1), k])?;
            let ct2 = b.reshape(ct, vec![b.dims(ct).iter().product::<usize>() / n.max(1), n])?;
            let x2t = transpose_last(b, x2)?;
            b.emit(Prim::Matmul, &[x2t, ct2])?
        } else {
            let xt = transpose_last(b, x)?;
            b.emit(Prim::Matmul, &[xt, ct])?
        };
        Ok(Some(vec![Some(b.sum_to(gx, &sx)?), Some(b.sum_to(gy, &sy)?)]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        // bilinear: ta @ b + a @ tb
        multilinear_jvp(b, &Prim::Matmul, args, tans, &[0, 1]).map(Some)
    }
}

/// Products with equal batch axes (or none) through `kernels::bmm`. `None`
/// when the kernel does not take them.
fn batched(a: &Tensor, b: &Tensor, c: Kx) -> Result<Option<Tensor>> {
    let (ad, bd) = (a.dims(), b.dims());
    let r = ad.len();
    // Checked before any reshaping, which may copy: off the CPU, or for
    // other dtypes, the operands go to candle untouched.
    if r < 2 || bd.len() != r || ad[..r - 2] != bd[..r - 2] || !bmm::eligible(a, b, c.1) {
        return Ok(None);
    }
    if r == 2 {
        let y = batched(&a.unsqueeze(0).op("matmul")?, &b.unsqueeze(0).op("matmul")?, c)?;
        return y.map(|y| y.squeeze(0).op("matmul")).transpose();
    }
    let (a3, b3) = (as_rank3(a, c).op("matmul")?, as_rank3(b, c).op("matmul")?);
    if !bmm::takes_kernel(&a3, &b3, c.1) {
        return Ok(None);
    }
    let y = bmm::bmm(&a3, &b3, c.0, c.1).op("matmul")?;
    let shape = [&ad[..r - 2], &[ad[r - 2], bd[r - 1]]].concat();
    Ok(Some(y.reshape(shape).op("matmul")?))
}

/// `.. m n -> (..) m n`: unit batch axes are dropped as views; other
/// batch axes merge in place when contiguous, or after a copy.
fn as_rank3(t: &Tensor, c: Kx) -> candle_core::Result<Tensor> {
    let mut t = t.clone();
    while t.rank() > 3 {
        match t.dims()[..t.rank() - 2].iter().position(|&d| d == 1) {
            Some(axis) => t = t.squeeze(axis)?,
            None => break,
        }
    }
    if t.rank() == 3 {
        return Ok(t);
    }
    let d = t.dims().to_vec();
    let r = d.len();
    let batch: usize = d[..r - 2].iter().product();
    c.0.note(&t);
    crate::kernels::transpose::contiguous(&t, c.1)?.reshape((batch, d[r - 2], d[r - 1]))
}

/// Swaps the last two axes (`.. m n -> .. n m`).
fn transpose_last(b: &mut Builder, v: VarId) -> Result<VarId> {
    let r = b.ty(v).rank();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    b.permute(v, perm)
}

/// candle's matmul. When candle refuses a layout (it is strict about the
/// strides of size-1 axes, even on contiguous tensors), both operands are
/// copied to contiguous memory with the batch axes merged (`.. m k -> (..) m k`).
///
/// An inner dimension of 1 (a per-sample linear weight gradient) goes to
/// the outer-product kernel instead.
/// The bytes [`mm_bf16`] allocates besides its result for `a @ b -> out`:
/// the operands and the product in f32, or for a blocked product the
/// left operand (or a block of it), one block of the right, and the f32
/// product of a block (or the running sum and one partial product).
fn bf16_widened(a: &TensorType, b: &TensorType, out: &TensorType) -> usize {
    let elems = |t: &TensorType| t.shape.iter().product::<usize>();
    let (ea, eo) = (elems(a), elems(out));
    let blocked = match b.shape[..] {
        [k, n] if k.saturating_mul(n).saturating_mul(4) > WIDE_BLOCK => Some((k, n)),
        _ => None,
    };
    let Some((k, n)) = blocked else {
        return ea.saturating_add(elems(b)).saturating_add(eo).saturating_mul(4);
    };
    let m = ea / k.max(1);
    if n >= k {
        let step = (WIDE_BLOCK / (4 * k)).max(1).min(n);
        // a in f32, a block of b in f32, its product in f32 and in bf16
        let f32s = ea + k * step + m * step;
        return f32s.saturating_mul(4).saturating_add(m * step * 2);
    }
    let step = (WIDE_BLOCK / (4 * n)).max(1).min(k);
    // a block of a copied (bf16) and widened, a block of b widened, the
    // running sum, the partial product and their sum
    let f32s = m * step + step * n + 3 * m * n;
    f32s.saturating_mul(4).saturating_add(m * step * 2)
}

/// The most bytes of a bf16 product's weight widened to f32 at once: a
/// larger one (Qwen2-0.5B's tied output head, 545 MB in f32) is
/// multiplied a block of rows or columns at a time.
const WIDE_BLOCK: usize = 64 << 20;

/// A bf16 product on the CPU: both operands widened across the threads to
/// f32 (`kernels::widen`, where candle widens on one thread and copies a
/// transposed weight into row order), the crate's f32 product, the result
/// narrowed across the threads. A `[k, n]` right operand over
/// [`WIDE_BLOCK`] in f32 is taken in blocks along its larger side: columns
/// (each block of the output written in place) or rows (the partial
/// products summed in f32). `None` for other dtypes and paths.
fn mm_bf16(a: &Tensor, b: &Tensor, c: Kx) -> Result<Option<Tensor>> {
    let half = |t: &Tensor| t.dtype() == DType::BF16 && t.device().is_cpu();
    if !(half(a) && half(b)) || c.1 != crate::kernels::Path::Fast {
        return Ok(None);
    }
    let wide = |t: &Tensor| -> Result<Tensor> {
        widen::widen_any(t, c.1)?.ok_or_else(|| Error::internal("matmul", "a bf16 operand did not widen"))
    };
    let (k, n) = match b.dims() {
        [k, n] if a.rank() == 2 && k.saturating_mul(*n).saturating_mul(4) > WIDE_BLOCK => (*k, *n),
        _ => return widen::in_f32(&[a, b], c.1, |w| mm(&w[0], &w[1], c)),
    };
    let m = a.dims()[0];
    if n >= k {
        // column blocks: out[:, j..] = a @ b[:, j..], written in place
        let a32 = wide(a)?;
        let step = (WIDE_BLOCK / (4 * k)).max(1);
        let out = Tensor::zeros((m, n), DType::BF16, a.device()).op("matmul")?;
        for j in (0..n).step_by(step) {
            let len = step.min(n - j);
            let bj = wide(&b.narrow(1, j, len).op("matmul")?)?;
            let yj = widen::narrow_any(&mm(&a32, &bj, c)?, c.1).op("matmul")?;
            out.slice_set(&yj, 1, j).op("matmul")?;
        }
        return Ok(Some(out));
    }
    // row blocks of b (column blocks of a): Σ_i a[:, i..] @ b[i.., :] in f32
    let step = (WIDE_BLOCK / (4 * n)).max(1);
    let mut acc: Option<Tensor> = None;
    for i in (0..k).step_by(step) {
        let len = step.min(k - i);
        let ai = wide(&a.narrow(1, i, len).op("matmul")?)?;
        let bi = wide(&b.narrow(0, i, len).op("matmul")?)?;
        let part = mm(&ai, &bi, c)?;
        acc = Some(match acc {
            None => part,
            Some(s) => (s + part).op("matmul")?,
        });
    }
    match acc {
        Some(y) => Ok(Some(widen::narrow_any(&y, c.1).op("matmul")?)),
        None => Ok(None),
    }
}

fn mm(a: &Tensor, b: &Tensor, c: Kx) -> Result<Tensor> {
    if let Some(y) = mm_bf16(a, b, c)? {
        return Ok(y);
    }
    let k = a.dims()[a.rank() - 1];
    if k == 1 && a.rank() == b.rank() && a.dims()[..a.rank() - 2] == b.dims()[..b.rank() - 2] {
        return outer(a, b, c.1).op("matmul");
    }
    if let Some(t) = batched(a, b, c)? {
        return Ok(t);
    }
    if let Ok(t) = a.matmul(b) {
        return Ok(t);
    }
    let (ad, bd) = (a.dims(), b.dims());
    let r = ad.len();
    let batch: usize = ad[..r - 2].iter().product();
    let a3 = a
        .relayout(c.0)
        .op("matmul")?
        .reshape((batch, ad[r - 2], ad[r - 1]))
        .op("matmul")?;
    let b3 = b
        .relayout(c.0)
        .op("matmul")?
        .reshape((batch, bd[r - 2], bd[r - 1]))
        .op("matmul")?;
    let y = a3.matmul(&b3).op("matmul")?;
    y.reshape([&ad[..r - 2], &[ad[r - 2], bd[r - 1]]].concat()).op("matmul")
}
