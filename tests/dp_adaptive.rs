//! Adaptive clipping (Andrew et al. 2021): the bound's geometric update,
//! the flat step it equals at the current bound, its convergence to the
//! target quantile, its noise split and its accounting.

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, AdaptiveClipping, DpConfig, PrivacyEngine};
use candle_func::rng::Rng;
use candle_func::{nn, Error, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

type Map = BTreeMap<String, Tracer>;

fn model(seed: u64) -> VarMap {
    let vm = VarMap::new();
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(seed);
    let w: Vec<f32> = (0..12).map(|_| rng.normal() as f32).collect();
    let w = Tensor::from_vec(w, (3, 4), &dev).unwrap();
    vm.data()
        .lock()
        .unwrap()
        .insert("fc.weight".into(), candle_core::Var::from_tensor(&w).unwrap());
    vm
}

fn loss(p: Map, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let logits = x.unsqueeze(0)?.matmul(&p["fc.weight"].t()?)?;
    nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
}

/// Examples whose gradient norms spread over an order of magnitude.
fn data(n: usize) -> (Tensor, Tensor) {
    let mut rng = Rng::seeded(11);
    let xs: Vec<f32> = (0..n * 4)
        .map(|i| (rng.normal() * (1.0 + (i / 4) as f64 * 0.2)) as f32)
        .collect();
    let dev = Device::Cpu;
    (
        Tensor::from_vec(xs, (n, 4), &dev).unwrap(),
        Tensor::from_vec((0..n as u32).map(|i| i % 3).collect(), n, &dev).unwrap(),
    )
}

fn values(vm: &VarMap) -> Vec<f32> {
    vm.data().lock().unwrap()["fc.weight"]
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn norms(vm: &VarMap, xs: &Tensor, ys: &Tensor) -> Vec<f64> {
    let p: BTreeMap<String, Tensor> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let (n, _) = dp::per_sample_grad_norms(loss as fn(_, _, _) -> _)
        .call((&p, xs, ys))
        .unwrap();
    n.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

#[test]
fn without_noise_a_step_is_the_flat_step_at_the_bound_and_the_bound_moves_geometrically() {
    let (xs, ys) = data(20);
    let spec = AdaptiveClipping::new(0.8, 0.5);
    let (adaptive, flat) = (model(1), model(1));
    // the whole data set every step (q = 1): the count is known
    let mut a = PrivacyEngine::new()
        .rng(Rng::seeded(0))
        .physical_batch(6)
        .make_private(
            loss as fn(_, _, _) -> _,
            &adaptive,
            candle_func::optim::Sgd::new(&adaptive, 0.5, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::adaptive(20, 0.0, spec.clone()),
        )
        .unwrap();
    let mut c = 0.8;
    for step in 0..4 {
        let before = norms(&adaptive, &xs, &ys);
        let mut f = PrivacyEngine::new()
            .rng(Rng::seeded(0))
            .physical_batch(6)
            .make_private(
                loss as fn(_, _, _) -> _,
                &flat,
                candle_func::optim::Sgd::new(&flat, 0.5, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::new(20, 0.0, c),
            )
            .unwrap();
        let (ia, iff) = (a.step().unwrap(), f.step().unwrap());
        assert_eq!(ia.clip_bound, c, "step {step}");
        assert!(
            (ia.mean_loss - iff.mean_loss).abs() < 1e-6,
            "step {step}: {} vs {}",
            ia.mean_loss,
            iff.mean_loss
        );
        assert!((ia.clipped_fraction - iff.clipped_fraction).abs() < 1e-12);
        let d = values(&adaptive)
            .iter()
            .zip(values(&flat))
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            d < 1e-5,
            "step {step}: the adaptive step differs from the flat one by {d}"
        );
        let unclipped = before.iter().filter(|&&v| v <= c).count() as f64;
        c *= (-0.2 * (unclipped / 20.0 - 0.5)).exp();
        assert!(
            (a.clip_bound() - c).abs() < 1e-9 * c,
            "step {step}: bound {} vs {c}",
            a.clip_bound()
        );
    }
}

#[test]
fn the_bound_settles_at_the_target_quantile_of_the_norms() {
    let (xs, ys) = data(40);
    let vm = model(2);
    let norms = norms(&vm, &xs, &ys);
    for target in [0.2, 0.5, 0.9] {
        let mut spec = AdaptiveClipping::new(10.0, target);
        spec.learning_rate = 0.3;
        // lr 0: the parameters, and so the norms, stay as they are
        let mut t = PrivacyEngine::new()
            .rng(Rng::seeded(5))
            .make_private(
                loss as fn(_, _, _) -> _,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.0, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::adaptive(40, 0.0, spec),
            )
            .unwrap();
        for _ in 0..80 {
            t.step().unwrap();
        }
        let c = t.clip_bound();
        let below = norms.iter().filter(|&&v| v <= c).count() as f64 / norms.len() as f64;
        assert!(
            (below - target).abs() <= 0.1,
            "target {target}: the bound {c} leaves {below} unclipped"
        );
    }
}

#[test]
fn the_count_takes_its_share_of_the_noise_and_the_accountant_records_sigma() {
    let (xs, ys) = data(50);
    let run = |config: DpConfig| {
        let vm = model(3);
        let mut t = PrivacyEngine::new()
            .rng(Rng::seeded(8))
            .make_private(
                loss as fn(_, _, _) -> _,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&xs, &ys),
                config,
            )
            .unwrap();
        for _ in 0..5 {
            t.step().unwrap();
        }
        t.epsilon(1e-5).unwrap()
    };
    let adaptive = run(DpConfig::adaptive(40, 1.0, AdaptiveClipping::new(1.0, 0.5)));
    let flat = run(DpConfig::new(40, 1.0, 1.0));
    assert_eq!(adaptive, flat, "the same σ, q and steps spend the same ε");
    // σ_b must exceed σ / 2, else the gradient's share is not defined
    let mut spec = AdaptiveClipping::new(1.0, 0.5);
    spec.count_noise_std = Some(0.4);
    let vm = model(3);
    let refusal = |spec: AdaptiveClipping, why: &str| {
        let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
        let config = DpConfig::adaptive(10, 1.0, spec);
        let made = PrivacyEngine::new().make_private(loss as fn(_, _, _) -> _, &vm, sgd, (&xs, &ys), config);
        made.err().expect(why)
    };
    let err = refusal(spec, "σ_b = 0.4 < σ / 2 = 0.5");
    assert!(
        matches!(&err, Error::PrivacyConfig { setting, .. } if setting.contains("count_noise_std")),
        "{err}"
    );
    for (field, spec) in [
        (
            "target_quantile",
            AdaptiveClipping {
                target_quantile: 1.5,
                ..AdaptiveClipping::new(1.0, 0.5)
            },
        ),
        ("initial_bound", AdaptiveClipping::new(-1.0, 0.5)),
        (
            "max_bound",
            AdaptiveClipping {
                max_bound: 1e-9,
                ..AdaptiveClipping::new(1.0, 0.5)
            },
        ),
    ] {
        let err = refusal(spec, "a bad setting");
        assert!(err.to_string().contains(field), "{field}: {err}");
    }
}
