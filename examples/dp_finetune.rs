//! DP fine-tuning of a pretrained model as it is done: the sentence encoder
//! all-MiniLM-L6-v2 (`scripts/fetch_minilm.sh`) learns to tell the topic of
//! the fortune texts shipped in `data/` (computers, politics, science,
//! work), tokenised with Hugging Face's `tokenizers`, the same 300 records
//! held out as `dp_text` holds out. Each example is a tree `(ids [T], mask
//! [T], label)`; a classification head (mean pooling, then linear) is new.
//!
//!     cargo run --release --example dp_finetune -- --model "$(scripts/fetch_minilm.sh)"
//!
//! Seven runs on the same Poisson steps, one table at the end:
//!
//! * `full-*`: every weight on the head's path trains (AdamW, the head in a
//!   parameter group of its own with a higher rate; BERT's pooler, which a
//!   mean-pooled head does not use, stays frozen);
//! * `lora-*`: LoRA adapters on `query` and `value` (rank 8, alpha 16) and
//!   the head train, the encoder is frozen (constants of the traced loss);
//! * each at ε = 8 and ε = 1 (δ = 1e-5, PRV accountant, the noise
//!   multiplier chosen for the epochs) and without privacy (no clipping,
//!   no noise);
//! * `linear-probe`: logistic regression on the frozen encoder's pooled
//!   features (non-private).
//!
//! Every run prints a `RESULT <run> accuracy <test accuracy> epsilon <ε or
//! inf>` line. Options: `--model DIR`, `--quick` (a short schedule for a
//! smoke test), `--epochs E`, `--batch B` (expected), `--physical P`,
//! `--seq T`, `--runs a,b,..` (a subset), `--seed S` (reproducible and NOT
//! private; without it the noise is keyed from the OS).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{DpConfig, PrivacyEngine, Trainable};
use candle_func::models::bert::BertModel;
use candle_func::models::{mean_pool, Checkpoint};
use candle_func::nn::{self, Lora, LoraConfig, Params, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{jit, Tracer};
use common::arg;
use std::collections::BTreeMap;
use std::time::Instant;

type Map = BTreeMap<String, Tracer>;
const TOPICS: [&str; 4] = ["computers", "politics", "science", "work"];
const DELTA: f64 = 1e-5;

/// Token ids and masks `[N, T]` (u32) and labels `[N]` of one split.
struct Split {
    ids: Tensor,
    mask: Tensor,
    labels: Tensor,
}

fn tokenise(dir: &str, texts: &[(usize, String)], t: usize) -> Result<Split, Box<dyn std::error::Error>> {
    let mut tok = tokenizers::Tokenizer::from_file(format!("{dir}/tokenizer.json")).map_err(|e| e.to_string())?;
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: t,
        ..Default::default()
    }))
    .map_err(|e| e.to_string())?;
    tok.with_padding(Some(tokenizers::PaddingParams {
        strategy: tokenizers::PaddingStrategy::Fixed(t),
        ..Default::default()
    }));
    let enc = tok
        .encode_batch(texts.iter().map(|(_, s)| s.as_str()).collect::<Vec<_>>(), true)
        .map_err(|e| e.to_string())?;
    let n = texts.len();
    let ids: Vec<u32> = enc.iter().flat_map(|e| e.get_ids().to_vec()).collect();
    let mask: Vec<u32> = enc.iter().flat_map(|e| e.get_attention_mask().to_vec()).collect();
    let labels: Vec<u32> = texts.iter().map(|(l, _)| *l as u32).collect();
    let dev = Device::Cpu;
    Ok(Split {
        ids: Tensor::from_vec(ids, (n, t), &dev)?,
        mask: Tensor::from_vec(mask, (n, t), &dev)?,
        labels: Tensor::from_vec(labels, n, &dev)?,
    })
}

/// The schedule shared by the runs.
struct Plan {
    epochs: f64,
    batch: usize,
    physical: usize,
    seed: Option<u64>,
    /// Runs to do (all by default).
    only: Option<Vec<String>>,
}

/// One run's outcome.
struct Outcome {
    name: String,
    accuracy: f64,
    epsilon: f64,
    seconds: f64,
    /// The parameters that trained (for a private run, the noise's dimension).
    trained: usize,
}

/// The encoder, the data and the timing every run shares.
struct Task {
    dir: String,
    bert: BertModel,
    train: Split,
    test: Split,
    plan: Plan,
    started: Instant,
    /// Examples still to go over all runs, for the estimate of what is left.
    todo: std::cell::Cell<f64>,
    done: std::cell::Cell<f64>,
}

