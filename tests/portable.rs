//! The portable path (`Options::portable`, `CANDLE_FUNC_PORTABLE=1`): the
//! CPU runs candle's operations, as every other device does, instead of
//! the crate's kernels. Its results are candle's own to the bit where a
//! primitive is one candle operation, differ from the kernels' in the
//! last bits where those sum or approximate otherwise, and agree with
//! them to rounding on whole programs; the variable turns it on for a
//! function whose options do not say, and an option overrides it.
//! `.ci/run` also runs the fixture, loop and DP tests with the variable
//! set.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, Module, Params};
use candle_func::{grad, jit, vmap, Options, Tracer};
use common::{assert_close, max_diff};
use std::collections::BTreeMap;

fn x() -> Tensor {
    Tensor::randn(0f32, 2., 4096, &Device::Cpu).unwrap()
}

fn exp(x: Tracer) -> candle_func::Result<Tracer> {
    x.exp()
}

/// A stride-1 convolution with enough channels for the shifted-GEMM
/// kernel, and candle's `conv2d` on the same operands.
fn conv_operands() -> (Tensor, Tensor) {
    let x = Tensor::randn(0f32, 1., (2, 16, 12, 12), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 1., (8, 16, 3, 3), &Device::Cpu).unwrap();
    (x, w)
}

fn conv(x: Tracer, w: Tracer) -> candle_func::Result<Tracer> {
    x.conv2d(&w, 1, 1, 1, 1)
}

#[test]
fn portable_runs_candles_operations_and_the_kernels_do_not() {
    let x = x();
    let candle = x.exp().unwrap();
    let portable = jit(exp).options(Options::new().portable(true)).call(&x).unwrap();
    assert_eq!(max_diff(&portable, &candle), 0.0, "exp: candle's, to the bit");
    let fast = jit(exp).options(Options::new().portable(false)).call(&x).unwrap();
    assert!(max_diff(&fast, &candle) > 0.0, "the kernel's exp is its own");
    assert_close(&fast, &candle, 1e-6, "and agrees to rounding");

    let (xs, w) = conv_operands();
    let candle = xs.conv2d(&w, 1, 1, 1, 1).unwrap();
    let portable = jit(conv)
        .options(Options::new().portable(true))
        .call((&xs, &w))
        .unwrap();
    assert_eq!(max_diff(&portable, &candle), 0.0, "conv2d: candle's, to the bit");
    let fast = jit(conv)
        .options(Options::new().portable(false))
        .call((&xs, &w))
        .unwrap();
    assert_close(&fast, &candle, 1e-5, "the shifted GEMMs agree to rounding");
}

/// Per-sample gradients of a small CNN (convolutions, pooling, ReLU, a
/// linear layer, cross-entropy) through every route, on both paths.
#[test]
fn per_sample_gradients_agree_on_both_paths_through_every_route() {
    use candle_func::ConvRoute;
    let map = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let c1 = nn::conv2d(1, 4, 3, Default::default(), vb.pp("c1")).unwrap();
    let fc = nn::linear(4 * 5 * 5, 3, vb.pp("fc")).unwrap();
    let p: BTreeMap<String, Tensor> = [c1.params(), fc.params()].into_iter().flatten().collect();
    let xs = Tensor::randn(0f32, 1., (5, 1, 12, 12), &Device::Cpu).unwrap();
    let ys = Tensor::new(&[0u32, 2, 1, 1, 0], &Device::Cpu).unwrap();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let params = Params::with(&p);
        let h = c1.forward_with(&params, &x.unsqueeze(0)?)?.relu()?.max_pool2d(2)?;
        let logits = fc.forward_with(&params, &h.flatten_from(1)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let run = |route: ConvRoute, portable: bool| {
        vmap(grad(loss))
            .in_dims([None, Some(0), Some(0)])
            .options(Options::new().conv_route(route).portable(portable))
            .call((&p, &xs, &ys))
            .unwrap()
    };
    let want = run(ConvRoute::Loop, false);
    for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop, ConvRoute::Auto] {
        let got = run(route, true);
        for (k, v) in &want {
            assert_close(&got[k], v, 1e-4, &format!("{route:?}, portable: d/d{k}"));
        }
    }
}

/// The child: what the variable alone does (run by the test below).
#[test]
#[ignore]
fn child_with_the_variable_set() {
    if std::env::var(candle_func::settings::PORTABLE_ENV).as_deref() != Ok("1") {
        return;
    }
    let x = x();
    let candle = x.exp().unwrap();
    let by_env = jit(exp).call(&x).unwrap();
    assert_eq!(max_diff(&by_env, &candle), 0.0, "the variable turns it on");
    let overridden = jit(exp).options(Options::new().portable(false)).call(&x).unwrap();
    assert!(max_diff(&overridden, &candle) > 0.0, "an option overrides the variable");
    println!("CHILD OK");
}

#[test]
fn the_variable_turns_it_on_for_a_function_whose_options_do_not_say() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_with_the_variable_set", "--nocapture"])
        .env(candle_func::settings::PORTABLE_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every door through which a graph or a step runs honours the options of
/// the caller, not the environment alone: a graph from `make_graph` runs on
/// its function's path and under its memory limit, `dp::privatize_with`
/// takes its path from options and refuses one it would not read.
#[test]
fn every_door_honours_the_callers_options() {
    let x = x();
    let candle = x.exp().unwrap();
    let graph = |o: Options| candle_func::make_graph(&jit(exp).options(o), &x).unwrap();
    let portable = graph(Options::new().portable(true))
        .run(std::slice::from_ref(&x))
        .unwrap();
    assert_eq!(max_diff(&portable[0], &candle), 0.0, "make_graph(..).run: candle's exp");
    let fast = graph(Options::new().portable(false))
        .run(std::slice::from_ref(&x))
        .unwrap();
    assert!(max_diff(&fast[0], &candle) > 0.0, "and the kernel's on the other path");
    let small = graph(Options::new().memory_limit(1024));
    match small.run(std::slice::from_ref(&x)) {
        Err(candle_func::Error::Memory { limit, .. }) => assert_eq!(limit, 1024),
        other => panic!("a graph made under a 1 KiB limit ran: {other:?}"),
    }

    let per_sample = BTreeMap::from([("w".to_string(), Tensor::ones((4, 3), DType::F32, &Device::Cpu).unwrap())]);
    let mut rng = candle_func::rng::Rng::seeded(3);
    let on = |o: Options, rng: &mut candle_func::rng::Rng| {
        candle_func::dp::privatize_with(&per_sample, (1.0, 0.5, 4.0), rng, &o)
    };
    assert_eq!(on(Options::new().portable(true), &mut rng).unwrap()["w"].dims(), &[3]);
    let err = on(Options::new().memory_limit(1 << 20), &mut rng)
        .unwrap_err()
        .to_string();
    assert!(err.contains("privatize") && err.contains("portable"), "{err}");
    // bad settings are errors naming the setting, on either path
    for (sigma, batch, what) in [(f64::NAN, 4.0, "noise_multiplier"), (0.5, 0.0, "expected_batch")] {
        for portable in [true, false] {
            let opts = Options::new().portable(portable);
            let e = candle_func::dp::privatize_with(&per_sample, (1.0, sigma, batch), &mut rng, &opts).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}
