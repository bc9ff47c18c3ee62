//! Attention as Hugging Face's models compute it, in pieces a user can
//! assemble: heads split and merged, grouped-query attention (fewer key and
//! value heads than query heads, each shared by a group of consecutive
//! query heads), a causal mask and a padding mask; self-attention with
//! separate or fused projections; and a post-norm encoder block. (The
//! rotate-half rotary embedding is [`super::rope`].)

use super::layers::{Activation, Linear};
use super::norm::LayerNorm;
use super::{Module, Params};
use crate::error::{Error, Result};
use crate::trace::{Operand, Tracer};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// `[N, T, H * Dh] -> [N, H, T, Dh]`.
pub fn split_heads(x: &Tracer, heads: usize) -> Result<Tracer> {
    let d = x.dims();
    if d.len() != 3 || heads == 0 || !d[2].is_multiple_of(heads) {
        return Err(Error::shape(
            "split_heads",
            &[d],
            format!("expected [N, T, D] with D a multiple of the {heads} heads"),
        ));
    }
    // N T (H Dh) -> N T H Dh -> N H T Dh
    x.reshape((d[0], d[1], heads, d[2] / heads))?.permute(&[0, 2, 1, 3])
}

/// `[N, H, T, Dh] -> [N, T, H * Dh]`.
pub fn merge_heads(x: &Tracer) -> Result<Tracer> {
    let d = x.dims();
    if d.len() != 4 {
        return Err(Error::shape("merge_heads", &[d], "expected [N, H, T, Dh]"));
    }
    // N H T Dh -> N T H Dh -> N T (H Dh)
    x.permute(&[0, 2, 1, 3])?.reshape((d[0], d[2], d[1] * d[3]))
}

/// The most negative finite value of `dtype`: what Hugging Face adds to a
/// hidden score, so that a query whose keys are all hidden averages them
/// (where `-inf` would give NaN).
pub fn mask_value(dtype: DType) -> f64 {
    crate::kernels::attention::lowest(dtype)
}

/// What attention may not look at.
#[derive(Clone, Default)]
pub struct AttentionMask {
    /// Hide the keys after each query (a decoder).
    pub causal: bool,
    /// `[N, T]`, nonzero for a real token and 0 for padding (Hugging
    /// Face's `attention_mask`): padded keys are hidden.
    pub keep: Option<Tracer>,
    /// A sliding window (Mistral's, Qwen2's `sliding_attention` layers):
    /// query `i` sees key `j` only where `i - j < window`. It needs
    /// `causal`; a window at least as long as the sequence changes nothing.
    pub window: Option<usize>,
}

/// `softmax(q k^T * scale + mask) v` over `q [N, H, T, Dh]` and `k`, `v`
/// `[N, Hkv, T, Dh]` where `Hkv` divides `H` (grouped-query attention:
/// query head `h` reads key/value head `h / (H / Hkv)`, as Hugging Face's
/// `repeat_kv`; `Hkv = 1` is multi-query attention). Hidden scores get
/// [`mask_value`], as in Hugging Face's eager attention. One primitive of
/// the graph: its kernel works through a block of queries at a time, and
/// its gradient recomputes a block's probabilities from its scores, so
/// neither holds the `[N, H, T, T]` probabilities (a BERT-base layer at
/// `T = 1024` and `N = 8` kept 384 MiB of them for the backward); every
/// transform goes through its rules.
pub fn attend(q: &Tracer, k: &Tracer, v: &Tracer, mask: &AttentionMask, scale: f64) -> Result<Tracer> {
    let (qd, kd) = (q.dims(), k.dims());
    let fits = qd.len() == 4
        && kd.len() == 4
        && v.dims() == kd
        && qd[0] == kd[0]
        && qd[2] == kd[2]
        && qd[3] == kd[3]
        && kd[1] > 0
        && qd[1].is_multiple_of(kd[1]);
    if !fits {
        return Err(Error::shape(
            "attention",
            &[qd, kd, v.dims()],
            "expected q [N, H, T, Dh] and k, v [N, Hkv, T, Dh] with Hkv dividing H",
        ));
    }
    let (n, t) = (qd[0], qd[2]);
    let group = qd[1] / kd[1];
    let (k, v) = (repeat_kv(k, group)?, repeat_kv(v, group)?);
    if let Some(keep) = &mask.keep {
        if keep.dims() != [n, t] {
            return Err(Error::shape(
                "attention",
                &[keep.dims(), &[n, t]],
                "the attention mask must be [N, T], as the token ids",
            ));
        }
    }
    match mask.window {
        Some(0) => Err(Error::shape(
            "attention",
            &[qd],
            "a sliding window of 0 tokens hides every key",
        )),
        Some(_) if !mask.causal => Err(Error::shape(
            "attention",
            &[qd],
            "a sliding window needs a causal mask (it hides keys before the window, the causal mask those after)",
        )),
        Some(w) if w < t => windowed(&q.matmul(&k.transpose(2, 3)?)?, &v, mask.keep.as_ref(), scale, w),
        // one primitive: scores, mask, softmax and the weighted sum, whose
        // gradient recomputes the probabilities rather than keeping them
        _ => q.attention(&k, &v, mask.keep.as_ref(), mask.causal, scale),
    }
}

