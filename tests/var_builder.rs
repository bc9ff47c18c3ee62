//! One way to load a model: a checkpoint served as a `candle_nn::VarBuilder`
//! backend, each model built from one struct per Hugging Face module with
//! `load(vb.pp(..), &cfg)`, and `params()` derived from what the structs
//! read. A model built from a `VarMap` shows the derivation: every variable
//! the structs made is a parameter, under the checkpoint's own names.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::models::bert::{BertConfig, BertForSequenceClassification};
use candle_func::models::gpt2::{Gpt2Config, Gpt2LmHeadModel};
use candle_func::models::llama::{LlamaConfig, LlamaForCausalLM};
use candle_func::models::roberta::RobertaForSequenceClassification;
use candle_func::models::Checkpoint;
use candle_func::nn::{self, Module};
use candle_func::{jit, Error, Tracer};
use candle_nn::{VarBuilder, VarMap};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn config<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The float weights stored in a fixture, by name.
fn stored(name: &str) -> BTreeMap<String, Tensor> {
    let all = candle_core::safetensors::load(fixture(name).join("model.safetensors"), &Device::Cpu).unwrap();
    all.into_iter().filter(|(_, t)| t.dtype().is_float()).collect()
}

fn ids() -> Tensor {
    Tensor::new(&[[1u32, 5, 7, 2, 3, 4]], &Device::Cpu).unwrap()
}

fn model_error<T>(r: candle_func::Result<T>) -> String {
    match r {
        Err(e @ Error::Model { .. }) => e.to_string(),
        Err(e) => panic!("expected Error::Model, got {e:?}"),
        Ok(_) => panic!("expected Error::Model, got a value"),
    }
}

#[test]
fn a_checkpoint_serves_nn_layers_through_a_var_builder() {
    let ck = Checkpoint::load(fixture("bert_cls"), DType::F32, &Device::Cpu).unwrap();
    let w = stored("bert_cls");
    let d = w["bert.pooler.dense.bias"].dims()[0];
    let vb = ck.var_builder();
    let pooler = nn::linear(d, d, vb.pp("bert").pp("pooler").pp("dense")).unwrap();
    let params = pooler.params();
    let names: Vec<&str> = params.keys().map(String::as_str).collect();
    assert_eq!(names, ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]);
    for (name, t) in &params {
        assert_eq!(common::max_diff(t, &w[name]), 0.0, "{name}");
    }
    assert_eq!(ck.read_names(), ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]);
    // a missing weight and a misshapen one are errors naming the weight
    let msg = model_error(nn::linear(d, d, vb.pp("bert").pp("nowhere")));
    assert!(
        msg.contains("\"bert.nowhere.weight\"") && msg.contains("missing"),
        "{msg}"
    );
    let msg = model_error(nn::linear(d + 1, d, vb.pp("bert").pp("pooler").pp("dense")));
    assert!(
        msg.contains("\"bert.pooler.dense.weight\"") && msg.contains(&format!("[{d}, {}]", d + 1)),
        "{msg}"
    );
    // the compute dtype is the checkpoint's
    let half = Checkpoint::load(fixture("bert_cls"), DType::BF16, &Device::Cpu).unwrap();
    let l = nn::linear(d, d, half.var_builder().pp("bert.pooler.dense")).unwrap();
    assert!(l.params().values().all(|t| t.dtype() == DType::BF16));
}

