//! Attention, `softmax(mask(q k^T * scale)) v`, and its gradient without
//! the `T x T` probabilities ever held whole: each thread takes one head
//! at a time and works through its queries in blocks of [`BQ`] rows, so
//! what it holds besides the operands is a block's scores (`BQ x T`) and,
//! in the backward, their gradient. The backward recomputes a block's
//! probabilities from its scores (the rows are whole, so each row's
//! maximum and sum come from the block itself: no statistics are saved
//! between the passes).
//!
//! Masking is Hugging Face's eager attention's: a hidden score (a key
//! after the query, with `causal`; a key whose `keep` is 0) is replaced by
//! the dtype's lowest finite value, so a query whose keys are all hidden
//! averages them, and a hidden score gets no gradient. A causal block
//! reads only the keys up to its last query (the others' probabilities are
//! exactly 0), except where its first query sees no key at all (left
//! padding), whose row then averages over all `T` keys as the whole
//! computation does. So, as in PyTorch's fused attention, a NaN or
//! infinity in a key or value after a block's last query does not reach
//! that block (the written-out product would carry `0 * NaN` into it).
//!
//! The layout is `[N, H, T, D]` for `q`, `k`, `v` and the result, `[N, T]`
//! for `keep` (nonzero: a real token); the gradient is packed `[N, H, T,
//! 3D]` (`dq | dk | dv` along the last axis), from `q`, `k`, `v` and the
//! output's cotangent alone (each row's `sum_j p_ij dp_ij` stands for
//! `sum_c dout_ic o_ic`, so the output need not be kept for it). f32 and f64 on the CPU take
//! the kernel; every other device and dtype (f16 and bf16 computed in f32)
//! candle's operations, which hold the scores whole.

use super::{product, run_jobs, zeroed, Mat, Path};
use candle_core::{bail, DType, Result, Storage, Tensor};
pub(crate) use rows::Real;
use rows::{dot, row_max};

/// `dst (+)= lhs rhs` on the calling thread (each head is a job of its
/// own already): [`product`] at these strides and sizes.
fn mul_into<T: Real>(
    dst: &mut [T],
    ds: (usize, usize),
    lhs: Mat<T>,
    rhs: Mat<T>,
    mnk: (usize, usize, usize),
    add: bool,
) {
    product(dst, ds, lhs, rhs, mnk, add, T::ONE, gemm::Parallelism::None);
}

/// Query rows per block.
const BQ: usize = 64;

/// Below this many multiply-adds (`N H T^2 D`) one thread does it all.
const MIN_PARALLEL_WORK: usize = 1 << 21;

/// The shape of one call: heads (`N H`), positions, head size, and how
/// the scores are scaled and masked.
#[derive(Clone, Copy)]
struct Geometry<'a> {
    heads: usize,
    per_n: usize,
    t: usize,
    d: usize,
    causal: bool,
    scale: f64,
    keep: Option<&'a [bool]>,
    /// Each sequence's first real key (`T` where it has none).
    first: &'a [usize],
}

impl<'a> Geometry<'a> {
    /// `n` sequences of `h` heads, `t` positions of `d` features.
    fn new(
        (n, h, t, d): (usize, usize, usize, usize),
        causal: bool,
        scale: f64,
        keep: Option<&'a [bool]>,
        first: &'a [usize],
    ) -> Self {
        Geometry {
            heads: n * h,
            per_n: h,
            t,
            d,
            causal,
            scale,
            keep,
            first,
        }
    }

    /// Which of the first `kend` keys of `head` query `i` may see: those
    /// before the returned count (all of them, or up to `i` with
    /// `causal`), and of those the ones whose flag in the returned slice
    /// is set (every one without `keep`). Whole rows at a time, so the
    /// loops that mask a row vectorise.
    #[inline(always)]
    fn visible(&self, head: usize, i: usize, kend: usize) -> (usize, Option<&'a [bool]>) {
        let lim = match self.causal {
            true => (i + 1).min(kend),
            false => kend,
        };
        let seq = (head / self.per_n) * self.t;
        (lim, self.keep.map(|k| &k[seq..seq + lim]))
    }

    /// The keys the block of queries `r0..r1` of `head` reads: a causal
    /// block those up to its last query (past them every probability is
    /// 0), unless its first query sees no key at all (left padding): such
    /// a row averages every key, as the whole computation does.
    fn keys(&self, head: usize, r0: usize, r1: usize) -> usize {
        match self.causal && self.first[head / self.per_n] <= r0 {
            true => r1,
            false => self.t,
        }
    }

