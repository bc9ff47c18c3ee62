//! The parameters of each primitive family, and the names the graph
//! printer shows. The families' rules (shape inference, run, batching,
//! VJP) live in `crate::rules`, one file per family.

use super::TensorType;
use candle_core::DType;

// ---- elementwise

/// Unary elementwise maps.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Unary {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// natural logarithm
    Log,
    /// square root
    Sqrt,
    /// `x * x`
    Sqr,
    /// `1 / x`
    Recip,
    /// absolute value
    Abs,
    /// `max(x, 0)`
    Relu,
    /// hyperbolic tangent
    Tanh,
    /// the error function (GELU's exact form is built on it)
    Erf,
    /// logistic sigmoid
    Sigmoid,
    /// GELU in its exact form, `x Φ(x)` (`x / 2 (1 + erf(x / sqrt 2))`)
    Gelu,
    /// sine
    Sin,
    /// cosine
    Cos,
    /// `x^e` for a constant exponent
    Powf(f64),
    /// `x * mul + add`
    Affine(f64, f64),
    /// conversion to another dtype
    Cast(DType),
    /// the value unchanged, with no derivative: its cotangent and tangent
    /// are zero (JAX's `stop_gradient`, PyTorch's `detach`)
    StopGradient,
    /// Sequence lengths checked when the graph runs: the value unchanged
    /// with no derivative, or an error unless every element is a whole
    /// number in `1..=steps` (PyTorch's `pack_padded_sequence` refuses
    /// the others; a mask built from them would silently clamp)
    Lengths(usize),
}

impl Unary {
    pub(crate) fn name(&self) -> String {
        match self {
            Unary::Neg => "neg".into(),
            Unary::Exp => "exp".into(),
            Unary::Log => "log".into(),
            Unary::Sqrt => "sqrt".into(),
            Unary::Sqr => "sqr".into(),
            Unary::Recip => "recip".into(),
            Unary::Abs => "abs".into(),
            Unary::Relu => "relu".into(),
            Unary::Tanh => "tanh".into(),
            Unary::Erf => "erf".into(),
            Unary::Sigmoid => "sigmoid".into(),
            Unary::Gelu => "gelu".into(),
            Unary::Sin => "sin".into(),
            Unary::Cos => "cos".into(),
            Unary::Powf(e) => format!("powf[{e}]"),
            Unary::Affine(m, a) => format!("affine[mul={m},add={a}]"),
            Unary::Cast(dt) => format!("cast[{}]", format!("{dt:?}").to_lowercase()),
            Unary::StopGradient => "stop_gradient".into(),
            Unary::Lengths(steps) => format!("lengths[1..={steps}]"),
        }
    }
}

/// Binary elementwise maps with numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Binary {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// elementwise maximum
    Maximum,
    /// elementwise minimum
    Minimum,
    /// ReLU's gradient: `b` unless `a <= 0` (so a NaN `a` passes it, as
    /// PyTorch's), else 0 (`(x, ct) -> dx`; one pass instead of a
    /// comparison and a select)
    ReluGrad,
    /// GELU's gradient: `b gelu'(a)`, `gelu'(x) = Φ(x) + x φ(x)` (`(x,
    /// ct) -> dx`; one pass instead of the composition's eight)
    GeluGrad,
}

impl Binary {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
            Binary::Maximum => "maximum",
            Binary::Minimum => "minimum",
            Binary::ReluGrad => "relu_grad",
            Binary::GeluGrad => "gelu_grad",
        }
    }
}

/// Elementwise comparisons, giving a `u8` mask (1 where true).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compare {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl Compare {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Compare::Eq => "eq",
            Compare::Ne => "ne",
            Compare::Lt => "lt",
            Compare::Le => "le",
            Compare::Gt => "gt",
            Compare::Ge => "ge",
        }
    }
}

// ---- reduce

/// Reductions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    /// Sum over `axes` (sorted, distinct), keeping them as unit axes or not.
    Sum {
        /// Reduced axes.
        axes: Vec<usize>,
        /// Keep reduced axes with size 1.
        keepdim: bool,
    },
    /// Maximum over `axes`.
    Max {
        /// Reduced axes.
        axes: Vec<usize>,
        /// Keep reduced axes with size 1.
        keepdim: bool,
    },
    /// Softmax along one axis.
    Softmax(usize),
    /// Log-softmax along one axis.
    LogSoftmax(usize),
    /// The index (`u32`) of the maximum, or with `min` the minimum, along
    /// one axis: the first where several tie, a NaN's where there is one
    /// (as PyTorch).
    Arg {
        /// The reduced axis.
        axis: usize,
        /// Keep it with size 1.
        keepdim: bool,
        /// `argmin` rather than `argmax`.
        min: bool,
    },
}

