//! `grad` against candle's own `backward()` on the same computation, and
//! per-sample gradients (`vmap(grad)`, every route) against a loop of
//! candle `backward()` calls, one example at a time, for the fixture models
//! whose layers candle can differentiate correctly. candle 0.11's max-pool
//! backward scales the gradient by 1/(kh*kw), and its avg-pool backward
//! spreads gradient onto rows and columns no window covers when the kernel
//! does not tile the input; those layers are checked against PyTorch's
//! numbers (tests/fixtures.rs) and finite differences (tests/grad_fd.rs)
//! instead, and the models here avoid them.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_func::{grad, vmap, ConvRoute, Tracer};
use common::arch::{cross_entropy, forward, forward_eager, parse};
use common::{assert_close, rand, rand_idx};
use std::collections::BTreeMap;

/// candle's gradients of `loss(params)` for every parameter.
fn candle_grads(
    params: &BTreeMap<String, Tensor>,
    loss: impl Fn(&BTreeMap<String, Tensor>) -> candle_core::Result<Tensor>,
) -> BTreeMap<String, Tensor> {
    let vars: BTreeMap<String, Var> = params
        .iter()
        .map(|(k, v)| (k.clone(), Var::from_tensor(v).unwrap()))
        .collect();
    let ts: BTreeMap<String, Tensor> = vars.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    let store = loss(&ts).unwrap().backward().unwrap();
    vars.iter()
        .map(|(k, v)| (k.clone(), store.get(v.as_tensor()).unwrap().clone()))
        .collect()
}

fn candle_ce(logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(logits, y)
}

#[test]
fn grad_matches_candle_backward_on_an_mlp() {
    let mut p = BTreeMap::new();
    p.insert("w1".to_string(), rand(&[16, 8], 1));
    p.insert("b1".to_string(), rand(&[16], 2));
    p.insert("w2".to_string(), rand(&[5, 16], 3));
    let x = rand(&[12, 8], 4);
    let y = rand_idx(&[12], 5, 5);
    let ours = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let h = x.matmul(&p["w1"].t()?)?.add(&p["b1"])?.tanh()?;
        let h = h.maximum(&h.sigmoid()?.affine(0.5, 0.0)?)?;
        let logits = h.matmul(&p["w2"].t()?)?;
        let lp = logits.log_softmax(1)?;
        lp.gather(&y.unsqueeze(1)?, 1)?.neg()?.mean_all()
    })
    .call((&p, &x, &y))
    .unwrap();
    let theirs = candle_grads(&p, |p| {
        let h = x.matmul(&p["w1"].t()?)?.broadcast_add(&p["b1"])?.tanh()?;
        let h = h.maximum(&(candle_nn::ops::sigmoid(&h)? * 0.5)?)?;
        candle_ce(&h.matmul(&p["w2"].t()?)?, &y)
    });
    for (k, g) in &ours {
        assert_close(g, &theirs[k], 1e-5, k);
    }
}

#[test]
fn grad_matches_candle_backward_on_a_cnn() {
    let mut p = BTreeMap::new();
    p.insert("c1".to_string(), rand(&[4, 2, 3, 3], 1));
    p.insert("c2".to_string(), rand(&[6, 2, 3, 3], 2)); // groups 2
    p.insert("fc".to_string(), rand(&[3, 24], 3));
    let x = rand(&[5, 2, 10, 10], 4);
    let sel = Tensor::new(&[2u32, 0, 1], &Device::Cpu).unwrap();
    let ours = grad(|p: BTreeMap<String, Tracer>, x: Tracer| {
        let h = x.conv2d(&p["c1"], 1, 1, 1, 1)?.relu()?.avg_pool2d(2)?; // 5 4 5 5
        let h = h.conv2d(&p["c2"], 0, 1, 1, 2)?.relu()?.avg_pool2d(1)?; // 5 6 3 3
        let h = h.narrow(2, 0, 2)?.narrow(3, 0, 2)?.flatten_from(1)?; // 5 24
        let o = h.matmul(&p["fc"].t()?)?.index_select(&sel, 1)?;
        o.softmax(1)?.sqr()?.sum_all()
    })
    .call((&p, &x))
    .unwrap();
    let theirs = candle_grads(&p, |p| {
        let h = x.conv2d(&p["c1"], 1, 1, 1, 1)?.relu()?.avg_pool2d(2)?;
        let h = h.conv2d(&p["c2"], 0, 1, 1, 2)?.relu()?.avg_pool2d(1)?;
        let h = h.narrow(2, 0, 2)?.narrow(3, 0, 2)?.flatten_from(1)?;
        let o = h.matmul(&p["fc"].t()?)?.index_select(&sel, 1)?;
        candle_nn::ops::softmax(&o, 1)?.sqr()?.sum_all()
    });
    for (k, g) in &ours {
        assert_close(g, &theirs[k], 1e-4, k);
    }
}

