//! A memory limit on the `PrivacyEngine` bounds the whole process while
//! the trainer steps: the trainer's plan counts the optimiser's state, the
//! gradient sums and the data beside a pass's graph, chooses the largest
//! physical batch that fits when none is given, and refuses, naming
//! `physical_batch` and the parts, what does not fit. One test, so that
//! the process's resident memory (part of the plan) is this test's alone.

use candle_core::{Device, Tensor};
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::rng::Rng;
use candle_func::{Error, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

mod common;

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

const D: usize = 512;

/// A 512 -> 512 -> 10 net: about a megabyte of weights, so each
/// materialised per-sample gradient (`ghost(false)`) is too.
fn model() -> VarMap {
    let vm = VarMap::new();
    let mut data = vm.data().lock().unwrap();
    for (i, (name, shape)) in [("l.weight", &[D, D][..]), ("l.bias", &[D]), ("m.weight", &[10, D])]
        .into_iter()
        .enumerate()
    {
        let t = (common::hashed_values(i as u64 + 3, shape) * 0.05).unwrap();
        data.insert(name.into(), candle_core::Var::from_tensor(&t).unwrap());
    }
    drop(data);
    vm
}

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let h = x.unsqueeze(0)?.broadcast_matmul(&p["l.weight"].t()?)?;
    let h = h.broadcast_add(&p["l.bias"])?.tanh()?;
    let out = h.broadcast_matmul(&p["m.weight"].t()?)?;
    candle_func::nn::cross_entropy(&out, &y.unsqueeze(0)?, candle_func::nn::Reduction::Sum)
}

fn data() -> (Tensor, Tensor) {
    let xs = common::hashed_values(1, &[256, D]);
    let ys = Tensor::from_vec((0..256u32).map(|i| i % 10).collect(), 256, &Device::Cpu).unwrap();
    (xs, ys)
}

fn build(
    vm: &VarMap,
    (xs, ys): (&Tensor, &Tensor),
    limit: usize,
    physical: Option<usize>,
) -> candle_func::Result<dp::PrivateTrainer<Loss, candle_func::optim::Adam>> {
    let mut engine = PrivacyEngine::new()
        .rng(Rng::seeded(7))
        .ghost(false)
        .memory_limit(limit);
    if let Some(p) = physical {
        engine = engine.physical_batch(p);
    }
    // a batch of 256 expected: a default physical batch of 64
    engine.make_private(
        loss as Loss,
        vm,
        candle_func::optim::Adam::new(vm, 1e-3)?,
        (xs, ys),
        DpConfig::new(256, 1.0, 1.0),
    )
}

#[test]
fn the_trainer_plans_the_process_and_chooses_its_physical_batch() {
    let (xs, ys) = data();
    let vm = model();
    let trainable: usize = (D * D + D + 10 * D) * 4;

    // a limit everything fits under: the default batch, the parts counted
    let roomy = build(&vm, (&xs, &ys), 1 << 40, None).unwrap();
    let full = roomy.memory_plan().expect("a plan under a limit").clone();
    assert_eq!(roomy.physical_batch(), 64);
    assert_eq!(full.physical_batch, 64);
    assert_eq!(full.weights, trainable);
    assert_eq!(full.sums, trainable);
    assert_eq!(full.optimizer, 2 * trainable, "Adam's two moments");
    assert_eq!(full.data, 256 * D * 4 + 256 * 4);
    // 64 materialised per-sample gradients are in the pass's graph
    assert!(full.pass > 64 * trainable, "pass {} for 64 examples", full.pass);
    assert!(full.total() >= full.pass + full.sums + full.optimizer + full.data);
    drop(roomy);

    // a limit that leaves the pass about half its graph: a smaller batch
    let beside = full.rest + full.data + full.optimizer + full.sums;
    let limit = beside + full.pass / 2;
    let fitted = build(&vm, (&xs, &ys), limit, None).unwrap();
    let p = fitted.physical_batch();
    assert!(
        (16..64).contains(&p),
        "chose {p} examples a pass under half the pass's memory"
    );
    let plan = fitted.memory_plan().unwrap().clone();
    assert_eq!(plan.physical_batch, p);
    assert!(plan.total() <= limit, "plan {} over the limit {limit}", plan.total());
    drop(fitted);

    // the default batch asked for by name under that limit: refused, the
    // error naming the setting and a batch that fits
    let e = build(&vm, (&xs, &ys), limit, Some(64))
        .err()
        .expect("64 a pass does not fit");
    let msg = e.to_string();
    assert!(matches!(e, Error::TrainerMemory { .. }), "{msg}");
    assert!(msg.contains("physical_batch(") && msg.contains("at most"), "{msg}");
    assert!(msg.contains("optimiser state"), "{msg}");

    // under a limit the optimiser's state alone exceeds, nothing fits
    let e = build(&vm, (&xs, &ys), full.optimizer, None)
        .err()
        .expect("nothing fits");
    assert!(e.to_string().contains("no physical batch fits"), "{e}");

    // the chosen batch trains, bit for bit as the same batch given by name
    // (under a roomy limit: this process now holds more than it did)
    let run = |limit: usize, physical: Option<usize>| {
        let vm = model();
        let mut t = build(&vm, (&xs, &ys), limit, physical).unwrap();
        let infos: Vec<_> = (0..3).map(|_| t.step().unwrap()).collect();
        (infos, vm, t)
    };
    let (chosen, vm_chosen, mut t) = run(limit, None);
    // the rest of the process moves by a few megabytes between builds
    let p = t.physical_batch();
    assert!((16..64).contains(&p) && chosen[0].passes > 1, "{p} a pass, {chosen:?}");

    // a run saved at the chosen batch resumes in a trainer that would
    // choose a larger one: the saved batch is kept, and the run continues
    // bit for bit
    let dir = std::env::temp_dir().join(format!("candle-func-dp-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    t.save(&dir).unwrap();
    let next = t.step().unwrap();
    let w_next = weight(&vm_chosen);
    drop(t);
    let vm2 = model();
    let mut resumed = build(&vm2, (&xs, &ys), 1 << 40, None).unwrap();
    assert_eq!(resumed.physical_batch(), 64);
    resumed.resume(&dir).unwrap();
    assert_eq!(resumed.physical_batch(), p);
    assert_eq!(resumed.step().unwrap(), next);
    assert_eq!(common::max_diff(&w_next, &weight(&vm2)), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
    drop(resumed);

    let (named, _, _) = run(1 << 40, Some(p));
    assert_eq!(chosen, named);

    // Sgd without momentum keeps no state, so its plan counts none
    let vm3 = model();
    let sgd = PrivacyEngine::new()
        .rng(Rng::seeded(1))
        .memory_limit(1 << 40)
        .make_private(
            loss as Loss,
            &vm3,
            candle_func::optim::Sgd::new(&vm3, 0.1, 0.0).unwrap(),
            (&xs, &ys),
            DpConfig::new(256, 1.0, 1.0),
        )
        .unwrap();
    assert_eq!(sgd.memory_plan().unwrap().optimizer, 0);
}

fn weight(vm: &VarMap) -> Tensor {
    vm.data().lock().unwrap()["l.weight"].as_tensor().copy().unwrap()
}