pub(crate) fn kd(keepdim: bool) -> &'static str {
    if keepdim {
        ",keepdim"
    } else {
        ""
    }
}

impl Reduce {
    pub(crate) fn name(&self) -> String {
        match self {
            Reduce::Sum { axes, keepdim } => format!("sum[axes={axes:?}{}]", kd(*keepdim)),
            Reduce::Max { axes, keepdim } => format!("max[axes={axes:?}{}]", kd(*keepdim)),
            Reduce::Softmax(a) => format!("softmax[axis={a}]"),
            Reduce::LogSoftmax(a) => format!("log_softmax[axis={a}]"),
            Reduce::Arg { axis, keepdim, min } => {
                format!(
                    "{}[axis={axis}{}]",
                    if *min { "argmin" } else { "argmax" },
                    kd(*keepdim)
                )
            }
        }
    }
}

// ---- shape

/// Shape primitives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ShapeOp {
    /// Same elements, new dimensions (row-major order).
    Reshape(Vec<usize>),
    /// Axis `i` of the result is axis `perm[i]` of the operand.
    Permute(Vec<usize>),
    /// Numpy broadcasting (right-aligned) to a larger shape.
    Broadcast(Vec<usize>),
    /// `len` elements from `start` along `axis`.
    Narrow {
        /// The sliced axis.
        axis: usize,
        /// First index kept.
        start: usize,
        /// Number of indices kept.
        len: usize,
    },
    /// Concatenation of all operands along an axis.
    Concat(usize),
}

impl ShapeOp {
    pub(crate) fn name(&self) -> String {
        match self {
            ShapeOp::Reshape(s) => format!("reshape[{s:?}]"),
            ShapeOp::Permute(p) => format!("permute[{p:?}]"),
            ShapeOp::Broadcast(s) => format!("broadcast[{s:?}]"),
            ShapeOp::Narrow { axis, start, len } => format!("narrow[axis={axis},start={start},len={len}]"),
            ShapeOp::Concat(a) => format!("concat[axis={a}]"),
        }
    }
}

// ---- index

/// Indexing primitives; the index operand is an integer tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexOp {
    /// `x.index_select(idx, axis)`: `idx` is 1-D; the result takes
    /// `x[.., idx[k], ..]` along `axis`.
    IndexSelect(usize, Lookup),
    /// `x.gather(idx, axis)`: `idx` has x's rank; `out[.., k, ..] = x[.., idx[.., k, ..], ..]`.
    Gather(usize, Lookup),
    /// The adjoint of index-select: `src` rows added into `size` rows at
    /// `idx` along `axis` (zeros elsewhere).
    IndexAdd {
        /// The axis.
        axis: usize,
        /// Size of the result along `axis`.
        size: usize,
    },
    /// The adjoint of gather: `src` (shaped like `idx`) added into `size`
    /// positions along `axis` at `idx`.
    ScatterAdd {
        /// The axis.
        axis: usize,
        /// Size of the result along `axis`.
        size: usize,
    },
    /// Ghost clipping's norm of an embedding's per-example gradient: for
    /// rows `[B, T, D]` added into a `[size, D]` table at ids `[B, T]`,
    /// each example's squared norm of its table, `[B]`, without the table.
    LookupSqNorms {
        /// The table's rows (the ids' range).
        size: usize,
    },
}

/// What the user asked for when an index primitive was recorded: its
/// errors (an id out of range) name that operation, also after batching
/// turned an embedding's selection into a gather.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// `index_select` or `gather` itself.
    Index,
    /// An embedding: rows of a `[vocab, dim]` table by token id.
    Embedding,
}

impl IndexOp {
    pub(crate) fn name(&self) -> String {
        let tag = |l: &Lookup| if *l == Lookup::Embedding { ",embedding" } else { "" };
        match self {
            IndexOp::IndexSelect(a, l) => format!("index_select[axis={a}{}]", tag(l)),
            IndexOp::Gather(a, l) => format!("gather[axis={a}{}]", tag(l)),
            IndexOp::IndexAdd { axis, size } => format!("index_add[axis={axis},size={size}]"),
            IndexOp::ScatterAdd { axis, size } => format!("scatter_add[axis={axis},size={size}]"),
            IndexOp::LookupSqNorms { size } => format!("lookup_sq_norms[size={size}]"),
        }
    }
}

// ---- attention

/// Scaled dot-product attention as one primitive,
/// `softmax(mask(q k^T * scale)) v` over `q`, `k`, `v` `[N, H, T, D]`
/// (operands `q, k, v`, then `keep [N, T]` where `masked`: nonzero for a
/// real token), and its gradient (`backward`: operands `q, k, v, dout`,
/// then `keep`; result `dq | dk | dv` packed `[N, H, T, 3D]`). A
/// hidden score (a key after its query where `causal`, a padded key)
/// becomes the dtype's lowest finite value, as in Hugging Face's eager
/// attention.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AttnOp {
    /// The factor on `q k^T`.
    pub(crate) scale: f64,
    /// Hide the keys after each query.
    pub(crate) causal: bool,
    /// Whether a `keep` mask follows the tensors.
    pub(crate) masked: bool,
    /// The gradient rather than the attention.
    pub(crate) backward: bool,
}

