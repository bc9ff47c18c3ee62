//! Reductions over axes, and (log-)softmax along one axis.

use super::facts::{Arg, Facts, Workspace};
use super::{arity, in_f32, in_f32_workspace, multilinear_jvp, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Binary, Compare, Reduce, Unary};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::{is_half, softmax};
use candle_core::{DType, Tensor};

impl Reduce {
    /// Whether it runs in f32 on an operand of `dt` ([`super::in_f32`]):
    /// a sum or a (log-)softmax of half precision, which accumulate (summed
    /// in bf16, 49,152 ones make 256 and a 49,152-way cross-entropy of
    /// equal logits 5.53 instead of ln 49152 = 10.80). A maximum or an
    /// argmax is exact in any dtype.
    fn in_f32(&self, dt: DType) -> bool {
        let accumulates = matches!(self, Reduce::Sum { .. } | Reduce::Softmax(_) | Reduce::LogSoftmax(_));
        accumulates && is_half(dt)
    }

    /// The same reduction on a tensor with `n` extra leading axes.
    fn shifted(&self, n: usize) -> Reduce {
        let sh = |axes: &Vec<usize>| axes.iter().map(|a| a + n).collect();
        match self {
            Reduce::Sum { axes, keepdim } => Reduce::Sum {
                axes: sh(axes),
                keepdim: *keepdim,
            },
            Reduce::Max { axes, keepdim } => Reduce::Max {
                axes: sh(axes),
                keepdim: *keepdim,
            },
            Reduce::Softmax(a) => Reduce::Softmax(a + n),
            Reduce::LogSoftmax(a) => Reduce::LogSoftmax(a + n),
            Reduce::Arg { axis, keepdim, min } => Reduce::Arg {
                axis: axis + n,
                keepdim: *keepdim,
                min: *min,
            },
        }
    }
}

fn check_axes(op: &'static str, shape: &[usize], axes: &[usize]) -> Result<()> {
    for (i, &a) in axes.iter().enumerate() {
        if a >= shape.len() || axes[..i].contains(&a) {
            return Err(Error::shape(op, &[shape], format!("bad reduction axes {axes:?}")));
        }
    }
    Ok(())
}

fn reduced_shape(shape: &[usize], axes: &[usize], keepdim: bool) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, &d) in shape.iter().enumerate() {
        if !axes.contains(&i) {
            out.push(d);
        } else if keepdim {
            out.push(1);
        }
    }
    out
}

/// Sums `x` over `axes` (result keeps them as unit axes or drops them; the
/// caller reshapes). candle reduces fast only over the last axis: over any
/// other it walks strided indices, 30-70x slower (a per-channel bias
/// gradient, `[0, 2, 3]` of `[64, 64, 24, 24]`, took 31 ms instead of
/// 0.5 ms). So runs of adjacent reduced (R) or kept (K) axes are merged, a
/// trailing R run is a last-axis sum, and an R run before a K run is a
/// product with a row of ones, which GEMM does at full speed.
/// Where `x` attains its maximum `out` over `axes` (1 there, else 0, in
/// `x`'s dtype) and how many positions do, per reduced window (kept axes):
/// a max's derivative shares its (co)tangent evenly among them.
fn attained(b: &mut Builder, x: VarId, out: VarId, axes: &[usize]) -> Result<(VarId, VarId)> {
    let xs = b.dims(x);
    let o = b.reshape(out, reduced_shape(&xs, axes, true))?;
    let o = b.broadcast(o, xs)?;
    let hit = b.cmp(Compare::Eq, x, o)?;
    let hit = b.un(Unary::Cast(b.ty(x).dtype), hit)?;
    let count = b.sum_axes(hit, axes.to_vec(), true)?;
    Ok((hit, count))
}

/// `s * (v - sum(s * v))` along `axis` for the softmax `s`: its Jacobian
/// (symmetric) times `v`, so both its VJP and its JVP.
fn softmax_product(b: &mut Builder, s: VarId, v: VarId, axis: usize) -> Result<VarId> {
    let sv = b.bin(Binary::Mul, s, v)?;
    let sum = b.sum_axes(sv, vec![axis], true)?;
    let d = b.bin(Binary::Sub, v, sum)?;
    b.bin(Binary::Mul, s, d)
}

/// `y` (the maximum of `x` over `axes`, kept) with NaN where the reduced
/// values hold one, as PyTorch's `amax` (candle's skips NaN).
fn nan_where_any(x: &Tensor, y: Tensor, axes: &[usize]) -> candle_core::Result<Tensor> {
    let nans = sum_axes(&x.ne(x)?.to_dtype(x.dtype())?, axes)?.reshape(y.shape())?;
    // filled where it lives (no upload from the host)
    let nan = Tensor::full(f64::NAN, (), x.device())?
        .to_dtype(x.dtype())?
        .broadcast_as(y.shape())?;
    nans.gt(&nans.zeros_like()?)?.where_cond(&nan, &y)
}

