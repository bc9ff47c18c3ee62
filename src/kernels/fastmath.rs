//! `exp`, `tanh` and `erf` of f32 tensors in one threaded pass each, with
//! formulas the compiler vectorises (no libm call, no branch: every case
//! is computed and selected). candle maps them through libm one element at
//! a time: `erf` of `[32, 64, 256]` (GELU in a small transformer) took
//! 2.4 ms, a fifth of the model's per-sample gradients, and `tanh` of
//! `[64, 128]` 60 µs, 7 ns an element. Accuracy is within a few units in
//! the last place of f32 (the tests measure it against f64); NaN stays NaN.

use super::compare::by_blocks;
use super::contiguous_slice;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Which function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Math {
    /// `e^x`
    Exp,
    /// hyperbolic tangent
    Tanh,
    /// the error function
    Erf,
}

/// `x` rounded to the nearest integer, for `|x| < 2^22`: adding and
/// subtracting `1.5 * 2^23` leaves no fraction bits (vectorises, where
/// `f32::round` is a libm call on baseline x86-64).
#[inline(always)]
fn round(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// `e^x` on `[-87.3, 88.7]`: `2^n e^r` with `|r| <= ln 2 / 2`, `e^r` by
/// Cephes' `expf` polynomial, `2^n` built in the exponent bits.
#[inline(always)]
fn exp_core(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_55, 88.722_83);
    let n = round(x * LOG2E);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let e = p * r * r + r + 1.0;
    // n is in [-126, 128]: a normal power of two, or 2^128 = inf
    // 2^23 + 127 + n holds n + 127 in its low mantissa bits: shifted into
    // the exponent field it is 2^n (integer operations only, which
    // vectorise where a float-to-int cast does not)
    let biased = (n + 8_388_735.0).to_bits().wrapping_sub(0x4B00_0000);
    let scale = f32::from_bits(biased << 23);
    e * scale
}

/// `e^x` for every `x`: below `-87.3` through `2^-64 e^(x + 64 ln 2)`, so
/// results reach the subnormals and then 0; above `88.7` infinity.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const SHIFT: f32 = 44.361_42; // 64 ln 2
    const TINY: f32 = 5.421_011e-20; // 2^-64
    let low = x < -87.0;
    let y = exp_core(if low { x + SHIFT } else { x });
    let y = if low { y * TINY } else { y };
    let y = if x > 88.722_83 { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `tanh x`: Cephes' odd polynomial below `|x| = 0.625`, else `1 - 2 /
/// (e^{2|x|} + 1)` with the sign (1 for large `|x|`, where `e^{2|x|}` is
/// infinite).
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = -5.704_988_7e-3_f32;
    p = p * z + 2.063_908_9e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 1.333_144_2e-1;
    p = p * z - 3.333_328_2e-1;
    let small = x * (1.0 + p * z); // keeps the sign of a zero
    let big = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    let y = if a < 0.625 { small } else { big };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `erf x`: Cephes' `erff` polynomial for `|x| <= 1`; above, `1 - erfc`
/// with the Chebyshev fit of Numerical Recipes' `erfcc` (fractional error
/// under 1.2e-7, so at most 2e-8 in `erf` there), with the sign.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = 7.853_861_4e-5_f32;
    p = p * z - 8.010_193_6e-4;
    p = p * z + 5.188_327_7e-3;
    p = p * z - 2.685_381_2e-2;
    p = p * z + 1.128_358_5e-1;
    p = p * z - 3.761_262_6e-1;
    p = p * z + 1.128_379_2;
    let small = x * p;
    let t = 1.0 / (1.0 + 0.5 * a);
    let mut q = 0.170_872_77_f32;
    q = q * t - 0.822_152_23;
    q = q * t + 1.488_515_9;
    q = q * t - 1.135_203_98;
    q = q * t + 0.278_868_07;
    q = q * t - 0.186_288_06;
    q = q * t + 0.096_784_18;
    q = q * t + 0.374_091_96;
    q = q * t + 1.000_023_7;
    let erfc = t * exp(-z - 1.265_512_2 + t * q);
    let big = (1.0 - erfc).copysign(x);
    let y = if a <= 1.0 { small } else { big };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `m` of every element, threaded by blocks.
fn map(x: &[f32], m: Math) -> Result<Vec<f32>> {
    let mut dst = super::output::<f32>(x.len())?;
    // about 20 flops an element: threads pay from an eighth of the
    // memory-bound threshold
    by_blocks(&mut dst, 8, |start, d| fill(d, &x[start..], m));
    Ok(dst)
}

/// `d[i] = m(x[i])`: one loop per function, each calling it directly so it
/// is inlined and vectorised (through a closure or a function pointer the
/// larger `erf` stayed a call per element).
#[inline(always)]
fn fill_any(d: &mut [f32], x: &[f32], m: Math) {
    let pairs = d.iter_mut().zip(x);
    match m {
        Math::Exp => pairs.for_each(|(o, v)| *o = exp(*v)),
        Math::Tanh => pairs.for_each(|(o, v)| *o = tanh(*v)),
        Math::Erf => pairs.for_each(|(o, v)| *o = erf(*v)),
    }
}

/// [`fill_any`] compiled for AVX2 and FMA: eight lanes where the
/// baseline x86-64 target has SSE2's four (2.3 ns an element for `exp`
/// there, 0.6 here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fill_avx2(d: &mut [f32], x: &[f32], m: Math) {
    fill_any(d, x, m)
}

