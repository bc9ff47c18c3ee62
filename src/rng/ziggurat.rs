//! A standard normal sampler that spends 32 random bits a draw, for noise
//! that is released in `f32` (or rounded further, to f16/bf16).
//!
//! `rand_distr`'s `StandardNormal` spends 64 bits a draw and returns `f64`,
//! which `f32` noise then rounds away; at four draws a coordinate the
//! generator's output, not the arithmetic, bounds DP-SGD's noise on a CPU.
//! This is Marsaglia and Tsang's ziggurat (2000, "The Ziggurat Method for
//! Generating Random Variables", `RNOR` with 128 layers) with Doornik's
//! correction (2005, "An Improved Ziggurat Method to Generate Normal Random
//! Samples"): the layer index, the sign and the position inside the layer
//! come from separate bits of the word (7 + 1 + 24), where `RNOR` reused
//! the position's low bits as the index.
//!
//! The position has 24 bits, `f32`'s precision, so a draw inside a layer is
//! a multiple of `x_i / 2^24`: no coarser than the 24-bit uniforms from
//! which PyTorch draws the `float32` normals of Opacus's secure mode. The
//! slow paths (about 2.8% of draws: the wedges, the cap and the tail) test
//! in `f64` with 53-bit uniforms. The tables and the wedge test use
//! `libm`'s `exp` and `log`, so a seed gives the same noise on every
//! platform.

use rand::RngCore;
use std::sync::OnceLock;

/// Layers of the ziggurat, a power of two so the index is a mask.
const LAYERS: usize = 128;
/// The base layer's right edge for 128 layers (Marsaglia and Tsang).
const R: f64 = 3.442_619_855_899;
/// The area of each layer, the base's tail included.
const AREA: f64 = 9.912_563_035_262_17e-3;
/// 2^24: the position's range.
const SPAN: f64 = 16_777_216.0;

fn density(x: f64) -> f64 {
    libm::exp(-0.5 * x * x)
}

/// Layer `i` is the box `[0, edge_i] x [bottom_i, top_i]`; a position left
/// of `inner_i` lies under the curve whatever its height.
struct Tables {
    /// `edge_i / 2^24`: the value of one step of the position.
    step: [f32; LAYERS],
    /// `inner_i / edge_i * 2^24`, rounded down: below it, accept at once.
    fast: [u32; LAYERS],
    /// `f(edge_i)`: the layer's bottom (unused for the base, 0).
    bottom: [f64; LAYERS],
    /// The layer's top: the bottom of the layer above, 1 for the cap.
    top: [f64; LAYERS],
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        // Edges from the base up: layer 127 sits on the base and ends at
        // R, each higher layer is narrower, layer 1 is the cap. Layer `i`'s
        // area AREA = edge_i * (f(edge_{i-1}) - f(edge_i)) gives edge_{i-1}.
        let mut edge = [0.0f64; LAYERS];
        edge[0] = AREA / density(R); // the base: its box plus the tail
        edge[LAYERS - 1] = R;
        for i in (1..LAYERS - 1).rev() {
            let e = edge[i + 1];
            edge[i] = (-2.0 * libm::log(AREA / e + density(e))).sqrt();
        }
        let inner = |i: usize| match i {
            0 => R,
            1 => 0.0,
            _ => edge[i - 1],
        };
        let mut t = Tables {
            step: [0.0; LAYERS],
            fast: [0; LAYERS],
            bottom: [0.0; LAYERS],
            top: [0.0; LAYERS],
        };
        for i in 0..LAYERS {
            t.step[i] = (edge[i] / SPAN) as f32;
            t.fast[i] = (inner(i) / edge[i] * SPAN) as u32;
            t.bottom[i] = if i == 0 { 0.0 } else { density(edge[i]) };
            t.top[i] = match i {
                0 => density(R),
                1 => 1.0,
                _ => density(edge[i - 1]),
            };
        }
        t
    })
}

