//! The random source of DP-SGD (Gaussian noise, Poisson sampling of
//! batches, permutations) and of the random primitives (dropout masks).
//!
//! The generator is ChaCha12 (Bernstein's ChaCha with 12 rounds, from the
//! `rand_chacha` crate), the cryptographically secure generator `rand`
//! itself uses as its `StdRng`. [`Rng::from_os`] seeds it from the operating
//! system, which is what DP training should use: the privacy analysis
//! assumes the noise is unpredictable. [`Rng::seeded`] derives the key from
//! a `u64` for reproducible runs and tests; **its noise is predictable from
//! the seed and gives no privacy against anyone who knows or can guess it.**
//!
//! Gaussian noise ([`Rng::normal_tensor`]) is drawn the way Opacus's secure
//! mode draws it, after Holohan and Braghin (2021), "Secure Random Sampling
//! in Differential Privacy", section 5.1: each coordinate is the sum of four
//! independent `N(0, σ²)` draws divided by two (`2n` draws with `n = 2`).
//! A single floating-point Gaussian sample takes only some of the values
//! near any point, and which ones depends on the point, so an output can
//! betray which of two neighbouring inputs it was computed from (Jin et al.
//! 2021, "Are We There Yet? Timing and Floating-Point Attacks on
//! Differential Privacy Systems"); the sum of several draws covers the
//! floating-point values densely, and the attack's search grows from `2^53`
//! to about `2^159` candidate draws. Each draw is a ziggurat sample
//! (Marsaglia and Tsang 2000): for `f64` noise `rand_distr`'s
//! `StandardNormal`, 64 bits a draw; for `f32` (and f16/bf16, rounded from
//! it) the crate's 32-bit ziggurat, whose 24-bit position within a layer
//! is `f32`'s precision and no coarser than the 24-bit uniforms of the
//! `float32` draws Opacus's secure mode sums. A 64-bit draw rounded to
//! `f32` spent twice the generator's output for bits the rounding drops,
//! and the generator bounds the noise's cost.
//!
//! Large tensors are filled in blocks on the kernels' threads. Each call
//! takes a fresh 256-bit key from the generator, and block `k` draws from
//! that key's stream `k`, so the noise is the same whatever the number of
//! threads, and no two blocks or calls share a stream.
//!
//! ```
//! use candle_func::rng::Rng;
//! let mut a = Rng::seeded(42); // reproducible, not secure
//! let mut b = Rng::seeded(42);
//! assert_eq!(a.next_u64(), b.next_u64());
//! let batch = a.poisson_sample(1000, 0.01); // about 10 indices, increasing
//! assert!(batch.windows(2).all(|w| w[0] < w[1]));
//! let secure = Rng::from_os()?; // what training should use
//! assert!(!secure.is_seeded());
//! # Ok::<(), candle_func::Error>(())
//! ```

mod ziggurat;

