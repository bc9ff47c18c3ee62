//! What the transforms emit: under `vmap(grad)` a convolution's weight
//! gradient takes the conv route (the Opacus unfold formula, a grouped
//! gradient, or a loop), a linear layer's per-sample gradient is one batched
//! matmul no larger than `[B, out, in]`, and no dead forward work remains.

mod common;

use candle_func::graph::NodeView;
use candle_func::{grad, make_graph, vmap, ConvRoute, Graph, Tracer};
use common::rand;

fn count(g: &Graph, pred: impl Fn(&NodeView) -> bool) -> usize {
    g.nodes().filter(|n| pred(n)).count()
}

fn has(g: &Graph, name: &str) -> bool {
    g.nodes().any(|n| n.name().starts_with(name))
}

fn conv_loss(w: Tracer, x: Tracer) -> candle_func::Result<Tracer> {
    x.unsqueeze(0)?.conv2d(&w, 1, 1, 1, 2)?.sqr()?.sum_all()
}

#[test]
fn conv_weight_gradient_takes_the_route() {
    let w = rand(&[6, 2, 3, 3], 1);
    let xs = rand(&[5, 4, 7, 7], 2);
    let graph = |r| make_graph(&vmap(grad(conv_loss)).in_dims([None, Some(0)]).conv_route(r), (&w, &xs)).unwrap();
    let g = graph(ConvRoute::Unfold);
    assert!(has(&g, "unfold2d") && has(&g, "matmul"), "{g}");
    assert!(!has(&g, "conv2d_grad_weight") && !has(&g, "map["), "{g}");
    let g = graph(ConvRoute::Grouped);
    assert!(
        g.nodes()
            .any(|n| n.name().starts_with("conv2d_grad_weight") && n.name().contains("g=10")),
        "{g}"
    );
    let g = graph(ConvRoute::Loop);
    assert!(
        g.nodes()
            .any(|n| n.name().starts_with("map[") && n.name().contains("conv2d_grad_weight")),
        "{g}"
    );
    // and the three agree
    let run = |r| {
        vmap(grad(conv_loss))
            .in_dims([None, Some(0)])
            .conv_route(r)
            .call((&w, &xs))
            .unwrap()
    };
    let base = run(ConvRoute::Loop);
    for r in [ConvRoute::Unfold, ConvRoute::Grouped] {
        common::assert_close(&run(r), &base, 1e-4, &format!("{r:?}"));
    }
}

#[test]
fn ungrouped_weight_gradient_is_one_primitive_per_example() {
    // groups = 1: the Unfold route computes each example's weight gradient
    // with one primitive, and agrees with the loop, for a 2-d and a 3-d
    // convolution.
    let loss2 = |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv2d(&w, 1, 2, 1, 1)?.sqr()?.sum_all();
    let w = rand(&[3, 4, 3, 3], 1);
    let xs = rand(&[5, 4, 7, 7], 2);
    let f = |r| vmap(grad(loss2)).in_dims([None, Some(0)]).conv_route(r);
    let g = make_graph(&f(ConvRoute::Unfold), (&w, &xs)).unwrap();
    assert!(has(&g, "conv2d_grad_weight_each") && !has(&g, "map["), "{g}");
    let got = f(ConvRoute::Unfold).call((&w, &xs)).unwrap();
    common::assert_close(&got, &f(ConvRoute::Loop).call((&w, &xs)).unwrap(), 1e-4, "2d");
    let loss3 = |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv3d(&w, 1, 1, 1, 1)?.sqr()?.sum_all();
    let w = rand(&[2, 3, 2, 2, 2], 3);
    let xs = rand(&[4, 3, 4, 5, 3], 4);
    let f = |r| vmap(grad(loss3)).in_dims([None, Some(0)]).conv_route(r);
    let got = f(ConvRoute::Unfold).call((&w, &xs)).unwrap();
    common::assert_close(&got, &f(ConvRoute::Loop).call((&w, &xs)).unwrap(), 1e-4, "3d");
}

