//! Bytes copied to change a tensor's layout (a transposed operand made
//! row-major, a broadcast made real), counted per thread so a run can
//! report what its kernels copied besides computing (`RunStats`).

use candle_core::{Result, Tensor};
use std::cell::Cell;

thread_local! {
    static COPIED: Cell<usize> = const { Cell::new(0) };
}

/// Bytes this thread's relayouts have copied so far.
pub(crate) fn copied() -> usize {
    COPIED.with(Cell::get)
}

/// Counts `t` as copied when it is not already contiguous.
pub(crate) fn note(t: &Tensor) {
    if !t.is_contiguous() {
        let bytes = t.elem_count().saturating_mul(t.dtype().size_in_bytes());
        COPIED.with(|c| c.set(c.get().saturating_add(bytes)));
    }
}

/// `contiguous`, counted.
pub(crate) trait Relayout {
    /// The tensor in contiguous memory (itself when it already is), the
    /// bytes a copy takes counted.
    fn relayout(&self) -> Result<Tensor>;
}

impl Relayout for Tensor {
    fn relayout(&self) -> Result<Tensor> {
        note(self);
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
        let before = copied();
        t.relayout()?;
        assert_eq!(copied(), before);
        t.t()?.relayout()?;
        assert_eq!(copied(), before + 48);
        Ok(())
    }
}
