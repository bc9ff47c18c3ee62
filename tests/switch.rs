//! `switch` (JAX's `lax.switch`): one branch of several by an integer
//! index, clamped into range; against closed forms on single calls, under
//! `vmap` with an index per example (batched and per example) and through
//! `grad` and `jvp`, the branches not taken never reaching a gradient,
//! and bad indices and branches as errors naming `switch`.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::jacobian::jvp_fn;
use candle_func::loops::switch;
use candle_func::tracer::Operand;
use candle_func::{grad, jit, make_graph, vmap, Error, Function, Schedule, Tracer};
use common::assert_close;

fn t64(v: &[f64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

/// `[x^3, x sin x, sqrt(x)][k]`: the third branch is NaN for `x < 0`.
fn pick(k: &Tracer, x: &Tracer) -> candle_func::Result<Tracer> {
    switch(
        k,
        &[&|o: Tracer| o.powf(3.0), &|o: Tracer| o.sin()?.mul(&o), &|o: Tracer| {
            o.sqrt()
        }],
        x.clone(),
    )
}

/// The value and derivative of branch `k` clamped into `0..3`.
fn pick_ref(k: i64, x: f64) -> (f64, f64) {
    match k.clamp(0, 2) {
        0 => (x.powi(3), 3.0 * x * x),
        1 => (x.sin() * x, x.cos() * x + x.sin()),
        _ => (x.sqrt(), 0.5 / x.sqrt()),
    }
}

#[test]
fn switch_takes_its_clamped_branch_and_differentiates_through_it() {
    for k in [-3i64, 0, 1, 2, 9] {
        for x in [0.5, 1.7] {
            let f = move |x: Tracer| pick(&Tensor::new(k, &Device::Cpu)?.to_tracer(&x)?, &x);
            let xt = Tensor::new(x, &Device::Cpu).unwrap();
            let (want, dwant) = pick_ref(k, x);
            let y = jit(f).call(&xt).unwrap().to_scalar::<f64>().unwrap();
            let g = grad(f).call(&xt).unwrap().to_scalar::<f64>().unwrap();
            let (_, t) = jvp_fn(f)
                .call((&xt, &Tensor::new(1.0f64, &Device::Cpu).unwrap()))
                .unwrap();
            assert!((y - want).abs() < 1e-12, "value of branch {k} at {x}: {y} vs {want}");
            assert!((g - dwant).abs() < 1e-12, "grad of branch {k} at {x}: {g} vs {dwant}");
            let t = t.to_scalar::<f64>().unwrap();
            assert!((t - dwant).abs() < 1e-12, "jvp of branch {k} at {x}: {t} vs {dwant}");
        }
    }
}

#[test]
fn an_index_per_example_gives_each_example_its_own_branch_and_gradient() {
    // negative inputs take branches 0 and 1 only: sqrt's NaN must not
    // reach them through the batched run of branch 2
    let ks = [0i64, 1, 2, -1, 7, 1];
    let xs = [-1.5, -0.4, 2.0, 0.3, 0.9, 1.1];
    let kt = Tensor::new(&ks, &Device::Cpu).unwrap();
    let xt = t64(&xs);
    let want: Vec<f64> = ks.iter().zip(&xs).map(|(&k, &x)| pick_ref(k, x).0).collect();
    let dwant: Vec<f64> = ks.iter().zip(&xs).map(|(&k, &x)| pick_ref(k, x).1).collect();
    let f = |k: Tracer, x: Tracer| pick(&k, &x);
    for schedule in [Schedule::Batched, Schedule::PerExample, Schedule::Auto] {
        let what = format!("{schedule:?}");
        let y = vmap(f).schedule(schedule).call((&kt, &xt)).unwrap();
        assert_close(&y, &t64(&want), 1e-12, &format!("vmap {what}"));
        let g = vmap(grad(f).argnum::<1>()).schedule(schedule).call((&kt, &xt)).unwrap();
        assert_close(&g, &t64(&dwant), 1e-12, &format!("vmap(grad) {what}"));
        let g = grad(move |k: Tracer, x: Tracer| Function::apply(&vmap(f).schedule(schedule), (k, x))?.sum_all())
            .argnum::<1>()
            .call((&kt, &xt))
            .unwrap();
        assert_close(&g, &t64(&dwant), 1e-12, &format!("grad(vmap) {what}"));
    }
}

#[test]
fn a_shared_index_stays_one_cond_and_a_per_example_one_runs_each_branch_once() {
    let x = t64(&[0.5, 1.5, 2.5]);
    let shared = |x: Tracer| pick(&Tensor::new(1i64, &Device::Cpu)?.to_tracer(&x)?, &x);
    let g = make_graph(&vmap(shared), &x).unwrap();
    assert_eq!(g.to_string().matches("cond{").count(), 1, "{g}");
    let y = vmap(shared).call(&x).unwrap();
    let want: Vec<f64> = [0.5f64, 1.5, 2.5].iter().map(|&x| pick_ref(1, x).0).collect();
    assert_close(&y, &t64(&want), 1e-12, "shared index");
    // per example: one guarded cond per branch, nothing looped per example
    let k = Tensor::new(&[2u32, 0, 1], &Device::Cpu).unwrap();
    let g = make_graph(&vmap(|k: Tracer, x: Tracer| pick(&k, &x)), (&k, &x)).unwrap();
    assert_eq!(g.to_string().matches("cond{").count(), 3, "{g}");
    assert!(!g.to_string().contains("map["), "{g}");
}

#[test]
fn bad_indices_and_disagreeing_branches_are_errors_naming_switch() {
    let x = t64(&[1.0, 2.0]);
    let shape_err = |r: candle_func::Result<Tensor>, what: &str| match r {
        Err(e @ Error::Shape { .. }) => assert!(e.to_string().contains("switch"), "{what}: {e}"),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    };
    // a float index
    let f = |x: Tracer| pick(&x.sum_all()?, &x);
    shape_err(jit(f).call(&x), "a float index");
    // an index that is not a scalar
    let f = |x: Tracer| pick(&x.to_dtype(DType::I64)?, &x);
    shape_err(jit(f).call(&x), "a vector index");
    // no branches
    let f = |x: Tracer| switch::<Tracer, Tracer>(&x.sum_all()?.to_dtype(DType::U32)?, &[], x);
    shape_err(jit(f).call(&x), "no branches");
    // branches of other shapes
    let f = |x: Tracer| {
        let k = x.sum_all()?.to_dtype(DType::U32)?;
        switch(&k, &[&|o: Tracer| Ok(o), &|o: Tracer| o.sum_all()], x)
    };
    shape_err(jit(f).call(&x), "branches of other shapes");
    // branches of other structures: a pair and a list of two
    let f = |x: Tracer| {
        let k = x.sum_all()?.to_dtype(DType::U32)?;
        let pair = |o: Tracer| Ok(vec![o.clone(), o]);
        let both = |o: Tracer| Ok(vec![o.clone(), o.neg()?, o]);
        Ok(switch(&k, &[&pair, &both], x)?.remove(0))
    };
    shape_err(jit(f).call(&x), "branches of other structures");
}

/// Operands and results are trees: a map of named tensors in, a pair out.
#[test]
fn switch_takes_and_gives_trees() {
    use std::collections::BTreeMap;
    let x = t64(&[1.0, -2.0]);
    let f = |x: Tracer| {
        let ops: BTreeMap<String, Tracer> = [("a".to_string(), x.clone()), ("b".to_string(), x.sqr()?)].into();
        let k = x.sum_all()?.ge(0.0)?.to_dtype(DType::U32)?;
        let sum = |o: BTreeMap<String, Tracer>| Ok((o["a"].add(&o["b"])?, o["b"].clone()));
        let diff = |o: BTreeMap<String, Tracer>| Ok((o["a"].sub(&o["b"])?, o["a"].clone()));
        let (u, v) = switch(&k, &[&sum, &diff], ops)?;
        u.add(&v.affine(10.0, 0.0)?)
    };
    // sum(x) = -1 < 0: branch 0, a + b + 10 b
    let y = jit(f).call(&x).unwrap();
    assert_close(&y, &t64(&[12.0, 42.0]), 1e-12, "branch 0 of a tree");
}
