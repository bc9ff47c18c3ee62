//! The Jacobian family over trees, as `torch.func` shapes it: for each
//! output leaf a tree like the differentiated arguments, with leaves
//! `[*out, *in]`. Each block is checked against the same block of the
//! Jacobian of one flat function (every input concatenated in, every
//! output concatenated out), which `tests/jvp.rs` checks against finite
//! differences.

mod common;

use candle_core::{DType, Tensor};
use candle_func::{hessian, hvp, jacfwd, jacrev, jit, vhp, vmap, Error, Function, Tracer};
use common::{assert_close, rand};
use std::collections::BTreeMap;

fn f64s(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed).to_dtype(DType::F64).unwrap()
}

/// Two outputs of two arguments: `y1 [3]` and `y2 [2, 2]`.
fn two_by_two(a: Tracer, b: Tracer) -> candle_func::Result<(Tracer, Tracer)> {
    let y1 = a.tanh()?.sum(0)?.mul(&b.narrow(0, 0, 3)?)?; // [3]
    let y2 = a.narrow(1, 0, 2)?.exp()?.mul(&b.narrow(0, 2, 2)?.sigmoid()?)?; // [2, 2]
    Ok((y1, y2))
}

/// `two_by_two` as one function of the concatenated inputs `[6 + 4]`
/// to the concatenated outputs `[3 + 4]`.
fn flat(theta: Tracer) -> candle_func::Result<Tracer> {
    let a = theta.narrow(0, 0, 6)?.reshape((2, 3))?;
    let b = theta.narrow(0, 6, 4)?;
    let (y1, y2) = two_by_two(a, b)?;
    Tracer::cat(&[&y1, &y2.reshape(4)?], 0)
}

/// Rows `r` and columns `c` of a matrix, shaped `shape`.
fn block(j: &Tensor, r: (usize, usize), c: (usize, usize), shape: &[usize]) -> Tensor {
    j.narrow(0, r.0, r.1)
        .unwrap()
        .narrow(1, c.0, c.1)
        .unwrap()
        .reshape(shape)
        .unwrap()
}

#[test]
fn argnums_and_tuple_outputs_give_one_block_per_pair() {
    let (a, b) = (f64s(&[2, 3], 1), f64s(&[4], 2));
    let theta = Tensor::cat(&[a.flatten_all().unwrap(), b.clone()], 0).unwrap();
    let want = jit(jacrev(flat)).call(&theta).unwrap(); // [7, 10]
    let ((j1a, j1b), (j2a, j2b)) = jit(jacrev(two_by_two).argnums::<0, 1>()).call((&a, &b)).unwrap();
    let ((f1a, f1b), (f2a, f2b)) = jit(jacfwd(two_by_two).argnums::<0, 1>()).call((&a, &b)).unwrap();
    let blocks = [
        (&j1a, &f1a, (0, 3), (0, 6), vec![3, 2, 3]),
        (&j1b, &f1b, (0, 3), (6, 4), vec![3, 4]),
        (&j2a, &f2a, (3, 4), (0, 6), vec![2, 2, 2, 3]),
        (&j2b, &f2b, (3, 4), (6, 4), vec![2, 2, 4]),
    ];
    for (k, (r, f, rows, cols, shape)) in blocks.into_iter().enumerate() {
        assert_eq!(r.dims(), &shape[..], "block {k}: [*out, *in]");
        let w = block(&want, rows, cols, &shape);
        assert_close(r, &w, 1e-12, &format!("jacrev block {k}"));
        assert_close(f, &w, 1e-12, &format!("jacfwd block {k}"));
    }
    // argnums in the other order swap the inner pair; one argnum, no pair
    let ((s1b, s1a), _) = jit(jacrev(two_by_two).argnums::<1, 0>()).call((&a, &b)).unwrap();
    assert_close(&s1a, &j1a, 0.0, "argnums (1, 0)");
    assert_close(&s1b, &j1b, 0.0, "argnums (1, 0)");
    let (only_b, _) = jit(jacfwd(two_by_two).argnum::<1>()).call((&a, &b)).unwrap();
    assert_close(&only_b, &j1b, 1e-12, "argnum 1");
}

#[test]
fn maps_of_parameters_give_maps_of_jacobians() {
    let p = BTreeMap::from([("a".to_string(), f64s(&[2, 3], 3)), ("b".to_string(), f64s(&[4], 4))]);
    let f = |p: BTreeMap<String, Tracer>| {
        let (y1, y2) = two_by_two(p["a"].clone(), p["b"].clone())?;
        Ok(vec![y1, y2])
    };
    let theta = Tensor::cat(&[p["a"].flatten_all().unwrap(), p["b"].clone()], 0).unwrap();
    let want = jit(jacfwd(flat)).call(&theta).unwrap();
    for (how, j) in [
        ("jacrev", jit(jacrev(f)).call(&p).unwrap()),
        ("jacfwd", jit(jacfwd(f)).call(&p).unwrap()),
    ] {
        assert_eq!(j.len(), 2, "{how}: one map per output");
        assert_close(&j[0]["a"], &block(&want, (0, 3), (0, 6), &[3, 2, 3]), 1e-12, how);
        assert_close(&j[0]["b"], &block(&want, (0, 3), (6, 4), &[3, 4]), 1e-12, how);
        assert_close(&j[1]["a"], &block(&want, (3, 4), (0, 6), &[2, 2, 2, 3]), 1e-12, how);
        assert_close(&j[1]["b"], &block(&want, (3, 4), (6, 4), &[2, 2, 4]), 1e-12, how);
    }
}

