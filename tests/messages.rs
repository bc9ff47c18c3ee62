//! Error messages a user can act on: each names the user's operation and
//! the values they passed (not an internal shape, a primitive the call was
//! lowered to, or candle's backtrace). One test per class of message.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{functional_call, Module};
use candle_func::{dp, hvp, jit, vhp, vmap, Error, Tracer};
use common::rand;
use std::collections::BTreeMap;

fn text<T>(r: candle_func::Result<T>) -> (Error, String) {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let s = e.to_string();
            (e, s)
        }
    }
}

/// Errors that pass through candle's error type, produced under
/// `RUST_BACKTRACE=1`. Run in a child process (below) so that the setting
/// is read fresh: the standard library caches it at the first capture.
#[test]
#[ignore = "run by errors_carry_no_backtrace_under_rust_backtrace in a child process"]
fn child_errors_under_rust_backtrace() {
    // the setting is live, or this test would pass for nothing
    let probe = std::backtrace::Backtrace::capture();
    assert_eq!(probe.status(), std::backtrace::BacktraceStatus::Captured);
    let mut msgs = Vec::new();
    // a candle error a user's closure returns with `?`
    let e: Error = candle_core::Error::msg("boom").into();
    msgs.push(e.to_string());
    // a checkpoint without the tensor a layer needs
    let vb = candle_nn::VarBuilder::from_tensors(Default::default(), DType::F32, &Device::Cpu);
    msgs.push(text(candle_func::nn::linear(4, 2, vb.pp("lin"))).1);
    // checks built on candle's messages: reshape and convolution geometry
    msgs.push(text(jit(|x: Tracer| x.reshape((5, 2))).call(rand(&[3, 3], 1))).1);
    let x = rand(&[2, 3, 4, 4], 2);
    msgs.push(text(jit(|x: Tracer| x.conv2d(rand(&[5, 3, 7, 7], 3), 0, 1, 1, 1)).call(&x)).1);
    msgs.push(text(jit(|x: Tracer| x.conv2d(rand(&[5, 3, 3, 3], 3), 0, 0, 1, 1)).call(&x)).1);
    for m in msgs {
        assert!(
            !m.contains("Error::bt") && !m.contains("backtrace") && m.lines().count() <= 2,
            "a backtrace in the message:\n{m}"
        );
    }
}

#[test]
fn errors_carry_no_backtrace_under_rust_backtrace() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_errors_under_rust_backtrace",
            "--ignored",
            "--nocapture",
        ])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
}

#[test]
fn convolution_geometry_names_the_setting_and_its_value() {
    let x = rand(&[2, 3, 4, 4], 1);
    let conv = |w: Tensor, pad: usize, stride: usize, dil: usize, groups: usize| {
        text(jit(move |x: Tracer| x.conv2d(&w, pad, stride, dil, groups)).call(&x)).1
    };
    let m = conv(rand(&[5, 3, 3, 3], 2), 0, 0, 1, 1);
    assert!(m.contains("stride must be positive, got stride [0, 0]"), "{m}");
    let m = conv(rand(&[5, 3, 3, 3], 2), 0, 1, 0, 1);
    assert!(m.contains("dilation must be positive, got dilation [0, 0]"), "{m}");
    let m = conv(rand(&[5, 3, 7, 7], 2), 1, 1, 1, 1);
    assert!(m.contains("spans 7") && m.contains("is 4 (6 with padding 1"), "{m}");
    assert!(!m.contains("ConvGeom {"), "a debug dump instead of the settings: {m}");
    let m = conv(rand(&[5, 3, 3, 3], 2), 0, 1, 1, 0);
    assert!(m.contains("groups must be positive, got 0"), "{m}");
    let m = conv(rand(&[4, 3, 3, 3], 2), 0, 1, 1, 2);
    assert!(
        m.contains("the input has 3 channels") && m.contains("2 groups = 6"),
        "{m}"
    );
}

