//! `dp::PrivacyEngine` and its trainer: one step equals the materialised
//! DP-SGD step (Poisson batch, clipping, mean, update) whatever the
//! physical batch size, per-layer clipping clips each group, the noise has
//! the promised scale, a new Poisson size never traces again, the
//! optimisers follow PyTorch's formulas, and bad input is refused.

use candle_core::{DType, Device, Tensor};
use candle_func::dp::accountant::{noise_multiplier, Accountant, Mechanism};
use candle_func::dp::{self, Clipping, DpConfig, PrivacyEngine};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{grad, vmap, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

mod common;
use common::{max_diff, OneRank};

type Params = BTreeMap<String, Tensor>;
type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

fn values(seed: u64, shape: &[usize]) -> Tensor {
    common::hashed_values(seed, shape)
}

use common::{two_layer_loss as loss, two_layer_model as model};

fn data(n: usize) -> (Tensor, Tensor) {
    (values(1, &[n, 4]), values(2, &[n, 2]))
}

fn current(vm: &VarMap) -> Params {
    let data = vm.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// The first Poisson batch a trainer seeded with `seed` draws.
fn first_batch((xs, ys): (&Tensor, &Tensor), seed: u64, batch: usize) -> (Tensor, Tensor) {
    let n = xs.dims()[0];
    let idx = Rng::seeded(seed).poisson_sample(n, batch as f64 / n as f64);
    let ids = Tensor::from_vec(
        idx.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        idx.len(),
        &Device::Cpu,
    )
    .unwrap();
    (xs.index_select(&ids, 0).unwrap(), ys.index_select(&ids, 0).unwrap())
}

/// The materialised step: the same Poisson batch (the same seeded
/// generator's first draw), per-sample gradients, each group clipped,
/// summed, divided by `q N`, one SGD step of `lr`.
fn reference(
    before: &Params,
    (xs, ys): (&Tensor, &Tensor),
    seed: u64,
    batch: usize,
    groups: &[(&str, f64)],
    lr: f64,
) -> Params {
    let n = xs.dims()[0];
    let q = batch as f64 / n as f64;
    let (bx, by) = first_batch((xs, ys), seed, batch);
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((before, &bx, &by))
        .unwrap();
    let mut out = Params::new();
    for &(prefix, c) in groups {
        let group: Params = per
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, g) in dp::clip_per_sample(&group, c).unwrap() {
            let step = (g.sum(0).unwrap() * (lr / (q * n as f64))).unwrap();
            out.insert(k.clone(), (&before[&k] - step).unwrap());
        }
    }
    out
}

fn trainer(
    vm: &VarMap,
    d: (&Tensor, &Tensor),
    physical: usize,
    config: DpConfig,
    seed: u64,
) -> dp::PrivateTrainer<Loss, candle_func::optim::Sgd> {
    PrivacyEngine::new()
        .rng(Rng::seeded(seed))
        .physical_batch(physical)
        .make_private(
            loss as fn(_, _, _) -> _,
            vm,
            candle_func::optim::Sgd::new(vm, 0.1, 0.0).unwrap(),
            d,
            config,
        )
        .unwrap()
}

/// `engine.make_private_with_epsilon` for `loss` over `vm` with SGD.
fn with_epsilon(
    engine: PrivacyEngine,
    vm: &VarMap,
    d: (&Tensor, &Tensor),
    batch: usize,
    target: (f64, f64, f64),
) -> candle_func::Result<dp::PrivateTrainer<Loss, candle_func::optim::Sgd>> {
    let sgd = candle_func::optim::Sgd::new(vm, 0.1, 0.0)?;
    engine.make_private_with_epsilon(loss as Loss, vm, sgd, d, DpConfig::new(batch, 0.0, 1.0), target)
}

#[test]
fn one_step_equals_the_materialised_step_for_any_physical_batch() {
    let (xs, ys) = data(60);
    for physical in [1, 4, 7, 64] {
        let vm = model();
        let before = current(&vm);
        let mut t = trainer(&vm, (&xs, &ys), physical, DpConfig::new(12, 0.0, 0.5), 5);
        let info = t.step().unwrap();
        assert!(info.batch_size > 0 && info.passes == info.batch_size.div_ceil(physical));
        assert!(info.mean_loss.is_finite() && (0.0..=1.0).contains(&info.clipped_fraction));
        let want = reference(&before, (&xs, &ys), 5, 12, &[("", 0.5)], 0.1);
        let got = current(&vm);
        for (k, w) in &want {
            let d = max_diff(&got[k], w);
            assert!(d < 1e-5, "physical {physical}, {k}: {d}");
            // The step moved the weights.
            assert!(max_diff(&got[k], &before[k]) > 1e-4, "{k}");
        }
    }
}

#[test]
fn per_layer_clipping_clips_each_group() {
    let (xs, ys) = data(40);
    let vm = model();
    let before = current(&vm);
    let config = DpConfig::per_layer(10, 0.0, &[("l", 0.3), ("m", 0.7)]);
    let mut t = trainer(&vm, (&xs, &ys), 4, config, 9);
    let info = t.step().unwrap();
    assert!(info.clipped_fraction.is_nan());
    let want = reference(&before, (&xs, &ys), 9, 10, &[("l.", 0.3), ("m.", 0.7)], 0.1);
    let got = current(&vm);
    for (k, w) in &want {
        assert!(max_diff(&got[k], w) < 1e-5, "{k}: {}", max_diff(&got[k], w));
    }
}

#[test]
fn overlapping_or_repeated_clipping_groups_are_refused_naming_both() {
    // a parameter in two groups would be clipped twice while the noise
    // counts each group's bound once
    let (xs, ys) = data(40);
    let vm = model();
    for (groups, named) in [
        (
            &[("l", 0.3), ("l.weight", 0.5), ("m", 0.7)][..],
            "\"l\" and \"l.weight\"",
        ),
        (&[("l.bias", 0.3), ("m", 0.7), ("l", 0.5)][..], "\"l.bias\" and \"l\""),
        (&[("l", 0.3), ("m", 0.7), ("l", 0.3)][..], "\"l\" and \"l\""),
    ] {
        let e = PrivacyEngine::new()
            .make_private(
                loss as fn(_, _, _) -> _,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::per_layer(10, 1.0, groups),
            )
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(e, candle_func::Error::PrivacyConfig { .. }) && e.to_string().contains(named),
            "{groups:?}: {e}"
        );
    }
    // prefixes that share letters but not a component are apart
    let ok = PrivacyEngine::new().make_private(
        loss as fn(_, _, _) -> _,
        &vm,
        candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
        (&xs, &ys),
        DpConfig::per_layer(10, 1.0, &[("l.weight", 0.3), ("l.bias", 0.2), ("m", 0.7)]),
    );
    assert!(ok.is_ok());
}

