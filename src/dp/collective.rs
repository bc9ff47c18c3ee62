//! Data-parallel DP-SGD: one logical step spread over several processes.
//!
//! [`PrivateTrainer::distributed`](super::PrivateTrainer::distributed)
//! gives a trainer a [`Collective`] (with the `mpi` feature,
//! `dp::mpi::MpiCollective` over an MPI communicator).
//! Every rank holds the whole data set; rank 0's initial parameters are
//! broadcast to the others when the trainer is made distributed (as
//! PyTorch's DistributedDataParallel does), and each step then runs as
//! follows.
//!
//! 1. **Sampling.** Rank 0 draws the logical batch from its generator,
//!    one Bernoulli(`q`) per example of the whole data set with the global
//!    sample rate `q`, exactly as one process would, and broadcasts the
//!    members' indices. Rank `r` of `W` takes the members `i` with
//!    `i mod W = r` (a partition of the data set fixed before any
//!    sampling). The batch is therefore the same Poisson sample of the
//!    whole data set that one process draws: every example is in it
//!    independently with probability `q`, whatever `W` is and however the
//!    members fall to ranks, so the amplification by subsampling the
//!    accountant assumes holds unchanged. (Independent draws on each rank
//!    over its own part would be Poisson too; drawing on one rank keeps the
//!    one generator's stream, so a seeded run of one process reproduces a
//!    run over any number of ranks exactly.)
//! 2. **Clipping.** Each rank clips its members' gradients (ghost or
//!    materialised) in passes of the physical batch and sums them.
//! 3. **Noise, once.** Rank 0 adds the Gaussian noise (from its secure
//!    generator, four draws a coordinate) to its own sum *before* the sums
//!    are all-reduced, so the all-reduced total carries exactly one draw
//!    of noise, `N(0, σ² C²)` per coordinate, as in one process, and no
//!    separate broadcast of the noise is needed. Splitting the noise into
//!    `W` shares of variance `σ² C² / W` would give the same total
//!    variance, but then a rank that leaves out or learns its share
//!    changes the guarantee, and the run could not match one process's.
//! 4. **All-reduce.** One sum over ranks of the flattened sums (one buffer
//!    per dtype, plus the losses and the clipped count): the bytes a step
//!    moves are the model's size. Every rank then divides by `q N` and
//!    steps its own optimiser on identical gradients.
//! 5. **Accounting.** Every rank's accountant is stepped with the global
//!    `σ` and `q`, once per logical step, so every rank reports the same ε.
//! 6. **In step.** After each update the ranks compare a 64-bit hash of
//!    their parameters' bits; any difference is an error naming the ranks.
//!    Identical inputs give identical updates, so a difference means a
//!    rank's parameters were changed outside the step, or its arithmetic
//!    differs (another build or CPU).
//!
//! On GPUs the same design maps to NCCL through candle's `cudarc`: an
//! `ncclBroadcast` of the indices, an `ncclAllReduce` of the flattened
//! sums on the device (no copy to the host), one communicator per device.
//! Implementing [`Collective`] over it is what that would take; no GPU was
//! available to test it.

pub use crate::error::CollectiveFailure;
use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// The collective operations a distributed DP step needs, over the ranks
/// `0..size()` of one group. Every rank must call them in the same order.
pub trait Collective {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// How many ranks take part.
    fn size(&self) -> usize;
    /// Rank 0's `data` on every rank (its length too).
    fn broadcast_u64(&self, data: &mut Vec<u64>) -> Result<()>;
    /// Rank 0's `data` on every rank (the same length on every rank).
    fn broadcast_f64(&self, data: &mut [f64]) -> Result<()>;
    /// The elementwise sum over ranks, in place on every rank.
    fn all_reduce_sum_f32(&self, data: &mut [f32]) -> Result<()>;
    /// The elementwise sum over ranks, in place on every rank.
    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()>;
    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>>;
}

/// The members of `batch` that rank `rank` of `size` clips.
pub(crate) fn shard(batch: &[usize], rank: usize, size: usize) -> Vec<usize> {
    batch.iter().copied().filter(|&i| i % size == rank).collect()
}

/// The logical batch on every rank: rank 0's `draw()`, broadcast.
pub(crate) fn broadcast_batch(comm: &dyn Collective, draw: impl FnOnce() -> Vec<usize>) -> Result<Vec<usize>> {
    let mut ids: Vec<u64> = if comm.rank() == 0 {
        draw().into_iter().map(|i| i as u64).collect()
    } else {
        Vec::new()
    };
    comm.broadcast_u64(&mut ids)?;
    ids.into_iter()
        .map(|i| {
            usize::try_from(i).map_err(|_| {
                let msg = format!("example index {i} from rank 0 exceeds usize");
                failed(comm, CollectiveFailure::Invalid { msg })
            })
        })
        .collect()
}

/// `sums` added over ranks, with `extra` (the losses and counts) in the
/// same f64 all-reduce: one collective per dtype.
pub(crate) fn reduce_sums(
    comm: &dyn Collective,
    sums: BTreeMap<String, Tensor>,
    extra: &mut [f64],
) -> Result<BTreeMap<String, Tensor>> {
    let mut f32s: Vec<f32> = Vec::new();
    let mut f64s: Vec<f64> = Vec::new();
    for (k, t) in &sums {
        let flat = t.flatten_all()?;
        match t.dtype() {
            DType::F32 => f32s.extend(flat.to_vec1::<f32>()?),
            DType::F64 => f64s.extend(flat.to_vec1::<f64>()?),
            dt => {
                let msg = format!("parameter {k:?} is {dt:?}; only f32 and f64 are all-reduced");
                return Err(Error::data("distributed step", msg));
            }
        }
    }
    f64s.extend_from_slice(extra);
    if !f32s.is_empty() {
        comm.all_reduce_sum_f32(&mut f32s)?;
    }
    comm.all_reduce_sum_f64(&mut f64s)?;
    extra.copy_from_slice(&f64s[f64s.len() - extra.len()..]);
    let (mut at32, mut at64) = (0usize, 0usize);
    sums.into_iter()
        .map(|(k, t)| {
            let n = t.elem_count();
            let back = match t.dtype() {
                DType::F32 => {
                    at32 += n;
                    Tensor::from_slice(&f32s[at32 - n..at32], t.dims(), t.device())?
                }
                _ => {
                    at64 += n;
                    Tensor::from_slice(&f64s[at64 - n..at64], t.dims(), t.device())?
                }
            };
            Ok((k, back))
        })
        .collect()
}

