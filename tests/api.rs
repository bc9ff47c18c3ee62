//! The vmap API: trees of arguments and results, in_dims/out_dims, chunking,
//! nesting and captured outer values, the graph cache, dead-code removal,
//! liveness, and the generic loop fallback.

mod common;

use candle_core::{DType, Tensor};
use candle_func::{custom_op, jit, make_graph, vmap, Error, Function, Tracer};
use common::*;
use std::collections::{BTreeMap, HashMap};

#[test]
fn tuple_vec_and_map_arguments_and_results() {
    let xs = rand(&[4, 3], 1);
    let ys = rand(&[4, 3], 2);
    let w = rand(&[3], 3);
    let mut params = BTreeMap::new();
    params.insert("a".to_string(), rand(&[4, 3], 4));
    params.insert("b".to_string(), rand(&[4, 3], 5));
    // tuple in, tuple out; a Vec argument; a map argument, a map result
    let f = |(x, y): (Tracer, Tracer), v: Vec<Tracer>, p: BTreeMap<String, Tracer>| -> candle_func::Result<_> {
        let s = x.add(&y)?.mul(&v[0])?;
        let mut out = BTreeMap::new();
        out.insert("sum".to_string(), p["a"].add(&p["b"])?);
        Ok((s.sum(0)?, vec![s.clone(), x.clone()], out))
    };
    let (total, list, map) = vmap(f)
        .in_dims([Some(0), None, Some(0)])
        .call(((&xs, &ys), vec![w.clone()], &params))
        .unwrap();
    let s = (&xs + &ys).unwrap().broadcast_mul(&w).unwrap();
    assert_close(&total, &s.sum(1).unwrap(), 1e-6, "tuple result");
    assert_close(&list[0], &s, 1e-6, "vec result");
    assert_close(&list[1], &xs, 0.0, "passthrough");
    assert_close(&map["sum"], &(&params["a"] + &params["b"]).unwrap(), 1e-6, "map result");

    // HashMap in and out
    let hp: HashMap<String, Tensor> = params.clone().into_iter().collect();
    let out = vmap(
        |p: HashMap<String, Tracer>| -> candle_func::Result<HashMap<String, Tracer>> {
            Ok(p.iter().map(|(k, v)| (k.clone(), v.exp().unwrap())).collect())
        },
    )
    .call(&hp)
    .unwrap();
    assert_close(&out["b"], &params["b"].exp().unwrap(), 1e-6, "hashmap");
}

#[test]
fn in_dims_and_out_dims() {
    let x = rand(&[3, 5, 2], 1); // batch on axis 1
    let f = |x: Tracer| x.sqr()?.sum(-1);
    let want = x.sqr().unwrap().sum(2).unwrap().t().unwrap(); // [5, 3]
    let got = vmap(f).in_dims(1).call(&x).unwrap();
    assert_close(&got, &want, 1e-6, "in_dims 1");
    let got = vmap(f).in_dims(-2).call(&x).unwrap();
    assert_close(&got, &want, 1e-6, "in_dims -2");
    let got = vmap(f).in_dims(1).out_dims(1).call(&x).unwrap();
    assert_close(&got, &want.t().unwrap(), 1e-6, "out_dims 1");
    let got = vmap(f).in_dims(1).out_dims(-1).call(&x).unwrap();
    assert_close(&got, &want.t().unwrap(), 1e-6, "out_dims -1");
    // an output that does not depend on the batch may be unbatched...
    let w = rand(&[2], 9);
    let g = vmap(|x: Tracer, w: Tracer| Ok((x.sum_all()?, w.exp()?)))
        .in_dims([Some(0), None])
        .out_dims([Some(0), None]);
    let (s, e) = g.call((&x, &w)).unwrap();
    assert_eq!(s.dims(), &[3]);
    assert_close(&e, &w.exp().unwrap(), 1e-6, "unbatched output");
    // ...and is broadcast when a batch axis is asked for
    let g = vmap(|x: Tracer, w: Tracer| Ok((x.sum_all()?, w.exp()?))).in_dims([Some(0), None]);
    let (_, e) = g.call((&x, &w)).unwrap();
    assert_eq!(e.dims(), &[3, 2]);
}

#[test]
fn chunking_matches_the_whole_batch() {
    let x = rand(&[10, 4], 1);
    let w = rand(&[4, 3], 2);
    let f = |x: Tracer| x.unsqueeze(0)?.matmul(&w)?.tanh()?.squeeze(0);
    let whole = vmap(f).call(&x).unwrap();
    for k in [1, 3, 4, 10, 64] {
        let chunked = vmap(f).chunk_size(k).call(&x).unwrap();
        assert_close(&chunked, &whole, 1e-6, &format!("chunk {k}"));
    }
    let g = make_graph(&vmap(f).chunk_size(3), &x).unwrap().to_string();
    assert!(g.contains("concat"), "{g}");
    // out_dims != 0 with chunks
    let chunked = vmap(f).chunk_size(3).out_dims(1).call(&x).unwrap();
    assert_close(&chunked, &whole.t().unwrap(), 1e-6, "chunk with out_dims 1");
}

