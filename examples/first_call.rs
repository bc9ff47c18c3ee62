//! What the first call of a transform costs beside a warm one: per-sample
//! gradients of the torch.func tutorial's CNN (B = 64), in three fresh
//! processes each, so that "first" means the process's first call.
//!
//! * `Auto, measured afresh`: `Schedule::Auto` with its decisions file off
//!   (`CANDLE_FUNC_AUTO_CACHE=off`) times the candidate schedules;
//! * `Auto, decisions kept`: the same after an earlier process saved its
//!   decisions to a file, as the crate does by default;
//! * `Batched`: a schedule fixed by the caller, which measures nothing.
//!
//! Run it with `cargo run --release --example first_call` (add `-- --reps N`
//! for more processes per variant).

#[path = "common/models.rs"]
mod models;

use candle_core::{Device, Tensor};
use candle_func::nn::{self, functional_call, Module, Reduction};
use candle_func::{grad, planner, vmap, Schedule, Tracer};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

/// Set in a child process: which schedule to use.
const CHILD: &str = "FIRST_CALL_CHILD";

fn child(schedule: Schedule) -> candle_func::Result<()> {
    let (_vm, m) = models::build(models::cnn_t)?;
    let xs = Tensor::randn(0f32, 1., (64, 1, 28, 28), &Device::Cpu)?;
    let labels: Vec<u32> = (0..64u32).map(|i| i % 10).collect();
    let ys = Tensor::from_vec(labels, 64, &Device::Cpu)?;
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = functional_call(&m, &p, &x.unsqueeze(0)?)?;
        nn::cross_entropy(&logits, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let f = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).schedule(schedule);
    let p = m.params();
    let mut times = Vec::new();
    for _ in 0..6 {
        let t = Instant::now();
        f.call((&p, &xs, &ys))?;
        times.push(t.elapsed().as_secs_f64());
    }
    let mut warm = times[1..].to_vec();
    warm.sort_by(f64::total_cmp);
    // One line the parent reads: first call, warm median (seconds).
    println!("{} {}", times[0], warm[warm.len() / 2]);
    Ok(())
}

/// Runs this example again as a child; returns (first, warm) seconds.
fn spawn(schedule: &str, cache: &str) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .env(CHILD, schedule)
        .env(planner::AUTO_CACHE_ENV, cache)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or("");
    let nums: Vec<f64> = line.split_whitespace().filter_map(|s| s.parse().ok()).collect();
    match (out.status.success(), nums.as_slice()) {
        (true, [first, warm]) => Ok((*first, *warm)),
        _ => Err(format!(
            "first_call child ({schedule}) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Ok(which) = std::env::var(CHILD) {
        let schedule = if which == "batched" {
            Schedule::Batched
        } else {
            Schedule::Auto
        };
        return Ok(child(schedule)?);
    }
    let args: Vec<String> = std::env::args().collect();
    let reps = match args.iter().position(|a| a == "--reps") {
        Some(i) => args.get(i + 1).and_then(|s| s.parse().ok()).unwrap_or(3),
        None => 3,
    };
    let dir = std::env::temp_dir().join(format!("first_call_{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let kept = dir.join("auto.tsv").to_string_lossy().into_owned();
    // The process that saves the decisions the "kept" variant reads.
    spawn("auto", &kept)?;
    println!("first call of vmap(grad) on the tutorial CNN, B = 64 ({reps} processes each; medians, s)");
    println!("{:<26} {:>10} {:>10} {:>8}", "schedule", "first", "warm", "ratio");
    for (name, schedule, cache) in [
        ("Auto, measured afresh", "auto", "off"),
        ("Auto, decisions kept", "auto", kept.as_str()),
        ("Batched (fixed)", "batched", "off"),
    ] {
        let (mut first, mut warm) = (Vec::new(), Vec::new());
        for _ in 0..reps.max(1) {
            let (f, w) = spawn(schedule, cache)?;
            first.push(f);
            warm.push(w);
        }
        let (f, w) = (median(first), median(warm));
        println!("{name:<26} {f:>10.3} {w:>10.3} {:>7.1}x", f / w);
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
