//! Forward mode: `jvp` against central finite differences in f64 for every
//! primitive family, and against reverse mode (`<v, J u> = <J^T v, u>`
//! with `vjp`) on the same functions and a small CNN.

mod common;

use candle_core::{DType, Tensor};
use candle_func::tracer::Operand;
use candle_func::{jvp, vjp, Tracer};
use common::{arithmetic_ops, assert_close, rand, rand_idx, unary_maps, Un};

fn f64s(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::F64).unwrap()
}

/// `(f(x + h u) - f(x - h u)) / 2h`.
fn central(f: &dyn Fn(Tracer) -> candle_func::Result<Tracer>, x: &Tensor, u: &Tensor) -> Tensor {
    let h = 1e-6;
    let at = |s: f64| {
        let xs = (x + (u * s).unwrap()).unwrap();
        candle_func::jit(|x: Tracer| f(x)).call(&xs).unwrap()
    };
    ((at(h) - at(-h)).unwrap() / (2.0 * h)).unwrap()
}

/// jvp equals finite differences and agrees with vjp for `f` at `x`.
fn check(name: &str, f: &dyn Fn(Tracer) -> candle_func::Result<Tracer>, x: &Tensor, seed: u64) {
    let u = f64s(x.dims(), seed);
    let (y, dy) = jvp(&|x: Tracer| f(x), x, &u).unwrap();
    let want_y = candle_func::jit(|x: Tracer| f(x)).call(x).unwrap();
    assert_close(&y, &want_y, 1e-12, &format!("{name}: value"));
    assert_close(
        &dy,
        &central(f, x, &u),
        1e-5,
        &format!("{name}: tangent vs finite differences"),
    );
    // <v, J u> = <J^T v, u>
    let v = f64s(y.dims(), seed + 1);
    let (_, pullback) = vjp(&|x: Tracer| f(x), x).unwrap();
    let (jt_v,) = pullback.call(&v).unwrap();
    let lhs = (v * &dy).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    let rhs = (jt_v * &u).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    assert!(
        (lhs - rhs).abs() <= 1e-9 * (1.0 + lhs.abs()),
        "{name}: <v, Ju> {lhs} vs <J^T v, u> {rhs}"
    );
}