/// Attention over a sliding window of `w` keys from the raw scores `q k^T`
/// `[N, H, T, T]`, written out of the graph's operations (the fused
/// primitive knows only the causal mask). It holds the `[N, H, T, T]`
/// probabilities for its gradient. A query whose window holds only
/// padding (a padded position more than `w` tokens past the last real
/// one) attends to nothing and gets zeros, as PyTorch's
/// `scaled_dot_product_attention` (transformers' default) gives it; such
/// a position is never a real token's, so no loss reads it.
fn windowed(raw: &Tracer, v: &Tracer, keep: Option<&Tracer>, scale: f64, w: usize) -> Result<Tracer> {
    let (n, t) = (raw.dims()[0], raw.dims()[2]);
    crate::env::check_host_alloc("attention", "the sliding window's band", t.saturating_mul(t), 1)?;
    // key j visible to query i where 0 <= i - j < w
    let band: Vec<u8> = (0..t * t)
        .map(|x| u8::from(x % t <= x / t && x / t - x % t < w))
        .collect();
    let band = Tensor::from_vec(band, (1, 1, t, t), &raw.device())?.to_tracer(raw)?;
    let visible = match keep {
        // N T -> N 1 1 T: padded keys hidden for every query
        Some(keep) => keep.ne(0.0)?.reshape((n, 1, 1, t))?.where_cond(&band, 0.0)?,
        None => band,
    };
    let hidden = mask_value(raw.dtype());
    let s = visible.where_cond(raw.affine(scale, 0.0)?, hidden)?;
    // N 1 T T -> N 1 T 1: whether the query sees any key
    let sees = visible.to_dtype(DType::F32)?.max_keepdim(3)?.to_dtype(raw.dtype())?;
    s.softmax(3)?.broadcast_mul(&sees)?.matmul(v)
}

/// `[N, Hkv, T, Dh] -> [N, Hkv * group, T, Dh]`, each head repeated
/// `group` times in place (Hugging Face's `repeat_kv`).
fn repeat_kv(x: &Tracer, group: usize) -> Result<Tracer> {
    if group == 1 {
        return Ok(x.clone());
    }
    let d = x.dims().to_vec();
    // N Hkv T Dh -> N Hkv 1 T Dh -> N Hkv g T Dh -> N (Hkv g) T Dh
    x.unsqueeze(2)?
        .broadcast_as((d[0], d[1], group, d[2], d[3]))?
        .reshape((d[0], d[1] * group, d[2], d[3]))
}

/// The query, key and value projections: three layers, or one fused layer
/// whose output is the three side by side (GPT-2's `c_attn`).
enum Qkv {
    Separate(Box<[Linear; 3]>),
    Fused(Linear),
}

/// Self-attention as Hugging Face's models run it: q, k and v projections
/// (separate, or one fused projection split in three), `heads` query heads
/// over `kv_heads` key/value heads (grouped-query attention), optional
/// rotary embeddings on q and k, [`attend`], and the output projection.
pub struct SelfAttention {
    qkv: Qkv,
    o: Linear,
    heads: usize,
    kv_heads: usize,
}

