//! Rényi DP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar
//! and Zhang 2019) and its conversion to (ε, δ)-DP, computed as Opacus 1.6's
//! `RDPAccountant` computes it (the same code as TensorFlow Privacy's
//! `rdp_accountant`), so that an ε reported here can be compared with one
//! reported by Opacus for the same run:
//!
//! * at each order α the log of the moment `A_α` is a binomial sum when α is
//!   an integer and a pair of series with `erfc` factors otherwise (summed
//!   until both new terms fall below `e^-30`);
//! * one step has RDP `ln A_α / (α - 1)`; `steps` steps compose additively;
//! * RDP converts to ε with the improved bound of Balle et al. (2020),
//!   `ε = rdp - (ln δ + ln α) / (α - 1) + ln((α - 1) / α)`, minimised over α.
//!
//! Everything is in `f64` and in log space: the moments overflow `f64` long
//! before the orders and step counts of real training runs do.

use crate::error::{Error, Result};
use std::f64::consts::{LN_2, PI};

/// Default RDP orders (Opacus's): 1.1..=10.9 step 0.1, then 12..=63.
///
/// The fractional orders are built as `1 + k / 10` in `f64`, exactly as
/// Opacus builds them, so that `2.0`, `3.0`, … come out as exact integers and
/// take the integer-order formula, as they do there.
pub fn default_orders() -> Vec<f64> {
    (1..100)
        .map(|k| 1.0 + k as f64 / 10.0)
        .chain((12..64).map(|a| a as f64))
        .collect()
}

/// RDP of `steps` compositions of the Poisson-subsampled Gaussian mechanism at each order.
///
/// `sample_rate` is the probability `q` that an example joins a batch and
/// `noise_multiplier` the ratio `σ` of the noise's standard deviation to the
/// clipping norm. The result has one entry per order, in the same order.
///
/// Special cases (those of Opacus): `q = 0` gives 0 at every order, `σ = 0`
/// gives `∞`, `q = 1` gives the closed form `α / (2σ²)` of the plain Gaussian
/// mechanism, and an infinite order gives `∞`. An infinite `σ` gives 0 (the
/// limit; the series would give NaN). `steps = 0` gives 0 (where
/// Opacus would compute `∞ · 0 = NaN` for `σ = 0`).
///
/// An error for `q` outside `[0, 1]`, `σ` negative or NaN, an order NaN or
/// `≤ 1`, and an order whose series would need more than ten million
/// terms (integer orders above 10⁷; see [`MAX_TERMS`]).
pub fn compute_rdp(sample_rate: f64, noise_multiplier: f64, steps: usize, orders: &[f64]) -> Result<Vec<f64>> {
    const OP: &str = "compute_rdp";
    if !(0.0..=1.0).contains(&sample_rate) {
        return Err(Error::privacy(OP, "sample_rate", "in [0, 1]", sample_rate));
    }
    if noise_multiplier.is_nan() || noise_multiplier < 0.0 {
        return Err(Error::privacy(OP, "noise_multiplier", ">= 0", noise_multiplier));
    }
    check_orders(OP, orders)?;
    let rdp = rdp_values(sample_rate, noise_multiplier, steps, orders);
    match orders.iter().zip(&rdp).find(|(_, r)| r.is_nan()) {
        Some((alpha, _)) => Err(Error::Accounting {
            op: OP,
            mechanism: "rdp",
            msg: format!(
                "the series at order {alpha} (q = {sample_rate}, sigma = {noise_multiplier}) needs more than \
                 {MAX_TERMS} terms; use smaller orders"
            ),
        }),
        None => Ok(rdp),
    }
}

/// An error unless every order is above 1 (not NaN).
fn check_orders(op: &'static str, orders: &[f64]) -> Result<()> {
    match orders.iter().find(|a| a.is_nan() || **a <= 1.0) {
        Some(a) => Err(Error::privacy(op, "orders", "each > 1", a)),
        None => Ok(()),
    }
}

