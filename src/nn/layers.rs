//! Layers mirroring candle_nn's, built through a `VarBuilder` with
//! candle_nn's initialisations and parameter names.

use super::{EagerCache, Module, Params};
use crate::error::Result;
use crate::ir::ConvGeom;
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(super) fn full_name(prefix: &str, leaf: &str) -> String {
    if prefix.is_empty() {
        leaf.to_string()
    } else {
        format!("{prefix}.{leaf}")
    }
}

/// Adds `weight` (and `bias`) under the layer's prefix.
pub(super) fn collect(prefix: &str, weight: &Tensor, bias: &Option<Tensor>) -> BTreeMap<String, Tensor> {
    param_map(prefix, &[("weight", Some(weight)), ("bias", bias.as_ref())])
}

/// The named tensors that are present, under the layer's prefix.
pub(super) fn param_map(prefix: &str, named: &[(&str, Option<&Tensor>)]) -> BTreeMap<String, Tensor> {
    named
        .iter()
        .filter_map(|(n, t)| t.map(|t| (full_name(prefix, n), t.clone())))
        .collect()
}

/// The layer's parameter `leaf` if it has one: its own tensor, or the
/// replacement `p` gives by its full name.
pub(super) fn optional(
    p: &Params,
    prefix: &str,
    leaf: &str,
    own: Option<&Tensor>,
    like: &Tracer,
) -> Result<Option<Tracer>> {
    own.map(|t| p.get(&full_name(prefix, leaf), t, like)).transpose()
}

/// `y + bias` for a per-channel `bias` `[C]` of `y [N, C, *spatial]`
/// (`nd` spatial axes): `C -> C 1..` so it broadcasts over them. `y` as it
/// is without a bias.
pub(super) fn add_channel_bias(y: Tracer, bias: Option<Tracer>, nd: usize) -> Result<Tracer> {
    match bias {
        Some(b) => {
            let shape = [&[b.dims()[0]], &vec![1; nd][..]].concat();
            y.add(&b.reshape(shape)?)
        }
        None => Ok(y),
    }
}

/// candle_nn's bias initialisation: uniform in `±1/sqrt(fan_in)`.
fn bias_init(fan_in: usize) -> Init {
    let bound = 1. / (fan_in as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// `y = x W^T + b` over the last axis; `W: [out, in]` (or `y = x W + b`
/// with `W: [in, out]`, Hugging Face's `Conv1D` in GPT-2, made by
/// [`Linear::from_tensors_in_out`]).
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    prefix: String,
    // the weight is stored [in, out]: its gradient keeps that layout
    in_out: bool,
    cache: EagerCache,
}

/// A layer's `weight` of `shape`, initialised as candle_nn's layers do.
fn kaiming_weight(vb: &VarBuilder, shape: &[usize]) -> Result<Tensor> {
    super::param(vb, shape, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)
}

/// A linear layer with bias (candle_nn's `linear`).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = kaiming_weight(&vb, &[out_dim, in_dim])?;
    let bias = Some(super::param(&vb, &[out_dim], "bias", bias_init(in_dim))?);
    Ok(Linear {
        weight,
        bias,
        prefix: vb.prefix(),
        in_out: false,
        cache: EagerCache::default(),
    })
}

/// A linear layer without bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = kaiming_weight(&vb, &[out_dim, in_dim])?;
    Ok(Linear {
        weight,
        bias: None,
        prefix: vb.prefix(),
        in_out: false,
        cache: EagerCache::default(),
    })
}

/// A linear layer with a bias where `bias` (candle-transformers'
/// `linear_b`: a config's `attention_bias` or `mlp_bias` decides).
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    match bias {
        true => linear(in_dim, out_dim, vb),
        false => linear_no_bias(in_dim, out_dim, vb),
    }
}

/// A linear layer with bias whose weight is stored `[in, out]` (Hugging
/// Face's `Conv1D`, GPT-2's projections; see [`Linear::from_tensors_in_out`]).
pub fn linear_in_out(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = kaiming_weight(&vb, &[in_dim, out_dim])?;
    let bias = Some(super::param(&vb, &[out_dim], "bias", bias_init(in_dim))?);
    Ok(Linear {
        in_out: true,
        ..Linear::from_tensors(weight, bias, &vb.prefix())
    })
}

