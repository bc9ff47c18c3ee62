//! The loop oracle: for every primitive, `vmap(f)(xs)` equals stacking `f`
//! on each example, over random shapes and every batch-axis choice (`None`,
//! 0, last) for each argument; nested `vmap` included.

mod common;

use candle_core::{DType, Tensor};
use candle_func::graph::ConvGeom;
use candle_func::{jit, vmap, Tracer};
use common::*;
use proptest::prelude::*;

const TOL: f64 = 1e-5;

fn dim() -> impl Strategy<Value = Option<isize>> {
    prop_oneof![Just(None), Just(Some(0)), Just(Some(-1))]
}

fn dims2() -> impl Strategy<Value = [Option<isize>; 2]> {
    (dim(), dim()).prop_map(|(a, b)| {
        if a.is_none() && b.is_none() {
            [Some(0), b]
        } else {
            [a, b]
        }
    })
}

fn dims3() -> impl Strategy<Value = [Option<isize>; 3]> {
    (dim(), dim(), dim()).prop_map(|(a, b, c)| {
        if a.is_none() && b.is_none() && c.is_none() {
            [Some(-1), b, c]
        } else {
            [a, b, c]
        }
    })
}

fn shape(max_rank: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..4, 1..=max_rank)
}

/// A shape that broadcasts against `s`: a suffix of it with some axes set to 1.
fn broadcast_partner(s: Vec<usize>) -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    let n = s.len();
    (0..=n, prop::collection::vec(any::<bool>(), n)).prop_map(move |(drop, ones)| {
        let t: Vec<usize> = s[drop..]
            .iter()
            .zip(&ones[drop..])
            .map(|(&d, &o)| if o { 1 } else { d })
            .collect();
        (s.clone(), if t.is_empty() { vec![1] } else { t })
    })
}

fn unary_ops() -> Vec<(&'static str, Un)> {
    let mut ops = unary_maps();
    ops.extend::<Vec<(&'static str, Un)>>(vec![
        ("sqrt", |x| x.abs()?.sqrt()),
        ("powf", |x| x.abs()?.powf(1.7)),
        ("cast", |x| x.to_dtype(DType::F64)?.exp()?.to_dtype(DType::F32)),
    ]);
    ops
}

