//! BERT (Hugging Face's `BertModel`, `BertForSequenceClassification`):
//! word, position and token-type embeddings, post-norm encoder blocks, the
//! pooler (tanh of a dense layer on the first token) and the classifier.
//! The encoder is shared with [RoBERTa](super::roberta), which counts
//! positions differently.

use super::loader::recording;
use super::{activation, as_batch, first_token, unsupported, Batch, ID_DTYPE};
use crate::error::Result;
use crate::nn::{
    embedding, layer_norm, linear, Activation, AttentionMask, Embedding, LayerNorm, Linear, Module, Params,
    PostNormBlock, SelfAttention,
};
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::VarBuilder;
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

/// Hugging Face's `BertEmbeddings`: word, position and token-type tables
/// and their layer norm.
struct BertEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
}

impl BertEmbeddings {
    fn load(vb: VarBuilder, c: &BertConfig, positions: Positions) -> Result<Self> {
        let d = c.hidden_size;
        // PyTorch's padding_idx, as Hugging Face builds these tables: the
        // padding row gets no gradient
        let padded = |t: Embedding| match c.pad_token_id {
            Some(pad) => t.with_padding_idx(pad),
            None => Ok(t),
        };
        let mut position_embeddings = embedding(c.max_position_embeddings, d, vb.pp("position_embeddings"))?;
        if let Positions::AfterPadding(_) = positions {
            position_embeddings = padded(position_embeddings)?;
        }
        Ok(BertEmbeddings {
            word_embeddings: padded(embedding(c.vocab_size, d, vb.pp("word_embeddings"))?)?,
            position_embeddings,
            token_type_embeddings: embedding(c.type_vocab_size, d, vb.pp("token_type_embeddings"))?,
            layer_norm: layer_norm(d, c.layer_norm_eps, vb.pp("LayerNorm"))?,
        })
    }
}

/// Hugging Face's `BertLayer`: self-attention (`attention.self`) and its
/// output (`attention.output`), `intermediate` and `output`, post-norm.
struct BertLayer(PostNormBlock);

impl BertLayer {
    fn load(vb: VarBuilder, c: &BertConfig, act: Activation) -> Result<Self> {
        let (d, f, eps) = (c.hidden_size, c.intermediate_size, c.layer_norm_eps);
        let (attn, out) = (vb.pp("attention").pp("self"), vb.pp("attention").pp("output"));
        let self_attn = SelfAttention::separate(
            linear(d, d, attn.pp("query"))?,
            linear(d, d, attn.pp("key"))?,
            linear(d, d, attn.pp("value"))?,
            linear(d, d, out.pp("dense"))?,
            c.num_attention_heads,
            c.num_attention_heads,
        )?;
        Ok(BertLayer(PostNormBlock::new(
            self_attn,
            layer_norm(d, eps, out.pp("LayerNorm"))?,
            (
                linear(d, f, vb.pp("intermediate").pp("dense"))?,
                act,
                linear(f, d, vb.pp("output").pp("dense"))?,
            ),
            layer_norm(d, eps, vb.pp("output").pp("LayerNorm"))?,
        )))
    }
}

/// The BERT-family encoder (Hugging Face's `BertModel` body, RoBERTa's
/// too): embeddings, `encoder.layer.*` and an optional pooler.
pub(crate) struct Encoder {
    pub(crate) config: BertConfig,
    model: &'static str,
    positions: Positions,
    embeddings: BertEmbeddings,
    layers: Vec<BertLayer>,
    // Hugging Face's `BertPooler`: `pooler.dense`
    pub(crate) pooler: Option<Linear>,
    // every weight the encoder read, by name
    params: BTreeMap<String, Tensor>,
}

/// Whether an encoder loads its pooler (Hugging Face's
/// `add_pooling_layer`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Pooler {
    /// When the weights hold one (a base model).
    IfHeld,
    /// Always: a classifier reads it.
    Required,
    /// Never (RoBERTa's classifier has its own head).
    Without,
}

/// `vb` under `prefix` when it holds the encoder's embeddings there (a
/// task model's checkpoint), else `vb` itself (a bare `BertModel`, as
/// sentence-transformers saves one).
pub(crate) fn encoder_root<'a>(vb: &VarBuilder<'a>, prefix: &str) -> VarBuilder<'a> {
    match vb.contains_tensor(&format!("{prefix}.embeddings.word_embeddings.weight")) {
        true => vb.pp(prefix),
        false => vb.clone(),
    }
}

