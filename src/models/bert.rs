//! BERT (Hugging Face's `BertModel`, `BertForSequenceClassification`):
//! word, position and token-type embeddings, post-norm encoder blocks, the
//! pooler (tanh of a dense layer on the first token) and the classifier.
//! The encoder is shared with [RoBERTa](super::roberta), which counts
//! positions differently.

use super::{activation, as_batch, first_token, unsupported, Batch, Checkpoint, ID_DTYPE};
use crate::error::Result;
use crate::nn::{
    Activation, AttentionMask, Embedding, LayerNorm, Linear, Module, Params, PostNormBlock, SelfAttention,
};
use crate::trace::Tracer;
use candle_core::Tensor;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The fields of a BERT or RoBERTa `config.json` this crate reads.
#[derive(Clone, Debug, Deserialize)]
pub struct BertConfig {
    /// Rows of the word embedding.
    pub vocab_size: usize,
    /// Features per token.
    pub hidden_size: usize,
    /// Encoder blocks.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Features of the feed-forward layer.
    pub intermediate_size: usize,
    /// The feed-forward activation (`gelu`, `gelu_new`, `relu`, ...).
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// Rows of the position embedding.
    pub max_position_embeddings: usize,
    /// Rows of the token-type embedding.
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    /// The layer norms' epsilon.
    #[serde(default = "bert_eps")]
    pub layer_norm_eps: f64,
    /// The padding token (RoBERTa counts positions from it).
    #[serde(default)]
    pub pad_token_id: Option<usize>,
    /// Only `absolute` is implemented.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// Classes of a classification head (else `id2label`'s count).
    #[serde(default)]
    pub num_labels: Option<usize>,
    /// Class names by index, as Hugging Face writes them.
    #[serde(default)]
    pub id2label: Option<BTreeMap<String, String>>,
    /// A decoder (causal) BERT is not implemented.
    #[serde(default)]
    pub is_decoder: bool,
    /// Cross-attention is not implemented.
    #[serde(default)]
    pub add_cross_attention: bool,
}

fn gelu() -> String {
    "gelu".into()
}
fn two() -> usize {
    2
}
fn bert_eps() -> f64 {
    1e-12
}

impl BertConfig {
    /// Refuses what this crate does not implement, naming the field.
    pub(crate) fn check(&self, model: &str) -> Result<Activation> {
        if let Some(kind) = self.position_embedding_type.as_deref() {
            if kind != "absolute" {
                return Err(unsupported(
                    model,
                    "position_embedding_type",
                    format!("\"{kind}\" is not implemented (only \"absolute\")"),
                ));
            }
        }
        if self.is_decoder || self.add_cross_attention {
            return Err(unsupported(
                model,
                if self.is_decoder {
                    "is_decoder"
                } else {
                    "add_cross_attention"
                },
                "a decoder or cross-attention BERT is not implemented",
            ));
        }
        let heads = self.num_attention_heads;
        if heads == 0 || !self.hidden_size.is_multiple_of(heads) {
            return Err(unsupported(
                model,
                "num_attention_heads",
                format!("{heads} heads do not divide hidden_size {}", self.hidden_size),
            ));
        }
        activation(model, "hidden_act", &self.hidden_act)
    }

    /// Classes of a classification head: `num_labels`, else `id2label`'s
    /// count, else 2 (Hugging Face's default).
    pub fn labels(&self) -> usize {
        self.num_labels
            .or(self.id2label.as_ref().map(BTreeMap::len))
            .unwrap_or(2)
    }
}

/// How an encoder numbers its tokens' positions.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Positions {
    /// `0, 1, .., T-1` (BERT).
    Absolute,
    /// `padding_idx + 1, ..` over the real tokens, `padding_idx` at padding
    /// (RoBERTa's `create_position_ids_from_input_ids`).
    AfterPadding(usize),
}

pub(crate) fn linear(ck: &Checkpoint, name: &str, out: usize, inp: usize) -> Result<Linear> {
    let w = ck.weight(&format!("{name}.weight"), &[out, inp])?;
    let b = ck.weight(&format!("{name}.bias"), &[out])?;
    Ok(Linear::from_tensors(w, Some(b), name))
}

pub(crate) fn layer_norm(ck: &Checkpoint, name: &str, d: usize, eps: f64) -> Result<LayerNorm> {
    let w = ck.weight(&format!("{name}.weight"), &[d])?;
    let b = ck.weight(&format!("{name}.bias"), &[d])?;
    Ok(LayerNorm::from_tensors(w, Some(b), eps, name))
}

pub(crate) fn embedding(ck: &Checkpoint, name: &str, rows: usize, d: usize) -> Result<Embedding> {
    let w = ck.weight(&format!("{name}.weight"), &[rows, d])?;
    Ok(Embedding::from_tensors(w, name))
}

