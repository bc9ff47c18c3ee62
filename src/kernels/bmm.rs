//! Batched matrix products `[B, M, K] @ [B, K, N]`: with at least two
//! matrices per thread the batch is spread over threads, each running
//! single-threaded GEMMs; fewer, larger products each use every thread.
//! Either way the result goes into huge-page memory (`output`).
//!
//! candle runs a batch as a sequence of GEMMs, each split over all threads:
//! for the small matrices of per-sample gradients the threads synchronise
//! on every one of them. The tutorial CNN's per-sample conv2 weight
//! gradient, 64 x `[64, 576] @ [576, 288]`, ran at 91 GFLOP/s that way and
//! at PyTorch's `bmm` speed (~290 GFLOP/s) as one GEMM per thread.

use super::copies::Copies;
use super::{
    assume_written, has_cpu_kernel, max_threads, output, output_uninit, par_blocks_mut, product, product_into,
    run_jobs, Elem, Mat, Path,
};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use std::mem::MaybeUninit;

/// One operand: its storage slice from the layout's start, and the batch,
/// row and column strides.
struct Operand<'a, T> {
    data: &'a [T],
    sb: usize,
    sr: usize,
    sc: usize,
}

impl<'a, T> Operand<'a, T> {
    /// Checks that every element of the `b` matrices of `rows x cols` the
    /// strides address lies inside `data` (`product` checks each matrix
    /// again; this turns a bad layout into an error rather than a panic).
    fn new(op: &str, data: &'a [T], l: &Layout, (b, rows, cols): (usize, usize, usize)) -> Result<Self> {
        let &[sb, sr, sc] = l.stride() else {
            bail!("{op}: expected a rank-3 operand, got strides {:?}", l.stride())
        };
        let data = &data[l.start_offset()..];
        let last = (b - 1) * sb + (rows - 1) * sr + (cols - 1) * sc;
        if last >= data.len() {
            bail!("{op}: layout {l:?} reaches past its storage ({} elements)", data.len())
        }
        Ok(Operand { data, sb, sr, sc })
    }

    /// The matrix starting `offset` elements in, at the operand's row and
    /// column strides.
    fn mat(&self, offset: usize) -> Mat<'a, T> {
        Mat {
            data: &self.data[offset..],
            rs: self.sr,
            cs: self.sc,
        }
    }
}

fn bmm_cpu<T: Elem>(
    a: &Operand<T>,
    b: &Operand<T>,
    (nb, m, k, n): (usize, usize, usize, usize),
    one: T,
) -> candle_core::Result<Vec<T>> {
    if nb * m * n == 0 {
        return Ok(Vec::new());
    }
    if k == 0 {
        return output(nb * m * n); // an empty sum: zeros
    }
    let parts = split_k((nb, m, n, k));
    if parts > 1 {
        let mut dst = output(nb * m * n)?;
        split_k_cpu(a, b, (m, n, k), parts, one, &mut dst)?;
        return Ok(dst);
    }
    // written in full by the products below, so never zeroed
    let mut dst = output_uninit::<T>(nb * m * n)?;
    if nb >= 2 * max_threads() {
        // Threads are spawned per call: worth it only for enough products
        // (a multiply-add counts as a sixteenth of a copied element, so the
        // copying kernels' threshold serves; 10 x [64, 128] @ [128, 10]
        // ran 0.25 ms on two threads and a tenth of that on one).
        let work = (nb * m * n).saturating_mul(k) / 16;
        par_blocks_mut(&mut dst, m * n, work, |i, d| {
            product_into(
                d,
                a.mat(i * a.sb),
                b.mat(i * b.sb),
                (m, n, k),
                one,
                gemm::Parallelism::None,
            )
        });
    } else {
        // Few products: each split over all threads, as candle does, but
        // written into `output`'s huge pages; a small one on one thread,
        // a tall one in bands of rows.
        let par = match one_thread(m, n, k) {
            true => gemm::Parallelism::None,
            false => gemm::Parallelism::Rayon(max_threads()),
        };
        // [m, n] -> bands of `rows` x n: one band split over the threads
        // by gemm (`par`), or one band per thread, each a one-thread GEMM
        let (rows, par) = match row_bands(m, n, k) {
            1 => (m, par),
            bands => (m.div_ceil(bands), gemm::Parallelism::None),
        };
        for (i, d) in dst.chunks_exact_mut(m * n).enumerate() {
            let jobs: Vec<(usize, &mut [MaybeUninit<T>])> = d.chunks_mut(rows * n).enumerate().collect();
            run_jobs(jobs, |(j, band)| {
                let lhs = a.mat(i * a.sb + j * rows * a.sr);
                product_into(band, lhs, b.mat(i * b.sb), (band.len() / n, n, k), one, par);
            });
        }
    }
    // SAFETY: the nb blocks of m n elements tile `dst` (chunks_exact over a
    // length of nb m n; par_blocks_mut hands out every whole block; a
    // block in bands is tiled by chunks of whole rows, the last shorter),
    // and product_into wrote each block or band in full (k > 0)
    Ok(unsafe { assume_written(dst) })
}

