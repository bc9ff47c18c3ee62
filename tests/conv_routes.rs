//! The convolution batching rule: every route agrees with the per-example
//! loop and with candle's own unbatched convolution, over stride, padding,
//! dilation, groups, conv1d/2d/3d, and every combination of batched input,
//! weight and bias.

mod common;

use candle_core::Tensor;
use candle_func::{vmap, ConvRoute, Tracer};
use common::*;
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
struct Case {
    nd: usize,
    groups: usize,
    cin_g: usize,
    cout_g: usize,
    size: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dil: usize,
    n: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..4,
        1usize..3,
        1usize..3,
        1usize..3,
        3usize..7,
        1usize..4,
        1usize..3,
        0usize..2,
        1usize..3,
        1usize..3,
    )
        .prop_map(|(nd, groups, cin_g, cout_g, size, k, stride, pad, dil, n)| Case {
            nd,
            groups,
            cin_g,
            cout_g,
            size,
            k,
            stride,
            pad,
            dil,
            n,
        })
        .prop_filter("window fits", |c| c.size + 2 * c.pad > c.dil * (c.k - 1))
}

/// candle's own convolution of one example (1D/2D), or a direct conv3d by
/// explicit loops (candle has none).
fn reference(c: &Case, x: &Tensor, w: &Tensor, bias: &Tensor) -> Tensor {
    // candle's convolutions need contiguous operands to be right.
    let (x, w) = (&x.contiguous().unwrap(), &w.contiguous().unwrap());
    let y = match c.nd {
        1 => x.conv1d(w, c.pad, c.stride, c.dil, c.groups).unwrap(),
        2 => x.conv2d(w, c.pad, c.stride, c.dil, c.groups).unwrap(),
        _ => common::conv3d_direct(x, w, c.stride, c.pad, c.dil, c.groups).unwrap(),
    };
    let mut bs = vec![1, bias.dims()[0]];
    bs.extend(vec![1; c.nd]);
    y.broadcast_add(&bias.reshape(bs).unwrap()).unwrap()
}

fn conv_fn(c: Case) -> impl Fn(Tracer, Tracer, Tracer) -> candle_func::Result<Tracer> + Send + Sync + Clone {
    move |x, w, bias| {
        let y = match c.nd {
            1 => x.conv1d(&w, c.pad, c.stride, c.dil, c.groups)?,
            2 => x.conv2d(&w, c.pad, c.stride, c.dil, c.groups)?,
            _ => x.conv3d(&w, c.pad, c.stride, c.dil, c.groups)?,
        };
        let mut bs = vec![bias.dims()[0]];
        bs.extend(vec![1; c.nd]);
        y.add(&bias.reshape(bs)?)
    }
}

fn dims() -> impl Strategy<Value = [Option<isize>; 3]> {
    let x = prop_oneof![Just(None), Just(Some(0)), Just(Some(-1))];
    let w = prop_oneof![Just(None), Just(Some(0)), Just(Some(-1))];
    let b = prop_oneof![Just(None), Just(Some(0))];
    (x, w, b).prop_map(|(x, w, b)| {
        if x.is_none() && w.is_none() && b.is_none() {
            [Some(0), Some(0), b]
        } else {
            [x, w, b]
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn routes_agree_with_candle(c in case(), d in dims(), b in 1usize..4, seed in any::<u64>()) {
        let cin = c.cin_g * c.groups;
        let cout = c.cout_g * c.groups;
        let xs = [vec![c.n, cin], vec![c.size; c.nd]].concat();
        let ws = [vec![cout, c.cin_g], vec![c.k; c.nd]].concat();
        let x = batched(&xs, b, d[0], seed);
        let w = batched(&ws, b, d[1], seed + 1);
        let bias = batched(&[cout], b, d[2], seed + 2);
        let want: Vec<Tensor> = (0..b)
            .map(|i| reference(&c, &example(&x, d[0], i), &example(&w, d[1], i), &example(&bias, d[2], i)))
            .collect();
        let want = Tensor::stack(&want, 0).unwrap();
        for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
            let got = vmap(conv_fn(c)).in_dims(d).conv_route(route).call((&x, &w, &bias)).unwrap();
            assert_close(&got, &want, 1e-4, &format!("{route:?} {c:?} dims {d:?}"));
        }
    }
}

#[test]
fn unfold_route_is_one_batched_matmul() {
    // Both batched with groups: the graph holds an unfold and a matmul, no
    // per-example loop and no convolution.
    let c = Case {
        nd: 2,
        groups: 2,
        cin_g: 2,
        cout_g: 3,
        size: 6,
        k: 3,
        stride: 1,
        pad: 1,
        dil: 1,
        n: 1,
    };
    let x = rand(&[5, 1, 4, 6, 6], 1);
    let w = rand(&[5, 6, 2, 3, 3], 2);
    let bias = rand(&[6], 3);
    let f = vmap(conv_fn(c))
        .in_dims([Some(0), Some(0), None])
        .conv_route(ConvRoute::Unfold);
    let g = candle_func::make_graph(&f, (&x, &w, &bias)).unwrap().to_string();
    assert!(g.contains("unfold2d") && g.contains("matmul"), "{g}");
    assert!(!g.contains("map[") && !g.contains("conv2d"), "{g}");
    let grouped = vmap(conv_fn(c))
        .in_dims([Some(0), Some(0), None])
        .conv_route(ConvRoute::Grouped);
    let g = candle_func::make_graph(&grouped, (&x, &w, &bias)).unwrap().to_string();
    assert!(g.contains("g=10"), "grouped route folds the batch into the groups: {g}");
}

#[test]
fn every_route_lowers_conv3d_and_ungrouped_unfold_uses_rows() {
    let c = Case {
        nd: 3,
        groups: 1,
        cin_g: 2,
        cout_g: 2,
        size: 4,
        k: 2,
        stride: 1,
        pad: 0,
        dil: 1,
        n: 1,
    };
    let x = rand(&[3, 1, 2, 4, 4, 4], 1);
    let w = rand(&[3, 2, 2, 2, 2, 2], 2);
    let bias = rand(&[2], 3);
    let graph = |route| {
        let f = vmap(conv_fn(c)).in_dims([Some(0), Some(0), None]).conv_route(route);
        candle_func::make_graph(&f, (&x, &w, &bias)).unwrap().to_string()
    };
    let g = graph(ConvRoute::Unfold);
    assert!(
        g.contains("unfold_rows3d") && g.contains("matmul") && !g.contains("map["),
        "{g}"
    );
    let g = graph(ConvRoute::Grouped);
    assert!(g.contains("conv3d") && g.contains("g=3") && !g.contains("map["), "{g}");
    assert!(graph(ConvRoute::Loop).contains("map["));
}
