//! The benchmark suite under criterion: per-sample gradients of the peer
//! workloads through every conv route, a vmapped ensemble against a loop,
//! and `vmap(|x| model.forward(x))` against the plain batched forward.
//! `cargo run --release --example bench` runs the same workloads and prints
//! the ratio tables; this is the statistically careful per-variant view.
//!
//!     cargo bench --bench suite [-- FILTER]

#[path = "../examples/common/models.rs"]
mod models;

use candle_core::{Device, Tensor};
use candle_func::nn::{self, functional_call, stack_params, Module, Reduction, Sequential};
use candle_func::{grad, jit, vmap, ConvRoute, Schedule, Tracer};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use models::{build, c3d, cnn_o, cnn_t, mlp};
use std::collections::BTreeMap;
use std::time::Duration;

type Build = fn(candle_nn::VarBuilder) -> candle_func::Result<Sequential>;

fn labels(b: usize) -> Tensor {
    Tensor::from_vec((0..b as u32).map(|i| i % 10).collect::<Vec<u32>>(), b, &Device::Cpu).unwrap()
}

fn per_sample(c: &mut Criterion) {
    let cases: [(&str, Build, Vec<usize>); 4] = [
        ("T", cnn_t, vec![64, 1, 28, 28]),
        ("O", cnn_o, vec![64, 1, 28, 28]),
        ("O", cnn_o, vec![256, 1, 28, 28]),
        ("C3D", c3d, vec![16, 1, 16, 16, 16]),
    ];
    let mut g = c.benchmark_group("per_sample_grads");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for (tag, f, shape) in cases {
        let (_vm, model) = build(f).unwrap();
        let p = model.params();
        let xs = Tensor::randn(0f32, 1., shape.as_slice(), &Device::Cpu).unwrap();
        let ys = labels(shape[0]);
        let name = format!("{tag}/B={}", shape[0]);
        let step = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
            nn::cross_entropy(&functional_call(&model, &p, &x)?, &y, Reduction::Mean)
        });
        g.bench_function(BenchmarkId::new(&name, "batched step"), |b| {
            b.iter(|| step.call((&p, &xs, &ys)).unwrap())
        });
        let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
            nn::cross_entropy(
                &functional_call(&model, &p, &x.unsqueeze(0)?)?,
                &y.unsqueeze(0)?,
                Reduction::Mean,
            )
        };
        for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop, ConvRoute::Auto] {
            let psg = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).conv_route(route);
            g.bench_function(BenchmarkId::new(&name, format!("vmap(grad) {route:?}")), |b| {
                b.iter(|| psg.call((&p, &xs, &ys)).unwrap())
            });
        }
    }
    g.finish();
}

/// Ten models with a batch each: the loop, the default vmap, each
/// schedule, and the batched graph by route.
fn ensemble_of(c: &mut Criterion, name: &str, arch: Arch, example: &[usize]) {
    let built: Vec<_> = (0..10).map(|_| build(arch).unwrap()).collect();
    let models: Vec<&Sequential> = built.iter().map(|(_, m)| m).collect();
    let stacked = stack_params(&models).unwrap();
    let xs = Tensor::randn(0f32, 1., [&[10, 64], example].concat(), &Device::Cpu).unwrap();
    let mut g = c.benchmark_group(format!("ensemble_own_batch_{name}"));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_millis(500));
    let runs: Vec<_> = models.iter().map(|m| jit(move |x: Tracer| m.forward(&x))).collect();
    g.bench_function("loop over 10 models", |b| {
        b.iter(|| {
            runs.iter()
                .enumerate()
                .map(|(i, r)| r.call(xs.get(i).unwrap()).unwrap())
                .collect::<Vec<_>>()
        })
    });
    let f = |s: Schedule| vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(models[0], &p, &x)).schedule(s);
    for (label, s) in [
        ("vmap default", Schedule::Auto),
        ("vmap per example", Schedule::PerExample),
    ] {
        let f = f(s);
        g.bench_function(label, |b| b.iter(|| f.call((&stacked, &xs)).unwrap()));
    }
    for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop, ConvRoute::Auto] {
        let f = f(Schedule::Batched).conv_route(route);
        g.bench_function(format!("vmap batched {route:?}"), |b| {
            b.iter(|| f.call((&stacked, &xs)).unwrap())
        });
    }
    g.finish();
}

type Arch = fn(candle_nn::VarBuilder) -> candle_func::Result<Sequential>;

fn ensemble(c: &mut Criterion) {
    ensemble_of(c, "tutorial_cnn", cnn_t, &[1, 28, 28]);
    ensemble_of(c, "opacus_cnn", cnn_o, &[1, 28, 28]);
    ensemble_of(c, "mlp", mlp, &[784]);
}

fn forward(c: &mut Criterion) {
    let (_vm, model) = build(cnn_o).unwrap();
    let xs = Tensor::randn(0f32, 1., (256, 1, 28, 28), &Device::Cpu).unwrap();
    let plain = jit(|x: Tracer| model.forward(&x));
    let mapped = vmap(|x: Tracer| model.forward(&x.unsqueeze(0)?)?.squeeze(0));
    let mut g = c.benchmark_group("forward_O_B256");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    g.bench_function("plain batched", |b| b.iter(|| plain.call(&xs).unwrap()));
    g.bench_function("vmap(model.forward)", |b| b.iter(|| mapped.call(&xs).unwrap()));
    g.finish();
}

criterion_group!(suite, per_sample, ensemble, forward);
criterion_main!(suite);