impl AttnOp {
    pub(crate) fn name(&self) -> String {
        let kind = if self.backward { "attention_grad" } else { "attention" };
        let mut s = format!("{kind}[scale={}", self.scale);
        if self.causal {
            s.push_str(",causal");
        }
        if self.masked {
            s.push_str(",masked");
        }
        s.push(']');
        s
    }

    /// Operands before `keep`: `q, k, v`, and `dout` for the gradient.
    pub(crate) fn tensors(&self) -> usize {
        if self.backward {
            4
        } else {
            3
        }
    }
}

// ---- pool

/// Pooling primitives and their gradients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PoolOp {
    /// Maximum over each `kernel` window, windows `stride` apart.
    MaxPool2d {
        /// Window (height, width).
        kernel: (usize, usize),
        /// Step (height, width).
        stride: (usize, usize),
    },
    /// Mean over each window.
    AvgPool2d {
        /// Window (height, width).
        kernel: (usize, usize),
        /// Step (height, width).
        stride: (usize, usize),
    },
    /// `(x, ct) -> dx`: each window's cotangent goes to the window's first
    /// maximum of `x`.
    MaxPoolGrad {
        /// Window (height, width).
        kernel: (usize, usize),
        /// Step (height, width).
        stride: (usize, usize),
    },
    /// `(x, g) -> [N, C, H', W']`: `g` read at each window's first maximum of
    /// `x` (the adjoint of `MaxPoolGrad` in its second operand).
    MaxPoolSelect {
        /// Window (height, width).
        kernel: (usize, usize),
        /// Step (height, width).
        stride: (usize, usize),
    },
    /// `ct -> dx`: each window's cotangent spread evenly over the window.
    AvgPoolGrad {
        /// Window (height, width).
        kernel: (usize, usize),
        /// Step (height, width).
        stride: (usize, usize),
        /// Input (height, width).
        input: (usize, usize),
    },
}

pub(crate) type Window = ((usize, usize), (usize, usize));

impl PoolOp {
    pub(crate) fn name(&self) -> String {
        let (kind, (k, s)) = (self.kind(), self.window());
        match self {
            PoolOp::AvgPoolGrad { input, .. } => format!("{kind}[k={k:?},s={s:?},size={input:?}]"),
            _ => format!("{kind}[k={k:?},s={s:?}]"),
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            PoolOp::MaxPool2d { .. } => "max_pool2d",
            PoolOp::AvgPool2d { .. } => "avg_pool2d",
            PoolOp::MaxPoolGrad { .. } => "max_pool2d_grad",
            PoolOp::MaxPoolSelect { .. } => "max_pool2d_select",
            PoolOp::AvgPoolGrad { .. } => "avg_pool2d_grad",
        }
    }

    pub(crate) fn window(&self) -> Window {
        match *self {
            PoolOp::MaxPool2d { kernel, stride }
            | PoolOp::AvgPool2d { kernel, stride }
            | PoolOp::MaxPoolGrad { kernel, stride }
            | PoolOp::MaxPoolSelect { kernel, stride }
            | PoolOp::AvgPoolGrad { kernel, stride, .. } => (kernel, stride),
        }
    }
}

// ---- place

/// A concatenation lowered to writes in place: a buffer of the result
/// type, then each piece written into it as soon as it is made (and
/// dropped), rather than every piece held until one concatenation copies
/// them all (a chunked `vmap`'s result was held twice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PlaceOp {
    /// Zeros of this type, the buffer the writes fill.
    Empty(TensorType),
    /// Operand 0 (an `Empty`, or the write before) with operand 1 written
    /// at `offset` along `axis`, in place; the result is operand 0's buffer.
    Write {
        /// The axis the pieces are laid along.
        axis: usize,
        /// Where along it this piece starts.
        offset: usize,
    },
}

impl PlaceOp {
    pub(crate) fn name(&self) -> String {
        match self {
            PlaceOp::Empty(t) => format!("empty[{:?}]", t.shape),
            PlaceOp::Write { axis, offset } => format!("write[axis={axis},offset={offset}]"),
        }
    }
}

// ---- random

/// Values uniform in `[0, 1)` of a fixed shape and dtype, drawn anew at
/// every run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Uniform {
    /// Result type.
    pub(crate) ty: TensorType,
}

impl Uniform {
    pub(crate) fn name(&self) -> String {
        format!("uniform[{:?}]", self.ty.shape)
    }
}