impl Linear {
    /// A linear layer over existing tensors (`weight` `[out, in]`,
    /// `bias` `[out]`), sharing them, named `prefix`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>, prefix: &str) -> Linear {
        Linear {
            weight,
            bias,
            prefix: prefix.to_string(),
            in_out: false,
            cache: EagerCache::default(),
        }
    }

    /// A linear layer whose weight is stored `[in, out]` (Hugging Face's
    /// `Conv1D`, GPT-2's projections): `y = x W + b`. The parameter and its
    /// gradient keep the checkpoint's layout.
    pub fn from_tensors_in_out(weight: Tensor, bias: Option<Tensor>, prefix: &str) -> Linear {
        Linear {
            in_out: true,
            ..Linear::from_tensors(weight, bias, prefix)
        }
    }
}

impl Module for Linear {
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        if x.rank() == 1 {
            // one feature vector, as PyTorch's Linear takes it
            return self.forward_with(p, &x.unsqueeze(0)?)?.squeeze(0);
        }
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        let mut y = match self.in_out {
            true => x.matmul(&w)?,
            false => x.matmul(&w.t()?)?,
        };
        if let Some(lora) = p.adapters() {
            if let Some(d) = lora.delta(p, &self.prefix, x)? {
                y = y.add(&d)?;
            }
        }
        match &self.bias {
            Some(b) => y.add(&p.get(&full_name(&self.prefix, "bias"), b, x)?),
            None => Ok(y),
        }
    }

    fn params(&self) -> BTreeMap<String, Tensor> {
        collect(&self.prefix, &self.weight, &self.bias)
    }

    fn in_out_weights(&self) -> Vec<String> {
        match self.in_out {
            true => vec![full_name(&self.prefix, "weight")],
            false => Vec::new(),
        }
    }
}

/// Convolution settings, the same in every spatial dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvConfig {
    /// Zero padding on both sides.
    pub padding: usize,
    /// Step between windows.
    pub stride: usize,
    /// Spacing between kernel taps.
    pub dilation: usize,
    /// Channel groups.
    pub groups: usize,
}

impl Default for ConvConfig {
    fn default() -> Self {
        ConvConfig {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        }
    }
}

/// A 1D, 2D or 3D convolution with optional bias (PyTorch semantics).
pub struct Conv {
    nd: usize,
    weight: Tensor,
    bias: Option<Tensor>,
    cfg: ConvConfig,
    prefix: String,
    cache: EagerCache,
}

