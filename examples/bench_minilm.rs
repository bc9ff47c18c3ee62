//! A pretrained model at real size: all-MiniLM-L6-v2 (6-layer BERT, 22.7M
//! parameters) with a new 4-class head, B=32, T=64 (padded, every example
//! keeping 34 to 64 tokens), one variant per process so that the process's
//! peak resident memory is that variant's:
//!
//! * `forward`: the logits of the batch;
//! * `step`: the ordinary training step (the batch's mean loss, its
//!   gradient, SGD);
//! * `psg`: every parameter's per-sample gradient (`vmap(grad)`);
//! * `dp`: one DP-SGD step through `dp::PrivacyEngine` (ghost clipping,
//!   secure noise, SGD), the batch as the whole data set (q = 1);
//! * `dp_lora`: the same DP step training LoRA adapters (rank 8, alpha 16,
//!   on `query` and `value`, peft's names) and the head, the encoder
//!   frozen.
//!
//! ```text
//! CANDLE_FUNC_MINILM="$(scripts/fetch_minilm.sh)" \
//!   cargo run --release --example bench_minilm -- --variant dp --reps 5
//! ```
//!
//! `--profile RUNS` prints where the variant's graph spends its time
//! instead (`forward`, `step`, `psg`; `dp` profiles the clipped gradient
//! sum): per node, per primitive, and each product shape's GFLOP/s.
//!
//! It prints `RESULT ours_<variant> median_ms .. first_ms .. peak_rss_mib ..
//! plan_mib ..`; `benches/peers/side_by_side_minilm.py` pairs it with
//! `bench_minilm.py` (Hugging Face's `BertForSequenceClassification` in
//! PyTorch, Opacus 1.6).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, DpConfig, PrivacyEngine, Trainable};
use candle_func::models::bert::BertModel;
use candle_func::models::Checkpoint;
use candle_func::nn::{self, cross_entropy, Lora, LoraConfig, Module, Params, Reduction};
use candle_func::optim::Optimizer;
use candle_func::{grad, jit, make_graph, vmap, Tracer};
use common::arg;
use std::collections::BTreeMap;

const B: usize = 32;
const T: usize = 64;
const LABELS: usize = 4;

