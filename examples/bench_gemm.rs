//! The products of a transformer at real size, alone: each shape's rate in
//! GFLOP/s through the crate's kernel (a traced `matmul`, as a graph runs
//! it: a fresh output each call) and through candle's `Tensor::matmul`.
//! The shapes are MiniLM's at B=32, T=64 (2048 rows of hidden 384, FFN
//! 1536) and Qwen2-0.5B's at B=4, T=128 (512 rows of hidden 896, FFN 4864,
//! vocabulary 151,936), each in the layouts a training step takes: `nn`
//! (`x @ W`), `nt` (`x @ W^T`, a linear layer) and `tn` (`x^T @ dy`, a
//! weight's gradient).
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release --example bench_gemm
//! ```
//!
//! Prints `RATE <impl> <m>x<k>x<n> <layout> <GFLOP/s>` lines;
//! `benches/peers/side_by_side_gemm.py` runs it beside PyTorch's `mm`
//! (oneDNN/MKL) and NumPy's (OpenBLAS) at one and two threads and prints
//! the table in `docs/benchmarks.md` ("The products alone").

mod common;

use candle_core::{Device, Tensor};
use candle_func::{jit, Tracer};
use std::time::Instant;

/// `(m, k, n, layout)`: an `[m, k] @ [k, n]` product with its operands
/// stored as `layout` says.
const SHAPES: [(usize, usize, usize, &str); 11] = [
    (2048, 384, 384, "nt"),
    (2048, 384, 1536, "nt"),
    (2048, 1536, 384, "nt"),
    (384, 2048, 1536, "tn"),
    (512, 896, 896, "nt"),
    (512, 896, 128, "nt"),
    (512, 896, 4864, "nt"),
    (512, 4864, 896, "nt"),
    (896, 512, 4864, "tn"),
    (512, 896, 4864, "nn"),
    (512, 896, 151936, "nt"),
];

/// Median seconds of `f` over enough calls for about 2 GFLOP (3 at least).
fn median(flops: f64, mut f: impl FnMut() -> candle_func::Result<()>) -> candle_func::Result<f64> {
    f()?;
    let reps = ((2e9 / flops) as usize).max(3);
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[reps / 2])
}

/// The operands of `[m, k] @ [k, n]` stored as `layout` says (a
/// transposed operand is a transposed view of a row-major tensor).
fn operands(m: usize, k: usize, n: usize, layout: &str) -> candle_func::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let a = match layout.as_bytes()[0] {
        b't' => Tensor::randn(0f32, 1.0, (k, m), &dev)?.t()?,
        _ => Tensor::randn(0f32, 1.0, (m, k), &dev)?,
    };
    let b = match layout.as_bytes()[1] {
        b't' => Tensor::randn(0f32, 1.0, (n, k), &dev)?.t()?,
        _ => Tensor::randn(0f32, 1.0, (k, n), &dev)?,
    };
    Ok((a, b))
}

fn main() -> candle_func::Result<()> {
    common::keep_freed_memory();
    let ours = jit(|a: Tracer, b: Tracer| a.matmul(&b));
    for (m, k, n, layout) in SHAPES {
        let (a, b) = operands(m, k, n, layout)?;
        let flops = 2.0 * (m * k * n) as f64;
        let t_ours = median(flops, || ours.call((&a, &b)).map(|_| ()))?;
        let t_candle = median(flops, || a.matmul(&b).map(|_| ()).map_err(Into::into))?;
        for (name, t) in [("ours", t_ours), ("candle", t_candle)] {
            println!("RATE {name} {m}x{k}x{n} {layout} {:.1}", flops / t / 1e9);
        }
    }
    Ok(())
}
