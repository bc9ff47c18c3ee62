//! Same-shape arithmetic, `a + b`, `a - b`, `a * b` and `a / b` of two
//! contiguous f32, f64 or bf16 tensors, in one pass on rayon's pool: the pool
//! gemm's threads and the crate's other kernels run on. candle's maps run
//! on a second pool of candle's own, whose threads spin for a while after
//! every call; on a machine with as many cores as threads that spinning
//! takes a core from the product that follows (a Qwen2-0.5B LoRA step on
//! two threads makes 722 such products of a gate, a norm or a rotation).
//! The results are candle's: each element is one IEEE operation, NaN
//! propagating as it does. [`axpy_in_place`] is an optimiser's update,
//! `w += alpha v`, in one pass over the weight.

use super::{assume_written, by_blocks, contiguous_slice, has_cpu_kernel, output_uninit, own_slice_mut, Elem, Path};
use candle_core::{bail, CpuStorage, CustomOp2, DType, InplaceOp2, Layout, Result, Shape, Tensor};
use half::bf16;
use std::mem::MaybeUninit;
use std::ops::{Div, Sub};

/// Which operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arith {
    Add,
    Sub,
    Mul,
    Div,
}

/// Below this many elements candle's map (one thread there) is as fast,
/// and a call to the pool would cost more than the pass.
const MIN_ELEMS: usize = 1 << 15;

/// The element types this kernel takes.
trait Num: Elem + Sub<Output = Self> + Div<Output = Self> {}
impl Num for f32 {}
impl Num for f64 {}

/// `d[i] = a[i] op b[i]`: one loop per operation, so each vectorises.
#[inline(always)]
fn zip_into<T: Num>(d: &mut [MaybeUninit<T>], a: &[T], b: &[T], op: Arith) {
    let each = d.iter_mut().zip(a).zip(b);
    match op {
        Arith::Add => each.for_each(|((d, &x), &y)| {
            d.write(x + y);
        }),
        Arith::Sub => each.for_each(|((d, &x), &y)| {
            d.write(x - y);
        }),
        Arith::Mul => each.for_each(|((d, &x), &y)| {
            d.write(x * y);
        }),
        Arith::Div => each.for_each(|((d, &x), &y)| {
            d.write(x / y);
        }),
    }
}

/// `a op b` of two slices of one length, threaded by blocks.
fn run<T: Num>(a: &[T], b: &[T], op: Arith) -> Result<Vec<T>> {
    if a.len() != b.len() {
        bail!("zip: operands of {} and {} elements", a.len(), b.len())
    }
    let mut dst = output_uninit::<T>(a.len())?;
    // two elements read and one written per element: memory-bound
    by_blocks(&mut dst, 3, |start, d| {
        let end = start + d.len();
        zip_into(d, &a[start..end], &b[start..end], op)
    });
    // SAFETY: `by_blocks` hands every element of `dst` to exactly one
    // pass (the whole blocks, then the tail), and `zip_into` writes every
    // element of the piece it is given (`a` and `b` are as long as `dst`).
    Ok(unsafe { assume_written(dst) })
}

/// [`run`] for bf16: each element in f32 and rounded once, as `half`'s
/// (and so candle's) bf16 arithmetic computes it, across the threads.
fn run_bf16(a: &[bf16], b: &[bf16], op: Arith) -> Result<Vec<bf16>> {
    if a.len() != b.len() {
        bail!("zip: operands of {} and {} elements", a.len(), b.len())
    }
    let mut dst = vec![bf16::ZERO; a.len()];
    by_blocks(&mut dst, 4, |start, d| {
        let (a, b) = (&a[start..start + d.len()], &b[start..start + d.len()]);
        let each = d.iter_mut().zip(a).zip(b);
        match op {
            Arith::Add => each.for_each(|((d, x), y)| *d = bf16::from_f32(x.to_f32() + y.to_f32())),
            Arith::Sub => each.for_each(|((d, x), y)| *d = bf16::from_f32(x.to_f32() - y.to_f32())),
            Arith::Mul => each.for_each(|((d, x), y)| *d = bf16::from_f32(x.to_f32() * y.to_f32())),
            Arith::Div => each.for_each(|((d, x), y)| *d = bf16::from_f32(x.to_f32() / y.to_f32())),
        }
    });
    Ok(dst)
}

struct ZipOp(Arith);

