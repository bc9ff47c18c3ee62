//! RoBERTa (Hugging Face's `RobertaModel`,
//! `RobertaForSequenceClassification`): BERT's encoder with positions
//! counted from `pad_token_id + 1` over the real tokens, as Hugging Face's
//! `create_position_ids_from_input_ids` does, and its own classification
//! head (a tanh dense layer on the first token, then `out_proj`).

use super::bert::{encoder_prefix, linear, BertConfig, Encoder, Positions};
use super::{first_token, unsupported, Checkpoint};
use crate::error::Result;
use crate::nn::{Linear, Module, Params};
use crate::trace::Tracer;
use candle_core::Tensor;
use std::collections::BTreeMap;

fn padding_idx(ck: &Checkpoint) -> Result<usize> {
    let c: BertConfig = ck.parse_config("roberta")?;
    c.pad_token_id
        .ok_or_else(|| unsupported("roberta", "pad_token_id", "missing: RoBERTa counts positions from it"))
}

/// RoBERTa's encoder: hidden states `[.., T, D]`.
pub struct RobertaModel {
    enc: Encoder,
}

impl RobertaModel {
    /// The encoder of a RoBERTa checkpoint (under `roberta.`, or bare),
    /// with its pooler when the checkpoint has one.
    pub fn load(ck: &Checkpoint) -> Result<RobertaModel> {
        let pre = encoder_prefix(ck, "roberta");
        let pooler = ck.has(&format!("{pre}pooler.dense.weight"));
        let pos = Positions::AfterPadding(padding_idx(ck)?);
        Ok(RobertaModel {
            enc: Encoder::load(ck, "roberta", &pre, pos, pooler)?,
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
    dense: Linear,
    out_proj: Linear,
}

impl RobertaForSequenceClassification {
    /// A RoBERTa classifier checkpoint (`roberta.*`, `classifier.dense`,
    /// `classifier.out_proj`; the encoder has no pooler here).
    pub fn load(ck: &Checkpoint) -> Result<RobertaForSequenceClassification> {
        let pos = Positions::AfterPadding(padding_idx(ck)?);
        let enc = Encoder::load(ck, "roberta", "roberta.", pos, false)?;
        let (d, labels) = (enc.config.hidden_size, enc.config.labels());
        Ok(RobertaForSequenceClassification {
            dense: linear(ck, "classifier.dense", d, d)?,
            out_proj: linear(ck, "classifier.out_proj", labels, d)?,
            roberta: RobertaModel { enc },
        })
    }

    /// Logits `[.., labels]` of token ids and their mask.
    pub fn forward_masked(&self, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        self.forward_full(&Params::own(), ids, mask)
    }

    /// [`Self::forward_masked`] with parameters replaced by name.
    pub fn forward_full(&self, p: &Params, ids: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        let h = self.roberta.enc.forward(p, ids, mask, None)?;
        let x = self.dense.forward_with(p, &first_token(&h)?)?.tanh()?;
        self.out_proj.forward_with(p, &x)
    }
}

impl Module for RobertaForSequenceClassification {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        self.forward_full(p, ids, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = self.roberta.params();
        all.extend(self.dense.params());
        all.extend(self.out_proj.params());
        all
    }
}
