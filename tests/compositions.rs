//! One derivative through every composition of transforms (Autodidax's
//! test): `vmap(grad)`, `grad(vmap)`, `vmap(vmap(grad))`, `grad(grad)`,
//! `jit(grad)`, `grad(jit)`, checked against finite differences in f64.

mod common;

use candle_core::{DType, Tensor};
use candle_func::{grad, jit, value_and_grad, vjp, vmap, Function, Tracer};
use common::{assert_close, rand};
use std::sync::Arc;

fn f64t(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::F64).unwrap()
}

use common::tanh_dot_square as f;

/// Central differences of a scalar function of one tensor, per element.
fn numeric_grad(g: &dyn Fn(&Tensor) -> f64, x: &Tensor) -> Tensor {
    let flat = x.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let eps = 1e-6;
    let grads: Vec<f64> = (0..flat.len())
        .map(|i| {
            let mut p = flat.clone();
            p[i] += eps;
            let mut m = flat.clone();
            m[i] -= eps;
            let t = |v: Vec<f64>| Tensor::from_vec(v, x.dims(), x.device()).unwrap();
            (g(&t(p)) - g(&t(m))) / (2.0 * eps)
        })
        .collect();
    Tensor::from_vec(grads, x.dims(), x.device()).unwrap()
}

fn scalar(t: Tensor) -> f64 {
    t.to_scalar::<f64>().unwrap()
}

#[test]
fn vmap_of_grad() {
    let xs = f64t(&[4, 3], 1);
    let got = vmap(grad(f)).call(&xs).unwrap();
    let one = jit(f);
    for i in 0..4 {
        let x = xs.get(i).unwrap();
        let want = numeric_grad(&|x| scalar(one.call(x).unwrap()), &x);
        assert_close(&got.get(i).unwrap(), &want, 1e-6, "vmap(grad)");
    }
}

#[test]
fn grad_of_vmap() {
    // d/dxs sum_i f(xs[i]) = stack of per-example gradients
    let xs = f64t(&[4, 3], 2);
    let total = |xs: Tracer| vmap(f).apply((xs,))?.sum_all();
    let got = grad(total).call(&xs).unwrap();
    let run = jit(total);
    let want = numeric_grad(&|x| scalar(run.call(x).unwrap()), &xs);
    assert_close(&got, &want, 1e-6, "grad(vmap)");
}

#[test]
fn vmap_of_vmap_of_grad() {
    let xs = f64t(&[2, 3, 4], 3);
    let got = vmap(vmap(grad(f))).call(&xs).unwrap();
    let one = jit(f);
    for i in 0..2 {
        for j in 0..3 {
            let x = xs.get(i).unwrap().get(j).unwrap();
            let want = numeric_grad(&|x| scalar(one.call(x).unwrap()), &x);
            assert_close(&got.get(i).unwrap().get(j).unwrap(), &want, 1e-6, "vmap(vmap(grad))");
        }
    }
}

#[test]
fn grad_of_grad() {
    // The Hessian-vector product <H v, u> of f, as grad of <grad f, v>.
    let x = f64t(&[5], 4);
    let v = f64t(&[5], 5);
    let inner = Arc::new(grad(f));
    let gv = {
        let (inner, v) = (inner.clone(), v.clone());
        move |x: Tracer| inner.apply((x,))?.mul(&v)?.sum_all()
    };
    let got = grad(gv.clone()).call(&x).unwrap();
    let run = jit(gv);
    let want = numeric_grad(&|x| scalar(run.call(x).unwrap()), &x);
    assert_close(&got, &want, 1e-6, "grad(grad)");
}

#[test]
fn grad_through_jit_and_back() {
    let x = f64t(&[2, 3], 6);
    let a = grad(jit(f)).call(&x).unwrap();
    let b = jit(grad(f)).call(&x).unwrap();
    let one = jit(f);
    let want = numeric_grad(&|x| scalar(one.call(x).unwrap()), &x);
    assert_close(&a, &want, 1e-6, "grad(jit)");
    assert_close(&b, &want, 1e-6, "jit(grad)");
}

#[test]
fn value_aux_argnums_and_vjp() {
    let x = f64t(&[3], 7);
    let y = f64t(&[3], 8);
    let h = |x: Tracer, y: Tracer| Ok((x.mul(&y)?.sum_all()?, x.add(&y)?));
    // value_and_grad with aux, with respect to the second argument
    let ((value, aux), gy) = value_and_grad(h).has_aux().argnum::<1>().call((&x, &y)).unwrap();
    assert!((scalar(value) - scalar((&x * &y).unwrap().sum_all().unwrap())).abs() < 1e-12);
    assert_close(&aux, &(&x + &y).unwrap(), 1e-6, "aux");
    assert_close(&gy, &x, 1e-6, "d/dy x.y = x");
    // both arguments
    let (gx, gy) = grad(|x: Tracer, y: Tracer| x.mul(&y)?.sum_all())
        .argnums::<0, 1>()
        .call((&x, &y))
        .unwrap();
    assert_close(&gx, &y, 1e-6, "d/dx");
    assert_close(&gy, &x, 1e-6, "d/dy");
    // grad with aux
    let (gx, aux) = grad(h).has_aux().call((&x, &y)).unwrap();
    assert_close(&gx, &y, 1e-6, "grad has_aux");
    assert_close(&aux, &(&x + &y).unwrap(), 1e-6, "grad aux");
    // vjp: one forward, several cotangents
    let (out, pullback) = vjp(&|x: Tracer, y: Tracer| Ok((x.mul(&y)?, x.exp()?)), (&x, &y)).unwrap();
    assert_close(&out.0, &(&x * &y).unwrap(), 1e-6, "vjp value");
    for seed in 0..3 {
        let (c0, c1) = (f64t(&[3], 10 + seed), f64t(&[3], 20 + seed));
        let (gx, gy) = pullback.call(&(c0.clone(), c1.clone())).unwrap();
        let want_x = ((&c0 * &y).unwrap() + (&c1 * x.exp().unwrap()).unwrap()).unwrap();
        assert_close(&gx, &want_x, 1e-6, "pullback x");
        assert_close(&gy, &(&c0 * &x).unwrap(), 1e-6, "pullback y");
    }
    assert!(
        pullback.call(&(f64t(&[4], 1), f64t(&[3], 2))).is_err(),
        "cotangents of the wrong shape"
    );
}

#[test]
fn grad_needs_a_scalar_and_names_missing_rules() {
    let x = f64t(&[3], 9);
    let r = grad(|x: Tracer| x.exp()).call(&x);
    assert!(matches!(r, Err(candle_func::Error::Shape { op: "grad", .. })), "{r:?}");
    let custom =
        |x: Tracer| candle_func::custom_op("opaque", &[&x], x.tensor_type().clone(), |xs| xs[0].exp())?.sum_all();
    match grad(custom).call(&x) {
        Err(candle_func::Error::Unsupported {
            op,
            transform: "grad",
            msg,
        }) => {
            assert_eq!(op, "custom");
            assert!(msg.contains("opaque"), "{msg}");
        }
        other => panic!("expected a missing-rule error, got {other:?}"),
    }
}
