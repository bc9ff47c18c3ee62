//! PyTorch's numbers: every `*.safetensors` case in `tests/fixtures` (or in
//! the directory named by `CANDLE_FUNC_FIXTURES`) runs through every conv
//! route. `ensemble` cases compare the logits of all models (vmap over
//! stacked parameters); `per_sample_grad` cases compare the per-sample
//! gradients of every parameter (`vmap(grad)`), the logits and the
//! per-example losses. A case the crate cannot handle fails; none is skipped.
//! Models are built from the `arch` string with `candle_func::nn` layers whose
//! weights load from the fixture's tensors by name (as a PyTorch state dict
//! would), and run through `functional_call` and `stack_params`. With
//! `CANDLE_FUNC_DEVICE=cuda` (and `--features cuda`) they run on the GPU.

mod common;

use candle_core::{Device, Tensor};
use candle_func::nn::{functional_call, stack_params, Module};
use candle_func::tracer::Operand;
use candle_func::{hessian, hvp, jacfwd, jacrev, jit, value_and_grad, vmap, ConvRoute, Function, Schedule, Tracer};
use common::arch::{build_nn, cross_entropy, parse};
use common::{max_abs, max_diff};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;

/// Every conv route batched, and the per-example schedule: how each
/// per-sample and ensemble case runs.
const RUNS: [(ConvRoute, Schedule); 4] = [
    (ConvRoute::Grouped, Schedule::Batched),
    (ConvRoute::Unfold, Schedule::Batched),
    (ConvRoute::Loop, Schedule::Batched),
    (ConvRoute::Unfold, Schedule::PerExample),
];

struct Fixture {
    name: String,
    meta: HashMap<String, String>,
    tensors: HashMap<String, Tensor>,
}

fn load(path: &Path) -> Fixture {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let tensors = candle_core::safetensors::load_buffer(&bytes, &device()).unwrap();
    Fixture {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        meta,
        tensors,
    }
}

/// The device the cases run on: the CPU, or the GPU where
/// `CANDLE_FUNC_DEVICE=cuda` (a build with `--features cuda`;
/// `scripts/gpu_check.sh` runs it so).
fn device() -> Device {
    // one for the process: each `new_cuda` is a device of its own, whose
    // tensors do not mix with another's
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    let make = || match std::env::var("CANDLE_FUNC_DEVICE").as_deref() {
        Err(_) | Ok("cpu") => Device::Cpu,
        Ok("cuda") => Device::new_cuda(0).unwrap_or_else(|e| panic!("CANDLE_FUNC_DEVICE=cuda: {e}")),
        Ok(other) => panic!("CANDLE_FUNC_DEVICE={other}: cpu or cuda"),
    };
    DEVICE.get_or_init(make).clone()
}

