//! The one-run audit (Steinke, Nasr and Jagielski 2023) of the private
//! trainer with white-box gradient canaries: sound on 20 seeds of a correct
//! run (the bound stays below the accountant's ε), and it catches each of
//! two broken mechanisms on every seed tried: noise secretly a tenth of
//! what the accountant was told, and canaries entering unclipped at ten
//! times the bound. Also the bound's arithmetic against hand-checked cases.

use candle_func::dp::accountant::{noise_multiplier, Accountant, Mechanism};
use candle_func::dp::audit::{self, Canaries};
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::rng::Rng;
use candle_func::Tracer;
use std::collections::BTreeMap;

mod common;

const D: usize = 1000;
const M: usize = 1000;
const N: usize = 100;
const BATCH: usize = 10;
const STEPS: usize = 100;
const DELTA: f64 = 1e-5;

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    x.mul(&p["w"])?.sum_all()?.sub(&y)?.sqr()
}

/// The claimed σ: ε = 1 at δ = 1e-5 over the run, by PRV.
fn claimed_sigma() -> f64 {
    noise_multiplier(Mechanism::Prv, 1.0, DELTA, BATCH as f64 / N as f64, STEPS).unwrap()
}

/// One audited run: noise `sigma`, canaries scaled by `scale`; returns the
/// audit's ε lower bound at 95%.
fn audited_run(seed: u64, sigma: f64, scale: f64) -> f64 {
    let vm = common::zeros_varmap("w", D);
    let xs = (common::hashed_values(seed + 1, &[N, D]) * 0.05).unwrap();
    let ys = common::hashed_values(seed + 2, &[N]);
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(seed))
        .physical_batch(BATCH)
        .make_private(
            loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.05, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::new(BATCH, sigma, 1.0),
        )
        .unwrap();
    let canaries = Canaries::new(M, 1000 + seed).unwrap().scaled(scale).unwrap();
    t.insert_canaries(canaries).unwrap();
    for _ in 0..STEPS {
        t.step().unwrap();
    }
    t.audit(DELTA, 0.95).unwrap().epsilon_lower_bound
}

#[test]
fn the_audit_is_sound_on_a_correct_run() {
    let sigma = claimed_sigma();
    let mut acc = Accountant::new(Mechanism::Prv);
    acc.record(sigma, BATCH as f64 / N as f64, STEPS).unwrap();
    let claimed = acc.epsilon(DELTA).unwrap();
    assert!(claimed <= 1.0);
    let bounds: Vec<f64> = (0..20).map(|seed| audited_run(seed, sigma, 1.0)).collect();
    eprintln!("correct run, claimed epsilon {claimed:.3}: audit lower bounds {bounds:.3?}");
    assert!(bounds.iter().all(|&b| b <= claimed), "{bounds:?} against {claimed}");
}

#[test]
fn the_audit_catches_a_tenth_of_the_noise() {
    let sigma = claimed_sigma();
    for seed in 0..3 {
        let bound = audited_run(seed, sigma / 10.0, 1.0);
        eprintln!("noise / 10, seed {seed}: lower bound {bound:.3} against the claimed 1");
        assert!(bound > 1.0, "seed {seed}: {bound}");
    }
}

#[test]
fn the_audit_catches_unclipped_gradients() {
    let sigma = claimed_sigma();
    for seed in 0..3 {
        let bound = audited_run(seed, sigma, 10.0);
        eprintln!("canaries at 10 C, seed {seed}: lower bound {bound:.3} against the claimed 1");
        assert!(bound > 1.0, "seed {seed}: {bound}");
    }
}

#[test]
fn the_bound_follows_the_theorem() {
    // all r guesses right with δ = 0: the p-value is q^r, so the bound is
    // the ε with (e^ε / (1 + e^ε))^r = 1 - confidence
    let (r, level) = (100usize, 0.05f64);
    let q = level.powf(1.0 / r as f64);
    let want = (q / (1.0 - q)).ln();
    let got = audit::epsilon_lower_bound(1000, r, r, 0.0, 1.0 - level).unwrap();
    assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    // half right is chance: nothing rejected
    assert_eq!(audit::epsilon_lower_bound(1000, 100, 50, 1e-5, 0.95).unwrap(), 0.0);
    // δ only loosens: the p-value grows with δ, the bound shrinks
    let (a, b) = (
        audit::p_value(1000, 100, 90, 1.0, 0.0).unwrap(),
        audit::p_value(1000, 100, 90, 1.0, 1e-3).unwrap(),
    );
    assert!(b > a);
    assert!(
        audit::epsilon_lower_bound(1000, 100, 95, 1e-3, 0.95).unwrap()
            < audit::epsilon_lower_bound(1000, 100, 95, 0.0, 0.95).unwrap()
    );
    // bad input
    assert!(audit::p_value(10, 20, 5, 1.0, 0.0).is_err());
    assert!(audit::epsilon_lower_bound(10, 5, 5, 0.0, 1.0).is_err());
    assert!(audit::one_run(&[1.0, f64::NAN], &[true, false], 0.0, 0.95).is_err());
    assert!(audit::one_run(&[1.0], &[true, false], 0.0, 0.95).is_err());
    assert!(Canaries::new(1, 0).is_err());
    assert!(audit::one_run(&[1.0, 0.0], &[true, false], 0.0, -1.0).is_err());
    // canaries join as Poisson-sampled examples: another scheme is refused
    let vm = common::zeros_varmap("w", 10);
    let (xs, ys) = (common::hashed_values(1, &[20, 10]), common::hashed_values(2, &[20]));
    let make = |engine: PrivacyEngine| {
        let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
        engine
            .make_private(loss, &vm, sgd, (&xs, &ys), DpConfig::new(5, 1.0, 1.0))
            .unwrap()
    };
    let mut t = make(PrivacyEngine::new().sampling(dp::Sampling::WithoutReplacement));
    let e = t.insert_canaries(Canaries::new(4, 0).unwrap()).unwrap_err().to_string();
    assert!(e.contains("without_replacement"), "{e}");
    // and more canaries than parameter entries
    let mut t = make(PrivacyEngine::new());
    assert!(t.insert_canaries(Canaries::new(11, 0).unwrap()).is_err());
    // no canaries inserted: nothing to audit
    assert!(t.audit(1e-5, 0.95).is_err());
    // a perfect separation of 200 canaries
    let inserted = Canaries::coins(200, 3);
    let scores: Vec<f64> = inserted.iter().map(|&i| if i { 1.0 } else { 0.0 }).collect();
    let report = audit::one_run(&scores, &inserted, 0.0, 0.95).unwrap();
    assert_eq!(report.correct, report.guesses);
    assert!(report.epsilon_lower_bound > 1.0);
}
