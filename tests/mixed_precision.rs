//! Mixed precision for private training (`dp::Precision::Bf16Mixed`,
//! `F16Mixed`): the loss computes in half precision on f32 master weights,
//! and every number that decides what is released stays in f32 — the
//! per-example norms (ghost norms included), the clipped sum, the noise
//! and the optimiser's state.

use candle_core::{DType, Device, Tensor, Var};
use candle_func::dp::{self, DpConfig, Precision, PrivacyEngine, Trainable};
use candle_func::rng::Rng;
use candle_func::{make_graph, nn, Error, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

mod common;

const D: usize = 256;

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

/// `tanh(x W1^T) W2^T` then cross-entropy over 8 classes: W1 `[D, D]` (a
/// product whose per-example gradient the ghost rule reads), W2 `[8, D]`.
fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let h = x.unsqueeze(0)?.to_dtype(p["w1"].dtype())?;
    let h = h.broadcast_matmul(&p["w1"].t()?)?.tanh()?;
    let out = h.broadcast_matmul(&p["w2"].t()?)?;
    nn::cross_entropy(&out, &y.unsqueeze(0)?, nn::Reduction::Sum)
}

/// The weights with `w1` frozen in `frozen` and `w2` trainable in f32.
fn model(frozen: DType) -> VarMap {
    let vm = VarMap::new();
    let mut data = vm.data().lock().unwrap();
    let w1 = (common::hashed_values(1, &[D, D]) * 0.1).unwrap();
    let w2 = (common::hashed_values(2, &[8, D]) * 0.1).unwrap();
    data.insert("w1".into(), Var::from_tensor(&w1.to_dtype(frozen).unwrap()).unwrap());
    data.insert("w2".into(), Var::from_tensor(&w2).unwrap());
    drop(data);
    vm
}

fn data() -> (Tensor, Tensor) {
    let xs = common::hashed_values(3, &[64, D]);
    let ys = Tensor::from_vec((0..64u32).map(|i| i % 8).collect(), 64, &Device::Cpu).unwrap();
    (xs, ys)
}

fn trainer(
    vm: &VarMap,
    precision: Precision,
    trainable: &[&str],
) -> candle_func::Result<dp::PrivateTrainer<Loss, candle_func::optim::Sgd>> {
    let (xs, ys) = data();
    PrivacyEngine::new()
        .rng(Rng::seeded(3))
        .precision(precision)
        .trainable(Trainable::prefixes(trainable))
        .physical_batch(16)
        .make_private(
            loss as Loss,
            vm,
            candle_func::optim::Sgd::new(vm, 0.5, 0.0)?,
            (&xs, &ys),
            DpConfig::new(32, 0.0, 0.05),
        )
}

/// A mixed run steps its f32 masters as the f32 run does, to the half
/// dtype's rounding of the loss, and keeps steps a half-precision weight
/// would lose.
#[test]
fn mixed_precision_trains_f32_masters_as_the_f32_run_does() {
    for (precision, half) in [(Precision::Bf16Mixed, DType::BF16), (Precision::F16Mixed, DType::F16)] {
        let (full, mixed) = (model(DType::F32), model(half));
        let before = common::values(mixed.data().lock().unwrap()["w2"].as_tensor());
        let mut a = trainer(&full, Precision::Native, &["w2"]).unwrap();
        let mut b = trainer(&mixed, precision, &["w2"]).unwrap();
        for _ in 0..3 {
            let (ia, ib) = (a.step().unwrap(), b.step().unwrap());
            assert_eq!(ia.batch_size, ib.batch_size);
            let gap = (ia.mean_loss - ib.mean_loss).abs() / ia.mean_loss;
            assert!(
                gap < 0.01,
                "{precision:?}: loss {} against {}",
                ib.mean_loss,
                ia.mean_loss
            );
            assert_eq!(ia.clipped_fraction, ib.clipped_fraction, "{precision:?}");
        }
        let w = |vm: &VarMap| vm.data().lock().unwrap()["w2"].as_tensor().clone();
        assert_eq!(w(&mixed).dtype(), DType::F32, "the master stays f32");
        let (wa, wb) = (common::values(&w(&full)), common::values(&w(&mixed)));
        // each step moved every weight by up to lr C / B = 0.5 * 0.05 / 32
        let moved: Vec<f64> = wb.iter().zip(&before).map(|(a, b)| (a - b).abs()).collect();
        let tiny = moved.iter().filter(|&&m| m > 0.0 && m < 2f64.powi(-9) * 0.05).count();
        assert!(
            tiny > 0,
            "{precision:?}: no step below a bf16 weight's half ulp was kept"
        );
        let diff = wa.iter().zip(&wb).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let step = moved.iter().cloned().fold(0.0, f64::max);
        assert!(
            diff < 0.05 * step,
            "{precision:?}: the masters differ by {diff}, the steps are {step}"
        );
    }
}

