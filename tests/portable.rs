//! Portable mode (`Options::portable`, `CANDLE_FUNC_PORTABLE=1`): the CPU
//! takes the path every other device takes, candle's operations instead
//! of the crate's own kernels. Here it gives the default path's numbers on
//! convolutions (every route), pooling, softmax and a DP step; `.ci/run`
//! runs the fixture, oracle and DP tests once more in it.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::{dp, grad, vmap, ConvRoute, Tracer};
use common::{assert_close, rand};
use std::collections::BTreeMap;

#[test]
fn portable_runs_give_the_default_paths_numbers() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let pad = nn::ConvConfig {
        padding: 1,
        ..Default::default()
    };
    let model = nn::seq()
        .add(nn::conv2d(2, 4, 3, pad, vb.pp("c1")).unwrap())
        .add(nn::Activation::Tanh)
        .add(nn::MaxPool2d { kernel: 2, stride: 2 })
        .add(nn::Flatten)
        .add(nn::linear(4 * 3 * 3, 5, vb.pp("fc")).unwrap());
    let xs = rand(&[6, 2, 6, 6], 1);
    let ys = Tensor::new(&[0u32, 1, 2, 3, 4, 0], &Device::Cpu).unwrap();
    let p = model.params();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&model, &p, &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits.log_softmax(1)?.exp()?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
        let psg = |portable: bool| {
            vmap(grad(loss))
                .in_dims([None, Some(0), Some(0)])
                .conv_route(route)
                .portable(portable)
                .call((&p, &xs, &ys))
                .unwrap()
        };
        let (fast, slow) = (psg(false), psg(true));
        for (k, g) in &fast {
            assert_close(&slow[k], g, 1e-5, &format!("{route:?} {k}"));
        }
    }
    let step = |portable: bool| {
        dp::clipped_grad_sum(loss, 0.1)
            .portable(portable)
            .call((&p, &xs, &ys))
            .unwrap()
    };
    let ((fast, fast_norms, _), (slow, slow_norms, _)) = (step(false), step(true));
    assert_close(&slow_norms, &fast_norms, 1e-5, "per-sample norms");
    for (k, g) in &fast {
        assert_close(&slow[k], g, 1e-5, &format!("clipped sum {k}"));
    }
}
