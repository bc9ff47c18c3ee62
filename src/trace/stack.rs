//! The trace stack: builder ids, the traces active on this thread
//! (innermost last), and finding the innermost among some tracers.

use super::{BuilderRef, Tracer};
use std::sync::atomic::{AtomicU64, Ordering};

/// A process-unique id for a new trace's builder (0 is left to the
/// rules' scratch builders).
pub(crate) fn next_builder_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

thread_local! {
    /// The traces being traced on this thread, innermost last: where a
    /// loop's body is traced, so that it may read any of them (JAX's trace
    /// stack).
    static ACTIVE: std::cell::RefCell<Vec<BuilderRef>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` (which traces into `b`) with `b` the innermost active trace;
/// the stack is restored when `f` returns or unwinds.
pub(crate) fn tracing<T>(b: &BuilderRef, f: impl FnOnce() -> T) -> T {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            ACTIVE.with(|a| a.borrow_mut().pop());
        }
    }
    ACTIVE.with(|a| a.borrow_mut().push(b.clone()));
    let _pop = Pop;
    f()
}

/// The innermost trace being traced on this thread, if any.
pub(crate) fn innermost_active() -> Option<BuilderRef> {
    ACTIVE.with(|a| a.borrow().last().cloned())
}

/// The innermost builder among the leaves (all must belong to one chain of
/// nested traces).
pub(crate) fn innermost(leaves: &[Vec<Tracer>]) -> Option<BuilderRef> {
    leaves
        .iter()
        .flatten()
        .max_by_key(|t| t.b.borrow().ancestors.len())
        .map(|t| t.b.clone())
}
