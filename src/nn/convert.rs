//! Transposed convolution layers, and conversions from candle_nn's layers
//! to this crate's, sharing their tensors (no copy): a model built with
//! candle_nn keeps its weights when its layers are converted.
//!
//! Code written against candle's `Tensor` cannot be traced: candle records
//! no graph a library outside it can read (its backprop graph is private
//! and holds only what autograd needs), so `vmap` and `grad` see the
//! model's operations only when they are written with [`Tracer`]. The path
//! is to convert each layer (or build this crate's from the same
//! `VarBuilder`) and compose them as the candle model does.

use super::layers::{add_channel_bias, collect, full_name, optional, Conv, ConvConfig, Linear};
use super::norm::{BatchNorm, LayerNorm, RmsNorm};
use super::transformer::{Embedding, Norm};
use super::{EagerCache, Module, Params};
use crate::error::{Error, Result};
use crate::ir::ConvGeom;
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;

/// A 1D or 2D transposed convolution `[N, Cin, *S] -> [N, Cout, *O]` with
/// weight `[Cin, Cout/groups, *k]` and optional bias (candle_nn's
/// `ConvTranspose1d/2d`, PyTorch's `ConvTranspose*d`).
pub struct ConvTranspose {
    nd: usize,
    weight: Tensor,
    bias: Option<Tensor>,
    cfg: ConvConfig,
    output_padding: usize,
    prefix: String,
    cache: EagerCache,
}

