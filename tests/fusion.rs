//! Epilogue fusion: a convolution or matrix product followed by a bias add
//! and a ReLU runs as one `fused` node, with the numbers of the unfused ops
//! (candle's), where fusing is allowed, and not where an intermediate is
//! read twice; gradients and vmaps of models with fused layers agree.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::{grad, jit, make_graph, vmap, Schedule, Tracer};
use common::{assert_close, rand};

fn count(g: &candle_func::Graph, what: &str) -> usize {
    g.nodes().filter(|n| n.name().starts_with(what)).count()
}

fn conv_layer(x: Tracer, w: Tracer, b: Tracer) -> candle_func::Result<Tracer> {
    x.conv2d(&w, 1, 1, 1, 1)?.add(&b.reshape(((), 1, 1))?)?.relu()
}

fn linear_layer(x: Tracer, w: Tracer, b: Tracer) -> candle_func::Result<Tracer> {
    x.matmul(&w.t()?)?.add(&b)
}

#[test]
fn conv_bias_relu_is_one_node_with_candles_numbers() {
    let (x, w, b) = (rand(&[3, 8, 9, 9], 1), rand(&[5, 8, 3, 3], 2), rand(&[5], 3));
    let g = make_graph(&jit(conv_layer), (&x, &w, &b)).unwrap();
    assert_eq!(count(&g, "fused[conv2d"), 1, "{g}");
    assert_eq!(count(&g, "relu") + count(&g, "add"), 0, "{g}");
    let want = x.conv2d(&w, 1, 1, 1, 1).unwrap();
    let want = want
        .broadcast_add(&b.reshape((5, 1, 1)).unwrap())
        .unwrap()
        .relu()
        .unwrap();
    assert_close(
        &jit(conv_layer).call((&x, &w, &b)).unwrap(),
        &want,
        1e-5,
        "conv+bias+relu",
    );
}

#[test]
fn linear_and_relu_alone_fuse_and_keep_nan() {
    let (mut x, w, b) = (rand(&[6, 7], 4), rand(&[4, 7], 5), rand(&[4], 6));
    // a NaN input row: NaN through the product, the bias and the ReLU
    let nan = Tensor::full(f32::NAN, (1, 7), &Device::Cpu).unwrap();
    x = Tensor::cat(&[&x.narrow(0, 0, 5).unwrap(), &nan], 0).unwrap();
    let f = jit(|x: Tracer, w: Tracer, b: Tracer| linear_layer(x, w, b));
    let g = make_graph(&f, (&x, &w, &b)).unwrap();
    assert_eq!(count(&g, "fused[matmul+bias]"), 1, "{g}");
    let got = f.call((&x, &w, &b)).unwrap();
    let want = x.matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
    let head = |t: &Tensor| t.narrow(0, 0, 5).unwrap();
    assert_close(&head(&got), &head(&want), 1e-5, "linear");
    let last: Vec<f32> = got.get(5).unwrap().to_vec1().unwrap();
    assert!(last.iter().all(|v| v.is_nan()), "{last:?}");
    let relu_only = jit(|x: Tracer, w: Tracer| x.matmul(&w.t()?)?.relu());
    let g = make_graph(&relu_only, (&x, &w)).unwrap();
    assert_eq!(count(&g, "fused[matmul+relu]"), 1, "{g}");
    let got: Vec<Vec<f32>> = relu_only.call((&x, &w)).unwrap().to_vec2().unwrap();
    assert!(got[5].iter().all(|v| v.is_nan()), "relu keeps NaN: {:?}", got[5]);
    let want: Vec<Vec<f32>> = x.matmul(&w.t().unwrap()).unwrap().relu().unwrap().to_vec2().unwrap();
    for (g, w) in got.iter().zip(&want).take(5) {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}

#[test]
fn an_intermediate_read_twice_or_returned_is_not_fused() {
    let (x, w, b) = (rand(&[3, 8, 9, 9], 7), rand(&[5, 8, 3, 3], 8), rand(&[5], 9));
    // the product also returned: nothing fused
    let both = jit(|x: Tracer, w: Tracer, b: Tracer| {
        let y = x.conv2d(&w, 1, 1, 1, 1)?;
        Ok((y.clone(), y.add(&b.reshape(((), 1, 1))?)?.relu()?))
    });
    let g = make_graph(&both, (&x, &w, &b)).unwrap();
    assert_eq!(count(&g, "fused"), 0, "{g}");
    // the sum read twice: the product and the add fuse, the ReLU stays
    let twice = jit(|x: Tracer, w: Tracer, b: Tracer| {
        let s = x.conv2d(&w, 1, 1, 1, 1)?.add(&b.reshape(((), 1, 1))?)?;
        s.relu()?.add(&s)
    });
    let g = make_graph(&twice, (&x, &w, &b)).unwrap();
    assert_eq!(
        count(&g, "fused[conv2d[k=[3, 3],s=[1, 1],p=[1, 1],d=[1, 1]]+bias]"),
        1,
        "{g}"
    );
    let s = x
        .conv2d(&w, 1, 1, 1, 1)
        .unwrap()
        .broadcast_add(&b.reshape((5, 1, 1)).unwrap())
        .unwrap();
    let want = (s.relu().unwrap() + &s).unwrap();
    assert_close(&twice.call((&x, &w, &b)).unwrap(), &want, 1e-5, "read twice");
}

#[test]
fn an_add_that_grows_the_product_is_not_an_epilogue() {
    let (x, w, z) = (rand(&[6, 7], 10), rand(&[4, 7], 11), rand(&[2, 6, 4], 12));
    let f = jit(|x: Tracer, w: Tracer, z: Tracer| x.matmul(&w.t()?)?.add(&z)?.relu());
    let g = make_graph(&f, (&x, &w, &z)).unwrap();
    assert_eq!(count(&g, "fused"), 0, "{g}");
    let want = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&z)
        .unwrap()
        .relu()
        .unwrap();
    assert_close(&f.call((&x, &w, &z)).unwrap(), &want, 1e-5, "growing add");
}

