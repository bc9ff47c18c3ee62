//! The Llama family (Hugging Face's `LlamaForCausalLM`, and the Mistral
//! and Qwen2 configurations): RMSNorm, rotary embeddings in the
//! rotate-half layout with `rope_theta`, SwiGLU, grouped-query and
//! multi-query attention (`num_key_value_heads`), q/k/v biases (Qwen2,
//! or `attention_bias`), and a tied or untied head.

use super::loader::recording;
use super::{activation, as_batch, lm_logits, unsupported};
use crate::error::Result;
use crate::nn::{
    embedding, linear_b, linear_no_bias, rms_norm, Activation, AttentionMask, Embedding, Linear, Module, Params,
    RmsNorm, RotaryCache, SelfAttention,
};
use crate::trace::{Operand, Tracer};
use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The fields of a Llama, Mistral or Qwen2 `config.json` this crate reads.
#[derive(Clone, Debug, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `mistral` or `qwen2`.
    pub model_type: String,
    /// Rows of the embedding.
    pub vocab_size: usize,
    /// Features per token.
    pub hidden_size: usize,
    /// Features of the SwiGLU layer.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (the query heads' count when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Features per head (`hidden_size / num_attention_heads` when absent).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The SwiGLU gate's activation.
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// The longest sequence.
    pub max_position_embeddings: usize,
    /// The RMS norms' epsilon.
    #[serde(default = "llama_eps")]
    pub rms_norm_eps: f64,
    /// The rotary base (transformers 4.x writes it here).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Must be absent or null: scaled rotary embeddings are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5.x's rotary settings: `rope_theta` and `rope_type`
    /// (only `default` is implemented).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Biases on q, k, v and o (Llama); Qwen2 has q, k, v biases always.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases on the SwiGLU projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The output head is the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral's (and Qwen2's, when `use_sliding_window`) attention window.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2: whether `sliding_window` applies.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Qwen2 (transformers 4.x): the first this many layers attend in
    /// full, the rest through the window (28 when absent, as transformers'
    /// default).
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// transformers 5.x: each layer's attention, `full_attention` or
    /// `sliding_attention`; wins over `max_window_layers`.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// The padding token: its embedding row gets no gradient (PyTorch's
    /// `padding_idx`, as Hugging Face builds the table).
    #[serde(default)]
    pub pad_token_id: Option<usize>,
    /// Must be absent or 1: a partial rotary embedding is not implemented.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

fn silu() -> String {
    "silu".into()
}
fn llama_eps() -> f64 {
    1e-6
}

/// What a config resolves to, checked.
struct Resolved {
    kv_heads: usize,
    head_dim: usize,
    // heads x head size of the queries and of the keys/values, checked
    q_dim: usize,
    kv_dim: usize,
    theta: f64,
    qkv_bias: bool,
    o_bias: bool,
    /// Each layer's sliding window, if it has one.
    windows: Vec<Option<usize>>,
    act: Activation,
}

