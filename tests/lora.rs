//! LoRA adapters on every pretrained family: the identity at start (B = 0),
//! the merged export equal to the adapted model, ghost norms of the
//! adapters equal to materialised ones, the DP trainer training adapters
//! alone, and bad settings named.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, DpConfig, PrivacyEngine, Trainable};
use candle_func::models::bert::BertForSequenceClassification;
use candle_func::models::gpt2::Gpt2LmHeadModel;
use candle_func::models::llama::LlamaForCausalLM;
use candle_func::models::roberta::RobertaForSequenceClassification;
use candle_func::models::Checkpoint;
use candle_func::nn::{self, Lora, LoraConfig, Module, Params};
use candle_func::rng::Rng;
use candle_func::{jit, Error, Tracer};
use common::max_diff;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Map = BTreeMap<String, Tracer>;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn load(name: &str, dir: &Path) -> Box<dyn Module> {
    let ck = Checkpoint::load(dir, DType::F32, &Device::Cpu).unwrap();
    match name {
        "bert_cls" => Box::new(BertForSequenceClassification::load(&ck).unwrap()),
        "roberta_cls" => Box::new(RobertaForSequenceClassification::load(&ck).unwrap()),
        "gpt2_lm" => Box::new(Gpt2LmHeadModel::load(&ck).unwrap()),
        _ => Box::new(LlamaForCausalLM::load(&ck).unwrap()),
    }
}

/// Each family with the layers peft's examples adapt in it.
const FAMILIES: [(&str, &[&str]); 4] = [
    ("bert_cls", &["query", "value"]),
    ("roberta_cls", &["query", "value"]),
    ("gpt2_lm", &["c_attn"]),
    ("llama_lm", &["q_proj", "v_proj"]),
];

fn ids(n: usize, t: usize) -> Tensor {
    let v: Vec<u32> = (0..n * t).map(|i| 3 + ((i * 5 + i / t) % 40) as u32).collect();
    Tensor::from_vec(v, (n, t), &Device::Cpu).unwrap()
}

/// The model's output on `ids` with the adapters applied.
fn adapted(m: &dyn Module, lora: &Lora, ids: &Tensor) -> Tensor {
    jit(|x: Tracer| m.forward_with(&Params::own().lora(lora), &x))
        .call(ids)
        .unwrap()
}

fn plain(m: &dyn Module, ids: &Tensor) -> Tensor {
    jit(|x: Tracer| m.forward(&x)).call(ids).unwrap()
}

/// The map's variables whose names `keep` accepts, by name.
fn vars(varmap: &candle_nn::VarMap, keep: impl Fn(&str) -> bool) -> BTreeMap<String, Tensor> {
    let data = varmap.data().lock().unwrap();
    data.iter()
        .filter(|(k, _)| keep(k))
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect()
}

fn randomise_b(varmap: &candle_nn::VarMap, seed: u64) {
    for (k, v) in varmap.data().lock().unwrap().iter() {
        if k.ends_with("lora_B.weight") {
            let b = common::rand(v.dims(), seed).affine(0.5, 0.0).unwrap();
            v.set(&b.to_dtype(v.dtype()).unwrap()).unwrap();
        }
    }
}

