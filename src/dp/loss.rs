//! The loss the private trainer differentiates: one example's loss (or a
//! user's, the weighted sum of its examples' losses under user-level DP)
//! times its weight, the frozen parameters lifted in as constants.

use crate::error::{Error, Result};
use crate::ir::options::{Randomness, Schedule};
use crate::trace::{Operand, Tracer};
use crate::transforms::dims::Dims;
use crate::transforms::tree::{SymTree, TreeDef};
use crate::transforms::vmap::vmap;
use crate::transforms::Function;
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;
use std::marker::PhantomData;

/// The example form of [`PrivacyEngine::make_private`](super::PrivacyEngine::make_private):
/// one input and one target per example, a loss `(params, x, y)`. (The
/// tree form, [`make_private_examples`](super::PrivacyEngine::make_private_examples),
/// has the example's symbolic tree in its place.)
#[derive(Clone, Copy, Debug)]
pub struct XsYs;

/// The per-example loss times the example's weight (1, or 0 for padding):
/// a padded example's gradient is exactly zero, so it adds nothing. The
/// frozen parameters join the trainable ones as constants, so the loss
/// sees every parameter by name and differentiates only what trains.
pub(super) struct Masked<F, S> {
    pub(super) loss: F,
    pub(super) def: TreeDef,
    pub(super) frozen: BTreeMap<String, Tensor>,
    /// The dtype the loss computes in under mixed precision: each
    /// trainable (f32) weight is cast to it where the loss reads it, and
    /// the loss back to f32.
    pub(super) half: Option<DType>,
    /// User-level DP with more than one example a user: the leaves hold a
    /// user's `k` examples and the weights are `[k]` (see [`super::users`]),
    /// the inner `vmap` over them with this randomness.
    pub(super) per_user: Option<Option<Randomness>>,
    pub(super) form: PhantomData<fn() -> S>,
}

type Args = (BTreeMap<String, Tracer>, Vec<Tracer>, Tracer);

impl<F, S> Masked<F, S> {
    /// The trainable parameters with the frozen ones lifted into `like`'s
    /// trace as constants.
    fn all_params(&self, mut p: BTreeMap<String, Tracer>, like: &Tracer) -> Result<BTreeMap<String, Tracer>> {
        if let Some(h) = self.half {
            for t in p.values_mut() {
                *t = t.to_dtype(h)?;
            }
        }
        for (k, t) in &self.frozen {
            p.insert(k.clone(), t.to_tracer(like)?);
        }
        Ok(p)
    }
}

impl<F: ExampleLoss<S>, S> Masked<F, S> {
    /// One example's loss, in f32 under mixed precision.
    fn example(&self, p: BTreeMap<String, Tracer>, leaves: Vec<Tracer>) -> Result<Tracer> {
        let loss = self.loss.example_loss(p, leaves, &self.def)?;
        match self.half {
            Some(_) => loss.to_dtype(DType::F32),
            None => Ok(loss),
        }
    }
}

fn weighted(l: Tracer, w: &Tracer) -> Result<Tracer> {
    l.mul(&w.to_dtype(l.dtype())?)
}

/// A per-example loss a [`PrivateTrainer`](crate::dp::PrivateTrainer) takes, for the example form `S`:
/// implemented for every [`Function`] of `(params, example tree)` (with `S`
/// the tree) and of `(params, x, y)` (with `S` = [`XsYs`]), which is all
/// it is for.
pub trait ExampleLoss<S> {
    /// The loss of one example from its leaves, rebuilt by `def`.
    #[doc(hidden)]
    fn example_loss(&self, params: BTreeMap<String, Tracer>, leaves: Vec<Tracer>, def: &TreeDef) -> Result<Tracer>;
}

impl<F, S> ExampleLoss<S> for F
where
    S: SymTree,
    F: Function<(BTreeMap<String, Tracer>, S), Output = Tracer>,
{
    fn example_loss(&self, p: BTreeMap<String, Tracer>, leaves: Vec<Tracer>, def: &TreeDef) -> Result<Tracer> {
        self.apply((p, S::unflatten_from(def, &mut leaves.into_iter())?))
    }
}

impl<F> ExampleLoss<XsYs> for F
where
    F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
{
    fn example_loss(&self, p: BTreeMap<String, Tracer>, leaves: Vec<Tracer>, _: &TreeDef) -> Result<Tracer> {
        let [x, y]: [Tracer; 2] = leaves.try_into().map_err(|l: Vec<Tracer>| {
            Error::internal(
                "PrivateTrainer",
                format!("{} example tensors, expected xs and ys", l.len()),
            )
        })?;
        self.apply((p, x, y))
    }
}

impl<F: ExampleLoss<S>, S> Function<Args> for Masked<F, S> {
    type Output = Tracer;

    fn apply(&self, (p, leaves, w): Args) -> Result<Tracer> {
        let p = self.all_params(p, &w)?;
        let Some(randomness) = self.per_user else {
            return weighted(self.example(p, leaves)?, &w);
        };
        // a user's k examples: their losses [k] by a batched inner vmap (the
        // ghost rules read its products), summed by their weights [k]
        let one = |p: BTreeMap<String, Tracer>, leaves: Vec<Tracer>| self.example(p, leaves);
        let mut inner = vmap(one)
            .in_dims(Dims::Each(vec![None, Some(0)]))
            .schedule(Schedule::Batched);
        if let Some(r) = randomness {
            inner = inner.randomness(r);
        }
        weighted(inner.apply((p, leaves))?, &w)?.sum_all()
    }
}
