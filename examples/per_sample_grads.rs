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

use candle_core::{Device, Tensor};
use candle_func::{grad, jit, vmap, ConvRoute, Result, Tracer};
use std::collections::BTreeMap;
use std::time::Instant;

type Params = BTreeMap<String, Tensor>;
type SymParams = BTreeMap<String, Tracer>;

struct Model {
    name: &'static str,
    params: Params,
    forward: fn(&SymParams, &Tracer) -> Result<Tracer>,
}

fn init(shapes: &[(&str, &[usize])], dev: &Device) -> Result<Params> {
    let mut p = BTreeMap::new();
    for (name, shape) in shapes {
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        let t = (Tensor::randn(0f32, 1., *shape, dev)? / (fan_in as f64).sqrt())?;
        p.insert(name.to_string(), t);
    }
    Ok(p)
}

fn linear(p: &SymParams, name: &str, x: &Tracer) -> Result<Tracer> {
    x.matmul(&p[&format!("{name}.weight")].t()?)?
        .add(&p[&format!("{name}.bias")])
}

fn conv(p: &SymParams, name: &str, x: &Tracer, pad: usize, stride: usize) -> Result<Tracer> {
    let b = &p[&format!("{name}.bias")];
    let y = x.conv2d(&p[&format!("{name}.weight")], pad, stride, 1, 1)?;
    y.add(&b.reshape((b.dims()[0], 1, 1))?)
}

fn tutorial(dev: &Device) -> Result<Model> {
    let params = init(
        &[
            ("conv1.weight", &[32, 1, 3, 3]),
            ("conv1.bias", &[32]),
            ("conv2.weight", &[64, 32, 3, 3]),
            ("conv2.bias", &[64]),
            ("fc1.weight", &[128, 9216]),
            ("fc1.bias", &[128]),
            ("fc2.weight", &[10, 128]),
            ("fc2.bias", &[10]),
        ],
        dev,
    )?;
    let forward = |p: &SymParams, x: &Tracer| {
        let h = conv(p, "conv1", x, 0, 1)?.relu()?;
        let h = conv(p, "conv2", &h, 0, 1)?.relu()?.max_pool2d(2)?.flatten_from(1)?;
        linear(p, "fc2", &linear(p, "fc1", &h)?.relu()?)
    };
    Ok(Model {
        name: "PyTorch-tutorial CNN",
        params,
        forward,
    })
}

fn opacus(dev: &Device) -> Result<Model> {
    let params = init(
        &[
            ("conv1.weight", &[16, 1, 8, 8]),
            ("conv1.bias", &[16]),
            ("conv2.weight", &[32, 16, 4, 4]),
            ("conv2.bias", &[32]),
            ("fc1.weight", &[32, 512]),
            ("fc1.bias", &[32]),
            ("fc2.weight", &[10, 32]),
            ("fc2.bias", &[10]),
        ],
        dev,
    )?;
    let forward = |p: &SymParams, x: &Tracer| {
        let h = conv(p, "conv1", x, 3, 2)?.relu()?.max_pool2d_with_stride(2, 1)?;
        let h = conv(p, "conv2", &h, 0, 2)?
            .relu()?
            .max_pool2d_with_stride(2, 1)?
            .flatten_from(1)?;
        linear(p, "fc2", &linear(p, "fc1", &h)?.relu()?)
    };
    Ok(Model {
        name: "Opacus MNIST CNN",
        params,
        forward,
    })
}

/// Mean cross-entropy of a batch of logits `[N, C]` against labels `[N]`.
fn cross_entropy(logits: &Tracer, y: &Tracer) -> Result<Tracer> {
    logits.log_softmax(1)?.gather(&y.unsqueeze(1)?, 1)?.neg()?.mean_all()
}

fn median_ms(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up, and the trace
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
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
    let model = match opt("--model").as_deref() {
        Some("opacus") => opacus(&dev)?,
        _ => tutorial(&dev)?,
    };
    let batch: usize = opt("--batch").and_then(|v| v.parse().ok()).unwrap_or(64);
    let reps: usize = opt("--reps").and_then(|v| v.parse().ok()).unwrap_or(5);
    let xs = Tensor::randn(0f32, 1., (batch, 1, 28, 28), &dev)?;
    let ys = Tensor::from_vec(
        (0..batch as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(),
        batch,
        &dev,
    )?;
    let fwd = model.forward;
    println!(
        "{}, batch {batch}, f32, {} threads, median of {reps}",
        model.name,
        candle_core::utils::get_num_threads()
    );

    // One example's loss (the example gets a batch axis of one, as in the tutorial).
    let loss = move |p: SymParams, x: Tracer, y: Tracer| cross_entropy(&fwd(&p, &x.unsqueeze(0)?)?, &y.unsqueeze(0)?);
    // The ordinary batched step: the gradient of the mean loss over the batch.
    let batched = grad(move |p: SymParams, x: Tracer, y: Tracer| cross_entropy(&fwd(&p, &x)?, &y));
    let step_ms = median_ms(reps, || batched.call((&model.params, &xs, &ys)).map(|_| ()))?;

    // The per-example loop: the same gradient, one example at a time.
    let one = jit(grad(loss));
    let per_example = || -> Result<Params> {
        let mut parts: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for i in 0..batch {
            let g = one.call((&model.params, xs.get(i)?, ys.get(i)?))?;
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
        let g = psg.call((&model.params, &xs, &ys))?;
        let diff = max_diff(&g, &reference)?;
        let ms = median_ms(reps, || psg.call((&model.params, &xs, &ys)).map(|_| ()))?;
        println!(
            "| vmap(grad), {route:?} route | {ms:.1} | {:.2} | {:.2} | {diff:.1e} |",
            ms / step_ms,
            loop_ms / ms
        );
    }
    Ok(())
}
