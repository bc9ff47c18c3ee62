//! Layers against candle_nn's own layers on the same weights (forward and
//! gradients), `functional_call` against the model's own forward,
//! ensembles of `stack_params` against each model alone, loading from
//! safetensors, losses, and dropout under `vmap`'s randomness settings.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_func::nn::{self, functional_call, stack_params, unstack_params, Module, Reduction};
use candle_func::{grad, vmap, Error, Randomness, Tracer};
use candle_nn::{Module as CandleModule, VarBuilder, VarMap};
use common::{assert_close, rand, rand_idx};
use std::collections::BTreeMap;

fn vb(varmap: &VarMap) -> VarBuilder<'_> {
    VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu)
}

#[test]
fn layers_match_candle_nn_forward_and_gradients() {
    let varmap = VarMap::new();
    let cfg = nn::ConvConfig {
        padding: 1,
        stride: 2,
        dilation: 1,
        groups: 2,
    };
    let ours_conv = nn::conv2d(4, 6, 3, cfg, vb(&varmap).pp("conv")).unwrap();
    let ours_fc = nn::linear(6 * 4 * 4, 5, vb(&varmap).pp("fc")).unwrap();
    // candle_nn's layers over the same variables (same names, same shapes)
    let ccfg = candle_nn::Conv2dConfig {
        padding: 1,
        stride: 2,
        dilation: 1,
        groups: 2,
        cudnn_fwd_algo: None,
    };
    let theirs_conv = candle_nn::conv2d(4, 6, 3, ccfg, vb(&varmap).pp("conv")).unwrap();
    let theirs_fc = candle_nn::linear(6 * 4 * 4, 5, vb(&varmap).pp("fc")).unwrap();
    let names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    assert_eq!(names.len(), 4, "{names:?}");
    let x = rand(&[3, 4, 8, 8], 1);
    let model = nn::seq()
        .add(ours_conv)
        .add(nn::Activation::Relu)
        .add(nn::Flatten)
        .add(ours_fc);
    let ours = model.forward_eager(&x).unwrap();
    let theirs = theirs_fc
        .forward(
            &theirs_conv
                .forward(&x)
                .unwrap()
                .relu()
                .unwrap()
                .flatten_from(1)
                .unwrap(),
        )
        .unwrap();
    assert_close(&ours, &theirs, 1e-5, "forward");
    // gradients with respect to every parameter
    let y = rand_idx(&[3], 5, 2);
    let g = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(&functional_call(&model, &p, &x)?, &y, Reduction::Mean)
    })
    .call((&model.params(), &x, &y))
    .unwrap();
    let vars: BTreeMap<String, Var> = varmap.data().lock().unwrap().clone().into_iter().collect();
    let store = candle_nn::loss::cross_entropy(&theirs, &y).unwrap().backward().unwrap();
    for (name, var) in &vars {
        assert_close(&g[name], store.get(var.as_tensor()).unwrap(), 1e-5, name);
    }
}

#[test]
fn functional_call_replaces_parameters_by_name() {
    let varmap = VarMap::new();
    let model = nn::seq()
        .add(nn::linear(3, 4, vb(&varmap).pp("a")).unwrap())
        .add(nn::Activation::Tanh)
        .add(nn::linear(4, 2, vb(&varmap).pp("b")).unwrap());
    let x = rand(&[5, 3], 1);
    let own = model.forward_eager(&x).unwrap();
    // all parameters passed explicitly: the same result
    let p = model.params();
    let same = candle_func::jit(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(&model, &p, &x))
        .call((&p, &x))
        .unwrap();
    assert_close(&same, &own, 1e-6, "functional_call with the model's parameters");
    // one replaced: b.bias doubled changes the output by b.bias
    let mut q = BTreeMap::new();
    q.insert("b.bias".to_string(), (&p["b.bias"] * 2.0).unwrap());
    let moved = candle_func::jit(|q: BTreeMap<String, Tracer>, x: Tracer| functional_call(&model, &q, &x))
        .call((&q, &x))
        .unwrap();
    assert_close(
        &(moved - &own).unwrap(),
        &p["b.bias"].unsqueeze(0).unwrap().broadcast_as((5, 2)).unwrap(),
        1e-6,
        "partial",
    );
    // unknown name and wrong shape are errors
    let mut bad = BTreeMap::new();
    bad.insert("c.weight".to_string(), rand(&[2, 2], 3));
    let r = candle_func::jit(|q: BTreeMap<String, Tracer>, x: Tracer| functional_call(&model, &q, &x)).call((&bad, &x));
    assert!(matches!(r, Err(Error::Tree { .. })), "{r:?}");
    let mut bad = BTreeMap::new();
    bad.insert("a.weight".to_string(), rand(&[3, 3], 3));
    let r = candle_func::jit(|q: BTreeMap<String, Tracer>, x: Tracer| functional_call(&model, &q, &x)).call((&bad, &x));
    assert!(
        matches!(
            r,
            Err(Error::Shape {
                op: "functional_call",
                ..
            })
        ),
        "{r:?}"
    );
}

fn small_cnn(vm: &VarMap) -> nn::Sequential {
    nn::seq()
        .add(nn::conv2d(1, 4, 3, Default::default(), vb(vm).pp("c1")).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::MaxPool2d { kernel: 2, stride: 1 })
        .add(nn::Flatten)
        .add(nn::linear(4 * 5 * 5, 3, vb(vm).pp("fc")).unwrap())
}