#[test]
fn other_dtypes_run_the_unfused_ops() {
    // f16 has no in-place CPU kernel: the fused node runs as add and relu
    let (x, w, b) = (rand(&[6, 7], 13), rand(&[4, 7], 14), rand(&[4], 15));
    let h = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
    let f = jit(|x: Tracer, w: Tracer, b: Tracer| linear_layer(x, w, b)?.relu());
    let g = make_graph(&f, (&h(&x), &h(&w), &h(&b))).unwrap();
    assert_eq!(count(&g, "fused[matmul+bias+relu]"), 1, "{g}");
    let got = f.call((&h(&x), &h(&w), &h(&b))).unwrap().to_dtype(DType::F32).unwrap();
    let want = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap()
        .relu()
        .unwrap();
    assert_close(&got, &want, 1e-2, "f16");
}

#[test]
fn gradients_and_vmaps_of_fused_layers_agree_with_the_unfused_numbers() {
    let (x, w, b) = (rand(&[3, 8, 9, 9], 16), rand(&[5, 8, 3, 3], 17), rand(&[5], 18));
    let loss = |w: Tracer, b: Tracer, x: Tracer| conv_layer(x, w, b)?.sqr()?.sum_all();
    // The gradient graph fuses its forward layer and is checked against
    // candle's own autodiff of the unfused ops.
    let g = make_graph(&grad(loss).argnums::<0, 1>(), (&w, &b, &x)).unwrap();
    assert!(count(&g, "fused") >= 1, "{g}");
    let (got_w, got_b) = grad(loss).argnums::<0, 1>().call((&w, &b, &x)).unwrap();
    let (vw, vb) = (
        candle_core::Var::from_tensor(&w).unwrap(),
        candle_core::Var::from_tensor(&b).unwrap(),
    );
    let y = x.conv2d(&vw, 1, 1, 1, 1).unwrap();
    let y = y
        .broadcast_add(&vb.reshape((5, 1, 1)).unwrap())
        .unwrap()
        .relu()
        .unwrap();
    let gs = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_close(&got_w, gs.get(&vw).unwrap(), 1e-4, "dw");
    assert_close(&got_b, gs.get(&vb).unwrap(), 1e-4, "db");
    // an ensemble over stacked weights, batched and per example
    let (ws, bs) = (rand(&[4, 5, 8, 3, 3], 19), rand(&[4, 5], 20));
    for s in [Schedule::Batched, Schedule::PerExample] {
        let f = vmap(|w: Tracer, b: Tracer, x: Tracer| conv_layer(x, w, b))
            .in_dims([Some(0), Some(0), None])
            .schedule(s);
        if s == Schedule::PerExample {
            // fused inside the map's body
            let g = make_graph(&f, (&ws, &bs, &x)).unwrap().to_string();
            assert!(g.contains("map[") && g.contains("fused[conv2d"), "{g}");
        }
        let got = f.call((&ws, &bs, &x)).unwrap();
        for m in 0..4 {
            let want = jit(conv_layer)
                .call((&x, &ws.get(m).unwrap(), &bs.get(m).unwrap()))
                .unwrap();
            assert_close(&got.get(m).unwrap(), &want, 1e-4, &format!("{s:?} model {m}"));
        }
    }
}

