//! Finite differences in f64 for every VJP rule: the directional derivative
//! `<grad f(x), v>` against `(f(x + eps v) - f(x - eps v)) / 2 eps` along a
//! random direction, with `f = sum(r * prim(x))` for a random `r`, over
//! random shapes. Gradient primitives (conv input/weight gradients, fold,
//! pooling gradients, index-add, scatter-add) are checked through
//! `grad(grad(..))`.

mod common;

use candle_core::{DType, Tensor};
use candle_func::graph::ConvGeom;
use candle_func::{grad, jit, vmap, ConvRoute, Result, Tracer};
use common::*;
use proptest::prelude::*;

const EPS: f64 = 1e-6;

fn f64t(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::F64).unwrap()
}

fn dot(a: &Tensor, b: &Tensor) -> f64 {
    (a * b).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
}

/// Checks the gradient of `x -> sum(r * f(x))` along a random direction.
fn fd1<F>(what: &str, f: F, x: &Tensor, seed: u64)
where
    F: Fn(Tracer) -> Result<Tracer> + Clone,
{
    let out = jit(f.clone()).call(x).unwrap();
    let r = f64t(out.dims(), seed + 7);
    let scalar = move |x: Tracer| f(x)?.mul(&r)?.sum_all();
    let g = grad(scalar.clone()).call(x).unwrap();
    let v = f64t(x.dims(), seed + 11);
    let run = jit(scalar);
    let at = |s: f64| {
        run.call((x + (&v * s).unwrap()).unwrap())
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    close_to(what, dot(&g, &v), (at(EPS) - at(-EPS)) / (2.0 * EPS), 1e-6);
}

/// The same for a function of two tensors, differentiated in both.
fn fd2<F>(what: &str, f: F, x: &Tensor, y: &Tensor, seed: u64)
where
    F: Fn(Tracer, Tracer) -> Result<Tracer> + Clone,
{
    let out = jit(f.clone()).call((x, y)).unwrap();
    let r = f64t(out.dims(), seed + 7);
    let scalar = move |x: Tracer, y: Tracer| f(x, y)?.mul(&r)?.sum_all();
    let (gx, gy) = grad(scalar.clone()).argnums::<0, 1>().call((x, y)).unwrap();
    let (vx, vy) = (f64t(x.dims(), seed + 11), f64t(y.dims(), seed + 13));
    let run = jit(scalar);
    let at = |s: f64| {
        let xs = (x + (&vx * s).unwrap()).unwrap();
        let ys = (y + (&vy * s).unwrap()).unwrap();
        run.call((xs, ys)).unwrap().to_scalar::<f64>().unwrap()
    };
    close_to(
        what,
        dot(&gx, &vx) + dot(&gy, &vy),
        (at(EPS) - at(-EPS)) / (2.0 * EPS),
        1e-6,
    );
}

fn unary_ops() -> Vec<(&'static str, Un)> {
    let mut ops = unary_maps();
    ops.extend::<Vec<(&'static str, Un)>>(vec![
        ("sqrt", |x| x.abs()?.affine(1.0, 0.5)?.sqrt()),
        ("powf", |x| x.abs()?.affine(1.0, 0.5)?.powf(1.7)),
        ("sum", |x| x.sum_keepdim(0)),
        ("mean", |x| x.mean_all()),
        ("max", |x| x.max(-1)),
        ("reshape", |x| x.flatten_all()),
        ("permute", |x| x.t()),
        ("broadcast", |x| x.broadcast_as([&[2], x.dims()].concat())),
        ("narrow", |x| x.narrow(-1, 1, 1)),
        ("concat", |x| Tracer::cat(&[&x, &x.exp()?], 0)),
        ("where", |x| x.gt(0.0)?.where_cond(&x.sqr()?, &x.neg()?)),
    ]);
    ops
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn unary_and_shape_rules(s in prop::collection::vec(2usize..4, 2..=3), seed in any::<u64>()) {
        let x = f64t(&s, seed);
        for (name, f) in unary_ops() {
            fd1(name, f, &x, seed);
        }
        // A round trip through f32 rounds to ~1e-7, so this one takes a
        // coarser step and tolerance.
        let cast = |x: Tracer| x.to_dtype(DType::F32)?.exp()?.to_dtype(DType::F64);
        let g = grad(move |x: Tracer| cast(x)?.sum_all()).call(&x).unwrap();
        let v = f64t(x.dims(), seed + 11);
        let run = jit(move |x: Tracer| cast(x)?.sum_all());
        let at = |s: f64| run.call((&x + (&v * s).unwrap()).unwrap()).unwrap().to_scalar::<f64>().unwrap();
        close_to("cast", dot(&g, &v), (at(1e-3) - at(-1e-3)) / 2e-3, 1e-3);
    }

    #[test]
    fn binary_rules_with_broadcasting(s in prop::collection::vec(2usize..4, 2..=3), drop in 0usize..2, seed in any::<u64>()) {
        let x = f64t(&s, seed);
        let mut t = s[drop..].to_vec();
        t[0] = 1;
        let y = f64t(&t, seed + 1);
        for (name, f) in arithmetic_ops() {
            fd2(name, f, &x, &y, seed);
            fd2(name, f, &y, &x, seed + 3);
        }
    }

    #[test]
    fn matmul_rule(m in 1usize..4, k in 1usize..4, n in 1usize..4, lead in 0usize..3, seed in any::<u64>()) {
        let la = if lead == 1 { vec![2] } else { vec![] };
        let lb = if lead == 2 { vec![2] } else { vec![] };
        let a = f64t(&[&la[..], &[m, k]].concat(), seed);
        let b = f64t(&[&lb[..], &[k, n]].concat(), seed + 1);
        fd2("matmul", |a: Tracer, b: Tracer| a.matmul(&b), &a, &b, seed);
    }

    #[test]
    fn index_rules(s in prop::collection::vec(2usize..4, 2..=3), k in 1usize..4, seed in any::<u64>()) {
        let x = f64t(&s, seed);
        let idx = rand_idx(&[k], s[1], seed);
        fd1("index_select", move |x: Tracer| x.index_select(&idx, 1), &x, seed);
        let mut is = s.clone();
        *is.last_mut().unwrap() = k;
        is[0] = 1; // smaller than the operand off the gathered axis
        let gi = rand_idx(&is, *s.last().unwrap(), seed + 5);
        fd1("gather", move |x: Tracer| x.gather(&gi, -1), &x, seed);
    }

    #[test]
    fn conv_rules(nd in 1usize..4, groups in 1usize..3, size in 4usize..7, k in 1usize..4, st in 1usize..3,
                  p in 0usize..2, dl in 1usize..3, seed in any::<u64>()) {
        prop_assume!(size + 2 * p > dl * (k - 1));
        let x = f64t(&[[2, 2 * groups].as_slice(), &vec![size; nd]].concat(), seed);
        let w = f64t(&[[2 * groups, 2].as_slice(), &vec![k; nd]].concat(), seed + 1);
        let g = ConvGeom::uniform(nd, k, p, st, dl);
        let conv = move |x: Tracer, w: Tracer| x.conv(&w, g.clone(), groups);
        fd2("conv", conv.clone(), &x, &w, seed);
        let g = ConvGeom::uniform(nd, k, p, st, dl);
        fd1("unfold", move |x: Tracer| x.unfold(g.clone()), &x, seed);
        // second order: the gradients of conv (input and weight gradients,
        // and fold through unfold's gradient) differentiated again
        let q = {
            let out = jit(conv.clone()).call((&x, &w)).unwrap();
            f64t(out.dims(), seed + 17)
        };
        let inner = std::sync::Arc::new(grad(move |x: Tracer, w: Tracer| conv(x, w)?.mul(&q)?.sum_all()).argnums::<0, 1>());
        let (rx, rw) = (f64t(x.dims(), seed + 19), f64t(w.dims(), seed + 23));
        let outer = move |x: Tracer, w: Tracer| {
            let (gx, gw) = candle_func::Function::apply(&*inner, (x, w))?;
            gx.sqr()?.mul(&rx)?.sum_all()?.add(&gw.sqr()?.mul(&rw)?.sum_all()?)
        };
        fd2("conv grad_input/grad_weight", outer, &x, &w, seed);
        if groups == 1 {
            // per-sample weight gradients (the Unfold route's
            // grad_weight_each) differentiated again
            let g = ConvGeom::uniform(nd, k, p, st, dl);
            let loss = move |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv(&w, g.clone(), 1)?.sqr()?.sum_all();
            let per = std::sync::Arc::new(vmap(grad(loss)).in_dims([None, Some(0)]).conv_route(ConvRoute::Unfold));
            let r = f64t(&[[2usize].as_slice(), w.dims()].concat(), seed + 29);
            let twice = move |x: Tracer, w: Tracer| {
                let pw = candle_func::Function::apply(&*per, (w, x))?;
                pw.sqr()?.mul(&r)?.sum_all()
            };
            fd2("conv grad_weight_each", twice, &x, &w, seed);
        }
        let g = ConvGeom::uniform(nd, k, p, st, dl);
        let fold_twice = move |x: Tracer| {
            let inner = grad(|x: Tracer| x.unfold(g.clone())?.sqr()?.sum_all());
            candle_func::Function::apply(&inner, (x,))
        };
        fd1("fold", fold_twice, &x, seed);
    }

    #[test]
    fn pool_rules(h in 3usize..7, w in 3usize..7, k in 1usize..4, st in 1usize..3, seed in any::<u64>()) {
        prop_assume!(k <= h && k <= w);
        let x = f64t(&[2, 2, h, w], seed);
        fd1("max_pool2d", move |x: Tracer| x.max_pool2d_with_stride(k, st), &x, seed);
        fd1("avg_pool2d", move |x: Tracer| x.avg_pool2d_with_stride(k, st), &x, seed);
        // second order through max_pool2d_grad / max_pool2d_select / avg_pool2d_grad
        let twice = move |x: Tracer| {
            let g = grad(move |x: Tracer| x.max_pool2d_with_stride(k, st)?.sqr()?.sum_all());
            let a = grad(move |x: Tracer| x.avg_pool2d_with_stride(k, st)?.sqr()?.sum_all());
            candle_func::Function::apply(&g, (x.clone(),))?.add(&candle_func::Function::apply(&a, (x,))?)
        };
        fd1("pool gradients", twice, &x, seed);
    }

    #[test]
    fn index_gradient_rules(s in prop::collection::vec(2usize..4, 2..=3), k in 1usize..4, seed in any::<u64>()) {
        let x = f64t(&s, seed);
        let idx = rand_idx(&[k], s[1], seed);
        let mut is = s.clone();
        *is.last_mut().unwrap() = k;
        let gi = rand_idx(&is, *s.last().unwrap(), seed + 5);
        // index_add and scatter_add appear as the gradients of index_select
        // and gather; differentiate them again.
        let twice = move |x: Tracer| {
            let (i, g) = (idx.clone(), gi.clone());
            let a = grad(move |x: Tracer| x.index_select(&i, 1)?.sqr()?.sum_all());
            let b = grad(move |x: Tracer| x.gather(&g, -1)?.sqr()?.sum_all());
            candle_func::Function::apply(&a, (x.clone(),))?.mul(&candle_func::Function::apply(&b, (x,))?)
        };
        fd1("index_add / scatter_add", twice, &x, seed);
    }
}

