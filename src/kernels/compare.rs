//! Comparison of a tensor with a scalar, `x > 0` in every ReLU gradient.
//! candle compares against a broadcast scalar through its strided path
//! (4.4 ms for 2.4 M elements, twice its own ReLU); this is one threaded
//! pass.

use super::{contiguous_slice, has_cpu_kernel, par_blocks_mut, Elem};
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Which orderings of `x` against `s` count as true.
#[derive(Clone, Copy, Debug)]
pub struct Accept {
    /// Unordered (a NaN) is true: IEEE's `!=`, nothing else.
    pub unordered: bool,
    /// `x < s` is true.
    pub less: bool,
    /// `x == s` is true.
    pub equal: bool,
    /// `x > s` is true.
    pub greater: bool,
}

struct CmpOp {
    accept: Accept,
    scalar: f64,
}

/// Elements per task; a whole number of blocks is all `par_blocks_mut`
/// needs, so the tail is done separately.
const BLOCK: usize = 1 << 14;

fn cmp_cpu<T: Elem>(x: &[T], s: T, a: Accept) -> Vec<u8> {
    // Plain comparisons joined with non-short-circuit `&` / `|`: no
    // branches, so random signs cost no mispredictions and the loop
    // vectorises (a `match` on `partial_cmp` ran 5x slower than candle).
    let test = |v: &T| {
        let (lt, eq, gt) = (*v < s, *v == s, *v > s);
        let un = !(lt | eq | gt);
        ((lt & a.less) | (eq & a.equal) | (gt & a.greater) | (un & a.unordered)) as u8
    };
    let mut dst = vec![0u8; x.len()];
    let whole = x.len() / BLOCK * BLOCK;
    let (head, tail) = dst.split_at_mut(whole);
    par_blocks_mut(head, BLOCK, 2 * whole, |i, d| {
        for (o, v) in d.iter_mut().zip(&x[i * BLOCK..]) {
            *o = test(v);
        }
    });
    for (o, v) in tail.iter_mut().zip(&x[whole..]) {
        *o = test(v);
    }
    dst
}

impl CustomOp1 for CmpOp {
    fn name(&self) -> &'static str {
        "compare_scalar"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(v) => cmp_cpu(contiguous_slice("compare", v, l)?, self.scalar as f32, self.accept),
            CpuStorage::F64(v) => cmp_cpu(contiguous_slice("compare", v, l)?, self.scalar, self.accept),
            _ => bail!("compare_scalar: no CPU kernel for this dtype"),
        };
        Ok((CpuStorage::U8(out), l.shape().clone()))
    }
}

/// `x <op> s` as a u8 mask, where `s` is a one-element tensor; `None` when
/// the kernel does not apply (not CPU f32/f64, or `s` not a single value),
/// for the caller to use candle's broadcasting comparison.
pub fn with_scalar(x: &Tensor, s: &Tensor, accept: Accept) -> Result<Option<Tensor>> {
    if !has_cpu_kernel(x) || s.elem_count() != 1 || s.dtype() != x.dtype() {
        return Ok(None);
    }
    let scalar = s.flatten_all()?.to_dtype(DType::F64)?.get(0)?.to_scalar::<f64>()?;
    let op = CmpOp { accept, scalar };
    Ok(Some(x.contiguous()?.apply_op1_no_bwd(&op)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle() -> Result<()> {
        let d = Device::Cpu;
        // Enough elements for several blocks and a tail; ties included.
        let x = (Tensor::randn(0f32, 1., 3 * BLOCK + 77, &d)?.relu()? * 1.0)?;
        let zero = Tensor::new(0f32, &d)?;
        let gt = Accept {
            unordered: false,
            less: false,
            equal: false,
            greater: true,
        };
        let le = Accept {
            unordered: false,
            less: true,
            equal: true,
            greater: false,
        };
        let got = with_scalar(&x, &zero, gt)?.expect("takes f32");
        assert_eq!(got.to_vec1::<u8>()?, x.gt(0f64)?.to_vec1::<u8>()?);
        let got = with_scalar(&x.to_dtype(DType::F64)?, &zero.to_dtype(DType::F64)?, le)?.expect("takes f64");
        assert_eq!(got.to_vec1::<u8>()?, x.le(0f64)?.to_vec1::<u8>()?);
        assert!(with_scalar(&x, &x, gt)?.is_none());
        // NaN: only != holds
        let nan = Tensor::new(&[f32::NAN, 1.0], &d)?;
        let ne = Accept {
            unordered: true,
            less: true,
            equal: false,
            greater: true,
        };
        let got = with_scalar(&nan, &Tensor::new(1f32, &d)?, ne)?.expect("takes f32");
        assert_eq!(got.to_vec1::<u8>()?, nan.ne(1f64)?.to_vec1::<u8>()?);
        Ok(())
    }
}
