//! Losses with PyTorch's reductions.

use crate::error::{Error, Result};
use crate::trace::Tracer;

/// How per-element losses are combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reduction {
    /// The mean over the batch (PyTorch's default).
    #[default]
    Mean,
    /// The sum over the batch.
    Sum,
    /// One loss per example.
    None,
}

fn reduce(l: Tracer, r: Reduction) -> Result<Tracer> {
    match r {
        Reduction::Mean => l.mean_all(),
        Reduction::Sum => l.sum_all(),
        Reduction::None => Ok(l),
    }
}

/// Negative log-likelihood of log-probabilities `[N, C]` at integer labels
/// `[N]`.
pub fn nll(log_probs: &Tracer, labels: &Tracer, r: Reduction) -> Result<Tracer> {
    let (lp, y) = (log_probs.dims(), labels.dims());
    if lp.len() != 2 || y.len() != 1 || lp[0] != y[0] {
        return Err(Error::shape(
            "nll",
            &[lp, y],
            "expected log-probabilities [N, C] and labels [N]",
        ));
    }
    let picked = log_probs.gather(&labels.unsqueeze(1)?, 1)?.squeeze(1)?;
    reduce(picked.neg()?, r)
}

/// Cross-entropy of logits `[N, C]` against integer labels `[N]`
/// (log-softmax, then negative log-likelihood).
pub fn cross_entropy(logits: &Tracer, labels: &Tracer, r: Reduction) -> Result<Tracer> {
    nll(&logits.log_softmax(-1)?, labels, r)
}

/// Mean squared error (or summed, or per element).
pub fn mse(pred: &Tracer, target: &Tracer, r: Reduction) -> Result<Tracer> {
    if pred.dims() != target.dims() {
        return Err(Error::shape("mse", &[pred.dims(), target.dims()], "shapes differ"));
    }
    reduce(pred.sub(target)?.sqr()?, r)
}