impl Task {
    /// Logits `[1, 4]` of one example's ids and mask `[T]`, `[B, 4]` of a
    /// batch's `[B, T]`, with parameters `p`
    /// (adapters applied when given).
    fn logits(&self, p: &Map, lora: Option<&Lora>, ids: &Tracer, mask: &Tracer) -> candle_func::Result<Tracer> {
        let params = match lora {
            Some(l) => Params::with(p).lora(l),
            None => Params::with(p),
        };
        let mask = mask.to_dtype(DType::F32)?;
        let h = self.bert.forward_full(&params, ids, Some(&mask), None)?;
        let pooled = mean_pool(&h, &mask)?;
        // one example's [D] as a batch of one: logits [1, 4] or [B, 4]
        let pooled = if pooled.rank() == 1 {
            pooled.unsqueeze(0)?
        } else {
            pooled
        };
        let w = &p["classifier.weight"];
        pooled.matmul(&w.t()?)?.broadcast_add(&p["classifier.bias"])
    }

    /// A fresh copy of the checkpoint's weights and a zero head, as
    /// variables.
    fn fresh(&self) -> candle_func::Result<candle_nn::VarMap> {
        let varmap = nn::varmap_of(&self.bert)?;
        let d = self.bert.config().hidden_size;
        let dev = Device::Cpu;
        for (name, shape) in [
            ("classifier.weight", vec![TOPICS.len(), d]),
            ("classifier.bias", vec![TOPICS.len()]),
        ] {
            let z = candle_core::Var::zeros(shape, DType::F32, &dev)?;
            varmap.data().lock().expect("a fresh map").insert(name.into(), z);
        }
        Ok(varmap)
    }

    /// Test accuracy of the varmap's parameters.
    fn accuracy(&self, varmap: &candle_nn::VarMap, lora: Option<&Lora>) -> candle_func::Result<f64> {
        let params = values(varmap);
        let f = jit(|p: Map, ids: Tracer, mask: Tracer| self.logits(&p, lora, &ids, &mask)?.argmax(1));
        let n = self.test.labels.dims()[0];
        let mut right = 0usize;
        for start in (0..n).step_by(50) {
            let len = 50.min(n - start);
            let (ids, mask) = (
                self.test.ids.narrow(0, start, len)?,
                self.test.mask.narrow(0, start, len)?,
            );
            let pred = f.call((&params, &ids, &mask))?.to_vec1::<u32>()?;
            let want = self.test.labels.narrow(0, start, len)?.to_vec1::<u32>()?;
            right += pred.iter().zip(&want).filter(|(a, b)| a == b).count();
        }
        Ok(right as f64 / n as f64)
    }

    fn progress(&self, run: &str, epoch: usize, epochs: usize, loss: f64, examples: f64) {
        self.done.set(self.done.get() + examples);
        let elapsed = self.started.elapsed().as_secs_f64();
        let left = elapsed / self.done.get().max(1.0) * (self.todo.get() - self.done.get()).max(0.0);
        println!(
            "  {run} epoch {epoch}/{epochs}: mean loss {loss:.3}, {:.0} s elapsed, about {:.0} s left",
            elapsed, left
        );
    }

    fn wanted(&self, run: &str) -> bool {
        self.plan.only.as_ref().is_none_or(|o| o.iter().any(|r| r == run))
    }