    /// `s [rows, kend] = scale * q[r0..r0 + rows] k[..kend]^T` with hidden
    /// scores replaced by the lowest value.
    fn scores<T: Real>(&self, head: usize, q: &[T], k: &[T], (r0, rows, kend): (usize, usize, usize), s: &mut [T]) {
        let d = self.d;
        let lhs = Mat {
            data: &q[r0 * d..],
            rs: d,
            cs: 1,
        };
        let rhs = Mat { data: k, rs: 1, cs: d };
        mul_into(s, (kend, 1), lhs, rhs, (rows, kend, d), false);
        let scale = T::of(self.scale);
        for (i, row) in s.chunks_exact_mut(kend).enumerate() {
            let (lim, keep) = self.visible(head, r0 + i, kend);
            let (seen, unseen) = row.split_at_mut(lim);
            unseen.fill(T::LOWEST);
            match keep {
                None => seen.iter_mut().for_each(|x| *x = *x * scale),
                Some(k) => seen
                    .iter_mut()
                    .zip(k)
                    .for_each(|(x, &keep)| *x = if keep { *x * scale } else { T::LOWEST }),
            }
        }
    }

    /// The scores of a block, its probabilities in their place, and the
    /// number of keys they span.
    fn probabilities<T: Real>(&self, head: usize, q: &[T], k: &[T], r0: usize, rows: usize, s: &mut [T]) -> usize {
        let kend = self.keys(head, r0, r0 + rows);
        self.scores(head, q, k, (r0, rows, kend), &mut s[..rows * kend]);
        for row in s[..rows * kend].chunks_exact_mut(kend) {
            let m = row_max(row);
            let r = T::ONE / T::exp_shifted(row, m);
            for x in row.iter_mut() {
                *x = *x * r;
            }
        }
        kend
    }

    /// One head's output `[T, D]` into `out`.
    fn forward_head<T: Real>(&self, head: usize, q: &[T], k: &[T], v: &[T], out: &mut [T], s: &mut [T]) {
        let (t, d) = (self.t, self.d);
        for r0 in (0..t).step_by(BQ) {
            let rows = BQ.min(t - r0);
            let kend = self.probabilities(head, q, k, r0, rows, s);
            let p = Mat {
                data: &s[..rows * kend],
                rs: kend,
                cs: 1,
            };
            let vm = Mat { data: v, rs: d, cs: 1 };
            let dst = &mut out[r0 * d..(r0 + rows) * d];
            mul_into(dst, (d, 1), p, vm, (rows, d, kend), false);
        }
    }

    /// One head's gradient `[T, 3D]` (`dq | dk | dv`, zeros on entry)
    /// from the output's cotangent `dout`.
    fn backward_head<T: Real>(
        &self,
        head: usize,
        [q, k, v, dout]: [&[T]; 4],
        dst: &mut [T],
        s: &mut [T],
        dp: &mut [T],
    ) {
        let (t, d) = (self.t, self.d);
        let scale = T::of(self.scale);
        for r0 in (0..t).step_by(BQ) {
            let rows = BQ.min(t - r0);
            let kend = self.probabilities(head, q, k, r0, rows, s);
            let p = &s[..rows * kend];
            let do_b = Mat {
                data: &dout[r0 * d..],
                rs: d,
                cs: 1,
            };
            // dv[..kend] += p^T dout_b
            let pt = Mat {
                data: p,
                rs: 1,
                cs: kend,
            };
            mul_into(&mut dst[2 * d..], (3 * d, 1), pt, do_b, (kend, d, rows), true);
            // dp = dout_b v[..kend]^T
            let vt = Mat { data: v, rs: 1, cs: d };
            let dpb = &mut dp[..rows * kend];
            mul_into(dpb, (kend, 1), do_b, vt, (rows, kend, d), false);
            // ds = p (dp - D) * scale with D_i = sum_j p_ij dp_ij (which is
            // sum_c dout_ic o_ic: the output is not needed), none where
            // the score was hidden
            for (i, (drow, prow)) in dpb.chunks_exact_mut(kend).zip(p.chunks_exact(kend)).enumerate() {
                let dot = dot(drow, prow);
                let (lim, keep) = self.visible(head, r0 + i, kend);
                let (seen, unseen) = drow.split_at_mut(lim);
                unseen.fill(T::default());
                let ds = |x: T, pj: T| pj * (x - dot) * scale;
                match keep {
                    None => seen.iter_mut().zip(prow).for_each(|(x, &pj)| *x = ds(*x, pj)),
                    Some(k) => seen.iter_mut().zip(prow).zip(k).for_each(|((x, &pj), &keep)| {
                        *x = if keep { ds(*x, pj) } else { T::default() };
                    }),
                }
            }
            let ds = Mat {
                data: &dp[..rows * kend],
                rs: kend,
                cs: 1,
            };
            // dq_b = ds k[..kend]
            let km = Mat { data: k, rs: d, cs: 1 };
            let dq = &mut dst[r0 * 3 * d..];
            mul_into(dq, (3 * d, 1), ds, km, (rows, d, kend), false);
            // dk[..kend] += ds^T q_b
            let dst_t = Mat {
                data: &dp[..rows * kend],
                rs: 1,
                cs: kend,
            };
            let qb = Mat {
                data: &q[r0 * d..],
                rs: d,
                cs: 1,
            };
            mul_into(&mut dst[d..], (3 * d, 1), dst_t, qb, (kend, d, rows), true);
        }
    }

