//! Any `candle_nn::Optimizer` as the trainer's optimiser: the noisy
//! gradient is handed over as the `GradStore` a `backward` would have made.

use super::{var_for, vars_of, Optimizer};
use crate::error::Result;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;

/// A `candle_nn` optimiser (its `AdamW`, `SGD`, or one of your own) stepping
/// a `VarMap`'s variables by name, for [`PrivacyEngine`](crate::dp::PrivacyEngine)
/// and [`PrivateTrainer`](crate::dp::PrivateTrainer).
///
/// Each step puts the named gradients in a `GradStore` under their
/// variables and calls the optimiser's `step`; variables without a
/// gradient (frozen ones) are left to the optimiser, and candle's own skip
/// them. The crate's [`Sgd`](super::Sgd), [`Adam`](super::Adam) and
/// [`AdamW`](super::AdamW) remain for parameter groups and for saving
/// their state: a `candle_nn` optimiser does not expose its state, so
/// [`PrivateTrainer::save`](crate::dp::PrivateTrainer::save) refuses a trainer
/// that steps with one.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_func::optim::{CandleOptimizer, Optimizer};
/// use candle_nn::{AdamW, ParamsAdamW};
/// let varmap = candle_nn::VarMap::new();
/// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let _ = candle_func::nn::linear(4, 3, vb.pp("fc"))?;
/// let config = ParamsAdamW { lr: 1e-3, ..Default::default() };
/// let opt: CandleOptimizer<AdamW> = CandleOptimizer::new(&varmap, config)?;
/// assert_eq!(opt.lr(), 1e-3);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub struct CandleOptimizer<O> {
    inner: O,
    vars: BTreeMap<String, Var>,
}

impl<O: candle_nn::Optimizer> CandleOptimizer<O> {
    /// `O` built by `candle_nn::Optimizer::new` over every variable of
    /// `varmap`, with `config`.
    pub fn new(varmap: &candle_nn::VarMap, config: O::Config) -> Result<CandleOptimizer<O>> {
        let vars = vars_of(varmap, "CandleOptimizer::new")?;
        let inner = O::new(vars.values().cloned().collect(), config)?;
        Ok(CandleOptimizer { inner, vars })
    }

    /// `optimizer`, already built over (some of) `varmap`'s variables;
    /// gradients are handed over by `varmap`'s names.
    pub fn wrap(varmap: &candle_nn::VarMap, optimizer: O) -> Result<CandleOptimizer<O>> {
        let vars = vars_of(varmap, "CandleOptimizer::wrap")?;
        Ok(CandleOptimizer { inner: optimizer, vars })
    }

    /// The wrapped optimiser.
    pub fn inner(&self) -> &O {
        &self.inner
    }
}

impl<O: candle_nn::Optimizer> Optimizer for CandleOptimizer<O> {
    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        const OP: &str = "CandleOptimizer::step";
        let mut store = GradStore::default();
        for (name, g) in grads {
            let var = var_for(&self.vars, OP, name, g)?;
            store.insert(var.as_tensor(), g.to_dtype(var.dtype())?);
        }
        Ok(self.inner.step(&store)?)
    }

    fn lr(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        crate::error::positive("CandleOptimizer::set_lr", "lr", lr, true)?;
        self.inner.set_learning_rate(lr);
        Ok(())
    }
}
