//! Forward mode: `jvp` evaluates a function and its directional
//! derivative together, one JVP rule per primitive (beside its VJP rule),
//! as `jax.jvp` and `torch.func.jvp` do.

use super::transformed::{Transform, Transformed};
use super::tree::{ArgList, CallArgs, SymTree};
use super::{flatten_call, Call, Function};
use crate::error::{Error, Result};
use crate::interp::exec::Executable;
use crate::ir::options::Options;
use crate::ir::TensorType;
use crate::rules::walk::jvp_graph;
use crate::rules::{Builder, TraceCtx};
use crate::trace::Tracer;
use candle_core::Tensor;

/// `g`'s JVP as one graph: `g`'s inputs, then a tangent input for each
/// (ignored for integer ones), in; `g`'s outputs, then their tangents
/// (zeros where none), out.
fn joint_graph(g: &crate::ir::Graph, device: candle_core::Device) -> Result<crate::ir::Graph> {
    let b = Builder::root(
        super::next_builder_id(),
        Options::new(),
        TraceCtx::new(device, crate::rules::infer),
    );
    let mut bb = b.borrow_mut();
    let types = g.input_types();
    let ins: Vec<_> = types.iter().map(|t| bb.input(t.clone())).collect();
    let mut tans = Vec::with_capacity(ins.len());
    for t in &types {
        let u = bb.input(t.clone());
        tans.push(t.dtype.is_float().then_some(u));
    }
    let (outs, out_tans) = jvp_graph(g, &mut bb, &ins, &tans)?;
    let mut results = outs.clone();
    for (&o, t) in outs.iter().zip(out_tans) {
        results.push(bb.or_zeros(t, o)?);
    }
    Ok(bb.finish(results).0.eliminate_dead_code())
}

/// What [`jvp`] returns: the value and its tangent, each a concrete tree
/// shaped like the function's result.
pub type ValueAndTangent<O> = (<O as SymTree>::Concrete, <O as SymTree>::Concrete);

/// `f(primals)` and its derivative along `tangents`, `J(primals) tangents`,
/// both shaped like `f`'s result (forward mode: one pass, whose cost is a
/// small multiple of `f`'s, whatever the number of outputs). `tangents` has
/// the structure, shapes and dtypes of `primals`; integer arguments take
/// a tangent too (of their shape and dtype) but it is ignored, as JAX's
/// `float0`. Where an output does not depend on a tangent its tangent is
/// zeros.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jvp, Tracer};
/// let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let u = Tensor::new(&[1f32, 0., 1.], &Device::Cpu)?;
/// let (y, dy) = jvp(&|x: Tracer| x.sqr(), &x, &u)?;
/// assert_eq!(y.to_vec1::<f32>()?, vec![1., 4., 9.]);
/// assert_eq!(dy.to_vec1::<f32>()?, vec![2., 0., 6.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jvp<S, F, C>(f: &F, primals: C, tangents: C) -> Result<ValueAndTangent<F::Output>>
where
    S: ArgList,
    F: Function<S>,
    C: CallArgs<S>,
{
    let call = Call::of(f, &primals)?;
    let (tan_leaves, tan_defs, _) = flatten_call(&tangents)?;
    let types = |l: &[Vec<Tensor>]| -> Vec<TensorType> { l.iter().flatten().map(TensorType::of).collect() };
    let (pt, tt) = (types(&call.leaves), types(&tan_leaves));
    if call.defs != tan_defs || pt != tt {
        return Err(Error::Tree {
            msg: format!("jvp: tangents {tt:?} do not match the primals {pt:?}"),
        });
    }
    let traced = call.trace_as(f, true)?;
    let Call {
        given, leaves, device, ..
    } = call;
    let n_out = traced.graph.outputs.len();
    let joint = Executable::new(&joint_graph(&traced.graph, device)?, given.machine())
        .named("jvp")
        .seeded(traced.seed, Default::default());
    let flat: Vec<Tensor> = leaves.into_iter().chain(tan_leaves).flatten().collect();
    let mut outs = joint.run(&flat)?;
    let tangent_outs = outs.split_off(n_out);
    let value = F::Output::concrete_from(&traced.out_def, &mut outs.into_iter())?;
    let tangent = F::Output::concrete_from(&traced.out_def, &mut tangent_outs.into_iter())?;
    Ok((value, tangent))
}

