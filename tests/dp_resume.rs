//! A private trainer saved and resumed ends bit-identical to one that
//! never stopped (seeded); a folder that does not fit is an error and
//! loads nothing.

use candle_core::{Device, Tensor};
use candle_func::dp::{self, AdaptiveClipping, DpConfig, PrivacyEngine, Trainable};
use candle_func::rng::Rng;
use candle_func::{nn, Error, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::path::PathBuf;

type Map = BTreeMap<String, Tracer>;

fn model() -> VarMap {
    let vm = VarMap::new();
    let mut rng = Rng::seeded(4);
    for (name, shape) in [("body.weight", (6, 4)), ("head.weight", (3, 6))] {
        let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| rng.normal() as f32 * 0.5).collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        vm.data()
            .lock()
            .unwrap()
            .insert(name.into(), candle_core::Var::from_tensor(&t).unwrap());
    }
    vm
}

fn loss(p: Map, (x, y): (Tracer, Tracer)) -> candle_func::Result<Tracer> {
    let h = x.unsqueeze(0)?.matmul(&p["body.weight"].t()?)?.tanh()?;
    let logits = h.matmul(&p["head.weight"].t()?)?;
    nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
}

type Loss = fn(Map, (Tracer, Tracer)) -> candle_func::Result<Tracer>;

