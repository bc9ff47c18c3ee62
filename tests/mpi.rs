//! Data-parallel DP training over MPI (`--features mpi`): 2 and 3 ranks
//! (`mpirun -np N`, oversubscribed) end a few steps with the parameters and
//! ε of the single-process run of the same logical batches, whatever the
//! other ranks' initial values (rank 0's are broadcast); ranks whose
//! parameters drift apart fail the step; a rank that dies, hangs or
//! panics makes the others fail instead of wait.
//!
//! The tests launch this test binary under `mpirun`, running only the
//! ignored `worker` test, which reads what to do from
//! `CANDLE_FUNC_MPI_MODE`.
#![cfg(feature = "mpi")]

use candle_core::Tensor;
use candle_func::dp::collective::{Collective, CollectiveFailure};
use candle_func::dp::mpi::MpiCollective;
use candle_func::dp::{DpConfig, PrivacyEngine, PrivateTrainer};
use candle_func::optim::Sgd;
use candle_func::rng::Rng;
use candle_func::Tracer;
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

type Loss = fn(BTreeMap<String, Tracer>, Tracer, Tracer) -> candle_func::Result<Tracer>;

fn values(seed: u64, shape: &[usize]) -> Tensor {
    common::hashed_values(seed, shape)
}

/// Two layers (4 -> 8, tanh; 8 -> 2) with fixed values, the same on every rank.
fn model() -> VarMap {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        let shapes = [("l.weight", &[8, 4][..]), ("l.bias", &[8]), ("m.weight", &[2, 8])];
        for (i, (name, shape)) in shapes.into_iter().enumerate() {
            let v = candle_core::Var::from_tensor(&values(i as u64 + 10, shape)).unwrap();
            data.insert(name.into(), v);
        }
    }
    vm
}

