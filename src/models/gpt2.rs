//! GPT-2 (Hugging Face's `GPT2LMHeadModel`): learned positions, pre-norm
//! blocks whose projections are `Conv1D`s (weights stored `[in, out]`),
//! the fused `c_attn` split into queries, keys and values, `ln_f`, and the
//! output head tied to `wte`.

use super::loader::recording;
use super::{activation, as_batch, lm_logits, unsupported};
use crate::error::Result;
use crate::nn::{
    embedding, layer_norm, linear_in_out, Activation, AttentionMask, Embedding, LayerNorm, Linear, Module, Params,
    SelfAttention,
};
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::VarBuilder;
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

/// Hugging Face's `GPT2Attention`: the fused `c_attn` and `c_proj`.
struct Gpt2Attention;

impl Gpt2Attention {
    fn load(vb: VarBuilder, c: &Gpt2Config) -> Result<SelfAttention> {
        let d = c.n_embd;
        let qkv = times(c, 3)?;
        SelfAttention::fused(
            linear_in_out(d, qkv, vb.pp("c_attn"))?,
            linear_in_out(d, d, vb.pp("c_proj"))?,
            c.n_head,
        )
    }
}

/// `n_embd * k`, checked: a wrapped product would be a shape no weight
/// has, a panic in a debug build.
fn times(c: &Gpt2Config, k: usize) -> Result<usize> {
    (c.n_embd.checked_mul(k))
        .ok_or_else(|| unsupported("gpt2", "n_embd", format!("{k} x {} overflows usize", c.n_embd)))
}

/// Hugging Face's `GPT2MLP`: `c_proj(act(c_fc(x)))`.
struct Gpt2Mlp {
    c_fc: Linear,
    c_proj: Linear,
    act: Activation,
}

impl Gpt2Mlp {
    fn load(vb: VarBuilder, c: &Gpt2Config) -> Result<Self> {
        let d = c.n_embd;
        let f = match c.n_inner {
            Some(f) => f,
            None => times(c, 4)?,
        };
        Ok(Gpt2Mlp {
            c_fc: linear_in_out(d, f, vb.pp("c_fc"))?,
            c_proj: linear_in_out(f, d, vb.pp("c_proj"))?,
            act: activation("gpt2", "activation_function", &c.activation_function)?,
        })
    }
}

/// Hugging Face's `GPT2Block`: pre-norm attention and MLP.
struct Gpt2Block {
    ln_1: LayerNorm,
    attn: SelfAttention,
    ln_2: LayerNorm,
    mlp: Gpt2Mlp,
}

impl Gpt2Block {
    fn load(vb: VarBuilder, c: &Gpt2Config) -> Result<Self> {
        let (d, eps) = (c.n_embd, c.layer_norm_epsilon);
        Ok(Gpt2Block {
            ln_1: layer_norm(d, eps, vb.pp("ln_1"))?,
            attn: Gpt2Attention::load(vb.pp("attn"), c)?,
            ln_2: layer_norm(d, eps, vb.pp("ln_2"))?,
            mlp: Gpt2Mlp::load(vb.pp("mlp"), c)?,
        })
    }

    fn forward(&self, p: &Params, h: &Tracer, mask: &AttentionMask, scale: f64) -> Result<Tracer> {
        let x = self.ln_1.forward_with(p, h)?;
        let h = h.add(&self.attn.forward(p, &x, mask, scale, None)?)?;
        let x = self.ln_2.forward_with(p, &h)?;
        let m = &self.mlp;
        let ff = m
            .c_proj
            .forward_with(p, &m.act.forward_with(p, &m.c_fc.forward_with(p, &x)?)?)?;
        h.add(&ff)
    }

    fn in_out_weights(&self) -> Vec<String> {
        let mut all = self.attn.in_out_weights();
        all.extend(self.mlp.c_fc.in_out_weights());
        all.extend(self.mlp.c_proj.in_out_weights());
        all
    }
}

/// Hugging Face's `GPT2Model`: token and position tables, the blocks and
/// `ln_f`.
struct Gpt2Model {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Gpt2Block>,
    ln_f: LayerNorm,
}

impl Gpt2Model {
    fn load(vb: VarBuilder, c: &Gpt2Config) -> Result<Self> {
        let d = c.n_embd;
        let h = (0..c.n_layer)
            .map(|i| Gpt2Block::load(vb.pp("h").pp(i), c))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt2Model {
            wte: embedding(c.vocab_size, d, vb.pp("wte"))?,
            wpe: embedding(c.n_positions, d, vb.pp("wpe"))?,
            h,
            ln_f: layer_norm(d, c.layer_norm_epsilon, vb.pp("ln_f"))?,
        })
    }
}

/// GPT-2 with its language-modelling head: logits `[.., T, vocab]`.
pub struct Gpt2LmHeadModel {
    config: Gpt2Config,
    transformer: Gpt2Model,
    // every weight the structs above read, by name
    params: BTreeMap<String, Tensor>,
}

impl Gpt2LmHeadModel {
    load_checkpoint!(
        "gpt2",
        "A GPT-2 checkpoint (`transformer.*`, or bare as `GPT2Model` saves it); the head is `wte`."
    );

    /// The model from `vb` and its configuration, as candle-transformers'
    /// models load: the blocks under `transformer.` unless `vb` holds a
    /// bare `wte.weight` (a `GPT2Model` checkpoint). `vb` is a checkpoint's
    /// [`Checkpoint::var_builder`](crate::models::Checkpoint::var_builder), or a `VarMap`'s for a new model
    /// initialised as `nn`'s layers are. Its parameters are the weights it
    /// read.
    pub fn load_vb(vb: VarBuilder, c: &Gpt2Config) -> Result<Gpt2LmHeadModel> {
        activation("gpt2", "activation_function", &c.activation_function)?;
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
        let (vb, record) = recording(vb);
        let vb = match vb.contains_tensor("wte.weight") {
            true => vb,
            false => vb.pp("transformer"),
        };
        Ok(Gpt2LmHeadModel {
            transformer: Gpt2Model::load(vb, c)?,
            config: c.clone(),
            params: record.all(),
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
        let (c, m) = (&self.config, &self.transformer);
        let b = as_batch("gpt2", ids, mask, c.n_positions)?;
        let t = b.ids.dims()[1];
        let pos = m.wpe.table(p, &b.ids)?.narrow(0, 0, t)?; // T D
        let mut h = m.wte.forward_with(p, &b.ids)?.broadcast_add(&pos)?; // N T D
        let attn_mask = AttentionMask {
            window: None,
            causal: true,
            keep: b.keep.clone(),
        };
        for (i, blk) in m.h.iter().enumerate() {
            let mut scale = match c.scale_attn_weights {
                true => 1.0 / ((c.n_embd / c.n_head) as f64).sqrt(),
                false => 1.0,
            };
            if c.scale_attn_by_inverse_layer_idx {
                scale /= (i + 1) as f64;
            }
            h = blk.forward(p, &h, &attn_mask, scale)?;
        }
        let h = m.ln_f.forward_with(p, &h)?;
        b.finish(lm_logits(p, &h, None, &m.wte)?)
    }
}

impl Module for Gpt2LmHeadModel {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.params.clone()
    }

    fn in_out_weights(&self) -> Vec<String> {
        self.transformer.h.iter().flat_map(Gpt2Block::in_out_weights).collect()
    }
}
