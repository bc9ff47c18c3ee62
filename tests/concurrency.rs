//! Work that runs at once on the CPU's threads: a map's examples (the
//! per-example schedule, the loop convolution route) in waves of the pool's
//! width, and two independent loops (the directions of a bidirectional
//! LSTM, and their gradients) side by side. Each gives the numbers of one
//! thread bit for bit, whatever the pool, and the plan bounds what the run
//! holds.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, cross_entropy, Module, Params, RecurrentConfig, Reduction};
use candle_func::{grad, make_graph, vmap, ConvRoute, Schedule, Tracer};
use common::rand;
use std::collections::BTreeMap;

/// `f` run in a rayon pool of `threads` threads (the transforms resolve
/// their width there, and the runs take that pool).
fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u32>> {
    ts.iter()
        .map(|t| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// Whether some loop of `g` is followed by one that reads nothing
/// computed from its start on: a pair the interpreter runs at once.
fn has_neighbour_loops(g: &candle_func::graph::Graph) -> bool {
    let loops: Vec<usize> = g
        .nodes()
        .filter(|n| n.name().starts_with("scan") || n.name().starts_with("map"))
        .map(|n| n.index())
        .collect();
    loops
        .windows(2)
        .any(|w| g.node(w[1]).unwrap().args().iter().all(|&a| a < w[0]))
}

/// Per-sample gradients of a two-layer bidirectional LSTM classifier: its
/// graph has the directions' loops paired, and every pool gives one
/// thread's numbers.
#[test]
fn a_bidirectional_lstms_directions_run_side_by_side_with_one_threads_numbers() {
    let map = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let cfg = RecurrentConfig {
        layers: 2,
        bidirectional: true,
        ..RecurrentConfig::default()
    };
    let rnn = nn::lstm(6, 8, cfg, vb.pp("rnn")).unwrap();
    let fc = nn::linear(8, 3, vb.pp("fc")).unwrap();
    let params: BTreeMap<String, Tensor> = rnn.params().into_iter().chain(fc.params()).collect();
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let q = Params::with(&p);
        let h_n = rnn.run(&q, &x, None)?.h_n; // [L*D, H]
        let logits = fc.forward_with(&q, &h_n.sum(0)?)?;
        cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let psg = || vmap(grad(one)).in_dims([None, Some(0), Some(0)]);
    let xs = rand(&[5, 9, 6], 1);
    let ys = Tensor::new(&[0u32, 2, 1, 1, 0], &Device::Cpu).unwrap();
    let g = make_graph(&psg(), (&params, &xs, &ys)).unwrap();
    assert!(has_neighbour_loops(&g), "the directions' loops are not paired: {g}");
    let run = || -> Vec<Tensor> { psg().call((&params, &xs, &ys)).unwrap().into_values().collect() };
    let one_thread = bits(&in_pool(1, run));
    for threads in [2, 3] {
        let many = bits(&in_pool(threads, run));
        assert!(
            one_thread == many,
            "{threads} threads: per-sample gradients differ from one thread's"
        );
    }
}

#[test]
fn independent_loops_are_made_neighbours_and_the_plan_bounds_their_run() {
    // two scans over the same input, the second reading a value computed
    // after the first in trace order: the prepared graph computes that
    // value first, so the second scan reads nothing the first is after
    let f = |xs: Tracer| {
        let init = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 0.0)?;
        let sums = |c: Vec<Tracer>, x: Vec<Tracer>| {
            let s = c[0].add(&x[0])?.tanh()?;
            Ok((vec![s.clone()], vec![s]))
        };
        let (_, a) = candle_func::loops::scan(sums, vec![init.clone()], vec![xs.clone()])?;
        let (_, b) = candle_func::loops::scan(sums, vec![init], vec![xs.exp()?])?;
        a[0].add(&b[0])
    };
    let xs = rand(&[16, 32], 2);
    let g = make_graph(&grad(move |x: Tracer| f(x)?.sum_all()), &xs).unwrap();
    let scans: Vec<usize> = g
        .nodes()
        .filter(|n| n.name().starts_with("scan"))
        .map(|n| n.index())
        .collect();
    assert_eq!(scans.len(), 4, "two scans forward, two backward: {g}");
    for pair in [[scans[0], scans[1]], [scans[2], scans[3]]] {
        let second = g.node(pair[1]).unwrap();
        assert!(
            second.args().iter().all(|&a| a < pair[0]),
            "scan {} reads a value computed after scan {} starts: {g}",
            pair[1],
            pair[0]
        );
    }
    let (one, _) = in_pool(1, || g.run_with_stats(std::slice::from_ref(&xs)).unwrap());
    let (two, stats) = in_pool(2, || g.run_with_stats(std::slice::from_ref(&xs)).unwrap());
    assert!(bits(&one) == bits(&two), "the paired run differs from one thread's");
    assert!(
        stats.peak_bytes <= g.planned_peak_bytes(),
        "held {} bytes, planned {}",
        stats.peak_bytes,
        g.planned_peak_bytes()
    );
}

/// A small CNN's per-sample gradients (every convolution a map under the
/// loop route) and an MLP's outputs under the per-example schedule.
#[test]
fn a_maps_examples_run_in_waves_with_one_threads_numbers() {
    let w1 = rand(&[4, 2, 3, 3], 3);
    let w2 = rand(&[4 * 4 * 4, 3], 4);
    let xs = rand(&[7, 2, 8, 8], 5);
    let loss = |w1: Tracer, w2: Tracer, x: Tracer| {
        let h = x.unsqueeze(0)?.conv2d(&w1, 1, 1, 1, 1)?.relu()?.max_pool2d(2)?;
        h.flatten_from(1)?.matmul(&w2)?.tanh()?.sum_all()
    };
    let psg = |route| {
        vmap(grad(loss).argnums::<0, 1>())
            .in_dims([None, None, Some(0)])
            .conv_route(route)
            .call((&w1, &w2, &xs))
            .unwrap()
    };
    let mlp = |w: Tracer, x: Tracer| x.matmul(&w)?.tanh()?.sum(0);
    let per_example = || {
        vmap(mlp)
            .in_dims([None, Some(0)])
            .schedule(Schedule::PerExample)
            .call((&w2, &xs.reshape((7, 2, 64)).unwrap()))
            .unwrap()
    };
    let g = make_graph(
        &vmap(grad(loss).argnums::<0, 1>())
            .in_dims([None, None, Some(0)])
            .conv_route(ConvRoute::Loop),
        (&w1, &w2, &xs),
    )
    .unwrap();
    assert!(g.to_string().contains("map["), "the loop route maps: {g}");
    let pe = make_graph(
        &vmap(mlp).in_dims([None, Some(0)]).schedule(Schedule::PerExample),
        (&w2, &xs.reshape((7, 2, 64)).unwrap()),
    )
    .unwrap();
    assert!(pe.to_string().contains("map["), "the per-example schedule maps: {pe}");
    let (a1, b1) = in_pool(1, || psg(ConvRoute::Loop));
    let m1 = in_pool(1, per_example);
    for threads in [2, 4] {
        let (a, b) = in_pool(threads, || psg(ConvRoute::Loop));
        assert!(
            bits(&[a1.clone(), b1.clone()]) == bits(&[a, b]),
            "{threads} threads: loop route"
        );
        let m = in_pool(threads, per_example);
        assert!(
            bits(std::slice::from_ref(&m1)) == bits(&[m]),
            "{threads} threads: per example"
        );
    }
    // and the maps agree with the batched route
    let (a, b) = psg(ConvRoute::Unfold);
    common::assert_close(&a1, &a, 1e-4, "loop = unfold (w1)");
    common::assert_close(&b1, &b, 1e-4, "loop = unfold (w2)");
}
