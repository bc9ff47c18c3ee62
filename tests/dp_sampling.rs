//! The trainer's sampling schemes: each step's batch is drawn by the scheme
//! the accountant analyses (fixed size without replacement, truncated
//! Poisson, Poisson), one trace serves every sampled size, shuffling is
//! refused with its reason, a run never resumes as another scheme, and the
//! draws are uniform.

use candle_core::Tensor;
use candle_func::dp::accountant::{Accountant, Mechanism};
use candle_func::dp::{self, DpConfig, PrivacyEngine, Sampling};
use candle_func::rng::Rng;
use candle_func::Tracer;
use candle_nn::VarMap;
use std::collections::BTreeMap;

mod common;

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

fn model() -> VarMap {
    let vm = VarMap::new();
    let mut data = vm.data().lock().unwrap();
    let w = common::hashed_values(3, &[2, 4]);
    data.insert("w".into(), candle_core::Var::from_tensor(&w).unwrap());
    drop(data);
    vm
}

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let out = x.unsqueeze(0)?.broadcast_matmul(&p["w"].t()?)?;
    out.sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()
}

fn data(n: usize) -> (Tensor, Tensor) {
    (common::hashed_values(1, &[n, 4]), common::hashed_values(2, &[n, 2]))
}

fn trainer(
    engine: PrivacyEngine,
    vm: &VarMap,
    d: (&Tensor, &Tensor),
    config: DpConfig,
) -> candle_func::Result<dp::PrivateTrainer<Loss, candle_func::optim::Sgd>> {
    let sgd = candle_func::optim::Sgd::new(vm, 0.1, 0.0)?;
    engine
        .rng(Rng::seeded(7))
        .physical_batch(4)
        .make_private(loss as Loss, vm, sgd, d, config)
}

#[test]
fn without_replacement_takes_exactly_the_batch_and_accounts_for_it() {
    let (xs, ys) = data(50);
    let vm = model();
    let engine = PrivacyEngine::new().sampling(Sampling::WithoutReplacement);
    let mut t = trainer(engine, &vm, (&xs, &ys), DpConfig::new(10, 1.0, 1.0)).unwrap();
    for _ in 0..6 {
        let info = t.step().unwrap();
        assert_eq!(info.batch_size, 10);
        assert_eq!(info.passes, 3); // 10 examples in passes of 4, the last padded
    }
    assert_eq!(t.traced_signatures(), 1);
    assert_eq!(t.accountant().sampling(), Sampling::WithoutReplacement);
    assert_eq!(t.accountant().mechanism(), Mechanism::Pld); // the default that covers it
    let mut want = Accountant::new(Mechanism::Pld)
        .with_sampling(Sampling::WithoutReplacement)
        .unwrap();
    want.record(1.0, 0.2, 6).unwrap();
    assert_eq!(t.epsilon(1e-5).unwrap(), want.epsilon(1e-5).unwrap());
    // replace-one without replacement is not the Poisson figure
    let mut poisson = Accountant::new(Mechanism::Pld);
    poisson.record(1.0, 0.2, 6).unwrap();
    assert_ne!(t.epsilon(1e-5).unwrap(), poisson.epsilon(1e-5).unwrap());
}

#[test]
fn truncated_poisson_never_exceeds_its_cap() {
    let (xs, ys) = data(60);
    let vm = model();
    let sampling = Sampling::TruncatedPoisson {
        dataset_size: 60,
        max_batch: 9,
    };
    let engine = PrivacyEngine::new().sampling(sampling);
    let mut t = trainer(engine, &vm, (&xs, &ys), DpConfig::new(10, 1.0, 1.0)).unwrap();
    let sizes: Vec<usize> = (0..30).map(|_| t.step().unwrap().batch_size).collect();
    assert!(sizes.iter().all(|&b| b <= 9), "{sizes:?}");
    // expected 10 > 9: most steps are cut, some are not
    assert!(sizes.iter().filter(|&&b| b == 9).count() >= 10, "{sizes:?}");
    assert!(sizes.iter().any(|&b| b < 9), "{sizes:?}");
    assert_eq!(t.traced_signatures(), 1);
    let mut want = Accountant::new(Mechanism::Pld).with_sampling(sampling).unwrap();
    want.record(1.0, 10.0 / 60.0, 30).unwrap();
    assert_eq!(t.epsilon(1e-5).unwrap(), want.epsilon(1e-5).unwrap());
    // the cap costs privacy: more than the uncut Poisson run
    let mut poisson = Accountant::new(Mechanism::Pld);
    poisson.record(1.0, 10.0 / 60.0, 30).unwrap();
    assert!(t.epsilon(1e-5).unwrap() > poisson.epsilon(1e-5).unwrap());
}

