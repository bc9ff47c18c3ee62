//! The layers of a transformer: embeddings, rotary position embeddings
//! (candle_nn's `rope` and `rope_i`), multi-head attention with causal and
//! key-padding masks, a pre-norm block, and a small GPT-style language
//! model built from them. Inputs are `[N, T, D]` (an example is usually
//! one sequence, `N = 1`, under `vmap`).

use super::layers::{linear, linear_no_bias, param_map, Activation, Linear};
use super::norm::{layer_norm, rms_norm, LayerNorm, RmsNorm};
use super::{EagerCache, Module, Params};
use crate::error::{CandleContext, Error, Result};
use crate::trace::{Operand, Tracer};
use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;

/// A lookup table `[vocab, dim]`: integer ids `[..]` to rows `[.., dim]`
/// (candle_nn's `embedding`, initialised `N(0, 1)`). Its per-example
/// gradient is an index-add of the rows, never a one-hot product.
pub struct Embedding {
    weight: Tensor,
    prefix: String,
    // PyTorch's `padding_idx`: this row gets no gradient
    padding_idx: Option<usize>,
    cache: EagerCache,
}

/// An embedding of `vocab` ids as `dim` values.
pub fn embedding(vocab: usize, dim: usize, vb: VarBuilder) -> Result<Embedding> {
    let weight = super::param(&vb, &[vocab, dim], "weight", Init::Randn { mean: 0., stdev: 1. })?;
    Ok(Embedding::from_tensors(weight, &vb.prefix()))
}

impl Embedding {
    /// The table `[vocab, dim]` as `p` gives it (replaced by name, or the
    /// layer's own), in `like`'s trace: for lookups other than by id, such
    /// as the first `T` rows of a position table, or a tied output head.
    pub fn table(&self, p: &Params, like: &Tracer) -> Result<Tracer> {
        p.table(&self.prefix, &self.weight, like)
    }

    /// An embedding over an existing table `[vocab, dim]`, sharing it.
    pub fn from_tensors(weight: Tensor, prefix: &str) -> Embedding {
        Embedding {
            weight,
            prefix: prefix.to_string(),
            padding_idx: None,
            cache: EagerCache::default(),
        }
    }

    /// PyTorch's `padding_idx`: row `idx` is looked up as it is but gets no
    /// gradient (Hugging Face's BERT, RoBERTa and Llama set it to
    /// `pad_token_id`). An index outside the table is an error.
    pub fn with_padding_idx(mut self, idx: usize) -> Result<Embedding> {
        let rows = self.weight.dims()[0];
        if idx >= rows {
            return Err(Error::shape(
                "embedding",
                &[self.weight.dims()],
                format!("padding_idx {idx} is outside the table of {rows} rows"),
            ));
        }
        self.padding_idx = Some(idx);
        Ok(self)
    }
}

impl Module for Embedding {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        let w = p.table(&self.prefix, &self.weight, ids)?;
        let rows = w.embedding(ids)?;
        let Some(pad) = self.padding_idx else { return Ok(rows) };
        // the padding row's value, cut off from the gradient, where the
        // ids are `pad`: one row held apart, not the table
        let pad_row = w.narrow(0, pad, 1)?.stop_gradient()?.squeeze(0)?; // D
        ids.eq(pad as f64)?.unsqueeze(ids.rank())?.where_cond(&pad_row, &rows)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        param_map(&self.prefix, &[("weight", Some(&self.weight))])
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}

/// `x [.., T, D]` rotated by position as candle_nn's `rope` does (the
/// halves of the last axis as pairs, GPT-NeoX style): `x cos + rotate_half(x)
/// sin`, with `cos`, `sin` `[T, D/2]` (the first `T` rows of a longer table
/// are used).
pub fn rope(x: &Tracer, cos: &Tracer, sin: &Tracer) -> Result<Tracer> {
    let (t, d) = rope_dims("rope", x, cos, sin)?;
    let (cos, sin) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
    let cos = Tracer::cat(&[&cos, &cos], 1)?;
    let sin = Tracer::cat(&[&sin, &sin], 1)?;
    let r = x.rank();
    let half = x.narrow(r - 1, d / 2, d / 2)?.neg()?;
    let rotated = Tracer::cat(&[&half, &x.narrow(r - 1, 0, d / 2)?], r - 1)?;
    x.mul(&cos)?.add(&rotated.mul(&sin)?)
}

