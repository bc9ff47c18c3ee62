//! A Hugging Face checkpoint folder as it is laid out on the Hub:
//! `config.json` and the weights, one `model.safetensors` or several shards
//! listed by `model.safetensors.index.json`.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use serde::de::DeserializeOwned;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A checkpoint folder's configuration and weights, read once; the models'
/// `load` functions build from it. Weights are converted to the dtype
/// asked for when a model takes them (a bf16 or f16 checkpoint loads as
/// f32, say).
pub struct Checkpoint {
    dir: PathBuf,
    config: serde_json::Value,
    tensors: HashMap<String, Tensor>,
    dtype: DType,
    device: Device,
    /// The weights models built from this have read ([`Checkpoint::read_names`]).
    taken: Mutex<BTreeSet<String>>,
}

fn bad(what: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::Model {
        what: what.into(),
        msg: msg.into(),
    }
}

impl Checkpoint {
    /// Reads `dir/config.json` and the weights in `dir` onto `device`,
    /// to be used as `dtype` (f32, f64, f16 or bf16).
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Checkpoint> {
        Self::read(dir.as_ref(), dtype, device, false)
    }

    /// [`Checkpoint::load`] then [`Checkpoint::into_variables`], with each
    /// weight stored in the compute dtype read straight into its variable:
    /// the weights are held once while they load, not twice. How to load a
    /// model to train.
    pub fn load_variables(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Checkpoint> {
        Self::read(dir.as_ref(), dtype, device, true)
    }

    /// Reads a folder, the float weights as variables where `vars`. Each
    /// file is read a tensor at a time (`weights`), never whole.
    fn read(dir: &Path, dtype: DType, device: &Device, vars: bool) -> Result<Checkpoint> {
        let dir = dir.to_path_buf();
        if !dtype.is_float() {
            return Err(bad(
                format!("checkpoint {}", dir.display()),
                format!("a model's dtype must be a float type, got {dtype:?}"),
            ));
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| bad(config_path.display().to_string(), format!("cannot be read: {e}")))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(config_path.display().to_string(), format!("is not JSON: {e}")))?;
        if !config.is_object() {
            return Err(bad(config_path.display().to_string(), "is not a JSON object"));
        }
        let mut tensors = HashMap::new();
        let (files, index) = weight_files(&dir)?;
        for file in files {
            let read = super::weights::read(&file, device, vars.then_some(dtype))?;
            if let Some(index) = &index {
                owned(index, &file, &read)?;
            }
            tensors.extend(read);
        }
        // A name the index lists that no shard holds is not an error here:
        // converted Hub checkpoints list tied weights (`lm_head.weight`)
        // their shards dropped; `weight` names one a model really needs.
        Ok(Checkpoint {
            dir,
            config,
            tensors,
            dtype,
            device: device.clone(),
            taken: Mutex::default(),
        })
    }

    /// Every weight as a training variable, in the compute dtype (each
    /// copied once, the original dropped): a model built from this holds
    /// variables, so [`crate::nn::varmap_of`] on it shares them instead of
    /// copying, and a trainer's `VarMap` and the model are one copy of the
    /// weights in memory. Training then moves the model's own weights.
    /// [`Checkpoint::load_variables`] does this without the copy.
    pub fn into_variables(mut self) -> Result<Checkpoint> {
        for t in self.tensors.values_mut() {
            if t.dtype().is_float() && !(t.is_variable() && t.dtype() == self.dtype) {
                *t = candle_core::Var::from_tensor(&t.to_dtype(self.dtype)?)?
                    .as_tensor()
                    .clone();
            }
        }
        Ok(self)
    }

    /// The folder this was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json` as it was read.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// The dtype the models built from this checkpoint compute in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the weights were read onto.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `config.json`'s `model_type` (`bert`, `gpt2`, `llama`, ...).
    pub fn model_type(&self) -> Result<String> {
        match self.config.get("model_type") {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(self.field_error("model_type", format!("expected a string, got {v}"))),
            None => Err(self.field_error("model_type", "missing")),
        }
    }

    /// The names of the weights in the folder, sorted.
    pub fn names(&self) -> Vec<&str> {
        let set: BTreeSet<&str> = self.tensors.keys().map(String::as_str).collect();
        set.into_iter().collect()
    }

    /// `config.json` parsed into `T`; an error names the field that failed.
    pub fn parse_config<T: DeserializeOwned>(&self, model: &str) -> Result<T> {
        serde_path_to_error::deserialize(self.config.clone()).map_err(|e| {
            let field = e.path().to_string();
            bad(format!("{model} config.json field \"{field}\""), e.inner().to_string())
        })
    }

