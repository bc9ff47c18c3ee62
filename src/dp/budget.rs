//! The memory a private trainer's process holds while it steps, planned
//! as a whole. A memory limit on the engine bounds the process, not only
//! the clipping graph: the graph's planned peak (the weights, one pass's
//! examples, its activations and the clipped sum it returns) plus what
//! lives beside it — the optimiser's state, the gradient sum carried
//! between passes, the data set, and the rest of the process as it was
//! when the trainer was built. Under such a limit the trainer chooses its
//! physical batch as the largest whose plan fits (at most the default, a
//! quarter of the expected batch), as `vmap` chooses its chunks.
//!
//! The plan is held to fifteen sixteenths of the limit: the sixteenth left
//! covers what no plan sees, the allocator's own overhead and the graph
//! plan's error (the process's peak came out 3–5% above the plan on
//! Qwen2-0.5B's full DP step with AdamW, mimalloc returning freed memory
//! at once). An allocator that keeps freed memory (mimalloc with purging
//! off) holds more than any plan.

use super::trainer::{ExampleLoss, PrivateTrainer};
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use candle_core::Tensor;
use std::collections::BTreeMap;

/// What a private step holds at its peak, part by part, in bytes
/// ([`PrivateTrainer::memory_plan`]). Its [`MemoryPlan::total`] is what
/// the engine's memory limit bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryPlan {
    /// Examples per pass.
    pub physical_batch: usize,
    /// The clipping graph's planned peak at that batch: every weight
    /// (the trainable ones as its arguments, the frozen ones as its
    /// constants), one pass's examples, the activations and gradients
    /// alive at once, and the clipped sum it returns.
    pub pass: usize,
    /// Every variable of the `VarMap`, trainable and frozen.
    pub weights: usize,
    /// The optimiser's state once every trainable tensor has stepped
    /// (Adam's two moments, a momentum's velocity).
    pub optimizer: usize,
    /// The gradient sum carried from one pass to the next (one copy of
    /// the trainable parameters).
    pub sums: usize,
    /// The most a step allocates between its passes at once besides the
    /// weights and the sum: a pass's clipped sum being added to it, the
    /// noise of one tensor, the optimiser's update of one.
    pub workspace: usize,
    /// The data set's tensors.
    pub data: usize,
    /// The rest of the process when the trainer was built: its resident
    /// memory less the weights and the data (0 where the operating system
    /// does not say, as off Linux).
    pub rest: usize,
    /// Whether the trainer chose `physical_batch` (none was given).
    pub(super) chosen: bool,
}

impl MemoryPlan {
    /// The bytes the process holds at a step's peak: the larger of a pass
    /// (with the sum so far beside it) and the work between passes.
    pub fn total(&self) -> usize {
        let beside = self.rest.saturating_add(self.data).saturating_add(self.optimizer);
        let during = self.pass.saturating_add(self.sums);
        let between = [self.weights, self.sums, self.workspace]
            .into_iter()
            .fold(0, usize::saturating_add);
        beside.saturating_add(during.max(between))
    }

    /// What the step holds besides a pass's own graph: the bytes left to
    /// the graph are the limit less these.
    fn beside_pass(&self) -> usize {
        [self.rest, self.data, self.optimizer, self.sums]
            .into_iter()
            .fold(0, usize::saturating_add)
    }

    /// The plan with `pass` as the graph's peak, in words, for an error.
    fn parts(&self) -> String {
        let mib = |b: usize| format!("{:.0} MiB", b as f64 / (1 << 20) as f64);
        let pass = match self.pass {
            0 => format!("the weights {}", mib(self.weights)),
            p => format!(
                "a pass of {} examples {} (the weights {} among them)",
                self.physical_batch,
                mib(p),
                mib(self.weights)
            ),
        };
        format!(
            "{pass}, optimiser state {}, gradient sums {}, work between passes {}, the data set {}, \
             the rest of the process {}",
            mib(self.optimizer),
            mib(self.sums),
            mib(self.workspace),
            mib(self.data),
            mib(self.rest)
        )
    }
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count().saturating_mul(t.dtype().size_in_bytes())
}

fn sum_bytes<'a>(ts: impl Iterator<Item = &'a Tensor>) -> usize {
    ts.map(bytes).fold(0, usize::saturating_add)
}

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

fn no_batch_fits() -> String {
    "no physical batch fits, not even one example a pass: raise the limit, train fewer parameters \
     (PrivacyEngine::trainable, LoRA), or use an optimiser with less state (Sgd without momentum keeps none)"
        .into()
}