    /// `f(head, chunk)` for each head's `per`-element chunk of `dst`, the
    /// heads spread over threads where the work pays for them.
    fn each_head<T: Real>(&self, dst: &mut [T], per: usize, f: impl Fn(usize, &mut [T]) + Sync) {
        if per == 0 {
            return;
        }
        let work = self.heads.saturating_mul(self.t * self.t).saturating_mul(self.d);
        let threads = super::max_threads().min(self.heads).max(1);
        if threads == 1 || work < MIN_PARALLEL_WORK {
            dst.chunks_exact_mut(per).enumerate().for_each(|(h, c)| f(h, c));
            return;
        }
        let group = self.heads.div_ceil(threads);
        let jobs: Vec<(usize, &mut [T])> = dst.chunks_mut(group * per).enumerate().collect();
        run_jobs(jobs, |(g, chunk)| {
            for (i, c) in chunk.chunks_exact_mut(per).enumerate() {
                f(g * group + i, c)
            }
        });
    }
}

/// A CPU tensor's values as a slice (contiguous).
fn values<'a, T: candle_core::WithDType>(s: &'a Storage, t: &Tensor) -> Result<&'a [T]> {
    let Storage::Cpu(c) = s else {
        bail!("attention: not a CPU tensor")
    };
    super::contiguous_slice("attention", c.as_slice::<T>()?, t.layout())
}

/// `keep [N, T]` as flags (nonzero, in its own dtype: a real token), and
/// each sequence's first real key (`T` where none is; every sequence's is
/// 0 without a mask).
fn flags(keep: Option<&Tensor>, n: usize, t: usize) -> Result<(Option<Vec<bool>>, Vec<usize>)> {
    let Some(k) = keep else {
        return Ok((None, vec![0; n]));
    };
    let v: Vec<bool> = k
        .ne(0.0)?
        .flatten_all()?
        .to_vec1::<u8>()?
        .into_iter()
        .map(|x| x != 0)
        .collect();
    let first = (0..n)
        .map(|i| v[i * t..(i + 1) * t].iter().position(|&x| x).unwrap_or(t))
        .collect();
    Ok((Some(v), first))
}

/// The lowest finite value of `dtype`: what a hidden score becomes
/// (Hugging Face's `torch.finfo(dtype).min`).
pub(crate) fn lowest(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::MIN,
        DType::F16 => -65504.0,
        DType::BF16 => -3.3895313892515355e38,
        _ => f32::MIN as f64,
    }
}

/// Whether the kernel takes these operands.
fn fast(q: &Tensor, path: Path) -> bool {
    super::has_cpu_kernel(q, path)
}

/// `[N, H, T, D]` of `q`, checked against `k`, `v` and `keep`.
fn dims(q: &Tensor, k: &Tensor, v: &Tensor, keep: Option<&Tensor>) -> Result<(usize, usize, usize, usize)> {
    let (n, h, t, d) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() || keep.is_some_and(|m| m.dims() != [n, t]) {
        bail!(
            "attention: q {:?}, k {:?}, v {:?} and keep {:?} do not fit [N, H, T, D] and [N, T]",
            q.dims(),
            k.dims(),
            v.dims(),
            keep.map(|m| m.dims())
        )
    }
    Ok((n, h, t, d))
}

/// `softmax(mask(q k^T * scale)) v`, `[N, H, T, D]` (see the module docs).
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keep: Option<&Tensor>,
    causal: bool,
    scale: f64,
    path: Path,
) -> Result<Tensor> {
    let (n, h, t, d) = dims(q, k, v, keep)?;
    // bf16 on the f32 kernel (the generic path would hold the scores)
    if let Some(y) = super::widen::in_f32(&[q, k, v], path, |w| {
        forward(&w[0], &w[1], &w[2], keep, causal, scale, path)
    })? {
        return Ok(y);
    }
    if !fast(q, path) {
        return generic::forward(q, k, v, keep, causal, scale);
    }
    let ts: Vec<Tensor> = [q, k, v].iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let (flags, first) = flags(keep, n, t)?;
    let g = Geometry::new((n, h, t, d), causal, scale, flags.as_deref(), &first);
    match q.dtype() {
        DType::F32 => forward_as::<f32>(&g, &ts),
        _ => forward_as::<f64>(&g, &ts),
    }
}

