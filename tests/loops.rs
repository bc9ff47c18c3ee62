//! `scan` against the same loop unrolled (which only uses primitives
//! tested elsewhere), under every transform and their compositions, with
//! finite differences in f64 for its VJP and JVP, `vmap` against a loop
//! of single calls, the graph's size against the trip count, and bad
//! bodies.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::loops::{scan, scan_with, ScanOptions};
use candle_func::{grad, jit, jvp, make_graph, vmap, Error, Function, Tracer};
use common::{assert_close, rand};
use std::collections::BTreeMap;

type P = BTreeMap<String, Tracer>;
const H: usize = 5;
const E: usize = 3;
const T: usize = 6;

fn params(dtype: DType, seed: u64) -> BTreeMap<String, Tensor> {
    let t = |shape: &[usize], k: u64| {
        rand(shape, seed * 10 + k)
            .affine(0.6, 0.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    BTreeMap::from([
        ("W".to_string(), t(&[H, H], 1)),
        ("U".to_string(), t(&[H, E], 2)),
        ("b".to_string(), t(&[H], 3)),
        ("h0".to_string(), t(&[H], 4)),
    ])
}

fn xs(dtype: DType, lead: &[usize], seed: u64) -> Tensor {
    let shape = [lead, &[T, E]].concat();
    rand(&shape, seed).to_dtype(dtype).unwrap()
}

/// An Elman cell: `tanh(W h + U x + b)`.
fn cell(p: &P, h: &Tracer, x: &Tracer) -> candle_func::Result<Tracer> {
    let wh = p["W"].matmul(&h.unsqueeze(1)?)?.squeeze(1)?;
    let ux = p["U"].matmul(&x.unsqueeze(1)?)?.squeeze(1)?;
    wh.add(&ux)?.add(&p["b"])?.tanh()
}

/// The states as outputs (and their squares, a second output) and the
/// final state, by `scan`.
fn run_scan(p: &P, x: &Tracer, reverse: bool) -> candle_func::Result<(Tracer, Tracer, Tracer)> {
    let opts = if reverse {
        ScanOptions::new().reverse()
    } else {
        ScanOptions::new()
    };
    let (c, ys) = scan_with(
        |c: Vec<Tracer>, x: Vec<Tracer>| {
            let h = cell(p, &c[0], &x[0])?;
            Ok((vec![h.clone()], vec![h.clone(), h.sqr()?.sum_all()?]))
        },
        vec![p["h0"].clone()],
        vec![x.clone()],
        opts,
    )?;
    Ok((c[0].clone(), ys[0].clone(), ys[1].clone()))
}

/// The same, unrolled.
fn run_unrolled(p: &P, x: &Tracer, reverse: bool) -> candle_func::Result<(Tracer, Tracer, Tracer)> {
    let mut h = p["h0"].clone();
    let mut rows: Vec<Option<(Tracer, Tracer)>> = vec![None; T];
    let order: Vec<usize> = if reverse {
        (0..T).rev().collect()
    } else {
        (0..T).collect()
    };
    for t in order {
        h = cell(p, &h, &x.narrow(0, t, 1)?.squeeze(0)?)?;
        rows[t] = Some((h.clone(), h.sqr()?.sum_all()?));
    }
    let rows: Vec<(Tracer, Tracer)> = rows.into_iter().flatten().collect();
    let hs: Vec<&Tracer> = rows.iter().map(|r| &r.0).collect();
    let ss: Vec<&Tracer> = rows.iter().map(|r| &r.1).collect();
    Ok((h, Tracer::stack(&hs, 0)?, Tracer::stack(&ss, 0)?))
}

type Run = fn(&P, &Tracer, bool) -> candle_func::Result<(Tracer, Tracer, Tracer)>;

/// A scalar of everything the loop makes: the final state, the states and
/// the second output.
fn loss(run: Run, reverse: bool) -> impl Fn(P, Tracer) -> candle_func::Result<Tracer> + Clone {
    move |p: P, x: Tracer| {
        let (c, hs, ss) = run(&p, &x, reverse)?;
        c.mul(&c.sin()?)?
            .sum_all()?
            .add(&hs.affine(0.5, 0.1)?.sqr()?.sum_all()?)?
            .add(&ss.sum_all()?)
    }
}

/// The loss with the data among the parameters, so `grad` reaches it.
fn loss_all(run: Run, reverse: bool) -> impl Fn(P) -> candle_func::Result<Tracer> + Clone {
    move |mut p: P| {
        let x = p.remove("x").expect("x");
        loss(run, reverse)(p, x)
    }
}

fn with_x(p: &BTreeMap<String, Tensor>, x: &Tensor) -> BTreeMap<String, Tensor> {
    let mut p = p.clone();
    p.insert("x".into(), x.clone());
    p
}

#[test]
fn scan_runs_as_the_unrolled_loop_forwards_and_backwards() {
    let p = params(DType::F32, 1);
    let x = xs(DType::F32, &[], 2);
    for reverse in [false, true] {
        let f = |run: Run| {
            jit(move |p: P, x: Tracer| {
                let (c, hs, ss) = run(&p, &x, reverse)?;
                Ok((c, hs, ss))
            })
            .call((&p, &x))
            .unwrap()
        };
        let (a, b) = (f(run_scan), f(run_unrolled));
        assert_close(&a.0, &b.0, 1e-6, "final carry");
        assert_close(&a.1, &b.1, 1e-6, "stacked states");
        assert_close(&a.2, &b.2, 1e-5, "stacked scalar outputs");
        assert_eq!(a.1.dims(), &[T, H]);
        assert_eq!(a.2.dims(), &[T]);
    }
}

#[test]
fn grad_jvp_and_their_compositions_through_scan_equal_the_unrolled_loop() {
    let p = with_x(&params(DType::F64, 3), &xs(DType::F64, &[], 4));
    let v = with_x(&params(DType::F64, 5), &xs(DType::F64, &[], 6));
    for reverse in [false, true] {
        let (s, u) = (loss_all(run_scan, reverse), loss_all(run_unrolled, reverse));
        let (gs, gu) = (grad(s.clone()).call(&p).unwrap(), grad(u.clone()).call(&p).unwrap());
        for k in gu.keys() {
            assert_close(&gs[k], &gu[k], 1e-10, &format!("grad {k} reverse={reverse}"));
        }
        let (ys, ts) = jvp(&s, &p, &v).unwrap();
        let (yu, tu) = jvp(&u, &p, &v).unwrap();
        assert_close(&ys, &yu, 1e-10, "jvp primal");
        assert_close(&ts, &tu, 1e-10, "jvp tangent");
        // forward over reverse: a Hessian-vector product
        let hvp = |f: &dyn Fn(P) -> candle_func::Result<Tracer>| {
            let g = grad(f);
            jvp(&g, &p, &v).unwrap().1
        };
        let (hs, hu) = (hvp(&s), hvp(&u));
        for k in hu.keys() {
            assert_close(&hs[k], &hu[k], 1e-9, &format!("hvp {k}"));
        }
        // reverse over reverse: the gradient of a gradient's norm
        let gg = |f: &dyn Fn(P) -> candle_func::Result<Tracer>| {
            grad(|p: P| {
                let g = grad(f).apply((p,))?;
                let mut n: Option<Tracer> = None;
                for t in g.values() {
                    let s = t.sqr()?.sum_all()?;
                    n = Some(match n {
                        None => s,
                        Some(m) => m.add(&s)?,
                    });
                }
                Ok(n.expect("a gradient"))
            })
            .call(&p)
            .unwrap()
        };
        let (a, b) = (gg(&s), gg(&u));
        for k in b.keys() {
            assert_close(&a[k], &b[k], 1e-9, &format!("grad of grad {k}"));
        }
    }
}

#[test]
fn scans_vjp_and_jvp_agree_with_finite_differences() {
    let p = with_x(&params(DType::F64, 7), &xs(DType::F64, &[], 8));
    let v = with_x(&params(DType::F64, 9), &xs(DType::F64, &[], 10));
    let eps = 1e-6;
    for reverse in [false, true] {
        let f = loss_all(run_scan, reverse);
        let at = |s: f64| {
            let q: BTreeMap<String, Tensor> = p
                .iter()
                .map(|(k, t)| (k.clone(), (t + (&v[k] * s).unwrap()).unwrap()))
                .collect();
            jit(f.clone()).call(&q).unwrap().to_scalar::<f64>().unwrap()
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * eps);
        let g = grad(f.clone()).call(&p).unwrap();
        let dot: f64 = g
            .iter()
            .map(|(k, t)| (t * &v[k]).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap())
            .sum();
        let (_, tangent) = jvp(&f, &p, &v).unwrap();
        let tangent = tangent.to_scalar::<f64>().unwrap();
        let tol = 1e-6 * fd.abs().max(1.0);
        assert!((dot - fd).abs() < tol, "vjp {dot} against finite differences {fd}");
        assert!(
            (tangent - fd).abs() < tol,
            "jvp {tangent} against finite differences {fd}"
        );
    }
}

/// `f` applied to each example alone, stacked.
fn per_example<O>(b: usize, mut f: impl FnMut(usize) -> O) -> Vec<O> {
    (0..b).map(&mut f).collect()
}

#[test]
fn vmap_of_scan_and_per_sample_gradients_equal_a_loop_of_single_calls() {
    const B: usize = 4;
    let p = params(DType::F64, 11);
    let x = xs(DType::F64, &[B], 12);
    let one = |i: usize| x.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
    for reverse in [false, true] {
        let f = loss(run_scan, reverse);
        let batched = vmap(f.clone()).in_dims([None, Some(0)]).call((&p, &x)).unwrap();
        let singles = per_example(B, |i| jit(f.clone()).call((&p, &one(i))).unwrap());
        assert_close(&batched, &Tensor::stack(&singles, 0).unwrap(), 1e-10, "vmap of scan");
        // per-sample gradients: vmap(grad)
        let psg = vmap(grad(f.clone())).in_dims([None, Some(0)]).call((&p, &x)).unwrap();
        let singles = per_example(B, |i| grad(f.clone()).call((&p, &one(i))).unwrap());
        for k in p.keys() {
            let want: Vec<Tensor> = singles.iter().map(|g| g[k].clone()).collect();
            assert_close(
                &psg[k],
                &Tensor::stack(&want, 0).unwrap(),
                1e-10,
                &format!("per-sample {k}"),
            );
        }
        // grad of the batched loss: the sum of the per-sample gradients
        let total = grad(|p: P, x: Tracer| vmap(f.clone()).in_dims([None, Some(0)]).apply((p, x))?.sum_all())
            .call((&p, &x))
            .unwrap();
        for k in p.keys() {
            assert_close(&total[k], &psg[k].sum(0).unwrap(), 1e-10, &format!("grad of vmap {k}"));
        }
        // forward mode through the batched loop: each example's tangent
        let v = params(DType::F64, 21);
        let xt = xs(DType::F64, &[B], 22);
        let batched = vmap(f.clone()).in_dims([None, Some(0)]);
        let (_, t) = jvp(&batched, (&p, &x), (&v, &xt)).unwrap();
        let singles = per_example(B, |i| {
            let ti = xt.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
            jvp(&f, (&p, &one(i)), (&v, &ti)).unwrap().1
        });
        assert_close(&t, &Tensor::stack(&singles, 0).unwrap(), 1e-10, "jvp of vmap");
        // chunks of the batch, and the batch on another axis of the data
        let chunked = vmap(f.clone())
            .in_dims([None, Some(0)])
            .chunk_size(3)
            .call((&p, &x))
            .unwrap();
        assert_close(
            &chunked,
            &batched.call((&p, &x)).unwrap(),
            1e-12,
            "chunked vmap of scan",
        );
        let moved = x.permute((1, 0, 2)).unwrap().contiguous().unwrap(); // T B E
        let on_axis_1 = vmap(f.clone()).in_dims([None, Some(1)]).call((&p, &moved)).unwrap();
        assert_close(&on_axis_1, &batched.call((&p, &x)).unwrap(), 1e-12, "batch on axis 1");
        // an ensemble: each model its own weights, one shared sequence
        let stacked: BTreeMap<String, Tensor> = params(DType::F64, 13)
            .iter()
            .map(|(k, t)| (k.clone(), Tensor::stack(&[t, &p[k], t], 0).unwrap()))
            .collect();
        let x0 = one(0);
        let ens = vmap(f.clone()).in_dims([Some(0), None]).call((&stacked, &x0)).unwrap();
        let singles = per_example(3, |m| {
            let pm: BTreeMap<String, Tensor> = stacked
                .iter()
                .map(|(k, t)| (k.clone(), t.narrow(0, m, 1).unwrap().squeeze(0).unwrap()))
                .collect();
            jit(f.clone()).call((&pm, &x0)).unwrap()
        });
        assert_close(&ens, &Tensor::stack(&singles, 0).unwrap(), 1e-10, "ensemble");
        // vmap of vmap: batches of batches
        let x2 = xs(DType::F64, &[2, B], 14);
        let vv = vmap(vmap(f.clone()).in_dims([None, Some(0)]))
            .in_dims([None, Some(0)])
            .call((&p, &x2))
            .unwrap();
        for j in 0..2 {
            let xj = x2.narrow(0, j, 1).unwrap().squeeze(0).unwrap();
            let want = vmap(f.clone()).in_dims([None, Some(0)]).call((&p, &xj)).unwrap();
            assert_close(
                &vv.narrow(0, j, 1).unwrap().squeeze(0).unwrap(),
                &want,
                1e-10,
                "vmap of vmap",
            );
        }
    }
}

#[test]
fn the_graph_does_not_grow_with_the_trip_count() {
    let p = params(DType::F32, 15);
    let nodes = |t: usize| {
        let x = rand(&[t, E], 16);
        let f = |p: P, x: Tracer| -> candle_func::Result<Tracer> {
            let (c, _) = scan(
                |c: Vec<Tracer>, x: Vec<Tracer>| Ok((vec![cell(&p, &c[0], &x[0])?], ())),
                vec![p["h0"].clone()],
                vec![x],
            )?;
            c[0].sum_all()
        };
        let g = make_graph(&grad(f), (&p, &x)).unwrap();
        let loops: Vec<String> = g.nodes().map(|n| n.name()).filter(|n| n.starts_with("scan")).collect();
        (g.nodes().count(), loops)
    };
    let (short, loops) = nodes(8);
    let (long, _) = nodes(512);
    assert_eq!(short, long, "a gradient through 8 and 512 steps has one graph size");
    assert_eq!(loops.len(), 2, "the forward loop and its backward loop: {loops:?}");
    // the backward loop carries the state's cotangent and the bias's sum
    // (two carries); W's and U's cotangents, one product a step, leave it as
    // factors and are contracted over the steps after it
    assert!(loops.iter().any(|l| l.contains("carries=2,reverse=true")), "{loops:?}");
}

/// A loop whose carries nothing reads (a forward pass) keeps its last
/// carry only, not every step's: its planned peak is the input's and not
/// twice it, and its values are the unrolled loop's. Under `grad` the
/// forward loop keeps every carry (the backward loop reads them) and the
/// backward loop keeps its last only.
#[test]
fn a_loop_whose_carries_nothing_reads_keeps_only_its_last() {
    const N: usize = 4096;
    const STEPS: usize = 128;
    let x = rand(&[STEPS, N], 17);
    let run = |looped: bool| {
        move |x: Tracer| -> candle_func::Result<Tracer> {
            let step = |c: Tracer, x: Tracer| -> candle_func::Result<(Tracer, Tracer)> {
                let c = c.mul(&x)?.add(&x)?.tanh()?;
                let y = c.sum_all()?;
                Ok((c, y))
            };
            let init = x.narrow(0, 0, 1)?.squeeze(0)?;
            let (c, ys) = match looped {
                true => scan(step, init, x)?,
                false => {
                    let (mut c, mut ys) = (init, Vec::new());
                    for t in 0..STEPS {
                        let y;
                        (c, y) = step(c, x.narrow(0, t, 1)?.squeeze(0)?)?;
                        ys.push(y.unsqueeze(0)?);
                    }
                    (c, Tracer::cat(&ys.iter().collect::<Vec<_>>(), 0)?)
                }
            };
            c.sum_all()?.add(&ys.sum_all()?)
        }
    };
    let g = make_graph(&run(true), &x).unwrap();
    let loops: Vec<String> = g.nodes().map(|n| n.name()).filter(|n| n.starts_with("scan")).collect();
    assert!(loops.len() == 1 && loops[0].contains("last carry only"), "{loops:?}");
    let input = STEPS * N * 4;
    // every carry kept would be another `input`
    assert!(
        g.planned_peak_bytes() < input + input / 4,
        "{} planned",
        g.planned_peak_bytes()
    );
    assert_close(
        &g.run(std::slice::from_ref(&x)).unwrap()[0],
        &jit(run(false)).call(&x).unwrap(),
        1e-5,
        "value",
    );
    let g = make_graph(&grad(run(true)), &x).unwrap();
    let loops: Vec<String> = g.nodes().map(|n| n.name()).filter(|n| n.starts_with("scan")).collect();
    assert_eq!(loops.len(), 2, "{loops:?}");
    assert!(loops.iter().any(|l| l.contains("reverse=false]")), "{loops:?}");
    assert!(
        loops.iter().any(|l| l.contains("reverse=true,last carry only")),
        "{loops:?}"
    );
    let (gl, gu) = (grad(run(true)).call(&x).unwrap(), grad(run(false)).call(&x).unwrap());
    assert_close(&gl, &gu, 1e-5, "gradient");
}

#[test]
fn a_loop_with_no_scanned_operand_runs_its_length_and_an_empty_one_returns_its_carry() {
    let x = Tensor::new(&[1.5f64, -0.5], &Device::Cpu).unwrap();
    let f = |steps: usize| {
        move |x: Tracer| -> candle_func::Result<(Tracer, Tracer)> {
            let (c, ys) = scan_with(
                |c: Vec<Tracer>, _: Vec<Tracer>| {
                    let n = c[0].affine(0.5, 1.0)?;
                    Ok((vec![n.clone()], vec![n.sum_all()?]))
                },
                vec![x],
                Vec::<Tracer>::new(),
                ScanOptions::new().length(steps),
            )?;
            Ok((c[0].clone(), ys[0].clone()))
        }
    };
    let (c, ys) = jit(f(3)).call(&x).unwrap();
    let mut want = x.clone();
    let mut sums = Vec::new();
    for _ in 0..3 {
        want = want.affine(0.5, 1.0).unwrap();
        sums.push(want.sum_all().unwrap());
    }
    assert_close(&c, &want, 1e-12, "three steps of x/2 + 1");
    assert_close(&ys, &Tensor::stack(&sums, 0).unwrap(), 1e-12, "their sums");
    let (c, ys) = jit(f(0)).call(&x).unwrap();
    assert_close(&c, &x, 0.0, "no step: the carry as given");
    assert_eq!(ys.dims(), &[0]);
    let g = grad(|x: Tracer| f(3)(x)?.0.sum_all()).call(&x).unwrap();
    assert_close(
        &g,
        &Tensor::new(&[0.125f64, 0.125], &Device::Cpu).unwrap(),
        1e-12,
        "d/dx of three halvings",
    );
}

fn shape_error<T: std::fmt::Debug>(r: candle_func::Result<T>) -> String {
    match r {
        Err(e @ Error::Shape { op: "scan", .. }) => e.to_string(),
        other => panic!("expected a shape error naming scan, got {other:?}"),
    }
}

#[test]
fn a_body_that_changes_its_carry_or_lengths_that_disagree_are_errors_naming_the_loop() {
    let x = rand(&[T, E], 17);
    let grows = |x: Tracer| {
        let init = x.narrow(0, 0, 1)?.squeeze(0)?;
        let (c, _) = scan(
            |c: Vec<Tracer>, x: Vec<Tracer>| Ok((vec![Tracer::cat(&[&c[0], &x[0]], 0)?], ())),
            vec![init],
            vec![x],
        )?;
        c[0].sum_all()
    };
    let msg = shape_error(jit(grows).call(&x));
    assert!(msg.contains("changed carry 0 from F32 [3] to F32 [6]"), "{msg}");
    let two = |x: Tracer| {
        let y = x.narrow(0, 0, T - 1)?;
        let (c, _) = scan(
            |c: Vec<Tracer>, _: Vec<Tracer>| Ok((c.to_vec(), ())),
            vec![x.sum_all()?],
            vec![x, y],
        )?;
        Ok(c[0].clone())
    };
    let msg = shape_error(jit(two).call(&x));
    assert!(msg.contains("6 and 5 steps"), "{msg}");
    let length = |x: Tracer| {
        let (c, _) = scan_with(
            |c: Vec<Tracer>, _: Vec<Tracer>| Ok((c.to_vec(), ())),
            vec![x.sum_all()?],
            vec![x],
            ScanOptions::new().length(4),
        )?;
        Ok(c[0].clone())
    };
    let msg = shape_error(jit(length).call(&x));
    assert!(msg.contains("4 and 6 steps"), "{msg}");
    // a mix of dtypes is carried, each leaf as itself (an i64 output
    // beside an f32 carry; tests/mixed_carries.rs)
    let mixed = |x: Tracer| {
        let (c, ys) = scan(
            |c: Vec<Tracer>, x: Vec<Tracer>| Ok((c.to_vec(), vec![x[0].to_dtype(DType::I64)?])),
            vec![x.sum_all()?],
            vec![x.clone()],
        )?;
        Ok((c[0].clone(), ys[0].clone()))
    };
    let (c, ys) = jit(mixed).call(&x).unwrap();
    assert_eq!(
        c.to_scalar::<f32>().unwrap(),
        x.sum_all().unwrap().to_scalar::<f32>().unwrap()
    );
    assert_eq!(
        ys.to_vec2::<i64>().unwrap(),
        x.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap()
    );
}

/// The carry, the scanned operands and the outputs are trees: a pair
/// carry (a state and a running count), a map of scanned operands, a
/// tuple of outputs; against the same loop written out step by step,
/// and its gradient through the tree.
#[test]
fn scan_takes_and_gives_trees() {
    let xs = rand(&[T, E], 21).to_dtype(DType::F64).unwrap();
    let ws = rand(&[T, E], 22).to_dtype(DType::F64).unwrap();
    let looped = |xs: Tracer, ws: Tracer| {
        let ops: BTreeMap<String, Tracer> = [("x".to_string(), xs.clone()), ("w".to_string(), ws)].into();
        let init = (
            xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 1.0)?,
            xs.sum_all()?.affine(0.0, 0.0)?,
        );
        let ((s, n), (ys, norms)) = scan(
            |(s, n): (Tracer, Tracer), o: BTreeMap<String, Tracer>| {
                let s = s.mul(&o["x"])?.add(&o["w"])?.tanh()?;
                let norm = s.sqr()?.sum_all()?;
                Ok(((s.clone(), n.affine(1.0, 1.0)?), (s, norm)))
            },
            init,
            ops,
        )?;
        Ok((s, n, ys, norms))
    };
    let unrolled = |xs: Tracer, ws: Tracer| {
        let mut s = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 1.0)?;
        let (mut ys, mut norms) = (Vec::new(), Vec::new());
        for t in 0..T {
            let (x, w) = (xs.narrow(0, t, 1)?.squeeze(0)?, ws.narrow(0, t, 1)?.squeeze(0)?);
            s = s.mul(&x)?.add(&w)?.tanh()?;
            norms.push(s.sqr()?.sum_all()?.unsqueeze(0)?);
            ys.push(s.unsqueeze(0)?);
        }
        let n = xs.sum_all()?.affine(0.0, T as f64)?;
        Ok((
            s,
            n,
            Tracer::cat(&ys.iter().collect::<Vec<_>>(), 0)?,
            Tracer::cat(&norms.iter().collect::<Vec<_>>(), 0)?,
        ))
    };
    let (s, n, ys, norms) = jit(looped).call((&xs, &ws)).unwrap();
    let (s2, n2, ys2, norms2) = jit(unrolled).call((&xs, &ws)).unwrap();
    assert_close(&s, &s2, 1e-12, "final state");
    assert_close(&n, &n2, 1e-12, "step count");
    assert_close(&ys, &ys2, 1e-12, "stacked states");
    assert_close(&norms, &norms2, 1e-12, "stacked norms");
    assert_eq!(ys.dims(), &[T, E]);
    type Four = candle_func::Result<(Tracer, Tracer, Tracer, Tracer)>;
    let loss = |f: fn(Tracer, Tracer) -> Four| {
        move |xs: Tracer, ws: Tracer| {
            let (s, _, _, norms) = f(xs, ws)?;
            s.sum_all()?.add(&norms.sum_all()?)
        }
    };
    let g = grad(loss(looped)).argnum::<1>().call((&xs, &ws)).unwrap();
    let g2 = grad(loss(unrolled)).argnum::<1>().call((&xs, &ws)).unwrap();
    assert_close(&g, &g2, 1e-12, "gradient through the tree");
}

#[test]
fn a_body_that_changes_its_carrys_structure_is_an_error_naming_the_loop() {
    let x = rand(&[T, E], 23);
    let grows = |x: Tracer| {
        let (c, ()) = scan(
            |c: Vec<Tracer>, _: Tracer| Ok((vec![c[0].clone(), c[0].clone()], ())),
            vec![x.sum_all()?],
            x,
        )?;
        Ok(c[0].clone())
    };
    let msg = shape_error(jit(grows).call(&x));
    assert!(msg.contains("structure"), "{msg}");
}
