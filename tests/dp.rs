//! DP helpers: clipping bounds every per-sample norm and leaves small ones
//! alone, the noise has the promised mean and variance, Poisson sampling
//! and SGD behave, the accountant matches Opacus (in the module's unit
//! tests), and a short end-to-end DP-SGD run on the shipped digits lowers
//! the loss.

mod common;
#[path = "../examples/common/digits.rs"]
mod digits;

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{self, accountant::Accountant};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{grad, vmap, Tracer};
use common::rand;
use std::collections::BTreeMap;

fn grads(seed: u64, scale: f64) -> BTreeMap<String, Tensor> {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), (rand(&[16, 3, 4], seed) * scale).unwrap());
    g.insert("b".to_string(), (rand(&[16, 5], seed + 1) * scale).unwrap());
    g
}

#[test]
fn clipping_bounds_norms_and_keeps_small_gradients() {
    let big = grads(1, 10.0);
    let norms = dp::norm_per_sample(&big).unwrap().to_vec1::<f32>().unwrap();
    assert!(norms.iter().all(|&n| n > 1.0), "{norms:?}");
    let clipped = dp::clip_per_sample(&big, 1.0).unwrap();
    for n in dp::norm_per_sample(&clipped).unwrap().to_vec1::<f32>().unwrap() {
        assert!(n <= 1.0 + 1e-5, "norm {n} above the bound");
        assert!(n > 0.999, "clipped to the bound, got {n}");
    }
    let small = grads(2, 0.01);
    let kept = dp::clip_per_sample(&small, 1.0).unwrap();
    for (k, g) in &small {
        common::assert_close(&kept[k], g, 1e-6, "below the bound: unchanged");
    }
    // per-sample norms agree with a direct computation
    let direct: Vec<f32> = (0..16)
        .map(|i| {
            let s: f32 = big
                .values()
                .map(|g| {
                    g.get(i)
                        .unwrap()
                        .sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                })
                .sum();
            s.sqrt()
        })
        .collect();
    for (a, b) in norms.iter().zip(direct) {
        assert!((a - b).abs() < 1e-3 * b, "{a} vs {b}");
    }
}

#[test]
fn noise_has_the_promised_mean_and_variance() {
    // zero gradients: what privatize returns is noise / expected batch
    let mut zero = BTreeMap::new();
    zero.insert(
        "w".to_string(),
        Tensor::zeros((4, 50_000), DType::F32, &Device::Cpu).unwrap(),
    );
    let (c, sigma, b) = (2.0, 1.5, 10.0);
    let mut rng = Rng::seeded(3);
    let out = dp::privatize(&zero, c, sigma, b, &mut rng).unwrap();
    let v = out["w"].to_dtype(DType::F64).unwrap();
    let n = v.elem_count() as f64;
    let mean = v.mean_all().unwrap().to_scalar::<f64>().unwrap();
    let var = v.sqr().unwrap().mean_all().unwrap().to_scalar::<f64>().unwrap() - mean * mean;
    let want_std = sigma * c / b;
    assert!(mean.abs() < 5.0 * want_std / n.sqrt(), "mean {mean}");
    assert!(
        (var.sqrt() / want_std - 1.0).abs() < 0.02,
        "std {} vs {want_std}",
        var.sqrt()
    );
    // seeded: the same seed gives the same noise
    let again = dp::privatize(&zero, c, sigma, b, &mut Rng::seeded(3)).unwrap();
    common::assert_close(&again["w"], &out["w"], 0.0, "seeded noise");
}

