//! User-level DP (`PrivacyEngine::users`): one example a user is
//! example-level DP bit for bit; a user's combined gradient (mean or sum)
//! is clipped whole, ghost norms with their cross terms equal to the
//! per-user reference; the noise and ε are those of the user-level
//! analysis; bad input is refused.

use candle_core::{DType, Device, Tensor};
use candle_func::dp::accountant::{Accountant, Mechanism};
use candle_func::dp::{DpConfig, PrivacyEngine, Sampling, UserGradient};
use candle_func::rng::Rng;
use candle_func::{grad, Tracer};
use candle_nn::VarMap;
use std::collections::BTreeMap;

mod common;
use common::{hashed_values as values, max_diff, two_layer_loss, two_layer_model};

type Params = BTreeMap<String, Tensor>;

fn current(vm: &VarMap) -> Params {
    let data = vm.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

fn ids_u32(v: impl IntoIterator<Item = u32>) -> Tensor {
    let v: Vec<u32> = v.into_iter().collect();
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

#[test]
fn one_example_a_user_is_example_level_dp_bit_for_bit() {
    let n = 40;
    let (xs, ys) = (values(1, &[n, 4]), values(2, &[n, 2]));
    for sampling in [Sampling::Poisson, Sampling::WithoutReplacement] {
        let run = |users: Option<Tensor>| {
            let vm = two_layer_model();
            let mut engine = PrivacyEngine::new()
                .rng(Rng::seeded(11))
                .physical_batch(3)
                .sampling(sampling);
            if let Some(u) = &users {
                // a cap above one changes nothing when every user has one example
                engine = engine.users(u, 4).user_gradient(UserGradient::Mean);
            }
            let mut t = engine
                .make_private(
                    two_layer_loss,
                    &vm,
                    candle_func::optim::Sgd::new(&vm, 0.1, 0.5).unwrap(),
                    (&xs, &ys),
                    DpConfig::new(8, 0.9, 0.5),
                )
                .unwrap();
            let infos: Vec<_> = (0..5).map(|_| t.step().unwrap()).collect();
            (current(&vm), infos, t.epsilon(1e-5).unwrap())
        };
        let (p_ex, i_ex, e_ex) = run(None);
        let (p_us, i_us, e_us) = run(Some(ids_u32(0..n as u32)));
        assert_eq!(i_ex, i_us, "{sampling:?}");
        assert_eq!(e_ex, e_us);
        for (k, t) in &p_ex {
            assert_eq!(max_diff(t, &p_us[k]), 0.0, "{sampling:?} {k}");
        }
    }
}

/// A sequence model: an embedding, then a linear layer over the positions
/// (ghost rules for both), squared error against `[T, 3]` targets.
fn seq_model() -> VarMap {
    common::varmap_of(
        &[("emb.weight", &[30, 8]), ("fc.weight", &[3, 8]), ("fc.bias", &[3])],
        5,
    )
}

fn seq_loss(p: BTreeMap<String, Tracer>, ids: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let h = p["emb.weight"].index_select(&ids, 0)?; // [T, 8]
    let out = h.broadcast_matmul(&p["fc.weight"].t()?)?.broadcast_add(&p["fc.bias"])?;
    out.sub(&y)?.sqr()?.sum_all()
}

/// 7 users owning 1 to 4 examples each (ids out of order).
fn seq_data() -> (Tensor, Tensor, Tensor, Vec<u32>) {
    let owner: Vec<u32> = vec![3, 0, 0, 5, 1, 3, 0, 2, 5, 4, 3, 6, 0, 1, 5, 4];
    let n = owner.len();
    let ids = common::rand_idx(&[n, 5], 30, 7);
    let y = values(9, &[n, 5, 3]);
    (ids, y, ids_u32(owner.iter().copied()), owner)
}

/// The step by hand: every user sampled (q = 1), each user's examples'
/// gradients by `grad` one at a time, combined, clipped, summed, divided
/// by the user count, one SGD step of 1.
fn by_hand(before: &Params, (ids, y): (&Tensor, &Tensor), owner: &[u32], mean: bool, c: f64) -> Params {
    let users: std::collections::BTreeSet<u32> = owner.iter().copied().collect();
    let mut total: Option<Params> = None;
    for u in &users {
        let mine: Vec<usize> = (0..owner.len()).filter(|&i| owner[i] == *u).collect();
        let mut g: Option<Params> = None;
        for &i in &mine {
            let gi = grad(seq_loss)
                .call((before, &ids.get(i).unwrap(), &y.get(i).unwrap()))
                .unwrap();
            g = Some(match g {
                None => gi,
                Some(g) => g.iter().map(|(k, t)| (k.clone(), (t + &gi[k]).unwrap())).collect(),
            });
        }
        let scale = if mean { 1.0 / mine.len() as f64 } else { 1.0 };
        let g: Params = g
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.affine(scale, 0.0).unwrap()))
            .collect();
        let norm = g
            .values()
            .map(|t| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
            .sum::<f64>()
            .sqrt();
        let f = (c / (norm + 1e-6)).min(1.0);
        total = Some(match total {
            None => g.iter().map(|(k, t)| (k.clone(), t.affine(f, 0.0).unwrap())).collect(),
            Some(s) => s
                .iter()
                .map(|(k, t)| (k.clone(), (t + g[k].affine(f, 0.0).unwrap()).unwrap()))
                .collect(),
        });
    }
    let total = total.unwrap();
    before
        .iter()
        .map(|(k, p)| {
            (
                k.clone(),
                (p - total[k].affine(1.0 / users.len() as f64, 0.0).unwrap()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_users_combined_gradient_is_clipped_whole_ghost_or_not() {
    let (ids, y, users, owner) = seq_data();
    for gradient in [UserGradient::Mean, UserGradient::Sum] {
        for ghost in [true, false] {
            let vm = seq_model();
            let before = current(&vm);
            let mut t = PrivacyEngine::new()
                .rng(Rng::seeded(3))
                .ghost(ghost)
                .physical_batch(3) // 7 users in passes of 3, the last padded
                .users(&users, 4)
                .user_gradient(gradient)
                .make_private(
                    seq_loss,
                    &vm,
                    candle_func::optim::Sgd::new(&vm, 1.0, 0.0).unwrap(),
                    (&ids, &y),
                    DpConfig::new(7, 0.0, 2.0),
                )
                .unwrap();
            let info = t.step().unwrap();
            assert_eq!((info.batch_size, info.examples, info.passes), (7, 16, 3));
            let want = by_hand(&before, (&ids, &y), &owner, gradient == UserGradient::Mean, 2.0);
            let got = current(&vm);
            for (k, w) in &want {
                let d = max_diff(&got[k], w);
                assert!(d < 2e-5, "{gradient:?} ghost {ghost} {k}: {d}");
            }
            // the clipping bit: some user's gradient exceeded the bound
            assert!(info.clipped_fraction > 0.0, "{info:?}");
        }
    }
}

#[test]
fn the_cap_takes_at_most_k_examples_of_a_user() {
    let (ids, y, users, owner) = seq_data();
    let vm = seq_model();
    let mut t = PrivacyEngine::new()
        .rng(Rng::seeded(3))
        .users(&users, 2)
        .make_private(
            seq_loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
            (&ids, &y),
            DpConfig::new(7, 1.0, 1.0),
        )
        .unwrap();
    let capped: usize = (0..7u32)
        .map(|u| owner.iter().filter(|&&o| o == u).count().min(2))
        .sum();
    for _ in 0..3 {
        let info = t.step().unwrap();
        assert_eq!((info.batch_size, info.examples), (7, capped));
    }
    assert_eq!(t.traced_signatures(), 1);
}

#[test]
fn the_noise_and_epsilon_are_the_user_level_analysis() {
    // 120 examples of 30 users, 4 each; a wide layer for many noise draws
    let (n, users_n, d_in, d_out) = (120, 30, 64, 32);
    let xs = values(1, &[n, d_in]);
    let ys = values(2, &[n, d_out]);
    let users = ids_u32((0..n as u32).map(|i| i % users_n as u32));
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        x.unsqueeze(0)?
            .broadcast_matmul(&p["w"].t()?)?
            .sub(&y.unsqueeze(0)?)?
            .sqr()?
            .sum_all()
    };
    let (batch, sigma, c) = (6, 2.0, 0.5);
    let step = |sigma: f64| {
        let vm = common::varmap_of(&[("w", &[d_out, d_in])], 4);
        let before = current(&vm)["w"].clone();
        let mut t = PrivacyEngine::new()
            .rng(Rng::seeded(21))
            .users(&users, 3)
            .make_private(
                loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 1.0, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::new(batch, sigma, c),
            )
            .unwrap();
        t.step().unwrap();
        let eps = t.epsilon(1e-5).unwrap();
        ((before - &current(&vm)["w"]).unwrap(), eps, t.sample_rate())
    };
    // the same seed draws the same users; only the noise differs
    let (quiet, _, _) = step(0.0);
    let (noisy, eps, q) = step(sigma);
    assert_eq!(q, batch as f64 / users_n as f64);
    let noise = common::values(&(noisy - quiet).unwrap());
    let sd = (noise.iter().map(|v| v * v).sum::<f64>() / noise.len() as f64).sqrt();
    // σ C over the expected number of users, q U (not examples, q N)
    let want = sigma * c / batch as f64;
    assert!((sd / want - 1.0).abs() < 0.05, "noise sd {sd}, expected {want}");
    // ε per user: the accountant's at the users' rate
    let mut acc = Accountant::new(Mechanism::Prv);
    acc.step(sigma, batch as f64 / users_n as f64).unwrap();
    assert_eq!(eps, acc.epsilon(1e-5).unwrap());
    let mut per_example = Accountant::new(Mechanism::Prv);
    per_example.step(sigma, batch as f64 / n as f64).unwrap();
    assert!(eps > per_example.epsilon(1e-5).unwrap());
}

#[test]
fn ghost_norms_keep_a_users_gradient_unmaterialised() {
    // a wide linear layer on sequences: materialised, each user's
    // gradient is 256 x 256; ghost, a (k T)² Gram matrix
    let (n, t, d) = (32, 4, 256);
    let xs = values(1, &[n, t, d]);
    let ys = values(2, &[n, t, d]);
    let users = ids_u32((0..n as u32).map(|i| i / 4));
    let loss =
        |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| x.broadcast_matmul(&p["w"].t()?)?.sub(&y)?.sqr()?.sum_all();
    let peak = |ghost: bool| {
        let vm = common::varmap_of(&[("w", &[d, d])], 4);
        let t = PrivacyEngine::new()
            .rng(Rng::seeded(1))
            .ghost(ghost)
            .physical_batch(8)
            .memory_limit(1 << 36)
            .users(&users, 4)
            .make_private(
                loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 1.0, 0.0).unwrap(),
                (&xs, &ys),
                DpConfig::new(4, 1.0, 1.0),
            )
            .unwrap();
        t.memory_plan().unwrap().pass
    };
    let (ghost, materialised) = (peak(true), peak(false));
    // 8 users' 256 x 256 f32 gradients are 2 MiB
    assert!(materialised >= 8 * d * d * 4, "{materialised}");
    assert!(ghost * 2 < materialised, "ghost {ghost}, materialised {materialised}");
}

#[test]
fn make_private_with_epsilon_counts_users() {
    let (ids, y, users, _) = seq_data();
    let vm = seq_model();
    let t = PrivacyEngine::new()
        .users(&users, 4)
        .make_private_with_epsilon(
            seq_loss,
            &vm,
            candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
            (&ids, &y),
            DpConfig::new(2, 0.0, 1.0),
            (4.0, 1e-5, 3.0),
        )
        .unwrap();
    assert_eq!(t.sample_rate(), 2.0 / 7.0);
    assert_eq!(t.steps_per_epoch(), 4);
    let mut acc = Accountant::new(Mechanism::Prv);
    acc.record(t.noise_multiplier(), 2.0 / 7.0, 12).unwrap();
    let eps = acc.epsilon(1e-5).unwrap();
    assert!(eps <= 4.0 && eps > 3.5, "{eps}");
}

#[test]
fn a_checkpoint_refuses_another_grouping_of_users() {
    let (ids, y, users, _) = seq_data();
    let dir = std::env::temp_dir().join(format!("candle_func_users_ckpt_{}", std::process::id()));
    let make = |engine: PrivacyEngine| {
        let vm = seq_model();
        engine
            .rng(Rng::seeded(2))
            .make_private(
                seq_loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&ids, &y),
                DpConfig::new(3, 1.0, 1.0),
            )
            .unwrap()
    };
    let mut t = make(PrivacyEngine::new().users(&users, 4));
    t.step().unwrap();
    t.save(&dir).unwrap();
    let mut again = make(PrivacyEngine::new().users(&users, 4));
    again.resume(&dir).unwrap();
    let mut other = make(PrivacyEngine::new().users(&users, 2));
    let msg = other.resume(&dir).unwrap_err().to_string();
    assert!(msg.contains("users") && msg.contains("max_examples"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_user_input_is_refused() {
    let (ids, y, users, _) = seq_data();
    let make = |engine: PrivacyEngine, batch: usize| {
        let vm = seq_model();
        engine
            .make_private(
                seq_loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&ids, &y),
                DpConfig::new(batch, 1.0, 1.0),
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let short = ids_u32(0..5);
    let m = make(PrivacyEngine::new().users(&short, 2), 2);
    assert!(
        m.contains("PrivacyEngine::users") && m.contains("[16]") && m.contains("[5]"),
        "{m}"
    );
    let floats = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
    let m = make(PrivacyEngine::new().users(&floats, 2), 2);
    assert!(m.contains("F32") && m.contains("integer"), "{m}");
    let m = make(PrivacyEngine::new().users(&users, 0), 2);
    assert!(m.contains("max_examples"), "{m}");
    let m = make(PrivacyEngine::new().user_gradient(UserGradient::Sum), 2);
    assert!(m.contains("user_gradient") && m.contains("without users"), "{m}");
    // the batch counts users: 7 of them
    let m = make(PrivacyEngine::new().users(&users, 2), 8);
    assert!(m.contains("batch_size") && m.contains("1..=7"), "{m}");
    let m = make(
        PrivacyEngine::new()
            .users(&users, 2)
            .sampling(Sampling::TruncatedPoisson {
                dataset_size: 16,
                max_batch: 4,
            }),
        2,
    );
    assert!(
        m.contains("dataset_size") && m.contains("7 (the number of users)"),
        "{m}"
    );
}

#[test]
fn distributed_users_are_the_single_process_step() {
    let (ids, y, users, _) = seq_data();
    let run = |distributed: bool| {
        let vm = seq_model();
        let mut t = PrivacyEngine::new()
            .rng(Rng::seeded(8))
            .physical_batch(2)
            .users(&users, 3)
            .make_private(
                seq_loss,
                &vm,
                candle_func::optim::Sgd::new(&vm, 0.1, 0.0).unwrap(),
                (&ids, &y),
                DpConfig::new(3, 0.8, 1.0),
            )
            .unwrap();
        if distributed {
            t = t.distributed(common::OneRank { lie: false, rank: 0 }).unwrap();
        }
        let infos: Vec<_> = (0..4).map(|_| t.step().unwrap()).collect();
        (current(&vm), infos)
    };
    let ((pa, ia), (pb, ib)) = (run(false), run(true));
    for (a, b) in ia.iter().zip(&ib) {
        assert_eq!(
            (a.batch_size, a.examples, a.passes),
            (b.batch_size, b.examples, b.passes)
        );
    }
    for (k, t) in &pa {
        // noise added, then scaled: the rounding of one product apart
        assert!(max_diff(t, &pb[k]) < 1e-6, "{k}");
    }
}