    /// An error about config field `field`.
    pub(crate) fn field_error(&self, field: &str, msg: impl Into<String>) -> Error {
        bad(
            format!("{} field \"{field}\"", self.dir.join("config.json").display()),
            msg,
        )
    }

    /// The weights the models built from this checkpoint have read
    /// through [`Checkpoint::weight`], sorted: for a model, its parameters
    /// (`Module::params()` holds exactly these; `tests/hf_models.rs`
    /// checks it for every case, so a layer a model forgets to list is
    /// caught).
    pub fn read_names(&self) -> Vec<String> {
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The folder's float weights no model built from it has read
    /// (transformers' "weights of the checkpoint not used"): a pooler a
    /// model without one leaves, or a layer a model skipped.
    pub fn unread(&self) -> Vec<&str> {
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<&str> = (self.tensors.iter())
            .filter(|(k, t)| t.dtype().is_float() && !taken.contains(*k))
            .map(|(k, _)| k.as_str())
            .collect();
        out.sort_unstable();
        out
    }

    /// Whether the folder holds weight `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Weight `name`, which the configuration says is `shape`, in the
    /// checkpoint's compute dtype.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.stored(name, Some(shape))?.to_dtype(self.dtype)?;
        self.mark_read(name);
        Ok(t)
    }

    /// Float weight `name` as stored, its shape checked against `shape`
    /// when given.
    pub(crate) fn stored(&self, name: &str, shape: Option<&[usize]>) -> Result<&Tensor> {
        let implied = shape.map_or(String::new(), |s| format!(" (the configuration implies {s:?})"));
        let t = self.tensors.get(name).ok_or_else(|| {
            bad(
                format!("weight \"{name}\""),
                format!(
                    "missing from {}{implied}; it holds {} weights",
                    self.dir.display(),
                    self.tensors.len()
                ),
            )
        })?;
        if let Some(shape) = shape.filter(|s| t.dims() != *s) {
            return Err(bad(
                format!("weight \"{name}\""),
                format!(
                    "is {:?} in the checkpoint but the configuration implies {shape:?}",
                    t.dims()
                ),
            ));
        }
        if !t.dtype().is_float() {
            return Err(bad(
                format!("weight \"{name}\""),
                format!("is {:?}, not a float tensor", t.dtype()),
            ));
        }
        Ok(t)
    }

    /// Counts weight `name` as read by a model ([`Checkpoint::read_names`]).
    pub(crate) fn mark_read(&self, name: &str) {
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
    }
}

/// A sharded checkpoint's index: which shard holds each weight.
struct Index {
    path: PathBuf,
    map: HashMap<String, String>,
}

/// Every weight of the shard `file` is one the index places in it: a
/// weight in two shards, or in one the index does not name for it, would
/// otherwise load from whichever shard was read last.
fn owned(index: &Index, file: &Path, read: &HashMap<String, Tensor>) -> Result<()> {
    let shard = file
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    for name in read.keys() {
        match index.map.get(name) {
            Some(own) if *own == shard => {}
            Some(own) => {
                return Err(bad(
                    format!("weight \"{name}\""),
                    format!("is in {shard}, but {} places it in {own}", index.path.display()),
                ))
            }
            None => {
                return Err(bad(
                    format!("weight \"{name}\""),
                    format!("is in {shard}, but {} does not list it", index.path.display()),
                ))
            }
        }
    }
    Ok(())
}

/// `model.safetensors`, or the shards an index lists (each once) with the
/// index.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<Index>)> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|_| {
        bad(
            format!("checkpoint {}", dir.display()),
            "holds neither model.safetensors nor model.safetensors.index.json",
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(index.display().to_string(), format!("is not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad(index.display().to_string(), "has no \"weight_map\" object"))?;
    let mut files = BTreeSet::new();
    let mut owners = HashMap::with_capacity(map.len());
    for (name, file) in map {
        let f = file.as_str().ok_or_else(|| {
            bad(
                index.display().to_string(),
                format!("weight \"{name}\" maps to {file}, not a file name"),
            )
        })?;
        // a shard is a file of this folder, never a path out of it
        if f.contains('/') || f.contains('\\') || f == ".." {
            return Err(bad(
                index.display().to_string(),
                format!("shard \"{f}\" is not a file name"),
            ));
        }
        files.insert(dir.join(f));
        owners.insert(name.clone(), f.to_string());
    }
    if files.is_empty() {
        return Err(bad(index.display().to_string(), "lists no shards"));
    }
    let index = Index {
        path: index,
        map: owners,
    };
    Ok((files.into_iter().collect(), Some(index)))
}
