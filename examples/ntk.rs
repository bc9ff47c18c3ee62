//! The empirical neural tangent kernel of a small CNN, as in the
//! torch.func NTK tutorial, two ways:
//!
//! * Jacobian contraction: each example's Jacobian of the logits with
//!   respect to all parameters (`vmap(jacrev)`), then
//!   `ntk[i, j, a, b] = <J(x1_i)[a], J(x2_j)[b]>`;
//! * NTK-vector products: for each pair of examples and each basis vector
//!   `e_a` of the logits, a VJP at `x1_i` (a gradient of `<f(x1_i), e_a>`)
//!   pushed forward at `x2_j` by a JVP, all under `vmap`; no Jacobian is
//!   stored.
//!
//! ```text
//! cargo run --release --example ntk
//! ```
//! Both give the same kernel; the times are medians of 5 runs.
mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, Activation, ConvConfig, Module, Sequential};
use candle_func::{grad, jacrev, jit, jvp_fn, vmap, Function, Operand, Tracer};
use std::collections::BTreeMap;

type Params = BTreeMap<String, Tensor>;

/// The tutorial's CNN, smaller: conv 3->16 k3, relu, conv 16->16 k3, relu,
/// flatten, linear to 10 classes, on 3x16x16 images.
fn cnn(vb: candle_nn::VarBuilder) -> candle_func::Result<Sequential> {
    let c = ConvConfig::default();
    Ok(nn::seq()
        .add(nn::conv2d(3, 16, 3, c, vb.pp("conv1"))?)
        .add(Activation::Relu)
        .add(nn::conv2d(16, 16, 3, c, vb.pp("conv2"))?)
        .add(Activation::Relu)
        .add(nn::Flatten)
        .add(nn::linear(16 * 12 * 12, 10, vb.pp("fc"))?))
}

/// The parameters as one flat vector (in name order) and back.
fn flat(p: &Params) -> candle_core::Result<Tensor> {
    let parts: Vec<Tensor> = p
        .values()
        .map(|t| t.flatten_all())
        .collect::<candle_core::Result<_>>()?;
    Tensor::cat(&parts, 0)
}

fn unflat(theta: &Tracer, like: &Params) -> candle_func::Result<BTreeMap<String, Tracer>> {
    let mut at = 0;
    let mut out = BTreeMap::new();
    for (k, t) in like {
        out.insert(k.clone(), theta.narrow(0, at, t.elem_count())?.reshape(t.dims())?);
        at += t.elem_count();
    }
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let (_vm, model) = common::models::build(cnn)?;
    let p = model.params();
    let theta = flat(&p)?;
    let (x1, x2) = (
        Tensor::randn(0f32, 1., (20, 3, 16, 16), &dev)?,
        Tensor::randn(0f32, 1., (5, 3, 16, 16), &dev)?,
    );
    // logits of one example as a function of the flat parameters
    let logits = |th: &Tracer, x: &Tracer| -> candle_func::Result<Tracer> {
        functional_call(&model, &unflat(th, &p)?, &x.unsqueeze(0)?)?.squeeze(0)
    };

    // 1. Jacobian contraction
    let jac = vmap(|x: Tracer, th: Tracer| {
        let f = |th: Tracer| logits(&th, &x);
        Function::apply(&jacrev(f), (th,))
    })
    .in_dims([Some(0), None]);
    let contract = jit(|a: Tracer, b: Tracer| {
        let (n1, c, np) = (a.dims()[0], a.dims()[1], a.dims()[2]);
        let n2 = b.dims()[0];
        let k = a.reshape((n1 * c, np))?.matmul(&b.reshape((n2 * c, np))?.t()?)?;
        k.reshape((n1, c, n2, c))?.permute(&[0, 2, 1, 3])
    });
    let full = || -> candle_func::Result<Tensor> {
        let (j1, j2) = (jac.call((&x1, &theta))?, jac.call((&x2, &theta))?);
        contract.call((&j1, &j2))
    };

    // 2. NTK-vector products: vmap over x1, x2 and the logits' basis
    let classes = 10;
    let basis = Tensor::eye(classes, DType::F32, &dev)?;
    let slice = |x1: Tracer, x2: Tracer, e: Tracer, th: Tracer| -> candle_func::Result<Tracer> {
        // the VJP of f(., x1) with e: the gradient of <f(th, x1), e>
        let dot = |th: Tracer| logits(&th, &x1)?.mul(&e)?.sum_all();
        let v = Function::apply(&grad(dot), (th.clone(),))?;
        // pushed forward through f(., x2)
        let f2 = |th: Tracer| logits(&th, &x2);
        Function::apply(&jvp_fn(f2), (th, v)).map(|(_, t)| t)
    };
    let by_basis = |x1: Tracer, x2: Tracer, th: Tracer| {
        let e = basis.to_tracer(&x1)?;
        Function::apply(&vmap(slice).in_dims([None, None, Some(0), None]), (x1, x2, e, th))
    };
    let over_x2 = |x1: Tracer, x2: Tracer, th: Tracer| {
        Function::apply(&vmap(by_basis).in_dims([None, Some(0), None]), (x1, x2, th))
    };
    // [N1, N2, classes (a), classes (b)]
    let vps = vmap(over_x2).in_dims([Some(0), None, None]);

    let k_full = full()?;
    let k_vps = vps.call((&x1, &x2, &theta))?;
    let diff = (&k_full - &k_vps)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = k_full.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    println!("empirical NTK [N1, N2, classes, classes] = {:?}", k_full.dims());
    println!("the two methods agree: max difference {diff:.2e} (scale {scale:.2e})");
    let t_full = common::median_ms(5, || full().map(|_| ()))?;
    let t_vps = common::median_ms(5, || vps.call((&x1, &x2, &theta)).map(|_| ()))?;
    println!(
        "Jacobian contraction: {t_full:.1} ms; NTK-vector products: {t_vps:.1} ms ({})",
        common::allocator()
    );
    assert!(diff <= 1e-3 * scale.max(1.0), "the two NTKs differ");
    Ok(())
}