/// The wrapping sum of an integer tensor over `axes`, shaped `out` (through
/// the host: candle's integer sums panic on overflow in debug builds).
fn int_sum(x: &Tensor, axes: &[usize], out: &[usize]) -> candle_core::Result<Tensor> {
    // kept axes first, reduced ones last: each output is one run
    let mut order: Vec<usize> = (0..x.rank()).filter(|a| !axes.contains(a)).collect();
    order.extend(axes.iter().copied());
    let run: usize = axes.iter().map(|&a| x.dims()[a]).product();
    let flat = x.permute(order)?.contiguous()?.flatten_all()?;
    fn sums<T: candle_core::WithDType>(v: Vec<T>, run: usize, add: fn(T, T) -> T) -> Vec<T> {
        if run == 0 {
            return Vec::new();
        }
        v.chunks(run).map(|c| c.iter().copied().fold(T::zero(), add)).collect()
    }
    let n: usize = out.iter().product();
    let dev = x.device();
    let y = match x.dtype() {
        DType::U8 => Tensor::new(sums(flat.to_vec1::<u8>()?, run, u8::wrapping_add), dev)?,
        DType::U32 => Tensor::new(sums(flat.to_vec1::<u32>()?, run, u32::wrapping_add), dev)?,
        DType::I64 => Tensor::new(sums(flat.to_vec1::<i64>()?, run, i64::wrapping_add), dev)?,
        dt => return Err(candle_core::Error::UnsupportedDTypeForOp(dt, "integer sum")),
    };
    if run == 0 {
        // a sum over an empty axis: zeros
        return Tensor::zeros(out, x.dtype(), dev);
    }
    debug_assert_eq!(y.elem_count(), n);
    y.reshape(out)
}

pub(crate) fn sum_axes(x: &Tensor, axes: &[usize]) -> candle_core::Result<Tensor> {
    let fast_dtype = x.dtype().is_float();
    if x.elem_count() == 0 || !fast_dtype {
        return x.sum_keepdim(axes.to_vec());
    }
    // (reduced, merged size) per run; unit axes join any run.
    let mut runs: Vec<(bool, usize)> = Vec::new();
    for (i, &d) in x.dims().iter().enumerate() {
        let r = axes.contains(&i);
        match runs.last_mut() {
            _ if d == 1 => {}
            Some((last, size)) if *last == r => *size *= d,
            _ => runs.push((r, d)),
        }
    }
    let sizes: Vec<usize> = runs.iter().map(|r| r.1).collect();
    let mut y = x.contiguous()?.reshape(sizes)?;
    // .. K R -> .. K
    if let Some(&(true, _)) = runs.last() {
        y = y.sum(y.rank() - 1)?;
        runs.pop();
    }
    let ones = |shape: &[usize]| Tensor::ones(shape, y.dtype(), y.device());
    match runs.as_slice() {
        [] | [(false, _)] => Ok(y),
        // R K -> 1 K: [1, R] @ [R, K]
        &[(true, r), (false, _)] => ones(&[1, r])?.matmul(&y),
        // K R K -> K 1 K: [K, 1, R] @ [K, R, K]
        &[(false, o), (true, r), (false, _)] => ones(&[o, 1, r])?.matmul(&y),
        _ => {
            let left: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].0).collect();
            y.sum_keepdim(left)
        }
    }
}

/// The first index of the maximum (or minimum) along `axis`, kept with
/// size 1; where the values hold a NaN, the first NaN's (PyTorch's rule;
/// candle's comparisons pass NaN over).
fn arg_extreme(x: &Tensor, axis: usize, min: bool) -> Result<Tensor> {
    let op = if min { "argmin" } else { "argmax" };
    let idx = if min {
        x.argmin_keepdim(axis)
    } else {
        x.argmax_keepdim(axis)
    }
    .op(op)?;
    if !x.dtype().is_float() {
        return Ok(idx);
    }
    let nan = x.ne(x).and_then(|m| m.to_dtype(DType::F32)).op(op)?;
    let any = nan.max_keepdim(axis).op(op)?;
    let first = nan.argmax_keepdim(axis).op(op)?;
    any.gt(&any.zeros_like().op(op)?)
        .and_then(|has| has.where_cond(&first, &idx))
        .op(op)
}