#[test]
fn nested_vmap_captures_outer_values() {
    // outer over x, inner over the rows of m (shared), reading x from the
    // enclosing trace: out[i, j] = x[i] * m[j]
    let x = rand(&[3, 2], 1);
    let m = rand(&[4, 2], 2);
    let f = |x: Tracer, m: Tracer| vmap(|row: Tracer| x.mul(&row)).apply((m,));
    let got = vmap(f).in_dims([Some(0), None]).call((&x, &m)).unwrap();
    assert_eq!(got.dims(), &[3, 4, 2]);
    let want = x.unsqueeze(1).unwrap().broadcast_mul(&m.unsqueeze(0).unwrap()).unwrap();
    assert_close(&got, &want, 1e-6, "captured outer tracer");
}

#[test]
fn graphs_are_cached_per_signature() {
    let f = vmap(|x: Tracer| x.exp());
    f.call(rand(&[4, 3], 1)).unwrap();
    f.call(rand(&[4, 3], 2)).unwrap();
    assert_eq!(f.traced_signatures(), 1);
    f.call(rand(&[5, 3], 3)).unwrap();
    f.call(rand(&[4, 3], 3).to_dtype(DType::F64).unwrap()).unwrap();
    assert_eq!(f.traced_signatures(), 3);
    // the cache is shared safely between threads
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || f.call(rand(&[4, 3], i)).unwrap())
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(f.traced_signatures(), 3);
}

#[test]
fn dead_code_is_removed_and_values_are_freed() {
    let x = rand(&[4, 3], 1);
    let g = make_graph(
        &jit(|x: Tracer| {
            let _unused = x.exp()?.log()?;
            x.relu()
        }),
        &x,
    )
    .unwrap();
    assert_eq!(g.equation_count(), 1, "{g}");
    assert!(!g.to_string().contains("exp"));
    // a chain of 20 ops holds at most input, current and next value
    let big = rand(&[256, 256], 2);
    let chain = jit(|x: Tracer| {
        let mut h = x.clone();
        for _ in 0..20 {
            h = h.affine(0.5, 0.1)?;
        }
        Ok(h)
    });
    let g = make_graph(&chain, &big).unwrap();
    let (out, stats) = g.run_with_stats(std::slice::from_ref(&big)).unwrap();
    assert_close(&out[0], &chain.call(&big).unwrap(), 0.0, "stats run");
    assert!(stats.peak_values <= 3, "{stats:?}");
    assert!(stats.peak_bytes <= 3 * 256 * 256 * 4, "{stats:?}");
}

#[test]
fn graph_prints_like_a_jaxpr() {
    let x = rand(&[2, 3], 1);
    let g = make_graph(&vmap(|x: Tracer| x.sum(0)), &x).unwrap().to_string();
    assert!(g.starts_with("{ lambda %0:f32[2,3] ."), "{g}");
    assert!(g.contains("sum[axes=[1]]"), "{g}");
    assert!(g.trim_end().ends_with("in (%1) }"), "{g}");
}

fn custom_square(x: &Tracer) -> candle_func::Result<Tracer> {
    custom_op("square", &[x], x.tensor_type().clone(), |xs| xs[0].sqr())
}

