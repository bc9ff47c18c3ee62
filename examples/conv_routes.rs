//! Times the convolution batching routes side by side, in one run, on the
//! ensemble fixtures' shapes and on a realistic ensemble of the PyTorch
//! tutorial CNN's convolutions, and times candle's own conv2d against
//! unfold + matmul for unbatched convolutions.
//!
//!     cargo run --release --example conv_routes [-- --reps N]
//!
//! Prints markdown tables of medians and ratios; only ratios measured in
//! the same run mean anything on a shared machine.

mod common;

use candle_core::{Device, Tensor};
use candle_func::{jit, vmap, ConvRoute, Tracer};

struct Shape {
    name: &'static str,
    models: usize,
    x: Vec<usize>, // per-model input [N, Cin, H, W]
    w: Vec<usize>, // [Cout, Cin, k, k]
}

fn routes_table(shapes: &[Shape], reps: usize) -> candle_func::Result<()> {
    println!("\n## Both batched: M models, each on its own batch\n");
    println!("| shape | Grouped ms | Unfold ms | Loop ms | candle loop ms | Loop / Unfold | Grouped / Unfold |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let dev = Device::Cpu;
    for s in shapes {
        let xs = Tensor::randn(0f32, 1., [&[s.models], &s.x[..]].concat(), &dev)?;
        let ws = Tensor::randn(0f32, 1., [&[s.models], &s.w[..]].concat(), &dev)?;
        let mut ms = Vec::new();
        for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
            let f = vmap(|x: Tracer, w: Tracer| x.conv2d(&w, 0, 1, 1, 1)).conv_route(route);
            ms.push(common::median_ms(reps, || f.call((&xs, &ws)).map(|_| ()))?);
        }
        let candle_loop = common::median_ms(reps, || -> candle_core::Result<()> {
            let ys = (0..s.models)
                .map(|m| xs.get(m)?.conv2d(&ws.get(m)?, 0, 1, 1, 1))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::stack(&ys, 0).map(|_| ())
        })?;
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
            s.name,
            ms[0],
            ms[1],
            ms[2],
            candle_loop,
            ms[2] / ms[1],
            ms[0] / ms[1]
        );
    }
    Ok(())
}

/// (label, input shape, weight shape, stride, padding)
type Unbatched<'a> = (&'a str, Vec<usize>, Vec<usize>, usize, usize);

fn unbatched_table(shapes: &[Unbatched], reps: usize) -> candle_func::Result<()> {
    println!("\n## Unbatched convolution: candle's conv2d against this crate's (CPU kernels)\n");
    println!("| shape | candle conv2d ms | ours ms | candle / ours |");
    println!("| --- | --- | --- | --- |");
    let dev = Device::Cpu;
    for (name, x, w, stride, pad) in shapes {
        let x = Tensor::randn(0f32, 1., x.as_slice(), &dev)?;
        let w = Tensor::randn(0f32, 1., w.as_slice(), &dev)?;
        let (pad, stride) = (*pad, *stride);
        let ours = jit(move |x: Tracer, w: Tracer| x.conv2d(&w, pad, stride, 1, 1));
        let candle = common::median_ms(reps, || x.conv2d(&w, pad, stride, 1, 1).map(|_| ()))?;
        let unfold = common::median_ms(reps, || ours.call((&x, &w)).map(|_| ()))?;
        println!("| {name} | {candle:.3} | {unfold:.3} | {:.2} |", candle / unfold);
    }
    Ok(())
}

fn main() -> candle_func::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(21);
    println!(
        "conv routes, f32, {} threads, median of {reps}",
        candle_core::utils::get_num_threads()
    );
    routes_table(
        &[
            Shape {
                name: "ens_cnn_own c1: 3 x [3,1,10,10] * [8,1,3,3]",
                models: 3,
                x: vec![3, 1, 10, 10],
                w: vec![8, 1, 3, 3],
            },
            Shape {
                name: "ens_cnn_shared c2: 4 x [5,8,8,8] * [8,8,3,3]",
                models: 4,
                x: vec![5, 8, 8, 8],
                w: vec![8, 8, 3, 3],
            },
            Shape {
                name: "tutorial conv1: 10 x [64,1,28,28] * [32,1,3,3]",
                models: 10,
                x: vec![64, 1, 28, 28],
                w: vec![32, 1, 3, 3],
            },
            Shape {
                name: "tutorial conv2: 10 x [64,32,26,26] * [64,32,3,3]",
                models: 10,
                x: vec![64, 32, 26, 26],
                w: vec![64, 32, 3, 3],
            },
            Shape {
                name: "per-sample: 64 x [1,32,26,26] * [64,32,3,3]",
                models: 64,
                x: vec![1, 32, 26, 26],
                w: vec![64, 32, 3, 3],
            },
        ],
        reps,
    )?;
    unbatched_table(
        &[
            (
                "[64,1,28,28] * [32,1,3,3]",
                vec![64, 1, 28, 28],
                vec![32, 1, 3, 3],
                1,
                0,
            ),
            (
                "[64,32,26,26] * [64,32,3,3]",
                vec![64, 32, 26, 26],
                vec![64, 32, 3, 3],
                1,
                0,
            ),
            (
                "[256,1,28,28] * [16,1,8,8] s2 p3",
                vec![256, 1, 28, 28],
                vec![16, 1, 8, 8],
                2,
                3,
            ),
            (
                "[256,16,13,13] * [32,16,4,4] s2",
                vec![256, 16, 13, 13],
                vec![32, 16, 4, 4],
                2,
                0,
            ),
            ("[5,8,8,8] * [8,8,3,3]", vec![5, 8, 8, 8], vec![8, 8, 3, 3], 1, 0),
        ],
        reps,
    )
}
