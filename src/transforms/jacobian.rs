//! The Jacobian family, as `torch.func` has it: `jacfwd` (a `vmap` of
//! forward mode over the input basis), `jacrev` (a `vmap` of reverse mode
//! over the output basis), `hessian` (`jacfwd` of `jacrev`) and `hvp`
//! (forward over reverse). Each Jacobian is shaped `[*out, *in]`. They are
//! [`Function`]s of one tensor to one tensor, so they nest under `vmap`
//! (per-example Jacobians) and each other.

use super::grad::grad;
use super::jvp::jvp_fn;
use super::tree::{ArgList, CallArgs};
use super::vmap::vmap;
use super::{jit, Function};
use crate::error::{CandleContext, Result};
use crate::ir::options::Options;
use crate::trace::{Operand, Tracer};
use candle_core::Tensor;

/// Borrows a function as a function (transforms take theirs by value).
struct ByRef<'a, F>(&'a F);

impl<S: ArgList, F: Function<S>> Function<S> for ByRef<'_, F> {
    type Output = F::Output;
    fn apply(&self, args: S) -> Result<F::Output> {
        self.0.apply(args)
    }
    fn own_options(&self) -> Options {
        self.0.own_options()
    }
}

/// `n` one-hot rows shaped `[n, *shape]`: the basis a Jacobian maps over.
fn basis(like: &Tracer, shape: &[usize]) -> Result<Tracer> {
    let n: usize = shape.iter().product();
    let eye = Tensor::eye(n, like.dtype(), &like.device())
        .and_then(|e| e.reshape([&[n], shape].concat()))
        .op("jacobian basis")?;
    eye.to_tracer(like)
}

/// `[n, *out]` with the basis axis first, as `[*out, *in]` (`n` = the
/// input's size) or `[*in, ...]`: moves axis 0 to the end and splits it.
fn basis_last(t: Tracer, split: &[usize]) -> Result<Tracer> {
    let r = t.rank();
    let perm: Vec<usize> = (1..r).chain(std::iter::once(0)).collect();
    let moved = t.permute(&perm)?;
    let lead = moved.dims()[..r - 1].to_vec();
    moved.reshape([&lead[..], split].concat())
}

/// The Jacobian of `f` (one tensor to one tensor) by forward mode, shaped
/// `[*out, *in]`: one JVP per input element, batched by `vmap`. The cheaper
/// direction where inputs are fewer than outputs.
pub struct Jacfwd<F> {
    f: F,
}

/// See [`Jacfwd`]; like `torch.func.jacfwd`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jacfwd, jit, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let j = jit(jacfwd(|x: Tracer| x.sqr())).call(&x)?;
/// assert_eq!(j.to_vec2::<f32>()?, vec![vec![2., 0.], vec![0., 4.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jacfwd<F>(f: F) -> Jacfwd<F> {
    Jacfwd { f }
}

impl<F: Function<(Tracer,), Output = Tracer>> Function<(Tracer,)> for Jacfwd<F> {
    type Output = Tracer;
    fn apply(&self, (x,): (Tracer,)) -> Result<Tracer> {
        // as jacrev (through grad) and JAX: no Jacobian of an integer input
        if !x.dtype().is_float() {
            return Err(crate::error::Error::DType {
                op: "jacfwd",
                dtypes: vec![x.dtype()],
                msg: "the Jacobian is taken with respect to a floating-point tensor only".into(),
            });
        }
        let shape = x.dims().to_vec();
        let e = basis(&x, &shape)?;
        let f = ByRef(&self.f);
        let one = |x: Tracer, u: Tracer| Function::apply(&jvp_fn(ByRef(&f)), (x, u)).map(|(_, t)| t);
        // [n, *out], then [*out, *in]
        let t = Function::apply(&vmap(one).in_dims([None, Some(0)]), (x, e))?;
        basis_last(t, &shape)
    }
}

/// The Jacobian of `f` (one tensor to one tensor) by reverse mode, shaped
/// `[*out, *in]`: one VJP per output element, batched by `vmap` (the
/// forward pass, not batched, runs once). The cheaper direction where
/// outputs are fewer than inputs.
pub struct Jacrev<F> {
    f: F,
}

