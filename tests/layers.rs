//! The sequence-model layers against candle_nn's on one `VarMap` (the same
//! variables serve both), their gradients against candle's backward or
//! finite differences, their per-sample gradients against a loop, and the
//! attention masks and batch norm's modes.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_func::nn::{self, BlockConfig, Module, NormKind};
use candle_func::tracer::Operand;
use candle_func::{grad, jit, vmap, Error, Tracer};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_close, rand};
use std::collections::BTreeMap;

/// Every variable of `vm` set to random values (so ones and zeros from
/// the initialisers cannot hide a mistake).
fn randomise(vm: &VarMap, seed: u64) {
    let data = vm.data().lock().unwrap();
    for (i, (_, v)) in data.iter().enumerate() {
        let r = rand(v.dims(), seed + i as u64).to_dtype(v.dtype()).unwrap();
        v.set(&(r + 1.5).unwrap()).unwrap();
    }
}

fn vb(vm: &VarMap) -> VarBuilder<'static> {
    VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu)
}

#[test]
fn norms_and_embedding_match_candle_nn_on_one_varmap() {
    use candle_core::{Module as _, ModuleT as _};
    let vm = VarMap::new();
    let (ours_ln, theirs_ln) = (
        nn::layer_norm(6, 1e-5, vb(&vm).pp("ln")).unwrap(),
        candle_nn::layer_norm(6, 1e-5, vb(&vm).pp("ln")).unwrap(),
    );
    let ours_rms = nn::rms_norm(6, 1e-5, vb(&vm).pp("rms")).unwrap();
    let theirs_rms = candle_nn::rms_norm(6, 1e-5, vb(&vm).pp("rms")).unwrap();
    let ours_gn = nn::group_norm(2, 4, 1e-5, vb(&vm).pp("gn")).unwrap();
    let theirs_gn = candle_nn::group_norm(2, 4, 1e-5, vb(&vm).pp("gn")).unwrap();
    let ours_emb = nn::embedding(10, 6, vb(&vm).pp("emb")).unwrap();
    let theirs_emb = candle_nn::embedding(10, 6, vb(&vm).pp("emb")).unwrap();
    let cfg = candle_nn::BatchNormConfig {
        eps: 1e-5,
        ..Default::default()
    };
    let ours_bn = nn::batch_norm(4, 1e-5, vb(&vm).pp("bn")).unwrap();
    let theirs_bn = candle_nn::batch_norm(4, cfg, vb(&vm).pp("bn")).unwrap();
    randomise(&vm, 1);
    let x = (rand(&[3, 5, 6], 10) * 2.0).unwrap();
    let img = rand(&[3, 4, 5, 5], 11);
    let ids = Tensor::new(&[[1u32, 9, 0], [4, 4, 7]], &Device::Cpu).unwrap();
    let close = |a: &Tensor, b: &Tensor, what: &str| assert_close(a, b, 1e-5, what);
    close(
        &ours_ln.forward_eager(&x).unwrap(),
        &theirs_ln.forward(&x).unwrap(),
        "layer_norm",
    );
    close(
        &ours_rms.forward_eager(&x).unwrap(),
        &theirs_rms.forward(&x).unwrap(),
        "rms_norm",
    );
    close(
        &ours_gn.forward_eager(&img).unwrap(),
        &theirs_gn.forward(&img).unwrap(),
        "group_norm",
    );
    close(
        &ours_emb.forward_eager(&ids).unwrap(),
        &theirs_emb.forward(&ids).unwrap(),
        "embedding",
    );
    close(
        &ours_bn.forward_eager(&img).unwrap(),
        &theirs_bn.forward_t(&img, false).unwrap(),
        "batch_norm (evaluation)",
    );
    // training mode: the batch's statistics, as candle_nn's
    ours_bn.train(true);
    close(
        &ours_bn.forward_eager(&img).unwrap(),
        &theirs_bn.forward_t(&img, true).unwrap(),
        "batch_norm (training)",
    );
    // ... and under vmap an error that says why
    let r = vmap(|x: Tracer| ours_bn.forward(&x.unsqueeze(0)?)).call(&img);
    match r {
        Err(Error::Unsupported { msg, .. }) => assert!(msg.contains("other examples"), "{msg}"),
        other => panic!("expected an error, got {:?}", other.map(|_| ())),
    }
    ours_bn.train(false);
    assert!(vmap(|x: Tracer| ours_bn.forward(&x.unsqueeze(0)?)).call(&img).is_ok());
    // the parameters are the VarMap's own tensors, by candle_nn's names
    let names: Vec<String> = ours_ln.params().into_keys().collect();
    assert_eq!(names, vec!["ln.bias", "ln.weight"]);
    assert_eq!(ours_bn.params().len(), 2, "running statistics are not parameters");
    // bad input names the layer
    let r = ours_ln.forward_eager(&rand(&[2, 5], 12));
    assert!(
        matches!(r, Err(Error::Shape { op: "layer_norm", .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(nn::group_norm(3, 4, 1e-5, vb(&vm).pp("bad")).is_err());
}

#[test]
fn gradients_of_the_norms_match_candle_backward() {
    // candle's layer norm and group norm as differentiable operations
    let x = Var::from_tensor(&(rand(&[2, 4, 6], 20) * 2.0).unwrap()).unwrap();
    let w = Var::from_tensor(&rand(&[6], 21).affine(1.0, 1.5).unwrap()).unwrap();
    let b = Var::from_tensor(&rand(&[6], 22)).unwrap();
    let r = rand(&[2, 4, 6], 23);
    let mean = x.mean_keepdim(2).unwrap();
    let c = x.broadcast_sub(&mean).unwrap();
    let var = c.sqr().unwrap().mean_keepdim(2).unwrap();
    let y = c.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap()).unwrap();
    let y = y.broadcast_mul(&w).unwrap().broadcast_add(&b).unwrap();
    let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let ln = nn::LayerNorm::from_tensors(w.as_tensor().clone(), Some(b.as_tensor().clone()), 1e-5, "ln");
    let p = ln.params();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer| nn::functional_call(&ln, &p, &x)?.mul(&r)?.sum_all();
    let (gp, gx) = grad(loss).argnums::<0, 1>().call((&p, x.as_tensor())).unwrap();
    assert_close(&gx, g.get(&x).unwrap(), 1e-5, "d/dx");
    assert_close(&gp["ln.weight"], g.get(&w).unwrap(), 1e-5, "d/dweight");
    assert_close(&gp["ln.bias"], g.get(&b).unwrap(), 1e-5, "d/dbias");
}

#[test]
fn activations_match_candle_nn() {
    use candle_core::Module as _;
    let x = (rand(&[4, 5], 30) * 3.0).unwrap();
    let pairs = [
        (nn::Activation::Gelu, candle_nn::Activation::Gelu),
        (nn::Activation::GeluTanh, candle_nn::Activation::NewGelu),
        (nn::Activation::Silu, candle_nn::Activation::Silu),
        (nn::Activation::LeakyRelu(0.2), candle_nn::Activation::LeakyRelu(0.2)),
        (nn::Activation::Elu(0.7), candle_nn::Activation::Elu(0.7)),
        (nn::Activation::Sigmoid, candle_nn::Activation::Sigmoid),
    ];
    for (ours, theirs) in pairs {
        let got = jit(move |x: Tracer| ours.forward(&x)).call(&x).unwrap();
        assert_close(&got, &theirs.forward(&x).unwrap(), 1e-5, &format!("{ours:?}"));
    }
}

#[test]
fn rope_matches_candle_nn() {
    let x = rand(&[2, 3, 5, 8], 40);
    let (cos, sin) = nn::rotary_tables(8, 7, 10000.0, DType::F32, &Device::Cpu).unwrap();
    // candle_nn's kernels want the tables' first T rows
    let (c5, s5) = (cos.narrow(0, 0, 5).unwrap(), sin.narrow(0, 0, 5).unwrap());
    let want = candle_nn::rotary_emb::rope(&x, &c5, &s5).unwrap();
    let want_i = candle_nn::rotary_emb::rope_i(&x, &c5, &s5).unwrap();
    let (cos2, sin2) = (cos.clone(), sin.clone());
    let got = jit(move |x: Tracer| nn::rope(&x, &cos2.to_tracer(&x)?, &sin2.to_tracer(&x)?))
        .call(&x)
        .unwrap();
    let got_i = jit(move |x: Tracer| nn::rope_i(&x, &cos.to_tracer(&x)?, &sin.to_tracer(&x)?))
        .call(&x)
        .unwrap();
    assert_close(&got, &want, 1e-5, "rope");
    assert_close(&got_i, &want_i, 1e-5, "rope_i");
    let bad = jit(move |x: Tracer| nn::rope(&x, &x, &x)).call(&x);
    assert!(matches!(bad, Err(Error::Shape { op: "rope", .. })));
    assert!(nn::rotary_tables(7, 4, 1e4, DType::F32, &Device::Cpu).is_err());
}

#[test]
fn attention_masks_hide_what_they_should() {
    let vm = VarMap::new();
    let attn = nn::multi_head_attention(8, 2, true, vb(&vm).pp("attn")).unwrap();
    let x = rand(&[1, 5, 8], 50);
    let y = jit(|x: Tracer| attn.forward(&x)).call(&x).unwrap();
    // causal: changing the last position changes only the last output
    let mut v = x.to_vec3::<f32>().unwrap();
    v[0][4] = vec![3.0; 8];
    let x2 = Tensor::new(v, &Device::Cpu).unwrap();
    let y2 = jit(|x: Tracer| attn.forward(&x)).call(&x2).unwrap();
    assert_close(
        &y.narrow(1, 0, 4).unwrap(),
        &y2.narrow(1, 0, 4).unwrap(),
        1e-6,
        "causal",
    );
    assert!(common::max_diff(&y.narrow(1, 4, 1).unwrap(), &y2.narrow(1, 4, 1).unwrap()) > 1e-3);
    // the crate's one mask convention (nonzero: a real token, as the
    // models' attention_mask): a padded key changes no other position's
    // output
    let open = nn::multi_head_attention(8, 2, false, vb(&vm).pp("open")).unwrap();
    let keep = Tensor::new(&[[1u8, 1, 0, 1, 1]], &Device::Cpu).unwrap();
    let f = |x: Tracer, m: Tracer| open.forward_with_mask(&nn::Params::own(), &x, Some(&m));
    let mut v = x.to_vec3::<f32>().unwrap();
    v[0][2] = vec![-2.0; 8];
    let x3 = Tensor::new(v, &Device::Cpu).unwrap();
    let (a, b) = (jit(f).call((&x, &keep)).unwrap(), jit(f).call((&x3, &keep)).unwrap());
    for t in [0, 1, 3, 4] {
        assert_close(
            &a.narrow(1, t, 1).unwrap(),
            &b.narrow(1, t, 1).unwrap(),
            1e-6,
            "padding mask",
        );
    }
    // every token real: the unmasked layer; no token real: finite (each
    // query averages the hidden keys, as Hugging Face's eager attention)
    let all = Tensor::ones((1, 5), DType::U8, &Device::Cpu).unwrap();
    let plain = jit(|x: Tracer| open.forward(&x)).call(&x).unwrap();
    assert_close(&jit(f).call((&x, &all)).unwrap(), &plain, 1e-6, "all real");
    let none = jit(f).call((&x, &all.zeros_like().unwrap())).unwrap();
    let finite = |t: &Tensor| {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    };
    assert!(finite(&none), "a fully hidden query is finite");
    // a block takes the models' mask the same way
    let c = BlockConfig {
        dim: 8,
        heads: 2,
        ff: 16,
        causal: false,
        norm: NormKind::LayerNorm,
        act: nn::Activation::Gelu,
    };
    let block = nn::transformer_block(c, vb(&vm).pp("blk")).unwrap();
    let fb = |x: Tracer, m: Tracer| block.forward_with_mask(&nn::Params::own(), &x, Some(&m));
    let (a, b) = (jit(fb).call((&x, &keep)).unwrap(), jit(fb).call((&x3, &keep)).unwrap());
    assert_close(
        &a.narrow(1, 0, 2).unwrap(),
        &b.narrow(1, 0, 2).unwrap(),
        1e-6,
        "block mask",
    );
    let r = jit(f).call((&x, &Tensor::zeros((1, 4), DType::U8, &Device::Cpu).unwrap()));
    assert!(matches!(r, Err(Error::Shape { op: "attention", .. })));
    assert!(nn::multi_head_attention(8, 3, false, vb(&vm).pp("bad")).is_err());
    // against attention written out eagerly with candle
    let p = open.params();
    let lin = |n: &str, h: &Tensor| {
        h.broadcast_matmul(&p[&format!("open.{n}.weight")].t().unwrap())
            .unwrap()
            .broadcast_add(&p[&format!("open.{n}.bias")])
            .unwrap()
    };
    let heads = |t: Tensor| {
        t.reshape((1, 5, 2, 4))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (q, k, vv) = (heads(lin("q", &x)), heads(lin("k", &x)), heads(lin("v", &x)));
    let s = (q.matmul(&k.t().unwrap()).unwrap() / 2.0).unwrap();
    let o = candle_nn::ops::softmax_last_dim(&s).unwrap().matmul(&vv).unwrap();
    let o = o.transpose(1, 2).unwrap().reshape((1, 5, 8)).unwrap();
    let got = jit(|x: Tracer| open.forward(&x)).call(&x).unwrap();
    assert_close(&got, &lin("o", &o), 1e-5, "attention written out");
}

#[test]
fn gpt_per_sample_gradients_equal_a_loop() {
    use nn::{BlockConfig, CrossEntropy, NormKind};
    let vm = VarMap::new();
    let block = BlockConfig {
        dim: 8,
        heads: 2,
        ff: 16,
        causal: true,
        norm: NormKind::RmsNorm,
        act: nn::Activation::Silu,
    };
    let m = nn::gpt(11, 6, 2, block, vb(&vm)).unwrap();
    let p = m.params();
    assert!(p.contains_key("blocks.1.ff2.bias") && p.contains_key("head.weight") && !p.contains_key("head.bias"));
    let xs = Tensor::new(
        &[[1u32, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1], [0, 0, 10, 10, 3, 3]],
        &Device::Cpu,
    )
    .unwrap();
    let ys = Tensor::new(
        &[[2u32, 3, 4, 5, 6, 0], [5, 4, 3, 2, 1, 0], [0, 10, 10, 3, 3, 1]],
        &Device::Cpu,
    )
    .unwrap();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = nn::functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        nn::cross_entropy_with(&logits, &y, CrossEntropy::default())
    };
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((&p, &xs, &ys))
        .unwrap();
    for i in 0..3 {
        let one = grad(loss).call((&p, &xs.get(i).unwrap(), &ys.get(i).unwrap())).unwrap();
        for (name, g) in &one {
            assert_close(&per[name].get(i).unwrap(), g, 1e-5, &format!("example {i} {name}"));
        }
    }
    // a sequence longer than the position table is an error naming the model
    let long = Tensor::zeros((1, 7), DType::U32, &Device::Cpu).unwrap();
    assert!(matches!(m.forward_eager(&long), Err(Error::Shape { op: "gpt", .. })));
    // float ids, and ids beyond the vocabulary
    let float_ids = Tensor::zeros((1, 3), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        m.forward_eager(&float_ids),
        Err(Error::Shape { op: "gpt", .. })
    ));
    let far = Tensor::new(&[[3u32, 11, 0]], &Device::Cpu).unwrap();
    assert!(m.forward_eager(&far).is_err(), "id 11 of a vocabulary of 11");
}

#[test]
fn losses_match_their_definitions() {
    let logits = (rand(&[6, 5], 60) * 3.0).unwrap();
    let y = Tensor::new(&[0i64, 4, 2, -100, 1, 3], &Device::Cpu).unwrap();
    let ce = |o: nn::CrossEntropy| {
        jit(move |l: Tracer, y: Tracer| nn::cross_entropy_with(&l, &y, o))
            .call((&logits, &y))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let lp = candle_nn::ops::log_softmax(&logits, 1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let kept = [0usize, 1, 2, 4, 5];
    let labels = [0usize, 4, 2, 0, 1, 3];
    let nll: f32 = kept.iter().map(|&i| -lp[i][labels[i]]).sum::<f32>() / 5.0;
    let ignore = nn::CrossEntropy {
        ignore_index: Some(-100),
        ..Default::default()
    };
    assert!((ce(ignore) - nll).abs() < 1e-5, "ignore_index: {} vs {nll}", ce(ignore));
    let s = 0.1;
    let smooth: f32 = kept
        .iter()
        .map(|&i| (1.0 - s) * -lp[i][labels[i]] + s * -lp[i].iter().sum::<f32>() / 5.0)
        .sum::<f32>()
        / 5.0;
    let o = nn::CrossEntropy {
        label_smoothing: s as f64,
        ..ignore
    };
    assert!((ce(o) - smooth).abs() < 1e-5, "label smoothing: {} vs {smooth}", ce(o));
    // an out-of-range label that is not ignored is an error, as in PyTorch
    assert!(
        jit(|l: Tracer, y: Tracer| nn::cross_entropy_with(&l, &y, Default::default()))
            .call((&logits, &y))
            .is_err()
    );
    // sequences [N, T, C], against candle_nn's on the flattened positions
    let seq = rand(&[2, 3, 5], 61);
    let t = Tensor::new(&[[1u32, 0, 4], [2, 2, 3]], &Device::Cpu).unwrap();
    let got = jit(|l: Tracer, y: Tracer| nn::cross_entropy_with(&l, &y, Default::default()))
        .call((&seq, &t))
        .unwrap();
    let want = candle_nn::loss::cross_entropy(&seq.reshape((6, 5)).unwrap(), &t.flatten_all().unwrap()).unwrap();
    assert_close(&got, &want, 1e-6, "sequence cross-entropy");
    // bce, l1, huber
    let (a, b) = (rand(&[4, 3], 62), rand(&[4, 3], 63).affine(0.5, 0.5).unwrap());
    let bce = jit(|a: Tracer, b: Tracer| nn::bce_with_logits(&a, &b, nn::Reduction::Mean))
        .call((&a, &b))
        .unwrap();
    assert_close(
        &bce,
        &candle_nn::loss::binary_cross_entropy_with_logit(&a, &b).unwrap(),
        1e-6,
        "bce",
    );
    let l1 = jit(|a: Tracer, b: Tracer| nn::l1(&a, &b, nn::Reduction::Sum))
        .call((&a, &b))
        .unwrap();
    assert_close(&l1, &(&a - &b).unwrap().abs().unwrap().sum_all().unwrap(), 1e-6, "l1");
    let hub = jit(|a: Tracer, b: Tracer| nn::huber(&a, &b, 0.3, nn::Reduction::None))
        .call((&a, &b))
        .unwrap();
    let d = (&a - &b).unwrap().to_vec2::<f32>().unwrap();
    let want: Vec<Vec<f32>> = d
        .iter()
        .map(|r| {
            r.iter()
                .map(|&d| {
                    if d.abs() < 0.3 {
                        0.5 * d * d
                    } else {
                        0.3 * (d.abs() - 0.15)
                    }
                })
                .collect()
        })
        .collect();
    assert_close(&hub, &Tensor::new(want, &Device::Cpu).unwrap(), 1e-6, "huber");
    assert!(jit(|a: Tracer, b: Tracer| nn::huber(&a, &b, 0.0, nn::Reduction::Mean))
        .call((&a, &b))
        .is_err());
}

#[test]
fn candle_nn_layers_convert_sharing_their_tensors() {
    use candle_core::{Module as _, ModuleT as _};
    let vm = VarMap::new();
    let v = vb(&vm);
    let lin = candle_nn::linear(6, 4, v.pp("lin")).unwrap();
    let c1cfg = candle_nn::Conv1dConfig {
        padding: 1,
        stride: 2,
        groups: 2,
        ..Default::default()
    };
    let c1 = candle_nn::conv1d(4, 6, 3, c1cfg, v.pp("c1")).unwrap();
    let c2cfg = candle_nn::Conv2dConfig {
        padding: 1,
        dilation: 2,
        ..Default::default()
    };
    let c2 = candle_nn::conv2d(3, 5, 3, c2cfg, v.pp("c2")).unwrap();
    let t1cfg = candle_nn::ConvTranspose1dConfig {
        padding: 1,
        output_padding: 1,
        stride: 2,
        dilation: 1,
        groups: 2,
    };
    let t1 = candle_nn::conv_transpose1d(4, 6, 3, t1cfg, v.pp("t1")).unwrap();
    let t2cfg = candle_nn::ConvTranspose2dConfig {
        padding: 1,
        output_padding: 1,
        stride: 2,
        dilation: 1,
    };
    let t2 = candle_nn::conv_transpose2d(3, 5, 3, t2cfg, v.pp("t2")).unwrap();
    let emb = candle_nn::embedding(9, 6, v.pp("emb")).unwrap();
    let ln = candle_nn::layer_norm(6, 1e-5, v.pp("ln")).unwrap();
    let rms = candle_nn::rms_norm(6, 1e-5, v.pp("rms")).unwrap();
    let bn = candle_nn::batch_norm(3, 1e-5, v.pp("bn")).unwrap();
    // a same-named layer of ours from the VarMap is the same variables
    let ours_t2 = nn::conv_transpose2d(
        3,
        5,
        3,
        nn::ConvConfig {
            padding: 1,
            stride: 2,
            ..Default::default()
        },
        1,
        v.pp("t2"),
    )
    .unwrap();
    randomise(&vm, 70);
    let (x6, s4, img) = (rand(&[2, 3, 6], 71), rand(&[2, 4, 9], 72), rand(&[2, 3, 7, 7], 73));
    let ids = Tensor::new(&[[0u32, 8, 3]], &Device::Cpu).unwrap();
    let eq = |a: Tensor, b: Tensor, what: &str| assert_close(&a, &b, 1e-5, what);
    eq(
        nn::Linear::from_candle(&lin, "lin").forward_eager(&x6).unwrap(),
        lin.forward(&x6).unwrap(),
        "Linear",
    );
    eq(
        nn::Conv::from_candle_conv1d(&c1, "c1").forward_eager(&s4).unwrap(),
        c1.forward(&s4).unwrap(),
        "Conv1d",
    );
    eq(
        nn::Conv::from_candle_conv2d(&c2, "c2").forward_eager(&img).unwrap(),
        c2.forward(&img).unwrap(),
        "Conv2d",
    );
    eq(
        nn::ConvTranspose::from_candle_1d(&t1, "t1").forward_eager(&s4).unwrap(),
        t1.forward(&s4).unwrap(),
        "ConvTranspose1d",
    );
    let twin_t2 = nn::ConvTranspose::from_candle_2d(&t2, "t2");
    eq(
        twin_t2.forward_eager(&img).unwrap(),
        t2.forward(&img).unwrap(),
        "ConvTranspose2d",
    );
    eq(
        ours_t2.forward_eager(&img).unwrap(),
        t2.forward(&img).unwrap(),
        "conv_transpose2d from one VarMap",
    );
    eq(
        nn::Embedding::from_candle(&emb, "emb").forward_eager(&ids).unwrap(),
        emb.forward(&ids).unwrap(),
        "Embedding",
    );
    let ln_twin = nn::Norm::from_candle(&ln, "ln").unwrap();
    assert!(matches!(ln_twin, nn::Norm::Layer(_)));
    eq(
        ln_twin.forward_eager(&x6).unwrap(),
        ln.forward(&x6).unwrap(),
        "LayerNorm",
    );
    eq(
        nn::RmsNorm::from_candle(&rms, "rms").forward_eager(&x6).unwrap(),
        rms.forward(&x6).unwrap(),
        "RmsNorm",
    );
    // candle_nn's LayerNorm built as an RMS norm is recognised as one
    let as_rms = candle_nn::LayerNorm::rms_norm(rms.weight().clone(), 1e-5);
    let twin = nn::Norm::from_candle(&as_rms, "rms").unwrap();
    assert!(matches!(twin, nn::Norm::Rms(_)));
    eq(
        twin.forward_eager(&x6).unwrap(),
        as_rms.forward(&x6).unwrap(),
        "LayerNorm::rms_norm",
    );
    eq(
        nn::BatchNorm::from_candle(&bn, "bn").forward_eager(&img).unwrap(),
        bn.forward_t(&img, false).unwrap(),
        "BatchNorm",
    );
    // shared, not copied: a change to the variable shows in the twin
    let twin = nn::Linear::from_candle(&lin, "lin");
    assert_eq!(twin.params().keys().collect::<Vec<_>>(), vec!["lin.bias", "lin.weight"]);
    vm.data().lock().unwrap()["lin.weight"]
        .set(&Tensor::zeros((4, 6), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let b = lin
        .bias()
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .broadcast_as((2, 3, 4))
        .unwrap();
    eq(twin.forward_eager(&x6).unwrap(), b, "shared weight");
}

/// Bad input to the sequence layers is an error naming the layer.
#[test]
fn bad_input_to_the_layers_is_an_error() {
    let vm = VarMap::new();
    let attn = nn::multi_head_attention(8, 2, true, vb(&vm).pp("a")).unwrap();
    let r = attn.forward_eager(&rand(&[5, 8], 80));
    assert!(
        matches!(r, Err(Error::Shape { op: "attention", .. })),
        "{:?}",
        r.map(|_| ())
    );
    let rms = nn::rms_norm(6, 1e-5, vb(&vm).pp("r")).unwrap();
    assert!(matches!(
        rms.forward_eager(&rand(&[2, 5], 81)),
        Err(Error::Shape { op: "rms_norm", .. })
    ));
    let bn = nn::batch_norm(3, 1e-5, vb(&vm).pp("b")).unwrap();
    assert!(matches!(
        bn.forward_eager(&rand(&[2, 4, 5, 5], 82)),
        Err(Error::Shape { op: "batch_norm", .. })
    ));
    let gn = nn::group_norm(2, 4, 1e-5, vb(&vm).pp("g")).unwrap();
    assert!(matches!(
        gn.forward_eager(&rand(&[2, 3, 5, 5], 83)),
        Err(Error::Shape { op: "group_norm", .. })
    ));
    let cfg = nn::ConvConfig {
        groups: 2,
        ..Default::default()
    };
    assert!(matches!(
        nn::conv_transpose2d(3, 4, 3, cfg, 0, vb(&vm).pp("t")),
        Err(Error::Config { .. })
    ));
    let emb = nn::embedding(5, 4, vb(&vm).pp("e")).unwrap();
    assert!(emb.forward_eager(&rand(&[2, 3], 84)).is_err(), "float ids");
    assert!(
        emb.forward_eager(&Tensor::new(&[[1u32, 5]], &Device::Cpu).unwrap())
            .is_err(),
        "id 5 of 5"
    );
    let ints = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    for f in [
        |x: Tracer| x.var_keepdim(0),
        |x: Tracer| x.leaky_relu(0.1),
        |x: Tracer| x.elu(1.0),
    ] {
        assert!(matches!(jit(f).call(&ints), Err(Error::DType { .. })));
    }
}