/// Products of fewer multiply-adds than this run on one thread: gemm
/// splitting one over two threads made it slower, and more so for a
/// column-major operand (`[64, 784] @ [784, 128]` from a transposed
/// weight: 157 µs on two threads, 64 on one; `[64, 128] @ [128, 784]`:
/// 85 against 58), while at 33 M (`[2048, 256] @ [256, 64]`) two threads
/// took 155 µs to one's 263.
const ONE_THREAD_MACS: usize = 1 << 24;

fn one_thread(m: usize, n: usize, k: usize) -> bool {
    m.saturating_mul(n).saturating_mul(k) < ONE_THREAD_MACS
}

/// Rows each band of [`row_bands`] has at least.
const MIN_BAND_ROWS: usize = 256;

/// Into how many bands of rows, one single-threaded GEMM each, one large
/// product is split (1: not split; gemm threads it itself). gemm splits a
/// product's columns between threads that meet at a barrier twice per
/// slice of the inner dimension and share one packed right operand; a
/// band per thread runs without either, at the price of each thread
/// packing the whole right operand. That price is small for bands of at
/// least [`MIN_BAND_ROWS`] rows: on two threads (Intel Xeon, AVX-512) `[512,
/// 896] @ [896, 896]^T` ran at 323 GFLOP/s threaded by gemm and 355 in two
/// bands, `[512, 4864] @ [4864, 896]^T` at 310 and 334. With bands of 128
/// rows (MiniLM's 2048 rows on 16 threads) the repeated packing made the
/// forward pass slower (158 against 148 ms), so thinner bands are not
/// cut.
fn row_bands(m: usize, n: usize, k: usize) -> usize {
    let threads = max_threads();
    if threads < 2 || one_thread(m, n, k) || m < MIN_BAND_ROWS * threads {
        return 1;
    }
    threads
}

/// Outputs at most this large with an inner dimension of at least
/// `SPLIT_K_MIN` per thread split that dimension between the threads.
const SPLIT_K_MAX_OUT: usize = 64 * 64;
const SPLIT_K_MIN: usize = 2048;

/// How many slices of the inner dimension one product of a few hundred
/// outputs and a long inner dimension is split into (1: not split). A GEMM
/// splits its output between threads, and an output this small leaves all
/// but one idle: a linear layer's `[16, 27648] @ [27648, 10]` (the conv3d
/// net's head) and a weight gradient's sum over every example and position
/// (`[8, 43904] @ [43904, 27]`) ran on one thread. (The sum's order then
/// depends on the number of threads, as in any parallel reduction.)
fn split_k((nb, m, n, k): (usize, usize, usize, usize)) -> usize {
    if nb != 1 || m * n > SPLIT_K_MAX_OUT {
        return 1;
    }
    // each slice worth a thread: such a product is bound by reading its
    // operands, `k (m + n)` elements (a dot product of 4096 is not split)
    let work = k.saturating_mul(m + n);
    max_threads()
        .min(k / SPLIT_K_MIN)
        .min(work / super::MIN_ELEMS_PER_THREAD)
        .max(1)
}

