//! Hand-written compute kernels that candle lacks or that per-sample
//! gradients need in explicit form: candle `CustomOp`s on concrete
//! tensors, nothing symbolic (the layer below the rules).
//!
//! * [`mod@unfold`]: im2col / col2im ([`unfold::unfold`] / [`unfold::fold`])
//!   for 1-, 2- and 3-d windows and a convolution built on them
//!   ([`unfold::conv_unfold`], the grouped and the generic lowering).
//! * [`rows`]: the same im2col with one row per output position
//!   ([`rows::unfold_rows`]) and its adjoint, so that a convolution and its
//!   gradients over a whole batch are single GEMMs.
//! * [`shift`]: stride-1 convolutions and both their gradients as one GEMM
//!   per kernel tap on the input's own grid, with no im2col at all.
//! * [`bmm`]: batched matrix products with the batch spread over threads
//!   (candle splits each small product over all threads instead), reading
//!   stacked and transposed operands in place.
//! * [`epilogue`]: a bias add and/or a ReLU applied in place to a fresh
//!   product's output (the fused nodes' second half).
//! * [`outer`]: batched outer products (`[B, M, 1] @ [B, 1, N]`), the
//!   per-sample weight gradient of a linear layer.
//! * [`pool`]: 2D max-pooling forward, its gradient and the gradient's
//!   adjoint, for any kernel and stride.
//! * [`transpose`]: contiguous copies of batched transposes (candle copies
//!   those element by element).
//! * [`fastmath`]: vectorised exp, tanh, erf and GELU and its gradient;
//!   [`softmax`]: the last-axis softmax; [`scale`]: one factor per row (DP's
//!   clip factors).
//! * [`compare`]: a tensor against a scalar (ReLU's gradient mask).
//! * `copies`: the count of bytes a run copied to change a layout.
//!
//! Each is a multi-threaded CPU kernel for f32/f64 with a generic
//! candle-op fallback on every other device and dtype.

pub(crate) mod adam;
pub(crate) mod attention;
pub mod bmm;
pub mod compare;
pub(crate) mod copies;
pub mod epilogue;
pub mod fastmath;
pub mod outer;
pub mod pool;
pub mod rows;
pub mod scale;
pub(crate) mod scatter;
pub(crate) mod segments;
pub mod shift;
pub mod softmax;
pub mod transpose;
pub mod unfold;
pub(crate) mod widen;
pub(crate) mod zip;

use candle_core::{bail, DType, Layout, Result, Tensor};
use std::mem::MaybeUninit;
use std::ops::AddAssign;
use std::sync::OnceLock;

/// Element types with a CPU kernel. `Default` is the zero used for padding.
pub(crate) trait Elem:
    Copy
    + Default
    + AddAssign
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + Send
    + Sync
    + 'static
{
}
impl Elem for f32 {}
impl Elem for f64 {}

/// Below this many elements (read + written, ~1 MiB of f32) per thread,
/// spawning costs more than it saves: these kernels are memory-bound, and
/// on a 2-vCPU machine a second thread only paid off above this size.
pub(crate) const MIN_ELEMS_PER_THREAD: usize = 1 << 18;

/// `candle_core::utils::get_num_threads()`, read once: it probes the CPU
/// topology on every call (~20 µs on Linux), more than a small kernel takes.
pub(crate) fn max_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// Calls `f(i, block_i)` for every `block`-sized block of `dst`, spread
/// over up to `get_num_threads()` threads (`run_jobs`) when `work` (elements read
/// and written in all) is large enough to pay for them. Blocks are
/// independent, so no synchronisation is needed.
pub(crate) fn par_blocks_mut<T: Send>(dst: &mut [T], block: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if block == 0 || dst.is_empty() {
        return;
    }
    let blocks = dst.len() / block;
    let threads = max_threads().min(blocks).min(work / MIN_ELEMS_PER_THREAD).max(1);
    let per = blocks.div_ceil(threads);
    let run = |first: usize, d: &mut [T]| {
        for (i, b) in d.chunks_exact_mut(block).enumerate() {
            f(first + i, b)
        }
    };
    let jobs: Vec<(usize, &mut [T])> = dst.chunks_mut(per * block).enumerate().collect();
    run_jobs(jobs, |(j, d)| run(j * per, d));
}

/// Elements per task of [`by_blocks`].
pub(crate) const BLOCK: usize = 1 << 14;