/// `[B, 2, T]`: each example's ids and attention mask (what the DP trainer
/// takes as one tensor), and the labels `[B]`. Ids are drawn by a fixed
/// recurrence, as `bench_minilm.py` draws them: `[CLS]`, words, `[SEP]`,
/// then padding; example `i` keeps `64 - 2 (i mod 16)` tokens.
fn batch(vocab: usize) -> candle_func::Result<(Tensor, Tensor)> {
    let (mut ids, mut mask) = (vec![0u32; B * T], vec![0u32; B * T]);
    let mut state = 12345u64;
    for i in 0..B {
        let keep = T - 2 * (i % 16);
        for t in 0..keep {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let word = 1000 + (state >> 33) as usize % (vocab - 1000);
            ids[i * T + t] = match t {
                0 => 101,
                _ if t == keep - 1 => 102,
                _ => word as u32,
            };
            mask[i * T + t] = 1;
        }
    }
    let ids = Tensor::from_vec(ids, (B, 1, T), &Device::Cpu)?;
    let mask = Tensor::from_vec(mask, (B, 1, T), &Device::Cpu)?;
    let labels = Tensor::from_vec((0..B as u32).map(|i| i % LABELS as u32).collect(), B, &Device::Cpu)?;
    Ok((Tensor::cat(&[ids, mask], 1)?, labels))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let variant: String = arg("--variant", "dp".to_string());
    let reps: usize = arg("--reps", 5);
    let dir = match std::env::var("CANDLE_FUNC_MINILM") {
        Ok(d) => d,
        Err(_) => return Err("set CANDLE_FUNC_MINILM to the folder scripts/fetch_minilm.sh prints".into()),
    };
    let dev = Device::Cpu;
    let bert = BertModel::load(&Checkpoint::load_variables(&dir, DType::F32, &dev)?)?;
    let d = bert.config().hidden_size;
    // every weight a variable of the VarMap the optimisers update: the
    // checkpoint's under Hugging Face's names, and a new head
    let varmap = nn::varmap_of(&bert)?;
    let head = nn::linear(
        d,
        LABELS,
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev).pp("classifier"),
    )?;
    let lora = match variant.as_str() {
        "dp_lora" => {
            let config = LoraConfig::new(8, 16.0, &["query", "value"]).modules_to_save(&["classifier"]);
            Some(Lora::add(&bert, &varmap, config)?)
        }
        _ => None,
    };
    let params: BTreeMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let (xs, ys) = batch(bert.config().vocab_size)?;
    // logits of ids and mask `[.., 2, T]`: one example or a batch
    let logits = |p: &BTreeMap<String, Tracer>, x: &Tracer| -> candle_func::Result<Tracer> {
        let ax = x.rank() - 2;
        let (ids, mask) = (x.narrow(ax, 0, 1)?.squeeze(ax)?, x.narrow(ax, 1, 1)?.squeeze(ax)?);
        let p = match &lora {
            Some(l) => Params::with(p).lora(l),
            None => Params::with(p),
        };
        let h = bert.forward_full(&p, &ids, Some(&mask), None)?;
        head.forward_with(&p, &bert.pool(&p, &h)?)
    };
    let batch_loss =
        |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| cross_entropy(&logits(&p, &x)?, &y, Reduction::Mean);
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        cross_entropy(&logits(&p, &x)?.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let forward = jit(|p: BTreeMap<String, Tracer>, x: Tracer| logits(&p, &x));
    let step = grad(batch_loss);
    let psg = vmap(grad(one)).in_dims([None, Some(0), Some(0)]);
    let mut sgd = candle_func::optim::Sgd::new(&varmap, 1e-3, 0.0)?;
    let trainable = match &lora {
        Some(l) => Trainable::prefixes(&l.trainable_prefixes()),
        None => Trainable::all(),
    };
    let mut trainer = PrivacyEngine::new()
        .rng(candle_func::rng::Rng::seeded(0))
        .physical_batch(B)
        .trainable(trainable)
        .make_private(
            one,
            &varmap,
            candle_func::optim::Sgd::new(&varmap, 1e-3, 0.0)?,
            (&xs, &ys),
            DpConfig::new(B, 1.0, 1.0),
        )?;
    if arg("--profile", 0usize) > 0 {
        let g = match variant.as_str() {
            "forward" => make_graph(&forward, (&params, &xs))?,
            "step" => make_graph(&step, (&params, &xs, &ys))?,
            "psg" => make_graph(&psg, (&params, &xs, &ys))?,
            _ => make_graph(&dp::clipped_grad_sum(one, 1.0), (&params, &xs, &ys))?,
        };
        let mut inputs: Vec<Tensor> = params.values().cloned().collect();
        inputs.push(xs.clone());
        if variant != "forward" {
            inputs.push(ys.clone());
        }
        let title = format!("{variant}, B={B}, T={T}");
        return Ok(common::profile::report(&title, &g, &inputs, arg("--profile", 0usize))?);
    }
    let run = || -> candle_func::Result<()> {
        match variant.as_str() {
            "forward" => forward.call((&params, &xs)).map(|_| ()),
            "step" => sgd.step(&step.call((&params, &xs, &ys))?),
            "psg" => psg.call((&params, &xs, &ys)).map(|_| ()),
            "dp" | "dp_lora" => trainer.step().map(|_| ()),
            other => Err(candle_func::Error::Config {
                msg: format!("--variant {other}: one of forward, step, psg, dp, dp_lora"),
            }),
        }
    };
    common::report(&variant, reps, run, || -> candle_func::Result<usize> {
        Ok(match variant.as_str() {
            "forward" => make_graph(&forward, (&params, &xs))?.planned_peak_bytes(),
            "step" => make_graph(&step, (&params, &xs, &ys))?.planned_peak_bytes(),
            "psg" => make_graph(&psg, (&params, &xs, &ys))?.planned_peak_bytes(),
            _ => 0,
        })
    })?;
    Ok(())
}
