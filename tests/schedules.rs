//! Whole-graph schedules: a vmap runs its batch batched, or the unbatched
//! graph once per example as one map node, or its convolutions per example
//! and the rest batched, or (Auto) the fastest for a large program. Every
//! schedule gives the same numbers.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::planner::schedule_choices;
use candle_func::tracer::Operand;
use candle_func::{make_graph, vmap, ConvRoute, Function, Randomness, Schedule, Tracer};
use common::{assert_close, rand};

/// A small CNN ensemble member: conv, relu, conv, sum, plus a second
/// output of another dtype.
fn model(w1: Tracer, w2: Tracer, x: Tracer) -> candle_func::Result<(Tracer, Tracer)> {
    let h = x.conv2d(&w1, 1, 1, 1, 1)?.relu()?;
    let y = h.conv2d(&w2, 0, 2, 1, 1)?;
    Ok((y.clone(), y.sum([2, 3])?.to_dtype(DType::F64)?))
}

#[test]
fn per_example_runs_the_unbatched_graph_and_agrees() {
    let w1 = rand(&[4, 6, 2, 3, 3], 1);
    let w2 = rand(&[4, 5, 6, 3, 3], 2);
    for (x, dims) in [
        (rand(&[3, 2, 9, 9], 3), [Some(0), Some(0), None]), // one shared batch
        (rand(&[4, 3, 2, 9, 9], 4), [Some(0), Some(0), Some(0)]), // a batch per model
    ] {
        let f = |s| vmap(model).in_dims(dims).schedule(s).conv_route(ConvRoute::Unfold);
        let g = make_graph(&f(Schedule::PerExample), (&w1, &w2, &x))
            .unwrap()
            .to_string();
        assert_eq!(
            g.matches("map[").count(),
            1,
            "one map, its outputs of two dtypes its results: {g}"
        );
        assert!(g.contains("(f32[4,3,5,4,4], f64[4,3,5]) = map["), "{g}");
        assert!(!g.contains("unfold_rows"), "no batched lowering: {g}");
        let (a, a64) = f(Schedule::PerExample).call((&w1, &w2, &x)).unwrap();
        let (b, b64) = f(Schedule::Batched).call((&w1, &w2, &x)).unwrap();
        assert_eq!(a.dims(), b.dims());
        assert_eq!(a64.dtype(), DType::F64);
        assert_close(&a, &b, 1e-4, "per example = batched");
        assert_close(&a64, &b64, 1e-3, "second output");
        // and out_dims moves the batch axis as for the batched graph
        let moved = vmap(model)
            .in_dims(dims)
            .out_dims(1)
            .schedule(Schedule::PerExample)
            .call((&w1, &w2, &x))
            .unwrap();
        assert_close(&moved.0, &b.transpose(0, 1).unwrap(), 1e-4, "out_dims 1");
    }
}

/// A CNN with a linear head: conv, relu, max-pool, flatten, linear, relu,
/// linear, log-softmax (a batch of images to log-probabilities).
fn cnn(w1: Tracer, w2: Tracer, w3: Tracer, x: Tracer) -> candle_func::Result<Tracer> {
    let h = x.conv2d(&w1, 1, 1, 1, 1)?.relu()?.max_pool2d(2)?.flatten_from(1)?;
    h.matmul(&w2)?.relu()?.matmul(&w3)?.log_softmax(1)
}

