//! A word-level bidirectional LSTM that classifies the fortune texts
//! shipped in `data/` by topic (computers, politics, science, work),
//! trained with DP-Adam through `dp::PrivacyEngine` beside the same model
//! trained without privacy on Poisson batches of the same rate, from the
//! same initial weights. Words are the training texts' lower-cased runs
//! of letters and digits seen at least twice (the rest one unknown word);
//! each example is a tree `(words [T], length, topic)`: the LSTM
//! (`nn::lstm`, one `scan` node per direction) reads each text up to its
//! own length, as `pack_padded_sequence` makes PyTorch do, and the head
//! reads the mean of its outputs over the text. The held-out 300 records
//! are the ones `dp_text` and `dp_finetune` hold out.
//!
//!     cargo run --release --example dp_lstm
//!
//! Options: --epochs N, --batch B (expected batch size), --physical P,
//! --lr, --clip C, --epsilon ε, --delta δ, --seq T (words read),
//! --emb E, --hidden H, --seed S (reproducible noise, NOT private; without
//! it the noise is keyed from the OS). It ends with `RESULT dp accuracy ..
//! epsilon ..` and `RESULT nonprivate accuracy ..` lines.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::accountant::Mechanism;
use candle_func::dp::{DpConfig, PrivacyEngine};
use candle_func::nn::{self, Embedding, Linear, Module, Params, Recurrent, RecurrentConfig, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{grad, jit, Tracer};
use common::arg;
use common::fortunes;
use std::collections::BTreeMap;
use std::time::Instant;

const TOPICS: [&str; 4] = ["computers", "politics", "science", "work"];

/// The classifier: words, an LSTM both ways, a linear head on the mean of
/// its outputs over the text.
struct Model {
    emb: Embedding,
    rnn: Recurrent,
    fc: Linear,
}

impl Model {
    fn new(vm: &candle_nn::VarMap, vocab: usize, e: usize, h: usize) -> candle_func::Result<Model> {
        let vb = candle_nn::VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
        let cfg = RecurrentConfig {
            bidirectional: true,
            ..RecurrentConfig::default()
        };
        Ok(Model {
            emb: nn::embedding(vocab, e, vb.pp("emb"))?,
            rnn: nn::lstm(e, h, cfg, vb.pp("rnn"))?,
            fc: nn::linear(2 * h, TOPICS.len(), vb.pp("fc"))?,
        })
    }

    /// Logits of one text `[T]` (its `len`) or of a batch `[N, T]` (`[N]`).
    fn logits(&self, p: &Params, ids: &Tracer, len: &Tracer) -> candle_func::Result<Tracer> {
        let out = self.rnn.run(p, &self.emb.forward_with(p, ids)?, Some(len))?.output;
        // the outputs are zero past the text: their sum over the steps
        // divided by the length is the mean over the text
        let time = out.rank() - 2;
        let mean = out.sum(time)?.div(&len.to_dtype(out.dtype())?.unsqueeze(len.rank())?)?;
        self.fc.forward_with(p, &mean)
    }
}

/// A text's lower-cased runs of letters and digits.
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

/// Ids of the words seen at least twice in `texts`, from 2 (0 pads, 1 is
/// any other word).
fn vocabulary(texts: &[(u32, &str)]) -> BTreeMap<String, u32> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (_, text) in texts {
        for w in words(text) {
            *counts.entry(w).or_default() += 1;
        }
    }
    let kept = counts.into_iter().filter(|(_, n)| *n >= 2).map(|(w, _)| w);
    kept.zip(2u32..).collect()
}