fn binary_ops() -> Vec<(&'static str, Bin)> {
    let mut ops = arithmetic_ops();
    ops.extend::<Vec<(&'static str, Bin)>>(vec![
        ("eq", |a, b| {
            a.ge(0.0)?.to_dtype(DType::F32)?.eq(&b.ge(0.0)?.to_dtype(DType::F32)?)
        }),
        ("ne", |a, b| a.ne(&b)),
        ("lt", |a, b| a.lt(&b)),
        ("le", |a, b| a.le(&b)),
        ("gt", |a, b| a.gt(&b)),
        ("ge", |a, b| a.ge(&b)),
    ]);
    ops
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn unary(s in shape(3), d in dim(), b in 1usize..4, seed in any::<u64>()) {
        let d = d.or(Some(0));
        let x = batched(&s, b, d, seed);
        for (name, f) in unary_ops() {
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| oracle1(f, &x, d, b, TOL)));
            prop_assert!(got.is_ok(), "{name} failed for shape {s:?} dim {d:?}");
        }
    }

    #[test]
    fn binary((sa, sb) in shape(3).prop_flat_map(broadcast_partner), swap in any::<bool>(),
              dims in dims2(), b in 1usize..4, seed in any::<u64>()) {
        let (sa, sb) = if swap { (sb, sa) } else { (sa, sb) };
        let x = batched(&sa, b, dims[0], seed);
        let y = batched(&sb, b, dims[1], seed + 1);
        for (name, f) in binary_ops() {
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| oracle2(f, (&x, &y), dims, b, TOL)));
            prop_assert!(got.is_ok(), "{name} failed for shapes {sa:?} {sb:?} dims {dims:?}");
        }
    }

    #[test]
    fn where_select((sa, sb) in shape(3).prop_flat_map(broadcast_partner), dims in dims3(),
                    b in 1usize..4, seed in any::<u64>()) {
        let m = batched(&sb, b, dims[0], seed);
        let x = batched(&sa, b, dims[1], seed + 1);
        let y = batched(&sb, b, dims[2], seed + 2);
        oracle3(|m: Tracer, x: Tracer, y: Tracer| m.gt(0.0)?.where_cond(&x, &y), (&m, &x, &y), dims, b, TOL);
    }

    #[test]
    fn reductions(s in shape(3), d in dim(), b in 1usize..4, seed in any::<u64>(), ax in 0usize..3, keep in any::<bool>()) {
        let d = d.or(Some(-1));
        let x = batched(&s, b, d, seed);
        let a = ax % s.len();
        oracle1(move |x: Tracer| if keep { x.sum_keepdim(a) } else { x.sum(a) }, &x, d, b, TOL);
        oracle1(move |x: Tracer| if keep { x.max_keepdim(a) } else { x.max(a) }, &x, d, b, TOL);
        oracle1(|x: Tracer| x.mean_all(), &x, d, b, TOL);
        oracle1(|x: Tracer| x.sum_all(), &x, d, b, TOL);
        oracle1(move |x: Tracer| x.mean_keepdim(a), &x, d, b, TOL);
        let all: Vec<usize> = (0..s.len()).collect();
        oracle1(move |x: Tracer| x.max(all.clone()), &x, d, b, TOL);
    }

    #[test]
    fn shape_ops(s in prop::collection::vec(1usize..4, 2..=3), d in dim(), b in 1usize..4, seed in any::<u64>()) {
        let d = d.or(Some(0));
        let x = batched(&s, b, d, seed);
        let n: usize = s.iter().product();
        let r = s.len();
        oracle1(move |x: Tracer| x.reshape((n,)), &x, d, b, TOL);
        oracle1(move |x: Tracer| x.reshape(((), 1)), &x, d, b, TOL);
        oracle1(|x: Tracer| x.t(), &x, d, b, TOL);
        oracle1(move |x: Tracer| x.permute(&(0..r).rev().collect::<Vec<_>>()), &x, d, b, TOL);
        let mut big = s.clone();
        big.insert(0, 2);
        oracle1(move |x: Tracer| x.broadcast_as(big.clone()), &x, d, b, TOL);
        let last = s[r - 1];
        oracle1(move |x: Tracer| x.narrow(-1, last / 2, last - last / 2), &x, d, b, TOL);
        oracle1(|x: Tracer| x.unsqueeze(1)?.squeeze(1), &x, d, b, TOL);
        oracle1(|x: Tracer| x.flatten_all(), &x, d, b, TOL);
        oracle1(|x: Tracer| x.flatten(0, 1), &x, d, b, TOL);
    }

    #[test]
    fn concat_stack(s in shape(3), dims in dims2(), b in 1usize..4, seed in any::<u64>(), ax in 0usize..3) {
        let a = ax % s.len();
        let x = batched(&s, b, dims[0], seed);
        let y = batched(&s, b, dims[1], seed + 1);
        oracle2(move |x: Tracer, y: Tracer| Tracer::cat(&[&x, &y, &x], a), (&x, &y), dims, b, TOL);
        oracle2(move |x: Tracer, y: Tracer| Tracer::stack(&[&x, &y], a), (&x, &y), dims, b, TOL);
    }

    #[test]
    fn indexing(s in prop::collection::vec(1usize..4, 2..=3), dims in dims2(), b in 1usize..4, seed in any::<u64>(), k in 1usize..4) {
        let x = batched(&s, b, dims[0], seed);
        // index_select along axis 1 with a 1-D index of k entries
        let idx = match dims[1] {
            None => rand_idx(&[k], s[1], seed),
            Some(0) => rand_idx(&[b, k], s[1], seed),
            Some(_) => rand_idx(&[k, b], s[1], seed),
        };
        oracle2(|x: Tracer, i: Tracer| x.index_select(&i, 1), (&x, &idx), dims, b, TOL);
        // gather along the last axis, index of the same rank
        let mut is = s.clone();
        *is.last_mut().unwrap() = k;
        let bound = *s.last().unwrap();
        let gi = match dims[1] {
            None => rand_idx(&is, bound, seed + 3),
            Some(0) => rand_idx(&[&[b], &is[..]].concat(), bound, seed + 3),
            Some(_) => rand_idx(&[&is[..], &[b]].concat(), bound, seed + 3),
        };
        oracle2(|x: Tracer, i: Tracer| x.gather(&i, -1), (&x, &gi), dims, b, TOL);
    }

    #[test]
    fn matmul(m in 1usize..4, k in 1usize..4, n in 1usize..4, lead_a in 0usize..3, lead_b in 0usize..3,
              dims in dims2(), b in 1usize..4, seed in any::<u64>()) {
        // leading axes: none, [2], or [1] (broadcasting against [2])
        let lead = |l: usize| match l { 0 => vec![], 1 => vec![2], _ => vec![1] };
        let sa = [lead(lead_a), vec![m, k]].concat();
        let sb = [lead(lead_b), vec![k, n]].concat();
        let x = batched(&sa, b, dims[0], seed);
        let y = batched(&sb, b, dims[1], seed + 1);
        oracle2(|a: Tracer, b: Tracer| a.matmul(&b), (&x, &y), dims, b, 1e-4);
    }

    #[test]
    fn pooling(c in 1usize..3, h in 2usize..7, w in 2usize..7, k in 1usize..3, st in 1usize..3, d in dim(),
               b in 1usize..4, seed in any::<u64>()) {
        let d = d.or(Some(0));
        let x = batched(&[1, c, h, w], b, d, seed);
        oracle1(move |x: Tracer| x.max_pool2d_with_stride(k, st), &x, d, b, TOL);
        oracle1(move |x: Tracer| x.avg_pool2d_with_stride(k, st), &x, d, b, TOL);
    }

    #[test]
    fn unfold(nd in 1usize..4, c in 1usize..3, size in 3usize..6, k in 1usize..3, st in 1usize..3, p in 0usize..2,
              dl in 1usize..3, d in dim(), b in 1usize..3, seed in any::<u64>()) {
        prop_assume!(size + 2 * p > dl * (k - 1));
        let d = d.or(Some(0));
        let s = [vec![2, c], vec![size; nd]].concat();
        let x = batched(&s, b, d, seed);
        let g = ConvGeom::uniform(nd, k, p, st, dl);
        oracle1(move |x: Tracer| x.unfold(g.clone()), &x, d, b, TOL);
    }

    #[test]
    fn nested(sa in shape(2), d_outer in dims2(), d_inner in dims2(), b1 in 1usize..3, b2 in 1usize..3, seed in any::<u64>()) {
        // f(x, y) = sum(tanh(x) * y) over the last axis, vmapped twice.
        let f = |x: Tracer, y: Tracer| x.tanh()?.mul(&y)?.sum_keepdim(-1);
        let inner_shape = |d: Option<isize>, s: &[usize], n: usize| -> Vec<usize> {
            match d { None => s.to_vec(), Some(0) => [&[n], s].concat(), Some(_) => [s, &[n]].concat() }
        };
        let xs_inner = inner_shape(d_inner[0], &sa, b2);
        let ys_inner = inner_shape(d_inner[1], &sa, b2);
        let x = batched(&xs_inner, b1, d_outer[0], seed);
        let y = batched(&ys_inner, b1, d_outer[1], seed + 1);
        let vv = vmap(vmap(f).in_dims(d_inner)).in_dims(d_outer);
        let got = vv.call((&x, &y)).unwrap();
        let inner = vmap(f).in_dims(d_inner);
        let parts: Vec<Tensor> = (0..b1)
            .map(|i| inner.call((example(&x, d_outer[0], i), example(&y, d_outer[1], i))).unwrap())
            .collect();
        assert_close(&got, &Tensor::stack(&parts, 0).unwrap(), TOL, "nested vmap");
        // and the inner level against a plain loop
        let one = jit(f);
        for (i, part) in parts.iter().enumerate() {
            let (xi, yi) = (example(&x, d_outer[0], i), example(&y, d_outer[1], i));
            let rows: Vec<Tensor> = (0..b2)
                .map(|j| one.call((example(&xi, d_inner[0], j), example(&yi, d_inner[1], j))).unwrap())
                .collect();
            assert_close(part, &Tensor::stack(&rows, 0).unwrap(), TOL, "inner vmap");
        }
    }
}
