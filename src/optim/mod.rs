//! Optimisers over a `VarMap` that take gradients as a name -> tensor map:
//! [`Sgd`], [`Adam`] and [`AdamW`] with parameter groups and saved state,
//! and [`CandleOptimizer`] for any `candle_nn::Optimizer`. Nothing in them
//! is private: with the privatized gradients of [`dp`](crate::dp) they are
//! DP-SGD, DP-Adam and DP-AdamW, since everything after the noise is
//! post-processing of private values, at no privacy cost. `dp` re-exports
//! them under the names DP code has always used (`dp::Adam`).

use crate::error::{positive, Error, Result};
use crate::nn::{overlap, under};
// The dtype an optimiser computes a variable's update in and keeps its
// state in: f32 for half-precision weights (as mixed-precision training
// keeps its moments; in bf16 `v * 0.999` rounds back to `v`, so Adam's
// second moment never decays), the weight's own otherwise.
use crate::interp::exec::portable_path;
use crate::kernels::accumulation_dtype as work_dtype;
use crate::kernels::{self, Path};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

mod candle;
pub use candle::CandleOptimizer;

/// `Optimizer::lr` and `set_lr` for an optimiser with an `lr` field.
macro_rules! lr_field {
    () => {
        fn lr(&self) -> f64 {
            self.lr
        }

        fn set_lr(&mut self, lr: f64) -> Result<()> {
            positive("set_lr", "lr", lr, true)?;
            self.groups.rescale(self.lr, lr);
            self.lr = lr;
            Ok(())
        }
    };
}

/// An optimiser's state for a checkpoint: its tensors (moments) and its
/// numbers (learning rates, step count, hyper-parameters) by name.
#[derive(Clone, Debug, Default)]
pub struct OptimizerState {
    /// Which optimiser (`"sgd"`, `"adam"`, `"adamw"`).
    pub kind: String,
    /// Per-variable tensors, named `{what}/{variable}` (`m/fc.weight`).
    pub tensors: BTreeMap<String, Tensor>,
    /// Scalars by name.
    pub scalars: BTreeMap<String, f64>,
}

fn state_error(msg: String) -> Error {
    Error::Checkpoint {
        what: "Optimizer::load_state",
        msg,
    }
}

impl OptimizerState {
    /// The scalar `name`, an error naming it when missing.
    fn scalar(&self, name: &str) -> Result<f64> {
        self.scalars
            .get(name)
            .copied()
            .ok_or_else(|| state_error(format!("the saved {} state has no {name:?}", self.kind)))
    }

    /// An error unless the saved hyper-parameter `name` is `value`: a
    /// resumed run with other settings is another run.
    fn same(&self, name: &str, value: f64) -> Result<()> {
        let saved = self.scalar(name)?;
        if saved.to_bits() != value.to_bits() {
            return Err(state_error(format!("{name} was {saved} when saved, is {value} now")));
        }
        Ok(())
    }

    /// The tensors saved under `what/`, each checked against its variable.
    fn per_var(&self, what: &str, vars: &BTreeMap<String, Var>) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for (k, t) in &self.tensors {
            let Some(name) = k.strip_prefix(what).and_then(|r| r.strip_prefix('/')) else {
                continue;
            };
            match vars.get(name) {
                Some(v) if v.dims() == t.dims() => out.insert(name.to_string(), t.to_dtype(work_dtype(v.dtype()))?),
                Some(v) => {
                    let msg = format!("{k:?} is {:?}, the variable {:?}", t.dims(), v.dims());
                    return Err(state_error(msg));
                }
                None => return Err(state_error(format!("{k:?} names no variable of the optimiser"))),
            };
        }
        Ok(out)
    }

    fn kind_is(&self, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(state_error(format!("saved by {:?}, loaded into {kind:?}", self.kind)));
        }
        Ok(())
    }
}

/// `groups`' learning rates as scalars `group/{prefix}/lr`.
fn group_scalars(groups: &Groups, into: &mut BTreeMap<String, f64>) {
    for (p, lr, _) in &groups.0 {
        into.insert(format!("group/{p}/lr"), *lr);
    }
}

/// `groups`' learning rates read back (the groups themselves must match).
fn load_groups(groups: &mut Groups, state: &OptimizerState) -> Result<()> {
    let saved = state.scalars.keys().filter(|k| k.starts_with("group/")).count();
    if saved != groups.0.len() {
        return Err(state_error(format!(
            "{saved} parameter groups saved, {} now",
            groups.0.len()
        )));
    }
    for g in &mut groups.0 {
        g.1 = state.scalar(&format!("group/{}/lr", g.0))?;
    }
    Ok(())
}

