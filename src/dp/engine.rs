//! DP-SGD training at Opacus's level: a [`PrivacyEngine`] turns a
//! per-example loss, a `VarMap`, an optimiser and a data set into a
//! [`PrivateTrainer`] whose `step` does everything one private step needs.
//!
//! One step, as Opacus takes it:
//!
//! 1. **Poisson sampling**: each example joins the logical batch with
//!    probability `q = batch_size / N`, from the engine's generator.
//! 2. **Virtual batches**: the logical batch runs in passes of a fixed
//!    physical size (Opacus's `BatchMemoryManager`), the last one padded
//!    with examples of weight 0, so that every pass has the same shapes: a
//!    new Poisson size never traces or times anything again, and memory is
//!    bounded by the physical size.
//! 3. **Clipping** ([`clipped_grad_sum`](super::clipped_grad_sum)): each
//!    example's gradient clipped to the bound (flat) or each group of
//!    parameters to its own (per layer), with ghost norms where they pay.
//! 4. **Noise**, once per logical step: `N(0, (σ S)²)` per coordinate with
//!    `S` the sensitivity (the bound, or `sqrt(Σ bounds²)` per layer), from
//!    the secure sampler; then division by the expected batch size `q N`.
//! 5. **The update** by any [`Optimizer`] (DP-SGD, DP-Adam, DP-AdamW).
//! 6. **Accounting**: the step is recorded with `(σ, q)`.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_func::dp::{self, DpConfig, PrivacyEngine};
//! use candle_func::{nn, Tracer};
//! use std::collections::BTreeMap;
//! let dev = Device::Cpu;
//! let varmap = candle_nn::VarMap::new();
//! let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let model = nn::linear(4, 3, vb.pp("fc"))?;
//! let xs = Tensor::randn(0f32, 1., (100, 4), &dev)?;
//! let ys = Tensor::from_vec((0..100u32).map(|i| i % 3).collect(), 100, &dev)?;
//! // one example's loss
//! let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
//!     let logits = nn::functional_call(&model, &p, &x.unsqueeze(0)?)?;
//!     nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
//! };
//! let mut trainer = PrivacyEngine::new() // PRV accountant, OS-keyed noise, ghost clipping
//!     .physical_batch(8)
//!     .make_private_with_epsilon(
//!         loss,
//!         &varmap,
//!         dp::AdamW::new(&varmap, 1e-3, 0.01)?,
//!         (&xs, &ys),
//!         DpConfig::new(10, 0.0, 1.0), // expected batch 10, σ chosen below, C = 1
//!         (3.0, 1e-5, 2.0),           // ε = 3 at δ = 1e-5 over 2 epochs
//!     )?;
//! for _ in 0..2 * trainer.steps_per_epoch() {
//!     trainer.step()?;
//! }
//! assert!(trainer.epsilon(1e-5)? <= 3.0);
//! assert_eq!(trainer.traced_signatures(), 1); // every pass has the physical batch's shape
//! let checkpoint = trainer.accountant().to_json(); // resume with Accountant::from_json
//! # let _ = checkpoint;
//! # Ok::<(), candle_func::Error>(())
//! ```

use super::accountant::{noise_multiplier_with, Accountant, Mechanism};
use super::clip::{clipped_grad_sum, ClippedGradSum};
use super::collective::{self, Collective};
use super::optim::Optimizer;
use super::rng::Rng;
use crate::error::{CollectiveFailure, Error, Result};
use crate::ir::options::Options;
use crate::trace::Tracer;
use crate::transforms::Function;
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;

/// How per-example gradients are bounded.
#[derive(Clone, Debug, PartialEq)]
pub enum Clipping {
    /// The whole gradient to this L2 norm (Opacus's `"flat"`).
    Flat(f64),
    /// Each group of parameters to its own norm (Opacus's `"per_layer"`,
    /// with groups): `(prefix, bound)` where a parameter belongs to the
    /// first group whose prefix is its name or a `.`-separated head of it
    /// (`"fc1"` holds `fc1.weight` and `fc1.bias`). Every parameter must
    /// belong to a group.
    PerLayer(Vec<(String, f64)>),
}

/// The privacy parameters of [`PrivacyEngine::make_private`].
#[derive(Clone, Debug, PartialEq)]
pub struct DpConfig {
    /// The expected logical batch size: the sample rate is `batch_size / N`.
    pub batch_size: usize,
    /// The noise's standard deviation over the sensitivity, `σ`.
    pub noise_multiplier: f64,
    /// The clipping of per-example gradients.
    pub clipping: Clipping,
}

