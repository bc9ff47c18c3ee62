//! DP fine-tuning as it is done: examples that are trees of tensors, a
//! trainable subset of the parameters (the rest frozen as constants),
//! parameter groups, and the engine's options passed to its inner `vmap`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{DpConfig, PrivacyEngine, Trainable};
use candle_func::nn::{self, Module, Params};
use candle_func::rng::Rng;
use candle_func::{Error, Options, Schedule, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

type Map = BTreeMap<String, Tracer>;

/// A bag-of-embeddings text classifier: `emb` [V, 6] -> masked mean ->
/// `hidden` 6 -> 5 -> tanh -> `head` 5 -> 3.
struct Text {
    emb: nn::Embedding,
    hidden: nn::Linear,
    head: nn::Linear,
}

fn text_model() -> (VarMap, Text) {
    let vm = VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let m = Text {
        emb: nn::embedding(20, 6, vb.pp("emb")).unwrap(),
        hidden: nn::linear(6, 5, vb.pp("hidden")).unwrap(),
        head: nn::linear(5, 3, vb.pp("head")).unwrap(),
    };
    (vm, m)
}

impl Text {
    /// One example's loss from its ids [T], mask [T] (f32) and label [].
    fn loss(&self, p: &Map, ids: &Tracer, mask: &Tracer, y: &Tracer) -> candle_func::Result<Tracer> {
        let p = Params::with(p);
        let h = self.emb.forward_with(&p, ids)?; // T 6
        let pooled = h.broadcast_mul(&mask.unsqueeze(1)?)?.sum_keepdim(0)?; // 1 6
        let pooled = pooled.broadcast_div(&mask.sum_all()?.affine(1.0, 1e-6)?)?;
        let z = self.hidden.forward_with(&p, &pooled)?.tanh()?;
        let logits = self.head.forward_with(&p, &z)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    }
}

/// `n` examples of `t` tokens: ids, a 0/1 mask with 2 to `t` real tokens,
/// labels.
fn text_data(n: usize, t: usize) -> (Tensor, Tensor, Tensor) {
    let ids: Vec<u32> = (0..n * t).map(|i| ((i * 7 + i / t) % 20) as u32).collect();
    let mask: Vec<f32> = (0..n * t)
        .map(|i| f32::from(u8::from(i % t < 2 + (i / t) % (t - 1))))
        .collect();
    let dev = Device::Cpu;
    (
        Tensor::from_vec(ids, (n, t), &dev).unwrap(),
        Tensor::from_vec(mask, (n, t), &dev).unwrap(),
        Tensor::from_vec((0..n as u32).map(|i| i % 3).collect(), n, &dev).unwrap(),
    )
}

fn values(vm: &VarMap) -> BTreeMap<String, Vec<f32>> {
    let data = vm.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

fn copy_of(vm: &VarMap) -> VarMap {
    let out = VarMap::new();
    for (k, v) in vm.data().lock().unwrap().iter() {
        let t = v.as_tensor().copy().unwrap();
        out.data()
            .lock()
            .unwrap()
            .insert(k.clone(), candle_core::Var::from_tensor(&t).unwrap());
    }
    out
}

#[test]
fn a_tree_of_examples_trains_as_the_same_data_packed_into_xs_and_ys() {
    let (ids, mask, ys) = text_data(30, 5);
    let (vm_tree, m) = text_model();
    let vm_packed = copy_of(&vm_tree);
    // the tree: (ids, mask, label), one example's each
    let tree_loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let data = (&ids, &mask, &ys);
    let mut tree = PrivacyEngine::new()
        .rng(Rng::seeded(3))
        .physical_batch(4)
        .make_private_examples(
            tree_loss,
            &vm_tree,
            candle_func::optim::Sgd::new(&vm_tree, 0.5, 0.0).unwrap(),
            &data,
            DpConfig::new(8, 0.7, 0.3),
        )
        .unwrap();
    // the same examples packed by hand: ids and mask as f32 [N, 2, T]
    let xs = Tensor::stack(&[ids.to_dtype(DType::F32).unwrap(), mask.clone()], 1).unwrap();
    let packed_loss = |p: Map, x: Tracer, y: Tracer| {
        let ids = x.narrow(0, 0, 1)?.squeeze(0)?.to_dtype(DType::U32)?;
        let mask = x.narrow(0, 1, 1)?.squeeze(0)?;
        m.loss(&p, &ids, &mask, &y)
    };
    let mut packed = PrivacyEngine::new()
        .rng(Rng::seeded(3))
        .physical_batch(4)
        .make_private(
            packed_loss,
            &vm_packed,
            candle_func::optim::Sgd::new(&vm_packed, 0.5, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::new(8, 0.7, 0.3),
        )
        .unwrap();
    for _ in 0..3 {
        let (a, b) = (tree.step().unwrap(), packed.step().unwrap());
        assert_eq!(a.batch_size, b.batch_size);
        assert!(
            (a.mean_loss - b.mean_loss).abs() < 1e-5,
            "{} vs {}",
            a.mean_loss,
            b.mean_loss
        );
    }
    let (a, b) = (values(&vm_tree), values(&vm_packed));
    for (k, v) in &a {
        let d = v.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "{k}: the tree and the packed form differ by {d}");
    }
    assert_eq!(tree.traced_signatures(), 1);
}

#[test]
fn a_map_of_named_examples_is_a_tree_too() {
    let (ids, mask, ys) = text_data(16, 4);
    let (vm, m) = text_model();
    let data: BTreeMap<String, Tensor> = [("ids", ids), ("mask", mask), ("label", ys)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let loss = |p: Map, ex: Map| m.loss(&p, &ex["ids"], &ex["mask"], &ex["label"]);
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(0))
        .make_private_examples(
            loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
            &data,
            DpConfig::new(4, 1.0, 1.0),
        )
        .unwrap();
    let info = t.step().unwrap();
    assert!(info.batch_size == 0 || info.mean_loss.is_finite());
}

#[test]
fn examples_of_different_counts_are_an_error_naming_them() {
    let (ids, mask, ys) = text_data(10, 4);
    let (vm, m) = text_model();
    let short = ys.narrow(0, 0, 9).unwrap();
    let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
    let err = PrivacyEngine::new()
        .make_private_examples(loss, &vm, sgd, &(&ids, &mask, &short), DpConfig::new(4, 1.0, 1.0))
        .err()
        .expect("10, 10 and 9 examples");
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Shape { .. }) && msg.contains("[10, 4]") && msg.contains("[9]"),
        "{msg}"
    );
}