/// [`rope`] with adjacent elements as pairs (candle_nn's `rope_i`, the
/// original RoFormer layout).
pub fn rope_i(x: &Tracer, cos: &Tracer, sin: &Tracer) -> Result<Tracer> {
    let (t, d) = rope_dims("rope_i", x, cos, sin)?;
    let (cos, sin) = (cos.narrow(0, 0, t)?.unsqueeze(1)?, sin.narrow(0, 0, t)?.unsqueeze(1)?);
    let lead = &x.dims()[..x.rank() - 1];
    // .. T D -> .. T (D/2) 2, each pair rotated
    let pairs = x.reshape([lead, &[d / 2, 2]].concat())?;
    let r = pairs.rank();
    let (x0, x1) = (pairs.narrow(r - 1, 0, 1)?, pairs.narrow(r - 1, 1, 1)?);
    let (cos, sin) = (cos.reshape((t, d / 2, 1))?, sin.reshape((t, d / 2, 1))?);
    let y0 = x0.mul(&cos)?.sub(&x1.mul(&sin)?)?;
    let y1 = x0.mul(&sin)?.add(&x1.mul(&cos)?)?;
    Tracer::cat(&[&y0, &y1], r - 1)?.reshape(x.dims())
}

fn rope_dims(op: &'static str, x: &Tracer, cos: &Tracer, sin: &Tracer) -> Result<(usize, usize)> {
    let r = x.rank();
    let ok = r >= 2
        && cos.rank() == 2
        && cos.dims() == sin.dims()
        && x.dims()[r - 1] == 2 * cos.dims()[1]
        && x.dims()[r - 2] <= cos.dims()[0];
    if !ok {
        return Err(Error::shape(
            op,
            &[x.dims(), cos.dims(), sin.dims()],
            "expected x [.., T, D] and cos, sin [>= T, D/2]",
        ));
    }
    Ok((x.dims()[r - 2], x.dims()[r - 1]))
}

/// The `cos` and `sin` tables `[max_seq, dim/2]` of rotary position
/// embeddings with base `theta` (10000 in RoFormer and Llama): angle
/// `t / theta^(2i / dim)` at position `t`, pair `i`.
pub fn rotary_tables(
    dim: usize,
    max_seq: usize,
    theta: f64,
    dtype: DType,
    dev: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(Error::Config {
            msg: format!("rotary_tables: the head size {dim} must be even"),
        });
    }
    use crate::env::{check_host_shape, host_vec};
    let what = "the tables' angles";
    check_host_shape("rotary_tables", what, &[max_seq, dim / 2], 8)?;
    let inv: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / dim as f64))
        .collect();
    let mut angles: Vec<f64> = host_vec("rotary_tables", what, max_seq * (dim / 2))?;
    angles.extend((0..max_seq).flat_map(|t| inv.iter().map(move |f| t as f64 * f)));
    let a = Tensor::from_vec(angles, (max_seq, dim / 2), dev).op("rotary_tables")?;
    let (cos, sin) = (a.cos().op("rotary_tables")?, a.sin().op("rotary_tables")?);
    Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
}

