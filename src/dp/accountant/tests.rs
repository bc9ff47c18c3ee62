//! The accountant as a whole: Opacus's PRV figures, the mechanisms against
//! each other, the saved state, and bad input.

use super::*;

/// The PRV (and RDP) ε Opacus reports for five settings.
fn opacus_cases() -> Vec<(f64, f64, usize, f64, f64, f64)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/prv_epsilon.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a list of cases");
    assert!(!cases.is_empty());
    cases
        .iter()
        .map(|c| {
            let num = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} in {c}"));
            let steps = c["steps"].as_u64().expect("steps") as usize;
            (
                num("sample_rate"),
                num("noise_multiplier"),
                steps,
                num("delta"),
                num("epsilon_prv"),
                num("epsilon_rdp"),
            )
        })
        .collect()
}

fn run(mechanism: Mechanism, sigma: f64, q: f64, steps: usize) -> Accountant {
    let mut acc = Accountant::new(mechanism);
    for _ in 0..steps {
        acc.step(sigma, q).unwrap();
    }
    acc
}

#[test]
fn prv_matches_opacus_within_one_percent() {
    for (q, sigma, steps, delta, want_prv, want_rdp) in opacus_cases() {
        let prv = run(Mechanism::Prv, sigma, q, steps);
        let (lo, est, hi) = prv.epsilon_range(delta).unwrap();
        let rel = (hi - want_prv).abs() / want_prv;
        assert!(
            rel < 0.01,
            "q={q} sigma={sigma} steps={steps}: {hi} vs Opacus {want_prv} ({rel:.2e})"
        );
        assert!(lo < est && est < hi && hi - lo < 0.021, "{lo} {est} {hi}");
        let rdp = run(Mechanism::Rdp, sigma, q, steps).epsilon(delta).unwrap();
        assert!((rdp - want_rdp).abs() / want_rdp < 1e-3, "{rdp} vs {want_rdp}");
        // PRV is the tighter bound.
        assert!(hi < rdp, "{hi} vs RDP {rdp}");
    }
}

#[test]
fn prv_composes_different_runs() {
    // Two halves kept apart (as a loaded state keeps them) take the
    // convolution path; they must agree with the one run of the same steps.
    let whole = run(Mechanism::Prv, 1.1, 0.01, 1000);
    let json = r#"{"mechanism":"prv","eps_error":0.01,"history":[[1.1,0.01,400],[1.1,0.01,600]]}"#;
    let split = Accountant::from_json(json).unwrap();
    assert_eq!(split.history().len(), 2);
    let (a, b) = (
        whole.epsilon_range(1e-5).unwrap().1,
        split.epsilon_range(1e-5).unwrap().1,
    );
    assert!((a - b).abs() < 2e-3, "{a} vs {b}");
    // Mixed parameters lie between the two constant runs.
    let mut mixed = run(Mechanism::Prv, 1.1, 0.01, 500);
    mixed.record(2.0, 0.01, 500).unwrap();
    let low = run(Mechanism::Prv, 2.0, 0.01, 1000).epsilon(1e-5).unwrap();
    let m = mixed.epsilon(1e-5).unwrap();
    assert!(low < m && m < whole.epsilon(1e-5).unwrap(), "{low} {m}");
}

#[test]
fn gdp_is_close_to_prv_for_many_small_steps() {
    // The central limit regime: many steps at a small rate.
    let gdp = run(Mechanism::Gdp, 1.1, 0.01, 1000).epsilon(1e-5).unwrap();
    let prv = run(Mechanism::Prv, 1.1, 0.01, 1000).epsilon_range(1e-5).unwrap().1;
    assert!((gdp - prv).abs() / prv < 0.1, "gdp {gdp} prv {prv}");
    let mut changing = run(Mechanism::Gdp, 1.1, 0.01, 10);
    changing.step(2.0, 0.01).unwrap();
    assert!(changing.epsilon(1e-5).unwrap_err().to_string().contains("constant"));
}

