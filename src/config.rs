//! Process-wide settings other than the conv route, and once-only warnings.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static STRICT: AtomicBool = AtomicBool::new(false);
static MODE_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts changes of trace-time state that is not in a call's arguments
/// (a layer switched between training and evaluation): part of the graph
/// cache key, so a cached graph never outlives the mode it was traced in.
pub(crate) fn bump_mode_epoch() {
    MODE_EPOCH.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn mode_epoch() -> u64 {
    MODE_EPOCH.load(Ordering::Relaxed)
}
static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Process-wide strict mode: when on, `vmap` refuses to batch a primitive
/// with the per-example loop fallback and returns an error instead of a
/// warning. A transform's own `.strict(..)` wins.
pub fn set_strict(on: bool) {
    STRICT.store(on, Ordering::Relaxed);
}

/// Whether process-wide strict mode is on.
pub fn strict() -> bool {
    STRICT.load(Ordering::Relaxed)
}

/// Logs `msg` as a warning the first time `key` is seen in this process.
/// Returns whether it was logged.
pub(crate) fn warn_once(key: String, msg: String) -> bool {
    let mut guard = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    let first = guard.get_or_insert_with(HashSet::new).insert(key);
    if first {
        log::warn!("{msg}");
    }
    first
}

/// Whether a warning with this key has been given (for tests).
pub fn warned(key: &str) -> bool {
    let guard = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    guard.as_ref().is_some_and(|s| s.contains(key))
}