/// Rotary tables built for the sequence lengths a model is run at, not for
/// every position its configuration allows (a Llama's 1M-token
/// `max_position_embeddings` would be 2 GiB of tables at load): the
/// longest built so far is kept, and a shorter sequence reads its first
/// rows (each row depends on its position alone, so they are the values a
/// table of that length would hold). A longer one builds the next power
/// of two of rows, up to `max`, so that lengths growing one at a time
/// build `log T` tables, not `T`.
#[derive(Debug)]
pub(crate) struct RotaryCache {
    dim: usize,
    theta: f64,
    max: usize,
    dtype: DType,
    device: candle_core::Device,
    built: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

impl RotaryCache {
    /// Nothing built yet; `dim` must be even (checked by [`rotary_tables`]
    /// when the first tables are built).
    pub(crate) fn new(dim: usize, theta: f64, max: usize, dtype: DType, device: &candle_core::Device) -> RotaryCache {
        RotaryCache {
            dim,
            theta,
            max,
            dtype,
            device: device.clone(),
            built: std::sync::Mutex::new(None),
        }
    }

    /// `(cos, sin)` of `[t, dim / 2]`.
    pub(crate) fn tables(&self, t: usize) -> Result<(Tensor, Tensor)> {
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((cos, sin)) = built.as_ref().filter(|(c, _)| c.dims()[0] >= t) {
            return Ok((cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?));
        }
        let rows = t.checked_next_power_of_two().unwrap_or(t).min(self.max).max(t);
        let (cos, sin) = rotary_tables(self.dim, rows, self.theta, self.dtype, &self.device)?;
        *built = Some((cos.clone(), sin.clone()));
        Ok((cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?))
    }
}

/// Multi-head self-attention over `[N, T, D]` with `heads` heads of `D /
/// heads`: `q`, `k`, `v` and `o` are linear layers with bias (PyTorch's
/// parameter names under the prefix: `q.weight`, ...). Scores are `q k^T /
/// sqrt(D / heads)`; a causal mask hides the keys after each query, an
/// attention mask ([`MultiHeadAttention::forward_with_mask`]: `[N, T]`,
/// nonzero for a real token and 0 for padding, the crate's one convention
/// and Hugging Face's `attention_mask`) hides padded keys, and optional
/// rotary tables rotate `q` and `k` ([`rope`]). The scores go through
/// [`attend`](super::attend), as the models' do.
pub struct MultiHeadAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    dim: usize,
    causal: bool,
    rotary: Option<(Tensor, Tensor)>,
}

/// Self-attention of `dim` features in `heads` heads, causal or not.
pub fn multi_head_attention(dim: usize, heads: usize, causal: bool, vb: VarBuilder) -> Result<MultiHeadAttention> {
    if heads == 0 || !dim.is_multiple_of(heads) {
        return Err(Error::Config {
            msg: format!("multi_head_attention: {heads} heads do not divide {dim} features"),
        });
    }
    Ok(MultiHeadAttention {
        q: linear(dim, dim, vb.pp("q"))?,
        k: linear(dim, dim, vb.pp("k"))?,
        v: linear(dim, dim, vb.pp("v"))?,
        o: linear(dim, dim, vb.pp("o"))?,
        heads,
        dim,
        causal,
        rotary: None,
    })
}

/// The attention an earlier 0.2 development build made for a padding
/// mask: the same layer, whose deprecated
/// [`MultiHeadAttention::forward_masked`] reads its mask as padding.
#[deprecated(
    since = "0.2.0",
    note = "use nn::multi_head_attention and forward_with_mask, whose mask is nonzero for a real token: invert a padding mask with mask.eq(0.0)"
)]
pub fn multi_head_attention_key_padding(
    dim: usize,
    heads: usize,
    causal: bool,
    vb: VarBuilder,
) -> Result<MultiHeadAttention> {
    multi_head_attention(dim, heads, causal, vb)
}

impl MultiHeadAttention {
    /// Rotates queries and keys by position with these tables
    /// ([`rotary_tables`] of the head size).
    pub fn with_rotary(mut self, cos: Tensor, sin: Tensor) -> Self {
        self.rotary = Some((cos, sin));
        self
    }