fn conv_t(
    nd: usize,
    cin: usize,
    cout: usize,
    k: usize,
    cfg: ConvConfig,
    output_padding: usize,
    vb: VarBuilder,
) -> Result<ConvTranspose> {
    let groups = cfg.groups.max(1);
    if !cout.is_multiple_of(groups) || !cin.is_multiple_of(groups) {
        return Err(Error::Config {
            msg: format!("conv_transpose: {groups} groups do not divide {cin} and {cout} channels"),
        });
    }
    // candle_nn's initialisation bounds
    let bound = match nd {
        1 => 1. / (cout as f64 * k as f64).sqrt(),
        _ => 1. / (cout as f64).sqrt() / k as f64,
    };
    let init = Init::Uniform { lo: -bound, up: bound };
    let shape = [&[cin, cout / groups], &vec![k; nd][..]].concat();
    Ok(ConvTranspose {
        nd,
        weight: super::param(&vb, &shape, "weight", init)?,
        bias: Some(super::param(&vb, &[cout], "bias", init)?),
        cfg,
        output_padding,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

/// A 1D transposed convolution with bias (candle_nn's `conv_transpose1d`).
pub fn conv_transpose1d(
    cin: usize,
    cout: usize,
    k: usize,
    cfg: ConvConfig,
    output_padding: usize,
    vb: VarBuilder,
) -> Result<ConvTranspose> {
    conv_t(1, cin, cout, k, cfg, output_padding, vb)
}

/// A 2D transposed convolution with bias (candle_nn's `conv_transpose2d`).
pub fn conv_transpose2d(
    cin: usize,
    cout: usize,
    k: usize,
    cfg: ConvConfig,
    output_padding: usize,
    vb: VarBuilder,
) -> Result<ConvTranspose> {
    conv_t(2, cin, cout, k, cfg, output_padding, vb)
}

impl Module for ConvTranspose {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        let c = self.cfg;
        let geom = ConvGeom::uniform(self.nd, 0, c.padding, c.stride, c.dilation);
        let y = x.conv_transpose(&w, geom, self.output_padding, c.groups.max(1))?;
        add_channel_bias(y, optional(p, &self.prefix, "bias", self.bias.as_ref(), x)?, self.nd)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        collect(&self.prefix, &self.weight, &self.bias)
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}

/// Conversions from candle_nn's layers, named `prefix` (the name their
/// `VarBuilder` gave them, so `functional_call` and per-sample gradients
/// use the same names as the `VarMap`). The tensors are shared, not copied.
impl Linear {
    /// This crate's twin of a candle_nn `Linear`.
    pub fn from_candle(l: &candle_nn::Linear, prefix: &str) -> Linear {
        Linear::from_tensors(l.weight().clone(), l.bias().cloned(), prefix)
    }
}

fn conv_config(padding: usize, stride: usize, dilation: usize, groups: usize) -> ConvConfig {
    ConvConfig {
        padding,
        stride,
        dilation,
        groups,
    }
}

impl Conv {
    /// The twin of a candle_nn `Conv1d`.
    pub fn from_candle_conv1d(c: &candle_nn::Conv1d, prefix: &str) -> Conv {
        let k = c.config();
        let cfg = conv_config(k.padding, k.stride, k.dilation, k.groups);
        Conv::from_tensors(1, c.weight().clone(), c.bias().cloned(), cfg, prefix)
    }

    /// The twin of a candle_nn `Conv2d`.
    pub fn from_candle_conv2d(c: &candle_nn::Conv2d, prefix: &str) -> Conv {
        let k = c.config();
        let cfg = conv_config(k.padding, k.stride, k.dilation, k.groups);
        Conv::from_tensors(2, c.weight().clone(), c.bias().cloned(), cfg, prefix)
    }
}

impl ConvTranspose {
    fn from_parts(
        nd: usize,
        weight: Tensor,
        bias: Option<Tensor>,
        cfg: ConvConfig,
        output_padding: usize,
        prefix: &str,
    ) -> Self {
        ConvTranspose {
            nd,
            weight,
            bias,
            cfg,
            output_padding,
            prefix: prefix.to_string(),
            cache: EagerCache::default(),
        }
    }

    /// The twin of a candle_nn `ConvTranspose1d`.
    pub fn from_candle_1d(c: &candle_nn::ConvTranspose1d, prefix: &str) -> Self {
        let k = c.config();
        let cfg = conv_config(k.padding, k.stride, k.dilation, k.groups);
        Self::from_parts(1, c.weight().clone(), c.bias().cloned(), cfg, k.output_padding, prefix)
    }

    /// The twin of a candle_nn `ConvTranspose2d` (which has no groups).
    pub fn from_candle_2d(c: &candle_nn::ConvTranspose2d, prefix: &str) -> Self {
        let k = c.config();
        let cfg = conv_config(k.padding, k.stride, k.dilation, 1);
        Self::from_parts(2, c.weight().clone(), c.bias().cloned(), cfg, k.output_padding, prefix)
    }
}

impl Embedding {
    /// The twin of a candle_nn `Embedding`.
    pub fn from_candle(e: &candle_nn::Embedding, prefix: &str) -> Embedding {
        Embedding::from_tensors(e.embeddings().clone(), prefix)
    }
}

impl RmsNorm {
    /// The twin of a candle_nn `RmsNorm`.
    pub fn from_candle(n: &candle_nn::RmsNorm, prefix: &str) -> RmsNorm {
        RmsNorm::from_tensors(n.weight().clone(), n.eps(), prefix)
    }
}

impl Norm {
    /// The twin of a candle_nn `LayerNorm`. candle_nn's `LayerNorm` also
    /// serves as an RMS norm (`remove_mean: false`) and does not say which
    /// it is, so this runs it once on a probe row and keeps the formula
    /// that gives its output.
    pub fn from_candle(n: &candle_nn::LayerNorm, prefix: &str) -> Result<Norm> {
        use candle_core::Module as _;
        let d = n.weight().dims1()?;
        let probe = Tensor::arange(0u32, d as u32, n.weight().device())?
            .to_dtype(n.weight().dtype())?
            .affine(0.37, 0.5)?
            .unsqueeze(0)?;
        let theirs = n.forward(&probe)?;
        let ln = LayerNorm::from_tensors(n.weight().clone(), n.bias().cloned(), n.eps(), prefix);
        let ours = ln.forward_eager(&probe)?;
        let diff = (ours - &theirs)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_dtype(candle_core::DType::F64)?;
        if diff.to_scalar::<f64>()? <= 1e-4 {
            return Ok(Norm::Layer(ln));
        }
        if n.bias().is_some() {
            return Err(Error::Config {
                msg: "Norm::from_candle: a LayerNorm that does not remove the mean but has a bias is neither form"
                    .into(),
            });
        }
        Ok(Norm::Rms(RmsNorm::from_tensors(n.weight().clone(), n.eps(), prefix)))
    }
}

impl BatchNorm {
    /// The twin of a candle_nn `BatchNorm` (its running statistics and
    /// affine parameters shared), in evaluation mode.
    pub fn from_candle(n: &candle_nn::BatchNorm, prefix: &str) -> BatchNorm {
        let affine = n.weight_and_bias().map(|(w, b)| (w.clone(), b.clone()));
        BatchNorm::from_tensors(
            n.running_mean().clone(),
            n.running_var().clone(),
            affine,
            n.eps(),
            prefix,
        )
    }
}
