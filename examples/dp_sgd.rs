//! Differentially private training (DP-SGD) of a small CNN on real data: the
//! UCI handwritten digits shipped in `data/`, through `dp::PrivacyEngine`
//! (Opacus's API): Poisson sampling, ghost clipping, noise from the secure
//! sampler, SGD with momentum, and the PRV accountant (the RDP figure is
//! printed beside it for comparison).
//!
//!     cargo run --release --example dp_sgd
//!     cargo run --release --example dp_sgd -- --noise 0          # no privacy
//!
//! Options: --epochs N, --batch B (expected batch size), --physical P, --lr,
//! --momentum, --noise σ, --clip C, --delta δ, --route grouped|unfold|loop,
//! --seed S (a reproducible run: the noise then follows from S and is not
//! private), --target-epsilon ε (choose σ for it instead of --noise),
//! --audit M (insert M white-box canaries and print the one-run audit's
//! ε lower bound at the end).

mod common;

use candle_core::{DType, Device};
use candle_func::dp::accountant::Mechanism;
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{ConvRoute, Options, Tracer};
use common::{arg, digits, digits_cnn};
use std::collections::BTreeMap;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let epochs: usize = arg("--epochs", 30);
    let batch: usize = arg("--batch", 64);
    let physical: usize = arg("--physical", 32);
    let lr: f64 = arg("--lr", 1.0);
    let momentum: f64 = arg("--momentum", 0.5);
    let noise: f64 = arg("--noise", 1.0);
    let target: f64 = arg("--target-epsilon", 0.0);
    let clip: f64 = arg("--clip", 1.0);
    let delta: f64 = arg("--delta", 1e-5);
    let seed: Option<u64> = std::env::args().any(|a| a == "--seed").then(|| arg("--seed", 0));
    let route: ConvRoute = arg::<String>("--route", "unfold".into()).parse()?;
    let audit: usize = arg("--audit", 0);

    let all = digits::load(&dev)?;
    let (train, test) = digits::split(&all)?;
    let n = train.len();
    println!(
        "DP-SGD on the UCI digits: {n} training and {} test examples",
        test.len()
    );

    candle_func::settings::manual_seed(seed.unwrap_or(0));
    let varmap = candle_nn::VarMap::new();
    let model = digits_cnn(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    // One example's loss; the engine batches, clips and noises it.
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&model, &p, &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let rng = match seed {
        Some(s) => Rng::seeded(s),
        None => Rng::from_os()?,
    };
    let engine = PrivacyEngine::new()
        .accountant(Mechanism::Prv)
        .rng(rng)
        .physical_batch(physical)
        .options(Options::new().conv_route(route));
    let sgd = candle_func::optim::Sgd::new(&varmap, lr, momentum)?;
    let data = (&train.images, &train.labels);
    let config = DpConfig::new(batch, noise, clip);
    let mut trainer = if target > 0.0 {
        engine.make_private_with_epsilon(loss, &varmap, sgd, data, config, (target, delta, epochs as f64))?
    } else {
        engine.make_private(loss, &varmap, sgd, data, config)?
    };
    if audit > 0 {
        // white-box gradient canaries for a one-run audit; their coins come
        // from the OS, so the training code cannot know them
        let coins = Rng::from_os()?.next_u64();
        trainer.insert_canaries(dp::audit::Canaries::new(audit, coins)?)?;
    }
    let steps_per_epoch = trainer.steps_per_epoch();
    let sigma = trainer.noise_multiplier();
    println!(
        "sample rate {:.4} (expected batch {batch}, physical {physical}), noise multiplier {sigma:.4}, \
         clipping norm {clip}, {epochs} epochs x {steps_per_epoch} steps = {} steps, delta {delta:e}, \
         lr {lr} (cosine decay), momentum {momentum}, conv route {route:?}, {}",
        trainer.sample_rate(),
        epochs * steps_per_epoch,
        match seed {
            Some(s) => format!("seed {s} (reproducible: NOT private)"),
            None => "noise keyed from the OS".into(),
        }
    );
    let start = Instant::now();
    let total_steps = (epochs * steps_per_epoch) as f64;
    let mut step = 0usize;
    let eps = |t: &dp::PrivateTrainer<_, _>, m: Mechanism| -> candle_func::Result<f64> {
        if sigma == 0.0 {
            return Ok(f64::INFINITY);
        }
        t.accountant().with_mechanism(m).epsilon(delta)
    };
    for epoch in 1..=epochs {
        for _ in 0..steps_per_epoch {
            // Cosine decay of the learning rate: the late, small steps average
            // the noise away (post-processing, so no privacy cost).
            let decayed = lr * 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total_steps).cos());
            trainer.optimizer_mut().set_lr(decayed)?;
            step += 1;
            trainer.step()?;
        }
        println!(
            "epoch {epoch:>3}  train loss {:.4}  test accuracy {:.4}  epsilon {:.2} (PRV)  time {:.1}s",
            mean_loss(&model, &train)?,
            accuracy(&model, &test)?,
            eps(&trainer, Mechanism::Prv)?,
            start.elapsed().as_secs_f64()
        );
    }
    println!(
        "epsilon: {:.2} by PRV, {:.2} by RDP (delta {delta:e})",
        eps(&trainer, Mechanism::Prv)?,
        eps(&trainer, Mechanism::Rdp)?
    );
    println!("test accuracy: {:.2}", accuracy(&model, &test)?);
    if audit > 0 {
        let report = trainer.audit(delta, 0.95)?;
        println!(
            "one-run audit, {audit} white-box canaries: epsilon >= {:.3} at 95% ({} of {} guesses right)",
            report.epsilon_lower_bound, report.correct, report.guesses
        );
    }
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
