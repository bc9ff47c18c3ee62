//! A graph under construction, and the helpers rules use to emit into it
//! (the rules write their batched and derivative computations with them).
//! A builder made for a nested transform remembers its enclosing builders,
//! so a traced closure may read a value of an outer trace: the outer value
//! is *captured* as an extra, unbatched input of the inner graph, as JAX does
//! for closed-over tracers.

use crate::error::{Error, Result};
use crate::ir::ops::{Binary, Compare, Reduce, ShapeOp, Unary};
use crate::ir::options::Options;
use crate::ir::{Graph, Node, Prim, TensorType, VarId};
use candle_core::{DType, Device, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A graph under construction.
pub(crate) struct Builder {
    pub(crate) id: u64,
    /// Ids of the enclosing builders, outermost first.
    pub(crate) ancestors: Vec<u64>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) inputs: Vec<VarId>,
    pub(crate) consts: Vec<Tensor>,
    const_ids: HashMap<candle_core::TensorId, VarId>,
    /// Outer values read by this trace, each bound to an input node of ours.
    pub(crate) captures: Vec<(Outer, VarId)>,
    capture_ids: HashMap<(u64, VarId), VarId>,
    /// The options set explicitly by the transform whose trace this is and
    /// by those enclosing it (what a nested transform inherits).
    pub(crate) given: Options,
    /// What every builder of one top-level trace shares.
    pub(crate) ctx: Rc<TraceCtx>,
    /// Whether what is traced here will be differentiated (a trace made by
    /// `grad` or `vjp`, or nested in one).
    pub(crate) differentiated: bool,
    /// Whether what is traced here is one example of a batch (a trace made
    /// by `vmap`, or nested in one): a layer whose output would depend on
    /// the other examples (batch norm in training) refuses to run.
    pub(crate) batched: bool,
}

/// A value of an enclosing trace: its builder's id, the value's id there
/// and its type (what a tracer holds besides the builder itself).
#[derive(Clone)]
pub(crate) struct Outer {
    pub(crate) bid: u64,
    pub(crate) id: VarId,
    pub(crate) ty: TensorType,
}

/// The rules' type inference (`rules::infer`): what a node's type is, given
/// its primitive and operands' types, checked. The trace room sits below
/// the rules, so the rules hand it to each top-level trace, as the
/// interpreter hands the rules a runner of sub-graphs.
pub(crate) type Infer = fn(&Prim, &[&TensorType]) -> Result<TensorType>;

/// What the builders of one top-level trace share: the device the call
/// will run on (where the planner measures), the rules' type inference,
/// the train/eval flags read while tracing (with the values read, so a
/// cached graph is used only while they hold), the notes of loop
/// fallbacks to warn about once the trace ends, and the seed the run
/// draws from.
pub(crate) struct TraceCtx {
    pub(crate) device: Device,
    pub(crate) infer: Infer,
    pub(crate) mode_deps: RefCell<Vec<(Arc<AtomicBool>, bool)>>,
    pub(crate) fallbacks: RefCell<Vec<String>>,
    /// The seed of the outermost transform in the trace that has one: it
    /// seeds the run when the function called on tensors has none.
    pub(crate) seed: Cell<Option<u64>>,
}

impl std::fmt::Debug for TraceCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceCtx")
            .field("device", &self.device)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl TraceCtx {
    pub(crate) fn new(device: Device, infer: Infer) -> Rc<TraceCtx> {
        Rc::new(TraceCtx {
            device,
            infer,
            mode_deps: RefCell::new(Vec::new()),
            fallbacks: RefCell::new(Vec::new()),
            seed: Cell::new(None),
        })
    }

    /// Notes the seed of a transform in the trace (the outermost wins: it
    /// is traced first).
    pub(crate) fn offer_seed(&self, seed: Option<u64>) {
        if self.seed.get().is_none() {
            self.seed.set(seed);
        }
    }

    /// Reads a mode flag, remembering the value for the cache.
    pub(crate) fn read_mode(&self, flag: &Arc<AtomicBool>) -> bool {
        let on = flag.load(Ordering::Relaxed);
        let mut deps = self.mode_deps.borrow_mut();
        if !deps.iter().any(|(f, _)| Arc::ptr_eq(f, flag)) {
            deps.push((flag.clone(), on));
        }
        on
    }
}

pub(crate) type BuilderRef = Rc<RefCell<Builder>>;

impl Builder {
    /// A builder for a top-level trace; `id` is unique in the process
    /// (the transforms allocate it), so a tracer of another trace is told
    /// apart from this one's.
    pub(crate) fn root(id: u64, given: Options, ctx: Rc<TraceCtx>) -> BuilderRef {
        Self::with_ancestors(id, Vec::new(), given, ctx)
    }

