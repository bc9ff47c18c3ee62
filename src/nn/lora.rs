//! Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers, as
//! Hugging Face's peft adds them: for each targeted layer `y = x W^T + b +
//! (alpha / r) (dropout(x) A^T) B^T` with `A [r, in]` drawn as peft draws
//! it and `B [out, r]` zero, so that training starts from the base model.
//!
//! The adapters are variables of a `VarMap` named after the layer
//! (`{layer}.lora_A.weight`, `{layer}.lora_B.weight`, peft's names without
//! its `base_model.model.` head and adapter name); a forward pass applies
//! them when its [`Params`] carries the [`Lora`] (`Params::with(&p).lora(&lora)`).
//! The adapter is two products, not the `B A` matrix: a per-example
//! gradient of `A` or `B` is then a product over the sequence like a
//! linear layer's, whose norm the ghost rules take without materialising
//! it.

use super::{Dropout, Module, Params};
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::trace::Tracer;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The settings of [`Lora::add`] (peft's `LoraConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r`, at least 1.
    pub r: usize,
    /// `alpha`: the adapter's output is scaled by `alpha / r`.
    pub alpha: f64,
    /// Dropout on the adapter's input in training mode, in `[0, 1)`.
    pub dropout: f64,
    /// The layers to adapt, as peft names them: a layer is adapted when its
    /// name is a target or ends with `.` and a target (`query`, `value`,
    /// `q_proj`, `v_proj`, `c_attn`, or a full name).
    pub target_modules: Vec<String>,
    /// Prefixes of other parameters that train in full beside the adapters
    /// (peft's `modules_to_save`: a new classification head).
    pub modules_to_save: Vec<String>,
    /// The seed `A` is drawn from.
    pub seed: u64,
    /// The adapters' dtype; `None` (the default) takes the adapted
    /// weight's. `Some(DType::F32)` on a half-precision base keeps the
    /// adapters as f32 masters, for `dp::Precision::Bf16Mixed`.
    pub dtype: Option<DType>,
}

impl LoraConfig {
    /// Rank `r`, scale `alpha / r`, no dropout, on `target_modules`.
    pub fn new<S: AsRef<str>>(r: usize, alpha: f64, target_modules: &[S]) -> LoraConfig {
        LoraConfig {
            r,
            alpha,
            dropout: 0.0,
            target_modules: target_modules.iter().map(|s| s.as_ref().to_string()).collect(),
            modules_to_save: Vec::new(),
            seed: 0,
            dtype: None,
        }
    }

    /// Dropout on the adapters' input in training mode.
    pub fn dropout(mut self, p: f64) -> LoraConfig {
        self.dropout = p;
        self
    }

