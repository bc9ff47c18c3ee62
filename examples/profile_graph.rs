//! Where a graph spends its time: runs a workload's graph with per-node
//! timings and prints the slowest nodes and the time per primitive.
//!
//!     cargo run --release --example profile_graph -- tutorial|opacus|c3d|lm|forward [--batch B] [--route R]
//!     cargo run --release --example profile_graph -- ensemble [--model tutorial|opacus|mlp] [--own] [--route R]
//!         [--schedule batched|per-example|convs]
//!
//! For `tutorial`, `opacus` and `c3d` it profiles the ordinary batched
//! gradient step, `vmap(grad)` (per-sample gradients) and the DP clipping
//! step (`dp::clipped_grad_sum`) of the model;
//! `lm` profiles the same three for `tiny_lm` (the bench's `LM` row, B=32 by
//! default); `forward` profiles the tutorial CNN's forward alone, `ensemble` the
//! batched forward of 10 stacked models, on one shared batch or (`--own`)
//! a batch per model.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, stack_params, Module, Reduction, Sequential};
use candle_func::settings::set_conv_route;
use candle_func::{grad, make_graph, vmap, ConvRoute, Graph, Schedule, Tracer};
use common::models::{build, c3d, cnn_o, cnn_t, mlp, tiny_lm};
use std::collections::BTreeMap;

fn report(title: &str, g: &Graph, inputs: &[Tensor]) -> candle_func::Result<()> {
    common::profile::report(title, g, inputs, common::arg("--runs", 3usize))
}

fn labels(b: usize) -> candle_core::Result<Tensor> {
    Tensor::from_vec((0..b as u32).map(|i| i % 10).collect::<Vec<u32>>(), b, &Device::Cpu)
}

fn per_sample(model: &Sequential, b: usize, input: &[usize]) -> Result<(), Box<dyn std::error::Error>> {
    let xs = Tensor::randn(0f32, 1., [&[b], input].concat(), &Device::Cpu)?;
    let ce = |logits: &Tracer, y: &Tracer| nn::cross_entropy(logits, y, Reduction::Mean);
    steps("", model, &xs, &labels(b)?, ce)
}

fn lm(b: usize) -> Result<(), Box<dyn std::error::Error>> {
    let (_vm, m, xs, ys) = tiny_lm(b)?;
    let ce = |logits: &Tracer, y: &Tracer| nn::cross_entropy_with(logits, y, nn::CrossEntropy::default());
    steps("tiny_lm ", &m, &xs, &ys, ce)
}

/// The batched gradient step of `loss(model(xs), ys)`, `vmap(grad)` of
/// each example's loss and the DP clipping step, each profiled (and
/// printed with `PRINT_GRAPH`).
fn steps<M: Module>(
    tag: &str,
    model: &M,
    xs: &Tensor,
    ys: &Tensor,
    loss: impl Fn(&Tracer, &Tracer) -> candle_func::Result<Tracer> + Copy,
) -> Result<(), Box<dyn std::error::Error>> {
    let b = xs.dims()[0];
    let p = model.params();
    let all = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| loss(&functional_call(model, &p, &x)?, &y);
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| all(p, x.unsqueeze(0)?, y.unsqueeze(0)?);
    let mut inputs: Vec<Tensor> = p.values().cloned().collect();
    inputs.extend([xs.clone(), ys.clone()]);
    let graphs = [
        ("batched gradient step", make_graph(&grad(all), (&p, xs, ys))?),
        (
            "vmap(grad)",
            make_graph(&vmap(grad(one)).in_dims([None, Some(0), Some(0)]), (&p, xs, ys))?,
        ),
        (
            "DP clipping step",
            make_graph(&candle_func::dp::clipped_grad_sum(one, 1.0), (&p, xs, ys))?,
        ),
    ];
    for (what, g) in &graphs {
        if std::env::var("PRINT_GRAPH").is_ok() {
            println!("{g}");
        }
        report(&format!("{tag}{what}, B={b}"), g, &inputs)?;
    }
    Ok(())
}

fn forward(b: usize) -> Result<(), Box<dyn std::error::Error>> {
    let (_vm, model) = build(cnn_t)?;
    let x = Tensor::randn(0f32, 1., (b, 1, 28, 28), &Device::Cpu)?;
    let g = make_graph(&|x: Tracer| model.forward(&x), &x)?;
    report(&format!("tutorial CNN forward, B={b}"), &g, &[x])?;
    Ok(())
}

fn ensemble(arch: &str, own: bool) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    type Arch = fn(candle_nn::VarBuilder) -> candle_func::Result<Sequential>;
    let (make, example): (Arch, &[usize]) = match arch {
        "mlp" => (mlp, &[784]),
        "opacus" => (cnn_o, &[1, 28, 28]),
        _ => (cnn_t, &[1, 28, 28]),
    };
    let built = (0..10).map(|_| build(make)).collect::<candle_func::Result<Vec<_>>>()?;
    let refs: Vec<&Sequential> = built.iter().map(|(_, m)| m).collect();
    let stacked = stack_params(&refs)?;
    let lead: &[usize] = if own { &[10, 64] } else { &[64] };
    let x = Tensor::randn(0f32, 1., [lead, example].concat(), &dev)?;
    let model = refs[0];
    let f = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(model, &p, &x))
        .in_dims([Some(0), own.then_some(0)])
        .schedule(match common::arg("--schedule", String::new()).as_str() {
            "per-example" => Schedule::PerExample,
            "convs" => Schedule::ConvsPerExample,
            _ => Schedule::Batched,
        });
    let g = make_graph(&f, (&stacked, &x))?;
    if std::env::var("PRINT_GRAPH").is_ok() {
        println!("{g}");
    }
    let mut inputs: Vec<Tensor> = stacked.values().cloned().collect();
    inputs.push(x);
    let kind = if own { "a batch per model" } else { "one shared batch" };
    report(
        &format!("vmapped ensemble of 10 {arch} models, {kind} of 64"),
        &g,
        &inputs,
    )?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "tutorial".into());
    let b: usize = common::arg("--batch", 64);
    let route: String = common::arg("--route", "unfold".to_string());
    set_conv_route(Some(route.parse::<ConvRoute>()?));
    let _ = DType::F32;
    match which.as_str() {
        "ensemble" => ensemble(
            &common::arg("--model", "tutorial".to_string()),
            std::env::args().any(|a| a == "--own"),
        ),
        "forward" => forward(b),
        "lm" => lm(common::arg("--batch", 32)),
        "opacus" => per_sample(&build(cnn_o)?.1, b, &[1, 28, 28]),
        "c3d" => per_sample(&build(c3d)?.1, b, &[1, 16, 16, 16]),
        _ => per_sample(&build(cnn_t)?.1, b, &[1, 28, 28]),
    }
}