/// A batched convolution folds the batch into `N` and reshapes back before
/// the bias add (`(B N) C H W -> B N C H W`): the reshape joins the fused
/// node, and per-sample gradients keep their numbers.
#[test]
fn a_reshape_between_product_and_epilogue_is_fused() {
    let (xs, w, b) = (rand(&[4, 1, 8, 9, 9], 24), rand(&[5, 8, 3, 3], 25), rand(&[5], 26));
    let f = vmap(|x: Tracer, w: Tracer, b: Tracer| conv_layer(x, w, b)).in_dims([Some(0), None, None]);
    let g = make_graph(&f, (&xs, &w, &b)).unwrap();
    assert_eq!(
        count(&g, "fused[conv2d[k=[3, 3],s=[1, 1],p=[1, 1],d=[1, 1]]+reshape"),
        1,
        "{g}"
    );
    assert_eq!(count(&g, "relu") + count(&g, "add"), 0, "{g}");
    let got = f.call((&xs, &w, &b)).unwrap();
    for i in 0..4 {
        let want = jit(conv_layer).call((&xs.get(i).unwrap(), &w, &b)).unwrap();
        assert_close(&got.get(i).unwrap(), &want, 1e-5, &format!("example {i}"));
    }
    let loss = |w: Tracer, b: Tracer, x: Tracer| conv_layer(x, w, b)?.sqr()?.sum_all();
    let per = vmap(grad(loss).argnums::<0, 1>()).in_dims([None, None, Some(0)]);
    let g = make_graph(&per, (&w, &b, &xs)).unwrap();
    assert!(count(&g, "fused[conv2d") >= 1, "{g}");
    let (gw, gb) = per.call((&w, &b, &xs)).unwrap();
    for i in 0..4 {
        let (ww, wb) = grad(loss)
            .argnums::<0, 1>()
            .call((&w, &b, &xs.get(i).unwrap()))
            .unwrap();
        assert_close(&gw.get(i).unwrap(), &ww, 1e-4, &format!("dw {i}"));
        assert_close(&gb.get(i).unwrap(), &wb, 1e-4, &format!("db {i}"));
    }
}

