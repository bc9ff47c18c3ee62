//! `dp::Dataset`: examples read lazily from safetensors shards train exactly
//! as the same examples held in memory, each step fetches only its passes'
//! examples, and bad shards or indices are refused by name.

use candle_core::{DType, Device, Tensor};
use candle_func::dp::{Dataset, DpConfig, PrivacyEngine, SafetensorsDataset, TensorDataset};
use candle_func::rng::Rng;
use candle_func::Tracer;
use candle_nn::VarMap;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

mod common;
use common::max_diff;

fn model() -> VarMap {
    let vm = VarMap::new();
    let w = common::hashed_values(3, &[2, 4]);
    vm.data()
        .lock()
        .unwrap()
        .insert("w".into(), candle_core::Var::from_tensor(&w).unwrap());
    vm
}

fn example_loss(p: &BTreeMap<String, Tracer>, x: &Tracer, y: &Tracer) -> candle_func::Result<Tracer> {
    let out = x.unsqueeze(0)?.broadcast_matmul(&p["w"].t()?)?;
    out.sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()
}

/// Shards of 7, 5 and 9 examples (`xs [n, 4]`, `ys [n, 2]`), written to a
/// fresh folder, and the same examples concatenated.
fn shards(tag: &str) -> (Vec<PathBuf>, Tensor, Tensor) {
    let dir = std::env::temp_dir().join(format!("candle_func_dataset_{tag}_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (xs, ys) = (common::hashed_values(1, &[21, 4]), common::hashed_values(2, &[21, 2]));
    let mut paths = Vec::new();
    let mut at = 0;
    for (k, n) in [7, 5, 9].into_iter().enumerate() {
        let path = dir.join(format!("shard{k}.safetensors"));
        let map = HashMap::from([
            ("xs".to_string(), xs.narrow(0, at, n).unwrap()),
            ("ys".to_string(), ys.narrow(0, at, n).unwrap()),
        ]);
        candle_core::safetensors::save(&map, &path).unwrap();
        paths.push(path);
        at += n;
    }
    (paths, xs, ys)
}

#[test]
fn shards_fetch_the_rows_asked_for() {
    let (paths, xs, ys) = shards("fetch");
    let d = SafetensorsDataset::open(&paths, &["ys", "xs"], &Device::Cpu).unwrap();
    assert_eq!(d.len(), 21);
    assert_eq!(d.shapes(), vec![(vec![4], DType::F32), (vec![2], DType::F32)]); // sorted by name
    let idx = [0usize, 8, 20, 8, 6, 7, 12];
    let got = d.fetch(&idx).unwrap();
    let ids = Tensor::from_vec(
        idx.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        idx.len(),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(max_diff(&got[0], &xs.index_select(&ids, 0).unwrap()), 0.0);
    assert_eq!(max_diff(&got[1], &ys.index_select(&ids, 0).unwrap()), 0.0);
    let e = d.fetch(&[3, 21]).unwrap_err().to_string();
    assert!(e.contains("21") && e.contains("out of range"), "{e}");
    // the in-memory data set answers the same
    let mem = TensorDataset::new(&(xs.clone(), ys.clone())).unwrap();
    assert_eq!(max_diff(&mem.fetch(&idx).unwrap()[0], &got[0]), 0.0);
    assert_eq!(mem.resident_bytes(), 21 * 6 * 4);
    assert_eq!(d.resident_bytes(), 0);
}

#[test]
fn a_trainer_on_shards_equals_one_on_tensors() {
    let (paths, xs, ys) = shards("train");
    let (on_disk, in_memory) = (model(), model());
    let config = DpConfig::new(6, 0.8, 1.0);
    let disk = SafetensorsDataset::open(&paths, &["xs", "ys"], &Device::Cpu).unwrap();
    let loss = |p: BTreeMap<String, Tracer>, ex: BTreeMap<String, Tracer>| example_loss(&p, &ex["xs"], &ex["ys"]);
    let mut a = PrivacyEngine::new()
        .rng(Rng::seeded(5))
        .physical_batch(4)
        .make_private_dataset(
            loss,
            &on_disk,
            candle_func::optim::Sgd::new(&on_disk, 0.1, 0.0).unwrap(),
            disk,
            config.clone(),
        )
        .unwrap();
    let plain = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| example_loss(&p, &x, &y);
    let mut b = PrivacyEngine::new()
        .rng(Rng::seeded(5))
        .physical_batch(4)
        .make_private(
            plain,
            &in_memory,
            candle_func::optim::Sgd::new(&in_memory, 0.1, 0.0).unwrap(),
            (&xs, &ys),
            config,
        )
        .unwrap();
    for _ in 0..5 {
        assert_eq!(a.step().unwrap().batch_size, b.step().unwrap().batch_size);
    }
    assert_eq!(a.traced_signatures(), 1);
    let (wa, wb) = (
        on_disk.all_vars()[0].as_tensor().copy().unwrap(),
        in_memory.all_vars()[0].as_tensor().copy().unwrap(),
    );
    assert_eq!(max_diff(&wa, &wb), 0.0);
    assert!(max_diff(&wa, &common::hashed_values(3, &[2, 4])) > 1e-3);
    assert_eq!(a.epsilon(1e-5).unwrap(), b.epsilon(1e-5).unwrap());
}

#[test]
fn bad_shards_are_refused_by_name() {
    let (paths, _, _) = shards("bad");
    let e = SafetensorsDataset::open(&paths, &["xs", "zs"], &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("zs") && e.contains("missing") && e.contains("shard0"), "{e}");
    // a shard whose examples are shaped otherwise
    let odd = paths[0].with_file_name("odd.safetensors");
    let map = HashMap::from([
        (
            "xs".to_string(),
            Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "ys".to_string(),
            Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap(),
        ),
    ]);
    candle_core::safetensors::save(&map, &odd).unwrap();
    let e = SafetensorsDataset::open(&[paths[0].clone(), odd], &["xs", "ys"], &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("odd.safetensors") && e.contains("[5]"), "{e}");
    let none: [PathBuf; 0] = [];
    assert!(SafetensorsDataset::open(&none, &["xs"], &Device::Cpu).is_err());
    let garbage = paths[0].with_file_name("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let e = SafetensorsDataset::open(&[garbage], &["xs"], &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("garbage.safetensors"), "{e}");
}

/// A safetensors file whose header is written by hand.
fn raw_file(name: &str, header: &str, data: usize) -> PathBuf {
    let path = std::env::temp_dir().join(format!("candle_func_raw_{name}_{}.safetensors", std::process::id()));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, data));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_lying_header_is_an_error_not_a_panic() {
    for (name, header, data, says) in [
        (
            "reversed",
            r#"{"xs":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}}"#,
            16,
            "bytes 16..0",
        ),
        (
            "huge",
            r#"{"xs":{"dtype":"F32","shape":[2,4611686018427387904],"data_offsets":[0,16]}}"#,
            16,
            "shape",
        ),
        (
            "short",
            r#"{"xs":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
            8,
            "past the end",
        ),
    ] {
        let path = raw_file(name, header, data);
        let e = SafetensorsDataset::open(&[&path], &["xs"], &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains(says) && e.contains("xs"), "{name}: {e}");
        std::fs::remove_file(&path).ok();
    }
}

/// A data set that describes itself wrongly.
struct Broken {
    len: usize,
}

impl Dataset for Broken {
    fn len(&self) -> usize {
        self.len
    }
    fn tree(&self) -> candle_func::tree::TreeDef {
        candle_func::tree::TreeDef::Map(vec![
            ("xs".into(), candle_func::tree::TreeDef::Leaf),
            ("ys".into(), candle_func::tree::TreeDef::Leaf),
        ])
    }
    fn shapes(&self) -> Vec<(Vec<usize>, DType)> {
        vec![(vec![4], DType::F32)] // one shape for two leaves
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn fetch(&self, _: &[usize]) -> candle_func::Result<Vec<Tensor>> {
        unreachable!("never fetched: refused when the trainer is made")
    }
}

#[test]
fn a_data_set_that_misdescribes_itself_is_refused() {
    let vm = model();
    let loss = |p: BTreeMap<String, Tracer>, ex: BTreeMap<String, Tracer>| example_loss(&p, &ex["xs"], &ex["ys"]);
    for len in [0, 10] {
        let sgd = candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap();
        let e = PrivacyEngine::new()
            .make_private_dataset(loss, &vm, sgd, Broken { len }, DpConfig::new(2, 1.0, 1.0))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{len} examples")) && e.contains("2 leaves"), "{e}");
    }
    // an empty tree of tensors
    let none = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(TensorDataset::new(&none).is_err());
}
