//! A private trainer's whole state in one folder, so that a long run can
//! stop and resume: `params.safetensors` (the trainable parameters),
//! `optimizer.safetensors` (its moments), `state.json` (the step count,
//! the accountant's history, the optimiser's numbers, adaptive clipping's
//! bound, a seeded generator's position, and what the run was: its
//! parameters' names and shapes, its data set's shapes, `q`, `σ`, the
//! physical batch) and `checksums.sha256` (every other file's SHA-256).
//!
//! **Atomic.** A save writes the new folder beside the old one, flushes
//! every file to disk, and renames it into place in one step (Linux's
//! `renameat2` exchange; elsewhere two renames, between which the target
//! is briefly absent while both folders are whole beside it: `resume`
//! names the one moved aside if a kill lands there). A save that fails
//! half-way (a full disk, a kill) leaves the previous checkpoint as it
//! was, so a DP run never has to start again and spend its budget twice.
//! The folder is the checkpoint's alone: one holding other files is not
//! replaced; its parent must be writable (a mount point cannot be
//! replaced: save into a folder inside the volume).
//!
//! **Checked.** `resume` verifies the digest before reading anything (a
//! folder of the first format, which had none, is read with a warning),
//! so a file cut short or changed after the save is an error naming it;
//! then
//! every step of the saved accountant history must be one this trainer
//! takes (its `σ` and `q`) and their count the saved step count. The ε
//! the resumed trainer reports is recomputed from that history by the
//! trainer's own accountant (its mechanism and error band, whatever the
//! saved run's were).
//!
//! **Not a security boundary.** The digest catches accidents, not an
//! adversary: whoever can write the folder can rewrite the digest with
//! it, and so can make a run that spent ε = 4 report less (by saving a
//! shorter history with matching step counts). Keep checkpoints where
//! only the training job can write.
//!
//! **Keys.** An OS-keyed generator is never saved, and an OS-keyed
//! trainer never adopts a saved key: it keeps its fresh OS key and takes
//! the saved step count, accountant and moments. That is sound because
//! DP-SGD's guarantee needs each step's noise to be fresh and secret, not
//! to come from one stream: the accountant composes the steps whatever
//! generator drew them. Saving the key would be unsound: ChaCha seeks
//! backwards as easily as forwards, so whoever read the checkpoint could
//! recompute every noise draw already released and subtract it. A seeded
//! trainer (reproducible, not private) continues a seeded run's stream,
//! with a warning; resuming an OS-keyed run with a seeded generator is an
//! error, since it would make the rest of a private run predictable.

mod folder;
#[cfg(test)]
mod tests;

use super::accountant::Accountant;
use super::trainer::PrivateTrainer;
use crate::error::{Error, Result};
use crate::optim::{Optimizer, OptimizerState};
use crate::rng::Rng;
use crate::transforms::settings::warn_once;
use candle_core::{Device, Tensor};
use folder::{hex, io};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The folder's format: 2 added the digest; 1 is still read.
const FORMAT: u64 = 2;

fn bad(msg: impl Into<String>) -> Error {
    Error::Checkpoint {
        what: "PrivateTrainer::resume",
        msg: msg.into(),
    }
}

/// What the run is, given its trainable parameters' current values: a
/// resumed run must be the same one.
fn identity<F, O, S>(t: &PrivateTrainer<F, O, S>, params: &BTreeMap<String, Tensor>) -> Value {
    let params: Vec<Value> = params
        .iter()
        .map(|(k, v)| json!([k, v.dims(), format!("{:?}", v.dtype())]))
        .collect();
    let data: Vec<Value> = t.setup.data.dims().into_iter().map(|(k, d)| json!([k, d])).collect();
    json!({
        "trainable": params,
        "examples": data,
        "sample_rate": t.setup.sample_rate,
        "noise_multiplier": t.setup.noise_multiplier,
        "physical_batch": t.setup.physical,
        "users": t.setup.data.users.as_ref().map(|u| u.describe()),
    })
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    // hex digits only (`from_str_radix` takes a leading `+` too)
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
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
    rng: Keying,
    steps: u64,
    bound: Option<f64>,
    /// The saved run's physical batch.
    physical: usize,
}

/// The files of a checkpoint folder besides the digest.
const FILES: [&str; 3] = ["params.safetensors", "optimizer.safetensors", "state.json"];

/// How a saved run's generator and this trainer's combine on resume.
enum Keying {
    /// Keep this trainer's own generator (OS-keyed).
    Keep,
    /// Continue the saved seeded stream (a seeded trainer).
    Adopt(Box<Rng>),
}

