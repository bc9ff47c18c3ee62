//! Rows scaled by one factor each, `x [R, ..] * w [R, 1, ..]`: how the DP
//! clipping step reweights each example's activations or output gradients.
//! candle broadcasts the factor through a scalar per-element loop (0.69 ms
//! for the Opacus CNN's `[256, 32, 5, 5]`); one threaded pass over rows
//! takes a tenth of that.

use super::{contiguous_slice, has_cpu_kernel, in_blocks, Elem, Path};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

struct ScaleRows;

fn scale_cpu<T: Elem>(x: &[T], w: &[T]) -> Result<Vec<T>> {
    let row = x.len().checked_div(w.len()).unwrap_or(0);
    let mut dst = super::output(x.len())?;
    if row == 0 {
        return Ok(dst);
    }
    // Whole rows per block, so each block reads its factors in order.
    let block = row * (super::BLOCK / row).max(1);
    in_blocks(&mut dst, block, 2, |start, d| {
        for (i, (o, v)) in d.chunks_mut(row).zip(x[start..].chunks(row)).enumerate() {
            let f = w[start / row + i];
            for (a, b) in o.iter_mut().zip(v) {
                *a = *b * f;
            }
        }
    });
    Ok(dst)
}

impl CustomOp2 for ScaleRows {
    fn name(&self) -> &'static str {
        "scale_rows"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (l1.dims(), l2.dims());
        if w.len() != 1 || x.first() != w.first() {
            bail!("scale_rows: shapes {x:?} and {w:?}: one factor per row")
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => CpuStorage::F32(scale_cpu(
                contiguous_slice("scale_rows", x, l1)?,
                contiguous_slice("scale_rows", w, l2)?,
            )?),
            (CpuStorage::F64(x), CpuStorage::F64(w)) => CpuStorage::F64(scale_cpu(
                contiguous_slice("scale_rows", x, l1)?,
                contiguous_slice("scale_rows", w, l2)?,
            )?),
            _ => bail!("scale_rows: no CPU kernel for these dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `x * w` for CPU f32/f64 `x: [R, ..]` and `w: [R, 1, .., 1]` of one
/// dtype (a factor per row, broadcast over the rest), in one threaded
/// pass; `None` for any other pair.
pub fn scale_rows(x: &Tensor, w: &Tensor, path: Path) -> Result<Option<Tensor>> {
    let (xd, wd) = (x.dims(), w.dims());
    let per_row = xd.len() >= 2 && wd.len() == xd.len() && wd[0] == xd[0] && wd[1..].iter().all(|&d| d == 1);
    if !per_row || !has_cpu_kernel(x, path) || x.dtype() != w.dtype() || !w.device().is_cpu() {
        return Ok(None);
    }
    let w = w.flatten_all()?.contiguous()?;
    Ok(Some(x.contiguous()?.apply_op2_no_bwd(&w, &ScaleRows)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn matches_candle_and_refuses_other_shapes() -> Result<()> {
        let d = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            // Rows longer and shorter than a block, a tail, NaN kept.
            for shape in [[300usize, 7, 9], [3, 20_000, 1], [1, 1, 5]] {
                let x = Tensor::randn(0f32, 1., &shape[..], &d)?.to_dtype(dt)?;
                let mut wv: Vec<f32> = (0..shape[0]).map(|i| i as f32 - 2.5).collect();
                wv[0] = f32::NAN;
                let w = Tensor::from_vec(wv, (shape[0], 1, 1), &d)?.to_dtype(dt)?;
                let got = scale_rows(&x, &w, Path::Fast)?.expect("a factor per row");
                let want = x.broadcast_mul(&w)?;
                let flat = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>();
                let (g, e) = (flat(&got)?, flat(&want)?);
                assert!(g.iter().zip(&e).all(|(a, b)| a == b || (a.is_nan() && b.is_nan())));
            }
        }
        let x = Tensor::zeros((4, 3), DType::F32, &d)?;
        assert!(scale_rows(&x, &Tensor::zeros((1, 3), DType::F32, &d)?, Path::Fast)?.is_none());
        assert!(scale_rows(&x, &Tensor::zeros((4, 1), DType::F64, &d)?, Path::Fast)?.is_none());
        assert!(scale_rows(&x, &Tensor::zeros(4, DType::F32, &d)?, Path::Fast)?.is_none());
        Ok(())
    }
}
