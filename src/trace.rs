//! Symbolic tensors: what a traced closure receives.
//!
//! A [`Tracer`] stands for a tensor while a function is traced: it carries a
//! shape and dtype and appends one node per operation to its builder
//! (`crate::rules::Builder`). A closure may read a tracer of an outer trace
//! (`vmap(|y| x.add(&y))` inside another transform): the builder captures it
//! as an extra, unbatched input of the inner graph.

use crate::error::Result;
use crate::ir::{Prim, TensorType, VarId};
use crate::rules::{BuilderRef, Outer};
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