    /// One fine-tuning run: `lora` or full, at `epsilon` (`None`: no
    /// privacy).
    fn finetune(&self, name: &str, lora_on: bool, epsilon: Option<f64>) -> Result<Outcome, Box<dyn std::error::Error>> {
        let t0 = Instant::now();
        let varmap = self.fresh()?;
        let (lora, trainable, opt) = if lora_on {
            let config = LoraConfig::new(8, 16.0, &["query", "value"]).modules_to_save(&["classifier"]);
            let lora = Lora::add(&self.bert, &varmap, config)?;
            let trainable = Trainable::prefixes(&lora.trainable_prefixes());
            let opt = candle_func::optim::AdamW::new(&varmap, 2e-3, 0.0)?.group("classifier", 2e-2, 0.0)?;
            (Some(lora), trainable, opt)
        } else {
            let opt = candle_func::optim::AdamW::new(&varmap, 5e-5, 0.01)?.group("classifier", 2e-2, 0.0)?;
            // BERT's pooler is not on the path of a mean-pooled head: left
            // trainable, the trainer refuses it as never reached
            (None, Trainable::except(&["pooler"]), opt)
        };
        let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| {
            let logits = self.logits(&p, lora.as_ref(), &ids, &mask)?;
            nn::cross_entropy(&logits, &y.unsqueeze(0)?, Reduction::Mean)
        };
        let plan = &self.plan;
        let mut engine = PrivacyEngine::new().physical_batch(plan.physical).trainable(trainable);
        if let Some(s) = plan.seed {
            engine = engine.rng(Rng::seeded(s));
        }
        let data = (&self.train.ids, &self.train.mask, &self.train.labels);
        let mut trainer = match epsilon {
            Some(eps) => engine.make_private_examples_with_epsilon(
                loss,
                &varmap,
                opt,
                &data,
                DpConfig::new(plan.batch, 0.0, 1.0),
                (eps, DELTA, plan.epochs),
            )?,
            // no privacy: the same Poisson steps, nothing clipped or noised
            None => engine.make_private_examples(loss, &varmap, opt, &data, DpConfig::new(plan.batch, 0.0, 1e12))?,
        };
        let per_epoch = trainer.steps_per_epoch();
        let steps = (plan.epochs * per_epoch as f64).ceil() as usize;
        let lr = trainer.optimizer_mut().lr();
        let (mut loss_sum, mut seen, mut epoch) = (0.0, 0usize, 0);
        for step in 0..steps {
            // linear decay to a tenth, a common fine-tuning schedule
            let frac = step as f64 / steps as f64;
            trainer.optimizer_mut().set_lr(lr * (1.0 - 0.9 * frac))?;
            let info = trainer.step()?;
            if info.batch_size > 0 {
                loss_sum += info.mean_loss * info.batch_size as f64;
                seen += info.batch_size;
            }
            if (step + 1) % per_epoch == 0 || step + 1 == steps {
                epoch += 1;
                let epochs = plan.epochs.ceil() as usize;
                self.progress(name, epoch, epochs, loss_sum / seen.max(1) as f64, seen as f64);
                (loss_sum, seen) = (0.0, 0);
            }
        }
        let epsilon = match epsilon {
            Some(_) => trainer.epsilon(DELTA)?,
            None => f64::INFINITY,
        };
        let trained = trainer.noise_dimension()?;
        if epsilon.is_finite() {
            println!(
                "  {name}: ({epsilon:.2}, {DELTA})-DP for each fortune text, σ = {:.3}, q = {:.4}, {} steps, noise on the {trained} trained parameters",
                trainer.noise_multiplier(),
                trainer.sample_rate(),
                trainer.steps()
            );
        }
        Ok(Outcome {
            name: name.into(),
            accuracy: self.accuracy(&varmap, lora.as_ref())?,
            epsilon,
            seconds: t0.elapsed().as_secs_f64(),
            trained,
        })
    }

