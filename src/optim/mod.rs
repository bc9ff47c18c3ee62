//! Optimisers over a `VarMap` that take gradients as a name -> tensor map:
//! [`Sgd`], [`Adam`] and [`AdamW`] with parameter groups and saved state,
//! and [`CandleOptimizer`] for any `candle_nn::Optimizer`. Nothing in them
//! is private: with the privatized gradients of [`dp`](crate::dp) they are
//! DP-SGD, DP-Adam and DP-AdamW, since everything after the noise is
//! post-processing of private values, at no privacy cost.
//!
//! Each steps on the kernel path it was made for (`.portable(on)`, else
//! the `CANDLE_FUNC_PORTABLE` variable), or on the one a step is given
//! ([`Optimizer::step_on`], what the DP trainer calls).

use crate::env::Path;
use crate::error::{positive, Error, Result};
// The dtype an optimiser computes a variable's update in and keeps its
// state in: f32 for half-precision weights (as mixed-precision training
// keeps its moments; in bf16 `v * 0.999` rounds back to `v`, so Adam's
// second moment never decays), the weight's own otherwise.
use crate::kernels::accumulation_dtype as work_dtype;
use crate::transforms::tree::{overlap, under};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;

/// `Optimizer::lr` and `set_lr` for an optimiser with an `lr` field and
/// parameter groups, and its steps on its own path (a `path` field) or the
/// one given, through its `step_path`.
macro_rules! own_fields {
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

        fn step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
            self.step_path(grads, self.path)
        }

        fn step_on(&mut self, grads: &BTreeMap<String, Tensor>, portable: bool) -> Result<()> {
            self.step_path(grads, Path::resolve(Some(portable)))
        }

        #[allow(deprecated)]
        fn set_portable(&mut self, portable: bool) {
            self.path = Path::resolve(Some(portable));
        }
    };
}

mod adam;
mod candle;
mod sgd;
mod state;

pub use adam::{Adam, AdamW};
pub use candle::CandleOptimizer;
pub use sgd::Sgd;
use state::unsupported_state;
pub use state::OptimizerState;

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
    /// One step on candle's operations only (`portable`) or the crate's
    /// CPU kernels where they apply: the DP trainer steps on the path its
    /// clipping graph ran on, so that one step runs on one path. An
    /// optimiser without kernels of its own has one path (the default:
    /// [`Optimizer::step`]).
    fn step_on(&mut self, grads: &BTreeMap<String, Tensor>, portable: bool) -> Result<()> {
        let _ = portable;
        self.step(grads)
    }
    /// Sets the path later steps take.
    #[deprecated(
        since = "0.2.0",
        note = "give the path where it is used: `.portable(on)` when the optimiser is made, or `Optimizer::step_on`"
    )]
    fn set_portable(&mut self, _portable: bool) {}
}

/// The bytes `t` takes in the dtype an optimiser keeps its state in.
fn work_bytes(t: &Tensor) -> usize {
    t.elem_count().saturating_mul(work_dtype(t.dtype()).size_in_bytes())
}

/// `per_tensor` copies of every tensor of `params` in the work dtype, and
/// `temps` copies of the largest: an optimiser's state and its step's
/// workspace (its step works a tensor at a time).
pub(super) fn sized(params: &BTreeMap<String, Tensor>, per_tensor: usize, temps: usize) -> (usize, usize) {
    let all: usize = params.values().map(work_bytes).fold(0, usize::saturating_add);
    let largest = params.values().map(work_bytes).max().unwrap_or(0);
    (all.saturating_mul(per_tensor), largest.saturating_mul(temps))
}

/// `var = w - lr x`, where `w` is `decayed` (a fresh tensor) or else the
/// variable's own value: updated in place in one pass where the crate's
/// CPU kernels run (`kernels::zip::axpy_in_place`, bit for bit the
/// expression below), else a scaled copy and a difference, then `set`.
pub(super) fn descend(var: &Var, decayed: Option<Tensor>, x: &Tensor, lr: f64, path: Path) -> Result<()> {
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
pub(super) fn checked<'a>(
    vars: &'a BTreeMap<String, Var>,
    op: &'static str,
    name: &str,
    g: &Tensor,
) -> Result<(&'a Var, Tensor)> {
    let var = var_for(vars, op, name, g)?;
    Ok((var, g.to_dtype(work_dtype(var.dtype()))?))
}