fn conv(nd: usize, cin: usize, cout: usize, k: usize, cfg: ConvConfig, bias: bool, vb: VarBuilder) -> Result<Conv> {
    let shape = [&[cout, cin / cfg.groups.max(1)], &vec![k; nd][..]].concat();
    let weight = kaiming_weight(&vb, &shape)?;
    // candle_nn bounds the conv bias by the input channels, not the fan-in.
    let bias = if bias {
        Some(super::param(&vb, &[cout], "bias", bias_init(cin))?)
    } else {
        None
    };
    Ok(Conv {
        nd,
        weight,
        bias,
        cfg,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

/// A 1D convolution with bias (candle_nn's `conv1d`).
pub fn conv1d(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(1, cin, cout, k, cfg, true, vb)
}
/// A 1D convolution without bias.
pub fn conv1d_no_bias(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(1, cin, cout, k, cfg, false, vb)
}
/// A 2D convolution with bias (candle_nn's `conv2d`).
pub fn conv2d(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(2, cin, cout, k, cfg, true, vb)
}
/// A 2D convolution without bias.
pub fn conv2d_no_bias(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(2, cin, cout, k, cfg, false, vb)
}
/// A 3D convolution with bias (candle has none; initialised like candle_nn's
/// 2D one).
pub fn conv3d(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(3, cin, cout, k, cfg, true, vb)
}
/// A 3D convolution without bias.
pub fn conv3d_no_bias(cin: usize, cout: usize, k: usize, cfg: ConvConfig, vb: VarBuilder) -> Result<Conv> {
    conv(3, cin, cout, k, cfg, false, vb)
}

impl Conv {
    /// An `nd`-dimensional convolution over existing tensors (`weight`
    /// `[Cout, Cin/groups, *k]`, `bias` `[Cout]`), sharing them.
    pub fn from_tensors(nd: usize, weight: Tensor, bias: Option<Tensor>, cfg: ConvConfig, prefix: &str) -> Conv {
        Conv {
            nd,
            weight,
            bias,
            cfg,
            prefix: prefix.to_string(),
            cache: EagerCache::default(),
        }
    }
}

impl Module for Conv {
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        let c = self.cfg;
        let geom = ConvGeom::uniform(self.nd, 0, c.padding, c.stride, c.dilation);
        let y = x.conv(&w, geom, c.groups)?;
        add_channel_bias(y, optional(p, &self.prefix, "bias", self.bias.as_ref(), x)?, self.nd)
    }

    fn params(&self) -> BTreeMap<String, Tensor> {
        collect(&self.prefix, &self.weight, &self.bias)
    }
}

/// 2D max pooling, any kernel and stride.
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl Module for MaxPool2d {
    fn forward_with(&self, _p: &Params, x: &Tracer) -> Result<Tracer> {
        x.max_pool2d_with_stride(self.kernel, self.stride)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::new()
    }
}

/// 2D average pooling, any kernel and stride.
#[derive(Clone, Copy, Debug)]
pub struct AvgPool2d {
    /// Window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl Module for AvgPool2d {
    fn forward_with(&self, _p: &Params, x: &Tracer) -> Result<Tracer> {
        x.avg_pool2d_with_stride(self.kernel, self.stride)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::new()
    }
}

/// All axes but the leading (batch) one merged into one.
#[derive(Clone, Copy, Debug)]
pub struct Flatten;

impl Module for Flatten {
    fn forward_with(&self, _p: &Params, x: &Tracer) -> Result<Tracer> {
        x.flatten_from(1)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::new()
    }
}

/// Elementwise activations.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Activation {
    /// `max(x, 0)`
    Relu,
    /// hyperbolic tangent
    Tanh,
    /// logistic sigmoid
    Sigmoid,
    /// GELU, exact (erf) form
    Gelu,
    /// GELU, tanh approximation (candle_nn's `Activation::NewGelu`)
    GeluTanh,
    /// SiLU (swish), `x * sigmoid(x)`
    Silu,
    /// `x` for `x >= 0`, else `slope * x`
    LeakyRelu(f64),
    /// `x` for `x > 0`, else `alpha (e^x - 1)`
    Elu(f64),
    /// `log(1 + e^x)`
    Softplus,
    /// `x * sigmoid(1.702 x)` (Hugging Face's `quick_gelu`)
    QuickGelu,
}

impl Activation {
    /// The activation a Hugging Face config names (`hidden_act`,
    /// `activation_function`): `gelu`, `gelu_new` / `gelu_pytorch_tanh` /
    /// `gelu_fast` (the tanh form), `relu`, `silu` / `swish`, `quick_gelu`,
    /// `tanh`, `sigmoid`; `None` for any other.
    pub fn from_hf(name: &str) -> Option<Activation> {
        Some(match name {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            "silu" | "swish" => Activation::Silu,
            "quick_gelu" => Activation::QuickGelu,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            _ => return None,
        })
    }
}

impl Module for Activation {
    fn forward_with(&self, _p: &Params, x: &Tracer) -> Result<Tracer> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Silu => x.silu(),
            Activation::LeakyRelu(s) => x.leaky_relu(*s),
            Activation::Elu(a) => x.elu(*a),
            Activation::Softplus => x.softplus(),
            Activation::QuickGelu => x.mul(&x.affine(1.702, 0.0)?.sigmoid()?),
        }
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::new()
    }
}

/// Dropout: in training mode zeroes each element with probability `p` and
/// scales the rest by `1 / (1 - p)`; the identity in evaluation mode (the
/// default). Under `vmap` it needs the transform's `randomness` setting.
#[derive(Debug)]
pub struct Dropout {
    p: f64,
    training: Arc<AtomicBool>,
}

impl Dropout {
    /// Dropout with drop probability `p` (in `[0, 1)`), in evaluation mode.
    pub fn new(p: f64) -> Self {
        Dropout {
            p,
            training: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Module for Dropout {
    fn forward_with(&self, _p: &Params, x: &Tracer) -> Result<Tracer> {
        // Read through the trace, so a cached graph is used only in the
        // mode it was traced in.
        if !x.read_mode(&self.training) || self.p == 0.0 {
            return Ok(x.clone());
        }
        if !(0.0..1.0).contains(&self.p) {
            return Err(crate::Error::Config {
                msg: format!("dropout: probability {} is outside [0, 1)", self.p),
            });
        }
        let keep = x.rand_uniform_like()?.ge(self.p)?.to_dtype(x.dtype())?;
        x.mul(&keep)?.affine(1.0 / (1.0 - self.p), 0.0)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::new()
    }
    fn train(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed);
    }
}

/// Layers applied in order.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module + Send + Sync>>,
    cache: EagerCache,
}

/// An empty [`Sequential`].
pub fn seq() -> Sequential {
    Sequential::default()
}

impl Sequential {
    /// Appends a layer.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: Module + Send + Sync + 'static>(mut self, layer: M) -> Self {
        self.layers.push(Box::new(layer));
        self.cache = EagerCache::default(); // graphs of the shorter model are stale
        self
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward_with(p, &h)?;
        }
        Ok(h)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }
    fn train(&self, on: bool) {
        for l in &self.layers {
            l.train(on);
        }
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}