impl DpConfig {
    /// Flat clipping to `max_grad_norm`.
    pub fn new(batch_size: usize, noise_multiplier: f64, max_grad_norm: f64) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::Flat(max_grad_norm),
        }
    }

    /// Per-layer clipping: `(prefix, bound)` groups (see [`Clipping::PerLayer`]).
    pub fn per_layer(batch_size: usize, noise_multiplier: f64, groups: &[(&str, f64)]) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::PerLayer(groups.iter().map(|&(p, c)| (p.to_string(), c)).collect()),
        }
    }
}

/// Builds private trainers (Opacus's `PrivacyEngine`): which accountant,
/// which generator, ghost clipping or not, and the physical batch size.
#[derive(Debug)]
pub struct PrivacyEngine {
    mechanism: Mechanism,
    rng: Option<Rng>,
    ghost: bool,
    secure_mode: bool,
    physical_batch: Option<usize>,
    eps_error: Option<f64>,
    options: Options,
}

impl Default for PrivacyEngine {
    fn default() -> PrivacyEngine {
        PrivacyEngine::new()
    }
}

impl PrivacyEngine {
    /// The PRV accountant, a generator keyed from the operating system, and
    /// ghost clipping.
    pub fn new() -> PrivacyEngine {
        PrivacyEngine {
            mechanism: Mechanism::Prv,
            rng: None,
            ghost: true,
            secure_mode: true,
            physical_batch: None,
            eps_error: None,
            options: Options::new(),
        }
    }

    /// The analysis the trainer's accountant reports ε by.
    pub fn accountant(mut self, mechanism: Mechanism) -> PrivacyEngine {
        self.mechanism = mechanism;
        self
    }

    /// The PRV accountant's error band on ε (default 0.01, Opacus's; see
    /// [`Accountant::with_eps_error`]), for `make_private_with_epsilon`'s
    /// search and the trainer's accountant.
    pub fn eps_error(mut self, eps_error: f64) -> PrivacyEngine {
        self.eps_error = Some(eps_error);
        self
    }

    /// The generator for sampling and noise; [`Rng::seeded`] makes a run
    /// reproducible and **not private against anyone who knows the seed**.
    pub fn rng(mut self, rng: Rng) -> PrivacyEngine {
        self.rng = Some(rng);
        self
    }

    /// Ghost clipping where it pays (default), or every per-sample gradient
    /// materialised.
    pub fn ghost(mut self, on: bool) -> PrivacyEngine {
        self.ghost = on;
        self
    }

    /// Whether noise is drawn as the four-draw sum that defeats the
    /// floating-point attack on a single Gaussian draw (default, see
    /// [`Rng::normal_tensor`]), or one draw a coordinate
    /// ([`Rng::normal_tensor_single_draw`]: Opacus's default, four times
    /// cheaper, **open to that attack**). The generator stays OS-keyed
    /// either way unless [`PrivacyEngine::rng`] says otherwise.
    pub fn secure_mode(mut self, on: bool) -> PrivacyEngine {
        self.secure_mode = on;
        self
    }

    /// Examples per pass (Opacus's `max_physical_batch_size`), at least 1.
    /// The default, a quarter of the expected batch, pads at most a quarter
    /// of a batch per step while keeping passes large. Every pass holds
    /// this many examples (a short one padded with examples weighted 0), so
    /// that a new Poisson batch size never traces again; more than the data
    /// set's size is taken as its size, since no batch is larger.
    pub fn physical_batch(mut self, n: usize) -> PrivacyEngine {
        self.physical_batch = Some(n);
        self
    }

    /// Options for the transforms inside (convolution route, strict mode).
    pub fn options(mut self, options: Options) -> PrivacyEngine {
        self.options = options;
        self
    }

