//! The same computations in candle's operations, for every other device
//! and dtype (f16 and bf16 in f32).

use crate::kernels::accumulation_dtype as work_dtype;
use candle_core::{Result, Tensor, D};

/// `[N, 1, T, T]` (or `[1, 1, T, T]`): 1 where query `i` may not see
/// key `j`.
fn hidden(keep: Option<&Tensor>, causal: bool, n: usize, t: usize, q: &Tensor) -> Result<Option<Tensor>> {
    let dev = q.device();
    let mut m: Option<Tensor> = None;
    if causal {
        let pos = Tensor::arange(0u32, t as u32, dev)?;
        let after = pos.unsqueeze(0)?.broadcast_gt(&pos.unsqueeze(1)?)?; // T T: j > i
        m = Some(after.reshape((1, 1, t, t))?);
    }
    if let Some(k) = keep {
        let pad = k.eq(0.0)?.reshape((n, 1, 1, t))?;
        m = Some(match m {
            Some(c) => c.broadcast_maximum(&pad)?,
            None => pad,
        });
    }
    Ok(m)
}

/// The probabilities `[N, H, T, T]` and the hidden mask, in the work dtype.
fn probabilities(
    q: &Tensor,
    k: &Tensor,
    keep: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let (n, _, t, _) = q.dims4()?;
    let s = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?;
    let hidden = hidden(keep, causal, n, t, q)?;
    let s = match &hidden {
        Some(m) => {
            let m = m.broadcast_as(s.shape())?;
            // one value broadcast, not a score-sized tensor of it
            let fill = Tensor::new(super::lowest(s.dtype()), s.device())?.to_dtype(s.dtype())?;
            m.where_cond(&fill.broadcast_as(s.shape())?, &s)?
        }
        None => s,
    };
    Ok((candle_nn::ops::softmax_last_dim(&s)?, hidden))
}

pub(super) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keep: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> Result<Tensor> {
    let (dt, wt) = (q.dtype(), work_dtype(q.dtype()));
    // operands as the model makes them (a permuted view of a projection):
    // candle's product takes them contiguous
    let (q, k, v) = (q.to_dtype(wt)?.contiguous()?, k.to_dtype(wt)?, v.to_dtype(wt)?);
    let (p, _) = probabilities(&q, &k, keep, causal, scale)?;
    p.matmul(&v.contiguous()?)?.to_dtype(dt)
}

pub(super) fn backward(ts: [&Tensor; 4], keep: Option<&Tensor>, causal: bool, scale: f64) -> Result<Tensor> {
    let (dt, wt) = (ts[0].dtype(), work_dtype(ts[0].dtype()));
    let [q, k, v, dout] = ts.map(|t| t.to_dtype(wt).and_then(|t| t.contiguous()));
    let (q, k, v, dout) = (q?, k?, v?, dout?);
    let (p, hidden) = probabilities(&q, &k, keep, causal, scale)?;
    let dv = p.t()?.contiguous()?.matmul(&dout)?;
    let dp = dout.matmul(&v.t()?.contiguous()?)?;
    let dot = (&p * &dp)?.sum_keepdim(D::Minus1)?;
    let mut ds = (p * dp.broadcast_sub(&dot)?)?;
    if let Some(m) = hidden {
        let m = m.broadcast_as(ds.shape())?;
        let zero = Tensor::new(0f64, ds.device())?
            .to_dtype(ds.dtype())?
            .broadcast_as(ds.shape())?;
        ds = m.where_cond(&zero, &ds)?;
    }
    let ds = (ds * scale)?;
    let dq = ds.matmul(&k)?;
    let dk = ds.t()?.contiguous()?.matmul(&q)?;
    Tensor::cat(&[dq, dk, dv], 3)?.to_dtype(dt)
}
