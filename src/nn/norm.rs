//! Normalisation layers, with candle_nn's parameter names and
//! initialisations (`weight` ones, `bias` zeros): layer norm, RMS norm,
//! group norm and batch norm. Each normalises within one example, except
//! batch norm in training mode, which refuses to run under `vmap`.

use super::layers::{collect, full_name, optional, param_map};
use super::{EagerCache, Module, Params};
use crate::error::{Error, Result};
use crate::trace::Tracer;
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// `(x - mean) / sqrt(var + eps)` over `axes` (biased variance), as
/// PyTorch computes it: the centred input times `rstd`. A product, not a
/// quotient, because the backward pass then holds the centred input (which
/// the variance's derivative needs anyway) and the small `rstd`, where a
/// division's derivative would hold its result too: one activation-sized
/// value less per norm under `grad`.
fn standardise(x: &Tracer, axes: Vec<usize>, eps: f64) -> Result<Tracer> {
    let centred = x.sub(&x.mean_keepdim(axes.clone())?)?;
    let var = centred.sqr()?.mean_keepdim(axes)?;
    centred.mul(&var.affine(1.0, eps)?.sqrt()?.recip()?)
}

/// `x * weight + bias`, the parameters reshaped to broadcast along `axis`
/// (`[C] -> [C, 1, ..]` for channels, as is for the last axis).
fn affine_along(x: &Tracer, w: Option<Tracer>, b: Option<Tracer>, axis: usize) -> Result<Tracer> {
    let shape = |t: &Tracer| -> Vec<usize> {
        let mut s = vec![t.dims()[0]];
        s.extend(std::iter::repeat_n(1, x.rank() - axis - 1));
        s
    };
    let mut y = x.clone();
    if let Some(w) = w {
        y = y.mul(&w.reshape(shape(&w))?)?;
    }
    if let Some(b) = b {
        y = y.add(&b.reshape(shape(&b))?)?;
    }
    Ok(y)
}

fn ones(size: usize, name: &str, vb: &VarBuilder) -> Result<Tensor> {
    super::param(vb, &[size], name, Init::Const(1.))
}

fn zeros(size: usize, name: &str, vb: &VarBuilder) -> Result<Tensor> {
    super::param(vb, &[size], name, Init::Const(0.))
}

fn check_last(op: &'static str, x: &Tracer, size: usize) -> Result<()> {
    match x.dims().last() {
        Some(&d) if d == size => Ok(()),
        _ => Err(Error::shape(
            op,
            &[x.dims()],
            format!("the last axis must have size {size}"),
        )),
    }
}

/// Layer normalisation over the last axis (PyTorch's `LayerNorm(D)`,
/// candle_nn's `layer_norm`): `(x - mean) / sqrt(var + eps) * weight +
/// bias`.
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    eps: f64,
    prefix: String,
    cache: EagerCache,
}

/// A layer norm over a last axis of `size`, with weight and bias.
pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: ones(size, "weight", &vb)?,
        bias: Some(zeros(size, "bias", &vb)?),
        eps,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

/// A layer norm with a weight and no bias (PyTorch's `bias=False`).
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: ones(size, "weight", &vb)?,
        bias: None,
        eps,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

impl LayerNorm {
    /// A layer norm over existing tensors (`weight` `[D]`, `bias` `[D]`),
    /// sharing them: how a candle_nn `LayerNorm`'s weights come across.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>, eps: f64, prefix: &str) -> LayerNorm {
        LayerNorm {
            weight,
            bias,
            eps,
            prefix: prefix.to_string(),
            cache: EagerCache::default(),
        }
    }
}

impl Module for LayerNorm {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        check_last("layer_norm", x, self.weight.dims()[0])?;
        let last = x.rank() - 1;
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        let b = optional(p, &self.prefix, "bias", self.bias.as_ref(), x)?;
        affine_along(&standardise(x, vec![last], self.eps)?, Some(w), b, last)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        collect(&self.prefix, &self.weight, &self.bias)
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}