use crate::env::Path;
use crate::error::{Error, Result};
use crate::kernels::{by_blocks, contiguous_slice, has_cpu_kernel, output, Elem, BLOCK};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor, WithDType};
use rand::{Rng as _, RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;
use rand_distr::StandardNormal;
use ziggurat::fill_normal_f32;

/// A ChaCha12 generator with the draws DP-SGD needs. It is not `Clone`: a
/// copy would repeat the original's noise, which privacy forbids.
#[derive(Debug)]
pub struct Rng {
    inner: ChaCha12Rng,
    seeded: bool,
}

impl Rng {
    /// A generator keyed from the operating system's secure source; an
    /// error only when that source cannot be read.
    pub fn from_os() -> Result<Rng> {
        let inner = ChaCha12Rng::try_from_os_rng().map_err(|e| Error::Config {
            msg: format!("Rng::from_os: the operating system's random source failed: {e}"),
        })?;
        Ok(Rng { inner, seeded: false })
    }

    /// Renamed [`Rng::seeded`], which says what it is: a stream anyone
    /// who knows the seed can repeat (train with [`Rng::from_os`]).
    #[deprecated(
        since = "0.2.0",
        note = "renamed Rng::seeded (reproducible, not private); train with Rng::from_os()"
    )]
    pub fn new(seed: u64) -> Rng {
        Rng::seeded(seed)
    }

    /// A generator whose whole stream is determined by `seed`, for
    /// reproducible runs. **Not secure**: anyone who knows the seed knows
    /// the noise.
    pub fn seeded(seed: u64) -> Rng {
        Rng {
            inner: ChaCha12Rng::seed_from_u64(seed),
            seeded: true,
        }
    }

    /// Whether this generator came from [`Rng::seeded`].
    pub fn is_seeded(&self) -> bool {
        self.seeded
    }

    /// A seeded generator's exact position (key, stream, word), to resume
    /// its stream from a checkpoint; `None` for an OS-keyed one, whose key
    /// must never be written down: ChaCha seeks backwards as easily as
    /// forwards, so the key would give away every draw already made.
    pub(crate) fn state(&self) -> Option<([u8; 32], u64, u128)> {
        self.seeded.then(|| {
            (
                self.inner.get_seed(),
                self.inner.get_stream(),
                self.inner.get_word_pos(),
            )
        })
    }

    /// The seeded generator at a position [`Rng::state`] gave.
    pub(crate) fn from_state((key, stream, word): ([u8; 32], u64, u128)) -> Rng {
        let mut inner = ChaCha12Rng::from_seed(key);
        inner.set_stream(stream);
        inner.set_word_pos(word);
        Rng { inner, seeded: true }
    }

    /// The next 64 uniformly random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in `[0, 1)`: a multiple of `2⁻⁵³`, each equally likely.
    pub fn uniform(&mut self) -> f64 {
        self.inner.random::<f64>()
    }

    /// One standard normal draw (a single ziggurat sample: use
    /// [`Rng::normal_tensor`] for noise that is released).
    pub fn normal(&mut self) -> f64 {
        self.inner.sample(StandardNormal)
    }

    /// A tensor of i.i.d. `N(0, std²)` values of the given shape and dtype
    /// (f32, f64, or f16/bf16 rounded from f32) on `device`, each the sum of
    /// four draws over two (see the module docs).
    ///
    /// Values are computed on the host (in `f64` for f64, in `f32` for the
    /// rest), rounded to `dtype` and copied to `device`, so a seed gives the
    /// same noise on every device, platform and thread count. An error for a `std` that is negative,
    /// NaN or infinite, a dtype that is not a float, or a shape whose size
    /// overflows.
    pub fn normal_tensor(&mut self, std: f64, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.noise(std, shape, dtype, device, SECURE_DRAWS)
    }

    /// As [`Rng::normal_tensor`] with ONE draw per coordinate: four times
    /// cheaper, and what Opacus does outside its secure mode, but **open
    /// to the floating-point attack** the four-draw sum defends against
    /// (the generator is as unpredictable; the values' low bits are not).
    pub fn normal_tensor_single_draw(
        &mut self,
        std: f64,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.noise(std, shape, dtype, device, 1)
    }

    /// `N(0, std²)` noise, each coordinate the sum of `draws` standard
    /// draws scaled by `std / sqrt(draws)`.
    fn noise(&mut self, std: f64, shape: &[usize], dtype: DType, device: &Device, draws: usize) -> Result<Tensor> {
        if !(std.is_finite() && std >= 0.0) {
            return Err(Error::privacy("normal_tensor", "std", "finite and >= 0", std));
        }
        let n = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Error::shape("normal_tensor", &[shape], "the element count overflows usize"))?;
        if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
            return Err(Error::shape(
                "normal_tensor",
                &[shape],
                format!("noise must be a float dtype, got {dtype:?}"),
            ));
        }
        let key = self.key();
        let t = if dtype == DType::F64 {
            Tensor::from_vec(fill::<f64>(n, std, key, draws, None)?, shape, &Device::Cpu)?
        } else {
            Tensor::from_vec(fill::<f32>(n, std, key, draws, None)?, shape, &Device::Cpu)?.to_dtype(dtype)?
        };
        Ok(t.to_device(device)?)
    }

    /// A fresh 256-bit key for one call's streams.
    fn key(&mut self) -> [u8; 32] {
        let mut key = [0u8; 32];
        self.inner.fill_bytes(&mut key);
        key
    }

    /// `(sum + N(0, std²)) * scale`: DP-SGD's noisy mean, with the noise of
    /// [`Rng::normal_tensor`] (`secure`) or [`Rng::normal_tensor_single_draw`].
    /// A contiguous f32/f64 `sum` on the CPU takes one pass that draws,
    /// adds and scales block by block, where the separate ops took three
    /// passes and two parameter-sized temporaries; the noise is the same.
    /// Elsewhere (or on the portable `path`) the noise is drawn on the host
    /// and copied to the sum's device, where it is added.
    pub(crate) fn add_noise(&mut self, sum: &Tensor, std: f64, scale: f64, secure: bool, path: Path) -> Result<Tensor> {
        let draws = if secure { SECURE_DRAWS } else { 1 };
        // half precision noised and scaled in f32 and rounded once (in
        // bf16 the sum plus its noise, then the scale, round twice, and
        // the scale itself: 1/300 is 0.4% off)
        if crate::kernels::is_half(sum.dtype()) {
            let wide = sum.to_dtype(DType::F32)?;
            return Ok(self.add_noise(&wide, std, scale, secure, path)?.to_dtype(sum.dtype())?);
        }
        if has_cpu_kernel(sum, path) && sum.is_contiguous() && std.is_finite() && std >= 0.0 {
            let (storage, layout) = sum.storage_and_layout();
            let fused = Fused { std, draws, scale };
            match &*storage {
                Storage::Cpu(CpuStorage::F32(v)) => return fused.run(v, layout, self.key()),
                Storage::Cpu(CpuStorage::F64(v)) => return fused.run(v, layout, self.key()),
                _ => {}
            }
        }
        let noise = self.noise(std, sum.dims(), sum.dtype(), sum.device(), draws)?;
        Ok(((sum + noise)? * scale)?)
    }

    /// A Poisson-sampled batch: each index in `0..n` independently with
    /// probability `q`, in increasing order (Opacus's `UniformWithReplacementSampler`).
    /// `q ≤ 0` or NaN gives an empty batch and `q ≥ 1` every index.
    pub fn poisson_sample(&mut self, n: usize, q: f64) -> Vec<usize> {
        if q.is_nan() || q <= 0.0 {
            return Vec::new();
        }
        if q >= 1.0 {
            return (0..n).collect();
        }
        (0..n).filter(|_| self.inner.random_bool(q)).collect()
    }

    /// `k` distinct indices of `0..n` drawn uniformly (every subset of
    /// size `k` equally likely), in increasing order; all of them when
    /// `k ≥ n`.
    pub fn subset(&mut self, n: usize, k: usize) -> Vec<usize> {
        if k >= n {
            return (0..n).collect();
        }
        let mut idx = rand::seq::index::sample(&mut self.inner, n, k).into_vec();
        idx.sort_unstable();
        idx
    }

    /// A uniformly random permutation of `0..n` (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        use rand::seq::SliceRandom;
        let mut p: Vec<usize> = (0..n).collect();
        p.shuffle(&mut self.inner);
        p
    }
}