#[test]
fn aux_outputs_pass_through_and_chunks_change_nothing() {
    let (a, b) = (f64s(&[2, 3], 5), f64s(&[4], 6));
    let with_aux = |a: Tracer, b: Tracer| {
        let (y1, _) = two_by_two(a.clone(), b)?;
        // an integer aux: no derivative is taken of it
        Ok((y1, (a.gt(0.0)?, a.sum_all()?)))
    };
    let plain = jit(jacrev(two_by_two)).call((&a, &b)).unwrap().0;
    let (j, (idx, total)) = jit(jacrev(with_aux).has_aux()).call((&a, &b)).unwrap();
    assert_close(&j, &plain, 0.0, "jacrev has_aux");
    assert_eq!(idx.dtype(), DType::U8);
    assert_eq!(
        idx.to_vec2::<u8>().unwrap(),
        a.gt(0.0).unwrap().to_vec2::<u8>().unwrap()
    );
    assert_close(&total, &a.sum_all().unwrap(), 1e-12, "aux value");
    let (jf, _) = jit(jacfwd(with_aux).has_aux()).call((&a, &b)).unwrap();
    assert_close(&jf, &plain, 1e-12, "jacfwd has_aux");
    for k in [1, 2, 5, 100] {
        let r = jit(jacrev(two_by_two).chunk_size(k)).call((&a, &b)).unwrap();
        let f = jit(jacfwd(two_by_two).chunk_size(k)).call((&a, &b)).unwrap();
        assert_close(&r.0, &plain, 0.0, &format!("jacrev chunk {k}"));
        assert_close(
            &f.1,
            &jit(jacfwd(two_by_two)).call((&a, &b)).unwrap().1,
            0.0,
            "jacfwd chunk",
        );
    }
    let r = jit(jacrev(two_by_two).chunk_size(0)).call((&a, &b));
    assert!(r.is_err(), "chunk_size 0: {:?}", r.map(|_| ()));
}

