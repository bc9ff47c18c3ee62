//! A program written against the previous release's paths still builds
//! for one release and computes what the new paths compute: every moved or
//! renamed item keeps a deprecated alias (the warnings are the point, so
//! they are allowed here and nowhere else).
#![allow(deprecated)]

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::Module;
use candle_func::{dp, grad, vmap, Tracer};
use common::{max_diff, rand};
use std::collections::BTreeMap;

fn same(a: &Tensor, b: &Tensor) {
    let d = max_diff(a, b) as f32;
    assert!(d == 0.0, "the old path differs by {d}");
}

#[test]
fn moved_functions_and_types_work_at_their_old_paths() {
    let x = rand(&[3], 1);
    let f = |x: Tracer| x.tanh()?.sum_all();
    // the *_fn forms at the root, and their types
    let old: candle_func::HvpFn<_> = candle_func::hvp_fn(f);
    let new = candle_func::jacobian::hvp_fn(f);
    same(&old.call((&x, &x)).unwrap(), &new.call((&x, &x)).unwrap());
    let old: candle_func::JvpFn<_> = candle_func::jvp_fn(|x: Tracer| x.exp());
    let (_, t) = old.call((&x, &x)).unwrap();
    same(&t, &candle_func::jvp(&|x: Tracer| x.exp(), &x, &x).unwrap().1);
    // trees and dims
    let dims: candle_func::Dims = vec![candle_func::DimTree::from(0)].into();
    let ys = vmap(|x: Tracer| x.exp()).in_dims(dims).call(rand(&[2, 3], 2)).unwrap();
    assert_eq!(ys.dims(), &[2, 3]);
    // settings and the planner
    assert_eq!(candle_func::cache_capacity(), candle_func::settings::cache_capacity());
    assert_eq!(candle_func::ROUTE_ENV, candle_func::settings::ROUTE_ENV);
    assert_eq!(
        candle_func::auto_choices().len(),
        candle_func::planner::auto_choices().len()
    );
    // the graph's types
    let g = candle_func::make_graph(&|x: Tracer| x.exp(), &x).unwrap();
    let t: candle_func::TensorType = g.input_types()[0].clone();
    assert_eq!(t.shape, vec![3]);
    let _: Option<candle_func::RunStats> = None;
    // a gradient's type names
    let _: candle_func::Grad<fn(Tracer) -> candle_func::Result<Tracer>> = grad(|x: Tracer| x.sum_all());
    // Options' getters
    let o = candle_func::Options::new().chunk_size(4);
    assert_eq!(o.get_chunk_size(), o.chunk_size);
}

#[test]
fn renamed_dp_items_work_under_their_old_names() {
    let grads = BTreeMap::from([("w".to_string(), rand(&[4, 3], 1))]);
    same(
        &dp::per_sample_norms(&grads).unwrap(),
        &dp::norm_per_sample(&grads).unwrap(),
    );
    let old = dp::accountant::noise_multiplier_for(2.0, 1e-5, 0.01, 1000).unwrap();
    let new = dp::accountant::noise_multiplier(dp::accountant::Mechanism::Rdp, 2.0, 1e-5, 0.01, 1000).unwrap();
    assert_eq!(old, new);
    // the old seeded generator's name draws the new one's stream
    let (mut a, mut b) = (dp::rng::Rng::new(7), dp::rng::Rng::seeded(7));
    let shape = [5];
    same(
        &a.normal_tensor(1.0, &shape, DType::F32, &Device::Cpu).unwrap(),
        &b.normal_tensor(1.0, &shape, DType::F32, &Device::Cpu).unwrap(),
    );
}

#[test]
fn forward_t_runs_the_module_eagerly() {
    let vs = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vs, DType::F32, &Device::Cpu);
    let lin = candle_func::nn::linear(4, 2, vb.pp("fc")).unwrap();
    let x = rand(&[3, 4], 3);
    same(&lin.forward_t(&x).unwrap(), &lin.forward_eager(&x).unwrap());
}

