//! Loops and branches whose leaves are of several dtypes, as JAX allows:
//! an f32 state beside an f64 running sum and a u32 counter, against the
//! same loop written out step by step (values exactly, gradients and
//! tangents to f32's precision), per example under `vmap`, through
//! `while_loop` and `cond`, and an i64 beside a float, which no one dtype
//! holds, carried exactly (every leaf is a value of its own type).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::loops::{cond, scan, while_loop};
use candle_func::tracer::Operand;
use candle_func::{grad, jit, jvp, vmap, Tracer};
use common::{assert_close, rand};

const T: usize = 5;
const E: usize = 4;
/// A count past f32's last exact integer (2^24): a u32 carried in f32
/// would lose it.
const START: u32 = (1 << 24) + 1;

type Out = candle_func::Result<(Tracer, Tracer, Tracer, Tracer)>;

/// One step: the f32 state, the f64 sum of its squares so far, the u32
/// count, and the step's f32 output.
fn step(s: &Tracer, sum: &Tracer, n: &Tracer, x: &Tracer, w: &Tracer) -> Out {
    let s = s.mul(w)?.add(x)?.tanh()?;
    let sum = sum.add(&s.sqr()?.sum_all()?.to_dtype(DType::F64)?)?;
    let n = n.add(Tensor::new(1u32, &Device::Cpu)?)?;
    let y = s.sum_all()?;
    Ok((s, sum, n, y))
}

/// The loop as a scan: carry `(state f32, sum f64, count u32)`, outputs
/// `(y f32, count u32)` per step; the final state and sum, the counts
/// and the outputs.
fn looped(xs: Tracer, w: Tracer) -> Out {
    let init = (
        w.affine(0.0, 0.5)?,
        w.sum_all()?.affine(0.0, 0.0)?.to_dtype(DType::F64)?,
        count(&w)?,
    );
    let ((s, sum, _), (ys, ns)) = scan(
        |(s, sum, n): (Tracer, Tracer, Tracer), x: Tracer| {
            let (s, sum, n, y) = step(&s, &sum, &n, &x, &w)?;
            Ok(((s, sum, n.clone()), (y, n)))
        },
        init,
        xs,
    )?;
    Ok((s, sum, ns, ys))
}

/// The same loop written out.
fn unrolled(xs: Tracer, w: Tracer) -> Out {
    let mut s = w.affine(0.0, 0.5)?;
    let mut sum = w.sum_all()?.affine(0.0, 0.0)?.to_dtype(DType::F64)?;
    let mut n = count(&w)?;
    let (mut ys, mut ns) = (Vec::new(), Vec::new());
    for t in 0..T {
        let x = xs.narrow(0, t, 1)?.squeeze(0)?;
        let y;
        (s, sum, n, y) = step(&s, &sum, &n, &x, &w)?;
        ys.push(y.unsqueeze(0)?);
        ns.push(n.unsqueeze(0)?);
    }
    let cat = |v: &[Tracer]| Tracer::cat(&v.iter().collect::<Vec<_>>(), 0);
    Ok((s, sum, cat(&ns)?, cat(&ys)?))
}

/// The count's start, a constant of `like`'s trace.
fn count(like: &Tracer) -> candle_func::Result<Tracer> {
    Tensor::new(START, &Device::Cpu)?.to_tracer(like)
}

fn loss(f: fn(Tracer, Tracer) -> Out) -> impl Fn(Tracer, Tracer) -> candle_func::Result<Tracer> + Clone {
    move |xs, w| {
        let (s, sum, _, ys) = f(xs, w)?;
        s.sum_all()?.add(&ys.sum_all()?)?.to_dtype(DType::F64)?.add(&sum)
    }
}