    /// `[N, T, D] -> [N, H, T, D/H]`.
    fn split_heads(&self, x: &Tracer) -> Result<Tracer> {
        let (n, t) = (x.dims()[0], x.dims()[1]);
        x.reshape((n, t, self.heads, self.dim / self.heads))?
            .permute(&[0, 2, 1, 3])
    }

    /// `x [N, T, D]` checked, and its queries (rotated), keys (rotated)
    /// and values, `[N, H, T, D/H]` each.
    fn project(&self, p: &Params, x: &Tracer) -> Result<(Tracer, Tracer, Tracer)> {
        if x.rank() != 3 || x.dims()[2] != self.dim {
            return Err(Error::shape(
                "attention",
                &[x.dims()],
                format!("expected [N, T, {}]", self.dim),
            ));
        }
        let mut q = self.split_heads(&self.q.forward_with(p, x)?)?;
        let mut k = self.split_heads(&self.k.forward_with(p, x)?)?;
        let v = self.split_heads(&self.v.forward_with(p, x)?)?;
        if let Some((cos, sin)) = &self.rotary {
            let (cos, sin) = (cos.to_tracer(x)?, sin.to_tracer(x)?);
            q = rope(&q, &cos, &sin)?;
            k = rope(&k, &cos, &sin)?;
        }
        Ok((q, k, v))
    }

    /// `[N, H, T, D/H] -> [N, T, D]`, then the output projection.
    fn merge(&self, p: &Params, out: &Tracer) -> Result<Tracer> {
        let (n, t) = (out.dims()[0], out.dims()[2]);
        self.o
            .forward_with(p, &out.permute(&[0, 2, 1, 3])?.reshape((n, t, self.dim))?)
    }

    /// Attention with an optional mask `[N, T]`, nonzero for a real token
    /// and 0 for padding (Hugging Face's `attention_mask`, as the models'
    /// `forward_masked` take it): padded keys get the dtype's lowest finite
    /// score ([`mask_value`](super::mask_value)), so a query whose keys are
    /// all hidden averages them rather than giving NaN (Hugging Face's eager
    /// attention).
    pub fn forward_with_mask(&self, p: &Params, x: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        let (q, k, v) = self.project(p, x)?;
        let mask = super::AttentionMask {
            window: None,
            causal: self.causal,
            keep: mask.cloned(),
        };
        let scale = 1.0 / ((self.dim / self.heads) as f64).sqrt();
        self.merge(p, &super::attend(&q, &k, &v, &mask, scale)?)
    }

    /// The previous release's masked attention, whose mask is nonzero
    /// where a key is **padding** (the inverse of every other mask of the
    /// crate, the models' included) and fills hidden scores with `-inf`, so
    /// a query whose keys are all hidden gets NaN; written out, not fused.
    #[deprecated(
        since = "0.2.0",
        note = "use forward_with_mask, whose mask is nonzero for a real token (Hugging Face's attention_mask, as the models take it): pass mask.eq(0.0) of a padding mask"
    )]
    pub fn forward_masked(&self, p: &Params, x: &Tracer, key_padding: Option<&Tracer>) -> Result<Tracer> {
        let (q, k, v) = self.project(p, x)?;
        let (n, t) = (x.dims()[0], x.dims()[1]);
        let scale = 1.0 / ((self.dim / self.heads) as f64).sqrt();
        // [N, H, T, T]
        let mut scores = q.matmul(&k.transpose(2, 3)?)?.affine(scale, 0.0)?;
        if self.causal {
            let pos = Tracer::arange(x, 0, t as i64, DType::U32)?;
            let after = pos
                .unsqueeze(0)?
                .broadcast_as((t, t))?
                .gt(&pos.unsqueeze(1)?.broadcast_as((t, t))?)?;
            scores = scores.masked_fill(&after, f64::NEG_INFINITY)?;
        }
        if let Some(pad) = key_padding {
            if pad.dims() != [n, t] {
                return Err(Error::shape(
                    "attention",
                    &[pad.dims(), x.dims()],
                    "the key-padding mask must be [N, T]",
                ));
            }
            let hidden = pad.ne(0.0)?.reshape((n, 1, 1, t))?;
            scores = scores.masked_fill(&hidden, f64::NEG_INFINITY)?;
        }
        self.merge(p, &scores.softmax(-1)?.matmul(&v)?)
    }
}

