//! A save that fails at any file leaves the previous checkpoint whole:
//! resuming it gives the run it saved, bit for bit.

use super::folder::{DIGEST, FAIL_AT};
use crate::dp::{DpConfig, PrivacyEngine, PrivateTrainer};
use crate::nn;
use crate::optim::Sgd;
use crate::rng::Rng;
use crate::trace::Tracer;
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> crate::error::Result<Tracer>;

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> crate::error::Result<Tracer> {
    let logits = x.unsqueeze(0)?.matmul(&p["w"].t()?)?;
    nn::cross_entropy(&logits, &y.unsqueeze(0)?, nn::Reduction::Mean)
}

fn setup() -> (VarMap, Tensor, Tensor) {
    let vm = VarMap::new();
    let mut rng = Rng::seeded(3);
    let w: Vec<f32> = (0..12).map(|_| rng.normal() as f32).collect();
    let w = Tensor::from_vec(w, (3, 4), &Device::Cpu).unwrap();
    vm.data()
        .lock()
        .unwrap()
        .insert("w".into(), candle_core::Var::from_tensor(&w).unwrap());
    let xs: Vec<f32> = (0..40 * 4).map(|_| rng.normal() as f32).collect();
    let xs = Tensor::from_vec(xs, (40, 4), &Device::Cpu).unwrap();
    let ys = Tensor::from_vec((0..40u32).map(|i| i % 3).collect(), 40, &Device::Cpu).unwrap();
    (vm, xs, ys)
}

fn trainer(vm: &VarMap, xs: &Tensor, ys: &Tensor) -> PrivateTrainer<Loss, Sgd> {
    PrivacyEngine::new()
        .rng(Rng::seeded(11))
        .physical_batch(4)
        .make_private(
            loss as Loss,
            vm,
            Sgd::new(vm, 0.3, 0.9).unwrap(),
            (xs, ys),
            DpConfig::new(8, 1.0, 1.0),
        )
        .unwrap()
}