/// What [`jvp_fn`] does: `f` and its tangent in one forward pass. `op`
/// names it in errors (`jvp`, or `hvp` for the Hessian-vector product
/// built on it).
pub struct JvpOf<F> {
    f: F,
    op: &'static str,
}

/// `f` in forward mode as a function of `(primals, tangents)` (one
/// argument tree each) giving `(value, tangent)`: a [`Function`], so it
/// nests under other transforms (`vmap` over tangents is `jacfwd`; a
/// `jvp_fn` of `grad` is a Hessian-vector product). Made by [`jvp_fn`].
pub type JvpFn<F> = Transformed<JvpOf<F>>;

/// `f` in forward mode as a composable function of `(primals, tangents)`
/// (see [`JvpFn`]); [`jvp`] calls it on tensors directly.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jvp_fn, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let u = Tensor::new(&[1f32, 1.], &Device::Cpu)?;
/// let (y, dy) = jvp_fn(|x: Tracer| x.exp()).call((&x, &u))?;
/// assert_eq!(dy.to_vec1::<f32>()?, y.to_vec1::<f32>()?);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jvp_fn<F>(f: F) -> JvpFn<F> {
    named_jvp_fn(f, "jvp")
}

/// [`jvp_fn`] whose errors name `op`.
pub(crate) fn named_jvp_fn<F>(f: F, op: &'static str) -> JvpFn<F> {
    Transformed::new(JvpOf { f, op })
}

impl<A: SymTree, F: Function<(A,)>> Transform<(A, A)> for JvpOf<F> {
    type Output = (F::Output, F::Output);

    fn apply(&self, options: &Options, (primals, tangents): (A, A)) -> Result<Self::Output> {
        let op = self.op;
        options.check_not_vmap(op)?;
        let (mut p, mut t) = (Vec::new(), Vec::new());
        let (pd, td) = (primals.flatten_into(&mut p), tangents.flatten_into(&mut t));
        let (pt, tt): (Vec<TensorType>, Vec<TensorType>) = (
            p.iter().map(|x| x.ty.clone()).collect(),
            t.iter().map(|x| x.ty.clone()).collect(),
        );
        if pd != td || pt != tt {
            return Err(Error::Tree {
                msg: format!("{op}: tangents {tt:?} do not match the primals {pt:?}"),
            });
        }
        let outer = super::innermost(&[p.clone(), t.clone()]).ok_or_else(|| Error::Tree {
            msg: format!("{op}: the function has no tensor arguments"),
        })?;
        let given = options.inherit(&self.f.own_options()).inherit(&outer.borrow().given);
        let (g, captures, out_def) = super::trace_inner(&self.f, &outer, (given, true, false), &[pd], &[pt])?;
        let (outs, tans) = {
            let mut ob = outer.borrow_mut();
            let mut ins = Vec::with_capacity(p.len() + captures.len());
            let mut tin = Vec::with_capacity(ins.capacity());
            for (x, u) in p.iter().zip(&t) {
                ins.push(ob.lift(&x.outer())?);
                let u = ob.lift(&u.outer())?;
                tin.push(x.ty.dtype.is_float().then_some(u));
            }
            for c in &captures {
                ins.push(ob.lift(c)?);
                tin.push(None); // closed over: constant in the primals
            }
            let (outs, out_tans) = jvp_graph(&g, &mut ob, &ins, &tin)?;
            let mut tans = Vec::with_capacity(outs.len());
            for (&o, t) in outs.iter().zip(out_tans) {
                tans.push(ob.or_zeros(t, o)?);
            }
            (outs, tans)
        };
        let tr = |ids: Vec<usize>| ids.into_iter().map(|id| Tracer::new(&outer, id)).collect::<Vec<_>>();
        let value = F::Output::unflatten_from(&out_def, &mut tr(outs).into_iter())?;
        let tangent = F::Output::unflatten_from(&out_def, &mut tr(tans).into_iter())?;
        Ok((value, tangent))
    }
}