/// `dst = a @ b` as `parts` single-threaded products over slices of the
/// inner dimension, run in parallel into partial sums, then added.
fn split_k_cpu<T: Elem>(
    a: &Operand<T>,
    b: &Operand<T>,
    (m, n, k): (usize, usize, usize),
    parts: usize,
    one: T,
    dst: &mut [T],
) -> candle_core::Result<()> {
    let per = k.div_ceil(parts);
    let mut partial = super::zeroed(parts * m * n)?;
    par_blocks_mut(&mut partial, m * n, usize::MAX, |p, d| {
        let (k0, kk) = (p * per, per.min(k.saturating_sub(p * per)));
        if kk == 0 {
            return;
        }
        // element (i, k0 + j) of `a` and (k0 + j, c) of `b`
        let (lhs, rhs) = (a.mat(k0 * a.sc), b.mat(k0 * b.sr));
        product(d, (n, 1), lhs, rhs, (m, n, kk), false, one, gemm::Parallelism::None);
    });
    for part in partial.chunks_exact(m * n) {
        for (o, v) in dst.iter_mut().zip(part) {
            *o += *v;
        }
    }
    Ok(())
}

struct BmmOp;

impl CustomOp2 for BmmOp {
    fn name(&self) -> &'static str {
        "bmm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (&[nb, m, k], &[_, _, n]) = (l1.dims(), l2.dims()) else {
            bail!("bmm: expected rank-3 operands, got {:?} and {:?}", l1.dims(), l2.dims())
        };
        let sizes = (nb, m, k, n);
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                let (a, b) = (
                    Operand::new("bmm", a, l1, (nb, m, k))?,
                    Operand::new("bmm", b, l2, (nb, k, n))?,
                );
                CpuStorage::F32(bmm_cpu(&a, &b, sizes, 1.0)?)
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                let (a, b) = (
                    Operand::new("bmm", a, l1, (nb, m, k))?,
                    Operand::new("bmm", b, l2, (nb, k, n))?,
                );
                CpuStorage::F64(bmm_cpu(&a, &b, sizes, 1.0)?)
            }
            _ => bail!("bmm: no CPU kernel for these dtypes"),
        };
        Ok((out, Shape::from((nb, m, n))))
    }
}

/// Whether operands of any rank are ones the kernel could take once in
/// rank 3: f32/f64 on the CPU, one dtype, no empty dimension.
pub fn eligible(a: &Tensor, b: &Tensor, path: Path) -> bool {
    has_cpu_kernel(a, path)
        && b.device().is_cpu()
        && a.dtype() == b.dtype()
        && a.dims().iter().chain(b.dims()).all(|&d| d > 0)
}

/// Whether [`bmm`] runs its own kernel for these operands: [`eligible`],
/// rank 3, matching batch and inner dimensions.
pub fn takes_kernel(a: &Tensor, b: &Tensor, path: Path) -> bool {
    let (ad, bd) = (a.dims(), b.dims());
    eligible(a, b, path) && ad.len() == 3 && bd.len() == 3 && ad[0] == bd[0] && ad[2] == bd[1]
}

/// `[B, M, K] @ [B, K, N] -> [B, M, N]`, operands at any strides. Our
/// kernel where [`takes_kernel`] holds, candle's matmul otherwise. An
/// operand copied to another layout first is counted in `copies`.
pub(crate) fn bmm(a: &Tensor, b: &Tensor, copies: &Copies, path: Path) -> Result<Tensor> {
    if takes_kernel(a, b, path) {
        // Products spread over threads read a column-major `b` of their own
        // (stacked weights) in place: each GEMM runs on one thread and packs
        // its operand itself (10 x [64, 784] @ [784, 128] took 0.42-0.54 ms
        // that way and 0.64-0.83 with `b` copied first). One product split
        // over the threads packs it slowly, and a `b` shared by every
        // product (batch stride 0) would be packed once per product: copied
        // or transposed once first.
        let spread = a.dims()[0] >= 2 * max_threads() && b.stride()[0] != 0;
        let (ad, bd) = (a.dims(), b.dims());
        let split = split_k((ad[0], ad[1], bd[2], ad[2])) > 1;
        // one thread packs a column-major `b` itself, faster than a copy,
        // and so do the threads for a product of many rows
        let alone = one_thread(ad[1], bd[2], ad[2]);
        if column_major(b) && !spread && !split && !alone && !gemm_packs_rhs(ad[1], bd[2]) {
            return by_row_major_rhs(a, b, copies);
        }
        return a.apply_op2_no_bwd(b, &BmmOp);
    }
    a.matmul(b)
}