impl Module for MultiHeadAttention {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        self.forward_with_mask(p, x, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        [&self.q, &self.k, &self.v, &self.o]
            .iter()
            .flat_map(|l| l.params())
            .collect()
    }
}

/// Which normalisation a block uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NormKind {
    /// [`LayerNorm`] with weight and bias.
    LayerNorm,
    /// [`RmsNorm`].
    RmsNorm,
}

/// A layer norm or an RMS norm, chosen at construction.
pub enum Norm {
    /// Layer normalisation.
    Layer(LayerNorm),
    /// RMS normalisation.
    Rms(RmsNorm),
}

/// A norm of the given kind over `dim` features, epsilon 1e-5.
pub fn norm(kind: NormKind, dim: usize, vb: VarBuilder) -> Result<Norm> {
    Ok(match kind {
        NormKind::LayerNorm => Norm::Layer(layer_norm(dim, 1e-5, vb)?),
        NormKind::RmsNorm => Norm::Rms(rms_norm(dim, 1e-5, vb)?),
    })
}

impl Module for Norm {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        match self {
            Norm::Layer(n) => n.forward_with(p, x),
            Norm::Rms(n) => n.forward_with(p, x),
        }
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        match self {
            Norm::Layer(n) => n.params(),
            Norm::Rms(n) => n.params(),
        }
    }
}

/// The shape of a transformer block and of a [`Gpt`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    /// Features per position.
    pub dim: usize,
    /// Attention heads (dividing `dim`).
    pub heads: usize,
    /// Hidden features of the feed-forward part.
    pub ff: usize,
    /// Whether attention is causal (a language model's).
    pub causal: bool,
    /// The norm before attention and before the feed-forward part.
    pub norm: NormKind,
    /// The feed-forward activation.
    pub act: Activation,
}

/// A pre-norm transformer block: `x + o(attention(ln1(x)))`, then `x +
/// ff2(act(ff1(ln2(x))))`, with parameters `ln1`, `q`, `k`, `v`, `o`,
/// `ln2`, `ff1`, `ff2` under its prefix.
pub struct TransformerBlock {
    ln1: Norm,
    attn: MultiHeadAttention,
    ln2: Norm,
    ff1: Linear,
    ff2: Linear,
    act: Activation,
}

/// A pre-norm block of the given shape.
pub fn transformer_block(c: BlockConfig, vb: VarBuilder) -> Result<TransformerBlock> {
    Ok(TransformerBlock {
        ln1: norm(c.norm, c.dim, vb.pp("ln1"))?,
        attn: multi_head_attention(c.dim, c.heads, c.causal, vb.clone())?,
        ln2: norm(c.norm, c.dim, vb.pp("ln2"))?,
        ff1: linear(c.dim, c.ff, vb.pp("ff1"))?,
        ff2: linear(c.ff, c.dim, vb.pp("ff2"))?,
        act: c.act,
    })
}

/// The block an earlier 0.2 development build made for a padding mask:
/// the same block, whose deprecated [`TransformerBlock::forward_masked`]
/// reads its mask as padding.
#[deprecated(
    since = "0.2.0",
    note = "use nn::transformer_block and forward_with_mask, whose mask is nonzero for a real token: invert a padding mask with mask.eq(0.0)"
)]
pub fn transformer_block_key_padding(c: BlockConfig, vb: VarBuilder) -> Result<TransformerBlock> {
    transformer_block(c, vb)
}

impl TransformerBlock {
    /// The block with an attention mask `[N, T]` for its attention,
    /// nonzero for a real token (see
    /// [`MultiHeadAttention::forward_with_mask`]).
    pub fn forward_with_mask(&self, p: &Params, x: &Tracer, mask: Option<&Tracer>) -> Result<Tracer> {
        let a = self.attn.forward_with_mask(p, &self.ln1.forward_with(p, x)?, mask)?;
        self.feed_forward(p, &x.add(&a)?)
    }

