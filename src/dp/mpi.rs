//! [`Collective`] over MPI (the `mpi` crate, rsmpi), for data-parallel
//! DP-SGD across processes and hosts: see [`super::collective`].
//!
//! Every collective is issued non-blocking and polled against a deadline
//! ([`MpiCollective::timeout`], 300 s by default). A rank that dies makes
//! `mpirun` end the job when it exits non-zero; one that hangs, or dies
//! where the launcher does not notice, leaves the others waiting in a
//! collective, and the deadline turns that wait into an error. MPI cannot
//! cancel a collective once issued (its buffers stay lent to the library),
//! so on the deadline the rank prints the error and calls `MPI_Abort`,
//! which ends every rank of the job with a non-zero status.
//!
//! A panic would hang the job too: unwinding drops rsmpi's `Universe`,
//! whose `MPI_Finalize` waits for the ranks still in a collective.
//! [`abort_job_on_panic`] installs a panic hook that, after the usual
//! message, aborts the whole job; a program calls it once after
//! initialising MPI (it is not installed for you, since it also ends the
//! job on panics a program catches). A program should treat an error from
//! `main` the same way (print it, then `world.abort(code)`), as
//! `examples/dp_sgd_mpi.rs` does: returning it finalises MPI while the
//! other ranks wait. An error from a distributed step is returned on every
//! rank together, so ranks do not wait on each other for one.
//!
//! Initialise MPI with `mpi::initialize_with_threading(Threading::Funneled)`:
//! the kernels run on a thread pool, though only the calling thread talks
//! to MPI.

use super::collective::Collective;
use crate::error::{CollectiveFailure, Error, Result};
use mpi::collective::SystemOperation;
use mpi::request::{scope, Request, Scope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::time::{Duration, Instant};

/// An MPI communicator with a deadline on each collective.
pub struct MpiCollective {
    world: SimpleCommunicator,
    timeout: Duration,
}

impl MpiCollective {
    /// The collectives of `world` (say `universe.world()`), each allowed
    /// 300 s.
    pub fn new(world: SimpleCommunicator) -> MpiCollective {
        MpiCollective {
            world,
            timeout: Duration::from_secs(300),
        }
    }

    /// How long one collective may wait for the other ranks before this
    /// rank aborts the job.
    pub fn timeout(mut self, timeout: Duration) -> MpiCollective {
        self.timeout = timeout;
        self
    }

    /// Polls `req` until it completes, or prints the error and aborts the
    /// job at the deadline.
    fn finish<'a, D: ?Sized, S: Scope<'a>>(&self, op: &str, mut req: Request<'a, D, S>) {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            if start.elapsed() > self.timeout {
                let e = Error::Collective {
                    rank: self.world.rank() as usize,
                    ranks: self.world.size() as usize,
                    failure: CollectiveFailure::Timeout {
                        op: op.to_string(),
                        waited: self.timeout,
                    },
                };
                eprintln!("{e}");
                self.world.abort(70);
            }
            // spin briefly (a collective is usually microseconds), then sleep
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

/// Chains a panic hook that ends every rank of the job (`MPI_Abort`)
/// after the previous hook's message, instead of unwinding into a
/// `MPI_Finalize` that waits for the other ranks forever. Call it once,
/// after initialising MPI; a panic before that, or after finalising,
/// unwinds as usual.
pub fn abort_job_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
            // SAFETY: MPI is initialised and not finalised (checked just
            // above), which is MPI_Abort's only precondition; the
            // communicator is MPI_COMM_WORLD, a constant of the library,
            // and MPI_Abort does not return on success. rsmpi offers abort
            // only on a communicator object, which a 'static hook cannot
            // hold. Exercised by tests/mpi.rs (`panic` mode).
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
            }
        }
    }));
}

impl MpiCollective {
    /// Rank 0's `data` on every rank, in place (the same length on every rank).
    fn broadcast<T: Equivalence>(&self, data: &mut [T]) {
        let root = self.world.process_at_rank(0);
        scope(|s| self.finish("broadcast", root.immediate_broadcast_into(s, data)));
    }

    /// The elementwise sum over ranks of `data`, in place.
    fn all_reduce_sum<T: Equivalence + Copy>(&self, data: &mut [T]) -> Result<()> {
        let send = data.to_vec();
        scope(|s| {
            let req = self
                .world
                .immediate_all_reduce_into(s, &send[..], data, SystemOperation::sum());
            self.finish("all_reduce", req)
        });
        Ok(())
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn broadcast_u64(&self, data: &mut Vec<u64>) -> Result<()> {
        let mut len = [data.len() as u64];
        self.broadcast(&mut len[..]);
        let len = usize::try_from(len[0]).map_err(|_| {
            let msg = format!("a broadcast of {} values exceeds usize", len[0]);
            super::collective::failed(self, CollectiveFailure::Invalid { msg })
        })?;
        data.resize(len, 0);
        self.broadcast(&mut data[..]);
        Ok(())
    }

    fn broadcast_f64(&self, data: &mut [f64]) -> Result<()> {
        self.broadcast(data);
        Ok(())
    }

    fn all_reduce_sum_f32(&self, data: &mut [f32]) -> Result<()> {
        self.all_reduce_sum(data)
    }

    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()> {
        self.all_reduce_sum(data)
    }

    fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        let mut out = vec![0u64; self.size()];
        scope(|s| {
            let req = self.world.immediate_all_gather_into(s, &value, &mut out[..]);
            self.finish("all_gather", req)
        });
        Ok(out)
    }
}
