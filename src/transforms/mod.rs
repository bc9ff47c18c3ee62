//! Transforms and what they share, a file each: the [`Function`] trait (a
//! traceable function: a closure or another transform, `function.rs`), the
//! per-signature graph cache (`cache.rs`),
//! tracing and calling a traced function on concrete tensors (`call.rs`)
//! and [`jit`] (`jit.rs`); one file per transform beside them. A graph
//! `make_graph` returns runs by the interpreter's own type
//! (`interp::Prepared`).

mod cache;
mod call;
pub(crate) mod dims;
mod function;
pub(crate) mod grad;
pub(crate) mod jacobian;
mod jit;
pub(crate) mod jvp;
pub(crate) mod planner;
pub(crate) mod schedule;
mod segments;
pub(crate) mod settings;
pub(crate) mod transformed;
pub(crate) mod tree;
pub(crate) mod vmap;

pub(crate) use crate::trace::{innermost, next_builder_id};
pub(crate) use cache::{CacheKey, GraphCache, Traced};
pub use call::make_graph;
pub(crate) use call::{call_concrete, flatten_call, planned_peak_of, trace_inner, Call};
pub(crate) use function::ByRef;
pub use function::Function;
pub use jit::{jit, Jit, JitOf};
