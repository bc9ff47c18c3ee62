//! The PLD accountant against Google's `dp_accounting` (a grid of cases
//! computed offline by `scripts/make_pld_cases.py`), against the exact
//! Gaussian mechanism, and on its own invariants.

use super::super::sampling::binomial_at_least;
use super::super::{Accountant, Mechanism, Sampling};
use super::*;

struct Case {
    sampling: Sampling,
    history: Vec<(f64, f64, usize)>,
    deltas: Vec<f64>,
    pld: Vec<f64>,
    rdp: Option<Vec<f64>>,
}

fn cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dp/pld_cases.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["value_discretization_interval"].as_f64(), Some(INTERVAL));
    let numbers = |x: &serde_json::Value| -> Vec<f64> {
        x.as_array()
            .expect("a list")
            .iter()
            .map(|n| n.as_f64().expect("a number"))
            .collect()
    };
    let cases: Vec<Case> = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let segs: Vec<Vec<f64>> = c["history"].as_array().expect("history").iter().map(numbers).collect();
            let sampling = match c["sampling"].as_str().expect("sampling") {
                "poisson" => Sampling::Poisson,
                "without_replacement" => Sampling::WithoutReplacement,
                "truncated_poisson" => Sampling::TruncatedPoisson {
                    dataset_size: segs[0][3] as usize,
                    max_batch: segs[0][4] as usize,
                },
                other => panic!("unknown sampling {other}"),
            };
            Case {
                sampling,
                history: segs.iter().map(|s| (s[0], s[1], s[2] as usize)).collect(),
                deltas: numbers(&c["deltas"]),
                pld: numbers(&c["pld_epsilon"]),
                rdp: (!c["rdp_epsilon"].is_null()).then(|| numbers(&c["rdp_epsilon"])),
            }
        })
        .collect();
    assert!(cases.len() >= 60, "the fixture holds {} cases", cases.len());
    cases
}

fn accountant(mechanism: Mechanism, case: &Case) -> Accountant {
    let mut acc = Accountant::new(mechanism)
        .with_sampling(case.sampling)
        .expect("supported");
    for &(sigma, q, n) in &case.history {
        acc.record(sigma, q, n).expect("valid step");
    }
    acc
}

#[test]
fn pld_matches_dp_accounting_within_half_a_percent() {
    let (mut worst, mut lowest) = (0.0f64, 0.0f64);
    let mut counted = [0usize; 3];
    for case in cases() {
        let acc = accountant(Mechanism::Pld, &case);
        for (&delta, &want) in case.deltas.iter().zip(&case.pld) {
            let got = acc.epsilon(delta).expect("epsilon");
            let rel = (got - want) / want;
            assert!(
                rel.abs() <= 5e-3,
                "{:?} {:?} at delta {delta:e}: ours {got}, dp_accounting {want} ({:+.3}%)",
                case.sampling,
                case.history,
                rel * 100.0
            );
            worst = worst.max(rel.abs());
            lowest = lowest.min(rel);
        }
        counted[match case.sampling {
            Sampling::Poisson => 0,
            Sampling::WithoutReplacement => 1,
            _ => 2,
        }] += 1;
    }
    assert!(counted.iter().all(|&c| c >= 8), "cases per scheme: {counted:?}");
    eprintln!(
        "PLD vs dp_accounting: worst {:.4}%, lowest {:+.4}%",
        worst * 100.0,
        lowest * 100.0
    );
}

#[test]
fn rdp_without_replacement_matches_dp_accounting() {
    let mut seen = 0;
    for case in cases()
        .into_iter()
        .filter(|c| c.sampling == Sampling::WithoutReplacement)
    {
        let acc = accountant(Mechanism::Rdp, &case);
        let pld = accountant(Mechanism::Pld, &case);
        for (&delta, &want) in case.deltas.iter().zip(case.rdp.as_ref().expect("rdp figures")) {
            let got = acc.epsilon(delta).expect("epsilon");
            assert!(
                ((got - want) / want).abs() <= 5e-3,
                "{:?} at delta {delta:e}: ours {got}, dp_accounting {want}",
                case.history
            );
            // two upper bounds on one mechanism: the numerical one is the tighter
            assert!(pld.epsilon(delta).expect("pld") <= got);
            seen += 1;
        }
    }
    assert!(seen >= 24);
}