impl<F, O: Optimizer, S> PrivateTrainer<F, O, S> {
    /// Saves the whole state to the folder `dir`, atomically: the files are
    /// written to a new folder beside it, flushed to disk, and that folder
    /// takes `dir`'s place in one rename, so a save that fails half-way
    /// leaves the previous checkpoint in `dir` whole and resumable (see the
    /// module docs). `dir`'s parent is created if missing. An error when
    /// the optimiser cannot save its state, a file cannot be written, or
    /// `dir` holds files that are not a checkpoint's (the folder is
    /// replaced whole, so it must be the checkpoint's own).
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        const WHAT: &str = "PrivateTrainer::save";
        let dir = dir.as_ref();
        folder::check_replaceable(dir, &FILES, WHAT)?;
        // a history this trainer's own resume would refuse (one given by
        // set_accountant) is refused before anything is written
        self.check_history(&self.setup.accountant, self.steps, WHAT)?;
        // everything read from the trainer before anything is written
        let current = self.params_now()?;
        let opt = self.optimizer.state()?;
        let state = self.state_json(&current, &opt)?;
        let mut staged = folder::Staged::new(dir, WHAT)?;
        staged.file(FILES[0], WHAT, |p| save_tensors(&current, p))?;
        staged.file(FILES[1], WHAT, |p| save_tensors(&opt.tensors, p))?;
        staged.file(FILES[2], WHAT, |p| {
            std::fs::write(p, &state).map_err(|e| io(WHAT, p, e))
        })?;
        staged.publish(WHAT)
    }

    /// `state.json`'s text.
    fn state_json(&self, current: &BTreeMap<String, Tensor>, opt: &OptimizerState) -> Result<String> {
        const WHAT: &str = "PrivateTrainer::save";
        let accountant: Value = serde_json::from_str(&self.setup.accountant.to_json())
            .map_err(|e| Error::internal(WHAT, format!("the accountant's JSON: {e}")))?;
        let rng = self
            .setup
            .rng
            .state()
            .map(|(key, stream, word)| json!({"key": hex(&key), "stream": stream, "word_pos": word.to_string()}));
        let state = json!({
            "format": FORMAT,
            "run": identity(self, current),
            "steps": self.steps,
            "accountant": accountant,
            "optimizer": {"kind": opt.kind, "scalars": opt.scalars},
            "rng": rng,
            "clip_bound": self.setup.adaptive.as_ref().map(|a| a.bound),
        });
        serde_json::to_string_pretty(&state).map_err(|e| Error::internal(WHAT, e.to_string()))
    }

    /// Restores the state [`PrivateTrainer::save`] wrote into this trainer,
    /// built as the saved one was (same loss, data, parameters and
    /// configuration): all of it, or nothing and an error naming what is
    /// missing, corrupt or different. The folder's digest is checked
    /// first; the saved accountant history must hold only steps with this
    /// trainer's noise multiplier and sample rate, as many as the saved
    /// step count; ε is then recomputed from it by this trainer's own
    /// accountant (its mechanism and error band).
    ///
    /// The generator: an OS-keyed trainer keeps its own fresh key whatever
    /// the folder holds; a seeded one continues a seeded run's stream (so
    /// the resumed run ends bit-identical to one that never stopped),
    /// with the same warning as `make_private`, and refuses to resume an
    /// OS-keyed run's folder. See the module docs.
    pub fn resume(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        // steps taken before the resume would vanish from the accounting,
        // though what they released (their reports, a model evaluated
        // then) may be out
        if self.steps != 0 || self.setup.accountant.steps() != 0 {
            return Err(bad(format!(
                "this trainer has taken {} steps: resume into a newly built one, whose accounting is empty",
                self.steps.max(self.setup.accountant.steps() as u64)
            )));
        }
        let r = self.read(dir.as_ref())?;
        // the optimiser checks its state whole before taking any of it; the
        // parameters were checked by `read`
        self.optimizer.load_state(&r.optimizer)?;
        for k in &self.setup.trainable {
            self.set_param(k, &r.params[k])?;
        }
        self.setup.accountant = r.accountant;
        if let Keying::Adopt(rng) = r.rng {
            self.setup.rng = *rng;
        }
        if let (Some(a), Some(c)) = (&mut self.setup.adaptive, r.bound) {
            a.bound = c;
        }
        self.steps = r.steps;
        self.setup.physical = r.physical;
        if let Some(m) = &mut self.memory {
            // its pass stays planned for the larger batch: a bound
            m.physical_batch = r.physical;
        }
        Ok(())
    }

    /// Reads and checks a saved folder against this trainer.
    fn read(&self, dir: &Path) -> Result<Restored> {
        let state = read_state(dir)?;
        let current = self.params_now()?;
        let physical = self.same_run(&state, &current)?;
        // onto the parameters' device (the data may live elsewhere)
        let device = match current.values().next() {
            Some(t) => t.device().clone(),
            None => self.setup.data.source.device(),
        };
        let params = load_params(dir, &current, &device)?;
        let optimizer = optimizer_state(&state["optimizer"], dir, &device)?;
        let steps = state["steps"]
            .as_u64()
            .ok_or_else(|| bad("state.json: steps is not a count"))?;
        let accountant = self.checked_history(&state["accountant"], steps)?;
        let rng = self.keying(&state["rng"], dir)?;
        let bound = match (&self.setup.adaptive, &state["clip_bound"]) {
            (None, Value::Null) => None,
            (Some(_), Value::Number(c)) => c.as_f64().filter(|c| c.is_finite() && *c > 0.0),
            (_, v) => return Err(bad(format!("clip_bound {v} does not fit this trainer's clipping"))),
        };
        if self.setup.adaptive.is_some() && bound.is_none() {
            return Err(bad("clip_bound is not a positive number"));
        }
        Ok(Restored {
            params,
            optimizer,
            accountant,
            rng,
            steps,
            bound,
            physical,
        })
    }

    /// The saved run's physical batch, where the state saved describes this
    /// trainer's run (what it trains, on which examples, at which sample
    /// rate and noise, in which batches, for which users), else an error
    /// naming the field.
    fn same_run(&self, state: &Value, current: &BTreeMap<String, Tensor>) -> Result<usize> {
        let now = identity(self, current);
        let physical = state["run"]["physical_batch"].as_u64().unwrap_or(0) as usize;
        for field in [
            "trainable",
            "examples",
            "sample_rate",
            "noise_multiplier",
            "physical_batch",
            "users",
        ] {
            // a batch the trainer chose under its memory limit gives way to
            // a smaller saved one, which fits too and continues the run's
            // sums bit for bit
            let smaller = (1..=self.setup.physical).contains(&physical);
            if field == "physical_batch" && smaller && self.memory.as_ref().is_some_and(|m| m.chosen) {
                continue;
            }
            if state["run"][field] != now[field] {
                let msg = format!("{field} was {} when saved, is {} now", state["run"][field], now[field]);
                return Err(bad(msg));
            }
        }
        Ok(physical)
    }

    /// The saved history checked step by step against this trainer (every
    /// step at its `σ` and `q`, `steps` of them), as this trainer's own
    /// accountant: the mechanism and error band are the trainer's, the
    /// saved ones only reported in a warning when they differ.
    fn checked_history(&self, saved: &Value, steps: u64) -> Result<Accountant> {
        let saved = Accountant::from_json(&saved.to_string())?;
        self.check_history(&saved, steps, "PrivateTrainer::resume")?;
        if saved.mechanism() != self.setup.accountant.mechanism() {
            warn_once(
                "dp-resume-mechanism".into(),
                format!(
                    "PrivateTrainer::resume: the saved run reported epsilon by {}, this trainer by {}: \
                     epsilon is recomputed from the saved history by {}",
                    saved.mechanism().name(),
                    self.setup.accountant.mechanism().name(),
                    self.setup.accountant.mechanism().name()
                ),
            );
        }
        let mut accountant = self.setup.accountant.emptied();
        let steps = usize::try_from(steps).map_err(|_| bad(format!("{steps} steps overflow usize")))?;
        accountant.record(self.setup.noise_multiplier, self.setup.sample_rate, steps)?;
        Ok(accountant)
    }

    /// An error of `what` unless every step `acc` records is one this
    /// trainer takes (its `σ` and `q`), `steps` of them.
    fn check_history(&self, acc: &Accountant, steps: u64, what: &'static str) -> Result<()> {
        let bad = |msg: String| Error::Checkpoint { what, msg };
        let (sigma, q) = (self.setup.noise_multiplier, self.setup.sample_rate);
        // a run sampled one way is never accounted as another
        if acc.sampling() != self.setup.accountant.sampling() {
            return Err(bad(format!(
                "the accountant's steps were sampled {:?}, this trainer samples {:?}",
                acc.sampling(),
                self.setup.accountant.sampling()
            )));
        }
        for (i, &(s, r, n)) in acc.history().iter().enumerate() {
            if s.to_bits() != sigma.to_bits() || r.to_bits() != q.to_bits() {
                return Err(bad(format!(
                    "accountant history entry {i} records {n} steps at noise multiplier {s} and sample rate {r}; \
                     this trainer steps at noise multiplier {sigma} and sample rate {q}"
                )));
            }
        }
        let recorded = acc
            .history()
            .iter()
            .try_fold(0u64, |t, &(_, _, n)| t.checked_add(n as u64));
        if recorded != Some(steps) {
            let recorded = recorded.map_or("more than 2^64".to_string(), |r| r.to_string());
            return Err(bad(format!(
                "the accountant history records {recorded} steps, the step count is {steps}"
            )));
        }
        Ok(())
    }

    /// What to do with the saved generator (see the module docs).
    fn keying(&self, saved: &Value, dir: &Path) -> Result<Keying> {
        match (saved, self.setup.rng.is_seeded()) {
            (Value::Null, false) => Ok(Keying::Keep),
            (Value::Null, true) => Err(bad(format!(
                "{} was saved by a run whose noise came from an OS-keyed generator; this trainer's is seeded \
                 (PrivacyEngine::rng), which would make the rest of that private run's noise predictable from \
                 its seed: build the trainer without .rng(..) to resume it",
                dir.display()
            ))),
            (r, false) => {
                rng_of(r).ok_or_else(|| bad(format!("state.json: rng {r} is not a generator's state")))?;
                warn_once(
                    "dp-resume-seeded-run".into(),
                    format!(
                        "PrivateTrainer::resume: {} was saved by a seeded run: its steps so far give no \
                         privacy against whoever knows the seed; this trainer continues with its own OS key",
                        dir.display()
                    ),
                );
                Ok(Keying::Keep)
            }
            (r, true) => {
                let rng = rng_of(r).ok_or_else(|| bad(format!("state.json: rng {r} is not a generator's state")))?;
                warn_once(
                    "dp-seeded-rng".into(),
                    "PrivateTrainer::resume: a seeded generator makes the noise predictable from its seed: \
                     reproducible, but not private"
                        .into(),
                );
                Ok(Keying::Adopt(Box::new(rng)))
            }
        }
    }
}