    /// Parameters (by prefix) that train in full beside the adapters.
    pub fn modules_to_save<S: AsRef<str>>(mut self, prefixes: &[S]) -> LoraConfig {
        self.modules_to_save = prefixes.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    /// The seed `A` is drawn from.
    pub fn seed(mut self, seed: u64) -> LoraConfig {
        self.seed = seed;
        self
    }

    /// The adapters' dtype (default: the adapted weight's).
    pub fn dtype(mut self, dtype: DType) -> LoraConfig {
        self.dtype = Some(dtype);
        self
    }

    fn check(&self) -> Result<()> {
        let bad = |field: &str, msg: String| Error::Model {
            what: format!("LoraConfig.{field}"),
            msg,
        };
        if self.r == 0 {
            return Err(bad("r", "the rank must be at least 1".into()));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(bad("alpha", format!("{} is not finite and > 0", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad("dropout", format!("{} is outside [0, 1)", self.dropout)));
        }
        if self.target_modules.is_empty() {
            return Err(bad("target_modules", "no layer to adapt".into()));
        }
        if let Some(dt) = self.dtype.filter(|dt| !dt.is_float()) {
            return Err(bad("dtype", format!("{dt:?} is not a floating-point dtype")));
        }
        Ok(())
    }
}

/// One layer's adapter: `A [r, in]`, `B [out, r]`, and whether the base
/// weight is stored `[in, out]` (GPT-2's `Conv1D`).
struct Adapter {
    a: Var,
    b: Var,
    in_out: bool,
}

/// Adapters added to a model's linear layers (see the module docs).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_func::nn::{self, Lora, LoraConfig, Module, Params};
/// use candle_func::Tracer;
/// let dev = Device::Cpu;
/// let base = candle_nn::VarMap::new();
/// let vb = candle_nn::VarBuilder::from_varmap(&base, DType::F32, &dev);
/// let layer = nn::linear(4, 3, vb.pp("attn.query"))?;
/// let varmap = nn::varmap_of(&layer)?;
/// let lora = Lora::add(&layer, &varmap, LoraConfig::new(2, 4.0, &["query"]))?;
/// assert_eq!(lora.layers(), ["attn.query"]);
/// // B starts at zero: the adapted layer is the base layer
/// let x = Tensor::randn(0f32, 1., (5, 4), &dev)?;
/// let f = |x: Tracer| layer.forward_with(&Params::own().lora(&lora), &x);
/// let adapted = candle_func::jit(f).call(&x)?;
/// let plain = layer.forward_eager(&x)?;
/// assert_eq!(adapted.to_vec2::<f32>()?, plain.to_vec2::<f32>()?);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub struct Lora {
    config: LoraConfig,
    adapters: BTreeMap<String, Adapter>,
    dropout: Dropout,
}

/// Whether peft would adapt the layer `name` for `target`.
fn targets(name: &str, target: &str) -> bool {
    name == target || name.strip_suffix(target).is_some_and(|h| h.ends_with('.'))
}

/// The variables of `varmap`, locked; a poisoned lock is an error naming
/// `what` asked.
fn lock<'a>(varmap: &'a VarMap, what: &str) -> Result<std::sync::MutexGuard<'a, HashMap<String, Var>>> {
    varmap.data().lock().map_err(|_| Error::Model {
        what: what.into(),
        msg: "the VarMap's lock is poisoned".into(),
    })
}

impl Lora {
    /// Adapters on every linear layer of `model` that `config` targets,
    /// added to `varmap` (which should hold the model's parameters, say
    /// from [`super::varmap_of`], and any new head). An error names a
    /// target that matches no layer, a `modules_to_save` prefix that holds
    /// no variable of the map, or an adapter the map already holds.
    pub fn add<M: Module + ?Sized>(model: &M, varmap: &VarMap, config: LoraConfig) -> Result<Lora> {
        config.check()?;
        let params = model.params();
        let in_out = model.in_out_weights();
        let layers: Vec<(&str, &Tensor)> = params
            .iter()
            .filter_map(|(k, t)| Some((k.strip_suffix(".weight")?, t)))
            .filter(|(_, t)| t.rank() == 2)
            .collect();
        for target in &config.target_modules {
            if !layers.iter().any(|(l, _)| targets(l, target)) {
                let shown: Vec<&str> = layers.iter().map(|l| l.0).take(12).collect();
                return Err(Error::Model {
                    what: format!("LoraConfig.target_modules {target:?}"),
                    msg: format!("matches no linear layer of the model (layers: {shown:?}..)"),
                });
            }
        }
        let mut data = lock(varmap, "Lora::add")?;
        // a saved module may be new (a head built on the map), so the map
        // is where it must be
        for keep in &config.modules_to_save {
            if !data.keys().any(|k| crate::transforms::tree::under(k, keep)) {
                return Err(Error::Model {
                    what: format!("LoraConfig.modules_to_save {keep:?}"),
                    msg: "holds no variable of the VarMap".into(),
                });
            }
        }
        let mut rng = Rng::seeded(config.seed);
        let mut adapters = BTreeMap::new();
        for (layer, w) in layers {
            if !config.target_modules.iter().any(|t| targets(layer, t)) {
                continue;
            }
            let flipped = in_out.iter().any(|n| n.strip_suffix(".weight") == Some(layer));
            let (out_dim, in_dim) = match (w.dims2()?, flipped) {
                ((i, o), true) => (o, i),
                ((o, i), false) => (o, i),
            };
            let (a_name, b_name) = (format!("{layer}.lora_A.weight"), format!("{layer}.lora_B.weight"));
            if data.contains_key(&a_name) || data.contains_key(&b_name) {
                return Err(Error::Model {
                    what: format!("Lora::add {layer:?}"),
                    msg: "the VarMap already holds this layer's adapter".into(),
                });
            }
            // peft's kaiming_uniform_(a = sqrt 5): U(-1/sqrt(in), 1/sqrt(in))
            let bound = 1.0 / (in_dim as f64).sqrt();
            let vals: Vec<f64> = (0..config.r * in_dim)
                .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
                .collect();
            let dt = config.dtype.unwrap_or(w.dtype());
            let a = Tensor::from_vec(vals, (config.r, in_dim), w.device())?.to_dtype(dt)?;
            let a = Var::from_tensor(&a)?;
            let b = Var::zeros((out_dim, config.r), dt, w.device())?;
            data.insert(a_name, a.clone());
            data.insert(b_name, b.clone());
            adapters.insert(layer.to_string(), Adapter { a, b, in_out: flipped });
        }
        Ok(Lora {
            dropout: Dropout::new(config.dropout),
            config,
            adapters,
        })
    }