#[test]
fn edge_cases() {
    for m in [Mechanism::Prv, Mechanism::Rdp, Mechanism::Gdp] {
        let empty = Accountant::new(m);
        assert_eq!(empty.epsilon(1e-5).unwrap(), 0.0, "{m:?}");
        // Not sampled, nothing spent (RDP's conversion keeps its floor of
        // about 0.1, as Opacus's does); no noise, no privacy.
        let unsampled = run(m, 1.0, 0.0, 10).epsilon(1e-5).unwrap();
        assert!(unsampled == 0.0 || (m == Mechanism::Rdp && unsampled < 0.11), "{m:?}");
        assert_eq!(run(m, 0.0, 0.1, 10).epsilon(1e-5).unwrap(), f64::INFINITY, "{m:?}");
        for delta in [0.0, -1.0, 1.0, f64::NAN] {
            let msg = run(m, 1.0, 0.1, 3).epsilon(delta).unwrap_err().to_string();
            assert!(msg.contains("delta"), "{msg}");
        }
        // More steps never cost less.
        let few = run(m, 1.0, 0.05, 50).epsilon(1e-5).unwrap();
        let more = run(m, 1.0, 0.05, 100).epsilon(1e-5).unwrap();
        assert!(few < more, "{m:?}: {few} {more}");
    }
    // A budget whose grid would not fit is refused, naming the size.
    let mut huge = Accountant::new(Mechanism::Prv).with_eps_error(1e-6).unwrap();
    huge.record(1.0, 0.01, 100_000).unwrap();
    let msg = huge.epsilon(1e-5).unwrap_err().to_string();
    assert!(msg.contains("grid") && msg.contains("eps_error"), "{msg}");
    // So is a δ below what the grid's rounding allows.
    let msg = run(Mechanism::Prv, 1.0, 0.05, 100)
        .epsilon(1e-13)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("too small"), "{msg}");
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(Accountant::new(Mechanism::Prv).with_eps_error(bad).is_err());
    }
}

#[test]
fn state_round_trips_and_bad_state_is_refused() {
    let mut acc = Accountant::new(Mechanism::Rdp).with_eps_error(0.02).unwrap();
    acc.record(1.0 / 3.0, 0.044_537_230_340_988_17, 660).unwrap();
    acc.record(0.7, 0.1, 3).unwrap();
    let back = Accountant::from_json(&acc.to_json()).unwrap();
    assert_eq!(back, acc);
    assert_eq!(back.steps(), 663);
    assert_eq!("PRV".parse::<Mechanism>().unwrap(), Mechanism::Prv);
    for bad in [
        "",
        "{}",
        r#"{"mechanism":"moments","eps_error":0.01,"history":[]}"#,
        r#"{"mechanism":"rdp","history":[]}"#,
        r#"{"mechanism":"rdp","eps_error":0.01,"history":[[1.0,0.1]]}"#,
        r#"{"mechanism":"rdp","eps_error":0.01,"history":[[1.0,1.5,3]]}"#,
        r#"{"mechanism":"rdp","eps_error":0.01,"history":[[-1.0,0.1,3]]}"#,
        r#"{"mechanism":"rdp","eps_error":0.01,"history":[[1.0,0.1,-3]]}"#,
    ] {
        let err = Accountant::from_json(bad).unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::Checkpoint {
                    what: "Accountant::from_json",
                    ..
                }
            ),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn noise_multiplier_each_mechanism() {
    // The digits example's setting: q = 0.0445, 660 steps, ε = 7.67 at σ = 1.
    let (q, steps) = (0.044_537_230_340_988_17, 660);
    let mut sigmas = vec![];
    for m in [Mechanism::Prv, Mechanism::Rdp] {
        let sigma = noise_multiplier(m, 7.669, 1e-5, q, steps).unwrap();
        let mut acc = Accountant::new(m);
        acc.record(sigma, q, steps).unwrap();
        let eps = acc.epsilon(1e-5).unwrap();
        assert!(eps <= 7.669 && 7.669 - eps <= 0.01, "{m:?}: sigma {sigma} eps {eps}");
        sigmas.push(sigma);
    }
    // PRV needs less noise for the same ε: about σ = 1 for this target.
    assert!(sigmas[0] < sigmas[1], "{sigmas:?}");
    // GDP, constant steps only, reaches its target too.
    let sigma = noise_multiplier(Mechanism::Gdp, 2.0, 1e-5, q, steps).unwrap();
    let mut acc = Accountant::new(Mechanism::Gdp);
    acc.record(sigma, q, steps).unwrap();
    let eps = acc.epsilon(1e-5).unwrap();
    assert!(eps <= 2.0 && 2.0 - eps <= 0.01, "gdp: sigma {sigma} eps {eps}");
    assert!((sigmas[0] - 1.0).abs() < 0.01, "{sigmas:?}");
}
