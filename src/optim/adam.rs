//! Adam and AdamW (PyTorch's formulations), with parameter groups.

use super::state::{group_scalars, load_groups, state_error, OptimizerState};
use super::{check_hyper, checked, descend, sized, value, vars_of, Groups, Optimizer};
use crate::env::Path;
use crate::error::{positive, Error, Result};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

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
            path: Path::resolve(None),
        })
    }

    /// Steps on candle's operations only (`true`) or the crate's CPU
    /// kernels where they apply (`false`), as [`Options::portable`](crate::Options::portable)
    /// says for a transform; unset, the `CANDLE_FUNC_PORTABLE` variable.
    pub fn portable(mut self, on: bool) -> Adam {
        self.path = Path::resolve(Some(on));
        self
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

impl Adam {
    /// One step on `path`.
    fn step_path(&mut self, grads: &BTreeMap<String, Tensor>, path: Path) -> Result<()> {
        self.steps = self.steps.saturating_add(1);
        let (b1, b2) = self.betas;
        let (c1, c2) = (1.0 - b1.powi(self.steps), 1.0 - b2.powi(self.steps));
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
                Some((m, v)) if crate::kernels::adam::fits(&[&m, &v, &g], path) => {
                    let (m, v) = if shared { (m.copy()?, v.copy()?) } else { (m, v) };
                    crate::kernels::adam::moments_in_place(&m, &v, &g, (b1, b2))?;
                    (m, v)
                }
                Some((m, v)) => (
                    ((m * b1)? + (&g * (1.0 - b1))?)?,
                    ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                ),
                None => ((&g * (1.0 - b1))?, (g.sqr()? * (1.0 - b2))?),
            };
            let decoupled = wd != 0.0 && self.decoupled;
            let u = crate::kernels::adam::Update {
                lr,
                c1,
                c2,
                eps: self.eps,
                decay: decoupled.then_some(1.0 - lr * wd),
            };
            if var.dtype() == m.dtype() && crate::kernels::adam::update_in_place(var.as_tensor(), &m, &v, u, path)? {
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
}

impl Optimizer for Adam {
    own_fields!();

    fn memory_bytes(&self, params: &BTreeMap<String, Tensor>) -> Option<(usize, usize)> {
        // two moments. The step in place holds at most copies of one
        // tensor's moments (after a state was handed out) and L2 decay's
        // gradient; with candle's operations, the gradient, the old and
        // new moments and the denominator and update of one tensor
        let path = self.path;
        let in_place = params.values().all(|p| crate::kernels::adam::fits(&[p], path));
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

    /// The kernel path (as [`Adam::portable`]).
    pub fn portable(self, on: bool) -> AdamW {
        AdamW(self.0.portable(on))
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

    fn step_on(&mut self, grads: &BTreeMap<String, Tensor>, portable: bool) -> Result<()> {
        self.0.step_on(grads, portable)
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

    #[allow(deprecated)]
    fn set_portable(&mut self, portable: bool) {
        self.0.set_portable(portable)
    }
}
