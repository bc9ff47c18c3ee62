//! An optimiser's saved state: what a checkpoint keeps of it and how it
//! is checked when loaded back.

use super::{work_dtype, Groups};
use crate::error::{Error, Result};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;

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

pub(super) fn state_error(msg: String) -> Error {
    Error::Checkpoint {
        what: "Optimizer::load_state",
        msg,
    }
}

impl OptimizerState {
    /// The scalar `name`, an error naming it when missing.
    pub(super) fn scalar(&self, name: &str) -> Result<f64> {
        self.scalars
            .get(name)
            .copied()
            .ok_or_else(|| state_error(format!("the saved {} state has no {name:?}", self.kind)))
    }

    /// An error unless the saved hyper-parameter `name` is `value`: a
    /// resumed run with other settings is another run.
    pub(super) fn same(&self, name: &str, value: f64) -> Result<()> {
        let saved = self.scalar(name)?;
        if saved.to_bits() != value.to_bits() {
            return Err(state_error(format!("{name} was {saved} when saved, is {value} now")));
        }
        Ok(())
    }

    /// The tensors saved under `what/`, each checked against its variable.
    pub(super) fn per_var(&self, what: &str, vars: &BTreeMap<String, Var>) -> Result<BTreeMap<String, Tensor>> {
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

    pub(super) fn kind_is(&self, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(state_error(format!("saved by {:?}, loaded into {kind:?}", self.kind)));
        }
        Ok(())
    }
}

/// `groups`' learning rates as scalars `group/{prefix}/lr`.
pub(super) fn group_scalars(groups: &Groups, into: &mut BTreeMap<String, f64>) {
    for (p, lr, _) in &groups.0 {
        into.insert(format!("group/{p}/lr"), *lr);
    }
}

/// `groups`' learning rates read back (the groups themselves must match).
pub(super) fn load_groups(groups: &mut Groups, state: &OptimizerState) -> Result<()> {
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

pub(super) fn unsupported_state() -> Error {
    state_error("this optimiser does not save its state".into())
}