impl CustomOp2 for ZipOp {
    fn name(&self) -> &'static str {
        "zip"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if l1.dims() != l2.dims() {
            bail!("zip {:?}: shapes {:?} and {:?} differ", self.0, l1.dims(), l2.dims())
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(run(
                contiguous_slice("zip", a, l1)?,
                contiguous_slice("zip", b, l2)?,
                self.0,
            )?),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => CpuStorage::F64(run(
                contiguous_slice("zip", a, l1)?,
                contiguous_slice("zip", b, l2)?,
                self.0,
            )?),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => CpuStorage::BF16(run_bf16(
                contiguous_slice("zip", a, l1)?,
                contiguous_slice("zip", b, l2)?,
                self.0,
            )?),
            _ => bail!("zip {:?}: no CPU kernel for these dtypes", self.0),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// Whether the kernels here take `a` and `b`: both contiguous, of one
/// shape and one dtype, each with a CPU kernel on `path`.
fn pair_fits(a: &Tensor, b: &Tensor, path: Path) -> bool {
    has_cpu_kernel(a, path)
        && has_cpu_kernel(b, path)
        && a.dtype() == b.dtype()
        && a.dims() == b.dims()
        && a.is_contiguous()
        && b.is_contiguous()
}

/// `a op b` for two contiguous CPU tensors of one shape and dtype (f32,
/// f64, or bf16 computed in f32 and rounded once as candle's is) of at
/// least [`MIN_ELEMS`] elements; `None` otherwise (the caller uses
/// candle's, which broadcasts and takes any layout).
pub(crate) fn zip(a: &Tensor, b: &Tensor, op: Arith, path: Path) -> Result<Option<Tensor>> {
    let bf16_pair = path == Path::Fast
        && a.device().is_cpu()
        && (a.dtype(), b.dtype()) == (DType::BF16, DType::BF16)
        && a.dims() == b.dims()
        && a.is_contiguous()
        && b.is_contiguous();
    if !(pair_fits(a, b, path) || bf16_pair) || a.elem_count() < MIN_ELEMS {
        return Ok(None);
    }
    Ok(Some(a.apply_op2_no_bwd(b, &ZipOp(op))?))
}

/// `y += alpha x`, element by element as `y + (alpha x)` (two roundings,
/// as candle's `y - x * lr` with `alpha = -lr`), threaded by blocks.
struct Axpy(f64);

fn axpy<T: Num>(y: &mut [T], x: &[T], alpha: T) {
    by_blocks(y, 3, |start, d| {
        let x = &x[start..start + d.len()];
        d.iter_mut().zip(x).for_each(|(v, &g)| *v += alpha * g);
    });
}

impl InplaceOp2 for Axpy {
    fn name(&self) -> &'static str {
        "axpy"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        if l1.dims() != l2.dims() {
            bail!("axpy: shapes {:?} and {:?} differ", l1.dims(), l2.dims())
        }
        match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(x)) => axpy(
                own_slice_mut("axpy", y, l1)?,
                contiguous_slice("axpy", x, l2)?,
                self.0 as f32,
            ),
            (CpuStorage::F64(y), CpuStorage::F64(x)) => {
                axpy(own_slice_mut("axpy", y, l1)?, contiguous_slice("axpy", x, l2)?, self.0)
            }
            _ => bail!("axpy: no CPU kernel for these dtypes"),
        }
        Ok(())
    }
}

/// Whether two tensors read the same storage (a write lock on one and a
/// read on the other would wait on itself). One lock at a time: the
/// storage's address is fixed while the tensor holds it.
fn share_storage(a: &Tensor, b: &Tensor) -> bool {
    let at = |t: &Tensor| std::ptr::from_ref(&*t.storage_and_layout().0).addr();
    at(a) == at(b)
}