fn data() -> (Tensor, Tensor) {
    let mut rng = Rng::seeded(5);
    let xs: Vec<f32> = (0..60 * 4).map(|_| rng.normal() as f32).collect();
    (
        Tensor::from_vec(xs, (60, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec((0..60u32).map(|i| i % 3).collect(), 60, &Device::Cpu).unwrap(),
    )
}

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle_func_resume_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn values(vm: &VarMap) -> BTreeMap<String, Vec<u32>> {
    let data = vm.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| {
            let f: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            (k.clone(), f.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

fn trainer(
    vm: &VarMap,
    d: &(Tensor, Tensor),
    config: &DpConfig,
    seed: u64,
    adamw: bool,
) -> dp::PrivateTrainer<Loss, Box<dyn candle_func::optim::Optimizer>, (Tracer, Tracer)> {
    let opt: Box<dyn candle_func::optim::Optimizer> = if adamw {
        Box::new(
            candle_func::optim::AdamW::new(vm, 0.05, 0.01)
                .unwrap()
                .group("head", 0.1, 0.0)
                .unwrap(),
        )
    } else {
        Box::new(candle_func::optim::Sgd::new(vm, 0.2, 0.9).unwrap())
    };
    PrivacyEngine::new()
        .rng(Rng::seeded(seed))
        .physical_batch(5)
        .trainable(if adamw {
            Trainable::all()
        } else {
            Trainable::prefixes(&["head"])
        })
        .make_private_examples(loss as Loss, vm, opt, &(&d.0, &d.1), config.clone())
        .unwrap()
}

#[test]
fn a_resumed_seeded_run_ends_bit_identical_to_one_that_never_stopped() {
    let d = data();
    let configs = [
        (DpConfig::new(12, 1.1, 0.7), false),
        (DpConfig::adaptive(12, 0.3, AdaptiveClipping::new(0.5, 0.6)), true),
    ];
    for (k, (config, adamw)) in configs.iter().enumerate() {
        let whole = model();
        let mut straight = trainer(&whole, &d, config, 21, *adamw);
        // lr schedules are state too: halve it half-way in both runs
        for i in 0..6 {
            if i == 3 {
                straight.optimizer_mut().set_lr(0.02).unwrap();
            }
            straight.step().unwrap();
        }
        let halves = model();
        let mut first = trainer(&halves, &d, config, 21, *adamw);
        for _ in 0..3 {
            first.step().unwrap();
        }
        first.optimizer_mut().set_lr(0.02).unwrap();
        let folder = dir(&format!("same{k}"));
        first.save(&folder).unwrap();
        drop(first);
        // a fresh trainer on a fresh model, another seed: all from the folder
        let fresh = model();
        let mut second = trainer(&fresh, &d, config, 999, *adamw);
        second.resume(&folder).unwrap();
        assert_eq!(second.steps(), 3);
        for _ in 0..3 {
            second.step().unwrap();
        }
        assert_eq!(values(&fresh), values(&whole), "config {k}: the resumed run differs");
        assert_eq!(second.epsilon(1e-5).unwrap(), straight.epsilon(1e-5).unwrap());
        assert_eq!(second.clip_bound().to_bits(), straight.clip_bound().to_bits());
        assert_eq!(second.steps(), 6);
        std::fs::remove_dir_all(&folder).unwrap();
    }
}

#[test]
fn a_folder_that_does_not_fit_is_an_error_and_loads_nothing() {
    let d = data();
    let config = DpConfig::new(12, 1.1, 0.7);
    let vm = model();
    let mut t = trainer(&vm, &d, &config, 1, true);
    t.step().unwrap();
    let folder = dir("bad");
    t.save(&folder).unwrap();
    let check = |config: &DpConfig, adamw: bool, d: &(Tensor, Tensor), named: &str| {
        let other = model();
        let before = values(&other);
        let mut u = trainer(&other, d, config, 1, adamw);
        let err = u.resume(&folder).expect_err(named);
        assert!(
            matches!(err, Error::Checkpoint { .. }) && err.to_string().contains(named),
            "{named}: {err}"
        );
        assert_eq!(
            values(&other),
            before,
            "{named}: a failed resume changed the parameters"
        );
        assert_eq!(u.steps(), 0);
    };
    check(&DpConfig::new(12, 1.2, 0.7), true, &d, "noise_multiplier");
    check(&DpConfig::new(15, 1.1, 0.7), true, &d, "sample_rate");
    check(&config, false, &d, "trainable");
    let short = (d.0.narrow(0, 0, 50).unwrap(), d.1.narrow(0, 0, 50).unwrap());
    check(&DpConfig::new(10, 1.1, 0.7), true, &short, "examples");
    // a corrupt state.json, and a missing parameter file
    let state = folder.join("state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&state, &text[..text.len() / 2]).unwrap();
    check(&config, true, &d, "state.json");
    std::fs::write(&state, &text).unwrap();
    std::fs::remove_file(folder.join("params.safetensors")).unwrap();
    check(&config, true, &d, "params.safetensors");
    std::fs::remove_dir_all(&folder).unwrap();
}

#[test]
fn an_os_keyed_generator_is_never_written_down() {
    let d = data();
    let vm = model();
    let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
    let mut t = PrivacyEngine::new()
        .make_private_examples(loss as Loss, &vm, sgd, &(&d.0, &d.1), DpConfig::new(12, 1.0, 1.0))
        .unwrap();
    t.step().unwrap();
    let folder = dir("os");
    t.save(&folder).unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("state.json")).unwrap()).unwrap();
    assert!(state["rng"].is_null(), "{}", state["rng"]);
    assert_eq!(state["steps"], 1);
    let vm2 = model();
    let sgd = candle_func::optim::Sgd::new(&vm2, 0.1, 0.0).unwrap();
    let mut u = PrivacyEngine::new()
        .make_private_examples(loss as Loss, &vm2, sgd, &(&d.0, &d.1), DpConfig::new(12, 1.0, 1.0))
        .unwrap();
    u.resume(&folder).unwrap();
    assert_eq!(values(&vm2), values(&vm));
    assert_eq!(u.epsilon(1e-5).unwrap(), t.epsilon(1e-5).unwrap());
    std::fs::remove_dir_all(&folder).unwrap();
}

#[test]
fn an_optimiser_state_that_does_not_fit_is_an_error_and_loads_nothing() {
    use candle_func::optim::Optimizer;
    let vm = model();
    let grads: BTreeMap<String, Tensor> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().ones_like().unwrap()))
        .collect();
    let mut sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.9).unwrap();
    sgd.step(&grads).unwrap();
    let saved = sgd.state().unwrap();
    // another optimiser's state
    let mut adam = candle_func::optim::Adam::new(&vm, 0.1).unwrap();
    let err = adam.load_state(&saved).expect_err("sgd's state into adam");
    assert!(
        matches!(err, Error::Checkpoint { .. }) && err.to_string().contains("sgd"),
        "{err}"
    );
    // other hyper-parameters
    let mut other = candle_func::optim::Sgd::new(&vm, 0.1, 0.5).unwrap();
    let err = other.load_state(&saved).expect_err("another momentum");
    assert!(err.to_string().contains("momentum"), "{err}");
    // a moment of another shape, named; nothing taken
    let mut bad = saved.clone();
    bad.tensors.insert(
        "velocity/head.weight".into(),
        Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    bad.scalars.insert("lr".into(), 7.0);
    let mut fresh = candle_func::optim::Sgd::new(&vm, 0.1, 0.9).unwrap();
    let err = fresh.load_state(&bad).expect_err("a misshapen moment");
    assert!(err.to_string().contains("velocity/head.weight"), "{err}");
    assert_eq!(fresh.lr(), 0.1, "a failed load changed the rate");
}

/// An OS-keyed trainer over a fresh model (SGD on the head).
fn os_keyed(
    vm: &VarMap,
    d: &(Tensor, Tensor),
    engine: PrivacyEngine,
) -> dp::PrivateTrainer<Loss, candle_func::optim::Sgd, (Tracer, Tracer)> {
    let sgd = candle_func::optim::Sgd::new(vm, 0.1, 0.0).unwrap();
    engine
        .physical_batch(5)
        .trainable(Trainable::prefixes(&["head"]))
        .make_private_examples(loss as Loss, vm, sgd, &(&d.0, &d.1), DpConfig::new(12, 1.1, 0.7))
        .unwrap()
}

fn seeded(
    vm: &VarMap,
    d: &(Tensor, Tensor),
    seed: u64,
) -> dp::PrivateTrainer<Loss, candle_func::optim::Sgd, (Tracer, Tracer)> {
    os_keyed(vm, d, PrivacyEngine::new().rng(Rng::seeded(seed)))
}

#[test]
fn an_os_keyed_trainer_never_adopts_a_saved_key() {
    // a seeded prototype run's folder holds its key
    let d = data();
    let vm = model();
    let mut proto = seeded(&vm, &d, 7);
    proto.step().unwrap();
    let folder = dir("adopt");
    proto.save(&folder).unwrap();
    // what the seeded stream gives next
    proto.step().unwrap();
    let predictable = values(&vm);
    // two OS-keyed trainers resume the same folder: each keeps its own key,
    // and takes the saved steps, accountant and parameters
    let mut runs = Vec::new();
    for _ in 0..2 {
        let vm2 = model();
        let mut t = os_keyed(&vm2, &d, PrivacyEngine::new());
        let (r, warnings) = candle_func::settings::capture_warnings(|| t.resume(&folder));
        r.unwrap();
        assert!(warnings.iter().any(|w| w.key == "dp-resume-seeded-run"), "{warnings:?}");
        assert_eq!(t.steps(), 1);
        assert_eq!(t.accountant().history(), &[(1.1, 12.0 / 60.0, 1)]);
        t.step().unwrap();
        let v = values(&vm2);
        assert_ne!(v["head.weight"], predictable["head.weight"], "the saved key's noise");
        runs.push(v);
    }
    assert_ne!(
        runs[0]["head.weight"], runs[1]["head.weight"],
        "two OS-keyed resumes drew the same noise"
    );
    // a key written by hand into an OS-keyed run's folder is ignored too
    let vm3 = model();
    let mut t = os_keyed(&vm3, &d, PrivacyEngine::new());
    t.step().unwrap();
    let os_folder = dir("adopt_os");
    t.save(&os_folder).unwrap();
    let state_path = os_folder.join("state.json");
    let mut state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state_path).unwrap()).unwrap();
    let saved_seeded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("state.json")).unwrap()).unwrap();
    state["rng"] = saved_seeded["rng"].clone();
    rewrite(&os_folder, "state.json", &serde_json::to_string_pretty(&state).unwrap());
    let vm_b = model();
    let mut b = os_keyed(&vm_b, &d, PrivacyEngine::new());
    b.resume(&os_folder).unwrap();
    b.step().unwrap();
    let vm_c = model();
    let mut c = os_keyed(&vm_c, &d, PrivacyEngine::new());
    c.resume(&os_folder).unwrap();
    c.step().unwrap();
    assert_ne!(values(&vm_b)["head.weight"], values(&vm_c)["head.weight"]);
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::remove_dir_all(&os_folder).unwrap();
}

