//! Any `candle_nn::Optimizer` steps the trainer: `candle_nn::AdamW` and
//! `candle_nn::SGD` through `candle_func::optim::CandleOptimizer` train exactly as the
//! crate's `candle_func::optim::AdamW` and `candle_func::optim::Sgd` do, and what they cannot do (save
//! their state, step an unknown name) is an error.

use candle_core::Tensor;
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::optim::{CandleOptimizer, Optimizer};
use candle_func::rng::Rng;
use candle_func::Tracer;
use candle_nn::{Optimizer as _, VarMap};
use std::collections::BTreeMap;

mod common;
use common::max_diff;

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

use common::{two_layer_loss as loss, two_layer_model as model};

fn values(vm: &VarMap) -> BTreeMap<String, Tensor> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// Parameters after `steps` seeded private steps with optimiser `opt`.
fn train<O: Optimizer>(vm: &VarMap, opt: O, steps: usize) -> dp::PrivateTrainer<Loss, O> {
    let (xs, ys) = (common::hashed_values(1, &[40, 4]), common::hashed_values(2, &[40, 2]));
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(11))
        .physical_batch(4)
        .make_private(loss as Loss, vm, opt, (&xs, &ys), DpConfig::new(8, 0.7, 1.0))
        .unwrap();
    for _ in 0..steps {
        t.step().unwrap();
    }
    t
}

#[test]
fn candle_adamw_trains_as_dp_adamw() {
    let (ours, theirs) = (model(), model());
    train(&ours, candle_func::optim::AdamW::new(&ours, 0.01, 0.05).unwrap(), 6);
    let config = candle_nn::ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.05,
        ..Default::default()
    };
    let opt: CandleOptimizer<candle_nn::AdamW> = CandleOptimizer::new(&theirs, config).unwrap();
    let t = train(&theirs, opt, 6);
    let (a, b, start) = (values(&ours), values(&theirs), values(&model()));
    for (k, v) in &a {
        assert!(max_diff(v, &b[k]) < 1e-6, "{k}: {}", max_diff(v, &b[k]));
        assert!(max_diff(v, &start[k]) > 1e-3, "{k} did not move");
    }
    // candle's optimisers keep their state to themselves: a checkpoint is refused
    let dir = std::env::temp_dir().join(format!("candle_func_candle_optim_{}", std::process::id()));
    let e = t.save(&dir).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("state"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn candle_sgd_trains_as_dp_sgd_and_follows_the_schedule() {
    let (ours, theirs, built) = (model(), model(), model());
    let mut a = candle_func::optim::Sgd::new(&ours, 0.2, 0.0).unwrap();
    a.set_lr(0.1).unwrap();
    train(&ours, a, 4);
    // wrapped after building it over the variables by hand
    let sgd = candle_nn::SGD::new(theirs.all_vars(), 0.2).unwrap();
    let mut b = CandleOptimizer::wrap(&theirs, sgd).unwrap();
    b.set_lr(0.1).unwrap();
    assert_eq!(b.inner().learning_rate(), 0.1);
    assert!(b.set_lr(f64::NAN).is_err() && b.set_lr(-1.0).is_err());
    train(&theirs, b, 4);
    // built by the wrapper
    let mut c: CandleOptimizer<candle_nn::SGD> = CandleOptimizer::new(&built, 0.2).unwrap();
    c.set_lr(0.1).unwrap();
    train(&built, c, 4);
    let (x, y, z) = (values(&ours), values(&theirs), values(&built));
    for (k, v) in &x {
        assert!(max_diff(v, &y[k]) < 1e-6 && max_diff(v, &z[k]) < 1e-6, "{k}");
    }
}

#[test]
fn an_unknown_or_misshapen_gradient_is_refused() {
    let vm = model();
    let mut opt: CandleOptimizer<candle_nn::SGD> = CandleOptimizer::new(&vm, 0.1).unwrap();
    let g = |shape: &[usize]| Tensor::zeros(shape, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let e = opt
        .step(&BTreeMap::from([("nope".to_string(), g(&[2]))]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    let e = opt
        .step(&BTreeMap::from([("l.bias".to_string(), g(&[4]))]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("l.bias") && e.contains("[3]") && e.contains("[4]"), "{e}");
}