    /// A builder for a trace nested inside `parent`'s, by a transform with
    /// the options `given` (already merged with the parent's).
    pub(crate) fn child(parent: &BuilderRef, id: u64, given: Options) -> BuilderRef {
        let p = parent.borrow();
        let mut ancestors = p.ancestors.clone();
        ancestors.push(p.id);
        let b = Self::with_ancestors(id, ancestors, given, p.ctx.clone());
        b.borrow_mut().differentiated = p.differentiated;
        b.borrow_mut().batched = p.batched;
        b
    }

    /// A free-standing builder for a rule's own sub-graph (a map's body, a
    /// candidate lowering) in the context `ctx`. No tracer ever reads it,
    /// so it needs no id of its own (0, which no trace gets) and captures
    /// nothing.
    pub(crate) fn scratch(given: Options, ctx: Rc<TraceCtx>) -> BuilderRef {
        Self::with_ancestors(0, Vec::new(), given, ctx)
    }

    fn with_ancestors(id: u64, ancestors: Vec<u64>, given: Options, ctx: Rc<TraceCtx>) -> BuilderRef {
        Rc::new(RefCell::new(Builder {
            id,
            ancestors,
            nodes: Vec::new(),
            inputs: Vec::new(),
            consts: Vec::new(),
            const_ids: HashMap::new(),
            captures: Vec::new(),
            capture_ids: HashMap::new(),
            given,
            ctx,
            differentiated: false,
            batched: false,
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
        // detached: the graph keeps the value, not candle's history of it
        self.consts.push(t.detach());
        let v = self.push(Prim::Const(k), vec![], TensorType::of(t));
        self.const_ids.insert(t.id(), v);
        v
    }

    /// A scalar literal of the given dtype.
    pub(crate) fn scalar(&mut self, value: f64, dtype: DType) -> VarId {
        self.push(Prim::Scalar(value), vec![], TensorType::new(vec![], dtype))
    }

    /// Appends `prim(args)`, inferring and checking its type. A primitive
    /// with several results goes through [`Builder::emit_many`].
    pub(crate) fn emit(&mut self, prim: Prim, args: &[VarId]) -> Result<VarId> {
        if prim.is_tuple() || matches!(prim, Prim::Get(_)) {
            return Err(Error::internal(prim.name(), "emitted as one value"));
        }
        self.push_inferred(prim, args)
    }

    /// Appends `prim(args)` with the type the rules infer for it.
    fn push_inferred(&mut self, prim: Prim, args: &[VarId]) -> Result<VarId> {
        let tys: Vec<&TensorType> = args.iter().map(|&a| &self.nodes[a].ty).collect();
        let ty = (self.ctx.infer)(&prim, &tys)?;
        Ok(self.push(prim, args.to_vec(), ty))
    }

    /// Appends `prim(args)` for a primitive with several results, checked
    /// against its operands: the tuple, which only [`Builder::get`] reads.
    pub(crate) fn emit_tuple(&mut self, prim: Prim, args: &[VarId]) -> Result<VarId> {
        if !prim.is_tuple() {
            return Err(Error::internal(prim.name(), "emitted as a tuple"));
        }
        self.push_inferred(prim, args)
    }

    /// Result `k` of the tuple `t`.
    pub(crate) fn get(&mut self, t: VarId, k: usize) -> Result<VarId> {
        let ty = self.nodes[t]
            .prim
            .results()
            .and_then(|rs| rs.into_iter().nth(k))
            .ok_or_else(|| Error::internal(self.nodes[t].prim.name(), format!("no result {k}")))?;
        Ok(self.push(Prim::Get(k), vec![t], ty))
    }

    /// [`Builder::emit_tuple`], then every result (their types worked out
    /// once, not per result).
    pub(crate) fn emit_many(&mut self, prim: Prim, args: &[VarId]) -> Result<Vec<VarId>> {
        let types = prim.results().unwrap_or_default();
        let t = self.emit_tuple(prim, args)?;
        let gets = types.into_iter().enumerate();
        Ok(gets.map(|(k, ty)| self.push(Prim::Get(k), vec![t], ty)).collect())
    }

    /// The id of the value `v` in this builder, capturing it as an extra
    /// input when it belongs to an enclosing trace.
    pub(crate) fn lift(&mut self, v: &Outer) -> Result<VarId> {
        if v.bid == self.id {
            return Ok(v.id);
        }
        if !self.ancestors.contains(&v.bid) {
            return Err(Error::Trace {
                msg: format!(
                    "a symbolic tensor of shape {:?} was used outside the trace that made it \
                     (it escaped a transformed function, or comes from an unrelated trace)",
                    v.ty.shape
                ),
            });
        }
        if let Some(&id) = self.capture_ids.get(&(v.bid, v.id)) {
            return Ok(id);
        }
        let id = self.input(v.ty.clone());
        self.captures.push((v.clone(), id));
        self.capture_ids.insert((v.bid, v.id), id);
        Ok(id)
    }

    /// Ends the trace: the graph (captured outer values come last among its
    /// inputs) and the outer values to bind to those inputs.
    pub(crate) fn finish(&self, outputs: Vec<VarId>) -> (Graph, Vec<Outer>) {
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

// Emitting helpers shared by the rules: each adds one shape node.
impl Builder {
    pub(crate) fn reshape(&mut self, v: VarId, shape: Vec<usize>) -> Result<VarId> {
        if self.dims(v) == shape {
            return Ok(v);
        }
        self.emit(Prim::Shape(ShapeOp::Reshape(shape)), &[v])
    }

    pub(crate) fn permute(&mut self, v: VarId, perm: Vec<usize>) -> Result<VarId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(v);
        }
        self.emit(Prim::Shape(ShapeOp::Permute(perm)), &[v])
    }

    /// Moves axis `from` to position `to`, keeping the others in order.
    pub(crate) fn move_axis(&mut self, v: VarId, from: usize, to: usize) -> Result<VarId> {
        let mut perm: Vec<usize> = (0..self.ty(v).rank()).filter(|&i| i != from).collect();
        perm.insert(to, from);
        self.permute(v, perm)
    }

    pub(crate) fn broadcast(&mut self, v: VarId, shape: Vec<usize>) -> Result<VarId> {
        if self.dims(v) == shape {
            return Ok(v);
        }
        self.emit(Prim::Shape(ShapeOp::Broadcast(shape)), &[v])
    }

    pub(crate) fn narrow(&mut self, v: VarId, axis: usize, start: usize, len: usize) -> Result<VarId> {
        if start == 0 && self.dims(v)[axis] == len {
            return Ok(v);
        }
        self.emit(Prim::Shape(ShapeOp::Narrow { axis, start, len }), &[v])
    }

    pub(crate) fn concat(&mut self, vs: &[VarId], axis: usize) -> Result<VarId> {
        if vs.len() == 1 {
            return Ok(vs[0]);
        }
        self.emit(Prim::Shape(ShapeOp::Concat(axis)), vs)
    }
}

// Emitting helpers for the VJP rules.
impl Builder {
    pub(crate) fn un(&mut self, u: Unary, v: VarId) -> Result<VarId> {
        self.emit(Prim::Unary(u), &[v])
    }

    pub(crate) fn bin(&mut self, op: Binary, a: VarId, b: VarId) -> Result<VarId> {
        self.emit(Prim::Binary(op), &[a, b])
    }

    pub(crate) fn cmp(&mut self, op: Compare, a: VarId, b: VarId) -> Result<VarId> {
        self.emit(Prim::Compare(op), &[a, b])
    }

    /// `where(mask, t, f)`
    pub(crate) fn select(&mut self, mask: VarId, t: VarId, f: VarId) -> Result<VarId> {
        self.emit(Prim::Where, &[mask, t, f])
    }

    /// A scalar literal with `like`'s dtype.
    pub(crate) fn scalar_as(&mut self, value: f64, like: VarId) -> VarId {
        let dt = self.ty(like).dtype;
        self.scalar(value, dt)
    }

    /// Zeros of a shape and dtype (a broadcast literal).
    /// `v`, or where it is `None` (a zero tangent or cotangent), zeros of
    /// `like`'s type.
    pub(crate) fn or_zeros(&mut self, v: Option<VarId>, like: VarId) -> Result<VarId> {
        match v {
            Some(v) => Ok(v),
            None => {
                let ty = self.ty(like).clone();
                self.zeros(ty.shape, ty.dtype)
            }
        }
    }

    pub(crate) fn zeros(&mut self, shape: Vec<usize>, dtype: candle_core::DType) -> Result<VarId> {
        let z = self.scalar(0.0, dtype);
        self.broadcast(z, shape)
    }

    pub(crate) fn sum_axes(&mut self, v: VarId, axes: Vec<usize>, keepdim: bool) -> Result<VarId> {
        if axes.is_empty() {
            return Ok(v);
        }
        self.emit(Prim::Reduce(Reduce::Sum { axes, keepdim }), &[v])
    }

    /// Sums a broadcast result back to an operand's shape: over the leading
    /// axes the operand lacks and the axes where it has size 1.
    pub(crate) fn sum_to(&mut self, v: VarId, shape: &[usize]) -> Result<VarId> {
        let s = self.dims(v);
        if s == shape {
            return Ok(v);
        }
        let lead = s.len() - shape.len();
        let mut axes: Vec<usize> = (0..lead).collect();
        axes.extend(
            (0..shape.len())
                .filter(|&i| shape[i] == 1 && s[lead + i] != 1)
                .map(|i| i + lead),
        );
        let r = self.sum_axes(v, axes, true)?;
        self.reshape(r, shape.to_vec())
    }
}