#[test]
fn a_seeded_trainer_refuses_an_os_keyed_run_and_warns_resuming_a_seeded_one() {
    let d = data();
    let vm = model();
    let mut t = os_keyed(&vm, &d, PrivacyEngine::new());
    t.step().unwrap();
    let folder = dir("seeded_os");
    t.save(&folder).unwrap();
    let other = model();
    let before = values(&other);
    let mut s = seeded(&other, &d, 3);
    let e = s.resume(&folder).unwrap_err();
    assert!(
        matches!(e, Error::Checkpoint { .. }) && e.to_string().contains("OS-keyed") && e.to_string().contains("seeded"),
        "{e}"
    );
    assert_eq!(
        (values(&other), s.steps()),
        (before, 0),
        "a refused resume loaded something"
    );
    // seeded into seeded: continues the stream, and says it is not private
    let mut p = seeded(&model(), &d, 3);
    p.step().unwrap();
    let seeded_folder = dir("seeded_seeded");
    p.save(&seeded_folder).unwrap();
    let mut q = seeded(&model(), &d, 4);
    let (r, warnings) = candle_func::settings::capture_warnings(|| q.resume(&seeded_folder));
    r.unwrap();
    assert!(warnings.iter().any(|w| w.key == "dp-seeded-rng"), "{warnings:?}");
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::remove_dir_all(&seeded_folder).unwrap();
}

