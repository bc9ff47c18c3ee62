//! # candle-func
//!
//! Composable function transforms for [candle](https://github.com/huggingface/candle),
//! in the style of JAX and `torch.func`: [`vmap`] vectorises a function over a
//! batch axis, [`grad`] differentiates it, and transforms nest:
//! `vmap(grad(loss))` gives per-sample gradients. A function is traced once per input
//! signature into a small graph IR, rewritten by per-primitive rules, and
//! run by an interpreter on candle tensors.
//!
//! ## Quick start
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_func::{grad, vmap, ConvRoute, Tracer};
//!
//! let dev = Device::Cpu;
//! // A tiny per-example model: conv -> relu -> global sum -> linear.
//! let w = Tensor::randn(0f32, 1., (4, 1, 3, 3), &dev)?;
//! let fc = Tensor::randn(0f32, 1., (4, 2), &dev)?;
//! let model = |x: Tracer| -> candle_func::Result<Tracer> {
//!     // x: [1, 8, 8] for one example; add the N axis candle's conv wants.
//!     let h = x.unsqueeze(0)?.conv2d(&w, 1, 1, 1, 1)?.relu()?; // [1, 4, 8, 8]
//!     h.sum([2, 3])?.matmul(&fc)?.squeeze(0)                  // [2]
//! };
//! let xs = Tensor::randn(0f32, 1., (16, 1, 8, 8), &dev)?;
//! let ys = vmap(model).call(&xs)?;
//! assert_eq!(ys.dims(), &[16, 2]);
//!
//! // Ensembling: five models' filters stacked on a leading axis, one batch.
//! let ws = Tensor::randn(0f32, 1., (5, 4, 1, 3, 3), &dev)?;
//! let ensemble = vmap(|w: Tracer, x: Tracer| x.conv2d(&w, 0, 1, 1, 1))
//!     .in_dims([Some(0), None])
//!     .conv_route(ConvRoute::Unfold);
//! let out = ensemble.call((&ws, &xs))?;
//! assert_eq!(out.dims(), &[5, 16, 4, 6, 6]);
//!
//! // Per-sample gradients: the gradient of each example's own loss.
//! let loss = |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv2d(&w, 1, 1, 1, 1)?.sqr()?.mean_all();
//! let per_sample = vmap(grad(loss)).in_dims([None, Some(0)]).call((&w, &xs))?;
//! assert_eq!(per_sample.dims(), &[16, 4, 1, 3, 3]);
//! # Ok::<(), candle_func::Error>(())
//! ```
//!
//! ## Pieces
//!
//! * [`Tracer`]: the symbolic tensor a traced closure receives; its methods
//!   mirror candle's `Tensor` and check shapes as they record.
//! * [`vmap`] with `in_dims`, `out_dims`, `chunk_size`, `conv_route`,
//!   `strict`, `randomness`, `seed`; [`grad`], [`value_and_grad`] and
//!   [`vjp`] for reverse mode; [`jit`] runs a traced function without
//!   transforming it; [`make_graph`] shows the graph a call runs (and
//!   [`Graph::run`] runs it).
//! * [`Schedule`]: whether a `vmap` runs its batch batched, the unbatched
//!   graph once per example, or its convolutions per example and the rest
//!   batched (`Auto`, the default, measures a large program every way).
//! * [`Options`]: a transform's settings as one value. A transform nested
//!   in another inherits the route and strict mode it does not set;
//!   [`set_conv_route`], `CANDLE_FUNC_CONV_ROUTE`, [`set_strict`] and
//!   [`manual_seed`] are process-wide defaults only.
//! * [`ConvRoute`]: how a convolution with batched input and weight is
//!   lowered (grouped convolution, unfold + batched matmul, or a loop).
//! * Forward mode and the Jacobian family: [`jvp`], [`jvp_fn`],
//!   [`linearize`], [`vjp_fn`], [`jacfwd`], [`jacrev`] (with `argnums`,
//!   `has_aux`, `chunk_size`), [`hessian`], [`hvp`] and [`vhp`]; custom
//!   derivative and batching rules for an opaque kernel with
//!   [`custom_op_with_rules`].
//! * Arguments and results are trees: a tensor, tuples, `Vec`s and
//!   `String`-keyed maps of trees ([`TensorTree`], [`SymTree`]);
//!   `in_dims`/`out_dims` may be a [`DimTree`] per argument.
//!
//! ## Transforms inside a traced function
//!
//! Every transform is a [`Function`]: `.call` runs it on tensors, and
//! [`Function::apply`] calls it on the symbolic tensors of an enclosing
//! trace, so a transform can be used in the middle of a traced closure
//! (here a gradient step inside a function that `vmap` batches, and a
//! Jacobian inside a loss). The arguments go as a tuple, one element per
//! parameter of the function.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_func::{grad, jacrev, jit, vmap, Function, Tracer};
//! let dev = Device::Cpu;
//! let loss = |w: Tracer, x: Tracer| w.mul(&x)?.sum_all()?.sqr();
//! // one SGD step per example, batched: w - 0.25 * grad(loss)(w, x)
//! let step = |w: Tracer, x: Tracer| {
//!     let g = Function::apply(&grad(loss), (w.clone(), x))?;
//!     w.sub(&g.affine(0.25, 0.)?)
//! };
//! let w = Tensor::new(&[1f32, 1.], &dev)?;
//! let xs = Tensor::new(&[[1f32, 0.], [0., 2.]], &dev)?;
//! let ws = vmap(step).in_dims([None, Some(0)]).call((&w, &xs))?;
//! assert_eq!(ws.to_vec2::<f32>()?, vec![vec![0.5, 1.], vec![1., -1.]]);
//! // a penalty on the Jacobian's norm, itself differentiable
//! let penalty = |x: Tracer| Function::apply(&jacrev(|x: Tracer| x.tanh()), (x,))?.sqr()?.sum_all();
//! let g = jit(grad(penalty)).call(&Tensor::new(&[0f32, 1.], &dev)?)?;
//! assert_eq!(g.dims(), &[2]);
//! # Ok::<(), candle_func::Error>(())
//! ```

