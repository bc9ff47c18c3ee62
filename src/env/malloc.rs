//! glibc's malloc, tuned to keep a graph's working memory between runs.
//!
//! A graph's values are a few large buffers, allocated and freed on every
//! run. glibc maps buffers above its mmap threshold afresh and unmaps them
//! when freed, and returns free memory at the top of its heap to the
//! kernel once it exceeds the trim threshold (twice the largest buffer
//! freed so far); either way the next run faults every page in again and
//! the kernel zeroes it. The torch.func tutorial's ensemble of ten MLPs
//! took 360 page faults a call that way, and ran no faster batched than
//! as a loop over the models. So before a graph runs, the thresholds are
//! set so that buffers up to 2 MiB (glibc's own ceiling for its dynamic
//! threshold) always come from the heap, and free memory up to the
//! largest planned peak run so far (at least 64 MiB) stays in the
//! process: memory the process held at its peak anyway, never more.
//! Larger buffers stay mapped afresh: `kernels` asks for huge pages for
//! them, so they fault in 2 MiB at a time rather than 4 KiB.
//!
//! Only glibc's malloc is touched, and only its thresholds; a program
//! with a global allocator of its own (mimalloc, jemalloc) is unaffected.
//! `CANDLE_FUNC_MALLOC=system` leaves glibc's defaults alone.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The trim threshold set so far (0: not yet, or opted out).
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// The smallest amount of free memory kept.
const MIN_KEPT: usize = 64 << 20;

/// Buffers up to this size come from the heap (glibc's own maximum for
/// its dynamic threshold on 64-bit targets).
const HEAP_BUFFERS: usize = 2 << 20;

/// Keeps at least `peak` bytes of freed memory in the process.
pub(crate) fn keep(peak: usize) {
    let want = peak.max(MIN_KEPT);
    let kept = KEPT.load(Ordering::Relaxed);
    if kept >= want || kept == usize::MAX {
        return;
    }
    if kept == 0 && super::vars::malloc_system() {
        KEPT.store(usize::MAX, Ordering::Relaxed);
        return;
    }
    if KEPT.fetch_max(want, Ordering::Relaxed) < want {
        set_thresholds(want);
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds(trim: usize) {
    let clamp = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only changes glibc's tuning parameters (it takes the
    // arenas' locks itself and is safe to call from any thread at any
    // time); no memory is touched. Exercised by every test that runs a
    // graph on Linux.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, clamp(HEAP_BUFFERS));
        libc::mallopt(libc::M_TRIM_THRESHOLD, clamp(trim));
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds(_trim: usize) {}

/// Returns the free pages of glibc's heap to the kernel, so that the
/// process's resident memory read next is what it holds live (the memory
/// a trainer's plan starts from) rather than what earlier graphs freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn trim() {
    // SAFETY: malloc_trim only gives free pages back to the kernel (it
    // takes the arenas' locks itself and moves no live allocation); safe
    // from any thread at any time. Exercised by tests/dp_memory.rs, whose
    // trainers plan under a memory limit.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn trim() {}