/// Replaces `name` in a saved folder and rewrites its digest to match, as
/// whoever can write the folder can: what the history check must catch
/// with the digest out of the way.
fn rewrite(folder: &std::path::Path, name: &str, text: &str) {
    use sha2::{Digest, Sha256};
    std::fs::write(folder.join(name), text).unwrap();
    let sums = std::fs::read_to_string(folder.join("checksums.sha256")).unwrap();
    let hex: String = Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let sums: String = sums
        .lines()
        .map(|l| match l.split_once("  ") {
            Some((_, n)) if n == name => format!("{hex}  {n}\n"),
            _ => format!("{l}\n"),
        })
        .collect();
    std::fs::write(folder.join("checksums.sha256"), sums).unwrap();
}

#[test]
fn an_edited_history_or_a_changed_file_is_refused() {
    let d = data();
    let vm = model();
    let mut t = seeded(&vm, &d, 5);
    for _ in 0..4 {
        t.step().unwrap();
    }
    let spent = t.epsilon(1e-5).unwrap();
    let folder = dir("history");
    t.save(&folder).unwrap();
    let state_path = folder.join("state.json");
    let text = std::fs::read_to_string(&state_path).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    let refused = |edit: &dyn Fn(&mut serde_json::Value), named: &[&str]| {
        let mut s = state.clone();
        edit(&mut s);
        rewrite(&folder, "state.json", &serde_json::to_string_pretty(&s).unwrap());
        let mut u = seeded(&model(), &d, 5);
        let e = u.resume(&folder).unwrap_err();
        assert!(matches!(e, Error::Checkpoint { .. }), "{e}");
        for n in named {
            assert!(e.to_string().contains(n), "{named:?}: {e}");
        }
        assert_eq!((u.steps(), u.accountant().steps()), (0, 0));
    };
    // an empty history, fewer steps, another sigma or q; each names both values
    refused(
        &|s| s["accountant"]["history"] = serde_json::json!([]),
        &["records 0 steps", "step count is 4"],
    );
    refused(
        &|s| s["accountant"]["history"][0][2] = 2.into(),
        &["records 2 steps", "step count is 4"],
    );
    refused(
        &|s| s["accountant"]["history"][0][0] = 50.0.into(),
        &["noise multiplier 50", "noise multiplier 1.1"],
    );
    refused(
        &|s| s["accountant"]["history"] = serde_json::json!([[1.1, 0.2, 2], [1.1, 0.0, 2]]),
        &["sample rate 0", "sample rate 0.2"],
    );
    // the untouched folder resumes, and reports what the run spent
    rewrite(&folder, "state.json", &text);
    let mut u = seeded(&model(), &d, 5);
    u.resume(&folder).unwrap();
    assert_eq!(u.epsilon(1e-5).unwrap(), spent);
    // an edit without the digest's update, and a file cut short, are named
    let params = folder.join("params.safetensors");
    let bytes = std::fs::read(&params).unwrap();
    std::fs::write(&params, &bytes[..bytes.len() - 3]).unwrap();
    let e = seeded(&model(), &d, 5).resume(&folder).unwrap_err();
    assert!(
        e.to_string().contains("params.safetensors") && e.to_string().contains("SHA-256"),
        "{e}"
    );
    std::fs::write(&params, &bytes).unwrap();
    std::fs::write(&state_path, text.replace("\"steps\": 4", "\"steps\": 3")).unwrap();
    let e = seeded(&model(), &d, 5).resume(&folder).unwrap_err();
    assert!(
        e.to_string().contains("state.json") && e.to_string().contains("SHA-256"),
        "{e}"
    );
    std::fs::remove_file(folder.join("checksums.sha256")).unwrap();
    let e = seeded(&model(), &d, 5).resume(&folder).unwrap_err();
    assert!(e.to_string().contains("checksums.sha256"), "{e}");
    std::fs::remove_dir_all(&folder).unwrap();
}