fn unsupported_state() -> Error {
    state_error("this optimiser does not save its state".into())
}

/// An optimiser stepping a `VarMap`'s variables by name.
pub trait Optimizer {
    /// One step with `grads` (name -> gradient, shaped like the variable).
    /// Every gradient must name a variable; variables without a gradient
    /// are left alone.
    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()>;
    /// The learning rate (of the variables in no group).
    fn lr(&self) -> f64;
    /// Sets the learning rate (for schedules); an error unless it is
    /// finite and `>= 0`. Each parameter group's rate is scaled by the
    /// same factor (set to `lr` when the old rate was 0).
    fn set_lr(&mut self, lr: f64) -> Result<()>;
    /// The state to save with a checkpoint (an error by default, for an
    /// optimiser that cannot).
    fn state(&self) -> Result<OptimizerState> {
        Err(unsupported_state())
    }
    /// Restores a [`Optimizer::state`]: all of it, or nothing and an error
    /// naming what does not match (another optimiser, other
    /// hyper-parameters or groups, a moment of another shape).
    fn load_state(&mut self, _state: &OptimizerState) -> Result<()> {
        Err(unsupported_state())
    }
    /// `(state, workspace)`: the bytes this optimiser's state holds once it
    /// has stepped every tensor of `params` (moments, velocities), and the
    /// most its step allocates besides at once. A trainer with a memory
    /// limit plans the process's memory with them; `None` (the default)
    /// says the optimiser does not tell, and the trainer then warns that
    /// its plan leaves the optimiser out.
    fn memory_bytes(&self, _params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        None
    }
    /// Runs candle's operations only (`true`) or the crate's CPU kernels
    /// where they apply (`false`). An optimiser starts on the path the
    /// `CANDLE_FUNC_PORTABLE` variable names when it is made; the DP
    /// trainer sets the path its clipping graph runs on, so one step runs
    /// on one path. One without kernels of its own ignores it (the
    /// default).
    fn set_portable(&mut self, _portable: bool) {}
}

/// The bytes `t` takes in the dtype an optimiser keeps its state in.
fn work_bytes(t: &Tensor) -> usize {
    t.elem_count().saturating_mul(work_dtype(t.dtype()).size_in_bytes())
}

/// `per_tensor` copies of every tensor of `params` in the work dtype, and
/// `temps` copies of the largest: an optimiser's state and its step's
/// workspace (its step works a tensor at a time).
fn sized(params: &BTreeMap<String, Tensor>, per_tensor: usize, temps: usize) -> (usize, usize) {
    let all: usize = params.values().map(work_bytes).fold(0, usize::saturating_add);
    let largest = params.values().map(work_bytes).max().unwrap_or(0);
    (all.saturating_mul(per_tensor), largest.saturating_mul(temps))
}

/// Stochastic gradient descent with momentum (PyTorch's formulation:
/// `g += wd w; v = momentum v + g; w -= lr v`, weight decay only in a
/// group that sets it), applied to named variables.
#[derive(Debug)]
pub struct Sgd {
    vars: BTreeMap<String, Var>,
    lr: f64,
    momentum: f64,
    velocity: BTreeMap<String, Tensor>,
    groups: Groups,
    path: Path,
}

impl Sgd {
    /// An optimiser over the variables of `varmap` (by name).
    pub fn new(varmap: &candle_nn::VarMap, lr: f64, momentum: f64) -> Result<Sgd> {
        check_hyper("Sgd", &[("lr", lr), ("momentum", momentum)])?;
        Ok(Sgd {
            vars: vars_of(varmap, "Sgd")?,
            lr,
            momentum,
            velocity: BTreeMap::new(),
            groups: Groups::default(),
            path: portable_path(None),
        })
    }

    /// A parameter group: the variables under `prefix` step with their own
    /// learning rate and (L2, added to the gradient) weight decay.
    pub fn group(mut self, prefix: &str, lr: f64, weight_decay: f64) -> Result<Sgd> {
        self.groups.add("Sgd::group", &self.vars, prefix, lr, weight_decay)?;
        Ok(self)
    }
}

