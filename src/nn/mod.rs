//! Layers, losses and the functional API for models: write a model once and
//! run it eagerly, under `vmap(|x| model.forward(&x))`, under `grad`, as
//! per-sample gradients and as an ensemble.
//!
//! Layers mirror candle_nn's: their weights are created and loaded through
//! [`candle_nn::VarBuilder`] with candle_nn's initialisations and parameter
//! names (`conv1.weight`), so a `VarMap` or a safetensors file written by
//! candle (or by PyTorch with the same names) loads unchanged.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_func::nn::{self, Module};
//! use candle_func::{vmap, Tracer};
//! let varmap = candle_nn::VarMap::new();
//! let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let model = nn::seq()
//!     .add(nn::conv2d(1, 4, 3, Default::default(), vb.pp("conv1"))?)
//!     .add(nn::Activation::Relu)
//!     .add(nn::Flatten)
//!     .add(nn::linear(4 * 6 * 6, 10, vb.pp("fc"))?);
//! let xs = Tensor::randn(0f32, 1., (16, 1, 8, 8), &Device::Cpu)?;
//! // per example: x is [1, 8, 8]; the model wants a batch axis
//! let ys = vmap(|x: Tracer| model.forward(&x.unsqueeze(0)?)?.squeeze(0)).call(&xs)?;
//! assert_eq!(ys.dims(), &[16, 10]);
//! // the same model, eagerly, on the whole batch
//! let eager = model.forward_eager(&xs)?;
//! assert!((ys - eager)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
//! # Ok::<(), candle_func::Error>(())
//! ```

#[doc = include_str!("../../docs/bring_a_candle_model.md")]
pub mod candle_models {}
mod attention;
mod convert;
mod layers;
mod lora;
mod losses;
mod norm;
mod recurrent;
mod transformer;
pub(crate) use transformer::RotaryCache;

pub use attention::{attend, mask_value, merge_heads, split_heads, AttentionMask, PostNormBlock, SelfAttention};
pub use convert::{conv_transpose1d, conv_transpose2d, ConvTranspose};
pub use layers::{
    conv1d, conv1d_no_bias, conv2d, conv2d_no_bias, conv3d, conv3d_no_bias, linear, linear_b, linear_in_out,
    linear_no_bias, seq, Activation, AvgPool2d, Conv, ConvConfig, Dropout, Flatten, Linear, MaxPool2d, Sequential,
};
pub use lora::{Lora, LoraConfig};
pub use losses::{bce_with_logits, cross_entropy, cross_entropy_with, huber, l1, mse, nll, CrossEntropy, Reduction};

/// The losses' old path (`nn::loss::mse`): each is at `nn::` (`nn::mse`),
/// its one path; these are deprecated, for one release.
#[doc(hidden)]
pub mod loss {
    use crate::error::Result;
    use crate::trace::Tracer;

    /// A deprecated name of the loss at `nn::`.
    macro_rules! moved {
        ($name:ident, $note:literal, ($($a:ident: $t:ty),*)) => {
            #[doc = $note]
            #[deprecated(since = "0.2.0", note = $note)]
            pub fn $name($($a: $t),*) -> Result<Tracer> {
                super::$name($($a),*)
            }
        };
    }
    type R = super::Reduction;
    moved!(nll, "moved to candle_func::nn::nll", (a: &Tracer, b: &Tracer, r: R));
    moved!(cross_entropy, "moved to candle_func::nn::cross_entropy", (a: &Tracer, b: &Tracer, r: R));
    moved!(mse, "moved to candle_func::nn::mse", (a: &Tracer, b: &Tracer, r: R));
    moved!(l1, "moved to candle_func::nn::l1", (a: &Tracer, b: &Tracer, r: R));
    moved!(bce_with_logits, "moved to candle_func::nn::bce_with_logits", (a: &Tracer, b: &Tracer, r: R));
    moved!(huber, "moved to candle_func::nn::huber", (a: &Tracer, b: &Tracer, delta: f64, r: R));
    moved!(cross_entropy_with, "moved to candle_func::nn::cross_entropy_with", (a: &Tracer, b: &Tracer, o: super::CrossEntropy));

