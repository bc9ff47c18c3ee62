//! The machine and the process: the bottom room, beside `error`, that
//! every layer may read and none below the crate's root writes.
//!
//! It holds what the process and the machine say, each read in one place:
//!
//! * [`Machine`]: the kernel path and the memory limit a call runs under,
//!   resolved once from a transform's options ([`Machine::resolve`]) and
//!   carried down in the resolved options, the executable and a prepared
//!   graph, so that no layer reads a setting of its own;
//! * the variables the crate reads (`vars`);
//! * the `/proc` readers: the machine's memory, the process's resident
//!   memory, the CPU's name (`memory`);
//! * the guards before a host allocation sized from user input (`host`);
//! * the process-wide random stream (`seed`) and glibc's malloc tuning
//!   (`malloc`).
//!
//! ## What "the machine's memory" means
//!
//! One meaning at trace time: a caller's limit where one is set, else the
//! memory the machine had available when the process first asked
//! (`MemAvailable`, read once per process). A `vmap`'s chunks, a scan's
//! checkpoints and a Jacobian's basis are planned against it, so a cached
//! graph never depends on how busy the machine was when it was traced.
//! A run checks its plan against the limit, else against what is
//! available then ([`Machine::fits`]): that check is about the moment, so
//! it reads the moment.

mod host;
mod malloc;
mod memory;
mod seed;
mod vars;

pub(crate) use host::{check_host_alloc, check_host_shape, checked_elems, host_vec};
pub(crate) use malloc::keep as keep_freed;
pub(crate) use memory::{cpu_name, process_alive, resident_memory, resident_now};
pub(crate) use seed::{manual_seed, mix, process_seed};
pub(crate) use vars::{auto_cache_var, route_var};
pub use vars::{AUTO_CACHE_ENV, PORTABLE_ENV, ROUTE_ENV};

use std::sync::OnceLock;

/// Which implementation a run's operations take: the crate's CPU kernels
/// where they apply, or candle's operations only — the path every other
/// device takes, which the CPU takes too when asked
/// (`Options::portable`, `CANDLE_FUNC_PORTABLE=1`) so that tests check
/// that path on every commit. The caller says which: no kernel reads a
/// setting of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) enum Path {
    /// The crate's kernels where they apply.
    #[default]
    Fast,
    /// candle's operations only.
    Portable,
}

impl Path {
    /// `portable` where given, else the variable's (read once per process).
    pub(crate) fn resolve(portable: Option<bool>) -> Path {
        match portable.unwrap_or_else(vars::portable_var) {
            true => Path::Portable,
            false => Path::Fast,
        }
    }
}

/// Below this planned peak a run does not read the machine's available
/// memory (a file read per call would cost more than a small program).
const UNCHECKED_BYTES: usize = 256 << 20;

/// What a call runs on: the kernel path and the caller's memory limit,
/// resolved once from its options and carried, never read again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Machine {
    /// The kernels the run takes.
    pub(crate) path: Path,
    /// The most bytes a call may hold, where the caller set it (`None`:
    /// the machine's memory, in the module's one meaning).
    pub(crate) limit: Option<usize>,
}

impl Machine {
    /// The machine a call with these settings runs on: `portable` where
    /// given, else the `CANDLE_FUNC_PORTABLE` variable; the limit as given.
    pub(crate) fn resolve(portable: Option<bool>, limit: Option<usize>) -> Machine {
        Machine {
            path: Path::resolve(portable),
            limit,
        }
    }

    /// The bytes a graph is planned for while it is traced: the limit,
    /// else the memory available when the process first asked (`None`
    /// where it cannot be read).
    pub(crate) fn trace_bytes(&self) -> Option<usize> {
        self.limit.or_else(|| {
            static FIRST: OnceLock<Option<usize>> = OnceLock::new();
            *FIRST.get_or_init(memory::available)
        })
    }

    /// Whether a plan needing `needed` bytes fits [`Machine::trace_bytes`].
    pub(crate) fn plan_fits(&self, needed: usize) -> bool {
        self.trace_bytes().is_none_or(|l| needed <= l)
    }

    /// Whether a run whose plan needs `needed` bytes may start: within the
    /// limit, else within the memory available now (read only for a plan
    /// above `UNCHECKED_BYTES`; no bound where it cannot be read).
    pub(crate) fn fits(&self, needed: usize) -> bool {
        match self.limit {
            Some(l) => needed <= l,
            None if needed < UNCHECKED_BYTES => true,
            None => memory::available().is_none_or(|l| needed <= l),
        }
    }

    /// The bound [`Machine::fits`] checked, for its error (`usize::MAX`
    /// where none could be read).
    pub(crate) fn run_bound(&self) -> usize {
        self.limit.or_else(memory::available).unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_limit_is_the_one_bound() {
        let m = Machine::resolve(Some(true), Some(1000));
        assert_eq!(m.path, Path::Portable);
        assert!(m.fits(1000) && !m.fits(1001));
        assert!(m.plan_fits(1000) && !m.plan_fits(1001));
        assert_eq!((m.trace_bytes(), m.run_bound()), (Some(1000), 1000));
    }

    #[test]
    fn without_a_limit_small_plans_run_unread() {
        let m = Machine::resolve(Some(false), None);
        assert_eq!(m.path, Path::Fast);
        assert!(m.fits(UNCHECKED_BYTES - 1));
        // the trace-time reading is taken once: asked twice, it answers alike
        assert_eq!(m.trace_bytes(), m.trace_bytes());
        assert!(!m.fits(usize::MAX) || memory::available().is_none());
    }
}