/// Builds each family from a `VarMap` and from its checkpoint by
/// `load_vb`, and checks the derivation and the names.
fn check_family<M: Module>(name: &str, build: impl Fn(VarBuilder) -> candle_func::Result<M>) {
    let cpu = Device::Cpu;
    // a new model: every variable its structs made is a parameter, and
    // their names are the checkpoint's
    let vm = VarMap::new();
    let fresh = build(VarBuilder::from_varmap(&vm, DType::F32, &cpu)).unwrap();
    let made: BTreeSet<String> = vm.data().lock().unwrap().keys().cloned().collect();
    let params: BTreeSet<String> = fresh.params().keys().cloned().collect();
    assert_eq!(params, made, "{name}: parameters against the VarMap's variables");
    let names: BTreeSet<String> = stored(name).into_keys().collect();
    assert_eq!(params, names, "{name}: a new model's names against the checkpoint's");
    let y = jit(|i: Tracer| fresh.forward(&i)).call(ids()).unwrap();
    assert!(
        common::values(&y).iter().all(|v| v.is_finite()),
        "{name}: a new model's output"
    );
    // from the checkpoint's VarBuilder: the stored values, shared
    let ck = Checkpoint::load(fixture(name), DType::F32, &cpu).unwrap();
    let loaded = build(ck.var_builder()).unwrap();
    let w = stored(name);
    for (n, t) in loaded.params() {
        assert_eq!(common::max_diff(&t, &w[&n]), 0.0, "{name}: {n}");
    }
    assert!(ck.unread().is_empty(), "{name}: unread {:?}", ck.unread());
}

#[test]
fn each_family_loads_from_a_var_builder_with_parameters_derived_from_its_reads() {
    check_family("llama_lm", |vb| {
        LlamaForCausalLM::load_vb(vb, &config::<LlamaConfig>("llama_lm"))
    });
    check_family("qwen2_window_lm", |vb| {
        LlamaForCausalLM::load_vb(vb, &config::<LlamaConfig>("qwen2_window_lm"))
    });
    check_family("gpt2_lm", |vb| {
        Gpt2LmHeadModel::load_vb(vb, &config::<Gpt2Config>("gpt2_lm"))
    });
    check_family("bert_cls", |vb| {
        BertForSequenceClassification::load_vb(vb, &config::<BertConfig>("bert_cls"))
    });
    check_family("roberta_cls", |vb| {
        RobertaForSequenceClassification::load_vb(vb, &config::<BertConfig>("roberta_cls"))
    });
}

#[test]
fn load_vb_and_load_give_the_same_model() {
    let ck = Checkpoint::load(fixture("mistral_window_lm"), DType::F32, &Device::Cpu).unwrap();
    let a = LlamaForCausalLM::load(&ck).unwrap();
    let b = LlamaForCausalLM::load_vb(ck.var_builder(), a.config()).unwrap();
    let run = |m: &LlamaForCausalLM| jit(|i: Tracer| m.forward(&i)).call(ids()).unwrap();
    assert_eq!(common::max_diff(&run(&a), &run(&b)), 0.0);
    // a bad config given with a VarBuilder is refused by field, as from a folder
    let mut c = a.config().clone();
    c.num_key_value_heads = Some(3);
    let msg = model_error(LlamaForCausalLM::load_vb(ck.var_builder(), &c));
    assert!(msg.contains("num_key_value_heads"), "{msg}");
}

#[test]
fn the_new_layer_constructors_refuse_sizes_that_do_not_fit() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    // a product that overflows, and one far beyond the host's memory:
    // errors naming the parameter, never an aborted allocation
    for (i, o) in [(usize::MAX, 2), (1 << 40, 1 << 20)] {
        let e = nn::linear_in_out(i, o, vb.pp("c_fc")).err().expect("refused");
        assert!(e.to_string().contains("c_fc.weight"), "{e}");
        let e = nn::linear_b(i, o, false, vb.pp("q_proj")).err().expect("refused");
        assert!(e.to_string().contains("q_proj.weight"), "{e}");
    }
    // a checkpoint's weight asked for at another orientation is named
    let ck = Checkpoint::load(fixture("gpt2_lm"), DType::F32, &Device::Cpu).unwrap();
    let w = stored("gpt2_lm");
    let (i, o) = w["transformer.h.0.mlp.c_fc.weight"].dims2().unwrap();
    let msg = model_error(nn::linear_in_out(o, i, ck.var_builder().pp("transformer.h.0.mlp.c_fc")));
    assert!(msg.contains("\"transformer.h.0.mlp.c_fc.weight\""), "{msg}");
    assert!(nn::linear_in_out(i, o, ck.var_builder().pp("transformer.h.0.mlp.c_fc")).is_ok());
}
