//! Random DP settings (noise multipliers, clipping bounds, batch sizes,
//! physical batches, sample rates, δ, target ε, error bands, learning
//! rates: sensible, extreme and bad) through the privacy engine, a step and
//! the accountants: each call gives a result that makes sense (no NaN ε,
//! finite parameters after a step with finite settings) or an `Error` that
//! is not `Error::Internal`, never a panic.
//!
//! CI runs the same 32 cases every time; `CANDLE_FUNC_FUZZ_CASES=2000
//! cargo test --release --test random_dp -- --nocapture` runs fresh ones
//! and prints the tally.

use candle_core::{Device, Tensor};
use candle_func::dp::accountant::{compute_rdp, eps_from_rdp, noise_multiplier, Accountant, Mechanism};
use candle_func::dp::{DpConfig, PrivacyEngine};
use candle_func::rng::Rng;
use candle_func::{Error, Tracer};
use candle_nn::VarMap;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A value: mostly sensible, now and then extreme or bad.
fn real() -> impl Strategy<Value = f64> {
    let sensible = prop::sample::select(vec![0.01, 0.1, 0.5, 1.0, 1.1, 3.0, 8.0]);
    let odd = prop::sample::select(vec![
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -1.0,
        0.0,
        1e-300,
        1e-5,
        1e6,
        1e300,
    ]);
    prop_oneof![4 => sensible, 1 => odd]
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => prop::sample::select(vec![1usize, 3, 5, 11, 12]),
        1 => prop::sample::select(vec![0usize, 13, usize::MAX]),
    ]
}

/// A δ: mostly one a run would use.
fn delta() -> impl Strategy<Value = f64> {
    prop_oneof![4 => prop::sample::select(vec![1e-5, 1e-3, 0.01]), 1 => real()]
}

fn mechanism() -> impl Strategy<Value = Mechanism> {
    prop::sample::select(vec![Mechanism::Prv, Mechanism::Rdp, Mechanism::Gdp])
}

/// One case: the engine's settings, the config, the search's target, and
/// what the accountant is asked afterwards.
#[derive(Clone, Debug)]
struct Case {
    mechanism: Mechanism,
    eps_error: Option<f64>,
    physical: Option<usize>,
    ghost: bool,
    batch: usize,
    noise: f64,
    clip: f64,
    lr: f64,
    /// `(target ε, δ, epochs)` for make_private_with_epsilon, else none
    target: Option<(f64, f64, f64)>,
    delta: f64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            mechanism(),
            prop::option::of(real()),
            prop::option::of(size()),
            any::<bool>(),
        ),
        (size(), real(), real(), real()),
        (prop::option::of((real(), delta(), real())), delta()),
    )
        .prop_map(
            |((mechanism, eps_error, physical, ghost), (batch, noise, clip, lr), (target, delta))| Case {
                mechanism,
                eps_error,
                physical,
                ghost,
                batch,
                noise,
                clip,
                lr,
                target,
                delta,
            },
        )
}

/// A 3 -> 2 linear layer's squared error, 12 examples.
fn setup() -> (VarMap, Tensor, Tensor) {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        let w = Tensor::new(&[[0.5f32, -1., 0.25], [1., 0.5, -0.5]], &Device::Cpu).unwrap();
        data.insert("w".into(), candle_core::Var::from_tensor(&w).unwrap());
    }
    let xs = Tensor::arange(0f32, 36., &Device::Cpu)
        .unwrap()
        .reshape((12, 3))
        .unwrap();
    let xs = (xs / 36.).unwrap();
    let ys = Tensor::ones((12, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
    (vm, xs, ys)
}

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let out = x.unsqueeze(0)?.broadcast_matmul(&p["w"].t()?)?;
    out.sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()
}

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