/// Calls `pass(start, d)` for each piece `d` of `dst` that starts at
/// element `start`: whole `BLOCK`s spread over threads when
/// `work_per_elem` times their length pays for them, then the tail.
pub(crate) fn by_blocks<O: Send>(dst: &mut [O], work_per_elem: usize, pass: impl Fn(usize, &mut [O]) + Sync) {
    in_blocks(dst, BLOCK, work_per_elem, pass)
}

/// [`by_blocks`] with blocks of `block` elements (a whole number of rows,
/// for a kernel that works row by row); `par_blocks_mut` takes whole
/// blocks only, so the tail is a piece of its own.
pub(crate) fn in_blocks<O: Send>(
    dst: &mut [O],
    block: usize,
    work_per_elem: usize,
    pass: impl Fn(usize, &mut [O]) + Sync,
) {
    let whole = dst.len() / block.max(1) * block;
    let (head, tail) = dst.split_at_mut(whole);
    par_blocks_mut(head, block, work_per_elem * whole, |i, d| pass(i * block, d));
    pass(whole, tail);
}

/// Runs `job(x)` for every `x` of `jobs` on rayon's pool, which gemm's
/// threads already are; the calling thread waits. A scoped thread spawned
/// per call cost about 45 µs on this crate's 2-vCPU benchmark machine and
/// waking a pool thread 10–30 µs (`examples/threads.rs` measures both per
/// size). The calling thread waits rather than taking a share: beside the
/// pool's threads it made one thread more than cores, and the pool's idle
/// spinning then slowed the conv3d net's step from 4.0 to 4.9 ms.
pub(crate) fn run_jobs<J: Send>(jobs: Vec<J>, job: impl Fn(J) + Sync) {
    if jobs.len() <= 1 {
        return jobs.into_iter().for_each(job);
    }
    let job = &job;
    rayon::scope(|scope| {
        for j in jobs {
            scope.spawn(move |_| job(j));
        }
    });
}

/// Buffers at least this large (bytes) ask for transparent huge pages.
const HUGE_MIN_BYTES: usize = 4 << 20;

/// Asks Linux to back the 2 MiB-aligned part of `v`'s allocation with
/// transparent huge pages before anything touches it. A kernel's output is
/// fresh memory, and faulting it in 4 KiB at a time cost more than the
/// kernel's own work: 302 MiB of per-sample linear gradients took 95 ms
/// with 4 KiB pages and 30 ms with 2 MiB ones on this crate's benchmark
/// machine. A no-op below `HUGE_MIN_BYTES`, off Linux, and where the
/// kernel refuses (the advice is only a hint, so its result is ignored).
fn advise_huge<T>(v: &mut Vec<T>) {
    let bytes = v.capacity() * std::mem::size_of::<T>();
    if bytes < HUGE_MIN_BYTES || !cfg!(target_os = "linux") {
        return;
    }
    const HUGE: usize = 1 << 21;
    let start = v.as_mut_ptr() as usize;
    let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
    if hi > lo {
        madvise_hugepage(lo, hi - lo);
    }
}

#[cfg(target_os = "linux")]
fn madvise_hugepage(addr: usize, len: usize) {
    // SAFETY: `[addr, addr + len)` lies inside one live allocation owned by
    // the caller's Vec (`advise_huge` rounds inwards to 2 MiB boundaries),
    // and MADV_HUGEPAGE changes only how the kernel backs those pages, never
    // their contents or mapping, so no Rust reference can observe it. Tested
    // by `kernels::tests::huge_buffers_read_and_write`.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn madvise_hugepage(_addr: usize, _len: usize) {}

/// An output buffer of `n` zeros for a kernel that only writes it
/// (`calloc`'d, so the pages are touched first by the kernel's threads).
pub(crate) fn output<T: Elem>(n: usize) -> Result<Vec<T>> {
    // Reserved fallibly first, then taken from `calloc` (`vec!` of zeros):
    // fresh pages come zeroed from the kernel, so the kernel writing its
    // output is the only pass over them.
    drop(reserve::<T>(n)?);
    let mut v = vec![T::default(); n];
    advise_huge(&mut v);
    Ok(v)
}

/// Room for `n` elements that a kernel writes in full before anything
/// reads them ([`product_into`]), in huge pages like [`output`]'s but not
/// zeroed: `calloc`'s zeroing is a serial pass (or, for fresh pages,
/// faults taken while the product's threads write) that costs as much as
/// a large product's own work on two threads. [`assume_written`] turns it
/// into the result.
pub(crate) fn output_uninit<T: Elem>(n: usize) -> Result<Vec<MaybeUninit<T>>> {
    let mut v = reserve::<MaybeUninit<T>>(n)?;
    advise_huge(&mut v);
    // SAFETY: the capacity is at least `n` (reserved above), and a
    // `MaybeUninit` element needs no initialisation.
    unsafe { v.set_len(n) };
    Ok(v)
}

/// The vector [`output_uninit`] gave, every element of it now written.
///
/// # Safety
/// Every element of `v` has been written.
pub(crate) unsafe fn assume_written<T: Elem>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: `MaybeUninit<T>` has `T`'s size and alignment, so the
    // allocation, length and capacity carry over; every element is
    // initialised (the caller's promise); `v` is not dropped.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
}