#[test]
fn sgd_with_momentum_follows_pytorch() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let w = vb.get_with_hints(3, "w", candle_nn::Init::Const(1.0)).unwrap();
    let mut opt = candle_func::optim::Sgd::new(&vm, 0.1, 0.9).unwrap();
    let mut g = BTreeMap::new();
    g.insert("w".to_string(), Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap());
    opt.step(&g).unwrap(); // v = g; w = 1 - 0.1 g
    opt.step(&g).unwrap(); // v = 0.9 g + g; w -= 0.1 * 1.9 g
    let want: Vec<f32> = [1f32, 2., 3.].iter().map(|g| 1.0 - 0.1 * g - 0.19 * g).collect();
    let got = w.to_vec1::<f32>().unwrap();
    for (a, b) in got.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{got:?}");
    }
    let mut bad = BTreeMap::new();
    bad.insert("nope".to_string(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap());
    assert!(opt.step(&bad).is_err());
}

/// Adam against PyTorch's update written out (bias-corrected moments,
/// betas 0.9 and 0.999, eps 1e-8) over three steps of changing gradients,
/// and a gradient of the wrong name or shape is an error.
#[test]
fn adam_follows_pytorch() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
    let w = vb.get_with_hints(2, "w", candle_nn::Init::Const(0.5)).unwrap();
    let mut opt = candle_func::optim::Adam::new(&vm, 0.01).unwrap();
    let (mut m, mut v, mut want) = ([0f64; 2], [0f64; 2], [0.5f64; 2]);
    for (t, g) in [[1.0f64, -2.0], [0.5, 3.0], [-1.0, 0.1]].iter().enumerate() {
        let mut grads = BTreeMap::new();
        grads.insert("w".to_string(), Tensor::new(g, &Device::Cpu).unwrap());
        opt.step(&grads).unwrap();
        let t = t as i32 + 1;
        for i in 0..2 {
            m[i] = 0.9 * m[i] + 0.1 * g[i];
            v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - 0.9f64.powi(t)), v[i] / (1.0 - 0.999f64.powi(t)));
            want[i] -= 0.01 * mh / (vh.sqrt() + 1e-8);
        }
        let got = w.to_vec1::<f64>().unwrap();
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "step {t}: {got:?} vs {want:?}");
        }
    }
    opt.set_lr(0.0).unwrap();
    assert_eq!(opt.lr(), 0.0);
    let mut bad = BTreeMap::new();
    bad.insert("nope".to_string(), Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap());
    assert!(opt.step(&bad).is_err());
    bad.clear();
    bad.insert("w".to_string(), Tensor::zeros(3, DType::F64, &Device::Cpu).unwrap());
    assert!(opt.step(&bad).is_err());
}

#[test]
fn a_short_dp_sgd_run_lowers_the_loss() {
    let dev = Device::Cpu;
    let all = digits::load(&dev).unwrap();
    let (train, _) = digits::split(&all).unwrap();
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let model = nn::seq().add(nn::Flatten).add(nn::linear(64, 10, vb.pp("fc")).unwrap());
    let params = model.params();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(
            &functional_call(&model, &p, &x.unsqueeze(0)?)?,
            &y.unsqueeze(0)?,
            Reduction::Mean,
        )
    };
    let per_sample = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]);
    let mean_loss = || {
        let logits = model.forward_eager(&train.images).unwrap();
        candle_nn::loss::cross_entropy(&logits, &train.labels)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let before = mean_loss();
    let (n, q, sigma, c) = (train.len(), 64.0 / train.len() as f64, 1.0, 1.0);
    let mut rng = Rng::seeded(1);
    let mut opt = candle_func::optim::Sgd::new(&vm, 1.0, 0.5).unwrap();
    let mut acct = Accountant::default();
    for _ in 0..60 {
        let idx = rng.poisson_sample(n, q);
        if idx.is_empty() {
            continue;
        }
        let b = train.select(&idx).unwrap();
        let g = per_sample.call((&params, &b.images, &b.labels)).unwrap();
        opt.step(&dp::privatize(&g, c, sigma, 64.0, &mut rng).unwrap()).unwrap();
        acct.step(sigma, q).unwrap();
    }
    let after = mean_loss();
    assert!(after < 0.8 * before, "loss {before} -> {after}");
    let eps = acct.epsilon(1e-5).unwrap();
    assert!(eps.is_finite() && eps > 0.0, "epsilon {eps}");
}