#[test]
fn frozen_parameters_stay_put_and_only_the_trainable_ones_are_noised() {
    let (ids, mask, ys) = text_data(24, 5);
    let (vm, m) = text_model();
    let before = values(&vm);
    let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(1))
        .trainable(Trainable::prefixes(&["head", "hidden.weight"]))
        .make_private_examples(
            loss,
            &vm,
            candle_func::optim::Adam::new(&vm, 0.05).unwrap(),
            &(&ids, &mask, &ys),
            DpConfig::new(6, 1.0, 1.0),
        )
        .unwrap();
    assert_eq!(t.trainable_names(), ["head.bias", "head.weight", "hidden.weight"]);
    assert_eq!(t.noise_dimension().unwrap(), 3 + 15 + 30);
    for _ in 0..3 {
        t.step().unwrap();
    }
    let after = values(&vm);
    for (k, v) in &before {
        let moved = *v != after[k];
        let trains = t.trainable_names().contains(k);
        assert_eq!(moved, trains, "{k}: moved {moved}, trains {trains}");
    }
}

#[test]
fn freezing_equals_training_a_map_of_the_trainable_parameters_alone() {
    // the same step computed with the frozen ones baked into the loss by hand
    let (ids, mask, ys) = text_data(24, 5);
    let (vm, m) = text_model();
    let trained = VarMap::new();
    for (k, v) in vm.data().lock().unwrap().iter().filter(|(k, _)| k.starts_with("head")) {
        let t = v.as_tensor().copy().unwrap();
        trained
            .data()
            .lock()
            .unwrap()
            .insert(k.clone(), candle_core::Var::from_tensor(&t).unwrap());
    }
    let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let data = (&ids, &mask, &ys);
    let config = DpConfig::new(6, 0.8, 0.5);
    let mut frozen = PrivacyEngine::new()
        .rng(Rng::seeded(9))
        .trainable(Trainable::except(&["emb", "hidden"]))
        .make_private_examples(
            loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.3, 0.9).unwrap(),
            &data,
            config.clone(),
        )
        .unwrap();
    // the model's own tensors are the frozen values: Params falls back to them
    let mut alone = PrivacyEngine::new()
        .rng(Rng::seeded(9))
        .make_private_examples(
            loss,
            &trained,
            candle_func::optim::Sgd::new(&trained, 0.3, 0.9).unwrap(),
            &data,
            config,
        )
        .unwrap();
    for _ in 0..3 {
        frozen.step().unwrap();
        alone.step().unwrap();
    }
    let (a, b) = (values(&vm), values(&trained));
    for (k, v) in &b {
        assert_eq!(*v, a[k], "{k}");
    }
}