/// An empty vector with room for `n` elements; a request the allocator
/// cannot meet is an error rather than an abort.
fn reserve<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(n).is_err() {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        candle_core::bail!("out of memory: a kernel's buffer of {n} elements ({bytes} bytes) could not be allocated")
    }
    Ok(v)
}

/// `n` zeros, written out rather than taken from `calloc`, for a kernel
/// that accumulates (`+=`). A large `calloc` maps the shared zero page, so
/// reading before writing takes two faults per page, the second a
/// copy-on-write that flushes the TLB of every thread of the process; in a
/// VM those inter-processor interrupts made a 9 MiB max-pool gradient take
/// 20-35 ms instead of 3 (`perf record`: `do_wp_page` ->
/// `flush_tlb_mm_range`).
pub(crate) fn zeroed<T: Elem>(n: usize) -> Result<Vec<T>> {
    let mut v = reserve(n)?;
    advise_huge(&mut v);
    v.resize(n, T::default());
    Ok(v)
}

/// A matrix operand for [`product`]: a slice starting at its first element,
/// with its row and column strides (in elements).
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

/// One past the last element a `rows x cols` matrix at these strides
/// touches.
fn reach(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs + 1
}

/// `dst [m, n] = lhs [m, k] @ rhs [k, n]`, or `+=` with `accumulate`, by
/// gemm, `dst` at row and column strides `ds`. The one place the kernels
/// call gemm: it checks that every element gemm would touch lies inside
/// the slices it is given (a planning mistake panics instead of reading or
/// writing out of bounds).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product<T: Elem>(
    dst: &mut [T],
    ds: (usize, usize),
    lhs: Mat<T>,
    rhs: Mat<T>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    one: T,
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        assert!(reach(m, n, ds.0, ds.1) <= dst.len());
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * ds.0 + j * ds.1] = T::default();
                }
            }
        }
        return;
    }
    // SAFETY: `dst` is an initialised slice borrowed mutably for the call.
    unsafe {
        gemm_checked(
            dst.as_mut_ptr(),
            dst.len(),
            ds,
            lhs,
            rhs,
            (m, n, k),
            accumulate,
            one,
            par,
        )
    }
}

/// [`product`] into memory nothing has written yet (from
/// [`output_uninit`]): gemm writes every element of the contiguous
/// `[m, n]` block and reads none, so a kernel whose products cover its
/// whole output skips zeroing it first. Zeroing a fresh 12 MiB output
/// (`calloc`) made a `[2048, 384] @ [384, 1536]` product take 11.3 ms
/// instead of 7.4 on two threads. `k > 0`.
pub(crate) fn product_into<T: Elem>(
    dst: &mut [MaybeUninit<T>],
    lhs: Mat<T>,
    rhs: Mat<T>,
    (m, n, k): (usize, usize, usize),
    one: T,
    par: gemm::Parallelism,
) {
    assert!(k > 0 && dst.len() == m * n, "product_into: an [m, n] block with k > 0");
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: `dst` is borrowed mutably for the call and `MaybeUninit<T>`
    // has `T`'s layout; with `accumulate` false gemm only writes `dst`, and
    // it writes all `m n` elements of the contiguous block (k > 0).
    unsafe {
        gemm_checked(
            dst.as_mut_ptr().cast::<T>(),
            dst.len(),
            (n, 1),
            lhs,
            rhs,
            (m, n, k),
            false,
            one,
            par,
        )
    }
}