fn bits(vm: &VarMap) -> Vec<u32> {
    let w = vm.data().lock().unwrap()["w"].as_tensor().flatten_all().unwrap();
    w.to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn folder(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle_func_ckpt_unit_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The names in `dir`'s parent that start with `.{dir's name}.`: a staging
/// folder left behind.
fn leftovers(dir: &Path) -> Vec<String> {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!(".{name}.")))
        .collect()
}

#[test]
fn a_save_that_fails_at_any_file_leaves_the_previous_checkpoint_resumable() {
    let (vm, xs, ys) = setup();
    let mut t = trainer(&vm, &xs, &ys);
    let dir = folder("fail");
    for _ in 0..2 {
        t.step().unwrap();
    }
    t.save(&dir).unwrap();
    // what two more steps from the saved point give, never interrupted
    for _ in 0..2 {
        t.step().unwrap();
    }
    let after_four = bits(&vm);
    const POINTS: [&[&str]; 5] = [
        &["params.safetensors"],
        &["optimizer.safetensors"],
        &["state.json"],
        &[DIGEST],
        &["publish"],
    ];
    for points in POINTS {
        let point = points[0];
        FAIL_AT.with(|f| f.set(points));
        let e = t.save(&dir).unwrap_err();
        FAIL_AT.with(|f| f.set(&[]));
        assert!(
            e.to_string().contains(&format!("injected failure at {point}")),
            "{point}: {e}"
        );
        assert!(leftovers(&dir).is_empty(), "{point}: {:?}", leftovers(&dir));
        // a fresh trainer resumes the previous checkpoint, and continues
        // it bit for bit as the run that never stopped
        let (vm2, _, _) = setup();
        let mut back = trainer(&vm2, &xs, &ys);
        back.resume(&dir).unwrap();
        assert_eq!(back.steps(), 2, "{point}");
        for _ in 0..2 {
            back.step().unwrap();
        }
        assert_eq!(bits(&vm2), after_four, "{point}: the resumed run differs");
    }
    // and a save that goes through replaces it
    t.save(&dir).unwrap();
    let (vm3, _, _) = setup();
    let mut back = trainer(&vm3, &xs, &ys);
    back.resume(&dir).unwrap();
    assert_eq!((back.steps(), bits(&vm3)), (4, after_four));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_save_replaces_the_previous_folder_whole() {
    let (vm, xs, ys) = setup();
    let mut t = trainer(&vm, &xs, &ys);
    let dir = folder("swap");
    t.save(&dir).unwrap();
    let first = std::fs::read(dir.join("state.json")).unwrap();
    t.step().unwrap();
    // the second save swaps the folder (renameat2's exchange on Linux)
    t.save(&dir).unwrap();
    let second = std::fs::read(dir.join("state.json")).unwrap();
    assert_ne!(first, second);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [DIGEST, "optimizer.safetensors", "params.safetensors", "state.json"]
    );
    // the exchange itself: two folders trade names
    #[cfg(target_os = "linux")]
    {
        let (a, b) = (folder("xa"), folder("xb"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("f"), "a").unwrap();
        std::fs::write(b.join("f"), "b").unwrap();
        super::folder::exchange(&a, &b).unwrap();
        assert_eq!(std::fs::read_to_string(a.join("f")).unwrap(), "b");
        assert_eq!(std::fs::read_to_string(b.join("f")).unwrap(), "a");
        let missing = folder("xmissing");
        assert!(super::folder::exchange(&a, &missing).is_err());
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_dir_all(&b).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_two_renames_replace_the_folder_where_the_exchange_cannot_and_undo_a_failure() {
    let (vm, xs, ys) = setup();
    let mut t = trainer(&vm, &xs, &ys);
    let dir = folder("fallback");
    t.step().unwrap();
    t.save(&dir).unwrap();
    t.step().unwrap();
    let after_two = bits(&vm);
    // the second of the two renames fails: the first is undone
    FAIL_AT.with(|f| f.set(&["exchange", "second rename"]));
    let e = t.save(&dir).unwrap_err();
    FAIL_AT.with(|f| f.set(&[]));
    assert!(e.to_string().contains("injected failure at second rename"), "{e}");
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    let (vm2, _, _) = setup();
    let mut back = trainer(&vm2, &xs, &ys);
    back.resume(&dir).unwrap();
    assert_eq!(back.steps(), 1);
    // no exchange: the two renames put the new folder in place
    FAIL_AT.with(|f| f.set(&["exchange"]));
    t.save(&dir).unwrap();
    FAIL_AT.with(|f| f.set(&[]));
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    let (vm3, _, _) = setup();
    let mut back = trainer(&vm3, &xs, &ys);
    back.resume(&dir).unwrap();
    assert_eq!((back.steps(), bits(&vm3)), (2, after_two));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn folders_a_dead_save_left_are_removed_or_named() {
    let (vm, xs, ys) = setup();
    let mut t = trainer(&vm, &xs, &ys);
    let dir = folder("stale");
    let parent = dir.parent().unwrap().to_path_buf();
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    t.save(&dir).unwrap();
    // a staging folder of a process that is gone (no pid reaches 2^30)
    let stale = parent.join(format!(".{name}.saving-1073741824-00"));
    std::fs::create_dir_all(&stale).unwrap();
    t.step().unwrap();
    t.save(&dir).unwrap();
    #[cfg(target_os = "linux")]
    assert!(!stale.exists(), "a dead save's staging folder was left");
    let _ = std::fs::remove_dir_all(&stale);
    // the target missing, the previous checkpoint moved aside by a save
    // that died between its two renames: kept, and named by resume
    let aside = parent.join(format!(".{name}.saving-1073741824-01.old"));
    std::fs::rename(&dir, &aside).unwrap();
    let (vm2, _, _) = setup();
    let e = trainer(&vm2, &xs, &ys).resume(&dir).unwrap_err();
    assert!(e.to_string().contains(&aside.display().to_string()), "{e}");
    std::fs::rename(&aside, &dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_relative_target_is_resolved_to_the_folder_it_names() {
    let cwd = std::fs::canonicalize(".").unwrap();
    for (given, name) in [("ckpt", "ckpt"), ("ckpt/", "ckpt"), ("./ckpt", "ckpt")] {
        let (parent, got) = super::folder::resolve(Path::new(given), "test").unwrap();
        assert_eq!((parent, got.as_str()), (cwd.clone(), name), "{given}");
    }
    assert!(!Path::new("ckpt").exists(), "resolving made the target");
}

#[test]
fn a_trainer_resumes_only_with_an_empty_account_and_saves_only_its_own_history() {
    let (vm, xs, ys) = setup();
    let mut t = trainer(&vm, &xs, &ys);
    t.step().unwrap();
    let dir = folder("fresh_only");
    t.save(&dir).unwrap();
    // a trainer that has stepped would drop its own steps from epsilon
    let (vm2, _, _) = setup();
    let mut stepped = trainer(&vm2, &xs, &ys);
    stepped.step().unwrap();
    let e = stepped.resume(&dir).unwrap_err();
    assert!(e.to_string().contains("has taken 1 steps"), "{e}");
    // an accountant set by hand that this trainer's resume would refuse
    let mut other = crate::dp::accountant::Accountant::default();
    other.step(9.0, 0.2).unwrap();
    t.set_accountant(other);
    let e = t.save(&dir).unwrap_err();
    assert!(e.to_string().contains("noise multiplier 9"), "{e}");
    // and the folder is still the earlier save
    let (vm3, _, _) = setup();
    let mut back = trainer(&vm3, &xs, &ys);
    back.resume(&dir).unwrap();
    assert_eq!(back.steps(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}