#[test]
fn linear_per_sample_gradient_is_one_batched_matmul() {
    let (b, fin, fout) = (8, 32, 10);
    let w = rand(&[fout, fin], 1);
    let xs = rand(&[b, fin], 2);
    let loss = |w: Tracer, x: Tracer| x.unsqueeze(0)?.matmul(&w.t()?)?.tanh()?.sum_all();
    let g = make_graph(&vmap(grad(loss)).in_dims([None, Some(0)]), (&w, &xs)).unwrap();
    let biggest = g.nodes().map(|n| n.ty().elem_count()).max().unwrap();
    assert_eq!(biggest, b * fin * fout, "{g}");
    let big_matmuls: Vec<_> = g
        .nodes()
        .filter(|n| n.name() == "matmul" && n.ty().elem_count() == b * fin * fout)
        .collect();
    assert_eq!(big_matmuls.len(), 1, "{g}");
    // written in the gradient's own layout, `[B, out, in]`, not as
    // `[B, in, out]` and permuted
    assert_eq!(big_matmuls[0].ty().shape, vec![b, fout, fin], "{g}");
    let per = vmap(grad(loss)).in_dims([None, Some(0)]).call((&w, &xs)).unwrap();
    assert!(per.is_contiguous());
    for i in 0..b {
        let one = grad(loss).call((&w, &xs.get(i).unwrap())).unwrap();
        common::assert_close(&per.get(i).unwrap(), &one, 1e-5, &format!("example {i}"));
    }
}

#[test]
fn no_dead_forward_work() {
    // A two-layer MLP differentiated with respect to its weights only: two
    // forward matmuls, two weight gradients, one backward through layer 2;
    // no gradient with respect to the data.
    let w1 = rand(&[16, 8], 1);
    let w2 = rand(&[4, 16], 2);
    let xs = rand(&[6, 8], 3);
    let loss = |(w1, w2): (Tracer, Tracer), x: Tracer| {
        let h = x.unsqueeze(0)?.matmul(&w1.t()?)?.relu()?;
        let _unused = h.exp()?.sum_all()?;
        h.matmul(&w2.t()?)?.log_softmax(1)?.sum_all()
    };
    let g = make_graph(&vmap(grad(loss)).in_dims([None, Some(0)]), ((&w1, &w2), &xs)).unwrap();
    // (the first forward matmul carries its ReLU as a fused epilogue)
    let products = |n: &candle_func::graph::NodeView| n.name() == "matmul" || n.name().starts_with("fused[matmul");
    assert_eq!(count(&g, products), 5, "{g}");
    assert_eq!(
        count(&g, |p| p.name() == "exp"),
        1,
        "only log_softmax's gradient needs an exp: {g}"
    );
}

/// A flat vector cut by `narrow` into pieces: the gradient places the
/// pieces' cotangents side by side in one concatenation, with no full-size
/// zero pads added together.
#[test]
fn narrowed_pieces_share_one_concatenation() {
    let theta = rand(&[10], 1);
    let loss = |t: Tracer| {
        let (a, b, c) = (t.narrow(0, 0, 3)?, t.narrow(0, 3, 4)?, t.narrow(0, 8, 2)?);
        a.sqr()?
            .sum_all()?
            .add(&b.tanh()?.sum_all()?)?
            .add(&c.exp()?.sum_all()?)
    };
    let g = make_graph(&grad(loss), &theta).unwrap();
    let concats = count(&g, |n| n.name().starts_with("concat"));
    let full_adds = count(&g, |n| n.name() == "add" && n.ty().shape == vec![10]);
    assert_eq!((concats, full_adds), (1, 0), "{g}");
    // and the values: 2a, 1 - tanh^2 b, 0 at index 7, exp c
    let got = grad(loss).call(&theta).unwrap().to_vec1::<f32>().unwrap();
    let t = theta.to_vec1::<f32>().unwrap();
    for (i, (&gi, &ti)) in got.iter().zip(&t).enumerate() {
        let want = match i {
            0..=2 => 2.0 * ti,
            3..=6 => 1.0 - ti.tanh().powi(2),
            7 => 0.0,
            _ => ti.exp(),
        };
        assert!((gi - want).abs() < 1e-5, "{i}: {gi} vs {want}");
    }
}

