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

/// Options of [`cross_entropy_with`], PyTorch's `CrossEntropyLoss`
/// arguments: labels equal to `ignore_index` count for nothing (a mean is
/// over the others), and `label_smoothing` mixes the one-hot target with
/// the uniform distribution.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropy {
    /// Labels to leave out (PyTorch's `ignore_index`, often -100).
    pub ignore_index: Option<i64>,
    /// In `[0, 1]`: the target is `(1 - s) one_hot + s / C`.
    pub label_smoothing: f64,
    /// How the per-position losses combine.
    pub reduction: Reduction,
}

/// Cross-entropy of logits `[.., C]` (`[N, C]`, or `[N, T, C]` for a
/// sequence) against integer labels `[..]`, with PyTorch's
/// `ignore_index` and `label_smoothing`. A mean over positions that are
/// all ignored is NaN, as in PyTorch.
pub fn cross_entropy_with(logits: &Tracer, labels: &Tracer, o: CrossEntropy) -> Result<Tracer> {
    let (lg, y) = (logits.dims(), labels.dims());
    if lg.is_empty() || lg[..lg.len() - 1] != *y || labels.dtype().is_float() {
        return Err(Error::shape(
            "cross_entropy",
            &[lg, y],
            "expected logits [.., C] and integer labels [..] of the leading shape",
        ));
    }
    if !(0.0..=1.0).contains(&o.label_smoothing) {
        return Err(Error::Config {
            msg: format!("cross_entropy: label_smoothing {} is outside [0, 1]", o.label_smoothing),
        });
    }
    let c = lg[lg.len() - 1];
    let lp = logits.reshape(((), c))?.log_softmax(1)?;
    let y = labels.flatten_all()?;
    // ignored labels (possibly out of range) read class 0, then weigh 0
    let keep = match o.ignore_index {
        Some(i) => Some(y.to_dtype(candle_core::DType::I64)?.ne(i as f64)?),
        None => None,
    };
    let safe = match &keep {
        Some(k) => k.where_cond(&y, 0.0)?,
        None => y.clone(),
    };
    let mut per = lp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    if o.label_smoothing > 0.0 {
        let s = o.label_smoothing;
        let uniform = lp.mean(1)?.neg()?;
        per = per.affine(1.0 - s, 0.0)?.add(&uniform.affine(s, 0.0)?)?;
    }
    let per = per.reshape(y.dims())?;
    let Some(k) = keep else {
        return reduce(per.reshape(labels.dims())?, o.reduction);
    };
    let w = k.to_dtype(logits.dtype())?;
    let per = per.mul(&w)?;
    match o.reduction {
        Reduction::Mean => per.sum_all()?.div(&w.sum_all()?),
        Reduction::Sum => per.sum_all(),
        Reduction::None => per.reshape(labels.dims()),
    }
}

/// Binary cross-entropy of logits against targets in `[0, 1]` of the same
/// shape, computed stably: `max(x, 0) - x y + log(1 + e^-|x|)` (PyTorch's
/// `binary_cross_entropy_with_logits`).
pub fn bce_with_logits(logits: &Tracer, targets: &Tracer, r: Reduction) -> Result<Tracer> {
    if logits.dims() != targets.dims() {
        return Err(Error::shape(
            "bce_with_logits",
            &[logits.dims(), targets.dims()],
            "shapes differ",
        ));
    }
    let tail = logits.abs()?.neg()?.exp()?.log1p()?;
    reduce(logits.relu()?.sub(&logits.mul(targets)?)?.add(&tail)?, r)
}

/// Mean absolute error (or summed, or per element).
pub fn l1(pred: &Tracer, target: &Tracer, r: Reduction) -> Result<Tracer> {
    if pred.dims() != target.dims() {
        return Err(Error::shape("l1", &[pred.dims(), target.dims()], "shapes differ"));
    }
    reduce(pred.sub(target)?.abs()?, r)
}

/// The Huber loss with threshold `delta > 0`: `d^2 / 2` where `|d| <
/// delta`, else `delta (|d| - delta / 2)` (PyTorch's `huber_loss`).
pub fn huber(pred: &Tracer, target: &Tracer, delta: f64, r: Reduction) -> Result<Tracer> {
    if pred.dims() != target.dims() {
        return Err(Error::shape("huber", &[pred.dims(), target.dims()], "shapes differ"));
    }
    if delta.is_nan() || delta <= 0.0 {
        return Err(Error::Config {
            msg: format!("huber: delta {delta} must be positive"),
        });
    }
    let d = pred.sub(target)?;
    let a = d.abs()?;
    let linear = a.affine(delta, -0.5 * delta * delta)?;
    reduce(a.lt(delta)?.where_cond(&d.sqr()?.affine(0.5, 0.0)?, &linear)?, r)
}
