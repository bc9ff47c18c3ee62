//! Elementwise primitives: unary maps, casts, broadcasting binary maps,
//! comparisons and `where`.

use super::{arity, broadcast_shapes, same_dtype, BVal, BatchCx, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType};
use candle_core::{DType, Tensor};

/// Unary elementwise maps.
#[derive(Clone, Debug, PartialEq)]
pub enum Unary {
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
    /// logistic sigmoid
    Sigmoid,
    /// `x^e` for a constant exponent
    Powf(f64),
    /// `x * mul + add`
    Affine(f64, f64),
    /// conversion to another dtype
    Cast(DType),
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
            Unary::Sigmoid => "sigmoid".into(),
            Unary::Powf(e) => format!("powf[{e}]"),
            Unary::Affine(m, a) => format!("affine[mul={m},add={a}]"),
            Unary::Cast(dt) => format!("cast[{}]", format!("{dt:?}").to_lowercase()),
        }
    }
}

fn is_float(dt: DType) -> bool {
    matches!(dt, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

impl Rule for Unary {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("unary", args, 1)?;
        if let Unary::Cast(dt) = self {
            return Ok(args[0].with_shape(args[0].shape.clone()).cast(*dt));
        }
        let needs_float = !matches!(self, Unary::Neg | Unary::Abs | Unary::Relu | Unary::Sqr);
        if needs_float && !is_float(args[0].dtype) {
            return Err(Error::DType {
                op: "unary",
                dtypes: vec![args[0].dtype],
                msg: format!("{} needs a floating-point operand", self.name()),
            });
        }
        Ok(args[0].clone())
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let x = args[0];
        let r = match self {
            Unary::Neg => x.neg(),
            Unary::Exp => x.exp(),
            Unary::Log => x.log(),
            Unary::Sqrt => x.sqrt(),
            Unary::Sqr => x.sqr(),
            Unary::Recip => x.recip(),
            Unary::Abs => x.abs(),
            Unary::Relu => x.relu(),
            Unary::Tanh => x.tanh(),
            Unary::Sigmoid => candle_nn::ops::sigmoid(x),
            Unary::Powf(e) => x.powf(*e),
            Unary::Affine(m, a) => x.affine(*m, *a),
            Unary::Cast(dt) => x.to_dtype(*dt),
        };
        r.op(&self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // Elementwise: the batch axis stays where it is.
        let (v, bdim) = args[0];
        Ok(Some((cx.b.emit(Prim::Unary(self.clone()), &[v])?, bdim)))
    }
}

impl TensorType {
    pub(crate) fn cast(mut self, dtype: DType) -> TensorType {
        self.dtype = dtype;
        self
    }
}

/// Binary elementwise maps with numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
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
        }
    }
}

impl Rule for Binary {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity(self.name(), args, 2)?;
        let dt = same_dtype(self.name(), args)?;
        Ok(TensorType::new(
            broadcast_shapes(self.name(), &args[0].shape, &args[1].shape)?,
            dt,
        ))
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let (a, b) = (args[0], args[1]);
        let r = match self {
            Binary::Add => a.broadcast_add(b),
            Binary::Sub => a.broadcast_sub(b),
            Binary::Mul => a.broadcast_mul(b),
            Binary::Div => a.broadcast_div(b),
            Binary::Maximum => a.broadcast_maximum(b),
            Binary::Minimum => a.broadcast_minimum(b),
        };
        r.op(self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Binary(*self), args).map(Some)
    }
}

/// Elementwise comparisons, giving a `u8` mask (1 where true).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compare {
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

impl Rule for Compare {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity(self.name(), args, 2)?;
        same_dtype(self.name(), args)?;
        let shape = broadcast_shapes(self.name(), &args[0].shape, &args[1].shape)?;
        Ok(TensorType::new(shape, DType::U8))
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let (a, b) = (args[0], args[1]);
        let r = match self {
            Compare::Eq => a.broadcast_eq(b),
            Compare::Ne => a.broadcast_ne(b),
            Compare::Lt => a.broadcast_lt(b),
            Compare::Le => a.broadcast_le(b),
            Compare::Gt => a.broadcast_gt(b),
            Compare::Ge => a.broadcast_ge(b),
        };
        r.op(self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Compare(*self), args).map(Some)
    }
}

/// `where(mask, on_true, on_false)`, all three broadcast together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Where;

impl Rule for Where {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("where", args, 3)?;
        let dt = same_dtype("where", &args[1..])?;
        if !matches!(args[0].dtype, DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::DType {
                op: "where",
                dtypes: vec![args[0].dtype],
                msg: "the mask must be an integer tensor (a comparison's u8 result)".into(),
            });
        }
        let s = broadcast_shapes("where", &args[0].shape, &args[1].shape)?;
        Ok(TensorType::new(broadcast_shapes("where", &s, &args[2].shape)?, dt))
    }

    fn run(&self, args: &[&Tensor], out: &TensorType) -> Result<Tensor> {
        let shape = out.shape.as_slice();
        let m = args[0].broadcast_as(shape).op("where")?;
        let t = args[1].broadcast_as(shape).op("where")?;
        let f = args[2].broadcast_as(shape).op("where")?;
        m.where_cond(&t, &f).op("where")
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Where, args).map(Some)
    }
}

/// The batching rule of every broadcasting elementwise primitive: batched
/// operands get their batch axis first and unit axes up to the largest
/// per-example rank (`B x.. -> B 1.. x..`); unbatched operands broadcast
/// against them unchanged, right-aligned.
fn batch_broadcasting(cx: &mut BatchCx, prim: Prim, args: &[BVal]) -> Result<BVal> {
    let rank = args.iter().map(|&a| cx.logical_rank(a)).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(args.len());
    for &a in args {
        ids.push(match a.1 {
            Some(_) => cx.front_padded(a, rank)?,
            None => a.0,
        });
    }
    Ok((cx.b.emit(prim, &ids)?, Some(0)))
}
