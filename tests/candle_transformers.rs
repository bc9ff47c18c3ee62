//! The forward pass equals candle-transformers' own implementation on the
//! same checkpoint (BERT and Llama), so users of the Rust ecosystem's
//! models get the same numbers from ours.

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_func::models::bert::BertModel;
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::Checkpoint;
use candle_func::{jit, Tracer};
use candle_transformers::models::{bert, llama};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn candle_vb(dir: &Path) -> candle_nn::VarBuilder<'static> {
    let w = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn bert_hidden_states_equal_candle_transformers() {
    let dir = fixture("bert_cls");
    let ours = BertModel::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let cfg: bert::Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let theirs = bert::BertModel::load(candle_vb(&dir), &cfg).unwrap();
    let ids = Tensor::new(&[[2u32, 15, 7, 9, 33, 4], [2, 41, 3, 8, 0, 0]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &Device::Cpu).unwrap();
    let h = jit(|i: Tracer, m: Tracer| ours.forward_masked(&i, Some(&m)))
        .call((&ids, &mask))
        .unwrap();
    let want = theirs.forward(&ids, &ids.zeros_like().unwrap(), Some(&mask)).unwrap();
    let d = max_diff(&h, &want);
    println!("BERT hidden states: max difference {d:.2e}");
    assert!(d < 1e-5, "BERT differs from candle-transformers by {d}");
}

#[test]
fn llama_logits_equal_candle_transformers() {
    let dir = fixture("llama_lm");
    let ours = LlamaForCausalLM::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let cfg: llama::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let theirs = llama::Llama::load(candle_vb(&dir), &cfg).unwrap();
    let ids = Tensor::new(&[[5u32, 17, 3, 60, 42, 9, 11, 80]], &Device::Cpu).unwrap();
    let mut cache = llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
    // candle-transformers returns the last position's logits
    let want = theirs.forward(&ids, 0, &mut cache).unwrap();
    let all = jit(|i: Tracer| ours.forward_masked(&i, None)).call(&ids).unwrap();
    let last = all.i((.., 7, ..)).unwrap();
    let d = max_diff(&last, &want);
    println!("Llama logits: max difference {d:.2e}");
    assert!(d < 1e-4, "Llama differs from candle-transformers by {d}");
}