    /// Moved to `candle_func::nn::Reduction`.
    #[deprecated(since = "0.2.0", note = "moved to candle_func::nn::Reduction")]
    pub type Reduction = super::Reduction;

    /// Moved to `candle_func::nn::CrossEntropy`.
    #[deprecated(since = "0.2.0", note = "moved to candle_func::nn::CrossEntropy")]
    pub type CrossEntropy = super::CrossEntropy;
}
pub use norm::{
    batch_norm, group_norm, layer_norm, layer_norm_no_bias, rms_norm, BatchNorm, GroupNorm, LayerNorm, RmsNorm,
};
pub use recurrent::{gru, lstm, rnn, Recurrent, RecurrentCell, RecurrentConfig, RecurrentOutput};
pub use transformer::{
    embedding, gpt, multi_head_attention, norm, rope, rope_i, rotary_tables, transformer_block, BlockConfig, Embedding,
    Gpt, MultiHeadAttention, Norm, NormKind, TransformerBlock,
};
#[allow(deprecated)]
#[doc(hidden)]
pub use transformer::{multi_head_attention_key_padding, transformer_block_key_padding};

use crate::error::{Error, Result};
use crate::trace::Tracer;
use crate::transforms::{call_concrete, jit, GraphCache};
use candle_core::Tensor;
use std::collections::BTreeMap;

/// The parameter `name` of `shape` from `vb` (made by the VarMap's
/// initialiser where missing), its size checked first: a layer sized from
/// user input (a hidden size of 2^40) is an error naming it, never an
/// aborted allocation.
pub(crate) fn param(vb: &candle_nn::VarBuilder, shape: &[usize], name: &str, init: candle_nn::Init) -> Result<Tensor> {
    use crate::env::{check_host_shape, checked_elems};
    let what = format!("parameter {:?}", layers::full_name(&vb.prefix(), name));
    // the host's memory bounds a parameter made on the host only (a GPU's
    // is another size); every device's bounds the element count
    match vb.device().is_cpu() {
        true => check_host_shape("nn", &what, shape, vb.dtype().size_in_bytes())?,
        false => checked_elems("nn", &what, shape).map(|_| ())?,
    }
    Ok(vb.get_with_hints(shape, name, init)?)
}

/// Where a module reads its parameters: its own tensors (captured as
/// constants of the trace), or replacements given by name
/// ([`functional_call`]).
#[derive(Clone, Copy, Default)]
pub struct Params<'a> {
    overrides: Option<&'a BTreeMap<String, Tracer>>,
    lora: Option<&'a Lora>,
}

impl<'a> Params<'a> {
    /// The module's own parameters.
    pub fn own() -> Self {
        Params {
            overrides: None,
            lora: None,
        }
    }

    /// Parameters replaced by `overrides` where a name matches.
    pub fn with(overrides: &'a BTreeMap<String, Tracer>) -> Self {
        Params {
            overrides: Some(overrides),
            lora: None,
        }
    }

    /// These parameters with `lora`'s adapters applied to the layers it
    /// adapts (their `A` and `B` read by name like any parameter).
    pub fn lora(self, lora: &'a Lora) -> Self {
        Params {
            lora: Some(lora),
            ..self
        }
    }

