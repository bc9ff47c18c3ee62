//! Privacy loss distributions (PLD): the accountant of Google's
//! `dp_accounting` (Koskela et al. 2020; Doroshenko, Ghazi, Kamath, Kumar
//! and Manurangsi 2022, "Connect the Dots"), written from the papers.
//!
//! One step of a sampled Gaussian mechanism is a pair of distributions
//! `(P, Q)` on the released value; its privacy loss `ln(P(x) / Q(x))`
//! under `x ~ P` is a random variable whose `ε`-hockey-stick divergence is
//! the `δ` of the step at `ε`. The method:
//!
//! 1. **Discretise pessimistically** ("connect the dots"): on the grid
//!    `i h` (`h = 1e-4` by default) between the losses of the noise's
//!    `e^-50` tails, evaluate `δ(ε)` of the step exactly (normal CDFs), and
//!    put on each grid point the mass that makes the discrete loss's `δ`
//!    agree with the true one at every grid point and lie above it between
//!    them (`δ` is convex in `e^ε`); what lies beyond the top point is
//!    mass at `+∞`.
//! 2. **Compose** `n` identical steps by one FFT raised to the `n`-th
//!    power, on a window that Chernoff bounds say holds all but `1e-15` of
//!    the mass (the rest counts as `+∞`); different steps by linear
//!    convolution, cutting at most `1e-15` from the tails (the upper cut
//!    counts as `+∞`, the lower joins the lowest point kept).
//! 3. **Read** `ε(δ)` off the composed distribution:
//!    `δ(ε) = p_∞ + Σ_{ℓ > ε} p_ℓ (1 - e^{ε - ℓ})`.
//!
//! Every approximation rounds towards more privacy loss, so the ε reported
//! is an upper bound up to floating point. Pairs: **add/remove** one example
//! under Poisson sampling (the larger of the two directions' ε, which differ
//! when `q < 1`), and **replace one** under sampling without replacement,
//! where the sampled component moves from `+1` to `-1` (the clipped sum
//! moves by up to `2C`).

use super::fft::{power, Fft};
use super::rdp::{log_add, log_erfc};
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::f64::consts::{LN_2, SQRT_2};

/// The default grid step on the privacy loss (`dp_accounting`'s
/// `value_discretization_interval`).
pub(super) const INTERVAL: f64 = 1e-4;
/// The noise's tails left out of the discretisation, `ln` of their mass.
const LOG_MASS_TRUNCATION: f64 = -50.0;
/// The mass a composition may cut from the tails.
const TAIL_TRUNCATION: f64 = 1e-15;
/// The largest grid built: 2²⁶ points, 0.5 GiB per distribution.
const MAX_POINTS: usize = 1 << 26;

/// Which pair of output distributions dominates one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pair {
    /// `P = (1-q) N(0) + q N(-1)`, `Q = N(0)`: an example removed.
    Remove,
    /// `P = N(0)`, `Q = (1-q) N(0) + q N(1)`: an example added.
    Add,
    /// `P = (1-q) N(0) + q N(-1)`, `Q = (1-q) N(0) + q N(1)`: replaced.
    Replace,
}

/// The Gaussian mechanism with noise `s` (standard deviation over the
/// sensitivity), subsampled with probability `q ∈ (0, 1]`, for one pair.
#[derive(Clone, Copy, Debug)]
pub(super) struct Gaussian {
    pub s: f64,
    pub q: f64,
    pub pair: Pair,
}

/// `Φ(z)`, the standard normal CDF.
fn phi(z: f64) -> f64 {
    0.5 * libm::erfc(-z / SQRT_2)
}

/// `ln Φ(z)`, accurate in both tails.
fn log_phi(z: f64) -> f64 {
    if z < 0.0 {
        log_erfc(-z / SQRT_2) - LN_2
    } else {
        (-0.5 * libm::erfc(z / SQRT_2)).ln_1p()
    }
}

