//! Attention at length: a BERT-base-shaped encoder (12 post-norm layers,
//! hidden 768, 12 heads, feed-forward 3072, GELU; random weights from a
//! `VarMap`, token and position embeddings, a 2-class head) at B = 8,
//! T = 1024, every example padded past its own length, one variant per
//! process so that the peak resident memory is the variant's:
//!
//! * `dp`: one DP-SGD step through `dp::PrivacyEngine` (ghost clipping,
//!   secure noise, SGD), the batch as the whole data set;
//! * `step`: the ordinary training step's gradient;
//! * `forward`: the logits.
//!
//! ```text
//! cargo run --release --example bench_attention -- --variant dp --reps 2
//! ```
//!
//! It prints `RESULT ours_<variant> median_ms .. first_ms .. peak_rss_mib
//! .. plan_mib ..` (the plan is the gradient's for `step`, the clipping
//! step's for `dp`; `--top K` lists that graph's K largest values first).
//! `--layers`,
//! `--t` and `--b` shrink it; `--shape minilm` takes all-MiniLM-L6-v2's
//! sizes instead (6 layers, hidden 384, 12 heads, feed-forward 1536), and
//! `--profile RUNS` prints where the variant's graph spends its time
//! instead (per node, per primitive, each product shape's GFLOP/s), and
//! `--variant psg` times every parameter's per-sample gradient
//! (`vmap(grad)`). `benches/peers/bench_encoder.py` is the same encoder in
//! PyTorch, and `scripts/cpu_scaling.sh` runs both at 1, 4 and 16 threads.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::nn::{self, cross_entropy, Activation, AttentionMask, Module, Params, PostNormBlock, Reduction};
use candle_func::{grad, jit, make_graph, vmap, Tracer};
use candle_nn::{VarBuilder, VarMap};
use common::arg;
use std::collections::BTreeMap;

const VOCAB: usize = 30522;

/// The encoder's sizes: hidden, heads, feed-forward, and the default depth.
#[derive(Clone, Copy)]
struct Shape {
    d: usize,
    heads: usize,
    ff: usize,
    layers: usize,
}

fn shape(name: &str) -> Result<Shape, String> {
    match name {
        "bert-base" => Ok(Shape {
            d: 768,
            heads: 12,
            ff: 3072,
            layers: 12,
        }),
        "minilm" => Ok(Shape {
            d: 384,
            heads: 12,
            ff: 1536,
            layers: 6,
        }),
        other => Err(format!("--shape {other}: one of bert-base, minilm")),
    }
}

struct Encoder {
    words: nn::Embedding,
    positions: nn::Embedding,
    norm: nn::LayerNorm,
    blocks: Vec<PostNormBlock>,
    head: nn::Linear,
}

fn encoder(s: Shape, layers: usize, t: usize, vb: VarBuilder) -> candle_func::Result<Encoder> {
    let Shape {
        d, heads, ff: ff_dim, ..
    } = s;
    let ln = |vb: VarBuilder| nn::layer_norm(d, 1e-12, vb);
    let blocks = (0..layers)
        .map(|i| {
            let vb = vb.pp(format!("layer.{i}"));
            let lin = |i: usize, o: usize, name: &str| nn::linear(i, o, vb.pp(name));
            let attn = nn::SelfAttention::separate(
                lin(d, d, "query")?,
                lin(d, d, "key")?,
                lin(d, d, "value")?,
                lin(d, d, "attention_out")?,
                heads,
                heads,
            )?;
            let ff = (
                lin(d, ff_dim, "intermediate")?,
                Activation::Gelu,
                lin(ff_dim, d, "output")?,
            );
            Ok(PostNormBlock::new(
                attn,
                ln(vb.pp("attention_norm"))?,
                ff,
                ln(vb.pp("output_norm"))?,
            ))
        })
        .collect::<candle_func::Result<Vec<_>>>()?;
    Ok(Encoder {
        words: nn::embedding(VOCAB, d, vb.pp("words"))?,
        positions: nn::embedding(t, d, vb.pp("positions"))?,
        norm: ln(vb.pp("embeddings_norm"))?,
        blocks,
        head: nn::linear(d, 2, vb.pp("classifier"))?,
    })
}

impl Encoder {
    /// Logits `[.., 2]` of ids and mask `[.., 2, T]` (one example or a batch).
    fn logits(&self, p: &Params, x: &Tracer) -> candle_func::Result<Tracer> {
        let one = x.rank() == 2;
        let x = if one { x.unsqueeze(0)? } else { x.clone() };
        let (ids, keep) = (x.narrow(1, 0, 1)?.squeeze(1)?, x.narrow(1, 1, 1)?.squeeze(1)?);
        let t = ids.dims()[1];
        let pos = Tracer::arange(&ids, 0, t as i64, DType::U32)?;
        let h = self
            .words
            .forward_with(p, &ids)?
            .broadcast_add(&self.positions.forward_with(p, &pos)?)?;
        let mut h = self.norm.forward_with(p, &h)?;
        let mask = AttentionMask {
            window: None,
            causal: false,
            keep: Some(keep.clone()),
        };
        for b in &self.blocks {
            h = b.forward(p, &h, &mask)?;
        }
        let first = h.narrow(1, 0, 1)?.squeeze(1)?; // the [CLS] position
        let logits = self.head.forward_with(p, &first)?;
        if one {
            logits.squeeze(0)
        } else {
            Ok(logits)
        }
    }
}