#[test]
fn hessians_over_argnums_and_per_example_jacobians() {
    let (a, b) = (f64s(&[2, 3], 7), f64s(&[4], 8));
    let loss = |a: Tracer, b: Tracer| {
        let (y1, y2) = two_by_two(a, b)?;
        y1.sqr()?.sum_all()?.add(&y2.sum_all()?)
    };
    let flat_loss = |t: Tracer| {
        let y = flat(t)?;
        y.narrow(0, 0, 3)?.sqr()?.sum_all()?.add(&y.narrow(0, 3, 4)?.sum_all()?)
    };
    let theta = Tensor::cat(&[a.flatten_all().unwrap(), b.clone()], 0).unwrap();
    let h = jit(hessian(flat_loss)).call(&theta).unwrap(); // [10, 10]
    let ((haa, hab), (hba, hbb)) = jit(hessian(loss).argnums::<0, 1>()).call((&a, &b)).unwrap();
    assert_close(&haa, &block(&h, (0, 6), (0, 6), &[2, 3, 2, 3]), 1e-10, "H_aa");
    assert_close(&hab, &block(&h, (0, 6), (6, 4), &[2, 3, 4]), 1e-10, "H_ab");
    assert_close(&hba, &block(&h, (6, 4), (0, 6), &[4, 2, 3]), 1e-10, "H_ba");
    assert_close(&hbb, &block(&h, (6, 4), (6, 4), &[4, 4]), 1e-10, "H_bb");
    let hb = jit(hessian(loss).argnum::<1>()).call((&a, &b)).unwrap();
    assert_close(&hb, &hbb, 1e-12, "argnum 1");
    // hvp and vhp over a map agree with the Hessian
    let p = BTreeMap::from([("a".to_string(), a.clone()), ("b".to_string(), b.clone())]);
    let v = BTreeMap::from([("a".to_string(), f64s(&[2, 3], 9)), ("b".to_string(), f64s(&[4], 10))]);
    let map_loss = |p: BTreeMap<String, Tracer>| loss(p["a"].clone(), p["b"].clone());
    let vt = Tensor::cat(&[v["a"].flatten_all().unwrap(), v["b"].clone()], 0).unwrap();
    let want = h.matmul(&vt.unsqueeze(1).unwrap()).unwrap().squeeze(1).unwrap();
    for (how, r) in [
        ("hvp", hvp(&map_loss, &p, &v).unwrap()),
        ("vhp", vhp(&map_loss, &p, &v).unwrap()),
    ] {
        let got = Tensor::cat(&[r["a"].flatten_all().unwrap(), r["b"].clone()], 0).unwrap();
        assert_close(&got, &want, 1e-10, how);
    }
    // per-example Jacobians w.r.t. a map, the data batched
    let xs = f64s(&[5, 3], 11);
    let f = |p: BTreeMap<String, Tracer>, x: Tracer| p["a"].matmul(&x.unsqueeze(1)?)?.squeeze(1)?.tanh();
    let per = vmap(jacrev(f)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
    assert_eq!(per["a"].dims(), &[5, 2, 2, 3]);
    assert_eq!(per["b"].dims(), &[5, 2, 4], "b is unused: zeros");
    assert_eq!(
        per["b"].abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(),
        0.0
    );
    let one = jit(jacfwd(f)).call((&p, &xs.get(3).unwrap())).unwrap();
    assert_close(&per["a"].get(3).unwrap(), &one["a"], 1e-12, "example 3");
}

#[test]
fn empty_and_bad_input() {
    let x = f64s(&[3], 12);
    // no elements on one side: a zero-size Jacobian, not an error
    let empty = Tensor::zeros(0, DType::F64, x.device()).unwrap();
    let j = jit(jacrev(|x: Tracer| x.exp())).call(&empty).unwrap();
    assert_eq!(j.dims(), &[0, 0]);
    let j = jit(jacfwd(|x: Tracer, e: Tracer| Ok((x.exp()?, e.exp()?))).argnum::<1>())
        .call((&x, &empty))
        .unwrap();
    assert_eq!((j.0.dims(), j.1.dims()), (&[3, 0][..], &[0, 0][..]));
    // an argument named twice, an integer output, an integer argument
    let two = |a: Tracer, b: Tracer| a.mul(&b);
    let r = jit(jacrev(two).argnums::<0, 0>()).call((&x, &x));
    assert!(matches!(r, Err(Error::Tree { .. })), "{:?}", r.map(|_| ()));
    let r = jit(jacfwd(|x: Tracer| x.gt(0.0))).call(&x);
    assert!(
        matches!(r, Err(Error::DType { op: "jacfwd", .. })),
        "{:?}",
        r.map(|_| ())
    );
    let labels = Tensor::new(&[0u32, 2, 1], x.device()).unwrap();
    let pick = |x: Tracer, y: Tracer| x.gather(&y, 0);
    let r = jit(jacrev(pick).argnum::<1>()).call((&x, &labels));
    assert!(
        matches!(r, Err(Error::DType { op: "jacrev", .. })),
        "{:?}",
        r.map(|_| ())
    );
    // a direction of another structure or shape; a Hessian of integers
    let loss = |x: Tracer| x.sqr()?.sum_all();
    let r = vhp(&loss, &x, &f64s(&[4], 13));
    assert!(matches!(r, Err(Error::Tree { .. })), "{:?}", r.map(|_| ()));
    let (p, q) = (vec![x.clone()], vec![x.clone(), x.clone()]);
    let r = hvp(&|v: Vec<Tracer>| v[0].sqr()?.sum_all(), &p, &q);
    assert!(matches!(r, Err(Error::Tree { .. })), "{:?}", r.map(|_| ()));
    let ints = Tensor::new(&[1u32, 2], x.device()).unwrap();
    let r = jit(hessian(|x: Tracer| x.sum_all())).call(&ints);
    assert!(matches!(r, Err(Error::DType { .. })), "{:?}", r.map(|_| ()));
    // a basis of 2^20 x 2^20 elements (4 TiB) is refused before it is made
    let big = Tensor::zeros(1 << 20, DType::F32, x.device()).unwrap();
    let r = jit(jacfwd(|x: Tracer| x.exp())).call(&big);
    match r {
        Err(Error::Unsupported {
            transform: "jacfwd",
            msg,
            ..
        }) => assert!(msg.contains("1048576 x 1048576"), "{msg}"),
        other => panic!("expected an error, got {:?}", other.map(|_| ())),
    }
    // an integer argument that is not differentiated is fine
    let j = jit(jacrev(pick)).call((&x, &labels)).unwrap();
    assert_eq!(
        j.to_vec2::<f64>().unwrap(),
        vec![vec![1., 0., 0.], vec![0., 0., 1.], vec![0., 1., 0.]]
    );
    // a Jacobian called inside another trace, as a Function
    let outer = |x: Tracer| Function::apply(&jacrev(|x: Tracer| x.sqr()), (x,))?.sum_all();
    let s = jit(outer).call(&x).unwrap().to_scalar::<f64>().unwrap();
    let want = (&x * 2.0).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    assert!((s - want).abs() < 1e-12, "{s} vs {want}");
}
