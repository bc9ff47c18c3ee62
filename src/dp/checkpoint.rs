//! A private trainer's whole state in one folder, so that a long run can
//! stop and resume: `params.safetensors` (the trainable parameters),
//! `optimizer.safetensors` (its moments) and `state.json` (the step count,
//! the accountant's history, the optimiser's numbers, adaptive clipping's
//! bound, a seeded generator's position, and what the run was: its
//! parameters' names and shapes, its data set's shapes, `q`, `σ`, the
//! physical batch). `state.json` is written last, so a folder without it
//! is an interrupted save.
//!
//! An OS-keyed generator is never saved: a resumed run draws from a fresh
//! OS key. That is sound because DP-SGD's guarantee needs each step's
//! noise to be fresh and secret, not to come from one stream: the
//! accountant composes the steps whatever generator drew them. Saving the
//! key would be unsound: ChaCha seeks backwards as easily as forwards, so
//! whoever read the checkpoint could recompute every noise draw already
//! released and subtract it.

use super::accountant::Accountant;
use super::optim::{Optimizer, OptimizerState};
use super::rng::Rng;
use super::trainer::PrivateTrainer;
use crate::error::{Error, Result};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

const FORMAT: u64 = 1;

fn bad(msg: impl Into<String>) -> Error {
    Error::Checkpoint {
        what: "PrivateTrainer::resume",
        msg: msg.into(),
    }
}

fn io(what: &'static str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        what,
        msg: format!("{}: {e}", path.display()),
    }
}

