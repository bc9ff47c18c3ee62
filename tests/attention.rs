//! `nn::attend` as one fused primitive: its value, gradient, per-sample
//! gradients, forward mode and second derivatives equal attention written
//! out in ordinary operations (scores, `masked_fill`, softmax, product) in
//! f64, with causal and padding masks (a sequence whose keys are all
//! hidden included); its gradient graph holds no `T x T` value; bad masks
//! are errors naming the operation.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::jacobian::hvp_fn;
use candle_func::nn::{self, AttentionMask};
use candle_func::{grad, jit, jvp, make_graph, vmap, Error, Options, Tracer};
use common::assert_close;

const N: usize = 2;
const H: usize = 2;
const T: usize = 7;
const D: usize = 3;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    common::rand(shape, seed).to_dtype(DType::F64).unwrap()
}

/// Sequence 0 keeps its first 5 tokens; sequence 1 hides its first 2
/// (left padding: under the causal mask its first queries see no key).
fn keep() -> Tensor {
    let v: Vec<u8> = (0..N * T)
        .map(|i| u8::from(if i < T { i < 5 } else { i - T >= 2 }))
        .collect();
    Tensor::from_vec(v, (N, T), &Device::Cpu).unwrap()
}

/// Attention written out: what `attend` computed before it was one
/// primitive.
fn written_out(q: &Tracer, k: &Tracer, v: &Tracer, keep: Option<&Tracer>, causal: bool) -> candle_func::Result<Tracer> {
    let (n, t) = (q.dims()[0], q.dims()[2]);
    let fill = nn::mask_value(q.dtype());
    let mut s = q.matmul(&k.transpose(2, 3)?)?.affine(0.4, 0.0)?;
    if causal {
        let pos = Tracer::arange(q, 0, t as i64, DType::U32)?;
        let after = pos
            .unsqueeze(0)?
            .broadcast_as((t, t))?
            .gt(&pos.unsqueeze(1)?.broadcast_as((t, t))?)?;
        s = s.masked_fill(&after, fill)?;
    }
    if let Some(keep) = keep {
        s = s.masked_fill(&keep.eq(0.0)?.reshape((n, 1, 1, t))?, fill)?;
    }
    s.softmax(-1)?.matmul(v)
}

fn fused(q: &Tracer, k: &Tracer, v: &Tracer, keep: Option<&Tracer>, causal: bool) -> candle_func::Result<Tracer> {
    let mask = AttentionMask {
        window: None,
        causal,
        keep: keep.cloned(),
    };
    nn::attend(q, k, v, &mask, 0.4)
}

type Attn = fn(&Tracer, &Tracer, &Tracer, Option<&Tracer>, bool) -> candle_func::Result<Tracer>;

/// A scalar of the attention's output, weighted so every entry matters.
fn loss(attn: Attn, causal: bool) -> impl Fn(Tracer, Tracer, Tracer, Tracer) -> candle_func::Result<Tracer> + Copy {
    move |q, k, v, keep| {
        let o = attn(&q, &k, &v, Some(&keep), causal)?;
        o.mul(&o.sin()?)?.sum_all()
    }
}

