//! Bytes copied to change a tensor's layout (a transposed operand made
//! row-major, a broadcast made real), counted in a tally the caller owns
//! (the interpreter makes one per run and reports it in `RunStats`), so no
//! kernel keeps state of its own.

use candle_core::{Result, Tensor};
use std::cell::Cell;

/// A count of the bytes copied to change layouts.
#[derive(Debug, Default)]
pub(crate) struct Copies(Cell<usize>);

impl Copies {
    /// Bytes counted so far.
    pub(crate) fn bytes(&self) -> usize {
        self.0.get()
    }

    /// Counts `t` as copied when it is not already contiguous.
    pub(crate) fn note(&self, t: &Tensor) {
        if !t.is_contiguous() {
            let bytes = t.elem_count().saturating_mul(t.dtype().size_in_bytes());
            self.0.set(self.0.get().saturating_add(bytes));
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
