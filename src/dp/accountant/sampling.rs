//! How each step's batch is drawn, and the accounting that is sound for it.
//!
//! The privacy a step spends depends on how its batch was drawn, so the
//! scheme is part of the accountant: a run sampled one way cannot be
//! reported as another (Chua et al., NeurIPS 2024, "How Private are DP-SGD
//! Implementations?", show that shuffled batches reported with Poisson
//! accounting can overstate privacy by a wide margin).

use super::pld::Pld;
use super::Mechanism;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// How each step's batch is drawn; the accountant analyses the run under it
/// (see [`Mechanism`] for which analyses apply to which scheme).
///
/// | scheme | neighbouring datasets | analyses |
/// | --- | --- | --- |
/// | `Poisson` | add or remove one | PRV, RDP, PLD, GDP |
/// | `WithoutReplacement` | replace one | PLD, RDP |
/// | `TruncatedPoisson` | add or remove one | PLD |
/// | `Shuffled` | — | none: refused |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Sampling {
    /// Each example joins each step's batch independently with probability
    /// `q` (the recorded sample rate); the batch size varies. Opacus's
    /// scheme and the default.
    #[default]
    Poisson,
    /// Each step draws exactly `B` of the `N` examples without replacement;
    /// the recorded sample rate is `B / N`. The guarantee is for datasets
    /// that differ by replacing one example (`N` is public), under which the
    /// clipped sum moves by up to `2C`: PLD analyses the pair
    /// `(1-q) N(0, σ²) + q N(∓1, σ²)` (in units of `C`); RDP uses Wang,
    /// Balle and Kasiviswanathan's bound with noise `σ / 2` over the
    /// sensitivity, as `dp_accounting` does for
    /// `SampledWithoutReplacementDpEvent`.
    WithoutReplacement,
    /// Poisson sampling at rate `q` whose batch is cut to `max_batch`
    /// examples (a fixed upper shape for accelerators; the excess, chosen
    /// uniformly, is dropped). Accounted as `dp_accounting`'s
    /// `TruncatedSubsampledGaussianDpEvent`: with probability `p` that the
    /// other `N - 1` examples alone reach `max_batch` the step is treated
    /// as a replace-one Gaussian with noise `σ / 2` sampled at the chance
    /// that a given example survives the cut, otherwise as the Poisson
    /// step; the two PLDs are mixed with weights `p` and `1 - p`. Choose
    /// `max_batch` several standard deviations above `q N`: where the cut
    /// is likely, ε grows fast.
    TruncatedPoisson {
        /// `N`, the number of examples sampled from.
        dataset_size: usize,
        /// The largest batch kept.
        max_batch: usize,
    },
    /// Shuffled epochs: every example once per epoch, in fixed batches.
    /// Named so that asking for it gets a reason rather than a silent
    /// substitute: every accountant refuses it. Its amplification has no
    /// tight analysis here, and reporting it as Poisson (as most DP-SGD
    /// code does) overstates privacy, sometimes several-fold in ε (Chua
    /// et al., NeurIPS 2024). Fixed-size batches are
    /// [`Sampling::WithoutReplacement`], which has one.
    Shuffled,
}

