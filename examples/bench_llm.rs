//! A causal language model at real size (issue 36): a checkpoint folder that
//! `scripts/make_scale_checkpoint.py` writes (Qwen2-0.5B's, SmolLM2-360M's or
//! GPT-2 medium's configuration, random weights, f32), B=4 sequences of
//! T=128 tokens (example i keeps 128 - 16 i, the rest padding), one variant
//! per process so that the process's peak resident memory is that
//! variant's:
//!
//! * `forward`: the batch's logits;
//! * `lora_step`: a non-private LoRA training step (rank 8, alpha 16, on
//!   `q_proj` and `v_proj`, GPT-2's `c_attn`): the gradient of the batch's
//!   loss with respect to the adapters alone (`Lora::trainable_params`;
//!   the base weights are constants of the trace), then SGD;
//! * `dp_lora`: one DP-SGD step through `dp::PrivacyEngine` training the same
//!   adapters (ghost clipping, secure noise, SGD), the batch as the data set;
//! * `dp`: the same DP step training every weight.
//!
//! The loss is each example's mean next-token cross-entropy over its real
//! tokens (`models::causal_lm_loss`), averaged over the batch.
//!
//! ```text
//! PY="$HOME/peers/bin/python"
//! dir="$("$PY" scripts/make_scale_checkpoint.py qwen2-0.5b)"
//! cargo run --release --example bench_llm -- --model "$dir" --variant lora_step --reps 2
//! ```
//!
//! It prints `RESULT ours_<variant> median_ms .. first_ms .. peak_rss_mib ..
//! plan_mib ..`; `benches/peers/side_by_side_llm.py` pairs it with
//! `benches/peers/bench_llm.py` (transformers, peft, Opacus). `--b` and `--t`
//! change the batch; `--profile RUNS` prints where the variant's graph
//! spends its time instead (per node, per primitive, GFLOP/s per product).
//! For the DP variants, `--optimizer adamw` steps AdamW instead of SGD, and
//! `--memory-limit-gib G` bounds the process by the engine's memory limit:
//! the trainer chooses its physical batch (at most a quarter of the batch)
//! and prints its plan beside the peak resident memory (mimalloc then
//! returns freed memory at once instead of keeping it). `--precision
//! bf16-mixed` loads the checkpoint in bf16 and trains with
//! `dp::Precision::Bf16Mixed` (LoRA adapters as f32 masters);
//! `--losses N` takes N seeded steps and prints the last step's loss;
//! `--variant loss` prints the batch's loss with the checkpoint loaded in
//! the precision's dtype (`f32`, `bf16-mixed`, `f16-mixed`), beside
//! `benches/peers/llm_loss.py`'s from transformers.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, DpConfig, Precision, PrivacyEngine, Trainable};
use candle_func::models::gpt2::Gpt2LmHeadModel;
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::{causal_lm_loss, Checkpoint};
use candle_func::nn::{self, cross_entropy, Lora, LoraConfig, Module, Params, Reduction};
use candle_func::optim::Optimizer;
use candle_func::{grad, jit, make_graph, Tracer};
use common::arg;
use std::collections::BTreeMap;

/// The families the scale checkpoints come in.
enum Lm {
    Llama(Box<LlamaForCausalLM>),
    Gpt2(Box<Gpt2LmHeadModel>),
}

impl Lm {
    fn load(ck: &Checkpoint) -> candle_func::Result<Lm> {
        Ok(match ck.model_type()?.as_str() {
            "gpt2" => Lm::Gpt2(Box::new(Gpt2LmHeadModel::load(ck)?)),
            _ => Lm::Llama(Box::new(LlamaForCausalLM::load(ck)?)),
        })
    }

    fn module(&self) -> &dyn Module {
        match self {
            Lm::Llama(m) => m.as_ref(),
            Lm::Gpt2(m) => m.as_ref(),
        }
    }

    fn logits(&self, p: &Params, ids: &Tracer, mask: &Tracer) -> candle_func::Result<Tracer> {
        match self {
            Lm::Llama(m) => m.forward_full(p, ids, Some(mask)),
            Lm::Gpt2(m) => m.forward_full(p, ids, Some(mask)),
        }
    }

    /// peft's usual targets: the query and value projections.
    fn lora_targets(&self) -> &'static [&'static str] {
        match self {
            Lm::Llama(_) => &["q_proj", "v_proj"],
            Lm::Gpt2(_) => &["c_attn"],
        }
    }

    fn vocab(&self) -> usize {
        match self {
            Lm::Llama(m) => m.config().vocab_size,
            Lm::Gpt2(m) => m.config().vocab_size,
        }
    }
}