    /// Logistic regression on the frozen encoder's mean-pooled features.
    fn linear_probe(&self) -> Result<Outcome, Box<dyn std::error::Error>> {
        let t0 = Instant::now();
        let params = values(&self.fresh()?);
        let features = jit(|p: Map, ids: Tracer, mask: Tracer| {
            let mask = mask.to_dtype(DType::F32)?;
            mean_pool(
                &self.bert.forward_full(&Params::with(&p), &ids, Some(&mask), None)?,
                &mask,
            )
        });
        let embed = |s: &Split| -> candle_func::Result<Tensor> {
            let n = s.labels.dims()[0];
            let parts = (0..n)
                .step_by(50)
                .map(|i| {
                    let len = 50.min(n - i);
                    features.call((&params, &s.ids.narrow(0, i, len)?, &s.mask.narrow(0, i, len)?))
                })
                .collect::<candle_func::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        };
        let (ftrain, ftest) = (embed(&self.train)?, embed(&self.test)?);
        self.progress("linear-probe", 1, 1, f64::NAN, self.train.labels.dims()[0] as f64);
        let head = nn::varmap_of(&nn::Linear::from_tensors(
            params["classifier.weight"].copy()?,
            Some(params["classifier.bias"].copy()?),
            "classifier",
        ))?;
        let mut opt = candle_func::optim::Adam::new(&head, 1e-2)?;
        let step = candle_func::grad(|p: Map, x: Tracer, y: Tracer| {
            let logits = x
                .matmul(&p["classifier.weight"].t()?)?
                .broadcast_add(&p["classifier.bias"])?;
            nn::cross_entropy(&logits, &y, Reduction::Mean)
        });
        let current = || values(&head);
        for _ in 0..300 {
            opt.step(&step.call((&current(), &ftrain, &self.train.labels))?)?;
        }
        let p = current();
        let logits = ftest
            .matmul(&p["classifier.weight"].t()?)?
            .broadcast_add(&p["classifier.bias"])?;
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let want = self.test.labels.to_vec1::<u32>()?;
        let right = pred.iter().zip(&want).filter(|(a, b)| a == b).count();
        Ok(Outcome {
            name: "linear-probe".into(),
            accuracy: right as f64 / want.len() as f64,
            epsilon: f64::INFINITY,
            seconds: t0.elapsed().as_secs_f64(),
            trained: TOPICS.len() * (self.bert.config().hidden_size + 1),
        })
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let dir: String = arg("--model", std::env::var("CANDLE_FUNC_MINILM").unwrap_or_default());
    if dir.is_empty() {
        return Err("name the checkpoint folder: --model \"$(scripts/fetch_minilm.sh)\"".into());
    }
    let t: usize = arg("--seq", 64);
    let plan = Plan {
        epochs: arg("--epochs", if quick { 0.05 } else { 2.0 }),
        batch: arg("--batch", if quick { 16 } else { 128 }),
        physical: arg("--physical", 16),
        seed: std::env::args().any(|a| a == "--seed").then(|| arg("--seed", 0)),
        only: std::env::args()
            .position(|a| a == "--runs")
            .and_then(|i| std::env::args().nth(i + 1))
            .map(|s| s.split(',').map(str::to_string).collect()),
    };
    // the same split as dp_text: a fixed shuffle, the first tenth held out
    let all = common::fortunes::load()?;
    let order = Rng::seeded(0).permutation(all.len());
    let records: Vec<(usize, String)> = order
        .iter()
        .map(|&i| {
            let topic = TOPICS.iter().position(|t| *t == all[i].0).ok_or("an unknown topic")?;
            Ok((topic, all[i].1.clone()))
        })
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    let (test, train) = records.split_at(all.len() / 10);
    let test = if quick { &test[..100] } else { test };
    let task = Task {
        bert: BertModel::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu)?)?,
        train: tokenise(&dir, train, t)?,
        test: tokenise(&dir, test, t)?,
        dir,
        plan,
        started: Instant::now(),
        todo: std::cell::Cell::new(0.0),
        done: std::cell::Cell::new(0.0),
    };
    let n = task.train.labels.dims()[0];
    let runs: [(&str, Option<bool>, Option<f64>); 7] = [
        ("linear-probe", None, None),
        ("lora-nonprivate", Some(true), None),
        ("lora-dp8", Some(true), Some(8.0)),
        ("lora-dp1", Some(true), Some(1.0)),
        ("full-nonprivate", Some(false), None),
        ("full-dp8", Some(false), Some(8.0)),
        ("full-dp1", Some(false), Some(1.0)),
    ];
    let chosen: Vec<_> = runs.iter().filter(|r| task.wanted(r.0)).collect();
    let per_run = task.plan.epochs * n as f64;
    task.todo.set(
        chosen
            .iter()
            .map(|r| if r.1.is_some() { per_run } else { n as f64 })
            .sum(),
    );
    println!(
        "fine-tuning {} on {n} fortunes ({} held out), {t} tokens, {} epochs of expected batch {}",
        task.dir,
        task.test.labels.dims()[0],
        task.plan.epochs,
        task.plan.batch
    );
    let mut out = Vec::new();
    for (name, lora, eps) in chosen {
        let o = match lora {
            None => task.linear_probe()?,
            Some(l) => task.finetune(name, *l, *eps)?,
        };
        println!(
            "RESULT {} accuracy {:.4} epsilon {}",
            o.name,
            o.accuracy,
            fmt_eps(o.epsilon)
        );
        out.push(o);
    }
    println!("\n| run | test accuracy | ε (δ = 1e-5, PRV) | parameters trained | time |");
    println!("|---|---|---|---|---|");
    for o in &out {
        let (acc, eps, secs) = (o.accuracy, fmt_eps(o.epsilon), o.seconds);
        println!("| {} | {acc:.3} | {eps} | {} | {secs:.0} s |", o.name, o.trained);
    }
    Ok(())
}

/// A `VarMap`'s current values by name.
fn values(varmap: &candle_nn::VarMap) -> BTreeMap<String, Tensor> {
    let data = varmap.data().lock().expect("no thread panicked");
    data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
}

fn fmt_eps(e: f64) -> String {
    if e.is_finite() {
        format!("{e:.2}")
    } else {
        "inf".into()
    }
}
