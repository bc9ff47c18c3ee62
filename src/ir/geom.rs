//! The window geometry of a convolution, shared by the convolution
//! primitives and the kernels that run them.

use candle_core::Result;

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
        // Not `bail!`: that captures a backtrace into the message.
        self.fit(spatial)
            .map_err(|why| candle_core::Error::Msg(format!("{op}: {why}")))
    }

    /// Checks that the four vectors agree in length (1..=3) and that kernel,
    /// stride and dilation are positive.
    pub(crate) fn validate(&self, op: &str) -> Result<()> {
        self.check()
            .map_err(|why| candle_core::Error::Msg(format!("{op}: {why}")))
    }

    /// The output spatial size, or why there is none in the user's terms
    /// (the setting and its value, the input size), without an op name.
    pub(crate) fn fit(&self, spatial: &[usize]) -> std::result::Result<Vec<usize>, String> {
        self.check()?;
        if spatial.len() != self.ndim() {
            return Err(format!(
                "an input of spatial size {spatial:?} ({} dims) for a {}-d window ({self})",
                spatial.len(),
                self.ndim()
            ));
        }
        (0..self.ndim())
            .map(|i| {
                // Sizes come from the user: overflow is an error, not a wrap.
                let span = self.dilation[i]
                    .checked_mul(self.kernel[i] - 1)
                    .and_then(|s| s.checked_add(1));
                let padded = self.padding[i].checked_mul(2).and_then(|p| p.checked_add(spatial[i]));
                let (Some(span), Some(padded)) = (span, padded) else {
                    return Err(format!(
                        "the window or the padding overflows in spatial dim {i} ({self})"
                    ));
                };
                if padded < span {
                    return Err(format!(
                        "the window spans {span} (kernel {}, dilation {}) but spatial dim {i} of the input is {} \
                         ({padded} with padding {} on each side): input spatial size {spatial:?}, {self}",
                        self.kernel[i], self.dilation[i], spatial[i], self.padding[i]
                    ));
                }
                Ok((padded - span) / self.stride[i] + 1)
            })
            .collect()
    }

    /// Lengths 1..=3 and agreeing; kernel, stride and dilation positive.
    /// The message names the offending setting and its value.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let n = self.ndim();
        let lens = [self.stride.len(), self.padding.len(), self.dilation.len()];
        if !(1..=3).contains(&n) || lens.iter().any(|&l| l != n) {
            return Err(format!(
                "kernel, stride, padding and dilation must all have 1, 2 or 3 entries, got {self}"
            ));
        }
        for (name, v) in [
            ("kernel", &self.kernel),
            ("stride", &self.stride),
            ("dilation", &self.dilation),
        ] {
            if v.contains(&0) {
                return Err(format!("{name} must be positive, got {name} {v:?} ({self})"));
            }
        }
        Ok(())
    }
}

/// `kernel [3, 3], stride [1, 1], padding [0, 0], dilation [1, 1]`: the
/// settings as a user passed them, for messages.
impl std::fmt::Display for ConvGeom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernel {:?}, stride {:?}, padding {:?}, dilation {:?}",
            self.kernel, self.stride, self.padding, self.dilation
        )
    }
}