#[test]
fn a_prefix_that_matches_nothing_or_a_parameter_never_reached_is_an_error_naming_it() {
    let (ids, mask, ys) = text_data(12, 4);
    let (vm, m) = text_model();
    let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let data = (&ids, &mask, &ys);
    let engine = |t: Trainable| PrivacyEngine::new().rng(Rng::seeded(0)).trainable(t);
    let sgd = || candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
    let err = engine(Trainable::prefixes(&["head", "clasifier"]))
        .make_private_examples(loss, &vm, sgd(), &data, DpConfig::new(4, 1.0, 1.0))
        .err()
        .expect("a misspelt prefix");
    assert!(
        matches!(&err, Error::PrivacyConfig { setting, .. } if setting.contains("\"clasifier\"")),
        "{err}"
    );
    let err = engine(Trainable::matching(|n| n.starts_with("nothing")))
        .make_private_examples(loss, &vm, sgd(), &data, DpConfig::new(4, 1.0, 1.0))
        .err()
        .expect("nothing to train");
    assert!(err.to_string().contains("at least one parameter"), "{err}");
    // a loss that skips the hidden layer never reaches its parameters
    let skips = |p: Map, (ids, _mask, y): (Tracer, Tracer, Tracer)| {
        let p = Params::with(&p);
        let h = m.emb.forward_with(&p, &ids)?.narrow(1, 0, 5)?.sum_keepdim(0)?;
        let logits = m.head.forward_with(&p, &h)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let mut t = engine(Trainable::all())
        .make_private_examples(skips, &vm, sgd(), &data, DpConfig::new(6, 1.0, 1.0))
        .unwrap();
    let err = (0..5)
        .find_map(|_| t.step().err())
        .expect("the hidden layer is never reached");
    assert!(
        matches!(&err, Error::PrivacyConfig { setting, .. } if setting.contains("hidden.bias")),
        "{err}"
    );
    assert!(err.to_string().contains("never reached"), "{err}");
}

#[test]
fn a_checkpoint_becomes_a_trainable_varmap_in_one_call() {
    let (_, m) = text_model();
    let vm = nn::varmap_of(&m.hidden).unwrap();
    let names: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
    assert_eq!(names.len(), 2);
    let own = m.hidden.params();
    for (k, v) in vm.data().lock().unwrap().iter() {
        assert_eq!(common::max_diff(v.as_tensor(), &own[k]), 0.0, "{k}");
    }
}

#[test]
fn a_checkpoint_loaded_as_variables_shares_its_weights_with_the_varmap() {
    use candle_func::models::{bert::BertForSequenceClassification, Checkpoint};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/bert_cls");
    let ck = Checkpoint::load(&dir, DType::F32, &Device::Cpu)
        .unwrap()
        .into_variables()
        .unwrap();
    let m = BertForSequenceClassification::load(&ck).unwrap();
    let vm = nn::varmap_of(&m).unwrap();
    let name = "classifier.weight";
    let var = vm.data().lock().unwrap()[name].clone();
    var.set(&var.as_tensor().affine(2.0, 0.0).unwrap()).unwrap();
    // one copy: the model's own weight moved with the variable
    assert_eq!(common::max_diff(&m.params()[name], var.as_tensor()), 0.0);
    // without into_variables the map holds copies
    let plain =
        BertForSequenceClassification::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let copies = nn::varmap_of(&plain).unwrap();
    let var = copies.data().lock().unwrap()[name].clone();
    var.set(&var.as_tensor().affine(2.0, 1.0).unwrap()).unwrap();
    assert!(common::max_diff(&plain.params()[name], var.as_tensor()) > 0.0);
}

#[test]
fn parameter_groups_step_with_their_own_rate_and_decay() {
    // one plain step of each optimiser with a group against the formula
    let dev = Device::Cpu;
    for kind in ["sgd", "adam", "adamw"] {
        let vm = VarMap::new();
        let w = Tensor::new(&[1f32, -2.], &dev).unwrap();
        for name in ["body.w", "head.w"] {
            vm.data()
                .lock()
                .unwrap()
                .insert(name.into(), candle_core::Var::from_tensor(&w.copy().unwrap()).unwrap());
        }
        let g = Tensor::new(&[0.5f32, 0.25], &dev).unwrap();
        let grads: BTreeMap<String, Tensor> =
            [("body.w".to_string(), g.clone()), ("head.w".to_string(), g.clone())].into();
        let (lr, glr, gwd) = (0.1, 0.3, 0.2);
        let mut opt: Box<dyn candle_func::optim::Optimizer> = match kind {
            "sgd" => Box::new(
                candle_func::optim::Sgd::new(&vm, lr, 0.0)
                    .unwrap()
                    .group("head", glr, gwd)
                    .unwrap(),
            ),
            "adam" => Box::new(
                candle_func::optim::Adam::new(&vm, lr)
                    .unwrap()
                    .group("head", glr, gwd)
                    .unwrap(),
            ),
            _ => Box::new(
                candle_func::optim::AdamW::new(&vm, lr, 0.0)
                    .unwrap()
                    .group("head", glr, gwd)
                    .unwrap(),
            ),
        };
        opt.step(&grads).unwrap();
        let v = values(&vm);
        let (w0, g0) = (1f32, 0.5f32);
        // the first Adam step moves by lr * sign(g) (up to eps)
        let (body, head) = match kind {
            "sgd" => (w0 - 0.1 * g0, w0 - 0.3 * (g0 + 0.2 * w0)),
            "adam" => (w0 - 0.1, w0 - 0.3),
            _ => (w0 - 0.1, w0 * (1.0 - 0.3 * 0.2) - 0.3),
        };
        assert!(
            (v["body.w"][0] - body).abs() < 1e-5,
            "{kind} body {} vs {body}",
            v["body.w"][0]
        );
        assert!(
            (v["head.w"][0] - head).abs() < 1e-5,
            "{kind} head {} vs {head}",
            v["head.w"][0]
        );
        // a schedule scales every group alike
        opt.set_lr(0.05).unwrap();
        assert_eq!(opt.lr(), 0.05);
    }
    let vm = VarMap::new();
    vm.data()
        .lock()
        .unwrap()
        .insert("a.w".into(), candle_core::Var::zeros(2, DType::F32, &dev).unwrap());
    let err = candle_func::optim::AdamW::new(&vm, 0.1, 0.0)
        .unwrap()
        .group("b", 0.1, 0.0)
        .expect_err("no such prefix");
    assert!(err.to_string().contains("\"b\""), "{err}");
    let err = candle_func::optim::Sgd::new(&vm, 0.1, 0.0)
        .unwrap()
        .group("a", f64::NAN, 0.0)
        .expect_err("a NaN rate");
    assert!(err.to_string().contains("lr"), "{err}");
}

#[test]
fn the_engine_passes_schedule_chunk_size_and_randomness_to_its_vmap() {
    let (ids, mask, ys) = text_data(20, 4);
    let (vm0, m) = text_model();
    let loss = |p: Map, (ids, mask, y): (Tracer, Tracer, Tracer)| m.loss(&p, &ids, &mask, &y);
    let data = (&ids, &mask, &ys);
    let run = |options: Options| {
        let vm = copy_of(&vm0);
        let mut t = PrivacyEngine::new()
            .rng(Rng::seeded(4))
            .physical_batch(4)
            .options(options)
            .make_private_examples(
                loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.5, 0.0).unwrap(),
                &data,
                DpConfig::new(6, 0.5, 0.2),
            )
            .unwrap();
        for _ in 0..2 {
            t.step().unwrap();
        }
        values(&vm)
    };
    let batched = run(Options::new());
    for options in [
        Options::new().schedule(Schedule::PerExample),
        Options::new().chunk_size(3),
    ] {
        let other = run(options);
        for (k, v) in &batched {
            let d = v.iter().zip(&other[k]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "{options:?} {k}: {d}");
        }
    }
}