/// [`compute_rdp`] without its checks: NaN for an order out of range or a
/// series given up, which [`best_epsilon`] skips.
fn rdp_values(sample_rate: f64, noise_multiplier: f64, steps: usize, orders: &[f64]) -> Vec<f64> {
    orders
        .iter()
        .map(|&alpha| {
            let per_step = rdp_one_step(sample_rate, noise_multiplier, alpha);
            if steps == 0 && !per_step.is_nan() {
                // Nothing has been released, whatever the mechanism.
                0.0
            } else {
                per_step * steps as f64
            }
        })
        .collect()
}

/// (epsilon, best order) for the given RDP values at `delta`.
///
/// Uses the conversion of Balle et al. (2020, Theorem 21), as Opacus does:
/// `ε(α) = rdp(α) - (ln δ + ln α) / (α - 1) + ln((α - 1) / α)`, and returns
/// the smallest over the orders together with the order that attains it (the
/// first one on ties). NaN values of ε are skipped, as Opacus's
/// `nanargmin` skips them; where every one is NaN the result is `(∞, NaN)`,
/// Opacus's "no privacy" answer. When every ε is `∞` (for example `σ = 0`)
/// the result is `(∞, orders[0])`.
///
/// An error for `orders` and `rdp` of different lengths or empty, an order
/// NaN or `≤ 1`, and `delta` outside the open interval `(0, 1)`.
pub fn eps_from_rdp(orders: &[f64], rdp: &[f64], delta: f64) -> Result<(f64, f64)> {
    const OP: &str = "eps_from_rdp";
    if orders.len() != rdp.len() || orders.is_empty() {
        let msg = "one RDP value per order, at least one order";
        return Err(Error::shape(OP, &[&[orders.len()], &[rdp.len()]], msg));
    }
    check_orders(OP, orders)?;
    if !is_valid_delta(delta) {
        return Err(Error::privacy(OP, "delta", "in (0, 1)", delta));
    }
    Ok(best_epsilon(orders, rdp, delta))
}

/// [`eps_from_rdp`] without its checks: orders out of range skipped, and
/// `(NaN, NaN)` for an invalid `delta` or mismatched lengths.
pub(super) fn best_epsilon(orders: &[f64], rdp: &[f64], delta: f64) -> (f64, f64) {
    if orders.len() != rdp.len() || !is_valid_delta(delta) {
        return (f64::NAN, f64::NAN);
    }
    let log_delta = delta.ln();
    let mut best: Option<(f64, f64)> = None;
    for (&alpha, &r) in orders.iter().zip(rdp) {
        if alpha.is_nan() || alpha <= 1.0 {
            continue;
        }
        // Same expression, same evaluation order as Opacus, so the minimiser
        // agrees even when two orders are within rounding of each other.
        let eps = r - (log_delta + alpha.ln()) / (alpha - 1.0) + ((alpha - 1.0) / alpha).ln();
        if eps.is_nan() {
            continue;
        }
        match best {
            // Neither is NaN here; keeping the first order on ties is what
            // numpy's nanargmin does.
            Some((b, _)) if eps >= b => {}
            _ => best = Some((eps, alpha)),
        }
    }
    best.unwrap_or((f64::INFINITY, f64::NAN))
}

/// `(epsilon, best order)` of a history of `(noise_multiplier, sample_rate,
/// steps)` runs at `delta`, over [`default_orders`]: RDP composes by adding
/// the runs' values order by order. `(0.0, 0.0)` for an empty history, as in
/// Opacus.
pub(super) fn history_epsilon(history: &[(f64, f64, usize)], delta: f64) -> (f64, f64) {
    if history.is_empty() {
        return (0.0, 0.0);
    }
    let orders = default_orders();
    let mut rdp = vec![0.0; orders.len()];
    for &(sigma, q, n) in history {
        for (total, r) in rdp.iter_mut().zip(rdp_values(q, sigma, n, &orders)) {
            *total += r;
        }
    }
    best_epsilon(&orders, &rdp, delta)
}

