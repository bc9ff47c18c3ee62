//! Adam's step in place: the moments updated where they are and the
//! weight moved where it is, in three passes over memory with nothing
//! allocated. Written as candle's expressions would round them (a scalar
//! product is candle's affine `x * a + 0`, a division by a scalar a
//! product by its reciprocal), so a step is bit for bit the one the
//! optimiser computes with candle's operations, which allocate six
//! temporaries the size of the tensor (3.1 GB for Qwen2-0.5B's embedding).

use super::{by_blocks, contiguous_slice, has_cpu_kernel, own_slice_mut, Elem, Path};
use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

/// The element types the kernels take.
trait Float: Elem + std::ops::Div<Output = Self> {
    fn of(v: f64) -> Self;
    fn sqrt(self) -> Self;
}

impl Float for f32 {
    fn of(v: f64) -> f32 {
        v as f32
    }
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}

impl Float for f64 {
    fn of(v: f64) -> f64 {
        v
    }
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

/// A moment's update `m = m b + g (1 - b)` (candle's `(m * b) + (g * (1 -
/// b))`), of the gradient's square where `square`.
struct Ema {
    beta: f64,
    square: bool,
}

fn ema<T: Float>(m: &mut [T], g: &[T], beta: f64, square: bool) {
    let (b, c, zero) = (T::of(beta), T::of(1.0 - beta), T::default());
    by_blocks(m, 4, |start, d| {
        let g = &g[start..start + d.len()];
        match square {
            true => d
                .iter_mut()
                .zip(g)
                .for_each(|(m, &g)| *m = (*m * b + zero) + (g * g * c + zero)),
            false => d
                .iter_mut()
                .zip(g)
                .for_each(|(m, &g)| *m = (*m * b + zero) + (g * c + zero)),
        }
    });
}

impl InplaceOp2 for Ema {
    fn name(&self) -> &'static str {
        "adam-moment"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        if l1.dims() != l2.dims() {
            bail!("adam-moment: shapes {:?} and {:?} differ", l1.dims(), l2.dims())
        }
        let op = "adam-moment";
        match (s1, s2) {
            (CpuStorage::F32(m), CpuStorage::F32(g)) => ema(
                own_slice_mut(op, m, l1)?,
                contiguous_slice(op, g, l2)?,
                self.beta,
                self.square,
            ),
            (CpuStorage::F64(m), CpuStorage::F64(g)) => ema(
                own_slice_mut(op, m, l1)?,
                contiguous_slice(op, g, l2)?,
                self.beta,
                self.square,
            ),
            _ => bail!("adam-moment: no CPU kernel for these dtypes"),
        }
        Ok(())
    }
}

/// The weight's update from its moments (see [`update_in_place`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Update {
    /// The learning rate.
    pub(crate) lr: f64,
    /// The bias corrections `1 - β₁ᵗ` and `1 - β₂ᵗ`.
    pub(crate) c1: f64,
    pub(crate) c2: f64,
    pub(crate) eps: f64,
    /// AdamW's factor `1 - lr wd`, applied to the weight first.
    pub(crate) decay: Option<f64>,
}

fn update<T: Float>(w: &mut [T], m: &[T], v: &[T], u: Update) {
    let zero = T::default();
    let (r1, r2, eps, one) = (T::of(1.0 / u.c1), T::of(1.0 / u.c2), T::of(u.eps), T::of(1.0));
    let (alpha, decay) = (T::of(-u.lr), u.decay.map(T::of));
    by_blocks(w, 12, |start, d| {
        let (m, v) = (&m[start..start + d.len()], &v[start..start + d.len()]);
        for ((w, &m), &v) in d.iter_mut().zip(m).zip(v) {
            let denom = (v * r2 + zero).sqrt() * one + eps;
            let step = (m * r1 + zero) / denom;
            let base = match decay {
                Some(k) => *w * k + zero,
                None => *w,
            };
            *w = base + alpha * step;
        }
    });
}

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        "adam-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        if l1.dims() != l2.dims() || l1.dims() != l3.dims() {
            bail!(
                "adam-update: shapes {:?}, {:?} and {:?} differ",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let op = "adam-update";
        match (s1, s2, s3) {
            (CpuStorage::F32(w), CpuStorage::F32(m), CpuStorage::F32(v)) => update(
                own_slice_mut(op, w, l1)?,
                contiguous_slice(op, m, l2)?,
                contiguous_slice(op, v, l3)?,
                *self,
            ),
            (CpuStorage::F64(w), CpuStorage::F64(m), CpuStorage::F64(v)) => update(
                own_slice_mut(op, w, l1)?,
                contiguous_slice(op, m, l2)?,
                contiguous_slice(op, v, l3)?,
                *self,
            ),
            _ => bail!("adam-update: no CPU kernel for these dtypes"),
        }
        Ok(())
    }
}

