//! Stochastic gradient descent with momentum and parameter groups.

use super::state::{group_scalars, load_groups, OptimizerState};
use super::{check_hyper, checked, descend, sized, value, vars_of, Groups, Optimizer};
use crate::env::Path;
use crate::error::{positive, Result};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;

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
            path: Path::resolve(None),
        })
    }

    /// Steps on candle's operations only (`true`) or the crate's CPU
    /// kernels where they apply (`false`), as [`Options::portable`](crate::Options::portable)
    /// says for a transform; unset, the `CANDLE_FUNC_PORTABLE` variable.
    pub fn portable(mut self, on: bool) -> Sgd {
        self.path = Path::resolve(Some(on));
        self
    }

    /// A parameter group: the variables under `prefix` step with their own
    /// learning rate and (L2, added to the gradient) weight decay.
    pub fn group(mut self, prefix: &str, lr: f64, weight_decay: f64) -> Result<Sgd> {
        self.groups.add("Sgd::group", &self.vars, prefix, lr, weight_decay)?;
        Ok(self)
    }
}

impl Sgd {
    /// The path its steps take.
    #[cfg(test)]
    pub(super) fn path(&self) -> Path {
        self.path
    }

    /// One step on `path`.
    fn step_path(&mut self, grads: &BTreeMap<String, Tensor>, path: Path) -> Result<()> {
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
}

impl Optimizer for Sgd {
    own_fields!();

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