/// The same pieces with a dense read of the whole vector between them in
/// the sum: the pieces still share one concatenation, added once to the
/// dense cotangent; overlapping pieces are added as they are.
#[test]
fn narrowed_pieces_beside_a_dense_read_and_overlapping_ones() {
    let theta = rand(&[10], 2);
    let dense = |t: Tracer| {
        let (a, c) = (t.narrow(0, 0, 3)?, t.narrow(0, 8, 2)?);
        a.sqr()?.sum_all()?.add(&t.sin()?.sum_all()?)?.add(&c.exp()?.sum_all()?)
    };
    let g = make_graph(&grad(dense), &theta).unwrap();
    let concats = count(&g, |n| n.name().starts_with("concat"));
    let full_adds = count(&g, |n| n.name() == "add" && n.ty().shape == vec![10]);
    assert_eq!((concats, full_adds), (1, 1), "{g}");
    let got = grad(dense).call(&theta).unwrap().to_vec1::<f32>().unwrap();
    let t = theta.to_vec1::<f32>().unwrap();
    for (i, (&gi, &ti)) in got.iter().zip(&t).enumerate() {
        let piece = match i {
            0..=2 => 2.0 * ti,
            8.. => ti.exp(),
            _ => 0.0,
        };
        assert!((gi - piece - ti.cos()).abs() < 1e-5, "{i}");
    }
    // [0, 4) and [2, 6) overlap: two pads, one add
    let overlapping = |t: Tracer| t.narrow(0, 0, 4)?.sqr()?.sum_all()?.add(&t.narrow(0, 2, 4)?.sum_all()?);
    let got = grad(overlapping).call(&theta).unwrap().to_vec1::<f32>().unwrap();
    for (i, (&gi, &ti)) in got.iter().zip(&t).enumerate() {
        let want = if i < 4 { 2.0 * ti } else { 0.0 } + if (2..6).contains(&i) { 1.0 } else { 0.0 };
        assert!((gi - want).abs() < 1e-5, "{i}: {gi} vs {want}");
    }
}

/// Per-example Jacobians of a linear layer w.r.t. its weight
/// (`vmap(jacrev)`, torch.func's NTK recipe): the batching rule folds
/// examples and basis rows into one outer product `[(B in), 1] @ [1, (C
/// C)]`, whose result is read split and transposed; it is computed as a
/// batch of products in the layout it is read in (`[B, (C C), in]`), not
/// written `[B, in, (C C)]` and copied by a permute.
#[test]
fn per_example_jacobians_are_written_in_their_own_layout() {
    use candle_func::jacrev;
    let (b, fin, c) = (6, 40, 5);
    let w = rand(&[c, fin], 3);
    let xs = rand(&[b, fin], 4);
    // a last (linear) layer: the cotangents are the basis, shared by all
    // examples, the inputs are the examples'
    let f = |w: Tracer, x: Tracer| x.unsqueeze(0)?.matmul(&w.t()?)?.squeeze(0);
    let jac = vmap(jacrev(f)).in_dims([None, Some(0)]);
    let g = make_graph(&jac, (&w, &xs)).unwrap();
    let big = b * c * c * fin;
    let outer: Vec<_> = g
        .nodes()
        .filter(|n| n.name() == "matmul" && n.ty().elem_count() == big)
        .collect();
    assert_eq!(outer.len(), 1, "{g}");
    assert_eq!(outer[0].ty().shape, vec![b, c * c, fin], "{g}");
    assert_eq!(
        count(&g, |n| n.name().starts_with("permute") && n.ty().elem_count() == big),
        0,
        "{g}"
    );
    let per = jac.call((&w, &xs)).unwrap();
    assert_eq!(per.dims(), &[b, c, c, fin]);
    assert!(per.is_contiguous());
    for i in 0..b {
        let one = candle_func::jit(jacrev(f)).call((&w, &xs.get(i).unwrap())).unwrap();
        common::assert_close(&per.get(i).unwrap(), &one, 1e-6, &format!("example {i}"));
    }
}