#[test]
fn the_fused_primitive_equals_attention_written_out_under_every_transform() {
    let (q, k, v, m) = (
        rand(&[N, H, T, D], 1),
        rand(&[N, H, T, D], 2),
        rand(&[N, H, T, D], 3),
        keep(),
    );
    let (tq, tk, tv) = (rand(&[N, H, T, D], 4), rand(&[N, H, T, D], 5), rand(&[N, H, T, D], 6));
    for causal in [false, true] {
        let what = |w: &str| format!("{w}, causal {causal}");
        // values, with and without the padding mask
        for mask in [None, Some(&m)] {
            let f = |q: Tracer, k: Tracer, v: Tracer, m: Vec<Tracer>| fused(&q, &k, &v, m.first(), causal);
            let w = |q: Tracer, k: Tracer, v: Tracer, m: Vec<Tracer>| written_out(&q, &k, &v, m.first(), causal);
            let ms: Vec<Tensor> = mask.into_iter().cloned().collect();
            let (a, b) = (
                jit(f).call((&q, &k, &v, &ms)).unwrap(),
                jit(w).call((&q, &k, &v, &ms)).unwrap(),
            );
            assert_close(&a, &b, 1e-12, &what("value"));
        }
        let (lf, lw) = (loss(fused, causal), loss(written_out, causal));
        // the gradient in each of q, k, v
        macro_rules! each_argnum {
            ($($i:literal),*) => {$(
                let a = grad(lf).argnum::<$i>().call((&q, &k, &v, &m)).unwrap();
                let b = grad(lw).argnum::<$i>().call((&q, &k, &v, &m)).unwrap();
                assert_close(&a, &b, 1e-10, &what(&format!("grad {}", $i)));
            )*};
        }
        each_argnum!(0, 1, 2);
        // per-sample gradients: each sequence its own example
        let per = |attn: Attn| {
            let l = loss(attn, causal);
            let one = move |q: Tracer, k: Tracer, v: Tracer, m: Tracer| {
                l(q.unsqueeze(0)?, k.unsqueeze(0)?, v.unsqueeze(0)?, m.unsqueeze(0)?)
            };
            vmap(grad(one)).call((&q, &k, &v, &m)).unwrap()
        };
        assert_close(&per(fused), &per(written_out), 1e-10, &what("per-sample"));
        // forward mode
        let tangent = |attn: Attn| {
            let f = move |q: Tracer, k: Tracer, v: Tracer| attn(&q, &k, &v, None, causal);
            let g = move |(q, k, v): (Tracer, Tracer, Tracer)| f(q, k, v);
            jvp(&g, &(&q, &k, &v), &(&tq, &tk, &tv)).unwrap().1
        };
        assert_close(&tangent(fused), &tangent(written_out), 1e-10, &what("jvp"));
        // second derivatives (forward over reverse)
        let hv = |attn: Attn| {
            let l = loss(attn, causal);
            let mc = m.clone();
            let f = move |q: Tracer| {
                let like = |t: &Tensor| candle_func::tracer::Operand::to_tracer(t, &q);
                l(
                    q.clone(),
                    like(&rand(&[N, H, T, D], 2))?,
                    like(&rand(&[N, H, T, D], 3))?,
                    like(&mc)?,
                )
            };
            hvp_fn(f).call((&q, &tq)).unwrap()
        };
        assert_close(&hv(fused), &hv(written_out), 1e-9, &what("hvp"));
        // reverse over reverse: the gradient of a gradient's norm
        let gg = |attn: Attn| {
            let l = loss(attn, causal);
            let inner = grad(l);
            let outer = move |q: Tracer, k: Tracer, v: Tracer, m: Tracer| {
                let g = candle_func::Function::apply(&inner, (q, k, v, m))?;
                g.sqr()?.sum_all()
            };
            grad(outer).call((&q, &k, &v, &m)).unwrap()
        };
        assert_close(&gg(fused), &gg(written_out), 1e-9, &what("grad of grad"));
    }
}

#[test]
fn the_gradient_keeps_no_scores_and_a_bad_mask_is_named() {
    // T = 96: a T x T value would be [2, 2, 96, 96]
    let t = 96;
    let (q, k, v) = (rand(&[N, H, t, D], 1), rand(&[N, H, t, D], 2), rand(&[N, H, t, D], 3));
    let m = Tensor::ones((N, t), DType::U8, &Device::Cpu).unwrap();
    for (name, attn) in [("fused", fused as Attn), ("written out", written_out as Attn)] {
        let g = make_graph(&grad(loss(attn, true)), (&q, &k, &v, &m)).unwrap();
        let square = g.nodes().any(|n| {
            let s = &n.ty().shape;
            s.len() == 4 && s[2] == t && s[3] == t
        });
        assert_eq!(square, name == "written out", "{name}:\n{g}");
    }
    let bad = Tensor::ones((N, t + 1), DType::U8, &Device::Cpu).unwrap();
    let e = grad(loss(fused, false)).call((&q, &k, &v, &bad)).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "attention", .. }), "{e}");
}

