//! Privacy accounting for DP-SGD: how much (ε, δ)-DP a run of the
//! subsampled Gaussian mechanism has spent.
//!
//! One [`Accountant`] records the steps (noise multiplier and sample rate of
//! each, merged into runs of identical steps), knows how their batches were
//! drawn ([`Sampling`]: Poisson, fixed size without replacement, truncated
//! Poisson) and reports ε by one of four analyses ([`Mechanism`]):
//!
//! * **PRV** (the default): numerical composition of privacy loss random
//!   variables (Gopi, Lee and Wutschitz 2021), computed as Opacus's
//!   `PRVAccountant` does, with its default error band (`eps_error = 0.01`,
//!   `delta_error = δ / 1000`) and reporting the band's upper end. It is a
//!   rigorous bound and the tightest of the three: 7.67 where RDP gives 8.42
//!   for the digits example's settings. The examples report it, beside the
//!   RDP figure, because it is what Opacus's `PrivacyEngine` reports by
//!   default and so the number to compare with.
//! * **RDP**: Rényi DP (Mironov, Talwar and Zhang 2019) converted with
//!   Balle et al. (2020), as Opacus's `RDPAccountant`; looser, but cheap and
//!   standard in older papers. The functions [`compute_rdp`] and
//!   [`eps_from_rdp`] expose it order by order.
//! * **GDP**: the central-limit approximation of Gaussian DP (Opacus's
//!   `GaussianAccountant`). Not a bound (it can understate ε); for
//!   comparison only.
//! * **PLD**: privacy loss distributions with pessimistic
//!   ("connect-the-dots") discretisation, composed by FFT, as Google's
//!   `dp_accounting` computes them; within 0.0001% of its figures on a grid
//!   of Poisson, without-replacement and truncated cases, and about 0.01
//!   below PRV's reported ε (PRV reports the top of its error band). The
//!   analysis for every sampling scheme, and the default for the schemes
//!   other than Poisson.
//!
//! The state is a few numbers and saves as JSON with a checkpoint
//! ([`Accountant::to_json`], [`Accountant::from_json`]).
//!
//! ```
//! use candle_func::dp::accountant::{Accountant, Mechanism, Sampling};
//! let mut prv = Accountant::new(Mechanism::Prv);
//! let mut rdp = Accountant::new(Mechanism::Rdp);
//! for _ in 0..1000 {
//!     prv.step(1.1, 0.01)?;
//!     rdp.step(1.1, 0.01)?;
//! }
//! let (e_prv, e_rdp) = (prv.epsilon(1e-5)?, rdp.epsilon(1e-5)?);
//! assert!((e_rdp - 1.71177).abs() < 1e-3);
//! assert!((e_prv - 1.5255).abs() < 0.015 && e_prv < e_rdp);
//! let resumed = Accountant::from_json(&prv.to_json())?;
//! assert_eq!(resumed.epsilon(1e-5)?, e_prv);
//! // B = 600 of N = 60,000 each step, without replacement (replace one)
//! let mut pld = Accountant::new(Mechanism::Pld).with_sampling(Sampling::WithoutReplacement)?;
//! pld.record(1.1, 0.01, 1000)?;
//! assert!(pld.epsilon(1e-5)? > e_prv); // the replace-one pair moves further
//! assert!(Accountant::new(Mechanism::Prv).with_sampling(Sampling::WithoutReplacement).is_err());
//! # Ok::<(), candle_func::Error>(())
//! ```

mod fft;
mod gdp;
mod legacy;
mod pld;
mod prv;
mod rdp;
mod rdp_wor;
mod sampling;

#[allow(deprecated)]
pub use legacy::RdpAccountant;
pub use rdp::{compute_rdp, default_orders, eps_from_rdp, MAX_TERMS};
pub(crate) use sampling::binomial_log_pmf;
pub use sampling::Sampling;

use super::positive;
use crate::error::{Error, Result};
use rdp::is_valid_delta;

/// Which analysis an [`Accountant`] reports ε by; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mechanism {
    /// Privacy loss random variables (the default, as in Opacus).
    #[default]
    Prv,
    /// Rényi DP.
    Rdp,
    /// Gaussian DP by the central limit theorem (approximate).
    Gdp,
    /// Privacy loss distributions composed by FFT with pessimistic
    /// discretisation, as Google's `dp_accounting` computes them; the one
    /// analysis for every [`Sampling`] scheme.
    Pld,
}

impl Mechanism {
    /// Opacus's name for it: `"prv"`, `"rdp"` or `"gdp"`.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Prv => "prv",
            Mechanism::Rdp => "rdp",
            Mechanism::Gdp => "gdp",
            Mechanism::Pld => "pld",
        }
    }
}