impl Sampling {
    /// The scheme's name in saved state and messages.
    pub fn name(self) -> &'static str {
        match self {
            Sampling::Poisson => "poisson",
            Sampling::WithoutReplacement => "without_replacement",
            Sampling::TruncatedPoisson { .. } => "truncated_poisson",
            Sampling::Shuffled => "shuffled",
        }
    }

    /// Whether `mechanism` has a sound analysis of this scheme.
    pub fn accounted_by(self, mechanism: Mechanism) -> bool {
        matches!(
            (self, mechanism),
            (Sampling::Poisson, _)
                | (Sampling::WithoutReplacement, Mechanism::Pld | Mechanism::Rdp)
                | (Sampling::TruncatedPoisson { .. }, Mechanism::Pld)
        )
    }

    /// An error unless `mechanism` analyses this scheme, naming both.
    pub(super) fn check(self, op: &'static str, mechanism: Mechanism) -> Result<()> {
        if let Sampling::TruncatedPoisson {
            dataset_size,
            max_batch,
        } = self
        {
            if dataset_size == 0 || max_batch == 0 {
                return Err(Error::Accounting {
                    op,
                    mechanism: mechanism.name(),
                    msg: format!(
                        "truncated Poisson sampling needs dataset_size and max_batch >= 1, \
                         got {dataset_size} and {max_batch}"
                    ),
                });
            }
        }
        if self.accounted_by(mechanism) {
            return Ok(());
        }
        if self == Sampling::Shuffled {
            return Err(Error::Accounting {
                op,
                mechanism: mechanism.name(),
                msg: "shuffled epochs have no sound accounting here: reporting them as Poisson \
                      overstates privacy (Chua et al., NeurIPS 2024, measure the gap); use \
                      Sampling::WithoutReplacement for fixed-size batches, or Sampling::Poisson"
                    .into(),
            });
        }
        let offered: Vec<&str> = [Mechanism::Pld, Mechanism::Prv, Mechanism::Rdp, Mechanism::Gdp]
            .into_iter()
            .filter(|&m| self.accounted_by(m))
            .map(Mechanism::name)
            .collect();
        Err(Error::Accounting {
            op,
            mechanism: mechanism.name(),
            msg: format!(
                "{} sampling has no sound {} analysis here; use {}",
                self.name(),
                mechanism.name(),
                offered.join(" or ")
            ),
        })
    }

    /// The PLD of one step at noise `sigma > 0` and rate `q ∈ (0, 1]`.
    pub(super) fn step_pld(self, sigma: f64, q: f64, h: f64) -> Result<Pld> {
        match self {
            Sampling::Poisson => Pld::poisson(sigma, q, h),
            Sampling::WithoutReplacement => Pld::replace(sigma, q, h),
            Sampling::Shuffled => Err(Error::internal(
                "Sampling::step_pld",
                "shuffled sampling is never accounted",
            )),
            Sampling::TruncatedPoisson {
                dataset_size,
                max_batch,
            } => {
                let plain = Pld::poisson(sigma, q, h)?;
                let (n, b) = (dataset_size as u64, max_batch as u64);
                // the chance that the other N - 1 examples alone fill the batch
                let cut = binomial_at_least(n - 1, q, b);
                if cut == 0.0 {
                    return Ok(plain);
                }
                // the chance that a given example survives a cut batch
                let kept = binomial_at_least(n, q, b + 1) * b as f64 / (cut * n as f64);
                let cut_step = Pld::replace(sigma / 2.0, kept.min(1.0), h)?;
                Ok(cut_step.mixture(&plain, cut))
            }
        }
    }

    /// One step's batch of the `n` examples, in increasing order: Poisson
    /// at rate `q`; exactly `batch` of them without replacement; or Poisson
    /// cut to `max_batch` by a uniformly chosen subset.
    pub(crate) fn draw(self, rng: &mut Rng, n: usize, q: f64, batch: usize) -> Vec<usize> {
        match self {
            Sampling::Poisson | Sampling::Shuffled => rng.poisson_sample(n, q),
            Sampling::WithoutReplacement => rng.subset(n, batch),
            Sampling::TruncatedPoisson { max_batch, .. } => {
                let all = rng.poisson_sample(n, q);
                if all.len() <= max_batch {
                    return all;
                }
                rng.subset(all.len(), max_batch).into_iter().map(|i| all[i]).collect()
            }
        }
    }
}

/// The ε at `delta` of a history under `sampling` by PLD with grid `h`.
pub(super) fn pld_epsilon(history: &[(f64, f64, usize)], sampling: Sampling, h: f64, delta: f64) -> Result<f64> {
    let live = super::live(history);
    if live.is_empty() {
        return Ok(0.0);
    }
    if live.iter().any(|&(sigma, _, _)| sigma == 0.0) {
        return Ok(f64::INFINITY);
    }
    let mut total: Option<Pld> = None;
    for &(sigma, q, n) in &live {
        let run = sampling.step_pld(sigma, q, h)?.self_composed(n)?;
        total = Some(match total {
            None => run,
            Some(t) => t.composed(&run),
        });
    }
    Ok(total.expect("live is not empty").epsilon(delta))
}

/// `ln P[X = k]` for `X ~ Binomial(n, q)`, `0 < q < 1`.
pub(crate) fn binomial_log_pmf(n: u64, q: f64, k: u64) -> f64 {
    let (n, k) = (n as f64, k as f64);
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0) + k * q.ln() + (n - k) * (-q).ln_1p()
}

/// `P(X ≥ k)` for `X ~ Binomial(n, q)`: the terms summed outward from `k`
/// by their ratios, from the side of the mean that converges; relative
/// error about `1e-7` at `n = 10⁷` (from `lgamma`'s absolute error).
pub(super) fn binomial_at_least(n: u64, q: f64, k: u64) -> f64 {
    if k == 0 || q >= 1.0 {
        return if k <= n { 1.0 } else { 0.0 };
    }
    if k > n || q <= 0.0 {
        return 0.0;
    }
    let log_pmf = |j: u64| binomial_log_pmf(n, q, j);
    let odds = q / (1.0 - q);
    if k as f64 > n as f64 * q {
        // upper tail: t_{j+1} = t_j (n - j) / (j + 1) · q / (1 - q)
        let (mut t, mut sum, mut j) = (log_pmf(k).exp(), 0.0, k);
        while t > 0.0 && t > sum * 1e-18 {
            sum += t;
            if j == n {
                break;
            }
            t *= (n - j) as f64 / (j + 1) as f64 * odds;
            j += 1;
        }
        sum
    } else {
        // 1 - P(X ≤ k - 1), summing downward: t_{j-1} = t_j j / (n - j + 1) · (1 - q) / q
        let (mut t, mut sum, mut j) = (log_pmf(k - 1).exp(), 0.0, k - 1);
        while t > 0.0 && t > sum * 1e-18 {
            sum += t;
            if j == 0 {
                break;
            }
            t *= j as f64 / (n - j + 1) as f64 / odds;
            j -= 1;
        }
        (1.0 - sum).max(0.0)
    }
}