#[test]
fn schemes_are_refused_where_unsound_or_misconfigured() {
    let (xs, ys) = data(40);
    let vm = model();
    let cfg = || DpConfig::new(8, 1.0, 1.0);
    let err = |engine: PrivacyEngine| {
        trainer(engine, &vm, (&xs, &ys), cfg())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let shuffled = err(PrivacyEngine::new().sampling(Sampling::Shuffled));
    assert!(shuffled.contains("shuffled") && shuffled.contains("Chua"), "{shuffled}");
    let prv = err(PrivacyEngine::new()
        .sampling(Sampling::WithoutReplacement)
        .accountant(Mechanism::Prv));
    assert!(prv.contains("without_replacement") && prv.contains("prv"), "{prv}");
    let truncated = Sampling::TruncatedPoisson {
        dataset_size: 41,
        max_batch: 10,
    };
    let size = err(PrivacyEngine::new().sampling(truncated));
    assert!(
        size.contains("dataset_size") && size.contains("41") && size.contains("40"),
        "{size}"
    );
    let zero = Sampling::TruncatedPoisson {
        dataset_size: 40,
        max_batch: 0,
    };
    assert!(err(PrivacyEngine::new().sampling(zero)).contains("max_batch"));
    // RDP covers sampling without replacement
    let rdp = PrivacyEngine::new()
        .sampling(Sampling::WithoutReplacement)
        .accountant(Mechanism::Rdp);
    assert!(trainer(rdp, &vm, (&xs, &ys), cfg()).is_ok());
}

#[test]
fn noise_for_a_target_epsilon_follows_the_scheme() {
    let (xs, ys) = data(100);
    let vm = model();
    let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
    let mut t = PrivacyEngine::new()
        .sampling(Sampling::WithoutReplacement)
        .rng(Rng::seeded(1))
        .make_private_with_epsilon(
            loss as Loss,
            &vm,
            sgd,
            (&xs, &ys),
            DpConfig::new(20, 0.0, 1.0),
            (2.0, 1e-5, 3.0),
        )
        .unwrap();
    for _ in 0..3 * t.steps_per_epoch() {
        t.step().unwrap();
    }
    let eps = t.epsilon(1e-5).unwrap();
    assert!(eps <= 2.0 && eps > 1.9, "{eps}");
}

#[test]
fn a_run_resumes_only_under_its_own_scheme() {
    let (xs, ys) = data(40);
    let vm = model();
    let make = |engine: PrivacyEngine| trainer(engine, &vm, (&xs, &ys), DpConfig::new(8, 1.0, 1.0)).unwrap();
    let mut t = make(PrivacyEngine::new().sampling(Sampling::WithoutReplacement));
    t.step().unwrap();
    let dir = std::env::temp_dir().join(format!("candle_func_sampling_{}", std::process::id()));
    t.save(&dir).unwrap();
    let mut same = make(PrivacyEngine::new().sampling(Sampling::WithoutReplacement));
    same.resume(&dir).unwrap();
    assert_eq!(same.epsilon(1e-5).unwrap(), t.epsilon(1e-5).unwrap());
    let mut other = make(PrivacyEngine::new().accountant(Mechanism::Pld));
    let e = other.resume(&dir).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("WithoutReplacement") && e.contains("Poisson"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn subsets_are_uniform() {
    // every 2-subset of 0..5 equally often
    let mut rng = Rng::seeded(3);
    let mut counts = BTreeMap::new();
    let draws = 20_000;
    for _ in 0..draws {
        let s = rng.subset(5, 2);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        *counts.entry(s).or_insert(0usize) += 1;
    }
    assert_eq!(counts.len(), 10);
    let expected = draws as f64 / 10.0;
    let sd = (expected * 0.9).sqrt();
    for (s, &c) in &counts {
        assert!((c as f64 - expected).abs() < 5.0 * sd, "{s:?}: {c}");
    }
    // the cut of a truncated batch keeps each sampled example equally often
    let mut hits = [0usize; 20];
    for _ in 0..draws {
        let all = rng.poisson_sample(20, 0.5);
        let kept = rng.subset(all.len(), 3.min(all.len()));
        for i in kept {
            hits[all[i]] += 1;
        }
    }
    let mean = hits.iter().sum::<usize>() as f64 / 20.0;
    assert!(hits.iter().all(|&h| (h as f64 - mean).abs() < 0.06 * mean), "{hits:?}");
    assert_eq!(rng.subset(3, 5), vec![0, 1, 2]);
}
