//! Optimisers over stacked parameters: `candle_func::optim::Sgd`, `Adam` and `AdamW` built
//! over `nn::stack_vars` train an ensemble of `M` models at once, and after
//! some steps each model's slice equals what `M` separate optimisers over
//! the models' own variables give.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, stack_vars, unstack_params};
use candle_func::optim::Optimizer;
use common::{max_diff, rand};
use std::collections::BTreeMap;

const M: usize = 3;

fn models() -> (Vec<candle_nn::VarMap>, Vec<nn::Sequential>) {
    let varmaps: Vec<candle_nn::VarMap> = (0..M).map(|_| candle_nn::VarMap::new()).collect();
    let models = varmaps
        .iter()
        .map(|vm| {
            let vb = candle_nn::VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
            Ok(nn::seq()
                .add(nn::linear(4, 3, vb.pp("a"))?)
                .add(nn::linear(3, 2, vb.pp("b"))?))
        })
        .collect::<candle_func::Result<Vec<_>>>()
        .unwrap();
    (varmaps, models)
}

fn values(vm: &candle_nn::VarMap) -> BTreeMap<String, Tensor> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect()
}

type Make = fn(&candle_nn::VarMap) -> Box<dyn Optimizer>;

#[test]
fn a_stacked_optimiser_equals_one_per_model() {
    let makers: [(&str, Make); 3] = [
        ("sgd", |vm| {
            Box::new(candle_func::optim::Sgd::new(vm, 0.1, 0.9).unwrap())
        }),
        ("adam", |vm| Box::new(candle_func::optim::Adam::new(vm, 0.01).unwrap())),
        ("adamw", |vm| {
            Box::new(candle_func::optim::AdamW::new(vm, 0.01, 0.1).unwrap())
        }),
    ];
    for (name, make) in makers {
        let (varmaps, ms) = models();
        let refs: Vec<&nn::Sequential> = ms.iter().collect();
        let stacked = stack_vars(&refs).unwrap();
        let mut together = make(&stacked);
        let mut apart: Vec<Box<dyn Optimizer>> = varmaps.iter().map(make).collect();
        for step in 0..4 {
            // stacked gradients, one slice per model
            let grads: BTreeMap<String, Tensor> = values(&stacked)
                .iter()
                .enumerate()
                .map(|(i, (k, v))| (k.clone(), rand(v.dims(), 100 * step + i as u64)))
                .collect();
            together.step(&grads).unwrap();
            for (m, opt) in apart.iter_mut().enumerate() {
                let own: BTreeMap<String, Tensor> = grads.iter().map(|(k, g)| (k.clone(), g.get(m).unwrap())).collect();
                opt.step(&own).unwrap();
            }
        }
        for (m, slice) in unstack_params(&values(&stacked)).unwrap().iter().enumerate() {
            for (k, t) in slice {
                let own = &values(&varmaps[m])[k];
                let d = max_diff(t, own) as f32;
                assert!(d < 1e-6, "{name}: model {m} {k} differs by {d}");
            }
        }
    }
}
