//! Hugging Face checkpoints against `transformers`' own numbers: every case
//! folder under `tests/fixtures/hf` (or the folder `CANDLE_FUNC_HF_FIXTURES`
//! names) is built from its `config.json` and weights alone, and its
//! logits and every parameter's per-sample gradient (`vmap(grad)`, by the
//! default schedule and by the per-example one) must match the reference
//! to 1e-4 relative. A case the crate cannot handle fails.

use candle_core::{DType, Device, Tensor};
use candle_func::models::bert::BertForSequenceClassification;
use candle_func::models::gpt2::Gpt2LmHeadModel;
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::roberta::RobertaForSequenceClassification;
use candle_func::models::{causal_lm_loss, Checkpoint};
use candle_func::nn::{cross_entropy, Module, Params, Reduction};
use candle_func::{grad, jit, vmap, Schedule, Tracer};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const TOLERANCE: f64 = 1e-4;

/// A model of any family, as the tests drive it.
enum Model {
    Bert(BertForSequenceClassification),
    Roberta(RobertaForSequenceClassification),
    Gpt2(Gpt2LmHeadModel),
    Llama(LlamaForCausalLM),
}

impl Model {
    fn load(ck: &Checkpoint) -> candle_func::Result<Model> {
        Ok(match ck.model_type()?.as_str() {
            "bert" => Model::Bert(BertForSequenceClassification::load(ck)?),
            "roberta" => Model::Roberta(RobertaForSequenceClassification::load(ck)?),
            "gpt2" => Model::Gpt2(Gpt2LmHeadModel::load(ck)?),
            _ => Model::Llama(LlamaForCausalLM::load(ck)?),
        })
    }

    fn forward(&self, p: &Params, ids: &Tracer, mask: &Tracer) -> candle_func::Result<Tracer> {
        match self {
            Model::Bert(m) => m.forward_full(p, ids, Some(mask), None),
            Model::Roberta(m) => m.forward_full(p, ids, Some(mask)),
            Model::Gpt2(m) => m.forward_full(p, ids, Some(mask)),
            Model::Llama(m) => m.forward_full(p, ids, Some(mask)),
        }
    }

    fn params(&self) -> BTreeMap<String, Tensor> {
        match self {
            Model::Bert(m) => m.params(),
            Model::Roberta(m) => m.params(),
            Model::Gpt2(m) => m.params(),
            Model::Llama(m) => m.params(),
        }
    }

    /// One example's own loss, as the reference computed it.
    fn loss(
        &self,
        p: &BTreeMap<String, Tracer>,
        ids: &Tracer,
        mask: &Tracer,
        label: &Tracer,
    ) -> candle_func::Result<Tracer> {
        let logits = self.forward(&Params::with(p), ids, mask)?;
        match self {
            Model::Bert(_) | Model::Roberta(_) => {
                cross_entropy(&logits.unsqueeze(0)?, &label.unsqueeze(0)?, Reduction::Mean)
            }
            Model::Gpt2(_) | Model::Llama(_) => causal_lm_loss(&logits, ids, Some(mask)),
        }
    }
}

fn cases() -> Vec<PathBuf> {
    let root = std::env::var_os("CANDLE_FUNC_HF_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf"));
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    v.sort();
    v
}