/// Ids and mask `[B, T]` as `bench_llm.py` draws them (the same recurrence):
/// example `i` keeps `T - 16 i` tokens (at least 2), then padding (id 0).
fn batch(b: usize, t: usize, vocab: usize) -> candle_func::Result<(Tensor, Tensor)> {
    let (mut ids, mut mask) = (vec![0u32; b * t], vec![0u32; b * t]);
    let mut state = 2024u64;
    for i in 0..b {
        for j in 0..t.saturating_sub(16 * i).max(2.min(t)) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ids[i * t + j] = ((state >> 33) % vocab as u64) as u32;
            mask[i * t + j] = 1;
        }
    }
    Ok((
        Tensor::from_vec(ids, (b, t), &Device::Cpu)?,
        Tensor::from_vec(mask, (b, t), &Device::Cpu)?,
    ))
}

type Map = BTreeMap<String, Tracer>;

/// `p`, with the adapters applied where there are any.
fn params<'a>(p: &'a Map, lora: &'a Option<Lora>) -> Params<'a> {
    match lora {
        Some(l) => Params::with(p).lora(l),
        None => Params::with(p),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let variant: String = arg("--variant", "forward".to_string());
    let reps: usize = arg("--reps", 2);
    let (b, t): (usize, usize) = (arg("--b", 4), arg("--t", 128));
    let dir: String = arg("--model", std::env::var("CANDLE_FUNC_SCALE_MODEL").unwrap_or_default());
    if dir.is_empty() {
        return Err("--model DIR: a folder scripts/make_scale_checkpoint.py printed".into());
    }
    if !matches!(variant.as_str(), "forward" | "loss" | "lora_step" | "dp_lora" | "dp") {
        return Err(format!("--variant {variant}: one of forward, loss, lora_step, dp_lora, dp").into());
    }
    let (precision, dtype) = match arg("--precision", "f32".to_string()).as_str() {
        "f32" => (Precision::Native, DType::F32),
        "bf16-mixed" => (Precision::Bf16Mixed, DType::BF16),
        "f16-mixed" => (Precision::F16Mixed, DType::F16),
        other => return Err(format!("--precision {other}: f32, bf16-mixed or f16-mixed").into()),
    };
    // the weights read straight into the variables the optimisers step
    let model = Lm::load(&Checkpoint::load_variables(&dir, dtype, &Device::Cpu)?)?;
    let varmap = nn::varmap_of(model.module())?;
    let lora = match variant.as_str() {
        "lora_step" | "dp_lora" => Some(Lora::add(
            model.module(),
            &varmap,
            // f32 adapters: the masters of the mixed policy
            LoraConfig::new(8, 16.0, model.lora_targets()).dtype(DType::F32),
        )?),
        _ => None,
    };
    let (ids, mask) = batch(b, t, model.vocab())?;
    let all: BTreeMap<String, Tensor> = model.module().params();
    let trainable = match &lora {
        Some(l) => l.trainable_params(&varmap)?,
        None => all.clone(),
    };
    // the batch's loss: each example's token mean, averaged (as batched
    // operations: one cross-entropy over every position of the batch)
    let batch_loss = |p: Map, ids: Tracer, mask: Tracer| {
        let logits = model.logits(&params(&p, &lora), &ids, &mask)?;
        let v = logits.dims()[2];
        // B T V -> (B T-1) V: positions 0..T-1 predict tokens 1..T
        let pred = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
        let target = ids.narrow(1, 1, t - 1)?.reshape(b * (t - 1))?;
        let losses = cross_entropy(&pred, &target, Reduction::None)?.reshape((b, t - 1))?;
        let w = mask.narrow(1, 1, t - 1)?.ne(0.0)?.to_dtype(losses.dtype())?;
        losses.mul(&w)?.sum(1)?.div(&w.sum(1)?)?.mean_all()
    };
    // one example's loss, for the DP trainer
    let one = |p: Map, ids: Tracer, mask: Tracer| {
        let logits = model.logits(&params(&p, &lora), &ids, &mask)?;
        causal_lm_loss(&logits, &ids, Some(&mask))
    };
    // the trainer's loss as the trainer traces it: the f32 masters read in
    // the compute dtype (for the plan and the profile)
    let cast = |p: Map, ids: Tracer, mask: Tracer| {
        let p = p
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
            .collect::<candle_func::Result<Map>>()?;
        one(p, ids, mask)
    };
    let forward = jit(|p: Map, ids: Tracer, mask: Tracer| model.logits(&params(&p, &lora), &ids, &mask));
    let step = grad(batch_loss);
    let mut sgd = candle_func::optim::Sgd::new(&varmap, 1e-4, 0.0)?;
    let limit_gib: f64 = arg("--memory-limit-gib", 0.0);
    let optimizer: Box<dyn Optimizer> = match arg("--optimizer", "sgd".to_string()).as_str() {
        "sgd" => Box::new(candle_func::optim::Sgd::new(&varmap, 1e-4, 0.0)?),
        "adamw" => Box::new(candle_func::optim::AdamW::new(&varmap, 1e-4, 0.01)?),
        other => return Err(format!("--optimizer {other}: sgd or adamw").into()),
    };
    let mut trainer = match variant.as_str() {
        "dp" | "dp_lora" => {
            let mut engine = PrivacyEngine::new().precision(precision).trainable(match &lora {
                Some(l) => Trainable::prefixes(&l.trainable_prefixes()),
                None => Trainable::all(),
            });
            if arg("--losses", 0usize) > 0 {
                engine = engine.rng(candle_func::rng::Rng::seeded(0));
            }
            engine = match limit_gib > 0.0 {
                true => {
                    common::return_freed_memory();
                    engine.memory_limit((limit_gib * (1u64 << 30) as f64) as usize)
                }
                false => engine.physical_batch(b),
            };
            let tr = engine.make_private(one, &varmap, optimizer, (&ids, &mask), DpConfig::new(b, 1.0, 1.0))?;
            if let Some(plan) = tr.memory_plan() {
                let gib = |v: usize| v as f64 / (1u64 << 30) as f64;
                println!(
                    "memory plan: physical batch {} of {b}, total {:.2} GiB under {limit_gib} GiB: pass {:.2}, \
                     weights {:.2}, optimizer {:.2}, sums {:.2}, workspace {:.2}, data {:.3}, rest {:.2}",
                    plan.physical_batch,
                    gib(plan.total()),
                    gib(plan.pass),
                    gib(plan.weights),
                    gib(plan.optimizer),
                    gib(plan.sums),
                    gib(plan.workspace),
                    gib(plan.data),
                    gib(plan.rest)
                );
            }
            Some(tr)
        }
        _ => None,
    };
    if variant == "loss" {
        // the batch's loss with the checkpoint in the precision's dtype
        // (`benches/peers/llm_loss.py` prints transformers')
        let loss = jit(batch_loss).call((&all, &ids, &mask))?;
        let v = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        println!("RESULT ours_loss {dtype:?} {v:.6}");
        return Ok(());
    }
    if let (n @ 1.., Some(tr)) = (arg("--losses", 0usize), trainer.as_mut()) {
        let mut last = f64::NAN;
        for _ in 0..n {
            last = tr.step()?.mean_loss;
        }
        println!("RESULT ours_{variant} loss_after_{n}_steps {last:.6}");
        return Ok(());
    }
    if arg("--profile", 0usize) > 0 {
        // the variant's graph with per-node timings (`--profile RUNS`)
        let (g, p) = match variant.as_str() {
            "forward" => (make_graph(&forward, (&all, &ids, &mask))?, &all),
            "lora_step" => (make_graph(&step, (&trainable, &ids, &mask))?, &trainable),
            _ => (
                make_graph(&dp::clipped_grad_sum(cast, 1.0), (&trainable, &ids, &mask))?,
                &trainable,
            ),
        };
        let mut inputs: Vec<Tensor> = p.values().cloned().collect();
        inputs.extend([ids.clone(), mask.clone()]);
        let title = format!("{variant}, B={b}, T={t}");
        return Ok(common::profile::report(&title, &g, &inputs, arg("--profile", 0usize))?);
    }
    let run = || -> candle_func::Result<()> {
        match (variant.as_str(), trainer.as_mut()) {
            ("forward", _) => forward.call((&all, &ids, &mask)).map(|_| ()),
            ("lora_step", _) => sgd.step(&step.call((&trainable, &ids, &mask))?),
            (_, Some(tr)) => tr.step().map(|_| ()),
            (other, None) => Err(candle_func::Error::Config {
                msg: format!("--variant {other}: no trainer was made for it"),
            }),
        }
    };
    common::report(&variant, reps, run, || -> candle_func::Result<usize> {
        Ok(match variant.as_str() {
            "forward" => make_graph(&forward, (&all, &ids, &mask))?.planned_peak_bytes(),
            "lora_step" => make_graph(&step, (&trainable, &ids, &mask))?.planned_peak_bytes(),
            _ => make_graph(&dp::clipped_grad_sum(cast, 1.0), (&trainable, &ids, &mask))?.planned_peak_bytes(),
        })
    })?;
    Ok(())
}
