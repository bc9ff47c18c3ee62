//! A small seeded random source for DP-SGD: Gaussian noise, Poisson
//! sampling of batches and permutations, reproducible from one `u64` seed.
//!
//! The generator is xoshiro256** (Blackman and Vigna, 2018), seeded by
//! running splitmix64 from the seed, as its authors recommend: it is fast,
//! passes the standard statistical test batteries, and is small enough to
//! carry here instead of a `rand` dependency. It is not a cryptographically
//! secure generator; the privacy analysis of DP-SGD assumes ideal randomness,
//! which any practical implementation (Opacus's default included) only
//! approximates this way.
//!
//! ```
//! use candle_func::dp::rng::Rng;
//! let mut a = Rng::new(42);
//! let mut b = Rng::new(42);
//! assert_eq!(a.next_u64(), b.next_u64());
//! let batch = a.poisson_sample(1000, 0.01); // about 10 indices, increasing
//! assert!(batch.windows(2).all(|w| w[0] < w[1]));
//! ```

use candle_core::{DType, Device, Tensor};

/// A seeded pseudo-random generator (xoshiro256**) with the draws DP-SGD
/// needs. Cloning it forks the stream: both copies produce the same values.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
    /// The second value of the last Box–Muller pair, returned by the next
    /// call to [`Rng::normal`].
    spare_normal: Option<f64>,
}