/// ReLU's gradient differentiated again: with respect to the cotangent it
/// masks, the mask `[x > 0]`; with respect to `x`, zero (piecewise
/// constant), through `grad(grad)`.
#[test]
fn relu_gradient_differentiated_again() {
    let x = Tensor::new(&[-1.5f64, -0.2, 0.3, 2.0], &candle_core::Device::Cpu).unwrap();
    let c = Tensor::new(&[1.0f64, 2.0, 3.0, 4.0], &candle_core::Device::Cpu).unwrap();
    let inner = |x: Tracer, c: Tracer| x.relu()?.mul(&c)?.sum_all();
    // d/dc sum(grad_x) = [x > 0]
    let by_c = grad(|c: Tracer, x: Tracer| {
        use candle_func::Function;
        grad(inner).apply((x, c))?.sum_all()
    })
    .call((&c, &x))
    .unwrap();
    assert_eq!(by_c.to_vec1::<f64>().unwrap(), vec![0., 0., 1., 1.]);
    // d/dx sum(grad_x) = 0
    let by_x = grad(|x: Tracer, c: Tracer| {
        use candle_func::Function;
        grad(inner).apply((x, c))?.sum_all()
    })
    .call((&x, &c))
    .unwrap();
    assert_eq!(by_x.to_vec1::<f64>().unwrap(), vec![0.; 4]);
}

