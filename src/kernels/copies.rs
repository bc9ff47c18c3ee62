//! Bytes copied to change a tensor's layout (a transposed operand made
//! row-major, a broadcast made real), counted in a tally the caller owns
//! (the interpreter makes one per run and reports it in `RunStats`), so no
//! kernel keeps state of its own.

use candle_core::{Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A count of the bytes copied to change layouts. Atomic because a map's
/// examples may run on several threads at once, each counting into the
/// run's one tally; the count is a total, so no ordering is needed.
#[derive(Debug, Default)]
pub(crate) struct Copies(AtomicUsize);

impl Copies {
    /// Bytes counted so far.
    pub(crate) fn bytes(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts `t` as copied when it is not already contiguous.
    pub(crate) fn note(&self, t: &Tensor) {
        if !t.is_contiguous() {
            let bytes = t.elem_count().saturating_mul(t.dtype().size_in_bytes());
            // saturating: a total past usize::MAX stays there
            let _ = self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_add(bytes)));
        }
    }
}

/// `contiguous`, counted.
pub(crate) trait Relayout {
    /// The tensor in contiguous memory (itself when it already is), the
    /// bytes a copy takes counted in `copies`.
    fn relayout(&self, copies: &Copies) -> Result<Tensor>;
}

impl Relayout for Tensor {
    fn relayout(&self, copies: &Copies) -> Result<Tensor> {
        copies.note(self);
        self.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn counts_only_real_copies() -> Result<()> {
        let t = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
        let copies = Copies::default();
        t.relayout(&copies)?;
        assert_eq!(copies.bytes(), 0);
        t.t()?.relayout(&copies)?;
        assert_eq!(copies.bytes(), 48);
        Ok(())
    }
}