/// One of BERT's post-norm blocks under Hugging Face's names.
fn block(ck: &Checkpoint, c: &BertConfig, act: Activation, name: &str) -> Result<PostNormBlock> {
    let (d, f, eps) = (c.hidden_size, c.intermediate_size, c.layer_norm_eps);
    let a = |leaf: &str| format!("{name}.attention.{leaf}");
    let attn = SelfAttention::separate(
        linear(ck, &a("self.query"), d, d)?,
        linear(ck, &a("self.key"), d, d)?,
        linear(ck, &a("self.value"), d, d)?,
        linear(ck, &a("output.dense"), d, d)?,
        c.num_attention_heads,
        c.num_attention_heads,
    )?;
    Ok(PostNormBlock::new(
        attn,
        layer_norm(ck, &a("output.LayerNorm"), d, eps)?,
        (
            linear(ck, &format!("{name}.intermediate.dense"), f, d)?,
            act,
            linear(ck, &format!("{name}.output.dense"), d, f)?,
        ),
        layer_norm(ck, &format!("{name}.output.LayerNorm"), d, eps)?,
    ))
}

/// The BERT-family encoder: embeddings, blocks and an optional pooler,
/// under a name prefix (`bert`, `roberta`, or none for a bare checkpoint).
pub(crate) struct Encoder {
    pub(crate) config: BertConfig,
    model: &'static str,
    positions: Positions,
    words: Embedding,
    position_table: Embedding,
    types: Embedding,
    emb_norm: LayerNorm,
    blocks: Vec<PostNormBlock>,
    pub(crate) pooler: Option<Linear>,
}

/// The prefix under which a checkpoint holds the encoder: `prefix.` when
/// its embeddings are there (a task model's checkpoint), else none (a bare
/// `BertModel`, as sentence-transformers saves one).
pub(crate) fn encoder_prefix(ck: &Checkpoint, prefix: &str) -> String {
    match ck.has(&format!("{prefix}.embeddings.word_embeddings.weight")) {
        true => format!("{prefix}."),
        false => String::new(),
    }
}

impl Encoder {
    pub(crate) fn load(
        ck: &Checkpoint,
        model: &'static str,
        pre: &str,
        positions: Positions,
        pooler: bool,
    ) -> Result<Encoder> {
        let config: BertConfig = ck.parse_config(model)?;
        let act = config.check(model)?;
        let c = &config;
        let d = c.hidden_size;
        let e = |leaf: &str| format!("{pre}embeddings.{leaf}");
        let blocks = (0..c.num_hidden_layers)
            .map(|i| block(ck, c, act, &format!("{pre}encoder.layer.{i}")))
            .collect::<Result<Vec<_>>>()?;
        let pooler = match pooler {
            true => Some(linear(ck, &format!("{pre}pooler.dense"), d, d)?),
            false => None,
        };
        // PyTorch's padding_idx, as Hugging Face builds these tables: the
        // padding row gets no gradient
        let padded = |t: Embedding| match c.pad_token_id {
            Some(pad) => t.with_padding_idx(pad),
            None => Ok(t),
        };
        let mut position_table = embedding(ck, &e("position_embeddings"), c.max_position_embeddings, d)?;
        if let Positions::AfterPadding(_) = positions {
            position_table = padded(position_table)?;
        }
        Ok(Encoder {
            words: padded(embedding(ck, &e("word_embeddings"), c.vocab_size, d)?)?,
            position_table,
            types: embedding(ck, &e("token_type_embeddings"), c.type_vocab_size, d)?,
            emb_norm: layer_norm(ck, &e("LayerNorm"), d, c.layer_norm_eps)?,
            blocks,
            pooler,
            model,
            positions,
            config,
        })
    }

    /// Hidden states `[.., T, D]` of ids `[T]` or `[B, T]`.
    pub(crate) fn forward(
        &self,
        p: &Params,
        ids: &Tracer,
        mask: Option<&Tracer>,
        token_types: Option<&Tracer>,
    ) -> Result<Tracer> {
        let c = &self.config;
        let max = match self.positions {
            Positions::Absolute => c.max_position_embeddings,
            // positions start after the padding index
            Positions::AfterPadding(pad) => c.max_position_embeddings.saturating_sub(pad + 1),
        };
        let b = as_batch(self.model, ids, mask, max)?;
        let t = b.ids.dims()[1];
        let words = self.words.forward_with(p, &b.ids)?; // N T D
        let pos = self.position_embeddings(p, &b, t)?;
        let types = match token_types {
            Some(tt) => {
                let tt = if b.one { tt.unsqueeze(0)? } else { tt.clone() };
                if tt.dims() != b.ids.dims() {
                    return Err(crate::error::Error::shape(
                        self.model,
                        &[tt.dims(), b.ids.dims()],
                        "token_type_ids must have the token ids' shape",
                    ));
                }
                self.types.forward_with(p, &tt)?
            }
            // type 0 everywhere: its row, broadcast (as the first T
            // position rows are read)
            None => self.types.table(p, &b.ids)?.narrow(0, 0, 1)?,
        };
        let x = words.broadcast_add(&pos)?.broadcast_add(&types)?;
        let mut h = self.emb_norm.forward_with(p, &x)?;
        let attn_mask = AttentionMask {
            window: None,
            causal: false,
            keep: b.keep.clone(),
        };
        for block in &self.blocks {
            h = block.forward(p, &h, &attn_mask)?;
        }
        b.finish(h)
    }

