//! `grad`, `value_and_grad` and `vjp`: reverse-mode differentiation as a
//! graph transform. The function is traced, its forward pass re-emitted into
//! the enclosing trace, and its reverse pass emitted node by node through
//! each primitive's VJP rule. The result is itself traceable, so `grad`
//! composes with `vmap` (and with itself) in any order.

use super::transformed::{Transform, Transformed};
use super::tree::{ArgList, CallArgs, SymTree, TreeDef};
use super::{innermost, trace_inner, Call, Function, Traced};
use crate::error::{Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::Options;
use crate::ir::{Graph, Node, Prim, TensorType, VarId};
use crate::rules::walk::vjp_graph;
use crate::rules::{Builder, TraceCtx};
use crate::trace::Tracer;
use candle_core::Tensor;
use std::marker::PhantomData;

/// The argument list's element `I`.
pub trait Nth<const I: usize> {
    /// Its type.
    type T: SymTree;
}

macro_rules! nth {
    ($i:tt => $t:ident; $($a:ident),+) => {
        impl<$($a: SymTree),+> Nth<$i> for ($($a,)+) {
            type T = $t;
        }
    };
}
nth!(0 => A; A);
nth!(0 => A; A, B);
nth!(1 => B; A, B);
nth!(0 => A; A, B, C);
nth!(1 => B; A, B, C);
nth!(2 => C; A, B, C);
nth!(0 => A; A, B, C, D);
nth!(1 => B; A, B, C, D);
nth!(2 => C; A, B, C, D);
nth!(3 => D; A, B, C, D);

/// Which arguments a gradient is taken with respect to (`argnums`), and the
/// type of the gradients: [`Wrt`] for one argument, [`Wrt2`] for two.
pub trait Argnums<S> {
    /// The gradients' tree type.
    type Grads: SymTree;
    /// The argument positions.
    fn indices() -> Vec<usize>;
    /// The gradients' structure, from each argument's.
    fn def(defs: &[TreeDef]) -> TreeDef {
        match Self::indices()[..] {
            [i] => defs[i].clone(),
            ref many => TreeDef::Tuple(many.iter().map(|&i| defs[i].clone()).collect()),
        }
    }
    /// Builds the gradients from each selected argument's structure and leaves.
    fn build(defs: &[TreeDef], grads: Vec<Vec<Tracer>>) -> Result<Self::Grads>;
}

/// Differentiate with respect to argument `I` (the default is 0, as in JAX).
pub struct Wrt<const I: usize>;

/// Differentiate with respect to arguments `I` and `J`; the gradients come
/// as a pair.
pub struct Wrt2<const I: usize, const J: usize>;

impl<S: Nth<I>, const I: usize> Argnums<S> for Wrt<I> {
    type Grads = <S as Nth<I>>::T;
    fn indices() -> Vec<usize> {
        vec![I]
    }
    fn build(defs: &[TreeDef], grads: Vec<Vec<Tracer>>) -> Result<Self::Grads> {
        let mut it = grads.into_iter().next().unwrap_or_default().into_iter();
        <S as Nth<I>>::T::unflatten_from(&defs[I], &mut it)
    }
}

impl<S: Nth<I> + Nth<J>, const I: usize, const J: usize> Argnums<S> for Wrt2<I, J> {
    type Grads = (<S as Nth<I>>::T, <S as Nth<J>>::T);
    fn indices() -> Vec<usize> {
        vec![I, J]
    }
    fn build(defs: &[TreeDef], grads: Vec<Vec<Tracer>>) -> Result<Self::Grads> {
        let mut g = grads.into_iter();
        Ok((unflatten_each(&defs[I], &mut g)?, unflatten_each(&defs[J], &mut g)?))
    }
}

/// Differentiate with respect to arguments `I`, `J` and `K`; the
/// gradients come as a triple.
pub struct Wrt3<const I: usize, const J: usize, const K: usize>;

/// Differentiate with respect to arguments `I`, `J`, `K` and `L` (every
/// argument of a four-argument function); the gradients come as a 4-tuple.
pub struct Wrt4<const I: usize, const J: usize, const K: usize, const L: usize>;

/// The selected arguments' gradients, one tree each, in `argnums` order.
fn unflatten_each<T: SymTree>(def: &TreeDef, grads: &mut std::vec::IntoIter<Vec<Tracer>>) -> Result<T> {
    T::unflatten_from(def, &mut grads.next().unwrap_or_default().into_iter())
}

impl<S: Nth<I> + Nth<J> + Nth<K>, const I: usize, const J: usize, const K: usize> Argnums<S> for Wrt3<I, J, K> {
    type Grads = (<S as Nth<I>>::T, <S as Nth<J>>::T, <S as Nth<K>>::T);
    fn indices() -> Vec<usize> {
        vec![I, J, K]
    }
    fn build(defs: &[TreeDef], grads: Vec<Vec<Tracer>>) -> Result<Self::Grads> {
        let mut g = grads.into_iter();
        Ok((
            unflatten_each(&defs[I], &mut g)?,
            unflatten_each(&defs[J], &mut g)?,
            unflatten_each(&defs[K], &mut g)?,
        ))
    }
}

impl<S, const I: usize, const J: usize, const K: usize, const L: usize> Argnums<S> for Wrt4<I, J, K, L>
where
    S: Nth<I> + Nth<J> + Nth<K> + Nth<L>,
{
    type Grads = (<S as Nth<I>>::T, <S as Nth<J>>::T, <S as Nth<K>>::T, <S as Nth<L>>::T);
    fn indices() -> Vec<usize> {
        vec![I, J, K, L]
    }
    fn build(defs: &[TreeDef], grads: Vec<Vec<Tracer>>) -> Result<Self::Grads> {
        let mut g = grads.into_iter();
        Ok((
            unflatten_each(&defs[I], &mut g)?,
            unflatten_each(&defs[J], &mut g)?,
            unflatten_each(&defs[K], &mut g)?,
            unflatten_each(&defs[L], &mut g)?,
        ))
    }
}

/// Mode marker: the gradients only.
pub struct Plain;
/// Mode marker: the function returns `(loss, aux)`; the result is `(grads, aux)`.
pub struct Aux;
/// Mode marker: the result is `(value, grads)`.
pub struct Value;
/// Mode marker: the function returns `(loss, aux)`; the result is
/// `((value, aux), grads)`.
pub struct ValueAux;

/// What [`grad`] does: the reverse pass of `f` with respect to the
/// arguments `W`, returning what the mode `M` says.
pub struct GradOf<F, W = Wrt<0>, M = Plain> {
    f: F,
    // the user's operation its errors name (`hvp` when it computes one)
    op: &'static str,
    _sel: PhantomData<fn() -> (W, M)>,
}

/// The gradient of a scalar function (see [`grad`], [`value_and_grad`]).
pub type Grad<F, W = Wrt<0>, M = Plain> = Transformed<GradOf<F, W, M>>;

/// The gradient of `f` with respect to its first argument, like `jax.grad`
/// and `torch.func.grad`: `f` returns a scalar (shape `[]`), and the result
/// has the structure of the first argument (a tensor, a tuple, a map of
/// parameters, ...). Choose other arguments with [`Grad::argnum`] or
/// [`Grad::argnums`]; return `(loss, aux)` and call [`Grad::has_aux`] to
/// carry auxiliary outputs.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{grad, vmap, Tracer};
/// let w = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let xs = Tensor::new(&[[1f32, 0., 0.], [0., 1., 1.]], &Device::Cpu)?;
/// // loss(w, x) = (w . x)^2; its gradient is 2 (w . x) x
/// let loss = |w: Tracer, x: Tracer| w.mul(&x)?.sum_all()?.sqr();
/// let per_sample = vmap(grad(loss)).in_dims([None, Some(0)]).call((&w, &xs))?;
/// assert_eq!(per_sample.to_vec2::<f32>()?, vec![vec![2., 0., 0.], vec![0., 10., 10.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn grad<F>(f: F) -> Grad<F> {
    named_grad(f, "grad")
}