impl std::str::FromStr for Mechanism {
    type Err = Error;

    fn from_str(s: &str) -> Result<Mechanism> {
        match s.to_ascii_lowercase().as_str() {
            "prv" => Ok(Mechanism::Prv),
            "rdp" => Ok(Mechanism::Rdp),
            "gdp" => Ok(Mechanism::Gdp),
            "pld" => Ok(Mechanism::Pld),
            _ => Err(Error::privacy(
                "Mechanism::from_str",
                "mechanism",
                "prv, rdp, gdp or pld",
                format!("{s:?}"),
            )),
        }
    }
}

/// Records the steps of a DP-SGD run and reports the ε spent, like Opacus's
/// accountants.
///
/// The history is a list of `(noise_multiplier, sample_rate, steps)`;
/// consecutive steps with identical parameters merge into one entry (exact
/// comparison, as in Opacus), so a run costs one evaluation per change of
/// parameters, not one per step.
#[derive(Clone, Debug, PartialEq)]
pub struct Accountant {
    mechanism: Mechanism,
    sampling: Sampling,
    history: Vec<(f64, f64, usize)>,
    eps_error: f64,
    interval: f64,
}

impl Accountant {
    /// An accountant with no steps recorded, reporting by `mechanism`.
    pub fn new(mechanism: Mechanism) -> Accountant {
        Accountant {
            mechanism,
            sampling: Sampling::Poisson,
            history: Vec::new(),
            eps_error: 0.01,
            interval: pld::INTERVAL,
        }
    }

    /// This accountant analysing steps drawn by `sampling` (the recorded
    /// sample rate is then that scheme's: `B / N` without replacement). An
    /// error, naming both, when the mechanism has no sound analysis of the
    /// scheme (see [`Sampling`]).
    pub fn with_sampling(mut self, sampling: Sampling) -> Result<Accountant> {
        sampling.check("Accountant::with_sampling", self.mechanism)?;
        self.sampling = sampling;
        Ok(self)
    }