    /// A trainer for `loss(params, x, y)`, the loss of ONE example (`x` and
    /// `y` without a batch axis), over the variables of `varmap`, stepping
    /// `optimizer`, on the data set `(xs, ys)` (examples along axis 0; `ys`
    /// of whatever dtype the loss reads, u32 class ids for
    /// `nn::cross_entropy`).
    ///
    /// Write the closure's argument types out, `|p: BTreeMap<String,
    /// Tracer>, x: Tracer, y: Tracer|`: the bound is the crate's
    /// [`Function`] trait, which Rust cannot infer closure arguments from.
    /// A `&loss` works too, to share one closure between trainers.
    pub fn make_private<F, O>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        (xs, ys): (&Tensor, &Tensor),
        config: DpConfig,
    ) -> Result<PrivateTrainer<F, O>>
    where
        F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
        O: Optimizer,
    {
        let n = examples(xs, ys)?;
        let q = sample_rate(config.batch_size, n)?;
        super::positive("make_private", "noise_multiplier", config.noise_multiplier, true)?;
        let names = super::optim::var_names(varmap)?;
        if names.is_empty() {
            return Err(Error::data("make_private", "the VarMap has no variables to train"));
        }
        if self.physical_batch == Some(0) {
            return Err(Error::privacy("make_private", "physical_batch", ">= 1", 0));
        }
        let (of_leaf, bounds) = groups(&names, &config.clipping)?;
        let sensitivity = bounds.iter().map(|c| c * c).sum::<f64>().sqrt();
        // the default, a quarter of a batch of at least 1, is at least 1;
        // no logical batch holds more than the n examples there are
        let physical = self.physical_batch.unwrap_or(config.batch_size.div_ceil(4)).min(n);
        let clip = clipped_grad_sum(Masked(loss), bounds[0])
            .per_group(of_leaf, bounds)
            .ghost(self.ghost)
            .options(self.options);
        let accountant = self.accountant_new()?;
        let rng = match self.rng {
            Some(r) => r,
            None => Rng::from_os()?,
        };
        if rng.is_seeded() {
            crate::transforms::settings::warn_once(
                "dp-seeded-rng".into(),
                "make_private: a seeded generator makes the noise predictable from its seed: \
                 reproducible, but not private"
                    .into(),
            );
        }
        Ok(PrivateTrainer {
            clip,
            varmap: varmap.clone(),
            optimizer,
            accountant,
            rng,
            xs: xs.clone(),
            ys: ys.clone(),
            sample_rate: q,
            noise_multiplier: config.noise_multiplier,
            sensitivity,
            physical,
            secure_mode: self.secure_mode,
            bound: match config.clipping {
                Clipping::Flat(c) => Some(c),
                Clipping::PerLayer(_) => None,
            },
            comm: None,
        })
    }

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
        (target_epsilon, delta, epochs): (f64, f64, f64),
    ) -> Result<PrivateTrainer<F, O>>
    where
        F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
        O: Optimizer,
    {
        let q = sample_rate(config.batch_size, examples(data.0, data.1)?)?;
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
        let config = DpConfig {
            noise_multiplier,
            ..config
        };
        self.make_private(loss, varmap, optimizer, data, config)
    }
}

impl PrivacyEngine {
    /// An empty accountant of the engine's mechanism and error band.
    fn accountant_new(&self) -> Result<Accountant> {
        let acc = Accountant::new(self.mechanism);
        match self.eps_error {
            Some(e) => acc.with_eps_error(e),
            None => Ok(acc),
        }
    }
}

/// The number of examples, the same in `xs` and `ys`.
fn examples(xs: &Tensor, ys: &Tensor) -> Result<usize> {
    match (xs.dims().first(), ys.dims().first()) {
        (Some(&a), Some(&b)) if a == b && a > 0 => Ok(a),
        _ => Err(Error::shape(
            "make_private",
            &[xs.dims(), ys.dims()],
            "inputs and targets need the same, non-zero number of examples along axis 0",
        )),
    }
}

fn sample_rate(batch_size: usize, n: usize) -> Result<f64> {
    if batch_size == 0 || batch_size > n {
        let expected = format!("in 1..={n} (the data set's size)");
        return Err(Error::privacy("make_private", "batch_size", expected, batch_size));
    }
    Ok(batch_size as f64 / n as f64)
}

fn steps_per_epoch(q: f64) -> usize {
    ((1.0 / q).round() as usize).max(1)
}

