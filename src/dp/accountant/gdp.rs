//! Gaussian differential privacy (Dong, Roth and Su 2019; Bu, Dong, Long
//! and Su 2020), as Opacus's `GaussianAccountant` computes it for Poisson
//! sampling: by the central limit theorem, `n` steps at rate `q` with noise
//! multiplier `σ` are approximately `μ`-GDP with
//! `μ = q √n √(e^{1/σ²} - 1)`, and `μ`-GDP is `(ε, δ(ε))`-DP for
//! `δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)`.
//!
//! The limit is an approximation, not a bound: it can *under*-state ε,
//! badly so for few steps or large `q` (Gopi et al. 2021, figure 1). It is
//! here for comparison with papers that report it; train on the PRV or RDP
//! figure.

use crate::error::{Error, Result};

/// ε at `delta` for a constant history `(sigma, q, steps)`.
pub(super) fn epsilon(history: &[(f64, f64, usize)], delta: f64) -> Result<f64> {
    let live = super::live(history);
    let Some(&(sigma, q, _)) = live.first() else {
        return Ok(0.0);
    };
    if live.iter().any(|&(s, r, _)| s != sigma || r != q) {
        return Err(Error::Accounting {
            op: "Accountant::epsilon",
            mechanism: "gdp",
            msg: "the noise multiplier and sample rate must stay constant \
                  (the central-limit approximation is for identical steps)"
                .into(),
        });
    }
    if sigma == 0.0 {
        return Ok(f64::INFINITY);
    }
    let steps = super::total_steps(&live);
    let mu = q * (steps as f64).sqrt() * (1.0 / (sigma * sigma)).exp_m1().sqrt();
    if !mu.is_finite() {
        return Ok(f64::INFINITY);
    }
    Ok(eps_from_mu(mu, delta))
}

/// `Φ(x)`, the standard normal CDF.
fn phi(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// `δ(ε)` of `μ`-GDP; decreasing in ε.
fn delta_of(eps: f64, mu: f64) -> f64 {
    phi(-eps / mu + mu / 2.0) - eps.exp() * phi(-eps / mu - mu / 2.0)
}

/// The ε with `δ(ε) = delta`, by bisection on `[0, 500]` (Opacus's bracket)
/// to the resolution of `f64`; 0 when already `δ(0) ≤ delta`.
fn eps_from_mu(mu: f64, delta: f64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 500.0f64);
    if delta_of(lo, mu) <= delta {
        return 0.0;
    }
    if delta_of(hi, mu) > delta {
        return f64::INFINITY;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if delta_of(mid, mu) > delta {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_of_inverts() {
        for mu in [0.1, 0.5, 1.0, 3.0] {
            let eps = eps_from_mu(mu, 1e-5);
            assert!((delta_of(eps, mu) - 1e-5).abs() < 1e-12, "mu {mu}: eps {eps}");
        }
        // Without noise the ε is unbounded; identical steps only.
        assert_eq!(epsilon(&[(0.0, 0.1, 10)], 1e-5).unwrap(), f64::INFINITY);
        assert!(epsilon(&[(1.0, 0.1, 10), (2.0, 0.1, 10)], 1e-5).is_err());
    }
}