/// [`grad`] whose errors name `op`, the transform built on it.
pub(crate) fn named_grad<F>(f: F, op: &'static str) -> Grad<F> {
    Transformed::new(GradOf {
        f,
        op,
        _sel: PhantomData,
    })
}

/// The value of `f` and its gradient, computed together: the result is
/// `(value, grads)`.
pub fn value_and_grad<F>(f: F) -> Grad<F, Wrt<0>, Value> {
    Transformed::new(GradOf {
        f,
        op: "value_and_grad",
        _sel: PhantomData,
    })
}

impl<F, W, M> Grad<F, W, M> {
    fn with<W2, M2>(self) -> Grad<F, W2, M2> {
        self.map(|k| GradOf {
            f: k.f,
            op: k.op,
            _sel: PhantomData,
        })
    }

    /// Differentiate with respect to argument `I` instead.
    pub fn argnum<const I: usize>(self) -> Grad<F, Wrt<I>, M> {
        self.with()
    }

    /// Differentiate with respect to arguments `I` and `J`; the gradients
    /// come as a pair.
    pub fn argnums<const I: usize, const J: usize>(self) -> Grad<F, Wrt2<I, J>, M> {
        self.with()
    }

    /// Differentiate with respect to arguments `I`, `J` and `K`; the
    /// gradients come as a triple.
    pub fn argnums3<const I: usize, const J: usize, const K: usize>(self) -> Grad<F, Wrt3<I, J, K>, M> {
        self.with()
    }

