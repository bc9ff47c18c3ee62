//! GPT-2 (Hugging Face's `GPT2LMHeadModel`): learned positions, pre-norm
//! blocks whose projections are `Conv1D`s (weights stored `[in, out]`),
//! the fused `c_attn` split into queries, keys and values, `ln_f`, and the
//! output head tied to `wte`.

use super::bert::layer_norm;
use super::{activation, as_batch, unsupported, Checkpoint};
use crate::error::Result;
use crate::nn::{Activation, AttentionMask, Embedding, LayerNorm, Linear, Module, Params, SelfAttention};
use crate::trace::Tracer;
use candle_core::Tensor;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The fields of a GPT-2 `config.json` this crate reads.
#[derive(Clone, Debug, Deserialize)]
pub struct Gpt2Config {
    /// Rows of `wte`.
    pub vocab_size: usize,
    /// Features per token.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Rows of `wpe`: the longest sequence.
    pub n_positions: usize,
    /// Features of the feed-forward layer (4 `n_embd` when absent).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The feed-forward activation.
    #[serde(default = "gelu_new")]
    pub activation_function: String,
    /// The layer norms' epsilon.
    #[serde(default = "gpt2_eps")]
    pub layer_norm_epsilon: f64,
    /// Scores divided by `sqrt(head size)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Scores of block `i` also divided by `i + 1`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The output head is `wte` (the only layout implemented).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn gelu_new() -> String {
    "gelu_new".into()
}
fn gpt2_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}

struct Block {
    ln_1: LayerNorm,
    attn: SelfAttention,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

fn conv1d(ck: &Checkpoint, name: &str, inp: usize, out: usize) -> Result<Linear> {
    let w = ck.weight(&format!("{name}.weight"), &[inp, out])?;
    let b = ck.weight(&format!("{name}.bias"), &[out])?;
    Ok(Linear::from_tensors_in_out(w, Some(b), name))
}

impl Block {
    fn load(ck: &Checkpoint, c: &Gpt2Config, name: &str) -> Result<Block> {
        let (d, eps) = (c.n_embd, c.layer_norm_epsilon);
        // sizes from config.json, checked: a wrapped product would be a
        // shape no weight has, a panic in a debug build
        let times = |k: usize| {
            d.checked_mul(k)
                .ok_or_else(|| super::unsupported("gpt2", "n_embd", format!("{k} x {d} overflows usize")))
        };
        let f = match c.n_inner {
            Some(f) => f,
            None => times(4)?,
        };
        let qkv = times(3)?;
        Ok(Block {
            ln_1: layer_norm(ck, &format!("{name}.ln_1"), d, eps)?,
            attn: SelfAttention::fused(
                conv1d(ck, &format!("{name}.attn.c_attn"), d, qkv)?,
                conv1d(ck, &format!("{name}.attn.c_proj"), d, d)?,
                c.n_head,
            )?,
            ln_2: layer_norm(ck, &format!("{name}.ln_2"), d, eps)?,
            c_fc: conv1d(ck, &format!("{name}.mlp.c_fc"), d, f)?,
            mlp_proj: conv1d(ck, &format!("{name}.mlp.c_proj"), f, d)?,
        })
    }