    /// The scheme the steps are analysed under.
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }

    /// The PLD accountant's grid step on the privacy loss (default `1e-4`,
    /// `dp_accounting`'s `value_discretization_interval`): smaller is
    /// tighter and slower. Must be finite and positive.
    pub fn with_interval(mut self, interval: f64) -> Result<Accountant> {
        positive("Accountant::with_interval", "interval", interval, false)?;
        self.interval = interval;
        Ok(self)
    }

    /// The PRV accountant's error band on ε (default 0.01, Opacus's): the
    /// reported ε is at most this much above the estimate, and the grid
    /// grows as `1 / eps_error`. Must be finite and positive.
    pub fn with_eps_error(mut self, eps_error: f64) -> Result<Accountant> {
        positive("Accountant::with_eps_error", "eps_error", eps_error, false)?;
        self.eps_error = eps_error;
        Ok(self)
    }

    /// The same history reported by another analysis (for example the RDP
    /// figure beside the PRV one). Where that analysis does not cover the
    /// sampling scheme, [`Accountant::epsilon`] says so.
    pub fn with_mechanism(&self, mechanism: Mechanism) -> Accountant {
        Accountant {
            mechanism,
            ..self.clone()
        }
    }

    /// This accountant with no steps recorded: the same mechanism and
    /// error band.
    pub(crate) fn emptied(&self) -> Accountant {
        Accountant {
            history: Vec::new(),
            ..self.clone()
        }
    }

    /// The smallest noise multiplier whose ε after `steps` steps at
    /// `sample_rate` is at most `target_epsilon`, by this accountant's
    /// analysis, sampling scheme and error band (its history is ignored):
    /// [`noise_multiplier`] for any scheme.
    ///
    /// ```
    /// use candle_func::dp::accountant::{Accountant, Mechanism, Sampling};
    /// let wor = Accountant::new(Mechanism::Pld).with_sampling(Sampling::WithoutReplacement)?;
    /// let sigma = wor.noise_multiplier(2.0, 1e-5, 0.01, 1000)?;
    /// let mut check = wor.clone();
    /// check.record(sigma, 0.01, 1000)?;
    /// assert!(check.epsilon(1e-5)? <= 2.0);
    /// # Ok::<(), candle_func::Error>(())
    /// ```
    pub fn noise_multiplier(&self, target_epsilon: f64, delta: f64, sample_rate: f64, steps: usize) -> Result<f64> {
        self.sampling.check("Accountant::noise_multiplier", self.mechanism)?;
        noise_multiplier_with(
            "Accountant::noise_multiplier",
            self,
            target_epsilon,
            delta,
            sample_rate,
            steps,
        )
    }

    /// The analysis this accountant reports by.
    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    /// Records one step with noise multiplier `noise_multiplier` (finite,
    /// `≥ 0`) and sampling probability `sample_rate` (in `[0, 1]`).
    pub fn step(&mut self, noise_multiplier: f64, sample_rate: f64) -> Result<()> {
        self.record(noise_multiplier, sample_rate, 1)
    }

    /// Records `steps` identical steps at once.
    pub fn record(&mut self, noise_multiplier: f64, sample_rate: f64, steps: usize) -> Result<()> {
        check_step(noise_multiplier, sample_rate)?;
        if steps == 0 {
            return Ok(());
        }
        match self.history.last_mut() {
            Some((sigma, q, n)) if *sigma == noise_multiplier && *q == sample_rate => {
                *n = n.checked_add(steps).ok_or_else(|| Error::Accounting {
                    op: "Accountant::record",
                    mechanism: self.mechanism.name(),
                    msg: format!("{n} + {steps} steps overflow usize"),
                })?
            }
            _ => self.history.push((noise_multiplier, sample_rate, steps)),
        }
        Ok(())
    }

    /// The ε spent so far at `delta` (0 before any step): for PRV the upper
    /// end of the error band, as Opacus reports it. `∞` when a step had no
    /// noise. An error for `delta` outside `(0, 1)`, a constant-only
    /// mechanism (GDP) given changing steps, or a PRV grid that would not
    /// fit (see [`Accountant::with_eps_error`]). PRV also refuses a `delta`
    /// below `f64::EPSILON` times the grid's size (about 1e-10 for the
    /// digits example), where the grid's rounding could dominate; Opacus
    /// checks against `long double`'s epsilon there and computes in f64
    /// regardless.
    pub fn epsilon(&self, delta: f64) -> Result<f64> {
        Ok(self.epsilon_range(delta)?.2)
    }

    /// `(lower, estimate, upper)` of ε at `delta`. Only PRV has a band; the
    /// others give the same value three times. Each is at least 0.
    pub fn epsilon_range(&self, delta: f64) -> Result<(f64, f64, f64)> {
        if !is_valid_delta(delta) {
            return Err(Error::privacy("Accountant::epsilon", "delta", "in (0, 1)", delta));
        }
        self.sampling.check("Accountant::epsilon", self.mechanism)?;
        let same = |e: f64| [e, e, e];
        let [lo, est, hi] = match self.mechanism {
            Mechanism::Rdp if self.sampling == Sampling::WithoutReplacement => {
                same(rdp_wor::history_epsilon(&self.history, delta).0)
            }
            Mechanism::Rdp => same(rdp::history_epsilon(&self.history, delta).0),
            Mechanism::Gdp => same(gdp::epsilon(&self.history, delta)?),
            Mechanism::Pld => same(sampling::pld_epsilon(
                &self.history,
                self.sampling,
                self.interval,
                delta,
            )?),
            Mechanism::Prv => {
                let budget = prv::Budget {
                    eps_error: self.eps_error,
                    delta_error: delta / 1000.0,
                };
                prv::epsilon(&self.history, delta, budget)?
            }
        };
        // ε is never below 0: a negative figure (PRV's grid at a sample
        // rate near 0, where Opacus reports it as computed) is rounding
        let at_least_0 = |e: f64| if e < 0.0 { 0.0 } else { e };
        Ok((at_least_0(lo), at_least_0(est), at_least_0(hi)))
    }

    /// The number of steps recorded.
    pub fn steps(&self) -> usize {
        total_steps(&self.history)
    }

    /// The recorded history, `(noise_multiplier, sample_rate, steps)` per run
    /// of identical consecutive steps, oldest first.
    pub fn history(&self) -> &[(f64, f64, usize)] {
        &self.history
    }

    /// The state as JSON (Opacus's `state_dict` fields plus the error band,
    /// the PLD grid and the sampling scheme):
    /// `{"eps_error":0.01,"history":[[σ, q, steps], …],"interval":0.0001,
    /// "mechanism":"prv","sampling":{"scheme":"poisson"}}`. Numbers are
    /// written so that they read back exactly.
    pub fn to_json(&self) -> String {
        let history: Vec<serde_json::Value> = self
            .history
            .iter()
            .map(|&(s, q, n)| serde_json::json!([s, q, n]))
            .collect();
        let mut sampling = serde_json::json!({ "scheme": self.sampling.name() });
        if let Sampling::TruncatedPoisson {
            dataset_size,
            max_batch,
        } = self.sampling
        {
            sampling["dataset_size"] = dataset_size.into();
            sampling["max_batch"] = max_batch.into();
        }
        serde_json::json!({
            "mechanism": self.mechanism.name(),
            "eps_error": self.eps_error,
            "interval": self.interval,
            "sampling": sampling,
            "history": history,
        })
        .to_string()
    }

    /// An accountant from [`Accountant::to_json`]'s output; every entry is
    /// checked as [`Accountant::step`] checks it.
    pub fn from_json(json: &str) -> Result<Accountant> {
        let bad = |why: &str| Error::Checkpoint {
            what: "Accountant::from_json",
            msg: format!("cannot restore: {why}"),
        };
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| bad(&e.to_string()))?;
        let mechanism: Mechanism = v["mechanism"]
            .as_str()
            .ok_or_else(|| bad("no \"mechanism\" string"))?
            .parse()
            .map_err(|e: Error| bad(&e.to_string()))?;
        let eps_error = v["eps_error"].as_f64().ok_or_else(|| bad("no \"eps_error\" number"))?;
        // state saved before PLD and sampling schemes: PLD's grid, Poisson
        let interval = match v.get("interval") {
            None => pld::INTERVAL,
            Some(i) => i.as_f64().ok_or_else(|| bad("\"interval\" is not a number"))?,
        };
        let sampling = match v.get("sampling") {
            None => Sampling::Poisson,
            Some(s) => sampling_from_json(s).map_err(|why| bad(&why))?,
        };
        let mut acc = Accountant::new(mechanism)
            .with_eps_error(eps_error)
            .and_then(|a| a.with_interval(interval))
            .and_then(|a| a.with_sampling(sampling))
            .map_err(|e| bad(&e.to_string()))?;
        let entries = v["history"].as_array().ok_or_else(|| bad("no \"history\" list"))?;
        for e in entries {
            let (sigma, q, n) = match e.as_array().map(|a| a.as_slice()) {
                Some([s, q, n]) => (s.as_f64(), q.as_f64(), n.as_u64()),
                _ => (None, None, None),
            };
            let (Some(sigma), Some(q), Some(n)) = (sigma, q, n) else {
                return Err(bad(&format!("history entry {e} is not [sigma, q, steps]")));
            };
            let n = usize::try_from(n).map_err(|_| bad("a step count overflows usize"))?;
            // Pushed as saved, not merged: the history reads back unchanged.
            check_step(sigma, q).map_err(|err| bad(&format!("history entry {e}: {err}")))?;
            acc.history.push((sigma, q, n));
        }
        Ok(acc)
    }
}

