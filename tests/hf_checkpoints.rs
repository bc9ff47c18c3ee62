//! Checkpoint folders as users bring them: sharded, in bf16, and broken in
//! each way a folder can be (a config field missing, of the wrong type or
//! asking for what the crate does not implement; a weight missing or of
//! another shape), and inputs a model must refuse or handle. Each failure
//! is an `Error::Model` or a shape error naming the field, the weight or
//! the shapes.

mod common;

use common::max_diff;

use candle_core::{DType, Device, Tensor};
use candle_func::models::bert::{BertForSequenceClassification, BertModel};
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::{mean_pool, Checkpoint};
use candle_func::{jit, Error, Tracer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// A fresh copy of fixture `name` in a folder of its own, to break.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle_func_hf_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
    }
    dir
}

/// A change to a config.json.
type Edit = Box<dyn Fn(&mut serde_json::Value)>;

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn weights(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn load_bert(dir: &Path) -> candle_func::Result<BertForSequenceClassification> {
    BertForSequenceClassification::load(&Checkpoint::load(dir, DType::F32, &Device::Cpu)?)
}

fn model_error<T>(r: candle_func::Result<T>) -> String {
    match r {
        Err(e @ Error::Model { .. }) => e.to_string(),
        Err(e) => panic!("expected Error::Model, got {e:?}"),
        Ok(_) => panic!("expected Error::Model, got a model"),
    }
}

fn ids() -> (Tensor, Tensor) {
    let ids = Tensor::new(&[[2u32, 5, 7, 9, 0, 0]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 0, 0]], &Device::Cpu).unwrap();
    (ids, mask)
}

fn logits(m: &BertForSequenceClassification, ids: &Tensor, mask: &Tensor) -> candle_func::Result<Tensor> {
    jit(|i: Tracer, k: Tracer| m.forward_masked(&i, Some(&k))).call((ids, mask))
}

#[test]
fn a_sharded_and_a_bf16_checkpoint_load_as_the_single_file_does() {
    let (ids, mask) = ids();
    let want = logits(&load_bert(&fixture("bert_cls")).unwrap(), &ids, &mask).unwrap();
    // two shards and their index
    let dir = copy("bert_cls", "shards");
    let all = weights(&dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let (mut a, mut b, mut map) = (HashMap::new(), HashMap::new(), serde_json::Map::new());
    for (i, (k, v)) in all.iter().enumerate() {
        let (part, file) = if i % 2 == 0 {
            (&mut a, "model-00001-of-00002.safetensors")
        } else {
            (&mut b, "model-00002-of-00002.safetensors")
        };
        part.insert(k.clone(), v.clone());
        map.insert(k.clone(), file.into());
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let got = logits(&load_bert(&dir).unwrap(), &ids, &mask).unwrap();
    assert_eq!(got.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
    // a weight in two shards (a stale copy in the shard that sorts last),
    // one the index does not list, one the index places in a shard
    // lacking it: each refused by name rather than read from either
    let (first, second) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    let stale_name = a.keys().next().unwrap().clone();
    let mut b_stale = b.clone();
    b_stale.insert(stale_name.clone(), a[&stale_name].zeros_like().unwrap());
    candle_core::safetensors::save(&b_stale, dir.join(second)).unwrap();
    let msg = model_error(load_bert(&dir));
    assert!(
        msg.contains(&format!("\"{stale_name}\"")) && msg.contains(&format!("is in {second}")) && msg.contains(first),
        "{msg}"
    );
    let mut b_extra = b.clone();
    b_extra.insert("extra.weight".into(), a[&stale_name].clone());
    candle_core::safetensors::save(&b_extra, dir.join(second)).unwrap();
    let msg = model_error(load_bert(&dir));
    assert!(
        msg.contains("\"extra.weight\"") && msg.contains("does not list it"),
        "{msg}"
    );
    candle_core::safetensors::save(&b, dir.join(second)).unwrap();
    // a name the index lists and no shard holds (a tied weight a converter
    // dropped) loads, as transformers loads it
    let mut listed = map.clone();
    listed.insert("tied.weight".into(), first.into());
    let index = serde_json::json!({ "metadata": {}, "weight_map": listed });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let got = logits(&load_bert(&dir).unwrap(), &ids, &mask).unwrap();
    assert_eq!(got.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
    // a bf16 checkpoint, computed in f32
    let half: HashMap<String, Tensor> = all
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap()))
        .collect();
    let dir = copy("bert_cls", "bf16");
    candle_core::safetensors::save(&half, dir.join("model.safetensors")).unwrap();
    let m = load_bert(&dir).unwrap();
    let got = logits(&m, &ids, &mask).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    let d = max_diff(&got, &want) as f32;
    assert!(d < 5e-2, "bf16 weights moved the logits by {d}");
}

#[test]
fn config_fields_are_checked_by_name() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "wrong type",
            Box::new(|v| v["hidden_size"] = "32".into()),
            "\"hidden_size\"",
        ),
        (
            "missing",
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("vocab_size");
            }),
            "vocab_size",
        ),
        (
            "activation",
            Box::new(|v| v["hidden_act"] = "mish".into()),
            "\"hidden_act\"",
        ),
        (
            "positions",
            Box::new(|v| v["position_embedding_type"] = "relative_key".into()),
            "\"position_embedding_type\"",
        ),
        (
            "heads",
            Box::new(|v| v["num_attention_heads"] = 5.into()),
            "\"num_attention_heads\"",
        ),
        ("decoder", Box::new(|v| v["is_decoder"] = true.into()), "\"is_decoder\""),
    ];
    for (what, edit, names) in cases {
        let dir = copy("bert_cls", "cfg");
        edit_config(&dir, edit);
        let msg = model_error(load_bert(&dir));
        assert!(msg.contains(names), "{what}: {msg}");
    }
    // the sizes a config implies are checked against the weights
    let dir = copy("bert_cls", "size");
    edit_config(&dir, |v| v["intermediate_size"] = 40.into());
    let msg = model_error(load_bert(&dir));
    assert!(
        msg.contains("intermediate.dense.weight") && msg.contains("[37, 32]") && msg.contains("[40, 32]"),
        "{msg}"
    );
}