impl LlamaConfig {
    fn resolve(&self) -> Result<Resolved> {
        let m = self.model_type.as_str();
        if !matches!(m, "llama" | "mistral" | "qwen2") {
            return Err(unsupported(
                m,
                "model_type",
                format!("\"{m}\" is not a Llama-family model this crate implements (llama, mistral, qwen2)"),
            ));
        }
        let act = activation(m, "hidden_act", &self.hidden_act)?;
        let heads = self.num_attention_heads;
        let kv_heads = self.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(unsupported(
                m,
                "num_key_value_heads",
                format!("{kv_heads} key/value heads must divide the {heads} attention heads"),
            ));
        }
        let head_dim = match self.head_dim {
            Some(h) => h,
            None if self.hidden_size.is_multiple_of(heads) => self.hidden_size / heads,
            None => {
                return Err(unsupported(
                    m,
                    "num_attention_heads",
                    format!("{heads} heads do not divide hidden_size {}", self.hidden_size),
                ))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(unsupported(
                m,
                "head_dim",
                format!("the rotary embedding needs an even head size, got {head_dim}"),
            ));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported(
                m,
                "rope_scaling",
                "scaled rotary embeddings are not implemented",
            ));
        }
        if self.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            return Err(unsupported(
                m,
                "partial_rotary_factor",
                "a partial rotary embedding is not implemented",
            ));
        }
        let theta = self.theta(m)?;
        let product = |field: &'static str, n: usize| {
            n.checked_mul(head_dim)
                .ok_or_else(|| unsupported(m, field, format!("{n} heads of {head_dim} overflow usize")))
        };
        let (q_dim, kv_dim) = (
            product("num_attention_heads", heads)?,
            product("num_key_value_heads", kv_heads)?,
        );
        let (qkv_bias, o_bias) = match (m, self.attention_bias) {
            ("qwen2", _) => (true, false),
            (_, Some(b)) => (b, b),
            _ => (false, false),
        };
        let windows = self.windows(m)?;
        Ok(Resolved {
            kv_heads,
            head_dim,
            q_dim,
            kv_dim,
            theta,
            qkv_bias,
            o_bias,
            windows,
            act,
        })
    }

    /// Each layer's window: `layer_types` where given (transformers 5.x);
    /// else Qwen2's layers from `max_window_layers` on when
    /// `use_sliding_window`, Mistral's (and Llama's) every layer.
    fn windows(&self, m: &str) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let Some(w) = self.sliding_window else {
            return Ok(vec![None; n]);
        };
        if let Some(types) = &self.layer_types {
            if types.len() != n {
                let msg = format!("{} entries for {n} layers", types.len());
                return Err(unsupported(m, "layer_types", msg));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(None),
                    "sliding_attention" => Ok(Some(w)),
                    other => Err(unsupported(
                        m,
                        "layer_types",
                        format!("{other:?} attention is not implemented"),
                    )),
                })
                .collect();
        }
        Ok(match m {
            "qwen2" if !self.use_sliding_window => vec![None; n],
            "qwen2" => {
                let full = self.max_window_layers.unwrap_or(28);
                (0..n).map(|i| (i >= full).then_some(w)).collect()
            }
            _ => vec![Some(w); n],
        })
    }

    /// `rope_theta` at the top level (transformers 4.x) or inside
    /// `rope_parameters` (5.x), whose `rope_type` must be `default`.
    fn theta(&self, m: &str) -> Result<f64> {
        let nested = match &self.rope_parameters {
            None | Some(serde_json::Value::Null) => None,
            Some(p) => {
                match p.get("rope_type").and_then(|t| t.as_str()) {
                    None | Some("default") => {}
                    Some(other) => {
                        return Err(unsupported(
                            m,
                            "rope_parameters.rope_type",
                            format!("\"{other}\" is not implemented (only \"default\")"),
                        ))
                    }
                }
                match p.get("rope_theta") {
                    None => None,
                    Some(v) => Some(v.as_f64().ok_or_else(|| {
                        unsupported(m, "rope_parameters.rope_theta", format!("expected a number, got {v}"))
                    })?),
                }
            }
        };
        let theta = nested.or(self.rope_theta).unwrap_or(10000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(unsupported(
                m,
                "rope_theta",
                format!("must be a positive number, got {theta}"),
            ));
        }
        Ok(theta)
    }
}

/// Hugging Face's `LlamaAttention`: q, k, v and o projections over
/// grouped-query heads, with this layer's sliding window.
struct LlamaAttention {
    attn: SelfAttention,
    window: Option<usize>,
}

impl LlamaAttention {
    fn load(vb: VarBuilder, c: &LlamaConfig, r: &Resolved, layer: usize) -> Result<Self> {
        let (d, qd, kvd) = (c.hidden_size, r.q_dim, r.kv_dim);
        Ok(LlamaAttention {
            attn: SelfAttention::separate(
                linear_b(d, qd, r.qkv_bias, vb.pp("q_proj"))?,
                linear_b(d, kvd, r.qkv_bias, vb.pp("k_proj"))?,
                linear_b(d, kvd, r.qkv_bias, vb.pp("v_proj"))?,
                linear_b(qd, d, r.o_bias, vb.pp("o_proj"))?,
                c.num_attention_heads,
                r.kv_heads,
            )?,
            window: r.windows[layer],
        })
    }
}

/// Hugging Face's `LlamaMLP`: `down(act(gate(x)) * up(x))`.
struct LlamaMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
}

impl LlamaMlp {
    fn load(vb: VarBuilder, c: &LlamaConfig, r: &Resolved) -> Result<Self> {
        let (d, f, bias) = (c.hidden_size, c.intermediate_size, c.mlp_bias);
        Ok(LlamaMlp {
            gate_proj: linear_b(d, f, bias, vb.pp("gate_proj"))?,
            up_proj: linear_b(d, f, bias, vb.pp("up_proj"))?,
            down_proj: linear_b(f, d, bias, vb.pp("down_proj"))?,
            act: r.act,
        })
    }

    fn forward(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let gate = self.act.forward_with(p, &self.gate_proj.forward_with(p, x)?)?;
        self.down_proj
            .forward_with(p, &gate.mul(&self.up_proj.forward_with(p, x)?)?)
    }
}

/// Hugging Face's `LlamaDecoderLayer`: pre-norm attention and MLP.
struct LlamaDecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: LlamaMlp,
}

