//! DP-SGD training at Opacus's level: a [`PrivacyEngine`] turns a
//! per-example loss, a `VarMap`, an optimiser and a data set into a
//! [`PrivateTrainer`] whose `step` does everything one private step needs.
//!
//! One step, as Opacus takes it:
//!
//! 1. **Sampling**: each example joins the logical batch with probability
//!    `q = batch_size / N`, from the engine's generator, or another
//!    [`Sampling`] scheme, which the accountant then analyses.
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
//! The examples may be any tree of tensors ([`PrivacyEngine::make_private_examples`]),
//! only some parameters may train ([`PrivacyEngine::trainable`]; LoRA
//! adapters are `nn::Lora`), the bound may adapt ([`DpConfig::adaptive`]),
//! and the whole state saves and resumes ([`PrivateTrainer::save`]).
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
//!         candle_func::optim::AdamW::new(&varmap, 1e-3, 0.01)?,
//!         (&xs, &ys),
//!         DpConfig::new(10, 0.0, 1.0), // expected batch 10, σ chosen below, C = 1
//!         (3.0, 1e-5, 2.0),           // ε = 3 at δ = 1e-5 over 2 epochs
//!     )?;
//! for _ in 0..2 * trainer.steps_per_epoch() {
//!     trainer.step()?;
//! }
//! assert!(trainer.epsilon(1e-5)? <= 3.0);
//! assert_eq!(trainer.traced_signatures(), 1); // every pass has the physical batch's shape
//! let dir = std::env::temp_dir().join(format!("candle_func_doc_dp_{}", std::process::id()));
//! trainer.save(&dir)?; // parameters, moments, accountant, step count: `resume` reads them
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), candle_func::Error>(())
//! ```

use super::accountant::{Accountant, Mechanism, Sampling};
use super::adaptive::Adaptive;
use super::clip::clipped_grad_sum;
use super::config::groups;
pub use super::config::{Clipping, DpConfig};
use super::dataset::Examples;
use super::dataset::{Dataset, TensorDataset};
use super::loss::Masked;
use super::precision::Precision;
use super::trainable::Trainable;
use super::trainer::Setup;
pub use super::trainer::{ExampleLoss, PrivateTrainer, StepInfo, XsYs};
use super::users::{UserGradient, Users};
use crate::error::{Error, Result};
use crate::ir::options::Options;
use crate::optim::Optimizer;
use crate::rng::Rng;
use crate::trace::Tracer;
use crate::transforms::tree::{SymTree, TensorTree, TreeDef};
use crate::transforms::Function;
use candle_core::Tensor;
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::marker::PhantomData;