/// RMS normalisation over the last axis (PyTorch's `RMSNorm(D)`,
/// candle_nn's `rms_norm`): `x / sqrt(mean(x^2) + eps) * weight`.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    prefix: String,
    cache: EagerCache,
}

/// An RMS norm over a last axis of `size`.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    Ok(RmsNorm {
        weight: ones(size, "weight", &vb)?,
        eps,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

impl RmsNorm {
    /// An RMS norm over an existing weight `[D]`, sharing it.
    pub fn from_tensors(weight: Tensor, eps: f64, prefix: &str) -> RmsNorm {
        RmsNorm {
            weight,
            eps,
            prefix: prefix.to_string(),
            cache: EagerCache::default(),
        }
    }
}

impl Module for RmsNorm {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        check_last("rms_norm", x, self.weight.dims()[0])?;
        let last = x.rank() - 1;
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        // times the reciprocal, not divided (see `standardise`)
        let rms = x.sqr()?.mean_keepdim(last)?.affine(1.0, self.eps)?.sqrt()?;
        x.mul(&rms.recip()?)?.mul(&w)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        param_map(&self.prefix, &[("weight", Some(&self.weight))])
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}

/// Group normalisation of `[N, C, ..]` (PyTorch's `GroupNorm(G, C)`,
/// candle_nn's `group_norm`): each example's channels in `G` groups, each
/// group standardised over its channels and positions, then a per-channel
/// weight and bias. Within one example, so per-sample gradients are
/// defined (the usual replacement for batch norm in DP training).
pub struct GroupNorm {
    groups: usize,
    weight: Tensor,
    bias: Tensor,
    eps: f64,
    prefix: String,
    cache: EagerCache,
}

/// A group norm of `channels` in `groups` groups (`groups` divides
/// `channels`).
pub fn group_norm(groups: usize, channels: usize, eps: f64, vb: VarBuilder) -> Result<GroupNorm> {
    if groups == 0 || !channels.is_multiple_of(groups) {
        return Err(Error::Config {
            msg: format!("group_norm: {groups} groups do not divide {channels} channels"),
        });
    }
    Ok(GroupNorm {
        groups,
        weight: ones(channels, "weight", &vb)?,
        bias: zeros(channels, "bias", &vb)?,
        eps,
        prefix: vb.prefix(),
        cache: EagerCache::default(),
    })
}

impl GroupNorm {
    /// A group norm over existing `weight` and `bias` (`[C]`), sharing them.
    pub fn from_tensors(groups: usize, weight: Tensor, bias: Tensor, eps: f64, prefix: &str) -> Result<GroupNorm> {
        let c = weight.dims1()?;
        if groups == 0 || c % groups != 0 {
            return Err(Error::Config {
                msg: format!("group_norm: {groups} groups do not divide {c} channels"),
            });
        }
        Ok(GroupNorm {
            groups,
            weight,
            bias,
            eps,
            prefix: prefix.to_string(),
            cache: EagerCache::default(),
        })
    }
}

impl Module for GroupNorm {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let c = self.weight.dims()[0];
        if x.rank() < 2 || x.dims()[1] != c {
            return Err(Error::shape(
                "group_norm",
                &[x.dims()],
                format!("expected [N, {c}, ..]"),
            ));
        }
        // N C .. -> N G (C/G ..): standardise the last axis, then back
        let n = x.dims()[0];
        let grouped = x.reshape((n, self.groups, ()))?;
        let y = standardise(&grouped, vec![2], self.eps)?.reshape(x.dims())?;
        let w = p.get(&full_name(&self.prefix, "weight"), &self.weight, x)?;
        let b = p.get(&full_name(&self.prefix, "bias"), &self.bias, x)?;
        affine_along(&y, Some(w), Some(b), 1)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        param_map(
            &self.prefix,
            &[("weight", Some(&self.weight)), ("bias", Some(&self.bias))],
        )
    }
    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}