/// Standard draws summed per coordinate by [`Rng::normal_tensor`]
/// (Holohan and Braghin's `2n` with `n = 2`, as in Opacus).
const SECURE_DRAWS: usize = 4;

/// Standard draws a coordinate costs in work per element for
/// [`by_blocks`]'s threading: sampling is compute-bound (3.5 ns an f32
/// draw, 7 ns an f64 one), so threads pay off well below the memory-bound
/// kernels' sizes.
const WORK_PER_DRAW: usize = 16;

/// `n` values of `N(0, std²)`, each the sum of `draws` standard draws
/// times `std / sqrt(draws)`. Block `k` of the kernels' `BLOCK`s draws
/// from stream `k` of `key`, so the values do not depend on how the
/// blocks are spread over threads. A buffer the allocator cannot give is
/// an error, not an abort.
/// With `base = Some((sum, post))`, each value becomes `(sum + noise) *
/// post` while its block is still in cache.
fn fill<T: Noise>(n: usize, std: f64, key: [u8; 32], draws: usize, base: Option<(&[T], T)>) -> Result<Vec<T>> {
    let mut out = output::<T>(n)?;
    let scale = std / (draws as f64).sqrt();
    by_blocks(&mut out, WORK_PER_DRAW * draws, |start, chunk| {
        let mut g = ChaCha12Rng::from_seed(key);
        g.set_stream((start / BLOCK) as u64);
        T::fill_block(&mut g, chunk, draws, scale);
        if let Some((sum, post)) = base {
            for (v, &s) in chunk.iter_mut().zip(&sum[start..]) {
                *v = (s + *v) * post;
            }
        }
    });
    Ok(out)
}

/// [`Rng::add_noise`]'s one pass over a contiguous CPU sum.
struct Fused {
    std: f64,
    draws: usize,
    scale: f64,
}