    fn params(&self, into: &mut BTreeMap<String, Tensor>) {
        into.extend(self.attn.params());
        for m in [&self.c_fc, &self.mlp_proj] {
            into.extend(m.params());
        }
        into.extend(self.ln_1.params());
        into.extend(self.ln_2.params());
    }
}

/// GPT-2 with its language-modelling head: logits `[.., T, vocab]`.
pub struct Gpt2LmHeadModel {
    config: Gpt2Config,
    act: Activation,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

impl Gpt2LmHeadModel {
    /// A GPT-2 checkpoint (`transformer.*`, or bare as `GPT2Model` saves
    /// it); the head is `wte`.
    pub fn load(ck: &Checkpoint) -> Result<Gpt2LmHeadModel> {
        let c: Gpt2Config = ck.parse_config("gpt2")?;
        let act = activation("gpt2", "activation_function", &c.activation_function)?;
        if !c.tie_word_embeddings {
            return Err(unsupported(
                "gpt2",
                "tie_word_embeddings",
                "an untied GPT-2 head is not implemented",
            ));
        }
        if c.n_head == 0 || !c.n_embd.is_multiple_of(c.n_head) {
            return Err(unsupported(
                "gpt2",
                "n_head",
                format!("{} heads do not divide n_embd {}", c.n_head, c.n_embd),
            ));
        }
        let pre = if ck.has("transformer.wte.weight") {
            "transformer."
        } else {
            ""
        };
        let d = c.n_embd;
        let table = |name: &str, rows: usize| -> Result<Embedding> {
            let full = format!("{pre}{name}");
            Ok(Embedding::from_tensors(
                ck.weight(&format!("{full}.weight"), &[rows, d])?,
                &full,
            ))
        };
        let blocks = (0..c.n_layer)
            .map(|i| Block::load(ck, &c, &format!("{pre}h.{i}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt2LmHeadModel {
            wte: table("wte", c.vocab_size)?,
            wpe: table("wpe", c.n_positions)?,
            ln_f: layer_norm(ck, &format!("{pre}ln_f"), d, c.layer_norm_epsilon)?,
            blocks,
            act,
            config: c,
        })
    }

    /// The configuration read from `config.json`.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// Logits `[.., T, vocab]` of token ids `[T]` or `[B, T]` and their
    /// attention mask.
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.forward_full(&Params::own(), ids, mask)
    }

    /// [`Self::forward_masked`] with parameters replaced by name.
    pub fn forward_full(&self, p: &Params, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        let c = &self.config;
        let b = as_batch("gpt2", ids, mask, c.n_positions)?;
        let t = b.ids.dims()[1];
        let pos = self.wpe.table(p, &b.ids)?.narrow(0, 0, t)?; // T D
        let mut h = self.wte.forward_with(p, &b.ids)?.broadcast_add(&pos)?; // N T D
        let attn_mask = AttentionMask {
            window: None,
            causal: true,
            keep: b.keep.clone(),
        };
        let (d, heads) = (c.n_embd, c.n_head);
        for (i, blk) in self.blocks.iter().enumerate() {
            let x = blk.ln_1.forward_with(p, &h)?;
            let mut scale = if c.scale_attn_weights {
                1.0 / ((d / heads) as f64).sqrt()
            } else {
                1.0
            };
            if c.scale_attn_by_inverse_layer_idx {
                scale /= (i + 1) as f64;
            }
            h = h.add(&blk.attn.forward(p, &x, &attn_mask, scale, None)?)?;
            let x = blk.ln_2.forward_with(p, &h)?;
            let ff = blk
                .mlp_proj
                .forward_with(p, &self.act.forward_with(p, &blk.c_fc.forward_with(p, &x)?)?)?;
            h = h.add(&ff)?;
        }
        let h = self.ln_f.forward_with(p, &h)?;
        // the head tied to wte: N T D @ D V
        let logits = h.matmul(&self.wte.table(p, &h)?.t()?)?;
        b.finish(logits)
    }
}

impl Module for Gpt2LmHeadModel {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = BTreeMap::new();
        all.extend(self.wte.params());
        all.extend(self.wpe.params());
        for b in &self.blocks {
            b.params(&mut all);
        }
        all.extend(self.ln_f.params());
        all
    }

    fn in_out_weights(&self) -> Vec<String> {
        let mut all = Vec::new();
        for b in &self.blocks {
            all.extend(b.attn.in_out_weights());
            all.extend(b.c_fc.in_out_weights());
            all.extend(b.mlp_proj.in_out_weights());
        }
        all
    }
}