/// Builds private trainers (Opacus's `PrivacyEngine`): which accountant,
/// which generator, ghost clipping or not, and the physical batch size.
#[derive(Debug)]
pub struct PrivacyEngine {
    mechanism: Option<Mechanism>,
    sampling: Sampling,
    rng: Option<Rng>,
    ghost: bool,
    secure_mode: bool,
    physical_batch: Option<usize>,
    memory_limit: Option<usize>,
    precision: Precision,
    eps_error: Option<f64>,
    options: Options,
    trainable: Trainable,
    users: Option<(Tensor, usize)>,
    user_gradient: Option<UserGradient>,
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
            mechanism: None,
            sampling: Sampling::Poisson,
            rng: None,
            ghost: true,
            secure_mode: true,
            physical_batch: None,
            memory_limit: None,
            precision: Precision::Native,
            eps_error: None,
            options: Options::new(),
            trainable: Trainable::all(),
            users: None,
            user_gradient: None,
        }
    }

    /// The analysis the trainer's accountant reports ε by (default: PRV
    /// for Poisson sampling, as Opacus; PLD for the other schemes).
    pub fn accountant(mut self, mechanism: Mechanism) -> PrivacyEngine {
        self.mechanism = Some(mechanism);
        self
    }

    /// How each step's batch is drawn (default [`Sampling::Poisson`]); the
    /// accountant analyses the run under the same scheme, and refuses one
    /// it has no sound analysis for. `WithoutReplacement` takes exactly the
    /// configured batch size each step; `TruncatedPoisson` names the data
    /// set's size, which must be the examples'.
    pub fn sampling(mut self, sampling: Sampling) -> PrivacyEngine {
        self.sampling = sampling;
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

    /// The most bytes the process may hold while the trainer steps: the
    /// weights, the optimiser's state, the gradient sums, the data set,
    /// one pass's graph, and the rest of the process as it is when the
    /// trainer is built (see [`MemoryPlan`](super::MemoryPlan)). Without a
    /// [`PrivacyEngine::physical_batch`], the trainer passes the largest
    /// number of examples at once whose plan fits (at most the default);
    /// with one, a plan over the limit is an error naming the largest that
    /// fits. Either way `make_private` refuses a limit nothing fits under,
    /// before any step runs. A limit in [`PrivacyEngine::options`] means
    /// the same; this one wins where both are set.
    pub fn memory_limit(mut self, bytes: usize) -> PrivacyEngine {
        self.memory_limit = Some(bytes);
        self
    }

    /// How the loss computes: in each weight's own dtype (the default), or
    /// mixed precision ([`Precision::Bf16Mixed`], [`Precision::F16Mixed`]):
    /// the loss in half precision, the trainable weights kept as f32
    /// masters (an error names one that is not f32), each example's norm,
    /// the clipping, the noise and the optimiser's state in f32, and the
    /// frozen weights as half-precision constants (held once when loaded
    /// in that dtype).
    pub fn precision(mut self, precision: Precision) -> PrivacyEngine {
        self.precision = precision;
        self
    }

    /// Options for the transforms inside: the convolution route, strict
    /// mode, and the inner `vmap`'s schedule, chunk size and randomness
    /// (`Randomness::Different` for a loss with dropout). The ghost rules
    /// read the batched graph: a per-example schedule or a chunk size
    /// materialises every per-sample gradient instead.
    pub fn options(mut self, options: Options) -> PrivacyEngine {
        self.options = options;
        self
    }

    /// Which of the `VarMap`'s variables train (default: all). The others
    /// are frozen: constants of the traced loss, with no per-sample
    /// gradient, no noise, no update and no optimiser state. A prefix that
    /// holds no variable is an error, and so is a trainable variable the
    /// loss never reaches (its gradient would be zero whatever the data).
    pub fn trainable(mut self, trainable: Trainable) -> PrivacyEngine {
        self.trainable = trainable;
        self
    }

    /// User-level DP: `users` holds each example's
    /// user id (`[N]`, any integer dtype), and the guarantee protects a
    /// user with all their examples. Each step samples users by the
    /// engine's [`Sampling`] at the rate `config.batch_size / users` (the
    /// batch size counts users), takes at most `max_examples` of each
    /// sampled user's examples (drawn uniformly when the user has more),
    /// clips the user's combined gradient ([`UserGradient`], the mean by
    /// default) to the bound, adds `σ C` noise once and divides by the
    /// expected number of users. The accountant's ε is then per user.
    /// Ghost clipping applies: a user's norm has the cross terms between
    /// its examples. With one example a user this is example-level DP, bit
    /// for bit. Each pass holds `physical_batch` users of `max_examples`
    /// slots (fewer when no user has that many).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_func::dp::{self, DpConfig, PrivacyEngine, UserGradient};
    /// use candle_func::{nn, Tracer};
    /// use std::collections::BTreeMap;
    /// let dev = Device::Cpu;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    /// let model = nn::linear(4, 3, vb.pp("fc"))?;
    /// let xs = Tensor::randn(0f32, 1., (60, 4), &dev)?;
    /// let ys = Tensor::from_vec((0..60u32).map(|i| i % 3).collect(), 60, &dev)?;
    /// let users = Tensor::from_vec((0..60u32).map(|i| i / 3).collect(), 60, &dev)?; // 20 users
    /// let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
    ///     let logits = nn::functional_call(&model, &p, &x.unsqueeze(0)?)?;
    ///     nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    /// };
    /// let mut trainer = PrivacyEngine::new()
    ///     .users(&users, 2) // at most 2 of a user's 3 examples a step
    ///     .user_gradient(UserGradient::Sum)
    ///     .make_private(loss, &varmap, candle_func::optim::Sgd::new(&varmap, 0.1, 0.0)?, (&xs, &ys), DpConfig::new(5, 1.0, 1.0))?;
    /// let info = trainer.step()?;
    /// assert_eq!(trainer.sample_rate(), 5.0 / 20.0); // users sampled, not examples
    /// assert!(info.examples <= 2 * info.batch_size);
    /// # use candle_func::nn::Module;
    /// # Ok::<(), candle_func::Error>(())
    /// ```
    pub fn users(mut self, users: &Tensor, max_examples: usize) -> PrivacyEngine {
        self.users = Some((users.clone(), max_examples));
        self
    }

    /// How a user's examples' gradients combine before clipping under
    /// [`PrivacyEngine::users`] (default [`UserGradient::Mean`]); an error
    /// at `make_private` without users.
    pub fn user_gradient(mut self, gradient: UserGradient) -> PrivacyEngine {
        self.user_gradient = Some(gradient);
        self
    }

    /// A trainer for `loss(params, x, y)`, the loss of ONE example (`x` and
    /// `y` without a batch axis), over the variables of `varmap`, stepping
    /// `optimizer`, on the data set `(xs, ys)` (examples along axis 0; `ys`
    /// of whatever dtype the loss reads, u32 class ids for
    /// `nn::cross_entropy`). `params` holds every variable by name, the
    /// frozen ones (see [`PrivacyEngine::trainable`]) as constants.
    ///
    /// Write the closure's argument types out, `|p: BTreeMap<String,
    /// Tracer>, x: Tracer, y: Tracer|`: the bound is the crate's
    /// [`Function`] trait, which Rust cannot infer closure arguments from.
    /// A `&loss` works too, to share one closure between trainers. For
    /// examples of more than two tensors, see
    /// [`PrivacyEngine::make_private_examples`].
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
        self.build(loss, varmap, optimizer, Box::new(xs_ys(xs, ys)?), config)
    }

    /// A trainer whose examples are any tree of tensors sharing a leading
    /// example axis (`(ids [N, T], mask [N, T], labels [N])`, a map of
    /// named tensors), and whose `loss(params, example)` takes ONE
    /// example's tree (every leaf without its example axis). Sampling,
    /// virtual batches, clipping and accounting are those of
    /// [`PrivacyEngine::make_private`].
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_func::dp::{self, DpConfig, PrivacyEngine, Trainable};
    /// use candle_func::{nn, Tracer};
    /// use std::collections::BTreeMap;
    /// let dev = Device::Cpu;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    /// let emb = nn::embedding(50, 8, vb.pp("emb"))?;
    /// let head = nn::linear(8, 2, vb.pp("head"))?;
    /// let ids = Tensor::from_vec((0..60u32).map(|i| i % 50).collect(), (20, 3), &dev)?;
    /// let mask = Tensor::ones((20, 3), DType::F32, &dev)?;
    /// let labels = Tensor::from_vec((0..20u32).map(|i| i % 2).collect(), 20, &dev)?;
    /// // one example: its ids, its mask and its label
    /// let loss = |p: BTreeMap<String, Tracer>, (ids, mask, y): (Tracer, Tracer, Tracer)| {
    ///     let p = nn::Params::with(&p);
    ///     let h = emb.forward_with(&p, &ids)?; // [T, 8]
    ///     let pooled = h.broadcast_mul(&mask.unsqueeze(1)?)?.sum_keepdim(0)?; // [1, 8]
    ///     let logits = head.forward_with(&p, &pooled)?;
    ///     nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    /// };
    /// let mut trainer = PrivacyEngine::new()
    ///     .rng(candle_func::rng::Rng::seeded(0))
    ///     .trainable(Trainable::prefixes(&["head"])) // the embedding stays as it is
    ///     .make_private_examples(
    ///         loss,
    ///         &varmap,
    ///         candle_func::optim::Sgd::new(&varmap, 0.1, 0.0)?,
    ///         &(&ids, &mask, &labels),
    ///         DpConfig::new(5, 1.0, 1.0),
    ///     )?;
    /// trainer.step()?;
    /// assert_eq!(trainer.trainable_names(), ["head.bias", "head.weight"]);
    /// assert_eq!(trainer.noise_dimension()?, 8 * 2 + 2);
    /// # use candle_func::nn::Module;
    /// # Ok::<(), candle_func::Error>(())
    /// ```
    pub fn make_private_examples<F, O, D>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        data: &D,
        config: DpConfig,
    ) -> Result<PrivateTrainer<F, O, D::Sym>>
    where
        D: TensorTree + ?Sized,
        F: Function<(BTreeMap<String, Tracer>, D::Sym), Output = Tracer>,
        O: Optimizer,
    {
        self.build(loss, varmap, optimizer, Box::new(TensorDataset::new(data)?), config)
    }

    /// A trainer over any [`Dataset`]: each step fetches only the examples
    /// it sampled (each pass's, padding included), so the data set need not
    /// fit in memory (a [`SafetensorsDataset`](super::SafetensorsDataset)
    /// reads rows from shards on disk). The loss takes one example's tree
    /// as the dataset describes it ([`Dataset::tree`]: a
    /// `BTreeMap<String, Tracer>` for safetensors shards). Sampling,
    /// virtual batches, clipping and accounting are those of
    /// [`PrivacyEngine::make_private`].
    pub fn make_private_dataset<F, O, S, D>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        dataset: D,
        config: DpConfig,
    ) -> Result<PrivateTrainer<F, O, S>>
    where
        D: Dataset + 'static,
        S: SymTree,
        F: Function<(BTreeMap<String, Tracer>, S), Output = Tracer>,
        O: Optimizer,
    {
        self.build(loss, varmap, optimizer, Box::new(dataset), config)
    }

    /// The trainer for either form of the examples.
    fn build<F, O, S>(
        self,
        loss: F,
        varmap: &VarMap,
        optimizer: O,
        source: Box<dyn Dataset>,
        config: DpConfig,
    ) -> Result<PrivateTrainer<F, O, S>>
    where
        F: ExampleLoss<S>,
        O: Optimizer,
    {
        let def = source.tree();
        let mut data = Examples::new(source)?;
        data.users = self.users_of(data.n)?;
        let n = data.units();
        let q = sample_rate(config.batch_size, n)?;
        super::positive("make_private", "noise_multiplier", config.noise_multiplier, true)?;
        let names = self.checked_names(varmap, n, data.users.is_some())?;
        let (trainable, frozen_names) = self.trainable.split(&names)?;
        let (of_leaf, bounds) = groups(&trainable, &config.clipping)?;
        let sensitivity = bounds.iter().map(|c| c * c).sum::<f64>().sqrt();
        // the default, a quarter of a batch of at least 1, is at least 1;
        // no logical batch holds more than the n examples there are
        let physical = self.physical_batch.unwrap_or(config.batch_size.div_ceil(4)).min(n);
        let adaptive = match &config.clipping {
            Clipping::Adaptive(spec) => Some(Adaptive::new(spec, config.noise_multiplier, q * n as f64)?),
            _ => None,
        };
        let (frozen, masters): (BTreeMap<_, _>, BTreeMap<_, _>) = crate::optim::var_tensors(varmap)?
            .into_iter()
            .partition(|(k, _)| frozen_names.contains(k));
        self.precision.check_trainable(&masters)?;
        let masked = Masked {
            loss,
            def,
            frozen: self.precision.frozen(frozen)?,
            half: self.precision.half(),
            per_user: data
                .users
                .as_ref()
                .is_some_and(Users::grouped)
                .then_some(self.options.randomness),
            form: PhantomData,
        };
        let mut clip = clipped_grad_sum(masked, bounds[0]).per_group(of_leaf, bounds);
        if let Clipping::Automatic(gamma) = config.clipping {
            clip = clip.automatic(gamma);
        }
        let clip = clip.ghost(self.ghost).options(self.options);
        let accountant = self.accountant_new()?;
        let rng = Self::generator(self.rng)?;
        let setup = Setup {
            trainable,
            accountant,
            rng,
            data,
            sample_rate: q,
            noise_multiplier: config.noise_multiplier,
            sensitivity,
            physical,
            secure_mode: self.secure_mode,
            bound: match config.clipping {
                Clipping::Flat(c) => Some(c),
                Clipping::Adaptive(_) => Some(1.0),
                Clipping::PerLayer(_) | Clipping::Automatic(_) => None,
            },
            adaptive,
            // the clipping graph's path: its options' (resolved as the
            // clipping transform resolves them), which the noise and the
            // optimiser's step take too
            path: self.options.machine().path,
        };
        let trainer = PrivateTrainer::new(clip, varmap, optimizer, setup)?;
        match self.memory_limit.or(self.options.memory_limit) {
            Some(limit) => trainer.fit_memory(limit, self.physical_batch.is_none()),
            None => Ok(trainer),
        }
    }
}