/// Elements [`bmm`] allocates besides its result for `nb` products `[m, k]
/// @ [k, n]` with column-major (transposed) operands where `a_t` and
/// `b_t` say: the copies `by_row_major_rhs` makes, the partial sums of a
/// product split along its inner dimension, and gemm's packed right-hand
/// panels (at most `k x n`). The memory plan's view of this kernel, kept
/// beside it so the two change together.
pub(crate) fn scratch((nb, m, k, n): (usize, usize, usize, usize), a_t: bool, b_t: bool) -> usize {
    let parts = split_k((nb, m, n, k));
    let spread = nb >= 2 * max_threads();
    let copies = if b_t && !spread && parts == 1 && !one_thread(m, n, k) && !gemm_packs_rhs(m, n) {
        let copy_a = if a_t { 0 } else { m * k };
        (k * n).min(copy_a + 2 * m * n)
    } else {
        0
    };
    let partial = if parts > 1 { parts * m * n } else { 0 };
    // gemm packs the right-hand side in panels of up to 512 rows per
    // thread; a product in bands of rows packs one per band
    let packers = match row_bands(m, n, k) {
        1 => max_threads().min(nb.max(1)),
        bands => bands,
    };
    let packed = if m > 32 { k.min(512) * n * packers } else { 0 };
    copies + partial + packed
}

/// Whether a product `[m, k] @ [k, n]` with a column-major right operand
/// goes to gemm as it is rather than through [`by_row_major_rhs`]: for
/// at least 128 rows and 128 columns. gemm packs such an operand itself
/// as fast as a row-major one, where the copy costs a pass over the
/// weight each call: a linear layer of Qwen2-0.5B at B=4, T=128 (`[512,
/// 896] @ [896, 896]^T`) ran at 161-245 GFLOP/s through the copy and
/// 281-323 directly on two threads (`[512, 896] @ [896, 128]^T`: 137-213
/// against 237-277; `examples/bench_gemm.rs`), and a tied vocabulary head
/// (`[512, 896] @ [896, 151936]^T`) would transpose its 311 MB result
/// back on one thread (1.7 s, 82 GFLOP/s in all). Below 128 rows gemm
/// reads the operand unpacked (`[64, 9216] @ [9216, 128]`: 50 against 80
/// GFLOP/s), and with fewer than 128 columns its threads split them
/// badly: the MLP ensemble's `[1280, 784] @ [784, 64]^T` made that
/// benchmark 1.4x slower directly. A result under 64K elements stays with
/// the copy too (the Opacus CNN ensemble's products, `m n` of a few ten
/// thousand, ran 1.4x slower directly).
fn gemm_packs_rhs(m: usize, n: usize) -> bool {
    m >= 128 && n >= 128 && m.saturating_mul(n) >= 1 << 16
}