impl Fused {
    fn run<T: Noise>(&self, sum: &[T], layout: &candle_core::Layout, key: [u8; 32]) -> Result<Tensor> {
        let base = contiguous_slice("add_noise", sum, layout)?;
        let n = layout.shape().elem_count();
        let out = fill::<T>(n, self.std, key, self.draws, Some((base, T::from_f64(self.scale))))?;
        Ok(Tensor::from_vec(out, layout.dims(), &Device::Cpu)?)
    }
}

/// How a block of noise is drawn in each precision.
trait Noise: Elem + WithDType {
    fn fill_block(g: &mut ChaCha12Rng, out: &mut [Self], draws: usize, scale: f64);
}

impl Noise for f32 {
    /// 32 bits a draw (`ziggurat`): f32 keeps 24 of a 64-bit draw's bits.
    fn fill_block(g: &mut ChaCha12Rng, out: &mut [f32], draws: usize, scale: f64) {
        fill_normal_f32(g, out, draws, scale as f32);
    }
}

impl Noise for f64 {
    /// `rand_distr`'s 64-bit ziggurat, the full precision of f64.
    fn fill_block(g: &mut ChaCha12Rng, out: &mut [f64], draws: usize, scale: f64) {
        for v in out {
            let s: f64 = (0..draws).map(|_| g.sample::<f64, _>(StandardNormal)).sum();
            *v = s * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_different_seeds_differ() {
        let (mut a, mut b) = (Rng::seeded(7), Rng::seeded(7));
        let xs: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..16).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_eq!(
            Rng::seeded(3).poisson_sample(500, 0.1),
            Rng::seeded(3).poisson_sample(500, 0.1)
        );
        assert_eq!(Rng::seeded(3).permutation(50), Rng::seeded(3).permutation(50));
        let firsts: Vec<u64> = (0..32).map(|s| Rng::seeded(s).next_u64()).collect();
        for i in 0..32 {
            for j in i + 1..32 {
                assert_ne!(firsts[i], firsts[j], "seeds {i} and {j}");
            }
        }
        // Two OS-keyed generators share nothing.
        let (mut c, mut d) = (Rng::from_os().unwrap(), Rng::from_os().unwrap());
        assert_ne!(c.next_u64(), d.next_u64());
    }

    #[test]
    fn uniform_and_normal_moments() {
        let mut r = Rng::seeded(11);
        let n = 200_000;
        let us: Vec<f64> = (0..n).map(|_| r.uniform()).collect();
        assert!(us.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = us.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 5.0 * (1.0 / 12.0 / n as f64).sqrt(), "{mean}");
        let zs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        moments_are_normal(&zs, 1.0);
    }

    /// Mean, variance, fourth moment and two-sided 2σ tail of `zs` against
    /// `N(0, std²)`, each within five standard errors.
    fn moments_are_normal(zs: &[f64], std: f64) {
        let nf = zs.len() as f64;
        let m = |k: i32| zs.iter().map(|z| (z / std).powi(k)).sum::<f64>() / nf;
        assert!(m(1).abs() < 5.0 / nf.sqrt(), "mean {}", m(1));
        assert!((m(2) - 1.0).abs() < 5.0 * (2.0 / nf).sqrt(), "var {}", m(2));
        assert!((m(4) - 3.0).abs() < 5.0 * (96.0 / nf).sqrt(), "m4 {}", m(4));
        let tail = zs.iter().filter(|z| (*z / std).abs() > 2.0).count() as f64 / nf;
        assert!(
            (tail - 0.0455).abs() < 5.0 * (0.0455 * 0.9545 / nf).sqrt(),
            "tail {tail}"
        );
    }

    #[test]
    fn normal_tensor_is_gaussian_and_thread_independent() {
        let dev = Device::Cpu;
        let mut r = Rng::seeded(5);
        // Several blocks, so the streams' joins are covered.
        let t = r.normal_tensor(2.5, &[7, 10_000], DType::F64, &dev).unwrap();
        let v = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        moments_are_normal(&v, 2.5);
        // Neighbouring blocks are not copies of each other.
        assert_ne!(v[..BLOCK], v[BLOCK..2 * BLOCK]);
        // The same seed gives the same noise on one thread and on many.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let again = one
            .install(|| Rng::seeded(5).normal_tensor(2.5, &[7, 10_000], DType::F64, &dev))
            .unwrap();
        assert_eq!(again.flatten_all().unwrap().to_vec1::<f64>().unwrap(), v);
        // f32 noise (the 32-bit sampler): normal, and the same on one thread.
        let f32s = |r: &mut Rng| {
            let t = r.normal_tensor(2.5, &[7, 10_000], DType::F32, &dev).unwrap();
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let f = f32s(&mut Rng::seeded(5));
        moments_are_normal(&f.iter().map(|&x| x as f64).collect::<Vec<_>>(), 2.5);
        assert_eq!(one.install(|| f32s(&mut Rng::seeded(5))), f);
        assert_ne!(f[..BLOCK], f[BLOCK..2 * BLOCK]);
        // One draw a coordinate: the same distribution.
        let single = r
            .normal_tensor_single_draw(2.5, &[7, 10_000], DType::F64, &dev)
            .unwrap();
        moments_are_normal(&single.flatten_all().unwrap().to_vec1::<f64>().unwrap(), 2.5);
        // Successive calls draw fresh noise.
        let next = r.normal_tensor(2.5, &[7, 10_000], DType::F64, &dev).unwrap();
        assert_ne!(next.flatten_all().unwrap().to_vec1::<f64>().unwrap(), v);
    }

    #[test]
    fn normal_tensor_shapes_and_bad_input() {
        let dev = Device::Cpu;
        let mut r = Rng::seeded(1);
        assert_eq!(r.normal_tensor(1.0, &[], DType::F32, &dev).unwrap().rank(), 0);
        assert_eq!(r.normal_tensor(1.0, &[0, 7], DType::F32, &dev).unwrap().dims(), &[0, 7]);
        assert_eq!(
            r.normal_tensor(1.0, &[3], DType::BF16, &dev).unwrap().dtype(),
            DType::BF16
        );
        let zero = r.normal_tensor(0.0, &[4], DType::F32, &dev).unwrap();
        assert_eq!(zero.to_vec1::<f32>().unwrap(), vec![0.0; 4]);
        for std in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(r.normal_tensor(std, &[2], DType::F32, &dev).is_err());
        }
        let msg = r.normal_tensor(1.0, &[4], DType::U32, &dev).unwrap_err().to_string();
        assert!(msg.contains("normal_tensor"), "{msg}");
        assert!(r.normal_tensor(1.0, &[usize::MAX, 2], DType::F32, &dev).is_err());
        // A size that does not overflow but cannot be allocated: an error.
        let msg = r
            .normal_tensor(1.0, &[1 << 40, 1 << 10], DType::F32, &dev)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("out of memory"), "{msg}");
    }

