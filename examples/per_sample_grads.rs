//! Per-sample gradients, the crate's version of PyTorch's per-sample-gradients
//! tutorial: the tutorial's CNN (conv 1->32 k3, conv 32->64 k3, max-pool 2,
//! linear 9216->128->10) on a batch of 64 random 28x28 inputs. Computes the
//! per-sample gradients with `vmap(grad)` through every conv route and with a
//! per-example loop, prints the largest difference, and times each side by
//! side against one ordinary batched gradient step of the same model.
//!
//!     cargo run --release --example per_sample_grads
//!     cargo run --release --example per_sample_grads -- --model opacus --batch 256
//!
//! `--model opacus` is the Opacus MNIST CNN (conv 1->16 k8 s2 p3, max-pool k2
//! s1, conv 16->32 k4 s2, max-pool k2 s1, linear 512->32->10). `--reps N`
//! sets the number of timed repetitions (median reported).

mod common;

use candle_core::{Device, Tensor};
use candle_func::nn::{self, functional_call, Module, Reduction, Sequential};
use candle_func::{grad, jit, vmap, ConvRoute, Result, Tracer};
use common::median_ms;
use common::models::{build, cnn_o, cnn_t};
use std::collections::BTreeMap;

type Params = BTreeMap<String, Tensor>;
type SymParams = BTreeMap<String, Tracer>;

/// Mean cross-entropy of `model` on a batch.
fn batch_loss(model: &Sequential, p: &SymParams, x: &Tracer, y: &Tracer) -> Result<Tracer> {
    nn::cross_entropy(&functional_call(model, p, x)?, y, Reduction::Mean)
}

fn max_diff(a: &Params, b: &Params) -> Result<f32> {
    let mut m = 0f32;
    for (k, t) in a {
        let d = (t - &b[k])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        m = m.max(d);
    }
    Ok(m)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let dev = Device::Cpu;
    let (name, (_varmap, model)) = match opt("--model").as_deref() {
        Some("opacus") => ("Opacus MNIST CNN", build(cnn_o)?),
        _ => ("PyTorch-tutorial CNN", build(cnn_t)?),
    };
    let params = model.params();
    let batch: usize = opt("--batch").and_then(|v| v.parse().ok()).unwrap_or(64);
    let reps: usize = opt("--reps").and_then(|v| v.parse().ok()).unwrap_or(5);
    let xs = Tensor::randn(0f32, 1., (batch, 1, 28, 28), &dev)?;
    let ys = Tensor::from_vec(
        (0..batch as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(),
        batch,
        &dev,
    )?;
    println!(
        "{name}, batch {batch}, f32, {} threads, median of {reps}",
        candle_core::utils::get_num_threads()
    );

    // One example's loss (the example gets a batch axis of one, as in the tutorial).
    let loss = |p: SymParams, x: Tracer, y: Tracer| batch_loss(&model, &p, &x.unsqueeze(0)?, &y.unsqueeze(0)?);
    // The ordinary batched step: the gradient of the mean loss over the batch.
    let batched = grad(|p: SymParams, x: Tracer, y: Tracer| batch_loss(&model, &p, &x, &y));
    let step_ms = median_ms(reps, || batched.call((&params, &xs, &ys)).map(|_| ()))?;

    // The per-example loop: the same gradient, one example at a time.
    let one = jit(grad(loss));
    let per_example = || -> Result<Params> {
        let mut parts: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for i in 0..batch {
            let g = one.call((&params, xs.get(i)?, ys.get(i)?))?;
            for (k, t) in g {
                parts.entry(k).or_default().push(t);
            }
        }
        parts.into_iter().map(|(k, v)| Ok((k, Tensor::stack(&v, 0)?))).collect()
    };
    let reference = per_example()?;
    let loop_ms = median_ms(reps.min(3), || per_example().map(|_| ()))?;

    println!("\n| method | median ms | / batched step | loop / this | max diff vs loop |");
    println!("| --- | --- | --- | --- | --- |");
    println!("| batched gradient step (not per-sample) | {step_ms:.1} | 1.00 | | |");
    println!(
        "| per-example loop | {loop_ms:.1} | {:.2} | 1.00 | 0 |",
        loop_ms / step_ms
    );
    for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
        let psg = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).conv_route(route);
        let g = psg.call((&params, &xs, &ys))?;
        let diff = max_diff(&g, &reference)?;
        let ms = median_ms(reps, || psg.call((&params, &xs, &ys)).map(|_| ()))?;
        println!(
            "| vmap(grad), {route:?} route | {ms:.1} | {:.2} | {:.2} | {diff:.1e} |",
            ms / step_ms,
            loop_ms / ms
        );
    }
    Ok(())
}
