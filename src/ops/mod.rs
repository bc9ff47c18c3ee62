//! The operations a traced function performs on [`Tracer`]s. Names and
//! argument orders follow candle's `Tensor` where candle has the operation;
//! binary operations broadcast (numpy rules), and every operation returns
//! `Result`, failing at trace time with the operation's name and shapes.

use crate::error::{Error, Result};
use crate::ir::conv::ConvOp;
use crate::ir::ops::{Binary, Compare, IndexOp, Lookup, PoolOp, Reduce, ShapeOp, Unary, Uniform};
use crate::ir::{ConvGeom, Prim};
use crate::rules::norm_axis;
use crate::trace::{Operand, Tracer};

mod conv_t;
mod custom;
mod seq;

use candle_core::shape::ShapeWithOneHole;
use candle_core::{DType, ToUsize2};
pub use custom::{custom_op, custom_op_with_rules, CustomRules};

/// An axis: a `usize`, or a signed integer where negative values count from
/// the end (`-1` is the last axis).
pub trait Axis: Copy {
    /// The axis as an index into `shape`.
    fn index(self, op: &'static str, shape: &[usize]) -> Result<usize>;
}

macro_rules! axis_ints {
    ($($t:ty),+) => {$(
        impl Axis for $t {
            fn index(self, op: &'static str, shape: &[usize]) -> Result<usize> {
                norm_axis(op, shape, self as isize)
            }
        }
    )+};
}
axis_ints!(usize, i32, i64, isize);

/// One or several axes: an [`Axis`], an array, a `Vec` or a slice of them.
pub trait Axes {
    /// The axes as sorted, distinct indices into `shape`.
    fn indices(self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>>;
}

fn sorted_distinct(op: &'static str, shape: &[usize], mut v: Vec<usize>) -> Result<Vec<usize>> {
    v.sort_unstable();
    if v.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::shape(op, &[shape], format!("axis repeated in {v:?}")));
    }
    Ok(v)
}

impl<A: Axis> Axes for A {
    fn indices(self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        Ok(vec![self.index(op, shape)?])
    }
}

impl<A: Axis> Axes for &[A] {
    fn indices(self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        let v = self.iter().map(|a| a.index(op, shape)).collect::<Result<Vec<_>>>()?;
        sorted_distinct(op, shape, v)
    }
}

impl<A: Axis, const N: usize> Axes for [A; N] {
    fn indices(self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        self.as_slice().indices(op, shape)
    }
}

impl<A: Axis> Axes for Vec<A> {
    fn indices(self, op: &'static str, shape: &[usize]) -> Result<Vec<usize>> {
        self.as_slice().indices(op, shape)
    }
}

impl Tracer {
    /// An error naming `op` unless this is a floating-point tensor.
    fn float_only(&self, op: &'static str) -> Result<()> {
        if self.dtype().is_float() {
            return Ok(());
        }
        Err(Error::DType {
            op,
            dtypes: vec![self.dtype()],
            msg: format!("{op} needs a floating-point operand"),
        })
    }

    fn unary(&self, u: Unary) -> Result<Tracer> {
        self.emit(Prim::Unary(u), &[])
    }

    /// The same values with no derivative: gradients and tangents through
    /// it are zero (JAX's `stop_gradient`, PyTorch's `detach`).
    pub fn stop_gradient(&self) -> Result<Tracer> {
        self.unary(Unary::StopGradient)
    }