/// GELU's gradient primitive differentiated again, in both operands,
/// against finite differences (`grad(grad)` and the Hessian), in f64 and
/// in f32 (the CPU's one-pass kernels).
#[test]
fn gelu_gradient_differentiated_again() {
    let x = f64t(&[3, 5], 40).affine(3.0, 0.0).unwrap();
    let c = f64t(&[3, 5], 41);
    fd2(
        "gelu grad",
        |x: Tracer, c: Tracer| {
            use candle_func::Function;
            grad(|x: Tracer, c: Tracer| x.gelu()?.mul(&c)?.sum_all()).apply((x, c))
        },
        &x,
        &c,
        42,
    );
    for dt in [DType::F64, DType::F32] {
        let x = x.to_dtype(dt).unwrap();
        let h = jit(candle_func::hessian(|x: Tracer| x.gelu()?.sum_all()))
            .call(x.flatten_all().unwrap())
            .unwrap();
        // diagonal: gelu''(x) = φ(x) (2 - x^2)
        let v = x
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let hd = h.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        for (i, &x) in v.iter().enumerate() {
            let want = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt() * (2.0 - x * x);
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-6 };
            assert!(
                (hd[i][i] - want).abs() <= tol,
                "{dt:?} gelu''({x}) = {} vs {want}",
                hd[i][i]
            );
        }
    }
}