/// `var = w - lr x`, where `w` is `decayed` (a fresh tensor) or else the
/// variable's own value: updated in place in one pass where the crate's
/// CPU kernels run (`kernels::zip::axpy_in_place`, bit for bit the
/// expression below), else a scaled copy and a difference, then `set`.
fn descend(var: &Var, decayed: Option<Tensor>, x: &Tensor, lr: f64, path: crate::kernels::Path) -> Result<()> {
    if x.dtype() != var.dtype() {
        // a half-precision weight: the step in f32, rounded once
        let w = match decayed {
            Some(w) => w,
            None => value(var)?,
        };
        return Ok(var.set(&(w - (x * lr)?)?.to_dtype(var.dtype())?)?);
    }
    let w = decayed.as_ref().unwrap_or(var.as_tensor());
    if crate::kernels::zip::axpy_in_place(w, x, -lr, path)? {
        return match &decayed {
            Some(w) => Ok(var.set(w)?),
            None => Ok(()),
        };
    }
    Ok(var.set(&(w - (x * lr)?)?)?)
}

impl Optimizer for Sgd {
    lr_field!();

    fn set_portable(&mut self, portable: bool) {
        self.path = portable_path(Some(portable));
    }

    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        let path = self.path;
        for (name, g) in grads {
            let (var, g) = checked(&self.vars, "sgd", name, g)?;
            let (lr, wd) = self.groups.of(name, (self.lr, 0.0));
            let g = if wd != 0.0 { (g + (value(var)? * wd)?)? } else { g };
            let v = match self.velocity.get(name) {
                Some(prev) if self.momentum != 0.0 => ((prev * self.momentum)? + &g)?,
                _ => g,
            };
            descend(var, None, &v, lr, path)?;
            // without momentum nothing carries over: keeping `v` would
            // hold a second copy of every gradient between steps
            if self.momentum != 0.0 {
                self.velocity.insert(name.clone(), v);
            }
        }
        Ok(())
    }

    fn memory_bytes(&self, params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        // the gradient in the work dtype, its decay term and the new velocity
        Some(sized(params, usize::from(self.momentum != 0.0), 3))
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut scalars = BTreeMap::from([("lr".to_string(), self.lr), ("momentum".to_string(), self.momentum)]);
        group_scalars(&self.groups, &mut scalars);
        let tensors = self
            .velocity
            .iter()
            .map(|(k, v)| (format!("velocity/{k}"), v.clone()))
            .collect();
        Ok(OptimizerState {
            kind: "sgd".into(),
            tensors,
            scalars,
        })
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        state.kind_is("sgd")?;
        state.same("momentum", self.momentum)?;
        let velocity = state.per_var("velocity", &self.vars)?;
        let lr = state.scalar("lr")?;
        let mut groups = self.groups.clone();
        load_groups(&mut groups, state)?;
        (self.velocity, self.lr, self.groups) = (velocity, lr, groups);
        Ok(())
    }
}

/// The variables of `varmap` by name.
pub(crate) fn vars_of(varmap: &candle_nn::VarMap, op: &'static str) -> Result<BTreeMap<String, Var>> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| Error::data(op, "the VarMap's lock is poisoned (a thread panicked holding it)"))?;
    Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// The names of `varmap`'s variables, sorted.
pub(crate) fn var_names(varmap: &candle_nn::VarMap) -> Result<Vec<String>> {
    Ok(vars_of(varmap, "make_private")?.into_keys().collect())
}

/// `varmap`'s variables' current values by name.
pub(crate) fn var_tensors(varmap: &candle_nn::VarMap) -> Result<BTreeMap<String, Tensor>> {
    Ok(vars_of(varmap, "PrivateTrainer")?
        .into_iter()
        .map(|(k, v)| (k, v.as_tensor().clone()))
        .collect())
}

/// The variable the gradient `g` of `name` is for: an error naming `op`
/// when there is none or its shape is not `g`'s.
pub(crate) fn var_for<'a>(
    vars: &'a BTreeMap<String, Var>,
    op: &'static str,
    name: &str,
    g: &Tensor,
) -> Result<&'a Var> {
    let var = vars.get(name).ok_or_else(|| Error::Tree {
        msg: format!("{op}: no variable named {name:?}"),
    })?;
    if var.dims() != g.dims() {
        return Err(Error::shape(
            op,
            &[var.dims(), g.dims()],
            format!("gradient of {name:?}"),
        ));
    }
    Ok(var)
}

/// The variable a gradient is for, and the gradient in its work dtype
/// (`work_dtype`).
fn checked<'a>(vars: &'a BTreeMap<String, Var>, op: &'static str, name: &str, g: &Tensor) -> Result<(&'a Var, Tensor)> {
    let var = var_for(vars, op, name, g)?;
    Ok((var, g.to_dtype(work_dtype(var.dtype()))?))
}

