//! Trains an ensemble of M small CNNs (default 8, each from its own
//! initialisation) at once on the UCI digits: `vmap` over the stacked
//! parameters, each model on its own shuffled minibatches, its gradient by
//! `vmap(grad(loss))`. Prints each model's test accuracy, the ensemble's
//! (averaged probabilities), and the time of one vmapped training step
//! against a loop over the M models, side by side.
//!
//!     cargo run --release --example ensemble [-- --models 8 --epochs 10 --batch 32 --lr 0.05]

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{
    self, functional_call, load_params, stack_params, stack_vars, unstack_params, Module, Reduction,
};
use candle_func::optim::{Optimizer, Sgd};
use candle_func::{grad, vmap, Tracer};
use common::{arg, digits, digits_cnn};
use std::collections::BTreeMap;
use std::time::Instant;

type Params = BTreeMap<String, Tensor>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let m: usize = arg("--models", 8);
    let epochs: usize = arg("--epochs", 10);
    let batch: usize = arg("--batch", 32);
    let lr: f64 = arg("--lr", 0.05);
    let momentum = 0.9;
    let all = digits::load(&dev)?;
    let (train, test) = digits::split(&all)?;
    println!(
        "ensemble of {m} CNNs on the UCI digits: {} train, {} test; {epochs} epochs, batch {batch}, lr {lr}",
        train.len(),
        test.len()
    );

    // M models of one architecture, each with its own initialisation.
    let varmaps: Vec<candle_nn::VarMap> = (0..m).map(|_| candle_nn::VarMap::new()).collect();
    let models = varmaps
        .iter()
        .map(|vm| digits_cnn(candle_nn::VarBuilder::from_varmap(vm, DType::F32, &dev)))
        .collect::<candle_func::Result<Vec<_>>>()?;
    let refs: Vec<&nn::Sequential> = models.iter().collect();
    // name -> [M, ...] as variables; one SGD trains every model's slice
    let stacked_vars = stack_vars(&refs)?;
    let mut sgd = Sgd::new(&stacked_vars, lr, momentum)?;
    let mut stacked = stack_params(&refs)?;
    let template = &models[0];
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(&functional_call(template, &p, &x)?, &y, Reduction::Mean)
    };
    let step_grads = vmap(grad(loss)); // every argument batched over the models
    let one_grad = grad(loss);
    let mut rng = candle_func::rng::Rng::seeded(7);
    let steps = train.len() / batch;
    let (mut t_vmap, mut t_loop, mut timed) = (0f64, 0f64, 0usize);
    for epoch in 1..=epochs {
        // each model its own shuffle of the training set
        let orders: Vec<Vec<usize>> = (0..m).map(|_| rng.permutation(train.len())).collect();
        for s in 0..steps {
            let parts = orders
                .iter()
                .map(|o| train.select(&o[s * batch..(s + 1) * batch]))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let xs = Tensor::stack(&parts.iter().map(|d| d.images.clone()).collect::<Vec<_>>(), 0)?; // M B 1 8 8
            let ys = Tensor::stack(&parts.iter().map(|d| d.labels.clone()).collect::<Vec<_>>(), 0)?; // M B
            let t0 = Instant::now();
            let g = step_grads.call((&stacked, &xs, &ys))?;
            let t1 = Instant::now();
            if s % 10 == 0 {
                // the same gradients by a loop over the models, for timing and a check
                let per_model = unstack_params(&stacked)?;
                let looped = (0..m)
                    .map(|i| one_grad.call((&per_model[i], parts[i].images.clone(), parts[i].labels.clone())))
                    .collect::<candle_func::Result<Vec<Params>>>()?;
                t_loop += t1.elapsed().as_secs_f64();
                t_vmap += (t1 - t0).as_secs_f64();
                timed += 1;
                // Not equal to rounding: the digits' flat backgrounds tie the
                // max-pool windows exactly, the batched and the per-model
                // convolutions round differently, and a tie broken the other
                // way sends a cotangent elsewhere. The loop's own gradient
                // moved by 2.8e-4 (relative norm ~1e-3) when its parameters
                // were perturbed by 1e-7; a wrong rule would move it by O(1).
                let diff = rel_diff(&g, &looped)?;
                assert!(
                    diff < 1e-2,
                    "vmapped and looped gradients differ by {diff:.2e} (relative)"
                );
            }
            sgd.step(&g)?;
            stacked = current(&stacked_vars);
        }
        println!(
            "epoch {epoch:>2}: mean test accuracy {:.4}",
            mean_accuracy(&stacked, &varmaps, &models, &test)?
        );
    }
    // Write the trained parameters back into each model and evaluate alone.
    let mut probs_sum: Option<Tensor> = None;
    for (i, p) in unstack_params(&stacked)?.iter().enumerate() {
        load_params(&varmaps[i], p)?;
        let logits = models[i].forward_eager(&test.images)?;
        println!("model {i}: test accuracy {:.4}", accuracy(&logits, &test.labels)?);
        let probs = candle_nn::ops::softmax(&logits, 1)?;
        probs_sum = Some(match probs_sum {
            None => probs,
            Some(s) => (s + probs)?,
        });
    }
    if let Some(p) = probs_sum {
        println!(
            "ensemble (averaged probabilities): test accuracy {:.4}",
            accuracy(&p, &test.labels)?
        );
    }
    let (v, l) = (t_vmap / timed as f64 * 1e3, t_loop / timed as f64 * 1e3);
    println!("\n| training step (gradients of {m} models) | ms |\n| --- | --- |");
    println!(
        "| vmap over stacked parameters | {v:.2} |\n| loop over the {m} models | {l:.2} |\n| loop / vmap | {:.2} |",
        l / v
    );
    Ok(())
}

/// The stacked variables' current values.
fn current(vars: &candle_nn::VarMap) -> Params {
    let data = vars.data().lock().expect("the VarMap's lock");
    data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
}

/// `|vmapped - looped| / |looped|` over every parameter's gradient of
/// every model (Euclidean norms).
fn rel_diff(stacked: &Params, looped: &[Params]) -> candle_core::Result<f64> {
    let (mut num, mut den) = (0f64, 0f64);
    for (k, g) in stacked {
        for (i, l) in looped.iter().enumerate() {
            let sq = |t: &Tensor| t.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>();
            num += sq(&(g.get(i)? - &l[k])?)?;
            den += sq(&l[k])?;
        }
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

fn accuracy(scores: &Tensor, labels: &Tensor) -> candle_core::Result<f64> {
    let right = scores
        .argmax(1)?
        .eq(labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(right as f64 / labels.dims()[0] as f64)
}

fn mean_accuracy(
    stacked: &Params,
    varmaps: &[candle_nn::VarMap],
    models: &[nn::Sequential],
    test: &digits::Digits,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut total = 0.0;
    for (i, p) in unstack_params(stacked)?.iter().enumerate() {
        load_params(&varmaps[i], p)?;
        total += accuracy(&models[i].forward_eager(&test.images)?, &test.labels)?;
    }
    Ok(total / models.len() as f64)
}
