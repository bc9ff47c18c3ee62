//! Sizes read from user input (a layer's hidden size, a loop's trip count,
//! a config.json field) are checked before anything is allocated: an error
//! naming the size, never an aborted process; and a Llama builds its
//! rotary tables for the lengths it runs at, not for every position its
//! configuration allows.

use candle_core::{DType, Device, Tensor};
use candle_func::loops::fori_loop;
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::Checkpoint;
use candle_func::nn::{self, Module, RecurrentConfig};
use candle_func::{jit, Error, Tracer};
use candle_nn::{VarBuilder, VarMap};
use std::path::{Path, PathBuf};

const HUGE: usize = 1 << 40;

fn vb(map: &VarMap) -> VarBuilder<'_> {
    VarBuilder::from_varmap(map, DType::F32, &Device::Cpu)
}

fn config_error<T>(r: candle_func::Result<T>, named: &str) {
    match r {
        Err(e @ Error::Config { .. }) => assert!(e.to_string().contains(named), "{named}: {e}"),
        Err(e) => panic!("{named}: expected a configuration error, got {e}"),
        Ok(_) => panic!("{named}: accepted"),
    }
}

#[test]
fn layers_sized_past_memory_are_errors_naming_the_parameter() {
    let map = VarMap::new();
    config_error(
        nn::lstm(4, HUGE, RecurrentConfig::default(), vb(&map).pp("rnn")),
        "\"rnn.weight_ih_l0\"",
    );
    config_error(nn::linear(HUGE, HUGE, vb(&map).pp("fc")), "\"fc.weight\"");
    config_error(nn::embedding(HUGE, 8, vb(&map).pp("emb")), "\"emb.weight\"");
    config_error(nn::layer_norm(HUGE, 1e-5, vb(&map).pp("ln")), "\"ln.weight\"");
    config_error(
        nn::conv2d(3, HUGE, 3, Default::default(), vb(&map).pp("c")),
        "\"c.weight\"",
    );
    // nothing was half made
    assert!(map.all_vars().is_empty());
    // sizes that fit are made as before
    nn::lstm(4, 8, RecurrentConfig::default(), vb(&map).pp("ok")).unwrap();
}

#[test]
fn a_loop_of_more_steps_than_memory_holds_indices_for_is_an_error() {
    let x = Tensor::new(1f32, &Device::Cpu).unwrap();
    let f =
        |x: Tracer| Ok(fori_loop(0, HUGE, |_: &Tracer, c: Vec<Tracer>| Ok(vec![c[0].clone()]), vec![x])?[0].clone());
    config_error(jit(f).call(&x), "fori_loop");
    // a loop that fits runs
    let g = |x: Tracer| {
        Ok(fori_loop(
            2,
            5,
            |_: &Tracer, c: Vec<Tracer>| Ok(vec![c[0].affine(2.0, 0.0)?]),
            vec![x],
        )?[0]
            .clone())
    };
    assert_eq!(jit(g).call(&x).unwrap().to_scalar::<f32>().unwrap(), 8.0);
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama_lm")
}

/// The Llama fixture's folder with `config.json` edited by `edit`.
fn edited(tag: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle_func_sizes_{tag}_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(fixture().join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    dir
}

fn logits(m: &LlamaForCausalLM, t: usize) -> Tensor {
    let ids: Vec<u32> = (0..2 * t as u32).map(|i| 3 + (i * 7) % 90).collect();
    let ids = Tensor::from_vec(ids, (2, t), &Device::Cpu).unwrap();
    jit(|x: Tracer| m.forward(&x)).call(&ids).unwrap()
}

#[test]
fn a_llama_with_a_vast_context_loads_at_once_and_builds_tables_for_its_lengths() {
    let plain = LlamaForCausalLM::load(&Checkpoint::load(fixture(), DType::F32, &Device::Cpu).unwrap()).unwrap();
    for (tag, positions) in [("vast", 1u64 << 40), ("million", 1 << 20)] {
        let dir = edited(tag, |c| c["max_position_embeddings"] = positions.into());
        let start = std::time::Instant::now();
        let m = LlamaForCausalLM::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap()).unwrap();
        // not a timing target: tables for 2^40 positions could not be built at all
        assert!(start.elapsed().as_secs() < 30, "{tag}: {:?}", start.elapsed());
        // lengths up, down and up again, each equal to the model of the
        // fixture's own configuration
        for t in [4, 9, 2, 9, 12] {
            let (got, want) = (logits(&m, t), logits(&plain, t));
            let d = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{tag}, T = {t}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn config_sizes_that_overflow_are_errors_naming_the_field() {
    let dir = edited("heads", |c| {
        c["head_dim"] = (1u64 << 62).into();
    });
    let e = LlamaForCausalLM::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(e, Error::Model { .. }) && e.to_string().contains("num_attention_heads"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    config_error(
        nn::rotary_tables(8, HUGE, 1e4, DType::F32, &Device::Cpu),
        "rotary_tables",
    );
}