    /// Differentiate with respect to arguments `I`, `J`, `K` and `L`; the
    /// gradients come as a 4-tuple.
    pub fn argnums4<const I: usize, const J: usize, const K: usize, const L: usize>(
        self,
    ) -> Grad<F, Wrt4<I, J, K, L>, M> {
        self.with()
    }
}

impl<F, W> Grad<F, W, Plain> {
    /// The function returns `(loss, aux)`; the result becomes `(grads, aux)`.
    pub fn has_aux(self) -> Grad<F, W, Aux> {
        self.with()
    }
}

impl<F, W> Grad<F, W, Value> {
    /// The function returns `(loss, aux)`; the result becomes
    /// `((value, aux), grads)`.
    pub fn has_aux(self) -> Grad<F, W, ValueAux> {
        self.with()
    }
}

/// The forward result and the selected gradients, as tracers of the
/// enclosing trace.
struct Differentiated<O, G> {
    out: O,
    grads: G,
}

/// The loss's type, where `g` returns a floating-point scalar and the
/// arguments `sel` are floating-point tensors (as JAX and torch.func:
/// real-valued outputs and inputs only, an integer gradient would be zeros
/// or ones with no meaning), else an error naming `op`.
fn differentiable(op: &'static str, g: &Graph, leaves: &[Vec<Tracer>], sel: &[usize]) -> Result<TensorType> {
    let loss = g
        .outputs
        .first()
        .map(|&o| g.ty(o).clone())
        .unwrap_or(TensorType::new(vec![0], candle_core::DType::F32));
    if loss.rank() != 0 {
        return Err(Error::shape(
            op,
            &[&loss.shape],
            "the differentiated function must return a scalar (shape [])",
        ));
    }
    if !loss.dtype.is_float() {
        return Err(Error::DType {
            op,
            dtypes: vec![loss.dtype],
            msg: "the differentiated function must return a floating-point scalar".into(),
        });
    }
    for &arg in sel {
        if let Some(t) = leaves[arg].iter().find(|t| !t.ty.dtype.is_float()) {
            return Err(Error::DType {
                op,
                dtypes: vec![t.ty.dtype],
                msg: format!(
                    "argument {arg} is differentiated but holds a {:?} tensor: gradients are taken with respect to floating-point tensors only (choose others with argnums)",
                    t.ty.dtype
                ),
            });
        }
    }
    Ok(loss)
}