    /// The adapters these parameters apply, if any.
    pub(crate) fn adapters(&self) -> Option<&'a Lora> {
        self.lora
    }

    /// The table `{layer}.weight` of a lookup (an embedding, a position
    /// table, a tied head), as [`Params::get`] gives it; an error naming
    /// it where the adapters target it: LoRA adapts linear layers only,
    /// and an adapter the forward pass never applies would train nothing
    /// while `Lora::merged` still added it to the table.
    pub(crate) fn table(&self, layer: &str, own: &Tensor, like: &Tracer) -> Result<Tracer> {
        if let Some(lora) = self.lora.filter(|l| l.adapts(layer)) {
            let targets = &lora.config().target_modules;
            return Err(Error::Model {
                what: format!("LoraConfig.target_modules {targets:?}"),
                msg: format!(
                    "target the lookup table {layer:?}, which takes no adapter (LoRA here adapts linear \
                     layers only): leave it out of target_modules, or train it whole with modules_to_save"
                ),
            });
        }
        let name = if layer.is_empty() {
            "weight".to_string()
        } else {
            format!("{layer}.weight")
        };
        self.get(&name, own, like)
    }

    /// The parameter `name`: the replacement if one is given (it must have
    /// the parameter's shape, and its dtype or, for a floating parameter,
    /// another floating dtype: a compute copy, as mixed precision reads an
    /// f32 master in bf16), else `own` lifted into `like`'s trace.
    pub fn get(&self, name: &str, own: &Tensor, like: &Tracer) -> Result<Tracer> {
        let copy = |t: &Tracer| t.dtype() == own.dtype() || (t.dtype().is_float() && own.dtype().is_float());
        match self.overrides.and_then(|m| m.get(name)) {
            Some(t) if t.dims() != own.dims() || !copy(t) => Err(Error::Shape {
                op: "parameter",
                shapes: vec![own.dims().to_vec(), t.dims().to_vec()],
                msg: format!("{name:?} replaced by a tensor of another shape or dtype"),
            }),
            Some(t) => Ok(t.clone()),
            None => crate::trace::Operand::to_tracer(own, like),
        }
    }
}

/// A model or layer that runs on symbolic tensors.
pub trait Module {
    /// Runs the module on a batch `x`, reading parameters through `p`.
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer>;

    /// The parameters by full name (`conv1.weight`), in name order.
    fn params(&self) -> BTreeMap<String, Tensor>;

    /// Sets training mode (dropout is active only in training mode).
    fn train(&self, _on: bool) {}

    /// The names of the weights stored `[in, out]` rather than `[out, in]`
    /// (GPT-2's `Conv1D`), so that adapters ([`Lora`]) know which of a
    /// weight's axes is its input. None by default.
    fn in_out_weights(&self) -> Vec<String> {
        Vec::new()
    }

    /// Runs the module with its own parameters.
    fn forward(&self, x: &Tracer) -> Result<Tracer> {
        self.forward_with(&Params::own(), x)
    }

    /// Runs the module eagerly on a concrete batch: traced once per input
    /// signature and train/eval mode, the graph kept in the module's
    /// [`EagerCache`] (see [`Module::eager_cache`]), then run. (candle_nn's
    /// `forward_t(xs, train)` is another thing: here the mode is set with
    /// [`Module::train`].)
    fn forward_eager(&self, x: &Tensor) -> Result<Tensor>
    where
        Self: Sized,
    {
        let f = |x: Tracer| self.forward(&x);
        match self.eager_cache() {
            Some(cache) => cache.call(&f, x),
            None => jit(f).call(x),
        }
    }

    /// Renamed [`Module::forward_eager`] (candle_nn's `forward_t` takes a
    /// train flag; rustc's suggestion, `forward`, traces instead of running).
    #[deprecated(since = "0.2.0", note = "renamed Module::forward_eager (not forward, which traces)")]
    fn forward_t(&self, x: &Tensor) -> Result<Tensor>
    where
        Self: Sized,
    {
        self.forward_eager(x)
    }

    /// Where [`Module::forward_eager`] keeps its traced graphs. The crate's
    /// layers and [`Sequential`] have one; the default, `None`, traces anew
    /// on every call, which is always correct: a cache is only right for a
    /// module whose trace depends on nothing but its input signature and
    /// the train/eval flags it reads.
    fn eager_cache(&self) -> Option<&EagerCache> {
        None
    }
}

/// The traced graphs of one module's [`Module::forward_eager`], per input
/// signature. Cloning gives an empty cache (a clone may be changed).
#[derive(Default, Debug)]
pub struct EagerCache {
    cache: GraphCache,
}

