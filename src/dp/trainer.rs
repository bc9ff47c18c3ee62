//! The private training loop's state and its step (see [`super::PrivacyEngine`]
//! for what one step does): the examples as a tree of tensors sharing a
//! leading example axis, the trainable parameters, the frozen ones as
//! constants of the traced loss.

use super::accountant::Accountant;
use super::adaptive::Adaptive;
use super::clip::ClippedGradSum;
use super::collective::{self, Collective};
use super::dataset::Examples;
use super::loss::Masked;
pub use super::loss::{ExampleLoss, XsYs};
use super::users::{self, Share, UserGradient, Users};
use crate::error::{CollectiveFailure, Error, Result};
use crate::optim::Optimizer;
use crate::rng::Rng;
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;

/// What one private step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepInfo {
    /// The logical (Poisson) batch size: examples, or users under
    /// user-level DP ([`PrivacyEngine::users`](super::PrivacyEngine::users)).
    pub batch_size: usize,
    /// The examples the batch held (`batch_size` at example level).
    pub examples: usize,
    /// Passes of the physical batch size it took (on this rank, when
    /// distributed).
    pub passes: usize,
    /// The mean loss over the batch's examples (NaN for an empty batch);
    /// under user-level DP with [`UserGradient::Mean`](super::UserGradient::Mean),
    /// the mean over users of each user's mean loss.
    pub mean_loss: f64,
    /// The fraction of the batch's examples (users) whose gradient norm exceeded
    /// the bound (flat clipping; NaN per layer, under automatic clipping or
    /// for an empty batch).
    pub clipped_fraction: f64,
    /// The flat bound this step clipped to (adaptive clipping moves it
    /// after every step; NaN per layer and under automatic clipping).
    pub clip_bound: f64,
}

/// A DP-SGD training loop's state: the clipping transform, the optimiser,
/// the accountant and the generator (see the module docs for one step).
/// `S` is the example's form: [`XsYs`] for `make_private`, the examples'
/// symbolic tree for `make_private_examples`.
pub struct PrivateTrainer<F, O, S = XsYs> {
    pub(super) clip: ClippedGradSum<Masked<F, S>>,
    pub(super) varmap: VarMap,
    pub(super) optimizer: O,
    /// What trains, the accountant, the generator, the data and the
    /// privacy parameters of every step, as the engine settled them.
    pub(super) setup: Setup,
    pub(super) comm: Option<Box<dyn Collective>>,
    /// Steps taken (restored by `resume`).
    pub(super) steps: u64,
    /// The process's memory plan, under a memory limit.
    pub(super) memory: Option<super::budget::MemoryPlan>,
    /// White-box canaries of a one-run audit, when inserted.
    pub(super) canaries: Option<super::audit::Canaries>,
}

/// What the engine settles for a trainer: what trains, the accountant and
/// the generator, the data, and the privacy parameters of every step.
pub(super) struct Setup {
    pub(super) trainable: Vec<String>,
    pub(super) accountant: Accountant,
    pub(super) rng: Rng,
    pub(super) data: Examples,
    pub(super) sample_rate: f64,
    pub(super) noise_multiplier: f64,
    /// The most one unit (example or user) moves the clipped sum by.
    pub(super) sensitivity: f64,
    pub(super) physical: usize,
    pub(super) secure_mode: bool,
    pub(super) bound: Option<f64>,
    pub(super) adaptive: Option<Adaptive>,
    pub(super) path: crate::env::Path,
}

impl<F, O, S> PrivateTrainer<F, O, S> {
    /// A trainer that has taken no step, with its invariants checked: a
    /// sample rate in `(0, 1]`, a finite noise multiplier of at least 0,
    /// a finite positive sensitivity, and a physical batch of 1 to the
    /// number of units sampled (the engine's settings reach here checked;
    /// these are its own mistakes).
    pub(super) fn new(clip: ClippedGradSum<Masked<F, S>>, varmap: &VarMap, optimizer: O, s: Setup) -> Result<Self> {
        let units = s.data.units();
        let broken = [
            (!(s.sample_rate > 0.0 && s.sample_rate <= 1.0), "sample rate"),
            (
                !(s.noise_multiplier.is_finite() && s.noise_multiplier >= 0.0),
                "noise multiplier",
            ),
            (!(s.sensitivity.is_finite() && s.sensitivity > 0.0), "sensitivity"),
            (!(1..=units).contains(&s.physical), "physical batch"),
        ];
        if let Some((_, what)) = broken.iter().find(|(bad, _)| *bad) {
            return Err(Error::internal(
                "make_private",
                format!(
                    "the trainer's {what} is out of range (q {}, σ {}, sensitivity {}, physical {} of {units})",
                    s.sample_rate, s.noise_multiplier, s.sensitivity, s.physical
                ),
            ));
        }
        Ok(PrivateTrainer {
            clip,
            varmap: varmap.clone(),
            optimizer,
            setup: s,
            comm: None,
            steps: 0,
            memory: None,
            canaries: None,
        })
    }
}

