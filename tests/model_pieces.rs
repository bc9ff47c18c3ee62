//! The pieces the pretrained models are built from: `Tracer::stop_gradient`
//! passes values and blocks derivatives in every transform, an embedding's
//! `padding_idx` row is looked up as it is but gets no gradient (PyTorch's
//! semantics), and `nn::SelfAttention`'s fused projection (GPT-2's) equals
//! its three separate slices.

mod common;

use candle_core::{Device, Tensor};
use candle_func::nn::{Embedding, Module};
use candle_func::{grad, jit, jvp, vmap, Tracer};
use common::{assert_close as close, rand};

#[test]
fn stop_gradient_blocks_every_derivative_and_keeps_values() {
    let x = rand(&[5], 1);
    // d/dx sum(sg(x) * x) = sg(x) = x, where without it it would be 2x
    let f = |x: Tracer| x.stop_gradient()?.mul(&x)?.sum_all();
    close(&grad(f).call(&x).unwrap(), &x, 1e-6, "values");
    close(
        &jit(|x: Tracer| x.stop_gradient()).call(&x).unwrap(),
        &x,
        1e-6,
        "values",
    );
    let (y, t) = jvp(&|x: Tracer| x.stop_gradient()?.exp(), &x, &x.ones_like().unwrap()).unwrap();
    close(&y, &x.exp().unwrap(), 1e-6, "values");
    close(&t, &x.zeros_like().unwrap(), 1e-6, "values");
    // per example
    let xs = rand(&[3, 5], 2);
    close(&vmap(grad(f)).call(&xs).unwrap(), &xs, 1e-6, "values");
}

#[test]
fn a_padding_row_is_looked_up_but_gets_no_gradient() {
    let table = rand(&[6, 4], 3);
    let plain = Embedding::from_tensors(table.clone(), "emb");
    let padded = Embedding::from_tensors(table.clone(), "emb")
        .with_padding_idx(0)
        .unwrap();
    let ids = Tensor::new(&[0u32, 2, 0, 5], &Device::Cpu).unwrap();
    let run = |m: &Embedding| jit(|i: Tracer| m.forward(&i)).call(&ids).unwrap();
    close(&run(&padded), &run(&plain), 1e-6, "values");
    let g = grad(|t: Tracer, i: Tracer| {
        let p = std::collections::BTreeMap::from([("emb.weight".to_string(), t)]);
        padded
            .forward_with(&candle_func::nn::Params::with(&p), &i)?
            .sqr()?
            .sum_all()
    })
    .call((&table, &ids))
    .unwrap();
    let rows = g.to_vec2::<f32>().unwrap();
    assert!(rows[0].iter().all(|&v| v == 0.0), "the padding row got {:?}", rows[0]);
    assert!(rows[2].iter().any(|&v| v != 0.0) && rows[5].iter().any(|&v| v != 0.0));
    assert!(rows[1].iter().all(|&v| v == 0.0));
    assert!(Embedding::from_tensors(table, "emb").with_padding_idx(6).is_err());
}

#[test]
fn fused_and_separate_attention_projections_agree() {
    use candle_func::nn::{AttentionMask, Linear, Params, SelfAttention};
    // one fused [D, 3D] (GPT-2's layout) against its three [D, D] slices
    let (d, heads) = (8, 2);
    let w = rand(&[d, 3 * d], 4);
    let b = rand(&[3 * d], 5);
    let o = || Linear::from_tensors(rand(&[d, d], 6), None, "o");
    let fused = SelfAttention::fused(
        Linear::from_tensors_in_out(w.clone(), Some(b.clone()), "qkv"),
        o(),
        heads,
    )
    .unwrap();
    let part = |k: usize| {
        let wk = w.narrow(1, k * d, d).unwrap().t().unwrap().contiguous().unwrap();
        Linear::from_tensors(wk, Some(b.narrow(0, k * d, d).unwrap()), "p")
    };
    let separate = SelfAttention::separate(part(0), part(1), part(2), o(), heads, heads).unwrap();
    let mask = AttentionMask {
        window: None,
        causal: true,
        keep: None,
    };
    let x = rand(&[1, 5, d], 7);
    let run = |a: &SelfAttention| {
        jit(|x: Tracer| a.forward(&Params::own(), &x, &mask, 0.5, None))
            .call(&x)
            .unwrap()
    };
    close(&run(&fused), &run(&separate), 1e-6, "values");
    // grouped-query: key/value heads must divide the query heads
    assert!(SelfAttention::separate(part(0), part(1), part(2), o(), 3, 2).is_err());
}