#[test]
fn reshape_names_both_shapes_and_counts() {
    let (e, m) = text(jit(|x: Tracer| x.reshape((5, 2))).call(rand(&[3, 3], 1)));
    assert!(matches!(e, Error::Shape { op: "reshape", .. }), "{e:?}");
    assert!(
        m.contains("cannot reshape [3, 3] (9 elements) into [5, 2] (10 elements)"),
        "{m}"
    );
    let m = text(jit(|x: Tracer| x.reshape((2, ()))).call(rand(&[3, 3], 1))).1;
    assert!(m.contains("[3, 3] (9 elements)"), "{m}");
}

#[test]
fn pooling_names_the_kernel_and_stride() {
    let x = rand(&[2, 3, 4, 4], 1);
    let m = text(jit(|x: Tracer| x.max_pool2d(0)).call(&x)).1;
    assert!(
        m.contains("max_pool2d") && m.contains("kernel must be positive, got kernel (0, 0)"),
        "{m}"
    );
    let m = text(jit(|x: Tracer| x.avg_pool2d_with_stride(2, (1, 0))).call(&x)).1;
    assert!(m.contains("avg_pool2d") && m.contains("stride (1, 0)"), "{m}");
    let m = text(jit(|x: Tracer| x.max_pool2d(5)).call(&x)).1;
    assert!(
        m.contains("kernel (5, 5) is larger than the input's H x W = (4, 4)"),
        "{m}"
    );
}

#[test]
fn functional_call_lists_both_dtypes() {
    let vs = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vs, DType::F32, &Device::Cpu);
    let lin = candle_func::nn::linear(4, 2, vb.pp("lin")).unwrap();
    let w64 = rand(&[2, 4], 1).to_dtype(DType::F64).unwrap();
    let f = |w: Tracer, x: Tracer| functional_call(&lin, &BTreeMap::from([("lin.weight".to_string(), w)]), &x);
    match jit(f).call((&w64, &rand(&[3, 4], 2))) {
        Err(Error::DType { op, dtypes, msg }) => {
            assert_eq!((op, dtypes), ("functional_call", vec![DType::F32, DType::F64]));
            assert!(msg.contains("lin.weight") && msg.contains("F64"), "{msg}");
        }
        other => panic!("expected a dtype error, got {:?}", other.map(|_| ())),
    }
    let m = text(jit(f).call((&rand(&[4, 2], 1), &rand(&[3, 4], 2)))).1;
    assert!(m.contains("is [2, 4]") && m.contains("[4, 2]"), "{m}");
}

#[test]
fn transposed_convolution_reports_the_users_shapes() {
    let x = rand(&[2, 3, 4, 4], 1);
    let w = rand(&[3, 5, 3, 3], 2);
    for (stride, dil, groups, says) in [
        (0, 1, 1, "stride must be positive, got stride [0, 0]"),
        (1, 0, 1, "dilation must be positive"),
        (1, 1, 2, "divide the 3 input channels, got groups = 2"),
    ] {
        let w = w.clone();
        let (e, m) = text(jit(move |x: Tracer| x.conv_transpose2d(&w, 0, 0, stride, dil, groups)).call(&x));
        match &e {
            Error::Shape { op, shapes, .. } => {
                assert_eq!(*op, "conv_transpose", "{m}");
                assert_eq!(shapes, &vec![vec![2, 3, 4, 4], vec![3, 5, 3, 3]], "{m}");
            }
            e => panic!("expected a shape error, got {e:?}"),
        }
        assert!(m.contains(says), "{m}");
    }
    // batched weights: the shapes are still one example's, as the user wrote them
    let ws = rand(&[2, 3, 5, 3, 3], 3);
    let f = |x: Tracer, w: Tracer| x.unsqueeze(0)?.conv_transpose2d(&w, 0, 0, 1, 1, 2);
    let (e, _) = text(vmap(f).call((&x, &ws)));
    assert!(
        matches!(&e, Error::Shape { op: "conv_transpose", shapes, .. } if shapes == &vec![vec![1, 3, 4, 4], vec![3, 5, 3, 3]]),
        "{e:?}"
    );
}