fn max_abs(t: &Tensor) -> f64 {
    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    t.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// `max |a - b| / max(max |b|, floor)`. The floor is a thousandth of the
/// case's largest reference gradient: a gradient that is zero in exact
/// arithmetic (a key bias, which the softmax cancels) is rounding noise on
/// both sides, 1e-16 in the reference's float64 and 1e-8 in float32, and
/// is compared against the model's gradient scale, not its own.
fn rel(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let diff = max_abs(&(f(a) - f(b)).unwrap());
    diff / max_abs(b).max(floor).max(1e-30)
}

fn check_case(dir: &Path) -> Result<f64, String> {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let dev = Device::Cpu;
    let ck = Checkpoint::load(dir, DType::F32, &dev).map_err(|e| format!("{name}: {e}"))?;
    let model = Model::load(&ck).map_err(|e| format!("{name}: {e}"))?;
    let reference: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &dev).map_err(|e| format!("{name}: {e}"))?;
    let r = |k: &str| {
        reference
            .get(k)
            .cloned()
            .ok_or_else(|| format!("{name}: reference lacks {k}"))
    };
    let (ids, mask, labels) = (r("input_ids")?, r("attention_mask")?, r("labels")?);
    let floor = 1e-3
        * reference
            .iter()
            .filter(|(k, _)| k.starts_with("grad."))
            .map(|(_, g)| max_abs(g))
            .fold(0.0, f64::max);
    let mut worst = 0f64;
    let mut bad = Vec::new();
    let mut check = |what: &str, ours: &Tensor, theirs: &Tensor, floor: f64| -> Result<(), String> {
        let e = rel(ours, theirs, floor);
        worst = worst.max(e);
        if e > TOLERANCE {
            bad.push(format!("{name}: {what} differs by {e:.2e} relative"));
        }
        Ok(())
    };
    // the whole batch with its mask
    let logits = jit(|i: Tracer, m: Tracer| model.forward(&Params::own(), &i, &m))
        .call((&ids, &mask))
        .map_err(|e| format!("{name}: forward: {e}"))?;
    check("logits", &logits, &r("logits")?, 0.0)?;
    // per-sample gradients, each example's loss alone
    let params = model.params();
    // the parameters are exactly the weights the model read, and it read
    // every float weight of the folder
    let names: Vec<String> = params.keys().cloned().collect();
    if names != ck.read_names() || !ck.unread().is_empty() {
        return Err(format!(
            "{name}: parameters {names:?}, weights read {:?}, not read {:?}",
            ck.read_names(),
            ck.unread()
        ));
    }
    let want: Vec<&String> = reference.keys().filter(|k| k.starts_with("grad.")).collect();
    if want.len() != params.len() {
        return Err(format!(
            "{name}: the reference has {} gradients, the model {} parameters",
            want.len(),
            params.len()
        ));
    }
    for schedule in [Schedule::Auto, Schedule::PerExample] {
        let loss = |p: BTreeMap<String, Tracer>, i: Tracer, m: Tracer, y: Tracer| model.loss(&p, &i, &m, &y);
        let per_sample = vmap(grad(loss))
            .in_dims([None, Some(0), Some(0), Some(0)])
            .schedule(schedule)
            .call((&params, &ids, &mask, &labels))
            .map_err(|e| format!("{name}: vmap(grad) {schedule:?}: {e}"))?;
        for (pname, g) in &per_sample {
            let theirs = r(&format!("grad.{pname}"))?;
            check(&format!("{schedule:?} grad of {pname}"), g, &theirs, floor)?;
        }
    }
    match bad.is_empty() {
        true => Ok(worst),
        false => Err(bad.join("\n")),
    }
}

