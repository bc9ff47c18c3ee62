//! The process-wide random stream: the seed of every run of a transform
//! without a seed of its own, and the mixing that derives a node's, an
//! example's or a step's seed from a run's.

use std::sync::atomic::{AtomicU64, Ordering};

/// The stream's seed and the draws taken from it.
static SEED: AtomicU64 = AtomicU64::new(0x5eed);
static DRAWS: AtomicU64 = AtomicU64::new(0);

/// Seeds the process-wide random stream (see `crate::manual_seed`): the
/// runs after this call draw the same sequence of seeds.
pub(crate) fn manual_seed(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    DRAWS.store(0, Ordering::Relaxed);
}

/// The seed of the next run drawing from the process-wide stream.
pub(crate) fn process_seed() -> u64 {
    mix(SEED.load(Ordering::Relaxed), DRAWS.fetch_add(1, Ordering::Relaxed))
}

/// splitmix64's finaliser: a well-mixed seed for each node (and each
/// example or step of a body) from the run's seed.
pub(crate) fn mix(seed: u64, k: u64) -> u64 {
    let mut z = seed ^ k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