    /// `[T, D]` rows for absolute positions, `[N, T, D]` for RoBERTa's.
    fn position_embeddings(&self, p: &Params, b: &Batch, t: usize) -> Result<Tracer> {
        match self.positions {
            Positions::Absolute => self.position_table.table(p, &b.ids)?.narrow(0, 0, t),
            Positions::AfterPadding(pad) => {
                // real = ids != pad; position = cumsum(real) * real + pad
                let real = b.ids.ne(pad as f64)?.to_dtype(candle_core::DType::F32)?;
                let count = real.cumsum(1)?.mul(&real)?.affine(1.0, pad as f64)?;
                self.position_table.forward_with(p, &count.to_dtype(ID_DTYPE)?)
            }
        }
    }

    /// The pooler's output, `tanh(dense(h[first token]))`, `[.., D]`.
    pub(crate) fn pool(&self, p: &Params, hidden: &Tracer) -> Result<Tracer> {
        let pooler = self
            .pooler
            .as_ref()
            .ok_or_else(|| unsupported(self.model, "pooler", "this model was loaded without its pooler"))?;
        pooler.forward_with(p, &first_token(hidden)?)?.tanh()
    }

    pub(crate) fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = BTreeMap::new();
        all.extend(self.words.params());
        all.extend(self.position_table.params());
        all.extend(self.types.params());
        all.extend(self.emb_norm.params());
        for b in &self.blocks {
            all.extend(b.params());
        }
        if let Some(pl) = &self.pooler {
            all.extend(pl.params());
        }
        all
    }
}

/// BERT's encoder (Hugging Face's `BertModel`): hidden states `[.., T, D]`
/// and the pooler's output.
pub struct BertModel {
    enc: Encoder,
}

impl BertModel {
    /// The encoder of a BERT checkpoint, with its pooler when the
    /// checkpoint has one (a task model's under `bert.`, or a bare one).
    pub fn load(ck: &Checkpoint) -> Result<BertModel> {
        let pre = encoder_prefix(ck, "bert");
        let pooler = ck.has(&format!("{pre}pooler.dense.weight"));
        Ok(BertModel {
            enc: Encoder::load(ck, "bert", &pre, Positions::Absolute, pooler)?,
        })
    }

    /// The configuration read from `config.json`.
    pub fn config(&self) -> &BertConfig {
        &self.enc.config
    }

    /// Hidden states `[.., T, D]` of token ids `[T]` or `[B, T]` with an
    /// attention mask of the same shape (1 real, 0 padding).
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.enc.forward(&Params::own(), ids, mask, None)
    }

    /// [`Self::forward_masked`] with parameters replaced by name and
    /// token-type ids (segment A 0, segment B 1; zeros when `None`).
    pub fn forward_full(
        &self,
        p: &Params,
        ids: &Tracer,
        mask: Option<&Tracer>,
        token_types: Option<&Tracer>,
    ) -> Result<Tracer> {
        self.enc.forward(p, ids, mask, token_types)
    }

    /// The pooler's output, `tanh(dense(h[0]))`, of hidden states.
    pub fn pool(&self, p: &Params, hidden: &Tracer) -> Result<Tracer> {
        self.enc.pool(p, hidden)
    }
}

impl Module for BertModel {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.enc.forward(p, ids, None, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.enc.params()
    }
}

/// BERT with a classification head (Hugging Face's
/// `BertForSequenceClassification`): the pooler's output through
/// `classifier`, logits `[.., labels]`.
pub struct BertForSequenceClassification {
    bert: BertModel,
    classifier: Linear,
}

impl BertForSequenceClassification {
    /// A BERT classifier checkpoint (`bert.*` and `classifier.*`).
    pub fn load(ck: &Checkpoint) -> Result<BertForSequenceClassification> {
        let enc = Encoder::load(ck, "bert", "bert.", Positions::Absolute, true)?;
        let (d, labels) = (enc.config.hidden_size, enc.config.labels());
        Ok(BertForSequenceClassification {
            classifier: linear(ck, "classifier", labels, d)?,
            bert: BertModel { enc },
        })
    }

    /// The encoder.
    pub fn bert(&self) -> &BertModel {
        &self.bert
    }

    /// Logits `[.., labels]` of token ids `[T]` or `[B, T]` and their mask.
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.forward_full(&Params::own(), ids, mask, None)
    }

    /// [`Self::forward_masked`] with parameters replaced by name and
    /// token-type ids.
    pub fn forward_full(
        &self,
        p: &Params,
        ids: &Tracer,
        mask: Option<&Tracer>,
        token_types: Option<&Tracer>,
    ) -> Result<Tracer> {
        let h = self.bert.enc.forward(p, ids, mask, token_types)?;
        self.classifier.forward_with(p, &self.bert.enc.pool(p, &h)?)
    }
}

impl Module for BertForSequenceClassification {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = self.bert.params();
        all.extend(self.classifier.params());
        all
    }
}