/// The `z` with `ln Φ(z) = target`, for `target < ln ½`, by bisection.
fn log_phi_inverse(target: f64) -> f64 {
    let (mut lo, mut hi) = (-60.0f64, 0.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if log_phi(mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

impl Gaussian {
    /// `ln(1 - q)` (`-∞` at `q = 1`).
    fn log_not_q(&self) -> f64 {
        (-self.q).ln_1p()
    }

    /// The loss of the removal pair at `x`: `ln(1 - q + q e^{(-½ - x)/s²})`.
    fn loss_remove(&self, x: f64) -> f64 {
        let unsampled = (-0.5 - x) / (self.s * self.s);
        if self.q == 1.0 {
            return unsampled;
        }
        log_add(self.q.ln() + unsampled, self.log_not_q())
    }

    /// The loss at `x`; non-increasing in `x`. The addition pair's loss is
    /// the removal pair's mirrored (the noise is symmetric).
    pub(super) fn loss(&self, x: f64) -> f64 {
        match self.pair {
            Pair::Remove => self.loss_remove(x),
            Pair::Add => -self.loss_remove(-x),
            Pair::Replace => self.loss_remove(x) - self.loss_remove(-x),
        }
    }

    /// The largest `x` whose loss is at least `loss`.
    fn inverse(&self, loss: f64) -> f64 {
        match self.pair {
            Pair::Remove => self.inverse_remove(loss),
            Pair::Add => -self.inverse_remove(-loss),
            Pair::Replace => self.inverse_replace(loss),
        }
    }

    /// Solves `ln(1 - q + q e^u) = loss` for `u = (-½ - x)/s²`, i.e.
    /// `u = loss + ln(1 - (1-q) e^{-loss}) - ln q`; `+∞` where no sample
    /// reaches the loss (at or below `ln(1 - q)`).
    fn inverse_remove(&self, loss: f64) -> f64 {
        let s2 = self.s * self.s;
        let u = if self.q == 1.0 {
            loss
        } else {
            if loss <= self.log_not_q() {
                return f64::INFINITY;
            }
            loss + (-(1.0 - self.q) * (-loss).exp()).ln_1p() - self.q.ln()
        };
        -0.5 - u * s2
    }

    /// With `v = x/s²` and `α = e^{1/(2s²)} (1-q)/q`, the replacement loss
    /// is `ln((1 + e^{-v}/α) / (1 + e^{v}/α))`, which equals `loss` at
    /// `v = asinh(-α sinh(loss/2)) - loss/2`.
    fn inverse_replace(&self, loss: f64) -> f64 {
        let s2 = self.s * self.s;
        if loss == 0.0 {
            return 0.0;
        }
        if self.q == 1.0 {
            return -loss * s2 / 2.0;
        }
        let log_alpha = 0.5 / s2 + self.log_not_q() - self.q.ln();
        let a = loss.abs() / 2.0;
        // ln sinh(a) = a + ln(1 - e^{-2a}) - ln 2
        let log_term = log_alpha + a + (-(-2.0 * a).exp()).ln_1p() - LN_2;
        // asinh(e^t) = ln(e^t + sqrt(e^{2t} + 1)), in logs
        let asinh = log_add(0.5 * log_add(0.0, 2.0 * log_term), log_term);
        s2 * (-loss.signum() * asinh - loss / 2.0)
    }

    /// `P(X ≤ x)` for `X ~ P`.
    fn upper_cdf(&self, x: f64) -> f64 {
        let s = self.s;
        match self.pair {
            Pair::Add => phi(x / s),
            _ if self.q == 1.0 => phi((x + 1.0) / s),
            _ => (1.0 - self.q) * phi(x / s) + self.q * phi((x + 1.0) / s),
        }
    }

    /// `ln Q(X ≤ x)`.
    fn lower_log_cdf(&self, x: f64) -> f64 {
        let s = self.s;
        match self.pair {
            Pair::Remove => log_phi(x / s),
            _ if self.q == 1.0 => log_phi((x - 1.0) / s),
            _ => log_add(self.log_not_q() + log_phi(x / s), self.q.ln() + log_phi((x - 1.0) / s)),
        }
    }

    /// The step's `δ` at `eps`, exactly: `P(X ≤ x) - e^ε Q(X ≤ x)` where
    /// `x` is the inverse loss of `eps`, clamped to `[0, 1]`.
    pub(super) fn delta(&self, eps: f64) -> f64 {
        if self.q < 1.0 {
            // beyond the loss's range the divergence is known in closed form
            if self.pair == Pair::Add && eps >= -self.log_not_q() {
                return 0.0;
            }
            if self.pair == Pair::Remove && eps <= self.log_not_q() {
                return -eps.exp_m1();
            }
        }
        let x = self.inverse(eps);
        let d = self.upper_cdf(x) - (eps + self.lower_log_cdf(x)).exp();
        d.clamp(0.0, 1.0)
    }

    /// The losses at the noise's `e^-50` tails: `(lowest, highest)`.
    fn loss_bounds(&self) -> (f64, f64) {
        let z = log_phi_inverse(LOG_MASS_TRUNCATION - LN_2);
        let (mut lower_x, mut upper_x) = (self.s * z, -self.s * z);
        if self.pair == Pair::Add {
            upper_x += 1.0;
        } else {
            lower_x -= 1.0;
        }
        (self.loss(upper_x), self.loss(lower_x))
    }
}

/// A discrete privacy loss: `probs[i]` at the loss `(lower + i) h`, and
/// `infinity` at `+∞`.
#[derive(Clone, Debug)]
pub(super) struct Pmf {
    pub lower: i64,
    pub probs: Vec<f64>,
    pub infinity: f64,
    pub h: f64,
}

fn too_large(what: &str, points: f64) -> Error {
    Error::Accounting {
        op: "Accountant::epsilon",
        mechanism: "pld",
        msg: format!("{what} needs a grid of {points:e} points (at most {MAX_POINTS}); raise the interval"),
    }
}

/// The smallest `2^a 3^b 5^c` at least `n`: a length the FFT is fast on.
fn fast_len(n: usize) -> usize {
    let mut best = n.next_power_of_two();
    let mut p5 = 1;
    while p5 < best {
        let mut p35 = p5;
        while p35 < best {
            let mut m = p35;
            while m < n {
                m *= 2;
            }
            best = best.min(m);
            p35 *= 3;
        }
        p5 *= 5;
    }
    best
}

impl Pmf {
    /// The connect-the-dots discretisation of one step on the grid `i h`.
    pub(super) fn connect_dots(g: &Gaussian, h: f64) -> Result<Pmf> {
        let (lo_eps, hi_eps) = g.loss_bounds();
        let (lo, hi) = ((lo_eps / h).floor(), (hi_eps / h).ceil());
        let points = hi - lo + 1.0;
        if !points.is_finite() || points > MAX_POINTS as f64 {
            return Err(too_large(&format!("noise {} at sample rate {}", g.s, g.q), points));
        }
        let (lo, n) = (lo as i64, points as usize);
        let mut d: Vec<f64> = (0..n)
            .into_par_iter()
            .map(|i| g.delta((lo + i as i64) as f64 * h))
            .collect();
        // δ is non-increasing in ε; keep rounding from breaking that
        for i in 1..n {
            d[i] = d[i].min(d[i - 1]);
        }
        if n == 1 {
            return Ok(Pmf {
                lower: lo,
                probs: vec![1.0 - d[0]],
                infinity: d[0],
                h,
            });
        }
        let (em1, e) = (h.exp_m1(), h.exp());
        let mut probs = vec![0.0; n];
        probs[0] = 1.0 - d[0] + (d[1] - d[0]) / em1;
        for i in 1..n - 1 {
            probs[i] = ((d[i + 1] - d[i]) - e * (d[i] - d[i - 1])) / em1;
        }
        probs[n - 1] = (d[n - 1] - d[n - 2]) / (-h).exp_m1();
        probs.iter_mut().for_each(|p| *p = p.max(0.0));
        Ok(Pmf {
            lower: lo,
            probs,
            infinity: d[n - 1],
            h,
        })
    }

    /// The grid window `[lower, upper]` (offsets from `n * self.lower`)
    /// that holds all but `TAIL_TRUNCATION` of the `n`-fold sum, by
    /// Chernoff bounds at 40 orders.
    fn self_composed_window(&self, n: usize) -> (f64, f64) {
        let len = self.probs.len() as f64;
        let (mut lower, mut upper) = (0.0f64, (len - 1.0) * n as f64);
        // Σ p_i e^{i t} at t = k / len for k = ±1..=±20: with w_i = e^{i/len}
        // every term is p_i w_i^k, between e^-20 p_i and e^20 p_i, so
        // running powers need no logarithms
        let mut mgf = [0.0f64; 40];
        for (i, &p) in self.probs.iter().enumerate() {
            if p <= 0.0 {
                continue;
            }
            let w = (i as f64 / len).exp();
            let (mut up, mut down) = (p, p);
            for k in 0..20 {
                up *= w;
                down /= w;
                mgf[k] += up;
                mgf[20 + k] += down;
            }
        }
        let slack = (2.0 / TAIL_TRUNCATION).ln();
        for (k, &m) in mgf.iter().enumerate() {
            let t = if k < 20 { (k + 1) as f64 } else { -((k - 19) as f64) } / len;
            let bound = (n as f64 * m.ln() + slack) / t;
            if !bound.is_finite() {
                continue;
            }
            if t > 0.0 {
                upper = upper.min(bound.ceil());
            } else {
                lower = lower.max(bound.floor());
            }
        }
        (lower, upper)
    }

    /// The sum of `n ≥ 1` independent copies.
    pub(super) fn self_composed(&self, n: usize, fft: &mut Fft) -> Result<Pmf> {
        if n == 1 {
            return Ok(self.clone());
        }
        let (lo, hi) = self.self_composed_window(n);
        // at least one point, should the bounds cross
        let out = (hi - lo + 1.0).max(1.0);
        if !(out.is_finite() && out <= MAX_POINTS as f64) {
            return Err(too_large(&format!("{n} steps"), out));
        }
        let (lo, out) = (lo as usize, out as usize);
        let size = fast_len(out.max(self.probs.len()));
        let mut x = self.probs.clone();
        x.resize(size, 0.0);
        let mut spectrum = fft.forward(x);
        spectrum.iter_mut().for_each(|c| *c = power(*c, n));
        // index j of the circular result holds the sums j (mod size)
        let circular = fft.inverse(&mut spectrum, size);
        let probs = (0..out).map(|i| circular[(i + lo) % size]).collect();
        let lower = self.lower.checked_mul(n as i64).and_then(|l| l.checked_add(lo as i64));
        Ok(Pmf {
            lower: lower.ok_or_else(|| too_large(&format!("{n} steps"), f64::INFINITY))?,
            probs,
            infinity: TAIL_TRUNCATION - (n as f64 * (-self.infinity).ln_1p()).exp_m1(),
            h: self.h,
        })
    }

    /// The sum of two independent losses on one grid.
    pub(super) fn composed(&self, other: &Pmf, fft: &mut Fft) -> Pmf {
        let len = self.probs.len() + other.probs.len() - 1;
        let size = fast_len(len);
        let padded = |p: &[f64]| {
            let mut v = p.to_vec();
            v.resize(size, 0.0);
            v
        };
        let a = fft.forward(padded(&self.probs));
        let b = fft.forward(padded(&other.probs));
        let mut prod: Vec<_> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
        let mut probs = fft.inverse(&mut prod, size);
        probs.truncate(len);
        let infinity = self.infinity + other.infinity - self.infinity * other.infinity;
        let mut pmf = Pmf {
            lower: self.lower + other.lower,
            probs,
            infinity,
            h: self.h,
        };
        pmf.truncate_tails();
        pmf
    }

    /// Cuts the longest prefix and suffix of at most `TAIL_TRUNCATION / 2`
    /// mass each; the prefix joins the lowest point kept, the suffix `+∞`.
    fn truncate_tails(&mut self) {
        let half = TAIL_TRUNCATION / 2.0;
        let prefix = |it: &mut dyn Iterator<Item = f64>| {
            let mut s = 0.0;
            for (i, v) in it.enumerate() {
                s += v;
                if s > half {
                    return i;
                }
            }
            usize::MAX
        };
        let n = self.probs.len();
        let left = prefix(&mut self.probs.iter().copied()).min(n);
        let right = n - prefix(&mut self.probs.iter().rev().copied()).min(n);
        let right = right.max(left + 1).min(n);
        if left >= right {
            return;
        }
        let left_mass: f64 = self.probs[..left].iter().sum();
        let right_mass: f64 = self.probs[right..].iter().sum();
        let mut kept = self.probs[left..right].to_vec();
        kept[0] += left_mass;
        self.probs = kept;
        self.lower += left as i64;
        self.infinity += right_mass;
    }

    /// `w self + (1 - w) other`, pointwise.
    pub(super) fn mixture(&self, other: &Pmf, w: f64) -> Pmf {
        let lower = self.lower.min(other.lower);
        let end = (self.lower + self.probs.len() as i64).max(other.lower + other.probs.len() as i64);
        let mut probs = vec![0.0; (end - lower) as usize];
        for (pmf, weight) in [(self, w), (other, 1.0 - w)] {
            let start = (pmf.lower - lower) as usize;
            for (slot, p) in probs[start..].iter_mut().zip(&pmf.probs) {
                *slot += weight * p;
            }
        }
        Pmf {
            lower,
            probs,
            infinity: w * self.infinity + (1.0 - w) * other.infinity,
            h: self.h,
        }
    }

    /// The smallest `ε ≥ 0` whose `δ(ε)` is at most `delta`: scanning the
    /// losses from the top while the running sums `Σ p` and `Σ p e^{-ℓ}`
    /// say ε lies below the current loss.
    pub(super) fn epsilon(&self, delta: f64) -> f64 {
        if self.infinity > delta {
            return f64::INFINITY;
        }
        let (mut upper, mut lower) = (self.infinity, 0.0f64);
        let top = self.lower + self.probs.len() as i64 - 1;
        for (k, &p) in self.probs.iter().rev().enumerate() {
            let loss = (top - k as i64) as f64 * self.h;
            if upper > delta && lower > 0.0 && ((upper - delta) / lower).ln() >= loss {
                break;
            }
            upper += p;
            lower += (-loss).exp() * p;
            if upper >= delta && lower == 0.0 {
                return loss.max(0.0);
            }
        }
        if upper <= lower + delta {
            return 0.0;
        }
        ((upper - delta) / lower).ln()
    }

    /// `δ(ε)` of this loss.
    #[cfg(test)]
    pub(super) fn delta(&self, eps: f64) -> f64 {
        let mut d = self.infinity;
        for (i, &p) in self.probs.iter().enumerate() {
            let loss = (self.lower + i as i64) as f64 * self.h;
            if loss > eps {
                d += -(eps - loss).exp_m1() * p;
            }
        }
        d
    }
}

/// A step's or a run's loss for both directions of a pair; `add` is
/// `None` where the two are the same (`q = 1`, or replacement).
#[derive(Clone, Debug)]
pub(super) struct Pld {
    pub remove: Pmf,
    pub add: Option<Pmf>,
}

impl Pld {
    /// One step of the Poisson-sampled Gaussian, add or remove one.
    pub(super) fn poisson(sigma: f64, q: f64, h: f64) -> Result<Pld> {
        let g = |pair| Gaussian { s: sigma, q, pair };
        if q == 1.0 {
            return Ok(Pld {
                remove: Pmf::connect_dots(&g(Pair::Remove), h)?,
                add: None,
            });
        }
        let (remove, add) = rayon::join(
            || Pmf::connect_dots(&g(Pair::Remove), h),
            || Pmf::connect_dots(&g(Pair::Add), h),
        );
        Ok(Pld {
            remove: remove?,
            add: Some(add?),
        })
    }

    /// One step sampled without replacement at `q = B / N`, replace one.
    pub(super) fn replace(sigma: f64, q: f64, h: f64) -> Result<Pld> {
        let g = Gaussian {
            s: sigma,
            q,
            pair: Pair::Replace,
        };
        Ok(Pld {
            remove: Pmf::connect_dots(&g, h)?,
            add: None,
        })
    }

    /// `n` independent copies; the two directions on two threads.
    pub(super) fn self_composed(&self, n: usize) -> Result<Pld> {
        let (remove, add) = rayon::join(
            || self.remove.self_composed(n, &mut Fft::new()),
            || {
                self.add
                    .as_ref()
                    .map(|a| a.self_composed(n, &mut Fft::new()))
                    .transpose()
            },
        );
        Ok(Pld {
            remove: remove?,
            add: add?,
        })
    }

    /// Two independent losses; the two directions on two threads.
    pub(super) fn composed(&self, other: &Pld) -> Pld {
        let (remove, add) = rayon::join(
            || self.remove.composed(&other.remove, &mut Fft::new()),
            || match (&self.add, &other.add) {
                (None, None) => None,
                (a, b) => {
                    let a = a.as_ref().unwrap_or(&self.remove);
                    let b = b.as_ref().unwrap_or(&other.remove);
                    Some(a.composed(b, &mut Fft::new()))
                }
            },
        );
        Pld { remove, add }
    }

    /// `w self + (1 - w) other`, direction by direction.
    pub(super) fn mixture(&self, other: &Pld, w: f64) -> Pld {
        let remove = self.remove.mixture(&other.remove, w);
        let add = match (&self.add, &other.add) {
            (None, None) => None,
            (a, b) => {
                let a = a.as_ref().unwrap_or(&self.remove);
                let b = b.as_ref().unwrap_or(&other.remove);
                Some(a.mixture(b, w))
            }
        };
        Pld { remove, add }
    }

    /// The larger of the two directions' ε at `delta`.
    pub(super) fn epsilon(&self, delta: f64) -> f64 {
        let e = self.remove.epsilon(delta);
        self.add.as_ref().map_or(e, |a| e.max(a.epsilon(delta)))
    }

    /// The larger of the two directions' δ at `eps`.
    #[cfg(test)]
    pub(super) fn delta(&self, eps: f64) -> f64 {
        let d = self.remove.delta(eps);
        self.add.as_ref().map_or(d, |a| d.max(a.delta(eps)))
    }
}

#[cfg(test)]
#[path = "pld_tests.rs"]
mod tests;
