//! A product's epilogue in place: `y = relu?(y + bias?)` in one threaded
//! pass over the fresh output of a convolution or matrix product, the
//! bias read through its broadcast strides. Separately, the add and the
//! ReLU each allocate a tensor as large as `y` (new pages to fault in) and
//! stream it through memory again.

use super::{own_slice_mut, par_blocks_mut, Elem};
use candle_core::{bail, CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor};

/// `y`'s dimensions with the bias's strides (0 where it is broadcast),
/// neighbours merged where the bias walks them as one (`N C H W` with a
/// `[C, 1, 1]` bias -> `(N) (C) (H W)`).
fn merged(dims: &[usize], strides: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    // unit dimensions move no index: dropped (a conv's `[N, C, 1, 1]`
    // output would otherwise be walked one element per row)
    for (&d, &s) in dims.iter().zip(strides).rev().filter(|(&d, _)| d != 1) {
        match out.last_mut() {
            Some((n, t)) if s == *t * *n => *n *= d,
            _ => out.push((d, s)),
        }
    }
    out.reverse();
    out
}

/// Adds the bias (at `strides` over `dims`) to `y` and applies ReLU,
/// row by row along the merged innermost dimension.
fn epilogue_cpu<T: Elem>(y: &mut [T], bias: Option<(&[T], &[usize])>, dims: &[usize], relu: bool) {
    let zero = T::default();
    // Branch-free, and NaN stays NaN (PyTorch's relu): `v` unless v <= 0.
    let act = |v: T| if relu { [v, zero][(v <= zero) as usize] } else { v };
    let Some((b, strides)) = bias else {
        super::by_blocks(y, 2, |_, d| d.iter_mut().for_each(|v| *v = act(*v)));
        return;
    };
    let m = merged(dims, strides);
    let Some((&(inner, step), outer)) = m.split_last() else {
        y[0] = act(y[0] + b[0]); // every dimension 1: one element
        return;
    };
    par_blocks_mut(y, inner, 3 * y.len(), |r, row| {
        // the bias offset of row r: its index over the outer dimensions
        let (mut rest, mut off) = (r, 0);
        for &(n, s) in outer.iter().rev() {
            off += (rest % n) * s;
            rest /= n;
        }
        match step {
            0 => {
                let c = b[off];
                row.iter_mut().for_each(|v| *v = act(*v + c));
            }
            1 => row.iter_mut().zip(&b[off..]).for_each(|(v, &c)| *v = act(*v + c)),
            s => row
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = act(*v + b[off + i * s])),
        }
    });
}

struct Epilogue {
    relu: bool,
}

impl InplaceOp1 for Epilogue {
    fn name(&self) -> &'static str {
        "epilogue"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s {
            CpuStorage::F32(v) => epilogue_cpu(own_slice_mut("epilogue", v, l)?, None, l.dims(), self.relu),
            CpuStorage::F64(v) => epilogue_cpu(own_slice_mut("epilogue", v, l)?, None, l.dims(), self.relu),
            _ => bail!("epilogue: no CPU kernel for this dtype"),
        }
        Ok(())
    }
}

impl InplaceOp2 for Epilogue {
    fn name(&self) -> &'static str {
        "epilogue"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        if l1.dims() != l2.dims() {
            bail!(
                "epilogue: bias laid out as {:?} for an output of {:?}",
                l2.dims(),
                l1.dims()
            )
        }
        let (dims, strides, start) = (l1.dims(), l2.stride(), l2.start_offset());
        match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(b)) => {
                let y = own_slice_mut("epilogue", y, l1)?;
                epilogue_cpu(y, Some((&b[start..], strides)), dims, self.relu)
            }
            (CpuStorage::F64(y), CpuStorage::F64(b)) => {
                let y = own_slice_mut("epilogue", y, l1)?;
                epilogue_cpu(y, Some((&b[start..], strides)), dims, self.relu)
            }
            _ => bail!("epilogue: no CPU kernel for these dtypes"),
        }
        Ok(())
    }
}

/// Whether [`apply`] runs in place on `y`: CPU f32/f64, contiguous, with
/// a bias (if any) of its dtype on the CPU.
pub(crate) fn applies(y: &Tensor, bias: Option<&Tensor>, path: super::Path) -> bool {
    super::has_cpu_kernel(y, path)
        && y.is_contiguous()
        && bias.is_none_or(|b| b.device().is_cpu() && b.dtype() == y.dtype())
}

/// `y = relu?(y + bias?)` in place, the bias broadcast to `y`'s shape.
/// `y` must be a tensor nothing else reads: the caller's fresh output.
pub(crate) fn apply(y: &Tensor, bias: Option<&Tensor>, relu: bool) -> Result<()> {
    if y.elem_count() == 0 {
        return Ok(());
    }
    let op = Epilogue { relu };
    match bias {
        Some(b) => y.inplace_op2(&b.broadcast_as(y.shape())?, &op),
        None => y.inplace_op1(&op),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::max_diff;
    use candle_core::{DType, Device};

    /// Against candle's broadcast add and ReLU: conv-style `[C, 1, 1]`,
    /// linear-style `[N]` and per-model `[B, 1, N]` biases, a transposed
    /// (strided) bias, no bias, f32 and f64; NaN stays NaN.
    #[test]
    fn matches_add_and_relu() -> Result<()> {
        let d = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            let r = |s: &[usize]| Tensor::randn(0f32, 1., s, &d).and_then(|t| t.to_dtype(dt));
            let cases: Vec<(Vec<usize>, Option<Tensor>)> = vec![
                (vec![4, 6, 5, 7], Some(r(&[6, 1, 1])?)),
                (vec![64, 300], Some(r(&[300])?)),
                (vec![3, 9, 20], Some(r(&[3, 1, 20])?)),
                (vec![5, 8], Some(r(&[8, 5])?.t()?)),
                (vec![70_000], None),
            ];
            for (shape, bias) in &cases {
                for relu in [false, true] {
                    let y0 = r(shape)?;
                    let want = match bias {
                        Some(b) => y0.broadcast_add(b)?,
                        None => y0.clone(),
                    };
                    let want = if relu { want.relu()? } else { want };
                    let y = y0.copy()?;
                    apply(&y, bias.as_ref(), relu)?;
                    assert_eq!(max_diff(&y, &want)?, 0.0, "{shape:?} relu={relu}");
                }
            }
        }
        let y = Tensor::new(&[[-1f32, 0.5], [f32::NAN, 2.0]], &d)?;
        apply(&y, Some(&Tensor::new(&[0.25f32, -1.0], &d)?), true)?;
        let v = y.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(&v[..2], &[0.0, 0.0]);
        assert!(v[2].is_nan());
        assert_eq!(v[3], 1.0);
        Ok(())
    }

    #[test]
    fn refuses_what_it_cannot_take() -> Result<()> {
        let d = Device::Cpu;
        let y = Tensor::zeros((4, 3), DType::F32, &d)?;
        assert!(applies(&y, None, crate::kernels::Path::Fast));
        assert!(!applies(&y.t()?, None, crate::kernels::Path::Fast));
        assert!(!applies(&y.to_dtype(DType::U32)?, None, crate::kernels::Path::Fast));
        assert!(!applies(
            &y,
            Some(&Tensor::zeros(3, DType::F64, &d)?),
            crate::kernels::Path::Fast
        ));
        assert!(apply(&y, Some(&Tensor::zeros(5, DType::F32, &d)?), true).is_err());
        Ok(())
    }
}