#[test]
fn the_pieces_refuse_bad_shapes_and_propagate_nan() {
    use candle_core::DType;
    use candle_func::models::{causal_lm_loss, l2_normalize, mean_pool, Checkpoint};
    use candle_func::nn::{attend, merge_heads, split_heads, stack_vars, AttentionMask};
    use candle_func::Error;
    let shape_err = |r: candle_func::Result<Tensor>, op: &str| match r {
        Err(Error::Shape { op: o, .. }) if o == op => {}
        other => panic!(
            "{op}: expected a shape error, got {:?}",
            other.map(|t| t.dims().to_vec())
        ),
    };
    let ids = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    // pooling: hidden [T, D] with a mask of another length
    shape_err(
        jit(|h: Tracer, m: Tracer| mean_pool(&h, &m)).call((&rand(&[3, 4], 1), &rand(&[2], 2))),
        "mean_pool",
    );
    shape_err(
        jit(|x: Tracer| l2_normalize(&x.sum_all()?)).call(rand(&[3], 1)),
        "l2_normalize",
    );
    // the loss: logits of another length than the ids, and a single token
    shape_err(
        jit(|l: Tracer, i: Tracer| causal_lm_loss(&l, &i, None)).call((&rand(&[4, 5], 1), &ids)),
        "causal_lm_loss",
    );
    let one = Tensor::new(&[1u32], &Device::Cpu).unwrap();
    shape_err(
        jit(|l: Tracer, i: Tracer| causal_lm_loss(&l, &i, None)).call((&rand(&[1, 5], 1), &one)),
        "causal_lm_loss",
    );
    // heads that do not divide the features, queries and keys that disagree
    shape_err(
        jit(|x: Tracer| split_heads(&x, 3)).call(rand(&[1, 2, 8], 1)),
        "split_heads",
    );
    shape_err(
        jit(|x: Tracer| split_heads(&x, 0)).call(rand(&[1, 2, 8], 1)),
        "split_heads",
    );
    shape_err(jit(|x: Tracer| merge_heads(&x)).call(rand(&[2, 8], 1)), "merge_heads");
    let none = AttentionMask::default();
    shape_err(
        jit(|q: Tracer, k: Tracer| attend(&q, &k, &k, &none, 1.0))
            .call((&rand(&[1, 3, 4, 2], 1), &rand(&[1, 2, 4, 2], 2))),
        "attention",
    );
    let wrong = jit(|q: Tracer| {
        let mask = AttentionMask {
            window: None,
            causal: false,
            keep: Some(candle_func::tracer::Operand::to_tracer(
                &Tensor::ones((1, 5), DType::U32, &Device::Cpu)?,
                &q,
            )?),
        };
        attend(&q, &q, &q, &mask, 1.0)
    });
    shape_err(wrong.call(rand(&[1, 2, 4, 2], 1)), "attention");
    // an embedding table that is not [vocab, dim]
    shape_err(
        jit(|t: Tracer, i: Tracer| t.embedding(&i)).call((&rand(&[2, 3, 4], 1), &ids)),
        "embedding",
    );
    // NaN propagates through pooling, as in PyTorch
    let nan = Tensor::new(&[[f32::NAN, 1.0], [2.0, 3.0]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[1u32, 1], &Device::Cpu).unwrap();
    let pooled = jit(|h: Tracer, m: Tracer| mean_pool(&h, &m))
        .call((&nan, &mask))
        .unwrap();
    assert!(pooled.to_vec1::<f32>().unwrap()[0].is_nan());
    // a checkpoint computed in an integer dtype, and an ensemble of no models
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/bert_cls");
    assert!(matches!(
        Checkpoint::load(&dir, DType::U32, &Device::Cpu),
        Err(Error::Model { .. })
    ));
    assert!(stack_vars::<Embedding>(&[]).is_err());
}