/// Whether `delta` is a usable δ: in the open interval `(0, 1)` (not NaN).
pub(super) fn is_valid_delta(delta: f64) -> bool {
    delta > 0.0 && delta < 1.0
}

/// The most terms a series for one order may take before the order is given
/// up as NaN. Integer orders need `α + 1` terms; fractional ones converge
/// after a few thousand terms for realistic parameters (about 2000 for
/// `σ = 2`), and need a few hundred thousand only for `σ` near 10⁶ (about
/// 250 000 at `q = 0.5`, `α = 1.1`). The cap turns absurd inputs (an order
/// of 10¹⁸) into NaN instead of a hang.
pub const MAX_TERMS: usize = 10_000_000;

/// RDP of one step at order `alpha` (Opacus's `_compute_rdp`, with input
/// validation in front).
fn rdp_one_step(q: f64, sigma: f64, alpha: f64) -> f64 {
    if !(0.0..=1.0).contains(&q) || sigma.is_nan() || sigma < 0.0 || alpha.is_nan() || alpha <= 1.0 {
        return f64::NAN;
    }
    if q == 0.0 {
        return 0.0;
    }
    if sigma == 0.0 {
        // No noise: no privacy.
        return f64::INFINITY;
    }
    if sigma == f64::INFINITY {
        // Pure noise: the limit of the formulas, which would give NaN here.
        return 0.0;
    }
    if q == 1.0 {
        // No subsampling: the plain Gaussian mechanism.
        return alpha / (2.0 * sigma * sigma);
    }
    if alpha.is_infinite() {
        return f64::INFINITY;
    }
    let log_a = if alpha.fract() == 0.0 {
        log_a_int(q, sigma, alpha)
    } else {
        log_a_frac(q, sigma, alpha)
    };
    log_a / (alpha - 1.0)
}

