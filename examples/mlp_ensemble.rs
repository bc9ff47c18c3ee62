//! The torch.func ensembling tutorial's case as a new user writes it: ten
//! MLPs 784-128-128-10, a batch of 64, run as a loop over the models and
//! as one `vmap` over their stacked parameters, with one shared batch and
//! with a batch per model. A plain program: it sets no global allocator
//! (the other examples run under mimalloc) and no option.
//!
//!     cargo run --release --example mlp_ensemble [-- --reps 200 --rounds 5]

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, stack_params, Activation, Module, Sequential};
use candle_func::{jit, vmap, Tracer};
use std::collections::BTreeMap;
use std::time::Instant;

fn mlp(vb: candle_nn::VarBuilder) -> candle_func::Result<Sequential> {
    Ok(nn::seq()
        .add(nn::linear(784, 128, vb.pp("fc1"))?)
        .add(Activation::Relu)
        .add(nn::linear(128, 128, vb.pp("fc2"))?)
        .add(Activation::Relu)
        .add(nn::linear(128, 10, vb.pp("fc3"))?))
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

/// Median milliseconds of a call of each job: `reps` calls of one job in a
/// row, as a program calls a model in a loop, then the next job's; the
/// blocks of calls take turns so that the machine's load falls on all.
fn medians(reps: usize, jobs: &mut [&mut dyn FnMut() -> candle_func::Result<()>]) -> candle_func::Result<Vec<f64>> {
    for job in jobs.iter_mut() {
        job()?; // trace, and let Auto decide
    }
    let mut times = vec![Vec::with_capacity(reps); jobs.len()];
    for (job, t) in jobs.iter_mut().zip(&mut times) {
        for _ in 0..reps {
            let start = Instant::now();
            job()?;
            t.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

fn main() -> candle_func::Result<()> {
    let (reps, rounds) = (arg("--reps", 200), arg("--rounds", 5));
    let (m, b, dev) = (10, 64, Device::Cpu);
    let varmaps: Vec<candle_nn::VarMap> = (0..m).map(|_| candle_nn::VarMap::new()).collect();
    let models = varmaps
        .iter()
        .map(|v| mlp(candle_nn::VarBuilder::from_varmap(v, DType::F32, &dev)))
        .collect::<candle_func::Result<Vec<_>>>()?;
    let refs: Vec<&Sequential> = models.iter().collect();
    let stacked = stack_params(&refs)?;
    let runs: Vec<_> = models.iter().map(|mm| jit(move |x: Tracer| mm.forward(&x))).collect();
    println!("10 MLPs 784-128-128-10, B={b}, no global allocator set; medians of {reps} calls, {rounds} rounds");
    for own in [false, true] {
        let x = match own {
            true => Tensor::randn(0f32, 1., (m, b, 784), &dev)?,
            false => Tensor::randn(0f32, 1., (b, 784), &dev)?,
        };
        let ensemble = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(refs[0], &p, &x))
            .in_dims([Some(0), if own { Some(0) } else { None }]);
        let mut looped = || -> candle_func::Result<()> {
            for (i, r) in runs.iter().enumerate() {
                r.call(&if own { x.get(i)? } else { x.clone() })?;
            }
            Ok(())
        };
        let mut batched = || ensemble.call((&stacked, &x)).map(|_| ());
        let mut ratios = Vec::new();
        for round in 0..rounds {
            // the order of the blocks alternates between rounds
            let ms = match round % 2 {
                0 => medians(reps, &mut [&mut looped, &mut batched])?,
                _ => medians(reps, &mut [&mut batched, &mut looped])?
                    .into_iter()
                    .rev()
                    .collect(),
            };
            ratios.push(ms[1] / ms[0]);
            println!(
                "{} batch, round {round}: loop {:.3} ms, vmap {:.3} ms, vmap / loop {:.2}",
                if own { "own" } else { "shared" },
                ms[0],
                ms[1],
                ms[1] / ms[0]
            );
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "{} batch: vmap / loop median {:.2} (min {:.2}, max {:.2})",
            if own { "own" } else { "shared" },
            ratios[rounds / 2],
            ratios[0],
            ratios[rounds - 1]
        );
    }
    Ok(())
}