/// Uniform in `(0, 1]` from 53 bits: never 0, so its logarithm is finite.
fn open_uniform(g: &mut impl RngCore) -> f64 {
    ((g.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The excess over `R` of a draw from the normal tail beyond `R`
/// (Marsaglia 1964, as in `RNOR`'s `nfix`).
fn tail_excess(g: &mut impl RngCore) -> f64 {
    loop {
        let x = -libm::log(open_uniform(g)) / R;
        let y = -libm::log(open_uniform(g));
        if 2.0 * y >= x * x {
            return x;
        }
    }
}

/// Fills `out` with `scale` times the sum of `draws` standard normal draws
/// per value. The fast path's words come from `g` in bulk, 256 at a time;
/// the slow path draws what it needs from `g` as it goes.
pub(crate) fn fill_normal_f32(g: &mut impl RngCore, out: &mut [f32], draws: usize, scale: f32) {
    const WORDS: usize = 256;
    let t = tables();
    assert!((1..=WORDS).contains(&draws), "fill_normal_f32: {draws} draws a value");
    let mut words = [0u32; WORDS];
    for piece in out.chunks_mut(WORDS / draws) {
        let words = &mut words[..piece.len() * draws];
        rand::Rng::fill(g, &mut words[..]);
        for (v, w) in piece.iter_mut().zip(words.chunks_exact(draws)) {
            let s: f32 = w.iter().map(|&bits| from_word(g, t, bits)).sum();
            *v = s * scale;
        }
    }
}

/// One standard normal draw as `f32` from the 32 bits `bits`, drawing more
/// from `g` only off the fast path.
#[inline]
fn from_word(g: &mut impl RngCore, t: &Tables, bits: u32) -> f32 {
    let layer = (bits as usize) & (LAYERS - 1);
    let pos = bits >> 8;
    if pos < t.fast[layer] {
        let x = pos as f32 * t.step[layer];
        // The sign bit moved into place: a branch on it would be
        // mispredicted half the time, which tripled the draw's cost.
        return f32::from_bits(x.to_bits() | ((bits & 0x80) << 24));
    }
    slow(g, t, bits)
}

/// One standard normal draw as `f32`, from 32 bits on the fast path.
#[cfg(test)]
fn normal_f32(g: &mut impl RngCore) -> f32 {
    let bits = g.next_u32();
    from_word(g, tables(), bits)
}

/// The ~2.8% of draws outside every layer's inner box: the base's overhang
/// (the tail), the wedges, and the redraws they reject. Out of line, so
/// the fast path stays a handful of instructions.
#[cold]
#[inline(never)]
fn slow(g: &mut impl RngCore, t: &Tables, mut bits: u32) -> f32 {
    loop {
        let layer = (bits as usize) & (LAYERS - 1);
        let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let pos = bits >> 8;
        let x = pos as f32 * t.step[layer];
        if pos < t.fast[layer] {
            return sign * x;
        }
        if layer == 0 {
            // The base box's overhang beyond R is the tail's share.
            if (x as f64) < R {
                return sign * x;
            }
            return sign * (R + tail_excess(g)) as f32;
        }
        // The wedge: accept if a uniform height in the layer is under the curve.
        let y = t.bottom[layer] + open_uniform(g) * (t.top[layer] - t.bottom[layer]);
        if y < density(x as f64) {
            return sign * x;
        }
        bits = g.next_u32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha12Rng;

    #[test]
    fn every_layer_has_the_same_area() {
        let t = tables();
        for i in 1..LAYERS {
            let edge = t.step[i] as f64 * SPAN;
            let area = edge * (t.top[i] - t.bottom[i]);
            assert!((area - AREA).abs() < 1e-6 * AREA, "layer {i}: {area}");
        }
        // The base: its box up to R plus the tail beyond R.
        let tail = (std::f64::consts::PI / 2.0).sqrt() * erfc(R / 2f64.sqrt());
        let base = R * density(R) + tail;
        assert!((base - AREA).abs() < 1e-6 * AREA, "base {base}");
        // The cap reaches the mode, whose height is 1.
        assert!(t.fast[1] == 0 && t.top[1] == 1.0);
    }

    /// Complementary error function to ~1e-7 relative (Numerical
    /// Recipes' Chebyshev fit), enough for the tail's area.
    fn erfc(x: f64) -> f64 {
        let z = x.abs();
        let t = 1.0 / (1.0 + 0.5 * z);
        let p = -z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
        let r = t * p.exp();
        if x >= 0.0 {
            r
        } else {
            2.0 - r
        }
    }

    fn phi(x: f64) -> f64 {
        0.5 * erfc(-x / 2f64.sqrt())
    }

    #[test]
    fn draws_follow_the_normal_cdf() {
        let mut g = ChaCha12Rng::seed_from_u64(21);
        let n = 1_000_000;
        let mut xs: Vec<f64> = (0..n).map(|_| normal_f32(&mut g) as f64).collect();
        xs.sort_by(|a, b| a.total_cmp(b));
        // Kolmogorov–Smirnov: D < 1.95 / sqrt(n) at the 0.1% level.
        let d = xs
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let f = phi(x);
                (f - i as f64 / n as f64)
                    .abs()
                    .max(((i + 1) as f64 / n as f64 - f).abs())
            })
            .fold(0.0, f64::max);
        assert!(d < 1.95 / (n as f64).sqrt(), "KS distance {d}");
        // The tail beyond R, both sides, and beyond 4, against the normal's
        // mass there, within five standard errors.
        for cut in [R, 4.0, 2.0, 0.5] {
            let p = 2.0 * (1.0 - phi(cut));
            let got = xs.iter().filter(|x| x.abs() > cut).count() as f64 / n as f64;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((got - p).abs() < 5.0 * se, "beyond {cut}: {got} vs {p}");
        }
        // Both signs, symmetric.
        let pos = xs.iter().filter(|&&x| x > 0.0).count() as f64 / n as f64;
        assert!((pos - 0.5).abs() < 5.0 * (0.25 / n as f64).sqrt(), "{pos}");
    }

    /// Pearson's chi-square of `xs` over bins of width 0.05 from `-R` up
    /// and the two tails, against the normal's mass in each.
    fn chi_square(xs: &[f64]) -> (f64, usize) {
        let width = 0.05;
        let inner = (2.0 * R / width).floor() as usize;
        let edges: Vec<f64> = (0..=inner).map(|k| -R + k as f64 * width).collect();
        let mut counts = vec![0usize; inner + 2];
        for &x in xs {
            let k = edges.partition_point(|&e| e <= x);
            counts[k] += 1;
        }
        let n = xs.len() as f64;
        let mut stat = 0.0;
        for (k, &c) in counts.iter().enumerate() {
            let lo = if k == 0 { f64::NEG_INFINITY } else { edges[k - 1] };
            let hi = if k == inner + 1 { f64::INFINITY } else { edges[k] };
            let p = phi(hi) - phi(lo);
            let e = n * p;
            stat += (c as f64 - e).powi(2) / e;
        }
        (stat, counts.len() - 1)
    }

    #[test]
    fn bins_wedges_and_tail_match_the_normal() {
        let mut g = ChaCha12Rng::seed_from_u64(99);
        let xs: Vec<f64> = (0..4_000_000).map(|_| normal_f32(&mut g) as f64).collect();
        // Chi-square over ~140 bins: below df + 3.3 sqrt(2 df), the
        // normal approximation's 0.05% point.
        let (stat, df) = chi_square(&xs);
        let bound = df as f64 + 3.3 * (2.0 * df as f64).sqrt();
        assert!(stat < bound, "chi-square {stat} over {df} degrees of freedom");
        // The tail beyond R on its own: the mean excess over R is
        // phi(R) / (1 - Phi(R)) - R, within five standard errors.
        let excess: Vec<f64> = xs.iter().filter(|x| x.abs() > R).map(|x| x.abs() - R).collect();
        let m = excess.iter().sum::<f64>() / excess.len() as f64;
        let sd = (excess.iter().map(|e| (e - m).powi(2)).sum::<f64>() / excess.len() as f64).sqrt();
        let pdf = density(R) / (2.0 * std::f64::consts::PI).sqrt();
        let want = pdf / (1.0 - phi(R)) - R;
        assert!(
            (m - want).abs() < 5.0 * sd / (excess.len() as f64).sqrt(),
            "{m} vs {want}"
        );
    }

    /// The bulk path, one draw and four summed (over two): the normal CDF.
    #[test]
    fn filled_blocks_follow_the_normal_cdf() {
        for (draws, scale) in [(1, 1.0f32), (4, 0.5)] {
            let mut g = ChaCha12Rng::seed_from_u64(77 + draws as u64);
            let mut out = vec![0f32; 300_001]; // not a whole number of pieces
            fill_normal_f32(&mut g, &mut out, draws, scale);
            let mut xs: Vec<f64> = out.iter().map(|&x| x as f64).collect();
            xs.sort_by(|a, b| a.total_cmp(b));
            let n = xs.len() as f64;
            let d = xs
                .iter()
                .enumerate()
                .map(|(i, &x)| (phi(x) - i as f64 / n).abs().max(((i + 1) as f64 / n - phi(x)).abs()))
                .fold(0.0, f64::max);
            assert!(d < 1.95 / n.sqrt(), "{draws} draws: KS distance {d}");
        }
    }

    #[test]
    fn layers_signs_and_positions_are_independent_bits() {
        // Each of the 128 layers x 2 signs is chosen equally often, so the
        // draws' magnitude does not depend on the sign (Doornik's point).
        let mut g = ChaCha12Rng::seed_from_u64(4);
        let n = 400_000;
        let (mut neg, mut pos) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let x = normal_f32(&mut g) as f64;
            if x < 0.0 {
                neg.push(-x)
            } else {
                pos.push(x)
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        // E|Z| = sqrt(2/pi); Var|Z| = 1 - 2/pi.
        let se = ((1.0 - 2.0 / std::f64::consts::PI) / (n as f64 / 2.0)).sqrt();
        for side in [&neg, &pos] {
            assert!((mean(side) - (2.0 / std::f64::consts::PI).sqrt()).abs() < 5.0 * se);
        }
    }
}
