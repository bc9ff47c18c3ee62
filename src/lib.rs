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
//! * The transforms: [`vmap`]; [`grad`], [`value_and_grad`] and [`vjp`]
//!   (reverse mode); [`jvp`] and [`linearize`] (forward mode); [`jacfwd`],
//!   [`jacrev`], [`hessian`], [`hvp`] and [`vhp`]; [`jit`] runs a traced
//!   function without transforming it. Each returns a
//!   [`transform::Transformed`] function with `.call` on tensors and the
//!   option setters (`conv_route`, `strict`, `seed`, `memory_limit`,
//!   `options`), except those that run at once on the tensors they are
//!   given, as JAX's do: [`vjp`] (the value and its pullback),
//!   [`linearize`] (the value and its linear map), [`jvp`] (the value and
//!   its tangent), [`hvp`] and [`vhp`] (the product); their composable
//!   forms are in [`jacobian`] (`jvp_fn`, `vjp_fn`, `hvp_fn`, `vhp_fn`).
//!   [`make_graph`] shows the graph a call runs.
//! * [`Options`]: a transform's settings as one value; [`Schedule`] (how
//!   a `vmap` runs its batch), [`ConvRoute`] (how a convolution with
//!   batched input and weight is lowered) and [`Randomness`] are its
//!   parts. Process-wide defaults are in [`settings`].
//! * [`custom_op`] and [`custom_op_with_rules`]: a candle function inside
//!   a trace, with the user's own derivative and batching rules.
//! * Modules: [`nn`] (layers, losses, `functional_call`), [`optim`]
//!   (SGD, Adam, AdamW over a `VarMap`, and any `candle_nn` optimiser),
//!   [`rng`] (the seeded and secure generator), [`dp`]
//!   (differentially private training), [`models`] (pretrained Hugging
//!   Face checkpoints: BERT, RoBERTa, GPT-2, the Llama family), [`transform`] (the transformed
//!   functions' types), [`jacobian`] (forward mode and the Jacobian
//!   family's types and `*_fn` forms), [`tree`] (argument trees and
//!   `in_dims`), [`settings`] (process-wide defaults), [`planner`] (what
//!   `Auto` measured, saved and loaded), [`graph`] (inspecting and running
//!   a traced graph), [`tracer`] (the traits behind `Tracer`'s
//!   arguments).
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
//! use candle_func::{grad, jacrev, vmap, Function, Tracer};
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
//! let g = grad(penalty).call(&Tensor::new(&[0f32, 1.], &dev)?)?;
//! assert_eq!(g.dims(), &[2]);
//! # Ok::<(), candle_func::Error>(())
//! ```

#![warn(missing_docs)]
#![warn(unnameable_types)]

// The layers, bottom to top: error (shared by all) <- env <- ir <- kernels
// <- rng <- trace <- rules <- interp <- ops <- transforms <- control <- optim
// <- nn <- dp <- models <- this root.
// Each imports only from those below it (tests/layering.rs keeps it so;
// rustfmt lists the declarations alphabetically). The public modules
// after the re-exports only re-export.
mod control;
pub mod dp;
mod env;
mod error;
mod interp;
mod ir;
mod kernels;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
pub mod rng;
mod rules;
mod trace;
mod transforms;

mod deprecated;

/// The README's and the chapters' code, run as doc-tests (`cargo test`),
/// so what a user copies from them compiles and runs.
#[cfg(doctest)]
mod doc_chapters {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/transforms.md")]
    struct Transforms;
    #[doc = include_str!("../docs/convolutions.md")]
    struct Convolutions;
    #[doc = include_str!("../docs/dp.md")]
    struct Dp;
    #[doc = include_str!("../docs/sequence_models.md")]
    struct SequenceModels;
    #[doc = include_str!("../docs/benchmarks.md")]
    struct Benchmarks;
    #[doc = include_str!("../docs/correctness.md")]
    struct Correctness;
    #[doc = include_str!("../docs/models.md")]
    struct Models;
}

pub use error::{Error, Result};
pub use interp::Prepared as Graph;
pub use ir::{ConvRoute, Options, Randomness, Schedule};
pub use ops::{custom_op, custom_op_with_rules, CustomRules};
pub use trace::Tracer;
pub use transforms::grad::{grad, value_and_grad, vjp};
pub use transforms::jacobian::{hessian, hvp, jacfwd, jacrev, vhp};
pub use transforms::jvp::{jvp, linearize};
pub use transforms::vmap::vmap;
pub use transforms::{jit, make_graph, Function};

