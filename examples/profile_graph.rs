//! Where a graph spends its time: runs a workload's graph with per-node
//! timings and prints the slowest primitives.
//!
//!     cargo run --release --example profile_graph -- ensemble|tutorial|opacus

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, stack_params, Module, Reduction};
use candle_func::{grad, interp, make_graph, vmap, Graph, Tracer};
use std::collections::BTreeMap;

fn report(g: &Graph, inputs: &[Tensor]) -> candle_func::Result<()> {
    interp::run(g, inputs)?; // warm-up
    let (_, times) = interp::run_profiled(g, inputs)?;
    let total: f64 = times.iter().map(|t| t.1).sum();
    let mut by_node: Vec<(f64, String)> = times
        .iter()
        .map(|&(v, t)| (t, format!("{} -> {:?}", g.nodes[v].prim.name(), g.nodes[v].ty.shape)))
        .collect();
    by_node.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!("total {:.2} ms over {} nodes; slowest:", total * 1e3, times.len());
    for (t, what) in by_node.iter().take(15) {
        println!("{:>8.3} ms  {what}", t * 1e3);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let which = std::env::args().nth(1).unwrap_or_else(|| "ensemble".into());
    let (m, b) = (8, 32);
    let vms: Vec<candle_nn::VarMap> = (0..m).map(|_| candle_nn::VarMap::new()).collect();
    let models = vms
        .iter()
        .map(|vm| common::digits_cnn(candle_nn::VarBuilder::from_varmap(vm, DType::F32, &dev)))
        .collect::<candle_func::Result<Vec<_>>>()?;
    let refs: Vec<&nn::Sequential> = models.iter().collect();
    let stacked = stack_params(&refs)?;
    let xs = Tensor::randn(0f32, 1., (m, b, 1, 8, 8), &dev)?;
    let ys = Tensor::zeros((m, b), DType::U32, &dev)?;
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(&functional_call(&models[0], &p, &x)?, &y, Reduction::Mean)
    };
    match which.as_str() {
        "ensemble" => {
            let f = vmap(grad(loss));
            let g = make_graph(&f, (&stacked, &xs, &ys))?;
            let mut inputs: Vec<Tensor> = stacked.values().cloned().collect();
            inputs.extend([xs.clone(), ys.clone()]);
            report(&g, &inputs)?;
        }
        _ => {
            let p = models[0].params();
            let (x, y) = (xs.get(0)?, ys.get(0)?);
            let f = vmap(grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
                loss(p, x.unsqueeze(0)?, y.unsqueeze(0)?)
            }))
            .in_dims([None, Some(0), Some(0)]);
            let g = make_graph(&f, (&p, &x, &y))?;
            let mut inputs: Vec<Tensor> = p.values().cloned().collect();
            inputs.extend([x, y]);
            report(&g, &inputs)?;
        }
    }
    Ok(())
}