fn fixture_dir() -> PathBuf {
    match std::env::var_os("CANDLE_FUNC_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// The `*.safetensors` cases in `dir`, sorted; none is a failure.
fn cases(dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no fixtures in {}", dir.display());
    paths
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
    let scale = max_abs(want).max(1.0);
    assert!(
        d <= TOL * scale,
        "{what}: max difference {d:e} exceeds {TOL:e} (scale {scale})"
    );
    d
}

/// The fixture's model as `nn` layers, weights loaded by name from `p`.
fn model(f: &Fixture, p: &BTreeMap<String, Tensor>) -> candle_func::nn::Sequential {
    let vb = candle_nn::VarBuilder::from_tensors(p.clone().into_iter().collect(), candle_core::DType::F32, &device());
    let m = build_nn(&parse(&f.meta["arch"]), &vb).unwrap_or_else(|e| panic!("{}: {e}", f.name));
    assert_eq!(
        m.params().keys().collect::<Vec<_>>(),
        p.keys().collect::<Vec<_>>(),
        "{}: parameter names",
        f.name
    );
    m
}

/// Each example's own loss (`loss(logits, y)` of the model's output for it,
/// as PyTorch computed it on a batch of one) through `vmap(value_and_grad)`,
/// its logits, loss and every parameter's per-sample gradient checked
/// against the fixture's.
fn per_sample_against<M: Module>(
    f: &Fixture,
    net: &M,
    p: &BTreeMap<String, Tensor>,
    loss: impl Fn(&Tracer, &Tracer) -> candle_func::Result<Tracer>,
    (route, schedule): (ConvRoute, Schedule),
) -> String {
    let (x, y) = (&f.tensors["x"], &f.tensors["y"]);
    let loss_fn = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| -> candle_func::Result<(Tracer, Tracer)> {
        let logits = functional_call(net, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        Ok((loss(&logits, &y)?, logits))
    };
    let ((losses, logits), grads) = vmap(value_and_grad(loss_fn).has_aux())
        .in_dims([None, Some(0), Some(0)])
        .conv_route(route)
        .schedule(schedule)
        .call((p, x, y))
        .unwrap_or_else(|e| panic!("{} {route:?}: {e}", f.name));
    let dl = check(&format!("{} {route:?} logits", f.name), &logits, &f.tensors["logits"]);
    let dx = check(&format!("{} {route:?} loss", f.name), &losses, &f.tensors["loss"]);
    let mut dg: f64 = 0.0;
    assert_eq!(grads.len(), p.len(), "{}: one gradient per parameter", f.name);
    for (name, g) in &grads {
        let want = &f.tensors[&format!("grad.{name}")];
        dg = dg.max(check(&format!("{} {route:?} grad.{name}", f.name), g, want));
    }
    let dc = clipped_against(
        f,
        p,
        |p, x, y| loss(&functional_call(net, &p, &x.unsqueeze(0)?)?.squeeze(0)?, &y),
        route,
    );
    format!(
        "logits max diff {dl:.2e}, loss max diff {dx:.2e}, per-sample grads max diff {dg:.2e}, clipped sum {dc:.2e}"
    )
}

/// `dp::clipped_grad_sum` with ghost rules against the same step with
/// every per-sample gradient materialised (to 1e-5 relative) and against
/// the clipped sum of PyTorch's per-sample gradients (to `TOL`), at a
/// bound that clips about half the examples; the worst relative
/// difference to the materialised step.
fn clipped_against(
    f: &Fixture,
    p: &BTreeMap<String, Tensor>,
    loss: impl Fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>,
    route: ConvRoute,
) -> f64 {
    use candle_func::dp;
    let (x, y) = (&f.tensors["x"], &f.tensors["y"]);
    let want: BTreeMap<String, Tensor> = p
        .keys()
        .map(|k| (k.clone(), f.tensors[&format!("grad.{k}")].clone()))
        .collect();
    let norms = dp::norm_per_sample(&want).unwrap();
    let mut sorted = norms.to_vec1::<f32>().unwrap();
    sorted.sort_by(f32::total_cmp);
    let c = sorted[sorted.len() / 2] as f64;
    let step = |ghost: bool| {
        dp::clipped_grad_sum(&loss, c)
            .ghost(ghost)
            .conv_route(route)
            .call((p, x, y))
            .unwrap_or_else(|e| panic!("{} {route:?} clipped_grad_sum: {e}", f.name))
    };
    let (ghost, ghost_norms, _) = step(true);
    let (full, full_norms, _) = step(false);
    let torch = dp::clip_per_sample(&want, c).unwrap();
    check(&format!("{} {route:?} norms", f.name), &ghost_norms, &norms);
    let mut worst = relative(&ghost_norms, &full_norms);
    for (k, g) in &ghost {
        let r = relative(g, &full[k]);
        assert!(
            r <= 1e-5,
            "{} {route:?} {k}: ghost and materialised clipped sums differ by {r:e} relative",
            f.name
        );
        check(
            &format!("{} {route:?} clipped {k}", f.name),
            g,
            &torch[k].sum(0).unwrap(),
        );
        worst = worst.max(r);
    }
    worst
}

/// `max |a - b| / max |b|`.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / max_abs(b).max(f64::MIN_POSITIVE)
}

fn run_per_sample(f: &Fixture, route: ConvRoute, schedule: Schedule) -> String {
    let p = params(f);
    let net = model(f, &p);
    per_sample_against(f, &net, &p, cross_entropy, (route, schedule))
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

/// The parameters as one flat vector (in name order).
fn flat(p: &BTreeMap<String, Tensor>) -> Tensor {
    let parts: Vec<Tensor> = p.values().map(|t| t.flatten_all().unwrap()).collect();
    Tensor::cat(&parts, 0).unwrap()
}

/// `jacobian` cases: each example's Jacobian of its logits w.r.t. its
/// input (`vmap(jacrev)` and `vmap(jacfwd)`), each example's Hessian of its
/// loss w.r.t. its input, and the Hessian of the batch-mean loss w.r.t. all
/// parameters jointly applied to `v`.
fn run_jacobian(f: &Fixture, route: ConvRoute) -> String {
    let (x, y) = (&f.tensors["x"], &f.tensors["y"]);
    let p = params(f);
    let net = model(f, &p);
    let logits = |x: Tracer| net.forward(&x.unsqueeze(0)?)?.squeeze(0);
    let name = |what: &str| format!("{} {route:?} {what}", f.name);
    let jr = vmap(jacrev(logits))
        .conv_route(route)
        .call(x)
        .unwrap_or_else(|e| panic!("{}: {e}", name("jacrev")));
    let jf = vmap(jacfwd(logits))
        .conv_route(route)
        .call(x)
        .unwrap_or_else(|e| panic!("{}: {e}", name("jacfwd")));
    let dj = check(&name("jac.input (jacrev)"), &jr, &f.tensors["jac.input"]);
    check(&name("jac.input (jacfwd)"), &jf, &f.tensors["jac.input"]);
    let per_hessian = |x: Tracer, y: Tracer| {
        let loss = move |x: Tracer| cross_entropy(&logits(x)?, &y);
        Function::apply(&hessian(loss), (x,))
    };
    let h = vmap(per_hessian)
        .conv_route(route)
        .call((x, y))
        .unwrap_or_else(|e| panic!("{}: {e}", name("hessian")));
    let dh = check(&name("hessian.input"), &h, &f.tensors["hessian.input"]);
    // the batch-mean loss as a function of the parameter map
    let v: BTreeMap<String, Tensor> = p
        .keys()
        .map(|k| (k.clone(), f.tensors[&format!("v.{k}")].clone()))
        .collect();
    let loss = |q: BTreeMap<String, Tracer>| -> candle_func::Result<Tracer> {
        let like = &q[p.keys().next().expect("parameters")];
        let out = functional_call(&net, &q, &x.to_tracer(like)?)?;
        let lp = out.log_softmax(1)?;
        lp.gather(&y.unsqueeze(1).unwrap().to_tracer(like)?, 1)?
            .neg()?
            .mean_all()
    };
    let hv = hvp(&loss, &p, &v).unwrap_or_else(|e| panic!("{}: {e}", name("hvp")));
    let want = flat(
        &p.keys()
            .map(|k| (k.clone(), f.tensors[&format!("hvp.{k}")].clone()))
            .collect(),
    );
    let hv = flat(&hv);
    let dv = check(&name("hvp"), &hv, &want);
    format!("jacobian max diff {dj:.2e}, hessian {dh:.2e}, hvp {dv:.2e}")
}

/// `ntk` cases: the empirical NTK of the logits, contracting per-example
/// Jacobians w.r.t. all parameters (torch.func's `compute='full'`).
fn run_ntk(f: &Fixture, route: ConvRoute) -> String {
    let (x1, x2) = (&f.tensors["x1"], &f.tensors["x2"]);
    let p = params(f);
    let net = model(f, &p);
    // per parameter [N, classes, *shape]: each example's Jacobian w.r.t.
    // the parameter map, as the torch.func tutorial's
    // vmap(jacrev(fnet_single), (None, 0))
    let jac = |xs: &Tensor| {
        let logits = |q: BTreeMap<String, Tracer>, x: Tracer| functional_call(&net, &q, &x.unsqueeze(0)?)?.squeeze(0);
        vmap(jacrev(logits))
            .in_dims([None, Some(0)])
            .conv_route(route)
            .call((&p, xs))
            .unwrap_or_else(|e| panic!("{} {route:?} ntk: {e}", f.name))
    };
    let (j1, j2) = (jac(x1), jac(x2));
    // contract each parameter's block over its elements, then sum
    let mut k: Option<Tensor> = None;
    for name in p.keys() {
        let (a, b) = (&j1[name], &j2[name]);
        let (n1, c) = (a.dims()[0], a.dims()[1]);
        let n2 = b.dims()[0];
        let part = jit(|a: Tracer, b: Tracer| {
            a.reshape((n1 * c, ()))?
                .matmul(&b.reshape((n2 * c, ()))?.t()?)?
                .reshape((n1, c, n2, c))
        })
        .call((a, b))
        .unwrap();
        k = Some(match k {
            Some(k) => (k + part).unwrap(),
            None => part,
        });
    }
    let k = k.expect("parameters");
    let ntk = k.permute((0, 2, 1, 3)).unwrap();
    let d = check(&format!("{} {route:?} ntk", f.name), &ntk, &f.tensors["ntk"]);
    format!("ntk max diff {d:.2e}")
}

/// The `higher_order/` cases (Jacobians, Hessians, hvp, NTK), through every
/// conv route.
#[test]
fn higher_order_fixtures_match_pytorch() {
    let dir = fixture_dir().join("higher_order");
    let paths = cases(&dir);
    for path in &paths {
        let f = load(path);
        for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
            let line = match f.meta.get("kind").map(String::as_str) {
                Some("jacobian") => run_jacobian(&f, route),
                Some("ntk") => run_ntk(&f, route),
                other => panic!("{}: unknown fixture kind {other:?}", f.name),
            };
            println!("fixture {} route {route:?}: {line}", f.name);
        }
    }
}

/// The `tiny_lm(...)` architecture's settings.
fn lm_config(arch: &str) -> (usize, usize, usize, candle_func::nn::BlockConfig) {
    use candle_func::nn::{Activation, BlockConfig, NormKind};
    let inner = arch
        .strip_prefix("tiny_lm(")
        .and_then(|a| a.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not a tiny_lm: {arch}"));
    let kw: HashMap<&str, &str> = inner.split(',').filter_map(|a| a.split_once('=')).collect();
    let n = |k: &str| -> usize { kw[k].parse().unwrap_or_else(|_| panic!("{k} in {arch}")) };
    let block = BlockConfig {
        dim: n("dim"),
        heads: n("heads"),
        ff: n("ff"),
        causal: kw["causal"] == "true",
        norm: match kw["norm"] {
            "layernorm" => NormKind::LayerNorm,
            "rmsnorm" => NormKind::RmsNorm,
            other => panic!("unknown norm {other} in {arch}"),
        },
        act: match kw["act"] {
            "gelu" => Activation::Gelu,
            "gelu_tanh" => Activation::GeluTanh,
            "silu" => Activation::Silu,
            other => panic!("unknown activation {other} in {arch}"),
        },
    };
    (n("vocab"), n("seq"), n("layers"), block)
}

/// `tiny_lm` cases: each sequence's per-sample gradients of its mean
/// next-token cross-entropy, its logits `[T, V]` and its loss.
fn run_lm(f: &Fixture, route: ConvRoute, schedule: Schedule) -> String {
    use candle_func::nn::{cross_entropy_with, gpt, CrossEntropy};
    let p = params(f);
    let (vocab, seq, layers, block) = lm_config(&f.meta["arch"]);
    let vb = candle_nn::VarBuilder::from_tensors(p.clone().into_iter().collect(), candle_core::DType::F32, &device());
    let net = gpt(vocab, seq, layers, block, vb).unwrap_or_else(|e| panic!("{}: {e}", f.name));
    assert_eq!(
        net.params().keys().collect::<Vec<_>>(),
        p.keys().collect::<Vec<_>>(),
        "{}: names",
        f.name
    );
    // logits [T, V] against targets [T]: the mean over the positions
    let loss = |logits: &Tracer, y: &Tracer| cross_entropy_with(logits, y, CrossEntropy::default());
    per_sample_against(f, &net, &p, loss, (route, schedule))
}

/// The `layers/` cases (a GPT-style language model, GroupNorm and
/// LayerNorm models), through every conv route and the per-example
/// schedule.
#[test]
fn layers_fixtures_match_pytorch() {
    let dir = fixture_dir().join("layers");
    for path in &cases(&dir) {
        let f = load(path);
        for (route, schedule) in RUNS {
            let line = match (
                f.meta.get("kind").map(String::as_str),
                f.meta.get("loss").map(String::as_str),
            ) {
                (Some("per_sample_grad"), Some("lm_cross_entropy")) => run_lm(&f, route, schedule),
                (Some("per_sample_grad"), _) => run_per_sample(&f, route, schedule),
                other => panic!("{}: unknown fixture kind {other:?}", f.name),
            };
            println!("fixture {} route {route:?} {schedule:?}: {line}", f.name);
        }
    }
}

#[test]
fn fixtures_match_pytorch() {
    let dir = fixture_dir();
    let paths = cases(&dir);
    let mut lines = 0;
    for path in &paths {
        let f = load(path);
        for (route, schedule) in RUNS {
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

/// The `rnn_cls(...)` architecture's settings.
fn rnn_config(arch: &str) -> HashMap<String, String> {
    let inner = arch
        .strip_prefix("rnn_cls(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not an rnn_cls: {arch}"));
    inner
        .split(',')
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{kv} in {arch}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// `rnn_cls` cases: an embedding, PyTorch's LSTM or GRU over each
/// sequence's first `lengths[i]` tokens, and a linear head on the last
/// layer's final states (directions side by side). The example is the
/// ids with the length appended (`[T + 1]`), so the clipped-sum check
/// takes it as it takes the other cases' `x`.
fn run_rnn(f: &Fixture, route: ConvRoute, schedule: Schedule) -> String {
    use candle_func::nn::{self, Params, RecurrentConfig};
    let p = params(f);
    let kw = rnn_config(&f.meta["arch"]);
    let n = |k: &str| -> usize { kw[k].parse().unwrap_or_else(|_| panic!("{k} in {}", f.meta["arch"])) };
    let cfg = RecurrentConfig {
        layers: n("layers"),
        bidirectional: kw["bidirectional"] == "true",
        bias: true,
    };
    let vb = candle_nn::VarBuilder::from_tensors(p.clone().into_iter().collect(), candle_core::DType::F32, &device());
    let emb = nn::embedding(n("vocab"), n("emb"), vb.pp("emb")).unwrap();
    let rnn = match kw["kind"].as_str() {
        "lstm" => nn::lstm(n("emb"), n("hidden"), cfg, vb.pp("rnn")),
        "gru" => nn::gru(n("emb"), n("hidden"), cfg, vb.pp("rnn")),
        other => panic!("{}: unknown recurrent kind {other}", f.name),
    }
    .unwrap();
    let dirs = if cfg.bidirectional { 2 } else { 1 };
    let fc = nn::linear(n("hidden") * dirs, n("classes"), vb.pp("fc")).unwrap();
    let mut names: Vec<String> = [emb.params(), rnn.params(), fc.params()]
        .into_iter()
        .flatten()
        .map(|(k, _)| k)
        .collect();
    names.sort();
    assert_eq!(
        names,
        p.keys().cloned().collect::<Vec<_>>(),
        "{}: parameter names",
        f.name
    );
    let t = n("seq");
    let logits = |p: &BTreeMap<String, Tracer>, x: &Tracer| -> candle_func::Result<Tracer> {
        let params = Params::with(p);
        let (ids, len) = (x.narrow(0, 0, t)?, x.narrow(0, t, 1)?.squeeze(0)?);
        let e = emb.forward_with(&params, &ids)?;
        let h_n = rnn.run(&params, &e, Some(&len))?.h_n;
        // the last layer's directions, forward first: L*D H -> D*H
        let last = h_n.narrow(0, (cfg.layers - 1) * dirs, dirs)?.flatten_all()?;
        fc.forward_with(&params, &last)
    };
    let x = Tensor::cat(&[&f.tensors["ids"], &f.tensors["lengths"].unsqueeze(1).unwrap()], 1).unwrap();
    let y = &f.tensors["y"];
    let loss_fn = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| -> candle_func::Result<(Tracer, Tracer)> {
        let l = logits(&p, &x)?;
        Ok((cross_entropy(&l, &y)?, l))
    };
    let ((losses, out), grads) = vmap(value_and_grad(loss_fn).has_aux())
        .in_dims([None, Some(0), Some(0)])
        .conv_route(route)
        .schedule(schedule)
        .call((&p, &x, y))
        .unwrap_or_else(|e| panic!("{} {route:?} {schedule:?}: {e}", f.name));
    let dl = check(&format!("{} logits", f.name), &out, &f.tensors["logits"]);
    let dx = check(&format!("{} loss", f.name), &losses, &f.tensors["loss"]);
    let mut dg: f64 = 0.0;
    for (name, g) in &grads {
        dg = dg.max(check(
            &format!("{} grad.{name}", f.name),
            g,
            &f.tensors[&format!("grad.{name}")],
        ));
    }
    let mut with_x = Fixture {
        name: f.name.clone(),
        meta: f.meta.clone(),
        tensors: f.tensors.clone(),
    };
    with_x.tensors.insert("x".into(), x.clone());
    let dc = clipped_against(&with_x, &p, |p, x, y| cross_entropy(&logits(&p, &x)?, &y), route);
    format!(
        "logits max diff {dl:.2e}, loss max diff {dx:.2e}, per-sample grads max diff {dg:.2e}, clipped sum {dc:.2e}"
    )
}

/// The `rnn/` cases (LSTM and bidirectional GRU classifiers over
/// sequences of different lengths), batched and per example.
#[test]
fn rnn_fixtures_match_pytorch() {
    let dir = fixture_dir().join("rnn");
    for path in &cases(&dir) {
        let f = load(path);
        for (route, schedule) in RUNS {
            let line = run_rnn(&f, route, schedule);
            println!("fixture {} {route:?} {schedule:?}: {line}", f.name);
        }
    }
}
