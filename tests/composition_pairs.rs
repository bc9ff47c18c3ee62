//! Every ordered pair of transforms among vmap, grad, jvp, jacrev, jacfwd
//! and vjp (inside as `vjp_fn`, outermost as the concrete `vjp`) applied to
//! one function, each checked against the closed-form gradient and Hessian
//! of `f(x) = sum(tanh(x) x) + (sum x)^2 / n` in f64 (Autodidax's test,
//! across the Jacobian family).

mod common;

use candle_core::{DType, Tensor};
use candle_func::jacobian::{jvp_fn, vjp_fn};
use candle_func::tracer::Operand;
use candle_func::{grad, jacfwd, jacrev, jit, jvp, vjp, vmap, Function, Tracer};
use common::{assert_close, rand};

const N: usize = 4;

use common::tanh_dot_square as f;

fn f64t(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::F64).unwrap()
}

/// The closed-form gradient of `f` at `x` (one example, `[N]`).
fn gradient(x: &Tensor) -> Tensor {
    let t = x.tanh().unwrap();
    let d = t.sqr().unwrap().affine(-1.0, 1.0).unwrap(); // 1 - t^2
    let s = x.sum_all().unwrap().to_scalar::<f64>().unwrap();
    ((&t + (x * &d).unwrap()).unwrap() + 2.0 * s / N as f64).unwrap()
}

/// The closed-form Hessian `[N, N]`.
fn hessian_at(x: &Tensor) -> Tensor {
    let t = x.tanh().unwrap();
    let d = t.sqr().unwrap().affine(-1.0, 1.0).unwrap();
    // 2 (1 - t^2) - 2 x t (1 - t^2) on the diagonal, 2/n everywhere
    let diag = ((&d * 2.0).unwrap() - ((x * &t).unwrap() * &d).unwrap() * 2.0).unwrap();
    let eye = Tensor::eye(N, DType::F64, x.device()).unwrap();
    let full = Tensor::ones((N, N), DType::F64, x.device()).unwrap() * (2.0 / N as f64);
    (eye.broadcast_mul(&diag.unsqueeze(0).unwrap()).unwrap() + full.unwrap()).unwrap()
}

/// The tangent each jvp uses where it is a constant: a fixed function
/// of the point.
fn dir_t(x: &Tensor) -> Tensor {
    x.affine(0.5, 0.25).unwrap().tanh().unwrap()
}

