//! The private trainer built for a target ε (Opacus's
//! `make_private_with_epsilon`): the noise multiplier chosen by the
//! engine's own accountant for the steps the loop will take.

use super::accountant::noise_multiplier_with;
use super::config::steps_per_epoch;
use super::dataset::{Dataset, TensorDataset};
use super::engine::{sample_rate, xs_ys, DpConfig, PrivacyEngine};
use super::trainer::PrivateTrainer;
use super::users::Users;
use crate::error::Result;
use crate::optim::Optimizer;
use crate::trace::Tracer;
use crate::transforms::tree::TensorTree;
use crate::transforms::Function;
use candle_core::Tensor;
use candle_nn::VarMap;
use std::collections::BTreeMap;

impl PrivacyEngine {
    /// As [`PrivacyEngine::make_private`], with the noise multiplier chosen
    /// so that `epochs` epochs spend at most `target_epsilon` at `delta` by
    /// the engine's accountant (Opacus's `make_private_with_epsilon`);
    /// `config.noise_multiplier` is replaced. An epoch is
    /// [`PrivateTrainer::steps_per_epoch`] steps, and the count is rounded
    /// up, so the ε is that of the steps the loop will take (Opacus counts
    /// `epochs / q` steps, which can be one short of its loop's).
    #[allow(clippy::too_many_arguments)]
    pub fn make_private_with_epsilon<F, O>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        data: (&Tensor, &Tensor),
        config: DpConfig,
        target: (f64, f64, f64),
    ) -> Result<PrivateTrainer<F, O>>
    where
        F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
        O: Optimizer,
    {
        let n = xs_ys(data.0, data.1)?.len();
        let config = self.for_epsilon(config, n, target)?;
        self.make_private(loss, varmap, optimizer, data, config)
    }

    /// [`PrivacyEngine::make_private_examples`] with the noise multiplier
    /// chosen for `(target_epsilon, delta, epochs)` as
    /// [`PrivacyEngine::make_private_with_epsilon`] chooses it.
    #[allow(clippy::too_many_arguments)]
    pub fn make_private_examples_with_epsilon<F, O, D>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        data: &D,
        config: DpConfig,
        target: (f64, f64, f64),
    ) -> Result<PrivateTrainer<F, O, D::Sym>>
    where
        D: TensorTree + ?Sized,
        F: Function<(BTreeMap<String, Tracer>, D::Sym), Output = Tracer>,
        O: Optimizer,
    {
        let n = TensorDataset::new(data)?.len();
        let config = self.for_epsilon(config, n, target)?;
        self.make_private_examples(loss, varmap, optimizer, data, config)
    }

    /// `config` with the noise multiplier that spends `target_epsilon` at
    /// `delta` over `epochs` epochs of `n` examples.
    fn for_epsilon(
        &self,
        config: DpConfig,
        n: usize,
        (target_epsilon, delta, epochs): (f64, f64, f64),
    ) -> Result<DpConfig> {
        let n = self.users_of(n)?.as_ref().map_or(n, Users::len);
        let q = sample_rate(config.batch_size, n)?;
        super::positive("make_private_with_epsilon", "epochs", epochs, false)?;
        let steps = (epochs * steps_per_epoch(q) as f64).ceil() as usize;
        let noise_multiplier = noise_multiplier_with(
            "make_private_with_epsilon",
            &self.accountant_new()?,
            target_epsilon,
            delta,
            q,
            steps,
        )?;
        Ok(DpConfig {
            noise_multiplier,
            ..config
        })
    }
}