    /// The settings.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The adapters' scale, `alpha / r`.
    pub fn scaling(&self) -> f64 {
        self.config.alpha / self.config.r as f64
    }

    /// The adapted layers' names, sorted.
    pub fn layers(&self) -> Vec<&str> {
        self.adapters.keys().map(String::as_str).collect()
    }

    /// The prefixes of what trains: every adapter and `modules_to_save`
    /// (for `dp::Trainable::prefixes`).
    pub fn trainable_prefixes(&self) -> Vec<String> {
        let adapters = self
            .adapters
            .keys()
            .flat_map(|l| [format!("{l}.lora_A"), format!("{l}.lora_B")]);
        adapters.chain(self.config.modules_to_save.iter().cloned()).collect()
    }

    /// What trains, by name, from `varmap` (the map [`Lora::add`] added the
    /// adapters to): every adapter's `A` and `B` and every variable under
    /// `modules_to_save`. Differentiate with respect to these alone and the
    /// frozen weights stay constants of the trace (read by
    /// [`Params::with`] from the model itself), so a step computes no
    /// gradient for them — a non-private LoRA training step:
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_func::nn::{self, Lora, LoraConfig, Module, Params};
    /// use candle_func::{grad, Tracer};
    /// use candle_func::optim::{Optimizer, Sgd};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use std::collections::BTreeMap;
    /// let base = VarMap::new();
    /// let model = nn::linear(4, 3, VarBuilder::from_varmap(&base, DType::F32, &Device::Cpu).pp("proj"))?;
    /// let varmap = nn::varmap_of(&model)?;
    /// let lora = Lora::add(&model, &varmap, LoraConfig::new(2, 4.0, &["proj"]))?;
    /// let loss = |p: BTreeMap<String, Tracer>, x: Tracer| {
    ///     model.forward_with(&Params::with(&p).lora(&lora), &x)?.sqr()?.mean_all()
    /// };
    /// let step = grad(loss);
    /// let mut opt = Sgd::new(&varmap, 0.1, 0.0)?;
    /// // the map's tensors share the variables' storage: one map for every step
    /// let trainable = lora.trainable_params(&varmap)?;
    /// let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
    /// let w = model.params()["proj.weight"].to_vec2::<f32>()?;
    /// for _ in 0..3 {
    ///     let grads = step.call((&trainable, &x))?; // proj.lora_A.weight, proj.lora_B.weight
    ///     opt.step(&grads)?;
    /// }
    /// assert_eq!(model.params()["proj.weight"].to_vec2::<f32>()?, w); // frozen
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn trainable_params(&self, varmap: &VarMap) -> Result<BTreeMap<String, Tensor>> {
        let data = lock(varmap, "Lora::trainable_params")?;
        let prefixes = self.trainable_prefixes();
        let mut out = BTreeMap::new();
        for (name, var) in data.iter() {
            if prefixes.iter().any(|p| crate::transforms::tree::under(name, p)) {
                out.insert(name.clone(), var.as_tensor().clone());
            }
        }
        for layer in self.adapters.keys() {
            for half in ["lora_A", "lora_B"] {
                let name = format!("{layer}.{half}.weight");
                if !out.contains_key(&name) {
                    return Err(Error::Model {
                        what: "Lora::trainable_params".into(),
                        msg: format!("the VarMap holds no {name:?}: pass the map the adapters were added to"),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Training mode (the adapters' dropout is active only in it).
    pub fn train(&self, on: bool) {
        self.dropout.train(on);
    }

    /// Whether the layer `layer` (its weight's name without `.weight`) has
    /// an adapter.
    pub(crate) fn adapts(&self, layer: &str) -> bool {
        self.adapters.contains_key(layer)
    }

    /// The adapter's term for the layer `layer` on `x [.., in]`, if it has
    /// one: `(alpha / r) (dropout(x) A^T) B^T`, `[.., out]`.
    pub(crate) fn delta(&self, p: &Params, layer: &str, x: &Tracer) -> Result<Option<Tracer>> {
        let Some(ad) = self.adapters.get(layer) else {
            return Ok(None);
        };
        let a = p.get(&format!("{layer}.lora_A.weight"), ad.a.as_tensor(), x)?;
        let b = p.get(&format!("{layer}.lora_B.weight"), ad.b.as_tensor(), x)?;
        let x = self.dropout.forward_with(p, x)?;
        // two products, never B A: .. in @ in r -> .. r @ r out -> .. out
        let h = x.matmul(&a.t()?)?;
        Ok(Some(h.matmul(&b.t()?)?.affine(self.scaling(), 0.0)?))
    }

    /// Every variable of `varmap` but the adapters, with each adapted
    /// weight merged, `W + (alpha / r) B A` (in the weight's own layout):
    /// the fine-tuned model under the base model's names, for
    /// [`Lora::save_merged`] or a model's loader.
    pub fn merged(&self, varmap: &VarMap) -> Result<BTreeMap<String, Tensor>> {
        let data = lock(varmap, "Lora::merged")?;
        // every adapted layer's base weight must be there to merge into:
        // a map without them would give a model without its adapters
        if let Some(layer) = self
            .adapters
            .keys()
            .find(|l| !data.contains_key(&format!("{l}.weight")))
        {
            return Err(Error::Model {
                what: format!("weight \"{layer}.weight\""),
                msg: "Lora::merged: the VarMap lacks this adapted layer's base weight (merge into the map \
                      Lora::add was given)"
                    .into(),
            });
        }
        let mut out = BTreeMap::new();
        for (name, var) in data.iter() {
            if name.contains(".lora_A.") || name.contains(".lora_B.") {
                continue;
            }
            let w = var.as_tensor();
            let layer = name.strip_suffix(".weight").and_then(|l| self.adapters.get(l));
            let merged = match layer {
                None => w.copy()?,
                Some(ad) => {
                    // in f32 at least: f64 weights keep their precision,
                    // f16/bf16 ones are rounded once, at the end
                    let dt = if w.dtype() == DType::F64 {
                        DType::F64
                    } else {
                        DType::F32
                    };
                    let (a, b) = (data_of(&data, name, "lora_A", dt)?, data_of(&data, name, "lora_B", dt)?);
                    let ba = (b.matmul(&a)? * self.scaling())?; // out in
                    let ba = if ad.in_out { ba.t()? } else { ba };
                    (w.to_dtype(dt)? + ba)?.to_dtype(w.dtype())?
                }
            };
            out.insert(name.clone(), merged);
        }
        Ok(out)
    }

    /// [`Lora::merged`] saved as one safetensors file.
    pub fn save_merged(&self, varmap: &VarMap, path: impl AsRef<Path>) -> Result<()> {
        let merged: HashMap<String, Tensor> = self.merged(varmap)?.into_iter().collect();
        candle_core::safetensors::save(&merged, path.as_ref())?;
        Ok(())
    }
}

/// The adapter tensor `part` (`lora_A` or `lora_B`) of the weight `name`,
/// as `dtype`.
fn data_of(data: &HashMap<String, Var>, name: &str, part: &str, dtype: DType) -> Result<Tensor> {
    let layer = name.strip_suffix(".weight").unwrap_or(name);
    let key = format!("{layer}.{part}.weight");
    let var = data.get(&key).ok_or_else(|| Error::Model {
        what: "Lora::merged".into(),
        msg: format!("the VarMap has no {key:?}"),
    })?;
    Ok(var.as_tensor().to_dtype(dtype)?)
}
