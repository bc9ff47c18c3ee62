//! Optimisers over a `VarMap` that take gradients as a name -> tensor map
//! (what the DP step produces). With privatized gradients they are DP-SGD,
//! DP-Adam and DP-AdamW: everything they do after the noise is
//! post-processing of private values, at no privacy cost.

use crate::error::{Error, Result};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;

/// `Optimizer::lr` and `set_lr` for an optimiser with an `lr` field.
macro_rules! lr_field {
    () => {
        fn lr(&self) -> f64 {
            self.lr
        }

        fn set_lr(&mut self, lr: f64) -> Result<()> {
            super::positive("set_lr", "lr", lr, true)?;
            self.lr = lr;
            Ok(())
        }
    };
}

/// An optimiser stepping a `VarMap`'s variables by name.
pub trait Optimizer {
    /// One step with `grads` (name -> gradient, shaped like the variable).
    /// Every gradient must name a variable; variables without a gradient
    /// are left alone.
    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()>;
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate (for schedules); an error unless it is
    /// finite and `>= 0`.
    fn set_lr(&mut self, lr: f64) -> Result<()>;
}

/// Stochastic gradient descent with momentum (PyTorch's formulation:
/// `v = momentum v + g; w -= lr v`), applied to named variables.
#[derive(Debug)]
pub struct Sgd {
    vars: BTreeMap<String, Var>,
    lr: f64,
    momentum: f64,
    velocity: BTreeMap<String, Tensor>,
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
        })
    }
}

impl Optimizer for Sgd {
    lr_field!();

    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        for (name, g) in grads {
            let (var, g) = checked(&self.vars, "sgd", name, g)?;
            let v = match self.velocity.get(name) {
                Some(prev) if self.momentum != 0.0 => ((prev * self.momentum)? + &g)?,
                _ => g,
            };
            var.set(&(var.as_tensor() - (&v * self.lr)?)?)?;
            self.velocity.insert(name.clone(), v);
        }
        Ok(())
    }
}

/// The variables of `varmap` by name.
pub(super) fn vars_of(varmap: &candle_nn::VarMap, op: &'static str) -> Result<BTreeMap<String, Var>> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| Error::data(op, "the VarMap's lock is poisoned (a thread panicked holding it)"))?;
    Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// The names of `varmap`'s variables, sorted.
pub(super) fn var_names(varmap: &candle_nn::VarMap) -> Result<Vec<String>> {
    Ok(vars_of(varmap, "make_private")?.into_keys().collect())
}

/// `varmap`'s variables' current values by name.
pub(super) fn var_tensors(varmap: &candle_nn::VarMap) -> Result<BTreeMap<String, Tensor>> {
    Ok(vars_of(varmap, "PrivateTrainer")?
        .into_iter()
        .map(|(k, v)| (k, v.as_tensor().clone()))
        .collect())
}

/// The variable a gradient is for, and the gradient in its dtype.
fn checked<'a>(vars: &'a BTreeMap<String, Var>, op: &'static str, name: &str, g: &Tensor) -> Result<(&'a Var, Tensor)> {
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
    Ok((var, g.to_dtype(var.dtype())?))
}

/// An error naming `op` unless each hyper-parameter is finite and `>= 0`.
fn check_hyper(op: &'static str, values: &[(&str, f64)]) -> Result<()> {
    values
        .iter()
        .try_for_each(|&(name, v)| super::positive(op, name, v, true))
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
    /// Decoupled weight decay (AdamW's): `w *= 1 - lr wd` before the update.
    weight_decay: f64,
    steps: i32,
    moments: BTreeMap<String, (Tensor, Tensor)>,
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
            steps: 0,
            moments: BTreeMap::new(),
        })
    }

    /// Other betas (each in `[0, 1)`) and eps (finite, `> 0`).
    pub fn with(mut self, betas: (f64, f64), eps: f64) -> Result<Adam> {
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        if !(beta_ok(betas.0) && beta_ok(betas.1)) {
            return Err(Error::privacy("Adam", "betas", "each in [0, 1)", format!("{betas:?}")));
        }
        super::positive("Adam", "eps", eps, false)?;
        self.betas = betas;
        self.eps = eps;
        Ok(self)
    }
}

impl Optimizer for Adam {
    lr_field!();

    fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        self.steps = self.steps.saturating_add(1);
        let (b1, b2) = self.betas;
        let (c1, c2) = (1.0 - b1.powi(self.steps), 1.0 - b2.powi(self.steps));
        for (name, g) in grads {
            let (var, g) = checked(&self.vars, "adam", name, g)?;
            let (m, v) = match self.moments.remove(name) {
                Some((m, v)) => (
                    ((m * b1)? + (&g * (1.0 - b1))?)?,
                    ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?,
                ),
                None => ((&g * (1.0 - b1))?, (g.sqr()? * (1.0 - b2))?),
            };
            let denom = ((&v / c2)?.sqrt()? + self.eps)?;
            let update = ((&m / c1)? / denom)?;
            let w = var.as_tensor();
            let w = if self.weight_decay != 0.0 {
                (w * (1.0 - self.lr * self.weight_decay))?
            } else {
                w.clone()
            };
            var.set(&(w - (update * self.lr)?)?)?;
            self.moments.insert(name.clone(), (m, v));
        }
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
}