#[test]
fn adapters_start_as_the_identity_and_merge_into_the_base_names() {
    for (name, targets) in FAMILIES {
        let m = load(name, &fixture(name));
        let varmap = nn::varmap_of(m.as_ref()).unwrap();
        let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(2, 4.0, targets)).unwrap();
        assert!(!lora.layers().is_empty());
        assert!(
            lora.layers().iter().all(|l| targets.iter().any(|t| l.ends_with(t))),
            "{name}"
        );
        let x = ids(2, 5);
        let base = plain(m.as_ref(), &x);
        assert_eq!(
            max_diff(&adapted(m.as_ref(), &lora, &x), &base),
            0.0,
            "{name}: B = 0 changes the model"
        );
        // trained adapters, merged and saved under the base names, reload
        // as a plain checkpoint of the same family
        randomise_b(&varmap, 7);
        let moved = adapted(m.as_ref(), &lora, &x);
        assert!(max_diff(&moved, &base) > 1e-5, "{name}: the adapters do nothing");
        let dir = std::env::temp_dir().join(format!("candle_func_lora_{name}_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).unwrap();
        lora.save_merged(&varmap, dir.join("model.safetensors")).unwrap();
        let merged = load(name, &dir);
        let names: Vec<String> = merged.params().into_keys().collect();
        assert_eq!(
            names,
            m.params().into_keys().collect::<Vec<_>>(),
            "{name}: merged names"
        );
        let d = max_diff(&plain(merged.as_ref(), &x), &moved);
        assert!(d < 1e-5, "{name}: the merged model differs from the adapted one by {d}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn ghost_norms_of_the_adapters_equal_the_materialised_ones() {
    for (name, targets) in FAMILIES {
        let m = load(name, &fixture(name));
        let varmap = nn::varmap_of(m.as_ref()).unwrap();
        let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(3, 6.0, targets)).unwrap();
        randomise_b(&varmap, 3);
        let adapters = vars(&varmap, |k| k.contains(".lora_"));
        let loss = |p: Map, x: Tracer| {
            let y = m.forward_with(&Params::with(&p).lora(&lora), &x.unsqueeze(0)?)?;
            y.sqr()?.mean_all()
        };
        let x = ids(4, 6);
        let (g, n, _) = dp::clipped_grad_sum(loss, 0.05).call((&adapters, &x)).unwrap();
        let (g0, n0, _) = dp::clipped_grad_sum(loss, 0.05)
            .ghost(false)
            .call((&adapters, &x))
            .unwrap();
        let scale = common::max_abs(&n0);
        assert!(scale > 0.0, "{name}");
        assert!(max_diff(&n, &n0) <= 1e-5 * scale, "{name}: norms {n} vs {n0}");
        for (k, v) in &g0 {
            let d = max_diff(&g[k], v);
            assert!(d <= 1e-5 * common::max_abs(v).max(1e-3), "{name} {k}: {d}");
        }
    }
}

#[test]
fn the_dp_trainer_trains_the_adapters_and_the_head_alone() {
    let m = load("bert_cls", &fixture("bert_cls"));
    let varmap = nn::varmap_of(m.as_ref()).unwrap();
    let config = LoraConfig::new(2, 4.0, &["query", "value"]).modules_to_save(&["classifier"]);
    let lora = Lora::add(m.as_ref(), &varmap, config).unwrap();
    let before = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect::<BTreeMap<_, _>>();
    let (n, t) = (12, 6);
    let xs = ids(n, t);
    let ys = Tensor::from_vec((0..n as u32).map(|i| i % 3).collect(), n, &Device::Cpu).unwrap();
    let loss = |p: Map, (x, y): (Tracer, Tracer)| {
        let logits = m.forward_with(&Params::with(&p).lora(&lora), &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let mut trainer = PrivacyEngine::new()
        .rng(Rng::seeded(2))
        .physical_batch(4)
        .trainable(Trainable::prefixes(&lora.trainable_prefixes()))
        .make_private_examples(
            loss,
            &varmap,
            candle_func::optim::Adam::new(&varmap, 0.01).unwrap(),
            &(&xs, &ys),
            DpConfig::new(6, 1.0, 1.0),
        )
        .unwrap();
    let adapters: usize = lora.layers().len() * 2 * 2 * 32; // A [2, 32], B [32, 2]
    let head = 3 * 32 + 3;
    assert_eq!(trainer.noise_dimension().unwrap(), adapters + head);
    for _ in 0..trainer.steps_per_epoch() {
        trainer.step().unwrap();
    }
    for (k, v) in varmap.data().lock().unwrap().iter() {
        let moved = max_diff(v.as_tensor(), &before[k]) > 0.0;
        let trains = k.contains(".lora_") || k.starts_with("classifier");
        assert_eq!(moved, trains, "{k}");
    }
}

#[test]
fn an_adapter_the_loss_never_applies_is_an_error_naming_it() {
    let m = load("bert_cls", &fixture("bert_cls"));
    let varmap = nn::varmap_of(m.as_ref()).unwrap();
    let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(2, 4.0, &["query"])).unwrap();
    let xs = ids(8, 4);
    let ys = Tensor::from_vec((0..8u32).map(|i| i % 3).collect(), 8, &Device::Cpu).unwrap();
    // the forward pass forgot `.lora(&lora)`: opacus#820's silent failure
    let loss = |p: Map, (x, y): (Tracer, Tracer)| {
        let logits = m.forward_with(&Params::with(&p), &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let mut trainer = PrivacyEngine::new()
        .rng(Rng::seeded(0))
        .trainable(Trainable::prefixes(&lora.trainable_prefixes()))
        .make_private_examples(
            loss,
            &varmap,
            candle_func::optim::Sgd::new(&varmap, 0.1, 0.0).unwrap(),
            &(&xs, &ys),
            DpConfig::new(6, 1.0, 1.0),
        )
        .unwrap();
    let err = (0..5)
        .find_map(|_| trainer.step().err())
        .expect("the adapters are never reached");
    assert!(
        matches!(&err, Error::PrivacyConfig { setting, .. } if setting.contains("lora_A.weight")),
        "{err}"
    );
}

#[test]
fn bad_lora_settings_are_named() {
    let m = load("llama_lm", &fixture("llama_lm"));
    let varmap = nn::varmap_of(&*m).unwrap();
    let cases: [(LoraConfig, &str); 7] = [
        (LoraConfig::new(0, 4.0, &["q_proj"]), "LoraConfig.r"),
        (
            LoraConfig::new(2, 4.0, &["q_proj"]).dtype(DType::U32),
            "LoraConfig.dtype",
        ),
        (LoraConfig::new(2, f64::NAN, &["q_proj"]), "LoraConfig.alpha"),
        (LoraConfig::new(2, 4.0, &["q_proj"]).dropout(1.0), "LoraConfig.dropout"),
        (LoraConfig::new(2, 4.0, &[] as &[&str]), "LoraConfig.target_modules"),
        (LoraConfig::new(2, 4.0, &["query"]), "\"query\""),
        (
            LoraConfig::new(2, 4.0, &["q_proj"]).modules_to_save(&["score"]),
            "\"score\"",
        ),
    ];
    for (config, named) in cases {
        let err = Lora::add(&*m, &varmap, config).err().expect("a bad setting");
        assert!(
            matches!(err, Error::Model { .. }) && err.to_string().contains(named),
            "{named}: {err}"
        );
    }
    Lora::add(&*m, &varmap, LoraConfig::new(2, 4.0, &["q_proj"])).unwrap();
    let err = Lora::add(&*m, &varmap, LoraConfig::new(2, 4.0, &["q_proj"]))
        .err()
        .expect("twice");
    assert!(err.to_string().contains("already"), "{err}");
}

#[test]
fn adapter_dropout_runs_in_training_mode_under_the_engines_randomness() {
    let m = load("bert_cls", &fixture("bert_cls"));
    let varmap = nn::varmap_of(m.as_ref()).unwrap();
    let config = LoraConfig::new(2, 4.0, &["query"])
        .dropout(0.5)
        .modules_to_save(&["classifier"]);
    let lora = Lora::add(m.as_ref(), &varmap, config).unwrap();
    randomise_b(&varmap, 5);
    // evaluation mode (the default): no dropout, the same output each call
    let x = ids(2, 5);
    assert_eq!(
        max_diff(&adapted(m.as_ref(), &lora, &x), &adapted(m.as_ref(), &lora, &x)),
        0.0
    );
    lora.train(true);
    let xs = ids(8, 4);
    let ys = Tensor::from_vec((0..8u32).map(|i| i % 3).collect(), 8, &Device::Cpu).unwrap();
    let loss = |p: Map, (x, y): (Tracer, Tracer)| {
        let logits = m.forward_with(&Params::with(&p).lora(&lora), &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let build = |options: candle_func::Options| {
        PrivacyEngine::new()
            .rng(Rng::seeded(0))
            .options(options)
            .trainable(Trainable::prefixes(&lora.trainable_prefixes()))
            .make_private_examples(
                loss,
                &varmap,
                candle_func::optim::Sgd::new(&varmap, 0.1, 0.0).unwrap(),
                &(&xs, &ys),
                DpConfig::new(8, 1.0, 1.0),
            )
            .unwrap()
    };
    // a random operation under the trainer's vmap needs its randomness set
    let err = build(candle_func::Options::new())
        .step()
        .expect_err("dropout without randomness");
    assert!(err.to_string().to_lowercase().contains("random"), "{err}");
    let mut t = build(candle_func::Options::new().randomness(candle_func::Randomness::Different));
    t.step().unwrap();
    lora.train(false);
}

#[test]
fn merging_keeps_f64_precision_and_names_a_missing_adapter() {
    let ck = Checkpoint::load(fixture("gpt2_lm"), DType::F64, &Device::Cpu).unwrap();
    let m = Gpt2LmHeadModel::load(&ck).unwrap();
    let varmap = nn::varmap_of(&m).unwrap();
    let lora = Lora::add(&m, &varmap, LoraConfig::new(2, 4.0, &["c_attn"])).unwrap();
    randomise_b(&varmap, 9);
    let merged = lora.merged(&varmap).unwrap();
    let layer = lora.layers()[0].to_string();
    let data = varmap.data().lock().unwrap();
    let get = |k: &str| data[k].as_tensor().clone();
    let (w, a, b) = (
        get(&format!("{layer}.weight")),
        get(&format!("{layer}.lora_A.weight")),
        get(&format!("{layer}.lora_B.weight")),
    );
    // GPT-2's Conv1D weight is [in, out]: W + s (B A)^T, all in f64
    let want = (w + (b.matmul(&a).unwrap().t().unwrap() * lora.scaling()).unwrap()).unwrap();
    let got = &merged[&format!("{layer}.weight")];
    assert_eq!(got.dtype(), DType::F64);
    assert!(max_diff(got, &want) < 1e-12, "{}", max_diff(got, &want));
    drop(data);
    // a map without the adapters: an error naming the missing one
    let bare = nn::varmap_of(&m).unwrap();
    let err = lora.merged(&bare).expect_err("no adapters in the map");
    assert!(
        matches!(err, Error::Model { .. }) && err.to_string().contains("lora_A"),
        "{err}"
    );
}

#[test]
fn an_adapter_on_a_lookup_table_is_refused_naming_it() {
    // BERT's word embeddings (matched by peft's suffix rule), GPT-2's token
    // and position tables (GPT-2's head is tied to wte: the table again)
    for (name, targets, named) in [
        ("bert_cls", &["word_embeddings", "query"][..], "word_embeddings"),
        ("gpt2_lm", &["wte"][..], "wte"),
        ("gpt2_lm", &["wpe"][..], "wpe"),
        ("llama_lm", &["embed_tokens", "q_proj"][..], "embed_tokens"),
    ] {
        let m = load(name, &fixture(name));
        let varmap = nn::varmap_of(m.as_ref()).unwrap();
        let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(2, 4.0, targets)).unwrap();
        let f = |x: Tracer| m.forward_with(&Params::own().lora(&lora), &x);
        let err = jit(f).call(ids(2, 4)).unwrap_err();
        assert!(
            matches!(err, Error::Model { .. })
                && err.to_string().contains(named)
                && err.to_string().contains("lookup table"),
            "{name} {targets:?}: {err}"
        );
    }
}

#[test]
fn merging_into_a_map_without_the_base_weights_is_an_error_naming_one() {
    let m = load("bert_cls", &fixture("bert_cls"));
    let varmap = nn::varmap_of(m.as_ref()).unwrap();
    let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(2, 4.0, &["query"])).unwrap();
    // a map holding the adapters alone
    let adapters_only = candle_nn::VarMap::new();
    for (k, v) in varmap.data().lock().unwrap().iter() {
        if k.contains(".lora_") {
            adapters_only.data().lock().unwrap().insert(k.clone(), v.clone());
        }
    }
    let err = lora.merged(&adapters_only).expect_err("no base weights");
    assert!(
        matches!(err, Error::Model { .. }) && err.to_string().contains("query.weight"),
        "{err}"
    );
    // and an empty one
    let err = lora.merged(&candle_nn::VarMap::new()).expect_err("an empty map");
    assert!(err.to_string().contains("query.weight"), "{err}");
}

/// The non-private LoRA step: the gradient with respect to
/// `Lora::trainable_params` alone equals those entries of the gradient
/// with respect to every weight, an optimiser step moves the adapters and
/// leaves the base, and a map without the adapters is refused by name.
#[test]
fn a_lora_step_differentiates_the_adapters_alone() {
    use candle_func::optim::Optimizer;
    for (name, targets) in FAMILIES {
        let m = load(name, &fixture(name));
        let varmap = nn::varmap_of(m.as_ref()).unwrap();
        let lora = Lora::add(m.as_ref(), &varmap, LoraConfig::new(2, 4.0, targets)).unwrap();
        randomise_b(&varmap, 5);
        let loss = |p: Map, x: Tracer| {
            let y = m.forward_with(&Params::with(&p).lora(&lora), &x)?;
            y.sqr()?.mean_all()
        };
        let trainable = lora.trainable_params(&varmap).unwrap();
        assert_eq!(trainable.len(), 2 * lora.layers().len(), "{name}");
        assert!(trainable.keys().all(|k| k.contains(".lora_")), "{name}");
        let all = vars(&varmap, |_| true);
        let x = ids(3, 6);
        let g = candle_func::grad(loss).call((&trainable, &x)).unwrap();
        let g_all = candle_func::grad(loss).call((&all, &x)).unwrap();
        assert_eq!(g.len(), trainable.len(), "{name}: a gradient for the adapters only");
        for (k, v) in &g {
            let scale = common::max_abs(&g_all[k]).max(1e-6);
            assert!(max_diff(v, &g_all[k]) <= 1e-5 * scale, "{name} {k}");
        }
        let base_name = m.params().keys().next().unwrap().clone();
        let base = m.params()[&base_name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let a_name = trainable.keys().find(|k| k.contains("lora_A")).unwrap().clone();
        let a = trainable[&a_name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut sgd = candle_func::optim::Sgd::new(&varmap, 0.5, 0.0).unwrap();
        sgd.step(&g).unwrap();
        let moved = trainable[&a_name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_ne!(moved, a, "{name}: the map sees the stepped adapter");
        assert_eq!(
            m.params()[&base_name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            base,
            "{name}: the base is frozen"
        );
        let other = nn::varmap_of(m.as_ref()).unwrap();
        let err = lora.trainable_params(&other).unwrap_err().to_string();
        assert!(
            err.contains("lora_A.weight") || err.contains("lora_B.weight"),
            "{name}: {err}"
        );
    }
}
