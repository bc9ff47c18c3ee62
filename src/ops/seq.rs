//! The operations sequence models need: more activations, masks, ranges,
//! cumulative sums, arg-max and arg-min, rank-1 products and candle's
//! `broadcast_*` names. Most are compositions of primitives (so every
//! transform handles them); `sin`, `cos` and the arg-extremes are
//! primitives of their own.

use super::Axis;
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{AttnOp, Reduce, Unary};
use crate::ir::Prim;
use crate::trace::{Operand, Tracer};
use candle_core::{DType, Tensor};

impl Tracer {
    /// Sine.
    pub fn sin(&self) -> Result<Tracer> {
        self.float_only("sin")?;
        self.unary(Unary::Sin)
    }

    /// Cosine.
    pub fn cos(&self) -> Result<Tracer> {
        self.float_only("cos")?;
        self.unary(Unary::Cos)
    }

    /// SiLU (swish), `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Tracer> {
        self.float_only("silu")?;
        self.mul(&self.sigmoid()?)
    }

    /// GELU in its tanh approximation, `x / 2 * (1 + tanh(sqrt(2 / pi) (x +
    /// 0.044715 x^3)))` (PyTorch's `gelu(approximate="tanh")`, candle's
    /// `gelu`).
    pub fn gelu_tanh(&self) -> Result<Tracer> {
        self.float_only("gelu_tanh")?;
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let inner = self.add(&self.powf(3.0)?.affine(0.044715, 0.0)?)?.affine(c, 0.0)?;
        self.mul(&inner.tanh()?.affine(0.5, 0.5)?)
    }

    /// `x` where `x >= 0`, else `slope * x` (PyTorch's `leaky_relu`).
    pub fn leaky_relu(&self, slope: f64) -> Result<Tracer> {
        self.float_only("leaky_relu")?;
        self.lt(0.0)?.where_cond(&self.affine(slope, 0.0)?, self)
    }

    /// `x` where `x > 0`, else `alpha (e^x - 1)` (PyTorch's `elu`).
    pub fn elu(&self, alpha: f64) -> Result<Tracer> {
        self.float_only("elu")?;
        // exp of the negative part only, so a large x cannot overflow it
        let neg = self.minimum(0.0)?.exp()?.affine(alpha, -alpha)?;
        self.gt(0.0)?.where_cond(self, &neg)
    }

    /// `log(1 + e^x)`, computed as `max(x, 0) + log(1 + e^-|x|)` so it
    /// neither overflows nor loses small values (PyTorch's `softplus`).
    pub fn softplus(&self) -> Result<Tracer> {
        self.float_only("softplus")?;
        let tail = self.abs()?.neg()?.exp()?.log1p()?;
        self.relu()?.add(&tail)
    }

    /// `log(1 + x)`, accurate where `x` is small (PyTorch's `log1p`): a
    /// series below `|x| = 1e-4` (truncated after `x^3 / 3`, a relative
    /// error under 1e-12), the logarithm elsewhere.
    pub fn log1p(&self) -> Result<Tracer> {
        self.float_only("log1p")?;
        let x2 = self.sqr()?;
        let series = self
            .sub(&x2.affine(0.5, 0.0)?)?
            .add(&x2.mul(self)?.affine(1.0 / 3.0, 0.0)?)?;
        // the logarithm's argument kept at 1 where the series is used, so
        // its derivative there is finite whatever x is
        let small = self.abs()?.lt(1e-4)?;
        let log = small.where_cond(0.0, self)?.affine(1.0, 1.0)?.log()?;
        small.where_cond(&series, &log)
    }

    /// Every value limited to `[min, max]` (PyTorch's `clamp`): the
    /// derivative is 1 inside, boundaries included, and 0 outside; NaN
    /// stays NaN.
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tracer> {
        if min.is_nan() || max.is_nan() || min > max {
            return Err(Error::shape(
                "clamp",
                &[self.dims()],
                format!("bounds [{min}, {max}] are not an interval"),
            ));
        }
        let high = self.gt(max)?.where_cond(max, self)?;
        self.lt(min)?.where_cond(min, &high)
    }

    /// Scaled dot-product attention with this tensor as the queries,
    /// `softmax(mask(q k^T * scale)) v` over `q`, `k`, `v` `[N, H, T, D]`
    /// with `keep [N, T]` (nonzero for a real token) and the causal mask
    /// hiding keys (a hidden score becomes the dtype's lowest finite
    /// value): one primitive whose gradient keeps no `T x T` matrix (see
    /// [`nn::attend`](crate::nn::attend), which takes grouped keys and
    /// values too).
    pub(crate) fn attention(
        &self,
        k: &Tracer,
        v: &Tracer,
        keep: Option<&Tracer>,
        causal: bool,
        scale: f64,
    ) -> Result<Tracer> {
        let op = AttnOp {
            scale,
            causal,
            masked: keep.is_some(),
            backward: false,
        };
        let mut others = vec![k, v];
        others.extend(keep);
        self.emit(Prim::Attention(op), &others)
    }

    /// `value` where `mask` (a `u8` tensor broadcast to this shape) is
    /// nonzero, else this value (PyTorch's `masked_fill`; attention fills
    /// hidden scores with [`nn::mask_value`](crate::nn::mask_value), as
    /// [`nn::attend`](crate::nn::attend) does).
    pub fn masked_fill(&self, mask: impl Operand, value: f64) -> Result<Tracer> {
        let mask = mask.to_tracer(self)?;
        if mask.dtype() != DType::U8 {
            return Err(Error::DType {
                op: "masked_fill",
                dtypes: vec![mask.dtype()],
                msg: "the mask is a u8 tensor (as comparisons give)".into(),
            });
        }
        mask.where_cond(value, self)
    }

    /// The lower triangle of the last two axes, diagonals above the
    /// `k`-th (0 the main diagonal, positive above it) set to zero
    /// (PyTorch's `tril`).
    pub fn tril(&self, k: i64) -> Result<Tracer> {
        self.triangle("tril", k, true)
    }

    /// The upper triangle of the last two axes, diagonals below the
    /// `k`-th set to zero (PyTorch's `triu`).
    pub fn triu(&self, k: i64) -> Result<Tracer> {
        self.triangle("triu", k, false)
    }

    fn triangle(&self, op: &'static str, k: i64, lower: bool) -> Result<Tracer> {
        let r = self.rank();
        if r < 2 {
            return Err(Error::shape(op, &[self.dims()], "needs at least two axes"));
        }
        let (n, m) = (self.dims()[r - 2], self.dims()[r - 1]);
        // keep (i, j) where j - i <= k (lower) or j - i >= k (upper)
        let keep: Vec<u8> = (0..n * m)
            .map(|e| {
                let d = (e % m) as i64 - (e / m) as i64;
                u8::from(if lower { d <= k } else { d >= k })
            })
            .collect();
        let mask = Tensor::from_vec(keep, (n, m), &self.device()).op(op)?;
        mask.to_tracer(self)?.where_cond(self, 0.0)
    }

    /// `start, start + 1, .., end - 1` as a rank-1 tensor of `dtype`, a
    /// constant of the trace `like` belongs to (candle's `arange`).
    pub fn arange(like: &Tracer, start: i64, end: i64, dtype: DType) -> Result<Tracer> {
        if end < start {
            return Err(Error::shape(
                "arange",
                &[],
                format!("end {end} is before start {start}"),
            ));
        }
        let t = Tensor::arange(start, end, &like.device())
            .and_then(|t| t.to_dtype(dtype))
            .op("arange")?;
        t.to_tracer(like)
    }

    /// The running sum along `axis` (PyTorch's `cumsum`), as products with
    /// a triangle of ones (GEMMs, and every transform's rule for free):
    /// one for up to 256 elements, else per block of 256 with the blocks'
    /// totals summed the same way.
    pub fn cumsum(&self, axis: impl Axis) -> Result<Tracer> {
        self.float_only("cumsum")?;
        let a = axis.index("cumsum", self.dims())?;
        let r = self.rank();
        self.transpose(a, r - 1)?.cumsum_last()?.transpose(a, r - 1)
    }

    fn cumsum_last(&self) -> Result<Tracer> {
        const BLOCK: usize = 256;
        let r = self.rank();
        let n = self.dims()[r - 1];
        if n <= BLOCK {
            // [.., n] @ U [n, n], U[i, j] = 1 where i <= j
            let upper: Vec<f64> = (0..n * n).map(|e| f64::from(u8::from(e / n <= e % n))).collect();
            let upper = Tensor::from_vec(upper, (n, n), &self.device())
                .and_then(|u| u.to_dtype(self.dtype()))
                .op("cumsum")?;
            return self.broadcast_matmul(&upper.to_tracer(self)?);
        }
        // [.., n] -> pad to [.., c * BLOCK] -> [.., c, BLOCK]
        let c = n.div_ceil(BLOCK);
        let lead = self.dims()[..r - 1].to_vec();
        let pad = Tensor::zeros([&lead[..], &[c * BLOCK - n]].concat(), self.dtype(), &self.device()).op("cumsum")?;
        let blocks = Tracer::cat(&[self, &pad.to_tracer(self)?], r - 1)?.reshape([&lead[..], &[c, BLOCK]].concat())?;
        let within = blocks.cumsum_last()?;
        // each block's total, then the totals of the blocks before it
        let totals = within.narrow(r, BLOCK - 1, 1)?.squeeze(r)?;
        let before = totals.cumsum_last()?.sub(&totals)?;
        let y = within.add(&before.unsqueeze(r)?)?;
        y.reshape([&lead[..], &[c * BLOCK]].concat())?.narrow(r - 1, 0, n)
    }

    /// The index (`u32`) of the maximum along `axis`, dropping it: the
    /// first where values tie, a NaN's where there is one (PyTorch's
    /// `argmax`). Not differentiable: its result is an integer.
    pub fn argmax(&self, axis: impl Axis) -> Result<Tracer> {
        self.arg_extreme("argmax", axis, false, false)
    }

    /// [`Tracer::argmax`], keeping the axis with size 1.
    pub fn argmax_keepdim(&self, axis: impl Axis) -> Result<Tracer> {
        self.arg_extreme("argmax", axis, true, false)
    }

    /// The index (`u32`) of the minimum along `axis`, dropping it (as
    /// [`Tracer::argmax`]).
    pub fn argmin(&self, axis: impl Axis) -> Result<Tracer> {
        self.arg_extreme("argmin", axis, false, true)
    }

    /// [`Tracer::argmin`], keeping the axis with size 1.
    pub fn argmin_keepdim(&self, axis: impl Axis) -> Result<Tracer> {
        self.arg_extreme("argmin", axis, true, true)
    }

    fn arg_extreme(&self, op: &'static str, axis: impl Axis, keepdim: bool, min: bool) -> Result<Tracer> {
        let axis = axis.index(op, self.dims())?;
        self.emit(Prim::Reduce(Reduce::Arg { axis, keepdim, min }), &[])
    }

    /// A matrix product with candle's names and PyTorch's `matmul` rules:
    /// leading axes broadcast, and a rank-1 operand is a row (left) or a
    /// column (right) vector whose axis the result drops.
    pub fn broadcast_matmul(&self, rhs: impl Operand) -> Result<Tracer> {
        let r = rhs.to_tracer(self)?;
        if self.rank() == 0 || r.rank() == 0 {
            return Err(Error::shape(
                "matmul",
                &[self.dims(), r.dims()],
                "a scalar has no matrix product",
            ));
        }
        let (l1, r1) = (self.rank() == 1, r.rank() == 1);
        let a = if l1 { self.unsqueeze(0)? } else { self.clone() };
        let b = if r1 { r.unsqueeze(1)? } else { r };
        let mut y = a.matmul(&b)?;
        if r1 {
            y = y.squeeze(y.rank() - 1)?;
        }
        if l1 {
            y = y.squeeze(y.rank().saturating_sub(if r1 { 1 } else { 2 }))?;
        }
        Ok(y)
    }

    /// `self + rhs` with broadcasting (candle's name; [`Tracer::add`]
    /// broadcasts too).
    pub fn broadcast_add(&self, rhs: impl Operand) -> Result<Tracer> {
        self.add(rhs)
    }

    /// `self - rhs` with broadcasting.
    pub fn broadcast_sub(&self, rhs: impl Operand) -> Result<Tracer> {
        self.sub(rhs)
    }

    /// `self * rhs` with broadcasting.
    pub fn broadcast_mul(&self, rhs: impl Operand) -> Result<Tracer> {
        self.mul(rhs)
    }

    /// `self / rhs` with broadcasting.
    pub fn broadcast_div(&self, rhs: impl Operand) -> Result<Tracer> {
        self.div(rhs)
    }

    /// The elementwise maximum with broadcasting.
    pub fn broadcast_maximum(&self, rhs: impl Operand) -> Result<Tracer> {
        self.maximum(rhs)
    }

    /// The elementwise minimum with broadcasting.
    pub fn broadcast_minimum(&self, rhs: impl Operand) -> Result<Tracer> {
        self.minimum(rhs)
    }

    /// The variance over `axes`, keeping them, with `n` in the denominator
    /// (the biased estimate normalisation layers use).
    pub fn var_keepdim(&self, axes: impl super::Axes) -> Result<Tracer> {
        self.float_only("var")?;
        let axes = axes.indices("var", self.dims())?;
        let d = self.sub(&self.mean_keepdim(axes.clone())?)?;
        d.sqr()?.mean_keepdim(axes)
    }
}