/// `a @ b` for a column-major `b`, which gemm packs slowly when it splits
/// one product over the threads (a linear
/// layer's `x @ W^T`, [64, 9216] @ [9216, 128]: 3.1 ms, against 0.7 ms for
/// a row-major `b`). Either `b` is copied row by row (k n elements), or
/// the transposed product `(b^T a^T)^T` runs with `b^T` row-major as it is
/// and `a^T` copied (m k elements, none if `a` is column-major itself) and
/// the small result transposed back (m n): whichever copies less.
fn by_row_major_rhs(a: &Tensor, b: &Tensor, copies: &Copies) -> Result<Tensor> {
    let (m, k, n) = (a.dims()[1], a.dims()[2], b.dims()[2]);
    let copy_a = if column_major(a) { 0 } else { m * k };
    if k * n <= copy_a + m * n {
        copies.note(b);
        return a.apply_op2_no_bwd(&super::transpose::contiguous(b, Path::Fast)?, &BmmOp);
    }
    let at = a.transpose(1, 2)?;
    copies.note(&at);
    let at = super::transpose::contiguous(&at, Path::Fast)?;
    let ct = b.transpose(1, 2)?.apply_op2_no_bwd(&at, &BmmOp)?; // B n m
    super::transpose::contiguous(&ct.transpose(1, 2)?, Path::Fast)
}

/// Whether a rank-3 operand's matrices are stored column by column (a
/// transposed view) rather than row by row.
fn column_major(t: &Tensor) -> bool {
    let (d, s) = (t.dims(), t.stride());
    d.len() == 3 && d[1] > 1 && d[2] > 1 && s[1] == 1 && s[2] >= d[1]
}

/// `a [M, K] @ b[i] [K, L]` for every `i` of `b [N, K, L]`: the weight of
/// a convolution against each example's columns. On the CPU through
/// [`bmm`], `a` read at batch stride 0 and the examples spread over
/// threads (candle's `broadcast_matmul` ran them one after another, every
/// small GEMM split over the threads: 4 ms for a grouped input gradient of
/// the digits CNN's second convolution that takes well under 1 this way).
pub(crate) fn each_example(a: &Tensor, b: &Tensor, copies: &Copies, path: Path) -> Result<Tensor> {
    let (&[m, k], &[n, ..]) = (a.dims(), b.dims()) else {
        bail!(
            "each_example: expected [M, K] and [N, K, L], got {:?} and {:?}",
            a.dims(),
            b.dims()
        )
    };
    let a3 = a.reshape((1, m, k))?.broadcast_as((n, m, k))?;
    if takes_kernel(&a3, b, path) {
        return bmm(&a3, b, copies, path);
    }
    a.broadcast_matmul(b)
}

