//! bf16 to f32 and back for the products of half-precision operands on
//! the CPU. candle multiplies bf16 by widening both operands to f32 on
//! one thread, copying a transposed weight into row order as it goes,
//! and narrowing the product on one thread: Qwen2-0.5B's tied output
//! head took 2.9 s that way against about 0.5 s for the same product in
//! f32. Here both operands widen across the threads in their own memory
//! order (a transposed weight stays column-major, which the f32 product
//! reads in place), the crate's f32 product runs, and the result
//! narrows across the threads, rounding to nearest even as candle does.

use super::{assume_written, by_blocks, contiguous_slice, output_uninit, Path};
use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};
use half::bf16;

/// `t` (bf16 on the CPU, contiguous or the transpose of a contiguous
/// tensor's last two axes) in f32 with the same layout; `None` for
/// anything else, or off the crate's path.
pub(crate) fn widen(t: &Tensor, path: Path) -> Result<Option<Tensor>> {
    if path != Path::Fast || !t.device().is_cpu() || t.dtype() != DType::BF16 {
        return Ok(None);
    }
    if t.is_contiguous() {
        return Ok(Some(widen_contiguous(t)?));
    }
    let r = t.rank();
    if r >= 2 {
        let back = t.transpose(r - 2, r - 1)?;
        if back.is_contiguous() {
            return Ok(Some(widen_contiguous(&back)?.transpose(r - 2, r - 1)?));
        }
    }
    Ok(None)
}

fn widen_contiguous(t: &Tensor) -> Result<Tensor> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::BF16(v)) = &*storage else {
        candle_core::bail!("widen: expected a bf16 CPU tensor")
    };
    let src = contiguous_slice("widen", v, layout)?;
    let mut out = output_uninit::<f32>(src.len())?;
    by_blocks(&mut out, 1, |start, d| {
        let s = &src[start..start + d.len()];
        // a bf16 is an f32's upper half: exact
        d.iter_mut()
            .zip(s)
            .for_each(|(d, x)| *d = std::mem::MaybeUninit::new(f32::from_bits(u32::from(x.to_bits()) << 16)));
    });
    // SAFETY: by_blocks hands every element of `out` to exactly one pass,
    // which writes it.
    let out = unsafe { assume_written(out) };
    Tensor::from_vec(out, t.shape(), &Device::Cpu)
}

/// `t` (f32, contiguous, on the CPU) rounded to bf16 to nearest even (NaN
/// kept), across the threads; `None` otherwise.
pub(crate) fn narrow(t: &Tensor, path: Path) -> Result<Option<Tensor>> {
    if path != Path::Fast || !t.device().is_cpu() || t.dtype() != DType::F32 || !t.is_contiguous() {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(v)) = &*storage else {
        return Ok(None);
    };
    let src = contiguous_slice("narrow", v, layout)?;
    let mut out = vec![bf16::ZERO; src.len()];
    by_blocks(&mut out, 1, |start, d| {
        let s = &src[start..start + d.len()];
        d.iter_mut().zip(s).for_each(|(d, &x)| *d = bf16::from_f32(x));
    });
    Ok(Some(Tensor::from_vec(out, t.shape(), &Device::Cpu)?))
}

/// `t` in f32 with [`widen`], after a contiguous copy where its layout is
/// neither contiguous nor transposed; `None` where `widen` takes no bf16
/// tensor (another dtype, device or path).
pub(crate) fn widen_any(t: &Tensor, path: Path) -> Result<Option<Tensor>> {
    match widen(t, path)? {
        Some(w) => Ok(Some(w)),
        None if t.dtype() == DType::BF16 && path == Path::Fast && t.device().is_cpu() => widen(&t.contiguous()?, path),
        None => Ok(None),
    }
}

/// `y` (f32) rounded to bf16: across the threads where [`narrow`] takes
/// it, else by candle (the same rounding).
pub(crate) fn narrow_any(y: &Tensor, path: Path) -> Result<Tensor> {
    match narrow(y, path)? {
        Some(h) => Ok(h),
        None => y.to_dtype(DType::BF16),
    }
}

/// `f` (an f32 kernel) on bf16 operands widened across the threads, its
/// f32 result rounded to bf16 once: how the crate runs bf16 work on its
/// f32 kernels. `None` unless every operand is a bf16 CPU tensor on the
/// crate's path.
pub(crate) fn in_f32<E: From<candle_core::Error>>(
    ts: &[&Tensor],
    path: Path,
    f: impl FnOnce(&[Tensor]) -> std::result::Result<Tensor, E>,
) -> std::result::Result<Option<Tensor>, E> {
    let mut wide = Vec::with_capacity(ts.len());
    for t in ts {
        match widen_any(t, path)? {
            Some(w) => wide.push(w),
            None => return Ok(None),
        }
    }
    Ok(Some(narrow_any(&f(&wide)?, path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit for bit candle's conversions both ways, for contiguous and
    /// transposed operands, NaN and infinities included.
    #[test]
    fn equals_candles_conversions() -> Result<()> {
        let n = 3 * super::super::BLOCK + 5;
        let mut vals: Vec<f32> = (0..2 * n).map(|i| ((i * 37 % 1001) as f32 - 500.0) / 7.3).collect();
        vals[3] = f32::NAN;
        vals[4] = f32::INFINITY;
        vals[5] = 1.0 + 2f32.powi(-8); // a tie: rounds to even
        let t = Tensor::from_vec(vals, (2, n), &Device::Cpu)?;
        let bits32 = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
        };
        let bits16 = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.flatten_all()?
                .to_vec1::<bf16>()?
                .iter()
                .map(|x| x.to_bits())
                .collect())
        };
        let got = narrow(&t, Path::Fast)?.expect("a contiguous f32 tensor");
        assert_eq!(bits16(&got)?, bits16(&t.to_dtype(DType::BF16)?)?);
        let h = got;
        for x in [h.clone(), h.t()?] {
            let wide = widen(&x, Path::Fast)?.expect("contiguous or transposed");
            assert_eq!(wide.dims(), x.dims());
            assert_eq!(
                bits32(&wide.contiguous()?)?,
                bits32(&x.to_dtype(DType::F32)?.contiguous()?)?
            );
        }
        assert!(
            widen(&h.narrow(1, 1, 5)?, Path::Fast)?.is_none(),
            "a strided view is left to candle"
        );
        assert!(widen(&h, Path::Portable)?.is_none());
        Ok(())
    }
}