#[test]
fn a_resumed_trainer_reports_by_its_own_mechanism() {
    use candle_func::dp::accountant::Mechanism;
    let d = data();
    let mut t = seeded(&model(), &d, 5);
    for _ in 0..3 {
        t.step().unwrap();
    }
    let folder = dir("mechanism");
    t.save(&folder).unwrap();
    let prv = t.epsilon(1e-5).unwrap();
    let rdp = t.accountant().with_mechanism(Mechanism::Rdp).epsilon(1e-5).unwrap();
    assert!(prv < rdp, "{prv} {rdp}");
    let mut u = os_keyed(
        &model(),
        &d,
        PrivacyEngine::new().rng(Rng::seeded(5)).accountant(Mechanism::Rdp),
    );
    let (r, warnings) = candle_func::settings::capture_warnings(|| u.resume(&folder));
    r.unwrap();
    assert!(warnings.iter().any(|w| w.key == "dp-resume-mechanism"), "{warnings:?}");
    assert_eq!(u.accountant().mechanism(), Mechanism::Rdp);
    assert_eq!(u.epsilon(1e-5).unwrap(), rdp);
    std::fs::remove_dir_all(&folder).unwrap();
}

#[test]
fn a_folder_holding_other_files_is_not_replaced() {
    let d = data();
    let mut t = seeded(&model(), &d, 5);
    t.step().unwrap();
    let folder = dir("foreign");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), "mine").unwrap();
    let e = t.save(&folder).unwrap_err();
    assert!(
        matches!(e, Error::Checkpoint { .. }) && e.to_string().contains("notes.txt"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(folder.join("notes.txt")).unwrap(), "mine");
    // a file where the folder should be
    let file = dir("a_file");
    std::fs::write(&file, "x").unwrap();
    assert!(t.save(&file).is_err());
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::remove_file(&file).unwrap();
}