impl Clone for EagerCache {
    fn clone(&self) -> Self {
        EagerCache::default()
    }
}

impl EagerCache {
    fn call<F: Fn(Tracer) -> Result<Tracer>>(&self, f: &F, x: &Tensor) -> Result<Tensor> {
        call_concrete(f, &self.cache, x)
    }

    /// Number of input signatures traced so far.
    pub fn traced_signatures(&self) -> usize {
        self.cache.len()
    }
}

/// Runs `model` with some or all of its parameters replaced by `params` (by
/// name), like `torch.func.functional_call`: the way to differentiate with
/// respect to parameters (`grad(|p, x| functional_call(&m, &p, &x))`) or to
/// run stacked parameters as an ensemble. An unknown name or a wrong shape
/// is an error.
pub fn functional_call<M: Module + ?Sized>(model: &M, params: &BTreeMap<String, Tracer>, x: &Tracer) -> Result<Tracer> {
    let own = model.params();
    for (name, t) in params {
        match own.get(name) {
            None => {
                return Err(Error::Tree {
                    msg: format!(
                        "functional_call: the model has no parameter {name:?} (it has {:?})",
                        own.keys().collect::<Vec<_>>()
                    ),
                })
            }
            Some(o) if o.dims() != t.dims() => {
                return Err(Error::Shape {
                    op: "functional_call",
                    shapes: vec![o.dims().to_vec(), t.dims().to_vec()],
                    msg: format!(
                        "parameter {name:?} is {:?} but was replaced by a tensor of shape {:?}",
                        o.dims(),
                        t.dims()
                    ),
                })
            }
            Some(o) if o.dtype() != t.dtype() => {
                return Err(Error::DType {
                    op: "functional_call",
                    dtypes: vec![o.dtype(), t.dtype()],
                    msg: format!(
                        "parameter {name:?} is {:?} but was replaced by a {:?} tensor",
                        o.dtype(),
                        t.dtype()
                    ),
                })
            }
            Some(_) => {}
        }
    }
    model.forward_with(&Params::with(params), x)
}

/// A module's parameters as the variables of a new `VarMap`, under the
/// module's names: one call from a loaded checkpoint to something
/// `dp`'s trainer and optimisers train. A parameter that already is a
/// variable is shared (training it moves the module too; a checkpoint's
/// model holds variables after `Checkpoint::into_variables`); any other is
/// copied once. Add a new head with `VarBuilder::from_varmap` on the
/// returned map.
///
/// ```
/// use candle_core::{DType, Device};
/// use candle_func::nn::{self, Module};
/// let varmap = candle_nn::VarMap::new();
/// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let body = nn::linear(4, 8, vb.pp("body"))?;
/// let vars = nn::varmap_of(&body)?;
/// let head_vb = candle_nn::VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
/// let _head = nn::linear(8, 2, head_vb.pp("head"))?;
/// let mut names: Vec<String> = vars.data().lock().unwrap().keys().cloned().collect();
/// names.sort();
/// assert_eq!(names, ["body.bias", "body.weight", "head.bias", "head.weight"]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn varmap_of<M: Module + ?Sized>(model: &M) -> Result<candle_nn::VarMap> {
    varmap_from("varmap_of", model.params())
}

/// A new `VarMap` holding `params` as variables (shared where they
/// already are variables).
fn varmap_from(op: &str, params: BTreeMap<String, Tensor>) -> Result<candle_nn::VarMap> {
    let varmap = candle_nn::VarMap::new();
    {
        let mut data = varmap.data().lock().map_err(|_| Error::Tree {
            msg: format!("{op}: the new VarMap's lock is poisoned"),
        })?;
        for (name, t) in params {
            data.insert(name, candle_core::Var::from_tensor(&t)?);
        }
    }
    Ok(varmap)
}