#[test]
fn elementwise_maps() {
    let x = f64s(&[3, 4], 1);
    for (name, f) in unary_maps() {
        check(name, &|x| f(x), &x, 2);
    }
    for (name, g) in arithmetic_ops() {
        let c = f64s(&[4], 3).abs().unwrap().affine(1.0, 0.5).unwrap();
        // both operands carry the tangent (x op (x^2 + c)), broadcasting
        check(
            name,
            &move |x: Tracer| g(x.clone(), x.sqr()?.add(&c.to_tracer(&x)?)?),
            &x,
            4,
        );
    }
    check("maximum", &|x: Tracer| x.maximum(&x.sqr()?.affine(0.5, -0.2)?), &x, 5);
    check("minimum", &|x: Tracer| x.minimum(&x.neg()?), &x, 6);
    check("where", &|x: Tracer| x.gt(0.1)?.where_cond(&x.exp()?, &x.sqr()?), &x, 7);
    // a cast is linear: through f32 (where finite differences of 1e-6 are
    // noise) the tangent of x^2 is 2 x u to f32 precision
    let u = f64s(x.dims(), 8);
    let (_, dy) = jvp(&|x: Tracer| x.to_dtype(DType::F32)?.sqr()?.to_dtype(DType::F64), &x, &u).unwrap();
    assert_close(&dy, &((&x * &u).unwrap() * 2.0).unwrap(), 1e-5, "casts");
    // into an integer dtype there is no tangent: zeros
    let (_, dz) = jvp(&|x: Tracer| x.to_dtype(DType::U32)?.to_dtype(DType::F64), &x, &u).unwrap();
    assert_eq!(dz.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
}

#[test]
fn reductions_and_shapes() {
    let x = f64s(&[2, 3, 4], 9);
    let cases: Vec<(&str, Un)> = vec![
        ("sum", |x| x.sum([0, 2])),
        ("sum_all", |x| x.sqr()?.sum_all()),
        ("mean", |x| x.mean(1)),
        ("max", |x| x.max(2)),
        ("max over two", |x| x.max([0, 1])),
        ("softmax", |x| x.softmax(-1)),
        ("log_softmax", |x| x.log_softmax(1)),
        ("reshape", |x| x.reshape((6, 4))?.sqr()),
        ("permute", |x| x.permute(&[2, 0, 1])?.exp()),
        ("broadcast", |x| x.unsqueeze(0)?.broadcast_as((5, 2, 3, 4))?.tanh()),
        ("narrow", |x| x.narrow(2, 1, 2)?.sqr()),
        ("concat", |x| Tracer::cat(&[&x, &x.sqr()?], 1)),
        ("matmul", |x| x.matmul(&x.transpose(1, 2)?)),
    ];
    for (i, (name, f)) in cases.into_iter().enumerate() {
        check(name, &f, &x, 10 + i as u64);
    }
    // indexing: linear in the values, integer indices
    let idx = rand_idx(&[5], 3, 30);
    check("index_select", &move |x: Tracer| x.index_select(&idx, 1)?.sqr(), &x, 31);
    let g = rand_idx(&[2, 3, 2], 4, 32);
    check("gather", &move |x: Tracer| x.gather(&g, 2)?.exp(), &x, 33);
}

#[test]
fn convolutions_and_pooling() {
    let x = f64s(&[2, 4, 7, 7], 40);
    let w = f64s(&[6, 2, 3, 3], 41);
    let wt = w.clone();
    // the input's tangent, then the weight's (through a closure over x)
    check("conv2d wrt x", &move |x: Tracer| x.conv2d(&wt, 1, 2, 1, 2), &x, 42);
    let xc = x.clone();
    check(
        "conv2d wrt w",
        &move |w: Tracer| xc.to_tracer(&w)?.conv2d(&w, 0, 1, 2, 2),
        &w,
        43,
    );
    let w1 = f64s(&[3, 4, 3], 44);
    check(
        "conv1d",
        &move |x: Tracer| x.reshape((2, 4, 49))?.conv1d(&w1, 1, 1, 1, 1),
        &x,
        45,
    );
    let w3 = f64s(&[2, 4, 2, 2, 2], 46);
    check(
        "conv3d",
        &move |x: Tracer| {
            x.reshape((2, 4, 7, 7, 1))?
                .broadcast_as((2, 4, 7, 7, 2))?
                .conv3d(&w3, 0, 1, 1, 1)
        },
        &x,
        47,
    );
    check("max_pool2d", &|x: Tracer| x.max_pool2d(2)?.sqr(), &x, 48);
    check("avg_pool2d", &|x: Tracer| x.avg_pool2d_with_stride(3, 2)?.exp(), &x, 49);
    // a whole CNN: conv, relu, pool, linear, log-softmax
    let (wc, wl) = (f64s(&[5, 4, 3, 3], 50), f64s(&[5 * 3 * 3, 3], 51));
    check(
        "cnn",
        &move |x: Tracer| {
            let h = x.conv2d(&wc, 1, 1, 1, 1)?.relu()?.max_pool2d(2)?;
            h.flatten_from(1)?.narrow(1, 0, 45)?.matmul(&wl)?.log_softmax(1)
        },
        &x,
        52,
    );
}

#[test]
fn gradient_primitives_have_jvps_too() {
    // forward-over-reverse: the tangent of a gradient (a Hessian-vector
    // product) through conv, pool and matmul gradient primitives
    let x = f64s(&[1, 2, 6, 6], 60);
    let w = f64s(&[3, 2, 3, 3], 61);
    let loss = move |x: Tracer| -> candle_func::Result<Tracer> {
        let wt = w.to_tracer(&x)?;
        x.conv2d(&wt, 1, 1, 1, 1)?.tanh()?.max_pool2d(2)?.sqr()?.sum_all()
    };
    let g = candle_func::grad(loss);
    let grad_of = move |x: Tracer| candle_func::Function::apply(&g, (x,));
    check("hvp through conv, pool", &grad_of, &x, 62);
}

#[test]
fn integer_arguments_take_no_tangent_and_errors_name_the_problem() {
    let x = f64s(&[3], 70);
    let i = Tensor::new(&[0u32, 2, 1], x.device()).unwrap();
    let (y, dy) = jvp(
        &|x: Tracer, i: Tracer| x.index_select(&i, 0)?.sqr(),
        (&x, &i),
        (&x.ones_like().unwrap(), &i.zeros_like().unwrap()),
    )
    .unwrap();
    assert_eq!(y.dims(), &[3]);
    let want = (x.index_select(&i, 0).unwrap() * 2.0).unwrap();
    assert_close(&dy, &want, 1e-12, "d/dx x_i^2 along ones");
    // tangents of another shape are an error
    let r = jvp(&|x: Tracer| x.exp(), &x, &f64s(&[4], 71));
    assert!(matches!(r, Err(candle_func::Error::Tree { .. })), "{r:?}");
    // a custom op has no JVP rule: a loud error naming it
    let r = jvp(
        &|x: Tracer| candle_func::custom_op("opaque", &[&x], x.tensor_type().clone(), |xs| Ok(xs[0].clone())),
        &x,
        &x,
    );
    match r {
        Err(e) => assert!(e.to_string().contains("no JVP rule"), "{e}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn through_vmap_maps_and_every_conv_route() {
    use candle_func::{vmap, ConvRoute, Schedule};
    // a vmapped CNN (per-example, and through each conv route's lowering,
    // the Loop route and the per-example schedule being maps)
    let xs = f64s(&[3, 2, 6, 6], 80);
    let w = f64s(&[4, 2, 3, 3], 81);
    for (route, schedule) in [
        (ConvRoute::Unfold, Schedule::Batched),
        (ConvRoute::Grouped, Schedule::Batched),
        (ConvRoute::Loop, Schedule::Batched),
        (ConvRoute::Unfold, Schedule::PerExample),
    ] {
        let (wv, xs) = (w.clone(), xs.clone());
        let f = move |w: Tracer| -> candle_func::Result<Tracer> {
            let xt = xs.to_tracer(&w)?;
            let per = vmap(|x: Tracer, w: Tracer| x.unsqueeze(0)?.conv2d(&w, 1, 1, 1, 1)?.tanh()?.sum_all())
                .in_dims([Some(0), None])
                .conv_route(route)
                .schedule(schedule);
            candle_func::Function::apply(&per, (xt, w))
        };
        check(&format!("vmap {route:?} {schedule:?}"), &f, &wv, 82);
    }
}

#[test]
fn jacobians_hessians_and_hvps_agree() {
    use candle_func::jacobian::jvp_fn;
    use candle_func::{grad, hessian, hvp, jacfwd, jacrev, jit, vhp, vmap};
    let w1 = f64s(&[5, 4], 90);
    let w2 = f64s(&[3, 5], 91);
    let mlp = move |x: Tracer| -> candle_func::Result<Tracer> {
        x.matmul(&w1.t().unwrap().to_tracer(&x)?)?
            .tanh()?
            .matmul(&w2.t().unwrap().to_tracer(&x)?)?
            .log_softmax(1)
    };
    let x = f64s(&[2, 4], 92);
    let jf = jit(jacfwd(mlp.clone())).call(&x).unwrap();
    let jr = jit(jacrev(mlp.clone())).call(&x).unwrap();
    assert_eq!(jf.dims(), &[2, 3, 2, 4], "[*out, *in]");
    assert_close(&jf, &jr, 1e-12, "jacfwd = jacrev");
    // column (i, k) of the Jacobian is the JVP along e_(i,k)
    for (i, k) in [(0, 0), (1, 3)] {
        let mut e = vec![0f64; 8];
        e[i * 4 + k] = 1.0;
        let e = Tensor::from_vec(e, (2, 4), x.device()).unwrap();
        let (_, col) = jvp(&mlp, &x, &e).unwrap();
        let want = jf
            .narrow(2, i, 1)
            .unwrap()
            .narrow(3, k, 1)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        assert_close(&col, &want, 1e-12, "a column");
    }
    // per-example Jacobians under vmap, as the torch.func tutorials do
    let w1b = f64s(&[5, 4], 93);
    let one = move |x: Tracer| {
        x.unsqueeze(0)?
            .matmul(&w1b.t().unwrap().to_tracer(&x)?)?
            .tanh()?
            .squeeze(0)
    };
    let xs = f64s(&[6, 4], 94);
    let per = vmap(jacrev(one.clone())).call(&xs).unwrap();
    assert_eq!(per.dims(), &[6, 5, 4]);
    let j2 = jit(jacfwd(one)).call(xs.get(2).unwrap()).unwrap();
    assert_close(&per.get(2).unwrap(), &j2, 1e-12, "example 2");
    // the Hessian of a scalar loss: symmetric, and H v = hvp
    let loss = {
        let f = mlp.clone();
        move |x: Tracer| f(x)?.exp()?.sqr()?.sum_all()
    };
    let h = jit(hessian(loss.clone())).call(&x).unwrap();
    assert_eq!(h.dims(), &[2, 4, 2, 4]);
    let hm = h.reshape((8, 8)).unwrap();
    assert_close(&hm, &hm.t().unwrap(), 1e-10, "symmetric");
    let v = f64s(&[2, 4], 95);
    let hv = hvp(&loss, &x, &v).unwrap();
    let want = hm.matmul(&v.reshape((8, 1)).unwrap()).unwrap().reshape((2, 4)).unwrap();
    assert_close(&hv, &want, 1e-10, "hvp = H v");
    assert_close(&vhp(&loss, &x, &v).unwrap(), &want, 1e-10, "vhp = v^T H (H symmetric)");
    let (g, hv2) = jit(jvp_fn(grad(loss.clone()))).call((&x, &v)).unwrap();
    assert_close(&hv2, &hv, 0.0, "jvp_fn(grad) is hvp");
    assert_close(&g, &grad(loss).call(&x).unwrap(), 1e-12, "with the gradient");
}

#[test]
fn linearize_gives_jvps_without_rerunning_the_forward() {
    use candle_func::linearize;
    let x = f64s(&[2, 3, 6, 6], 100);
    let w = f64s(&[4, 3, 3, 3], 101);
    let f = move |x: Tracer| x.conv2d(&w.to_tracer(&x)?, 1, 1, 1, 1)?.tanh()?.max_pool2d(2)?.sqr();
    let (y, lin) = linearize(&f, &x).unwrap();
    for seed in [102, 103, 104] {
        let u = f64s(x.dims(), seed);
        let (y2, ju) = jvp(&f, &x, &u).unwrap();
        assert_close(&y, &y2, 0.0, "the value");
        assert_close(&lin.call(&u).unwrap(), &ju, 1e-12, "linearized = jvp");
    }
    // linear: J(2u + v) = 2 Ju + Jv
    let (u, v) = (f64s(x.dims(), 105), f64s(x.dims(), 106));
    let lhs = lin.call(((&u * 2.0).unwrap() + &v).unwrap()).unwrap();
    let rhs = ((lin.call(&u).unwrap() * 2.0).unwrap() + lin.call(&v).unwrap()).unwrap();
    assert_close(&lhs, &rhs, 1e-12, "linear");
    assert!(matches!(
        lin.call(f64s(&[2, 3, 6, 5], 107)),
        Err(candle_func::Error::Tree { .. })
    ));
}

/// Bad input to the forward-mode and Jacobian functions is an error, and
/// NaN propagates through them as through the functions themselves.
#[test]
fn bad_input_to_the_new_transforms_is_an_error() {
    use candle_func::jacobian::vjp_fn;
    use candle_func::{hvp, jacfwd, jacrev, jit, Error};
    let x = f64s(&[3], 110);
    let ints = Tensor::new(&[1u32, 2, 3], x.device()).unwrap();
    let sq = |x: Tracer| x.sqr();
    // Jacobians of an integer input: no derivative to take
    assert!(matches!(jit(jacrev(sq)).call(&ints), Err(Error::DType { .. })));
    assert!(matches!(jit(jacfwd(sq)).call(&ints), Err(Error::DType { .. })));
    // a direction or cotangent of another shape
    let loss = |x: Tracer| x.sqr()?.sum_all();
    assert!(matches!(hvp(&loss, &x, &f64s(&[4], 111)), Err(Error::Tree { .. })));
    let r = jit(vjp_fn(sq)).call((&x, &f64s(&[2], 112)));
    assert!(matches!(r, Err(Error::Tree { .. })), "{r:?}");
    // erf and gelu are float-only
    for f in [|x: Tracer| x.erf(), |x: Tracer| x.gelu()] {
        assert!(matches!(jit(f).call(&ints), Err(Error::DType { .. })));
    }
    // NaN in, NaN out
    let nan = Tensor::new(&[1f64, f64::NAN, 2.], x.device()).unwrap();
    let (_, t) = jvp(&|x: Tracer| x.exp(), &nan, &x).unwrap();
    assert!(t.to_vec1::<f64>().unwrap()[1].is_nan());
    let j = jit(jacrev(|x: Tracer| x.tanh())).call(&nan).unwrap();
    assert!(j.get(1).unwrap().to_vec1::<f64>().unwrap()[1].is_nan());
}
