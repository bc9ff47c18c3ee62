//! Differentially private training: [`PrivacyEngine`] and its
//! [`PrivateTrainer`] (Opacus's API: Poisson sampling, virtual batches,
//! clipping, noise, the update and the accounting in one `step`), built on
//! the pieces below: the clipping step as one transform
//! ([`clipped_grad_sum`], with ghost norms where they pay), per-sample
//! norms and clipping of materialised gradients ([`norm_per_sample`],
//! [`clip_per_sample`], [`privatize`]), the secure generator ([`rng`]),
//! the optimisers ([`Sgd`], [`Adam`], [`AdamW`]) and the accountants
//! ([`accountant`]: PRV, RDP, GDP).
//!
//! One DP-SGD step, as Opacus takes it: sample a batch by Poisson sampling
//! (each example joins independently with probability `q`), compute
//! per-sample gradients (`vmap(grad(loss))`), clip each to norm `C`, sum,
//! add `N(0, (σC)²)` noise, divide by the expected batch size `qN`, and step.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_func::dp;
//! use candle_func::rng::Rng;
//! use std::collections::BTreeMap;
//! let mut per_sample = BTreeMap::new();
//! per_sample.insert("w".to_string(), Tensor::new(&[[3f32, 4.], [0.3, 0.4]], &Device::Cpu)?);
//! let norms = dp::norm_per_sample(&per_sample)?;
//! assert_eq!(norms.to_vec1::<f32>()?, vec![5., 0.5]);
//! let clipped = dp::clip_per_sample(&per_sample, 1.0)?;
//! let n = dp::norm_per_sample(&clipped)?.to_vec1::<f32>()?;
//! assert!((n[0] - 1.0).abs() < 1e-4 && (n[1] - 0.5).abs() < 1e-6);
//! let mut rng = Rng::seeded(0); // reproducible for the example; train with Rng::from_os()
//! let g = dp::privatize(&per_sample, 1.0, 1.1, 2.0, &mut rng)?; // noisy mean gradient
//! assert_eq!(g["w"].dims(), &[2]);
//! # Ok::<(), candle_func::Error>(())
//! ```

pub mod accountant;
mod adaptive;
pub mod audit;
mod budget;
mod checkpoint;
mod clip;
pub mod collective;
mod config;
mod dataset;
mod engine;
mod epsilon;
mod fit;
mod ghost;
mod loss;
#[cfg(feature = "mpi")]
pub mod mpi;
mod precision;
mod trainable;
mod trainer;
mod users;
pub use accountant::Sampling;
pub use adaptive::AdaptiveClipping;
pub use budget::MemoryPlan;
pub use clip::{
    clipped_grad_sum, per_sample_grad_norms, ClipOf, Clipped, ClippedGradSum, NormsOnly, PerSampleGradNorms,
};
pub use dataset::{Dataset, SafetensorsDataset, TensorDataset};
pub use engine::{Clipping, DpConfig, ExampleLoss, PrivacyEngine, PrivateTrainer, StepInfo, XsYs};
// The optimisers live in `crate::optim`. Their old names here are kept,
// deprecated, for one release; the trait's re-export cannot be deprecated
// (Rust ignores it on a `use`), so it stays, hidden.
#[doc(hidden)]
pub use crate::optim::Optimizer;
/// Moved to `candle_func::optim::Sgd`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::optim::Sgd")]
pub type Sgd = crate::optim::Sgd;
/// Moved to `candle_func::optim::Adam`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::optim::Adam")]
pub type Adam = crate::optim::Adam;
/// Moved to `candle_func::optim::AdamW`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::optim::AdamW")]
pub type AdamW = crate::optim::AdamW;
/// Moved to `candle_func::optim::CandleOptimizer`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::optim::CandleOptimizer")]
pub type CandleOptimizer<O> = crate::optim::CandleOptimizer<O>;
/// Moved to `candle_func::optim::OptimizerState`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::optim::OptimizerState")]
pub type OptimizerState = crate::optim::OptimizerState;
pub use precision::Precision;
pub use trainable::Trainable;
pub use users::UserGradient;
/// Moved to [`crate::rng`].
#[doc(hidden)]
pub mod rng {
    /// Moved to `candle_func::rng::Rng`.
    #[deprecated(since = "0.2.0", note = "moved to candle_func::rng::Rng")]
    pub type Rng = crate::rng::Rng;
}