#[test]
fn long_causal_sequences_with_left_padding_and_batched_masks_agree() {
    // T = 70: a first block of 64 queries and a second of 6; sequence 1's
    // first real key is at 5, so its first block's early queries see no
    // key at all and average every one, its second block reads only the
    // keys up to its last query
    let t = 70;
    let (q, k, v) = (rand(&[N, H, t, D], 7), rand(&[N, H, t, D], 8), rand(&[N, H, t, D], 9));
    let m = Tensor::from_vec(
        (0..N * t)
            .map(|i| u8::from(if i < t { i < 60 } else { i - t >= 5 }))
            .collect::<Vec<u8>>(),
        (N, t),
        &Device::Cpu,
    )
    .unwrap();
    for causal in [true, false] {
        let (lf, lw) = (loss(fused, causal), loss(written_out, causal));
        let a = jit(lf).call((&q, &k, &v, &m)).unwrap();
        let b = jit(lw).call((&q, &k, &v, &m)).unwrap();
        assert_close(&a, &b, 1e-10, &format!("value, causal {causal}"));
        for (ga, gb) in [
            (
                grad(lf).call((&q, &k, &v, &m)).unwrap(),
                grad(lw).call((&q, &k, &v, &m)).unwrap(),
            ),
            (
                grad(lf).argnum::<2>().call((&q, &k, &v, &m)).unwrap(),
                grad(lw).argnum::<2>().call((&q, &k, &v, &m)).unwrap(),
            ),
        ] {
            assert_close(&ga, &gb, 1e-10, &format!("grad, causal {causal}"));
        }
        // forward mode with the mask
        let tq = rand(&[N, H, t, D], 10);
        let tangent = |attn: Attn| {
            let (mc, k, v) = (m.clone(), k.clone(), v.clone());
            let f = move |q: Tracer| {
                let like = |x: &Tensor| candle_func::tracer::Operand::to_tracer(x, &q);
                attn(&q, &like(&k)?, &like(&v)?, Some(&like(&mc)?), causal)
            };
            jvp(&f, &q, &tq).unwrap().1
        };
        assert_close(
            &tangent(fused),
            &tangent(written_out),
            1e-10,
            &format!("jvp, causal {causal}"),
        );
    }
    // only the masks batched: the same q, k, v under each example's mask
    let masks = m.unsqueeze(1).unwrap(); // N 1 T: one [1, T] mask an example
    let one = |q: Tracer, k: Tracer, v: Tracer, keep: Tracer, attn: Attn| {
        attn(
            &q.narrow(0, 0, 1)?,
            &k.narrow(0, 0, 1)?,
            &v.narrow(0, 0, 1)?,
            Some(&keep),
            true,
        )
    };
    let f = |q: Tracer, k: Tracer, v: Tracer, keep: Tracer| one(q, k, v, keep, fused);
    let w = |q: Tracer, k: Tracer, v: Tracer, keep: Tracer| one(q, k, v, keep, written_out);
    let dims = [None, None, None, Some(0)];
    let a = vmap(f).in_dims(dims).call((&q, &k, &v, &masks)).unwrap();
    let b = vmap(w).in_dims(dims).call((&q, &k, &v, &masks)).unwrap();
    assert_close(&a, &b, 1e-12, "masks alone batched");
}