impl<F, O, S> PrivateTrainer<F, O, S>
where
    F: ExampleLoss<S>,
    O: Optimizer,
{
    /// One private step: sample, clip in passes, add noise once, update,
    /// account. Distributed ([`PrivateTrainer::distributed`]), each rank
    /// clips its share of the logical batch and the step ends with every
    /// rank's parameters checked equal.
    pub fn step(&mut self) -> Result<StepInfo> {
        let n = self.setup.data.units();
        let (idx, mine) = self.sample()?;
        let params = self.params_now()?;
        // Distributed, a local failure must not leave the other ranks in a
        // collective: it is carried into the all-reduce as a flag, and
        // every rank fails the step together.
        let local = self.clip_share(&mine, &params);
        let (sum, loss_sum, over, failed) = match (local, &self.comm) {
            (Ok((s, l, o)), _) => (s, l, o, None),
            (Err(e), None) => return Err(e),
            (Err(e), Some(_)) => (zeros(&params)?, 0.0, 0.0, Some(e)),
        };
        let clip_bound = self.clip_bound();
        // adaptive clipping's count of unclipped examples, noised once
        let mut unclipped = mine.len() as f64 - over;
        let draws = self.comm.as_ref().is_none_or(|c| c.rank() == 0);
        if let (Some(a), true) = (&self.setup.adaptive, draws) {
            unclipped += a.count_noise(&mut self.setup.rng);
        }
        let mut counts = [loss_sum, over, unclipped, failed.is_some() as u8 as f64];
        let mut sum = sum;
        self.add_canaries(&mut sum)?;
        let grads = self.noisy_mean(sum, n, &mut counts, failed.is_none());
        let [loss_sum, over, unclipped, failures] = counts;
        if let Some(e) = failed {
            return Err(e);
        }
        let grads = grads?; // this rank's own failure first
        if failures > 0.0 {
            let (rank, ranks) = self.comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
            let failure = CollectiveFailure::RankFailed {
                failed: failures as usize,
            };
            return Err(Error::Collective { rank, ranks, failure });
        }
        // Counted before the update, as Opacus does: an update that fails
        // half-way has still released noisy values.
        // The step count moves with the accountant, so that a checkpoint's
        // history always holds exactly `steps` steps (resume checks it).
        self.setup
            .accountant
            .step(self.setup.noise_multiplier, self.setup.sample_rate)?;
        self.score_canaries(&grads)?;
        self.steps += 1;
        // on the path the clipping graph ran on: one step, one path
        let portable = self.setup.path == crate::env::Path::Portable;
        self.optimizer.step_on(&grads, portable)?;
        if let Some(a) = &mut self.setup.adaptive {
            a.update(unclipped, self.setup.sample_rate * n as f64);
        }
        if let Some(c) = &self.comm {
            collective::check_in_step(c.as_ref(), &self.params_now()?, "after a step")?;
        }
        let b = idx.len() as f64;
        let by_user = matches!(&self.setup.data.users, Some(u) if u.grouped() && u.gradient == UserGradient::Mean);
        let losses = if by_user { b } else { idx.examples() as f64 };
        Ok(StepInfo {
            batch_size: idx.len(),
            examples: idx.examples(),
            passes: mine.len().div_ceil(self.setup.physical),
            mean_loss: if idx.len() == 0 { f64::NAN } else { loss_sum / losses },
            clipped_fraction: match (self.setup.bound, idx.len() == 0) {
                (Some(_), false) => over / b,
                _ => f64::NAN,
            },
            clip_bound,
        })
    }

    /// This step's logical batch, drawn by the scheme the accountant
    /// analyses (so the two agree; rank 0's, broadcast, where distributed),
    /// and this rank's share of it.
    fn sample(&mut self) -> Result<(users::Share, users::Share)> {
        let n = self.setup.data.units();
        let (q, rng, users) = (
            self.setup.sample_rate,
            &mut self.setup.rng,
            self.setup.data.users.as_ref(),
        );
        let sampling = self.setup.accountant.sampling();
        let batch = (q * n as f64).round() as usize;
        let mut draw = || users::draw(users, sampling, rng, (n, q, batch));
        match &self.comm {
            Some(c) => {
                let flat = collective::broadcast_batch(c.as_ref(), draw)?;
                users::share(users, flat, (c.rank(), c.size()))
            }
            None => users::share(users, draw(), (0, 1)),
        }
    }

    /// This rank's clipped sum over `mine` in passes of the physical size,
    /// its summed loss and how many norms exceeded the flat bound.
    fn clip_share(
        &self,
        mine: &Share,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(BTreeMap<String, Tensor>, f64, f64)> {
        let mut sum: Option<BTreeMap<String, Tensor>> = None;
        let (mut loss_sum, mut over) = (0.0, 0usize);
        for chunk in mine.passes(self.setup.physical) {
            let (examples, w) = self.pass(&chunk)?;
            let (clipped, norms, losses) = self.clip.call((params, &examples, &w)).map_err(|e| self.over(e))?;
            // the losses came weighted by 1 / C under adaptive clipping
            loss_sum += losses.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()? * self.unit();
            if let Some(c) = self.setup.bound {
                let real = norms.narrow(0, 0, chunk.len())?.to_dtype(DType::F64)?;
                over += real.to_vec1::<f64>()?.iter().filter(|&&v| v > c).count();
            }
            sum = Some(match sum {
                None => clipped,
                Some(s) => add_trees(s, &clipped)?,
            });
        }
        let sum = match sum {
            Some(s) => s,
            None => zeros(params)?,
        };
        Ok((sum, loss_sum, over as f64))
    }

    /// `(sum + noise) / (q N)`, the noise drawn once: alone, in one pass per
    /// tensor; distributed, rank 0 adds it to its own sum before the sums
    /// (and `counts`) are all-reduced.
    ///
    /// `counts` are all-reduced with the sums, the last of them the number
    /// of ranks that failed. A rank that failed (`!ok`, or drawing its
    /// noise) adds no noise but still takes part, so no rank waits.
    fn noisy_mean(
        &mut self,
        sum: BTreeMap<String, Tensor>,
        n: usize,
        counts: &mut [f64],
        ok: bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        let expected = self.setup.sample_rate * n as f64;
        // adaptive: the sum is of gradients scaled by 1 / C, clipped to 1
        let (std, unit) = match &self.setup.adaptive {
            Some(a) => (a.grad_sigma, a.bound),
            None => (self.setup.noise_multiplier * self.setup.sensitivity, 1.0),
        };
        let first = ok && self.comm.as_ref().is_none_or(|c| c.rank() == 0);
        let scale = if self.comm.is_some() { 1.0 } else { unit / expected };
        let mut noisy = BTreeMap::new();
        let mut failed = None;
        let path = self.setup.path;
        for (k, s) in sum {
            let s = match first {
                false => s,
                true => match self.setup.rng.add_noise(&s, std, scale, self.setup.secure_mode, path) {
                    Ok(t) => t,
                    // rank 0 still joins the all-reduce, flagged, if it fails
                    Err(e) if self.comm.is_some() => {
                        failed.get_or_insert(e);
                        s
                    }
                    Err(e) => return Err(e),
                },
            };
            noisy.insert(k, s);
        }
        let Some(c) = &self.comm else {
            return Ok(noisy);
        };
        if failed.is_some() {
            counts[counts.len() - 1] += 1.0;
        }
        let total = collective::reduce_sums(c.as_ref(), noisy, counts)?;
        if let Some(e) = failed {
            return Err(e);
        }
        total
            .into_iter()
            .map(|(k, t)| Ok((k, t.affine(unit / expected, 0.0)?)))
            .collect()
    }

    /// This trainer spread over the ranks of `comm` (see
    /// [`super::collective`]): every rank must build it from the same data
    /// set and configuration, and call `step` in lockstep. Rank 0's
    /// parameters are broadcast to the others first; only rank 0's
    /// generator draws (the batch and the noise). An error, on every rank,
    /// if the ranks' data sets or parameter shapes differ, or a parameter
    /// is not f32/f64.
    pub fn distributed(mut self, comm: impl Collective + 'static) -> Result<Self> {
        if comm.size() == 0 || comm.rank() >= comm.size() {
            return Err(Error::Collective {
                rank: comm.rank(),
                ranks: comm.size(),
                failure: CollectiveFailure::Invalid {
                    msg: "the communicator's rank is not below its size".into(),
                },
            });
        }
        if self.canaries.is_some() {
            // every rank would add them, and the sum would hold each `ranks` times
            return Err(Error::data(
                "PrivateTrainer::distributed",
                "auditing canaries run on one process",
            ));
        }
        let before = self.params_now()?;
        collective::check_same_setup(&comm, &before, &self.setup.data.probe()?)?;
        // every variable, the frozen ones too: they are constants of the
        // traced loss, which shares their storage and is traced at the
        // first step, after this
        collective::broadcast_vars(&comm, &crate::optim::vars_of(&self.varmap, "distributed")?)?;
        collective::check_in_step(&comm, &self.params_now()?, "after the broadcast of rank 0's parameters")?;
        self.comm = Some(Box::new(comm));
        Ok(self)
    }
}

impl<F, O, S> PrivateTrainer<F, O, S> {
    /// The adaptive bound `C` the examples are scaled by (`1 / C` as their
    /// weight), 1 for a fixed bound.
    fn unit(&self) -> f64 {
        self.setup.adaptive.as_ref().map_or(1.0, |a| a.bound)
    }

    /// The flat bound the next step clips to (moved after every step by
    /// adaptive clipping); NaN for per-layer clipping.
    pub fn clip_bound(&self) -> f64 {
        match (&self.setup.adaptive, self.setup.bound) {
            (Some(a), _) => a.bound,
            (None, Some(c)) => c,
            (None, None) => f64::NAN,
        }
    }

    /// A pass's plan over its limit, as the trainer's user can act on it:
    /// by the physical batch, not the inner `vmap`'s chunks.
    fn over(&self, e: Error) -> Error {
        let Error::Memory { needed, limit, .. } = e else {
            return e;
        };
        let remedy = match &self.memory {
            Some(_) => {
                "the memory plan changed since make_private (a variable or the data grew): build the trainer again"
            }
            None => {
                "pass fewer examples at once (PrivacyEngine::physical_batch), or set PrivacyEngine::memory_limit \
                     and leave physical_batch unset: the trainer then chooses the largest batch that fits"
            }
        };
        Error::TrainerMemory {
            op: "PrivateTrainer::step",
            needed,
            limit,
            parts: format!("a pass of {} examples", self.setup.physical),
            remedy: remedy.into(),
        }
    }

    /// Examples per pass: [`PrivacyEngine::physical_batch`](super::PrivacyEngine::physical_batch)'s,
    /// or the one the trainer chose under a memory limit.
    pub fn physical_batch(&self) -> usize {
        self.setup.physical
    }

    /// The process's memory at a step's peak by part, where the engine had
    /// a memory limit ([`PrivacyEngine::memory_limit`](super::PrivacyEngine::memory_limit));
    /// `None` without one.
    pub fn memory_plan(&self) -> Option<&super::budget::MemoryPlan> {
        self.memory.as_ref()
    }

    /// The trainable parameters' current values by name.
    pub(super) fn params_now(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut all = crate::optim::var_tensors(&self.varmap)?;
        all.retain(|k, _| self.setup.trainable.contains(k));
        if all.len() != self.setup.trainable.len() {
            let gone: Vec<&String> = self.setup.trainable.iter().filter(|k| !all.contains_key(*k)).collect();
            return Err(Error::data(
                "PrivateTrainer::step",
                format!("trainable variables {gone:?} were removed from the VarMap"),
            ));
        }
        Ok(all)
    }

    /// Sets the trainable variable `name` (shape and dtype checked by the
    /// caller).
    pub(super) fn set_param(&self, name: &str, t: &Tensor) -> Result<()> {
        let vars = crate::optim::vars_of(&self.varmap, "PrivateTrainer::resume")?;
        let var = vars
            .get(name)
            .ok_or_else(|| Error::data("PrivateTrainer::resume", format!("the VarMap has no {name:?}")))?;
        var.set(t)?;
        Ok(())
    }

    /// Steps taken, counting those before a [`PrivateTrainer::resume`]: each
    /// accounted step, also one whose update failed after its noise was
    /// drawn.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One pass's examples and weights: the chunk's units padded to the
    /// physical size with copies of its first, weighted 0; a pass of users
    /// `[physical, k, ..]` (see [`super::users`]).
    pub(super) fn pass(&self, chunk: &Share) -> Result<(Vec<Tensor>, Tensor)> {
        let chunk = match (chunk, &self.setup.data.users) {
            (Share::Examples(e), _) => e,
            (Share::Users(u), Some(users)) => return self.pass_users(users, u),
            (Share::Users(_), None) => return Err(Error::internal("PrivateTrainer::step", "users without users")),
        };
        let mut ids: Vec<usize> = chunk.to_vec();
        let pad = self.setup.physical - chunk.len();
        ids.extend(std::iter::repeat_n(ids[0], pad));
        let w = (1.0 / self.unit()) as f32;
        let weights: Vec<f32> = (0..self.setup.physical)
            .map(|i| if i < chunk.len() { w } else { 0.0 })
            .collect();
        let examples = self.setup.data.source.fetch(&ids)?;
        let weights = Tensor::from_vec(weights, self.setup.physical, &self.setup.data.source.device())?;
        Ok((examples, weights))
    }

    /// A pass of users: `physical` users of `k` slots, each leaf fetched as
    /// `[physical k, ..]` and split, `(B K) .. -> B K ..`.
    fn pass_users(&self, users: &Users, chunk: &[Vec<usize>]) -> Result<(Vec<Tensor>, Tensor)> {
        let (p, k) = (self.setup.physical, users.k);
        let (ids, w) = users::user_slots(users, chunk, p, 1.0 / self.unit());
        let examples = self
            .setup
            .data
            .source
            .fetch(&ids)?
            .into_iter()
            .map(|t| {
                let dims: Vec<usize> = [p, k].into_iter().chain(t.dims()[1..].iter().copied()).collect();
                t.reshape(dims)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((examples, Tensor::from_vec(w, (p, k), &self.setup.data.source.device())?))
    }

    /// The ε spent so far at `delta`, by the engine's accountant.
    pub fn epsilon(&self, delta: f64) -> Result<f64> {
        self.setup.accountant.epsilon(delta)
    }

    /// The accountant ([`PrivateTrainer::save`] saves it with the rest).
    pub fn accountant(&self) -> &Accountant {
        &self.setup.accountant
    }

    /// Replaces the accountant (to report ε by another analysis, say). Its
    /// history must still be this trainer's own steps (its noise multiplier
    /// and sample rate, [`PrivateTrainer::steps`] of them) for
    /// [`PrivateTrainer::save`], which refuses any other; to continue a
    /// saved run, use [`PrivateTrainer::resume`].
    pub fn set_accountant(&mut self, accountant: Accountant) {
        self.setup.accountant = accountant;
    }

    /// The optimiser (for its learning rate).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// How many input shapes the clipping step has traced: 1 after any
    /// number of steps, whatever their Poisson sizes, since every pass has
    /// the physical batch's shape.
    pub fn traced_signatures(&self) -> usize {
        self.clip.traced_signatures()
    }

    /// The noise multiplier `σ` in use.
    pub fn noise_multiplier(&self) -> f64 {
        self.setup.noise_multiplier
    }

    /// The sample rate `q = batch_size / N`.
    pub fn sample_rate(&self) -> f64 {
        self.setup.sample_rate
    }

    /// Steps per epoch: `1 / q` rounded, at least 1.
    pub fn steps_per_epoch(&self) -> usize {
        super::config::steps_per_epoch(self.setup.sample_rate)
    }

    /// The names of the parameters that train (and are noised), sorted;
    /// the rest of the `VarMap` is frozen.
    pub fn trainable_names(&self) -> &[String] {
        &self.setup.trainable
    }

    /// How many coordinates the noise is added to: the trainable
    /// parameters' element count, the `d` of the privacy statement.
    pub fn noise_dimension(&self) -> Result<usize> {
        Ok(self.params_now()?.values().map(Tensor::elem_count).sum())
    }
}

fn zeros(params: &BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    params.iter().map(|(k, p)| Ok((k.clone(), p.zeros_like()?))).collect()
}

fn add_trees(mut a: BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    for (k, v) in a.iter_mut() {
        let other = b.get(k).ok_or_else(|| Error::Internal {
            op: "PrivateTrainer::step".into(),
            msg: format!("the clipped sums disagree on {k:?}"),
        })?;
        *v = (&*v + other)?;
    }
    Ok(a)
}