#[test]
fn convs_per_example_maps_the_front_and_batches_the_head() {
    let w1 = rand(&[4, 6, 2, 3, 3], 1);
    let w2 = rand(&[4, 6 * 4 * 4, 16], 2);
    let w3 = rand(&[4, 16, 5], 3);
    for (x, dims) in [
        (rand(&[3, 2, 8, 8], 4), [Some(0), Some(0), Some(0), None]), // one shared batch
        (rand(&[4, 3, 2, 8, 8], 5), [Some(0), Some(0), Some(0), Some(0)]), // a batch per model
    ] {
        let f = |s| vmap(cnn).in_dims(dims).schedule(s).conv_route(ConvRoute::Unfold);
        let g = make_graph(&f(Schedule::ConvsPerExample), (&w1, &w2, &w3, &x))
            .unwrap()
            .to_string();
        assert_eq!(g.matches("map[").count(), 1, "one map, the front: {g}");
        // the map yields the flattened activations (the fewest bytes after
        // the convolution), and the head's products run batched outside it
        let map_line = g.lines().find(|l| l.contains("map[")).unwrap();
        assert!(
            map_line.contains(&format!("(f32[4,3,{}]) = map", 6 * 4 * 4)),
            "{map_line}"
        );
        let after_map = &g[g.find(map_line).unwrap()..];
        assert_eq!(after_map.matches("matmul").count(), 2, "{g}");
        assert!(!g.contains("unfold_rows"), "the convolution runs unbatched: {g}");
        let a = f(Schedule::ConvsPerExample).call((&w1, &w2, &w3, &x)).unwrap();
        let b = f(Schedule::Batched).call((&w1, &w2, &w3, &x)).unwrap();
        assert_eq!(a.dims(), &[4, 3, 5]);
        assert_close(&a, &b, 1e-4, "segments = batched");
        // differentiated through: the map's gradient is a map, the head's
        // the batched rules'
        let loss = |s: Schedule| {
            move |w2: Tracer, w1: Tracer, w3: Tracer, x: Tracer| {
                vmap(cnn).in_dims(dims).schedule(s).apply((w1, w2, w3, x))?.sum_all()
            }
        };
        let ga = candle_func::grad(loss(Schedule::ConvsPerExample))
            .call((&w2, &w1, &w3, &x))
            .unwrap();
        let gb = candle_func::grad(loss(Schedule::Batched))
            .call((&w2, &w1, &w3, &x))
            .unwrap();
        assert_close(&ga, &gb, 1e-3, "gradients agree");
    }
}

#[test]
fn convs_per_example_without_a_head_or_convolutions() {
    let w = rand(&[4, 8, 3], 1);
    let x = rand(&[4, 5, 8], 2);
    let f = |s| vmap(|w: Tracer, x: Tracer| x.matmul(&w)?.tanh()).schedule(s);
    let g = make_graph(&f(Schedule::ConvsPerExample), (&w, &x)).unwrap().to_string();
    assert!(!g.contains("map["), "{g}");
    // nothing batched after the last convolution: the whole program maps
    let w1 = rand(&[4, 6, 2, 3, 3], 3);
    let xs = rand(&[4, 1, 2, 8, 8], 4);
    let conv_only = |s| vmap(|w: Tracer, x: Tracer| x.conv2d(&w, 1, 1, 1, 1)?.relu()).schedule(s);
    let g = make_graph(&conv_only(Schedule::ConvsPerExample), (&w1, &xs))
        .unwrap()
        .to_string();
    assert_eq!(g.matches("map[").count(), 1, "{g}");
    let a = conv_only(Schedule::ConvsPerExample).call((&w1, &xs)).unwrap();
    let b = conv_only(Schedule::Batched).call((&w1, &xs)).unwrap();
    assert_close(&a, &b, 1e-5, "same numbers");
    assert_close(
        &f(Schedule::ConvsPerExample).call((&w, &x)).unwrap(),
        &f(Schedule::Batched).call((&w, &x)).unwrap(),
        0.0,
        "same kernels",
    );
}