/// Under mixed precision a trainable weight must be an f32 master, and
/// the error names it.
#[test]
fn mixed_precision_refuses_a_half_precision_trainable_weight() {
    let vm = model(DType::BF16);
    let e = trainer(&vm, Precision::Bf16Mixed, &["w1", "w2"])
        .err()
        .expect("w1 is bf16");
    assert!(matches!(e, Error::PrivacyConfig { .. }), "{e}");
    assert!(e.to_string().contains("\"w1\"") && e.to_string().contains("f32"), "{e}");
}

/// The ghost rule reads a product through the cast from the f32 master to
/// its half-precision copy: the clipped sum's plan holds no per-example
/// gradients, and its norms and sums are f32's, within the half dtype's
/// rounding of the f32 run and of the materialised ones (each of which
/// is a bf16 product's result, rounded entry by entry).
#[test]
fn ghost_norms_read_through_the_cast_to_half_precision() {
    let (xs, _) = data();
    let w = (common::hashed_values(5, &[D, D]) * 0.1).unwrap();
    // one example's loss: its layer's output summed, computed in bf16 on
    // the f32 master
    let mixed = |w: Tracer, x: Tracer| {
        let h = x.unsqueeze(0)?.to_dtype(DType::BF16)?;
        h.broadcast_matmul(&w.to_dtype(DType::BF16)?.t()?)?
            .tanh()?
            .to_dtype(DType::F32)?
            .sum_all()
    };
    let full = |w: Tracer, x: Tracer| x.unsqueeze(0)?.broadcast_matmul(&w.t()?)?.tanh()?.sum_all();
    let ghost = dp::clipped_grad_sum(mixed, 1.0);
    let dense = dp::clipped_grad_sum(mixed, 1.0).ghost(false);
    let (pg, pd) = (
        make_graph(&ghost, (&w, &xs)).unwrap().planned_peak_bytes(),
        make_graph(&dense, (&w, &xs)).unwrap().planned_peak_bytes(),
    );
    // 64 per-example [256, 256] gradients would be 16 MiB in f32
    assert!(pg * 4 < pd, "ghost plan {pg} against materialised {pd}");
    let (cg, ng, _) = ghost.call((&w, &xs)).unwrap();
    let (cd, nd, _) = dense.call((&w, &xs)).unwrap();
    let (cf, nf, _) = dp::clipped_grad_sum(full, 1.0).call((&w, &xs)).unwrap();
    assert_eq!((cg.dtype(), ng.dtype()), (DType::F32, DType::F32));
    let gap = |a: &Tensor, b: &Tensor| {
        let (a, b) = (common::values(a), common::values(b));
        let scale = b.iter().map(|v| v.abs()).fold(0.0, f64::max);
        a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
    };
    let ulp = 2f64.powi(-8);
    assert!(gap(&ng, &nd) < ulp, "ghost and materialised norms: {}", gap(&ng, &nd));
    assert!(gap(&cg, &cd) < ulp, "ghost and materialised sums: {}", gap(&cg, &cd));
    assert!(gap(&ng, &nf) < 2e-2, "bf16 norms against f32's: {}", gap(&ng, &nf));
    assert!(gap(&cg, &cf) < 2e-2, "bf16 sums against f32's: {}", gap(&cg, &cf));
}

/// A mixed-precision run saved and resumed continues bit for bit (its f32
/// masters and the optimiser's f32 state are what is saved), and so does
/// a bf16 run without the policy (bf16 weights, f32 moments).
#[test]
fn half_precision_runs_resume_bit_for_bit() {
    for precision in [Precision::Bf16Mixed, Precision::Native] {
        resumes(precision);
    }
}

fn resumes(precision: Precision) {
    let (xs, ys) = data();
    let model = |frozen: DType| {
        let vm = model(frozen);
        if precision == Precision::Native {
            let mut data = vm.data().lock().unwrap();
            let w2 = data["w2"].as_tensor().to_dtype(DType::BF16).unwrap();
            data.insert("w2".into(), Var::from_tensor(&w2).unwrap());
        }
        vm
    };
    let make = |vm: &VarMap| {
        PrivacyEngine::new()
            .rng(Rng::seeded(9))
            .precision(precision)
            .trainable(Trainable::prefixes(&["w2"]))
            .physical_batch(16)
            .make_private(
                loss as Loss,
                vm,
                candle_func::optim::AdamW::new(vm, 1e-3, 0.01).unwrap(),
                (&xs, &ys),
                DpConfig::new(32, 1.0, 0.05),
            )
            .unwrap()
    };
    let vm = model(DType::BF16);
    let mut t = make(&vm);
    t.step().unwrap();
    t.step().unwrap();
    let dir = std::env::temp_dir().join(format!("candle-func-mixed-{precision:?}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    t.save(&dir).unwrap();
    let next = t.step().unwrap();
    let vm2 = model(DType::BF16);
    let mut r = make(&vm2);
    r.resume(&dir).unwrap();
    assert_eq!(r.step().unwrap(), next);
    let w = |vm: &VarMap| vm.data().lock().unwrap()["w2"].as_tensor().clone();
    let master = if precision == Precision::Native {
        DType::BF16
    } else {
        DType::F32
    };
    assert_eq!(w(&vm2).dtype(), master);
    assert_eq!(common::values(&w(&vm)), common::values(&w(&vm2)), "{precision:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