/// `δ(ε)` of `n` Gaussian mechanisms of noise `s` (sensitivity 1): the
/// `μ`-GDP curve with `μ = √n / s`, exact.
fn gaussian_delta(eps: f64, mu: f64) -> f64 {
    let phi = |x: f64| 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
    phi(-eps / mu + mu / 2.0) - eps.exp() * phi(-eps / mu - mu / 2.0)
}

#[test]
fn full_batch_is_the_gaussian_mechanism_from_above() {
    for (sigma, n) in [(1.0, 1), (2.0, 100), (5.0, 1000), (0.8, 10)] {
        let mut acc = Accountant::new(Mechanism::Pld);
        acc.record(sigma, 1.0, n).unwrap();
        let mu = (n as f64).sqrt() / sigma;
        for delta in [1e-5, 1e-7] {
            let eps = acc.epsilon(delta).unwrap();
            // ours is an upper bound: the exact δ at our ε is at most δ ...
            assert!(gaussian_delta(eps, mu) <= delta * (1.0 + 1e-6), "sigma {sigma} n {n}");
            // ... and not by much: the exact ε is within 0.5% below ours
            let exact = bisect(|e| gaussian_delta(e, mu) - delta, 0.0, 200.0);
            assert!(
                eps >= exact - 1e-9 && eps <= exact * 1.005 + 1e-4,
                "{eps} vs exact {exact}"
            );
        }
    }
}

