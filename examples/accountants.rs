//! The accountants side by side: ε and the time to compute it for PLD,
//! PRV and RDP on DP-SGD runs from a few steps to 20,000, Poisson and
//! fixed-size batches (without replacement, replace one: PLD and RDP). The figures behind the choice of default.
//!
//!     cargo run --release --example accountants
//!
//! Each time is the median of three fresh computations (nothing cached).

use candle_func::dp::accountant::{Accountant, Mechanism, Sampling};
use std::time::Instant;

fn measure(acc: &Accountant, delta: f64) -> (String, f64) {
    let mut times = Vec::new();
    let mut eps = String::new();
    for _ in 0..3 {
        let t = Instant::now();
        eps = match acc.epsilon(delta) {
            Ok(e) => format!("{e:.4}"),
            Err(_) => "-".into(),
        };
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    (eps, times[1])
}

fn main() -> candle_func::Result<()> {
    let delta = 1e-5;
    // (label, sigma, q, steps); the first is the digits example's defaults:
    // 1,437 training examples, expected batch 64, 30 epochs
    let runs = [
        ("digits example", 1.0, 64.0 / 1437.0, 30 * 22),
        ("q 0.01, sigma 1.1", 1.1, 0.01, 1000),
        ("q 0.004, sigma 0.8", 0.8, 0.004, 20_000),
        ("q 0.001, sigma 2", 2.0, 0.001, 10),
        ("q 0.05, sigma 1.5", 1.5, 0.05, 2000),
    ];
    println!(
        "delta {delta:e}; time in ms (median of 3) on {} threads",
        rayon::current_num_threads()
    );
    println!(
        "{:<22} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>12} {:>9} {:>12} {:>9}",
        "run", "PLD eps", "ms", "PRV eps", "ms", "RDP eps", "ms", "PLD-wor eps", "ms", "RDP-wor eps", "ms"
    );
    for (label, sigma, q, steps) in runs {
        let mut row = format!("{label:<22}");
        for (mechanism, sampling) in [
            (Mechanism::Pld, Sampling::Poisson),
            (Mechanism::Prv, Sampling::Poisson),
            (Mechanism::Rdp, Sampling::Poisson),
            (Mechanism::Pld, Sampling::WithoutReplacement),
            (Mechanism::Rdp, Sampling::WithoutReplacement),
        ] {
            let mut acc = Accountant::new(mechanism).with_sampling(sampling)?;
            acc.record(sigma, q, steps)?;
            let (eps, ms) = measure(&acc, delta);
            row += &format!(" {eps:>10} {ms:>9.1}");
        }
        println!("{row}");
    }
    Ok(())
}
