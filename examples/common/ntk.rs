//! The torch.func NTK tutorial's CNN and its two ways to the empirical NTK,
//! shared by `examples/ntk.rs` and the benchmark (`bench --only NTK`), and
//! mirrored by `benches/peers/bench_higher_order.py`.
#![allow(dead_code)]

use candle_core::{DType, Tensor};
use candle_func::jacobian::jvp_fn;
use candle_func::nn::{self, functional_call, Activation, ConvConfig, Sequential};
use candle_func::tracer::Operand;
use candle_func::{grad, jacrev, jit, vmap, Function, Tracer};
use std::collections::BTreeMap;

type Params = BTreeMap<String, Tensor>;
type Map = BTreeMap<String, Tracer>;

/// The tutorial's CNN, smaller: conv 3->16 k3, relu, conv 16->16 k3, relu,
/// flatten, linear to 10 classes, on 3x16x16 images.
pub fn cnn(vb: candle_nn::VarBuilder) -> candle_func::Result<Sequential> {
    let c = ConvConfig::default();
    Ok(nn::seq()
        .add(nn::conv2d(3, 16, 3, c, vb.pp("conv1"))?)
        .add(Activation::Relu)
        .add(nn::conv2d(16, 16, 3, c, vb.pp("conv2"))?)
        .add(Activation::Relu)
        .add(nn::Flatten)
        .add(nn::linear(16 * 12 * 12, 10, vb.pp("fc"))?))
}

/// The tutorial's `fnet_single`: one example's logits as a function of the
/// parameter map.
fn fnet_single(model: &Sequential) -> impl Fn(Map, Tracer) -> candle_func::Result<Tracer> + Copy + '_ {
    move |q: Map, x: Tracer| functional_call(model, &q, &x.unsqueeze(0)?)?.squeeze(0)
}

/// `[N1 a, P] . [N2 b, P]` summed over every parameter's `P` elements, as
/// `[N1, N2, a, b]`: the kernel from two maps of per-example Jacobians.
fn contract(a: Map, b: Map) -> candle_func::Result<Tracer> {
    let (mut k, mut dims): (Option<Tracer>, _) = (None, (0, 0, 0));
    for (name, ja) in &a {
        let jb = &b[name];
        dims = (ja.dims()[0], ja.dims()[1], jb.dims()[0]);
        let (n1, c, n2) = dims;
        let part = ja.reshape((n1 * c, ()))?.matmul(&jb.reshape((n2 * c, ()))?.t()?)?;
        k = Some(match k {
            Some(k) => k.add(&part)?,
            None => part,
        });
    }
    let k = k.ok_or_else(|| candle_func::Error::Tree {
        msg: "ntk: no parameters".into(),
    })?;
    let (n1, c, n2) = dims;
    k.reshape((n1, c, n2, c))?.permute(&[0, 2, 1, 3])
}

/// The NTK by Jacobian contraction: each example's Jacobian of the logits
/// with respect to every parameter (the tutorial's `vmap(jacrev(fnet_single),
/// (None, 0))`), then their inner products. Traced once per shape.
pub fn by_contraction(model: &Sequential) -> impl Fn(&Params, &Tensor, &Tensor) -> candle_func::Result<Tensor> + '_ {
    let jac = vmap(jacrev(fnet_single(model))).in_dims([None, Some(0)]);
    let contract = jit(contract);
    move |p, x1, x2| {
        let (j1, j2) = (jac.call((p, x1))?, jac.call((p, x2))?);
        contract.call((&j1, &j2))
    }
}

/// The NTK by NTK-vector products: for each pair of examples and each basis
/// vector `e_a` of the logits, a VJP at `x1_i` (a gradient of `<f(x1_i),
/// e_a>`) pushed forward at `x2_j` by a JVP, all under `vmap`; no Jacobian
/// is stored. Traced once per shape.
pub fn by_products(model: &Sequential) -> impl Fn(&Params, &Tensor, &Tensor) -> candle_func::Result<Tensor> + '_ {
    let f = fnet_single(model);
    let slice = move |x1: Tracer, x2: Tracer, e: Tracer, q: Map| -> candle_func::Result<Tracer> {
        // the VJP of f(., x1) with e: the gradient of <f(q, x1), e>
        let dot = |q: Map| f(q, x1.clone())?.mul(&e)?.sum_all();
        let v = Function::apply(&grad(dot), (q.clone(),))?;
        // pushed forward through f(., x2)
        Function::apply(&jvp_fn(|q: Map| f(q, x2.clone())), (q, v)).map(|(_, t)| t)
    };
    let by_basis = move |x1: Tracer, x2: Tracer, q: Map| {
        let classes = f(q.clone(), x1.clone())?.dims()[0];
        let e = Tensor::eye(classes, DType::F32, &x1.device())?.to_tracer(&x1)?;
        Function::apply(&vmap(slice).in_dims([None, None, Some(0), None]), (x1, x2, e, q))
    };
    let over_x2 = move |x1: Tracer, x2: Tracer, q: Map| {
        Function::apply(&vmap(by_basis).in_dims([None, Some(0), None]), (x1, x2, q))
    };
    // [N1, N2, classes (a), classes (b)]
    let vps = vmap(over_x2).in_dims([Some(0), None, None]);
    move |p, x1, x2| vps.call((x1, x2, p))
}
