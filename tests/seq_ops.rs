//! The operations sequence models need, against candle's own where it has
//! them and against their definitions where it does not; the
//! differentiable ones are also in `common::unary_maps`, so the loop
//! oracle, finite differences and the JVP tests cover them.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::{grad, jit, jvp, vmap, Error, Tracer};
use common::{assert_close, oracle1, rand};

fn f64s(shape: &[usize], seed: u64) -> Tensor {
    (rand(shape, seed) * 3.0).unwrap().to_dtype(DType::F64).unwrap()
}

#[test]
fn activations_match_candle_and_their_definitions() {
    let x = f64s(&[4, 7], 1);
    let run = |f: fn(Tracer) -> candle_func::Result<Tracer>| jit(f).call(&x).unwrap();
    assert_close(&run(|x| x.sin()), &x.sin().unwrap(), 1e-12, "sin");
    assert_close(&run(|x| x.cos()), &x.cos().unwrap(), 1e-12, "cos");
    assert_close(&run(|x| x.silu()), &candle_nn::ops::silu(&x).unwrap(), 1e-12, "silu");
    // candle's `gelu` is the tanh approximation, `gelu_erf` the exact form
    assert_close(&run(|x| x.gelu_tanh()), &x.gelu().unwrap(), 1e-12, "gelu_tanh");
    assert_close(&run(|x| x.gelu()), &x.gelu_erf().unwrap(), 1e-12, "gelu");
    assert_close(&run(|x| x.elu(1.5)), &x.elu(1.5).unwrap(), 1e-12, "elu");
    let leaky = candle_nn::ops::leaky_relu(&x, 0.1).unwrap();
    assert_close(&run(|x| x.leaky_relu(0.1)), &leaky, 1e-12, "leaky_relu");
    let softplus = (x.exp().unwrap() + 1.0).unwrap().log().unwrap();
    assert_close(&run(|x| x.softplus()), &softplus, 1e-12, "softplus");
    assert_close(&run(|x| x.clamp(-1.0, 0.5)), &x.clamp(-1.0, 0.5).unwrap(), 0.0, "clamp");
    // softplus of large values neither overflows nor rounds to zero
    let big = Tensor::new(&[800f64, -700., -30.], &Device::Cpu).unwrap();
    let sp = jit(|x: Tracer| x.softplus())
        .call(&big)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert_eq!(sp[0], 800.0);
    assert!((sp[1] / (-700f64).exp() - 1.0).abs() < 1e-12, "{}", sp[1]);
    assert!((sp[2] / (-30f64).exp() - 1.0).abs() < 1e-12, "{}", sp[2]);
    let small = Tensor::new(&[1e-10f64, -3e-5, 0.5, -0.5], &Device::Cpu).unwrap();
    let got = jit(|x: Tracer| x.log1p())
        .call(&small)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    for (g, x) in got.iter().zip([1e-10f64, -3e-5, 0.5, -0.5]) {
        assert!((g / x.ln_1p() - 1.0).abs() < 1e-12, "log1p({x}) = {g}");
    }
    // clamp's derivative: 1 inside, boundaries included, 0 outside; NaN kept
    let pts = Tensor::new(&[-2f64, -1., 0., 0.5, 2., f64::NAN], &Device::Cpu).unwrap();
    let g = grad(|x: Tracer| x.clamp(-1.0, 0.5)?.sum_all()).call(&pts).unwrap();
    assert_eq!(&g.to_vec1::<f64>().unwrap()[..5], &[0., 1., 1., 1., 0.]);
    let c = jit(|x: Tracer| x.clamp(-1.0, 0.5)).call(&pts).unwrap();
    assert!(c.to_vec1::<f64>().unwrap()[5].is_nan());
    assert!(matches!(
        jit(|x: Tracer| x.clamp(1.0, 0.0)).call(&pts),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn masks_triangles_and_ranges() {
    let x = f64s(&[2, 3, 5], 2);
    for k in [-1i64, 0, 2] {
        let got = jit(move |x: Tracer| x.tril(k)).call(&x).unwrap();
        let up = jit(move |x: Tracer| x.triu(k + 1)).call(&x).unwrap();
        // tril(k) + triu(k + 1) = x, and tril(k) is zero above diagonal k
        assert_close(&(&got + &up).unwrap(), &x, 0.0, "tril + triu");
        let v = got.to_vec3::<f64>().unwrap();
        for (i, row) in v[1].iter().enumerate() {
            for (j, &e) in row.iter().enumerate() {
                if j as i64 - i as i64 > k {
                    assert_eq!(e, 0.0, "tril({k}) at ({i}, {j})");
                }
            }
        }
    }
    assert!(matches!(
        jit(|x: Tracer| x.tril(0)).call(f64s(&[3], 3)),
        Err(Error::Shape { .. })
    ));
    // a causal mask: positions after the query set to -inf before softmax
    let scores = f64s(&[4, 4], 4);
    let causal = |s: Tracer| {
        let t = Tracer::arange(&s, 0, 4, DType::U32)?;
        let after = t
            .unsqueeze(0)?
            .broadcast_as((4, 4))?
            .gt(&t.unsqueeze(1)?.broadcast_as((4, 4))?)?;
        s.masked_fill(&after, f64::NEG_INFINITY)?.softmax(-1)
    };
    let p = jit(causal).call(&scores).unwrap().to_vec2::<f64>().unwrap();
    assert_eq!(p[0][1..], [0.0, 0.0, 0.0]);
    assert!((p[2].iter().sum::<f64>() - 1.0).abs() < 1e-12 && p[2][3] == 0.0);
    let r = jit(|s: Tracer| s.masked_fill(&s, 0.0)).call(&scores);
    assert!(
        matches!(r, Err(Error::DType { op: "masked_fill", .. })),
        "{:?}",
        r.map(|_| ())
    );
    let a = jit(|s: Tracer| Tracer::arange(&s, -2, 3, DType::F32))
        .call(&scores)
        .unwrap();
    assert_eq!(a.to_vec1::<f32>().unwrap(), vec![-2., -1., 0., 1., 2.]);
    assert!(jit(|s: Tracer| Tracer::arange(&s, 3, 2, DType::F32))
        .call(&scores)
        .is_err());
    // under vmap and grad, a mask is a constant
    let xs = f64s(&[3, 4, 4], 5);
    oracle1(
        |x: Tracer| x.tril(0)?.exp(),
        &xs.to_dtype(DType::F32).unwrap(),
        Some(0),
        3,
        1e-5,
    );
    let g = grad(|x: Tracer| x.tril(-1)?.sqr()?.sum_all()).call(&scores).unwrap();
    let want = (Tensor::tril2(4, DType::F64, &Device::Cpu).unwrap()
        - Tensor::eye(4, DType::F64, &Device::Cpu).unwrap())
    .unwrap()
    .mul(&(&scores * 2.0).unwrap())
    .unwrap();
    assert_close(&g, &want, 1e-12, "grad of tril");
}

#[test]
fn cumsum_matches_candle_long_axes_too() {
    for (shape, axis) in [
        (vec![3, 5], 1usize),
        (vec![4, 3], 0),
        (vec![2, 1000], 1),
        (vec![600], 0),
    ] {
        let x = f64s(&shape, 6);
        let got = jit(move |x: Tracer| x.cumsum(axis)).call(&x).unwrap();
        assert_close(
            &got,
            &x.cumsum(axis).unwrap(),
            1e-9,
            &format!("cumsum {shape:?} axis {axis}"),
        );
        // its VJP is the reversed running sum of the cotangent
        let g = grad(move |x: Tracer| x.cumsum(axis)?.sum_all()).call(&x).unwrap();
        let n = shape[axis] as f64;
        // d/dx_i of sum_j cumsum_j is the number of j >= i, n - i
        let mut along = vec![1; shape.len()];
        along[axis] = shape[axis];
        let idx = Tensor::arange(0f64, n, &Device::Cpu).unwrap().reshape(along).unwrap();
        let want = idx.affine(-1.0, n).unwrap().broadcast_as(x.shape()).unwrap();
        assert_close(&g, &want, 1e-9, "grad of cumsum");
        let (_, t) = jvp(&move |x: Tracer| x.cumsum(axis), &x, &x).unwrap();
        assert_close(&t, &got, 1e-9, "cumsum is linear");
    }
}

#[test]
fn argmax_and_argmin_follow_pytorch() {
    let x = Tensor::new(
        &[[1f32, 3., 3., 0.], [2., f32::NAN, 5., f32::NAN], [-1., -1., -4., -4.]],
        &Device::Cpu,
    )
    .unwrap();
    let am = jit(|x: Tracer| x.argmax(1)).call(&x).unwrap();
    // the first of ties; the first NaN where there is one
    assert_eq!(am.to_vec1::<u32>().unwrap(), vec![1, 1, 0]);
    let an = jit(|x: Tracer| x.argmin_keepdim(1)).call(&x).unwrap();
    assert_eq!(an.to_vec2::<u32>().unwrap(), vec![vec![3], vec![1], vec![2]]);
    let col = jit(|x: Tracer| x.argmax(0)).call(x.narrow(1, 0, 1).unwrap()).unwrap();
    assert_eq!(col.to_vec1::<u32>().unwrap(), vec![1]);
    // under vmap, per example
    let xs = rand(&[5, 3, 4], 7);
    let got = vmap(|x: Tracer| x.argmax(-1)).call(&xs).unwrap();
    assert_eq!(
        got.to_vec2::<u32>().unwrap(),
        xs.argmax(2).unwrap().to_vec2::<u32>().unwrap()
    );
    // as an index inside a differentiated function: no derivative through
    // the index, the gradient flows through the gather
    let pick = |x: Tracer| x.gather(&x.argmax_keepdim(1)?, 1)?.sum_all();
    let g = grad(pick).call(rand(&[3, 4], 8)).unwrap();
    assert_eq!(g.sum_all().unwrap().to_scalar::<f32>().unwrap(), 3.0);
    // an integer result is not a loss
    let r = grad(|x: Tracer| x.argmax(0)?.sum_all()).call(rand(&[4], 9));
    assert!(matches!(r, Err(Error::DType { .. })), "{:?}", r.map(|_| ()));
    let empty = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        jit(|x: Tracer| x.argmax(1)).call(&empty),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn broadcast_matmul_takes_vectors_and_broadcasts() {
    let (m, v, b) = (f64s(&[3, 4], 10), f64s(&[4], 11), f64s(&[2, 4, 5], 12));
    let mv = jit(|m: Tracer, v: Tracer| m.broadcast_matmul(&v))
        .call((&m, &v))
        .unwrap();
    assert_close(
        &mv,
        &m.matmul(&v.unsqueeze(1).unwrap()).unwrap().squeeze(1).unwrap(),
        1e-12,
        "matrix @ vector",
    );
    let vm = jit(|v: Tracer, b: Tracer| v.broadcast_matmul(&b))
        .call((&v, &b))
        .unwrap();
    assert_eq!(vm.dims(), &[2, 5]);
    let want = v
        .unsqueeze(0)
        .unwrap()
        .broadcast_matmul(&b)
        .unwrap()
        .squeeze(1)
        .unwrap();
    assert_close(&vm, &want, 1e-12, "vector @ batch");
    let vv = jit(|v: Tracer| v.broadcast_matmul(&v)).call(&v).unwrap();
    assert_eq!(vv.dims(), &[] as &[usize]);
    let mb = jit(|m: Tracer, b: Tracer| m.broadcast_matmul(&b))
        .call((&m, &b))
        .unwrap();
    assert_close(&mb, &m.broadcast_matmul(&b).unwrap(), 1e-12, "broadcast leading axes");
    let g = grad(|v: Tracer, m: Tracer| m.broadcast_matmul(&v)?.sum_all())
        .call((&v, &m))
        .unwrap();
    assert_close(&g, &m.sum(0).unwrap(), 1e-12, "grad through a rank-1 product");
    let s = Tensor::new(2f64, &Device::Cpu).unwrap();
    let r = jit(|m: Tracer, s: Tracer| m.broadcast_matmul(&s)).call((&m, &s));
    assert!(matches!(r, Err(Error::Shape { .. })));
    // candle's broadcast_* names
    let names = |a: Tracer, b: Tracer| {
        a.broadcast_add(&b)?
            .broadcast_mul(&b)?
            .broadcast_sub(&b)?
            .broadcast_div(&b.abs()?.affine(1.0, 1.0)?)?
            .broadcast_maximum(&b)?
            .broadcast_minimum(2.0)
    };
    let got = jit(names).call((&m, &v)).unwrap();
    let want = m
        .broadcast_add(&v)
        .and_then(|t| t.broadcast_mul(&v))
        .and_then(|t| t.broadcast_sub(&v))
        .and_then(|t| t.broadcast_div(&(v.abs()? + 1.0)?))
        .and_then(|t| t.broadcast_maximum(&v))
        .and_then(|t| t.minimum(2.0))
        .unwrap();
    assert_close(&got, &want, 1e-12, "broadcast names");
    let var = jit(|x: Tracer| x.var_keepdim(1)).call(&m).unwrap();
    let mean = m.mean_keepdim(1).unwrap();
    let want = m.broadcast_sub(&mean).unwrap().sqr().unwrap().mean_keepdim(1).unwrap();
    assert_close(&var, &want, 1e-12, "biased variance");
}

#[test]
fn transposed_convolutions_match_candle() {
    let x = f64s(&[2, 4, 5, 6], 20);
    let w = f64s(&[4, 3, 3, 2], 21);
    for (p, op, s, d) in [(0, 0, 1, 1), (1, 1, 2, 1), (0, 0, 2, 2), (2, 0, 3, 1)] {
        let got = jit(move |x: Tracer, w: Tracer| x.conv_transpose2d(&w, p, op, s, d, 1)).call((&x, &w));
        let want = x.conv_transpose2d(&w, p, op, s, d);
        match (got, want) {
            (Ok(g), Ok(want)) => assert_close(&g, &want, 1e-10, &format!("conv_transpose2d p{p} op{op} s{s} d{d}")),
            (g, want) => panic!(
                "p{p} op{op} s{s} d{d}: {:?} vs {:?}",
                g.map(|t| t.dims().to_vec()),
                want.map(|t| t.dims().to_vec())
            ),
        }
    }
    let (x1, w1) = (f64s(&[2, 4, 7], 22), f64s(&[4, 6, 3], 23));
    let got = jit(|x: Tracer, w: Tracer| x.conv_transpose1d(&w, 1, 1, 2, 1, 2))
        .call((&x1, &w1))
        .unwrap();
    let want = x1.conv_transpose1d(&w1, 1, 1, 2, 1, 2).unwrap();
    assert_close(&got, &want, 1e-10, "conv_transpose1d, 2 groups");
    // per-sample gradients of the weight against a loop
    let xs = f64s(&[3, 1, 4, 5, 6], 24);
    let loss = |w: Tracer, x: Tracer| x.conv_transpose2d(&w, 1, 1, 2, 1, 1)?.tanh()?.sum_all();
    let per = vmap(grad(loss)).in_dims([None, Some(0)]).call((&w, &xs)).unwrap();
    for i in 0..3 {
        let one = grad(loss).call((&w, &xs.get(i).unwrap())).unwrap();
        assert_close(&per.get(i).unwrap(), &one, 1e-10, &format!("example {i}"));
    }
    let bad = jit(|x: Tracer, w: Tracer| x.conv_transpose2d(&w, 0, 2, 2, 1, 1)).call((&x, &w));
    assert!(matches!(
        bad,
        Err(Error::Shape {
            op: "conv_transpose",
            ..
        })
    ));
    let bad = jit(|x: Tracer, w: Tracer| x.conv_transpose2d(&w, 9, 0, 1, 1, 1)).call((&x, &w));
    assert!(matches!(
        bad,
        Err(Error::Shape {
            op: "conv_transpose",
            ..
        })
    ));
}