/// The variable's value in its work dtype.
fn value(var: &Var) -> Result<Tensor> {
    Ok(var.as_tensor().to_dtype(work_dtype(var.dtype()))?)
}

/// An error naming `op` unless each hyper-parameter is finite and `>= 0`.
fn check_hyper(op: &'static str, values: &[(&str, f64)]) -> Result<()> {
    values.iter().try_for_each(|&(name, v)| positive(op, name, v, true))
}

/// Parameter groups (`torch.optim`'s): variables under a prefix take their
/// own learning rate and weight decay, the rest the optimiser's.
#[derive(Clone, Debug, Default)]
struct Groups(Vec<(String, f64, f64)>);

impl Groups {
    /// The group of `name`'s `(lr, weight_decay)`, or `base`.
    fn of(&self, name: &str, base: (f64, f64)) -> (f64, f64) {
        self.0
            .iter()
            .find(|(p, _, _)| under(name, p))
            .map_or(base, |&(_, lr, wd)| (lr, wd))
    }

    /// A new group, checked: finite non-negative hyper-parameters, a
    /// prefix that holds a variable and is not already a group's.
    fn add(&mut self, op: &'static str, vars: &BTreeMap<String, Var>, prefix: &str, lr: f64, wd: f64) -> Result<()> {
        check_hyper(op, &[("lr", lr), ("weight_decay", wd)])?;
        if !vars.keys().any(|n| under(n, prefix)) {
            let names: Vec<&String> = vars.keys().take(8).collect();
            let expected = format!("a prefix of some variable's name (variables: {names:?}..)");
            return Err(Error::privacy(
                op,
                format!("group {prefix:?}"),
                expected,
                "a prefix of none",
            ));
        }
        if let Some((other, _, _)) = self.0.iter().find(|(p, _, _)| overlap(prefix, p)) {
            return Err(Error::privacy(
                op,
                format!("group {prefix:?}"),
                "apart from every other group",
                format!("overlapping group {other:?}"),
            ));
        }
        self.0.push((prefix.to_string(), lr, wd));
        Ok(())
    }

    /// Every group's learning rate scaled as the base one moves from `old`
    /// to `new` (what a schedule does to each of `torch.optim`'s groups);
    /// from 0, each group is set to `new`.
    fn rescale(&mut self, old: f64, new: f64) {
        for g in &mut self.0 {
            g.1 = if old > 0.0 { g.1 * (new / old) } else { new };
        }
    }
}

/// Adam (PyTorch's formulation with bias correction):
/// `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`, `w -= lr m^ /
/// (sqrt(v^) + eps)`, without weight decay.
#[derive(Debug)]
pub struct Adam {
    vars: BTreeMap<String, Var>,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    /// Weight decay: decoupled (AdamW's, `w *= 1 - lr wd` before the
    /// update) or, for Adam, L2 added to the gradient (PyTorch's Adam).
    weight_decay: f64,
    decoupled: bool,
    steps: i32,
    moments: BTreeMap<String, (Tensor, Tensor)>,
    /// Whether the moments may be shared with an [`OptimizerState`] that
    /// `state` gave out or `load_state` took: the next step copies each
    /// before updating it in place, so a state once handed out never
    /// changes.
    shared: AtomicBool,
    groups: Groups,
    path: Path,
}

impl Adam {
    /// Adam over the variables of `varmap` with PyTorch's defaults (betas
    /// 0.9 and 0.999, eps 1e-8).
    pub fn new(varmap: &candle_nn::VarMap, lr: f64) -> Result<Adam> {
        check_hyper("Adam", &[("lr", lr)])?;
        Ok(Adam {
            vars: vars_of(varmap, "Adam")?,
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            steps: 0,
            moments: BTreeMap::new(),
            shared: AtomicBool::new(false),
            groups: Groups::default(),
            path: portable_path(None),
        })
    }

    /// A parameter group: the variables under `prefix` step with their own
    /// learning rate and weight decay (L2, added to the gradient, as
    /// PyTorch's Adam has it).
    pub fn group(mut self, prefix: &str, lr: f64, weight_decay: f64) -> Result<Adam> {
        self.groups.add("Adam::group", &self.vars, prefix, lr, weight_decay)?;
        Ok(self)
    }

