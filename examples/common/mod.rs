//! Shared by the examples: the digits data set and the small CNN they train.
#![allow(dead_code)]

pub mod digits;
pub mod fortunes;
pub mod models;
pub mod ntk;
pub mod profile;

/// Every example runs under mimalloc, as the README recommends for
/// batched graphs; `--features system-alloc` keeps the system allocator.
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its `mimalloc.h` enum; the sys
/// crate names the options around it, 14 and 16, but not this one).
#[cfg(not(feature = "system-alloc"))]
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps memory mimalloc frees in the process instead of returning it to
/// the kernel a second later (`MIMALLOC_PURGE_DELAY=-1`, set here since the
/// variable is read before `main`): a graph frees and reallocates the same
/// large buffers every run, and each purged one faulted in again page by
/// page (a Qwen2-0.5B LoRA step's 311 MB logits and their gradient: 7.1 s
/// a step against 5.8 with the memory kept). The process keeps what it
/// held at its peak anyway, as the library already does with glibc's
/// malloc (`interp::malloc`). Left alone when the option's value is not
/// one of mimalloc's defaults (10 ms in version 2, 1000 in 3: another
/// numbering) or the variable is set.
pub fn keep_freed_memory() {
    #[cfg(not(feature = "system-alloc"))]
    {
        use libmimalloc_sys::{mi_option_get, mi_option_set};
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: mi_option_get and mi_option_set read and write one of
        // mimalloc's option values (an atomic); no memory is touched.
        // Every benchmark example runs it.
        unsafe {
            // mimalloc 2's default and mimalloc 3's
            if matches!(mi_option_get(MI_OPTION_PURGE_DELAY), 10 | 1000) {
                mi_option_set(MI_OPTION_PURGE_DELAY, -1);
            }
        }
    }
}

/// Makes mimalloc return freed memory to the system at once, for a run
/// whose resident peak is held to a memory limit: the crate's plans count
/// what is live, and memory an allocator keeps after it is freed is not.
/// [`keep_freed_memory`] then leaves the setting alone.
pub fn return_freed_memory() {
    #[cfg(not(feature = "system-alloc"))]
    {
        use libmimalloc_sys::mi_option_set;
        // SAFETY: as in keep_freed_memory; run by bench_llm under a limit.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
}

/// The global allocator this example was built with, for its printout.
pub fn allocator() -> &'static str {
    if cfg!(feature = "system-alloc") {
        "the system allocator"
    } else {
        "mimalloc"
    }
}

use candle_func::nn::{self, Activation, ConvConfig, MaxPool2d, Sequential};
use candle_nn::VarBuilder;

/// A small CNN for 8x8 digits: conv 1->16 k3 p1, tanh, max-pool 2,
/// conv 16->32 k3 p1, tanh, max-pool 2, linear 128->10. Tanh rather than
/// ReLU, as is usual for DP-SGD (bounded activations suit clipping).
pub fn digits_cnn(vb: VarBuilder) -> candle_func::Result<Sequential> {
    let pad = ConvConfig {
        padding: 1,
        ..Default::default()
    };
    Ok(nn::seq()
        .add(nn::conv2d(1, 16, 3, pad, vb.pp("conv1"))?)
        .add(Activation::Tanh)
        .add(MaxPool2d { kernel: 2, stride: 2 })
        .add(nn::conv2d(16, 32, 3, pad, vb.pp("conv2"))?)
        .add(Activation::Tanh)
        .add(MaxPool2d { kernel: 2, stride: 2 })
        .add(nn::Flatten)
        .add(nn::linear(128, 10, vb.pp("fc"))?))
}

/// Parses `--name value` from the command line.
/// The device the benchmarks run on: `CANDLE_FUNC_DEVICE=cuda` (a build
/// with `--features cuda`) for the first GPU, the CPU otherwise, as the
/// fixture tests read it.
/// One device for the whole process: each `Device::new_cuda` is a device
/// (and stream) of its own, whose tensors do not mix with another's.
pub fn device() -> candle_core::Device {
    static DEVICE: std::sync::OnceLock<candle_core::Device> = std::sync::OnceLock::new();
    let make = || match std::env::var("CANDLE_FUNC_DEVICE").as_deref() {
        Ok("cuda") => candle_core::Device::new_cuda(0).unwrap_or_else(|e| panic!("CANDLE_FUNC_DEVICE=cuda: {e}")),
        Ok("cpu") | Err(_) => candle_core::Device::Cpu,
        Ok(other) => panic!("CANDLE_FUNC_DEVICE={other}: cpu or cuda"),
    };
    DEVICE.get_or_init(make).clone()
}

/// Waits for the device's queued work (a GPU's kernels run after the call
/// that launched them returns), so a timer stopped after it counts them.
pub fn sync() {
    device().synchronize().expect("device synchronize");
}

pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median milliseconds of `reps` runs of `f`, after one warm-up run (which
/// also traces a transformed function's graph).
pub fn median_ms<E>(reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    f()?;
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let s = std::time::Instant::now();
        f()?;
        sync();
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

/// The process's peak resident memory so far (`VmHWM`), in MiB (NaN where
/// `/proc` cannot say).
pub fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Times `run`: the first call (tracing, planning) and the median of
/// `reps` more, in milliseconds, and prints the benchmarks' line `RESULT
/// ours_<variant> median_ms .. first_ms .. peak_rss_mib .. plan_mib ..
/// threads ..` (`plan` in bytes, from `plan()` after the runs).
pub fn report<E>(
    variant: &str,
    reps: usize,
    mut run: impl FnMut() -> Result<(), E>,
    plan: impl FnOnce() -> Result<usize, E>,
) -> Result<(), E> {
    keep_freed_memory();
    let start = std::time::Instant::now();
    run()?;
    let first = start.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let s = std::time::Instant::now();
        run()?;
        times.push(s.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let plan = plan()?;
    println!(
        "RESULT ours_{variant} median_ms {:.2} first_ms {first:.1} peak_rss_mib {:.1} plan_mib {:.1} threads {}",
        times[times.len() / 2],
        peak_rss_mib(),
        plan as f64 / (1 << 20) as f64,
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    Ok(())
}