/// `f` on the host slices of contiguous `ts` (their storage read-locked
/// meanwhile).
fn with_values<T: Real + candle_core::WithDType, R>(ts: &[Tensor], f: impl FnOnce(&[&[T]]) -> Result<R>) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout().0).collect();
    let vals: Vec<&[T]> = guards
        .iter()
        .zip(ts)
        .map(|(s, t)| values::<T>(s, t))
        .collect::<Result<_>>()?;
    f(&vals)
}

fn forward_as<T: Real + candle_core::WithDType>(g: &Geometry, ts: &[Tensor]) -> Result<Tensor> {
    let per = g.t * g.d;
    let out = with_values::<T, _>(ts, |vals| {
        let mut out = super::output::<T>(g.heads * per)?;
        g.each_head(&mut out, per, |head, o| {
            let at = head * per..(head + 1) * per;
            let mut s = vec![T::default(); BQ.min(g.t) * g.t];
            g.forward_head(
                head,
                &vals[0][at.clone()],
                &vals[1][at.clone()],
                &vals[2][at],
                o,
                &mut s,
            );
        });
        Ok(out)
    })?;
    Tensor::from_vec(out, ts[0].dims(), ts[0].device())
}

/// The gradient of [`forward`]'s result with cotangent `dout`: `dq | dk |
/// dv` packed along the last axis, `[N, H, T, 3D]`.
pub(crate) fn backward(
    [q, k, v, dout]: [&Tensor; 4],
    keep: Option<&Tensor>,
    causal: bool,
    scale: f64,
    path: Path,
) -> Result<Tensor> {
    let (n, h, t, d) = dims(q, k, v, keep)?;
    if dout.dims() != q.dims() {
        bail!("attention backward: the cotangent {:?} is not q's shape", dout.dims())
    }
    if let Some(g) = super::widen::in_f32(&[q, k, v, dout], path, |w| {
        backward([&w[0], &w[1], &w[2], &w[3]], keep, causal, scale, path)
    })? {
        return Ok(g);
    }
    if !fast(q, path) {
        return generic::backward([q, k, v, dout], keep, causal, scale);
    }
    let ts: Vec<Tensor> = [q, k, v, dout].iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let (flags, first) = flags(keep, n, t)?;
    let g = Geometry::new((n, h, t, d), causal, scale, flags.as_deref(), &first);
    match q.dtype() {
        DType::F32 => backward_as::<f32>(&g, &ts),
        _ => backward_as::<f64>(&g, &ts),
    }
}

fn backward_as<T: Real + candle_core::WithDType>(g: &Geometry, ts: &[Tensor]) -> Result<Tensor> {
    let (per, per3) = (g.t * g.d, 3 * g.t * g.d);
    let dst = with_values::<T, _>(ts, |vals| {
        // dk and dv accumulate over the query blocks: zeros written out
        let mut dst = zeroed::<T>(g.heads * per3)?;
        g.each_head(&mut dst, per3, |head, out| {
            let at = head * per..(head + 1) * per;
            let head_vals = [0, 1, 2, 3].map(|i| &vals[i][at.clone()]);
            let rows = BQ.min(g.t);
            let (mut s, mut dp) = (vec![T::default(); rows * g.t], vec![T::default(); rows * g.t]);
            g.backward_head(head, head_vals, out, &mut s, &mut dp);
        });
        Ok(dst)
    })?;
    let mut shape = ts[0].dims().to_vec();
    shape[3] *= 3;
    Tensor::from_vec(dst, shape, ts[0].device())
}

/// Bytes the kernel holds besides its operands and result, at most:
/// a block's scores and their gradient per thread, for `threads` heads at
/// once. The generic path holds the scores whole: what
/// [`generic_scratch`] counts.
pub(crate) fn kernel_scratch(t: usize, elem: usize, threads: usize) -> usize {
    2usize
        .saturating_mul(BQ.min(t))
        .saturating_mul(t)
        .saturating_mul(elem)
        .saturating_mul(threads)
}

/// Bytes the generic path holds: the scores and probabilities of every
/// head (`[N, H, T, T]`, twice; three times in the backward), in f32 at
/// least.
pub(crate) fn generic_scratch(heads: usize, t: usize, elem: usize) -> usize {
    3usize
        .saturating_mul(heads)
        .saturating_mul(t)
        .saturating_mul(t)
        .saturating_mul(elem.max(4))
}

mod generic;
mod rows;
#[cfg(test)]
mod tests;
