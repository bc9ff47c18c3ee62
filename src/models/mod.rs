//! Pretrained Hugging Face models, traced: load a checkpoint folder as the
//! Hub lays it out (`config.json` and `model.safetensors`, or shards with
//! `model.safetensors.index.json`), under Hugging Face's parameter names,
//! and run it under `vmap`, `grad`, `jvp` and the DP trainer.
//!
//! * BERT ([`bert`]): `BertModel`, `BertForSequenceClassification`;
//! * RoBERTa ([`roberta`]): `RobertaModel`, `RobertaForSequenceClassification`;
//! * GPT-2 ([`gpt2`]): `GPT2LMHeadModel`;
//! * the Llama family ([`llama`]): `LlamaForCausalLM`, and the Mistral and
//!   Qwen2 configurations.
//!
//! Each model takes token ids and an attention mask (1 for a real token, 0
//! for padding, as Hugging Face's `attention_mask`), either one example's
//! `[T]` (under `vmap`) or a batch `[B, T]`, and honours the mask in
//! attention, positions and pooling. Each is a [`Module`]
//! too (ids alone, no mask), so `functional_call` and `stack_params` apply;
//! its `params()` are named as in the checkpoint.
//!
//! Each model is built from one struct per Hugging Face module through a
//! `candle_nn::VarBuilder` ([`Checkpoint::var_builder`], or any other with
//! `load_vb`), and its `params()` are the weights those structs read.
//!
//! A configuration this crate does not implement (an unknown
//! `hidden_act`, `rope_scaling`, a relative `position_embedding_type`, an
//! unknown entry of `layer_types`) is an [`Error::Model`] naming the field,
//! never ignored.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_func::models::{bert::BertModel, mean_pool, Checkpoint};
//! use candle_func::{vmap, Tracer};
//! let ck = Checkpoint::load("all-MiniLM-L6-v2", DType::F32, &Device::Cpu)?;
//! let model = BertModel::load(&ck)?;
//! let ids = Tensor::new(&[[101u32, 7592, 2088, 102]], &Device::Cpu)?;
//! let mask = Tensor::ones((1, 4), DType::U32, &Device::Cpu)?;
//! // one sentence per call under vmap: [T] ids and mask
//! let embed = |ids: Tracer, mask: Tracer| mean_pool(&model.forward_masked(&ids, Some(&mask))?, &mask);
//! let e = vmap(embed).call((&ids, &mask))?; // [1, 384]
//! # Ok::<(), candle_func::Error>(())
//! ```

/// A family's `load(ck)`: the model from a checkpoint folder, its
/// `config.json` parsed as that family's and its weights read through
/// `load_vb` (what every model type of the crate offers), documented by
/// `$doc`.
macro_rules! load_checkpoint {
    ($family:literal, $doc:literal) => {
        #[doc = $doc]
        pub fn load(ck: &crate::models::Checkpoint) -> crate::error::Result<Self> {
            Self::load_vb(ck.var_builder(), &ck.parse_config($family)?)
        }
    };
}

mod checkpoint;
mod loader;
mod weights;

pub mod bert;
pub mod gpt2;
pub mod llama;
pub mod roberta;

pub use checkpoint::Checkpoint;

use crate::error::{Error, Result};
use crate::nn::{cross_entropy, Activation, Embedding, Linear, Module, Params, Reduction};
use crate::trace::Tracer;
use candle_core::DType;

/// The activation a config's `field` names, or an error naming the field
/// and the names implemented.
pub(crate) fn activation(model: &str, field: &str, name: &str) -> Result<Activation> {
    Activation::from_hf(name).ok_or_else(|| {
        unsupported(
            model,
            field,
            format!(
                "\"{name}\" is not implemented (gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, silu, swish, quick_gelu, tanh, sigmoid are)"
            ),
        )
    })
}

/// An error about a config field, for the models' checks after parsing.
pub(crate) fn unsupported(model: &str, field: &str, msg: impl Into<String>) -> Error {
    Error::Model {
        what: format!("{model} config.json field \"{field}\""),
        msg: msg.into(),
    }
}

/// Token ids and their mask as a batch: one example's `[T]` becomes
/// `[1, T]` (and the result is squeezed back), a batch `[B, T]` stays.
/// The mask, when given, must have the ids' shape.
pub(crate) struct Batch {
    pub ids: Tracer,
    pub keep: Option<Tracer>,
    pub one: bool,
}

pub(crate) fn as_batch(op: &'static str, ids: &Tracer, mask: Option<&Tracer>, max_len: usize) -> Result<Batch> {
    if !matches!(ids.rank(), 1 | 2) || ids.dtype().is_float() {
        return Err(Error::shape(
            op,
            &[ids.dims()],
            format!(
                "token ids are integers, [T] for one example or [B, T], got {:?}",
                ids.dtype()
            ),
        ));
    }
    if let Some(m) = mask {
        if m.dims() != ids.dims() {
            return Err(Error::shape(
                op,
                &[ids.dims(), m.dims()],
                "the attention mask must have the token ids' shape",
            ));
        }
    }
    let t = *ids.dims().last().unwrap_or(&0);
    if t == 0 || t > max_len {
        return Err(Error::shape(
            op,
            &[ids.dims()],
            format!("a sequence of {t} tokens: the model takes 1 to {max_len} (max_position_embeddings)"),
        ));
    }
    let one = ids.rank() == 1;
    let lift = |x: &Tracer| if one { x.unsqueeze(0) } else { Ok(x.clone()) };
    Ok(Batch {
        ids: lift(ids)?,
        keep: mask.map(lift).transpose()?,
        one,
    })
}