/// What the run is, given its trainable parameters' current values: a
/// resumed run must be the same one.
fn identity<F, O, S>(t: &PrivateTrainer<F, O, S>, params: &BTreeMap<String, Tensor>) -> Value {
    let params: Vec<Value> = params
        .iter()
        .map(|(k, v)| json!([k, v.dims(), format!("{:?}", v.dtype())]))
        .collect();
    let data: Vec<Value> = t.data.leaves.iter().map(|(k, v)| json!([k, v.dims()])).collect();
    json!({
        "trainable": params,
        "examples": data,
        "sample_rate": t.sample_rate,
        "noise_multiplier": t.noise_multiplier,
        "physical_batch": t.physical,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if s.len() != 64 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Everything read back from a folder, checked, before any of it is used.
struct Restored {
    params: BTreeMap<String, Tensor>,
    optimizer: OptimizerState,
    accountant: Accountant,
    rng: Option<Rng>,
    steps: u64,
    bound: Option<f64>,
}

impl<F, O: Optimizer, S> PrivateTrainer<F, O, S> {
    /// Saves the whole state to the folder `dir` (created if missing,
    /// files in it replaced). An error when the optimiser cannot save its
    /// state or a file cannot be written.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        const WHAT: &str = "PrivateTrainer::save";
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| io(WHAT, dir, e))?;
        let state_path = dir.join("state.json");
        // an interrupted save leaves no state.json to resume from
        if state_path.exists() {
            std::fs::remove_file(&state_path).map_err(|e| io(WHAT, &state_path, e))?;
        }
        let current = self.params_now()?;
        let params: HashMap<String, Tensor> = current.clone().into_iter().collect();
        candle_core::safetensors::save(&params, dir.join("params.safetensors"))?;
        let opt = self.optimizer.state()?;
        let moments: HashMap<String, Tensor> = opt.tensors.clone().into_iter().collect();
        candle_core::safetensors::save(&moments, dir.join("optimizer.safetensors"))?;
        let accountant: Value = serde_json::from_str(&self.accountant.to_json())
            .map_err(|e| Error::internal(WHAT, format!("the accountant's JSON: {e}")))?;
        let rng = self
            .rng
            .state()
            .map(|(key, stream, word)| json!({"key": hex(&key), "stream": stream, "word_pos": word.to_string()}));
        let state = json!({
            "format": FORMAT,
            "run": identity(self, &current),
            "steps": self.steps,
            "accountant": accountant,
            "optimizer": {"kind": opt.kind, "scalars": opt.scalars},
            "rng": rng,
            "clip_bound": self.adaptive.as_ref().map(|a| a.bound),
        });
        let text = serde_json::to_string_pretty(&state).map_err(|e| Error::internal(WHAT, e.to_string()))?;
        std::fs::write(&state_path, text).map_err(|e| io(WHAT, &state_path, e))
    }

    /// Restores the state [`PrivateTrainer::save`] wrote into this trainer,
    /// built as the saved one was (same loss, data, parameters and
    /// configuration): all of it, or nothing and an error naming what is
    /// missing, corrupt or different. With a seeded generator the resumed
    /// run continues the saved one's stream, so that it ends bit-identical
    /// to a run that never stopped; an OS-keyed one keeps its fresh key
    /// (see the module docs).
    pub fn resume(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let r = self.read(dir.as_ref())?;
        // the optimiser checks its state whole before taking any of it; the
        // parameters were checked by `read`
        self.optimizer.load_state(&r.optimizer)?;
        for k in &self.trainable {
            self.set_param(k, &r.params[k])?;
        }
        self.accountant = r.accountant;
        if let Some(rng) = r.rng {
            self.rng = rng;
        }
        if let (Some(a), Some(c)) = (&mut self.adaptive, r.bound) {
            a.bound = c;
        }
        self.steps = r.steps;
        Ok(())
    }

    /// Reads and checks a saved folder against this trainer.
    fn read(&self, dir: &Path) -> Result<Restored> {
        let path = dir.join("state.json");
        let text = std::fs::read_to_string(&path).map_err(|e| io("PrivateTrainer::resume", &path, e))?;
        let state: Value = serde_json::from_str(&text).map_err(|e| bad(format!("state.json: {e}")))?;
        if state["format"].as_u64() != Some(FORMAT) {
            return Err(bad(format!(
                "state.json has format {}, expected {FORMAT}",
                state["format"]
            )));
        }
        let current = self.params_now()?;
        let now = identity(self, &current);
        for field in [
            "trainable",
            "examples",
            "sample_rate",
            "noise_multiplier",
            "physical_batch",
        ] {
            if state["run"][field] != now[field] {
                let msg = format!("{field} was {} when saved, is {} now", state["run"][field], now[field]);
                return Err(bad(msg));
            }
        }
        let device = self.data.leaves[0].1.device().clone();
        let params = load_tensors(&dir.join("params.safetensors"), &device)?;
        for (k, t) in &current {
            match params.get(k) {
                Some(p) if p.dims() == t.dims() && p.dtype() == t.dtype() => {}
                _ => {
                    return Err(bad(format!(
                        "params.safetensors lacks {k:?} as {:?} {:?}",
                        t.dims(),
                        t.dtype()
                    )))
                }
            }
        }
        let opt = &state["optimizer"];
        let scalars = opt["scalars"]
            .as_object()
            .ok_or_else(|| bad("state.json: optimizer.scalars is not an object"))?
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    v.as_f64().ok_or_else(|| bad(format!("optimizer scalar {k:?}")))?,
                ))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        let optimizer = OptimizerState {
            kind: opt["kind"].as_str().unwrap_or_default().to_string(),
            tensors: load_tensors(&dir.join("optimizer.safetensors"), &device)?,
            scalars,
        };
        let accountant = Accountant::from_json(&state["accountant"].to_string())?;
        let steps = state["steps"]
            .as_u64()
            .ok_or_else(|| bad("state.json: steps is not a count"))?;
        let rng = match &state["rng"] {
            Value::Null => None,
            r => Some(rng_of(r).ok_or_else(|| bad(format!("state.json: rng {r} is not a generator's state")))?),
        };
        let bound = match (&self.adaptive, &state["clip_bound"]) {
            (None, Value::Null) => None,
            (Some(_), Value::Number(c)) => c.as_f64().filter(|c| c.is_finite() && *c > 0.0),
            (_, v) => return Err(bad(format!("clip_bound {v} does not fit this trainer's clipping"))),
        };
        if self.adaptive.is_some() && bound.is_none() {
            return Err(bad("clip_bound is not a positive number"));
        }
        Ok(Restored {
            params,
            optimizer,
            accountant,
            rng,
            steps,
            bound,
        })
    }
}

fn load_tensors(path: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    if !path.exists() {
        return Err(bad(format!("{} is missing", path.display())));
    }
    let t = candle_core::safetensors::load(path, device).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    Ok(t.into_iter().collect())
}

fn rng_of(r: &Value) -> Option<Rng> {
    let key = unhex(r["key"].as_str()?)?;
    let stream = r["stream"].as_u64()?;
    let word: u128 = r["word_pos"].as_str()?.parse().ok()?;
    Some(Rng::from_state((key, stream, word)))
}
