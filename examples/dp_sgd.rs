//! Differentially private training (DP-SGD) of a small CNN on real data: the
//! UCI handwritten digits shipped in `data/`. Per-sample gradients come from
//! `vmap(grad(loss))`; each is clipped, the sum is noised, batches are drawn
//! by Poisson sampling as Opacus does, and a Rényi-DP accountant reports ε.
//!
//!     cargo run --release --example dp_sgd
//!     cargo run --release --example dp_sgd -- --noise 0          # no privacy
//!
//! Options: --epochs N, --batch B (expected batch size), --lr, --momentum,
//! --noise σ, --clip C, --delta δ, --route grouped|unfold|loop, --seed S.

mod common;

use candle_core::{DType, Device};
use candle_func::dp::{self, accountant::RdpAccountant, rng::Rng};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::{grad, vmap, ConvRoute, Tracer};
use common::{arg, digits, digits_cnn};
use std::collections::BTreeMap;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let epochs: usize = arg("--epochs", 30);
    let batch: f64 = arg("--batch", 64.0);
    let lr: f64 = arg("--lr", 1.0);
    let momentum: f64 = arg("--momentum", 0.5);
    let noise: f64 = arg("--noise", 1.0);
    let clip: f64 = arg("--clip", 1.0);
    let delta: f64 = arg("--delta", 1e-5);
    let seed: u64 = arg("--seed", 0);
    let route: ConvRoute = arg::<String>("--route", "unfold".into()).parse()?;

    let all = digits::load(&dev)?;
    let (train, test) = digits::split(&all)?;
    let n = train.len();
    let q = batch / n as f64;
    let steps_per_epoch = (1.0 / q).round() as usize;
    println!(
        "DP-SGD on the UCI digits: {n} training and {} test examples",
        test.len()
    );
    println!(
        "sample rate {q:.4} (expected batch {batch}), noise multiplier {noise}, clipping norm {clip}, \
         {epochs} epochs x {steps_per_epoch} steps = {} steps, delta {delta:e}, lr {lr} (cosine decay), momentum {momentum}, \
         conv route {route:?}, seed {seed}",
        epochs * steps_per_epoch
    );

    candle_func::manual_seed(seed);
    let varmap = candle_nn::VarMap::new();
    let model = digits_cnn(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let params = model.params();
    // One example's loss; vmap(grad(..)) turns it into per-sample gradients.
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&model, &p, &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let per_sample = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).conv_route(route);
    let mut sgd = dp::Sgd::new(&varmap, lr, momentum)?;
    let mut rng = Rng::new(seed);
    let mut accountant = RdpAccountant::new();
    let start = Instant::now();
    let total_steps = (epochs * steps_per_epoch) as f64;
    let mut step = 0usize;
    for epoch in 1..=epochs {
        for _ in 0..steps_per_epoch {
            // Cosine decay of the learning rate: the late, small steps average
            // the noise away (post-processing, so no privacy cost).
            sgd.set_lr(lr * 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total_steps).cos()));
            step += 1;
            let idx = rng.poisson_sample(n, q);
            let grads = if idx.is_empty() {
                // An empty batch still takes a (noise-only) step.
                params
                    .iter()
                    .map(|(k, p)| Ok((k.clone(), p.zeros_like()?.unsqueeze(0)?)))
                    .collect::<candle_core::Result<_>>()?
            } else {
                let b = train.select(&idx)?;
                per_sample.call((&params, &b.images, &b.labels))?
            };
            let private = dp::privatize(&grads, clip, noise, batch, &mut rng)?;
            sgd.step(&private)?;
            accountant.step(noise, q);
        }
        let acc = accuracy(&model, &test)?;
        let eps = if noise > 0.0 {
            accountant.epsilon(delta)
        } else {
            f64::INFINITY
        };
        println!(
            "epoch {epoch:>3}  train loss {:.4}  test accuracy {acc:.4}  epsilon {eps:.2}  time {:.1}s",
            mean_loss(&model, &train)?,
            start.elapsed().as_secs_f64()
        );
    }
    let eps = if noise > 0.0 {
        accountant.epsilon(delta)
    } else {
        f64::INFINITY
    };
    println!("epsilon: {eps:.2} (delta {delta:e})");
    println!("test accuracy: {:.2}", accuracy(&model, &test)?);
    Ok(())
}

fn mean_loss(model: &impl Module, d: &digits::Digits) -> candle_func::Result<f64> {
    let logits = model.forward_eager(&d.images)?;
    let lp = candle_nn::ops::log_softmax(&logits, 1)?;
    let picked = lp.gather(&d.labels.unsqueeze(1)?, 1)?;
    Ok(-(picked.mean_all()?.to_scalar::<f32>()? as f64))
}

fn accuracy(model: &impl Module, d: &digits::Digits) -> candle_func::Result<f64> {
    let pred = model.forward_eager(&d.images)?.argmax(1)?;
    let right = pred
        .eq(&d.labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(right as f64 / d.len() as f64)
}