/// Each parameter's group (in name order) and each group's bound.
fn groups(names: &[String], clipping: &Clipping) -> Result<(Vec<usize>, Vec<f64>)> {
    match clipping {
        Clipping::Flat(c) => {
            super::positive("make_private", "max_grad_norm", *c, false)?;
            Ok((vec![0; names.len()], vec![*c]))
        }
        Clipping::PerLayer(groups) => {
            for (p, c) in groups {
                super::positive("make_private", &format!("the bound of group {p:?}"), *c, false)?;
            }
            let of_leaf = names
                .iter()
                .map(|name| {
                    let holds = |p: &str| name == p || name.strip_prefix(p).is_some_and(|r| r.starts_with('.'));
                    groups.iter().position(|(p, _)| holds(p)).ok_or_else(|| {
                        let prefixes: Vec<&String> = groups.iter().map(|g| &g.0).collect();
                        let expected = format!("in a per-layer clipping group (prefixes: {prefixes:?})");
                        Error::privacy("make_private", format!("parameter {name:?}"), expected, "in none")
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // A group that holds no parameter would add its bound to the
            // sensitivity, and so noise, for nothing: a misspelt prefix.
            if let Some(k) = (0..groups.len()).find(|k| !of_leaf.contains(k)) {
                let expected = format!("a prefix of some parameter's name (parameters: {names:?})");
                let setting = format!("per-layer clipping group {:?}", groups[k].0);
                return Err(Error::privacy("make_private", setting, expected, "a prefix of none"));
            }
            Ok((of_leaf, groups.iter().map(|g| g.1).collect()))
        }
    }
}

/// The per-example loss times the example's weight (1, or 0 for padding):
/// a padded example's gradient is exactly zero, so it adds nothing.
struct Masked<F>(F);

impl<F> Function<(BTreeMap<String, Tracer>, Tracer, Tracer, Tracer)> for Masked<F>
where
    F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
{
    type Output = Tracer;

    fn apply(&self, (p, x, y, w): (BTreeMap<String, Tracer>, Tracer, Tracer, Tracer)) -> Result<Tracer> {
        let l = self.0.apply((p, x, y))?;
        l.mul(&w.to_dtype(l.dtype())?)
    }
}

/// What one private step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepInfo {
    /// The logical (Poisson) batch size.
    pub batch_size: usize,
    /// Passes of the physical batch size it took (on this rank, when
    /// distributed).
    pub passes: usize,
    /// The mean loss over the batch's examples (NaN for an empty batch).
    pub mean_loss: f64,
    /// The fraction of the batch's examples whose gradient norm exceeded
    /// the bound (flat clipping; NaN per layer or for an empty batch).
    pub clipped_fraction: f64,
}

/// A DP-SGD training loop's state: the clipping transform, the optimiser,
/// the accountant and the generator (see the module docs for one step).
pub struct PrivateTrainer<F, O> {
    clip: ClippedGradSum<Masked<F>>,
    varmap: VarMap,
    optimizer: O,
    accountant: Accountant,
    rng: Rng,
    xs: Tensor,
    ys: Tensor,
    sample_rate: f64,
    noise_multiplier: f64,
    sensitivity: f64,
    physical: usize,
    secure_mode: bool,
    bound: Option<f64>,
    comm: Option<Box<dyn Collective>>,
}

impl<F, O> PrivateTrainer<F, O>
where
    F: Function<(BTreeMap<String, Tracer>, Tracer, Tracer), Output = Tracer>,
    O: Optimizer,
{
    /// One private step: sample, clip in passes, add noise once, update,
    /// account. Distributed ([`PrivateTrainer::distributed`]), each rank
    /// clips its share of the logical batch and the step ends with every
    /// rank's parameters checked equal.
    pub fn step(&mut self) -> Result<StepInfo> {
        let n = self.xs.dims()[0];
        let (q, rng) = (self.sample_rate, &mut self.rng);
        let (idx, mine) = match &self.comm {
            Some(c) => {
                let idx = collective::broadcast_batch(c.as_ref(), || rng.poisson_sample(n, q))?;
                let mine = collective::shard(&idx, c.rank(), c.size());
                (idx, mine)
            }
            None => {
                let idx = rng.poisson_sample(n, q);
                (idx.clone(), idx)
            }
        };
        let params = super::optim::var_tensors(&self.varmap)?;
        // Distributed, a local failure must not leave the other ranks in a
        // collective: it is carried into the all-reduce as a flag, and
        // every rank fails the step together.
        let local = self.clip_share(&mine, &params);
        let (sum, loss_sum, over, failed) = match (local, &self.comm) {
            (Ok((s, l, o)), _) => (s, l, o, None),
            (Err(e), None) => return Err(e),
            (Err(e), Some(_)) => (zeros(&params)?, 0.0, 0.0, Some(e)),
        };
        let mut counts = [loss_sum, over, failed.is_some() as u8 as f64];
        let grads = self.noisy_mean(sum, n, &mut counts, failed.is_none());
        let [loss_sum, over, failures] = counts;
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
        self.accountant.step(self.noise_multiplier, self.sample_rate)?;
        self.optimizer.step(&grads)?;
        if let Some(c) = &self.comm {
            collective::check_in_step(c.as_ref(), &super::optim::var_tensors(&self.varmap)?, "after a step")?;
        }
        let b = idx.len() as f64;
        Ok(StepInfo {
            batch_size: idx.len(),
            passes: mine.len().div_ceil(self.physical),
            mean_loss: if idx.is_empty() { f64::NAN } else { loss_sum / b },
            clipped_fraction: match (self.bound, idx.is_empty()) {
                (Some(_), false) => over / b,
                _ => f64::NAN,
            },
        })
    }

    /// This rank's clipped sum over `mine` in passes of the physical size,
    /// its summed loss and how many norms exceeded the flat bound.
    fn clip_share(
        &self,
        mine: &[usize],
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(BTreeMap<String, Tensor>, f64, f64)> {
        let mut sum: Option<BTreeMap<String, Tensor>> = None;
        let (mut loss_sum, mut over) = (0.0, 0usize);
        for chunk in mine.chunks(self.physical) {
            let (xs, ys, w) = self.pass(chunk)?;
            let (clipped, norms, losses) = self.clip.call((params, &xs, &ys, &w))?;
            loss_sum += losses.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
            if let Some(c) = self.bound {
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
        let expected = self.sample_rate * n as f64;
        let std = self.noise_multiplier * self.sensitivity;
        let first = ok && self.comm.as_ref().is_none_or(|c| c.rank() == 0);
        let scale = if self.comm.is_some() { 1.0 } else { 1.0 / expected };
        let mut noisy = BTreeMap::new();
        let mut failed = None;
        for (k, s) in sum {
            let s = match (first, &self.comm) {
                (false, _) => s,
                (true, None) => self.rng.add_noise(&s, std, scale, self.secure_mode)?,
                // rank 0 still joins the all-reduce, flagged, if it fails
                (true, Some(_)) => match self.rng.add_noise(&s, std, scale, self.secure_mode) {
                    Ok(t) => t,
                    Err(e) => {
                        failed.get_or_insert(e);
                        s
                    }
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
            .map(|(k, t)| Ok((k, t.affine(1.0 / expected, 0.0)?)))
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
        let before = super::optim::var_tensors(&self.varmap)?;
        collective::check_same_setup(&comm, &before, &self.xs, &self.ys)?;
        collective::broadcast_vars(&comm, &super::optim::vars_of(&self.varmap, "distributed")?)?;
        let params = super::optim::var_tensors(&self.varmap)?;
        collective::check_in_step(&comm, &params, "after the broadcast of rank 0's parameters")?;
        self.comm = Some(Box::new(comm));
        Ok(self)
    }

    /// One pass's inputs, targets and weights: the chunk's examples padded
    /// to the physical size with copies of its first, weighted 0.
    fn pass(&self, chunk: &[usize]) -> Result<(Tensor, Tensor, Tensor)> {
        let mut ids: Vec<u32> = Vec::with_capacity(self.physical);
        for &i in chunk {
            let id = u32::try_from(i)
                .map_err(|_| Error::data("PrivateTrainer::step", format!("example index {i} exceeds u32")))?;
            ids.push(id);
        }
        let pad = self.physical - chunk.len();
        ids.extend(std::iter::repeat_n(ids[0], pad));
        let weights: Vec<f32> = (0..self.physical).map(|i| (i < chunk.len()) as u8 as f32).collect();
        let dev = self.xs.device();
        let ids = Tensor::from_vec(ids, self.physical, dev)?;
        Ok((
            self.xs.index_select(&ids, 0)?,
            self.ys.index_select(&ids, 0)?,
            Tensor::from_vec(weights, self.physical, dev)?,
        ))
    }

    /// The ε spent so far at `delta`, by the engine's accountant.
    pub fn epsilon(&self, delta: f64) -> Result<f64> {
        self.accountant.epsilon(delta)
    }

    /// The accountant (save its [`Accountant::to_json`] with a checkpoint).
    pub fn accountant(&self) -> &Accountant {
        &self.accountant
    }

    /// Replaces the accountant, to resume a run from a checkpoint.
    pub fn set_accountant(&mut self, accountant: Accountant) {
        self.accountant = accountant;
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
        self.noise_multiplier
    }

    /// The sample rate `q = batch_size / N`.
    pub fn sample_rate(&self) -> f64 {
        self.sample_rate
    }

    /// Steps per epoch: `1 / q` rounded, at least 1.
    pub fn steps_per_epoch(&self) -> usize {
        steps_per_epoch(self.sample_rate)
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