/// The root of a decreasing `f` on `[lo, hi]`.
fn bisect(f: impl Fn(f64) -> f64, mut lo: f64, mut hi: f64) -> f64 {
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if f(mid) > 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

#[test]
fn epsilon_and_delta_are_inverse() {
    let pld = Pld::poisson(1.1, 0.01, INTERVAL).unwrap().self_composed(1000).unwrap();
    for delta in [1e-3, 1e-5, 1e-7] {
        let eps = pld.epsilon(delta);
        assert!(pld.delta(eps) <= delta * (1.0 + 1e-9), "delta {delta}");
        assert!(pld.delta(eps - 1e-3) > delta, "epsilon {eps} is not the smallest");
    }
}

#[test]
fn steps_compose_as_one_run() {
    // a run split in two segments is the same run
    let mut one = Accountant::new(Mechanism::Pld);
    one.record(1.0, 0.01, 1000).unwrap();
    let mut split = Accountant::new(Mechanism::Pld);
    split.record(1.0, 0.01, 400).unwrap();
    split.record(1.0 + 1e-15, 0.01, 600).unwrap();
    let (a, b) = (one.epsilon(1e-5).unwrap(), split.epsilon(1e-5).unwrap());
    assert!((a - b).abs() / a < 1e-3, "{a} vs {b}");
    // more noise in the second half spends less
    let mut quieter = Accountant::new(Mechanism::Pld);
    quieter.record(1.0, 0.01, 400).unwrap();
    quieter.record(2.0, 0.01, 600).unwrap();
    assert!(quieter.epsilon(1e-5).unwrap() < a);
}

#[test]
fn binomial_tail_matches_direct_sums() {
    for (n, q) in [(10u64, 0.3f64), (200, 0.05), (1000, 0.5), (60_000, 0.004)] {
        let pmf: Vec<f64> = {
            let mut p = vec![(1.0 - q).powf(n as f64)];
            for j in 0..n {
                let next = p[j as usize] * (n - j) as f64 / (j + 1) as f64 * q / (1.0 - q);
                p.push(next);
            }
            p
        };
        for k in [0, 1, n / 10, (n as f64 * q) as u64, (n as f64 * q) as u64 + 3, n] {
            let direct: f64 = pmf[k as usize..].iter().sum();
            let ours = binomial_at_least(n, q, k);
            assert!(
                (ours - direct).abs() <= 1e-9 * direct.max(1e-300) + 1e-15,
                "n {n} q {q} k {k}: {ours} vs {direct}"
            );
        }
    }
    assert_eq!(binomial_at_least(5, 0.5, 6), 0.0);
}

#[test]
fn schemes_save_and_restore() {
    let sampling = Sampling::TruncatedPoisson {
        dataset_size: 60_000,
        max_batch: 300,
    };
    let mut acc = Accountant::new(Mechanism::Pld)
        .with_sampling(sampling)
        .unwrap()
        .with_interval(2e-4)
        .unwrap();
    acc.record(1.0, 0.004, 50).unwrap();
    let back = Accountant::from_json(&acc.to_json()).unwrap();
    assert_eq!(back, acc);
    assert_eq!(back.epsilon(1e-5).unwrap(), acc.epsilon(1e-5).unwrap());
    // a state saved before sampling schemes existed reads as Poisson
    let old = r#"{"mechanism":"rdp","eps_error":0.01,"history":[[1.0,0.01,10]]}"#;
    assert_eq!(Accountant::from_json(old).unwrap().sampling(), Sampling::Poisson);
    let bad = r#"{"mechanism":"pld","eps_error":0.01,"history":[],"sampling":{"scheme":"shuffled"}}"#;
    assert!(Accountant::from_json(bad).unwrap_err().to_string().contains("shuffled"));
}

#[test]
fn unsound_pairs_are_refused_by_name() {
    for (mechanism, sampling) in [
        (Mechanism::Prv, Sampling::WithoutReplacement),
        (Mechanism::Gdp, Sampling::WithoutReplacement),
        (
            Mechanism::Rdp,
            Sampling::TruncatedPoisson {
                dataset_size: 10,
                max_batch: 2,
            },
        ),
    ] {
        let err = Accountant::new(mechanism)
            .with_sampling(sampling)
            .unwrap_err()
            .to_string();
        assert!(err.contains(sampling.name()) && err.contains(mechanism.name()), "{err}");
        // the same history reported by an analysis that does not cover it
        let acc = Accountant::new(Mechanism::Pld).with_sampling(sampling).unwrap();
        assert!(acc.with_mechanism(mechanism).epsilon(1e-5).is_err());
    }
    let zero = Sampling::TruncatedPoisson {
        dataset_size: 0,
        max_batch: 2,
    };
    assert!(Accountant::new(Mechanism::Pld).with_sampling(zero).is_err());
    assert!(Accountant::new(Mechanism::Pld).with_interval(0.0).is_err());
    assert!(Accountant::new(Mechanism::Pld).with_interval(f64::NAN).is_err());
    assert_eq!("PLD".parse::<Mechanism>().unwrap(), Mechanism::Pld);
    // the σ search refuses an analysis the scheme has none of, and bad targets
    let wor = Accountant::new(Mechanism::Pld)
        .with_sampling(Sampling::WithoutReplacement)
        .unwrap();
    assert!(wor
        .with_mechanism(Mechanism::Prv)
        .noise_multiplier(1.0, 1e-5, 0.01, 10)
        .is_err());
    assert!(wor.noise_multiplier(f64::NAN, 1e-5, 0.01, 10).is_err());
    assert!(wor.noise_multiplier(1.0, 1e-5, 1.5, 10).is_err());
}

#[test]
fn nothing_released_spends_nothing() {
    for mechanism in [Mechanism::Pld, Mechanism::Rdp] {
        let mut acc = Accountant::new(mechanism)
            .with_sampling(Sampling::WithoutReplacement)
            .unwrap();
        assert_eq!(acc.epsilon(1e-5).unwrap(), 0.0, "{mechanism:?}, no step");
        acc.record(1.0, 0.0, 100).unwrap();
        assert_eq!(acc.epsilon(1e-5).unwrap(), 0.0, "{mechanism:?}, q = 0");
        acc.record(0.0, 0.1, 1).unwrap();
        assert_eq!(acc.epsilon(1e-5).unwrap(), f64::INFINITY, "{mechanism:?}, no noise");
    }
}
