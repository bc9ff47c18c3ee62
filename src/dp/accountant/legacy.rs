//! The previous release's RDP accountant, kept for one release so that
//! programs written against it still build (see [`Accountant`]).

#![allow(deprecated)]

use super::rdp;
#[cfg(doc)]
use super::Accountant;

/// The previous release's RDP-only accountant: steps unchecked, ε a plain
/// number (NaN or infinite where a step was out of range). Port to
/// `Accountant::new(Mechanism::Rdp)`, whose `step` and `epsilon` return a
/// `Result` saying what was wrong (or to `Accountant::default()`, PRV,
/// Opacus's default and a tighter ε).
#[deprecated(
    since = "0.2.0",
    note = "use dp::accountant::Accountant::new(Mechanism::Rdp): its step and epsilon return a Result"
)]
#[derive(Clone, Debug, Default)]
pub struct RdpAccountant {
    history: Vec<(f64, f64, usize)>,
}

impl RdpAccountant {
    /// An accountant with no steps recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one step; out-of-range values are kept and make
    /// [`RdpAccountant::epsilon`] NaN or infinite, as they did.
    pub fn step(&mut self, noise_multiplier: f64, sample_rate: f64) {
        match self.history.last_mut() {
            Some((sigma, q, n)) if *sigma == noise_multiplier && *q == sample_rate => *n = n.saturating_add(1),
            _ => self.history.push((noise_multiplier, sample_rate, 1)),
        }
    }

    /// ε spent so far at `delta` (0 before any step; NaN for a `delta`
    /// outside `(0, 1)`, NaN or infinite after a step out of range).
    pub fn epsilon(&self, delta: f64) -> f64 {
        self.privacy_spent(delta).0
    }

    /// `(ε, best order)` spent so far at `delta`; `(0, 0)` before any step.
    pub fn privacy_spent(&self, delta: f64) -> (f64, f64) {
        rdp::history_epsilon(&self.history, delta)
    }

    /// The number of steps recorded.
    pub fn steps(&self) -> usize {
        self.history
            .iter()
            .fold(0usize, |acc, &(_, _, n)| acc.saturating_add(n))
    }

    /// `(noise_multiplier, sample_rate, steps)` per run of identical steps.
    pub fn history(&self) -> &[(f64, f64, usize)] {
        &self.history
    }
}
