//! Ten million generated examples train without ever being held: each step
//! fetches only its passes' examples, and the process's peak resident
//! memory stays far below the data set's 2.4 GiB. Alone in its binary so
//! that the peak is this test's.

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{Dataset, DpConfig, PrivacyEngine};
use candle_func::rng::Rng;
use candle_func::tree::TreeDef;
use candle_func::Tracer;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

mod common;

const N: usize = 10_000_000;
const D: usize = 64;

/// Example `i`: `x` a hash of `(i, j)` in `[-1, 1)`, `y` the sign of `x[0]`.
struct Generated {
    fetched: Arc<AtomicUsize>,
}

fn value(i: usize, j: usize) -> f32 {
    let h = ((i * D + j) as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl Dataset for Generated {
    fn len(&self) -> usize {
        N
    }
    fn tree(&self) -> TreeDef {
        TreeDef::Tuple(vec![TreeDef::Leaf, TreeDef::Leaf])
    }
    fn shapes(&self) -> Vec<(Vec<usize>, DType)> {
        vec![(vec![D], DType::F32), (vec![], DType::F32)]
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn fetch(&self, indices: &[usize]) -> candle_func::Result<Vec<Tensor>> {
        self.fetched.fetch_add(indices.len(), Ordering::Relaxed);
        let xs: Vec<f32> = indices.iter().flat_map(|&i| (0..D).map(move |j| value(i, j))).collect();
        let ys: Vec<f32> = indices.iter().map(|&i| value(i, 0).signum()).collect();
        Ok(vec![
            Tensor::from_vec(xs, (indices.len(), D), &Device::Cpu)?,
            Tensor::from_vec(ys, indices.len(), &Device::Cpu)?,
        ])
    }
}

/// The process's peak resident memory in MiB (`VmHWM`).
fn peak_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() / 1024.0
}

#[test]
fn ten_million_examples_train_without_being_held() {
    let vm = common::zeros_varmap("w", D);
    let fetched = Arc::new(AtomicUsize::new(0));
    let data = Generated {
        fetched: fetched.clone(),
    };
    let loss = |p: BTreeMap<String, Tracer>, (x, y): (Tracer, Tracer)| {
        let margin = x.mul(&p["w"])?.sum_all()?.mul(&y)?;
        margin.neg()?.affine(1.0, 1.0)?.relu()
    };
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(1))
        .physical_batch(16)
        .make_private_dataset(
            loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.5, 0.0).unwrap(),
            data,
            DpConfig::new(40, 0.5, 1.0),
        )
        .unwrap();
    let steps = 4;
    let mut examples = 0;
    for _ in 0..steps {
        let info = t.step().unwrap();
        examples += info.passes * 16;
    }
    let w = vm.all_vars()[0].as_tensor().to_vec1::<f32>().unwrap();
    assert!(w.iter().any(|v| *v != 0.0), "the weights moved");
    // only the passes' examples (padding included) were fetched
    assert_eq!(fetched.load(Ordering::Relaxed), examples);
    assert!(examples < 400, "{examples}");
    let held_mib = (N * (D + 1) * 4) as f64 / (1 << 20) as f64;
    let peak = peak_mib();
    eprintln!(
        "fetched {examples} examples in {steps} steps; peak resident {peak:.0} MiB, the data set {held_mib:.0} MiB"
    );
    assert!(peak < held_mib / 4.0, "peak resident {peak:.0} MiB");
    assert!(t.epsilon(1e-5).unwrap() > 0.0);
}
