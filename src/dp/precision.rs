//! Mixed precision for private training, as Opacus 1.6 and jax-privacy do
//! it: the loss computes in half precision, while every number that
//! decides what is released or kept stays in f32 — the trainable weights
//! (masters), their per-example norms, the clipping, the noise and the
//! optimiser's moments. The trainer casts each trainable f32 weight to
//! the half dtype where the loss reads it; the cast's gradient carries
//! each example's gradient back to f32, and the ghost rules widen a
//! layer's half-precision operands to f32 before its norm and clipped sum
//! (`dp::ghost`). Frozen weights are constants of the loss in the half
//! dtype: loaded in it, they take half the memory of f32.

use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// How a private trainer's loss computes ([`PrivacyEngine::precision`](super::PrivacyEngine::precision)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Precision {
    /// Every weight computes in its own dtype (the default).
    #[default]
    Native,
    /// The loss in bf16; trainable weights kept in f32 and cast to bf16
    /// where the loss reads them; norms, clipping, noise and optimiser
    /// state in f32; frozen weights in bf16.
    Bf16Mixed,
    /// As [`Precision::Bf16Mixed`] in f16.
    F16Mixed,
}

impl Precision {
    /// The dtype the loss computes in, for a mixed policy.
    pub(super) fn half(self) -> Option<DType> {
        match self {
            Precision::Native => None,
            Precision::Bf16Mixed => Some(DType::BF16),
            Precision::F16Mixed => Some(DType::F16),
        }
    }

    /// Checks the trainable weights are f32 masters under a mixed policy.
    pub(super) fn check_trainable(self, trainable: &BTreeMap<String, Tensor>) -> Result<()> {
        if self.half().is_none() {
            return Ok(());
        }
        match trainable.iter().find(|(_, t)| t.dtype() != DType::F32) {
            Some((name, t)) => Err(Error::privacy(
                "make_private",
                format!("trainable weight {name:?}"),
                "f32 under mixed precision (the master copy the optimiser steps; the loss reads a \
                 half-precision copy): create it in f32, as nn::LoraConfig::dtype(DType::F32) does for adapters",
                format!("{:?}", t.dtype()),
            )),
            None => Ok(()),
        }
    }

    /// The frozen weights as constants of the loss: floating ones in the
    /// half dtype under a mixed policy (a copy, and a warning, for those
    /// stored wider: loaded in the half dtype they are held once).
    pub(super) fn frozen(self, frozen: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
        let Some(h) = self.half() else {
            return Ok(frozen);
        };
        let mut copied = 0usize;
        let out = frozen
            .into_iter()
            .map(|(k, t)| {
                let wider = t.dtype().is_float() && t.dtype() != h;
                copied += usize::from(wider);
                Ok((k, if wider { t.to_dtype(h)? } else { t }))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        if copied > 0 {
            crate::transforms::settings::warn_once(
                "dp-mixed-frozen-copy".into(),
                format!(
                    "make_private: mixed precision copies {copied} frozen weights to {h:?} beside their \
                     originals; load them in {h:?} (Checkpoint::load_variables(.., DType::{h:?}, ..)) to hold them once"
                ),
            );
        }
        Ok(out)
    }
}
