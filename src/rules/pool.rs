//! 2D pooling over `[N, C, H, W]`, any kernel and stride, no padding, with
//! the gradients as primitives of their own. Max-pooling and its gradients
//! run on `kernels::pool` (candle's own max-pool backward refuses a stride
//! other than the kernel); the average-pooling gradient spreads each
//! window's cotangent over the window's unfolded columns and folds them back.

use super::facts::{Arg, Facts, Workspace};
use super::{arity, in_f32, in_f32_workspace, multilinear_jvp, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{PoolOp, Window};
use crate::ir::{Prim, TensorType, VarId};
use crate::kernels::unfold::{fold, ConvGeom};
use crate::kernels::{pool, Path};
use candle_core::{DType, Tensor};

fn pooled(kind: &'static str, (k, s): Window, x: &[usize]) -> Result<Vec<usize>> {
    let ((kh, kw), (sh, sw)) = (k, s);
    let why = if x.len() != 4 {
        Some(format!("the input must be [N, C, H, W], got rank {}", x.len()))
    } else if kh == 0 || kw == 0 {
        Some(format!("the kernel must be positive, got kernel ({kh}, {kw})"))
    } else if sh == 0 || sw == 0 {
        Some(format!("the stride must be positive, got stride ({sh}, {sw})"))
    } else if x[2] < kh || x[3] < kw {
        Some(format!(
            "the kernel ({kh}, {kw}) is larger than the input's H x W = ({}, {})",
            x[2], x[3]
        ))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(Error::shape(kind, &[x], why));
    }
    Ok(vec![x[0], x[1], (x[2] - kh) / sh + 1, (x[3] - kw) / sw + 1])
}

fn expect_shape(kind: &'static str, got: &[usize], want: &[usize], other: &[usize]) -> Result<()> {
    if got != want {
        return Err(Error::shape(kind, &[other, got], format!("expected shape {want:?}")));
    }
    Ok(())
}

impl PoolOp {
    /// Whether it runs in f32 on values of `dt` ([`super::in_f32`]): an
    /// average (or its gradient) of half precision, whose window sum
    /// accumulates.
    fn in_f32(&self, dt: DType) -> bool {
        matches!(self, PoolOp::AvgPool2d { .. } | PoolOp::AvgPoolGrad { .. }) && crate::kernels::is_half(dt)
    }
}

impl Rule for PoolOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        let (kind, w) = (self.kind(), self.window());
        let x = args.first().map(|t| t.shape.as_slice()).unwrap_or(&[]);
        match self {
            PoolOp::MaxPool2d { .. } | PoolOp::AvgPool2d { .. } => {
                arity(kind, args, 1)?;
                if matches!(self, PoolOp::AvgPool2d { .. }) && !args[0].dtype.is_float() {
                    return Err(Error::DType {
                        op: "avg_pool2d",
                        dtypes: vec![args[0].dtype],
                        msg: "average pooling needs a floating-point operand".into(),
                    });
                }
                Ok(args[0].with_shape(pooled(kind, w, x)?))
            }
            PoolOp::MaxPoolGrad { .. } => {
                arity(kind, args, 2)?;
                expect_shape(kind, &args[1].shape, &pooled(kind, w, x)?, x)?;
                Ok(args[1].with_shape(x.to_vec()))
            }
            PoolOp::MaxPoolSelect { .. } => {
                arity(kind, args, 2)?;
                expect_shape(kind, &args[1].shape, x, x)?;
                Ok(args[1].with_shape(pooled(kind, w, x)?))
            }
            PoolOp::AvgPoolGrad { input, .. } => {
                arity(kind, args, 1)?;
                let full = if x.len() == 4 {
                    vec![x[0], x[1], input.0, input.1]
                } else {
                    vec![]
                };
                expect_shape(kind, x, &pooled(kind, w, &full)?, &full)?;
                Ok(args[0].with_shape(full))
            }
        }
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            // a pooling forward is one pass over its operand
            cheap: matches!(self, PoolOp::MaxPool2d { .. } | PoolOp::AvgPool2d { .. }),
            ..Facts::costly()
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        let copies: usize = args.iter().map(Arg::copy_if_strided).sum();
        if self.in_f32(out.dtype) {
            return in_f32_workspace(args, out, |a, o| self.workspace(a, o));
        }
        match self {
            // each window's share, spread over the window, then folded
            PoolOp::AvgPoolGrad { kernel, .. } => Workspace {
                copies,
                scratch: args[0].bytes().saturating_mul(1 + kernel.0 * kernel.1),
            },
            _ => Workspace::copies(copies),
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let op = self.name();
        if self.in_f32(args[0].dtype()) {
            return in_f32(&op, args, out, cx.path, |a, o| self.run(a, o, cx));
        }
        let w = self.window();
        let p = cx.path;
        let r = match self {
            PoolOp::MaxPool2d { .. } => pool::max_pool2d(args[0], window(w), p),
            PoolOp::AvgPool2d { kernel, stride } => args[0].avg_pool2d_with_stride(*kernel, *stride),
            PoolOp::MaxPoolGrad { .. } => pool::max_pool2d_grad(args[0], args[1], window(w), p),
            PoolOp::MaxPoolSelect { .. } => pool::max_pool2d_select(args[0], args[1], window(w), p),
            PoolOp::AvgPoolGrad { .. } => avg_pool_grad(args[0], w, &out.shape, p),
        };
        r.op(&op)
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // B N C H W -> (B N) C H W -> pool -> B N C H' W'
        let mut ids = Vec::with_capacity(args.len());
        for &a in args {
            let v = cx.materialize(a)?;
            let d = cx.b.dims(v);
            ids.push(cx.b.reshape(v, vec![d[0] * d[1], d[2], d[3], d[4]])?);
        }
        let y = cx.b.emit(Prim::Pool(self.clone()), &ids)?;
        let yd = cx.b.dims(y);
        let y = cx.b.reshape(y, vec![cx.size, yd[0] / cx.size, yd[1], yd[2], yd[3]])?;
        Ok(Some((y, Some(0))))
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        let (kernel, stride) = self.window();
        let pool = |op: PoolOp| Prim::Pool(op);
        let cts = match self {
            PoolOp::MaxPool2d { .. } => {
                vec![Some(
                    b.emit(pool(PoolOp::MaxPoolGrad { kernel, stride }), &[args[0], ct])?,
                )]
            }
            // Piecewise constant in x; linear in the cotangent.
            PoolOp::MaxPoolGrad { .. } => {
                vec![
                    None,
                    Some(b.emit(pool(PoolOp::MaxPoolSelect { kernel, stride }), &[args[0], ct])?),
                ]
            }
            PoolOp::MaxPoolSelect { .. } => {
                vec![
                    None,
                    Some(b.emit(pool(PoolOp::MaxPoolGrad { kernel, stride }), &[args[0], ct])?),
                ]
            }
            PoolOp::AvgPool2d { .. } => {
                let d = b.dims(args[0]);
                let input = (d[2], d[3]);
                vec![Some(
                    b.emit(pool(PoolOp::AvgPoolGrad { kernel, stride, input }), &[ct])?,
                )]
            }
            PoolOp::AvgPoolGrad { .. } => vec![Some(b.emit(pool(PoolOp::AvgPool2d { kernel, stride }), &[ct])?)],
        };
        Ok(Some(cts))
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        let (kernel, stride) = self.window();
        match self {
            // the tangent read at each window's first maximum
            PoolOp::MaxPool2d { .. } => match tans[0] {
                None => Ok(Some(None)),
                Some(t) => {
                    let select = Prim::Pool(PoolOp::MaxPoolSelect { kernel, stride });
                    Ok(Some(Some(b.emit(select, &[args[0], t])?)))
                }
            },
            // piecewise constant in the selecting input, linear in the other
            PoolOp::MaxPoolGrad { .. } | PoolOp::MaxPoolSelect { .. } => {
                multilinear_jvp(b, &Prim::Pool(self.clone()), args, tans, &[1]).map(Some)
            }
            PoolOp::AvgPool2d { .. } | PoolOp::AvgPoolGrad { .. } => {
                multilinear_jvp(b, &Prim::Pool(self.clone()), args, tans, &[0]).map(Some)
            }
        }
    }
}

fn geom(((kh, kw), (sh, sw)): Window) -> ConvGeom {
    ConvGeom {
        kernel: vec![kh, kw],
        stride: vec![sh, sw],
        padding: vec![0, 0],
        dilation: vec![1, 1],
    }
}

fn window((kernel, stride): Window) -> pool::Window {
    pool::Window { kernel, stride }
}

fn avg_pool_grad(ct: &Tensor, w: Window, out: &[usize], path: Path) -> candle_core::Result<Tensor> {
    let (n, c, ho, wo) = ct.dims4()?;
    let kk = w.0 .0 * w.0 .1;
    let share = (ct.contiguous()?.reshape((n * c, 1, ho * wo))? / kk as f64)?;
    let cols = share.broadcast_as((n * c, kk, ho * wo))?.contiguous()?;
    fold(&cols, &geom(w), &out[2..], path)?.reshape(out)
}