#[test]
fn stacked_ensembles_match_each_model_alone() {
    let vms: Vec<VarMap> = (0..3).map(|_| VarMap::new()).collect();
    let models: Vec<nn::Sequential> = vms.iter().map(small_cnn).collect();
    let refs: Vec<&nn::Sequential> = models.iter().collect();
    let stacked = stack_params(&refs).unwrap();
    assert_eq!(stacked["c1.weight"].dims(), &[3, 4, 1, 3, 3]);
    let x = rand(&[6, 1, 8, 8], 1);
    let own_x = rand(&[3, 6, 1, 8, 8], 2);
    let run = |p: BTreeMap<String, Tracer>, x: Tracer| functional_call(&models[0], &p, &x);
    let shared = vmap(run).in_dims([Some(0), None]).call((&stacked, &x)).unwrap();
    let own = vmap(run).call((&stacked, &own_x)).unwrap();
    for (i, m) in models.iter().enumerate() {
        assert_close(
            &shared.get(i).unwrap(),
            &m.forward_eager(&x).unwrap(),
            1e-5,
            "shared batch",
        );
        assert_close(
            &own.get(i).unwrap(),
            &m.forward_eager(&own_x.get(i).unwrap()).unwrap(),
            1e-5,
            "own batch",
        );
    }
    // the inverse, and writing back into a model
    let back = unstack_params(&stacked).unwrap();
    assert_close(&back[2]["fc.bias"], &models[2].params()["fc.bias"], 0.0, "unstack");
    nn::load_params(&vms[0], &back[1]).unwrap();
    assert_close(
        &models[0].forward_eager(&x).unwrap(),
        &models[1].forward_eager(&x).unwrap(),
        1e-6,
        "load_params",
    );
}

#[test]
fn models_load_from_safetensors_unchanged() {
    let vm = VarMap::new();
    let model = small_cnn(&vm);
    let path = std::env::temp_dir().join(format!("candle_func_nn_{}.safetensors", std::process::id()));
    vm.save(&path).unwrap();
    let loaded_vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu) }.unwrap();
    let loaded = nn::seq()
        .add(nn::conv2d(1, 4, 3, Default::default(), loaded_vb.pp("c1")).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::MaxPool2d { kernel: 2, stride: 1 })
        .add(nn::Flatten)
        .add(nn::linear(4 * 5 * 5, 3, loaded_vb.pp("fc")).unwrap());
    std::fs::remove_file(&path).ok();
    let x = rand(&[2, 1, 8, 8], 3);
    assert_close(
        &loaded.forward_eager(&x).unwrap(),
        &model.forward_eager(&x).unwrap(),
        0.0,
        "loaded",
    );
}

#[test]
fn vmap_of_model_forward_matches_the_batched_forward() {
    let vm = VarMap::new();
    let model = small_cnn(&vm);
    let xs = rand(&[7, 1, 8, 8], 4);
    let per_example = vmap(|x: Tracer| model.forward(&x.unsqueeze(0)?)?.squeeze(0))
        .call(&xs)
        .unwrap();
    assert_close(
        &per_example,
        &model.forward_eager(&xs).unwrap(),
        1e-5,
        "vmap(model.forward)",
    );
}

#[test]
fn losses_and_reductions() {
    let logits = rand(&[4, 3], 1);
    let y = rand_idx(&[4], 3, 2);
    let f = |r: Reduction| {
        candle_func::jit(move |l: Tracer, y: Tracer| nn::cross_entropy(&l, &y, r))
            .call((&logits, &y))
            .unwrap()
    };
    let want = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
    assert_close(&f(Reduction::Mean), &want, 1e-6, "mean");
    assert_close(&f(Reduction::Sum), &(want.clone() * 4.0).unwrap(), 1e-5, "sum");
    assert_eq!(f(Reduction::None).dims(), &[4]);
    let t = rand(&[4, 3], 3);
    let mse = candle_func::jit(|a: Tracer, b: Tracer| nn::mse(&a, &b, Reduction::Mean))
        .call((&logits, &t))
        .unwrap();
    assert_close(&mse, &candle_nn::loss::mse(&logits, &t).unwrap(), 1e-6, "mse");
}

#[test]
fn dropout_follows_the_randomness_setting() {
    let drop = nn::Dropout::new(0.5);
    let xs = Tensor::ones((64, 200), DType::F32, &Device::Cpu).unwrap();
    // evaluation mode: the identity, under vmap too
    let id = vmap(|x: Tracer| drop.forward(&x)).call(&xs).unwrap();
    assert_close(&id, &xs, 0.0, "eval");
    drop.train(true);
    // training mode: refused by default
    let r = vmap(|x: Tracer| drop.forward(&x)).call(&xs);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    // same: one mask for every example
    let same = vmap(|x: Tracer| drop.forward(&x))
        .randomness(Randomness::Same)
        .call(&xs)
        .unwrap();
    let first = same.get(0).unwrap();
    for i in 1..64 {
        assert_close(&same.get(i).unwrap(), &first, 0.0, "same mask");
    }
    // different: masks differ, each keeping about half, scaled by 2
    let diff = vmap(|x: Tracer| drop.forward(&x))
        .randomness(Randomness::Different)
        .call(&xs)
        .unwrap();
    assert!(common::max_diff(&diff.get(0).unwrap(), &diff.get(1).unwrap()) > 0.0);
    let mean = diff.mean_all().unwrap().to_scalar::<f32>().unwrap();
    assert!((mean - 1.0).abs() < 0.05, "E[dropout(x)] = x, got {mean}");
    let kept = diff
        .ne(0f32)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!((kept - 0.5).abs() < 0.02, "keep rate {kept}");
    drop.train(false);
}