/// See [`Jacrev`]; like `torch.func.jacrev`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jacrev, jit, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let j = jit(jacrev(|x: Tracer| x.sqr()?.sum_all())).call(&x)?;
/// assert_eq!(j.to_vec1::<f32>()?, vec![2., 4.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jacrev<F>(f: F) -> Jacrev<F> {
    Jacrev { f }
}

impl<F: Function<(Tracer,), Output = Tracer>> Function<(Tracer,)> for Jacrev<F> {
    type Output = Tracer;
    fn apply(&self, (x,): (Tracer,)) -> Result<Tracer> {
        let out = self.f.apply((x.clone(),))?.dims().to_vec();
        let e = basis(&x, &out)?;
        let f = ByRef(&self.f);
        // row i: the gradient of <f(x), e_i>
        let row = |x: Tracer, e: Tracer| {
            let dot = |x: Tracer| f.apply((x,))?.mul(&e)?.sum_all();
            Function::apply(&grad(dot), (x,))
        };
        // [m, *in], then [*out, *in]
        let rows = Function::apply(&vmap(row).in_dims([None, Some(0)]), (x.clone(), e))?;
        rows.reshape([&out[..], x.dims()].concat())
    }
}

/// The Hessian of a scalar `f`, `[*in, *in]`: `jacfwd(jacrev(f))`, as
/// `torch.func.hessian`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{hessian, jit, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let h = jit(hessian(|x: Tracer| x.sqr()?.sum_all())).call(&x)?;
/// assert_eq!(h.to_vec2::<f32>()?, vec![vec![2., 0.], vec![0., 2.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn hessian<F>(f: F) -> Jacfwd<Jacrev<F>> {
    jacfwd(jacrev(f))
}

/// The Hessian-vector product of a scalar `f` as a [`Function`] of
/// `(x, v)` giving `(grad f(x), H v)`, by forward over reverse (one JVP of
/// the gradient; no Hessian is formed). Made by [`hvp_fn`]; wrap it in
/// [`jit`] to trace once and call it repeatedly.
pub struct HvpFn<F> {
    f: F,
}

/// See [`HvpFn`].
pub fn hvp_fn<F>(f: F) -> HvpFn<F> {
    HvpFn { f }
}

impl<F: Function<(Tracer,), Output = Tracer>> Function<(Tracer, Tracer)> for HvpFn<F> {
    type Output = (Tracer, Tracer);
    fn apply(&self, (x, v): (Tracer, Tracer)) -> Result<(Tracer, Tracer)> {
        let g = grad(ByRef(&self.f));
        Function::apply(&jvp_fn(g), (x, v))
    }
}

/// The Hessian of a scalar `f` at `x` times `v`, by forward over reverse
/// (one JVP of the gradient: no Hessian is formed), with `f`'s gradient:
/// `(grad f(x), H v)`, as `torch.func`'s `jvp(grad(f), ..)` recipe. It
/// traces `f` on every call; `jit(hvp_fn(f))` traces once.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{hvp, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let v = Tensor::new(&[1f32, 0.], &Device::Cpu)?;
/// let (g, hv) = hvp(&|x: Tracer| x.powf(3.)?.sum_all(), &x, &v)?;
/// assert_eq!(g.to_vec1::<f32>()?, vec![3., 12.]);
/// assert_eq!(hv.to_vec1::<f32>()?, vec![6., 0.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn hvp<F, C>(f: &F, x: C, v: C) -> Result<(Tensor, Tensor)>
where
    F: Function<(Tracer,), Output = Tracer>,
    C: CallArgs<(Tracer,)>,
{
    let both = hvp_fn(ByRef(f));
    let (x, v) = (x.flatten_args(), v.flatten_args());
    let one = |t: Vec<Vec<Tensor>>| t.into_iter().flatten().next();
    let (Some(x), Some(v)) = (one(x.0), one(v.0)) else {
        return Err(crate::error::Error::Tree {
            msg: "hvp: one tensor each for the point and the direction".into(),
        });
    };
    jit(both).call((&x, &v))
}