    /// The previous release's masked block, whose mask is nonzero where a
    /// key is **padding** (see [`MultiHeadAttention::forward_masked`]).
    #[deprecated(
        since = "0.2.0",
        note = "use forward_with_mask, whose mask is nonzero for a real token (Hugging Face's attention_mask): pass mask.eq(0.0) of a padding mask"
    )]
    pub fn forward_masked(&self, p: &Params, x: &Tracer, key_padding: Option<&Tracer>) -> Result<Tracer> {
        #[allow(deprecated)]
        let a = self
            .attn
            .forward_masked(p, &self.ln1.forward_with(p, x)?, key_padding)?;
        self.feed_forward(p, &x.add(&a)?)
    }

    /// `x + ff2(act(ff1(ln2(x))))`.
    fn feed_forward(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let h = self
            .act
            .forward_with(p, &self.ff1.forward_with(p, &self.ln2.forward_with(p, x)?)?)?;
        x.add(&self.ff2.forward_with(p, &h)?)
    }
}

impl Module for TransformerBlock {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        self.forward_with_mask(p, x, None)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        let mut m = self.ln1.params();
        m.extend(self.attn.params());
        m.extend(self.ln2.params());
        m.extend(self.ff1.params());
        m.extend(self.ff2.params());
        m
    }
}

/// A small GPT-style language model: token embedding `tok` plus learned
/// position embedding `pos`, `layers` pre-norm blocks `blocks.<i>`, a
/// final norm `ln_f` and a bias-free `head` to the vocabulary. Token ids
/// `[N, T]` (`T` at most `max_seq`) to logits `[N, T, vocab]`.
pub struct Gpt {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<TransformerBlock>,
    ln_f: Norm,
    head: Linear,
    cache: EagerCache,
}

/// A [`Gpt`] of `layers` blocks shaped by `block`, over `vocab` tokens and
/// sequences of up to `max_seq`.
pub fn gpt(vocab: usize, max_seq: usize, layers: usize, block: BlockConfig, vb: VarBuilder) -> Result<Gpt> {
    let blocks = (0..layers)
        .map(|i| transformer_block(block, vb.pp(format!("blocks.{i}"))))
        .collect::<Result<Vec<_>>>()?;
    Ok(Gpt {
        tok: embedding(vocab, block.dim, vb.pp("tok"))?,
        pos: embedding(max_seq, block.dim, vb.pp("pos"))?,
        blocks,
        ln_f: norm(block.norm, block.dim, vb.pp("ln_f"))?,
        head: linear_no_bias(block.dim, vocab, vb.pp("head"))?,
        cache: EagerCache::default(),
    })
}

impl Module for Gpt {
    fn forward_with(&self, p: &Params, ids: &Tracer) -> Result<Tracer> {
        let max = self.pos.weight.dims()[0];
        if ids.rank() != 2 || ids.dims()[1] > max || ids.dtype().is_float() {
            return Err(Error::shape(
                "gpt",
                &[ids.dims()],
                format!("expected integer ids [N, T] with T <= {max}"),
            ));
        }
        let t = ids.dims()[1];
        let positions = Tracer::arange(ids, 0, t as i64, DType::U32)?;
        let mut x = self
            .tok
            .forward_with(p, ids)?
            .add(&self.pos.forward_with(p, &positions)?)?;
        for b in &self.blocks {
            x = b.forward_with(p, &x)?;
        }
        self.head.forward_with(p, &self.ln_f.forward_with(p, &x)?)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        let mut m = self.tok.params();
        m.extend(self.pos.params());
        for b in &self.blocks {
            m.extend(b.params());
        }
        m.extend(self.ln_f.params());
        m.extend(self.head.params());
        m
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}
