//! Half precision (f16, bf16) reductions accumulate in f32, as PyTorch's
//! do: each kind of reduction on inputs where accumulating in the element
//! dtype fails (long rows of equal values, a 49,152-way cross-entropy),
//! compared with the same run in f32 within the half dtype's rounding.

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, cross_entropy, Module, Params, Reduction};
use candle_func::{grad, jit, Tracer};

mod common;

const HALVES: [DType; 2] = [DType::BF16, DType::F16];

/// A vocabulary's width (Qwen2's is three times as wide; 49,152 is
/// SmolLM2's): summed in bf16, its ones stop growing at 256.
const WIDE: usize = 49_152;

/// The largest relative gap between `half` (as f64) and `full`.
fn rel_gap(half: &Tensor, full: &Tensor) -> f64 {
    let (h, f) = (common::values(half), common::values(full));
    assert_eq!(h.len(), f.len());
    h.iter()
        .zip(&f)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// A half dtype's relative rounding (a few of its ulps).
fn tol(dt: DType) -> f64 {
    match dt {
        DType::BF16 => 3.0 * 2f64.powi(-8),
        _ => 3.0 * 2f64.powi(-11),
    }
}

/// `f` run on `x` in `dt` and in f32: the results' relative gap is within
/// `dt`'s rounding, and the half run's result keeps `dt`.
fn agrees(what: &str, x: &Tensor, f: impl Fn(Tracer) -> candle_func::Result<Tracer> + Clone) {
    let full = jit(f.clone()).call(x.to_dtype(DType::F32).unwrap()).unwrap();
    for dt in HALVES {
        let half = jit(f.clone()).call(x.to_dtype(dt).unwrap()).unwrap();
        assert_eq!(half.dtype(), dt, "{what}: the result keeps the dtype");
        let gap = rel_gap(&half, &full);
        assert!(gap <= tol(dt), "{what} in {dt:?}: {gap:e} from f32 ({half} vs {full})");
    }
}

#[test]
fn sums_and_means_of_long_rows_accumulate_in_f32() {
    let ones = Tensor::ones((2, WIDE), DType::F32, &Device::Cpu).unwrap();
    agrees("sum of ones", &ones, |x| x.sum(1));
    // one row: both rows' 98,304 would pass f16's largest value
    agrees("sum over everything", &ones.narrow(0, 0, 1).unwrap(), |x| x.sum_all());
    let tenths = (&ones * 0.1).unwrap();
    agrees("mean of tenths", &tenths, |x| x.mean(1));
    // over the leading axis (a bias's gradient over a batch)
    agrees("sum over rows", &ones.t().unwrap().contiguous().unwrap(), |x| x.sum(0));
}

#[test]
fn softmax_and_cross_entropy_over_a_vocabulary_accumulate_in_f32() {
    let zeros = Tensor::zeros((2, WIDE), DType::F32, &Device::Cpu).unwrap();
    agrees("softmax of equal logits", &zeros, |x| x.softmax(-1));
    agrees("log_softmax of equal logits", &zeros, |x| x.log_softmax(-1));
    let labels = Tensor::new(&[3u32, 40_000], &Device::Cpu).unwrap();
    for dt in HALVES {
        let loss = jit(|x: Tracer, y: Tracer| cross_entropy(&x, &y, Reduction::Mean))
            .call((&zeros.to_dtype(dt).unwrap(), &labels))
            .unwrap();
        let got = loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        let want = (WIDE as f64).ln();
        assert!(
            (got - want).abs() / want <= tol(dt),
            "cross-entropy in {dt:?}: {got}, want ln {WIDE} = {want}"
        );
    }
}

#[test]
fn norms_over_long_rows_accumulate_in_f32() {
    // a row of 1s and 3s: mean 2, variance 1, normalised to -1 and 1 (a
    // bf16 sum of it loses the 1s and 3s once it passes 4,096)
    let n = 8192;
    let v: Vec<f32> = (0..2 * n).map(|i| if i % 2 == 0 { 1.0 } else { 3.0 }).collect();
    let x = Tensor::from_vec(v, (2, n), &Device::Cpu).unwrap();
    let ones = Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    agrees("layer norm", &x, move |x| {
        let w = ones.to_dtype(x.dtype()).unwrap();
        nn::LayerNorm::from_tensors(w, None, 1e-5, "ln").forward_with(&Params::own(), &x)
    });
    // a norm per row (the reduction of the DP clipping norms)
    agrees("row norms", &x, |x| x.sqr()?.sum(1)?.sqrt());
}

#[test]
fn products_and_gradient_sums_over_long_axes_accumulate_in_f32() {
    let a = Tensor::ones((2, WIDE), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::ones((WIDE, 3), DType::F32, &Device::Cpu).unwrap();
    let full = a.matmul(&b).unwrap();
    for dt in HALVES {
        let half = jit(|a: Tracer, b: Tracer| a.matmul(&b))
            .call((&a.to_dtype(dt).unwrap(), &b.to_dtype(dt).unwrap()))
            .unwrap();
        let gap = rel_gap(&half, &full);
        assert!(gap <= tol(dt), "a product over {WIDE} in {dt:?}: {gap:e} ({half})");
    }
    // the gradient of a bias added to every row sums its cotangent over
    // the rows
    let rows = Tensor::ones((WIDE, 4), DType::F32, &Device::Cpu).unwrap();
    let bias = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let g = |x: &Tensor, b: &Tensor| {
        grad(|b: Tracer, x: Tracer| x.broadcast_add(&b)?.sum_all())
            .call((b, x))
            .unwrap()
    };
    let full = g(&rows, &bias);
    for dt in HALVES {
        let half = g(&rows.to_dtype(dt).unwrap(), &bias.to_dtype(dt).unwrap());
        let gap = rel_gap(&half, &full);
        assert!(
            gap <= tol(dt),
            "a bias's gradient over {WIDE} rows in {dt:?}: {gap:e} ({half})"
        );
    }
}

#[test]
fn a_private_sum_of_half_precision_gradients_accumulates_in_f32() {
    use candle_func::dp::privatize;
    use candle_func::rng::Rng;
    use std::collections::BTreeMap;
    // WIDE examples' gradients of 1 each (norms under the clip): summed
    // in bf16 they stop at 256
    let g = Tensor::ones((WIDE, 2), DType::F32, &Device::Cpu).unwrap();
    let run = |dt: DType| {
        let grads = BTreeMap::from([("w".to_string(), g.to_dtype(dt).unwrap())]);
        privatize(&grads, 10.0, 0.0, 1.0, &mut Rng::seeded(0)).unwrap()["w"].clone()
    };
    let full = run(DType::F32);
    for dt in HALVES {
        let half = run(dt);
        assert_eq!(half.dtype(), dt);
        let gap = rel_gap(&half, &full);
        assert!(gap <= tol(dt), "privatize in {dt:?}: {gap:e} ({half})");
    }
}

/// Adam and SGD with momentum over a half-precision weight keep their
/// moments in f32: bit for bit those of the same run over an f32 weight
/// (the gradients are exact in bf16 and there is no weight decay, so the
/// weight never reaches the moments), where in bf16 `v * 0.999` rounds
/// back to `v` and the second moment never decays. The weight is stepped
/// in f32 and rounded once: bit for bit an f32 run whose weight is rounded
/// to the half dtype after every step.
#[test]
fn optimiser_moments_of_half_precision_weights_are_kept_in_f32() {
    use candle_func::optim::{Adam, AdamW, Optimizer, Sgd};
    use std::collections::BTreeMap;
    let init: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
    // (the weight's dtype, the dtype an f32 weight is rounded to per step)
    // 0: Adam, 1: SGD with momentum, 2: AdamW with decoupled decay (the
    // decayed weight is the step's start: the moments stay bit for bit)
    let run = |dt: DType, round: Option<DType>, kind: usize| {
        let vm = candle_nn::VarMap::new();
        let w = vm.get(64, "w", candle_nn::Init::Const(0.0), dt, &Device::Cpu).unwrap();
        let set = |t: &Tensor| vm.data().lock().unwrap()["w"].set(t).unwrap();
        let start = Tensor::new(init.as_slice(), &Device::Cpu).unwrap();
        set(&start.to_dtype(round.unwrap_or(dt)).unwrap().to_dtype(dt).unwrap());
        let mut opt: Box<dyn Optimizer> = match kind {
            0 => Box::new(Adam::new(&vm, 0.05).unwrap()),
            1 => Box::new(Sgd::new(&vm, 0.05, 0.9).unwrap()),
            _ => Box::new(AdamW::new(&vm, 0.05, 0.1).unwrap()),
        };
        for step in 0..200 {
            // 1 for 50 steps, then 1/64: exact in bf16 and f16
            let g = if step < 50 { 1.0 } else { 1.0 / 64.0 };
            let g = Tensor::full(g, 64, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            opt.step(&BTreeMap::from([("w".to_string(), g)])).unwrap();
            if let Some(r) = round {
                set(&w.to_dtype(r).unwrap().to_dtype(dt).unwrap());
            }
        }
        (w.to_dtype(DType::F32).unwrap(), opt.state().unwrap().tensors)
    };
    for kind in 0..3 {
        for dt in HALVES {
            let (w, s) = run(dt, None, kind);
            let (w32, s32) = run(DType::F32, Some(dt), kind);
            assert!(!s.is_empty(), "optimiser {kind} keeps state");
            for (k, t) in &s {
                assert_eq!(t.dtype(), DType::F32, "{k} of a {dt:?} weight");
                assert_eq!(bits(t), bits(&s32[k]), "{k} of a {dt:?} weight against an f32 weight's");
            }
            assert_eq!(
                bits(&w),
                bits(&w32),
                "optimiser {kind}: the {dt:?} weight against the rounded f32 one"
            );
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// An embedding's gradient adds up the rows of each id, and an average
/// pool its window: both in f32 for half precision (49,152 lookups of one
/// id summed in bf16 stop at 256; a 64 x 64 window of 1s and 3s averages
/// to 2 only when the 8,192 it sums to is exact).
#[test]
fn embedding_gradients_and_average_pools_accumulate_in_f32() {
    let table = Tensor::ones((4, 8), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::zeros(WIDE, DType::U32, &Device::Cpu).unwrap();
    let g = |t: &Tensor| {
        grad(|t: Tracer, ids: Tracer| t.embedding(&ids)?.sum_all())
            .call((t, &ids))
            .unwrap()
    };
    let full = g(&table);
    for dt in HALVES {
        let half = g(&table.to_dtype(dt).unwrap());
        assert_eq!(half.dtype(), dt);
        let gap = rel_gap(&half.narrow(0, 0, 1).unwrap(), &full.narrow(0, 0, 1).unwrap());
        assert!(
            gap <= tol(dt),
            "an embedding's gradient over {WIDE} lookups in {dt:?}: {gap:e} ({half})"
        );
    }
    let v: Vec<f32> = (0..2 * 64 * 64).map(|i| if i % 2 == 0 { 1.0 } else { 3.0 }).collect();
    let x = Tensor::from_vec(v, (2, 1, 64, 64), &Device::Cpu).unwrap();
    agrees("average pool", &x, |x| x.avg_pool2d(64));
}

/// A bf16 product whose weight is over 64 MiB in f32 runs a block of the
/// weight at a time (its output's columns, or its inner axis summed in
/// f32): it agrees with candle's product (both operands widened whole)
/// to bf16's rounding, for a transposed weight (a tied output head) and a
/// row-major one (its gradient), and its plan counts a block, not the
/// whole weight in f32.
#[test]
fn bf16_products_of_a_large_weight_run_in_blocks() {
    let bf = |seed: f64, shape: &[usize]| {
        let n: usize = shape.iter().product();
        let t = Tensor::arange(0u32, n as u32, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        (t * (0.37 + seed))
            .unwrap()
            .sin()
            .unwrap()
            .reshape(shape)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let x = bf(1.0, &[8, 2048]);
    let w = bf(2.0, &[8400, 2048]); // [n, k]: x @ w^T, 8400 x 2048 in f32 is 69 MB
    let ct = bf(3.0, &[8, 8400]);
    let f = jit(|x: Tracer, w: Tracer| x.matmul(&w.t()?));
    let g = jit(|ct: Tracer, w: Tracer| ct.matmul(&w));
    let fwd = f.call((&x, &w)).unwrap();
    let bwd = g.call((&ct, &w)).unwrap();
    let want_fwd = x.matmul(&w.t().unwrap()).unwrap();
    assert_eq!(fwd.dtype(), DType::BF16);
    assert!(
        rel_gap(&fwd, &want_fwd) < tol(DType::BF16),
        "forward {}",
        rel_gap(&fwd, &want_fwd)
    );
    // summed in blocks, the inner axis rounds differently: compared
    // against the f32 product's own scale
    let f32_bwd = ct
        .to_dtype(DType::F32)
        .unwrap()
        .matmul(&w.to_dtype(DType::F32).unwrap())
        .unwrap();
    let scale = f32_bwd.abs().unwrap().max_keepdim(1).unwrap();
    let err = (bwd.to_dtype(DType::F32).unwrap() - &f32_bwd)
        .unwrap()
        .abs()
        .unwrap()
        .broadcast_div(&scale)
        .unwrap();
    let worst = err.flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!((worst as f64) < tol(DType::BF16), "gradient {worst}");
    // the plan holds a block of the weight in f32, not all 69 MB of it
    let plan = candle_func::make_graph(&f, (&x, &w)).unwrap().planned_peak_bytes();
    assert!(plan < 8400 * 2048 * 2 + (66 << 20), "plan {plan}");
}

/// A map of one tensor.
type Map = fn(Tracer) -> candle_func::Result<Tracer>;

/// exp, tanh, erf, GELU and sigmoid of bf16 (and f16) tensors agree with
/// the f32 run on the same (half-rounded) values to the half dtype's
/// rounding; bf16 takes the crate's f32 kernel on a widened copy, f16
/// candle's maps.
#[test]
fn transcendental_maps_of_half_tensors_agree_with_f32() {
    let n = 70_000;
    let x = Tensor::arange(0u32, n as u32, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    // values across [-6, 6): where each map bends
    let x = ((x * (12.0 / n as f64)).unwrap() - 6.0).unwrap();
    let maps: [(&str, Map); 5] = [
        ("exp", |x| x.exp()),
        ("tanh", |x| x.tanh()),
        ("erf", |x| x.erf()),
        ("gelu", |x| x.gelu()),
        ("sigmoid", |x| x.sigmoid()),
    ];
    for dt in HALVES {
        let xh = x.to_dtype(dt).unwrap();
        for (what, f) in maps {
            let half = jit(f).call(&xh).unwrap();
            let full = jit(f).call(xh.to_dtype(DType::F32).unwrap()).unwrap();
            assert_eq!(half.dtype(), dt, "{what}");
            // near a zero of the map, relative gaps mean nothing: against
            // the largest value's scale there
            let scale = full.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
            let err = (half.to_dtype(DType::F32).unwrap() - &full).unwrap().abs().unwrap();
            let rel = (err.clone() / full.abs().unwrap().clamp(1e-3 * scale, f64::MAX).unwrap()).unwrap();
            let worst = rel.max(0).unwrap().to_scalar::<f32>().unwrap() as f64;
            assert!(worst <= tol(dt), "{what} in {dt:?}: {worst:e}");
        }
    }
}