fn differentiate<S, F, W>(
    f: &F,
    op: &'static str,
    options: &Options,
    args: S,
) -> Result<Differentiated<F::Output, W::Grads>>
where
    S: ArgList,
    F: Function<S>,
    W: Argnums<S>,
{
    let (leaves, defs) = args.flatten_args();
    let outer =
        innermost(&leaves).ok_or_else(|| Error::unsupported(op, "grad", "the function has no tensor arguments"))?;
    let types: Vec<Vec<TensorType>> = leaves
        .iter()
        .map(|a| a.iter().map(|t| t.ty.clone()).collect())
        .collect();
    options.check_not_vmap(op)?;
    let given = options.inherit(&outer.borrow().given);
    outer.borrow().ctx.offer_seed(options.seed);
    let (g, captures, out_def) = trace_inner(f, &outer, (given, true, false), &defs, &types)?;
    let sel = W::indices();
    let loss = differentiable(op, &g, &leaves, &sel)?;
    let (outs, grads) = {
        let mut ob = outer.borrow_mut();
        let (mut inputs, mut wrt) = (Vec::new(), Vec::new());
        for (arg, arg_leaves) in leaves.iter().enumerate() {
            for t in arg_leaves {
                inputs.push(ob.lift(&t.outer())?);
                wrt.push(sel.contains(&arg));
            }
        }
        for c in &captures {
            inputs.push(ob.lift(c)?);
            wrt.push(false);
        }
        let seed = ob.scalar(1.0, loss.dtype);
        let (outs, cts) = vjp_graph(&g, &mut ob, &inputs, &wrt, &[(0, seed)])?;
        let mut grads = Vec::with_capacity(sel.len());
        for &arg in &sel {
            let start: usize = leaves[..arg].iter().map(Vec::len).sum();
            let mut arg_grads = Vec::new();
            for k in 0..leaves[arg].len() {
                arg_grads.push(ob.or_zeros(cts[start + k], inputs[start + k])?);
            }
            grads.push(arg_grads);
        }
        (outs, grads)
    };
    let tr = |ids: Vec<VarId>| ids.into_iter().map(|id| Tracer::new(&outer, id)).collect::<Vec<_>>();
    let out = F::Output::unflatten_from(&out_def, &mut tr(outs).into_iter())?;
    let grads = W::build(&defs, grads.into_iter().map(tr).collect())?;
    Ok(Differentiated { out, grads })
}

impl<S: ArgList, F: Function<S, Output = Tracer>, W: Argnums<S>> Transform<S> for GradOf<F, W, Plain> {
    type Output = W::Grads;
    fn apply(&self, options: &Options, args: S) -> Result<W::Grads> {
        Ok(differentiate::<S, F, W>(&self.f, self.op, options, args)?.grads)
    }
}

impl<S: ArgList, A: SymTree, F: Function<S, Output = (Tracer, A)>, W: Argnums<S>> Transform<S> for GradOf<F, W, Aux> {
    type Output = (W::Grads, A);
    fn apply(&self, options: &Options, args: S) -> Result<(W::Grads, A)> {
        let d = differentiate::<S, F, W>(&self.f, self.op, options, args)?;
        Ok((d.grads, d.out.1))
    }
}

impl<S: ArgList, F: Function<S, Output = Tracer>, W: Argnums<S>> Transform<S> for GradOf<F, W, Value> {
    type Output = (Tracer, W::Grads);
    fn apply(&self, options: &Options, args: S) -> Result<(Tracer, W::Grads)> {
        let d = differentiate::<S, F, W>(&self.f, self.op, options, args)?;
        Ok((d.out, d.grads))
    }
}

impl<S: ArgList, A: SymTree, F: Function<S, Output = (Tracer, A)>, W: Argnums<S>> Transform<S>
    for GradOf<F, W, ValueAux>
{
    type Output = ((Tracer, A), W::Grads);
    fn apply(&self, options: &Options, args: S) -> Result<((Tracer, A), W::Grads)> {
        let d = differentiate::<S, F, W>(&self.f, self.op, options, args)?;
        Ok((d.out, d.grads))
    }
}

