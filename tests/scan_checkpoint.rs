//! A scan whose gradient recomputes its carries (`ScanOptions::checkpoint`,
//! or chosen when a memory limit says so): the same values, gradients,
//! per-sample gradients and tangents as the loop that keeps every carry,
//! forwards and backwards, with segments that do and do not divide the
//! trip count; a planned and a measured peak that fall; and bad settings.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::loops::{fori_loop, scan_with, ScanOptions};
use candle_func::{grad, jit, jvp, make_graph, vmap, Error, Function, Options, Tracer};
use common::assert_close;
use std::collections::BTreeMap;

type P = BTreeMap<String, Tracer>;
const H: usize = 4;
const E: usize = 3;
const T: usize = 11;

/// `common::rand` in f64.
fn rand(shape: &[usize], seed: u64) -> Tensor {
    common::rand(shape, seed).to_dtype(DType::F64).unwrap()
}

fn params(seed: u64) -> BTreeMap<String, Tensor> {
    let t = |shape: &[usize], k: u64| rand(shape, seed * 10 + k).affine(0.6, 0.0).unwrap();
    BTreeMap::from([
        ("W".to_string(), t(&[H, H], 1)),
        ("U".to_string(), t(&[H, E], 2)),
        ("b".to_string(), t(&[H], 3)),
        ("h0".to_string(), t(&[H], 4)),
    ])
}

/// An Elman cell, its state as an output and a second, scalar output.
fn run(p: &P, x: &Tracer, opts: ScanOptions) -> candle_func::Result<Tracer> {
    let (c, ys) = scan_with(
        |c: Vec<Tracer>, x: Vec<Tracer>| {
            let wh = p["W"].matmul(&c[0].unsqueeze(1)?)?.squeeze(1)?;
            let ux = p["U"].matmul(&x[0].unsqueeze(1)?)?.squeeze(1)?;
            let h = wh.add(&ux)?.add(&p["b"])?.tanh()?;
            Ok((vec![h.clone()], vec![h.clone(), h.sqr()?.sum_all()?]))
        },
        vec![p["h0"].clone()],
        vec![x.clone()],
        opts,
    )?;
    // every value the loop gives, weighted so that no two rows are alike
    let w = Tensor::arange(0f64, (T * H) as f64, &Device::Cpu)?
        .affine(0.01, 0.2)?
        .reshape((T, H))?;
    c[0].sin()?
        .sum_all()?
        .add(&ys[0].mul(&w)?.sum_all()?)?
        .add(&ys[1].sqr()?.sum_all()?)
}

fn settings() -> Vec<(String, ScanOptions)> {
    let mut out = Vec::new();
    for reverse in [false, true] {
        // 1 keeps every carry; 3 leaves 2 steps over; 4 leaves 3; 11 and
        // more are one segment
        for k in [1, 2, 3, 4, 10, 11, 40] {
            let o = ScanOptions::new().checkpoint(k);
            out.push((
                format!("every {k}, reverse {reverse}"),
                if reverse { o.reverse() } else { o },
            ));
        }
    }
    out
}

/// The loss with the data among the parameters, so `grad` reaches it.
fn run_all(mut p: P, opts: ScanOptions) -> candle_func::Result<Tracer> {
    let x = p.remove("x").expect("x");
    run(&p, &x, opts)
}

fn with_x(seed: u64) -> BTreeMap<String, Tensor> {
    let mut p = params(seed);
    p.insert("x".into(), rand(&[T, E], seed + 100));
    p
}

/// The squared norm of `f`'s gradient, for a gradient of a gradient.
fn grad_norm(p: P, opts: ScanOptions) -> candle_func::Result<Tracer> {
    let g = grad(move |p: P| run_all(p, opts)).apply((p,))?;
    let norms: Vec<Tracer> = g
        .values()
        .map(|t| t.sqr()?.sum_all())
        .collect::<candle_func::Result<_>>()?;
    Tracer::stack(&norms.iter().collect::<Vec<_>>(), 0)?.sum_all()
}