/// Rank 0's values of `vars` on every rank, as DistributedDataParallel
/// broadcasts a module's state when it wraps it: ranks that initialised
/// their models from their own random streams start from one model. f32
/// and f64 values travel as f64, exactly.
pub(crate) fn broadcast_vars(comm: &dyn Collective, vars: &BTreeMap<String, candle_core::Var>) -> Result<()> {
    let mut flat: Vec<f64> = Vec::new();
    for t in vars.values() {
        flat.extend(t.as_tensor().flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?);
    }
    comm.broadcast_f64(&mut flat)?;
    let mut at = 0;
    for v in vars.values() {
        let n = v.elem_count();
        let t = Tensor::from_slice(&flat[at..at + n], v.dims(), v.device())?.to_dtype(v.dtype())?;
        v.set(&t)?;
        at += n;
    }
    Ok(())
}

/// A word-at-a-time hash (FxHash's mixing step), fast enough to run over
/// the parameters every step.
#[derive(Default)]
struct Hasher(u64);

impl Hasher {
    fn word(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn bytes(&mut self, b: &[u8]) {
        b.chunks(8).for_each(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.word(u64::from_le_bytes(w));
        });
    }

    /// A tensor's shape and dtype.
    fn header(&mut self, t: &Tensor) {
        t.dims().iter().for_each(|&d| self.word(d as u64));
        self.bytes(t.dtype().as_str().as_bytes());
    }

    /// A tensor's shape, dtype and values' bits (f32 and f64 natively,
    /// anything else through f64).
    fn tensor(&mut self, t: &Tensor) -> Result<()> {
        self.header(t);
        let flat = t.flatten_all()?;
        match t.dtype() {
            DType::F32 => flat
                .to_vec1::<f32>()?
                .iter()
                .for_each(|v| self.word(v.to_bits() as u64)),
            _ => flat
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?
                .iter()
                .for_each(|v| self.word(v.to_bits())),
        }
        Ok(())
    }
}

/// A hash of the named tensors: names, shapes, dtypes and bits.
fn tree_hash<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<u64> {
    let mut h = Hasher::default();
    for (k, t) in tensors {
        h.bytes(k.as_bytes());
        h.tensor(t)?;
    }
    Ok(h.0)
}

/// An error unless every rank has the same data set (each example tensor
/// by its path in the examples' tree), the
/// same parameter names, shapes and dtypes, and f32/f64 parameters only
/// (what the all-reduce carries): checked once, before anything is
/// broadcast, since ranks that disagree on sizes would pair collectives
/// of different lengths.
pub(crate) fn check_same_setup(
    comm: &dyn Collective,
    params: &BTreeMap<String, Tensor>,
    data: &[(String, Tensor)],
) -> Result<()> {
    if let Some((k, t)) = params
        .iter()
        .find(|(_, t)| !matches!(t.dtype(), DType::F32 | DType::F64))
    {
        let msg = format!(
            "parameter {k:?} is {:?}; only f32 and f64 parameters are all-reduced",
            t.dtype()
        );
        return Err(Error::data("distributed", msg));
    }
    let mut h = Hasher::default();
    for (k, t) in params {
        h.bytes(k.as_bytes());
        h.header(t);
    }
    h.word(tree_hash(data.iter().map(|(k, t)| (k.as_str(), t)))?);
    let (differ, _) = differing(comm, h.0)?;
    if differ.is_empty() {
        return Ok(());
    }
    let dims: Vec<(&str, &[usize])> = data.iter().map(|(k, t)| (k.as_str(), t.dims())).collect();
    let here = format!("examples {dims:?}, {} parameters here", params.len());
    Err(failed(comm, CollectiveFailure::Setup { ranks: differ, here }))
}

/// `failure` on this rank of `comm`.
pub(crate) fn failed(comm: &dyn Collective, failure: CollectiveFailure) -> Error {
    Error::Collective {
        rank: comm.rank(),
        ranks: comm.size(),
        failure,
    }
}

/// The ranks whose `hash` differs from rank 0's, and every rank's hash.
fn differing(comm: &dyn Collective, hash: u64) -> Result<(Vec<usize>, Vec<u64>)> {
    let hashes = comm.all_gather_u64(hash)?;
    let differ = (0..hashes.len()).filter(|&r| hashes[r] != hashes[0]).collect();
    Ok((differ, hashes))
}

/// An error unless every rank holds the same parameters, bit for bit.
pub(crate) fn check_in_step(comm: &dyn Collective, params: &BTreeMap<String, Tensor>, when: &str) -> Result<()> {
    let (differ, hashes) = differing(comm, tree_hash(params.iter().map(|(k, t)| (k.as_str(), t)))?)?;
    if differ.is_empty() {
        return Ok(());
    }
    let when = when.to_string();
    Err(failed(
        comm,
        CollectiveFailure::Drift {
            ranks: differ,
            when,
            hashes,
        },
    ))
}