/// `f` in reverse mode as a function of `(primals, cotangents)` giving the
/// cotangent of the primals (a tree like them): a [`Function`], so a
/// `vmap` over cotangents is JAX's `vmap(vjp_fun)` (the rows of a
/// Jacobian) and it nests under other transforms. Made by [`vjp_fn`];
/// [`vjp`](crate::vjp) is the concrete counterpart that keeps the forward
/// values for repeated pullbacks.
pub type VjpFn<F> = Transformed<VjpOf<F>>;

/// What [`vjp_fn`] does: the cotangent of the primals from the outputs'.
/// `op` names it in errors (`vjp`, or `vhp`).
pub struct VjpOf<F> {
    f: F,
    op: &'static str,
}

/// `f` in reverse mode as a composable function (see [`VjpFn`]).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{vjp_fn, vmap, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let basis = Tensor::eye(2, candle_core::DType::F32, &Device::Cpu)?;
/// // the Jacobian's rows, one cotangent each
/// let rows = vmap(vjp_fn(|x: Tracer| x.sqr())).in_dims([None, Some(0)]).call((&x, &basis))?;
/// assert_eq!(rows.to_vec2::<f32>()?, vec![vec![2., 0.], vec![0., 4.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn vjp_fn<F>(f: F) -> VjpFn<F> {
    named_vjp_fn(f, "vjp")
}

/// [`vjp_fn`] whose errors name `op`.
pub(crate) fn named_vjp_fn<F>(f: F, op: &'static str) -> VjpFn<F> {
    Transformed::new(VjpOf { f, op })
}

impl<A: SymTree, F: Function<(A,)>> Transform<(A, F::Output)> for VjpOf<F> {
    type Output = A;

    fn apply(&self, options: &Options, (primals, cts): (A, F::Output)) -> Result<A> {
        let op = self.op;
        options.check_not_vmap(op)?;
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let pd = primals.flatten_into(&mut p);
        let cd = cts.flatten_into(&mut c);
        let outer = super::innermost(&[p.clone(), c.clone()]).ok_or_else(|| Error::Tree {
            msg: format!("{op}: the function has no tensor arguments"),
        })?;
        let types: Vec<TensorType> = p.iter().map(|x| x.ty.clone()).collect();
        let given = options.inherit(&self.f.own_options()).inherit(&outer.borrow().given);
        let (g, captures, out_def) = super::trace_inner(
            &self.f,
            &outer,
            (given, true, false),
            std::slice::from_ref(&pd),
            &[types],
        )?;
        let ct_types: Vec<TensorType> = c.iter().map(|x| x.ty.clone()).collect();
        if cd != out_def || ct_types != g.output_types() {
            return Err(Error::Tree {
                msg: format!(
                    "{op}: cotangents {ct_types:?} do not match the outputs {:?}",
                    g.output_types()
                ),
            });
        }
        let grads = {
            let mut ob = outer.borrow_mut();
            let mut ins = Vec::with_capacity(p.len() + captures.len());
            for x in &p {
                ins.push(ob.lift(&x.outer())?);
            }
            for cap in &captures {
                ins.push(ob.lift(cap)?);
            }
            let mut seeds = Vec::with_capacity(c.len());
            for (i, x) in c.iter().enumerate() {
                seeds.push((i, ob.lift(&x.outer())?));
            }
            let wrt: Vec<bool> = (0..ins.len()).map(|k| k < p.len()).collect();
            let (_, cts) = crate::rules::walk::vjp_graph(&g, &mut ob, &ins, &wrt, &seeds)?;
            let mut grads = Vec::with_capacity(p.len());
            for (&x, ct) in ins.iter().zip(cts).take(p.len()) {
                grads.push(ob.or_zeros(ct, x)?);
            }
            grads
        };
        let leaves: Vec<Tracer> = grads.into_iter().map(|id| Tracer::new(&outer, id)).collect();
        A::unflatten_from(&pd, &mut leaves.into_iter())
    }
}

