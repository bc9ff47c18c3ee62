//! Rényi DP of the Gaussian mechanism on a batch of fixed size `B` drawn
//! without replacement from `N` examples, under the replace-one relation:
//! the bound of Wang, Balle and Kasiviswanathan (2019), "Subsampled Rényi
//! Differential Privacy and Analytical Moments Accountant", theorem 27, as
//! Google's `dp_accounting` evaluates it (`SampledWithoutReplacementDpEvent`).
//!
//! The theorem bounds the subsampled mechanism's RDP at integer orders from
//! the base mechanism's cumulant generating function `K(λ) = λ(λ+1)/(2s²)`,
//! where `s` is the noise over the base mechanism's sensitivity: for DP-SGD
//! replacing one example moves the clipped sum by up to `2C`, so
//! `s = σ / 2`. Fractional orders interpolate the CGF between the
//! neighbouring integers (the paper's corollary 10), which is an upper
//! bound. Orders up to 256 use the exact forward differences; above, the
//! simpler bound `2 e^{K(i-1)}` per term.

use super::rdp::{best_epsilon, log_add};

/// `dp_accounting`'s default orders: `1.1 ..= 10.9` by tenths, `11 ..= 63`,
/// then 128, 256, 512 and 1024.
pub(super) fn orders() -> Vec<f64> {
    (1..100)
        .map(|k| 1.0 + k as f64 / 10.0)
        .chain((11..64).map(|a| a as f64))
        .chain([128.0, 256.0, 512.0, 1024.0])
        .collect()
}

/// `(sign, ln |e^a - e^b|)`, the sign `true` when `a ≥ b`.
fn log_sub_sign(a: f64, b: f64) -> (bool, f64) {
    if a > b {
        (true, a + (-(b - a).exp()).ln_1p())
    } else if a < b {
        (false, b + (-(a - b).exp()).ln_1p())
    } else {
        (true, f64::NEG_INFINITY)
    }
}

/// `ln C(n, k)`.
fn log_comb(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// The logs and signs of the forward differences of `e^K` used by the
/// theorem: the values `[1, e^{K(0)}, …, e^{K(n+1)}]` differenced in place
/// `n + 2` times in sign-and-log form, keeping the head after each pass.
fn forward_diffs(k: &dyn Fn(f64) -> f64, n: usize) -> Vec<f64> {
    let mut v = vec![0.0; n + 3];
    let mut signs = vec![true; n + 3];
    for (i, slot) in v.iter_mut().enumerate().skip(1) {
        *slot = k((i - 1) as f64);
    }
    let mut deltas = vec![0.0; n + 2];
    for (i, d) in deltas.iter_mut().enumerate() {
        for j in 0..n + 2 - i {
            if signs[j] == signs[j + 1] {
                let (s, mag) = log_sub_sign(v[j + 1], v[j]);
                v[j] = mag;
                signs[j] = if signs[j + 1] { s } else { !s };
            } else {
                v[j] = log_add(v[j], v[j + 1]);
                signs[j] = signs[j + 1];
            }
        }
        *d = v[0];
    }
    deltas
}

/// `ln A_α` of the theorem at an integer order `alpha ≥ 2`.
fn log_a_int(q: f64, s: f64, alpha: usize) -> f64 {
    const EXACT_UP_TO: usize = 256;
    let cgf = |x: f64| x * (x + 1.0) / (2.0 * s * s);
    let rdp = |x: f64| x / (2.0 * s * s);
    let a = alpha as f64;
    let log_f2m1 = rdp(2.0) + (-(-rdp(2.0)).exp()).ln_1p();
    let first = 2.0 * q.ln() + log_comb(a, 2.0) + (4f64.ln() + log_f2m1).min(rdp(2.0) + 2f64.ln());
    let mut log_a = log_add(0.0, first);
    let deltas = (alpha <= EXACT_UP_TO).then(|| forward_diffs(&cgf, alpha));
    for i in 3..=alpha {
        let fi = i as f64;
        let mut term = 2f64.ln() + cgf(fi - 1.0);
        if let Some(d) = &deltas {
            let lo = d[2 * (i / 2) - 1];
            let hi = d[2 * i.div_ceil(2) - 1];
            term = term.min(4f64.ln() + 0.5 * (lo + hi));
        }
        log_a = log_add(log_a, term + fi * q.ln() + log_comb(a, fi));
    }
    log_a
}

/// RDP at order `alpha` of one step with sample fraction `q = B / N` and
/// noise `s` over the sensitivity.
pub(super) fn rdp_one_step(q: f64, s: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if s == 0.0 || alpha.is_infinite() {
        return f64::INFINITY;
    }
    if q == 1.0 {
        return alpha / (2.0 * s * s);
    }
    let at = |order: usize| if order < 2 { 0.0 } else { log_a_int(q, s, order) };
    if alpha.fract() == 0.0 {
        return at(alpha as usize) / (alpha - 1.0);
    }
    let (lo, hi) = (alpha.floor(), alpha.ceil());
    let t = alpha - lo;
    ((1.0 - t) * at(lo as usize) + t * at(hi as usize)) / (alpha - 1.0)
}

/// `(ε, best order)` at `delta` of a history of `(σ, q, steps)` runs of
/// DP-SGD steps without replacement (noise multiplier `σ`, so `s = σ/2`).
pub(super) fn history_epsilon(history: &[(f64, f64, usize)], delta: f64) -> (f64, f64) {
    let history = super::live(history);
    if history.is_empty() {
        // nothing released depends on any one example
        return (0.0, 0.0);
    }
    let orders = orders();
    let mut rdp = vec![0.0; orders.len()];
    for &(sigma, q, n) in &history {
        for (total, &alpha) in rdp.iter_mut().zip(&orders) {
            *total += n as f64 * rdp_one_step(q, sigma / 2.0, alpha);
        }
    }
    best_epsilon(&orders, &rdp, delta)
}
