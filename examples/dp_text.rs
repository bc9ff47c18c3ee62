//! Differentially private training of a tiny transformer language model on
//! real text: the fortune-cookie texts shipped in `data/` (3,009 records,
//! each one person's contribution). A character-level GPT (`nn::gpt`) is
//! trained with DP-Adam through `dp::PrivacyEngine`: Poisson sampling,
//! per-record clipping (ghost norms where they pay), noise from the secure
//! sampler, and the noise multiplier chosen for a target ε by the PRV
//! accountant (the RDP figure is printed beside it). Beside it, the same
//! model trained without privacy for the same number of steps on Poisson
//! batches of the same rate. Both report validation bits per character on
//! held-out records.
//!
//!     cargo run --release --example dp_text
//!
//! Both use Adam (for the private run DP-Adam: the moments are
//! post-processing of the privatized gradients).
//!
//! Options: --epochs N, --batch B (expected batch size), --physical P, --lr,
//! --lr-plain (the non-private run's), --clip C, --epsilon ε (target),
//! --sigma σ (a noise multiplier instead of a target ε), --delta δ, --seq T,
//! --dim D, --layers L, --seed S (reproducible noise, NOT private; without
//! it the noise is keyed from the OS).
//!
//! User-level DP: --authors A gives each training text one of A synthetic
//! authors (skewed: low ids write more), and the run protects an author
//! with all their texts: --batch then counts authors, at most
//! --per-author K (default 4) of an author's texts a step, each author's
//! mean gradient clipped whole (`PrivacyEngine::users`).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::accountant::Mechanism;
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::nn::{self, functional_call, BlockConfig, CrossEntropy, Module, NormKind, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{grad, vmap, Function, Tracer};
use common::arg;
use common::fortunes::{self, PAD, VOCAB};
use std::collections::BTreeMap;
use std::time::Instant;

/// Ignore the padding after a text's end.
const CE: CrossEntropy = CrossEntropy {
    ignore_index: Some(PAD as i64),
    label_smoothing: 0.0,
    reduction: Reduction::Mean,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let epochs: usize = arg("--epochs", 20);
    let batch: usize = arg("--batch", 256);
    let physical: usize = arg("--physical", 64);
    let lr: f64 = arg("--lr", 1e-2);
    let lr_plain: f64 = arg("--lr-plain", 1e-2);
    let clip: f64 = arg("--clip", 1.0);
    let target_eps: f64 = arg("--epsilon", 8.0);
    let delta: f64 = arg("--delta", 1e-5);
    let t: usize = arg("--seq", 64);
    let dim: usize = arg("--dim", 64);
    let layers: usize = arg("--layers", 2);
    let seed: Option<u64> = std::env::args().any(|a| a == "--seed").then(|| arg("--seed", 0));
    let sigma: Option<f64> = std::env::args().any(|a| a == "--sigma").then(|| arg("--sigma", 1.0));
    let authors: usize = arg("--authors", 0);
    let per_author: usize = arg("--per-author", 4);

    // records, shuffled (a fixed split), a tenth held out
    let all = fortunes::load()?;
    let order = Rng::seeded(0).permutation(all.len());
    let n_val = all.len() / 10;
    let texts: Vec<&str> = order.iter().map(|&i| all[i].1.as_str()).collect();
    let (val, train) = texts.split_at(n_val);
    let (xs, ys) = fortunes::windows(train, t, &dev)?;
    let (vx, vy) = fortunes::windows(val, t, &dev)?;
    let n = train.len();
    println!("DP-SGD on {n} fortune texts ({n_val} held out), characters {t} per record, vocabulary {VOCAB}");

    let block = BlockConfig {
        dim,
        heads: 4,
        ff: 4 * dim,
        causal: true,
        norm: NormKind::LayerNorm,
        act: nn::Activation::Gelu,
    };
    let (vm_dp, vm_plain) = (candle_nn::VarMap::new(), candle_nn::VarMap::new());
    let make = |vm: &candle_nn::VarMap| {
        nn::gpt(
            VOCAB,
            t,
            layers,
            block,
            candle_nn::VarBuilder::from_varmap(vm, DType::F32, &dev),
        )
    };
    let (private, plain) = (make(&vm_dp)?, make(&vm_plain)?);
    // the same initial weights for both
    nn::load_params(&vm_plain, &private.params())?;
    println!(
        "model: {} parameters",
        private.params().values().map(|p| p.elem_count()).sum::<usize>()
    );

    // One record's loss (its mean over its characters); the engine turns
    // it into clipped per-record gradients.
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&private, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        nn::cross_entropy_with(&logits, &y, CE)
    };
    // The non-private step: the mean of the same per-record losses.
    let mean = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let each = |x: Tracer, y: Tracer| {
            let logits = functional_call(&plain, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
            nn::cross_entropy_with(&logits, &y, CE)
        };
        Function::apply(&vmap(each), (x, y))?.mean_all()
    };
    let batch_grad = grad(mean);

    let rng = match seed {
        Some(s) => Rng::seeded(s),
        None => Rng::from_os()?,
    };
    let mut engine = PrivacyEngine::new()
        .accountant(Mechanism::Prv)
        .rng(rng)
        .physical_batch(physical);
    // the texts an expected private batch holds, for the non-private run's
    let mut texts_per_step = batch as f64;
    if authors > 0 {
        let ids = synthetic_authors(n, authors);
        let mut count = vec![0usize; authors];
        ids.iter().for_each(|&a| count[a as usize] += 1);
        let writers = count.iter().filter(|&&c| c > 0).count();
        let capped: usize = count.iter().map(|&c| c.min(per_author)).sum();
        texts_per_step = batch as f64 * capped as f64 / writers as f64;
        engine = engine.users(&Tensor::from_vec(ids, n, &dev)?, per_author);
        println!(
            "user-level DP: {writers} synthetic authors writing 1 to {} texts, at most {per_author} of an author's \
             texts a step",
            count.iter().max().unwrap_or(&0)
        );
    }
    let adam = candle_func::optim::Adam::new(&vm_dp, lr)?;
    let mut trainer = match sigma {
        Some(s) => engine.make_private(one, &vm_dp, adam, (&xs, &ys), DpConfig::new(batch, s, clip))?,
        None => engine.make_private_with_epsilon(
            one,
            &vm_dp,
            adam,
            (&xs, &ys),
            DpConfig::new(batch, 0.0, clip),
            (target_eps, delta, epochs as f64),
        )?,
    };
    let (q, steps_per_epoch) = (trainer.sample_rate(), trainer.steps_per_epoch());
    let steps = epochs * steps_per_epoch;
    let unit = if authors > 0 { "authors" } else { "texts" };
    println!(
        "sample rate {q:.4} (expected batch {batch} {unit}, physical {physical}), {epochs} epochs x \
         {steps_per_epoch} steps = {steps} steps; noise multiplier {:.3} ({}), clipping norm {clip}, Adam, lr {lr} \
         (non-private {lr_plain}; cosine decay), {}",
        trainer.noise_multiplier(),
        match sigma {
            Some(_) => "given".to_string(),
            None => format!("for epsilon {target_eps} at delta {delta:e} by PRV"),
        },
        match seed {
            Some(s) => format!("seed {s} (reproducible: NOT private)"),
            None => "noise keyed from the OS".into(),
        }
    );
    let mut opt_plain = candle_func::optim::Adam::new(&vm_plain, lr_plain)?;
    // The non-private run's batches: Poisson at the same rate.
    let mut batches = Rng::seeded(seed.unwrap_or(0).wrapping_add(1));
    let start = Instant::now();
    let (mut step, mut examples) = (0usize, 0usize);
    let eps = |t: &dp::PrivateTrainer<_, _>, m| t.accountant().with_mechanism(m).epsilon(delta);
    for epoch in 1..=epochs {
        for _ in 0..steps_per_epoch {
            let decay = 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / steps as f64).cos());
            trainer.optimizer_mut().set_lr(lr * decay)?;
            opt_plain.set_lr(lr_plain * decay)?;
            step += 1;
            examples += trainer.step()?.examples;
            // the non-private run's batches hold as many texts as the private one's, on average
            let idx = batches.poisson_sample(n, texts_per_step / n as f64);
            if idx.is_empty() {
                continue;
            }
            let i = Tensor::from_vec(idx.iter().map(|&i| i as u32).collect::<Vec<_>>(), idx.len(), &dev)?;
            let (bx, by) = (xs.index_select(&i, 0)?, ys.index_select(&i, 0)?);
            opt_plain.step(&batch_grad.call((&plain.params(), &bx, &by))?)?;
        }
        println!(
            "epoch {epoch:>3}  validation bits/char: private {:.3}, non-private {:.3}  epsilon {:.2}  time {:.0}s",
            bits_per_char(&private, &vx, &vy)?,
            bits_per_char(&plain, &vx, &vy)?,
            eps(&trainer, Mechanism::Prv)?,
            start.elapsed().as_secs_f64()
        );
    }
    let (bp, bn) = (bits_per_char(&private, &vx, &vy)?, bits_per_char(&plain, &vx, &vy)?);
    println!(
        "texts per step: {:.1} on average; validation bits per character: DP {bp:.3} at epsilon {:.2} per {} by \
         PRV ({:.2} by RDP; delta {delta:e}), non-private {bn:.3}: DP / non-private {:.3}",
        examples as f64 / steps as f64,
        eps(&trainer, Mechanism::Prv)?,
        &unit[..unit.len() - 1],
        eps(&trainer, Mechanism::Rdp)?,
        bp / bn
    );
    Ok(())
}

/// Each of `n` texts' author, of `authors`: `floor(A u²)` for a uniform `u`
/// (a fixed draw), so that low ids write many texts and high ids few, as
/// real authors do.
fn synthetic_authors(n: usize, authors: usize) -> Vec<u32> {
    let mut rng = Rng::seeded(7);
    (0..n)
        .map(|_| {
            let u = rng.uniform();
            ((authors as f64 * u * u) as usize).min(authors - 1) as u32
        })
        .collect()
}

/// Mean cross-entropy in bits over every held-out character.
fn bits_per_char(model: &impl Module, x: &Tensor, y: &Tensor) -> candle_func::Result<f64> {
    let logits = model.forward_eager(x)?;
    let lp = candle_nn::ops::log_softmax(&logits, 2)?;
    let picked = lp.gather(&y.unsqueeze(2)?, 2)?.squeeze(2)?;
    let real = y.ne(PAD)?.to_dtype(DType::F32)?;
    let nats = -((picked * &real)?.sum_all()?.to_scalar::<f32>()? / real.sum_all()?.to_scalar::<f32>()?);
    Ok(nats as f64 / std::f64::consts::LN_2)
}