use crate::error::{Error, Result};
use crate::ir::options::Options;
use crate::rng::Rng;
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// The L2 norm of each example's gradient across all parameters: `[B]` for
/// materialised per-sample gradients shaped `[B, ...]` (to take the norms
/// from a loss without materialising them, see [`per_sample_grad_norms`]).
/// An error naming the leaves when they disagree on `B` or one has no
/// batch axis.
pub fn norm_per_sample(grads: &BTreeMap<String, Tensor>) -> Result<Tensor> {
    const OP: &str = "norm_per_sample";
    let mut total: Option<(&str, Tensor)> = None;
    for (name, g) in grads {
        if g.rank() == 0 {
            return Err(Error::shape(OP, &[g.dims()], format!("{name:?} has no batch axis")));
        }
        let sq = g.to_dtype(DType::F32)?.sqr()?.flatten_from(1)?.sum(1)?;
        total = Some(match total {
            None => (name, sq),
            Some((first, t)) if t.dims() == sq.dims() => (first, (t + sq)?),
            Some((first, _)) => {
                let msg = format!("{first:?} and {name:?} hold different numbers of examples (axis 0)");
                return Err(Error::shape(OP, &[grads[first].dims(), g.dims()], msg));
            }
        });
    }
    let (_, total) = total.ok_or_else(|| Error::Tree {
        msg: format!("{OP}: no gradients"),
    })?;
    Ok(total.sqrt()?)
}

/// Renamed [`norm_per_sample`] (beside [`per_sample_grad_norms`], the
/// transform, the old name read as its twin).
#[deprecated(since = "0.2.0", note = "renamed dp::norm_per_sample")]
pub fn per_sample_norms(grads: &BTreeMap<String, Tensor>) -> Result<Tensor> {
    norm_per_sample(grads)
}

/// Scales each example's gradient so its norm is at most `max_norm`
/// (Opacus's factor `min(1, C / (norm + 1e-6))`); gradients below the bound
/// are unchanged.
pub fn clip_per_sample(grads: &BTreeMap<String, Tensor>, max_norm: f64) -> Result<BTreeMap<String, Tensor>> {
    positive("clip_per_sample", "max_norm", max_norm, false)?;
    let norms = norm_per_sample(grads)?;
    let factor = (norms.affine(1.0, 1e-6)?.recip()? * max_norm)?.clamp(0f32, 1f32)?;
    grads
        .iter()
        .map(|(k, g)| {
            // B -> B 1.. to scale every entry of example b
            let shape: Vec<usize> = std::iter::once(g.dims()[0])
                .chain(std::iter::repeat_n(1, g.rank() - 1))
                .collect();
            let f = factor.to_dtype(g.dtype())?.reshape(shape)?;
            Ok((k.clone(), g.broadcast_mul(&f)?))
        })
        .collect()
}

pub(crate) use crate::error::positive;

/// The private gradient of a batch: per-sample gradients clipped to
/// `max_norm`, summed, with Gaussian noise of standard deviation
/// `noise_multiplier * max_norm` added to each coordinate, divided by
/// `expected_batch` (for Poisson sampling, `q N`, as Opacus does). The
/// noise is drawn on the path the `CANDLE_FUNC_PORTABLE` variable names;
/// [`privatize_with`] takes it from options.
pub fn privatize(
    per_sample: &BTreeMap<String, Tensor>,
    max_norm: f64,
    noise_multiplier: f64,
    expected_batch: f64,
    rng: &mut Rng,
) -> Result<BTreeMap<String, Tensor>> {
    privatize_with(
        per_sample,
        (max_norm, noise_multiplier, expected_batch),
        rng,
        &Options::new(),
    )
}

/// [`privatize`] under `options`: `(max_norm, noise_multiplier,
/// expected_batch)` as there, the noise drawn on the kernel path
/// `options.portable` names (unset: the variable's). A memory limit or
/// any option a transform alone has is an error: nothing here would
/// read it.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{dp, rng::Rng, Options};
/// use std::collections::BTreeMap;
/// let g = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?; // 4 examples
/// let per_sample = BTreeMap::from([("w".to_string(), g)]);
/// let mut rng = Rng::seeded(7);
/// let private = dp::privatize_with(&per_sample, (1.0, 0.5, 4.0), &mut rng, &Options::new().portable(true))?;
/// assert_eq!(private["w"].dims(), &[3]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn privatize_with(
    per_sample: &BTreeMap<String, Tensor>,
    (max_norm, noise_multiplier, expected_batch): (f64, f64, f64),
    rng: &mut Rng,
    options: &Options,
) -> Result<BTreeMap<String, Tensor>> {
    positive("privatize", "noise_multiplier", noise_multiplier, true)?;
    positive("privatize", "expected_batch", expected_batch, false)?;
    let only_path = Options {
        portable: options.portable,
        ..Options::new()
    };
    if *options != only_path {
        return Err(Error::Config {
            msg: format!("privatize: only `portable` applies to the noise, got {options:?}"),
        });
    }
    let clipped = clip_per_sample(per_sample, max_norm)?;
    let path = options.machine().path;
    clipped
        .into_iter()
        .map(|(k, g)| {
            // half precision summed over the examples, noised and scaled
            // in f32, rounded once (in bf16 the sum of a large batch stalls
            // and the noise loses its small values)
            let dt = g.dtype();
            let sum = g.to_dtype(crate::kernels::accumulation_dtype(dt))?.sum(0)?;
            let noisy = rng.add_noise(&sum, noise_multiplier * max_norm, 1.0 / expected_batch, true, path)?;
            Ok((k, noisy.to_dtype(dt)?))
        })
        .collect()
}
