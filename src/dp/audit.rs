//! Empirical privacy auditing in one training run (Steinke, Nasr and
//! Jagielski 2023, "Privacy Auditing with One (1) Training Run").
//!
//! Insert `m` canaries, each independently with probability ½ (a secret
//! coin), train once, score every canary, guess "in" for the highest `k`
//! scores and "out" for the lowest `k`. If the training is (ε, δ)-DP, the
//! number of correct guesses `v` out of `r = 2k` is no more likely than a
//! binomial with success probability `e^ε / (1 + e^ε)` allows, up to a
//! `δ` term (the paper's theorem 3). The largest ε that this rejects at the
//! chosen confidence is a lower bound on the true ε: a bound above the
//! accountant's ε means the mechanism is broken.
//!
//! Two kinds of canary:
//!
//! * **white-box gradient canaries** ([`Canaries`],
//!   [`PrivateTrainer::insert_canaries`](super::PrivateTrainer::insert_canaries)):
//!   each canary is a coordinate of the parameters; an included canary is
//!   sampled like an example each step and adds the sensitivity to its
//!   coordinate of the clipped sum, before the noise; its score is the sum
//!   over steps of that coordinate of the noisy gradient (what an auditor
//!   who sees every update sees);
//! * **input-space canaries** (black box): examples the caller inserts in
//!   the training data on [`Canaries::coins`]'s coins and scores on the
//!   final model (a negated loss, say), then passes to [`one_run`].

use super::accountant::binomial_log_pmf;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// The outcome of a one-run audit.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct AuditReport {
    /// The ε lower bound at the requested confidence (0 when nothing is
    /// rejected).
    pub epsilon_lower_bound: f64,
    /// Canaries inserted or not, `m`.
    pub canaries: usize,
    /// Guesses made by the best cut (`r`).
    pub guesses: usize,
    /// How many of those guesses were right (`v`).
    pub correct: usize,
}

fn check(op: &'static str, m: usize, r: usize, v: usize, delta: f64) -> Result<()> {
    if !(v <= r && r <= m) {
        return Err(Error::privacy(
            op,
            "guesses",
            format!("v <= r <= m, here v = {v}, r = {r}, m = {m}"),
            r,
        ));
    }
    if !(0.0..=1.0).contains(&delta) {
        return Err(Error::privacy(op, "delta", "in [0, 1]", delta));
    }
    Ok(())
}

/// The probability, under the hypothesis that training is (ε, δ)-DP, of
/// `v` or more correct guesses out of `r` on `m` canaries (the paper's
/// theorem 3): `β + 2 m δ α` with `β = P[Bin(r, q) ≥ v]`,
/// `α = max_i P[v - i ≤ Bin(r, q) < v] / i` and `q = e^ε / (1 + e^ε)`,
/// at most 1.
pub fn p_value(m: usize, r: usize, v: usize, epsilon: f64, delta: f64) -> Result<f64> {
    check("audit::p_value", m, r, v, delta)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(Error::privacy("audit::p_value", "epsilon", ">= 0", epsilon));
    }
    let q = 1.0 / (1.0 + (-epsilon).exp());
    if q >= 1.0 {
        return Ok(1.0);
    }
    let pmf = |k: usize| binomial_log_pmf(r as u64, q, k as u64).exp();
    let beta: f64 = (v..=r).map(pmf).sum();
    let (mut alpha, mut below) = (0.0f64, 0.0f64);
    for i in 1..=v {
        below += pmf(v - i);
        alpha = alpha.max(below / i as f64);
    }
    Ok((beta + 2.0 * m as f64 * delta * alpha).min(1.0))
}

