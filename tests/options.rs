//! Options as values: they travel with a transform, nested transforms
//! inherit the route and strict mode, a transform's seed makes its random
//! draws reproducible and independent of the process-wide stream, and a
//! train/eval switch re-traces only the graphs that read it.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, Module};
use candle_func::{custom_op, jit, make_graph, vmap, ConvRoute, Error, Function, Options, Randomness, Tracer};
use common::rand;
use std::sync::atomic::{AtomicUsize, Ordering};

fn conv(x: Tracer, w: Tracer) -> candle_func::Result<Tracer> {
    x.conv2d(&w, 0, 1, 1, 1)
}

#[test]
fn an_options_value_sets_the_route() {
    let x = rand(&[3, 1, 2, 6, 6], 1);
    let w = rand(&[3, 4, 2, 3, 3], 2);
    let f = vmap(conv).options(Options::new().conv_route(ConvRoute::Loop));
    let g = make_graph(&f, (&x, &w)).unwrap().to_string();
    assert!(g.contains("map[") && g.contains("conv2d"), "{g}");
    let grouped = vmap(conv).options(Options::new().conv_route(ConvRoute::Grouped));
    common::assert_close(
        &f.call((&x, &w)).unwrap(),
        &grouped.call((&x, &w)).unwrap(),
        1e-5,
        "routes agree",
    );
}

#[test]
fn nested_transforms_inherit_route_and_strict_mode() {
    // two models' ensembles of three: the inner vmap sets no route
    let x = rand(&[2, 3, 1, 2, 6, 6], 1);
    let w = rand(&[2, 3, 4, 2, 3, 3], 2);
    let outer_loop = vmap(vmap(conv)).conv_route(ConvRoute::Loop);
    let g = make_graph(&outer_loop, (&x, &w)).unwrap().to_string();
    assert!(g.contains("map[") && !g.contains("unfold_rows"), "inherited Loop: {g}");
    // the inner transform's own route wins
    let inner_unfold = vmap(vmap(conv).conv_route(ConvRoute::Unfold)).conv_route(ConvRoute::Loop);
    let g = make_graph(&inner_unfold, (&x, &w)).unwrap().to_string();
    assert!(g.contains("unfold_rows"), "inner Unfold: {g}");
    common::assert_close(
        &outer_loop.call((&x, &w)).unwrap(),
        &inner_unfold.call((&x, &w)).unwrap(),
        1e-5,
        "same numbers",
    );
    // options on an enclosing jit or grad reach the vmap inside, in the
    // graph a call runs and in the one make_graph shows
    let jitted = jit(vmap(vmap(conv))).options(Options::new().conv_route(ConvRoute::Loop));
    let g = make_graph(&jitted, (&x, &w)).unwrap().to_string();
    assert!(g.contains("map[") && !g.contains("unfold_rows"), "jit's route: {g}");
    common::assert_close(
        &jitted.call((&x, &w)).unwrap(),
        &outer_loop.call((&x, &w)).unwrap(),
        0.0,
        "jit",
    );
    // strict mode set outside reaches the inner vmap's fallback
    let xs = rand(&[2, 3, 4], 3);
    let square = |x: Tracer| custom_op("square", &[&x], x.tensor_type().clone(), |xs| xs[0].sqr());
    let strict = vmap(vmap(square)).strict(true);
    match strict.call(&xs) {
        Err(Error::Unsupported {
            op, transform: "vmap", ..
        }) => assert_eq!(op, "custom"),
        other => panic!("strict mode must reach the inner vmap, got {other:?}"),
    }
    assert!(vmap(vmap(square)).call(&xs).is_ok());
}

fn dropout_draws(seed: Option<u64>, calls: usize) -> Vec<Tensor> {
    let xs = Tensor::ones((3, 50), DType::F32, &Device::Cpu).unwrap();
    let f = vmap(|x: Tracer| x.rand_uniform_like()).randomness(Randomness::Different);
    let f = match seed {
        Some(s) => f.seed(s),
        None => f,
    };
    (0..calls).map(|_| f.call(&xs).unwrap()).collect()
}