/// A matrix product of rank-2 or rank-3 operands through [`bmm`] (a
/// single matrix is a batch of one); other ranks go to candle.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, copies: &Copies, path: Path) -> Result<Tensor> {
    match (a.rank(), b.rank()) {
        (2, 2) => bmm(&a.unsqueeze(0)?, &b.unsqueeze(0)?, copies, path)?.squeeze(0),
        (3, 3) => bmm(a, b, copies, path),
        _ => a.matmul(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::max_diff;
    use candle_core::{DType, Device};

    /// Against candle's matmul for contiguous, transposed and narrowed
    /// operands, f32 and f64.
    #[test]
    fn matches_candle() -> Result<()> {
        let d = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            let a = Tensor::randn(0f32, 1., (9, 7, 5), &d)?.to_dtype(dt)?;
            let b = Tensor::randn(0f32, 1., (9, 5, 6), &d)?.to_dtype(dt)?;
            let bt = Tensor::randn(0f32, 1., (9, 6, 5), &d)?.to_dtype(dt)?;
            let wide = Tensor::randn(0f32, 1., (12, 7, 5), &d)?.to_dtype(dt)?;
            let one = (a.narrow(0, 0, 1)?, b.narrow(0, 0, 1)?);
            let three = (a.narrow(0, 0, 3)?, bt.narrow(0, 0, 3)?.transpose(1, 2)?);
            let cases = [
                one,
                three,
                (a.clone(), b.clone()),
                (a.clone(), bt.transpose(1, 2)?),
                (wide.narrow(0, 2, 9)?, b.clone()),
                (b.transpose(1, 2)?, a.transpose(1, 2)?),
            ];
            for (x, y) in &cases {
                assert!(takes_kernel(x, y, Path::Fast));
                let diff = max_diff(
                    &bmm(x, y, &Copies::default(), Path::Fast)?,
                    &x.contiguous()?.matmul(&y.contiguous()?)?,
                )?;
                assert!(diff < 1e-4, "{:?} {:?}", x.layout(), y.layout());
            }
        }
        // column-major right operands: copied (k n small), or the product
        // transposed (m small against k), with a row- or column-major left
        for dt in [DType::F32, DType::F64] {
            let a = Tensor::randn(0f32, 1., (2, 3, 40), &d)?.to_dtype(dt)?;
            let at = Tensor::randn(0f32, 1., (2, 40, 3), &d)?.to_dtype(dt)?.transpose(1, 2)?;
            let b = Tensor::randn(0f32, 1., (2, 6, 40), &d)?.to_dtype(dt)?.transpose(1, 2)?;
            let wide = Tensor::randn(0f32, 1., (2, 40, 50), &d)?.to_dtype(dt)?;
            let bn = Tensor::randn(0f32, 1., (2, 2, 50), &d)?.to_dtype(dt)?.transpose(1, 2)?;
            for (x, y) in [(&a, &b), (&at, &b), (&wide, &bn)] {
                assert!(column_major(y));
                let diff = max_diff(
                    &bmm(x, y, &Copies::default(), Path::Fast)?,
                    &x.contiguous()?.matmul(&y.contiguous()?)?,
                )?;
                assert!(diff < 1e-4, "{:?} {:?}", x.layout(), y.layout());
            }
        }
        Ok(())
    }

    /// The products split between the threads: a tall one in bands of
    /// rows, a small one along a long inner dimension; and an empty one.
    #[test]
    fn split_products_match_candle() -> Result<()> {
        let d = Device::Cpu;
        // one tall product in bands of rows (where there are several
        // threads), the last band shorter, with a row- or column-major
        // right operand and a batch of two taken one product at a time
        for dt in [DType::F32, DType::F64] {
            let (m, k, n) = (MIN_BAND_ROWS * max_threads() + 3, 260, 130);
            assert!(max_threads() == 1 || row_bands(m, n, k) > 1);
            let a = Tensor::randn(0f32, 1., (2, m, k), &d)?.to_dtype(dt)?;
            let b = Tensor::randn(0f32, 1., (2, k, n), &d)?.to_dtype(dt)?;
            let bt = Tensor::randn(0f32, 1., (2, n, k), &d)?.to_dtype(dt)?.transpose(1, 2)?;
            for y in [&b, &bt] {
                let diff = max_diff(
                    &bmm(&a, y, &Copies::default(), Path::Fast)?,
                    &a.matmul(&y.contiguous()?)?,
                )?;
                assert!(diff < 1e-3, "bands: {:?}", y.layout());
            }
        }
        // one product of a small output and a long inner dimension: split
        // between the threads (where there are several), either layout of b
        for dt in [DType::F32, DType::F64] {
            let k = 20 * SPLIT_K_MIN + 17;
            assert!(max_threads() == 1 || split_k((1, 8, 6, k)) > 1);
            let a = Tensor::randn(0f32, 1., (1, 8, k), &d)?.to_dtype(dt)?;
            let b = Tensor::randn(0f32, 1., (1, k, 6), &d)?.to_dtype(dt)?;
            let bt = Tensor::randn(0f32, 1., (1, 6, k), &d)?.to_dtype(dt)?.transpose(1, 2)?;
            for y in [&b, &bt] {
                let diff = max_diff(
                    &bmm(&a, y, &Copies::default(), Path::Fast)?,
                    &a.matmul(&y.contiguous()?)?,
                )?;
                assert!(diff < 1e-3, "split-k {dt:?}: {diff}");
            }
        }
        let e = Tensor::zeros((8, 3, 0), DType::F32, &d)?;
        let f = Tensor::zeros((8, 0, 2), DType::F32, &d)?;
        assert_eq!(bmm(&e, &f, &Copies::default(), Path::Fast)?.dims(), &[8, 3, 2]);
        Ok(())
    }
}