impl Default for Accountant {
    /// A PRV accountant, Opacus's default.
    fn default() -> Accountant {
        Accountant::new(Mechanism::Prv)
    }
}

/// A [`Sampling`] from its saved form.
fn sampling_from_json(v: &serde_json::Value) -> std::result::Result<Sampling, String> {
    let count = |key: &str| {
        v[key]
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("sampling has no \"{key}\" count"))
    };
    match v["scheme"].as_str() {
        Some("poisson") => Ok(Sampling::Poisson),
        Some("without_replacement") => Ok(Sampling::WithoutReplacement),
        Some("truncated_poisson") => Ok(Sampling::TruncatedPoisson {
            dataset_size: count("dataset_size")?,
            max_batch: count("max_batch")?,
        }),
        _ => Err(format!("unknown sampling {v}")),
    }
}

/// The steps of a history, saturating.
fn total_steps(history: &[(f64, f64, usize)]) -> usize {
    history.iter().fold(0usize, |acc, &(_, _, n)| acc.saturating_add(n))
}

/// The entries that release anything: sampled (`q > 0`) at least once.
fn live(history: &[(f64, f64, usize)]) -> Vec<(f64, f64, usize)> {
    history.iter().copied().filter(|&(_, q, n)| q > 0.0 && n > 0).collect()
}

fn check_step(noise_multiplier: f64, sample_rate: f64) -> Result<()> {
    positive("Accountant::step", "noise_multiplier", noise_multiplier, true)?;
    if !(0.0..=1.0).contains(&sample_rate) {
        return Err(Error::privacy(
            "Accountant::step",
            "sample_rate",
            "in [0, 1]",
            sample_rate,
        ));
    }
    Ok(())
}