/// [`fill_any`] with the widest vectors this CPU has (detected at run
/// time, as candle's and gemm's kernels do).
fn fill(d: &mut [f32], x: &[f32], m: Math) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: `fill_avx2` needs AVX2 and FMA, which were just detected
        // on the CPU this runs on; it is otherwise the safe `fill_any`.
        // (`tests::tensors_match_candle` runs this path on such a CPU.)
        return unsafe { fill_avx2(d, x, m) };
    }
    fill_any(d, x, m)
}

struct MathOp(Math);

impl CustomOp1 for MathOp {
    fn name(&self) -> &'static str {
        match self.0 {
            Math::Exp => "exp",
            Math::Tanh => "tanh",
            Math::Erf => "erf",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else {
            bail!("{}: no fast kernel for this dtype", self.name())
        };
        let x = contiguous_slice(self.name(), v, l)?;
        let dst = map(x, self.0)?;
        Ok((CpuStorage::F32(dst), l.shape().clone()))
    }
}

/// `f(x)` for a CPU f32 tensor; `None` otherwise (the caller uses
/// candle's).
pub fn apply(x: &Tensor, f: Math) -> Result<Option<Tensor>> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&MathOp(f))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest error in units of f32's last place against the f64
    /// function, over a dense grid and the edges.
    fn worst_ulps(f: fn(f32) -> f32, exact: fn(f64) -> f64, lo: f32, hi: f32) -> f64 {
        let n = 200_000;
        let mut worst: f64 = 0.0;
        for i in 0..=n {
            let x = lo + (hi - lo) * i as f32 / n as f32;
            let want = exact(x as f64);
            let got = f(x) as f64;
            let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE);
            let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
            worst = worst.max((got - want).abs() / ulp);
        }
        worst
    }

    #[test]
    fn within_a_few_ulps_of_f64() {
        let e = worst_ulps(exp, f64::exp, -87.0, 88.0);
        assert!(e <= 2.0, "exp: {e} ulps");
        let t = worst_ulps(tanh, f64::tanh, -10.0, 10.0);
        assert!(t <= 3.0, "tanh: {t} ulps");
        let t0 = worst_ulps(tanh, f64::tanh, -1e-3, 1e-3);
        assert!(t0 <= 2.0, "tanh near 0: {t0} ulps");
        let r = worst_ulps(erf, candle_core::cpu::erf::erf_f64, -6.0, 6.0);
        assert!(r <= 4.0, "erf: {r} ulps");
        let r0 = worst_ulps(erf, candle_core::cpu::erf::erf_f64, -1e-3, 1e-3);
        assert!(r0 <= 3.0, "erf near 0: {r0} ulps");
    }

    #[test]
    fn edges_nan_and_infinities() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-200.0), 0.0);
        // subnormal results, as libm's (to a couple of the smallest steps)
        let s = exp(-100.0);
        let step = f32::from_bits(1) as f64;
        assert!((s as f64 - (-100f64).exp()).abs() <= 2.0 * step, "{s}");
        assert!(exp(f32::NAN).is_nan() && tanh(f32::NAN).is_nan() && erf(f32::NAN).is_nan());
        assert_eq!((tanh(50.0), tanh(-50.0)), (1.0, -1.0));
        assert_eq!((erf(10.0), erf(-10.0)), (1.0, -1.0));
        assert_eq!(erf(0.0), 0.0);
        assert!(tanh(-0.0).is_sign_negative());
    }

    #[test]
    fn tensors_match_candle() -> Result<()> {
        let x = (Tensor::randn(0f32, 3., 3 * (1 << 14) + 5, &candle_core::Device::Cpu)? * 1.0)?;
        for (m, want) in [(Math::Exp, x.exp()?), (Math::Tanh, x.tanh()?), (Math::Erf, x.erf()?)] {
            let got = apply(&x, m)?.expect("f32 on the CPU");
            let rel = ((&got - &want)?.abs()? / (want.abs()? + 1e-30)?)?.max_all()?.to_scalar::<f32>()?;
            assert!(rel < 1e-6, "{m:?}: relative error {rel}");
        }
        assert!(apply(&x.to_dtype(DType::F64)?, Math::Exp)?.is_none());
        Ok(())
    }
}