#[test]
fn hugging_face_checkpoints_match_transformers() {
    let cases = cases();
    assert!(!cases.is_empty(), "no case folders found");
    let mut failures = Vec::new();
    for dir in &cases {
        match check_case(dir) {
            Ok(worst) => println!("{}: worst relative difference {worst:.2e}", dir.display()),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A half dtype's unit roundoff.
fn eps(dt: DType) -> f64 {
    match dt {
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    }
}

/// One case loaded in `dt` against `transformers` run in `dt` on the same
/// checkpoint: the batch's logits no further from PyTorch's than twice
/// PyTorch's own distance from the float64 reference (or four of the
/// dtype's roundings, where that is larger), and each example's loss within
/// 0.5% of PyTorch's loss in that dtype or one of its units in the last
/// place.
fn check_half(dir: &Path, tag: &str, dt: DType) -> Result<String, String> {
    let name = format!("{} in {tag}", dir.file_name().unwrap().to_string_lossy());
    let dev = Device::Cpu;
    let ck = Checkpoint::load(dir, dt, &dev).map_err(|e| format!("{name}: {e}"))?;
    let model = Model::load(&ck).map_err(|e| format!("{name}: {e}"))?;
    let load = |f: &str| candle_core::safetensors::load(dir.join(f), &dev).map_err(|e| format!("{name}: {f}: {e}"));
    let (full, half) = (load("reference.safetensors")?, load("reference_half.safetensors")?);
    let get = |m: &HashMap<String, Tensor>, k: &str| m.get(k).cloned().ok_or_else(|| format!("{name}: no {k}"));
    let (ids, mask, labels) = (
        get(&full, "input_ids")?,
        get(&full, "attention_mask")?,
        get(&full, "labels")?,
    );
    let logits = jit(|i: Tracer, m: Tracer| model.forward(&Params::own(), &i, &m))
        .call((&ids, &mask))
        .map_err(|e| format!("{name}: forward: {e}"))?;
    if logits.dtype() != dt {
        return Err(format!("{name}: logits in {:?}", logits.dtype()));
    }
    let theirs = get(&half, &format!("logits_{tag}"))?;
    let (ours_gap, their_gap) = (rel(&logits, &theirs, 0.0), rel(&theirs, &get(&full, "logits")?, 0.0));
    let bound = (2.0 * their_gap).max(4.0 * eps(dt));
    let mut bad = Vec::new();
    if ours_gap > bound {
        bad.push(format!(
            "{name}: logits {ours_gap:.2e} from PyTorch's in {tag} (PyTorch {their_gap:.2e} from float64; bound {bound:.2e})"
        ));
    }
    let params = model.params();
    let want = get(&half, &format!("loss_{tag}"))?
        .to_vec1::<f32>()
        .map_err(|e| e.to_string())?;
    let mut worst_loss = 0f64;
    for (i, &w) in want.iter().enumerate() {
        let one = |t: &Tensor| t.get(i).map_err(|e| e.to_string());
        let loss = |p: BTreeMap<String, Tracer>, i: Tracer, m: Tracer, y: Tracer| model.loss(&p, &i, &m, &y);
        let got = jit(loss)
            .call((&params, &one(&ids)?, &one(&mask)?, &one(&labels)?))
            .and_then(|l| Ok(l.to_dtype(DType::F64)?.to_scalar::<f64>()?))
            .map_err(|e| format!("{name}: loss of example {i}: {e}"))?;
        let gap = (got - w as f64).abs() / (w as f64).abs().max(1e-30);
        worst_loss = worst_loss.max(gap);
        // a loss is one value of the dtype: two computations of it may
        // round to neighbours, one unit in the last place apart (0.78% of
        // a bf16 loss of 4)
        let ulp = 2f64.powf((w as f64).abs().log2().floor()) * 2.0 * eps(dt);
        if gap > 5e-3 && (got - w as f64).abs() > ulp {
            bad.push(format!(
                "{name}: example {i}'s loss {got} against PyTorch's {w} in {tag}"
            ));
        }
    }
    match bad.is_empty() {
        true => Ok(format!(
            "{name}: logits {ours_gap:.2e} from PyTorch's (PyTorch {their_gap:.2e} from float64), losses within {worst_loss:.2e}"
        )),
        false => Err(bad.join("\n")),
    }
}

/// Every case in bf16 and in f16 against `transformers` in the same dtype
/// (`reference_half.safetensors`, written by `scripts/make_hf_half.py`):
/// reductions in f32 as PyTorch's, so the half-precision model computes
/// the same function to the dtype's rounding.
#[test]
fn hugging_face_checkpoints_in_half_precision_match_transformers_in_it() {
    let cases = cases();
    assert!(!cases.is_empty(), "no case folders found");
    let mut failures = Vec::new();
    for dir in &cases {
        for (tag, dt) in [("bf16", DType::BF16), ("f16", DType::F16)] {
            match check_half(dir, tag, dt) {
                Ok(line) => println!("{line}"),
                Err(e) => failures.push(e),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
