//! Symbolic tensors and the graph builder they record into.
//!
//! A [`Tracer`] stands for a tensor while a function is traced: it carries a
//! shape and dtype and appends one node per operation to its builder. A
//! builder made for a nested transform remembers its enclosing builders, so
//! a closure may read a tracer of an outer trace (`vmap(|y| x.add(&y))`
//! inside another transform): the outer value is *captured* as an extra,
//! unbatched input of the inner graph, as JAX does for closed-over tracers.

use crate::error::{Error, Result};
use crate::ir::{Graph, Node, Prim, TensorType, VarId};
use candle_core::{DType, Tensor};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_BUILDER: AtomicU64 = AtomicU64::new(1);

/// A graph under construction.
pub(crate) struct Builder {
    pub(crate) id: u64,
    /// Ids of the enclosing builders, outermost first.
    pub(crate) ancestors: Vec<u64>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) inputs: Vec<VarId>,
    pub(crate) consts: Vec<Tensor>,
    const_ids: HashMap<candle_core::TensorId, VarId>,
    /// Outer tracers read by this trace, each bound to an input node of ours.
    pub(crate) captures: Vec<(Tracer, VarId)>,
    capture_ids: HashMap<(u64, VarId), VarId>,
}

pub(crate) type BuilderRef = Rc<RefCell<Builder>>;

impl Builder {
    /// A builder for a top-level trace.
    pub(crate) fn root() -> BuilderRef {
        Self::with_ancestors(Vec::new())
    }

    /// A builder for a trace nested inside `parent`'s.
    pub(crate) fn child(parent: &BuilderRef) -> BuilderRef {
        let p = parent.borrow();
        let mut ancestors = p.ancestors.clone();
        ancestors.push(p.id);
        Self::with_ancestors(ancestors)
    }

    fn with_ancestors(ancestors: Vec<u64>) -> BuilderRef {
        Rc::new(RefCell::new(Builder {
            id: NEXT_BUILDER.fetch_add(1, Ordering::Relaxed),
            ancestors,
            nodes: Vec::new(),
            inputs: Vec::new(),
            consts: Vec::new(),
            const_ids: HashMap::new(),
            captures: Vec::new(),
            capture_ids: HashMap::new(),
        }))
    }

    pub(crate) fn ty(&self, v: VarId) -> &TensorType {
        &self.nodes[v].ty
    }

    pub(crate) fn dims(&self, v: VarId) -> Vec<usize> {
        self.nodes[v].ty.shape.clone()
    }

    fn push(&mut self, prim: Prim, args: Vec<VarId>, ty: TensorType) -> VarId {
        self.nodes.push(Node { prim, args, ty });
        self.nodes.len() - 1
    }

    /// A new graph input of the given type.
    pub(crate) fn input(&mut self, ty: TensorType) -> VarId {
        let k = self.inputs.len();
        let v = self.push(Prim::Input(k), vec![], ty);
        self.inputs.push(v);
        v
    }

    /// A captured candle tensor (deduplicated by tensor identity).
    pub(crate) fn constant(&mut self, t: &Tensor) -> VarId {
        if let Some(&v) = self.const_ids.get(&t.id()) {
            return v;
        }
        let k = self.consts.len();
        self.consts.push(t.clone());
        let v = self.push(Prim::Const(k), vec![], TensorType::of(t));
        self.const_ids.insert(t.id(), v);
        v
    }

    /// A scalar literal of the given dtype.
    pub(crate) fn scalar(&mut self, value: f64, dtype: DType) -> VarId {
        self.push(Prim::Scalar(value), vec![], TensorType::new(vec![], dtype))
    }

    /// Appends `prim(args)`, inferring and checking its type.
    pub(crate) fn emit(&mut self, prim: Prim, args: &[VarId]) -> Result<VarId> {
        let tys: Vec<&TensorType> = args.iter().map(|&a| &self.nodes[a].ty).collect();
        let ty = crate::rules::infer(&prim, &tys)?;
        Ok(self.push(prim, args.to_vec(), ty))
    }

    /// The id of `t` in this builder, capturing it as an extra input when it
    /// belongs to an enclosing trace.
    pub(crate) fn lift(&mut self, t: &Tracer) -> Result<VarId> {
        if t.bid == self.id {
            return Ok(t.id);
        }
        if !self.ancestors.contains(&t.bid) {
            return Err(Error::Trace {
                msg: format!(
                    "a symbolic tensor of shape {:?} was used outside the trace that made it \
                     (it escaped a transformed function, or comes from an unrelated trace)",
                    t.ty.shape
                ),
            });
        }
        if let Some(&v) = self.capture_ids.get(&(t.bid, t.id)) {
            return Ok(v);
        }
        let v = self.input(t.ty.clone());
        self.captures.push((t.clone(), v));
        self.capture_ids.insert((t.bid, t.id), v);
        Ok(v)
    }

    /// Ends the trace: the graph (captured outer values come last among its
    /// inputs) and the outer tracers to bind to those inputs.
    pub(crate) fn finish(&self, outputs: Vec<VarId>) -> (Graph, Vec<Tracer>) {
        let graph = Graph {
            nodes: self.nodes.clone(),
            inputs: self.inputs.clone(),
            outputs,
            consts: self.consts.clone(),
        };
        let captures = self.captures.iter().map(|(t, _)| t.clone()).collect();
        (graph, captures)
    }
}

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
            let mut args = vec![bb.lift(self)?];
            for o in others {
                args.push(bb.lift(o)?);
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