/// A saved folder's `state.json`, its digest checked first (so a file cut
/// short is named as such rather than failing to parse) and its format
/// one this crate reads.
fn read_state(dir: &Path) -> Result<Value> {
    // the digest first, so a file cut short is named as such rather
    // than failing to parse
    let digested = dir.join(folder::DIGEST).exists();
    if digested {
        folder::verify(dir, &FILES, "PrivateTrainer::resume")?;
    }
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| match folder::moved_aside(dir) {
        Some(aside) if !dir.exists() => bad(format!(
            "{} is missing; a save interrupted between its two renames left the previous checkpoint at {}: \
             rename that folder to {} to resume it",
            dir.display(),
            aside.display(),
            dir.display()
        )),
        _ => io("PrivateTrainer::resume", &path, e),
    })?;
    let state: Value = serde_json::from_str(&text).map_err(|e| bad(format!("state.json: {e}")))?;
    match state["format"].as_u64() {
        Some(FORMAT) if digested => {}
        Some(FORMAT) => return Err(bad(format!("{} is missing", dir.join(folder::DIGEST).display()))),
        // the first format had no digest: its history is still checked
        Some(1) => {
            warn_once(
                "dp-resume-no-digest".into(),
                format!(
                    "PrivateTrainer::resume: {} was saved without a digest (format 1): \
                     a truncated or edited file is caught only where it fails to parse",
                    dir.display()
                ),
            );
        }
        _ => {
            return Err(bad(format!(
                "state.json has format {}, expected {FORMAT}",
                state["format"]
            )))
        }
    }
    Ok(state)
}

/// The saved parameters, each of this trainer's as it is now (name, shape,
/// dtype), on `device`.
fn load_params(dir: &Path, current: &BTreeMap<String, Tensor>, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let params = load_tensors(&dir.join("params.safetensors"), device)?;
    for (k, t) in current {
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
    Ok(params)
}

/// The optimiser's saved state (`opt`, its tensors from the folder).
fn optimizer_state(opt: &Value, dir: &Path, device: &Device) -> Result<OptimizerState> {
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
    Ok(OptimizerState {
        kind: opt["kind"].as_str().unwrap_or_default().to_string(),
        tensors: load_tensors(&dir.join("optimizer.safetensors"), device)?,
        scalars,
    })
}

fn save_tensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors.clone().into_iter().collect();
    candle_core::safetensors::save(&map, path).map_err(|e| io("PrivateTrainer::save", path, e))
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