#[test]
fn a_transforms_seed_makes_its_draws_reproducible() {
    let a = dropout_draws(Some(7), 2);
    let b = dropout_draws(Some(7), 2);
    for (x, y) in a.iter().zip(&b) {
        common::assert_close(x, y, 0.0, "same seed, same draws");
    }
    assert!(common::max_diff(&a[0], &a[1]) > 0.0, "each call draws anew");
    let c = dropout_draws(Some(8), 1);
    assert!(common::max_diff(&a[0], &c[0]) > 0.0, "another seed, other draws");
    // examples draw independently, and values are in [0, 1)
    assert!(common::max_diff(&a[0].get(0).unwrap(), &a[0].get(1).unwrap()) > 0.0);
    let v = a[0].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|&u| (0.0..1.0).contains(&u)));
    // without a seed of its own a transform draws from the process stream,
    // which a transform's seed does not disturb
    candle_func::settings::manual_seed(3);
    let first = dropout_draws(None, 1);
    candle_func::settings::manual_seed(3);
    let _ = dropout_draws(Some(7), 3);
    let again = dropout_draws(None, 1);
    common::assert_close(&first[0], &again[0], 0.0, "process stream unaffected");
    // (the process stream is shared: its checks stay in this one test)
    // a seed on a transform nested in the function called seeds the run
    let xs = Tensor::ones((3, 40), DType::F32, &Device::Cpu).unwrap();
    let nested = |process: u64| {
        candle_func::settings::manual_seed(process);
        let inner = vmap(|x: Tracer| x.rand_uniform_like())
            .randomness(Randomness::Different)
            .seed(11);
        jit(move |x: Tracer| inner.apply((x,))).call(&xs).unwrap()
    };
    common::assert_close(&nested(1), &nested(2), 0.0, "the vmap's seed, not the process stream");
    // a call that draws nothing leaves the process stream where it was
    let draws = vmap(|x: Tracer| x.rand_uniform_like()).randomness(Randomness::Different);
    let plain = jit(|x: Tracer| x.exp());
    candle_func::settings::manual_seed(5);
    let a = draws.call(&xs).unwrap();
    candle_func::settings::manual_seed(5);
    plain.call(&xs).unwrap();
    let b = draws.call(&xs).unwrap();
    common::assert_close(&a, &b, 0.0, "an evaluation call does not shift the masks");
}

#[test]
fn a_mode_switch_retraces_only_graphs_that_read_it() {
    let traced_a = AtomicUsize::new(0);
    let traced_b = AtomicUsize::new(0);
    let drop = nn::Dropout::new(0.5);
    let xs = Tensor::ones((4, 64), DType::F32, &Device::Cpu).unwrap();
    // (a seed of its own: the process stream belongs to the seed test)
    let a = jit(|x: Tracer| {
        traced_a.fetch_add(1, Ordering::Relaxed);
        drop.forward(&x)
    })
    .options(Options::new().seed(1));
    let b = jit(|x: Tracer| {
        traced_b.fetch_add(1, Ordering::Relaxed);
        x.exp()
    });
    let eval = a.call(&xs).unwrap();
    b.call(&xs).unwrap();
    common::assert_close(&eval, &xs, 0.0, "evaluation mode is the identity");
    drop.train(true);
    let train = a.call(&xs).unwrap();
    b.call(&xs).unwrap();
    assert!(common::max_diff(&train, &xs) > 0.5, "training mode drops");
    assert_eq!(traced_a.load(Ordering::Relaxed), 2, "the dropout graph is traced again");
    assert_eq!(traced_b.load(Ordering::Relaxed), 1, "an unrelated graph is not");
    a.call(&xs).unwrap();
    assert_eq!(traced_a.load(Ordering::Relaxed), 2, "and then cached in its new mode");
    drop.train(false);
    common::assert_close(&a.call(&xs).unwrap(), &xs, 0.0, "back in evaluation mode");
}

#[test]
fn forward_eager_is_cached_per_signature() {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(8, 4, vb.pp("fc")).unwrap())
        .add(nn::Activation::Relu);
    let x = rand(&[5, 8], 1);
    let first = model.forward_eager(&x).unwrap();
    let second = model.forward_eager(&x).unwrap();
    common::assert_close(&first, &second, 0.0, "cached run");
    model.forward_eager(&rand(&[2, 8], 2)).unwrap();
    let cache = model.eager_cache().unwrap();
    assert_eq!(cache.traced_signatures(), 2, "one graph per input signature");
}

#[test]
fn vmap_only_options_elsewhere_are_errors() {
    let x = rand(&[4, 3], 1);
    let f = |x: Tracer| x.exp()?.sum_all();
    for o in [
        Options::new().chunk_size(2),
        Options::new().randomness(Randomness::Same),
    ] {
        assert!(matches!(jit(f).options(o).call(&x), Err(Error::Config { .. })));
        assert!(matches!(
            candle_func::grad(f).options(o).call(&x),
            Err(Error::Config { .. })
        ));
    }
    assert!(matches!(vmap(f).chunk_size(0).call(&x), Err(Error::Config { .. })));
    assert!(jit(f)
        .options(Options::new().conv_route(ConvRoute::Loop).seed(1))
        .call(&x)
        .is_ok());
}

#[test]
fn a_changed_transform_or_model_traces_anew() {
    let x = rand(&[3, 4], 1);
    let f = vmap(|x: Tracer| x.sum(0));
    assert_eq!(f.call(&x).unwrap().dims(), &[3]);
    let f = f.in_dims(1);
    assert_eq!(f.call(&x).unwrap().dims(), &[4], "in_dims changed after a call");
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = nn::seq().add(nn::linear(4, 3, vb.pp("a")).unwrap());
    assert_eq!(model.forward_eager(&x).unwrap().dims(), &[3, 3]);
    let model = model.add(nn::linear(3, 2, vb.pp("b")).unwrap());
    assert_eq!(
        model.forward_eager(&x).unwrap().dims(),
        &[3, 2],
        "a layer added after a call"
    );
}