/// gemm into `dst_len` elements at `dst`, after checking that every
/// element it touches lies inside `dst` and the operands.
///
/// # Safety
/// `dst` points to `dst_len` elements borrowed mutably for the call, all
/// initialised if `accumulate` (gemm reads `dst` only then).
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_checked<T: Elem>(
    dst: *mut T,
    dst_len: usize,
    ds: (usize, usize),
    lhs: Mat<T>,
    rhs: Mat<T>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    one: T,
    par: gemm::Parallelism,
) {
    assert!(reach(m, k, lhs.rs, lhs.cs) <= lhs.data.len());
    assert!(reach(k, n, rhs.rs, rhs.cs) <= rhs.data.len());
    assert!(reach(m, n, ds.0, ds.1) <= dst_len);
    // SAFETY: the assertions above keep every element gemm reads or writes
    // inside `lhs`, `rhs` and `dst`; the caller borrows `dst` mutably and
    // the operands immutably, so nothing else touches them during the call.
    // With `accumulate` false gemm never reads `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            ds.1 as isize,
            ds.0 as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            one,
            one,
            false,
            false,
            false,
            par,
        )
    }
}

/// The slice a contiguous layout covers, for a kernel that writes its
/// operand in place (an epilogue, an optimiser's update).
pub(crate) fn own_slice_mut<'a, T>(op: &str, v: &'a mut [T], l: &Layout) -> Result<&'a mut [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) if b <= v.len() => Ok(&mut v[a..b]),
        _ => bail!("{op}: expected a contiguous output, got {l:?}"),
    }
}

/// The contiguous slice a layout describes (the kernels index planes
/// directly, so they need it; the wrappers call `.contiguous()` first).
pub(crate) fn contiguous_slice<'a, T>(op: &str, data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    if layout.shape().elem_count() == 0 {
        // an empty view may start past its (empty) storage
        return Ok(&data[..0]);
    }
    match layout.contiguous_offsets() {
        Some((start, end)) if start <= end && end <= data.len() => Ok(&data[start..end]),
        Some((start, end)) => bail!(
            "{op}: the layout's elements {start}..{end} lie outside a storage of {}",
            data.len()
        ),
        None => bail!(
            "{op}: the CPU kernel needs a contiguous input, got shape {:?} strides {:?}",
            layout.dims(),
            layout.stride()
        ),
    }
}

pub(crate) use crate::env::Path;

/// What a kernel that may copy operands needs of the run: the tally of
/// layout copies and the path.
pub(crate) type Kx<'a> = (&'a copies::Copies, Path);

/// Whether a dtype is half precision (f16, bf16).
pub(crate) fn is_half(dt: DType) -> bool {
    matches!(dt, DType::F16 | DType::BF16)
}

/// The dtype values of `dt` are summed, noised and stepped in: f32 for
/// half precision (as PyTorch accumulates; summed in bf16, 49,152 ones
/// make 256), `dt` itself otherwise.
pub(crate) fn accumulation_dtype(dt: DType) -> DType {
    if is_half(dt) {
        DType::F32
    } else {
        dt
    }
}

/// Whether the hand-written kernels handle this tensor on `path`.
pub(crate) fn has_cpu_kernel(t: &Tensor, path: Path) -> bool {
    path == Path::Fast && t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The largest absolute difference between two tensors of one shape, as
/// f64 (the kernels' tests compare against candle or a generic path).
#[cfg(test)]
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims());
    (a - b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exercises the `madvise` path: buffers above the huge-page threshold
    /// (and one below) are zero, fully writable and read back intact.
    #[test]
    fn huge_buffers_read_and_write() {
        for n in [1000, (HUGE_MIN_BYTES / 4) + 12345, 3 * (1 << 20) + 7] {
            for mut v in [output::<f32>(n).unwrap(), zeroed::<f32>(n).unwrap()] {
                assert_eq!(v.len(), n);
                assert!(v.iter().all(|&x| x == 0.0));
                for (i, x) in v.iter_mut().enumerate() {
                    *x = i as f32;
                }
                assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
            }
        }
        // a request no allocator can meet is an error, not an abort
        let e = output::<f32>(usize::MAX / 8).unwrap_err().to_string();
        assert!(e.contains("out of memory"), "{e}");
        assert!(zeroed::<f64>(usize::MAX / 16).is_err());
    }
}