#[test]
fn noise_has_the_promised_scale_and_new_sizes_never_trace() {
    // A loss with zero gradient: the update is the noise alone,
    // -lr N(0, (σ S)²) / (q N) per coordinate, with S = sqrt(Σ bounds²).
    let zero = |p: BTreeMap<String, Tracer>, x: Tracer, _y: Tracer| {
        let w = p["big"].sum_all()?.add(&p["other"].sum_all()?)?;
        w.mul(0.0)?.add(&x.sum_all()?.mul(0.0)?)
    };
    let vm = VarMap::new();
    for (name, shape) in [("big", (200, 100)), ("other", (50, 20))] {
        let v = candle_core::Var::zeros(shape, DType::F32, &Device::Cpu).unwrap();
        vm.data().lock().unwrap().insert(name.into(), v);
    }
    let (xs, ys) = data(50);
    let (sigma, lr, batch) = (1.5, 0.1, 10);
    let config = DpConfig {
        clipping: Clipping::PerLayer(vec![("big".into(), 3.0), ("other".into(), 4.0)]),
        ..DpConfig::new(batch, sigma, 1.0)
    };
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(3))
        .physical_batch(4)
        .make_private(
            zero,
            &vm,
            candle_func::optim::Sgd::new(&vm, lr, 0.0).unwrap(),
            (&xs, &ys),
            config,
        )
        .unwrap();
    let mut sizes = std::collections::BTreeSet::new();
    for _ in 0..6 {
        sizes.insert(t.step().unwrap().batch_size);
    }
    // Several Poisson sizes, one trace.
    assert!(sizes.len() > 2, "{sizes:?}");
    assert_eq!(t.traced_signatures(), 1);
    assert_eq!(t.accountant().steps(), 6);
    let now = current(&vm);
    let w: Vec<f32> = ["big", "other"]
        .iter()
        .flat_map(|k| now[*k].flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    // Six independent steps add up: std sqrt(6) lr σ 5 / (q N).
    let want = 6f64.sqrt() * lr * sigma * 5.0 / batch as f64;
    let n = w.len() as f64;
    let std = (w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n).sqrt();
    assert!(
        (std - want).abs() < 5.0 * want / (2.0 * n).sqrt(),
        "std {std} vs {want}"
    );
}

