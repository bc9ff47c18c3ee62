//! 2D pooling over `[N, C, H, W]`, any kernel and stride, no padding.

use super::{arity, BVal, BatchCx, Rule};
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Prim, TensorType};
use candle_core::Tensor;

/// Pooling primitives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolOp {
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
}

impl PoolOp {
    pub(crate) fn name(&self) -> String {
        let (kind, k, s) = self.parts();
        format!("{kind}[k={k:?},s={s:?}]")
    }

    fn parts(&self) -> (&'static str, (usize, usize), (usize, usize)) {
        match *self {
            PoolOp::MaxPool2d { kernel, stride } => ("max_pool2d", kernel, stride),
            PoolOp::AvgPool2d { kernel, stride } => ("avg_pool2d", kernel, stride),
        }
    }
}

impl Rule for PoolOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("pool", args, 1)?;
        let (kind, (kh, kw), (sh, sw)) = self.parts();
        let x = args[0].shape.as_slice();
        if x.len() != 4 || kh == 0 || kw == 0 || sh == 0 || sw == 0 || x[2] < kh || x[3] < kw {
            return Err(Error::shape(
                kind,
                &[x],
                format!("needs [N, C, H, W] with H >= {kh}, W >= {kw} and a non-zero stride"),
            ));
        }
        let out = vec![x[0], x[1], (x[2] - kh) / sh + 1, (x[3] - kw) / sw + 1];
        Ok(args[0].with_shape(out))
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType) -> Result<Tensor> {
        let x = args[0];
        let r = match *self {
            PoolOp::MaxPool2d { kernel, stride } => x.max_pool2d_with_stride(kernel, stride),
            PoolOp::AvgPool2d { kernel, stride } => x.avg_pool2d_with_stride(kernel, stride),
        };
        r.op(&self.name())
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        // B N C H W -> (B N) C H W -> pool -> B N C H' W'
        let xb = cx.front(args[0])?;
        let d = cx.b.dims(xb);
        let xf = cx.b.reshape(xb, vec![d[0] * d[1], d[2], d[3], d[4]])?;
        let y = cx.b.emit(Prim::Pool(self.clone()), &[xf])?;
        let yd = cx.b.dims(y);
        let y = cx.b.reshape(y, vec![d[0], d[1], yd[1], yd[2], yd[3]])?;
        Ok(Some((y, Some(0))))
    }
}