#[test]
fn checkpointed_scans_give_the_values_gradients_and_tangents_of_the_plain_one() {
    let (p, v) = (with_x(1), with_x(2));
    for reverse in [false, true] {
        let plain = if reverse {
            ScanOptions::new().reverse()
        } else {
            ScanOptions::new()
        };
        let f = move |p: P| run_all(p, plain);
        let value = jit(f).call(&p).unwrap();
        let g = grad(f).call(&p).unwrap();
        let (_, tangent) = jvp(&f, &p, &v).unwrap();
        let gg = grad(move |p: P| grad_norm(p, plain)).call(&p).unwrap();
        for (name, o) in settings().into_iter().filter(|s| s.0.ends_with(&format!("{reverse}"))) {
            let c = move |p: P| run_all(p, o);
            assert_close(&jit(c).call(&p).unwrap(), &value, 1e-12, &name);
            let cg = grad(c).call(&p).unwrap();
            for (k, want) in &g {
                assert_close(&cg[k], want, 1e-10, &format!("{name}: d/d{k}"));
            }
            let (_, t) = jvp(&c, &p, &v).unwrap();
            assert_close(&t, &tangent, 1e-10, &format!("{name}: jvp"));
            let cgg = grad(move |p: P| grad_norm(p, o)).call(&p).unwrap();
            for (k, want) in &gg {
                assert_close(&cgg[k], want, 1e-9, &format!("{name}: grad of grad, {k}"));
            }
        }
    }
}