fn loss(p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> candle_func::Result<Tracer> {
    let h = x.unsqueeze(0)?.broadcast_matmul(&p["l.weight"].t()?)?;
    let h = h.broadcast_add(&p["l.bias"])?.tanh()?;
    let out = h.broadcast_matmul(&p["m.weight"].t()?)?;
    out.sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()
}

const STEPS: usize = 6;

/// A trainer of the model on 90 examples, logical batch 15, passes of 4,
/// noise from a generator seeded 42 (rank 0's draws everything).
fn trainer(vm: &VarMap) -> PrivateTrainer<Loss, Sgd> {
    let (xs, ys) = (values(1, &[90, 4]), values(2, &[90, 2]));
    PrivacyEngine::new()
        .rng(Rng::seeded(42))
        .physical_batch(4)
        .make_private(
            loss as Loss,
            vm,
            Sgd::new(vm, 0.05, 0.9).unwrap(),
            (&xs, &ys),
            DpConfig::new(15, 0.8, 1.0),
        )
        .unwrap()
}

fn params(vm: &VarMap) -> BTreeMap<String, Tensor> {
    let data = vm.data().lock().unwrap();
    data.iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    a.iter()
        .map(|(k, t)| {
            let d = (t - &b[k]).unwrap().abs().unwrap().flatten_all().unwrap();
            d.max(0).unwrap().to_scalar::<f32>().unwrap() as f64
        })
        .fold(0.0, f64::max)
}

fn perturb(vm: &VarMap, by: f64) {
    let data = vm.data().lock().unwrap();
    let b = &data["l.bias"];
    b.set(&(b.as_tensor() + by).unwrap()).unwrap();
}

#[test]
#[ignore = "a worker: the tests below run it under mpirun"]
fn worker() {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Funneled).expect("MPI initialises once per process");
    candle_func::dp::mpi::abort_job_on_panic();
    let mode = std::env::var("CANDLE_FUNC_MPI_MODE").unwrap_or_else(|_| "exact".into());
    let timeout = Duration::from_secs(if mode == "hang" { 5 } else { 120 });
    let comm = || MpiCollective::new(universe.world()).timeout(timeout);
    let (rank, size) = (comm().rank(), comm().size());
    if rank == 1 && mode == "die" {
        std::process::exit(3);
    }
    if rank == 1 && mode == "hang" {
        std::thread::sleep(Duration::from_secs(600));
    }
    if rank == 1 && mode == "panic" {
        panic!("rank 1 panics before the first collective");
    }
    // Every rank but 0 starts from other values: rank 0's are broadcast.
    let vm = model();
    if rank != 0 {
        perturb(&vm, rank as f64);
    }
    let mut t = trainer(&vm).distributed(comm()).unwrap();
    if mode == "drift" {
        t.step().unwrap();
        if rank == size - 1 {
            perturb(&vm, 1e-3); // changed outside the step
        }
        let e = t.step().expect_err("ranks whose parameters drift apart fail");
        match &e {
            candle_func::Error::Collective {
                failure: CollectiveFailure::Drift { ranks, when, hashes },
                ..
            } => {
                assert_eq!(ranks, &[size - 1], "{e}");
                assert_eq!(when, "after a step");
                assert_eq!(hashes.len(), size);
            }
            _ => panic!("not a drift: {e:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("differ from rank 0"), "{msg}");
        println!("MPI-DRIFT rank={rank} refused: {msg}");
        return;
    }
    let mut sizes = Vec::new();
    for _ in 0..STEPS {
        sizes.push(t.step().unwrap().batch_size);
    }
    let eps = t.epsilon(1e-5).unwrap();
    let all = comm().all_gather_u64(eps.to_bits()).unwrap();
    assert!(
        all.iter().all(|&e| e == all[0]),
        "ranks report different epsilons: {all:?}"
    );
    if rank == 0 {
        let alone_vm = model();
        let mut alone = trainer(&alone_vm);
        let alone_sizes: Vec<usize> = (0..STEPS).map(|_| alone.step().unwrap().batch_size).collect();
        assert_eq!(sizes, alone_sizes, "the logical batches differ from one process's");
        let d = max_diff(&params(&vm), &params(&alone_vm));
        assert_eq!(eps, alone.epsilon(1e-5).unwrap());
        println!("MPI-EXACT ranks={size} batches={sizes:?} max_param_diff={d:e} epsilon={eps}");
        assert!(d <= 1e-5, "parameters differ from the single-process run by {d}");
    }
}

/// Runs `worker` on `np` ranks in `mode`: (success, stdout + stderr,
/// seconds). A job still running after 180 s is killed and fails, so a
/// hang fails the test rather than the CI run.
fn mpirun(np: usize, mode: &str) -> (bool, String, f64) {
    let (code, text, secs) = mpirun_code(np, mode);
    (code == Some(0), text, secs)
}

/// [`mpirun`] with mpirun's exit code (`None` when killed or timed out).
fn mpirun_code(np: usize, mode: &str) -> (Option<i32>, String, f64) {
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "-np", &np.to_string()])
        .arg(exe)
        .args(["worker", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("CANDLE_FUNC_MPI_MODE", mode)
        // CI runs as root, which Open MPI refuses unless told twice
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (Open MPI) is installed");
    // both pipes are read while the job runs, so a full one cannot stall it
    let out = read_all(child.stdout.take());
    let err = read_all(child.stderr.take());
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if start.elapsed() > Duration::from_secs(180) {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    (code, text, start.elapsed().as_secs_f64())
}

/// A thread reading `pipe` to its end.
fn read_all(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut p) = pipe {
            p.read_to_string(&mut s).ok();
        }
        s
    })
}

#[test]
fn two_and_three_ranks_end_where_one_process_does() {
    for np in [1, 2, 3] {
        let (ok, out, secs) = mpirun(np, "exact");
        assert!(ok, "{np} ranks failed after {secs:.1} s:\n{out}");
        // the harness prints "test worker ... " before the worker's line
        let line = out.lines().find_map(|l| l.find("MPI-EXACT").map(|i| &l[i..]));
        let line = line.unwrap_or_else(|| panic!("{out}"));
        assert!(line.contains(&format!("ranks={np} ")), "{line}");
        eprintln!("{line} ({secs:.1} s)");
    }
}