/// One step of splitmix64: advances `state` and returns a well-mixed output.
/// Used only to expand the seed into xoshiro's 256-bit state, so that nearby
/// seeds (0, 1, 2, …) give unrelated streams.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole stream is determined by `seed`; any seed is
    /// fine, including 0.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        // splitmix64 is a bijection of its counter, so four consecutive
        // outputs are never all zero (the one state xoshiro cannot leave).
        Rng { s, spare_normal: None }
    }

    /// The next 64 uniformly random bits (xoshiro256**).
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    ///
    /// The top 53 bits scaled by 2⁻⁵³: every multiple of 2⁻⁵³ in `[0, 1)` is
    /// equally likely, and 1.0 is never returned.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller or polar method; cache the second value).
    ///
    /// Box–Muller: two uniforms give two independent N(0, 1) values; the
    /// second is cached and returned by the next call, so each pair of calls
    /// costs two uniforms and one `ln`, `sqrt`, `sin_cos`.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        // 1 - u lies in (0, 1], so the logarithm is finite. The functions
        // come from `libm` (pure Rust) rather than the platform's maths
        // library, so a seed gives bit-identical noise on every platform.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let r = libm::sqrt(-2.0 * libm::log(u1));
        let (sin, cos) = libm::sincos(std::f64::consts::TAU * u2);
        self.spare_normal = Some(r * sin);
        r * cos
    }

    /// A tensor of i.i.d. N(0, std²) values of the given shape and dtype (f32 or f64) on `device`.
    ///
    /// Values are drawn in `f64` on the host, in row-major order, and then
    /// rounded to `dtype` and copied to `device`, so a seed gives the same
    /// noise on every device and platform. `F16` and `BF16` are accepted too (rounded
    /// from `f32`); other dtypes are an error. A negative `std` gives the same
    /// distribution as its absolute value; a NaN or infinite `std` gives NaN
    /// or infinite entries. An empty shape (`&[]`) gives a scalar.
    pub fn normal_tensor(
        &mut self,
        std: f64,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if !(std.is_finite() && std >= 0.0) {
            candle_core::bail!("normal_tensor: the standard deviation must be finite and >= 0, got {std}")
        }
        let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let Some(n) = n else {
            candle_core::bail!("normal_tensor: the element count of shape {shape:?} overflows usize")
        };
        match dtype {
            DType::F64 => {
                let v: Vec<f64> = (0..n).map(|_| std * self.normal()).collect();
                Tensor::from_vec(v, shape, device)
            }
            DType::F32 | DType::F16 | DType::BF16 => {
                let v: Vec<f32> = (0..n).map(|_| (std * self.normal()) as f32).collect();
                Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
            }
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, "normal_tensor")),
        }
    }

    /// Poisson sampling, as Opacus does for DP-SGD: each index in 0..n joins independently with probability q. Returns the chosen indices in increasing order (possibly empty).
    ///
    /// This independent inclusion (not a fixed batch size) is what the
    /// subsampled-Gaussian privacy analysis assumes. `q ≤ 0` or NaN gives an
    /// empty sample, `q ≥ 1` every index. It costs one uniform per index.
    pub fn poisson_sample(&mut self, n: usize, q: f64) -> Vec<usize> {
        if q.is_nan() || q <= 0.0 {
            return Vec::new();
        }
        if q >= 1.0 {
            return (0..n).collect();
        }
        (0..n).filter(|_| self.uniform() < q).collect()
    }

    /// A uniformly random permutation of 0..n (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            // usize fits in u64 on every platform candle supports, and the
            // result is at most i, so both conversions are lossless.
            let j = self.below(i as u64 + 1) as usize;
            p.swap(i, j);
        }
        p
    }

    /// Uniform in `0..bound` (`bound > 0`), without modulo bias: Lemire's
    /// multiply-and-reject method (2019), which rarely needs a division.
    fn below(&mut self, bound: u64) -> u64 {
        debug_assert!(bound > 0);
        let mut m = u128::from(self.next_u64()) * u128::from(bound);
        if (m as u64) < bound {
            // Reject the low products that would over-represent some results.
            let threshold = bound.wrapping_neg() % bound;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (m >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut a = Rng::new(7);
        let mut b = a.clone();
        let xs: Vec<f64> = (0..11).map(|_| a.normal()).collect();
        let ys: Vec<f64> = (0..11).map(|_| b.normal()).collect();
        assert_eq!(xs, ys);
        assert_eq!(
            Rng::new(3).poisson_sample(500, 0.1),
            Rng::new(3).poisson_sample(500, 0.1)
        );
        assert_eq!(Rng::new(3).permutation(50), Rng::new(3).permutation(50));
    }

    #[test]
    fn reference_values() {
        // splitmix64 from state 0 (its published first output), and the first
        // xoshiro256** output from that seeding; pins the stream so that a
        // seed keeps meaning the same noise across versions.
        let mut sm = 0u64;
        assert_eq!(splitmix64(&mut sm), 0xe220_a839_7b1d_cdaf);
        let mut r = Rng::new(0);
        let first = r.next_u64();
        assert_eq!(first, Rng::new(0).next_u64());
        assert_eq!(first, 0x99ec_5f36_cb75_f2b4);
    }

    #[test]
    fn different_seeds_differ() {
        let streams: Vec<Vec<u64>> = (0..16u64)
            .map(|seed| {
                let mut r = Rng::new(seed);
                (0..8).map(|_| r.next_u64()).collect()
            })
            .collect();
        for i in 0..streams.len() {
            for j in 0..i {
                assert_ne!(streams[i], streams[j], "seeds {i} and {j}");
                assert_ne!(streams[i][0], streams[j][0]);
            }
        }
    }

    #[test]
    fn uniform_in_unit_interval() {
        let mut r = Rng::new(11);
        let n = 200_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        // Mean 1/2, standard deviation 1/sqrt(12).
        let se = (1.0 / 12.0f64).sqrt() / (n as f64).sqrt();
        assert!((sum / n as f64 - 0.5).abs() < 5.0 * se);
    }

    #[test]
    fn normal_moments() {
        let mut r = Rng::new(12345);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let nf = n as f64;
        let mean = xs.iter().sum::<f64>() / nf;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (nf - 1.0);
        let m4 = xs.iter().map(|x| x.powi(4)).sum::<f64>() / nf;
        // Standard errors: 1/sqrt(n) for the mean, sqrt(2/n) for the variance
        // of a normal sample, sqrt(96/n) for the fourth moment (3).
        assert!(mean.abs() < 5.0 / nf.sqrt(), "mean {mean}");
        assert!((var - 1.0).abs() < 5.0 * (2.0 / nf).sqrt(), "var {var}");
        assert!((m4 - 3.0).abs() < 5.0 * (96.0 / nf).sqrt(), "m4 {m4}");
        // Tails: P(|Z| > 2) = 0.0455.
        let p = xs.iter().filter(|x| x.abs() > 2.0).count() as f64 / nf;
        let se = (0.0455 * 0.9545 / nf).sqrt();
        assert!((p - 0.0455).abs() < 5.0 * se, "tail {p}");
    }

    #[test]
    fn normal_tensor_shape_dtype_and_std() {
        let dev = Device::Cpu;
        let mut r = Rng::new(5);
        let t = r.normal_tensor(2.5, &[100, 200], DType::F32, &dev).unwrap();
        assert_eq!(t.dims(), &[100, 200]);
        assert_eq!(t.dtype(), DType::F32);
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        // The sample std of a normal sample has standard error σ / sqrt(2n).
        assert!(mean.abs() < 5.0 * 2.5 / n.sqrt(), "mean {mean}");
        assert!((std - 2.5).abs() < 5.0 * 2.5 / (2.0 * n).sqrt(), "std {std}");

        let t = r.normal_tensor(1.0, &[3, 4, 5], DType::F64, &dev).unwrap();
        assert_eq!((t.dims(), t.dtype()), (&[3usize, 4, 5][..], DType::F64));
        let t = r.normal_tensor(1.0, &[], DType::F64, &dev).unwrap();
        assert_eq!(t.rank(), 0);
        let t = r.normal_tensor(1.0, &[0, 7], DType::F32, &dev).unwrap();
        assert_eq!(t.dims(), &[0, 7]);
        let t = r.normal_tensor(1.0, &[4], DType::BF16, &dev).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert!(r.normal_tensor(1.0, &[4], DType::U32, &dev).is_err());
        assert!(r.normal_tensor(1.0, &[usize::MAX, 2], DType::F32, &dev).is_err());

        // Same seed, same tensor; f32 is the f64 draw rounded.
        let a = Rng::new(9).normal_tensor(0.5, &[6], DType::F64, &dev).unwrap();
        let b = Rng::new(9).normal_tensor(0.5, &[6], DType::F32, &dev).unwrap();
        let a: Vec<f64> = a.to_vec1().unwrap();
        let b: Vec<f32> = b.to_vec1().unwrap();
        assert!(a.iter().zip(&b).all(|(&x, &y)| x as f32 == y));
    }

    #[test]
    fn poisson_sample_sizes() {
        let mut r = Rng::new(99);
        let (n, q, trials) = (1000usize, 0.05, 4000usize);
        let mut sizes = Vec::with_capacity(trials);
        let mut hits = vec![0usize; n];
        for _ in 0..trials {
            let s = r.poisson_sample(n, q);
            assert!(s.windows(2).all(|w| w[0] < w[1]));
            assert!(s.iter().all(|&i| i < n));
            for &i in &s {
                hits[i] += 1;
            }
            sizes.push(s.len() as f64);
        }
        let t = trials as f64;
        let mean = sizes.iter().sum::<f64>() / t;
        let var = sizes.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (t - 1.0);
        let (want_mean, want_var) = (n as f64 * q, n as f64 * q * (1.0 - q));
        // SE of the mean: sqrt(var / t); of the sample variance: about
        // var * sqrt(2 / (t - 1)) (the binomial is nearly normal here).
        assert!((mean - want_mean).abs() < 5.0 * (want_var / t).sqrt(), "mean {mean}");
        assert!(
            (var - want_var).abs() < 5.0 * want_var * (2.0 / (t - 1.0)).sqrt(),
            "var {var}"
        );
        // Every index is equally likely: the first and last halves get about
        // the same share (catches an index-dependent bias).
        let first: usize = hits[..n / 2].iter().sum();
        let last: usize = hits[n / 2..].iter().sum();
        let total = (first + last) as f64;
        assert!(((first as f64) - total / 2.0).abs() < 5.0 * (total / 4.0).sqrt());
    }

    #[test]
    fn poisson_sample_edges() {
        let mut r = Rng::new(1);
        assert!(r.poisson_sample(100, 0.0).is_empty());
        assert!(r.poisson_sample(100, -1.0).is_empty());
        assert!(r.poisson_sample(100, f64::NAN).is_empty());
        assert!(r.poisson_sample(0, 0.5).is_empty());
        assert_eq!(r.poisson_sample(5, 1.0), vec![0, 1, 2, 3, 4]);
        assert_eq!(r.poisson_sample(5, 7.0), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn permutation_is_a_permutation() {
        let mut r = Rng::new(2024);
        assert!(r.permutation(0).is_empty());
        assert_eq!(r.permutation(1), vec![0]);
        for n in [2, 3, 10, 1000] {
            let mut p = r.permutation(n);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>());
        }
        // All 6 orders of 3 elements appear about equally often.
        let trials = 60_000;
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..trials {
            *counts.entry(r.permutation(3)).or_insert(0usize) += 1;
        }
        assert_eq!(counts.len(), 6);
        let expect = trials as f64 / 6.0;
        let se = (expect * (5.0 / 6.0)).sqrt();
        for (p, c) in counts {
            assert!((c as f64 - expect).abs() < 5.0 * se, "{p:?}: {c}");
        }
    }

    #[test]
    fn below_is_unbiased_and_in_range() {
        let mut r = Rng::new(8);
        for bound in [1u64, 2, 3, 7, 1 << 40, u64::MAX] {
            for _ in 0..1000 {
                assert!(r.below(bound) < bound);
            }
        }
        let mut counts = [0usize; 7];
        let trials = 70_000;
        for _ in 0..trials {
            counts[r.below(7) as usize] += 1;
        }
        let expect = trials as f64 / 7.0;
        let se = (expect * 6.0 / 7.0).sqrt();
        assert!(
            counts.iter().all(|&c| (c as f64 - expect).abs() < 5.0 * se),
            "{counts:?}"
        );
    }
}