/// Per-sample gradients of sequence layers scale: a linear layer on `[T,
/// D]` inputs makes one `[B, out, in]` product (no `[B, T, out, in]`), an
/// embedding's gradient is an index-add of rows (no one-hot `[B, T, V]`),
/// and attention is one batched primitive (no per-example map, and no
/// `T x T` value kept).
#[test]
fn sequence_layers_per_sample_gradients_scale() {
    use candle_func::nn::{self, BlockConfig, CrossEntropy, Module, NormKind};
    let dev = candle_core::Device::Cpu;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, candle_core::DType::F32, &dev);
    let (v, d, t, b) = (50, 16, 12, 5);
    let block = BlockConfig {
        dim: d,
        heads: 2,
        ff: 32,
        causal: true,
        norm: NormKind::LayerNorm,
        act: nn::Activation::Gelu,
    };
    let m = nn::gpt(v, t, 1, block, vb).unwrap();
    let p = m.params();
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
    let xs = candle_core::Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let ys = xs.clone();
    let loss = |p: std::collections::BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = nn::functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        nn::cross_entropy_with(&logits, &y, CrossEntropy::default())
    };
    let g = make_graph(&vmap(grad(loss)).in_dims([None, Some(0), Some(0)]), (&p, &xs, &ys)).unwrap();
    // the largest value is a per-sample gradient itself ([B, V, D] for the
    // token table and the head, [B, ff, D] for the MLP), never T times one
    let biggest = g.nodes().map(|n| n.ty().elem_count()).max().unwrap();
    assert_eq!(biggest, b * v * d, "{g}");
    assert!(!has(&g, "map"), "no per-example loop: {g}");
    assert!(has(&g, "attention_grad"), "the fused attention's gradient: {g}");
    let square = |n: &candle_func::graph::NodeView| {
        let s = &n.ty().shape;
        s.len() >= 2 && s[s.len() - 1] == t && s[s.len() - 2] == t
    };
    assert_eq!(count(&g, square), 0, "no T x T value: {g}");
    // no value has a [.., T, .., V, .., D] layout of T x V x D elements
    assert_eq!(count(&g, |n| n.ty().elem_count() >= b * t * v * d / 2), 0, "{g}");
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((&p, &xs, &ys))
        .unwrap();
    for i in [0, 4] {
        let one = grad(loss).call((&p, &xs.get(i).unwrap(), &ys.get(i).unwrap())).unwrap();
        for (name, g) in &one {
            common::assert_close(&per[name].get(i).unwrap(), g, 1e-5, &format!("example {i} {name}"));
        }
    }
}

/// The gradient of a linear weight shared by a batch of rows is one
/// product over all the rows, `(B T) k`: no `[B, k, n]` product summed
/// after (it wrote B times the weight's size and ran far below the GEMM's
/// speed).
#[test]
fn a_shared_weight_gradient_is_one_product_over_every_row() {
    let w = rand(&[16, 24], 1);
    let xs = rand(&[8, 5, 16], 2);
    let loss = |w: Tracer, x: Tracer| x.matmul(&w)?.tanh()?.sum_all();
    let g = make_graph(&grad(loss), (&w, &xs)).unwrap();
    let per_row = count(&g, |n| n.ty().shape == [8, 16, 24]);
    assert_eq!(per_row, 0, "{g}");
    let products = count(&g, |n| n.name().starts_with("matmul") && n.ty().shape == [16, 24]);
    assert_eq!(products, 1, "{g}");
}