impl LlamaDecoderLayer {
    fn load(vb: VarBuilder, c: &LlamaConfig, r: &Resolved, layer: usize) -> Result<Self> {
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        Ok(LlamaDecoderLayer {
            input_layernorm: rms_norm(d, eps, vb.pp("input_layernorm"))?,
            self_attn: LlamaAttention::load(vb.pp("self_attn"), c, r, layer)?,
            post_attention_layernorm: rms_norm(d, eps, vb.pp("post_attention_layernorm"))?,
            mlp: LlamaMlp::load(vb.pp("mlp"), c, r)?,
        })
    }

    /// `[N, T, D] -> [N, T, D]`; `mask` without this layer's window.
    fn forward(
        &self,
        p: &Params,
        h: &Tracer,
        mask: &AttentionMask,
        scale: f64,
        rope: (&Tracer, &Tracer),
    ) -> Result<Tracer> {
        let mask = AttentionMask {
            window: self.self_attn.window,
            ..mask.clone()
        };
        let x = self.input_layernorm.forward_with(p, h)?;
        let h = h.add(&self.self_attn.attn.forward(p, &x, &mask, scale, Some(rope))?)?;
        let x = self.post_attention_layernorm.forward_with(p, &h)?;
        h.add(&self.mlp.forward(p, &x)?)
    }
}

/// Hugging Face's `LlamaModel`: the embedding, the layers and the final
/// norm.
struct LlamaModel {
    embed_tokens: Embedding,
    layers: Vec<LlamaDecoderLayer>,
    norm: RmsNorm,
}

impl LlamaModel {
    fn load(vb: VarBuilder, c: &LlamaConfig, r: &Resolved) -> Result<Self> {
        let d = c.hidden_size;
        let mut embed_tokens = embedding(c.vocab_size, d, vb.pp("embed_tokens"))?;
        if let Some(pad) = c.pad_token_id {
            embed_tokens = embed_tokens.with_padding_idx(pad)?;
        }
        let layers = (0..c.num_hidden_layers)
            .map(|i| LlamaDecoderLayer::load(vb.pp("layers").pp(i), c, r, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(LlamaModel {
            embed_tokens,
            layers,
            norm: rms_norm(d, c.rms_norm_eps, vb.pp("norm"))?,
        })
    }
}

/// A Llama-family causal language model: logits `[.., T, vocab]`.
pub struct LlamaForCausalLM {
    config: LlamaConfig,
    r: Resolved,
    model: LlamaModel,
    // None: tied to the embedding
    lm_head: Option<Linear>,
    // built for the lengths the model runs at, not max_position_embeddings
    rotary: RotaryCache,
    // every weight the structs above read, by name
    params: BTreeMap<String, Tensor>,
}

impl LlamaForCausalLM {
    load_checkpoint!(
        "llama",
        "A Llama, Mistral or Qwen2 checkpoint (`model.*`, `lm_head` unless tied)."
    );

    /// The model from `vb` (a checkpoint's [`Checkpoint::var_builder`](crate::models::Checkpoint::var_builder), or
    /// any `VarBuilder` holding these names) and its configuration, as
    /// candle-transformers' models load. Its parameters are the weights
    /// it read from `vb`.
    pub fn load_vb(vb: VarBuilder, c: &LlamaConfig) -> Result<LlamaForCausalLM> {
        let r = c.resolve()?;
        let (vb, record) = recording(vb);
        let model = LlamaModel::load(vb.pp("model"), c, &r)?;
        let lm_head = match c.tie_word_embeddings {
            true => None,
            false => Some(linear_no_bias(c.hidden_size, c.vocab_size, vb.pp("lm_head"))?),
        };
        let rotary = RotaryCache::new(r.head_dim, r.theta, c.max_position_embeddings, vb.dtype(), vb.device());
        Ok(LlamaForCausalLM {
            model,
            lm_head,
            rotary,
            r,
            config: c.clone(),
            params: record.all(),
        })
    }

    /// The configuration read from `config.json`.
    pub fn config(&self) -> &LlamaConfig {
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
        let b = as_batch("llama", ids, mask, c.max_position_embeddings)?;
        let t = b.ids.dims()[1];
        let (cos, sin) = self.rotary.tables(t)?;
        let (cos, sin) = (cos.to_tracer(&b.ids)?, sin.to_tracer(&b.ids)?);
        let mask = AttentionMask {
            window: None,
            causal: true,
            keep: b.keep.clone(),
        };
        let scale = 1.0 / (self.r.head_dim as f64).sqrt();
        let m = &self.model;
        let mut h = m.embed_tokens.forward_with(p, &b.ids)?; // N T D
        for layer in &m.layers {
            h = layer.forward(p, &h, &mask, scale, (&cos, &sin))?;
        }
        let h = m.norm.forward_with(p, &h)?;
        b.finish(lm_logits(p, &h, self.lm_head.as_ref(), &m.embed_tokens)?)
    }
}

impl Module for LlamaForCausalLM {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.params.clone()
    }
}
