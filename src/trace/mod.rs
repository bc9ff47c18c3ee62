//! Tracing: the room where a function becomes a graph.
//!
//! * [`Tracer`] (here): the symbolic tensor a traced closure receives. It
//!   carries a shape and dtype and appends one node per operation to its
//!   builder. A closure may read a tracer of an outer trace
//!   (`vmap(|y| x.add(&y))` inside another transform): the builder
//!   captures it as an extra, unbatched input of the inner graph.
//! * `builder`: the graph under construction (`Builder`), what the
//!   builders of one top-level trace share (`TraceCtx`, with the rules'
//!   type inference handed down), and the emitting helpers the rules
//!   write their batched and derivative computations with.
//! * `stack`: the traces active on this thread and their ids.
//! * `nested`: the entry of a top-level trace and the one routine that
//!   traces a function in a trace nested in another, which the
//!   transforms and the control-flow binders both call.
//!
//! The room sits below the rules (which emit into its builders) and above
//! the IR; the transforms' signature-keyed entry (`transforms::call`)
//! drives it.

mod builder;
mod nested;
mod stack;

pub(crate) use builder::{Builder, BuilderRef, Outer, TraceCtx};
pub(crate) use nested::{nested_builder, top_builder, trace_in};
pub(crate) use stack::{innermost, innermost_active, next_builder_id, tracing};

use crate::error::Result;
use crate::ir::{Prim, TensorType, VarId};
use candle_core::{DType, Tensor};
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A symbolic tensor: what a traced closure receives instead of a candle
/// `Tensor`. Operations on it are recorded, not computed; they check shapes
/// and dtypes at once and return `Result`.
#[derive(Clone)]
pub struct Tracer {
    pub(crate) b: BuilderRef,
    pub(crate) bid: u64,
    pub(crate) id: VarId,
    pub(crate) ty: TensorType,
}

impl fmt::Debug for Tracer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tracer(%{}: {:?}{:?})", self.id, self.ty.dtype, self.ty.shape)
    }
}

impl Tracer {
    pub(crate) fn new(b: &BuilderRef, id: VarId) -> Tracer {
        let (bid, ty) = {
            let bb = b.borrow();
            (bb.id, bb.ty(id).clone())
        };
        Tracer {
            b: b.clone(),
            bid,
            id,
            ty,
        }
    }

    /// The device of the trace this value belongs to (where the traced
    /// function runs): the device to make constants on inside a trace.
    pub fn device(&self) -> candle_core::Device {
        self.b.borrow().ctx.device.clone()
    }

    /// This value as the builders see it.
    pub(crate) fn outer(&self) -> Outer {
        Outer {
            bid: self.bid,
            id: self.id,
            ty: self.ty.clone(),
        }
    }

    /// Reads a train/eval flag at trace time; the graph cache remembers the
    /// value, so a cached graph is reused only while the flag holds it.
    pub(crate) fn read_mode(&self, flag: &Arc<AtomicBool>) -> bool {
        let ctx = self.b.borrow().ctx.clone();
        ctx.read_mode(flag)
    }

    /// Whether this value is traced as one example of a `vmap`'s batch.
    pub(crate) fn in_vmap(&self) -> bool {
        self.b.borrow().batched
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.ty.shape
    }

    /// The shape as a candle `Shape`.
    pub fn shape(&self) -> candle_core::Shape {
        candle_core::Shape::from(self.ty.shape.clone())
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.ty.rank()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.ty.elem_count()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// Shape and dtype.
    pub fn tensor_type(&self) -> &TensorType {
        &self.ty
    }

    /// Records `prim(self, others..)` into the innermost builder among the
    /// operands (outer operands are captured into it).
    pub(crate) fn emit(&self, prim: Prim, others: &[&Tracer]) -> Result<Tracer> {
        let mut target = self;
        for o in others {
            if o.b.borrow().ancestors.len() > target.b.borrow().ancestors.len() {
                target = o;
            }
        }
        let b = target.b.clone();
        let id = {
            let mut bb = b.borrow_mut();
            let mut args = vec![bb.lift(&self.outer())?];
            for o in others {
                args.push(bb.lift(&o.outer())?);
            }
            bb.emit(prim, &args)?
        };
        Ok(Tracer::new(&b, id))
    }
}

/// Something that can stand as an operand beside a tracer: another tracer,
/// a candle tensor (captured as a constant), or a scalar (a literal of the
/// tracer's dtype).
pub trait Operand {
    /// This operand as a tracer in `like`'s trace.
    fn to_tracer(&self, like: &Tracer) -> Result<Tracer>;
    /// Whether this is a scalar literal, whose dtype comes from `like`.
    fn is_literal(&self) -> bool {
        false
    }
}

impl Operand for Tracer {
    fn to_tracer(&self, _like: &Tracer) -> Result<Tracer> {
        Ok(self.clone())
    }
}

impl Operand for Tensor {
    fn to_tracer(&self, like: &Tracer) -> Result<Tracer> {
        let id = like.b.borrow_mut().constant(self);
        Ok(Tracer::new(&like.b, id))
    }
}

impl Operand for f64 {
    fn to_tracer(&self, like: &Tracer) -> Result<Tracer> {
        let id = like.b.borrow_mut().scalar(*self, like.dtype());
        Ok(Tracer::new(&like.b, id))
    }
    fn is_literal(&self) -> bool {
        true
    }
}

impl Operand for f32 {
    fn to_tracer(&self, like: &Tracer) -> Result<Tracer> {
        (*self as f64).to_tracer(like)
    }
    fn is_literal(&self) -> bool {
        true
    }
}

impl<T: Operand + ?Sized> Operand for &T {
    fn to_tracer(&self, like: &Tracer) -> Result<Tracer> {
        (**self).to_tracer(like)
    }
    fn is_literal(&self) -> bool {
        (**self).is_literal()
    }
}
