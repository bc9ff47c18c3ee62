//! Broadcasting binary maps: arithmetic, powers, extrema; integer maps
//! kept exact, NaN propagated as PyTorch does.

use super::{batch_broadcasting, is_float};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Binary, Compare, Unary};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::zip::{zip, Arith};
use crate::kernels::{compare, fastmath, scale, Path};
use crate::rules::facts::{bytes, Arg, Facts, Workspace};
use crate::rules::{arity, broadcast_shapes, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use candle_core::{DType, Tensor};

impl Rule for Binary {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity(self.name(), args, 2)?;
        let dt = same_dtype(self.name(), args)?;
        Ok(TensorType::new(
            broadcast_shapes(self.name(), &args[0].shape, &args[1].shape)?,
            dt,
        ))
    }

    fn facts(&self, _args: &[Arg], out: &TensorType) -> Facts {
        Facts {
            // zero divisors in the measurement's data are an error
            measurable: *self != Binary::Div || out.dtype.is_float(),
            ..Facts::cheap_map()
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        let (a, b) = (args[0], args[1]);
        match self {
            // integer arithmetic through the host: both operands broadcast
            // and copied, and the values
            _ if !is_float(out.dtype) => Workspace::scratch(3 * bytes(out)),
            // the fused gradient kernels read contiguous operands
            Binary::ReluGrad | Binary::GeluGrad => Workspace::copies(a.copy_if_strided() + b.copy_if_strided()),
            // a factor per row: the scaled operand is made contiguous
            Binary::Mul if a.ty.shape == out.shape || b.ty.shape == out.shape => {
                Workspace::copies(a.copy_if_strided().max(b.copy_if_strided()))
            }
            _ => Workspace::NONE,
        }
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let (a, b) = (args[0], args[1]);
        // same-shape float arithmetic on rayon's pool (`kernels::zip`)
        if let Some(op) = arith(*self) {
            if let Some(t) = zip(a, b, op, cx.path).op(self.name())? {
                return Ok(t);
            }
        }
        let r = match self {
            // Integer arithmetic wraps, as PyTorch's does (candle's panics
            // on overflow in debug builds, and `i64::MIN / -1` always).
            Binary::Add | Binary::Sub | Binary::Mul | Binary::Div if !is_float(b.dtype()) => {
                if *self == Binary::Div {
                    no_zero_divisor(b)?;
                }
                return int_zip(*self, a, b, &_out.shape).op(self.name());
            }
            Binary::Add => a.broadcast_add(b),
            Binary::Sub => a.broadcast_sub(b),
            Binary::Mul => {
                // A factor per row (the DP step's reweighting), either side.
                if let Some(t) = scale::scale_rows(a, b, cx.path).op("mul")? {
                    return Ok(t);
                }
                if let Some(t) = scale::scale_rows(b, a, cx.path).op("mul")? {
                    return Ok(t);
                }
                a.broadcast_mul(b)
            }
            Binary::Div => a.broadcast_div(b),
            Binary::Maximum => return keep_nan(a.broadcast_maximum(b).op("maximum")?, a, b),
            Binary::Minimum => return keep_nan(a.broadcast_minimum(b).op("minimum")?, a, b),
            Binary::ReluGrad => return relu_grad(a, b, &_out.shape, cx.path),
            Binary::GeluGrad => return gelu_grad(a, b, &_out.shape, cx.path),
        };
        r.op(self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Binary(*self), args).map(Some)
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let (x, y) = (args[0], args[1]);
        let (gx, gy) = binary_vjp(*self, b, x, y, out, ct)?;
        let (sx, sy) = (b.dims(x), b.dims(y));
        Ok(Some(vec![Some(b.sum_to(gx, &sx)?), Some(b.sum_to(gy, &sy)?)]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        // `df/dx tx + df/dy ty` at the broadcast shape: each partial is the
        // VJP's (elementwise) with that tangent as the cotangent
        let (x, y) = (args[0], args[1]);
        let shape = b.dims(out);
        let mut sum: Tan = None;
        for (i, t) in tans.iter().enumerate() {
            let Some(t) = *t else { continue };
            let t = if b.dims(t) == shape {
                t
            } else {
                b.broadcast(t, shape.clone())?
            };
            let (gx, gy) = binary_vjp(*self, b, x, y, out, t)?;
            let term = if i == 0 { gx } else { gy };
            sum = Some(match sum {
                None => term,
                Some(s) => b.bin(Binary::Add, s, term)?,
            });
        }
        Ok(Some(sum))
    }
}

/// `f` of every element of an integer tensor (through the host: these
/// are rare operations on small tensors such as labels).
pub(super) fn int_map(
    x: &Tensor,
    f8: fn(u8) -> u8,
    f32: fn(u32) -> u32,
    f64: fn(i64) -> i64,
) -> candle_core::Result<Tensor> {
    let flat = x.flatten_all()?;
    let y = match x.dtype() {
        DType::U8 => Tensor::new(
            flat.to_vec1::<u8>()?.into_iter().map(f8).collect::<Vec<_>>(),
            x.device(),
        )?,
        DType::U32 => Tensor::new(
            flat.to_vec1::<u32>()?.into_iter().map(f32).collect::<Vec<_>>(),
            x.device(),
        )?,
        DType::I64 => Tensor::new(
            flat.to_vec1::<i64>()?.into_iter().map(f64).collect::<Vec<_>>(),
            x.device(),
        )?,
        dt => return Err(candle_core::Error::UnsupportedDTypeForOp(dt, "integer map")),
    };
    y.reshape(x.shape())
}

/// `a op b` of integer tensors broadcast to `shape`, wrapping (through the
/// host, as `int_map`).
fn int_zip(op: Binary, a: &Tensor, b: &Tensor, shape: &[usize]) -> candle_core::Result<Tensor> {
    fn zip<T: candle_core::WithDType>(a: &Tensor, b: &Tensor, f: impl Fn(T, T) -> T) -> candle_core::Result<Vec<T>> {
        let (x, y) = (a.flatten_all()?.to_vec1::<T>()?, b.flatten_all()?.to_vec1::<T>()?);
        Ok(x.into_iter().zip(y).map(|(x, y)| f(x, y)).collect())
    }
    let (a, b) = (
        a.broadcast_as(shape)?.contiguous()?,
        b.broadcast_as(shape)?.contiguous()?,
    );
    macro_rules! wrapping {
        ($t:ty) => {
            zip::<$t>(
                &a,
                &b,
                match op {
                    Binary::Add => <$t>::wrapping_add,
                    Binary::Sub => <$t>::wrapping_sub,
                    Binary::Mul => <$t>::wrapping_mul,
                    _ => <$t>::wrapping_div,
                },
            )
        };
    }
    let dev = a.device();
    let y = match a.dtype() {
        DType::U8 => Tensor::new(wrapping!(u8)?, dev)?,
        DType::U32 => Tensor::new(wrapping!(u32)?, dev)?,
        DType::I64 => Tensor::new(wrapping!(i64)?, dev)?,
        dt => return Err(candle_core::Error::UnsupportedDTypeForOp(dt, "integer arithmetic")),
    };
    y.reshape(shape)
}

/// Integer division by zero is an error, as in PyTorch (candle panics).
fn no_zero_divisor(b: &Tensor) -> Result<()> {
    let zeros = b
        .eq(&b.zeros_like().op("div")?)
        .and_then(|z| z.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>())
        .op("div")?;
    if zeros > 0 {
        return Err(Error::DType {
            op: "div",
            dtypes: vec![b.dtype()],
            msg: format!(
                "integer division by zero ({zeros} zero divisors in a {:?} divisor)",
                b.dims()
            ),
        });
    }
    Ok(())
}

/// The arithmetic `kernels::zip` runs, if `op` is one.
fn arith(op: Binary) -> Option<Arith> {
    match op {
        Binary::Add => Some(Arith::Add),
        Binary::Sub => Some(Arith::Sub),
        Binary::Mul => Some(Arith::Mul),
        Binary::Div => Some(Arith::Div),
        _ => None,
    }
}

/// `r` (a maximum or minimum of `a` and `b`) with NaN wherever either
/// operand is NaN, as PyTorch's `maximum`/`minimum` (candle's keep the
/// other operand when the first is not NaN).
fn keep_nan(r: Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !is_float(r.dtype()) {
        return Ok(r);
    }
    let shape = r.dims().to_vec();
    let pick = |r: Tensor, x: &Tensor| -> candle_core::Result<Tensor> {
        let x = x.broadcast_as(shape.as_slice())?;
        x.ne(&x)?.where_cond(&x, &r)
    };
    pick(r, b).and_then(|r| pick(r, a)).op("maximum/minimum NaN")
}

/// Cotangents of both operands at the broadcast shape (summed back to each
/// operand's shape by the caller).
fn binary_vjp(op: Binary, b: &mut Builder, x: VarId, y: VarId, out: VarId, ct: VarId) -> Result<(VarId, VarId)> {
    use Binary::*;
    Ok(match op {
        Add => (ct, ct),
        Sub => (ct, b.un(Unary::Neg, ct)?),
        Mul => (b.bin(Mul, ct, y)?, b.bin(Mul, ct, x)?),
        Div => {
            let gx = b.bin(Div, ct, y)?;
            let q = b.bin(Div, out, y)?;
            let gy = b.bin(Mul, ct, q)?;
            (gx, b.un(Unary::Neg, gy)?)
        }
        // Ties split the cotangent evenly, as PyTorch does; where either
        // is NaN (no ordering) both take it, as PyTorch's do too.
        Maximum => (
            extremum_share(b, Compare::Lt, x, y, ct)?,
            extremum_share(b, Compare::Lt, y, x, ct)?,
        ),
        Minimum => (
            extremum_share(b, Compare::Gt, x, y, ct)?,
            extremum_share(b, Compare::Gt, y, x, ct)?,
        ),
        // ct gelu'(x): d/dx is ct gelu''(x) = ct φ(x) (2 - x^2); linear in ct
        GeluGrad => {
            let x2 = b.un(Unary::Sqr, x)?;
            let e = b.un(Unary::Affine(-0.5, 0.0), x2)?;
            let e = b.un(Unary::Exp, e)?;
            let pdf = b.un(Unary::Affine(1.0 / (2.0 * std::f64::consts::PI).sqrt(), 0.0), e)?;
            let two_minus = b.un(Unary::Affine(-1.0, 2.0), x2)?;
            let g2 = b.bin(Mul, pdf, two_minus)?;
            let cy = b.bin(Mul, ct, y)?;
            (b.bin(Mul, cy, g2)?, b.bin(GeluGrad, x, ct)?)
        }
        // Piecewise constant in x; linear in the cotangent it masks.
        ReluGrad => {
            let shape = b.dims(out);
            let dt = b.ty(out).dtype;
            (b.zeros(shape, dt)?, b.bin(ReluGrad, x, ct)?)
        }
    })
}

/// `ct` where `x > 0` (or NaN, as PyTorch), else 0, at the broadcast
/// shape `shape`: one pass on the CPU, a comparison and a select elsewhere.
fn relu_grad(x: &Tensor, ct: &Tensor, shape: &[usize], path: Path) -> Result<Tensor> {
    let op = "relu_grad";
    let (x, ct) = (x.broadcast_as(shape).op(op)?, ct.broadcast_as(shape).op(op)?);
    if let Some(t) = compare::relu_grad(&x, &ct, path).op(op)? {
        return Ok(t);
    }
    let zero = Tensor::zeros(shape, ct.dtype(), ct.device()).op(op)?;
    let off = x.le(&Tensor::zeros(shape, x.dtype(), x.device()).op(op)?).op(op)?;
    off.where_cond(&zero, &ct).op(op)
}

/// `ct gelu'(x)` at the broadcast shape `shape`: one pass for CPU f32,
/// candle's operations elsewhere (`Φ(x) + x φ(x)`).
fn gelu_grad(x: &Tensor, ct: &Tensor, shape: &[usize], path: Path) -> Result<Tensor> {
    let op = "gelu_grad";
    let (x, ct) = (x.broadcast_as(shape).op(op)?, ct.broadcast_as(shape).op(op)?);
    if let Some(t) = fastmath::gelu_grad_of(&x, &ct, path).op(op)? {
        return Ok(t);
    }
    let slow = || -> candle_core::Result<Tensor> {
        let cdf = ((x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()? + 1.0)? * 0.5)?;
        let pdf = (x.sqr()?.affine(-0.5, 0.0)?.exp()? * (1.0 / (2.0 * std::f64::consts::PI).sqrt()))?;
        (cdf + (x.mul(&pdf))?)?.mul(&ct)
    };
    slow().op(op)
}

/// `ct` unless `x` loses the comparison against `y` (then 0), `ct / 2`
/// where they tie.
fn extremum_share(b: &mut Builder, loses: Compare, x: VarId, y: VarId, ct: VarId) -> Result<VarId> {
    let zero = b.scalar_as(0.0, ct);
    let half = b.un(Unary::Affine(0.5, 0.0), ct)?;
    let tie = b.cmp(Compare::Eq, x, y)?;
    let lose = b.cmp(loses, x, y)?;
    let tied = b.select(tie, half, ct)?;
    b.select(lose, zero, tied)
}