/// Whether every tensor is a contiguous CPU tensor of the first one's
/// shape and dtype (f32 or f64) on the crate's path: what the kernels take.
pub(crate) fn fits(ts: &[&Tensor], path: Path) -> bool {
    let first = ts[0];
    ts.iter()
        .all(|t| has_cpu_kernel(t, path) && t.dtype() == first.dtype() && t.dims() == first.dims() && t.is_contiguous())
}

/// Adam's moments `m` and `v` (each owned by the optimiser alone) moved
/// by the gradient `g` in place; the tensors must be what [`fits`] takes
/// (an error otherwise, nothing done).
pub(crate) fn moments_in_place(m: &Tensor, v: &Tensor, g: &Tensor, betas: (f64, f64)) -> Result<()> {
    m.inplace_op2(
        g,
        &Ema {
            beta: betas.0,
            square: false,
        },
    )?;
    v.inplace_op2(
        g,
        &Ema {
            beta: betas.1,
            square: true,
        },
    )
}

/// The weight `w` (every tensor sharing its storage sees the new values,
/// as after `Var::set`) moved by its moments in place:
/// `w = w k - lr (m / c1) / (sqrt(v / c2) + eps)`, with `k` AdamW's decay
/// or 1. `false`, nothing done, where the tensors do not fit the kernel.
pub(crate) fn update_in_place(w: &Tensor, m: &Tensor, v: &Tensor, u: Update, path: Path) -> Result<bool> {
    if !fits(&[w, m, v], path) {
        return Ok(false);
    }
    w.inplace_op3(m, v, &u)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 37 + seed * 11) % 101) as f64 - 50.0) / 13.0)
            .collect()
    }

    /// Bit for bit the optimiser's candle expressions, NaN included, for
    /// each dtype, with and without AdamW's decay, at a length with a
    /// partial last block.
    #[test]
    fn equals_candles_expressions() -> Result<()> {
        let n = 3 * super::super::BLOCK + 17;
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            for decay in [None, Some(1.0 - 1e-3 * 0.01)] {
                let t = |seed| Tensor::from_vec(values(n, seed), n, &dev)?.to_dtype(dt);
                let (w, m, g) = (t(1)?, t(2)?, t(3)?);
                let mut gv = values(n, 3);
                gv[7] = f64::NAN;
                let g = Tensor::from_vec(gv, n, &dev)?.to_dtype(dt)?.add(&g.zeros_like()?)?;
                let v = t(4)?.abs()?;
                let (b1, b2, lr, eps) = (0.9, 0.999, 1e-3, 1e-8);
                let (c1, c2) = (1.0 - b1 * b1 * b1, 1.0 - b2 * b2 * b2);
                // the optimiser's expressions, as written with candle's operations
                let m2 = ((&m * b1)? + (&g * (1.0 - b1))?)?;
                let v2 = ((&v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
                let denom = ((&v2 / c2)?.sqrt()? + eps)?;
                let update = ((&m2 / c1)? / denom)?;
                let base = match decay {
                    Some(k) => (&w * k)?,
                    None => w.clone(),
                };
                let want = (base - (update * lr)?)?;
                let (wk, mk, vk) = (w.copy()?, m.copy()?, v.copy()?);
                assert!(fits(&[&mk, &vk, &g], Path::Fast));
                moments_in_place(&mk, &vk, &g, (b1, b2))?;
                let u = Update { lr, c1, c2, eps, decay };
                assert!(update_in_place(&wk, &mk, &vk, u, Path::Fast)?);
                let bits = |a: &Tensor| -> Result<Vec<u64>> {
                    Ok(a.to_dtype(DType::F64)?
                        .to_vec1::<f64>()?
                        .iter()
                        .map(|x| x.to_bits())
                        .collect())
                };
                assert_eq!(bits(&mk)?, bits(&m2)?, "{dt:?} first moment");
                assert_eq!(bits(&vk)?, bits(&v2)?, "{dt:?} second moment");
                let (got, want) = (bits(&wk)?, bits(&want)?);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a == b || (f64::from_bits(*a).is_nan() && f64::from_bits(*b).is_nan()));
                assert!(same, "{dt:?} {decay:?} weight");
                assert!(f64::from_bits(got[7]).is_nan(), "NaN reaches its weight");
                // the portable path and other layouts are left to candle
                assert!(!update_in_place(&wk, &mk, &vk, u, Path::Portable)?);
                let strided = Tensor::from_vec(values(12, 1), (3, 4), &dev)?.to_dtype(dt)?.t()?;
                assert!(!fits(&[&strided], Path::Fast));
            }
        }
        Ok(())
    }
}
