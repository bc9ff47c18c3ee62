//! The entry of a trace and the one routine that traces a function into a
//! builder: a top-level trace's (a transform called on tensors) or a
//! nested one's (a transform inside a trace, a loop's body, a branch).

use super::builder::Infer;
use super::{tracing, Builder, BuilderRef, Outer, TraceCtx, Tracer};
use crate::error::Result;
use crate::ir::options::Options;
use crate::ir::{Graph, TensorType};
use candle_core::Device;
use std::rc::Rc;

/// The root builder of a top-level trace on `device` (a transform called
/// on tensors), with the outermost transform's options `given` (its seed
/// offered to the run), and what its builders share. A top-level trace
/// has no enclosing one, so nothing can be captured.
pub(crate) fn top_builder(
    device: &Device,
    given: Options,
    differentiated: bool,
    infer: Infer,
) -> (BuilderRef, Rc<TraceCtx>) {
    let ctx = TraceCtx::new(device.clone(), infer);
    ctx.offer_seed(given.seed);
    let root = Builder::root(super::next_builder_id(), given, ctx.clone());
    root.borrow_mut().differentiated = differentiated;
    (root, ctx)
}

/// A builder for a trace nested in `outer`'s, by a transform (or a loop's
/// body) with the options `given`, differentiating or batching what it
/// traces where `outer` does or the flags say.
pub(crate) fn nested_builder(
    outer: &BuilderRef,
    given: Options,
    (differentiated, batched): (bool, bool),
) -> BuilderRef {
    let b = Builder::child(outer, super::next_builder_id(), given);
    b.borrow_mut().differentiated |= differentiated;
    b.borrow_mut().batched |= batched;
    b
}

/// Traces `f` into the fresh builder `b` on symbolic inputs of `types`,
/// with `b` the innermost active trace while it runs: the graph (an
/// output per value `f` gives), the outer values it captured, and what
/// else `f` returned.
pub(crate) fn trace_in<R>(
    b: &BuilderRef,
    types: &[TensorType],
    f: impl FnOnce(Vec<Tracer>) -> Result<(Vec<Tracer>, R)>,
) -> Result<(Graph, Vec<Outer>, R)> {
    let ins: Vec<Tracer> = types
        .iter()
        .map(|ty| {
            let id = b.borrow_mut().input(ty.clone());
            Tracer::new(b, id)
        })
        .collect();
    let (outs, rest) = tracing(b, || f(ins))?;
    let mut bb = b.borrow_mut();
    let ids = outs.iter().map(|o| bb.lift(&o.outer())).collect::<Result<Vec<_>>>()?;
    let (g, captures) = bb.finish(ids);
    Ok((g, captures, rest))
}