/// The linear map `u -> J(primals) u` of [`linearize`]: the forward values
/// it needs were kept when `linearize` ran, so each call runs only the
/// tangent computation, as JAX's `linearize`, refused (an
/// [`Error::Memory`](crate::Error::Memory) before it runs) where its plan
/// exceeds the memory limit of the function `linearize` was given.
pub struct Linearized<S: ArgList, O: SymTree> {
    residuals: Vec<Tensor>,
    tangent: Executable,
    in_types: Vec<TensorType>,
    in_defs: Vec<super::tree::TreeDef>,
    out_def: super::tree::TreeDef,
    _s: std::marker::PhantomData<fn() -> (S, O)>,
}

/// What [`linearize`] returns: the value and the linear map.
pub type ValueAndLinear<S, O> = (<O as SymTree>::Concrete, Linearized<S, O>);

/// `f(primals)` and the linear map `u -> J u` at `primals`, evaluated
/// once: calling the map runs only the tangent half of a `jvp` (no
/// forward pass), for many tangents at one point.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{linearize, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let (y, lin) = linearize(&|x: Tracer| x.sqr(), &x)?;
/// assert_eq!(y.to_vec1::<f32>()?, vec![1., 4.]);
/// let du = lin.call(&Tensor::new(&[1f32, 1.], &Device::Cpu)?)?;
/// assert_eq!(du.to_vec1::<f32>()?, vec![2., 4.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn linearize<S: ArgList, F: Function<S>, C: CallArgs<S>>(
    f: &F,
    primals: C,
) -> Result<ValueAndLinear<S, F::Output>> {
    let call = Call::of(f, &primals)?;
    let traced = call.trace_as(f, true)?;
    let Call {
        given,
        leaves,
        defs,
        device,
    } = call;
    let in_types = traced.graph.input_types();
    let joint = joint_graph(&traced.graph, device)?;
    // the forward now, the tangent map at every call
    let names = ("linearize", "linearized map");
    let (outs, residuals, tangent) = super::grad::forward_now(&joint, &traced, given, leaves, names)?;
    let value = F::Output::concrete_from(&traced.out_def, &mut outs.into_iter())?;
    let lin = Linearized {
        residuals,
        tangent,
        in_types,
        in_defs: defs,
        out_def: traced.out_def,
        _s: std::marker::PhantomData,
    };
    Ok((value, lin))
}

impl<S: ArgList, O: SymTree> Linearized<S, O> {
    /// `J u` for tangents `u` shaped like the primals.
    pub fn call<C: CallArgs<S>>(&self, tangents: C) -> Result<O::Concrete> {
        let (leaves, defs, _) = flatten_call(&tangents)?;
        let types: Vec<TensorType> = leaves.iter().flatten().map(TensorType::of).collect();
        if defs != self.in_defs || types != self.in_types {
            return Err(Error::Tree {
                msg: format!(
                    "linearize: tangents {types:?} do not match the primals {:?}",
                    self.in_types
                ),
            });
        }
        let inputs: Vec<Tensor> = self
            .residuals
            .iter()
            .cloned()
            .chain(leaves.into_iter().flatten())
            .collect();
        let outs = self.tangent.run(&inputs)?;
        O::concrete_from(&self.out_def, &mut outs.into_iter())
    }
}
