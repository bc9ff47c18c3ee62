//! `cond`, `while_loop` and `fori_loop`: against plain Rust control flow
//! on single calls, under `vmap` (a predicate or trip count per example,
//! batched and per example) against a loop of single calls, derivatives
//! against closed forms and finite differences (f64), and bad bodies.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::graph::TensorType;
use candle_func::jacobian::jvp_fn;
use candle_func::loops::{cond, fori_loop, scan, while_loop};
use candle_func::tracer::Operand;
use candle_func::{custom_op, grad, jit, jvp, vmap, Error, Function, Schedule, Tracer};
use common::assert_close;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn t64(v: &[f64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// `x < 0 ? -x^3 : sin(x) * x` by `cond` on a scalar.
fn piecewise(x: Tracer) -> candle_func::Result<Tracer> {
    let out = cond(
        &x.lt(0.0)?,
        |o: Vec<Tracer>| Ok(vec![o[0].powf(3.0)?.neg()?]),
        |o: Vec<Tracer>| Ok(vec![o[0].sin()?.mul(&o[0])?]),
        vec![x.clone()],
    )?;
    Ok(out[0].clone())
}

fn piecewise_ref(x: f64) -> (f64, f64) {
    if x < 0.0 {
        (-x.powi(3), -3.0 * x * x)
    } else {
        (x.sin() * x, x.cos() * x + x.sin())
    }
}

#[test]
fn cond_takes_its_branch_and_differentiates_through_it() {
    let xs = [-1.5, -0.25, 0.0, 0.7, 2.0];
    for &x in &xs {
        let xt = Tensor::new(x, &Device::Cpu).unwrap();
        let (want, dwant) = piecewise_ref(x);
        let y = jit(piecewise).call(&xt).unwrap().to_scalar::<f64>().unwrap();
        let g = grad(piecewise).call(&xt).unwrap().to_scalar::<f64>().unwrap();
        let (_, t) = jvp(&piecewise, &xt, &Tensor::new(1.0f64, &Device::Cpu).unwrap()).unwrap();
        assert!((y - want).abs() < 1e-12, "value at {x}");
        assert!((g - dwant).abs() < 1e-12, "grad at {x}: {g} vs {dwant}");
        assert!((t.to_scalar::<f64>().unwrap() - dwant).abs() < 1e-12, "jvp at {x}");
    }
    // vmap: a predicate per example, batched (select) and per example
    let batch = t64(&xs);
    let want: Vec<f64> = xs.iter().map(|&x| piecewise_ref(x).0).collect();
    let dwant: Vec<f64> = xs.iter().map(|&x| piecewise_ref(x).1).collect();
    for schedule in [Schedule::Batched, Schedule::PerExample, Schedule::Auto] {
        let y = vmap(piecewise).schedule(schedule).call(&batch).unwrap();
        assert_close(&y, &t64(&want), 1e-12, &format!("vmap {schedule:?}"));
        let g = vmap(grad(piecewise)).schedule(schedule).call(&batch).unwrap();
        assert_close(&g, &t64(&dwant), 1e-12, &format!("vmap(grad) {schedule:?}"));
    }
    // grad of a batched sum: the per-example derivatives
    let g = grad(|x: Tracer| Function::apply(&vmap(piecewise), (x,))?.sum_all())
        .call(&batch)
        .unwrap();
    assert_close(&g, &t64(&dwant), 1e-12, "grad of vmap");
}

#[test]
fn a_shared_predicate_stays_one_cond_and_a_per_example_one_runs_each_examples_branch_alone() {
    // counts how often each branch's opaque kernel runs (once per example
    // under vmap: custom ops have no batching rule)
    let calls = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let f = {
        let calls = calls.clone();
        move |x: Tracer| -> candle_func::Result<Tracer> {
            let branch = |k: usize| {
                let calls = calls.clone();
                move |o: Vec<Tracer>| {
                    let calls = calls.clone();
                    let ty = TensorType::new(vec![], DType::F64);
                    let y = custom_op("branch", &[&o[0]], ty, move |xs| {
                        calls[k].fetch_add(1, Ordering::SeqCst);
                        xs[0].affine(if k == 0 { 2.0 } else { -1.0 }, 0.0)
                    })?;
                    Ok(vec![y])
                }
            };
            Ok(cond(&x.gt(0.0)?, branch(0), branch(1), vec![x.clone()])?[0].clone())
        }
    };
    let xs = t64(&[1.0, -2.0, -3.0, -4.0]);
    let count = |schedule| {
        for c in calls.iter() {
            c.store(0, Ordering::SeqCst);
        }
        let y = vmap(f.clone()).schedule(schedule).call(&xs).unwrap();
        assert_close(&y, &t64(&[2.0, 2.0, 3.0, 4.0]), 0.0, "values");
        (calls[0].load(Ordering::SeqCst), calls[1].load(Ordering::SeqCst))
    };
    assert_eq!(
        count(Schedule::PerExample),
        (1, 3),
        "per example: each example's branch alone"
    );
    assert_eq!(
        count(Schedule::Batched),
        (4, 4),
        "batched: each branch taken by some example runs batched, then select"
    );
    // a branch no example takes is skipped
    let positive = t64(&[1.0, 2.0, 3.0]);
    for c in calls.iter() {
        c.store(0, Ordering::SeqCst);
    }
    let y = vmap(f.clone()).schedule(Schedule::Batched).call(&positive).unwrap();
    assert_close(&y, &t64(&[2.0, 4.0, 6.0]), 0.0, "all positive");
    assert_eq!(
        (calls[0].load(Ordering::SeqCst), calls[1].load(Ordering::SeqCst)),
        (3, 0),
        "the branch no example takes never ran"
    );
    // one predicate for the whole batch: a cond of batched branches
    let shared = |p: Tracer, x: Tracer| {
        Ok(cond(
            &p,
            |o: Vec<Tracer>| Ok(vec![o[0].exp()?]),
            |o: Vec<Tracer>| Ok(vec![o[0].neg()?]),
            vec![x],
        )?[0]
            .clone())
    };
    let x = t64(&[0.5, -1.0]);
    for (p, want) in [(1.0f64, x.exp().unwrap()), (0.0, x.neg().unwrap())] {
        let p = Tensor::new(p, &Device::Cpu).unwrap();
        let y = vmap(shared).in_dims([None, Some(0)]).call((&p, &x)).unwrap();
        assert_close(&y, &want, 1e-12, "shared predicate");
        let g = candle_func::make_graph(&vmap(shared).in_dims([None, Some(0)]), (&p, &x)).unwrap();
        assert!(
            g.nodes().any(|n| n.name().starts_with("cond")),
            "one cond for all:\n{g}"
        );
    }
}

/// Halvings until below 1, and their count.
fn halve(x: Tracer) -> candle_func::Result<(Tracer, Tracer)> {
    let zero = x.affine(0.0, 0.0)?;
    let out = while_loop(
        |c: &Vec<Tracer>| c[0].ge(1.0),
        |c: Vec<Tracer>| Ok(vec![c[0].affine(0.5, 0.0)?, c[1].affine(1.0, 1.0)?]),
        vec![x, zero],
    )?;
    Ok((out[0].clone(), out[1].clone()))
}

#[test]
fn while_loop_runs_each_examples_own_steps_and_is_forward_differentiable() {
    let xs = [5.0, 0.5, 12.0, 1.0];
    let want = |x: f64| {
        let (mut v, mut n) = (x, 0.0);
        while v >= 1.0 {
            v *= 0.5;
            n += 1.0;
        }
        (v, n)
    };
    let batch = t64(&xs);
    for schedule in [Schedule::Batched, Schedule::PerExample, Schedule::Auto] {
        let (v, n) = vmap(halve).schedule(schedule).call(&batch).unwrap();
        let (wv, wn): (Vec<f64>, Vec<f64>) = xs.iter().map(|&x| want(x)).unzip();
        assert_close(&v, &t64(&wv), 0.0, &format!("values {schedule:?}"));
        assert_close(&n, &t64(&wn), 0.0, &format!("counts {schedule:?}"));
    }
    // d/dx of x / 2^n(x) is 2^-n: forward mode through the loop
    for &x in &xs {
        let xt = Tensor::new(x, &Device::Cpu).unwrap();
        let (_, t) = jvp(
            &|x: Tracer| Ok(halve(x)?.0),
            &xt,
            &Tensor::new(1.0f64, &Device::Cpu).unwrap(),
        )
        .unwrap();
        assert!((t.to_scalar::<f64>().unwrap() - 0.5f64.powf(want(x).1)).abs() < 1e-12);
    }
    let ones = t64(&[1.0; 4]);
    let (_, t) = vmap(jvp_fn(|x: Tracer| Ok(halve(x)?.0))).call((&batch, &ones)).unwrap();
    let tw: Vec<f64> = xs.iter().map(|&x| 0.5f64.powf(want(x).1)).collect();
    assert_close(&t, &t64(&tw), 1e-12, "vmap of jvp");
    // reverse mode: an error pointing at fori_loop
    match vmap(grad(|x: Tracer| Ok(halve(x)?.0))).call(&batch) {
        Err(e @ Error::Unsupported { .. }) => assert!(e.to_string().contains("fori_loop"), "{e}"),
        other => panic!("expected an unsupported error, got {other:?}"),
    }
}

#[test]
fn fori_loop_is_reverse_differentiable_and_control_flow_nests() {
    // x -> x^(2^4) by four squarings, and its derivative 16 x^15
    let f = |x: Tracer| Ok(fori_loop(0, 4, |_i: &Tracer, c: Vec<Tracer>| Ok(vec![c[0].sqr()?]), vec![x])?[0].clone());
    let xs = t64(&[0.9, 1.05, -1.1]);
    let want: Vec<f64> = [0.9f64, 1.05, -1.1].iter().map(|x| 16.0 * x.powi(15)).collect();
    assert_close(
        &vmap(grad(f)).call(&xs).unwrap(),
        &t64(&want),
        1e-9,
        "vmap(grad) of fori_loop",
    );
    // the index reaches the body: sum of i * x over i in 2..5
    let g = |x: Tracer| {
        let zero = x.affine(0.0, 0.0)?;
        let out = fori_loop(
            2,
            5,
            |i: &Tracer, c: Vec<Tracer>| Ok(vec![c[0].add(&i.to_dtype(DType::F64)?.mul(&x)?)?]),
            vec![zero],
        )?;
        Ok(out[0].clone())
    };
    let y = jit(g).call(Tensor::new(1.5f64, &Device::Cpu).unwrap()).unwrap();
    assert!((y.to_scalar::<f64>().unwrap() - 9.0 * 1.5).abs() < 1e-12);
    // a cond inside a scan: a running sum of |x_t| - 1 where x_t < 1, x_t^2 elsewhere
    let h = |xs: Tracer| {
        let init = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 0.0)?;
        let (c, _) = scan(
            |c: Vec<Tracer>, x: Vec<Tracer>| {
                let v = cond(
                    &x[0].lt(1.0)?,
                    |o: Vec<Tracer>| Ok(vec![o[0].abs()?.affine(1.0, -1.0)?]),
                    |o: Vec<Tracer>| Ok(vec![o[0].sqr()?]),
                    vec![x[0].clone()],
                )?;
                Ok((vec![c[0].add(&v[0])?], ()))
            },
            vec![init],
            vec![xs],
        )?;
        Ok(c[0].clone())
    };
    let xs = t64(&[-2.0, 0.5, 3.0, 1.5]);
    let gh = grad(h).call(&xs).unwrap();
    assert_close(
        &gh,
        &t64(&[-1.0, 1.0, 6.0, 3.0]),
        1e-12,
        "grad through a cond in a scan",
    );
    // finite differences of the same
    let eps = 1e-6;
    let v = t64(&[0.3, -0.2, 0.5, 0.1]);
    let at = |s: f64| {
        jit(h)
            .call((&xs + (&v * s).unwrap()).unwrap())
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
    let dot = (&gh * &v).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    assert!((fd - dot).abs() < 1e-6, "{fd} vs {dot}");
}

#[test]
fn branches_that_disagree_and_bodies_that_change_the_carry_are_errors_naming_the_construct() {
    let x = t64(&[1.0, 2.0]);
    let two = |x: Tracer| {
        let p = x.sum_all()?.gt(0.0)?;
        Ok(cond(
            &p,
            |o: Vec<Tracer>| Ok(vec![o[0].clone()]),
            |o: Vec<Tracer>| Ok(vec![o[0].sum_all()?]),
            vec![x],
        )?[0]
            .clone())
    };
    match jit(two).call(&x) {
        Err(e @ Error::Shape { op: "cond", .. }) => assert!(e.to_string().contains("same shapes"), "{e}"),
        other => panic!("{other:?}"),
    }
    let vector_pred = |x: Tracer| {
        Ok(cond(
            &x.gt(0.0)?,
            |o: Vec<Tracer>| Ok(o.to_vec()),
            |o: Vec<Tracer>| Ok(o.to_vec()),
            vec![x],
        )?[0]
            .clone())
    };
    match jit(vector_pred).call(&x) {
        Err(e @ Error::Shape { op: "cond", .. }) => assert!(e.to_string().contains("scalar"), "{e}"),
        other => panic!("{other:?}"),
    }
    let grows = |x: Tracer| {
        let out = while_loop(
            |c: &Vec<Tracer>| c[0].sum_all()?.lt(10.0),
            |c: Vec<Tracer>| Ok(vec![Tracer::cat(&[&c[0], &c[0]], 0)?]),
            vec![x],
        )?;
        Ok(out[0].clone())
    };
    match jit(grows).call(&x) {
        Err(e @ Error::Shape { op: "while_loop", .. }) => assert!(e.to_string().contains("changed carry 0"), "{e}"),
        other => panic!("{other:?}"),
    }
    // a fori_loop with nothing to carry says so
    let nothing = |x: Tracer| {
        fori_loop(0, 3, |_i: &Tracer, c: Vec<Tracer>| Ok(c.to_vec()), Vec::<Tracer>::new())?;
        Ok(x)
    };
    match jit(nothing).call(&x) {
        Err(e @ Error::Shape { op: "fori_loop", .. }) => assert!(e.to_string().contains("needs a carry"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bodies_read_any_active_trace_draws_refuse_derivatives_and_a_cond_needs_no_operands() {
    // the weight w comes from grad's trace, the data from jit's outer one
    let x = t64(&[0.5, -1.0, 2.0]);
    let f = |x: Tracer| {
        let w0 = x.sum_all()?.affine(0.0, 1.5)?;
        let g = grad(|w: Tracer| {
            let init = x.sum_all()?.affine(0.0, 0.0)?;
            let (c, _) = scan(
                |c: Vec<Tracer>, xt: Vec<Tracer>| Ok((vec![c[0].add(&xt[0].mul(&w)?)?.tanh()?], ())),
                vec![init],
                vec![x.clone()],
            )?;
            Ok(c[0].clone())
        });
        Function::apply(&g, (w0,))
    };
    let got = jit(f).call(&x).unwrap().to_scalar::<f64>().unwrap();
    // the same loop unrolled by hand
    let unrolled = |w: f64| [0.5f64, -1.0, 2.0].iter().fold(0.0f64, |c, &xt| (c + xt * w).tanh());
    let eps = 1e-6;
    let want = (unrolled(1.5 + eps) - unrolled(1.5 - eps)) / (2.0 * eps);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    // a cond whose branches read only what they capture
    let h = |p: Tracer| {
        let w = p.affine(2.0, 0.0)?;
        let out = cond(
            &p.gt(0.0)?,
            |_: Vec<Tracer>| Ok(vec![w.sqr()?]),
            |_: Vec<Tracer>| Ok(vec![w.neg()?]),
            Vec::<Tracer>::new(),
        )?;
        Ok(out[0].clone())
    };
    let y = jit(h).call(Tensor::new(1.5f64, &Device::Cpu).unwrap()).unwrap();
    assert_eq!(y.to_scalar::<f64>().unwrap(), 9.0);
    // a body that draws: running it is fine, differentiating it is refused
    let noisy = |x: Tracer| {
        let init = x.sum_all()?.affine(0.0, 0.0)?;
        let (c, _) = scan(
            |c: Vec<Tracer>, xt: Vec<Tracer>| Ok((vec![c[0].add(&xt[0].mul(&xt[0].rand_uniform_like()?)?)?], ())),
            vec![init],
            vec![x],
        )?;
        Ok(c[0].clone())
    };
    assert!(jit(noisy).call(&x).is_ok());
    match grad(noisy).call(&x) {
        Err(e @ Error::Unsupported { .. }) => assert!(e.to_string().contains("random"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // a branch giving an i64 beside a float: each a result of its own
    // type, the i64 exact (2^53 + 1: no float holds it; nothing is packed)
    let big = Tensor::new(&[(1i64 << 53) + 1, -3], &Device::Cpu).unwrap();
    let mixed = |x: Tracer, n: Tracer| {
        cond(
            &x.sum_all()?.gt(0.0)?,
            |(x, n): (Tracer, Tracer)| Ok((x.exp()?, n.clone())),
            |(x, n): (Tracer, Tracer)| Ok((x.clone(), n.clone())),
            (x, n),
        )
    };
    let (y, m) = jit(mixed).call((&x, &big)).unwrap();
    assert_eq!(m.to_vec1::<i64>().unwrap(), big.to_vec1::<i64>().unwrap());
    let want = x.exp().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(y.to_vec1::<f64>().unwrap(), want, "the branch taken (x sums to 1.5)");
}

const SCHEDULES: [Option<Schedule>; 4] = [
    None,
    Some(Schedule::Batched),
    Some(Schedule::Auto),
    Some(Schedule::PerExample),
];

/// `vmap(f)` under `schedule` (`None`: the default).
fn under<F>(f: F, schedule: Option<Schedule>) -> candle_func::transform::Vmap<F> {
    match schedule {
        Some(s) => vmap(f).schedule(s),
        None => vmap(f),
    }
}

fn table() -> Tensor {
    Tensor::new(&[10f64, 11., 12., 13., 14.], &Device::Cpu).unwrap()
}

/// `i < 5 ? table[i] : 0` for an index `i` (f64, cast to a u32 index).
fn guarded(i: Tracer) -> candle_func::Result<Tracer> {
    let t = table();
    let out = cond(
        &i.lt(5.0)?,
        move |o: Vec<Tracer>| {
            Ok(vec![t
                .to_tracer(&o[0])?
                .index_select(&o[0].to_dtype(DType::U32)?.unsqueeze(0)?, 0)?
                .squeeze(0)?])
        },
        |o: Vec<Tracer>| Ok(vec![o[0].affine(0.0, 0.0)?]),
        vec![i.clone()],
    )?;
    Ok(out[0].clone())
}

#[test]
fn a_guarded_branch_runs_only_on_rows_that_take_it_under_every_schedule() {
    let is = [1.0, 7.0, 4.0, 5.0, 0.0];
    let want: Vec<f64> = is.iter().map(|&i| if i < 5.0 { 10.0 + i } else { 0.0 }).collect();
    // single calls
    for (&i, &w) in is.iter().zip(&want) {
        let y = jit(guarded).call(Tensor::new(i, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(y.to_scalar::<f64>().unwrap(), w, "single call at {i}");
    }
    for schedule in SCHEDULES {
        let y = under(guarded, schedule).call(t64(&is)).unwrap();
        assert_close(&y, &t64(&want), 0.0, &format!("{schedule:?}"));
        // every example out of the table: the guarded branch is skipped
        let y = under(guarded, schedule).call(t64(&[6.0, 9.0])).unwrap();
        assert_close(&y, &t64(&[0.0, 0.0]), 0.0, &format!("{schedule:?}, none in range"));
    }
}

/// `sqrt(|x|)` by a branch on the sign, each branch defined only on its side.
fn sqrt_abs(x: Tracer) -> candle_func::Result<Tracer> {
    let out = cond(
        &x.gt(0.0)?,
        |o: Vec<Tracer>| Ok(vec![o[0].sqrt()?]),
        |o: Vec<Tracer>| Ok(vec![o[0].neg()?.sqrt()?]),
        vec![x.clone()],
    )?;
    Ok(out[0].clone())
}

#[test]
fn the_branch_not_taken_never_reaches_a_gradient_under_any_schedule() {
    let xs = t64(&[-4.0, 4.0, 0.25, -1.0]);
    // d sqrt(|x|) / dx = sign(x) / (2 sqrt(|x|))
    let want = t64(&[-0.25, 0.25, 1.0, -0.5]);
    for schedule in SCHEDULES {
        let what = format!("{schedule:?}");
        let y = under(sqrt_abs, schedule).call(&xs).unwrap();
        assert_close(&y, &t64(&[2.0, 2.0, 0.5, 1.0]), 1e-12, &what);
        // grad of the batched function (grad(vmap)), and per-example
        // gradients (vmap(grad)): no NaN from sqrt of the other side
        let g = grad(move |x: Tracer| Function::apply(&under(sqrt_abs, schedule), (x,))?.sum_all())
            .call(&xs)
            .unwrap();
        assert_close(&g, &want, 1e-12, &format!("grad(vmap) {what}"));
        let g = under(grad(sqrt_abs), schedule).call(&xs).unwrap();
        assert_close(&g, &want, 1e-12, &format!("vmap(grad) {what}"));
        // forward mode alike
        let ones = t64(&[1.0; 4]);
        let (_, t) = under(jvp_fn(sqrt_abs), schedule).call((&xs, &ones)).unwrap();
        assert_close(&t, &want, 1e-12, &format!("vmap(jvp) {what}"));
        // every example on one side: the other branch never runs
        let g = under(grad(sqrt_abs), schedule).call(t64(&[4.0, 1.0])).unwrap();
        assert_close(&g, &t64(&[0.25, 0.5]), 1e-12, &format!("one side {what}"));
    }
}

/// Sums `table[i]` for `i` from its start while `i < 5`: a finished
/// example's `i` is past the table.
fn table_sum(i: Tracer) -> candle_func::Result<Tracer> {
    let t = table();
    let zero = i.affine(0.0, 0.0)?;
    let out = while_loop(
        |c: &Vec<Tracer>| c[0].lt(5.0),
        move |c: Vec<Tracer>| {
            let v = t
                .to_tracer(&c[0])?
                .index_select(&c[0].to_dtype(DType::U32)?.unsqueeze(0)?, 0)?
                .squeeze(0)?;
            Ok(vec![c[0].affine(1.0, 1.0)?, c[1].add(&v)?])
        },
        vec![i, zero],
    )?;
    Ok(out[1].clone())
}

#[test]
fn a_finished_loop_example_no_longer_feeds_the_body_its_own_values() {
    let is = [1.0, 7.0, 3.0, 5.0];
    let want: Vec<f64> = is
        .iter()
        .map(|&i| (i as usize..5).map(|k| 10.0 + k as f64).sum())
        .collect();
    for (&i, &w) in is.iter().zip(&want) {
        let y = jit(table_sum).call(Tensor::new(i, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(y.to_scalar::<f64>().unwrap(), w, "single call at {i}");
    }
    for schedule in SCHEDULES {
        let y = under(table_sum, schedule).call(t64(&is)).unwrap();
        assert_close(&y, &t64(&want), 0.0, &format!("{schedule:?}"));
    }
}

#[test]
fn nested_vmaps_of_a_guarded_lookup_agree_with_single_calls() {
    let look = |i: Tracer| -> candle_func::Result<Tracer> {
        let table = Tensor::new(&[10f32, 11., 12., 13., 14.], &Device::Cpu).unwrap();
        let out = cond(
            &i.lt(5.0)?,
            move |o: Vec<Tracer>| {
                Ok(vec![table
                    .to_tracer(&o[0])?
                    .index_select(&o[0].reshape(1)?, 0)?
                    .squeeze(0)?])
            },
            |o: Vec<Tracer>| Ok(vec![o[0].to_dtype(DType::F32)?.affine(0.0, 0.0)?]),
            vec![i],
        )?;
        Ok(out[0].clone())
    };
    let is = Tensor::new(&[[1i64, 7], [7, 2], [9, 8]], &Device::Cpu).unwrap();
    for schedule in SCHEDULES {
        let y = under(vmap(look), schedule).call(&is).unwrap();
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            [[11., 0.], [0., 12.], [0., 0.]],
            "{schedule:?}"
        );
    }
}

/// Steps `x` by `table[floor x] + 0` until it reaches 5.
fn walk_table(x: Tracer) -> candle_func::Result<Tracer> {
    let table = Tensor::new(&[1f64, 1., 2., 1., 1.], &Device::Cpu).unwrap();
    let out = while_loop(
        |c: &Vec<Tracer>| c[0].lt(5.0),
        move |c: Vec<Tracer>| {
            let step = table
                .to_tracer(&c[0])?
                .index_select(&c[0].to_dtype(DType::I64)?.reshape(1)?, 0)?;
            Ok(vec![c[0].add(&step.squeeze(0)?)?])
        },
        vec![x],
    )?;
    Ok(out[0].clone())
}

#[test]
fn a_finished_example_stays_out_of_the_loop_under_jvp_of_vmap_and_vmap_of_jvp() {
    let xs = t64(&[0.5, 4.5, 2.25, 7.0]);
    let ones = t64(&[1.0; 4]);
    let want = under(walk_table, Some(Schedule::PerExample)).call(&xs).unwrap();
    for schedule in SCHEDULES {
        let what = format!("{schedule:?}");
        assert_close(&under(walk_table, schedule).call(&xs).unwrap(), &want, 0.0, &what);
        let (y, t) = under(jvp_fn(walk_table), schedule).call((&xs, &ones)).unwrap();
        assert_close(&y, &want, 0.0, &format!("vmap(jvp) {what}"));
        assert_close(&t, &ones, 0.0, &format!("vmap(jvp) {what}"));
        let batched = under(walk_table, schedule);
        let (y, t) = jvp(&move |x: Tracer| Function::apply(&batched, (x,)), &xs, &ones).unwrap();
        assert_close(&y, &want, 0.0, &format!("jvp(vmap) {what}"));
        assert_close(&t, &ones, 0.0, &format!("jvp(vmap) {what}"));
    }
}

#[test]
fn vector_operands_and_a_cond_inside_a_scan_keep_each_examples_gradient() {
    // a vector operand and a second, batched one the branches ignore
    let f = |x: Tracer| -> candle_func::Result<Tracer> {
        let z = x.affine(0.0, 7.0)?;
        let out = cond(
            &x.sum_all()?.gt(0.0)?,
            |o: Vec<Tracer>| Ok(vec![o[0].sqrt()?]),
            |o: Vec<Tracer>| Ok(vec![o[0].neg()?.sqrt()?]),
            vec![x, z],
        )?;
        Ok(out[0].clone())
    };
    let x = Tensor::new(&[[-4f64, -1.0], [4., 9.]], &Device::Cpu).unwrap();
    let want = Tensor::new(&[[-0.25f64, -0.5], [0.25, 1.0 / 6.0]], &Device::Cpu).unwrap();
    for schedule in SCHEDULES {
        let g = grad(move |x: Tracer| Function::apply(&under(f, schedule), (x,))?.sum_all())
            .call(&x)
            .unwrap();
        assert_close(&g, &want, 1e-12, &format!("vectors {schedule:?}"));
    }
    // sqrt(|x_t|) summed by a scan, a branch per step and per example
    let h = |xs: Tracer| -> candle_func::Result<Tracer> {
        let init = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 0.0)?;
        let (c, _) = scan(
            |c: Vec<Tracer>, x: Vec<Tracer>| Ok((vec![c[0].add(&sqrt_abs(x[0].clone())?)?], ())),
            vec![init],
            vec![xs],
        )?;
        Ok(c[0].clone())
    };
    let xs = Tensor::new(&[[-4f64, 4.0, 1.0], [9.0, -1.0, -9.0]], &Device::Cpu).unwrap();
    let want = Tensor::new(&[[-0.25f64, 0.25, 0.5], [1.0 / 6.0, -0.5, -1.0 / 6.0]], &Device::Cpu).unwrap();
    for schedule in SCHEDULES {
        let g = under(grad(h), schedule).call(&xs).unwrap();
        assert_close(&g, &want, 1e-12, &format!("scan vmap(grad) {schedule:?}"));
        let g = grad(move |x: Tracer| Function::apply(&under(h, schedule), (x,))?.sum_all())
            .call(&xs)
            .unwrap();
        assert_close(&g, &want, 1e-12, &format!("scan grad(vmap) {schedule:?}"));
    }
}

#[test]
fn an_example_whose_rows_are_copied_keeps_its_own_gradient_at_a_singular_point() {
    // x = 0 takes sqrt, whose derivative there is infinite; the other two
    // examples' sqrt rows are copies of it, discarded: their zero
    // cotangents must not turn its infinite derivative into NaN
    let f = |x: Tracer| -> candle_func::Result<Tracer> {
        let out = cond(
            &x.ge(0.0)?,
            |o: Vec<Tracer>| Ok(vec![o[0].sqrt()?]),
            |o: Vec<Tracer>| Ok(vec![o[0].affine(2.0, 0.0)?]),
            vec![x],
        )?;
        Ok(out[0].clone())
    };
    let x = t64(&[0.0, -3.0, -1.0]);
    for schedule in SCHEDULES {
        let g = grad(move |x: Tracer| Function::apply(&under(f, schedule), (x,))?.sum_all())
            .call(&x)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(g, [f64::INFINITY, 2.0, 2.0], "{schedule:?}");
    }
}

#[test]
fn a_per_example_cond_differentiates_as_a_single_calls_does_or_refuses_alike() {
    use candle_func::Randomness;
    // a branch that draws: its gradient is refused batched as in one call
    let noisy = |x: Tracer| -> candle_func::Result<Tracer> {
        let out = cond(
            &x.gt(0.0)?,
            |o: Vec<Tracer>| Ok(vec![o[0].mul(&o[0].rand_uniform_like()?)?]),
            |o: Vec<Tracer>| Ok(vec![o[0].neg()?]),
            vec![x],
        )?;
        Ok(out[0].clone())
    };
    let xs = t64(&[-1.0, 2.0]);
    let single = grad(noisy)
        .call(Tensor::new(2.0f64, &Device::Cpu).unwrap())
        .unwrap_err();
    let batched =
        grad(move |x: Tracer| Function::apply(&vmap(noisy).randomness(Randomness::Different), (x,))?.sum_all())
            .call(&xs)
            .unwrap_err();
    for e in [single, batched] {
        assert!(
            matches!(e, Error::Unsupported { .. }) && e.to_string().contains("random"),
            "{e}"
        );
    }
    // running it is fine: each example its own branch
    let y = vmap(noisy).randomness(Randomness::Different).call(&xs).unwrap();
    let y = y.to_vec1::<f64>().unwrap();
    assert!(y[0] == 1.0 && (0.0..2.0).contains(&y[1]), "{y:?}");
}