#[test]
fn per_sample_gradients_through_a_checkpointed_scan_equal_the_plain_ones() {
    let p = params(5);
    let xs = rand(&[3, T, E], 6);
    let plain = |p: P, x: Tracer| run(&p, &x, ScanOptions::new());
    let want = vmap(grad(plain)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
    for k in [3, 4] {
        let f = move |p: P, x: Tracer| run(&p, &x, ScanOptions::new().checkpoint(k));
        let got = vmap(grad(f)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
        for (name, v) in &want {
            assert_close(&got[name], v, 1e-10, &format!("every {k}: per-sample d/d{name}"));
        }
    }
}

/// `x <- sin(x) * 0.9 + x * a` on a state of `N` doubles, `steps` times:
/// no outputs, so the carries are all a gradient keeps.
const N: usize = 8192;

fn iterate(steps: usize, opts: ScanOptions) -> impl Fn(Tracer, Tracer) -> candle_func::Result<Tracer> + Copy {
    move |x: Tracer, a: Tracer| {
        let (c, _) = scan_with(
            |c: Vec<Tracer>, _: Vec<Tracer>| Ok((vec![c[0].sin()?.affine(0.9, 0.0)?.add(&c[0].mul(&a)?)?], ())),
            vec![x],
            Vec::<Tracer>::new(),
            opts.length(steps),
        )?;
        c[0].sqr()?.sum_all()
    }
}

fn state() -> (Tensor, Tensor) {
    (rand(&[N], 7), rand(&[N], 8).affine(0.05, 0.0).unwrap())
}

#[test]
fn checkpoints_lower_the_planned_and_measured_peak_of_a_gradient() {
    let steps = 256;
    let (x, a) = state();
    let peaks = |k: usize| {
        let g = make_graph(&grad(iterate(steps, ScanOptions::new().checkpoint(k))), (&x, &a)).unwrap();
        let (outs, stats) = g.run_with_stats(&[x.clone(), a.clone()]).unwrap();
        (g.planned_peak_bytes(), stats.peak_bytes, outs[0].clone())
    };
    let (plan_all, ran_all, g_all) = peaks(1);
    let (plan_cp, ran_cp, g_cp) = peaks(16);
    assert_close(&g_cp, &g_all, 1e-10, "the gradient");
    eprintln!("peak bytes, every carry / every 16th: planned {plan_all} / {plan_cp}, measured {ran_all} / {ran_cp}");
    // 256 carries of 64 KiB (16 MiB) against 16 + 16 (2 MiB)
    let carries = steps * N * 8;
    assert!(plan_all >= carries, "{plan_all} < {carries}");
    assert!(plan_cp * 4 < plan_all, "planned: {plan_cp} against {plan_all}");
    assert!(ran_cp * 4 < ran_all, "measured: {ran_cp} against {ran_all}");
}

#[test]
fn a_memory_limit_the_saved_carries_exceed_makes_the_loop_recompute_them() {
    let steps = 256;
    let (x, a) = state();
    let want = grad(iterate(steps, ScanOptions::new())).call((&x, &a)).unwrap();
    let limit = 12 << 20;
    // every carry kept does not fit, and the call says so before it runs
    let all = grad(iterate(steps, ScanOptions::new().checkpoint(1))).memory_limit(limit);
    assert!(
        matches!(all.call((&x, &a)), Err(Error::Memory { .. })),
        "16 MiB of carries under a 12 MiB limit"
    );
    // left to choose, the loop checkpoints and fits
    let auto = grad(iterate(steps, ScanOptions::new())).memory_limit(limit);
    assert_close(
        &auto.call((&x, &a)).unwrap(),
        &want,
        1e-10,
        "the gradient under the limit",
    );
    assert!(make_graph(&auto, (&x, &a)).unwrap().planned_peak_bytes() <= limit);
    // the same through fori_loop, the limit set on an enclosing jit and
    // inherited by the gradient inside it
    let f = move |x: Tracer, a: Tracer| {
        let body = move |x: Tracer| {
            let step = |_i: &Tracer, c: Vec<Tracer>| Ok(vec![c[0].sin()?.affine(0.9, 0.0)?.add(&c[0].mul(&a)?)?]);
            fori_loop(0, steps, step, vec![x])?[0].sqr()?.sum_all()
        };
        grad(body).apply((x,))
    };
    let got = jit(f)
        .options(Options::new().memory_limit(limit))
        .call((&x, &a))
        .unwrap();
    assert_close(&got, &want, 1e-10, "fori_loop's gradient under the limit");
}

#[test]
fn a_checkpoint_every_zero_steps_is_an_error_naming_the_scan() {
    let (x, a) = state();
    let r = jit(iterate(4, ScanOptions::new().checkpoint(0))).call((&x, &a));
    match r {
        Err(e @ Error::Shape { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("scan") && msg.contains("checkpoint(0)"), "{msg}");
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn a_checkpointed_lstm_gives_the_per_sample_gradients_and_clipped_sums_of_the_plain_one() {
    use candle_func::dp;
    use candle_func::nn::{self, Module, Params, RecurrentConfig};
    use candle_nn::{VarBuilder, VarMap};
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu);
    let cfg = RecurrentConfig {
        layers: 2,
        bidirectional: true,
        bias: true,
    };
    let plain = nn::lstm(3, 4, cfg, vb.pp("lstm")).unwrap();
    let fc = nn::linear(8, 2, vb.pp("fc")).unwrap();
    let p: BTreeMap<String, Tensor> = [plain.params(), fc.params()].into_iter().flatten().collect();
    let xs = rand(&[4, 9, 3], 11);
    let lengths = Tensor::new(&[9i64, 4, 7, 1], &Device::Cpu).unwrap();
    let ys = Tensor::new(&[0u32, 1, 1, 0], &Device::Cpu).unwrap();
    let fc = &fc;
    let loss = |rnn: &nn::Recurrent| {
        let rnn = rnn.clone();
        move |p: P, x: Tracer, len: Tracer, y: Tracer| {
            let params = Params::with(&p);
            let out = rnn.run(&params, &x, Some(&len))?.output.mean(0)?;
            let logits = fc.forward_with(&params, &out)?;
            nn::cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, nn::Reduction::Mean)
        }
    };
    let args = (&p, &xs, &lengths, &ys);
    let dims = [None, Some(0), Some(0), Some(0)];
    let want = vmap(grad(loss(&plain))).in_dims(dims).call(args).unwrap();
    let (want_sum, want_norms, _) = dp::clipped_grad_sum(loss(&plain), 0.05).call(args).unwrap();
    for k in [2, 4] {
        let cp = plain.clone().with_checkpoint(k);
        let got = vmap(grad(loss(&cp))).in_dims(dims).call(args).unwrap();
        for (name, v) in &want {
            assert_close(&got[name], v, 1e-10, &format!("every {k}: per-sample d/d{name}"));
        }
        let (sum, norms, _) = dp::clipped_grad_sum(loss(&cp), 0.05).call(args).unwrap();
        assert_close(&norms, &want_norms, 1e-10, &format!("every {k}: per-sample norms"));
        for (name, v) in &want_sum {
            assert_close(&sum[name], v, 1e-10, &format!("every {k}: clipped sum {name}"));
        }
    }
}

#[test]
fn a_recurrent_layer_checkpointed_every_zero_steps_is_an_error_and_nan_propagates() {
    use candle_func::nn::{self, Params, RecurrentConfig};
    use candle_nn::{VarBuilder, VarMap};
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu);
    let lstm = nn::lstm(3, 4, RecurrentConfig::default(), vb.pp("lstm")).unwrap();
    let x = rand(&[9, 3], 21);
    let run = |layer: nn::Recurrent, x: &Tensor| {
        jit(move |x: Tracer| layer.run(&Params::own(), &x, None)?.output.sum_all()).call(x)
    };
    match run(lstm.clone().with_checkpoint(0), &x) {
        Err(e @ Error::Shape { .. }) => assert!(e.to_string().contains("checkpoint(0)"), "{e}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    // a NaN in the sequence reaches the output, as without checkpoints
    let mut v = x.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v[4] = f64::NAN;
    let bad = Tensor::from_vec(v, (9, 3), &Device::Cpu).unwrap();
    for layer in [lstm.clone(), lstm.with_checkpoint(2)] {
        let y = run(layer, &bad).unwrap().to_scalar::<f64>().unwrap();
        assert!(y.is_nan(), "{y}");
    }
}
