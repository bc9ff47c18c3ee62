//! Bad or edge input through the public API gets a clear error or the
//! answer PyTorch gives, never a panic: integer dtypes in float-only
//! operations, integer division by zero, NaN through max-pool, `max` and
//! `maximum`, labels out of range, sizes beyond `isize`, gradients of
//! integers, DP settings that would silently zero or poison gradients,
//! malformed `Auto` caches, and caches that stay bounded.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{cross_entropy, Reduction};
use candle_func::{grad, jit, vmap, Error, Tracer};
use common::{assert_close, rand};
use std::panic::{catch_unwind, AssertUnwindSafe};

type Un = fn(Tracer) -> candle_func::Result<Tracer>;

const INTS: [DType; 3] = [DType::U8, DType::U32, DType::I64];

/// `f`'s result, or a test failure naming `what` if it panicked.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| panic!("{what} panicked"))
}

fn dtype_error<T: std::fmt::Debug>(r: candle_func::Result<T>, op: &str) {
    match r {
        Err(Error::DType { op: o, .. }) if o == op => {}
        other => panic!("expected a dtype error from {op}, got {other:?}"),
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn integer_operands_are_computed_or_refused_by_name() {
    let d = Device::Cpu;
    for dt in INTS {
        let x = Tensor::new(&[[1u32, 2, 3], [0, 5, 7]], &d)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        // computed as PyTorch does (unsigned negation wraps, as for uint8)
        let neg = no_panic("neg", || jit(|x: Tracer| x.neg()).call(&x)).unwrap();
        let modulus = match dt {
            DType::U8 => 256.0,
            DType::U32 => 4294967296.0,
            _ => 0.0,
        };
        let want: Vec<f64> = values(&x)
            .iter()
            .map(|&v| if modulus > 0.0 { (modulus - v) % modulus } else { -v })
            .collect();
        assert_eq!(values(&neg), want, "{dt:?} neg");
        let sqr = no_panic("sqr", || jit(|x: Tracer| x.sqr()).call(&x)).unwrap();
        assert_eq!(values(&sqr), vec![1., 4., 9., 0., 25., 49.], "{dt:?} sqr");
        // refused by name: float-only operations
        let cases: [(&str, Un); 5] = [
            ("softmax", |x| x.softmax(1)),
            ("softmax", |x| x.log_softmax(1)),
            ("mean", |x| x.mean(1)),
            ("unary", |x| x.exp()),
            ("unary", |x| x.tanh()),
        ];
        for (op, f) in cases {
            dtype_error(no_panic(op, || jit(f).call(&x)), op);
        }
        let img = x.reshape((1, 1, 2, 3)).unwrap();
        dtype_error(
            no_panic("avg_pool2d", || jit(|x: Tracer| x.avg_pool2d(2)).call(&img)),
            "avg_pool2d",
        );
        // integer division: by zero an error, else truncating as candle does
        let z = x.zeros_like().unwrap();
        dtype_error(
            no_panic("div", || jit(|a: Tracer, b: Tracer| a.div(&b)).call((&x, &z))),
            "div",
        );
        let ones = x.ones_like().unwrap();
        let q = jit(|a: Tracer, b: Tracer| a.div(&b)).call((&x, &ones)).unwrap();
        assert_eq!(values(&q), values(&x));
    }
}

#[test]
fn gradients_of_or_with_respect_to_integers_are_errors() {
    let i = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    let f = rand(&[3], 1);
    dtype_error(grad(|x: Tracer| x.to_dtype(DType::F32)?.sum_all()).call(&i), "grad");
    dtype_error(grad(|x: Tracer| x.sum_all()).call(&i), "grad");
    // an integer argument that is not differentiated is fine
    let g = grad(|x: Tracer, i: Tracer| x.mul(&i.to_dtype(DType::F32)?)?.sum_all())
        .call((&f, &i))
        .unwrap();
    assert_eq!(values(&g), vec![1., 2., 3.]);
}

#[test]
fn nan_propagates_as_in_pytorch() {
    let d = Device::Cpu;
    let nan = f32::NAN;
    // max-pool: a NaN anywhere in the window wins, not only when first
    for img in [[[1f32, nan], [3., 2.]], [[nan, 1.], [3., 2.]], [[1., 2.], [3., nan]]] {
        let x = Tensor::new(&[[img]], &d).unwrap();
        let y = jit(|x: Tracer| x.max_pool2d(2)).call(&x).unwrap();
        assert!(values(&y)[0].is_nan(), "{img:?}");
        // its gradient goes to the NaN, as PyTorch's argmax does
        let g = grad(|x: Tracer| x.max_pool2d(2)?.sum_all()).call(&x).unwrap();
        let at = values(&x).iter().position(|v| v.is_nan()).unwrap();
        let gv = values(&g);
        assert_eq!(gv[at], 1.0, "{img:?} {gv:?}");
        assert_eq!(gv.iter().sum::<f64>(), 1.0);
    }
    // max over an axis
    let v = Tensor::new(&[[1f32, nan, 3.], [1., 2., 3.]], &d).unwrap();
    let m = values(&jit(|x: Tracer| x.max(1)).call(&v).unwrap());
    assert!(m[0].is_nan() && m[1] == 3.0, "{m:?}");
    let m = values(&jit(|x: Tracer| x.max([0, 1])).call(&v).unwrap());
    assert!(m[0].is_nan(), "{m:?}");
    // maximum / minimum: NaN on either side
    let a = Tensor::new(&[1f32, nan, 3., 0.], &d).unwrap();
    let b = Tensor::new(&[0f32, 0., nan, 5.], &d).unwrap();
    for (x, y) in [(&a, &b), (&b, &a)] {
        let mx = values(&jit(|x: Tracer, y: Tracer| x.maximum(&y)).call((x, y)).unwrap());
        let mn = values(&jit(|x: Tracer, y: Tracer| x.minimum(&y)).call((x, y)).unwrap());
        assert!(
            mx[0] == 1.0 && mx[1].is_nan() && mx[2].is_nan() && mx[3] == 5.0,
            "{mx:?}"
        );
        assert!(
            mn[0] == 0.0 && mn[1].is_nan() && mn[2].is_nan() && mn[3] == 0.0,
            "{mn:?}"
        );
    }
    // and broadcasting keeps it
    let s = Tensor::new(nan, &d).unwrap();
    let mx = values(&jit(|x: Tracer, y: Tracer| x.maximum(&y)).call((&b, &s)).unwrap());
    assert!(mx.iter().all(|v| v.is_nan()), "{mx:?}");
    // the gradient of maximum: both sides take the cotangent where NaN
    // leaves no ordering, as PyTorch's formula does; ties split it
    let t = Tensor::new(&[2f32, nan, 1.], &d).unwrap();
    let u = Tensor::new(&[2f32, 0., 4.], &d).unwrap();
    let (gt, gu) = grad(|x: Tracer, y: Tracer| x.maximum(&y)?.sum_all())
        .argnums::<0, 1>()
        .call((&t, &u))
        .unwrap();
    assert_eq!(values(&gt), vec![0.5, 1., 0.]);
    assert_eq!(values(&gu), vec![0.5, 1., 1.]);
}

#[test]
fn labels_and_indices_out_of_range_are_errors() {
    let d = Device::Cpu;
    let logits = rand(&[3, 4], 1);
    let ce = |l: Tracer, y: Tracer| cross_entropy(&l, &y, Reduction::Mean);
    // 4 classes: 4 is out of range, and so are the index dtypes' maxima,
    // which candle would read as padding (a loss of 0 for that example)
    let bad = [
        Tensor::new(&[0u32, 1, 4], &d).unwrap(),
        Tensor::new(&[0u32, 1, u32::MAX], &d).unwrap(),
        Tensor::new(&[0u8, 1, 255], &d).unwrap(),
        Tensor::new(&[0i64, -1, 2], &d).unwrap(),
    ];
    for y in &bad {
        let r = no_panic("cross_entropy", || jit(ce).call((&logits, y)));
        match r {
            Err(Error::Shape { op: "gather", msg, .. }) => assert!(msg.contains("out of range"), "{msg}"),
            other => panic!("labels {y}: expected an error, got {other:?}"),
        }
        let r = jit(|l: Tracer, y: Tracer| l.index_select(&y, 1)).call((&logits, y));
        assert!(matches!(r, Err(Error::Shape { op: "index_select", .. })), "{r:?}");
        // and under vmap, per example
        let r = vmap(|l: Tracer, y: Tracer| l.index_select(&y, 0)).call((&logits, y));
        assert!(r.is_err(), "{r:?}");
    }
    // in range is fine, in every index dtype
    for dt in INTS {
        let y = Tensor::new(&[0u32, 3, 2], &d).unwrap().to_dtype(dt).unwrap();
        let loss = jit(ce).call((&logits, &y)).unwrap();
        assert!(values(&loss)[0].is_finite());
    }
}

#[test]
fn in_dims_beyond_isize_are_errors() {
    let xs = rand(&[4, 3], 1);
    for dims in [usize::MAX, isize::MAX as usize + 1] {
        let r = vmap(|x: Tracer| x.exp()).in_dims(dims).call(&xs);
        assert!(matches!(r, Err(Error::InDims { .. })), "{dims}: {r:?}");
        let r = vmap(|x: Tracer| x.exp()).in_dims([dims]).call(&xs);
        assert!(matches!(r, Err(Error::InDims { .. })), "{dims}: {r:?}");
    }
    // -1 still counts from the end
    let r = vmap(|x: Tracer| x.exp()).in_dims(-1).call(&xs).unwrap();
    assert_eq!(r.dims(), &[3, 4]);
}

#[test]
fn batch_size_errors_name_the_leaves_once_and_suggest_in_dims() {
    let mut params = std::collections::BTreeMap::new();
    params.insert("fc1.weight".to_string(), rand(&[32, 10], 1));
    params.insert("fc1.bias".to_string(), rand(&[32], 2));
    let xs = rand(&[10, 10], 3);
    let f = vmap(|p: std::collections::BTreeMap<String, Tracer>, x: Tracer| {
        x.matmul(&p["fc1.weight"].t()?)?.add(&p["fc1.bias"])
    });
    let e = f.call((&params, &xs)).unwrap_err().to_string();
    assert!(
        e.contains(r#"argument 0 ["fc1.bias", "fc1.weight"] has size 32 on axis 0"#),
        "{e}"
    );
    assert_eq!(e.matches("size 32").count(), 1, "{e}");
    assert!(e.contains("argument 1 has size 10 on axis 0"), "{e}");
    assert!(e.contains("None in in_dims"), "{e}");
    // a convolution that is missing its N axis under vmap says so
    let w = rand(&[4, 2, 3, 3], 4);
    let imgs = rand(&[5, 2, 8, 8], 5);
    let e = vmap(|x: Tracer, w: Tracer| x.conv2d(&w, 0, 1, 1, 1))
        .in_dims([Some(0), None])
        .call((&imgs, &w))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsqueeze(0)"), "{e}");
}

#[test]
fn dp_settings_that_would_corrupt_gradients_are_errors() {
    use candle_func::dp;
    let mut g = std::collections::BTreeMap::new();
    g.insert("w".to_string(), rand(&[4, 3], 1));
    for bad in [-1.0, 0.0, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(
                dp::clip_per_sample(&g, bad),
                Err(Error::PrivacyConfig {
                    op: "clip_per_sample",
                    ..
                })
            ),
            "max_norm {bad}"
        );
    }
    let mut rng = candle_func::rng::Rng::seeded(7);
    for (noise, batch) in [(-1.0, 4.0), (f64::NAN, 4.0), (1.0, 0.0), (1.0, -2.0), (1.0, f64::NAN)] {
        let r = dp::privatize(&g, 1.0, noise, batch, &mut rng);
        assert!(
            matches!(r, Err(Error::PrivacyConfig { op: "privatize", .. })),
            "noise {noise}, batch {batch}: {r:?}"
        );
    }
    // zero noise is allowed (clipping only)
    let p = dp::privatize(&g, 1.0, 0.0, 4.0, &mut rng).unwrap();
    assert_eq!(p["w"].dims(), &[3]);
    assert!(rng.normal_tensor(-1.0, &[2], DType::F32, &Device::Cpu).is_err());
}

#[test]
fn malformed_auto_caches_are_refused() {
    let dir = std::env::temp_dir().join(format!("candle-func-robust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, line) in [
        ("nan", "k\tUnfold\tUnfold=NaN\tconv2d\t[]"),
        ("negative", "k\tUnfold\tUnfold=-1\tconv2d\t[]"),
        ("auto", "k\tAuto\tUnfold=1\tconv2d\t[]"),
        ("no-op", "k\tUnfold\tUnfold=1\t\t[]"),
        ("no-key", " \tUnfold\tUnfold=1\tconv2d\t[]"),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, format!("{line}\n")).unwrap();
        let r = candle_func::planner::load_auto_cache(&path);
        assert!(
            matches!(
                r,
                Err(Error::Checkpoint {
                    what: "load_auto_cache",
                    ..
                })
            ),
            "{name}: {r:?}"
        );
    }
    // all or nothing: a good first line is not kept when a later one is bad
    let half = dir.join("half");
    let first = "route\trobustness-half\tGrouped\tGrouped=1.5\tconv2d\t[]";
    std::fs::write(&half, format!("{first}\nschedule\tk\tNowhere\t\t4\t2\n")).unwrap();
    let r = candle_func::planner::load_auto_cache(&half);
    assert!(
        matches!(&r, Err(Error::Checkpoint { msg, .. }) if msg.contains("Nowhere") && msg.contains("nothing loaded")),
        "{r:?}"
    );
    let kept = candle_func::planner::auto_choices();
    assert!(!kept
        .iter()
        .any(|c| c.op == "conv2d" && c.timings_ms == vec![(candle_func::ConvRoute::Grouped, 1.5)]));
    let good = dir.join("good");
    std::fs::write(&good, "robustness-key\tGrouped\tGrouped=1.5,Unfold=2\tconv2d\t[]\n").unwrap();
    assert_eq!(candle_func::planner::load_auto_cache(&good).unwrap(), 1);
    // and a schedule
    let sched = dir.join("schedule");
    std::fs::write(
        &sched,
        "schedule\trobustness-s\tPerExample\tBatched=9,PerExample=3\t64\t12\n",
    )
    .unwrap();
    assert_eq!(candle_func::planner::load_auto_cache(&sched).unwrap(), 1);
    assert!(candle_func::planner::schedule_choices()
        .iter()
        .any(|c| c.size == 64 && c.equations == 12));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn caches_stay_bounded() {
    // one process-wide setting; this is the only test in this binary that
    // changes it
    candle_func::settings::set_cache_capacity(16);
    let f = jit(|x: Tracer| x.exp()?.sum_all());
    for n in 1..=10_000usize {
        f.call(Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap()).unwrap();
        assert!(f.traced_signatures() <= 16);
    }
    assert_eq!(f.traced_signatures(), 16);
    // the most recently used signatures are the ones kept
    let x = rand(&[10_000], 1);
    let want = x.exp().unwrap().sum_all().unwrap();
    assert_close(&f.call(&x).unwrap(), &want, 1e-3, "a kept signature");
    candle_func::settings::set_cache_capacity(candle_func::settings::DEFAULT_CACHE_CAPACITY);
    // the Auto table too
    candle_func::settings::set_auto_capacity(8);
    let dir = std::env::temp_dir().join(format!("candle-func-auto-cap-{}", std::process::id()));
    let lines: String = (0..100)
        .map(|i| format!("cap-{i}\tUnfold\tUnfold=1\tconv2d\t[]\n"))
        .collect();
    std::fs::write(&dir, lines).unwrap();
    assert_eq!(candle_func::planner::load_auto_cache(&dir).unwrap(), 100);
    assert!(candle_func::planner::auto_choices().len() <= 8);
    std::fs::remove_file(&dir).ok();
    candle_func::settings::set_auto_capacity(candle_func::settings::DEFAULT_AUTO_CAPACITY);
}

#[test]
fn plans_beyond_the_memory_limit_are_errors_before_running() {
    // a convolution whose padding makes a 32 TiB output: refused on any
    // machine before anything is allocated (it aborted the process)
    let x = rand(&[1, 1, 6, 6], 1);
    let w = rand(&[2, 1, 3, 3], 2);
    let r = no_panic("conv", || {
        jit(|x: Tracer, w: Tracer| x.conv2d(&w, 1 << 20, 1, 1, 1)).call((&x, &w))
    });
    match r {
        // the output alone exceeds any memory: chunks cannot help, and the
        // error does not suggest them
        Err(e @ Error::Memory { .. }) => assert!(e.to_string().contains("no schedule fits"), "{e}"),
        other => panic!("expected a memory error, got {other:?}"),
    }
    // per transform: per-sample gradients of a linear layer, B x out x in
    // floats, over a limit set below them and under one above
    let (w, xs) = (rand(&[64, 128], 3), rand(&[32, 128], 4));
    let psg = |limit: usize| {
        vmap(grad(|w: Tracer, x: Tracer| x.unsqueeze(0)?.matmul(&w.t()?)?.sum_all()))
            .in_dims([None, Some(0)])
            .options(candle_func::Options::new().memory_limit(limit))
            .call((&w, &xs))
    };
    match psg(1 << 20) {
        Err(Error::Memory {
            needed, limit, floor, ..
        }) => {
            assert!(needed >= 32 * 64 * 128 * 4, "{needed}");
            assert_eq!(limit, 1 << 20);
            // the per-sample gradients (the result) alone exceed it
            assert!(floor >= 32 * 64 * 128 * 4, "{floor}");
        }
        other => panic!("expected a memory error, got {other:?}"),
    }
    assert_eq!(psg(64 << 20).unwrap().dims(), &[32, 64, 128]);
}

#[test]
fn results_whose_size_overflows_are_shape_errors() {
    let x = rand(&[6], 1);
    let r = jit(|x: Tracer| x.broadcast_as((1usize << 62, 6))).call(&x);
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    let r = jit(|x: Tracer| x.reshape((usize::MAX, 2, 72))).call(&x);
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    // padding or dilation near usize::MAX / 2, with one channel or many
    for cin in [1, 8] {
        let x = rand(&[1, cin, 6, 6], 2);
        let w = rand(&[2, cin, 3, 3], 3);
        for (pad, dil) in [(usize::MAX / 2, 1), (0, usize::MAX / 2)] {
            let r = no_panic("conv", || {
                jit(move |x: Tracer, w: Tracer| x.conv2d(&w, pad, 1, dil, 1)).call((&x, &w))
            });
            assert!(matches!(r, Err(Error::Shape { .. })), "pad {pad} dil {dil}: {r:?}");
        }
    }
}