    /// The same values, checked when the graph runs to be whole numbers
    /// in `1..=steps` (an `Error::Data` naming the first that is not);
    /// no derivative. For sequence lengths, whose values a trace cannot
    /// see.
    pub(crate) fn checked_lengths(&self, steps: usize) -> Result<Tracer> {
        self.unary(Unary::Lengths(steps))
    }
    /// `-x`
    pub fn neg(&self) -> Result<Tracer> {
        self.unary(Unary::Neg)
    }
    /// `e^x`
    pub fn exp(&self) -> Result<Tracer> {
        self.unary(Unary::Exp)
    }
    /// Natural logarithm.
    pub fn log(&self) -> Result<Tracer> {
        self.unary(Unary::Log)
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tracer> {
        self.unary(Unary::Sqrt)
    }
    /// `x * x`
    pub fn sqr(&self) -> Result<Tracer> {
        self.unary(Unary::Sqr)
    }
    /// `1 / x`
    pub fn recip(&self) -> Result<Tracer> {
        self.unary(Unary::Recip)
    }
    /// Absolute value.
    pub fn abs(&self) -> Result<Tracer> {
        self.unary(Unary::Abs)
    }
    /// `max(x, 0)`
    pub fn relu(&self) -> Result<Tracer> {
        self.unary(Unary::Relu)
    }
    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tracer> {
        self.unary(Unary::Tanh)
    }
    /// The error function.
    pub fn erf(&self) -> Result<Tracer> {
        self.unary(Unary::Erf)
    }
    /// GELU in its exact form, `x / 2 * (1 + erf(x / sqrt 2))` (PyTorch's
    /// default `gelu`).
    pub fn gelu(&self) -> Result<Tracer> {
        self.float_only("gelu")?;
        self.unary(Unary::Gelu)
    }
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    pub fn sigmoid(&self) -> Result<Tracer> {
        self.unary(Unary::Sigmoid)
    }
    /// `x^e` for a constant exponent.
    pub fn powf(&self, e: f64) -> Result<Tracer> {
        self.unary(Unary::Powf(e))
    }
    /// `x * mul + add` for constants.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tracer> {
        self.unary(Unary::Affine(mul, add))
    }
    /// Conversion to another dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tracer> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        self.unary(Unary::Cast(dtype))
    }

    fn binary(&self, op: Binary, rhs: impl Operand) -> Result<Tracer> {
        let r = rhs.to_tracer(self)?;
        self.emit(Prim::Binary(op), &[&r])
    }

    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Add, rhs)
    }
    /// `self - rhs`, broadcasting.
    pub fn sub(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Sub, rhs)
    }
    /// `self * rhs`, broadcasting.
    pub fn mul(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Mul, rhs)
    }
    /// `self / rhs`, broadcasting.
    pub fn div(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Div, rhs)
    }
    /// Elementwise maximum, broadcasting.
    pub fn maximum(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Maximum, rhs)
    }
    /// Elementwise minimum, broadcasting.
    pub fn minimum(&self, rhs: impl Operand) -> Result<Tracer> {
        self.binary(Binary::Minimum, rhs)
    }

    fn compare(&self, op: Compare, rhs: impl Operand) -> Result<Tracer> {
        let r = rhs.to_tracer(self)?;
        self.emit(Prim::Compare(op), &[&r])
    }

    /// `self == rhs` as a `u8` mask, broadcasting.
    pub fn eq(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Eq, rhs)
    }
    /// `self != rhs` as a `u8` mask.
    pub fn ne(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Ne, rhs)
    }
    /// `self < rhs` as a `u8` mask.
    pub fn lt(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Lt, rhs)
    }
    /// `self <= rhs` as a `u8` mask.
    pub fn le(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Le, rhs)
    }
    /// `self > rhs` as a `u8` mask.
    pub fn gt(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Gt, rhs)
    }
    /// `self >= rhs` as a `u8` mask.
    pub fn ge(&self, rhs: impl Operand) -> Result<Tracer> {
        self.compare(Compare::Ge, rhs)
    }

    /// Uses `self` as a mask: `on_true` where it is non-zero, `on_false`
    /// elsewhere (candle's `where_cond`), broadcasting all three. A scalar
    /// branch takes the other branch's dtype (f32 when both are scalars).
    pub fn where_cond(&self, on_true: impl Operand, on_false: impl Operand) -> Result<Tracer> {
        let like = if !on_true.is_literal() {
            on_true.to_tracer(self)?
        } else if !on_false.is_literal() {
            on_false.to_tracer(self)?
        } else {
            let id = self.b.borrow_mut().scalar(0.0, DType::F32);
            Tracer::new(&self.b, id)
        };
        let t = on_true.to_tracer(&like)?;
        let f = on_false.to_tracer(&like)?;
        self.emit(Prim::Where, &[&t, &f])
    }

    fn reduce(&self, axes: impl Axes, keepdim: bool, max: bool) -> Result<Tracer> {
        let axes = axes.indices("reduce", self.dims())?;
        let r = if max {
            Reduce::Max { axes, keepdim }
        } else {
            Reduce::Sum { axes, keepdim }
        };
        self.emit(Prim::Reduce(r), &[])
    }

    /// Sum over `axes`, dropping them.
    pub fn sum(&self, axes: impl Axes) -> Result<Tracer> {
        self.reduce(axes, false, false)
    }
    /// Sum over `axes`, keeping them with size 1.
    pub fn sum_keepdim(&self, axes: impl Axes) -> Result<Tracer> {
        self.reduce(axes, true, false)
    }
    /// Sum of all elements (shape `[]`).
    pub fn sum_all(&self) -> Result<Tracer> {
        self.reduce((0..self.rank()).collect::<Vec<usize>>(), false, false)
    }
    /// Maximum over `axes`, dropping them.
    pub fn max(&self, axes: impl Axes) -> Result<Tracer> {
        self.reduce(axes, false, true)
    }
    /// Maximum over `axes`, keeping them with size 1.
    pub fn max_keepdim(&self, axes: impl Axes) -> Result<Tracer> {
        self.reduce(axes, true, true)
    }
    /// Mean over `axes`, dropping them.
    pub fn mean(&self, axes: impl Axes) -> Result<Tracer> {
        self.float_only("mean")?;
        let axes = axes.indices("mean", self.dims())?;
        let n: usize = axes.iter().map(|&a| self.dims()[a]).product();
        self.reduce(axes, false, false)?.affine(1.0 / n as f64, 0.0)
    }
    /// Mean over `axes`, keeping them with size 1.
    pub fn mean_keepdim(&self, axes: impl Axes) -> Result<Tracer> {
        self.float_only("mean")?;
        let axes = axes.indices("mean", self.dims())?;
        let n: usize = axes.iter().map(|&a| self.dims()[a]).product();
        self.reduce(axes, true, false)?.affine(1.0 / n as f64, 0.0)
    }
    /// Mean of all elements (shape `[]`).
    pub fn mean_all(&self) -> Result<Tracer> {
        self.mean((0..self.rank()).collect::<Vec<usize>>())
    }
    /// Softmax along `axis`.
    pub fn softmax(&self, axis: impl Axis) -> Result<Tracer> {
        let a = axis.index("softmax", self.dims())?;
        self.emit(Prim::Reduce(Reduce::Softmax(a)), &[])
    }
    /// Log-softmax along `axis` (numerically stable).
    pub fn log_softmax(&self, axis: impl Axis) -> Result<Tracer> {
        let a = axis.index("log_softmax", self.dims())?;
        self.emit(Prim::Reduce(Reduce::LogSoftmax(a)), &[])
    }

    fn shape_op(&self, op: ShapeOp) -> Result<Tracer> {
        self.emit(Prim::Shape(op), &[])
    }

    /// Same elements in a new shape; one dimension may be `()` to be inferred,
    /// as in candle (`x.reshape((b, ()))`).
    pub fn reshape(&self, shape: impl ShapeWithOneHole) -> Result<Tracer> {
        let n = self.elem_count();
        // candle's conversion multiplies the dimensions unchecked, which
        // panics on overflow in debug builds: that is a shape error here
        let s = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shape.into_shape(n)))
            .map_err(|_| Error::shape("reshape", &[self.dims()], "the target's element count overflows usize"))?
            .map_err(|e| reshape_error(self.dims(), n, e))?;
        if s.dims() == self.dims() {
            return Ok(self.clone());
        }
        self.shape_op(ShapeOp::Reshape(s.dims().to_vec()))
    }
    /// Reorders the axes: axis `i` of the result is axis `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tracer> {
        self.shape_op(ShapeOp::Permute(perm.to_vec()))
    }
    /// Swaps two axes.
    pub fn transpose(&self, a: impl Axis, b: impl Axis) -> Result<Tracer> {
        let (a, b) = (a.index("transpose", self.dims())?, b.index("transpose", self.dims())?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }
    /// Swaps the last two axes.
    pub fn t(&self) -> Result<Tracer> {
        if self.rank() < 2 {
            return Err(Error::shape("t", &[self.dims()], "needs rank >= 2"));
        }
        self.transpose(-2, -1)
    }
    /// Broadcasts (numpy rules, right-aligned) to a larger shape.
    pub fn broadcast_as(&self, shape: impl Into<candle_core::Shape>) -> Result<Tracer> {
        let s: candle_core::Shape = shape.into();
        if s.dims() == self.dims() {
            return Ok(self.clone());
        }
        self.shape_op(ShapeOp::Broadcast(s.dims().to_vec()))
    }
    /// `len` elements from `start` along `axis`.
    pub fn narrow(&self, axis: impl Axis, start: usize, len: usize) -> Result<Tracer> {
        let axis = axis.index("narrow", self.dims())?;
        self.shape_op(ShapeOp::Narrow { axis, start, len })
    }
    /// Removes a size-1 axis (a larger axis is left as it is, as in candle).
    pub fn squeeze(&self, axis: impl Axis) -> Result<Tracer> {
        let a = axis.index("squeeze", self.dims())?;
        if self.dims()[a] != 1 {
            return Ok(self.clone());
        }
        let mut d = self.dims().to_vec();
        d.remove(a);
        self.reshape(d)
    }
    /// Inserts a size-1 axis at `axis` (which may equal the rank).
    pub fn unsqueeze(&self, axis: usize) -> Result<Tracer> {
        if axis > self.rank() {
            return Err(Error::shape(
                "unsqueeze",
                &[self.dims()],
                format!("axis {axis} out of range"),
            ));
        }
        let mut d = self.dims().to_vec();
        d.insert(axis, 1);
        self.reshape(d)
    }
    /// Merges axes `start..=end` into one.
    pub fn flatten(&self, start: impl Axis, end: impl Axis) -> Result<Tracer> {
        let (s, e) = (start.index("flatten", self.dims())?, end.index("flatten", self.dims())?);
        if s > e {
            return Err(Error::shape(
                "flatten",
                &[self.dims()],
                format!("start {s} after end {e}"),
            ));
        }
        let d = self.dims();
        let merged: usize = d[s..=e].iter().product();
        self.reshape([&d[..s], &[merged], &d[e + 1..]].concat())
    }
    /// Merges axes `start..` into one.
    pub fn flatten_from(&self, start: impl Axis) -> Result<Tracer> {
        if self.rank() == 0 {
            return self.reshape(vec![1]);
        }
        self.flatten(start, self.rank() - 1)
    }
    /// All elements in one axis.
    pub fn flatten_all(&self) -> Result<Tracer> {
        self.reshape(vec![self.elem_count()])
    }
    /// Concatenates along `axis`.
    pub fn cat(xs: &[&Tracer], axis: impl Axis) -> Result<Tracer> {
        let (first, rest) = xs
            .split_first()
            .ok_or_else(|| Error::shape("cat", &[], "needs at least one tensor"))?;
        let a = axis.index("cat", first.dims())?;
        first.emit(Prim::Shape(ShapeOp::Concat(a)), rest)
    }
    /// Stacks along a new axis `axis`.
    pub fn stack(xs: &[&Tracer], axis: usize) -> Result<Tracer> {
        let ys = xs.iter().map(|x| x.unsqueeze(axis)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tracer> = ys.iter().collect();
        Tracer::cat(&refs, axis)
    }

    /// Selects `idx` (1-D, integer) along `axis`.
    pub fn index_select(&self, idx: impl Operand, axis: impl Axis) -> Result<Tracer> {
        let axis = axis.index("index_select", self.dims())?;
        let i = idx.to_tracer(self)?;
        self.emit(Prim::Index(IndexOp::IndexSelect(axis, Lookup::Index)), &[&i])
    }
    /// Rows of this `[vocab, dim]` table for integer `ids` of any shape:
    /// `[ids.., dim]` (an embedding lookup; `torch.nn.functional.embedding`).
    /// An id outside `0..vocab` is an error naming `embedding`.
    pub fn embedding(&self, ids: impl Operand) -> Result<Tracer> {
        if self.rank() != 2 {
            return Err(Error::shape(
                "embedding",
                &[self.dims()],
                "the table must be [vocab, dim]",
            ));
        }
        let ids = ids.to_tracer(self)?;
        let flat = ids.flatten_all()?;
        let rows = self.emit(Prim::Index(IndexOp::IndexSelect(0, Lookup::Embedding)), &[&flat])?;
        rows.reshape([ids.dims(), &[self.dims()[1]]].concat())
    }
    /// Gathers along `axis`: `idx` has this tensor's rank, and the result its
    /// shape (as candle's and PyTorch's `gather`).
    pub fn gather(&self, idx: impl Operand, axis: impl Axis) -> Result<Tracer> {
        let axis = axis.index("gather", self.dims())?;
        let i = idx.to_tracer(self)?;
        self.emit(Prim::Index(IndexOp::Gather(axis, Lookup::Index)), &[&i])
    }

    /// Matrix product over the last two axes; leading axes broadcast.
    pub fn matmul(&self, rhs: impl Operand) -> Result<Tracer> {
        let r = rhs.to_tracer(self)?;
        self.emit(Prim::Matmul, &[&r])
    }

    /// N-d convolution with the window geometry of `geom`. The kernel size
    /// is `w`'s spatial size: a geometry whose kernel is left at zero takes
    /// it from `w`, and one that names a kernel must agree with `w`.
    pub fn conv(&self, w: impl Operand, mut geom: ConvGeom, groups: usize) -> Result<Tracer> {
        let w = w.to_tracer(self)?;
        let k = w.dims().get(2..).unwrap_or(&[]).to_vec();
        if geom.kernel.iter().all(|&d| d == 0) {
            geom.kernel = k;
        } else if geom.kernel != k {
            return Err(Error::shape(
                "conv",
                &[self.dims(), w.dims()],
                format!("the geometry's kernel {:?} is not the weight's {k:?}", geom.kernel),
            ));
        }
        self.emit(Prim::Conv(ConvOp::Conv { geom, groups }), &[&w])
    }
    /// 1D convolution: `[N, Cin, L] * [Cout, Cin/groups, k]` (candle's argument order).
    pub fn conv1d(
        &self,
        w: impl Operand,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Tracer> {
        self.conv(w, ConvGeom::uniform(1, 0, padding, stride, dilation), groups)
    }
    /// 2D convolution: `[N, Cin, H, W] * [Cout, Cin/groups, kh, kw]`.
    pub fn conv2d(
        &self,
        w: impl Operand,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Tracer> {
        self.conv(w, ConvGeom::uniform(2, 0, padding, stride, dilation), groups)
    }
    /// 3D convolution: `[N, Cin, D, H, W] * [Cout, Cin/groups, kd, kh, kw]`
    /// (candle has none; this crate supplies it).
    pub fn conv3d(
        &self,
        w: impl Operand,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Tracer> {
        self.conv(w, ConvGeom::uniform(3, 0, padding, stride, dilation), groups)
    }
    /// im2col: `[N, C, *S] -> [N, C * prod(kernel), L]` (PyTorch's `F.unfold`
    /// order), for 1, 2 or 3 spatial dims.
    pub fn unfold(&self, geom: ConvGeom) -> Result<Tracer> {
        self.emit(Prim::Conv(ConvOp::Unfold(geom)), &[])
    }

    /// Values uniform in `[0, 1)` with this tensor's shape and dtype, drawn
    /// anew at every run (see [`crate::manual_seed`]; under `vmap`, the
    /// transform's `randomness` setting applies).
    pub fn rand_uniform_like(&self) -> Result<Tracer> {
        let prim = Prim::Random(Uniform { ty: self.ty.clone() });
        let id = self.b.borrow_mut().emit(prim, &[])?;
        Ok(Tracer::new(&self.b, id))
    }

    /// Max pooling over `[N, C, H, W]` with stride equal to the kernel.
    pub fn max_pool2d(&self, kernel: impl ToUsize2) -> Result<Tracer> {
        let k = kernel.to_usize2();
        self.max_pool2d_with_stride(k, k)
    }
    /// Max pooling with any kernel and stride.
    pub fn max_pool2d_with_stride(&self, kernel: impl ToUsize2, stride: impl ToUsize2) -> Result<Tracer> {
        let (kernel, stride) = (kernel.to_usize2(), stride.to_usize2());
        self.emit(Prim::Pool(PoolOp::MaxPool2d { kernel, stride }), &[])
    }
    /// Average pooling with stride equal to the kernel.
    pub fn avg_pool2d(&self, kernel: impl ToUsize2) -> Result<Tracer> {
        let k = kernel.to_usize2();
        self.avg_pool2d_with_stride(k, k)
    }
    /// Average pooling with any kernel and stride.
    pub fn avg_pool2d_with_stride(&self, kernel: impl ToUsize2, stride: impl ToUsize2) -> Result<Tracer> {
        let (kernel, stride) = (kernel.to_usize2(), stride.to_usize2());
        self.emit(Prim::Pool(PoolOp::AvgPool2d { kernel, stride }), &[])
    }
}

/// A failed reshape in the user's terms: the source shape and both element
/// counts (candle says "buffer of size 9 which is compatible with shape
/// [5, 2]", which reads as the opposite).
fn reshape_error(dims: &[usize], n: usize, e: candle_core::Error) -> Error {
    let msg = match crate::error::without_backtrace(e) {
        candle_core::Error::ShapeMismatch { shape, .. } => format!(
            "cannot reshape {dims:?} ({n} elements) into {:?} ({} elements)",
            shape.dims(),
            shape.elem_count()
        ),
        // a shape with a hole `()` the element count does not divide
        other => format!("cannot reshape {dims:?} ({n} elements): {other}"),
    };
    Error::shape("reshape", &[dims], msg)
}