/// The pullback of [`vjp`]: maps cotangents of the function's outputs to
/// cotangents of all its arguments. The forward values it needs were kept
/// when `vjp` ran, so each call runs only the reverse pass, refused (an
/// [`Error::Memory`] before it runs) where its plan, with those values,
/// exceeds the memory limit of the function `vjp` was given.
pub struct Pullback<S: ArgList> {
    residuals: Vec<Tensor>,
    backward: Executable,
    out_def: TreeDef,
    out_types: Vec<TensorType>,
    in_defs: Vec<TreeDef>,
    _s: PhantomData<fn() -> S>,
}

/// Evaluates `f` at `args` and returns its value with a [`Pullback`], like
/// `jax.vjp` and `torch.func.vjp`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{vjp, Tracer};
/// let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let (y, pullback) = vjp(&|x: Tracer| x.sqr(), &x)?;
/// assert_eq!(y.to_vec1::<f32>()?, vec![1., 4., 9.]);
/// let (dx,) = pullback.call(&Tensor::new(&[1f32, 1., 0.], &Device::Cpu)?)?;
/// assert_eq!(dx.to_vec1::<f32>()?, vec![2., 4., 0.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn vjp<S, F, C>(f: &F, args: C) -> Result<(<F::Output as SymTree>::Concrete, Pullback<S>)>
where
    S: ArgList,
    F: Function<S>,
    C: CallArgs<S>,
{
    let call = Call::of(f, &args)?;
    let traced = call.trace_as(f, true)?;
    let Call {
        given,
        leaves,
        defs,
        device,
    } = call;
    let fwd_graph = &traced.graph;
    let out_types = fwd_graph.output_types();
    // The joint graph: primals and output cotangents in, outputs and
    // argument cotangents out.
    let b = Builder::root(
        super::next_builder_id(),
        Options::new(),
        TraceCtx::new(device, crate::rules::infer),
    );
    let joint = {
        let mut bb = b.borrow_mut();
        let primals: Vec<VarId> = fwd_graph.input_types().into_iter().map(|t| bb.input(t)).collect();
        let seeds: Vec<(usize, VarId)> = out_types
            .iter()
            .enumerate()
            .map(|(i, t)| (i, bb.input(t.clone())))
            .collect();
        let wrt = vec![true; primals.len()];
        let (outs, cts) = vjp_graph(fwd_graph, &mut bb, &primals, &wrt, &seeds)?;
        let mut results = outs;
        for (&p, ct) in primals.iter().zip(cts) {
            results.push(bb.or_zeros(ct, p)?);
        }
        bb.finish(results).0
    };
    // fused only now, after differentiation: fused nodes have no VJP rule;
    // a pre-activation the backward pass reads is an output of the forward
    // half and so stays unfused
    let (outs, residuals, backward) = forward_now(&joint, &traced, given, leaves, ("vjp", "vjp pullback"))?;
    let value = F::Output::concrete_from(&traced.out_def, &mut outs.into_iter())?;
    let pullback = Pullback {
        residuals,
        backward,
        out_def: traced.out_def,
        out_types,
        in_defs: defs,
        _s: PhantomData,
    };
    Ok((value, pullback))
}

impl<S: ArgList> Pullback<S> {
    /// The cotangents of all arguments for the given cotangents of the
    /// outputs (a tree shaped like the function's result).
    pub fn call<T: super::tree::TensorTree + ?Sized>(&self, cts: &T) -> Result<S::Concrete> {
        let mut leaves = Vec::new();
        let def = cts.flatten_into(&mut leaves);
        let types: Vec<TensorType> = leaves.iter().map(TensorType::of).collect();
        if def != self.out_def || types != self.out_types {
            return Err(Error::Tree {
                msg: format!(
                    "vjp: cotangents {types:?} do not match the outputs {:?}",
                    self.out_types
                ),
            });
        }
        let mut inputs = self.residuals.clone();
        inputs.extend(leaves);
        let grads = self.backward.run(&inputs)?;
        let mut it = grads.into_iter();
        let per_arg = self
            .in_defs
            .iter()
            .map(|d| (&mut it).take(d.leaf_count()).collect())
            .collect();
        S::concrete_from(&self.in_defs, per_arg)
    }
}