/// The smallest noise multiplier whose ε after `steps` steps at
/// `sample_rate` is at most `target_epsilon`, by `mechanism`'s analysis.
///
/// This follows Opacus's `get_noise_multiplier` step for step, so that both
/// return the same σ: double σ from 20 until ε ≤ target (giving up once σ
/// would exceed 10⁶), then bisect on `[0, σ]`, keeping the upper end (whose ε
/// is always ≤ target), until ε is within `0.01` of the target. Note that
/// Opacus's tolerance, kept here, is absolute and on ε (`target - ε ≤ 0.01`),
/// not relative on σ. The bisection is capped at 200 halvings (past any
/// `f64` resolution), after which the current upper end is returned.
///
/// An error when no σ ≤ 10⁶ reaches the target (ε has a floor above zero:
/// about 0.1 at `δ = 10⁻⁵` under RDP, from its conversion, and the error
/// band `eps_error` under PRV, 0.01 by default, since the reported ε is the
/// band's upper end; a target near the floor is reached only with a huge
/// σ), and for
/// invalid inputs (`target_epsilon` NaN or `≤ 0`, `delta` outside `(0, 1)`,
/// `sample_rate` outside `[0, 1]`). When the noise cannot matter
/// (`sample_rate = 0` or `steps = 0`) the answer is 0 (Opacus would loop
/// forever there).
pub fn noise_multiplier(
    mechanism: Mechanism,
    target_epsilon: f64,
    delta: f64,
    sample_rate: f64,
    steps: usize,
) -> Result<f64> {
    let template = Accountant::new(mechanism);
    noise_multiplier_with("noise_multiplier", &template, target_epsilon, delta, sample_rate, steps)
}

/// The previous release's search: RDP only, `None` for a target no noise
/// reaches and for invalid inputs.
#[deprecated(
    since = "0.2.0",
    note = "use dp::accountant::noise_multiplier(Mechanism::Rdp, target_epsilon, delta, sample_rate, steps), which returns a Result saying why it failed (and takes PRV, Opacus's default)"
)]
pub fn noise_multiplier_for(target_epsilon: f64, delta: f64, sample_rate: f64, steps: usize) -> Option<f64> {
    noise_multiplier(Mechanism::Rdp, target_epsilon, delta, sample_rate, steps).ok()
}

/// [`noise_multiplier`] by the analysis and error band of `template` (its
/// history is ignored), its errors naming `op`.
pub(crate) fn noise_multiplier_with(
    op: &'static str,
    template: &Accountant,
    target_epsilon: f64,
    delta: f64,
    sample_rate: f64,
    steps: usize,
) -> Result<f64> {
    const MAX_SIGMA: f64 = 1e6;
    const EPSILON_TOLERANCE: f64 = 0.01;
    const MAX_HALVINGS: usize = 200;
    // an infinite target is reached by no noise at all, which is no
    // privacy: a bad input rather than a request for sigma = 0
    positive(op, "target_epsilon", target_epsilon, false)?;
    if !(0.0..=1.0).contains(&sample_rate) {
        return Err(Error::privacy(op, "sample_rate", "in [0, 1]", sample_rate));
    }
    let mechanism = template.mechanism;
    let eps_at = |sigma: f64| {
        let mut acc = Accountant {
            history: Vec::new(),
            ..template.clone()
        };
        acc.record(sigma, sample_rate, steps)?;
        acc.epsilon(delta)
    };
    if !is_valid_delta(delta) {
        return Err(Error::privacy(op, "delta", "in (0, 1)", delta));
    }
    if sample_rate == 0.0 || steps == 0 {
        return Ok(0.0);
    }
    let unreachable = || Error::Accounting {
        op,
        mechanism: mechanism.name(),
        msg: format!(
            "no noise multiplier up to {MAX_SIGMA:e} reaches epsilon {target_epsilon} at delta {delta:e} \
             (sample rate {sample_rate}, {steps} steps)"
        ),
    };
    let (mut sigma_low, mut sigma_high, mut eps_high) = (0.0, 10.0, f64::INFINITY);
    // A NaN ε counts as "not reached".
    while eps_high.is_nan() || eps_high > target_epsilon {
        sigma_high *= 2.0;
        if sigma_high > MAX_SIGMA {
            return Err(unreachable());
        }
        eps_high = eps_at(sigma_high)?;
    }
    for _ in 0..MAX_HALVINGS {
        // eps_high is finite and at most the target here.
        if target_epsilon - eps_high <= EPSILON_TOLERANCE {
            break;
        }
        let sigma = (sigma_low + sigma_high) / 2.0;
        match eps_at(sigma) {
            Ok(eps) if eps < target_epsilon => {
                sigma_high = sigma;
                eps_high = eps;
            }
            // Too little noise; where the PRV grid for it would not fit,
            // its ε is far above any target the upper end reached.
            _ => sigma_low = sigma,
        }
    }
    Ok(sigma_high)
}

#[cfg(test)]
mod tests;