    /// A half-precision sum is noised and scaled in f32 and rounded once:
    /// with no noise, exactly the f32 quotient rounded (in bf16 the scale
    /// 1/300 itself is 0.4% off).
    #[test]
    fn half_precision_noise_is_added_and_scaled_in_f32() {
        let dev = Device::Cpu;
        let sum = Tensor::arange(0f32, 4096., &dev).unwrap();
        for dt in [DType::BF16, DType::F16] {
            let half = sum.to_dtype(dt).unwrap();
            let got = Rng::seeded(1)
                .add_noise(&half, 0.0, 1.0 / 300.0, false, Path::Fast)
                .unwrap();
            let want = (half.to_dtype(DType::F32).unwrap() * (1.0 / 300.0))
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            assert_eq!(got.dtype(), dt);
            let same = got.eq(&want).unwrap().to_dtype(DType::F32).unwrap().mean_all().unwrap();
            assert_eq!(same.to_scalar::<f32>().unwrap(), 1.0, "{dt:?}");
        }
    }

    #[test]
    fn add_noise_is_the_separate_ops_in_one_pass() {
        let dev = Device::Cpu;
        let (std, scale) = (0.7, 1.0 / 48.0);
        for dt in [DType::F32, DType::F64, DType::BF16] {
            for secure in [true, false] {
                let sum = Tensor::arange(0f32, 40_000., &dev)
                    .unwrap()
                    .reshape((200, 200))
                    .unwrap();
                let sum = sum.to_dtype(dt).unwrap();
                // The same key: the separate ops draw the same noise.
                let fused = Rng::seeded(9).add_noise(&sum, std, scale, secure, Path::Fast).unwrap();
                let draws = if secure { SECURE_DRAWS } else { 1 };
                // bf16 is noised and scaled in f32, rounded once
                let work = if dt == DType::BF16 { DType::F32 } else { dt };
                let noise = Rng::seeded(9).noise(std, sum.dims(), work, &dev, draws).unwrap();
                let wide = sum.to_dtype(work).unwrap();
                let apart = ((&wide + noise).unwrap() * scale).unwrap().to_dtype(dt).unwrap();
                // the portable path is the separate ops themselves
                let portable = Rng::seeded(9)
                    .add_noise(&sum, std, scale, secure, Path::Portable)
                    .unwrap();
                let same = portable.eq(&apart).unwrap().to_dtype(DType::F64).unwrap();
                assert_eq!(
                    same.mean_all().unwrap().to_scalar::<f64>().unwrap(),
                    1.0,
                    "{dt:?} portable"
                );
                assert_eq!(fused.dims(), sum.dims());
                assert_eq!(fused.dtype(), dt);
                let tol = if dt == DType::BF16 { 1e-2 } else { 1e-6 };
                let diff = ((&fused - &apart).unwrap().abs().unwrap().to_dtype(DType::F64).unwrap())
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(diff <= tol * 40_000.0 * scale, "{dt:?} secure {secure}: {diff}");
                // A transposed sum (not contiguous) takes the separate ops.
                let t = Rng::seeded(9)
                    .add_noise(&sum.t().unwrap(), std, scale, secure, Path::Fast)
                    .unwrap();
                let sep = Rng::seeded(9).noise(std, &[200, 200], dt, &dev, draws).unwrap();
                let want = ((sum.t().unwrap() + sep).unwrap() * scale).unwrap();
                assert_eq!(t.dims(), &[200, 200]);
                let d = (t - want).unwrap().abs().unwrap().to_dtype(DType::F64).unwrap();
                assert!(d.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap() <= tol * 40_000.0 * scale);
            }
        }
        // NaN in the sum stays NaN; a bad deviation is an error naming the op.
        let sum = Tensor::new(&[1f32, f32::NAN, 3.0], &dev).unwrap();
        let out = Rng::seeded(1)
            .add_noise(&sum, 1.0, 0.5, true, Path::Fast)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(out[1].is_nan() && out[0].is_finite() && out[2].is_finite());
        for std in [-1.0, f64::NAN] {
            let msg = Rng::seeded(1)
                .add_noise(&sum, std, 1.0, true, Path::Fast)
                .unwrap_err()
                .to_string();
            assert!(msg.contains("normal_tensor"), "{msg}");
        }
    }

