//! Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning
//! with Adaptive Clipping"; Opacus's `AdaClipDPOptimizer`): the flat bound
//! `C` follows a target quantile `γ` of the per-example gradient norms.
//! After each step
//!
//! ```text
//! b = (#{i : ||g_i|| <= C} + N(0, σ_b²)) / (q N)
//! C <- clamp(C exp(-η (b - γ)), min_bound, max_bound)
//! ```
//!
//! The count is released with noise too, so the gradient's noise
//! multiplier is raised to `σ_g = (σ⁻² - (2 σ_b)⁻²)^(-1/2)` (the paper's
//! Theorem 1): the count and the gradient together cost what one Gaussian
//! query of multiplier `σ` costs, and the accountant records `σ`.

use crate::error::{Error, Result};
use crate::rng::Rng;

/// The settings of adaptive clipping (see the module docs and
/// [`DpConfig::adaptive`](super::DpConfig::adaptive)).
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveClipping {
    /// The bound of the first step.
    pub initial_bound: f64,
    /// `γ`: the fraction of examples the bound should leave unclipped.
    pub target_quantile: f64,
    /// `η`, the geometric update's rate (the paper's 0.2 by default).
    pub learning_rate: f64,
    /// The bound never goes below this (default 1e-6)...
    pub min_bound: f64,
    /// ...nor above this (default unbounded).
    pub max_bound: f64,
    /// `σ_b`, the count's noise; `None` is the paper's choice, the expected
    /// batch size over 20.
    pub count_noise_std: Option<f64>,
}

impl AdaptiveClipping {
    /// A bound starting at `initial_bound` that tracks the
    /// `target_quantile` of the norms, with the paper's defaults.
    pub fn new(initial_bound: f64, target_quantile: f64) -> AdaptiveClipping {
        AdaptiveClipping {
            initial_bound,
            target_quantile,
            learning_rate: 0.2,
            min_bound: 1e-6,
            max_bound: f64::INFINITY,
            count_noise_std: None,
        }
    }
}

/// Adaptive clipping's state in a trainer: the current bound and the two
/// noise multipliers.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Adaptive {
    pub(super) spec: AdaptiveClipping,
    /// The bound the next step clips to.
    pub(super) bound: f64,
    /// `σ_b`.
    pub(super) count_std: f64,
    /// `σ_g`, the gradient's noise multiplier.
    pub(super) grad_sigma: f64,
}

impl Adaptive {
    /// The checked settings for a run of noise multiplier `sigma` and
    /// expected batch size `expected`.
    pub(super) fn new(spec: &AdaptiveClipping, sigma: f64, expected: f64) -> Result<Adaptive> {
        const OP: &str = "make_private";
        super::positive(OP, "adaptive initial_bound", spec.initial_bound, false)?;
        super::positive(OP, "adaptive learning_rate", spec.learning_rate, true)?;
        super::positive(OP, "adaptive min_bound", spec.min_bound, false)?;
        if spec.max_bound.is_nan() || spec.max_bound < spec.min_bound {
            let expected = format!(">= min_bound ({})", spec.min_bound);
            return Err(Error::privacy(OP, "adaptive max_bound", expected, spec.max_bound));
        }
        if !(0.0..=1.0).contains(&spec.target_quantile) {
            return Err(Error::privacy(
                OP,
                "adaptive target_quantile",
                "in [0, 1]",
                spec.target_quantile,
            ));
        }
        let count_std = spec.count_noise_std.unwrap_or(expected / 20.0);
        if sigma == 0.0 {
            // no privacy asked for: neither release is noised
            return Ok(Adaptive {
                spec: spec.clone(),
                bound: spec.initial_bound,
                count_std: 0.0,
                grad_sigma: 0.0,
            });
        }
        if !(count_std.is_finite() && 2.0 * count_std > sigma) {
            let expected = format!(
                "finite and > noise_multiplier / 2 = {} (the count's share of σ)",
                sigma / 2.0
            );
            return Err(Error::privacy(OP, "adaptive count_noise_std", expected, count_std));
        }
        let grad_sigma = (sigma.powi(-2) - (2.0 * count_std).powi(-2)).powf(-0.5);
        Ok(Adaptive {
            spec: spec.clone(),
            bound: spec.initial_bound.clamp(spec.min_bound, spec.max_bound),
            count_std,
            grad_sigma,
        })
    }

    /// The count's noise, drawn by the one rank that draws.
    pub(super) fn count_noise(&self, rng: &mut Rng) -> f64 {
        if self.count_std == 0.0 {
            return 0.0;
        }
        rng.normal() * self.count_std
    }

    /// The geometric update from the noised count of unclipped examples.
    pub(super) fn update(&mut self, noisy_unclipped: f64, expected: f64) {
        let frac = noisy_unclipped / expected;
        let s = &self.spec;
        let next = self.bound * (-s.learning_rate * (frac - s.target_quantile)).exp();
        self.bound = next.clamp(s.min_bound, s.max_bound);
    }
}