#[allow(deprecated)]
pub use deprecated::*;

/// The transformed functions' types: what each transform returns (all one
/// generic [`Transformed`](transform::Transformed) wrapper around what the
/// transform does), and the markers that choose a gradient's arguments and
/// result.
pub mod transform {
    pub use crate::transforms::grad::{
        Argnums, Aux, Grad, GradOf, Nth, Plain, Pullback, Value, ValueAux, Wrt, Wrt2, Wrt3, Wrt4,
    };
    pub use crate::transforms::transformed::{Transform, Transformed};
    pub use crate::transforms::vmap::{Vmap, VmapOf};
    pub use crate::transforms::{Jit, JitOf};
}

/// Forward mode and the Jacobian family: the composable `*_fn` forms
/// (`jvp_fn(f)` and `vjp_fn(f)` as functions of primals and tangents or
/// cotangents, `hvp_fn` and `vhp_fn`) and the types the transforms at the
/// crate's root return ([`jacfwd`], [`hessian`],
/// [`linearize`], ...).
pub mod jacobian {
    pub use crate::transforms::jacobian::{
        hvp_fn, vhp_fn, Hessian, HessianOf, HvpFn, HvpOf, JacMode, Jacfwd, JacfwdOf, Jacrev, JacrevOf, VhpFn, VhpOf,
    };
    pub use crate::transforms::jvp::{
        jvp_fn, vjp_fn, JvpFn, JvpOf, Linearized, ValueAndLinear, ValueAndTangent, VjpFn, VjpOf,
    };
}

/// Arguments and results as trees: a tensor, tuples, `Vec`s and
/// `String`-keyed maps of trees ([`tree::TensorTree`] for
/// tensors, [`tree::SymTree`] for tracers), and `in_dims` /
/// `out_dims` given per argument or as a [`DimTree`](tree::DimTree).
pub mod tree {
    pub use crate::transforms::dims::{DimTree, Dims};
    pub use crate::transforms::tree::{ArgList, CallArgs, SymTree, TensorTree, TreeDef};
}

/// Process-wide defaults: what a transform uses for an option neither it
/// nor an enclosing transform sets (the route, strict mode, the random
/// stream), the capacities of the caches, and the warnings a call gave
/// ([`settings::capture_warnings`]).
pub mod settings {
    pub use crate::env::{PORTABLE_ENV, ROUTE_ENV};
    #[doc(hidden)]
    #[allow(deprecated)]
    pub use crate::transforms::settings::warned;
    pub use crate::transforms::settings::{
        auto_capacity, cache_capacity, capture_warnings, conv_route, manual_seed, set_auto_capacity,
        set_cache_capacity, set_conv_route, set_strict, strict, Warning, DEFAULT_AUTO_CAPACITY, DEFAULT_CACHE_CAPACITY,
    };
}

/// What `Auto` (the convolution route and the `vmap` schedule) measured and
/// chose, and its decisions saved to a file and loaded again.
pub mod planner {
    pub use crate::env::AUTO_CACHE_ENV;
    pub use crate::transforms::planner::{
        auto_choices, load_auto_cache, save_auto_cache, schedule_choices, AutoChoice, ScheduleChoice,
    };
}

/// A traced graph, as [`make_graph`] returns it: its
/// nodes and types, running it, and what a run held and how long each node
/// took.
pub mod graph {
    pub use crate::interp::Prepared as Graph;
    pub use crate::interp::{NodeTimes, RunStats};
    pub use crate::ir::{ConvGeom, CustomKernel, NodeView, TensorType};
}

/// Control flow inside a traced function, one node of the graph each
/// whatever the trip count, under every transform: [`scan`](loops::scan)
/// (JAX's `lax.scan`), [`fori_loop`](loops::fori_loop),
/// [`while_loop`](loops::while_loop), [`cond`](loops::cond) and [`switch`](loops::switch). The
/// recurrent layers of [`nn`] are built on `scan`.
pub mod loops {
    pub use crate::control::{cond, fori_loop, scan, scan_with, switch, while_loop, Branch, ScanOptions};
}

/// The traits behind [`Tracer`]'s arguments: an operand
/// that is a tracer or a captured tensor, an axis or a set of axes.
pub mod tracer {
    pub use crate::ops::{Axes, Axis};
    pub use crate::trace::{Operand, Tracer};
}