/// Words `[N, T]`, lengths `[N]` and topics `[N]` (u32).
fn examples(
    records: &[(u32, &str)],
    vocab: &BTreeMap<String, u32>,
    t: usize,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (mut ids, mut lens, mut ys) = (Vec::new(), Vec::new(), Vec::new());
    for (topic, text) in records {
        let seq: Vec<u32> = words(text).map(|w| *vocab.get(&w).unwrap_or(&1)).take(t).collect();
        lens.push(seq.len().max(1) as u32);
        ids.extend(seq.iter().copied().chain(std::iter::repeat(0)).take(t));
        ys.push(*topic);
    }
    let n = records.len();
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(ids, (n, t), &dev)?,
        Tensor::from_vec(lens, n, &dev)?,
        Tensor::from_vec(ys, n, &dev)?,
    ))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let epochs: usize = arg("--epochs", 15);
    let batch: usize = arg("--batch", 128);
    let physical: usize = arg("--physical", 64);
    let lr: f64 = arg("--lr", 1e-2);
    let clip: f64 = arg("--clip", 1.0);
    let target_eps: f64 = arg("--epsilon", 8.0);
    let delta: f64 = arg("--delta", 1e-5);
    let t: usize = arg("--seq", 64);
    let (e, h): (usize, usize) = (arg("--emb", 64), arg("--hidden", 64));
    let seed: Option<u64> = std::env::args().any(|a| a == "--seed").then(|| arg("--seed", 0));

    // the split of dp_text and dp_finetune: a fixed shuffle, a tenth held out
    let all = fortunes::load()?;
    let order = Rng::seeded(0).permutation(all.len());
    let records: Vec<(u32, &str)> = order
        .iter()
        .map(|&i| {
            let topic = TOPICS.iter().position(|t| *t == all[i].0).ok_or("an unknown topic")?;
            Ok((topic as u32, all[i].1.as_str()))
        })
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    let (test, train) = records.split_at(all.len() / 10);
    let vocab = vocabulary(train);
    let (ids, lens, ys) = examples(train, &vocab, t)?;
    let test = examples(test, &vocab, t)?;
    let n = train.len();
    let v = vocab.len() + 2;

    let (vm_dp, vm_plain) = (candle_nn::VarMap::new(), candle_nn::VarMap::new());
    let (private, plain) = (Model::new(&vm_dp, v, e, h)?, Model::new(&vm_plain, v, e, h)?);
    nn::load_params(&vm_plain, &varmap_tensors(&vm_dp))?; // the same start
    println!(
        "topics of {n} fortune texts ({} held out), the first {t} words of each ({v} words); \
         an LSTM both ways (embedding {e}, hidden {h}), {} parameters",
        test.0.dims()[0],
        varmap_tensors(&vm_dp).values().map(Tensor::elem_count).sum::<usize>()
    );

    // one example's loss, a tree (characters, length, topic)
    let one = |p: BTreeMap<String, Tracer>, (x, len, y): (Tracer, Tracer, Tracer)| {
        let logits = private.logits(&Params::with(&p), &x, &len)?;
        nn::cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let mean = |p: BTreeMap<String, Tracer>, x: Tracer, len: Tracer, y: Tracer| {
        let logits = plain.logits(&Params::with(&p), &x, &len)?;
        nn::cross_entropy(&logits, &y, Reduction::Mean)
    };
    let batch_grad = grad(mean);
    let rng = match seed {
        Some(s) => Rng::seeded(s),
        None => Rng::from_os()?,
    };
    let data = (ids.clone(), lens.clone(), ys.clone());
    let mut trainer = PrivacyEngine::new()
        .accountant(Mechanism::Prv)
        .rng(rng)
        .physical_batch(physical)
        .make_private_examples_with_epsilon(
            one,
            &vm_dp,
            candle_func::optim::Adam::new(&vm_dp, lr)?,
            &data,
            DpConfig::new(batch, 0.0, clip),
            (target_eps, delta, epochs as f64),
        )?;
    let (q, per_epoch) = (trainer.sample_rate(), trainer.steps_per_epoch());
    println!(
        "sample rate {q:.4} (expected batch {batch}), {epochs} epochs x {per_epoch} steps; noise multiplier {:.3} \
         for epsilon {target_eps} at delta {delta:e} (PRV), clipping norm {clip}, Adam lr {lr}, {}",
        trainer.noise_multiplier(),
        match seed {
            Some(s) => format!("seed {s} (reproducible: NOT private)"),
            None => "noise keyed from the OS".into(),
        }
    );
    let mut opt_plain = candle_func::optim::Adam::new(&vm_plain, lr)?;
    let mut batches = Rng::seeded(seed.unwrap_or(0).wrapping_add(1));
    let start = Instant::now();
    for epoch in 1..=epochs {
        for _ in 0..per_epoch {
            trainer.step()?;
            let idx = batches.poisson_sample(n, q);
            if idx.is_empty() {
                continue;
            }
            let i = Tensor::from_vec(
                idx.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                idx.len(),
                &Device::Cpu,
            )?;
            let pick = |t: &Tensor| t.index_select(&i, 0);
            let g = batch_grad.call((&varmap_tensors(&vm_plain), &pick(&ids)?, &pick(&lens)?, &pick(&ys)?))?;
            opt_plain.step(&g)?;
        }
        let done = start.elapsed().as_secs_f64();
        println!(
            "epoch {epoch:>2}  test accuracy: DP {:.3}, non-private {:.3}  epsilon {:.2}  {done:.0} s elapsed, \
             about {:.0} s left",
            accuracy(&private, &vm_dp, &test)?,
            accuracy(&plain, &vm_plain, &test)?,
            trainer.accountant().epsilon(delta)?,
            done / epoch as f64 * (epochs - epoch) as f64
        );
    }
    let eps = trainer.accountant().epsilon(delta)?;
    println!(
        "RESULT dp accuracy {:.4} epsilon {eps:.2}",
        accuracy(&private, &vm_dp, &test)?
    );
    println!(
        "RESULT nonprivate accuracy {:.4} epsilon inf",
        accuracy(&plain, &vm_plain, &test)?
    );
    Ok(())
}

/// A `VarMap`'s variables by name.
fn varmap_tensors(vm: &candle_nn::VarMap) -> BTreeMap<String, Tensor> {
    let data = vm.data().lock().unwrap_or_else(|e| e.into_inner());
    data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
}

/// The share of held-out texts whose topic the model's largest logit names.
fn accuracy(m: &Model, vm: &candle_nn::VarMap, (x, len, y): &(Tensor, Tensor, Tensor)) -> candle_func::Result<f64> {
    let f = |p: BTreeMap<String, Tracer>, x: Tracer, len: Tracer| m.logits(&Params::with(&p), &x, &len);
    let logits = jit(f).call((&varmap_tensors(vm), x, len))?;
    let pred = logits.argmax(1)?.to_vec1::<u32>()?;
    let want = y.to_vec1::<u32>()?;
    Ok(pred.iter().zip(&want).filter(|(a, b)| a == b).count() as f64 / want.len() as f64)
}