impl Batch {
    /// A result `[1, ..]` back to one example's `[..]`.
    pub(crate) fn finish(&self, y: Tracer) -> Result<Tracer> {
        if self.one {
            y.squeeze(0)
        } else {
            Ok(y)
        }
    }
}

/// The first token's hidden state, `[.., T, D] -> [.., D]` (BERT's `[CLS]`,
/// RoBERTa's `<s>`: what their poolers and heads read).
pub(crate) fn first_token(hidden: &Tracer) -> Result<Tracer> {
    let ax = hidden
        .rank()
        .checked_sub(2)
        .ok_or_else(|| Error::shape("first_token", &[hidden.dims()], "expected hidden states [.., T, D]"))?;
    hidden.narrow(ax, 0, 1)?.squeeze(ax)
}

/// Mean of the hidden states `[.., T, D]` over the real tokens of `mask`
/// `[.., T]` (sentence-transformers' mean pooling). An example with no
/// real token pools to zeros, as there (its count is clamped to 1e-9).
pub fn mean_pool(hidden: &Tracer, mask: &Tracer) -> Result<Tracer> {
    let (h, m) = (hidden.dims(), mask.dims());
    if h.len() < 2 || h[..h.len() - 1] != *m {
        return Err(Error::shape(
            "mean_pool",
            &[h, m],
            "expected hidden states [.., T, D] and a mask [.., T]",
        ));
    }
    let w = mask.to_dtype(hidden.dtype())?.unsqueeze(m.len())?; // .. T 1
    let sum = hidden.broadcast_mul(&w)?.sum(h.len() - 2)?; // .. D
    let count = w.sum(m.len() - 1)?.clamp(1e-9, f64::INFINITY)?; // .. 1
    sum.broadcast_div(&count)
}

/// `x / max(||x||, 1e-12)` over the last axis (PyTorch's `F.normalize`,
/// how sentence embeddings are compared).
pub fn l2_normalize(x: &Tracer) -> Result<Tracer> {
    let last = x
        .rank()
        .checked_sub(1)
        .ok_or_else(|| Error::shape("l2_normalize", &[x.dims()], "needs an axis"))?;
    let norm = x.sqr()?.sum_keepdim(last)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
    x.broadcast_div(&norm)
}

/// Causal language modelling's loss as Hugging Face's models compute it:
/// the logits at each position against the next token, averaged over the
/// positions whose target is a real token of `mask` (all when `None`).
/// `logits` `[T, V]` with `ids` `[T]` (one example), or `[B, T, V]` with
/// `[B, T]` (the mean over the batch's real targets).
pub fn causal_lm_loss(logits: &Tracer, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
    let (l, i) = (logits.dims(), ids.dims());
    let fits =
        matches!(l.len(), 2 | 3) && i.len() + 1 == l.len() && l[..l.len() - 1] == *i && *i.last().unwrap_or(&0) >= 2;
    if !fits || mask.is_some_and(|m| m.dims() != i) {
        return Err(Error::shape(
            "causal_lm_loss",
            &[l, i],
            "expected logits [.., T, V], token ids and mask [.., T], T >= 2",
        ));
    }
    let (ta, v) = (i.len() - 1, l[l.len() - 1]);
    let t = i[ta];
    // positions 0..T-1 predict tokens 1..T
    let pred = logits.narrow(ta, 0, t - 1)?.reshape(((), v))?;
    let target = ids.narrow(ta, 1, t - 1)?.flatten_all()?;
    let losses = cross_entropy(&pred, &target, Reduction::None)?;
    match mask {
        None => losses.mean_all(),
        Some(m) => {
            let w = m
                .narrow(ta, 1, t - 1)?
                .flatten_all()?
                .ne(0.0)?
                .to_dtype(losses.dtype())?;
            losses.mul(&w)?.sum_all()?.div(&w.sum_all()?)
        }
    }
}

/// The integer dtype ids are converted to for a lookup where they are
/// computed (RoBERTa's positions).
pub(crate) const ID_DTYPE: DType = DType::U32;

/// A causal language model's logits from its last hidden states `h`
/// (`N T D`): its own head where it has one, else the head tied to its
/// token embedding (`N T D @ D V`, as GPT-2 and a tied Llama have it).
pub(crate) fn lm_logits(p: &Params, h: &Tracer, head: Option<&Linear>, embedding: &Embedding) -> Result<Tracer> {
    match head {
        Some(head) => head.forward_with(p, h),
        None => h.matmul(&embedding.table(p, h)?.t()?),
    }
}