#[test]
fn the_key_padding_attention_keeps_its_inverted_mask() {
    use candle_func::{jit, nn};
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let x = rand(&[1, 5, 8], 50);
    let attn = nn::multi_head_attention(8, 2, false, vb.pp("a")).unwrap();
    let keep = Tensor::new(&[[1u8, 1, 0, 1, 1]], &Device::Cpu).unwrap();
    let pad = keep.eq(0u8).unwrap();
    let p = nn::Params::own();
    let old = |x: Tracer, k: Tracer| attn.forward_masked(&p, &x, Some(&k));
    let new = |x: Tracer, k: Tracer| attn.forward_with_mask(&p, &x, Some(&k));
    // each mask in its own reading: the same output
    let (a, b) = (jit(old).call((&x, &pad)).unwrap(), jit(new).call((&x, &keep)).unwrap());
    assert!(max_diff(&a, &b) < 1e-6);
    // and the old NaN where every key is padding
    let all = Tensor::ones((1, 5), DType::U8, &Device::Cpu).unwrap();
    let hidden = jit(old)
        .call((&x, &all))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(hidden.iter().any(|v| v.is_nan()));
    // the block alike
    let c = nn::BlockConfig {
        dim: 8,
        heads: 2,
        ff: 16,
        causal: false,
        norm: nn::NormKind::LayerNorm,
        act: nn::Activation::Gelu,
    };
    let block = nn::transformer_block(c, vb.pp("b")).unwrap();
    let old = |x: Tracer, k: Tracer| block.forward_masked(&p, &x, Some(&k));
    let new = |x: Tracer, k: Tracer| block.forward_with_mask(&p, &x, Some(&k));
    let (a, b) = (jit(old).call((&x, &pad)).unwrap(), jit(new).call((&x, &keep)).unwrap());
    assert!(max_diff(&a, &b) < 1e-6);
    // the padding constructors of the 0.2 development builds: the same
    // layers (same weights from the same VarMap paths), read as padding
    let attn_pad = nn::multi_head_attention_key_padding(8, 2, false, vb.pp("a")).unwrap();
    let via = |x: Tracer, k: Tracer| attn_pad.forward_masked(&p, &x, Some(&k));
    let attn_new = |x: Tracer, k: Tracer| attn.forward_with_mask(&p, &x, Some(&k));
    let (a, b) = (
        jit(via).call((&x, &pad)).unwrap(),
        jit(attn_new).call((&x, &keep)).unwrap(),
    );
    assert!(max_diff(&a, &b) < 1e-6);
    let block_pad = nn::transformer_block_key_padding(c, vb.pp("b")).unwrap();
    let via = |x: Tracer, k: Tracer| block_pad.forward_masked(&p, &x, Some(&k));
    let (a, b) = (jit(via).call((&x, &pad)).unwrap(), jit(new).call((&x, &keep)).unwrap());
    assert!(max_diff(&a, &b) < 1e-6);
    // bad heads are the same error as the new constructor's
    assert!(nn::multi_head_attention_key_padding(8, 3, false, vb.pp("bad")).is_err());
}

/// The names that had two paths (issue 48): the optimisers at `dp::`, the
/// generator at `dp::rng::`, the losses at `nn::loss::`; each old path is
/// a deprecated alias of the one path kept, and computes what it does.
#[test]
fn second_paths_are_deprecated_aliases_of_the_first() {
    let varmap = candle_nn::VarMap::new();
    let w = varmap
        .get((2,), "w", candle_nn::Init::Const(1.0), DType::F32, &Device::Cpu)
        .unwrap();
    let g = BTreeMap::from([("w".to_string(), Tensor::new(&[1f32, -1.0], &Device::Cpu).unwrap())]);
    let mut old: dp::Sgd = dp::Sgd::new(&varmap, 0.5, 0.0).unwrap();
    candle_func::optim::Optimizer::step(&mut old, &g).unwrap();
    same(&w, &Tensor::new(&[0.5f32, 1.5], &Device::Cpu).unwrap());
    let _: dp::AdamW = candle_func::optim::AdamW::new(&varmap, 1e-3, 0.0).unwrap();
    let (mut a, mut b) = (dp::rng::Rng::seeded(3), candle_func::rng::Rng::seeded(3));
    assert_eq!(a.next_u64(), b.next_u64());
    let (p, t) = (rand(&[4], 5), rand(&[4], 6));
    let old = |p: Tracer, t: Tracer| candle_func::nn::loss::mse(&p, &t, candle_func::nn::loss::Reduction::Sum);
    let new = |p: Tracer, t: Tracer| candle_func::nn::mse(&p, &t, candle_func::nn::Reduction::Sum);
    same(
        &candle_func::jit(old).call((&p, &t)).unwrap(),
        &candle_func::jit(new).call((&p, &t)).unwrap(),
    );
}
