//! RoBERTa (Hugging Face's `RobertaModel`,
//! `RobertaForSequenceClassification`): BERT's encoder with positions
//! counted from `pad_token_id + 1` over the real tokens, as Hugging Face's
//! `create_position_ids_from_input_ids` does, and its own classification
//! head (a tanh dense layer on the first token, then `out_proj`).

use super::bert::{encoder_root, BertConfig, Encoder, Pooler, Positions};
use super::loader::recording;
use super::{first_token, unsupported};
use crate::error::Result;
use crate::nn::{linear, Linear, Module, Params};
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::collections::BTreeMap;

fn padding_idx(c: &BertConfig) -> Result<usize> {
    c.pad_token_id
        .ok_or_else(|| unsupported("roberta", "pad_token_id", "missing: RoBERTa counts positions from it"))
}

/// RoBERTa's encoder: hidden states `[.., T, D]`.
pub struct RobertaModel {
    enc: Encoder,
}

impl RobertaModel {
    load_checkpoint!(
        "roberta",
        "The encoder of a RoBERTa checkpoint (under `roberta.`, or bare), with its pooler when the checkpoint has one."
    );

    /// The encoder from `vb` (under `roberta.` when `vb` holds it there)
    /// and its configuration; with its pooler when `vb` holds one.
    pub fn load_vb(vb: VarBuilder, c: &BertConfig) -> Result<RobertaModel> {
        let pos = Positions::AfterPadding(padding_idx(c)?);
        Ok(RobertaModel {
            enc: Encoder::load(encoder_root(&vb, "roberta"), c, "roberta", pos, Pooler::IfHeld)?,
        })
    }

    /// The configuration read from `config.json`.
    pub fn config(&self) -> &BertConfig {
        &self.enc.config
    }

    /// Hidden states `[.., T, D]` of token ids `[T]` or `[B, T]` and their
    /// attention mask. Positions follow the ids (padding is
    /// `pad_token_id`), as in Hugging Face.
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.enc.forward(&Params::own(), ids, mask, None)
    }

    /// [`Self::forward_masked`] with parameters replaced by name.
    pub fn forward_full(&self, p: &Params, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.enc.forward(p, ids, mask, None)
    }
}

impl Module for RobertaModel {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.enc.forward(p, ids, None, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.enc.params()
    }
}

/// RoBERTa with its classification head (Hugging Face's
/// `RobertaForSequenceClassification`): logits `[.., labels]`.
pub struct RobertaForSequenceClassification {
    roberta: RobertaModel,
    classifier: RobertaClassificationHead,
    // every weight it read, by name
    params: BTreeMap<String, Tensor>,
}

/// Hugging Face's `RobertaClassificationHead`: `out_proj(tanh(dense(x)))`
/// on the first token.
struct RobertaClassificationHead {
    dense: Linear,
    out_proj: Linear,
}

impl RobertaClassificationHead {
    fn load(vb: VarBuilder, c: &BertConfig) -> Result<Self> {
        let (d, labels) = (c.hidden_size, c.labels());
        Ok(RobertaClassificationHead {
            dense: linear(d, d, vb.pp("dense"))?,
            out_proj: linear(d, labels, vb.pp("out_proj"))?,
        })
    }
}

impl RobertaForSequenceClassification {
    load_checkpoint!(
        "roberta",
        "A RoBERTa classifier checkpoint (`roberta.*`, `classifier.dense`, `classifier.out_proj`; the encoder has no pooler here)."
    );

    /// The classifier from `vb` and its configuration.
    pub fn load_vb(vb: VarBuilder, c: &BertConfig) -> Result<RobertaForSequenceClassification> {
        let pos = Positions::AfterPadding(padding_idx(c)?);
        let (vb, record) = recording(vb);
        let enc = Encoder::load(vb.pp("roberta"), c, "roberta", pos, Pooler::Without)?;
        let head = RobertaClassificationHead::load(vb.pp("classifier"), c)?;
        Ok(RobertaForSequenceClassification {
            roberta: RobertaModel { enc },
            classifier: head,
            params: record.all(),
        })
    }

    /// Logits `[.., labels]` of token ids and their mask.
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.forward_full(&Params::own(), ids, mask)
    }

    /// [`Self::forward_masked`] with parameters replaced by name.
    pub fn forward_full(&self, p: &Params, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        let h = self.roberta.enc.forward(p, ids, mask, None)?;
        let head = &self.classifier;
        let x = head.dense.forward_with(p, &first_token(&h)?)?.tanh()?;
        head.out_proj.forward_with(p, &x)
    }
}

impl Module for RobertaForSequenceClassification {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.params.clone()
    }
}