#[test]
fn empty_batches_take_a_noise_only_step() {
    let (xs, ys) = data(1000);
    let vm = model();
    let before = current(&vm);
    let mut t = trainer(&vm, (&xs, &ys), 8, DpConfig::new(1, 0.0, 1.0), 0);
    let mut empty = None;
    for _ in 0..20 {
        let info = t.step().unwrap();
        if info.batch_size == 0 {
            empty = Some(info);
            break;
        }
    }
    let info = empty.expect("q = 0.001 gives empty batches");
    assert_eq!(info.passes, 0);
    assert!(info.mean_loss.is_nan() && info.clipped_fraction.is_nan());
    assert!(current(&vm)
        .values()
        .zip(before.values())
        .all(|(a, b)| a.dims() == b.dims()));
}

#[test]
fn make_private_with_epsilon_spends_at_most_the_target() {
    let (xs, ys) = data(100);
    let vm = model();
    let (target, delta, epochs) = (3.0, 1e-5, 2.0);
    for mech in [Mechanism::Prv, Mechanism::Rdp] {
        let engine = PrivacyEngine::new().accountant(mech).rng(Rng::seeded(1));
        let t = with_epsilon(engine, &vm, (&xs, &ys), 10, (target, delta, epochs)).unwrap();
        let steps = 2 * t.steps_per_epoch();
        assert_eq!(t.steps_per_epoch(), 10);
        let sigma = t.noise_multiplier();
        assert_eq!(sigma, noise_multiplier(mech, target, delta, 0.1, steps).unwrap());
        let mut acc = Accountant::new(mech);
        acc.record(sigma, 0.1, steps).unwrap();
        let eps = acc.epsilon(delta).unwrap();
        assert!(eps <= target && target - eps < 0.011, "{mech:?}: {eps}");
    }
}

#[test]
fn optimisers_follow_pytorch() {
    let vm = VarMap::new();
    let w0 = values(4, &[5]);
    vm.data()
        .lock()
        .unwrap()
        .insert("w".into(), candle_core::Var::from_tensor(&w0).unwrap());
    let g = values(5, &[5]);
    let grads = BTreeMap::from([("w".to_string(), g.clone())]);
    let (lr, wd) = (0.1, 0.05);
    let mut opt = candle_func::optim::AdamW::new(&vm, lr, wd).unwrap();
    opt.step(&grads).unwrap();
    // First step: m^ = g, v^ = g², so the update is lr g / (|g| + eps).
    let want = ((&w0 * (1.0 - lr * wd)).unwrap() - (g.sign().unwrap() * lr).unwrap()).unwrap();
    assert!(max_diff(&current(&vm)["w"], &want) < 1e-6);
    assert_eq!(opt.lr(), lr);
    opt.set_lr(0.5).unwrap();
    assert!(opt.set_lr(f64::NAN).is_err() && opt.set_lr(-1.0).is_err());
    assert_eq!(opt.lr(), 0.5);
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(candle_func::optim::AdamW::new(&vm, 0.1, bad).is_err());
        assert!(candle_func::optim::Adam::new(&vm, bad).is_err());
        assert!(candle_func::optim::Sgd::new(&vm, bad, 0.0).is_err());
    }
    assert!(candle_func::optim::Adam::new(&vm, 0.1)
        .unwrap()
        .with((1.0, 0.9), 1e-8)
        .is_err());
    // A gradient for a variable that does not exist, or of the wrong shape.
    let stray = BTreeMap::from([("v".to_string(), g.clone())]);
    assert!(opt.step(&stray).unwrap_err().to_string().contains("\"v\""));
    let wrong = BTreeMap::from([("w".to_string(), values(5, &[2, 2]))]);
    assert!(opt.step(&wrong).is_err());
}