/// `y += alpha x` in place for contiguous CPU tensors of one shape and
/// dtype (f32 or f64) that do not share storage: an optimiser's update of
/// a weight (`y`, every tensor sharing its storage sees the new values,
/// as after candle's `Var::set`) in one pass, instead of a scaled copy of
/// `x`, a difference and a copy back. `false`, nothing done, otherwise.
pub(crate) fn axpy_in_place(y: &Tensor, x: &Tensor, alpha: f64, path: Path) -> Result<bool> {
    if !pair_fits(y, x, path) || share_storage(y, x) {
        return Ok(false);
    }
    y.inplace_op2(x, &Axpy(alpha))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Bit for bit candle's, NaN and infinities included, for each
    /// operation and dtype, at a length with a partial last block.
    #[test]
    fn equals_candles_maps() -> Result<()> {
        let n = 7 * (3 * super::super::BLOCK / 7 + 11); // rows of 7, a partial last block
        for dt in [DType::F32, DType::F64] {
            let mut av: Vec<f64> = (0..n).map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0).collect();
            let bv: Vec<f64> = (0..n).map(|i| ((i * 53 % 89) as f64 - 44.0) / 3.0).collect();
            av[5] = f64::NAN;
            av[9] = f64::INFINITY;
            let a = Tensor::from_vec(av, (n / 7, 7), &Device::Cpu)?.to_dtype(dt)?;
            let b = Tensor::from_vec(bv, (n / 7, 7), &Device::Cpu)?.to_dtype(dt)?;
            for (op, want) in [
                (Arith::Add, a.broadcast_add(&b)?),
                (Arith::Sub, a.broadcast_sub(&b)?),
                (Arith::Mul, a.broadcast_mul(&b)?),
                (Arith::Div, a.broadcast_div(&b)?),
            ] {
                let got = zip(&a, &b, op, Path::Fast)?.expect("a contiguous CPU pair");
                let (g, w) = (
                    got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                    want.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
                );
                let same = g
                    .iter()
                    .zip(&w)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
                assert!(same, "{op:?} {dt:?}");
                assert!(g[5].is_nan(), "{op:?}: NaN reaches its element");
            }
        }
        Ok(())
    }

    /// bf16 arithmetic bit for bit candle's (each element in f32, rounded
    /// once), NaN included.
    #[test]
    fn bf16_equals_candles_maps() -> Result<()> {
        let n = 3 * super::super::BLOCK + 11;
        let mut av: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let bv: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0).collect();
        av[5] = f32::NAN;
        let a = Tensor::from_vec(av, n, &Device::Cpu)?.to_dtype(DType::BF16)?;
        let b = Tensor::from_vec(bv, n, &Device::Cpu)?.to_dtype(DType::BF16)?;
        let bits = |t: &Tensor| -> Result<Vec<u16>> { Ok(t.to_vec1::<bf16>()?.iter().map(|x| x.to_bits()).collect()) };
        for (op, want) in [
            (Arith::Add, (&a + &b)?),
            (Arith::Sub, (&a - &b)?),
            (Arith::Mul, (&a * &b)?),
            (Arith::Div, (&a / &b)?),
        ] {
            let got = zip(&a, &b, op, Path::Fast)?.expect("a contiguous bf16 pair");
            assert_eq!(bits(&got)?, bits(&want)?, "{op:?}");
            assert!(got.to_vec1::<bf16>()?[5].is_nan(), "{op:?}: NaN reaches its element");
        }
        assert!(zip(&a, &b, Arith::Add, Path::Portable)?.is_none());
        Ok(())
    }

    /// The update equals candle's `y - x * lr` bit for bit, reaches every
    /// tensor sharing the weight's storage, and leaves alone what it does
    /// not take (a gradient sharing the weight's storage, a transposed
    /// view, another dtype, the portable path).
    #[test]
    fn axpy_equals_candles_update() -> Result<()> {
        let n = 3 * super::super::BLOCK + 5;
        for dt in [DType::F32, DType::F64] {
            let w = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?.to_dtype(dt)?;
            let g = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?.to_dtype(dt)?;
            let want = w.broadcast_sub(&g.affine(0.01, 0.0)?)?;
            let var = candle_core::Var::from_tensor(&w)?;
            let alias = var.as_tensor().clone();
            assert!(axpy_in_place(var.as_tensor(), &g, -0.01, Path::Fast)?);
            for got in [var.as_tensor(), &alias] {
                let (a, b) = (
                    got.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                    want.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                );
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{dt:?}");
            }
            assert!(!axpy_in_place(var.as_tensor(), &alias, -0.01, Path::Fast)?);
            assert!(!axpy_in_place(var.as_tensor(), &g, -0.01, Path::Portable)?);
        }
        let m = Tensor::ones((4, 5), DType::F32, &Device::Cpu)?;
        let v = candle_core::Var::from_tensor(&Tensor::zeros((5, 4), DType::F32, &Device::Cpu)?)?;
        assert!(!axpy_in_place(v.as_tensor(), &m.t()?, 1.0, Path::Fast)?);
        assert!(!axpy_in_place(
            v.as_tensor(),
            &m.t()?.to_dtype(DType::F64)?,
            1.0,
            Path::Fast
        )?);
        Ok(())
    }

    /// What it does not take is left to candle: a transposed view,
    /// differing shapes or dtypes, a small tensor, the portable path.
    #[test]
    fn leaves_the_rest_to_candle() -> Result<()> {
        let a = Tensor::ones((256, 256), DType::F32, &Device::Cpu)?;
        let row = Tensor::ones(256, DType::F32, &Device::Cpu)?;
        assert!(zip(&a, &a.t()?, Arith::Add, Path::Fast)?.is_none());
        assert!(zip(&a, &row, Arith::Add, Path::Fast)?.is_none());
        assert!(zip(&a, &a.to_dtype(DType::F64)?, Arith::Add, Path::Fast)?.is_none());
        assert!(zip(&row, &row, Arith::Mul, Path::Fast)?.is_none());
        assert!(zip(&a, &a, Arith::Mul, Path::Portable)?.is_none());
        assert!(zip(&a, &a, Arith::Mul, Path::Fast)?.is_some());
        Ok(())
    }
}