impl Rule for Reduce {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("reduce", args, 1)?;
        let x = args[0];
        match self {
            Reduce::Sum { axes, keepdim } | Reduce::Max { axes, keepdim } => {
                check_axes("reduce", &x.shape, axes)?;
                if matches!(self, Reduce::Max { .. }) && axes.iter().any(|&a| x.shape[a] == 0) {
                    // as PyTorch: a maximum of nothing has no value
                    return Err(Error::shape(
                        "max",
                        &[&x.shape],
                        format!("cannot reduce an empty axis among {axes:?}"),
                    ));
                }
                Ok(x.with_shape(reduced_shape(&x.shape, axes, *keepdim)))
            }
            Reduce::Softmax(a) | Reduce::LogSoftmax(a) => {
                check_axes("softmax", &x.shape, &[*a])?;
                if !x.dtype.is_float() {
                    return Err(Error::DType {
                        op: "softmax",
                        dtypes: vec![x.dtype],
                        msg: format!("{} needs a floating-point operand", self.name()),
                    });
                }
                Ok(x.clone())
            }
            Reduce::Arg { axis, keepdim, .. } => {
                check_axes("argmax", &x.shape, &[*axis])?;
                if x.shape[*axis] == 0 {
                    return Err(Error::shape(
                        "argmax",
                        &[&x.shape],
                        format!("no index of an extreme along the empty axis {axis}"),
                    ));
                }
                Ok(TensorType::new(reduced_shape(&x.shape, &[*axis], *keepdim), DType::U32))
            }
        }
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts::costly()
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        let x = args[0];
        if self.in_f32(x.ty.dtype) {
            return in_f32_workspace(args, out, |a, o| self.workspace(a, o));
        }
        let float = x.ty.dtype.is_float();
        match self {
            // axes merged over a contiguous copy; integers through the host
            Reduce::Sum { .. } if float => Workspace::copies(x.copy_if_strided()),
            Reduce::Sum { .. } => Workspace::scratch(2 * x.bytes()),
            // one axis at a time, and the NaN mask
            Reduce::Max { .. } => Workspace::scratch(x.bytes()),
            Reduce::Softmax(a) if *a + 1 == x.ty.rank() => Workspace::copies(x.copy_if_strided()),
            // candle's: the maxima, the exponentials and their sums
            Reduce::Softmax(_) | Reduce::LogSoftmax(_) => Workspace::scratch(2 * x.bytes()),
            // the NaN mask as f32 and as u8
            Reduce::Arg { .. } => Workspace::scratch(5 * x.ty.elem_count()),
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let x = args[0];
        let op = self.name();
        // half-precision softmax rows in f32 a block at a time: the numbers
        // of the widened run below without its whole f32 copies
        let last = |a: usize| a + 1 == x.rank() && x.elem_count() > 0 && self.in_f32(x.dtype());
        let direct = match self {
            Reduce::Softmax(a) if last(*a) => softmax::softmax_last_dim(x, cx.path).op(&op)?,
            Reduce::LogSoftmax(a) if last(*a) => softmax::log_softmax_last_dim(x, cx.path).op(&op)?,
            _ => None,
        };
        if let Some(y) = direct {
            return Ok(y);
        }
        if self.in_f32(x.dtype()) {
            return in_f32(&op, args, out, cx.path, |a, o| self.run(a, o, cx));
        }
        match self {
            Reduce::Sum { axes, .. } if axes.is_empty() => Ok(x.clone()),
            Reduce::Sum { axes, .. } if !x.dtype().is_float() => int_sum(x, axes, &out.shape).op(&op),
            Reduce::Sum { axes, .. } => sum_axes(x, axes).op(&op)?.reshape(out.shape.as_slice()).op(&op),
            Reduce::Max { axes, .. } => {
                let mut y = x.clone();
                for &a in axes {
                    y = y.max_keepdim(a).op(&op)?;
                }
                if x.dtype().is_float() && !axes.is_empty() {
                    y = nan_where_any(x, y, axes).op(&op)?;
                }
                y.reshape(out.shape.as_slice()).op(&op)
            }
            // nothing to normalise (candle's softmax kernels panic on it)
            Reduce::Softmax(_) | Reduce::LogSoftmax(_) if x.elem_count() == 0 => Ok(x.clone()),
            Reduce::Softmax(a) if *a + 1 == x.rank() => match softmax::softmax_last_dim(x, cx.path).op(&op)? {
                Some(y) => Ok(y),
                None => candle_nn::ops::softmax_last_dim(&x.contiguous().op(&op)?).op(&op),
            },
            Reduce::Softmax(a) => candle_nn::ops::softmax(x, *a).op(&op),
            Reduce::LogSoftmax(a) if *a + 1 == x.rank() => match softmax::log_softmax_last_dim(x, cx.path).op(&op)? {
                Some(y) => Ok(y),
                None => candle_nn::ops::log_softmax(x, *a).op(&op),
            },
            Reduce::LogSoftmax(a) => candle_nn::ops::log_softmax(x, *a).op(&op),
            Reduce::Arg { axis, min, .. } => arg_extreme(x, *axis, *min)?.reshape(out.shape.as_slice()).op(&op),
        }
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // B x.. -> reduce the shifted axes; the batch axis stays first.
        let x = cx.front(args[0])?;
        Ok(Some((cx.b.emit(Prim::Reduce(self.shifted(1)), &[x])?, Some(0))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let x = args[0];
        let xs = b.dims(x);
        let g = match self {
            // The cotangent of a sum spreads over the reduced axes.
            Reduce::Sum { axes, .. } => {
                let c = b.reshape(ct, reduced_shape(&xs, axes, true))?;
                b.broadcast(c, xs)?
            }
            // ...of a max, evenly over the positions that attain it.
            Reduce::Max { axes, .. } => {
                let (hit, count) = attained(b, x, out, axes)?;
                let c = b.reshape(ct, reduced_shape(&xs, axes, true))?;
                let share = b.bin(Binary::Div, c, count)?;
                b.bin(Binary::Mul, hit, share)?
            }
            Reduce::Softmax(a) => softmax_product(b, out, ct, *a)?,
            // no cotangent reaches an integer result (a cast of it passes
            // none back); reaching here is a transform's bug
            Reduce::Arg { .. } => {
                return Err(Error::unsupported(
                    self.name(),
                    "grad",
                    "an index has no derivative (its result is an integer)",
                ))
            }
            // ct - exp(out) * sum(ct)
            Reduce::LogSoftmax(a) => {
                let s = b.sum_axes(ct, vec![*a], true)?;
                let e = b.un(Unary::Exp, out)?;
                let es = b.bin(Binary::Mul, e, s)?;
                b.bin(Binary::Sub, ct, es)?
            }
        };
        Ok(Some(vec![Some(g)]))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], out: VarId) -> Result<Option<Tan>> {
        let Some(t) = tans[0] else { return Ok(Some(None)) };
        let x = args[0];
        let tan = match self {
            // an integer result: no tangent
            Reduce::Arg { .. } => return Ok(Some(None)),
            // linear
            Reduce::Sum { .. } => return multilinear_jvp(b, &Prim::Reduce(self.clone()), args, tans, &[0]).map(Some),
            // the tangent at the positions that attain the max, shared evenly
            Reduce::Max { axes, .. } => {
                let (hit, count) = attained(b, x, out, axes)?;
                let ht = b.bin(Binary::Mul, hit, t)?;
                let num = b.sum_axes(ht, axes.clone(), true)?;
                let share = b.bin(Binary::Div, num, count)?;
                b.reshape(share, b.dims(out))?
            }
            // softmax's Jacobian is symmetric: the VJP's product
            Reduce::Softmax(a) => softmax_product(b, out, t, *a)?,
            // t - sum(exp(out) * t)
            Reduce::LogSoftmax(a) => {
                let e = b.un(Unary::Exp, out)?;
                let et = b.bin(Binary::Mul, e, t)?;
                let s = b.sum_axes(et, vec![*a], true)?;
                b.bin(Binary::Sub, t, s)?
            }
        };
        Ok(Some(Some(tan)))
    }
}

#[cfg(test)]
mod tests {
    use super::sum_axes;
    use candle_core::{DType, Device, Tensor};

    /// Every subset of axes of a rank-4 tensor with a unit axis, against
    /// candle's own sum, f32 and an integer dtype (the generic path).
    #[test]
    fn sum_axes_matches_candle() -> candle_core::Result<()> {
        let x = Tensor::randn(0f32, 1., (3, 1, 4, 5), &Device::Cpu)?;
        for dt in [DType::F32, DType::F64, DType::I64] {
            let x = (x.clone() * 10.)?.to_dtype(dt)?;
            for mask in 0u32..16 {
                let axes: Vec<usize> = (0..4).filter(|a| mask & (1 << a) != 0).collect();
                let want = x.sum_keepdim(axes.clone())?;
                let got = sum_axes(&x, &axes)?.reshape(want.shape())?;
                let diff = (got - &want)?.abs()?.flatten_all()?.to_dtype(DType::F64)?.max(0)?;
                assert!(diff.to_scalar::<f64>()? < 1e-3, "axes {axes:?} {dt:?}");
            }
        }
        let empty = Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?;
        assert_eq!(sum_axes(&empty, &[0])?.dims(), &[1, 3]);
        Ok(())
    }
}
