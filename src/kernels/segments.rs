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
    let work = super::accumulation_dtype(rows.dtype());
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

/// `out [V, ..] = 0`, then row `ids[n]` of `out` += row `n` of `x [N, ..]`
/// (an embedding's gradient: `index_add` along axis 0 with ids `[N]`),
/// threaded on the CPU for f32/f64 (None elsewhere: the caller uses
/// candle's). Each thread owns a range of the table's rows, zeroes it and
/// adds the rows whose id falls in it, so no two threads write one row and
/// each row's sum runs in the order of `n`, as candle's. candle's runs on
/// one thread: a BERT vocabulary's gradient took 27 ms of a 16-thread
/// training step that way.
pub(crate) fn index_add_rows(x: &Tensor, ids: &Tensor, v: usize, path: Path) -> Result<Option<Tensor>> {
    let n = ids.elem_count();
    if !super::has_cpu_kernel(x, path) || ids.rank() != 1 || x.rank() == 0 || x.dims()[0] != n {
        return Ok(None);
    }
    let d: usize = x.dims()[1..].iter().product();
    if n == 0 || d == 0 || v == 0 {
        return Ok(None);
    }
    let ids: Vec<i64> = ids.to_dtype(DType::I64)?.to_vec1()?;
    if ids.iter().any(|&i| i < 0 || i as usize >= v) {
        bail!("index_add: an id outside 0..{v}")
    }
    let x = x.contiguous()?;
    let (storage, l) = x.storage_and_layout();
    let Storage::Cpu(c) = &*storage else { return Ok(None) };
    let shape: Vec<usize> = [&[v], &x.dims()[1..]].concat();
    let op = "index_add";
    Ok(Some(match x.dtype() {
        DType::F32 => {
            let out = add_rows(super::contiguous_slice(op, c.as_slice::<f32>()?, l)?, &ids, (v, d))?;
            Tensor::from_vec(out, shape, x.device())?
        }
        _ => {
            let out = add_rows(super::contiguous_slice(op, c.as_slice::<f64>()?, l)?, &ids, (v, d))?;
            Tensor::from_vec(out, shape, x.device())?
        }
    }))
}

fn add_rows<T: Elem>(x: &[T], ids: &[i64], (v, d): (usize, usize)) -> Result<Vec<T>> {
    let mut out = output::<T>(v * d)?;
    // writing the table is the work (V D), adding the rows the rest (N D)
    let work = (v + ids.len()).saturating_mul(d);
    let threads = super::max_threads()
        .min(v)
        .min((work / super::MIN_ELEMS_PER_THREAD).max(1));
    let per = v.div_ceil(threads);
    let jobs: Vec<(usize, &mut [T])> = out.chunks_mut(per * d).enumerate().collect();
    run_jobs(jobs, |(j, rows)| {
        let first = j * per;
        let mine = first..first + rows.len() / d;
        for (n, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if mine.contains(&id) {
                let dst = &mut rows[(id - first) * d..(id - first + 1) * d];
                dst.iter_mut().zip(&x[n * d..(n + 1) * d]).for_each(|(a, &b)| *a += b);
            }
        }
    });
    Ok(out)
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

    /// The threaded index-add against candle's, f32 and f64, with repeated
    /// ids, rank-3 rows, and a table larger than the rows.
    #[test]
    fn index_add_rows_matches_candle() {
        for dt in [DType::F32, DType::F64] {
            for (n, v, rest) in [
                (7usize, 5usize, vec![3usize]),
                (600, 30522, vec![384]),
                (40, 9, vec![2, 3]),
            ] {
                let shape: Vec<usize> = [&[n], rest.as_slice()].concat();
                let x = Tensor::randn(0f32, 1., shape.clone(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap();
                let ids: Vec<u32> = (0..n).map(|i| ((i * 7919) % v.min(13)) as u32).collect();
                let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
                let table: Vec<usize> = [&[v], rest.as_slice()].concat();
                let want = Tensor::zeros(table, dt, &Device::Cpu)
                    .unwrap()
                    .index_add(&ids, &x, 0)
                    .unwrap();
                let got = index_add_rows(&x, &ids, v, Path::Fast).unwrap().unwrap();
                assert!(crate::kernels::max_diff(&got, &want).unwrap() < 1e-5, "{n} {v} {dt:?}");
            }
        }
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::new(&[0u32, 4], &Device::Cpu).unwrap();
        assert!(index_add_rows(&x, &bad, 4, Path::Fast).is_err());
        assert!(index_add_rows(&x, &bad, 4, Path::Portable).unwrap().is_none());
    }
}
