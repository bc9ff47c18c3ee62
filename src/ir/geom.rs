//! The window geometry of a convolution, shared by the convolution
//! primitives and the kernels that run them.

use candle_core::{bail, Result};

/// Window geometry of an N-d convolution (N = 1, 2 or 3; each Vec has length N).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    /// Kernel (window) size per spatial dim, each >= 1.
    pub kernel: Vec<usize>,
    /// Step between windows per spatial dim, each >= 1.
    pub stride: Vec<usize>,
    /// Zero padding added on both sides of each spatial dim.
    pub padding: Vec<usize>,
    /// Spacing between kernel taps per spatial dim, each >= 1.
    pub dilation: Vec<usize>,
}

impl ConvGeom {
    /// The same kernel, padding, stride and dilation in each of `ndim`
    /// spatial dims; the last three in the order candle's `conv2d` takes
    /// them. A kernel of 0 leaves the size to the weight (`Tracer::conv`).
    ///
    /// ```
    /// use candle_func::ConvGeom;
    /// let g = ConvGeom::uniform(2, 3, 1, 2, 1); // 3x3, padding 1, stride 2
    /// assert_eq!(g.out_spatial(&[28, 28])?, vec![14, 14]);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn uniform(ndim: usize, kernel: usize, padding: usize, stride: usize, dilation: usize) -> Self {
        Self {
            kernel: vec![kernel; ndim],
            stride: vec![stride; ndim],
            padding: vec![padding; ndim],
            dilation: vec![dilation; ndim],
        }
    }

    /// Number of spatial dimensions (the length of `kernel`).
    pub fn ndim(&self) -> usize {
        self.kernel.len()
    }

    /// Number of taps in one window, `prod(kernel)` (saturating: a
    /// geometry that large fails `out_spatial`'s checks anyway).
    pub fn kernel_numel(&self) -> usize {
        self.kernel.iter().fold(1usize, |a, &k| a.saturating_mul(k))
    }

    /// Output spatial size for an input spatial size (PyTorch's formula:
    /// `(s + 2p - d(k-1) - 1)/stride + 1`), error if the window does not fit.
    pub fn out_spatial(&self, spatial: &[usize]) -> Result<Vec<usize>> {
        self.out_spatial_for("out_spatial", spatial)
    }

    /// [`Self::out_spatial`] with errors attributed to the calling operation.
    pub(crate) fn out_spatial_for(&self, op: &str, spatial: &[usize]) -> Result<Vec<usize>> {
        self.validate(op)?;
        if spatial.len() != self.ndim() {
            bail!(
                "{op}: spatial size {spatial:?} has {} dims but the geometry is {}-d ({self:?})",
                spatial.len(),
                self.ndim()
            )
        }
        (0..self.ndim())
            .map(|i| {
                // Sizes come from the user: overflow is an error, not a wrap.
                let span = self.dilation[i]
                    .checked_mul(self.kernel[i] - 1)
                    .and_then(|s| s.checked_add(1));
                let padded = self.padding[i].checked_mul(2).and_then(|p| p.checked_add(spatial[i]));
                let (Some(span), Some(padded)) = (span, padded) else {
                    bail!("{op}: the window or the padding overflows in spatial dim {i} ({self:?})")
                };
                if padded < span {
                    bail!(
                        "{op}: window of span {span} (kernel {}, dilation {}) does not fit padded size {padded} \
                         in spatial dim {i} (input spatial {spatial:?}, {self:?})",
                        self.kernel[i],
                        self.dilation[i]
                    )
                }
                Ok((padded - span) / self.stride[i] + 1)
            })
            .collect()
    }

    /// Checks that the four vectors agree in length (1..=3) and that kernel,
    /// stride and dilation are positive.
    pub(crate) fn validate(&self, op: &str) -> Result<()> {
        let n = self.ndim();
        let lens = [self.stride.len(), self.padding.len(), self.dilation.len()];
        if !(1..=3).contains(&n) || lens.iter().any(|&l| l != n) {
            bail!("{op}: geometry vectors must all have length 1, 2 or 3, got {self:?}")
        }
        let positive = |v: &[usize]| v.iter().all(|&x| x > 0);
        if !positive(&self.kernel) || !positive(&self.stride) || !positive(&self.dilation) {
            bail!("{op}: kernel, stride and dilation must be positive, got {self:?}")
        }
        Ok(())
    }
}