#[test]
fn hessian_vector_products_name_themselves() {
    let not_scalar = |x: Tracer| x.sqr();
    for (name, r) in [
        ("hvp", hvp(&not_scalar, &rand(&[3], 1), &rand(&[3], 2))),
        ("vhp", vhp(&not_scalar, &rand(&[3], 1), &rand(&[3], 2))),
    ] {
        let (e, m) = text(r);
        assert!(matches!(&e, Error::Shape { op, .. } if *op == name), "{name}: {e:?}");
        assert!(m.contains("scalar"), "{m}");
    }
    let f = |x: Tracer| x.sqr()?.sum_all();
    let m = text(hvp(&f, &rand(&[3], 1), &rand(&[4], 2))).1;
    assert!(
        m.starts_with("tree structure mismatch: hvp:") && !m.contains("jvp"),
        "{m}"
    );
}

#[test]
fn embedding_ids_out_of_range_are_reported_as_embedding() {
    let vs = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vs, DType::F32, &Device::Cpu);
    let emb = candle_func::nn::embedding(10, 4, vb.pp("emb")).unwrap();
    let ids = Tensor::new(&[[1u32, 12], [3, 4]], &Device::Cpu).unwrap();
    let check = |r: candle_func::Result<Tensor>| {
        let (e, m) = text(r);
        assert!(matches!(e, Error::Shape { op: "embedding", .. }), "{e:?}");
        assert!(m.contains("token id 12") && m.contains("table of 10 rows"), "{m}");
    };
    check(emb.forward_eager(&ids));
    // a shared table, per-example ids
    check(vmap(|i: Tracer| emb.forward(&i)).call(&ids));
    // an ensemble of tables with per-example ids: lowered to a gather
    let tables = rand(&[2, 10, 4], 1);
    check(vmap(|t: Tracer, i: Tracer| t.embedding(&i)).call((&tables, &ids)));
    // index_select keeps its own name
    let (e, _) =
        text(jit(|t: Tracer, i: Tracer| t.index_select(&i, 0)).call((&rand(&[10, 4], 1), &ids.flatten_all().unwrap())));
    assert!(matches!(e, Error::Shape { op: "index_select", .. }), "{e:?}");
}

#[test]
fn a_wrong_count_of_in_dims_blames_no_argument() {
    let (a, b) = (rand(&[2, 3], 1), rand(&[2, 3], 2));
    for (dims, says) in [
        (vec![Some(0i32), Some(0), Some(0)], "3 entries given for 2 arguments"),
        (vec![Some(0i32)], "1 entries given for 2 arguments"),
    ] {
        let (e, m) = text(vmap(|a: Tracer, b: Tracer| a.add(&b)).in_dims(dims).call((&a, &b)));
        assert!(matches!(e, Error::Tree { .. }), "{e:?}");
        assert!(
            m.contains("in_dims") && m.contains(says) && !m.contains("argument 0"),
            "{m}"
        );
    }
    let (e, m) = text(vmap(|a: Tracer| a.exp()).out_dims(vec![Some(0i32), Some(0)]).call(&a));
    assert!(matches!(e, Error::Tree { .. }) && m.contains("out_dims"), "{e:?}");
}

#[test]
fn per_sample_norms_name_both_leaves() {
    let grads = BTreeMap::from([("a".to_string(), rand(&[4, 3], 1)), ("b".to_string(), rand(&[5, 3], 2))]);
    let m = text(dp::norm_per_sample(&grads)).1;
    assert!(
        m.contains("\"a\" and \"b\"") && m.contains("[4, 3]") && m.contains("[5, 3]"),
        "{m}"
    );
}