#[test]
fn bad_input_is_refused() {
    let (xs, ys) = data(20);
    let vm = model();
    let make = |d: (&Tensor, &Tensor), config: DpConfig| {
        PrivacyEngine::new()
            .rng(Rng::seeded(0))
            .make_private(
                loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                d,
                config,
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    assert!(make((&xs, &ys), DpConfig::new(0, 1.0, 1.0)).contains("batch_size"));
    assert!(make((&xs, &ys), DpConfig::new(21, 1.0, 1.0)).contains("batch_size"));
    assert!(make((&xs, &ys), DpConfig::new(5, f64::NAN, 1.0)).contains("noise_multiplier"));
    assert!(make((&xs, &ys), DpConfig::new(5, 1.0, -1.0)).contains("max_grad_norm"));
    let short = ys.narrow(0, 0, 19).unwrap();
    let msg = make((&xs, &short), DpConfig::new(5, 1.0, 1.0));
    assert!(msg.contains("make_private") && msg.contains("19"), "{msg}");
    let missing = DpConfig {
        clipping: Clipping::PerLayer(vec![("l".into(), 1.0)]),
        ..DpConfig::new(5, 1.0, 1.0)
    };
    assert!(make((&xs, &ys), missing).contains("\"m.weight\""));
    let nan_group = DpConfig {
        clipping: Clipping::PerLayer(vec![("l".into(), 1.0), ("m".into(), f64::NAN)]),
        ..DpConfig::new(5, 1.0, 1.0)
    };
    assert!(make((&xs, &ys), nan_group).contains("\"m\""));
    // A group that holds no parameter would only add noise.
    let stray = DpConfig {
        clipping: Clipping::PerLayer(vec![("l".into(), 1.0), ("m".into(), 1.0), ("mm".into(), 1.0)]),
        ..DpConfig::new(5, 1.0, 1.0)
    };
    assert!(make((&xs, &ys), stray).contains("\"mm\""));
    // Nothing to train.
    let empty = VarMap::new();
    let e = PrivacyEngine::new()
        .rng(Rng::seeded(0))
        .make_private(
            loss,
            &empty,
            candle_func::optim::Sgd::new(&empty, 0.1, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::new(5, 1.0, 1.0),
        )
        .map(|_| ())
        .unwrap_err();
    // a data error a caller can match, naming what is missing
    assert!(
        matches!(e, candle_func::Error::Data { op: "make_private", .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("no variables"), "{e}");
    // A seeded generator is allowed, with a warning that it is not private.
    let (_, warnings) =
        candle_func::settings::capture_warnings(|| trainer(&vm, (&xs, &ys), 4, DpConfig::new(5, 1.0, 1.0), 0));
    assert!(warnings.iter().any(|w| w.key == "dp-seeded-rng"), "{warnings:?}");
    // and an OS-keyed one is not warned about
    let (_, warnings) = candle_func::settings::capture_warnings(|| {
        PrivacyEngine::new()
            .make_private(
                loss as fn(_, _, _) -> _,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::new(5, 1.0, 1.0),
            )
            .unwrap()
    });
    assert!(warnings.is_empty(), "{warnings:?}");
    let with_eps = |eps: f64, epochs: f64| {
        let engine = PrivacyEngine::new().rng(Rng::seeded(0));
        let t = with_epsilon(engine, &vm, (&xs, &ys), 5, (eps, 1e-5, epochs));
        t.map(|_| ()).unwrap_err().to_string()
    };
    assert!(with_eps(1.0, 0.0).contains("epochs"));
    assert!(with_eps(1.0, f64::NAN).contains("epochs"));
    // The PRV figure carries its error band (0.01), so 0.005 is out of reach.
    assert!(with_eps(0.005, 1.0).contains("make_private_with_epsilon: prv accountant: no noise multiplier"));
    assert!(with_eps(-1.0, 1.0).contains("target_epsilon"));
    // An infinite target is refused at once, not searched for.
    assert!(with_eps(f64::INFINITY, 1.0).contains("target_epsilon must be finite and > 0, got inf"));
    // A wider PRV band lets the search and the trainer's accountant use it.
    let wide = |e: f64| {
        let engine = PrivacyEngine::new().rng(Rng::seeded(0)).eps_error(e);
        with_epsilon(engine, &vm, (&xs, &ys), 5, (1.0, 1e-5, 1.0))
    };
    let t = wide(0.05).unwrap();
    assert!(t.accountant().to_json().contains("\"eps_error\":0.05"));
    assert!(wide(-1.0).map(|_| ()).unwrap_err().to_string().contains("eps_error"));
}

#[test]
fn the_accountant_resumes_from_a_checkpoint() {
    let (xs, ys) = data(50);
    let vm = model();
    let mut t = trainer(&vm, (&xs, &ys), 4, DpConfig::new(5, 1.0, 1.0), 2);
    for _ in 0..3 {
        t.step().unwrap();
    }
    let saved = t.accountant().to_json();
    let eps = t.epsilon(1e-5).unwrap();
    let mut resumed = trainer(&vm, (&xs, &ys), 4, DpConfig::new(5, 1.0, 1.0), 3);
    resumed.set_accountant(Accountant::from_json(&saved).unwrap());
    assert_eq!(resumed.epsilon(1e-5).unwrap(), eps);
    resumed.step().unwrap();
    assert_eq!(resumed.accountant().steps(), 4);
    assert!(resumed.epsilon(1e-5).unwrap() > eps);
}

#[test]
fn one_rank_distributed_is_the_single_process_step() {
    let d = data(40);
    let config = || DpConfig::new(10, 0.7, 0.5);
    let (a, b) = (model(), model());
    let mut alone = trainer(&a, (&d.0, &d.1), 3, config(), 5);
    let mut one = trainer(&b, (&d.0, &d.1), 3, config(), 5)
        .distributed(OneRank { lie: false, rank: 0 })
        .unwrap();
    for _ in 0..4 {
        let (x, y) = (alone.step().unwrap(), one.step().unwrap());
        assert_eq!((x.batch_size, x.passes), (y.batch_size, y.passes));
        assert!((x.mean_loss - y.mean_loss).abs() <= 1e-6 * x.mean_loss.abs().max(1.0));
    }
    let (pa, pb) = (current(&a), current(&b));
    for (k, t) in &pa {
        // noise added, then scaled: the rounding of one product apart
        assert!(max_diff(t, &pb[k]) < 1e-6, "{k}");
    }
    assert_eq!(alone.epsilon(1e-5).unwrap(), one.epsilon(1e-5).unwrap());
    // A rank whose parameters differ fails the step, naming it.
    let msg = trainer(&model(), (&d.0, &d.1), 3, config(), 5)
        .distributed(OneRank { lie: true, rank: 0 })
        .err()
        .expect("a differing hash is an error")
        .to_string();
    assert!(msg.contains("ranks [1] have another data set"), "{msg}");
    // A rank outside the communicator is refused.
    let msg = trainer(&model(), (&d.0, &d.1), 3, config(), 5)
        .distributed(OneRank { lie: false, rank: 3 })
        .err()
        .expect("rank 3 of 1 is an error")
        .to_string();
    assert!(msg.contains("rank 3 of 1"), "{msg}");
}

/// A second rank simulated in process, as rank 0 sees it: it agrees on
/// everything except where told to disagree on the `nth` hash gathered
/// (0: the set-up check, 1: the check after the broadcast), or to report
/// that its part of every step failed.
struct TwoRanks {
    differ_at: Option<usize>,
    fails: bool,
    gathered: std::cell::Cell<usize>,
}

impl dp::collective::Collective for TwoRanks {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        2
    }
    fn broadcast_u64(&self, _: &mut Vec<u64>) -> candle_func::Result<()> {
        Ok(())
    }
    fn broadcast_f64(&self, _: &mut [f64]) -> candle_func::Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f32(&self, _: &mut [f32]) -> candle_func::Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> candle_func::Result<()> {
        // the last of the f64s is the count of ranks whose part failed
        if let (true, Some(last)) = (self.fails, data.last_mut()) {
            *last += 1.0;
        }
        Ok(())
    }
    fn all_gather_u64(&self, v: u64) -> candle_func::Result<Vec<u64>> {
        let n = self.gathered.replace(self.gathered.get() + 1);
        Ok(vec![v, if self.differ_at == Some(n) { v ^ 1 } else { v }])
    }
}

#[test]
fn dp_failures_are_variants_a_caller_can_match() {
    use candle_func::dp::collective::CollectiveFailure;
    use candle_func::Error;
    let vm = model();
    let (xs, ys) = data(20);
    let make = |config: DpConfig, engine: PrivacyEngine| {
        engine
            .rng(Rng::seeded(0))
            .make_private(
                loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&xs, &ys),
                config,
            )
            .map(|_| ())
            .unwrap_err()
    };
    // privacy configuration: the setting and the value that was refused
    match make(DpConfig::new(5, 1.0, -2.0), PrivacyEngine::new()) {
        Error::PrivacyConfig {
            op: "make_private",
            setting,
            value,
            ..
        } => {
            assert_eq!((setting.as_str(), value.as_str()), ("max_grad_norm", "-2"))
        }
        e => panic!("{e:?}"),
    }
    match make(DpConfig::new(5, 1.0, 1.0), PrivacyEngine::new().physical_batch(0)) {
        Error::PrivacyConfig { setting, value, .. } => {
            assert_eq!((setting.as_str(), value.as_str()), ("physical_batch", "0"))
        }
        e => panic!("{e:?}"),
    }
    match make(DpConfig::new(21, 1.0, 1.0), PrivacyEngine::new()) {
        Error::PrivacyConfig {
            setting,
            value,
            expected,
            ..
        } => {
            assert_eq!((setting.as_str(), value.as_str()), ("batch_size", "21"));
            assert!(expected.contains("1..=20"), "{expected}");
        }
        e => panic!("{e:?}"),
    }
    // accounting: a target no noise reaches, with the analysis that said so
    match noise_multiplier(Mechanism::Rdp, 0.01, 1e-5, 0.5, 10_000) {
        Err(Error::Accounting {
            op: "noise_multiplier",
            mechanism: "rdp",
            msg,
        }) => {
            assert!(msg.contains("0.01") && msg.contains("10000 steps"), "{msg}")
        }
        r => panic!("{r:?}"),
    }
    // data (nothing to train): Error::Data, checked in bad_input_is_refused
    // checkpoint: a saved accountant that does not restore
    let e = Accountant::from_json(r#"{"mechanism":"rdp","eps_error":0.01,"history":[[1.0,1.5,3]]}"#).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint { what: "Accountant::from_json", msg } if msg.contains("1.5")),
        "{e:?}"
    );
    // collectives: another set-up, drift after the broadcast, a failed rank
    let distributed = |differ_at, fails| {
        let comm = TwoRanks {
            differ_at,
            fails,
            gathered: Default::default(),
        };
        trainer(&model(), (&xs, &ys), 3, DpConfig::new(5, 1.0, 1.0), 5).distributed(comm)
    };
    match distributed(Some(0), false).err() {
        Some(Error::Collective {
            rank: 0,
            ranks: 2,
            failure: CollectiveFailure::Setup { ranks, .. },
        }) => assert_eq!(ranks, [1]),
        e => panic!("{e:?}"),
    }
    match distributed(Some(1), false).err() {
        Some(Error::Collective {
            failure: CollectiveFailure::Drift { ranks, when, hashes },
            ..
        }) => {
            assert_eq!(ranks, [1]);
            assert!(when.contains("broadcast"), "{when}");
            assert_eq!(hashes.len(), 2);
            assert_ne!(hashes[0], hashes[1]);
        }
        e => panic!("{e:?}"),
    }
    let mut t = distributed(None, true).unwrap();
    match t.step() {
        Err(Error::Collective {
            failure: CollectiveFailure::RankFailed { failed: 1 },
            ..
        }) => {}
        r => panic!("{:?}", r.map(|_| ())),
    }
    // a failed step spends nothing
    assert_eq!(t.accountant().steps(), 0);
}

/// Adam updates its moments and the weight in place: three steps follow
/// PyTorch's formulas (computed here in f64), a state handed out by
/// `state` or taken by `load_state` never changes afterwards, and an
/// optimiser that loaded it steps on bit for bit as the original.
#[test]
fn adam_in_place_follows_pytorch_and_leaves_handed_out_state_alone() {
    let one_var = |w: &Tensor| {
        let vm = VarMap::new();
        vm.data()
            .lock()
            .unwrap()
            .insert("w".into(), candle_core::Var::from_tensor(w).unwrap());
        vm
    };
    let w0 = values(4, &[300]);
    let vm = one_var(&w0);
    let (lr, wd, (b1, b2), eps) = (0.01, 0.1, (0.9f64, 0.999f64), 1e-8);
    let mut opt = candle_func::optim::AdamW::new(&vm, lr, wd).unwrap();
    let (mut w, mut m, mut v) = (common::values(&w0), vec![0.0; 300], vec![0.0; 300]);
    let mut handed: Option<(
        candle_func::optim::OptimizerState,
        Vec<Vec<f64>>,
        VarMap,
        candle_func::optim::AdamW,
    )> = None;
    for step in 1..=3 {
        let g = values(10 + step as u64, &[300]);
        let grads = BTreeMap::from([("w".to_string(), g.clone())]);
        opt.step(&grads).unwrap();
        let g = common::values(&g);
        let (c1, c2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        for i in 0..300 {
            w[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            w[i] -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
        }
        let got = common::values(&current(&vm)["w"]);
        let diff = got.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff < 1e-6, "step {step}: {diff}");
        match &mut handed {
            None => {
                let s = opt.state().unwrap();
                let copies = s.tensors.values().map(common::values).collect();
                let vm2 = one_var(&current(&vm)["w"]);
                let mut other = candle_func::optim::AdamW::new(&vm2, lr, wd).unwrap();
                other.load_state(&s).unwrap();
                handed = Some((s, copies, vm2, other));
            }
            Some((s, copies, vm2, other)) => {
                other.step(&grads).unwrap();
                assert_eq!(max_diff(&current(vm2)["w"], &current(&vm)["w"]), 0.0, "step {step}");
                let now: Vec<Vec<f64>> = s.tensors.values().map(common::values).collect();
                assert_eq!(&now, copies, "the state handed out after step 1 changed at step {step}");
            }
        }
    }
}

#[test]
fn automatic_clipping_step_equals_the_materialised_step() {
    let (xs, ys) = data(40);
    let vm = model();
    let before = current(&vm);
    let gamma = 0.05;
    let mut t = trainer(&vm, (&xs, &ys), 3, DpConfig::automatic(10, 0.0, gamma), 4);
    let info = t.step().unwrap();
    assert!(info.clipped_fraction.is_nan() && info.clip_bound.is_nan());
    // the same Poisson batch, each per-sample gradient over ||g|| + γ
    let (bx, by) = first_batch((&xs, &ys), 4, 10);
    let b = bx.dims()[0];
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((&before, &bx, &by))
        .unwrap();
    let scale = dp::norm_per_sample(&per)
        .unwrap()
        .affine(1.0, gamma)
        .unwrap()
        .recip()
        .unwrap();
    let got = current(&vm);
    for (k, g) in &per {
        let shape: Vec<usize> = std::iter::once(b).chain(std::iter::repeat_n(1, g.rank() - 1)).collect();
        let sum = g.broadcast_mul(&scale.reshape(shape).unwrap()).unwrap().sum(0).unwrap();
        let want = (&before[k] - (sum * (0.1 / 10.0)).unwrap()).unwrap();
        assert!(max_diff(&got[k], &want) < 1e-5, "{k}: {}", max_diff(&got[k], &want));
    }
    let bad = PrivacyEngine::new().make_private(
        loss as fn(_, _, _) -> _,
        &vm,
        candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
        (&xs, &ys),
        DpConfig::automatic(10, 1.0, 0.0),
    );
    assert!(bad.map(|_| ()).unwrap_err().to_string().contains("gamma"));
}