#[test]
fn weights_missing_or_misshapen_are_named() {
    let dir = copy("bert_cls", "weights");
    let mut w = weights(&dir);
    w.remove("bert.pooler.dense.bias");
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    let msg = model_error(load_bert(&dir));
    assert!(
        msg.contains("\"bert.pooler.dense.bias\"") && msg.contains("missing") && msg.contains("[32]"),
        "{msg}"
    );
    let mut w = weights(&copy("bert_cls", "weights2"));
    w.insert(
        "classifier.weight".into(),
        Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let dir = copy("bert_cls", "weights2");
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    let msg = model_error(load_bert(&dir));
    assert!(
        msg.contains("\"classifier.weight\"") && msg.contains("[4, 32]") && msg.contains("[3, 32]"),
        "{msg}"
    );
    // no weights, no config
    let dir = copy("bert_cls", "empty");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(model_error(Checkpoint::load(&dir, DType::F32, &Device::Cpu)).contains("model.safetensors"));
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(model_error(Checkpoint::load(&dir, DType::F32, &Device::Cpu)).contains("config.json"));
}

#[test]
fn the_llama_family_refuses_what_it_does_not_implement() {
    let load = |dir: &Path| LlamaForCausalLM::load(&Checkpoint::load(dir, DType::F32, &Device::Cpu)?);
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0})),
            "\"rope_scaling\"",
        ),
        (
            Box::new(|v| v["rope_parameters"]["rope_type"] = "yarn".into()),
            "rope_type",
        ),
        (Box::new(|v| v["model_type"] = "gemma".into()), "\"model_type\""),
        (
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
            "\"num_key_value_heads\"",
        ),
        (Box::new(|v| v["hidden_act"] = "relu2".into()), "\"hidden_act\""),
    ];
    for (edit, names) in cases {
        let dir = copy("llama_lm", "llama");
        edit_config(&dir, edit);
        let msg = model_error(load(&dir));
        assert!(msg.contains(names), "{msg}");
    }
    // a window runs (tests/hf_models.rs checks it against transformers);
    // a layer type not implemented, or a list of the wrong length, is named
    let short = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    let long = Tensor::new(&[1u32, 2, 3, 4, 5, 6], &Device::Cpu).unwrap();
    for (types, what) in [
        (vec!["sliding_attention", "chunked_attention"], "\"chunked_attention\""),
        (vec!["sliding_attention"], "1 entries for 2 layers"),
    ] {
        let dir = copy("llama_lm", "mistral");
        edit_config(&dir, |v| {
            v["model_type"] = "mistral".into();
            v["sliding_window"] = 4.into();
            v["layer_types"] = serde_json::json!(types);
        });
        let msg = model_error(load(&dir));
        assert!(msg.contains("layer_types") && msg.contains(what), "{msg}");
    }
    let dir = copy("llama_lm", "mistral");
    edit_config(&dir, |v| {
        v["model_type"] = "mistral".into();
        v["sliding_window"] = 4.into();
    });
    let m = load(&dir).unwrap();
    assert!(jit(|i: Tracer| m.forward_masked(&i, None)).call(&long).is_ok());
    // transformers 4.x's layout: rope_theta at the top level
    let dir = copy("llama_lm", "rope4");
    edit_config(&dir, |v| {
        v.as_object_mut().unwrap().remove("rope_parameters");
        v["rope_theta"] = 10000.0.into();
        v["rope_scaling"] = serde_json::Value::Null;
    });
    let a = load(&dir).unwrap();
    let b = load(&fixture("llama_lm")).unwrap();
    let run = |m: &LlamaForCausalLM| jit(|i: Tracer| m.forward_masked(&i, None)).call(&short).unwrap();
    assert_eq!(run(&a).to_vec2::<f32>().unwrap(), run(&b).to_vec2::<f32>().unwrap());
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let m = load_bert(&fixture("bert_cls")).unwrap();
    let run = |ids: &Tensor, mask: &Tensor| logits(&m, ids, mask);
    // an id outside the vocabulary (99 rows)
    let bad_ids = Tensor::new(&[[2u32, 120, 7]], &Device::Cpu).unwrap();
    let ones = Tensor::ones((1, 3), DType::U32, &Device::Cpu).unwrap();
    match run(&bad_ids, &ones) {
        Err(Error::Shape {
            op: "embedding", msg, ..
        }) => assert!(msg.contains("120") && msg.contains("99"), "{msg}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // longer than max_position_embeddings (64)
    let long = Tensor::zeros((1, 65), DType::U32, &Device::Cpu).unwrap();
    let msg = run(&long, &long).unwrap_err().to_string();
    assert!(msg.contains("65") && msg.contains("max_position_embeddings"), "{msg}");
    // a mask of another shape
    let (ids, _) = ids();
    let msg = run(&ids, &ones).unwrap_err().to_string();
    assert!(
        msg.contains("attention mask") && msg.contains("[1, 6]") && msg.contains("[1, 3]"),
        "{msg}"
    );
    // float ids
    let f = ids.to_dtype(DType::F32).unwrap();
    assert!(run(&f, &ones).unwrap_err().to_string().contains("integers"));
}

#[test]
fn an_example_with_no_real_token_attends_evenly_and_pools_to_zeros() {
    let m = BertModel::load(&Checkpoint::load(fixture("bert_cls"), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let (ids, _) = ids();
    let none = Tensor::zeros((1, 6), DType::U32, &Device::Cpu).unwrap();
    // Hugging Face's masking: every key hidden alike, so the scores stay
    // finite (an average), never NaN
    let h = jit(|i: Tracer, k: Tracer| m.forward_masked(&i, Some(&k)))
        .call((&ids, &none))
        .unwrap();
    assert!(h
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
    let pooled = jit(|i: Tracer, k: Tracer| mean_pool(&m.forward_masked(&i, Some(&k))?, &k))
        .call((&ids, &none))
        .unwrap();
    assert!(pooled
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
}

#[test]
fn forward_mode_through_a_pretrained_model_agrees_with_finite_differences() {
    // f64 weights: a central difference is then exact to ~1e-9
    let ck = Checkpoint::load(fixture("llama_lm"), DType::F64, &Device::Cpu).unwrap();
    let m = LlamaForCausalLM::load(&ck).unwrap();
    let params = candle_func::nn::Module::params(&m);
    let ids = Tensor::new(&[3u32, 14, 15, 9, 26], &Device::Cpu).unwrap();
    let f = |p: std::collections::BTreeMap<String, Tracer>| {
        let ids = ids.clone();
        m.forward_full(
            &candle_func::nn::Params::with(&p),
            &candle_func::tracer::Operand::to_tracer(&ids, p.values().next().unwrap())?,
            None,
        )?
        .sum_all()
    };
    let tangent: std::collections::BTreeMap<String, Tensor> = params
        .iter()
        .map(|(k, v)| (k.clone(), v.ones_like().unwrap()))
        .collect();
    let (_, t) = candle_func::jvp(&f, &params, &tangent).unwrap();
    let shifted = |eps: f64| -> f64 {
        let p: std::collections::BTreeMap<String, Tensor> = params
            .iter()
            .map(|(k, v)| (k.clone(), v.affine(1.0, eps).unwrap()))
            .collect();
        jit(f).call(&p).unwrap().to_scalar::<f64>().unwrap()
    };
    let eps = 1e-6;
    let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
    let t = t.to_scalar::<f64>().unwrap();
    assert!(
        (t - fd).abs() <= 1e-5 * fd.abs().max(1.0),
        "jvp {t} against finite differences {fd}"
    );
}

#[test]
fn the_dp_trainer_fine_tunes_a_pretrained_classifier() {
    use candle_func::dp::{DpConfig, PrivacyEngine};
    use candle_func::nn::{cross_entropy, Params, Reduction};
    let m = load_bert(&fixture("bert_cls")).unwrap();
    // every weight a variable the optimiser updates, under its checkpoint name
    let varmap = candle_nn::VarMap::new();
    for (name, t) in candle_func::nn::Module::params(&m) {
        varmap
            .data()
            .lock()
            .unwrap()
            .insert(name, candle_core::Var::from_tensor(&t).unwrap());
    }
    let before: Vec<f32> = varmap.data().lock().unwrap()["classifier.weight"]
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    // each example's ids and mask as one [2, T] tensor
    let (n, t) = (12usize, 6usize);
    let ids: Vec<u32> = (0..n * t).map(|i| 2 + (i as u32 * 7) % 90).collect();
    let keep: Vec<u32> = (0..n * t).map(|i| u32::from(i % t < 3 + (i / t) % 4)).collect();
    let ids = Tensor::from_vec(ids, (n, 1, t), &Device::Cpu).unwrap();
    let keep = Tensor::from_vec(keep, (n, 1, t), &Device::Cpu).unwrap();
    let xs = Tensor::cat(&[ids, keep], 1).unwrap();
    let ys = Tensor::from_vec((0..n as u32).map(|i| i % 3).collect(), n, &Device::Cpu).unwrap();
    let loss = |p: std::collections::BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let (ids, mask) = (x.narrow(0, 0, 1)?.squeeze(0)?, x.narrow(0, 1, 1)?.squeeze(0)?);
        let logits = m.forward_full(&Params::with(&p), &ids, Some(&mask), None)?;
        cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let mut trainer = PrivacyEngine::new()
        .rng(candle_func::rng::Rng::seeded(1))
        .physical_batch(4)
        .make_private(
            loss,
            &varmap,
            candle_func::optim::Sgd::new(&varmap, 0.1, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::new(6, 1.0, 1.0),
        )
        .unwrap();
    for _ in 0..trainer.steps_per_epoch() {
        trainer.step().unwrap();
    }
    let after: Vec<f32> = varmap.data().lock().unwrap()["classifier.weight"]
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_ne!(before, after, "the classifier did not move");
    assert!(after.iter().all(|v| v.is_finite()));
    let eps = trainer.epsilon(1e-5).unwrap();
    assert!(eps.is_finite() && eps > 0.0, "epsilon {eps}");
}