impl Encoder {
    /// The encoder at `vb`, with or without its pooler as `pooler` says.
    pub(crate) fn load(
        vb: VarBuilder,
        config: &BertConfig,
        model: &'static str,
        positions: Positions,
        pooler: Pooler,
    ) -> Result<Self> {
        let act = config.check(model)?;
        let c = config;
        let (vb, record) = recording(vb);
        let embeddings = BertEmbeddings::load(vb.pp("embeddings"), c, positions)?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| BertLayer::load(vb.pp("encoder").pp("layer").pp(i), c, act))
            .collect::<Result<Vec<_>>>()?;
        let pooler = match pooler {
            Pooler::IfHeld if !vb.contains_tensor("pooler.dense.weight") => None,
            Pooler::IfHeld | Pooler::Required => {
                Some(linear(c.hidden_size, c.hidden_size, vb.pp("pooler").pp("dense"))?)
            }
            Pooler::Without => None,
        };
        Ok(Encoder {
            embeddings,
            layers,
            pooler,
            model,
            positions,
            config: c.clone(),
            params: record.all(),
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
        let e = &self.embeddings;
        let words = e.word_embeddings.forward_with(p, &b.ids)?; // N T D
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
                e.token_type_embeddings.forward_with(p, &tt)?
            }
            // type 0 everywhere: its row, broadcast (as the first T
            // position rows are read)
            None => e.token_type_embeddings.table(p, &b.ids)?.narrow(0, 0, 1)?,
        };
        let x = words.broadcast_add(&pos)?.broadcast_add(&types)?;
        let mut h = e.layer_norm.forward_with(p, &x)?;
        let attn_mask = AttentionMask {
            window: None,
            causal: false,
            keep: b.keep.clone(),
        };
        for layer in &self.layers {
            h = layer.0.forward(p, &h, &attn_mask)?;
        }
        b.finish(h)
    }

    /// `[T, D]` rows for absolute positions, `[N, T, D]` for RoBERTa's.
    fn position_embeddings(&self, p: &Params, b: &Batch, t: usize) -> Result<Tracer> {
        match self.positions {
            Positions::Absolute => self.embeddings.position_embeddings.table(p, &b.ids)?.narrow(0, 0, t),
            Positions::AfterPadding(pad) => {
                // real = ids != pad; position = cumsum(real) * real + pad
                let real = b.ids.ne(pad as f64)?.to_dtype(candle_core::DType::F32)?;
                let count = real.cumsum(1)?.mul(&real)?.affine(1.0, pad as f64)?;
                (self.embeddings.position_embeddings).forward_with(p, &count.to_dtype(ID_DTYPE)?)
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
        self.params.clone()
    }
}

/// BERT's encoder (Hugging Face's `BertModel`): hidden states `[.., T, D]`
/// and the pooler's output.
pub struct BertModel {
    enc: Encoder,
}

impl BertModel {
    load_checkpoint!(
        "bert",
        "The encoder of a BERT checkpoint, with its pooler when the checkpoint has one (a task model's under `bert.`, or a bare one)."
    );

    /// The encoder from `vb` (under `bert.` when `vb` holds it there) and
    /// its configuration, as candle-transformers' models load; with its
    /// pooler when `vb` holds `pooler.dense`. Its parameters are the
    /// weights it read.
    pub fn load_vb(vb: VarBuilder, c: &BertConfig) -> Result<BertModel> {
        let vb = encoder_root(&vb, "bert");
        Ok(BertModel {
            enc: Encoder::load(vb, c, "bert", Positions::Absolute, Pooler::IfHeld)?,
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
    // every weight it read, by name
    params: BTreeMap<String, Tensor>,
}

impl BertForSequenceClassification {
    load_checkpoint!("bert", "A BERT classifier checkpoint (`bert.*` and `classifier.*`).");

    /// The classifier from `vb` (`bert.*` with its pooler, and
    /// `classifier`) and its configuration.
    pub fn load_vb(vb: VarBuilder, c: &BertConfig) -> Result<BertForSequenceClassification> {
        let (vb, record) = recording(vb);
        let enc = Encoder::load(vb.pp("bert"), c, "bert", Positions::Absolute, Pooler::Required)?;
        let (d, labels) = (c.hidden_size, c.labels());
        Ok(BertForSequenceClassification {
            classifier: linear(d, labels, vb.pp("classifier"))?,
            bert: BertModel { enc },
            params: record.all(),
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
        self.params.clone()
    }
}
