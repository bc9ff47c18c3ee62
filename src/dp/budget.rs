//! The memory a private trainer's process holds while it steps, planned
//! as a whole ([`MemoryPlan`]; the trainer fits itself to it in `fit`). A memory limit on the engine bounds the process, not only
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

use candle_core::Tensor;

/// What a private step holds at its peak, part by part, in bytes
/// ([`PrivateTrainer::memory_plan`](crate::dp::PrivateTrainer::memory_plan)). Its [`MemoryPlan::total`] is what
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
    pub(super) fn beside_pass(&self) -> usize {
        [self.rest, self.data, self.optimizer, self.sums]
            .into_iter()
            .fold(0, usize::saturating_add)
    }

    /// The plan with `pass` as the graph's peak, in words, for an error.
    pub(super) fn parts(&self) -> String {
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

pub(super) fn bytes(t: &Tensor) -> usize {
    t.elem_count().saturating_mul(t.dtype().size_in_bytes())
}

pub(super) fn sum_bytes<'a>(ts: impl Iterator<Item = &'a Tensor>) -> usize {
    ts.map(bytes).fold(0, usize::saturating_add)
}

/// The remedy where no physical batch fits.
pub(super) fn no_batch_fits() -> String {
    "no physical batch fits, not even one example a pass: raise the limit, train fewer parameters \
     (PrivacyEngine::trainable, LoRA), or use an optimiser with less state (Sgd without momentum keeps none)"
        .into()
}