/// Runs the case: builds the trainer, takes a step, asks ε. Ok(label) when
/// everything that succeeded made sense, Err(what went wrong) when a
/// result did not.
fn run(c: &Case) -> candle_func::Result<std::result::Result<&'static str, String>> {
    let (vm, xs, ys) = setup();
    let mut engine = PrivacyEngine::new()
        .rng(Rng::seeded(1))
        .accountant(c.mechanism)
        .ghost(c.ghost);
    if let Some(e) = c.eps_error {
        engine = engine.eps_error(e);
    }
    if let Some(n) = c.physical {
        engine = engine.physical_batch(n);
    }
    let opt = candle_func::optim::Sgd::new(&vm, c.lr, 0.0)?;
    let config = DpConfig::new(c.batch, c.noise, c.clip);
    let mut t = match c.target {
        Some(target) => engine.make_private_with_epsilon(loss as Loss, &vm, opt, (&xs, &ys), config, target)?,
        None => engine.make_private(loss as Loss, &vm, opt, (&xs, &ys), config)?,
    };
    t.step()?;
    let finite = [c.clip, c.lr].iter().all(|v| v.is_finite() && v.abs() < 1e3);
    let w = vm.data().lock().unwrap()["w"]
        .as_tensor()
        .flatten_all()?
        .to_vec1::<f32>()?;
    if finite && c.noise < 1e3 && w.iter().any(|v| !v.is_finite()) {
        return Ok(Err(format!("parameters not finite after a step: {w:?}")));
    }
    let eps = t.epsilon(c.delta)?;
    if eps.is_nan() || eps < 0.0 {
        return Ok(Err(format!("epsilon {eps}")));
    }
    Ok(Ok("stepped"))
}

/// The accountants' free functions on the same values.
fn accounting(c: &Case) -> candle_func::Result<std::result::Result<&'static str, String>> {
    let q = c.clip.clamp(-2.0, 2.0); // a sample rate from the pool
    let rdp = compute_rdp(q, c.noise, c.batch.min(1 << 20), &[1.5, 2.0, 32.0])?;
    let (eps, _) = eps_from_rdp(&[1.5, 2.0, 32.0], &rdp, c.delta)?;
    if eps.is_nan() || rdp.iter().any(|r| r.is_nan()) {
        return Ok(Err(format!("rdp {rdp:?}, epsilon {eps}")));
    }
    let mut acc = Accountant::new(c.mechanism);
    acc.record(c.noise, q, c.batch.min(1 << 20))?;
    let eps = acc.epsilon(c.delta)?;
    if eps.is_nan() || eps < 0.0 {
        return Ok(Err(format!("accountant epsilon {eps}")));
    }
    if let Some((target, delta, _)) = c.target.filter(|_| c.mechanism != Mechanism::Prv) {
        let sigma = noise_multiplier(c.mechanism, target, delta, q, c.batch.min(1000))?;
        if sigma.is_nan() || sigma < 0.0 {
            return Ok(Err(format!("noise multiplier {sigma}")));
        }
    }
    Ok(Ok("accounted"))
}

#[test]
fn random_dp_settings_give_a_trainer_or_an_error() {
    let asked: Option<u32> = std::env::var("CANDLE_FUNC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    let config = Config {
        cases: asked.unwrap_or(32),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = match asked {
        Some(_) => TestRunner::new(config),
        None => TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha)),
    };
    let tally: RefCell<BTreeMap<String, usize>> = RefCell::new(BTreeMap::new());
    let count = |k: String| *tally.borrow_mut().entry(k).or_default() += 1;
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = runner.run(&case(), |c| {
        type Check = fn(&Case) -> candle_func::Result<std::result::Result<&'static str, String>>;
        for (name, check) in [("engine", run as Check), ("accounting", accounting as Check)] {
            match catch_unwind(AssertUnwindSafe(|| check(&c))) {
                Ok(Ok(Ok(label))) => count(format!("{name}: {label}")),
                Ok(Ok(Err(wrong))) => return Err(TestCaseError::fail(format!("{name}: {wrong} on {c:?}"))),
                Ok(Err(e @ Error::Internal { .. })) => {
                    return Err(TestCaseError::fail(format!("{name} hit a bug on {c:?}: {e}")))
                }
                Ok(Err(e)) => {
                    let d = format!("{e:?}");
                    count(format!(
                        "{name}: Error::{}",
                        d.split([' ', '{', '(']).next().unwrap_or("?")
                    ));
                }
                Err(_) => return Err(TestCaseError::fail(format!("{name} panicked on {c:?}"))),
            }
        }
        Ok(())
    });
    std::panic::set_hook(hook);
    println!("{:#?}", tally.borrow());
    result.unwrap();
}
