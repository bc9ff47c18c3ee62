//! One test per error variant a caller can meet: each is returned (never a
//! panic) and names the operation and the offending shapes.

mod common;

use candle_core::DType;
use candle_func::graph::TensorType;
use candle_func::{custom_op, jit, make_graph, vmap, Error, Tracer};
use common::rand;
use std::cell::RefCell;

#[test]
fn shape_mismatch_is_reported_while_tracing() {
    let a = rand(&[4, 2, 3], 1);
    let b = rand(&[4, 4, 5], 2);
    let err = vmap(|a: Tracer, b: Tracer| a.matmul(&b)).call((&a, &b)).unwrap_err();
    match &err {
        Error::Shape { op, shapes, .. } => {
            assert_eq!(*op, "matmul");
            assert_eq!(shapes, &vec![vec![2, 3], vec![4, 5]]);
        }
        e => panic!("expected Shape, got {e:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("matmul") && msg.contains("[2, 3]") && msg.contains("[4, 5]"),
        "{msg}"
    );
    // broadcasting and conv shapes too
    assert!(matches!(
        vmap(|a: Tracer| a.add(rand(&[7], 3))).call(&a),
        Err(Error::Shape { op: "add", .. })
    ));
    let x = rand(&[2, 1, 3, 8, 8], 4);
    let w = rand(&[4, 2, 3, 3], 5);
    assert!(matches!(
        vmap(|x: Tracer| x.conv2d(&w, 0, 1, 1, 1)).call(&x),
        Err(Error::Shape { op: "conv", .. })
    ));
}

#[test]
fn dtype_mismatch() {
    let a = rand(&[4, 3], 1);
    let b = rand(&[4, 3], 2).to_dtype(DType::F64).unwrap();
    match vmap(|a: Tracer, b: Tracer| a.mul(&b)).call((&a, &b)) {
        Err(Error::DType { op, dtypes, .. }) => {
            assert_eq!(op, "mul");
            assert_eq!(dtypes, vec![DType::F32, DType::F64]);
        }
        other => panic!("expected DType, got {other:?}"),
    }
}

#[test]
fn bad_in_dims() {
    let x = rand(&[4, 3], 1);
    match vmap(|x: Tracer| x.exp()).in_dims(2).call(&x) {
        Err(Error::InDims { arg: 0, msg }) => assert!(msg.contains("[4, 3]"), "{msg}"),
        other => panic!("expected InDims, got {other:?}"),
    }
    // a wrong count is the tree's shape, no one argument's
    let r = vmap(|x: Tracer, y: Tracer| x.add(&y)).in_dims([Some(0)]).call((&x, &x));
    assert!(matches!(r, Err(Error::Tree { .. })), "{r:?}");
    let r = vmap(|x: Tracer| x.exp()).in_dims([None::<i32>]).call(&x);
    assert!(matches!(r, Err(Error::InDims { .. })), "{r:?}");
}

#[test]
fn bad_out_dims() {
    let x = rand(&[4, 3], 1);
    let r = vmap(|x: Tracer| x.exp()).out_dims(3).call(&x);
    assert!(matches!(r, Err(Error::OutDims { output: 0, .. })), "{r:?}");
    let r = vmap(|x: Tracer| x.exp()).out_dims([None::<i32>]).call(&x);
    assert!(matches!(r, Err(Error::OutDims { .. })), "{r:?}");
}

#[test]
fn inconsistent_batch_sizes() {
    let x = rand(&[4, 3], 1);
    let y = rand(&[5, 3], 2);
    match vmap(|x: Tracer, y: Tracer| x.add(&y)).call((&x, &y)) {
        Err(Error::BatchSize { sizes, .. }) => assert_eq!(sizes, vec![(0, 0, 4), (1, 0, 5)]),
        other => panic!("expected BatchSize, got {other:?}"),
    }
}

#[test]
fn unsupported_in_strict_mode() {
    let x = rand(&[4, 3], 1);
    let f = vmap(|x: Tracer| custom_op("id", &[&x], x.tensor_type().clone(), |xs| Ok(xs[0].clone()))).strict(true);
    assert!(matches!(f.call(&x), Err(Error::Unsupported { transform: "vmap", .. })));
}

#[test]
fn tree_mismatch() {
    let x = rand(&[4, 3], 1);
    let g = make_graph(&jit(|x: Tracer| x.exp()), &x).unwrap();
    let r = g.run(&[rand(&[4, 4], 2)]);
    assert!(matches!(r, Err(Error::Tree { .. })), "{r:?}");
    let r = g.run(&[]);
    assert!(matches!(r, Err(Error::Tree { .. })), "{r:?}");
}

#[test]
fn bad_configuration() {
    let x = rand(&[4, 3], 1);
    let r = vmap(|x: Tracer| x.exp()).chunk_size(0).call(&x);
    assert!(matches!(r, Err(Error::Config { .. })), "{r:?}");
    let r: candle_func::Result<candle_func::ConvRoute> = "sideways".parse();
    assert!(matches!(r, Err(Error::Config { .. })), "{r:?}");
}

thread_local! {
    static LEAK: RefCell<Option<Tracer>> = const { RefCell::new(None) };
}

#[test]
fn escaped_tracer() {
    // A tracer kept from one trace and used in another is an error.
    let f = jit(|x: Tracer| {
        let stale = LEAK.with(|l| l.borrow().clone());
        LEAK.with(|l| *l.borrow_mut() = Some(x.clone()));
        match stale {
            Some(s) => x.add(&s),
            None => x.exp(),
        }
    });
    f.call(rand(&[3], 1)).unwrap();
    let r = f.call(rand(&[4], 2));
    assert!(matches!(r, Err(Error::Trace { .. })), "{r:?}");
}

#[test]
fn candle_errors_are_wrapped_with_their_source() {
    let x = rand(&[4, 3], 1);
    let f = jit(|x: Tracer| {
        custom_op("fails", &[&x], TensorType::new(vec![4, 3], DType::F32), |_| {
            candle_core::bail!("the kernel refused")
        })
    });
    match f.call(&x) {
        Err(e @ Error::Candle { .. }) => {
            assert!(e.to_string().contains("fails"), "{e}");
            assert!(std::error::Error::source(&e)
                .unwrap()
                .to_string()
                .contains("the kernel refused"));
        }
        other => panic!("expected Candle, got {other:?}"),
    }
    // a custom op that lies about its result type is caught
    let f = jit(|x: Tracer| {
        custom_op("liar", &[&x], TensorType::new(vec![2], DType::F32), |xs| {
            Ok(xs[0].clone())
        })
    });
    assert!(matches!(f.call(&x), Err(Error::Shape { op: "custom", .. })));
}

#[test]
fn a_conv_geometry_must_agree_with_the_weight() {
    let x = rand(&[1, 2, 6, 6], 1);
    let w = rand(&[4, 2, 3, 3], 2);
    let f = |k: usize| {
        let geom = candle_func::graph::ConvGeom::uniform(2, k, 0, 1, 1);
        make_graph(&jit(move |x: Tracer, w: Tracer| x.conv(&w, geom.clone(), 1)), (&x, &w))
    };
    assert!(f(0).is_ok(), "a kernel of 0 is taken from the weight");
    assert!(f(3).is_ok(), "the weight's own kernel");
    match f(5) {
        Err(Error::Shape { op: "conv", msg, .. }) => assert!(msg.contains("[5, 5]"), "{msg}"),
        other => panic!("a kernel other than the weight's must be an error, got {other:?}"),
    }
    // window sizes that overflow are an error, not a wrap
    let huge = candle_func::graph::ConvGeom::uniform(2, 3, usize::MAX / 2, 1, 1);
    assert!(huge.out_spatial(&[6, 6]).is_err());
    let g = make_graph(&jit(move |x: Tracer, w: Tracer| x.conv(&w, huge.clone(), 1)), (&x, &w));
    assert!(matches!(g, Err(Error::Shape { .. })), "{g:?}");
}

#[test]
fn sizes_that_overflow_are_shape_errors() {
    let x = rand(&[1, 2, 6, 6], 1);
    let w = rand(&[4, 1, 3, 3], 2);
    // groups whose channel count overflows
    let g = make_graph(
        &jit(|x: Tracer, w: Tracer| x.conv2d(&w, 0, 1, 1, usize::MAX / 2 + 1)),
        (&x, &w),
    );
    assert!(matches!(g, Err(Error::Shape { .. })), "{g:?}");
    // an unfold whose window count overflows
    let huge = candle_func::graph::ConvGeom::uniform(2, 3, usize::MAX / 8, 1, 1);
    let g = make_graph(&jit(move |x: Tracer| x.unfold(huge.clone())), &x);
    assert!(matches!(g, Err(Error::Shape { .. })), "{g:?}");
}

#[test]
fn graph_views_and_runners_take_bad_input_as_errors() {
    let x = rand(&[4, 3], 1);
    let g = make_graph(&jit(|x: Tracer| x.exp()), &x).unwrap();
    assert!(g.node(usize::MAX).is_none());
    assert!(g.node(g.nodes().count()).is_none());
    let wrong = rand(&[4, 4], 2);
    assert!(matches!(
        g.run_with_stats(std::slice::from_ref(&wrong)),
        Err(Error::Tree { .. })
    ));
    assert!(matches!(
        g.run_profiled(std::slice::from_ref(&wrong)),
        Err(Error::Tree { .. })
    ));
    let f64x = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(g.run(std::slice::from_ref(&f64x)), Err(Error::Tree { .. })));
    // the per-example schedule over zero examples, and with a bad in_dims
    let empty = candle_core::Tensor::zeros((0, 3), DType::F32, &candle_core::Device::Cpu).unwrap();
    let per = vmap(|x: Tracer| x.exp()).schedule(candle_func::Schedule::PerExample);
    assert_eq!(per.call(&empty).unwrap().dims(), &[0, 3]);
    let bad = vmap(|x: Tracer| x.exp())
        .in_dims(5)
        .schedule(candle_func::Schedule::PerExample);
    assert!(matches!(bad.call(&x), Err(Error::InDims { .. })));
}