impl SelfAttention {
    /// Separate projections `q [H Dh, D]`, `k`, `v` `[Hkv Dh, D]` and
    /// `o [D, H Dh]`; `kv_heads` must divide `heads`.
    pub fn separate(q: Linear, k: Linear, v: Linear, o: Linear, heads: usize, kv_heads: usize) -> Result<Self> {
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::shape(
                "attention",
                &[],
                format!("{kv_heads} key/value heads must divide {heads} query heads"),
            ));
        }
        Ok(SelfAttention {
            qkv: Qkv::Separate(Box::new([q, k, v])),
            o,
            heads,
            kv_heads,
        })
    }

    /// One fused projection `D -> 3 D` (queries, keys, values side by side)
    /// and the output projection, `heads` heads.
    pub fn fused(qkv: Linear, o: Linear, heads: usize) -> Result<Self> {
        if heads == 0 {
            return Err(Error::shape("attention", &[], "needs at least one head"));
        }
        Ok(SelfAttention {
            qkv: Qkv::Fused(qkv),
            o,
            heads,
            kv_heads: heads,
        })
    }

    /// `[N, T, D] -> [N, T, D]`, scores scaled by `scale`, with `rotary`
    /// `(cos, sin)` tables ([`super::rope`]) applied to q and k when given.
    pub fn forward(
        &self,
        p: &Params,
        x: &Tracer,
        mask: &AttentionMask,
        scale: f64,
        rotary: Option<(&Tracer, &Tracer)>,
    ) -> Result<Tracer> {
        let (q, k, v) = match &self.qkv {
            Qkv::Separate(l) => (
                l[0].forward_with(p, x)?,
                l[1].forward_with(p, x)?,
                l[2].forward_with(p, x)?,
            ),
            Qkv::Fused(qkv) => {
                let all = qkv.forward_with(p, x)?; // N T 3D
                let d = all.dims()[2] / 3;
                (all.narrow(2, 0, d)?, all.narrow(2, d, d)?, all.narrow(2, 2 * d, d)?)
            }
        };
        let (mut q, mut k) = (split_heads(&q, self.heads)?, split_heads(&k, self.kv_heads)?);
        let v = split_heads(&v, self.kv_heads)?;
        if let Some((cos, sin)) = rotary {
            q = super::rope(&q, cos, sin)?;
            k = super::rope(&k, cos, sin)?;
        }
        self.o.forward_with(p, &merge_heads(&attend(&q, &k, &v, mask, scale)?)?)
    }

    /// The weights stored `[in, out]` (see [`Module::in_out_weights`]).
    pub fn in_out_weights(&self) -> Vec<String> {
        let mut all = self.o.in_out_weights();
        match &self.qkv {
            Qkv::Separate(l) => l.iter().for_each(|l| all.extend(l.in_out_weights())),
            Qkv::Fused(l) => all.extend(l.in_out_weights()),
        }
        all
    }

    /// The projections' parameters by name.
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = self.o.params();
        match &self.qkv {
            Qkv::Separate(l) => l.iter().for_each(|l| all.extend(l.params())),
            Qkv::Fused(l) => all.extend(l.params()),
        }
        all
    }
}

/// A post-norm encoder block (BERT's, the original Transformer's):
/// `x = norm1(x + attn(x))`, then `x = norm2(x + down(act(up(x))))`.
pub struct PostNormBlock {
    attn: SelfAttention,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
    act: Activation,
}

impl PostNormBlock {
    /// A block from its parts (each under the names of its checkpoint).
    pub fn new(
        attn: SelfAttention,
        attn_norm: LayerNorm,
        (up, act, down): (Linear, Activation, Linear),
        out_norm: LayerNorm,
    ) -> Self {
        PostNormBlock {
            attn,
            attn_norm,
            up,
            down,
            out_norm,
            act,
        }
    }

    /// `[N, T, D] -> [N, T, D]`, attention scaled by `1 / sqrt(head size)`.
    pub fn forward(&self, p: &Params, x: &Tracer, mask: &AttentionMask) -> Result<Tracer> {
        let scale = 1.0 / ((x.dims()[2] / self.attn.heads) as f64).sqrt();
        let h = self
            .attn_norm
            .forward_with(p, &x.add(&self.attn.forward(p, x, mask, scale, None)?)?)?;
        let ff = self
            .down
            .forward_with(p, &self.act.forward_with(p, &self.up.forward_with(p, &h)?)?)?;
        self.out_norm.forward_with(p, &h.add(&ff)?)
    }

    /// Every part's parameters by name.
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        let mut all = self.attn.params();
        for l in [&self.up, &self.down] {
            all.extend(l.params());
        }
        all.extend(self.attn_norm.params());
        all.extend(self.out_norm.params());
        all
    }
}
