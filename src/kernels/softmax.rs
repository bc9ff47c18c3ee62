//! Softmax over the last axis of an f32 tensor in one pass per row, with
//! the vectorised `exp` of [`fastmath`](super::fastmath). candle's
//! `softmax_last_dim` calls libm's `exp` per element: on a small
//! transformer's attention weights (`[32, 4, 64, 64]`) it took 1 ms a call,
//! a tenth of the model's per-sample gradients, where PyTorch's took 0.3.
//! Log-softmax likewise (a cross-entropy over a 151,936-word vocabulary,
//! `[508, 151936]`: 0.6 s a step through candle's operations, one thread
//! and libm per element), computed as candle's is, `(x - m) - ln sum
//! e^(x - m)`, so infinities and NaN come out the same. A bf16 or f16
//! tensor is computed in f32 a block of rows at a time and rounded once:
//! the numbers of widening the whole tensor first, without its f32 copies
//! (two of 311 MB for that vocabulary's logits).

use super::fastmath::{exp, widest, Fused, Madd, Plain};
use super::{contiguous_slice, in_blocks, output};
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Lanes of the partial maxima and sums: as wide as AVX-512's vectors, so
/// each lane's running value stays in one register.
const LANES: usize = 16;

/// The largest of `x`, skipping NaN (which reaches the result through its
/// own `exp`, and so every element through the sum, as in PyTorch).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    let tail = chunks.remainder().iter();
    tail.chain(&m)
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a })
}

/// `sum x` in `LANES` partial sums (a single running sum does not
/// vectorise: float addition is not associative).
#[inline(always)]
fn row_sum(x: &[f32]) -> f32 {
    let mut s = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            s[j] += c[j];
        }
    }
    chunks.remainder().iter().chain(&s).sum()
}

/// `d = softmax(x)` for each row of `n` elements.
#[inline(always)]
fn rows<A: Madd>(d: &mut [f32], x: &[f32], n: usize) {
    for (d, x) in d.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let m = row_max(x);
        for i in 0..n {
            d[i] = exp::<A>(x[i] - m);
        }
        let r = 1.0 / row_sum(d);
        for v in d.iter_mut() {
            *v *= r;
        }
    }
}

/// `d = log_softmax(x)` for each row of `n` elements.
#[inline(always)]
fn log_rows<A: Madd>(d: &mut [f32], x: &[f32], n: usize) {
    for (d, x) in d.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let m = row_max(x);
        for i in 0..n {
            d[i] = exp::<A>(x[i] - m);
        }
        let lse = row_sum(d).ln();
        for i in 0..n {
            d[i] = (x[i] - m) - lse;
        }
    }
}

fn fill(d: &mut [f32], x: &[f32], n: usize, log: bool) {
    match log {
        false => widest!(rows(d: &mut [f32], x: &[f32], n: usize)),
        true => widest!(log_rows(d: &mut [f32], x: &[f32], n: usize)),
    }
}

struct SoftmaxLast {
    log: bool,
}

impl CustomOp1 for SoftmaxLast {
    fn name(&self) -> &'static str {
        match self.log {
            false => "softmax_last_dim",
            true => "log_softmax_last_dim",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = match s {
            CpuStorage::F32(v) => v,
            CpuStorage::BF16(v) => return Ok((CpuStorage::BF16(self.half(v, l)?), l.shape().clone())),
            CpuStorage::F16(v) => return Ok((CpuStorage::F16(self.half(v, l)?), l.shape().clone())),
            _ => bail!("{}: no fast kernel for this dtype", self.name()),
        };
        let x = contiguous_slice(self.name(), v, l)?;
        let n = l.dims().last().copied().unwrap_or(1);
        let mut dst = output::<f32>(x.len())?;
        // rows in blocks of about 4096 elements; threads pay for a pass that
        // costs about as much as `exp` (20 flops an element)
        let per = (4096 / n.max(1)).max(1) * n;
        in_blocks(&mut dst, per, 8, |start, d| fill(d, &x[start..], n, self.log));
        Ok((CpuStorage::F32(dst), l.shape().clone()))
    }
}

impl SoftmaxLast {
    /// A half-precision tensor's rows in f32, a block at a time.
    fn half<H: Half>(&self, v: &[H], l: &Layout) -> Result<Vec<H>> {
        let x = contiguous_slice(self.name(), v, l)?;
        let n = l.dims().last().copied().unwrap_or(1);
        let mut dst = vec![H::from_f32(0.0); x.len()];
        let per = (4096 / n.max(1)).max(1) * n;
        in_blocks(&mut dst, per, 8, |start, d| {
            let wide: Vec<f32> = x[start..start + d.len()].iter().map(|h| h.to_f32()).collect();
            let mut out = vec![0f32; d.len()];
            fill(&mut out, &wide, n, self.log);
            d.iter_mut().zip(&out).for_each(|(d, &y)| *d = H::from_f32(y));
        });
        Ok(dst)
    }
}

