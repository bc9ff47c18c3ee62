//! Batched outer products: `a: [.., M, 1] @ b: [.., 1, N] -> [.., M, N]`,
//! the per-sample weight gradient of a linear layer (`x[b]^T ct[b]`).
//!
//! A GEMM with inner dimension 1 does no reuse and ran at about
//! 1 GFLOP/s in candle; this kernel writes each output row once, at memory
//! speed, rows spread over threads.

use super::{contiguous_slice, has_cpu_kernel, output, par_blocks_mut, Elem, Path};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

struct OuterOp;

fn outer_cpu<T: Elem>(a: &[T], b: &[T], m: usize, n: usize) -> candle_core::Result<Vec<T>> {
    let mut dst = output(a.len() * n)?;
    par_blocks_mut(&mut dst, n, a.len() * n + b.len(), |row, d| {
        let (av, bs) = (a[row], &b[(row / m) * n..(row / m + 1) * n]);
        for (o, &bv) in d.iter_mut().zip(bs) {
            *o = av * bv;
        }
    });
    Ok(dst)
}

impl CustomOp2 for OuterOp {
    fn name(&self) -> &'static str {
        "outer"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (ad, bd) = (l1.dims(), l2.dims());
        let r = ad.len();
        let (m, n) = (ad[r - 2], bd[r - 1]);
        let shape = Shape::from([&ad[..r - 2], &[m, n]].concat());
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(outer_cpu(
                contiguous_slice("outer", a, l1)?,
                contiguous_slice("outer", b, l2)?,
                m,
                n,
            )?),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => CpuStorage::F64(outer_cpu(
                contiguous_slice("outer", a, l1)?,
                contiguous_slice("outer", b, l2)?,
                m,
                n,
            )?),
            _ => bail!("outer: no CPU kernel for these dtypes"),
        };
        Ok((out, shape))
    }
}

/// `[.., M, 1] @ [.., 1, N] -> [.., M, N]` with equal leading axes. On other
/// devices and dtypes, candle's broadcast multiply.
pub fn outer(a: &Tensor, b: &Tensor, path: Path) -> Result<Tensor> {
    let (ad, bd) = (a.dims(), b.dims());
    let r = ad.len();
    let ok = r >= 2 && bd.len() == r && ad[r - 1] == 1 && bd[r - 2] == 1 && ad[..r - 2] == bd[..r - 2];
    if !ok {
        bail!("outer: expected [.., M, 1] and [.., 1, N], got {ad:?} and {bd:?}")
    }
    if has_cpu_kernel(a, path) && b.device().is_cpu() && a.dtype() == b.dtype() {
        return a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &OuterOp);
    }
    a.broadcast_mul(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::max_diff;
    use candle_core::{DType, Device};

    #[test]
    fn matches_broadcast_multiply() -> Result<()> {
        for dt in [DType::F32, DType::F64] {
            // Large enough to take several threads, and a small one.
            for (b, m, n) in [(3, 700, 500), (2, 3, 1)] {
                let a = Tensor::randn(0f32, 1., (b, m, 1), &Device::Cpu)?.to_dtype(dt)?;
                let c = Tensor::randn(0f32, 1., (b, 1, n), &Device::Cpu)?.to_dtype(dt)?;
                let fast = outer(&a, &c, Path::Fast)?;
                let slow = a.broadcast_mul(&c)?;
                assert_eq!(max_diff(&fast, &slow)?, 0.0);
            }
        }
        let a = Tensor::zeros((2, 3, 2), DType::F32, &Device::Cpu)?;
        assert!(outer(&a, &a, Path::Fast).is_err());
        Ok(())
    }
}
