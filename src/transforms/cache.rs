//! The per-signature graph cache: what a concrete call is cached under
//! and what it keeps (the traced graph, its compiled executable).

use super::settings;
use super::tree::TreeDef;
use crate::interp::exec::Executable;
use crate::ir::options::{ConvRoute, Options};
use crate::ir::{Graph, TensorType};
use candle_core::DeviceLocation;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a concrete call is cached under: argument structure and types, the
/// device, the outermost transform's options, and the process-wide
/// settings a nested transform may fall back on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey {
    pub(super) defs: Vec<TreeDef>,
    pub(super) types: Vec<TensorType>,
    pub(super) device: DeviceLocation,
    pub(super) given: Options,
    /// The process-wide route, `None` when the environment names none that
    /// parses (a transform with its own route does not need it).
    pub(super) route: Option<ConvRoute>,
    pub(super) strict: bool,
}

/// A function traced and transformed (and simplified) on tensors of one
/// signature, with the train/eval flags its trace read (and their values
/// then) and the seed of the outermost transform in it that has one.
#[derive(Debug)]
pub(crate) struct Traced {
    pub(crate) graph: Graph,
    pub(crate) out_def: TreeDef,
    pub(super) mode_deps: Vec<(Arc<AtomicBool>, bool)>,
    pub(crate) seed: Option<u64>,
}

impl Traced {
    /// Ready to run: the graph through the executable's passes, refused
    /// above `limit`, drawing from the trace's seed counted by `calls`.
    pub(crate) fn compile(self, given: &Options, calls: Arc<AtomicU64>) -> Compiled {
        Compiled {
            exe: Executable::new(&self.graph, given.machine()).seeded(self.seed, calls),
            out_def: self.out_def,
            mode_deps: self.mode_deps,
        }
    }
}

/// A traced function ready to run on tensors of its signature.
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) exe: Executable,
    pub(crate) out_def: TreeDef,
    pub(super) mode_deps: Vec<(Arc<AtomicBool>, bool)>,
}

impl Compiled {
    /// Whether every flag the trace read still has the value it had.
    pub(super) fn current(&self) -> bool {
        self.mode_deps.iter().all(|(f, on)| f.load(Ordering::Relaxed) == *on)
    }
}

/// Traced graphs of one transformed function, per input signature; shared
/// safely between threads. It also counts the function's calls, the
/// stream of a transform with its own seed.
#[derive(Default, Debug)]
pub(crate) struct GraphCache {
    /// Each signature's graph and when it was last used (a `tick`).
    map: Mutex<HashMap<CacheKey, (Arc<Compiled>, u64)>>,
    pub(super) calls: Arc<AtomicU64>,
    tick: AtomicU64,
}

impl GraphCache {
    /// Number of signatures cached (at most `settings::cache_capacity()`).
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The graph cached for `key`, marked as used now.
    pub(super) fn get(&self, key: &CacheKey) -> Option<Arc<Compiled>> {
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get_mut(key).map(|(c, used)| {
            *used = now;
            c.clone()
        })
    }

    /// Caches `c` for `key`, dropping the least recently used signatures
    /// beyond the capacity (a scan: it runs only after a trace, which costs
    /// far more).
    pub(super) fn insert(&self, key: CacheKey, c: Arc<Compiled>) {
        let now = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(key, (c, now));
        while map.len() > settings::cache_capacity() {
            let Some(oldest) = map.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone()) else {
                break;
            };
            map.remove(&oldest);
        }
    }
}
