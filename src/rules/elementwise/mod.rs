//! Elementwise primitives: unary maps, casts, broadcasting binary maps,
//! comparisons and `where`.

use super::facts::{bytes, Arg, Facts, Workspace};
use super::{arity, in_f32, in_f32_workspace, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Binary, Compare, Unary};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::{compare, fastmath, is_half, Path};
use candle_core::{DType, Tensor};

mod binary;
mod select;
use binary::int_map;
pub use select::Where;

pub(super) fn is_float(dt: DType) -> bool {
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
pub(super) fn sign(b: &mut Builder, x: VarId) -> Result<VarId> {
    let (zero, one, minus) = (b.scalar_as(0.0, x), b.scalar_as(1.0, x), b.scalar_as(-1.0, x));
    let pos = b.cmp(Compare::Gt, x, zero)?;
    let neg = b.cmp(Compare::Lt, x, zero)?;
    let inner = b.select(neg, minus, zero)?;
    b.select(pos, one, inner)
}

/// The batching rule of every broadcasting elementwise primitive: batched
/// operands get their batch axis first and unit axes up to the largest
/// per-example rank (`B x.. -> B 1.. x..`); unbatched operands broadcast
/// against them unchanged, right-aligned.
pub(super) fn batch_broadcasting(cx: &mut BatchCx, prim: Prim, args: &[BVal]) -> Result<BVal> {
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
            graphs: &crate::rules::NoGraphs,
        };
        let ty = TensorType::new(vec![1, 4], DType::F32);
        let out = Unary::StopGradient.run(&[&row], &ty, &cx)?;
        assert_eq!(out.layout().start_offset(), 0, "a view into a copy of the whole table");
        assert!(out.is_contiguous());
        assert_eq!(out.to_vec2::<f32>()?, row.to_vec2::<f32>()?);
        Ok(())
    }
}