/// The variable's value in its work dtype.
pub(super) fn value(var: &Var) -> Result<Tensor> {
    Ok(var.as_tensor().to_dtype(work_dtype(var.dtype()))?)
}

/// An error naming `op` unless each hyper-parameter is finite and `>= 0`.
pub(super) fn check_hyper(op: &'static str, values: &[(&str, f64)]) -> Result<()> {
    values.iter().try_for_each(|&(name, v)| positive(op, name, v, true))
}

/// Parameter groups (`torch.optim`'s): variables under a prefix take their
/// own learning rate and weight decay, the rest the optimiser's.
#[derive(Clone, Debug, Default)]
pub(super) struct Groups(Vec<(String, f64, f64)>);

impl Groups {
    /// The group of `name`'s `(lr, weight_decay)`, or `base`.
    pub(super) fn of(&self, name: &str, base: (f64, f64)) -> (f64, f64) {
        self.0
            .iter()
            .find(|(p, _, _)| under(name, p))
            .map_or(base, |&(_, lr, wd)| (lr, wd))
    }

    /// A new group, checked: finite non-negative hyper-parameters, a
    /// prefix that holds a variable and is not already a group's.
    pub(super) fn add(
        &mut self,
        op: &'static str,
        vars: &BTreeMap<String, Var>,
        prefix: &str,
        lr: f64,
        wd: f64,
    ) -> Result<()> {
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
    pub(super) fn rescale(&mut self, old: f64, new: f64) {
        for g in &mut self.0 {
            g.1 = if old > 0.0 { g.1 * (new / old) } else { new };
        }
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

    fn step_on(&mut self, grads: &BTreeMap<String, Tensor>, portable: bool) -> Result<()> {
        (**self).step_on(grads, portable)
    }

    #[allow(deprecated)]
    fn set_portable(&mut self, portable: bool) {
        (**self).set_portable(portable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Path;

    /// The path a step is given (the DP trainer's) is the one it takes,
    /// through AdamW and a box too; the builder sets the default one; and
    /// both paths step alike.
    #[test]
    fn the_path_given_is_the_path_every_optimiser_steps_on() -> Result<()> {
        let varmap = candle_nn::VarMap::new();
        let dev = candle_core::Device::Cpu;
        let w = varmap.get((3, 4), "w", candle_nn::Init::Const(0.5), candle_core::DType::F32, &dev)?;
        let g: BTreeMap<String, Tensor> =
            [("w".to_string(), Tensor::ones((3, 4), candle_core::DType::F32, &dev)?)].into();
        let sgd = Sgd::new(&varmap, 0.1, 0.9)?.portable(true);
        assert_eq!(sgd.path(), Path::Portable);
        assert_eq!(sgd.portable(false).path(), Path::Fast);
        let mut adamw: Box<dyn Optimizer> = Box::new(AdamW::new(&varmap, 0.1, 0.01)?.portable(false));
        adamw.step_on(&g, true)?;
        let portable = w.flatten_all()?.to_vec1::<f32>()?;
        let mut adamw = AdamW::new(&varmap, 0.1, 0.01)?.portable(true);
        adamw.step_on(&g, false)?;
        // the second step from where the first left: both moved every entry
        let fast = w.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            portable.iter().zip(&fast).all(|(p, f)| p < &0.5 && f < p),
            "{portable:?} {fast:?}"
        );
        // a gradient of another shape, or of no variable, is an error on
        // either path, and the variable stays as it was
        let bad: BTreeMap<String, Tensor> =
            [("w".to_string(), Tensor::ones((4, 3), candle_core::DType::F32, &dev)?)].into();
        let unknown: BTreeMap<String, Tensor> =
            [("v".to_string(), Tensor::ones((3, 4), candle_core::DType::F32, &dev)?)].into();
        for portable in [true, false] {
            assert!(adamw.step_on(&bad, portable).is_err());
            assert!(adamw.step_on(&unknown, portable).is_err());
        }
        assert_eq!(w.flatten_all()?.to_vec1::<f32>()?, fast);
        Ok(())
    }
}