#[test]
fn primitives_without_a_rule_loop_and_warn_once() {
    let x = rand(&[5, 3], 1);
    let f = vmap(|x: Tracer| custom_square(&x)?.sum(0));
    let (got, warnings) = candle_func::settings::capture_warnings(|| f.call(&x));
    let got = got.unwrap();
    assert_close(&got, &x.sqr().unwrap().sum(1).unwrap(), 1e-6, "custom op under vmap");
    assert!(warnings.iter().any(|w| w.key == "loop-custom"), "{warnings:?}");
    // the second call reuses its traced graph: nothing new to warn about
    let (_, again) = candle_func::settings::capture_warnings(|| f.call(&x));
    assert!(again.is_empty(), "{again:?}");
    let g = make_graph(&f, &x).unwrap();
    assert_eq!(
        g.to_string().matches("map[").count(),
        1,
        "one loop node, not B copies: {g}"
    );
    let strict = vmap(|x: Tracer| custom_square(&x)).strict(true);
    match strict.call(&x) {
        Err(Error::Unsupported { op, transform, .. }) => assert_eq!((op.as_str(), transform), ("custom", "vmap")),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // nested: a loop under another vmap
    let xs = rand(&[2, 5, 3], 2);
    let nested = vmap(vmap(|x: Tracer| custom_square(&x)));
    assert_close(&nested.call(&xs).unwrap(), &xs.sqr().unwrap(), 1e-6, "nested loop");
}

#[test]
fn jit_runs_the_traced_function() {
    let x = rand(&[3, 4], 1);
    let f = jit(|x: Tracer| x.softmax(1)?.log()?.mul(2.0f64));
    let want = (candle_nn::ops::log_softmax(&x, 1).unwrap() * 2.0).unwrap();
    assert_close(&f.call(&x).unwrap(), &want, 1e-5, "jit");
}

#[test]
fn graphs_are_simplified() {
    let w = rand(&[4, 1, 3, 3], 1);
    let xs = rand(&[5, 1, 6, 6], 2);
    let loss = |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv2d(&w, 0, 1, 1, 1)?.sqr()?.sum_all();
    let g = make_graph(&vmap(candle_func::grad(loss)).in_dims([None, Some(0)]), (&w, &xs)).unwrap();
    let name = |v: usize| g.node(v).unwrap().name();
    let is = |v: usize, prefix: &str| name(v).starts_with(prefix);
    for n in g.nodes() {
        let v = n.index();
        if is(v, "reshape") {
            assert!(!is(n.args()[0], "reshape"), "reshape of a reshape: {g}");
        }
        if is(v, "permute") {
            assert!(!is(n.args()[0], "permute"), "permute of a permute: {g}");
        }
        if is(v, "mul") {
            fn one(g: &candle_func::Graph, a: usize) -> bool {
                let n = g.node(a).unwrap();
                let p = n.name();
                match p.strip_prefix("scalar[") {
                    Some(x) => x.trim_end_matches(']').parse::<f64>() == Ok(1.0),
                    None if p.starts_with("reshape") || p.starts_with("broadcast") => one(g, n.args()[0]),
                    None => false,
                }
            }
            assert!(!n.args().iter().any(|&a| one(&g, a)), "multiplication by one: {g}");
        }
    }
    // and the simplified graph computes the same gradients
    let want = vmap(candle_func::grad(loss))
        .in_dims([None, Some(0)])
        .conv_route(candle_func::ConvRoute::Loop);
    let got = vmap(candle_func::grad(loss)).in_dims([None, Some(0)]);
    assert_close(
        &got.call((&w, &xs)).unwrap(),
        &want.call((&w, &xs)).unwrap(),
        1e-5,
        "simplified",
    );
}

/// `argnums` over three and four arguments give each argument's gradient
/// as `argnum` alone does.
#[test]
fn argnums_over_three_and_four_arguments() {
    let (a, b, c, d) = (
        common::rand(&[3], 1),
        common::rand(&[3], 2),
        common::rand(&[2, 3], 3),
        common::rand(&[3], 4),
    );
    let f = |a: Tracer, b: Tracer, c: Tracer, d: Tracer| a.mul(&b)?.tanh()?.add(&c)?.mul(&d.exp()?)?.sum_all();
    let (ga, gb, gc, gd) = candle_func::grad(f)
        .argnums4::<0, 1, 2, 3>()
        .call((&a, &b, &c, &d))
        .unwrap();
    let one = |i: usize| match i {
        0 => candle_func::grad(f).argnum::<0>().call((&a, &b, &c, &d)).unwrap(),
        1 => candle_func::grad(f).argnum::<1>().call((&a, &b, &c, &d)).unwrap(),
        2 => candle_func::grad(f).argnum::<2>().call((&a, &b, &c, &d)).unwrap(),
        _ => candle_func::grad(f).argnum::<3>().call((&a, &b, &c, &d)).unwrap(),
    };
    for (i, g) in [ga, gb, gc, gd].iter().enumerate() {
        common::assert_close(g, &one(i), 1e-6, &format!("argument {i}"));
    }
    let (g2, g0, g3) = candle_func::grad(f)
        .argnums3::<2, 0, 3>()
        .call((&a, &b, &c, &d))
        .unwrap();
    common::assert_close(&g2, &one(2), 1e-6, "argnums3 first");
    common::assert_close(&g0, &one(0), 1e-6, "argnums3 second");
    common::assert_close(&g3, &one(3), 1e-6, "argnums3 third");
}

/// `in_dims` and `out_dims` as prefix trees (JAX's and torch.func's rule):
/// an axis per leaf of a map or tuple, an axis for a whole subtree, and an
/// error naming the argument and the structure on a mismatch.
#[test]
fn in_dims_and_out_dims_as_prefix_trees() {
    use candle_func::tree::DimTree;
    let xs = rand(&[4, 3], 20);
    let mut p = BTreeMap::new();
    p.insert("w".to_string(), rand(&[3], 21)); // shared
    p.insert("b".to_string(), rand(&[3, 4], 22)); // one column per example
    let f = |p: BTreeMap<String, Tracer>, (x, s): (Tracer, Tracer)| -> candle_func::Result<_> {
        let y = x.mul(&p["w"])?.add(&p["b"])?.mul(&s)?;
        Ok((y.clone(), (y.sum_all()?, p["w"].clone())))
    };
    let scale = rand(&[3], 23); // shared, inside the batched tuple
    let dims = [
        DimTree::map([("b", Some(1)), ("w", None)]),
        DimTree::seq([Some(0), None]),
    ];
    let out_dims = [DimTree::from(1), DimTree::seq([Some(0), None])];
    let (y, (total, w)) = vmap(f)
        .in_dims(dims.clone())
        .out_dims(out_dims)
        .call((&p, (&xs, &scale)))
        .unwrap();
    for i in 0..4 {
        let x = xs.get(i).unwrap();
        let b = p["b"].narrow(1, i, 1).unwrap().squeeze(1).unwrap();
        let want = ((x * &p["w"]).unwrap() + b).unwrap().mul(&scale).unwrap();
        assert_close(
            &y.narrow(1, i, 1).unwrap().squeeze(1).unwrap(),
            &want,
            1e-6,
            "y, batch axis 1",
        );
        assert_close(&total.get(i).unwrap(), &want.sum_all().unwrap(), 1e-5, "total");
    }
    assert_close(&w, &p["w"], 0.0, "an unbatched output leaf");
    // a bare axis covers the whole subtree: the same as per leaf
    let whole = vmap(f)
        .in_dims([DimTree::map([("b", Some(1)), ("w", None)]), DimTree::from(0)])
        .call((&p, (&xs, &rand(&[4, 3], 24))));
    assert!(whole.is_ok(), "{:?}", whole.map(|_| ()));
    // mismatches name the argument and the structure
    let bad = [
        (DimTree::map([("b", Some(1))]), "keys"),
        (DimTree::seq([Some(0), None]), "a map"),
        (DimTree::map([("b", Some(1)), ("w", Some(5))]), "`w`"),
    ];
    for (d, says) in bad {
        let r = vmap(f).in_dims([d, DimTree::from(0)]).call((&p, (&xs, &scale)));
        match r {
            Err(Error::InDims { arg: 0, msg }) => assert!(msg.contains(says), "{msg}"),
            other => panic!("expected an in_dims error, got {:?}", other.map(|_| ())),
        }
    }
    let r = vmap(f)
        .in_dims([DimTree::from(0), DimTree::seq([Some(0)])])
        .call((&p, (&xs, &scale)));
    assert!(matches!(r, Err(Error::InDims { arg: 1, .. })), "{:?}", r.map(|_| ()));
    let r = vmap(f)
        .in_dims(dims)
        .out_dims([DimTree::from(0), DimTree::seq([Some(0)])])
        .call((&p, (&xs, &scale)));
    assert!(
        matches!(r, Err(Error::OutDims { output: 1, .. })),
        "{:?}",
        r.map(|_| ())
    );
}

/// A value computed twice is computed once (a transform re-emits the
/// forward pass; JVP and VJP rules take the same `exp`), but two random
/// draws stay two samples and two calls of a user's kernel stay two calls.
#[test]
fn common_subexpressions_are_computed_once_but_draws_are_not_merged() {
    let x = rand(&[4, 3], 30);
    let twice = |x: Tracer| x.exp()?.sum(0)?.add(&x.exp()?.sum(0)?);
    let g = make_graph(&twice, &x).unwrap();
    assert_eq!(g.nodes().filter(|n| n.name() == "exp").count(), 1, "{g}");
    let want = (x.exp().unwrap().sum(0).unwrap() * 2.0).unwrap();
    assert_close(&jit(twice).call(&x).unwrap(), &want, 1e-6, "value");
    let draws = |x: Tracer| Ok((x.rand_uniform_like()?, x.rand_uniform_like()?));
    let g = make_graph(&draws, &x).unwrap();
    assert_eq!(g.nodes().filter(|n| n.name().starts_with("uniform")).count(), 2, "{g}");
    let (a, b) = jit(draws).call(&x).unwrap();
    assert!(max_diff(&a, &b) > 0.0, "two draws, two samples");
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = {
        let calls = calls.clone();
        move |x: Tracer| {
            let ty = x.tensor_type().clone();
            let k = |c: std::sync::Arc<std::sync::atomic::AtomicUsize>| {
                move |t: &[Tensor]| {
                    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    t[0].exp()
                }
            };
            let a = custom_op("counted", &[&x], ty.clone(), k(calls.clone()))?;
            let b = custom_op("counted", &[&x], ty, k(calls.clone()))?;
            a.add(&b)
        }
    };
    jit(counted).call(&x).unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 2);
}