    /// Other betas (each in `[0, 1)`) and eps (finite, `> 0`).
    pub fn with(mut self, betas: (f64, f64), eps: f64) -> Result<Adam> {
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        if !(beta_ok(betas.0) && beta_ok(betas.1)) {
            return Err(Error::privacy("Adam", "betas", "each in [0, 1)", format!("{betas:?}")));
        }
        positive("Adam", "eps", eps, false)?;
        self.betas = betas;
        self.eps = eps;
        Ok(self)
    }
}

impl Optimizer for Adam {
    lr_field!();

    fn set_portable(&mut self, portable: bool) {
        self.path = portable_path(Some(portable));
    }

    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        self.steps = self.steps.saturating_add(1);
        let (b1, b2) = self.betas;
        let (c1, c2) = (1.0 - b1.powi(self.steps), 1.0 - b2.powi(self.steps));
        let path = self.path;
        let shared = self.shared.swap(false, Ordering::Relaxed);
        for (name, g) in grads {
            let (var, g) = checked(&self.vars, "adam", name, g)?;
            let (lr, wd) = self.groups.of(name, (self.lr, self.weight_decay));
            let g = if wd != 0.0 && !self.decoupled {
                (g + (value(var)? * wd)?)?
            } else {
                g
            };
            let (m, v) = match self.moments.remove(name) {
                // in place where the crate's kernel takes them, copies
                // first where a handed-out state may share them
                Some((m, v)) if kernels::adam::fits(&[&m, &v, &g], path) => {
                    let (m, v) = if shared { (m.copy()?, v.copy()?) } else { (m, v) };
                    kernels::adam::moments_in_place(&m, &v, &g, (b1, b2))?;
                    (m, v)
                }
                Some((m, v)) => (
                    ((m * b1)? + (&g * (1.0 - b1))?)?,
                    ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                ),
                None => ((&g * (1.0 - b1))?, (g.sqr()? * (1.0 - b2))?),
            };
            let decoupled = wd != 0.0 && self.decoupled;
            let u = kernels::adam::Update {
                lr,
                c1,
                c2,
                eps: self.eps,
                decay: decoupled.then_some(1.0 - lr * wd),
            };
            if var.dtype() == m.dtype() && kernels::adam::update_in_place(var.as_tensor(), &m, &v, u, path)? {
                self.moments.insert(name.clone(), (m, v));
                continue;
            }
            let denom = ((&v / c2)?.sqrt()? + self.eps)?;
            let update = ((&m / c1)? / denom)?;
            let decayed = match decoupled {
                true => Some((value(var)? * (1.0 - lr * wd))?),
                false => None,
            };
            descend(var, decayed, &update, lr, path)?;
            self.moments.insert(name.clone(), (m, v));
        }
        Ok(())
    }

    fn memory_bytes(&self, params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        // two moments. The step in place holds at most copies of one
        // tensor's moments (after a state was handed out) and L2 decay's
        // gradient; with candle's operations, the gradient, the old and
        // new moments and the denominator and update of one tensor
        let path = self.path;
        let in_place = params.values().all(|p| kernels::adam::fits(&[p], path));
        Some(sized(params, 2, if in_place { 4 } else { 6 }))
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut scalars: BTreeMap<String, f64> = [
            ("lr", self.lr),
            ("steps", f64::from(self.steps)),
            ("beta1", self.betas.0),
            ("beta2", self.betas.1),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        group_scalars(&self.groups, &mut scalars);
        let mut tensors = BTreeMap::new();
        // the state shares the moments' storage: the next step updates copies
        self.shared.store(true, Ordering::Relaxed);
        for (k, (m, v)) in &self.moments {
            tensors.insert(format!("m/{k}"), m.clone());
            tensors.insert(format!("v/{k}"), v.clone());
        }
        let kind = if self.decoupled { "adamw" } else { "adam" };
        Ok(OptimizerState {
            kind: kind.into(),
            tensors,
            scalars,
        })
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        state.kind_is(if self.decoupled { "adamw" } else { "adam" })?;
        for (k, v) in [
            ("beta1", self.betas.0),
            ("beta2", self.betas.1),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
        ] {
            state.same(k, v)?;
        }
        let (m, v) = (state.per_var("m", &self.vars)?, state.per_var("v", &self.vars)?);
        if m.keys().ne(v.keys()) {
            return Err(state_error(
                "the first and second moments name different variables".into(),
            ));
        }
        let steps = state.scalar("steps")?;
        if !(steps >= 0.0 && steps <= f64::from(i32::MAX) && steps.fract() == 0.0) {
            return Err(state_error(format!("steps {steps} is not a count")));
        }
        let lr = state.scalar("lr")?;
        let mut groups = self.groups.clone();
        load_groups(&mut groups, state)?;
        self.moments = m
            .into_iter()
            .zip(v.into_values())
            .map(|((k, m), v)| (k, (m, v)))
            .collect();
        // the moments may share the caller's state's storage
        self.shared.store(true, Ordering::Relaxed);
        (self.steps, self.lr, self.groups) = (steps as i32, lr, groups);
        Ok(())
    }
}