/// The two halves of `joint` (`partition`; its primals are `leaves`,
/// `traced`'s inputs, its first outputs `traced`'s), each an executable on
/// the machine `options` resolve to and checked against its limit before
/// it runs: the forward one (named `names.0`, seeded as the trace) run now,
/// its outputs and the residuals it leaves, and the other (named
/// `names.1`) to run later on those residuals. What `vjp` and
/// `linearize` share.
pub(super) fn forward_now(
    joint: &Graph,
    traced: &Traced,
    options: Options,
    leaves: Vec<Vec<Tensor>>,
    names: (&'static str, &'static str),
) -> Result<(Vec<Tensor>, Vec<Tensor>, Executable)> {
    let n_out = traced.graph.outputs.len();
    let (fwd, rest) = partition(joint, traced.graph.inputs.len(), n_out);
    let machine = options.machine();
    let fwd = Executable::new(&fwd, machine)
        .named(names.0)
        .seeded(traced.seed, Default::default());
    let rest = Executable::new(&rest, machine).named(names.1);
    let flat: Vec<Tensor> = leaves.into_iter().flatten().collect();
    let mut outs = fwd.run(&flat)?;
    let residuals = outs.split_off(n_out);
    Ok((outs, residuals, rest))
}

/// Splits a joint graph (primals, then cotangents, in; `n_out` outputs, then
/// gradients, out) into a forward graph (primals in; outputs, then the
/// residuals the reverse pass reads, out) and a backward graph (residuals,
/// then cotangents, in; gradients out).
pub(crate) fn partition(j: &Graph, n_primals: usize, n_out: usize) -> (Graph, Graph) {
    let flagged: Vec<bool> = (0..j.inputs.len()).map(|k| k >= n_primals).collect();
    let dep = j.downstream_of(&flagged);
    // Residuals: forward values read by the reverse pass or returned as
    // gradients.
    let mut residual = vec![false; j.nodes.len()];
    for (v, node) in j.nodes.iter().enumerate() {
        if dep[v] && !matches!(node.prim, Prim::Input(_)) {
            for &a in &node.args {
                residual[a] |= !dep[a];
            }
        }
    }
    for &o in &j.outputs[n_out..] {
        residual[o] |= !dep[o];
    }
    let residuals: Vec<VarId> = (0..j.nodes.len()).filter(|&v| residual[v]).collect();
    let fwd = Graph {
        nodes: j.nodes.clone(),
        inputs: j.inputs[..n_primals].to_vec(),
        outputs: j.outputs[..n_out]
            .iter()
            .copied()
            .chain(residuals.iter().copied())
            .collect(),
        consts: j.consts.clone(),
    }
    .eliminate_dead_code();
    // The backward graph: residuals become inputs, then the cotangents.
    let mut bwd = Graph {
        consts: j.consts.clone(),
        ..Graph::default()
    };
    let mut env = vec![usize::MAX; j.nodes.len()];
    for &r in &residuals {
        env[r] = push_input(&mut bwd, j.nodes[r].ty.clone());
    }
    for &v in &j.inputs[n_primals..] {
        env[v] = push_input(&mut bwd, j.nodes[v].ty.clone());
    }
    for (v, node) in j.nodes.iter().enumerate() {
        if dep[v] && !matches!(node.prim, Prim::Input(_)) {
            let mut n = node.clone();
            n.args = node.args.iter().map(|&a| env[a]).collect();
            bwd.nodes.push(n);
            env[v] = bwd.nodes.len() - 1;
        }
    }
    bwd.outputs = j.outputs[n_out..].iter().map(|&o| env[o]).collect();
    (fwd, bwd.eliminate_dead_code())
}

fn push_input(g: &mut Graph, ty: TensorType) -> VarId {
    let k = g.inputs.len();
    g.nodes.push(Node {
        prim: Prim::Input(k),
        args: vec![],
        ty,
    });
    g.inputs.push(g.nodes.len() - 1);
    g.nodes.len() - 1
}