#![warn(missing_docs)]
#![warn(unnameable_types)]

// The layers, bottom to top; each imports only from those above it in
// this list (tests/layering.rs keeps it so).
pub mod dp;
mod error;
mod interp;
mod ir;
mod kernels;
pub mod nn;
mod ops;
mod rules;
mod trace;
mod transforms;

pub use error::{Error, Result};
pub use interp::{NodeTimes, RunStats};
pub use ir::{ConvGeom, ConvRoute, CustomKernel, Graph, NodeView, Options, Randomness, Schedule, TensorType};
pub use ops::{custom_op, custom_op_with_rules, Axes, Axis, CustomRules};
pub use trace::{Operand, Tracer};
pub use transforms::dims::{DimTree, Dims};
pub use transforms::grad::{
    grad, value_and_grad, vjp, Argnums, Aux, Grad, Nth, Plain, Pullback, Value, ValueAux, Wrt, Wrt2, Wrt3, Wrt4,
};
pub use transforms::jacobian::{
    hessian, hvp, hvp_fn, jacfwd, jacrev, vhp, vhp_fn, Hessian, HvpFn, JacMode, Jacfwd, Jacrev, VhpFn,
};
pub use transforms::jvp::{jvp, jvp_fn, linearize, vjp_fn, JvpFn, Linearized, ValueAndLinear, ValueAndTangent, VjpFn};
pub use transforms::planner::{
    auto_choices, load_auto_cache, save_auto_cache, schedule_choices, AutoChoice, ScheduleChoice,
};
#[doc(hidden)]
pub use transforms::settings::warned;
pub use transforms::settings::{
    auto_capacity, cache_capacity, conv_route, manual_seed, set_auto_capacity, set_cache_capacity, set_conv_route,
    set_strict, strict, DEFAULT_AUTO_CAPACITY, DEFAULT_CACHE_CAPACITY, ROUTE_ENV,
};
pub use transforms::tree::{ArgList, CallArgs, SymTree, TensorTree, TreeDef};
pub use transforms::vmap::{vmap, Vmap};
pub use transforms::{jit, make_graph, Function, Jit};