/// AdamW (Loshchilov and Hutter 2019, PyTorch's formulation): Adam with
/// decoupled weight decay, `w *= 1 - lr wd` before each update.
#[derive(Debug)]
pub struct AdamW(Adam);

impl AdamW {
    /// AdamW over the variables of `varmap` with PyTorch's defaults (betas
    /// 0.9 and 0.999, eps 1e-8); PyTorch's default decay is 0.01.
    pub fn new(varmap: &candle_nn::VarMap, lr: f64, weight_decay: f64) -> Result<AdamW> {
        check_hyper("AdamW", &[("lr", lr), ("weight_decay", weight_decay)])?;
        let mut adam = Adam::new(varmap, lr)?;
        adam.weight_decay = weight_decay;
        adam.decoupled = true;
        Ok(AdamW(adam))
    }

    /// A parameter group: the variables under `prefix` step with their own
    /// learning rate and decoupled weight decay (a head trained faster than
    /// the body, biases and norms without decay).
    pub fn group(self, prefix: &str, lr: f64, weight_decay: f64) -> Result<AdamW> {
        let mut adam = self.0;
        adam.groups.add("AdamW::group", &adam.vars, prefix, lr, weight_decay)?;
        Ok(AdamW(adam))
    }

    /// Other betas and eps (as [`Adam::with`]).
    pub fn with(self, betas: (f64, f64), eps: f64) -> Result<AdamW> {
        Ok(AdamW(self.0.with(betas, eps)?))
    }
}

impl Optimizer for AdamW {
    fn lr(&self) -> f64 {
        self.0.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.0.set_lr(lr)
    }

    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        self.0.step(grads)
    }

    fn state(&self) -> Result<OptimizerState> {
        self.0.state()
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.0.load_state(state)
    }

    fn memory_bytes(&self, params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        self.0.memory_bytes(params)
    }

    fn set_portable(&mut self, portable: bool) {
        self.0.set_portable(portable)
    }
}

/// A boxed optimiser, so that one trainer type can take any of them.
impl<O: Optimizer + ?Sized> Optimizer for Box<O> {
    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        (**self).step(grads)
    }

    fn lr(&self) -> f64 {
        (**self).lr()
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        (**self).set_lr(lr)
    }

    fn state(&self) -> Result<OptimizerState> {
        (**self).state()
    }

    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        (**self).load_state(state)
    }

    fn memory_bytes(&self, params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        (**self).memory_bytes(params)
    }

    fn set_portable(&mut self, portable: bool) {
        (**self).set_portable(portable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path set from outside (the DP trainer's) is the one a step
    /// takes, through AdamW and a box too, and both paths step alike.
    #[test]
    fn set_portable_picks_the_path_every_optimiser_steps_on() -> Result<()> {
        let varmap = candle_nn::VarMap::new();
        let dev = candle_core::Device::Cpu;
        let w = varmap.get((3, 4), "w", candle_nn::Init::Const(0.5), candle_core::DType::F32, &dev)?;
        let g: BTreeMap<String, Tensor> =
            [("w".to_string(), Tensor::ones((3, 4), candle_core::DType::F32, &dev)?)].into();
        let mut sgd = Sgd::new(&varmap, 0.1, 0.9)?;
        sgd.set_portable(true);
        assert_eq!(sgd.path, Path::Portable);
        sgd.set_portable(false);
        assert_eq!(sgd.path, Path::Fast);
        let mut adamw: Box<dyn Optimizer> = Box::new(AdamW::new(&varmap, 0.1, 0.01)?);
        adamw.set_portable(true);
        adamw.step(&g)?;
        let portable = w.flatten_all()?.to_vec1::<f32>()?;
        let mut adamw = AdamW::new(&varmap, 0.1, 0.01)?;
        adamw.set_portable(false);
        assert_eq!(adamw.0.path, Path::Fast);
        adamw.step(&g)?;
        // the second step from where the first left: both moved every entry
        let fast = w.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            portable.iter().zip(&fast).all(|(p, f)| p < &0.5 && f < p),
            "{portable:?} {fast:?}"
        );
        Ok(())
    }
}
