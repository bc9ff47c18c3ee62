//! What it costs to hand a kernel's work to a second thread, per size: the
//! crate's CPU kernels split a pass into one job per thread, and this
//! compares running it on the calling thread alone, on scoped threads
//! spawned per call (what the kernels did before), and on rayon's pool (what
//! they do now, the pool gemm already runs on). Two passes: a memory-bound
//! one (an epilogue's `max(x * a + b, 0)`) and a compute-bound one (a few
//! multiply-adds per element, like a small GEMM's inner loop).
//!
//! ```text
//! cargo run --release --example threads
//! ```
//! Medians of 51 calls in microseconds; the three ways take turns per size.
mod common;

use std::time::Instant;

/// One element's work: `rounds` multiply-adds.
fn pass(src: &[f32], dst: &mut [f32], rounds: usize) {
    for (d, &s) in dst.iter_mut().zip(src) {
        let mut v = s;
        for _ in 0..rounds {
            v = v * 1.0001 + 0.5;
        }
        *d = v.max(0.0);
    }
}

fn jobs<'a>(src: &'a [f32], dst: &'a mut [f32], threads: usize) -> impl Iterator<Item = (&'a [f32], &'a mut [f32])> {
    let per = src.len().div_ceil(threads);
    src.chunks(per).zip(dst.chunks_mut(per))
}

fn spawned(src: &[f32], dst: &mut [f32], threads: usize, rounds: usize) {
    std::thread::scope(|scope| {
        for (s, d) in jobs(src, dst, threads) {
            scope.spawn(move || pass(s, d, rounds));
        }
    });
}

fn pooled(src: &[f32], dst: &mut [f32], threads: usize, rounds: usize) {
    rayon::scope(|scope| {
        for (s, d) in jobs(src, dst, threads) {
            scope.spawn(move |_| pass(s, d, rounds));
        }
    });
}

fn median_us(mut f: impl FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    let mut t: Vec<f64> = (0..51)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let threads = candle_core::utils::get_num_threads();
    println!("{threads} threads, {}", common::allocator());
    for (name, rounds) in [("memory-bound", 0usize), ("compute-bound (16 fma/elem)", 16)] {
        println!("\n{name}: elements, one thread, spawned, pool (µs), pool / one");
        for p in (12..=24).step_by(2) {
            let n = 1usize << p;
            let src = vec![1.0f32; n];
            let mut dst = vec![0.0f32; n];
            let one = median_us(|| pass(&src, &mut dst, rounds));
            let spawn = median_us(|| spawned(&src, &mut dst, threads, rounds));
            let pool = median_us(|| pooled(&src, &mut dst, threads, rounds));
            println!("  2^{p:<2} {one:10.1} {spawn:10.1} {pool:10.1}   {:.2}", pool / one);
        }
    }
}
