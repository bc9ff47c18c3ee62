//! Regression tests for cases a review found: empty batches, empty
//! convolution gradients, shared random draws across chunks, layer mode
//! changes after a graph was cached, bad parameter overrides, overflowing
//! ranges, scalar branches of `where_cond`, and outputs that kept candle's
//! autograd history.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, Module, Params};
use candle_func::{grad, jit, vmap, Error, Randomness, Tracer};
use common::rand;
use std::collections::BTreeMap;

#[test]
fn a_map_over_zero_examples_gives_empty_results() {
    let xs = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
    let f = |x: Tracer| x.exp()?.sum_keepdim(0);
    assert_eq!(vmap(f).call(&xs).unwrap().dims(), &[0, 1]);
    assert_eq!(vmap(f).chunk_size(2).call(&xs).unwrap().dims(), &[0, 1]);
    assert_eq!(vmap(f).out_dims(1).call(&xs).unwrap().dims(), &[1, 0]);
}

#[test]
fn convolution_gradients_of_empty_batches_are_zeros() {
    let w = rand(&[2, 1, 3, 3], 1);
    let x = Tensor::zeros((0, 1, 5, 5), DType::F32, &Device::Cpu).unwrap();
    let (gw, gx) = grad(|w: Tracer, x: Tracer| x.conv2d(&w, 0, 1, 1, 1)?.sum_all())
        .argnums::<0, 1>()
        .call((&w, &x))
        .unwrap();
    assert_eq!(gw.dims(), &[2, 1, 3, 3]);
    assert_eq!(gw.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(gx.dims(), &[0, 1, 5, 5]);
}

#[test]
fn same_randomness_is_one_draw_across_chunks() {
    let xs = Tensor::zeros((6, 5), DType::F32, &Device::Cpu).unwrap();
    let r = vmap(|x: Tracer| x.rand_uniform_like())
        .randomness(Randomness::Same)
        .chunk_size(2)
        .call(&xs)
        .unwrap();
    for i in 1..6 {
        common::assert_close(&r.get(i).unwrap(), &r.get(0).unwrap(), 0.0, "one draw");
    }
    let r = vmap(|x: Tracer| x.rand_uniform_like())
        .randomness(Randomness::Different)
        .chunk_size(2)
        .call(&xs)
        .unwrap();
    assert!(common::max_diff(&r.get(0).unwrap(), &r.get(4).unwrap()) > 0.0);
}

#[test]
fn switching_a_layer_to_training_mode_is_seen_by_cached_graphs() {
    let drop = nn::Dropout::new(0.5);
    let xs = Tensor::ones((4, 100), DType::F32, &Device::Cpu).unwrap();
    let f = vmap(|x: Tracer| drop.forward(&x)).randomness(Randomness::Different);
    let eval = f.call(&xs).unwrap();
    common::assert_close(&eval, &xs, 0.0, "evaluation mode");
    drop.train(true);
    let train = f.call(&xs).unwrap();
    assert!(
        common::max_diff(&train, &xs) > 0.0,
        "training mode after a cached evaluation-mode call"
    );
    drop.train(false);
    common::assert_close(&f.call(&xs).unwrap(), &xs, 0.0, "back to evaluation mode");
}

#[test]
fn parameter_overrides_of_the_wrong_shape_are_errors() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let conv = nn::conv2d(1, 2, 3, Default::default(), vb.pp("c")).unwrap();
    let mut over = BTreeMap::new();
    over.insert("c.bias".to_string(), Tensor::new(1f32, &Device::Cpu).unwrap());
    let x = rand(&[1, 1, 5, 5], 1);
    let r = jit(|p: BTreeMap<String, Tracer>, x: Tracer| conv.forward_with(&Params::with(&p), &x)).call((&over, &x));
    assert!(matches!(r, Err(Error::Shape { op: "parameter", .. })), "{r:?}");
}

#[test]
fn overflowing_ranges_and_scalar_branches() {
    let x = rand(&[2, 3], 1);
    let r = jit(|x: Tracer| x.narrow(1, usize::MAX, 2)).call(&x);
    assert!(matches!(r, Err(Error::Shape { op: "narrow", .. })), "{r:?}");
    // scalar branches take the other branch's dtype, or f32
    let y = jit(|x: Tracer| x.gt(0.0)?.where_cond(1.5, -1.0)).call(&x).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let want = x
        .gt(0f32)
        .unwrap()
        .where_cond(
            &Tensor::full(1.5f32, (2, 3), &Device::Cpu).unwrap(),
            &Tensor::full(-1f32, (2, 3), &Device::Cpu).unwrap(),
        )
        .unwrap();
    common::assert_close(&y, &want, 0.0, "scalar branches");
    let z = jit(|x: Tracer| x.gt(0.0)?.where_cond(0.0, &x)).call(&x).unwrap();
    common::assert_close(
        &z,
        &x.relu().unwrap().neg().unwrap().add(&x).unwrap(),
        1e-6,
        "scalar true branch",
    );
    // squeeze of a larger axis leaves the tensor as it is, as in candle
    assert_eq!(jit(|x: Tracer| x.squeeze(0)).call(&x).unwrap().dims(), &[2, 3]);
}

/// Outputs keep no candle autograd history of their inputs: a training
/// loop whose parameters started as `Var`s grew by every step's
/// intermediates while they did. Stacked parameters are detached too.
#[test]
fn outputs_and_stacks_keep_no_candle_history() {
    // elementwise ops of the Var that candle itself runs (and would track)
    let w = candle_core::Var::from_tensor(&rand(&[4, 3], 1)).unwrap();
    let x = rand(&[4, 3], 2);
    let g = grad(|w: Tracer| w.sqr()?.sum_all()).call(w.as_tensor()).unwrap();
    let y = jit(|w: Tracer, x: Tracer| w.exp()?.add(&x))
        .call((w.as_tensor(), &x))
        .unwrap();
    for out in [&g, &y] {
        assert!(!out.track_op(), "an output tracks candle ops");
        let grads = out.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(w.as_tensor()).is_none(), "an output reaches the Var");
    }
    let vb = candle_nn::VarBuilder::from_varmap(&candle_nn::VarMap::new(), DType::F32, &Device::Cpu);
    let m = nn::linear(3, 2, vb).unwrap();
    let stacked = nn::stack_params(&[&m, &m]).unwrap();
    assert!(stacked.values().all(|t| !t.track_op() && !t.is_variable()));
}

/// ReLU keeps NaN and its gradient passes the cotangent there, in every
/// dtype (f16 and bf16 take candle's ops, f32 the crate's kernel).
#[test]
fn relu_and_its_gradient_keep_nan_in_every_float_dtype() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = Tensor::new(&[f32::NAN, 1.0, -1.0, 0.0], &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let values = |t: Tensor| -> Vec<f32> { t.to_dtype(DType::F32).unwrap().to_vec1().unwrap() };
        let y = values(jit(|x: Tracer| x.relu()).call(&x).unwrap());
        assert!(y[0].is_nan(), "{dt:?}: {y:?}");
        assert_eq!(&y[1..], &[1.0, 0.0, 0.0], "{dt:?}");
        let g = values(grad(|x: Tracer| x.relu()?.sum_all()).call(&x).unwrap());
        assert_eq!(g, vec![1.0, 1.0, 0.0, 0.0], "{dt:?}");
    }
}
