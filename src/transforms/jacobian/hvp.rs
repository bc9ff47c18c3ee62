//! The Hessian-vector products: `hvp` (forward over reverse, one JVP of
//! the gradient) and `vhp` (reverse over reverse, one VJP of the
//! gradient), neither forming the Hessian.

use crate::error::Result;
use crate::ir::options::Options;
use crate::trace::Tracer;
use crate::transforms::grad::named_grad;
use crate::transforms::jvp::{named_jvp_fn, named_vjp_fn};
use crate::transforms::transformed::{Transform, Transformed};
use crate::transforms::tree::{SymTree, TensorTree};
use crate::transforms::{ByRef, Function};

/// What [`hvp_fn`] does: one JVP of the gradient.
pub struct HvpOf<F> {
    f: F,
}

/// The Hessian-vector product `H v` of a scalar `f` of one tree, by
/// forward over reverse (one JVP of the gradient; no Hessian is formed), as
/// a [`Function`] of `(x, v)`: the JAX cookbook's `hvp`. For the gradient
/// too, use `jvp_fn(grad(f))`. Made by [`hvp_fn`]; `.call` traces once
/// per signature and calls it repeatedly.
pub type HvpFn<F> = Transformed<HvpOf<F>>;

/// See [`HvpFn`].
pub fn hvp_fn<F>(f: F) -> HvpFn<F> {
    Transformed::new(HvpOf { f })
}

impl<A: SymTree, F: Function<(A,), Output = Tracer>> Transform<(A, A)> for HvpOf<F> {
    type Output = A;
    fn apply(&self, options: &Options, (x, v): (A, A)) -> Result<A> {
        // only the tangent: the gradient's last products are dead code
        Function::apply(
            &named_jvp_fn(named_grad(ByRef(&self.f), "hvp"), "hvp").options(*options),
            (x, v),
        )
        .map(|(_, hv)| hv)
    }
}

/// What [`vhp_fn`] does: one VJP of the gradient.
pub struct VhpOf<F> {
    f: F,
}

/// The vector-Hessian product `v^T H` of a scalar `f` of one tree, by
/// reverse over reverse (one VJP of the gradient), as a [`Function`] of
/// `(x, v)`: `torch.autograd.functional.vhp`'s product. Equal to
/// [`HvpFn`]'s where the Hessian is symmetric (`f` twice continuously
/// differentiable); which is faster depends on the function. Made by
/// [`vhp_fn`].
pub type VhpFn<F> = Transformed<VhpOf<F>>;

/// See [`VhpFn`].
pub fn vhp_fn<F>(f: F) -> VhpFn<F> {
    Transformed::new(VhpOf { f })
}

impl<A: SymTree, F: Function<(A,), Output = Tracer>> Transform<(A, A)> for VhpOf<F> {
    type Output = A;
    fn apply(&self, options: &Options, (x, v): (A, A)) -> Result<A> {
        Function::apply(
            &named_vjp_fn(named_grad(ByRef(&self.f), "vhp"), "vhp").options(*options),
            (x, v),
        )
    }
}

/// `H v`, the Hessian of a scalar `f` at `x` times `v` (trees of one
/// structure), by forward over reverse; see [`HvpFn`]. It traces `f` on
/// every call; `hvp_fn(f).call((x, v))` traces once per signature.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{hvp, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let v = Tensor::new(&[1f32, 0.], &Device::Cpu)?;
/// let hv = hvp(&|x: Tracer| x.powf(3.)?.sum_all(), &x, &v)?;
/// assert_eq!(hv.to_vec1::<f32>()?, vec![6., 0.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn hvp<F, T>(f: &F, x: &T, v: &T) -> Result<<T::Sym as SymTree>::Concrete>
where
    T: TensorTree + ?Sized,
    F: Function<(T::Sym,), Output = Tracer>,
{
    hvp_fn(ByRef(f)).call((x, v))
}

/// `v^T H` by reverse over reverse; see [`VhpFn`] and [`hvp`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{vhp, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let v = Tensor::new(&[0f32, 1.], &Device::Cpu)?;
/// let vh = vhp(&|x: Tracer| x.powf(3.)?.sum_all(), &x, &v)?;
/// assert_eq!(vh.to_vec1::<f32>()?, vec![0., 12.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn vhp<F, T>(f: &F, x: &T, v: &T) -> Result<<T::Sym as SymTree>::Concrete>
where
    T: TensorTree + ?Sized,
    F: Function<(T::Sym,), Output = Tracer>,
{
    vhp_fn(ByRef(f)).call((x, v))
}