impl PrivacyEngine {
    /// The names of `varmap`'s variables, checked with the engine's
    /// settings against a data set of `n` units (users, where `by_user`).
    fn checked_names(&self, varmap: &VarMap, n: usize, by_user: bool) -> Result<Vec<String>> {
        if let Sampling::TruncatedPoisson { dataset_size, .. } = self.sampling {
            if dataset_size != n {
                let expected = format!("{n} (the number of {})", units(by_user));
                return Err(Error::privacy(
                    "make_private",
                    "Sampling::TruncatedPoisson dataset_size",
                    expected,
                    dataset_size,
                ));
            }
        }
        let names = crate::optim::var_names(varmap)?;
        if names.is_empty() {
            return Err(Error::data("make_private", "the VarMap has no variables to train"));
        }
        if self.physical_batch == Some(0) {
            return Err(Error::privacy("make_private", "physical_batch", ">= 1", 0));
        }
        Ok(names)
    }

    /// The generator `given` to the engine, else one keyed by the
    /// operating system; a seeded one is warned about (its noise is
    /// predictable).
    fn generator(given: Option<Rng>) -> Result<Rng> {
        let rng = match given {
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
        Ok(rng)
    }

    /// The users of `n` examples, under user-level DP.
    pub(super) fn users_of(&self, n: usize) -> Result<Option<Users>> {
        match (&self.users, self.user_gradient) {
            (Some((ids, k)), g) => Users::new(ids, *k, n, g.unwrap_or_default()).map(Some),
            (None, Some(_)) => Err(Error::privacy(
                "make_private",
                "user_gradient",
                "set with PrivacyEngine::users",
                "set without users",
            )),
            (None, None) => Ok(None),
        }
    }

    /// An empty accountant of the engine's mechanism, sampling scheme and
    /// error band.
    pub(super) fn accountant_new(&self) -> Result<Accountant> {
        let default = match self.sampling {
            Sampling::Poisson => Mechanism::Prv,
            _ => Mechanism::Pld,
        };
        let acc = Accountant::new(self.mechanism.unwrap_or(default)).with_sampling(self.sampling)?;
        match self.eps_error {
            Some(e) => acc.with_eps_error(e),
            None => Ok(acc),
        }
    }
}

/// The `(xs, ys)` form's two leaves, named for messages.
pub(super) fn xs_ys(xs: &Tensor, ys: &Tensor) -> Result<TensorDataset> {
    let leaves = vec![("xs".to_string(), xs.clone()), ("ys".to_string(), ys.clone())];
    TensorDataset::from_leaves(leaves, TreeDef::Tuple(vec![TreeDef::Leaf; 2]))
}

/// What is sampled, for messages.
fn units(users: bool) -> &'static str {
    if users {
        "users"
    } else {
        "examples"
    }
}

pub(super) fn sample_rate(batch_size: usize, n: usize) -> Result<f64> {
    if batch_size == 0 || batch_size > n {
        let expected = format!("in 1..={n} (the data set's size in sampled units: examples, or users)");
        return Err(Error::privacy("make_private", "batch_size", expected, batch_size));
    }
    Ok(batch_size as f64 / n as f64)
}