/// A half-precision element: exact in f32, rounded back to nearest even.
trait Half: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Half for half::bf16 {
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl Half for half::f16 {
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// Softmax over the last axis for a non-empty CPU f32, bf16 or f16
/// tensor (half precision computed in f32, rounded once); `None`
/// otherwise (the caller uses candle's).
pub fn softmax_last_dim(x: &Tensor, path: super::Path) -> Result<Option<Tensor>> {
    last_dim(x, path, false)
}

/// Log-softmax over the last axis, as [`softmax_last_dim`] takes it.
pub fn log_softmax_last_dim(x: &Tensor, path: super::Path) -> Result<Option<Tensor>> {
    last_dim(x, path, true)
}

fn last_dim(x: &Tensor, path: super::Path, log: bool) -> Result<Option<Tensor>> {
    if path != super::Path::Fast
        || !x.device().is_cpu()
        || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        || x.elem_count() == 0
        || x.rank() == 0
    {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&SoftmaxLast { log })?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Rows with a NaN, all -inf, a +inf, and a -inf beside finite values.
    fn special_rows() -> Result<Tensor> {
        let inf = f32::INFINITY;
        let rows = [
            [1.0, f32::NAN, 2.0],
            [-inf, -inf, -inf],
            [0.0, inf, 1.0],
            [-inf, 0.0, 0.0],
        ];
        Tensor::new(&rows, &Device::Cpu)
    }

    /// Against candle's kernel on rows of several lengths (shorter than,
    /// equal to and longer than the lanes, with remainders), on both code
    /// paths; and PyTorch's handling of NaN and infinities.
    #[test]
    fn matches_candle_and_propagates_nan() -> Result<()> {
        for n in [1, 7, 16, 64, 100] {
            let x = (Tensor::randn(0f32, 4., (3 * 4096 / n + 5, n), &Device::Cpu)? * 1.0)?;
            let want = candle_nn::ops::softmax_last_dim(&x)?;
            let got = softmax_last_dim(&x, crate::kernels::Path::Fast)?.expect("f32 on the CPU");
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "n = {n}: {diff}");
            let v = x.flatten_all()?.to_vec1::<f32>()?;
            let mut plain = vec![0.0; v.len()];
            rows::<Plain>(&mut plain, &v, n);
            let want = want.flatten_all()?.to_vec1::<f32>()?;
            let worst = plain.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst < 1e-6, "n = {n}, plain: {worst}");
        }
        let x = special_rows()?;
        let y = softmax_last_dim(&x, crate::kernels::Path::Fast)?
            .expect("f32")
            .to_vec2::<f32>()?;
        assert!(y[0].iter().chain(&y[1]).chain(&y[2]).all(|v| v.is_nan()), "{y:?}");
        assert_eq!(y[3], [0.0, 0.5, 0.5]);
        assert!(softmax_last_dim(&x.to_dtype(DType::F64)?, crate::kernels::Path::Fast)?.is_none());
        Ok(())
    }

    /// Log-softmax against candle's on rows of several lengths (a
    /// vocabulary-sized one included) on both code paths, and the same
    /// NaN and infinities as candle's formula gives.
    #[test]
    fn log_softmax_matches_candle() -> Result<()> {
        for n in [1, 7, 16, 100, 151_936] {
            let rows = (3 * 4096 / n).max(2) + 1;
            let x = Tensor::randn(0f32, 4., (rows, n), &Device::Cpu)?;
            let want = candle_nn::ops::log_softmax(&x, 1)?;
            let got = log_softmax_last_dim(&x, crate::kernels::Path::Fast)?.expect("f32 on the CPU");
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 2e-5, "n = {n}: {diff}");
            let v = x.flatten_all()?.to_vec1::<f32>()?;
            let mut plain = vec![0.0; v.len()];
            log_rows::<Plain>(&mut plain, &v, n);
            let want = want.flatten_all()?.to_vec1::<f32>()?;
            let worst = plain.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst < 2e-5, "n = {n}, plain: {worst}");
        }
        let (x, inf) = (special_rows()?, f32::INFINITY);
        let y = log_softmax_last_dim(&x, crate::kernels::Path::Fast)?
            .expect("f32")
            .to_vec2::<f32>()?;
        let want = candle_nn::ops::log_softmax(&x, 1)?.to_vec2::<f32>()?;
        for (a, b) in y.iter().flatten().zip(want.iter().flatten()) {
            assert!(
                a == b || (a - b).abs() < 1e-6 || (a.is_nan() && b.is_nan()),
                "{y:?} vs {want:?}"
            );
        }
        assert!(y[0].iter().all(|v| v.is_nan()), "{y:?}");
        assert_eq!(y[3][0], -inf);
        Ok(())
    }

    /// bf16 and f16 rows computed in f32 a block at a time equal widening
    /// the whole tensor, running the f32 kernel and rounding once, bit for
    /// bit, NaN included.
    #[test]
    fn half_rows_equal_the_widened_run() -> Result<()> {
        for dt in [DType::BF16, DType::F16] {
            for n in [3, 4100] {
                let mut x = Tensor::randn(0f32, 4., (5, n), &Device::Cpu)?.to_dtype(dt)?;
                if n == 3 {
                    // NaN, infinities
                    x = Tensor::cat(&[&x, &special_rows()?.to_dtype(dt)?], 0)?;
                }
                for log in [false, true] {
                    let got = last_dim(&x, crate::kernels::Path::Fast, log)?.expect("a half CPU tensor");
                    let wide = last_dim(&x.to_dtype(DType::F32)?, crate::kernels::Path::Fast, log)?.expect("f32");
                    let want = wide.to_dtype(dt)?;
                    let bits = |t: &Tensor| -> Result<Vec<u32>> {
                        Ok(t.to_dtype(DType::F32)?
                            .flatten_all()?
                            .to_vec1::<f32>()?
                            .iter()
                            .map(|v| v.to_bits())
                            .collect())
                    };
                    let same = bits(&got)?
                        .iter()
                        .zip(bits(&want)?)
                        .all(|(a, b)| *a == b || (f32::from_bits(*a).is_nan() && f32::from_bits(b).is_nan()));
                    assert!(same, "{dt:?} n = {n} log = {log}");
                }
            }
        }
        Ok(())
    }
}