#[test]
fn a_carry_of_three_dtypes_runs_as_the_unrolled_loop() {
    let (xs, w) = (rand(&[T, E], 1), rand(&[E], 2));
    let (s, sum, n, ys) = jit(looped).call((&xs, &w)).unwrap();
    let (s2, sum2, n2, ys2) = jit(unrolled).call((&xs, &w)).unwrap();
    assert_eq!(
        (s.dtype(), sum.dtype(), n.dtype(), ys.dtype()),
        (DType::F32, DType::F64, DType::U32, DType::F32)
    );
    // the same operations in the same dtypes: equal, not close
    assert_close(&s, &s2, 0.0, "state");
    assert_close(&sum, &sum2, 0.0, "sum");
    assert_close(&ys, &ys2, 0.0, "outputs");
    let counts: Vec<u32> = (1..=T as u32).map(|t| START + t).collect();
    assert_eq!(n.to_vec1::<u32>().unwrap(), counts, "the counts, past 2^24");
    assert_eq!(n2.to_vec1::<u32>().unwrap(), counts);
}

/// A NaN in the f32 state goes round the f64 carrier and comes back a
/// NaN where the unrolled loop has one, as in PyTorch; the rest stays
/// equal.
#[test]
fn a_nan_in_a_mixed_carry_propagates_as_in_the_unrolled_loop() {
    let mut v = common::values(&rand(&[T, E], 10));
    v[E + 1] = f64::NAN; // step 1, entry 1
    let xs = Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<_>>(), (T, E), &Device::Cpu).unwrap();
    let w = rand(&[E], 11);
    let (s, sum, _, ys) = jit(looped).call((&xs, &w)).unwrap();
    let (s2, sum2, _, ys2) = jit(unrolled).call((&xs, &w)).unwrap();
    let nan = |t: &Tensor| common::values(t).iter().map(|x| x.is_nan()).collect::<Vec<_>>();
    assert_eq!(nan(&s), nan(&s2));
    assert_eq!(nan(&s), [false, true, false, false], "the state's NaN entry");
    assert!(sum.to_scalar::<f64>().unwrap().is_nan() && sum2.to_scalar::<f64>().unwrap().is_nan());
    assert_eq!(nan(&ys), nan(&ys2));
    let finite = |t: &Tensor| {
        common::values(t)
            .into_iter()
            .filter(|x| !x.is_nan())
            .collect::<Vec<_>>()
    };
    assert_eq!(finite(&s), finite(&s2));
}

#[test]
fn gradients_and_tangents_through_a_mixed_carry_are_the_unrolled_loops() {
    let (xs, w) = (rand(&[T, E], 3), rand(&[E], 4));
    // the f32 weight's cotangent is summed in the carry's f64 and
    // converted back: within f32's rounding of the unrolled sum
    let (gx, gw) = grad(loss(looped)).argnums::<0, 1>().call((&xs, &w)).unwrap();
    let (gx2, gw2) = grad(loss(unrolled)).argnums::<0, 1>().call((&xs, &w)).unwrap();
    assert_eq!((gx.dtype(), gw.dtype()), (DType::F32, DType::F32));
    assert_close(&gx, &gx2, 1e-6, "d/dxs");
    assert_close(&gw, &gw2, 1e-6, "d/dw");
    let (tx, tw) = (rand(&[T, E], 5), rand(&[E], 6));
    let (v, t) = jvp(&loss(looped), (&xs, &w), (&tx, &tw)).unwrap();
    let (v2, t2) = jvp(&loss(unrolled), (&xs, &w), (&tx, &tw)).unwrap();
    assert_close(&v, &v2, 1e-12, "value");
    assert_close(&t, &t2, 1e-6, "tangent");
}

#[test]
fn per_sample_gradients_through_a_mixed_carry_are_single_calls() {
    let (xs, w) = (rand(&[3, T, E], 7), rand(&[E], 8));
    let per = vmap(grad(loss(looped)).argnum::<1>())
        .in_dims([Some(0), None])
        .call((&xs, &w))
        .unwrap();
    for b in 0..3 {
        let x = xs.get(b).unwrap();
        let one = grad(loss(unrolled)).argnum::<1>().call((&x, &w)).unwrap();
        assert_close(&per.get(b).unwrap(), &one, 1e-6, "example's gradient");
    }
}

