//! `dp::clipped_grad_sum`: ghost norms and the folded clipped sum against
//! every per-sample gradient materialised, the graphs they make (no
//! per-sample weight gradient where the ghost form pays), the fallback's
//! warning and strict mode, and bad input.

use candle_core::{DType, Device, Tensor};
use candle_func::{dp, grad, make_graph, vmap, Error, Graph, Options, Tracer};
use common::{max_abs, max_diff};
use std::collections::BTreeMap;

mod common;

type Params = BTreeMap<String, Tensor>;

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    // deterministic values without a global generator: a hash of the index
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((h >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A two-layer network on one example `x: [T, D]` (or `[D]`), mean squared
/// output as the loss.
fn loss(p: BTreeMap<String, Tracer>, x: Tracer) -> candle_func::Result<Tracer> {
    let h = x.broadcast_matmul(&p["w1"].t()?)?.tanh()?;
    h.broadcast_matmul(&p["w2"].t()?)?.sqr()?.mean_all()
}

fn params(d: usize, h: usize, o: usize, dtype: DType) -> Params {
    BTreeMap::from([
        ("w1".to_string(), randn(&[h, d], 1, dtype)),
        ("w2".to_string(), randn(&[o, h], 2, dtype)),
    ])
}

/// The reference: per-sample gradients, Opacus's clipping, summed.
fn reference(p: &Params, xs: &Tensor, c: f64) -> (Params, Tensor) {
    let per = vmap(grad(loss)).in_dims([None, Some(0)]).call((p, xs)).unwrap();
    let norms = dp::norm_per_sample(&per).unwrap();
    let clipped = dp::clip_per_sample(&per, c).unwrap();
    (
        clipped.into_iter().map(|(k, g)| (k, g.sum(0).unwrap())).collect(),
        norms,
    )
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / max_abs(b).max(1e-300)
}

/// Whether `g` computes a value of `per` entries for each of `b` examples
/// (a per-sample gradient, in whatever layout; a broadcast is a view, and
/// the forward lookup's table broadcast over the batch is one).
fn has_per_sample(g: &Graph, b: usize, per: usize) -> bool {
    g.nodes().filter(|n| !n.name().starts_with("broadcast")).any(|n| {
        let s = &n.ty().shape;
        s.len() >= 2 && s[0] == b && s[1..].iter().product::<usize>() == per
    })
}

/// Ghost against materialised to `tol` relative; both against the
/// reference (whose norms and factors `dp` computes in f32) to 1e-5.
fn check_against_reference(p: &Params, xs: &Tensor, tol: f64) {
    let norms_ref = reference(p, xs, 1.0).1;
    let mut sorted = norms_ref.to_vec1::<f32>().unwrap();
    sorted.sort_by(f32::total_cmp);
    let c = sorted[sorted.len() / 2] as f64;
    let (want, want_norms) = reference(p, xs, c);
    let step = |ghost: bool| dp::clipped_grad_sum(loss, c).ghost(ghost).call((p, xs)).unwrap();
    let ((ghost, gn, losses), (full, fnorms, _)) = (step(true), step(false));
    assert_eq!(losses.dims(), &[xs.dims()[0]]);
    assert!(rel(&gn, &fnorms) < tol, "norms: {}", rel(&gn, &fnorms));
    assert!(
        rel(&gn, &want_norms) < 1e-5,
        "norms against the reference: {}",
        rel(&gn, &want_norms)
    );
    for (k, g) in &ghost {
        assert!(rel(g, &full[k]) < tol, "{k}: {}", rel(g, &full[k]));
        assert!(
            rel(g, &want[k]) < 1e-5,
            "{k} against the reference: {}",
            rel(g, &want[k])
        );
    }
}

#[test]
fn vector_inputs_take_no_per_sample_weight_gradient() {
    for dtype in [DType::F32, DType::F64] {
        let p = params(20, 30, 5, dtype);
        let xs = randn(&[8, 20], 3, dtype);
        check_against_reference(&p, &xs, if dtype == DType::F32 { 1e-5 } else { 1e-12 });
        let ghost = make_graph(&dp::clipped_grad_sum(loss, 1.0), (&p, &xs)).unwrap();
        let full = make_graph(&dp::clipped_grad_sum(loss, 1.0).ghost(false), (&p, &xs)).unwrap();
        for per in [30 * 20, 5 * 30] {
            assert!(
                !has_per_sample(&ghost, 8, per),
                "a per-sample gradient of {per} in\n{ghost}"
            );
            assert!(has_per_sample(&full, 8, per), "materialised: none of {per} in\n{full}");
        }
    }
}

#[test]
fn short_sequences_are_ghosted_and_long_ones_materialised() {
    // K (m + n) < m n: T = 3 on 16 -> 16 -> 16 is ghosted, T = 40 is not
    let p = params(16, 16, 16, DType::F32);
    for (t, ghosted) in [(3, true), (40, false)] {
        let xs = randn(&[4, t, 16], 4, DType::F32);
        check_against_reference(&p, &xs, 1e-5);
        let g = make_graph(&dp::clipped_grad_sum(loss, 1.0), (&p, &xs)).unwrap();
        assert_eq!(!has_per_sample(&g, 4, 16 * 16), ghosted, "T = {t}:\n{g}");
    }
}

#[test]
fn a_gradient_without_a_rule_warns_or_fails_in_strict_mode() {
    // a per-position scale: its per-example gradient is an elementwise product
    let scaled = |p: BTreeMap<String, Tracer>, x: Tracer| x.mul(&p["s"])?.sqr()?.sum_all();
    let p = BTreeMap::from([("s".to_string(), randn(&[6], 5, DType::F32))]);
    let xs = randn(&[3, 6], 6, DType::F32);
    let (got, warnings) = candle_func::settings::capture_warnings(|| dp::clipped_grad_sum(scaled, 0.5).call((&p, &xs)));
    let (got, _, _) = got.unwrap();
    assert!(warnings.iter().any(|w| w.key == "ghost-mul"), "{warnings:?}");
    let per = vmap(grad(scaled)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
    let want = dp::clip_per_sample(&per, 0.5).unwrap()["s"].sum(0).unwrap();
    assert!(rel(&got["s"], &want) < 1e-6);
    let strict = dp::clipped_grad_sum(scaled, 0.5).options(Options::new().strict(true));
    match strict.call((&p, &xs)) {
        Err(Error::Unsupported { .. }) => {}
        other => panic!("strict mode: {other:?}"),
    }
}

#[test]
fn a_nan_example_makes_the_sum_nan_as_in_opacus() {
    // Opacus: (C / (norm + 1e-6)).clamp(max=1) is NaN for a NaN norm, and
    // so is the clipped sum; the other examples' norms stay finite
    let p = params(4, 3, 2, DType::F32);
    let mut v = randn(&[3, 4], 9, DType::F32).to_vec2::<f32>().unwrap();
    v[1][2] = f32::NAN;
    let xs = Tensor::new(v, &Device::Cpu).unwrap();
    for ghost in [true, false] {
        let (sum, norms, _) = dp::clipped_grad_sum(loss, 1.0).ghost(ghost).call((&p, &xs)).unwrap();
        let n = norms.to_vec1::<f32>().unwrap();
        assert!(
            n[0].is_finite() && n[1].is_nan() && n[2].is_finite(),
            "ghost {ghost}: {n:?}"
        );
        for (k, g) in &sum {
            let all_nan = g
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|x| x.is_nan());
            assert!(all_nan, "ghost {ghost}: {k} is not NaN");
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    let p = params(4, 3, 2, DType::F32);
    let xs = randn(&[2, 4], 7, DType::F32);
    for c in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = dp::clipped_grad_sum(loss, c).call((&p, &xs)).unwrap_err();
        assert!(e.to_string().contains("max_norm"), "{e}");
    }
    // the inner vmap's options pass through (no ghost norms in chunks:
    // every per-sample gradient materialised, the same sums)
    let (whole, norms, _) = dp::clipped_grad_sum(loss, 1.0).call((&p, &xs)).unwrap();
    let (chunked, chunk_norms, _) = dp::clipped_grad_sum(loss, 1.0)
        .options(Options::new().chunk_size(1))
        .call((&p, &xs))
        .unwrap();
    assert!(max_diff(&norms, &chunk_norms) < 1e-5);
    for (k, v) in &whole {
        assert!(max_diff(v, &chunked[k]) < 1e-5, "{k}");
    }
    // examples of different sizes, and parameters given a batch axis they lack
    let e = dp::clipped_grad_sum(loss, 1.0)
        .call((&p, &randn(&[2, 5], 8, DType::F32)))
        .unwrap_err();
    assert!(!e.to_string().is_empty());
    let e = dp::clipped_grad_sum(loss, 1.0)
        .in_dims([Some(0), Some(0)])
        .call((&p, &xs))
        .unwrap_err();
    assert!(!e.to_string().is_empty());
}

#[test]
fn embeddings_and_attention_of_a_small_gpt() {
    use candle_func::nn::{self, functional_call, Activation, BlockConfig, Module, NormKind};
    // T = 5 positions of a 50-token vocabulary: the token embedding is
    // ghosted (T² < V), the 5-row position table materialised, and the
    // 16-wide linear layers ghosted (T (m + n) < m n)
    let (v, t, d, b) = (50, 5, 16, 6);
    let block = BlockConfig {
        dim: d,
        heads: 2,
        ff: 32,
        causal: true,
        norm: NormKind::LayerNorm,
        act: Activation::Gelu,
    };
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let m = nn::gpt(v, t, 1, block, vb).unwrap();
    let p = m.params();
    let ids = |k: u32| {
        Tensor::from_vec(
            (0..(b * t) as u32).map(|i| (i * k + 3) % v as u32).collect(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap()
    };
    let (xs, ys) = (ids(7), ids(13));
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy_with(
            &functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?,
            &y,
            Default::default(),
        )
    };
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((&p, &xs, &ys))
        .unwrap();
    let norms = dp::norm_per_sample(&per).unwrap();
    let mut sorted = norms.to_vec1::<f32>().unwrap();
    sorted.sort_by(f32::total_cmp);
    let c = sorted[b / 2] as f64;
    let want = dp::clip_per_sample(&per, c).unwrap();
    let step = |ghost: bool| dp::clipped_grad_sum(loss, c).ghost(ghost).call((&p, &xs, &ys)).unwrap();
    let ((ghost, gn, _), (full, fnorms, _)) = (step(true), step(false));
    assert!(rel(&gn, &fnorms) < 1e-5 && rel(&gn, &norms) < 1e-5, "norms");
    for (k, g) in &ghost {
        assert!(rel(g, &full[k]) < 1e-5, "{k}: {}", rel(g, &full[k]));
        assert!(rel(g, &want[k].sum(0).unwrap()) < 1e-5, "{k} against the reference");
    }
    let g = make_graph(&dp::clipped_grad_sum(loss, c), (&p, &xs, &ys)).unwrap();
    assert!(
        !has_per_sample(&g, b, v * d),
        "a per-sample token embedding gradient in\n{g}"
    );
    assert!(
        !has_per_sample(&g, b, d * 32),
        "a per-sample feed-forward gradient in\n{g}"
    );
    let full = make_graph(&dp::clipped_grad_sum(loss, c).ghost(false), (&p, &xs, &ys)).unwrap();
    assert!(has_per_sample(&full, b, v * d));
}

#[test]
fn convolutions_take_chunked_norms_or_materialise_whichever_holds_less() {
    // conv cin -> 6 (k, stride 2, padding k/2) on 10x10, relu, flatten,
    // linear to 3; the unfold route makes the per-example weight gradient
    // one product. With cin = 2, k = 3 its 6 x 18 entries are fewer than
    // the output gradient's 6 x 25 and the input's 2 x 100 that the chunked
    // form would hold, so it is materialised; with cin = 4, k = 5 (600
    // against 150 + 400) the norms are chunked.
    for (cin, k, chunked) in [(2, 3, false), (4, 5, true)] {
        let cnn = move |p: BTreeMap<String, Tracer>, x: Tracer| {
            let h = x.unsqueeze(0)?.conv2d(&p["c"], k / 2, 2, 1, 1)?.relu()?.flatten_all()?;
            h.unsqueeze(0)?.broadcast_matmul(&p["l"].t()?)?.sqr()?.mean_all()
        };
        for dtype in [DType::F32, DType::F64] {
            let p = BTreeMap::from([
                ("c".to_string(), randn(&[6, cin, k, k], 7, dtype)),
                ("l".to_string(), randn(&[3, 6 * 5 * 5], 8, dtype)),
            ]);
            let xs = randn(&[9, cin, 10, 10], 9, dtype);
            let per = vmap(grad(cnn)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
            let norms = dp::norm_per_sample(&per).unwrap();
            let mut sorted = norms.to_vec1::<f32>().unwrap();
            sorted.sort_by(f32::total_cmp);
            let c = sorted[4] as f64;
            let want = dp::clip_per_sample(&per, c).unwrap();
            let opts = Options::new().conv_route(candle_func::ConvRoute::Unfold);
            let step = dp::clipped_grad_sum(cnn, c).options(opts);
            let (got, got_norms, _) = step.call((&p, &xs)).unwrap();
            let full = dp::clipped_grad_sum(cnn, c).options(opts).ghost(false);
            let (full, full_norms, _) = full.call((&p, &xs)).unwrap();
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            assert!(rel(&got_norms, &full_norms) < tol);
            // norm_per_sample and the reference's clip factors work in f32
            let r = rel(&got_norms.to_dtype(DType::F32).unwrap(), &norms);
            assert!(r < 1e-5, "{dtype:?} norms: {r}");
            for (name, g) in &got {
                assert!(rel(g, &full[name]) < tol, "{dtype:?} {name}: {}", rel(g, &full[name]));
                let w = want[name].sum(0).unwrap();
                assert!(rel(g, &w) < 1e-5, "{dtype:?} {name}: {}", rel(g, &w));
            }
            let g = make_graph(&step, (&p, &xs)).unwrap();
            let has_norms = g.nodes().any(|n| n.name().starts_with("conv2d_grad_weight_sq_norms"));
            assert_eq!(has_norms, chunked, "{g}");
            assert_eq!(has_per_sample(&g, 9, 6 * cin * k * k), !chunked, "{g}");
            if chunked {
                // Not differentiable: a loud error naming the primitive.
                let twice = grad(|p: BTreeMap<String, Tracer>, x: Tracer| {
                    let inner = dp::clipped_grad_sum(cnn, c).options(opts);
                    let (_, norms, _) = candle_func::Function::apply(&inner, (p, x))?;
                    norms.sum_all()
                });
                let msg = twice.call((&p, &xs)).map(|_| ()).unwrap_err().to_string();
                assert!(msg.contains("grad_weight_sq_norms"), "{msg}");
            }
        }
    }
}

#[test]
fn per_sample_grad_norms_match_the_materialised_norms_without_them() {
    for dtype in [DType::F32, DType::F64] {
        let p = params(20, 30, 5, dtype);
        let xs = randn(&[8, 20], 3, dtype);
        let (norms, losses) = dp::per_sample_grad_norms(loss).call((&p, &xs)).unwrap();
        let want = reference(&p, &xs, 1.0).1;
        assert_eq!(losses.dims(), &[8]);
        let r = rel(&norms.to_dtype(DType::F32).unwrap(), &want);
        assert!(r < 1e-5, "{dtype:?}: {r}");
        let g = make_graph(&dp::per_sample_grad_norms(loss), (&p, &xs)).unwrap();
        for per in [30 * 20, 5 * 30] {
            assert!(!has_per_sample(&g, 8, per), "a per-sample gradient of {per} in\n{g}");
        }
        // The materialised reference agrees.
        let full = dp::per_sample_grad_norms(loss).ghost(false).call((&p, &xs)).unwrap().0;
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        assert!(rel(&norms, &full) < tol);
    }
    // A scalar "batch" has no examples to take norms of.
    let p = params(4, 3, 2, DType::F32);
    let x = randn(&[4], 1, DType::F32);
    let err = dp::per_sample_grad_norms(loss)
        .in_dims([None::<i32>, None])
        .call((&p, &x));
    assert!(err.is_err());
}

#[test]
fn a_long_sequence_of_few_distinct_tokens_ghosts_its_embedding_by_grouping_ids() {
    use candle_func::nn::{self, Module, Params as With};
    // T = 12 of a 20-token vocabulary: T² > V (the pairwise form would
    // cost more than the table), T < V (grouping equal ids costs less):
    // ghosted, with repeated ids in every example
    let (v, t, d, b) = (20usize, 12usize, 4, 5usize);
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
    let emb = nn::embedding(v, d, vb.pp("emb")).unwrap();
    let head = nn::linear(d, 3, vb.pp("head")).unwrap();
    let mut p = emb.params();
    p.extend(head.params());
    let xs = Tensor::from_vec(
        (0..(b * t) as u32)
            .map(|i| (i * i + 3 * (i / t as u32)) % v as u32)
            .collect(),
        (b, t),
        &Device::Cpu,
    )
    .unwrap();
    let ys = Tensor::from_vec((0..b as u32).map(|i| i % 3).collect(), b, &Device::Cpu).unwrap();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let p = With::with(&p);
        let h = emb.forward_with(&p, &x)?.sin()?.mean_keepdim(0)?; // 1 D
        nn::cross_entropy(&head.forward_with(&p, &h)?, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let per = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .call((&p, &xs, &ys))
        .unwrap();
    let norms = dp::norm_per_sample(&per).unwrap();
    let c = norms.to_vec1::<f32>().unwrap()[2] as f64;
    let want = dp::clip_per_sample(&per, c).unwrap();
    let step = |ghost: bool| dp::clipped_grad_sum(loss, c).ghost(ghost).call((&p, &xs, &ys)).unwrap();
    let ((ghost, gn, _), (full, fnorms, _)) = (step(true), step(false));
    assert!(rel(&gn, &fnorms) < 1e-10, "norms: {}", rel(&gn, &fnorms));
    for (k, g) in &ghost {
        assert!(rel(g, &full[k]) < 1e-10, "{k}: {}", rel(g, &full[k]));
        assert!(rel(g, &want[k].sum(0).unwrap()) < 1e-5, "{k} against the reference");
    }
    let g = make_graph(&dp::clipped_grad_sum(loss, c), (&p, &xs, &ys)).unwrap();
    assert!(g.nodes().any(|n| n.name().starts_with("lookup_sq_norms")), "{g}");
    assert!(!has_per_sample(&g, b, v * d), "a per-sample embedding gradient in\n{g}");
}

/// Automatic clipping (Bu et al. 2023): `Σ_b g_b / (||g_b|| + γ)`, with
/// ghost norms and with every per-sample gradient materialised, against
/// the per-sample gradients scaled by hand; and `γ ≤ 0` refused.
#[test]
fn automatic_clipping_normalises_each_example() {
    let gamma = 0.01;
    let p = params(6, 5, 3, DType::F64);
    // sequences, so the ghost rule for linear layers applies
    let xs = randn(&[7, 4, 6], 9, DType::F64);
    let per = vmap(grad(loss)).in_dims([None, Some(0)]).call((&p, &xs)).unwrap();
    // the norms in f64 by hand (dp::norm_per_sample works in f32)
    let sq = per
        .values()
        .fold(Tensor::zeros(7, DType::F64, &Device::Cpu).unwrap(), |acc, g| {
            (acc + g.sqr().unwrap().flatten_from(1).unwrap().sum(1).unwrap()).unwrap()
        });
    let norms = sq.sqrt().unwrap();
    let scale = (norms.affine(1.0, gamma).unwrap().recip()).unwrap();
    for ghost in [true, false] {
        let (sum, got_norms, _) = dp::clipped_grad_sum(loss, 123.0)
            .automatic(gamma)
            .ghost(ghost)
            .call((&p, &xs))
            .unwrap();
        assert!(
            rel(&got_norms, &norms) < 1e-9,
            "ghost {ghost}: {}",
            rel(&got_norms, &norms)
        );
        for (k, g) in &per {
            let shape: Vec<usize> = std::iter::once(7).chain(std::iter::repeat_n(1, g.rank() - 1)).collect();
            let want = g.broadcast_mul(&scale.reshape(shape).unwrap()).unwrap().sum(0).unwrap();
            assert!(
                rel(&sum[k], &want) < 1e-9,
                "ghost {ghost}, {k}: {}",
                rel(&sum[k], &want)
            );
        }
    }
    // each example's contribution has norm below 1, whatever its size
    let big = (xs.clone() * 1e3).unwrap();
    let one = big.narrow(0, 0, 1).unwrap();
    let (sum, _, _) = dp::clipped_grad_sum(loss, 1.0)
        .automatic(gamma)
        .call((&p, &one))
        .unwrap();
    let n = sum
        .values()
        .map(|g| g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap())
        .sum::<f64>()
        .sqrt();
    assert!(n < 1.0 && n > 0.99, "{n}");
    for bad in [0.0, -1.0, f64::NAN] {
        let e = dp::clipped_grad_sum(loss, 1.0)
            .automatic(bad)
            .call((&p, &xs))
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("gamma"), "{e}");
    }
}
