//! Transposed convolutions (PyTorch's `conv_transpose1d/2d`): the
//! input-gradient primitive of the convolution they transpose, so every
//! transform reuses that primitive's rules.

use crate::error::{Error, Result};
use crate::ir::conv::ConvOp;
use crate::ir::{ConvGeom, Prim};
use crate::trace::{Operand, Tracer};

impl Tracer {
    /// The transposed convolution of `x [N, Cin, *S]` with `w [Cin,
    /// Cout/groups, *k]` (PyTorch's layout), stride, padding, dilation and
    /// `output_padding` per `geom` (its kernel taken from `w`): `[N, Cout,
    /// *O]` with `O = (S - 1) stride - 2 padding + dilation (k - 1) +
    /// output_padding + 1`.
    pub fn conv_transpose(
        &self,
        w: impl Operand,
        mut geom: ConvGeom,
        output_padding: usize,
        groups: usize,
    ) -> Result<Tracer> {
        let w = w.to_tracer(self)?;
        let nd = geom.ndim();
        let shapes = [self.dims(), w.dims()];
        let bad = |why: String| Err(Error::shape("conv_transpose", &shapes, why));
        if self.rank() != nd + 2 || w.rank() != nd + 2 {
            return bad(format!(
                "a {nd}-d transposed convolution takes x [N, Cin, ..{nd} dims] and w [Cin, Cout/groups, ..{nd} dims]"
            ));
        }
        if w.dims()[0] != self.dims()[1] {
            return bad(format!(
                "x has {} channels but w's first dim (its input channels) is {}",
                self.dims()[1],
                w.dims()[0]
            ));
        }
        if groups == 0 || !self.dims()[1].is_multiple_of(groups) {
            return bad(format!(
                "groups must be positive and divide the {} input channels, got groups = {groups}",
                self.dims()[1]
            ));
        }
        geom.kernel = w.dims()[2..].to_vec();
        // checked here, in the user's terms, before the primitive's own
        // checks see the transposed (gradient) shapes
        if let Err(why) = geom.check() {
            return bad(why);
        }
        let mut out = Vec::with_capacity(nd);
        for i in 0..nd {
            let (s, p, d, k) = (geom.stride[i], geom.padding[i], geom.dilation[i], geom.kernel[i]);
            if output_padding >= s && output_padding >= d {
                return bad(format!(
                    "output_padding {output_padding} must be smaller than the stride {s} or the dilation {d}"
                ));
            }
            // (S - 1) s - 2 p + d (k - 1) + output_padding + 1, checked
            let size = self.dims()[2 + i]
                .checked_sub(1)
                .and_then(|v| v.checked_mul(s))
                .and_then(|v| v.checked_add(d.checked_mul(k.checked_sub(1)?)?))
                .and_then(|v| v.checked_add(output_padding + 1))
                .and_then(|v| v.checked_sub(p.checked_mul(2)?))
                .filter(|&v| v > 0);
            let Some(size) = size else {
                return bad(format!(
                    "no output along spatial dim {i}: (size {} - 1) x stride {s} - 2 x padding {p} + dilation {d} x (kernel {k} - 1) + output_padding {output_padding} + 1 is not positive",
                    self.dims()[2 + i]
                ));
            };
            out.push(size);
        }
        let op = ConvOp::GradInput {
            geom,
            groups,
            spatial: out,
        };
        self.emit(Prim::Conv(op), &[&w])
    }

    /// 1D transposed convolution, candle's argument order: `[N, Cin, L]`
    /// with `[Cin, Cout/groups, k]`.
    pub fn conv_transpose1d(
        &self,
        w: impl Operand,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Tracer> {
        self.conv_transpose(
            w,
            ConvGeom::uniform(1, 0, padding, stride, dilation),
            output_padding,
            groups,
        )
    }

    /// 2D transposed convolution, candle's argument order (plus `groups`).
    pub fn conv_transpose2d(
        &self,
        w: impl Operand,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Tracer> {
        self.conv_transpose(
            w,
            ConvGeom::uniform(2, 0, padding, stride, dilation),
            output_padding,
            groups,
        )
    }
}