/// [`stack_params`] as the variables of a new `VarMap`: name -> `[M, ...]`,
/// so that `dp`'s optimisers (`Sgd`, `Adam`, `AdamW`, built over this map)
/// train a whole ensemble at once, each model with its own slice of every
/// moment, as `M` optimisers would. The variables are copies: training
/// them leaves the models' own tensors alone ([`unstack_params`] reads the
/// trained ones back).
pub fn stack_vars<M: Module + ?Sized>(models: &[&M]) -> Result<candle_nn::VarMap> {
    varmap_from("stack_vars", stack_params(models)?)
}

/// Stacks the parameters of several models of the same architecture on a new
/// leading axis: name -> `[M, ...]`, for ensembling with `vmap` (like
/// `torch.func.stack_module_state`). The stack is detached from candle's
/// autograd (as `stack_module_state`'s is from PyTorch's).
pub fn stack_params<M: Module + ?Sized>(models: &[&M]) -> Result<BTreeMap<String, Tensor>> {
    let first = models.first().ok_or_else(|| Error::Tree {
        msg: "stack_params: no models".into(),
    })?;
    let names: Vec<String> = first.params().into_keys().collect();
    let all: Vec<BTreeMap<String, Tensor>> = models.iter().map(|m| m.params()).collect();
    let mut out = BTreeMap::new();
    for name in names {
        let mut parts = Vec::with_capacity(all.len());
        for (i, p) in all.iter().enumerate() {
            let t = p.get(&name).ok_or_else(|| Error::Tree {
                msg: format!("stack_params: model {i} has no parameter {name:?}"),
            })?;
            // Detached: the stack is a new value, not a step of candle's
            // autograd, and a training loop's updates of it would otherwise
            // each keep the one before alive.
            parts.push(t.detach());
        }
        let shapes: Vec<Vec<usize>> = parts.iter().map(|t| t.dims().to_vec()).collect();
        if shapes.iter().any(|s| *s != shapes[0]) {
            return Err(Error::Shape {
                op: "stack_params",
                shapes,
                msg: format!("parameter {name:?} differs in shape between models"),
            });
        }
        out.insert(name, Tensor::stack(&parts, 0)?);
    }
    if all.iter().any(|p| p.len() != out.len()) {
        return Err(Error::Tree {
            msg: "stack_params: the models have different parameter names".into(),
        });
    }
    Ok(out)
}

/// The inverse of [`stack_params`]: one name -> tensor map per model.
pub fn unstack_params(stacked: &BTreeMap<String, Tensor>) -> Result<Vec<BTreeMap<String, Tensor>>> {
    let m = stacked
        .values()
        .next()
        .map(|t| t.dims().first().copied().unwrap_or(0))
        .unwrap_or(0);
    let mut out = vec![BTreeMap::new(); m];
    for (name, t) in stacked {
        if t.dims().first() != Some(&m) {
            return Err(Error::Shape {
                op: "unstack_params",
                shapes: vec![t.dims().to_vec()],
                msg: format!("parameter {name:?} does not have {m} models on its leading axis"),
            });
        }
        for (i, p) in out.iter_mut().enumerate() {
            p.insert(name.clone(), t.get(i)?);
        }
    }
    Ok(out)
}

/// Writes `params` into the variables of `varmap` with the same names (the
/// way back from [`unstack_params`] or an optimiser step to a model built
/// from that `VarMap`). Every name must exist with the same shape.
pub fn load_params(varmap: &candle_nn::VarMap, params: &BTreeMap<String, Tensor>) -> Result<()> {
    let data = varmap.data().lock().map_err(|_| Error::Config {
        msg: "load_params: the VarMap's lock is poisoned".into(),
    })?;
    for (name, t) in params {
        let var = data.get(name).ok_or_else(|| Error::Tree {
            msg: format!("load_params: the VarMap has no variable {name:?}"),
        })?;
        if var.dims() != t.dims() {
            return Err(Error::Shape {
                op: "load_params",
                shapes: vec![var.dims().to_vec(), t.dims().to_vec()],
                msg: format!("variable {name:?}"),
            });
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
