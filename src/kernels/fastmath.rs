//! `exp`, `tanh`, `erf`, GELU and the logistic sigmoid of f32 tensors in
//! one threaded pass each, with
//! formulas the compiler vectorises (no libm call, no branch: every case
//! is computed and selected). candle maps them through libm one element at
//! a time: `erf` of `[32, 64, 256]` (GELU in a small transformer) took
//! 2.4 ms, a fifth of the model's per-sample gradients, and `tanh` of
//! `[64, 128]` 60 µs, 7 ns an element. Accuracy is within a few units in
//! the last place of f32 (the tests measure it against f64); NaN stays NaN.

use super::{by_blocks, contiguous_slice, Path};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Which function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Math {
    /// `e^x`
    Exp,
    /// hyperbolic tangent
    Tanh,
    /// the error function
    Erf,
    /// GELU, exact form: `x / 2 (1 + erf(x / sqrt 2))`
    Gelu,
    /// the logistic sigmoid `1 / (1 + e^-x)` (SiLU's gate in every
    /// Llama-family MLP: candle's went through libm's `exp` an element at
    /// a time, 0.2-0.3 s of a Qwen2-0.5B LoRA step on two threads)
    Sigmoid,
}

/// Calls `$any::<A>(args..)` compiled for the widest vectors this CPU has,
/// detected at run time as candle's and gemm's kernels do: AVX-512 (16
/// lanes and mask registers; `exp` of 2^19 floats 0.14 ms, against 0.27 on
/// AVX2 and 2.3 ns an element on baseline SSE2), else AVX2, each with
/// fused multiply-adds, else the baseline with [`Plain`] arithmetic.
macro_rules! widest {
    ($any:ident($($a:ident: $t:ty),*)) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn wide512($($a: $t),*) {
            $any::<Fused>($($a),*)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn wide256($($a: $t),*) {
            $any::<Fused>($($a),*)
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("fma") {
                // SAFETY: `wide512` needs AVX-512F, AVX2 and FMA (AVX-512F
                // implies AVX2), just detected on the CPU this runs on; it
                // is otherwise the safe generic function. The tests run the
                // path this CPU takes, and the plain one, against f64
                // references.
                return unsafe { wide512($($a),*) };
            }
            if has!("avx2") && has!("fma") {
                // SAFETY: as above, for AVX2 and FMA.
                return unsafe { wide256($($a),*) };
            }
        }
        $any::<Plain>($($a),*)
    }};
}
pub(super) use widest;

/// How `a * b + c` is computed: [`Fused`] in code compiled for FMA (one
/// rounding, one instruction), [`Plain`] elsewhere, where `mul_add` would
/// be a libm call per element.
pub(super) trait Madd {
    fn madd(a: f32, b: f32, c: f32) -> f32;
}

/// `a * b + c` as one fused multiply-add.
pub(super) struct Fused;

/// `a * b + c` as a product and a sum.
pub(super) struct Plain;

impl Madd for Fused {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Madd for Plain {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
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
fn exp_core<A: Madd>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_55, 88.722_83);
    let n = round(x * LOG2E);
    let r = A::madd(-n, LN2_LO, A::madd(-n, LN2_HI, x));
    let p = poly::<A>(
        r,
        &[
            1.987_569_1e-4,
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            5e-1,
        ],
    );
    let e = A::madd(p * r, r, r) + 1.0;
    // n is in [-126, 128]: a normal power of two, or 2^128 = inf
    // 2^23 + 127 + n holds n + 127 in its low mantissa bits: shifted into
    // the exponent field it is 2^n (integer operations only, which
    // vectorise where a float-to-int cast does not)
    let biased = (n + 8_388_735.0).to_bits().wrapping_sub(0x4B00_0000);
    let scale = f32::from_bits(biased << 23);
    e * scale
}

/// `c[0] x^(k-1) + ... + c[k-1]` by Horner's rule (unrolled: `c` is a
/// constant array at every call).
#[inline(always)]
fn poly<A: Madd>(x: f32, c: &[f32]) -> f32 {
    let mut p = c[0];
    for &ci in &c[1..] {
        p = A::madd(p, x, ci);
    }
    p
}