#[test]
fn per_example_falls_back_where_it_cannot_apply() {
    let xs = Tensor::ones((4, 8), DType::F32, &Device::Cpu).unwrap();
    // one draw shared by all examples cannot be drawn once per example
    let r = vmap(|x: Tracer| x.rand_uniform_like())
        .randomness(Randomness::Same)
        .schedule(Schedule::PerExample)
        .call(&xs)
        .unwrap();
    for i in 1..4 {
        assert_close(&r.get(i).unwrap(), &r.get(0).unwrap(), 0.0, "Same holds");
    }
    // per-example draws would be seeded by where each map sits, and a
    // gradient's maps (or a second dtype's) sit elsewhere: random programs
    // run batched, so a value and its gradient see one mask
    let w = Tensor::ones((4, 64), DType::F32, &Device::Cpu).unwrap();
    let masked = |w: Tracer| {
        let per = vmap(|w: Tracer| w.mul(&w.rand_uniform_like()?.ge(0.5)?.to_dtype(DType::F32)?)?.sum_all())
            .randomness(Randomness::Different)
            .schedule(Schedule::PerExample);
        per.apply((w,))?.sum_all()
    };
    let (value, g) = candle_func::value_and_grad(masked).call(&w).unwrap();
    assert_close(&value, &g.sum_all().unwrap(), 0.0, "value = sum of the gradient's mask");
    let (r, r64) = vmap(|x: Tracer| {
        let r = x.mul(&x.rand_uniform_like()?)?;
        Ok((r.clone(), r.to_dtype(DType::F64)?))
    })
    .randomness(Randomness::Different)
    .schedule(Schedule::PerExample)
    .call(&w)
    .unwrap();
    assert_close(
        &r.to_dtype(DType::F64).unwrap(),
        &r64,
        1e-7,
        "one draw for both outputs",
    );
    // an output that does not depend on the batch stays unbatched
    let c = rand(&[8], 1);
    let (y, k) = vmap(|x: Tracer| Ok((x.exp()?, c.to_tracer(&x)?.sqr()?)))
        .out_dims([Some(0), None])
        .schedule(Schedule::PerExample)
        .call(&xs)
        .unwrap();
    assert_eq!((y.dims(), k.dims()), (&[4, 8][..], &[8][..]));
}

#[test]
fn auto_measures_large_programs_only() {
    let before = schedule_choices().len();
    let small = vmap(|x: Tracer| x.exp()?.sum_all());
    small.call(rand(&[4, 16], 1)).unwrap();
    assert_eq!(
        schedule_choices().len(),
        before,
        "a small program is batched unmeasured"
    );
    // ten models' activations of 64 x 8 x 32 x 32 floats: 21 MiB per
    // batched op, several ops
    let w = rand(&[10, 8, 3, 3, 3], 2);
    let x = rand(&[64, 3, 32, 32], 3);
    let f = vmap(|w: Tracer, x: Tracer| x.conv2d(&w, 1, 1, 1, 1)?.relu()?.sqr()?.sum([2, 3])).in_dims([Some(0), None]);
    let auto = f.call((&w, &x)).unwrap();
    let choices = schedule_choices();
    assert_eq!(choices.len(), before + 1, "{choices:?}");
    let c = choices.last().unwrap();
    assert_eq!(c.size, 10);
    assert_eq!(c.timings_ms.len(), 2);
    assert!(c.timings_ms.iter().all(|(_, t)| *t > 0.0));
    let fastest = c.timings_ms.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_eq!(c.chosen, fastest);
    let batched = vmap(|w: Tracer, x: Tracer| x.conv2d(&w, 1, 1, 1, 1)?.relu()?.sqr()?.sum([2, 3]))
        .in_dims([Some(0), None])
        .schedule(Schedule::Batched)
        .call((&w, &x))
        .unwrap();
    assert_close(&auto, &batched, 1e-2, "auto's choice computes the same");
    // cached: a second call of the same signature measures nothing
    f.call((&w, &x)).unwrap();
    assert_eq!(schedule_choices().len(), before + 1);
    // inside a trace that will be differentiated: batched, unmeasured
    // (another program than the one measured above, so no cached decision
    // answers for it)
    let inner =
        vmap(|w: Tracer, x: Tracer| x.conv2d(&w, 1, 1, 1, 1)?.tanh()?.sqr()?.sum([2, 3])).in_dims([Some(0), None]);
    let loss = |w: Tracer| inner.apply((w.clone(), x.to_tracer(&w)?))?.sum_all();
    let gw = candle_func::grad(loss).call(&w).unwrap();
    assert_eq!(gw.dims(), w.dims());
    assert_eq!(schedule_choices().len(), before + 1, "no measurement under grad");
    // integer division is not measured on made-up divisors
    let a = Tensor::ones((8, 1 << 20), DType::U32, &Device::Cpu).unwrap();
    let q = vmap(|a: Tracer, b: Tracer| a.div(&b)).call((&a, &a)).unwrap();
    assert_eq!(q.dims(), &[8, 1 << 20]);
    assert_eq!(
        schedule_choices().len(),
        before + 1,
        "no measurement of an integer division"
    );
}