/// The largest ε that `v` correct guesses out of `r` on `m` canaries reject
/// at `confidence` (the p-value at most `1 - confidence`), by bisection;
/// 0 when even ε = 0 is not rejected.
pub fn epsilon_lower_bound(m: usize, r: usize, v: usize, delta: f64, confidence: f64) -> Result<f64> {
    const OP: &str = "audit::epsilon_lower_bound";
    check(OP, m, r, v, delta)?;
    if !(confidence > 0.0 && confidence < 1.0) {
        return Err(Error::privacy(OP, "confidence", "in (0, 1)", confidence));
    }
    let level = 1.0 - confidence;
    if p_value(m, r, v, 0.0, delta)? > level {
        return Ok(0.0);
    }
    let (mut lo, mut hi) = (0.0f64, 50.0f64);
    if p_value(m, r, v, hi, delta)? <= level {
        return Ok(hi);
    }
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if p_value(m, r, v, mid, delta)? <= level {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The audit of `scores` (higher = more likely inserted) of canaries
/// `inserted` (the secret coins): for each cut `k` in a fixed grid (1%,
/// 2%, 5%, 10%, 20% and 50% of `m`), guess "in" for the `k` highest scores
/// and "out" for the `k` lowest, and report the cut with the largest
/// bound. Each cut is tested at `1 - (1 - confidence) / cuts` (Bonferroni),
/// so the reported bound holds at `confidence` whatever cut wins.
pub fn one_run(scores: &[f64], inserted: &[bool], delta: f64, confidence: f64) -> Result<AuditReport> {
    const OP: &str = "audit::one_run";
    let m = scores.len();
    if m != inserted.len() || m < 2 {
        return Err(Error::shape(
            OP,
            &[&[m], &[inserted.len()]],
            "one score per canary, at least 2",
        ));
    }
    if !(confidence > 0.0 && confidence < 1.0) {
        return Err(Error::privacy(OP, "confidence", "in (0, 1)", confidence));
    }
    if let Some(i) = scores.iter().position(|s| s.is_nan()) {
        return Err(Error::privacy(OP, format!("score {i}"), "a number", "NaN"));
    }
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let mut cuts: Vec<usize> = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
        .iter()
        .map(|f| ((f * m as f64) as usize).clamp(1, m / 2))
        .collect();
    cuts.dedup();
    let per_cut = 1.0 - (1.0 - confidence) / cuts.len() as f64;
    let mut best = AuditReport {
        epsilon_lower_bound: 0.0,
        canaries: m,
        guesses: 0,
        correct: 0,
    };
    for &k in &cuts {
        let right_in = order[..k].iter().filter(|&&i| inserted[i]).count();
        let right_out = order[m - k..].iter().filter(|&&i| !inserted[i]).count();
        let (r, v) = (2 * k, right_in + right_out);
        let eps = epsilon_lower_bound(m, r, v, delta, per_cut)?;
        if eps > best.epsilon_lower_bound || best.guesses == 0 {
            best = AuditReport {
                epsilon_lower_bound: eps,
                canaries: m,
                guesses: r,
                correct: v,
            };
        }
    }
    Ok(best)
}

/// White-box gradient canaries for a one-run audit of a private trainer
/// (see the module docs): `m` coordinates of the trainable parameters,
/// each inserted on a secret coin.
#[derive(Debug)]
pub struct Canaries {
    pub(super) inserted: Vec<bool>,
    pub(super) rng: Rng,
    pub(super) scale: f64,
    /// `(parameter, flat index)` of each canary, chosen when inserted.
    pub(super) coords: Vec<(String, usize)>,
    pub(super) scores: Vec<f64>,
}

impl Canaries {
    /// `m ≥ 2` canaries whose coins, coordinates and sampling come from
    /// `seed` (keep it from the training code: the coins are the secret).
    pub fn new(m: usize, seed: u64) -> Result<Canaries> {
        if m < 2 {
            return Err(Error::privacy("Canaries::new", "m", ">= 2", m));
        }
        let inserted = Canaries::coins(m, seed);
        Ok(Canaries {
            inserted,
            rng: Rng::seeded(seed ^ 0x5EED_CA4A),
            scale: 1.0,
            coords: Vec::new(),
            scores: vec![0.0; m],
        })
    }

    /// `m` fair coins from `seed`: which canaries are inserted (for
    /// input-space canaries, which the caller inserts itself).
    pub fn coins(m: usize, seed: u64) -> Vec<bool> {
        let mut rng = Rng::seeded(seed);
        (0..m).map(|_| rng.uniform() < 0.5).collect()
    }

    /// Canaries that enter at `factor` times the sensitivity: a simulated
    /// clipping failure (an unclipped gradient), to check that the audit
    /// catches one. Must be finite and positive.
    pub fn scaled(mut self, factor: f64) -> Result<Canaries> {
        super::positive("Canaries::scaled", "factor", factor, false)?;
        self.scale = factor;
        Ok(self)
    }

    /// The secret coins.
    pub fn inserted(&self) -> &[bool] {
        &self.inserted
    }

    /// Each canary's score so far.
    pub fn scores(&self) -> &[f64] {
        &self.scores
    }
}

impl<F, O, S> super::PrivateTrainer<F, O, S>
where
    F: super::ExampleLoss<S>,
    O: super::Optimizer,
{
    /// Inserts white-box gradient canaries (see the module docs) into this
    /// trainer's following steps: `m` distinct coordinates of the trainable
    /// parameters, chosen from the canaries' seed. An error when
    /// distributed, or when the parameters have fewer than `m` entries.
    pub fn insert_canaries(&mut self, mut canaries: Canaries) -> Result<()> {
        const OP: &str = "PrivateTrainer::insert_canaries";
        if self.comm.is_some() {
            return Err(Error::data(OP, "auditing runs on one process"));
        }
        // the canaries join each step as Poisson-sampled examples do, so the
        // audit measures the add/remove-one guarantee of a Poisson run
        let sampling = self.setup.accountant.sampling();
        if sampling != crate::dp::accountant::Sampling::Poisson {
            return Err(Error::data(
                OP,
                format!(
                    "white-box canaries audit Poisson-sampled runs; this one samples {}",
                    sampling.name()
                ),
            ));
        }
        let params = self.params_now()?;
        // where each parameter's entries start in the flat order
        let mut starts = Vec::with_capacity(params.len());
        let mut total = 0usize;
        for t in params.values() {
            starts.push(total);
            total += t.elem_count();
        }
        let names: Vec<&String> = params.keys().collect();
        let m = canaries.inserted.len();
        if m > total {
            return Err(Error::privacy(
                OP,
                "canaries",
                format!("at most the {total} trainable entries"),
                m,
            ));
        }
        canaries.coords = canaries
            .rng
            .subset(total, m)
            .into_iter()
            .map(|flat| {
                // the last parameter starting at or before `flat` holds it
                let k = starts.partition_point(|&s| s <= flat) - 1;
                (names[k].clone(), flat - starts[k])
            })
            .collect();
        self.canaries = Some(canaries);
        Ok(())
    }

    /// The one-run audit of the canaries' scores so far ([`one_run`]), at
    /// `delta` and `confidence`; an error without canaries.
    pub fn audit(&self, delta: f64, confidence: f64) -> Result<AuditReport> {
        let c = self
            .canaries
            .as_ref()
            .ok_or_else(|| Error::data("PrivateTrainer::audit", "no canaries were inserted"))?;
        one_run(&c.scores, &c.inserted, delta, confidence)
    }

    /// Adds this step's sampled inserted canaries to the clipped `sum`,
    /// each the sensitivity (times the canaries' scale) on its coordinate.
    pub(super) fn add_canaries(
        &mut self,
        sum: &mut std::collections::BTreeMap<String, candle_core::Tensor>,
    ) -> Result<()> {
        let unit = if self.setup.adaptive.is_some() {
            1.0
        } else {
            self.setup.sensitivity
        };
        let q = self.setup.sample_rate;
        let Some(c) = self.canaries.as_mut() else {
            return Ok(());
        };
        let mut bumps: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
        for (i, (name, at)) in c.coords.iter().enumerate() {
            if c.inserted[i] && c.rng.uniform() < q {
                bumps.entry(name).or_default().push(*at);
            }
        }
        for (name, ats) in bumps {
            let s = &sum[name];
            let mut add = vec![0f64; s.elem_count()];
            for at in ats {
                add[at] += unit * c.scale;
            }
            let add = candle_core::Tensor::from_vec(add, s.shape(), s.device())?.to_dtype(s.dtype())?;
            sum.insert(name.to_string(), (s + add)?);
        }
        Ok(())
    }

    /// Adds each canary's coordinate of the noisy gradient to its score.
    pub(super) fn score_canaries(
        &mut self,
        grads: &std::collections::BTreeMap<String, candle_core::Tensor>,
    ) -> Result<()> {
        let Some(c) = self.canaries.as_mut() else {
            return Ok(());
        };
        let mut values: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
        for (i, (name, at)) in c.coords.iter().enumerate() {
            if !values.contains_key(name.as_str()) {
                let v = grads[name]
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F64)?
                    .to_vec1::<f64>()?;
                values.insert(name, v);
            }
            c.scores[i] += values[name.as_str()][*at];
        }
        Ok(())
    }
}