#[test]
fn ranks_whose_parameters_drift_apart_fail() {
    let (ok, out, _) = mpirun(2, "drift");
    assert!(ok, "{out}");
    assert_eq!(out.matches("MPI-DRIFT").count(), 2, "{out}");
}

/// `text` with every run of whitespace made one space (Open MPI aligns its
/// reports with runs of spaces).
fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The job failed as `mode` makes it fail, and no other way: the rank
/// that dies is the one reported with its exit code; the rank that hangs
/// is waited for by the others, one of which reports the timeout and aborts with the
/// collective's code (70); the panicking rank prints its panic and aborts
/// the job with 101. In none did a worker report a wrong result.
///
/// The abort's code is read from Open MPI's report or from mpirun's exit
/// code (`exit`): when two ranks abort at once, Open MPI can lose the
/// report ("ORTE_ERROR_LOG: Out of resource in file show_help.c").
fn failed_as_expected(mode: &str, out: &str, exit: Option<i32>) -> bool {
    let s = squeeze(out);
    let aborted = |code: i32| s.contains(&format!("with errorcode {code}")) || exit == Some(code);
    let wrong = s.contains("MPI-EXACT") || s.contains("assertion") || s.contains("differ from rank 0");
    !wrong
        && match mode {
            // rank 1 of job [[id,1],1] (Open MPI 4) or [prterun-..@1,1] (5)
            "die" => s.contains("Exit code: 3") && s.contains(",1] Exit code"),
            // every waiting rank may report, and two reports written at
            // once interleave ("distributed step on rank distributed step
            // on rank 2 of 3: ..."), so the rank's number is not matched
            "hang" => {
                s.contains("waited more than 5s for the other ranks (one has died or hung); aborting the job")
                    && s.contains("distributed step on rank")
                    && aborted(70)
            }
            "panic" => s.contains("rank 1 panics before the first collective") && aborted(101),
            _ => false,
        }
}

#[test]
fn a_rank_that_dies_hangs_or_panics_fails_the_others() {
    for mode in ["die", "hang", "panic"] {
        let (code, out, secs) = mpirun_code(3, mode);
        assert!(code != Some(0), "{mode}: the job succeeded:\n{out}");
        assert!(secs < 90.0, "{mode}: the job took {secs:.0} s to fail");
        assert!(
            failed_as_expected(mode, &out, code),
            "{mode}: not the expected failure:\n{out}"
        );
        eprintln!("{mode}: failed after {secs:.1} s, mpirun exit code {code:?}");
    }
}

/// The check above tells the three failures apart: each one's report
/// matches its own mode only.
#[test]
fn the_failure_checks_tell_the_modes_apart() {
    let reports = [
        ("die", "Process name: [[36913,1],1]\n  Exit code:    3"),
        (
            "hang",
            "distributed step on rank 0 of 3: broadcast waited more than 5s for the other ranks \
             (one has died or hung); aborting the job\nMPI_ABORT was invoked on rank 0 in communicator \
             MPI_COMM_WORLD\nwith errorcode 70.",
        ),
        (
            "panic",
            "thread 'worker' panicked at tests/mpi.rs:1:1:\nrank 1 panics before the first collective\n\
             MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\nwith errorcode 101.",
        ),
    ];
    for (mode, report) in reports {
        for (other, _) in reports {
            assert_eq!(
                failed_as_expected(other, report, None),
                mode == other,
                "{other} on {mode}'s report"
            );
        }
    }
    // a job that failed by a wrong result is not the expected failure
    let wrong = format!("{}\nassertion `left == right` failed", reports[2].1);
    assert!(!failed_as_expected("panic", &wrong, None));
}