    #[test]
    fn poisson_sample_sizes_and_edges() {
        let mut r = Rng::seeded(12345);
        let (n, q, trials) = (2000, 0.05, 400);
        let sizes: Vec<f64> = (0..trials)
            .map(|_| {
                let s = r.poisson_sample(n, q);
                assert!(s.windows(2).all(|w| w[0] < w[1]) && s.iter().all(|&i| i < n));
                s.len() as f64
            })
            .collect();
        let mean = sizes.iter().sum::<f64>() / trials as f64;
        let var = n as f64 * q * (1.0 - q);
        assert!(
            (mean - n as f64 * q).abs() < 5.0 * (var / trials as f64).sqrt(),
            "{mean}"
        );
        assert!(r.poisson_sample(100, 0.0).is_empty());
        assert!(r.poisson_sample(100, -1.0).is_empty());
        assert!(r.poisson_sample(100, f64::NAN).is_empty());
        assert!(r.poisson_sample(0, 0.5).is_empty());
        assert_eq!(r.poisson_sample(5, 1.0), vec![0, 1, 2, 3, 4]);
        assert_eq!(r.poisson_sample(5, 7.0), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn permutation_is_uniform() {
        let mut r = Rng::seeded(8);
        assert!(r.permutation(0).is_empty());
        let mut counts = std::collections::BTreeMap::new();
        let trials = 6000;
        for _ in 0..trials {
            let p = r.permutation(3);
            let mut s = p.clone();
            s.sort();
            assert_eq!(s, vec![0, 1, 2]);
            *counts.entry(p).or_insert(0usize) += 1;
        }
        assert_eq!(counts.len(), 6);
        let expect = trials as f64 / 6.0;
        for (p, &c) in &counts {
            let se = (trials as f64 * (1.0 / 6.0) * (5.0 / 6.0)).sqrt();
            assert!((c as f64 - expect).abs() < 5.0 * se, "{p:?}: {c}");
        }
    }
}