#[test]
fn the_portable_path_takes_the_heads_as_a_model_splits_them() {
    // q, k, v as permuted views of projections [N, T, H D] (N, H > 1):
    // candle's products refuse such a layout, so the portable path makes
    // them contiguous first
    let t = 9;
    let x = rand(&[N, t, H * D], 11).to_dtype(DType::F32).unwrap();
    let keep = Tensor::ones((N, t), DType::U8, &Device::Cpu).unwrap();
    let f = |x: Tracer, keep: Tracer| {
        let heads = |s: f64| nn::split_heads(&x.affine(s, 0.0)?, H);
        let mask = AttentionMask {
            window: None,
            causal: true,
            keep: Some(keep),
        };
        nn::attend(&heads(1.0)?, &heads(0.5)?, &heads(2.0)?, &mask, 0.3)
    };
    let fast = jit(f).call((&x, &keep)).unwrap();
    let portable = jit(f).options(Options::new().portable(true)).call((&x, &keep)).unwrap();
    assert_close(&portable, &fast, 1e-5, "portable against the kernel");
    let g = |x: Tracer, keep: Tracer| f(x, keep)?.sqr()?.sum_all();
    let (gf, gp) = (
        grad(g).call((&x, &keep)).unwrap(),
        grad(g)
            .options(Options::new().portable(true))
            .call((&x, &keep))
            .unwrap(),
    );
    assert_close(&gp, &gf, 1e-4, "portable gradient against the kernel");
}

/// A sliding window: at least as long as the sequence, it changes nothing
/// (the fused primitive runs); shorter, query `i` sees keys `i - w + 1..=i`
/// only, as the written-out attention with those keys hidden; a window of
/// 0 or one without the causal mask is an error naming the operation.
#[test]
fn a_sliding_window_hides_the_keys_before_it() {
    let (q, k, v) = (
        rand(&[2, 2, 6, 4], 31),
        rand(&[2, 2, 6, 4], 32),
        rand(&[2, 2, 6, 4], 33),
    );
    let keep = Tensor::new(&[[1f64, 1., 1., 1., 1., 1.], [1., 1., 1., 1., 0., 0.]], &Device::Cpu).unwrap();
    let with = |window: Option<usize>, causal: bool| {
        let mask = |keep: &Tracer| AttentionMask {
            window,
            causal,
            keep: Some(keep.clone()),
        };
        jit(move |q: Tracer, k: Tracer, v: Tracer, keep: Tracer| nn::attend(&q, &k, &v, &mask(&keep), 0.4))
            .call((&q, &k, &v, &keep))
    };
    let causal = with(None, true).unwrap();
    assert_close(
        &with(Some(6), true).unwrap(),
        &causal,
        1e-12,
        "a window as long as the sequence",
    );
    // window 2 written out: key j hidden unless i - 1 <= j <= i (and real)
    let band = jit(|q: Tracer, k: Tracer, v: Tracer, keep: Tracer| {
        let s = q.matmul(&k.transpose(2, 3)?)?.affine(0.4, 0.0)?;
        let pos = Tracer::arange(&q, 0, 6, DType::U32)?;
        let (i, j) = (
            pos.unsqueeze(1)?.broadcast_as((6, 6))?,
            pos.unsqueeze(0)?.broadcast_as((6, 6))?,
        );
        let seen = j.le(&i)?.mul(&j.add(1.0)?.ge(&i)?)?;
        let fill = nn::mask_value(DType::F64);
        let s = s.masked_fill(&seen.eq(0.0)?, fill)?;
        let s = s.masked_fill(&keep.eq(0.0)?.reshape((2, 1, 1, 6))?, fill)?;
        // a query whose window holds only padding (example 1, query 5) attends to nothing
        let sees = seen
            .to_dtype(DType::F64)?
            .broadcast_mul(&keep.reshape((2, 1, 1, 6))?)?
            .max_keepdim(3)?;
        s.softmax(-1)?.broadcast_mul(&sees)?.matmul(&v)
    })
    .call((&q, &k, &v, &keep))
    .unwrap();
    assert_close(&with(Some(2), true).unwrap(), &band, 1e-12, "a window of 2");
    for (window, causal) in [(Some(0), true), (Some(2), false)] {
        let e = with(window, causal).unwrap_err();
        assert!(matches!(e, Error::Shape { op: "attention", .. }), "{e}");
    }
}