/// An ensemble of two linear layers over one shared batch: the batching
/// rule computes the first as `(B out) in @ in N`, viewed as `B N out`
/// through a reshape and a transpose. The transpose moves past the bias
/// and the ReLU (which join the product in its own layout), the second
/// product reads both its operands as they are stored and returns its
/// result transposed, with the bias fused through the transpose (the
/// torch.func ensembling tutorial's layers); the loop's numbers, NaN kept.
#[test]
fn products_of_a_shared_batch_ensemble_take_their_epilogues_in_their_own_layout() {
    let (m, n, fin, hid, fout) = (6, 5, 12, 7, 3);
    let (w1, b1) = (rand(&[m, hid, fin], 40), rand(&[m, hid], 41));
    let (w2, b2) = (rand(&[m, fout, hid], 43), rand(&[m, fout], 44));
    let mut xv = rand(&[n, fin], 42).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    xv[3] = f32::NAN;
    let x = Tensor::from_vec(xv, (n, fin), &Device::Cpu).unwrap();
    let net = |w1: Tracer, b1: Tracer, w2: Tracer, b2: Tracer, x: Tracer| {
        linear_layer(linear_layer(x, w1, b1)?.relu()?, w2, b2)
    };
    let f = vmap(|p: (Tracer, Tracer, Tracer, Tracer), x: Tracer| net(p.0, p.1, p.2, p.3, x))
        .in_dims([Some(0), None])
        .schedule(Schedule::Batched);
    let params = (&w1, &b1, &w2, &b2);
    let g = make_graph(&f, (params, &x)).unwrap();
    assert_eq!(count(&g, "fused[matmul+reshape"), 1, "{g}");
    assert_eq!(count(&g, "fused[matmul+permute"), 1, "{g}");
    assert_eq!(count(&g, "relu") + count(&g, "add"), 0, "{g}");
    let got = f.call((params, &x)).unwrap();
    assert_eq!(got.dims(), &[m, n, fout]);
    let one = |p: (Tracer, Tracer, Tracer, Tracer), x: Tracer| net(p.0, p.1, p.2, p.3, x);
    for i in 0..m {
        let at = |t: &Tensor| t.get(i).unwrap();
        let p = (&at(&w1), &at(&b1), &at(&w2), &at(&b2));
        let want = jit(one).call((p, &x)).unwrap();
        let a = got.get(i).unwrap();
        let nan = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|v| v.is_nan()).collect::<Vec<_>>()
        };
        assert_eq!(nan(&a), nan(&want), "NaN where the loop has it, model {i}");
        let zero_nan = |t: &Tensor| t.ne(t).unwrap().where_cond(&t.zeros_like().unwrap(), t).unwrap();
        assert_close(&zero_nan(&a), &zero_nan(&want), 1e-5, &format!("model {i}"));
    }
}

/// `vjp` differentiates the unfused graph and fuses its two halves after:
/// a linear + ReLU and a conv + bias + ReLU layer, plainly and as a
/// per-example map, give the gradients `grad` gives.
#[test]
fn vjp_of_fusible_layers() {
    let (x, w, b) = (rand(&[3, 8, 9, 9], 21), rand(&[5, 8, 3, 3], 22), rand(&[5], 23));
    let (xl, wl) = (rand(&[6, 7], 24), rand(&[4, 7], 25));
    let lin = |x: Tracer, w: Tracer| x.matmul(&w.t()?)?.relu();
    let (y, pullback) = candle_func::vjp(&lin, (&xl, &wl)).unwrap();
    let ones = y.ones_like().unwrap();
    let (dx, dw) = pullback.call(&ones).unwrap();
    let sum = |x: Tracer, w: Tracer| lin(x, w)?.sum_all();
    let (gx, gw) = grad(sum).argnums::<0, 1>().call((&xl, &wl)).unwrap();
    assert_close(&dx, &gx, 1e-5, "linear dx");
    assert_close(&dw, &gw, 1e-5, "linear dw");
    for s in [Schedule::Batched, Schedule::PerExample] {
        let conv = vmap(|x: Tracer, w: Tracer, b: Tracer| conv_layer(x.unsqueeze(0)?, w, b))
            .in_dims([Some(0), None, None])
            .schedule(s);
        let (y, pullback) = candle_func::vjp(&conv, (&x, &w, &b)).unwrap();
        let (_, dw, db) = pullback.call(&y.ones_like().unwrap()).unwrap();
        let sum = |w: Tracer, b: Tracer, x: Tracer| conv_layer(x, w, b)?.sum_all();
        let (gw, gb) = grad(sum).argnums::<0, 1>().call((&w, &b, &x)).unwrap();
        assert_close(&dw, &gw, 1e-4, &format!("{s:?} conv dw"));
        assert_close(&db, &gb, 1e-4, &format!("{s:?} conv db"));
    }
}