/// Batch normalisation of `[N, C, ..]` (candle_nn's `batch_norm`, its
/// variables `running_mean`, `running_var`, `weight`, `bias`). In
/// evaluation mode (the default) it uses the running statistics, an
/// affine map per channel, so it runs under `vmap` and per-sample
/// gradients are defined. In training mode it standardises with the
/// batch's own statistics over `N` and the positions; the running
/// statistics are not updated by a traced forward (train them with
/// candle_nn's). Under `vmap` training mode is an error: an example's
/// output would depend on the other examples.
pub struct BatchNorm {
    running_mean: Tensor,
    running_var: Tensor,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    eps: f64,
    training: Arc<AtomicBool>,
    prefix: String,
}

/// A batch norm of `channels`, affine, in evaluation mode.
pub fn batch_norm(channels: usize, eps: f64, vb: VarBuilder) -> Result<BatchNorm> {
    Ok(BatchNorm {
        running_mean: zeros(channels, "running_mean", &vb)?,
        running_var: ones(channels, "running_var", &vb)?,
        weight: Some(ones(channels, "weight", &vb)?),
        bias: Some(zeros(channels, "bias", &vb)?),
        eps,
        training: Arc::new(AtomicBool::new(false)),
        prefix: vb.prefix(),
    })
}

impl BatchNorm {
    /// A batch norm over existing statistics and (optional) affine
    /// parameters, sharing them.
    pub fn from_tensors(
        running_mean: Tensor,
        running_var: Tensor,
        affine: Option<(Tensor, Tensor)>,
        eps: f64,
        prefix: &str,
    ) -> BatchNorm {
        let (weight, bias) = match affine {
            Some((w, b)) => (Some(w), Some(b)),
            None => (None, None),
        };
        BatchNorm {
            running_mean,
            running_var,
            weight,
            bias,
            eps,
            training: Arc::new(AtomicBool::new(false)),
            prefix: prefix.to_string(),
        }
    }
}

impl Module for BatchNorm {
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        let c = self.running_mean.dims()[0];
        if x.rank() < 2 || x.dims()[1] != c {
            return Err(Error::shape(
                "batch_norm",
                &[x.dims()],
                format!("expected [N, {c}, ..]"),
            ));
        }
        let w = optional(p, &self.prefix, "weight", self.weight.as_ref(), x)?;
        let b = optional(p, &self.prefix, "bias", self.bias.as_ref(), x)?;
        if x.read_mode(&self.training) {
            if x.in_vmap() {
                return Err(Error::unsupported(
                    "batch_norm",
                    "vmap",
                    "in training mode batch norm standardises with the statistics of the whole batch, so an \
                     example's output depends on the other examples and per-example results (per-sample \
                     gradients) are not defined; use evaluation mode (the running statistics), or GroupNorm \
                     or LayerNorm, as functorch's replace_all_batch_norm_modules_ advises",
                ));
            }
            let axes: Vec<usize> = (0..x.rank()).filter(|&a| a != 1).collect();
            return affine_along(&standardise(x, axes, self.eps)?, w, b, 1);
        }
        let mean = crate::trace::Operand::to_tracer(&self.running_mean, x)?;
        let var = crate::trace::Operand::to_tracer(&self.running_var, x)?;
        // (x - mean) / sqrt(var + eps) = x * inv - mean * inv
        let inv = var.affine(1.0, self.eps)?.sqrt()?.recip()?;
        let shift = mean.mul(&inv)?.neg()?;
        affine_along(&affine_along(x, Some(inv), Some(shift), 1)?, w, b, 1)
    }
    fn params(&self) -> BTreeMap<String, Tensor> {
        param_map(
            &self.prefix,
            &[("weight", self.weight.as_ref()), ("bias", self.bias.as_ref())],
        )
    }
    fn train(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed);
    }
}