#[test]
fn every_pair_agrees_with_the_closed_forms() {
    let x = f64t(&[N], 1);
    let xs = f64t(&[3, N], 2);
    let (g, h) = (gradient(&x), hessian_at(&x));
    let u = dir_t(&x);
    let hu = h.matmul(&u.unsqueeze(1).unwrap()).unwrap().squeeze(1).unwrap();
    let close = |got: Tensor, want: &Tensor, what: &str| assert_close(&got, want, 1e-9, what);
    // jvp with a direction fixed at the point (a constant, not traced)
    let jvp_at = |func: &dyn Fn(Tracer) -> candle_func::Result<Tracer>, x: &Tensor| {
        jvp(&|x: Tracer| func(x), x, &dir_t(x)).unwrap().1
    };

    // vmap outside: per example, against the closed forms
    let per = |t: Tensor, want: &dyn Fn(&Tensor) -> Tensor, what: &str| {
        for i in 0..3 {
            close(t.get(i).unwrap(), &want(&xs.get(i).unwrap()), what);
        }
    };
    per(vmap(grad(f)).call(&xs).unwrap(), &gradient, "vmap(grad)");
    per(vmap(jacrev(f)).call(&xs).unwrap(), &gradient, "vmap(jacrev)");
    per(vmap(jacfwd(f)).call(&xs).unwrap(), &gradient, "vmap(jacfwd)");
    per(
        vmap(vmap(grad(f)))
            .call(xs.unsqueeze(0).unwrap())
            .unwrap()
            .squeeze(0)
            .unwrap(),
        &gradient,
        "vmap(vmap)",
    );
    let tangents = Tensor::stack(&(0..3).map(|i| dir_t(&xs.get(i).unwrap())).collect::<Vec<_>>(), 0).unwrap();
    let vj = vmap(jvp_fn(f)).call((&xs, &tangents)).unwrap().1;
    for i in 0..3 {
        let gi = gradient(&xs.get(i).unwrap());
        let want = (gi * dir_t(&xs.get(i).unwrap())).unwrap().sum_all().unwrap();
        close(vj.get(i).unwrap(), &want, "vmap(jvp)");
    }

    // vmap inside: a function of the whole batch, sum_i f(x_i)
    let total = |xs: Tracer| vmap(f).apply((xs,))?.sum_all();
    let per_grad = Tensor::stack(&(0..3).map(|i| gradient(&xs.get(i).unwrap())).collect::<Vec<_>>(), 0).unwrap();
    close(grad(total).call(&xs).unwrap(), &per_grad, "grad(vmap)");
    close(jit(jacrev(total)).call(&xs).unwrap(), &per_grad, "jacrev(vmap)");
    close(jit(jacfwd(total)).call(&xs).unwrap(), &per_grad, "jacfwd(vmap)");
    let (_, pb) = vjp(&total, &xs).unwrap();
    close(
        pb.call(&Tensor::new(1f64, x.device()).unwrap()).unwrap().0,
        &per_grad,
        "vjp(vmap)",
    );
    let t_all = jvp(&total, &xs, &tangents).unwrap().1;
    let want = (&per_grad * &tangents).unwrap().sum_all().unwrap();
    close(t_all, &want, "jvp(vmap)");

    // gradients of gradients: the Hessian or its product with u
    let gr = |x: Tracer| Function::apply(&grad(f), (x,));
    let jr = |x: Tracer| Function::apply(&jacrev(f), (x,));
    let jf = |x: Tracer| Function::apply(&jacfwd(f), (x,));
    let jv = |x: Tracer| {
        let u = dir_t_tracer(&x)?;
        Function::apply(&jvp_fn(f), (x, u)).map(|(_, t)| t)
    };
    for (name, inner) in [("grad", &gr as &dyn Fn(Tracer) -> _), ("jacrev", &jr), ("jacfwd", &jf)] {
        close(jit(jacrev(inner)).call(&x).unwrap(), &h, &format!("jacrev({name})"));
        close(jit(jacfwd(inner)).call(&x).unwrap(), &h, &format!("jacfwd({name})"));
        close(jvp_at(&|x| inner(x), &x), &hu, &format!("jvp({name})"));
        let (_, pb) = vjp(&|x: Tracer| inner(x), &x).unwrap();
        close(pb.call(&u).unwrap().0, &hu, &format!("vjp({name})"));
        // grad of the sum: the Hessian's column sums
        let col = h.sum(0).unwrap();
        close(
            grad(|x: Tracer| inner(x)?.sum_all()).call(&x).unwrap(),
            &col,
            &format!("grad({name})"),
        );
    }
    // vjp inside (vjp_fn): the gradient as a VJP with cotangent 1, then
    // every transform around it; and vmap over cotangents (Jacobian rows)
    let vg = |x: Tracer| {
        let one = Tensor::new(1f64, &candle_core::Device::Cpu).unwrap().to_tracer(&x)?;
        Function::apply(&vjp_fn(f), (x, one))
    };
    close(jit(jacrev(vg)).call(&x).unwrap(), &h, "jacrev(vjp)");
    close(jit(jacfwd(vg)).call(&x).unwrap(), &h, "jacfwd(vjp)");
    close(jvp_at(&vg, &x), &hu, "jvp(vjp)");
    close(
        grad(|x: Tracer| vg(x)?.sum_all()).call(&x).unwrap(),
        &h.sum(0).unwrap(),
        "grad(vjp)",
    );
    let (_, pb) = vjp(&vg, &x).unwrap();
    close(pb.call(&u).unwrap().0, &hu, "vjp(vjp)");
    let eye = Tensor::eye(N, DType::F64, x.device()).unwrap();
    let rows = vmap(vjp_fn(|x: Tracer| Function::apply(&grad(f), (x,))))
        .in_dims([None, Some(0)])
        .call((&x, &eye))
        .unwrap();
    close(rows, &h, "vmap(vjp)");
    let per = vmap(vjp_fn(f))
        .in_dims([Some(0), None])
        .call((&xs, &Tensor::new(1f64, x.device()).unwrap()))
        .unwrap();
    let want = Tensor::stack(&(0..3).map(|i| gradient(&xs.get(i).unwrap())).collect::<Vec<_>>(), 0).unwrap();
    close(per, &want, "vmap(vjp) over points");
    // derivatives of a jvp, u(x) = tanh(x / 2 + 1/4) depending on x too:
    // d/dx <g(x), u(x)> = H u + J_u^T g
    let du = {
        let t = u.clone();
        (t.sqr().unwrap().affine(-0.5, 0.5)).unwrap() // d/dx tanh(x/2 + 1/4), diagonal
    };
    let dj = (&hu + (&du * &g).unwrap()).unwrap();
    close(grad(jv).call(&x).unwrap(), &dj, "grad(jvp)");
    close(jit(jacrev(jv)).call(&x).unwrap(), &dj, "jacrev(jvp)");
    close(jit(jacfwd(jv)).call(&x).unwrap(), &dj, "jacfwd(jvp)");
    let (_, pb) = vjp(&jv, &x).unwrap();
    close(
        pb.call(&Tensor::new(1f64, x.device()).unwrap()).unwrap().0,
        &dj,
        "vjp(jvp)",
    );
    // jvp(jvp): the derivative of <g, u> along u
    let want = (&dj * &u).unwrap().sum_all().unwrap();
    close(jvp_at(&jv, &x), &want, "jvp(jvp)");
}

/// The same direction traced, so it depends on the point.
fn dir_t_tracer(x: &Tracer) -> candle_func::Result<Tracer> {
    x.affine(0.5, 0.25)?.tanh()
}
