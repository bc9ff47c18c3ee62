//! A private trainer fitted to a memory limit: its physical batch checked,
//! or the largest whose [`MemoryPlan`] fits chosen, and its clipping graph
//! limited to its share (the plan's parts and why they are what they are
//! are in `budget`).

use super::budget::{bytes, no_batch_fits, sum_bytes, MemoryPlan};
use super::trainer::{ExampleLoss, PrivateTrainer};
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use candle_core::Tensor;
use std::collections::BTreeMap;

impl<F, O, S> PrivateTrainer<F, O, S>
where
    F: ExampleLoss<S>,
    O: Optimizer,
{
    /// Bounds the process by `limit` bytes: the physical batch given
    /// (`chosen` false) checked, or the largest that fits chosen, up to
    /// the present one; the clipping graph limited to its share.
    pub(super) fn fit_memory(mut self, limit: usize, chosen: bool) -> Result<Self> {
        let params = self.params_now()?;
        let mut plan = self.plan_beside(&params, chosen)?;
        // the plan's share of the limit (see the module docs)
        let target = limit - limit / 16;
        let over = |plan: &MemoryPlan, remedy: String| Error::TrainerMemory {
            op: "make_private",
            needed: plan.total(),
            limit: target,
            parts: plan.parts(),
            remedy,
        };
        if plan.total() > target {
            return Err(over(&plan, no_batch_fits()));
        }
        let budget = target - plan.beside_pass();
        let cap = self.setup.physical;
        let peak = |t: &mut Self, p: usize| -> Result<usize> {
            t.setup.physical = p;
            let (examples, w) = t.pass(&super::users::first(t.setup.data.users.as_ref(), p))?;
            // planned whole: no limit lets the inner vmap lower it to chunks
            t.clip
                .planned_peak((&params, &examples, &w), |o| o.memory_limit(usize::MAX))
        };
        plan.pass = peak(&mut self, cap)?;
        if plan.total() > target {
            // the largest batch that fits, by bisection: `lo` fits (0: none
            // known; its plan `lo_pass`), `hi` does not
            let (mut lo, mut lo_pass, mut hi) = (0usize, 0usize, cap);
            while hi - lo > 1 {
                let k = lo + (hi - lo) / 2;
                match peak(&mut self, k)? {
                    pass if pass <= budget => (lo, lo_pass) = (k, pass),
                    _ => hi = k,
                }
            }
            // `plan` still holds `cap`'s pass for the error
            let remedy = match (lo, chosen) {
                (0, _) => no_batch_fits(),
                (k, false) => format!(
                    "a physical batch of at most {k} fits: set PrivacyEngine::physical_batch({k}), or leave it \
                     unset and the trainer chooses the largest that fits"
                ),
                (k, true) => {
                    (plan.physical_batch, plan.pass) = (k, lo_pass);
                    log::debug!(
                        "make_private: {cap} examples a pass plan over the limit of {limit} bytes; passes of {k}"
                    );
                    self.setup.physical = k;
                    return self.limited(plan, budget);
                }
            };
            return Err(over(&plan, remedy));
        }
        self.setup.physical = cap;
        self.limited(plan, budget)
    }

    /// The trainer with its plan kept and its clipping graph refused
    /// above `budget`.
    fn limited(mut self, plan: MemoryPlan, budget: usize) -> Result<Self> {
        self.clip = self.clip.memory_limit(budget);
        self.memory = Some(plan);
        Ok(self)
    }

    /// The plan with everything but the pass's graph counted.
    fn plan_beside(&self, params: &BTreeMap<String, Tensor>, chosen: bool) -> Result<MemoryPlan> {
        let weights = sum_bytes(crate::optim::var_tensors(&self.varmap)?.values());
        let data = self.setup.data.source.resident_bytes();
        let (optimizer, step_work) = match self.optimizer.memory_bytes(params) {
            Some(m) => m,
            None => {
                crate::transforms::settings::warn_once(
                    "dp-optimizer-memory".into(),
                    "make_private: the optimiser does not report its memory (Optimizer::memory_bytes), so the \
                     memory limit leaves its state out"
                        .into(),
                );
                (0, 0)
            }
        };
        let sums = sum_bytes(params.values());
        let largest = params.values().map(bytes).max().unwrap_or(0);
        // the noise of one tensor: the noised copy the fused kernel writes
        // (f32 and f64 on the CPU); otherwise the draw, the sum and the
        // scaled result, in f32 (twice a half tensor's bytes)
        let path = self.setup.path;
        let fused = |p: &Tensor| crate::kernels::has_cpu_kernel(p, path) && p.is_contiguous();
        let noise = match params.values().all(fused) {
            true => largest,
            false => largest.saturating_mul(6),
        };
        // adding a pass's sum to the sum so far: the pass's sum and one
        // new tensor
        let adding = sums.saturating_add(largest);
        let rest = crate::env::resident_memory()
            .unwrap_or(0)
            .saturating_sub(weights.saturating_add(data));
        Ok(MemoryPlan {
            physical_batch: self.setup.physical,
            pass: 0,
            weights,
            optimizer,
            sums,
            workspace: step_work.max(noise).max(adding),
            data,
            rest,
            chosen,
        })
    }
}