/// Per-sample gradients against candle backward, one example at a time.
fn per_sample_against_candle(arch: &str, input: &[usize], classes: usize, batch: usize, seed: u64) {
    let layers = parse(arch);
    // parameter shapes from a dry run of the architecture
    let mut params = BTreeMap::new();
    let mut s = seed;
    let mut shape = input.to_vec();
    for l in &layers {
        use common::arch::Layer::*;
        match l {
            Conv {
                name,
                nd,
                k,
                s: st,
                p,
                d,
                g,
                bias,
                ..
            } => {
                let cout = 4;
                params.insert(
                    format!("{name}.weight"),
                    rand(&[&[cout, shape[0] / g], &vec![*k; *nd][..]].concat(), s),
                );
                if *bias {
                    params.insert(format!("{name}.bias"), rand(&[cout], s + 1));
                }
                let sp: Vec<usize> = shape[1..]
                    .iter()
                    .map(|&n| (n + 2 * p - d * (k - 1) - 1) / st + 1)
                    .collect();
                shape = [&[cout], &sp[..]].concat();
            }
            Linear { name, bias, .. } => {
                let fin: usize = shape.iter().product();
                params.insert(format!("{name}.weight"), rand(&[classes, fin], s));
                if *bias {
                    params.insert(format!("{name}.bias"), rand(&[classes], s + 1));
                }
                shape = vec![classes];
            }
            MaxPool { k, s: st } | AvgPool { k, s: st } => {
                shape = vec![shape[0], (shape[1] - k) / st + 1, (shape[2] - k) / st + 1];
            }
            _ => {}
        }
        s += 2;
    }
    let xs = rand(&[&[batch], input].concat(), seed + 100);
    let ys = rand_idx(&[batch], classes, seed + 101).to_dtype(DType::I64).unwrap();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        cross_entropy(&forward(&layers, &p, &x.unsqueeze(0)?)?.squeeze(0)?, &y)
    };
    for route in [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop] {
        let ours = vmap(grad(loss))
            .in_dims([None, Some(0), Some(0)])
            .conv_route(route)
            .call((&params, &xs, &ys))
            .unwrap();
        for i in 0..batch {
            let (x, y) = (xs.narrow(0, i, 1).unwrap(), ys.narrow(0, i, 1).unwrap());
            let theirs = candle_grads(&params, |p| candle_ce(&forward_eager(&layers, p, &x)?, &y));
            for (k, g) in &ours {
                assert_close(
                    &g.get(i).unwrap(),
                    &theirs[k],
                    1e-4,
                    &format!("{arch} {route:?} example {i} {k}"),
                );
            }
        }
    }
}

#[test]
fn per_sample_gradients_match_a_loop_of_candle_backward() {
    per_sample_against_candle("flatten;fc1=linear(64,32);tanh;fc2=linear(32,10)", &[1, 8, 8], 10, 6, 1);
    per_sample_against_candle(
        "c1=conv2d(3,8,k=3,s=2,p=1);relu;c2=conv2d(4,8,k=3,p=1);relu;avgpool2d(k=2,s=2);flatten;fc=linear(32,5)",
        &[3, 7, 7],
        5,
        4,
        2,
    );
    per_sample_against_candle(
        "c1=conv2d(2,4,k=3,g=2);relu;avgpool2d(k=3,s=3);flatten;fc=linear(16,4)",
        &[2, 8, 8],
        4,
        5,
        3,
    );
    per_sample_against_candle("c1=conv1d(2,4,k=3,d=2);tanh;flatten;fc=linear(16,3)", &[2, 8], 3, 4, 4);
    per_sample_against_candle(
        "c1=conv3d(1,4,k=3);relu;c2=conv3d(4,4,k=3,s=2);relu;flatten;fc=linear(32,4)",
        &[1, 8, 8, 8],
        4,
        3,
        5,
    );
}
