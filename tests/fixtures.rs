//! PyTorch's numbers: every `*.safetensors` case in `tests/fixtures` (or in
//! the directory named by `CANDLE_FUNC_FIXTURES`) runs through every conv
//! route. `ensemble` cases compare the logits of all models (vmap over
//! stacked parameters); `per_sample_grad` cases compare the per-sample
//! gradients of every parameter (`vmap(grad)`), the logits and the
//! per-example losses. A case the crate cannot handle fails; none is skipped.
//! Models are built from the `arch` string with `candle_func::nn` layers whose
//! weights load from the fixture's tensors by name (as a PyTorch state dict
//! would), and run through `functional_call` and `stack_params`.

mod common;

use candle_core::{Device, Tensor};
use candle_func::nn::{functional_call, stack_params, Module};
use candle_func::{value_and_grad, vmap, ConvRoute, Schedule, Tracer};
use common::arch::{build_nn, cross_entropy, parse};
use common::max_diff;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;

struct Fixture {
    name: String,
    meta: HashMap<String, String>,
    tensors: HashMap<String, Tensor>,
}

fn load(path: &Path) -> Fixture {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
    Fixture {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        meta,
        tensors,
    }
}

fn fixture_dir() -> PathBuf {
    match std::env::var_os("CANDLE_FUNC_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

fn params(f: &Fixture) -> BTreeMap<String, Tensor> {
    f.tensors
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("param.").map(|n| (n.to_string(), v.clone())))
        .collect()
}

/// |a - b| <= TOL * max(1, |b|) elementwise, reported as the worst ratio.
fn check(what: &str, got: &Tensor, want: &Tensor) -> f64 {
    let d = max_diff(got, want);
    let scale = want
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1.0) as f64;
    assert!(
        d <= TOL * scale,
        "{what}: max difference {d:e} exceeds {TOL:e} (scale {scale})"
    );
    d
}

/// The fixture's model as `nn` layers, weights loaded by name from `p`.
fn model(f: &Fixture, p: &BTreeMap<String, Tensor>) -> candle_func::nn::Sequential {
    let vb =
        candle_nn::VarBuilder::from_tensors(p.clone().into_iter().collect(), candle_core::DType::F32, &Device::Cpu);
    let m = build_nn(&parse(&f.meta["arch"]), &vb).unwrap_or_else(|e| panic!("{}: {e}", f.name));
    assert_eq!(
        m.params().keys().collect::<Vec<_>>(),
        p.keys().collect::<Vec<_>>(),
        "{}: parameter names",
        f.name
    );
    m
}

fn run_per_sample(f: &Fixture, route: ConvRoute, schedule: Schedule) -> String {
    let x = &f.tensors["x"];
    let y = &f.tensors["y"];
    let p = params(f);
    let net = model(f, &p);
    // Each example's own loss, as PyTorch computed it on a batch of one.
    let loss_fn = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| -> candle_func::Result<(Tracer, Tracer)> {
        let logits = functional_call(&net, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        Ok((cross_entropy(&logits, &y)?, logits))
    };
    let ((loss, logits), grads) = vmap(value_and_grad(loss_fn).has_aux())
        .in_dims([None, Some(0), Some(0)])
        .conv_route(route)
        .schedule(schedule)
        .call((&p, x, y))
        .unwrap_or_else(|e| panic!("{} {route:?}: {e}", f.name));
    let dl = check(&format!("{} {route:?} logits", f.name), &logits, &f.tensors["logits"]);
    let dx = check(&format!("{} {route:?} loss", f.name), &loss, &f.tensors["loss"]);
    let mut dg: f64 = 0.0;
    assert_eq!(grads.len(), p.len(), "{}: one gradient per parameter", f.name);
    for (name, g) in &grads {
        let want = &f.tensors[&format!("grad.{name}")];
        dg = dg.max(check(&format!("{} {route:?} grad.{name}", f.name), g, want));
    }
    format!("logits max diff {dl:.2e}, loss max diff {dx:.2e}, per-sample grads max diff {dg:.2e}")
}

fn run_ensemble(f: &Fixture, route: ConvRoute, schedule: Schedule) -> String {
    let shared = f.meta.get("shared_batch").map(|s| s == "true").unwrap_or(false);
    let stacked = params(f);
    // one model per slice of the stacked parameters, stacked again
    let m: usize = f.meta["models"].parse().unwrap();
    let nets: Vec<_> = (0..m)
        .map(|i| {
            model(
                f,
                &stacked.iter().map(|(k, v)| (k.clone(), v.get(i).unwrap())).collect(),
            )
        })
        .collect();
    let refs: Vec<&candle_func::nn::Sequential> = nets.iter().collect();
    let p = stack_params(&refs).unwrap();
    let x = &f.tensors["x"];
    let x_dim = if shared { None } else { Some(0) };
    let logits = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(&nets[0], &p, &x))
        .in_dims([Some(0), x_dim])
        .conv_route(route)
        .schedule(schedule)
        .call((&p, x))
        .unwrap_or_else(|e| panic!("{} {route:?}: {e}", f.name));
    let d = check(
        &format!("{} {route:?} ensemble logits", f.name),
        &logits,
        &f.tensors["logits"],
    );
    format!("ensemble logits max diff {d:.2e}")
}

#[test]
fn fixtures_match_pytorch() {
    let dir = fixture_dir();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no fixtures in {}", dir.display());
    let mut lines = 0;
    for path in &paths {
        let f = load(path);
        // every route batched, and the per-example schedule
        let runs = [
            (ConvRoute::Grouped, Schedule::Batched),
            (ConvRoute::Unfold, Schedule::Batched),
            (ConvRoute::Loop, Schedule::Batched),
            (ConvRoute::Unfold, Schedule::PerExample),
        ];
        for (route, schedule) in runs {
            let line = match f.meta.get("kind").map(String::as_str) {
                Some("per_sample_grad") => run_per_sample(&f, route, schedule),
                Some("ensemble") => run_ensemble(&f, route, schedule),
                other => panic!("{}: unknown fixture kind {other:?}", f.name),
            };
            println!("fixture {} route {route:?} schedule {schedule:?}: {line}", f.name);
            lines += 1;
        }
    }
    assert_eq!(lines, paths.len() * 4);
}
