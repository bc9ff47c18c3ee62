//! The digits DP-SGD example (`dp_sgd`) spread over MPI ranks: each rank
//! clips its share of every logical Poisson batch, the clipped sums are
//! all-reduced with rank 0's noise in them, and every rank takes the same
//! step (see `dp::collective`). Needs `--features mpi` and Open MPI:
//!
//!     cargo build --release --features mpi --example dp_sgd_mpi
//!     mpirun --oversubscribe -np 2 target/release/examples/dp_sgd_mpi
//!
//! (as root, add `--allow-run-as-root`). Options as `dp_sgd`'s: --epochs,
//! --batch, --physical, --lr, --momentum, --noise, --clip, --delta,
//! --seed. It prints, on rank 0, the time per logical step and the bytes
//! each step moves beside the model's size.

mod common;

use candle_core::{DType, Device};
use candle_func::dp::accountant::Mechanism;
use candle_func::dp::collective::Collective;
use candle_func::dp::mpi::MpiCollective;
use candle_func::dp::{self, DpConfig, PrivacyEngine};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::optim::Optimizer;
use candle_func::rng::Rng;
use candle_func::{Options, Tracer};
use common::{arg, digits, digits_cnn};
use std::collections::BTreeMap;
use std::time::Instant;

fn main() {
    let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
        eprintln!("dp_sgd_mpi: MPI was already initialised");
        std::process::exit(1);
    };
    dp::mpi::abort_job_on_panic();
    let comm = MpiCollective::new(universe.world());
    let rank = comm.rank();
    // An error on one rank ends the job: returning it would finalise MPI
    // while the other ranks wait in a collective.
    if let Err(e) = run(comm) {
        eprintln!("dp_sgd_mpi: rank {rank}: {e}");
        mpi::traits::Communicator::abort(&universe.world(), 1);
    }
}

fn run(comm: MpiCollective) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, size) = (comm.rank(), comm.size());
    let dev = Device::Cpu;
    let epochs: usize = arg("--epochs", 30);
    let batch: usize = arg("--batch", 64);
    let physical: usize = arg("--physical", 32);
    let lr: f64 = arg("--lr", 1.0);
    let momentum: f64 = arg("--momentum", 0.5);
    let noise: f64 = arg("--noise", 1.0);
    let clip: f64 = arg("--clip", 1.0);
    let delta: f64 = arg("--delta", 1e-5);
    let seed: Option<u64> = std::env::args().any(|a| a == "--seed").then(|| arg("--seed", 0));

    let all = digits::load(&dev)?;
    let (train, test) = digits::split(&all)?;
    // The model each rank makes is replaced by rank 0's when the trainer
    // becomes distributed.
    let varmap = candle_nn::VarMap::new();
    let model = digits_cnn(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&model, &p, &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, Reduction::Mean)
    };
    // Only rank 0's generator draws; the others' are never read.
    let rng = match seed {
        Some(s) => Rng::seeded(s),
        None => Rng::from_os()?,
    };
    let engine = PrivacyEngine::new()
        .accountant(Mechanism::Prv)
        .rng(rng)
        .physical_batch(physical)
        .options(Options::new());
    let sgd = candle_func::optim::Sgd::new(&varmap, lr, momentum)?;
    let config = DpConfig::new(batch, noise, clip);
    let mut trainer = engine
        .make_private(loss, &varmap, sgd, (&train.images, &train.labels), config)?
        .distributed(comm)?;
    let steps_per_epoch = trainer.steps_per_epoch();
    let params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    if rank == 0 {
        println!(
            "DP-SGD on the UCI digits over {size} ranks: {} training examples, expected batch {batch} \
             (about {} per rank), {epochs} epochs x {steps_per_epoch} steps, noise {noise}, clip {clip}",
            train.len(),
            batch / size
        );
    }
    let total_steps = (epochs * steps_per_epoch) as f64;
    let (mut step, mut timed, mut seconds) = (0usize, 0usize, 0.0);
    for epoch in 1..=epochs {
        for _ in 0..steps_per_epoch {
            let decayed = lr * 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total_steps).cos());
            trainer.optimizer_mut().set_lr(decayed)?;
            let t = Instant::now();
            trainer.step()?;
            // the first epoch traces and warms up; later steps are timed
            if epoch > 1 {
                seconds += t.elapsed().as_secs_f64();
                timed += 1;
            }
            step += 1;
        }
        if rank == 0 && (epoch % 5 == 0 || epoch == epochs) {
            println!(
                "epoch {epoch:>3}  test accuracy {:.4}  epsilon {:.2} (PRV)",
                accuracy(&model, &test)?,
                trainer.epsilon(delta)?
            );
        }
    }
    if rank == 0 {
        // per step: the all-reduced sums (f32) with the loss and clipped
        // count and the failure flag (three f64), the batch's indices broadcast (a length and ~B
        // u64), and one u64 hash gathered from each rank
        let reduced = params * 4 + 24;
        let broadcast = 8 * (1 + batch);
        println!(
            "time per logical step: {:.2} ms over {size} ranks (mean of {timed} steps after the first epoch)",
            1e3 * seconds / timed.max(1) as f64
        );
        println!(
            "bytes per step: {reduced} all-reduced + ~{broadcast} broadcast + {} gathered; the model: {params} parameters, {} bytes",
            8 * size,
            params * 4
        );
        println!(
            "epsilon: {:.2} by PRV, {:.2} by RDP (delta {delta:e})",
            trainer.epsilon(delta)?,
            trainer.accountant().with_mechanism(Mechanism::Rdp).epsilon(delta)?
        );
        println!("test accuracy: {:.2}", accuracy(&model, &test)?);
    }
    Ok(())
}

fn accuracy(model: &impl Module, d: &digits::Digits) -> candle_func::Result<f64> {
    let pred = model.forward_eager(&d.images)?.argmax(1)?;
    let right = pred
        .eq(&d.labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(right as f64 / d.len() as f64)
}
