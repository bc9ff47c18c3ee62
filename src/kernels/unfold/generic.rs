//! Generic (any device, any dtype) implementations from candle ops.

use super::{check_cols, check_input};
use crate::ir::ConvGeom;
use candle_core::{Result, Tensor};

/// The kernel taps as multi-indices, in row-major order (torch's row order).
fn kernel_taps(g: &ConvGeom) -> Vec<Vec<usize>> {
    (0..g.kernel_numel())
        .map(|mut flat| {
            let mut tap = vec![0; g.ndim()];
            for (t, &k) in tap.iter_mut().zip(&g.kernel).rev() {
                *t = flat % k;
                flat /= k;
            }
            tap
        })
        .collect()
}

/// Elements `start, start + step, ..` (`len` of them) along `dim`. Candle
/// has no strided slice, so for `step > 1` the span is padded to
/// `len * step`, split into `(len, step)` and the first column kept.
fn strided_narrow(t: &Tensor, dim: usize, start: usize, len: usize, step: usize) -> Result<Tensor> {
    if step == 1 {
        return t.narrow(dim, start, len);
    }
    let span = t
        .narrow(dim, start, (len - 1) * step + 1)?
        .pad_with_zeros(dim, 0, step - 1)?;
    let mut dims = span.dims().to_vec();
    dims.splice(dim..=dim, [len, step]);
    span.reshape(dims)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// The adjoint of [`strided_narrow`]: places the `len` elements of `t`
/// along `dim` at `start, start + step, ..` of a zero axis of size `total`.
fn strided_embed(t: &Tensor, dim: usize, start: usize, step: usize, total: usize) -> Result<Tensor> {
    let len = t.dim(dim)?;
    let t = if step == 1 {
        t.clone()
    } else {
        let spread = t.unsqueeze(dim + 1)?.pad_with_zeros(dim + 1, 0, step - 1)?;
        let mut dims = t.dims().to_vec();
        dims[dim] = len * step;
        spread.reshape(dims)?.narrow(dim, 0, (len - 1) * step + 1)?
    };
    let span = t.dim(dim)?;
    t.pad_with_zeros(dim, start, total - start - span)
}

/// [`unfold`](super::unfold) built only from candle ops (pad, narrow, reshape, stack), for
/// devices and dtypes without a kernel. Same results as the kernel.
pub fn unfold_generic(x: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let out = check_input("unfold", x, g)?;
    let mut xp = x.clone();
    for (i, &p) in g.padding.iter().enumerate() {
        xp = xp.pad_with_zeros(2 + i, p, p)?;
    }
    let pieces = kernel_taps(g)
        .iter()
        .map(|tap| {
            (0..g.ndim()).try_fold(xp.clone(), |t, i| {
                strided_narrow(&t, 2 + i, tap[i] * g.dilation[i], out[i], g.stride[i])
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // [N, C, K, *out] -> [N, C*K, L]: c outer, tap inner, as torch.
    let (n, c) = (x.dim(0)?, x.dim(1)?);
    let l = out.iter().product::<usize>();
    Tensor::stack(&pieces, 2)?.reshape((n, c * g.kernel_numel(), l))
}

/// [`fold`](super::fold) built only from candle ops, for devices and dtypes without a
/// kernel: each tap's columns are spread onto the padded image and summed,
/// then the padding is cut away. Same results as the kernel.
pub fn fold_generic(cols: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<Tensor> {
    let (n, c, out) = check_cols("fold", cols, g, spatial)?;
    let cols = cols.reshape([&[n, c, g.kernel_numel()], out.as_slice()].concat())?;
    let padded: Vec<usize> = spatial.iter().zip(&g.padding).map(|(s, p)| s + 2 * p).collect();
    let mut acc = Tensor::zeros([&[n, c], padded.as_slice()].concat(), cols.dtype(), cols.device())?;
    for (flat, tap) in kernel_taps(g).iter().enumerate() {
        let piece = (0..g.ndim()).try_fold(cols.narrow(2, flat, 1)?.squeeze(2)?, |t, i| {
            strided_embed(&t, 2 + i, tap[i] * g.dilation[i], g.stride[i], padded[i])
        })?;
        acc = (acc + piece)?;
    }
    for (i, (&p, &s)) in g.padding.iter().zip(spatial).enumerate() {
        acc = acc.narrow(2 + i, p, s)?;
    }
    acc.contiguous()
}