/// `ln A_α` for integer `α` (Mironov et al. 2019, section 3.3):
/// `A_α = Σ_{i=0..α} C(α, i) q^i (1-q)^(α-i) exp((i² - i) / (2σ²))`.
fn log_a_int(q: f64, sigma: f64, alpha: f64) -> f64 {
    if alpha > MAX_TERMS as f64 {
        return f64::NAN;
    }
    let n = alpha as u64;
    let log_q = q.ln();
    // ln(1 - q) via log1p: exact `1 - q` is not available for small q.
    let log_1mq = (-q).ln_1p();
    let two_sigma2 = 2.0 * sigma * sigma;
    let mut log_a = f64::NEG_INFINITY;
    // ln C(n, i), updated as a product so that it never overflows (C(1100,
    // 550) already exceeds f64, which an integer-valued binomial would not
    // survive).
    let mut log_binom = 0.0;
    for i in 0..=n {
        if i > 0 {
            log_binom += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        let fi = i as f64;
        let s = log_binom + fi * log_q + (n - i) as f64 * log_1mq + (fi * fi - fi) / two_sigma2;
        log_a = log_add(log_a, s);
    }
    log_a
}

/// `ln A_α` for fractional `α` (Mironov et al. 2019, section 3.3): the
/// integral is split at `z0 = σ² ln(1/q - 1) + 1/2` and each half expanded in
/// a binomial series with real exponent, whose coefficients change sign; each
/// half is accumulated in log space with additions and subtractions. The sum
/// stops once both new terms are below `e^-30`, as in Opacus.
fn log_a_frac(q: f64, sigma: f64, alpha: f64) -> f64 {
    let log_q = q.ln();
    let log_1mq = (-q).ln_1p();
    // ln(1/q - 1) = ln(1 - q) - ln q, without the rounding of `1/q - 1`
    // (which loses all precision as q approaches 1).
    let z0 = sigma * sigma * (log_1mq - log_q) + 0.5;
    let sqrt2_sigma = std::f64::consts::SQRT_2 * sigma;
    let two_sigma2 = 2.0 * sigma * sigma;
    let mut log_a0 = f64::NEG_INFINITY;
    let mut log_a1 = f64::NEG_INFINITY;
    // The generalised binomial coefficient C(α, i) = Π_{k<i} (α - k) / (k + 1),
    // kept as its log-magnitude and sign.
    let mut log_coef = 0.0;
    let mut positive = true;
    for i in 0..MAX_TERMS {
        let fi = i as f64;
        if i > 0 {
            let factor = alpha - (fi - 1.0);
            log_coef += factor.abs().ln() - fi.ln();
            if factor < 0.0 {
                positive = !positive;
            }
        }
        let j = alpha - fi;
        let log_t0 = log_coef + fi * log_q + j * log_1mq;
        let log_t1 = log_coef + j * log_q + fi * log_1mq;
        let log_e0 = -LN_2 + log_erfc((fi - z0) / sqrt2_sigma);
        let log_e1 = -LN_2 + log_erfc((z0 - j) / sqrt2_sigma);
        let log_s0 = log_t0 + (fi * fi - fi) / two_sigma2 + log_e0;
        let log_s1 = log_t1 + (j * j - j) / two_sigma2 + log_e1;
        if positive {
            log_a0 = log_add(log_a0, log_s0);
            log_a1 = log_add(log_a1, log_s1);
        } else {
            log_a0 = log_sub(log_a0, log_s0);
            log_a1 = log_sub(log_a1, log_s1);
        }
        if log_s0.is_nan() || log_s1.is_nan() || log_a0.is_nan() || log_a1.is_nan() {
            return f64::NAN;
        }
        if log_s0.max(log_s1) < -30.0 {
            return log_add(log_a0, log_a1);
        }
    }
    f64::NAN
}

/// `ln(e^x + e^y)`, exact when either is `-∞` (a zero).
pub(super) fn log_add(x: f64, y: f64) -> f64 {
    if x.is_nan() || y.is_nan() {
        return f64::NAN;
    }
    let (a, b) = if x < y { (x, y) } else { (y, x) };
    if a == f64::NEG_INFINITY {
        return b;
    }
    // e^a + e^b = (1 + e^(a-b)) e^b with a - b ≤ 0, so nothing overflows.
    (a - b).exp().ln_1p() + b
}

/// `ln(e^x - e^y)`; NaN when the difference would be negative (Opacus raises
/// there), `-∞` when it is zero.
fn log_sub(x: f64, y: f64) -> f64 {
    if x.is_nan() || y.is_nan() || x < y {
        return f64::NAN;
    }
    if y == f64::NEG_INFINITY {
        return x;
    }
    if x == y {
        return f64::NEG_INFINITY;
    }
    // e^x - e^y = (e^(x-y) - 1) e^y; expm1 keeps the small differences that
    // dominate when x and y are close.
    let d = (x - y).exp_m1();
    if d.is_infinite() {
        // e^y is negligible next to e^x.
        return x;
    }
    d.ln() + y
}

/// `ln erfc(x)`, accurate also where `erfc(x)` itself underflows.
///
/// Below the switch point `libm::erfc` is accurate in relative terms and its
/// logarithm is fine. For `x ≥ 25` (`erfc(25) ≈ 8e-274`, a little before
/// `f64` underflows near `x ≈ 26.5`) the asymptotic expansion
/// `erfc(x) = e^(-x²) / (x √π) · (1 - 1/(2x²) + 3/(4x⁴) - …)` is used in log
/// form; its truncation error there is below 1e-12.
pub(super) fn log_erfc(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    if x < 25.0 {
        return libm::erfc(x).ln();
    }
    let x2 = x * x;
    let inv2 = 1.0 / x2;
    -0.5 * PI.ln() - x.ln() - x2 + inv2 * (-0.5 + inv2 * (0.625 + inv2 * (-37.0 / 24.0 + inv2 * (353.0 / 64.0))))
}

#[cfg(test)]
#[path = "rdp_tests.rs"]
mod tests;