/// `[B, 2, T]` ids and masks (example `i` keeps `T - 32 i` tokens, at
/// least 16) and labels `[B]`.
fn batch(b: usize, t: usize) -> candle_func::Result<(Tensor, Tensor)> {
    let (mut ids, mut keep) = (vec![0u32; b * t], vec![0u32; b * t]);
    let mut state = 7u64;
    for i in 0..b {
        let len = t.saturating_sub(32 * i).max(16.min(t));
        for j in 0..len {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ids[i * t + j] = 1000 + (state >> 33) as u32 % (VOCAB as u32 - 1000);
            keep[i * t + j] = 1;
        }
    }
    let ids = Tensor::from_vec(ids, (b, 1, t), &Device::Cpu)?;
    let keep = Tensor::from_vec(keep, (b, 1, t), &Device::Cpu)?;
    let labels = Tensor::from_vec((0..b as u32).map(|i| i % 2).collect(), b, &Device::Cpu)?;
    Ok((Tensor::cat(&[ids, keep], 1)?, labels))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let variant: String = arg("--variant", "dp".to_string());
    let reps: usize = arg("--reps", 2);
    let s = shape(&arg("--shape", "bert-base".to_string()))?;
    let layers: usize = arg("--layers", s.layers);
    let (b, t): (usize, usize) = (arg("--b", 8), arg("--t", 1024));
    let varmap = VarMap::new();
    let model = encoder(s, layers, t, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let (xs, ys) = batch(b, t)?;
    let params: BTreeMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = model.logits(&Params::with(&p), &x)?;
        cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let batch_loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        cross_entropy(&model.logits(&Params::with(&p), &x)?, &y, Reduction::Mean)
    };
    let forward = jit(|p: BTreeMap<String, Tracer>, x: Tracer| model.logits(&Params::with(&p), &x));
    let step = grad(batch_loss);
    let psg = vmap(grad(one)).in_dims([None, Some(0), Some(0)]);
    let mut trainer = PrivacyEngine::new()
        .rng(candle_func::rng::Rng::seeded(0))
        .physical_batch(b)
        .make_private(
            one,
            &varmap,
            candle_func::optim::Sgd::new(&varmap, 1e-4, 0.0)?,
            (&xs, &ys),
            DpConfig::new(b, 1.0, 1.0),
        )?;
    let run = || -> candle_func::Result<()> {
        match variant.as_str() {
            "forward" => forward.call((&params, &xs)).map(|_| ()),
            "step" => step.call((&params, &xs, &ys)).map(|_| ()),
            "psg" => psg.call((&params, &xs, &ys)).map(|_| ()),
            "dp" => trainer.step().map(|_| ()),
            other => Err(candle_func::Error::Config {
                msg: format!("--variant {other}: one of forward, step, psg, dp"),
            }),
        }
    };
    if arg("--profile", 0usize) > 0 {
        // the variant's graph with per-node timings (`--profile RUNS`)
        let mut inputs: Vec<Tensor> = params.values().cloned().collect();
        inputs.push(xs.clone());
        let g = match variant.as_str() {
            "forward" => make_graph(&forward, (&params, &xs))?,
            "step" => make_graph(&step, (&params, &xs, &ys))?,
            "psg" => make_graph(&psg, (&params, &xs, &ys))?,
            _ => make_graph(&dp::clipped_grad_sum(one, 1.0), (&params, &xs, &ys))?,
        };
        if variant != "forward" {
            inputs.push(ys.clone());
        }
        let title = format!("{variant}, B={b}, T={t}, {layers} layers");
        return Ok(common::profile::report(&title, &g, &inputs, arg("--profile", 0usize))?);
    }
    if arg("--top", 0usize) > 0 {
        // the largest values of the clipping step's graph, by bytes
        let g = make_graph(&dp::clipped_grad_sum(one, 1.0), (&params, &xs, &ys))?;
        let mut nodes: Vec<(usize, String, Vec<usize>)> = g
            .nodes()
            .map(|n| {
                (
                    n.ty().elem_count() * n.ty().dtype.size_in_bytes(),
                    n.name(),
                    n.ty().shape.clone(),
                )
            })
            .collect();
        nodes.sort_by_key(|n| std::cmp::Reverse(n.0));
        for (bytes, name, shape) in nodes.iter().take(arg("--top", 0usize)) {
            println!("{:>9.1} MiB  {name} {shape:?}", *bytes as f64 / (1 << 20) as f64);
        }
    }
    common::report(&variant, reps, run, || -> candle_func::Result<usize> {
        Ok(match variant.as_str() {
            "forward" => make_graph(&forward, (&params, &xs))?.planned_peak_bytes(),
            "step" => make_graph(&step, (&params, &xs, &ys))?.planned_peak_bytes(),
            "psg" => make_graph(&psg, (&params, &xs, &ys))?.planned_peak_bytes(),
            // the trainer's clipping step, as a transform of its own
            _ => make_graph(&dp::clipped_grad_sum(one, 1.0), (&params, &xs, &ys))?.planned_peak_bytes(),
        })
    })?;
    Ok(())
}