/// `e^x` for every `x`: below `-87.3` through `2^-64 e^(x + 64 ln 2)`, so
/// results reach the subnormals and then 0; above `88.7` infinity.
#[inline(always)]
pub(super) fn exp<A: Madd>(x: f32) -> f32 {
    const SHIFT: f32 = 44.361_42; // 64 ln 2
    const TINY: f32 = 5.421_011e-20; // 2^-64
    let low = x < -87.0;
    let y = exp_core::<A>(if low { x + SHIFT } else { x });
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
fn tanh<A: Madd>(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let p = poly::<A>(
        z,
        &[
            -5.704_988_7e-3,
            2.063_909e-2,
            -5.373_971_6e-2,
            1.333_144_2e-1,
            -3.333_328e-1,
        ],
    );
    let small = x * A::madd(p, z, 1.0); // keeps the sign of a zero
    let big = (1.0 - 2.0 / (exp::<A>(2.0 * a) + 1.0)).copysign(x);
    let y = if a < 0.625 { small } else { big };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `erfc a` for `a >= 0`: the Chebyshev fit of Numerical Recipes'
/// `erfcc`, fractional error under 1.2e-7 everywhere (so `1 - erfc`
/// loses `erf`'s relative accuracy only near 0).
#[inline(always)]
fn erfc_pos<A: Madd>(a: f32) -> f32 {
    let t = 1.0 / A::madd(0.5, a, 1.0);
    let q = poly::<A>(
        t,
        &[
            0.170_872_77,
            -0.822_152_23,
            1.488_515_9,
            -1.135_204,
            0.278_868_07,
            -0.186_288_06,
            0.096_784_18,
            0.374_091_96,
            1.000_023_7,
        ],
    );
    t * exp::<A>(A::madd(-a, a, A::madd(t, q, -1.265_512_2)))
}

/// The normal CDF `Φ(x) = (1 + erf(x / sqrt 2)) / 2`: for `|x| <= sqrt 2`
/// by `erf`'s polynomial, beyond from [`erfc_pos`] of `|x| / sqrt 2`,
/// which below 0 keeps its relative accuracy where `1 + erf` would cancel
/// (GELU of a negative input).
#[inline(always)]
fn normal_cdf<A: Madd>(x: f32) -> f32 {
    let u = x * std::f32::consts::FRAC_1_SQRT_2;
    let a = u.abs();
    let small = A::madd(0.5, erf_poly::<A>(u), 0.5);
    let e = 0.5 * erfc_pos::<A>(a);
    let big = if u < 0.0 { e } else { 1.0 - e };
    if a <= 1.0 {
        small
    } else {
        big
    }
}

/// Cephes' `erff` polynomial, accurate for `|x| <= 1`.
#[inline(always)]
fn erf_poly<A: Madd>(x: f32) -> f32 {
    let z = x * x;
    let p = poly::<A>(
        z,
        &[
            7.853_861_4e-5,
            -8.010_193_6e-4,
            5.188_327_7e-3,
            -2.685_381_2e-2,
            1.128_358_5e-1,
            -3.761_262_6e-1,
            std::f32::consts::FRAC_2_SQRT_PI,
        ],
    );
    x * p
}

/// `erf x`: Cephes' `erff` polynomial for `|x| <= 1`; above, `1 - erfc`
/// ([`erfc_pos`], so at most 2e-8 off in `erf` there), with the sign.
#[inline(always)]
fn erf<A: Madd>(x: f32) -> f32 {
    let a = x.abs();
    let small = erf_poly::<A>(x);
    let big = (1.0 - erfc_pos::<A>(a)).copysign(x);
    let y = if a <= 1.0 { small } else { big };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `x / 2 (1 + erf(x / sqrt 2))`.
#[inline(always)]
fn gelu<A: Madd>(x: f32) -> f32 {
    let y = x * normal_cdf::<A>(x);
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `1 / (1 + e^-x)`, as `e^x / (1 + e^x)` below 0 so that `e^-|x|` never
/// overflows: the left tail keeps its relative accuracy down to the
/// subnormals (`1 / (1 + e^-x)` gives 0 below -88.7); NaN stays NaN
/// through `exp`.
#[inline(always)]
fn sigmoid<A: Madd>(x: f32) -> f32 {
    let e = exp::<A>(-x.abs());
    let r = 1.0 / (1.0 + e);
    if x < 0.0 {
        e * r
    } else {
        r
    }
}

/// `ct (Φ(x) + x φ(x))`: GELU's derivative times the cotangent.
#[inline(always)]
fn gelu_grad<A: Madd>(x: f32, ct: f32) -> f32 {
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    let pdf = INV_SQRT_2PI * exp::<A>(-0.5 * x * x);
    ct * A::madd(x, pdf, normal_cdf::<A>(x))
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
fn fill_any<A: Madd>(d: &mut [f32], x: &[f32], m: Math) {
    // plain indexed loops over equal lengths (an iterator's `fold` for the
    // larger `erf` was left a separate function, compiled without AVX2)
    let n = d.len().min(x.len());
    let (d, x) = (&mut d[..n], &x[..n]);
    match m {
        Math::Exp => {
            for i in 0..n {
                d[i] = exp::<A>(x[i]);
            }
        }
        Math::Tanh => {
            for i in 0..n {
                d[i] = tanh::<A>(x[i]);
            }
        }
        Math::Erf => {
            for i in 0..n {
                d[i] = erf::<A>(x[i]);
            }
        }
        Math::Gelu => {
            for i in 0..n {
                d[i] = gelu::<A>(x[i]);
            }
        }
        Math::Sigmoid => {
            for i in 0..n {
                d[i] = sigmoid::<A>(x[i]);
            }
        }
    }
}

/// [`fill_any`] with the widest vectors this CPU has.
fn fill(d: &mut [f32], x: &[f32], m: Math) {
    widest!(fill_any(d: &mut [f32], x: &[f32], m: Math))
}

struct MathOp(Math);

impl CustomOp1 for MathOp {
    fn name(&self) -> &'static str {
        match self.0 {
            Math::Exp => "exp",
            Math::Tanh => "tanh",
            Math::Erf => "erf",
            Math::Gelu => "gelu",
            Math::Sigmoid => "sigmoid",
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

/// `gelu_grad` of every pair, as [`fill`] with the widest vectors.
#[inline(always)]
fn fill2_any<A: Madd>(d: &mut [f32], x: &[f32], c: &[f32]) {
    let n = d.len().min(x.len()).min(c.len());
    let (d, x, c) = (&mut d[..n], &x[..n], &c[..n]);
    for i in 0..n {
        d[i] = gelu_grad::<A>(x[i], c[i]);
    }
}

fn fill2(d: &mut [f32], x: &[f32], c: &[f32]) {
    widest!(fill2_any(d: &mut [f32], x: &[f32], c: &[f32]))
}

struct GeluGradOp;

impl CustomOp2 for GeluGradOp {
    fn name(&self) -> &'static str {
        "gelu_grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(c)) = (s1, s2) else {
            bail!("gelu_grad: no fast kernel for these dtypes")
        };
        if l1.dims() != l2.dims() {
            bail!("gelu_grad: shapes {:?} and {:?} differ", l1.dims(), l2.dims())
        }
        let (x, c) = (
            contiguous_slice("gelu_grad", x, l1)?,
            contiguous_slice("gelu_grad", c, l2)?,
        );
        let mut dst = super::output::<f32>(x.len())?;
        by_blocks(&mut dst, 10, |start, d| fill2(d, &x[start..], &c[start..]));
        Ok((CpuStorage::F32(dst), l1.shape().clone()))
    }
}

/// `ct gelu'(x)` for CPU f32 tensors of one shape; `None` otherwise.
pub fn gelu_grad_of(x: &Tensor, ct: &Tensor, path: Path) -> Result<Option<Tensor>> {
    if path != Path::Fast
        || !x.device().is_cpu()
        || x.dtype() != DType::F32
        || ct.dtype() != DType::F32
        || x.dims() != ct.dims()
    {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op2_no_bwd(&ct.contiguous()?, &GeluGradOp)?))
}

/// `f(x)` for a CPU f32 tensor; `None` otherwise (the caller uses
/// candle's).
pub fn apply(x: &Tensor, f: Math, path: Path) -> Result<Option<Tensor>> {
    if path != Path::Fast || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&MathOp(f))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `m` of each `x`, by both code paths: the plain one (scalar
    /// multiply-adds) and the one this CPU dispatches to (fused on AVX2).
    fn both(m: Math, x: &[f32]) -> [Vec<f32>; 2] {
        let plain = |x: f32| match m {
            Math::Exp => exp::<Plain>(x),
            Math::Tanh => tanh::<Plain>(x),
            Math::Erf => erf::<Plain>(x),
            Math::Gelu => gelu::<Plain>(x),
            Math::Sigmoid => sigmoid::<Plain>(x),
        };
        let mut fast = vec![0.0; x.len()];
        fill(&mut fast, x, m);
        [x.iter().map(|&x| plain(x)).collect(), fast]
    }

    /// The largest error in units of f32's last place against the f64
    /// function, over a dense grid, on both code paths.
    fn worst_ulps(m: Math, exact: fn(f64) -> f64, lo: f32, hi: f32) -> f64 {
        let n = 200_000;
        let xs: Vec<f32> = (0..=n).map(|i| lo + (hi - lo) * i as f32 / n as f32).collect();
        let mut worst: f64 = 0.0;
        for got in both(m, &xs) {
            for (&x, &got) in xs.iter().zip(&got) {
                let want = exact(x as f64);
                let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE);
                let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
                worst = worst.max((got as f64 - want).abs() / ulp);
            }
        }
        worst
    }

    #[test]
    fn within_a_few_ulps_of_f64() {
        let e = worst_ulps(Math::Exp, f64::exp, -87.0, 88.0);
        assert!(e <= 2.0, "exp: {e} ulps");
        let t = worst_ulps(Math::Tanh, f64::tanh, -10.0, 10.0);
        assert!(t <= 3.0, "tanh: {t} ulps");
        let t0 = worst_ulps(Math::Tanh, f64::tanh, -1e-3, 1e-3);
        assert!(t0 <= 2.0, "tanh near 0: {t0} ulps");
        let r = worst_ulps(Math::Erf, candle_core::cpu::erf::erf_f64, -6.0, 6.0);
        assert!(r <= 4.0, "erf: {r} ulps");
        let exact_gelu = |x: f64| 0.5 * x * (1.0 + candle_core::cpu::erf::erf_f64(x / 2f64.sqrt()));
        // GELU's left tail is erfc(|x| / sqrt 2) of a rounded argument: the
        // rounding, times the exponent's x^2 / 2, costs tens of ulps near x
        // = -6 (a relative 4e-6 of a value of 6e-9; `(1 + erf) x / 2` in
        // f32, PyTorch's formula, gives 0 there)
        let g = worst_ulps(Math::Gelu, exact_gelu, -6.0, 6.0);
        assert!(g <= 96.0, "gelu: {g} ulps");
        let g = worst_ulps(Math::Gelu, exact_gelu, -1.0, 6.0);
        assert!(g <= 4.0, "gelu right of -1: {g} ulps");
        let exact_grad = |x: f64| {
            0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / 2f64.sqrt()))
                + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
        };
        // gelu' crosses zero near x = -0.75, where no relative bound holds:
        // absolute error against its scale (about 1), on both paths
        let xs: Vec<f32> = (0..=200_000).map(|i| -6.0 + 12.0 * i as f32 / 200_000.0).collect();
        let mut fast = vec![0.0; xs.len()];
        fill2(&mut fast, &xs, &vec![1.0; xs.len()]);
        let plain = xs.iter().map(|&x| gelu_grad::<Plain>(x, 1.0));
        let worst = xs
            .iter()
            .zip(plain.chain(fast))
            .map(|(&x, g)| (g as f64 - exact_grad(x as f64)).abs())
            .fold(0.0, f64::max);
        assert!(worst <= 4e-7, "gelu_grad: absolute error {worst}");
        let r0 = worst_ulps(Math::Erf, candle_core::cpu::erf::erf_f64, -1e-3, 1e-3);
        assert!(r0 <= 3.0, "erf near 0: {r0} ulps");
        let s = worst_ulps(Math::Sigmoid, |x| 1.0 / (1.0 + (-x).exp()), -87.0, 30.0);
        assert!(s <= 4.0, "sigmoid: {s} ulps");
    }

    #[test]
    fn edges_nan_and_infinities() {
        let x = [
            f32::NEG_INFINITY,
            f32::INFINITY,
            100.0,
            -200.0,
            -100.0,
            f32::NAN,
            50.0,
            -50.0,
            10.0,
            -10.0,
            0.0,
            -0.0,
        ];
        for [e, t, r, g, s] in (0..2)
            .map(|k| [Math::Exp, Math::Tanh, Math::Erf, Math::Gelu, Math::Sigmoid].map(|m| both(m, &x)[k].clone()))
        {
            // 0 and 1 at the infinities and far out, the left tail to the
            // subnormals, NaN kept, 1/2 at 0
            assert_eq!(s[..4], [0.0, 1.0, 1.0, 0.0]);
            let step = f32::from_bits(1) as f64;
            assert!((s[4] as f64 - (-100f64).exp()).abs() <= 2.0 * step, "{}", s[4]);
            assert!(s[5].is_nan());
            assert!((s[7] as f64 / 1.928_749_847_963_918e-22 - 1.0).abs() < 1e-6, "{}", s[7]);
            assert_eq!([s[6], s[10], s[11]], [1.0, 0.5, 0.5]);
            assert_eq!(e[..4], [0.0, f32::INFINITY, f32::INFINITY, 0.0]);
            // subnormal results, as libm's (to a couple of the smallest steps)
            let step = f32::from_bits(1) as f64;
            assert!((e[4] as f64 - (-100f64).exp()).abs() <= 2.0 * step, "{}", e[4]);
            assert!(e[5].is_nan() && t[5].is_nan() && r[5].is_nan() && g[5].is_nan());
            assert_eq!(t[6..8], [1.0, -1.0]);
            assert_eq!(r[8..11], [1.0, -1.0, 0.0]);
            assert!(t[11].is_sign_negative());
            // -inf times a vanishing Φ: NaN, as PyTorch's; +inf stays
            assert!(g[0].is_nan());
            assert_eq!(g[1..3], [f32::INFINITY, 100.0]);
            assert_eq!([g[8], g[10]], [10.0, 0.0]);
            // -10 Φ(-10) = -7.6198530e-23, where `(1 + erf) x / 2` gives -0
            assert!((g[9] / -7.619_853e-23 - 1.0).abs() < 1e-5, "{}", g[9]);
        }
    }

    #[test]
    fn tensors_match_candle() -> Result<()> {
        let x = (Tensor::randn(0f32, 3., 3 * (1 << 14) + 5, &candle_core::Device::Cpu)? * 1.0)?;
        let sig = candle_nn::ops::sigmoid(&x)?;
        for (m, want) in [
            (Math::Exp, x.exp()?),
            (Math::Tanh, x.tanh()?),
            (Math::Erf, x.erf()?),
            (Math::Sigmoid, sig),
        ] {
            let got = apply(&x, m, Path::Fast)?.expect("f32 on the CPU");
            let rel = ((&got - &want)?.abs()? / (want.abs()? + 1e-30)?)?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(rel < 1e-6, "{m:?}: relative error {rel}");
        }
        assert!(apply(&x.to_dtype(DType::F64)?, Math::Exp, Path::Fast)?.is_none());
        Ok(())
    }
}
