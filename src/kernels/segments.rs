//! The squared norm of each example's embedding gradient without the
//! gradient: example `b` adds its rows `c[b, t]` into the rows `ids[b, t]`
//! of a `[V, D]` table, whose squared norm is `sum_v |sum_{t: id_t = v}
//! c[b, t]|^2`. Sorting an example's positions by id puts equal ids side
//! by side, so each group's rows are summed once: `T log T + T D` an
//! example, where writing the table costs `V D` and the pairwise form
//! (`sum_ts [id_t = id_s] c_t . c_s`) `T^2 D` (a BERT-sized vocabulary at
//! `T = 1024` held a 715 MiB `[8, 30522, 768]` gradient for it). Other
//! devices and dtypes group the same way in candle's operations.

use super::{output, run_jobs, Elem, Path};
use candle_core::{bail, DType, Result, Storage, Tensor, D};

/// `[B]`: each example's squared norm of `sum_t onehot(ids[b, t]) c[b, t]`,
/// for rows `c [B, T, D]` and ids `[B, T]` (any integer dtype, in range:
/// the caller checks).
pub(crate) fn lookup_sq_norms(rows: &Tensor, ids: &Tensor, path: Path) -> Result<Tensor> {
    let (b, t, d) = rows.dims3()?;
    if ids.dims() != [b, t] {
        bail!(
            "lookup_sq_norms: ids {:?} do not fit rows {:?}",
            ids.dims(),
            rows.dims()
        )
    }
    let ids: Vec<i64> = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    if !super::has_cpu_kernel(rows, path) {
        return grouped(rows, &ids, (b, t));
    }
    let rows = rows.contiguous()?;
    let (storage, _) = rows.storage_and_layout();
    let Storage::Cpu(c) = &*storage else {
        bail!("lookup_sq_norms: not a CPU tensor")
    };
    let (op, l) = ("lookup_sq_norms", rows.layout());
    match rows.dtype() {
        DType::F32 => norms(
            super::contiguous_slice(op, c.as_slice::<f32>()?, l)?,
            &ids,
            (b, t, d),
            rows.device(),
        ),
        _ => norms(
            super::contiguous_slice(op, c.as_slice::<f64>()?, l)?,
            &ids,
            (b, t, d),
            rows.device(),
        ),
    }
}

fn norms<T: Elem + candle_core::WithDType>(
    rows: &[T],
    ids: &[i64],
    (b, t, d): (usize, usize, usize),
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let mut out = output::<T>(b)?;
    let one = |i: usize, o: &mut T| {
        let (ids, rows) = (&ids[i * t..(i + 1) * t], &rows[i * t * d..(i + 1) * t * d]);
        let mut order: Vec<usize> = (0..t).collect();
        order.sort_by_key(|&p| ids[p]);
        let mut acc = vec![T::default(); d];
        let mut total = T::default();
        for (k, &p) in order.iter().enumerate() {
            for (a, &x) in acc.iter_mut().zip(&rows[p * d..(p + 1) * d]) {
                *a += x;
            }
            // the end of a group of equal ids: its row of the table
            if order.get(k + 1).is_none_or(|&n| ids[n] != ids[p]) {
                for a in acc.iter_mut() {
                    total += *a * *a;
                    *a = T::default();
                }
            }
        }
        *o = total;
    };
    // an example's work is T D multiply-adds: threads pay for long ones
    if b > 1 && t * d >= 1 << 16 {
        let jobs: Vec<(usize, &mut T)> = out.iter_mut().enumerate().collect();
        run_jobs(jobs, |(i, o)| one(i, o));
    } else {
        out.iter_mut().enumerate().for_each(|(i, o)| one(i, o));
    }
    Tensor::from_vec(out, b, dev)
}

/// The same grouping in candle's operations (every other device and
/// dtype, f16/bf16 summed in f32): each example's ids ranked on the host
/// (they were read for the range check already), its rows added into one
/// row per distinct id, and that table's squared sum: `[U, D]` an
/// example, `U` its distinct ids, never a `T x T` or `V x D` value.
fn grouped(rows: &Tensor, ids: &[i64], (b, t): (usize, usize)) -> Result<Tensor> {
    if b == 0 {
        return Tensor::zeros(0, rows.dtype(), rows.device());
    }
    let work = match rows.dtype() {
        DType::F16 | DType::BF16 => DType::F32,
        dt => dt,
    };
    let mut norms = Vec::with_capacity(b);
    for i in 0..b {
        let ex = &ids[i * t..(i + 1) * t];
        let mut distinct: Vec<i64> = ex.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let rank: Vec<u32> = ex
            .iter()
            .map(|id| distinct.partition_point(|d| d < id) as u32)
            .collect();
        let rank = Tensor::from_vec(rank, t, rows.device())?;
        let r = rows.get(i)?.to_dtype(work)?.contiguous()?;
        let table = Tensor::zeros((distinct.len(), r.dim(D::Minus1)?), work, rows.device())?;
        norms.push(table.index_add(&rank, &r, 0)?.sqr()?.sum_all()?);
    }
    Tensor::stack(&norms, 0)?.to_dtype(rows.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against the table written out, in f64 and f32, with repeated ids,
    /// on both paths.
    #[test]
    fn equals_the_norm_of_the_table() {
        let (b, t, d, v) = (3, 9, 5, 4);
        for dt in [DType::F64, DType::F32] {
            let rows = Tensor::randn(0f64, 1.0, (b, t, d), &Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7 + i / 5) % v) as u32).collect();
            let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
            let mut want = Vec::new();
            for i in 0..b {
                let table = Tensor::zeros((v, d), dt, &Device::Cpu).unwrap();
                let table = table.index_add(&ids.get(i).unwrap(), &rows.get(i).unwrap(), 0).unwrap();
                let n = table.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap();
                want.push(n.to_scalar::<f64>().unwrap());
            }
            for path in [Path::Fast, Path::Portable] {
                let got = lookup_sq_norms(&rows, &ids, path)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap();
                for (g, w) in got.to_vec1::<f64>().unwrap().iter().zip(&want) {
                    assert!((g - w).abs() < 1e-4 * w.abs().max(1.0), "{dt:?} {path:?}: {g} vs {w}");
                }
            }
        }
    }
}