#[test]
fn while_loop_and_cond_carry_mixed_leaves() {
    // halve until below 1, counting the halvings in u32, per example
    let halve = |x: Tracer| {
        let zero = Tensor::new(0u32, &Device::Cpu)?.to_tracer(&x)?;
        let (y, n) = while_loop(
            |(y, _): &(Tracer, Tracer)| y.ge(1.0),
            |(y, n): (Tracer, Tracer)| Ok((y.affine(0.5, 0.0)?, n.add(Tensor::new(1u32, &Device::Cpu)?)?)),
            (x, zero),
        )?;
        Ok((y, n))
    };
    let x = Tensor::new(&[5f32, 0.5, 12.0], &Device::Cpu).unwrap();
    let (y, n) = vmap(halve).call(&x).unwrap();
    assert_eq!(y.to_vec1::<f32>().unwrap(), [0.625, 0.5, 0.75]);
    assert_eq!(n.to_vec1::<u32>().unwrap(), [3, 0, 4]);
    // a cond giving (f32, f64): the f32 operand's gradient through it
    let branch = |x: Tracer| {
        cond(
            &x.sum_all()?.gt(0.0)?,
            |o: Tracer| Ok((o.sqr()?, o.sum_all()?.to_dtype(DType::F64)?)),
            |o: Tracer| Ok((o.neg()?, o.sum_all()?.to_dtype(DType::F64)?.affine(3.0, 0.0)?)),
            x,
        )
    };
    let f = move |x: Tracer| {
        let (a, b) = branch(x)?;
        a.sum_all()?.to_dtype(DType::F64)?.add(&b)
    };
    let xs = Tensor::new(&[[1f32, 2.0], [-3.0, 1.0]], &Device::Cpu).unwrap();
    let g = vmap(grad(f)).call(&xs).unwrap();
    assert_eq!(g.dtype(), DType::F32);
    // x^2 + sum x on the first row; -x + 3 sum x on the second
    assert_eq!(g.to_vec2::<f32>().unwrap(), [[3.0, 5.0], [2.0, 2.0]]);
}

/// An i64 counter beside an f32 state, which no float holds exactly (the
/// count starts past 2^53): each leaf is a value of its own type, so the
/// count is exact, and the state's gradient and per-example values are the
/// unrolled loop's.
#[test]
fn an_i64_beside_a_float_is_carried_exactly() {
    const BIG: i64 = (1 << 53) + 1;
    let xs = rand(&[T, E], 9);
    let f = |xs: Tracer| {
        let n = Tensor::new(BIG, &Device::Cpu)?.to_tracer(&xs)?;
        let one = Tensor::new(1i64, &Device::Cpu)?;
        let ((s, n), ()) = scan(
            |(s, n): (Tracer, Tracer), x: Tracer| Ok(((s.mul(&x)?.add(&x)?.tanh()?, n.add(&one)?), ())),
            (xs.narrow(0, 0, 1)?.squeeze(0)?, n),
            xs,
        )?;
        Ok((s, n))
    };
    let unrolled = |xs: Tracer| {
        let mut s = xs.narrow(0, 0, 1)?.squeeze(0)?;
        for t in 0..T {
            let x = xs.narrow(0, t, 1)?.squeeze(0)?;
            s = s.mul(&x)?.add(&x)?.tanh()?;
        }
        Ok(s)
    };
    let (s, n) = jit(f).call(&xs).unwrap();
    assert_eq!(n.dtype(), DType::I64);
    assert_eq!(n.to_scalar::<i64>().unwrap(), BIG + T as i64, "the count, exactly");
    assert_close(&s, &jit(unrolled).call(&xs).unwrap(), 0.0, "the state");
    let loss = |xs: Tracer| f(xs)?.0.sum_all();
    let want = grad(|xs: Tracer| unrolled(xs)?.sum_all()).call(&xs).unwrap();
    assert_close(&grad(loss).call(&xs).unwrap(), &want, 1e-6, "the state's gradient");
    // per example: each example's own count and state
    let batch = Tensor::stack(&[&xs, &xs.affine(0.5, 0.0).unwrap()], 0).unwrap();
    let (bs, bn) = vmap(f).call(&batch).unwrap();
    assert_eq!(bn.to_vec1::<i64>().unwrap(), vec![BIG + T as i64; 2]);
    let second = jit(unrolled).call(xs.affine(0.5, 0.0).unwrap()).unwrap();
    assert_close(&bs.get(1).unwrap(), &second, 1e-6, "the second example's state");
}
