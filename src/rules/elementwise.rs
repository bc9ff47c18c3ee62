//! Elementwise primitives: unary maps, casts, broadcasting binary maps,
//! comparisons and `where`.

use super::facts::{bytes, Arg, Facts, Workspace};
use super::{
    arity, broadcast_shapes, in_f32, in_f32_workspace, same_dtype, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan,
};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Binary, Compare, Unary};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::zip::{zip, Arith};
use crate::kernels::{compare, fastmath, is_half, scale, Path};
use candle_core::{DType, Tensor};

fn is_float(dt: DType) -> bool {
    matches!(dt, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

impl Rule for Unary {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("unary", args, 1)?;
        if let Unary::Cast(dt) = self {
            return Ok(args[0].with_shape(args[0].shape.clone()).cast(*dt));
        }
        let needs_float = !matches!(
            self,
            Unary::Neg | Unary::Abs | Unary::Relu | Unary::Sqr | Unary::StopGradient | Unary::Lengths(_)
        );
        if needs_float && !is_float(args[0].dtype) {
            return Err(Error::DType {
                op: "unary",
                dtypes: vec![args[0].dtype],
                msg: format!("{} needs a floating-point operand", self.name()),
            });
        }
        Ok(args[0].clone())
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        match self {
            // measurement data (normal floats, zero integers) are not
            // lengths: timing a program with this check would fail it
            Unary::Lengths(_) => Facts {
                measurable: false,
                ..Facts::cheap_map()
            },
            _ => Facts::cheap_map(),
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        match self {
            // integer maps go through the host: the values and the result
            Unary::Neg | Unary::Sqr if !is_float(args[0].ty.dtype) => Workspace::scratch(2 * bytes(out)),
            // half precision scaled in f32
            Unary::Affine(..) if is_half(out.dtype) => in_f32_workspace(args, out, |_, _| Workspace::NONE),
            // bf16 widened to f32 for the crate's kernel, its result too
            Unary::Exp | Unary::Tanh | Unary::Erf | Unary::Gelu | Unary::Sigmoid if out.dtype == DType::BF16 => {
                in_f32_workspace(args, out, |_, _| Workspace::NONE)
            }
            // the crate's CPU kernels read a contiguous operand
            Unary::Exp | Unary::Tanh | Unary::Erf | Unary::Gelu | Unary::Sigmoid | Unary::Relu => {
                Workspace::copies(args[0].copy_if_strided())
            }
            _ => Workspace::NONE,
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let x = args[0];
        let r = match self {
            // candle has no integer `neg` or `sqr` (it panics), and its
            // integer arithmetic panics on overflow in debug builds: both
            // wrap, as PyTorch's do
            Unary::Neg if !is_float(x.dtype()) => int_map(x, u8::wrapping_neg, u32::wrapping_neg, i64::wrapping_neg),
            Unary::Sqr if !is_float(x.dtype()) => {
                int_map(x, |v| v.wrapping_mul(v), |v| v.wrapping_mul(v), |v| v.wrapping_mul(v))
            }
            Unary::Neg => x.neg(),
            // f32 on the CPU: one vectorised pass instead of libm per element
            // (bf16 widened to f32 across the threads around it and rounded
            // once, where candle maps bf16 on one thread)
            Unary::Exp | Unary::Tanh | Unary::Erf | Unary::Gelu | Unary::Sigmoid
                if cx.path == Path::Fast && matches!(x.dtype(), DType::F32 | DType::BF16) && x.device().is_cpu() =>
            {
                if x.dtype() == DType::BF16 {
                    return in_f32(&self.name(), args, out, cx.path, |w, o| self.run(w, o, cx));
                }
                let m = match self {
                    Unary::Exp => fastmath::Math::Exp,
                    Unary::Tanh => fastmath::Math::Tanh,
                    Unary::Gelu => fastmath::Math::Gelu,
                    Unary::Sigmoid => fastmath::Math::Sigmoid,
                    _ => fastmath::Math::Erf,
                };
                return fastmath::apply(x, m, cx.path)
                    .op(&self.name())?
                    .ok_or_else(|| Error::unsupported(self.name(), "run", "no fast kernel"));
            }
            Unary::Exp => x.exp(),
            Unary::Log => x.log(),
            Unary::Sqrt => x.sqrt(),
            Unary::Sqr => x.sqr(),
            Unary::Recip => x.recip(),
            Unary::Abs => x.abs(),
            Unary::Relu => match compare::relu(x, cx.path).op("relu")? {
                Some(y) => return Ok(y),
                // `x` unless x <= 0, NaN kept as PyTorch does (candle's
                // relu, `max(x, 0)`, gives 0 for NaN in some dtypes; the
                // VJP's mask reads this output)
                None => {
                    let zero = x.zeros_like().op("relu")?;
                    x.le(&zero).and_then(|off| off.where_cond(&zero, x))
                }
            },
            Unary::Tanh => x.tanh(),
            Unary::Erf => x.erf(),
            Unary::Sigmoid => candle_nn::ops::sigmoid(x),
            Unary::Gelu => x.gelu_erf(),
            Unary::Sin => x.sin(),
            Unary::Cos => x.cos(),
            Unary::Powf(e) => x.powf(*e),
            // in f32 for half precision, rounded once: candle rounds the
            // factor to the dtype first (a mean's 1/49,152 is an f16
            // subnormal, 0.15% off), where PyTorch scales in f32
            Unary::Affine(m, a) if is_half(x.dtype()) => {
                return in_f32("affine", args, out, cx.path, |w, _| Ok(w[0].affine(*m, *a)?));
            }
            Unary::Affine(m, a) => x.affine(*m, *a),
            Unary::Cast(dt) => x.to_dtype(*dt),
            // a copy, not the operand's buffer: every result is fresh to
            // the passes that write into one in place. Of the view alone:
            // candle's `copy` clones the whole storage under a view (a
            // padding row of a 30522-row table copied the table, 47 MB and
            // 23 ms a call, beyond the memory plan)
            Unary::StopGradient => x.force_contiguous(),
            Unary::Lengths(steps) => {
                check_lengths(x, *steps)?;
                x.force_contiguous()
            }
        };
        r.op(&self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // Elementwise: the batch axis stays where it is.
        let (v, bdim) = args[0];
        Ok(Some((cx.b.emit(Prim::Unary(self.clone()), &[v])?, bdim)))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        Ok(Some(vec![unary_vjp(self, b, args[0], out, ct)?]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        let Some(t) = tans[0] else { return Ok(Some(None)) };
        Ok(Some(match self {
            // linear: the tangent cast alike (none into an integer dtype)
            Unary::Cast(dt) if is_float(*dt) => Some(b.un(self.clone(), t)?),
            Unary::Cast(_) => None,
            // elementwise, so the VJP with the tangent as cotangent is
            // `f'(x) t`
            _ => unary_vjp(self, b, args[0], out, t)?,
        }))
    }
}

/// An error naming the first of `lengths` that is not a whole number in
/// `1..=steps` (NaN, fractions, 0 and negatives included), read to the
/// host once (a few numbers a batch).
fn check_lengths(lengths: &Tensor, steps: usize) -> Result<()> {
    const OP: &str = "Recurrent::run";
    let v = lengths
        .flatten_all()
        .and_then(|v| v.to_dtype(DType::F64))
        .and_then(|v| v.to_vec1::<f64>())
        .op(OP)?;
    let bad = v
        .iter()
        .enumerate()
        .find(|(_, &l)| !(l.fract() == 0.0 && l >= 1.0 && l <= steps as f64));
    match bad {
        None => Ok(()),
        Some((i, l)) => {
            let at = if lengths.rank() == 0 {
                String::new()
            } else {
                format!(" of sequence {i}")
            };
            Err(Error::data(
                OP,
                format!("the length {l}{at} is not a whole number in 1..={steps} (the sequences' {steps} steps)"),
            ))
        }
    }
}

/// `d/dx` of each unary map, times the cotangent.
fn unary_vjp(u: &Unary, b: &mut Builder, x: VarId, out: VarId, ct: VarId) -> Result<Option<VarId>> {
    use Binary::{Div, Mul};
    let g = match u {
        // no derivative: nothing flows back (or forward)
        Unary::StopGradient | Unary::Lengths(_) => return Ok(None),
        Unary::Neg => b.un(Unary::Neg, ct)?,
        Unary::Exp => b.bin(Mul, ct, out)?,
        Unary::Log => b.bin(Div, ct, x)?,
        Unary::Sqrt => {
            let two_out = b.un(Unary::Affine(2.0, 0.0), out)?;
            b.bin(Div, ct, two_out)?
        }
        Unary::Sqr => {
            let two_x = b.un(Unary::Affine(2.0, 0.0), x)?;
            b.bin(Mul, ct, two_x)?
        }
        Unary::Recip => {
            let sq = b.un(Unary::Sqr, out)?;
            let g = b.bin(Mul, ct, sq)?;
            b.un(Unary::Neg, g)?
        }
        Unary::Abs => {
            let sign = sign(b, x)?;
            b.bin(Mul, ct, sign)?
        }
        // Masked by the output: relu(x) > 0 exactly where x > 0, and NaN
        // where x is NaN (both forward paths keep NaN), so the mask is the
        // same; the pre-activation then
        // has no reader but the ReLU, which lets it fuse into the product
        // before it (`ir::fuse`) and need not be kept for the backward pass.
        Unary::Relu => b.bin(Binary::ReluGrad, out, ct)?,
        Unary::Tanh => {
            let sq = b.un(Unary::Sqr, out)?;
            let d = b.un(Unary::Affine(-1.0, 1.0), sq)?;
            b.bin(Mul, ct, d)?
        }
        // 2 / sqrt(pi) * exp(-x^2)
        Unary::Erf => {
            let sq = b.un(Unary::Sqr, x)?;
            let e = b.un(Unary::Neg, sq)?;
            let e = b.un(Unary::Exp, e)?;
            let d = b.un(Unary::Affine(std::f64::consts::FRAC_2_SQRT_PI, 0.0), e)?;
            b.bin(Mul, ct, d)?
        }
        Unary::Sigmoid => {
            let one_minus = b.un(Unary::Affine(-1.0, 1.0), out)?;
            let d = b.bin(Mul, out, one_minus)?;
            b.bin(Mul, ct, d)?
        }
        Unary::Gelu => b.bin(Binary::GeluGrad, x, ct)?,
        Unary::Sin => {
            let d = b.un(Unary::Cos, x)?;
            b.bin(Mul, ct, d)?
        }
        Unary::Cos => {
            let d = b.un(Unary::Sin, x)?;
            let g = b.bin(Mul, ct, d)?;
            b.un(Unary::Neg, g)?
        }
        Unary::Powf(e) => {
            let p = b.un(Unary::Powf(e - 1.0), x)?;
            let d = b.un(Unary::Affine(*e, 0.0), p)?;
            b.bin(Mul, ct, d)?
        }
        Unary::Affine(m, _) => b.un(Unary::Affine(*m, 0.0), ct)?,
        Unary::Cast(_) => {
            let dt = b.ty(x).dtype;
            if !is_float(dt) {
                return Ok(None);
            }
            b.un(Unary::Cast(dt), ct)?
        }
    };
    Ok(Some(g))
}

/// `sign(x)` as `1`, `-1` or `0`, in x's dtype.
fn sign(b: &mut Builder, x: VarId) -> Result<VarId> {
    let (zero, one, minus) = (b.scalar_as(0.0, x), b.scalar_as(1.0, x), b.scalar_as(-1.0, x));
    let pos = b.cmp(Compare::Gt, x, zero)?;
    let neg = b.cmp(Compare::Lt, x, zero)?;
    let inner = b.select(neg, minus, zero)?;
    b.select(pos, one, inner)
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
fn int_map(x: &Tensor, f8: fn(u8) -> u8, f32: fn(u32) -> u32, f64: fn(i64) -> i64) -> candle_core::Result<Tensor> {
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

impl Compare {
    /// Which orderings of `a` against `b` make the comparison true.
    fn accept(self) -> compare::Accept {
        let (less, equal, greater) = match self {
            Compare::Eq => (false, true, false),
            Compare::Ne => (true, false, true),
            Compare::Lt => (true, false, false),
            Compare::Le => (true, true, false),
            Compare::Gt => (false, false, true),
            Compare::Ge => (false, true, true),
        };
        compare::Accept {
            unordered: self == Compare::Ne,
            less,
            equal,
            greater,
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

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::cheap_map()
    }

    fn workspace(&self, args: &[Arg], _out: &TensorType) -> Workspace {
        // against a scalar, the CPU kernel reads a contiguous operand
        Workspace::copies(args[0].copy_if_strided())
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let (a, b) = (args[0], args[1]);
        if let Some(m) = compare::with_scalar(a, b, self.accept(), cx.path).op(self.name())? {
            return m.reshape(out.shape.as_slice()).op(self.name());
        }
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

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Ok(Some(vec![None, None]))
    }

    fn jvp(&self, _b: &mut Builder, _args: &[VarId], _tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        Ok(Some(None)) // an integer mask
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

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::cheap_map()
    }

    fn workspace(&self, _args: &[Arg], _out: &TensorType) -> Workspace {
        Workspace::NONE // candle selects through broadcast views in place
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, _cx: &RunCx) -> Result<Tensor> {
        let shape = out.shape.as_slice();
        let m = args[0].broadcast_as(shape).op("where")?;
        let t = args[1].broadcast_as(shape).op("where")?;
        let f = args[2].broadcast_as(shape).op("where")?;
        m.where_cond(&t, &f).op("where")
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch_broadcasting(cx, Prim::Where, args).map(Some)
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let (m, t, f) = (args[0], args[1], args[2]);
        let zero = b.scalar_as(0.0, ct);
        let gt = b.select(m, ct, zero)?;
        let gf = b.select(m, zero, ct)?;
        let (st, sf) = (b.dims(t), b.dims(f));
        Ok(Some(vec![None, Some(b.sum_to(gt, &st)?), Some(b.sum_to(gf, &sf)?)]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        if tans[1].is_none() && tans[2].is_none() {
            return Ok(Some(None));
        }
        let zero = b.scalar_as(0.0, out);
        let (tt, tf) = (tans[1].unwrap_or(zero), tans[2].unwrap_or(zero));
        Ok(Some(Some(b.select(args[0], tt, tf)?)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::copies::Copies;
    use candle_core::Device;

    /// `stop_gradient` of a row of a large table is a fresh buffer of that
    /// row, not a copy of the table under a view.
    #[test]
    fn stop_gradient_copies_its_view_alone() -> Result<()> {
        let table = Tensor::arange(0f32, 4000., &Device::Cpu)?.reshape((1000, 4))?;
        let row = table.narrow(0, 7, 1)?;
        let cx = RunCx {
            device: &Device::Cpu,
            seed: 0,
            copies: &Copies::default(),
            path: Path::Fast,
        };
        let ty = TensorType::new(vec![1, 4], DType::F32);
        let out = Unary::StopGradient.run(&[&row], &ty, &cx)?;
        assert_eq!(out.layout().start_offset(), 0, "a view into a copy of the whole table");
        assert!(out.is_contiguous());
        assert_eq!(out.to_vec2::<f32>()?, row.to_vec2::<f32>()?);
        Ok(())
    }
}
