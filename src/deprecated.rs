//! The names the crate's root held before its public items moved into
//! modules that say what they are, kept for one release so programs
//! written against it still build, each with a deprecation note naming
//! its new path. Functions and types warn where they are used; traits
//! (which Rust can neither alias nor deprecate through a re-export) are
//! re-exported as they were and listed in the CHANGELOG. None is shown in
//! the documentation.

#![allow(deprecated)]

use crate::error::Result;
use crate::ir::ConvRoute;
use crate::transforms;
use std::path::Path;

macro_rules! moved_type {
    ($name:ident $(<$($g:tt),*>)? => $new:literal, $path:ty) => {
        #[doc(hidden)]
        #[deprecated(since = "0.2.0", note = $new)]
        pub type $name $(<$($g),*>)? = $path;
    };
}

moved_type!(NodeTimes => "moved to candle_func::graph::NodeTimes", crate::interp::NodeTimes);
moved_type!(RunStats => "moved to candle_func::graph::RunStats", crate::interp::RunStats);
moved_type!(ConvGeom => "moved to candle_func::graph::ConvGeom", crate::ir::ConvGeom);
moved_type!(CustomKernel => "moved to candle_func::graph::CustomKernel", crate::ir::CustomKernel);
moved_type!(NodeView<'a> => "moved to candle_func::graph::NodeView", crate::ir::NodeView<'a>);
moved_type!(TensorType => "moved to candle_func::graph::TensorType", crate::ir::TensorType);
moved_type!(DimTree => "moved to candle_func::tree::DimTree", transforms::dims::DimTree);
moved_type!(Dims => "moved to candle_func::tree::Dims", transforms::dims::Dims);
moved_type!(TreeDef => "moved to candle_func::tree::TreeDef", transforms::tree::TreeDef);
moved_type!(Plain => "moved to candle_func::transform::Plain", transforms::grad::Plain);
moved_type!(Aux => "moved to candle_func::transform::Aux", transforms::grad::Aux);
moved_type!(Value => "moved to candle_func::transform::Value", transforms::grad::Value);
moved_type!(ValueAux => "moved to candle_func::transform::ValueAux", transforms::grad::ValueAux);
moved_type!(Vmap<F> => "moved to candle_func::transform::Vmap", transforms::vmap::Vmap<F>);
moved_type!(Jit<F> => "moved to candle_func::transform::Jit", transforms::Jit<F>);
moved_type!(JvpFn<F> => "moved to candle_func::jacobian::JvpFn", transforms::jvp::JvpFn<F>);
moved_type!(VjpFn<F> => "moved to candle_func::jacobian::VjpFn", transforms::jvp::VjpFn<F>);
moved_type!(HvpFn<F> => "moved to candle_func::jacobian::HvpFn", transforms::jacobian::HvpFn<F>);
moved_type!(VhpFn<F> => "moved to candle_func::jacobian::VhpFn", transforms::jacobian::VhpFn<F>);
moved_type!(AutoChoice => "moved to candle_func::planner::AutoChoice", transforms::planner::AutoChoice);
moved_type!(ScheduleChoice => "moved to candle_func::planner::ScheduleChoice", transforms::planner::ScheduleChoice);

/// Moved to `candle_func::transform::Pullback`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Pullback")]
pub type Pullback<S> = transforms::grad::Pullback<S>;

/// Moved to `candle_func::transform::Grad`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Grad")]
pub type Grad<F, W = transforms::grad::Wrt<0>, M = transforms::grad::Plain> = transforms::grad::Grad<F, W, M>;

/// Moved to `candle_func::transform::Wrt`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Wrt")]
pub type Wrt<const I: usize> = transforms::grad::Wrt<I>;

/// Moved to `candle_func::transform::Wrt2`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Wrt2")]
pub type Wrt2<const I: usize, const J: usize> = transforms::grad::Wrt2<I, J>;

/// Moved to `candle_func::transform::Wrt3`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Wrt3")]
pub type Wrt3<const I: usize, const J: usize, const K: usize> = transforms::grad::Wrt3<I, J, K>;

/// Moved to `candle_func::transform::Wrt4`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::transform::Wrt4")]
pub type Wrt4<const I: usize, const J: usize, const K: usize, const L: usize> = transforms::grad::Wrt4<I, J, K, L>;

/// Moved to `candle_func::jacobian::Jacfwd`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::Jacfwd")]
pub type Jacfwd<F, W = transforms::grad::Wrt<0>, M = transforms::grad::Plain> = transforms::jacobian::Jacfwd<F, W, M>;

/// Moved to `candle_func::jacobian::Jacrev`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::Jacrev")]
pub type Jacrev<F, W = transforms::grad::Wrt<0>, M = transforms::grad::Plain> = transforms::jacobian::Jacrev<F, W, M>;

/// Moved to `candle_func::jacobian::Hessian`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::Hessian")]
pub type Hessian<F, W = transforms::grad::Wrt<0>> = transforms::jacobian::Hessian<F, W>;

/// Moved to `candle_func::jacobian::Linearized`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::Linearized")]
pub type Linearized<S, O> = transforms::jvp::Linearized<S, O>;

/// Moved to `candle_func::jacobian::ValueAndLinear`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::ValueAndLinear")]
pub type ValueAndLinear<S, O> = transforms::jvp::ValueAndLinear<S, O>;

/// Moved to `candle_func::jacobian::ValueAndTangent`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::ValueAndTangent")]
pub type ValueAndTangent<O> = transforms::jvp::ValueAndTangent<O>;

// Traits cannot be aliased, and a re-export cannot be deprecated: these
// keep their old paths silently (the CHANGELOG lists their new ones).
#[doc(hidden)]
pub use crate::ops::{Axes, Axis};
#[doc(hidden)]
pub use crate::trace::Operand;
#[doc(hidden)]
pub use transforms::grad::{Argnums, Nth};
#[doc(hidden)]
pub use transforms::jacobian::JacMode;
#[doc(hidden)]
pub use transforms::tree::{ArgList, CallArgs, SymTree, TensorTree};

/// Moved to `candle_func::settings::ROUTE_ENV`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::settings::ROUTE_ENV")]
pub const ROUTE_ENV: &str = crate::env::ROUTE_ENV;

/// Moved to `candle_func::settings::DEFAULT_CACHE_CAPACITY`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::settings::DEFAULT_CACHE_CAPACITY")]
pub const DEFAULT_CACHE_CAPACITY: usize = transforms::settings::DEFAULT_CACHE_CAPACITY;

/// Moved to `candle_func::settings::DEFAULT_AUTO_CAPACITY`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::settings::DEFAULT_AUTO_CAPACITY")]
pub const DEFAULT_AUTO_CAPACITY: usize = transforms::settings::DEFAULT_AUTO_CAPACITY;

macro_rules! moved_fn {
    ($name:ident ($($arg:ident: $t:ty),*) $(-> $ret:ty)? => $new:literal, $path:path) => {
        #[doc(hidden)]
        #[deprecated(since = "0.2.0", note = $new)]
        pub fn $name($($arg: $t),*) $(-> $ret)? {
            $path($($arg),*)
        }
    };
}

moved_fn!(set_cache_capacity(signatures: usize) => "moved to candle_func::settings::set_cache_capacity", transforms::settings::set_cache_capacity);
moved_fn!(cache_capacity() -> usize => "moved to candle_func::settings::cache_capacity", transforms::settings::cache_capacity);
moved_fn!(set_auto_capacity(decisions: usize) => "moved to candle_func::settings::set_auto_capacity", transforms::settings::set_auto_capacity);
moved_fn!(auto_capacity() -> usize => "moved to candle_func::settings::auto_capacity", transforms::settings::auto_capacity);
moved_fn!(set_strict(on: bool) => "moved to candle_func::settings::set_strict", transforms::settings::set_strict);
moved_fn!(strict() -> bool => "moved to candle_func::settings::strict", transforms::settings::strict);
moved_fn!(set_conv_route(route: Option<ConvRoute>) => "moved to candle_func::settings::set_conv_route", transforms::settings::set_conv_route);
moved_fn!(conv_route() -> Result<ConvRoute> => "moved to candle_func::settings::conv_route", transforms::settings::conv_route);
moved_fn!(manual_seed(seed: u64) => "moved to candle_func::settings::manual_seed", transforms::settings::manual_seed);
moved_fn!(auto_choices() -> Vec<transforms::planner::AutoChoice> => "moved to candle_func::planner::auto_choices", transforms::planner::auto_choices);
moved_fn!(schedule_choices() -> Vec<transforms::planner::ScheduleChoice> => "moved to candle_func::planner::schedule_choices", transforms::planner::schedule_choices);

/// Moved to `candle_func::planner::save_auto_cache`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::planner::save_auto_cache")]
pub fn save_auto_cache(path: impl AsRef<Path>) -> Result<()> {
    transforms::planner::save_auto_cache(path)
}

/// Moved to `candle_func::planner::load_auto_cache`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::planner::load_auto_cache")]
pub fn load_auto_cache(path: impl AsRef<Path>) -> Result<usize> {
    transforms::planner::load_auto_cache(path)
}

/// Moved to `candle_func::jacobian::jvp_fn`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::jvp_fn")]
pub fn jvp_fn<F>(f: F) -> transforms::jvp::JvpFn<F> {
    transforms::jvp::jvp_fn(f)
}

/// Moved to `candle_func::jacobian::vjp_fn`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::vjp_fn")]
pub fn vjp_fn<F>(f: F) -> transforms::jvp::VjpFn<F> {
    transforms::jvp::vjp_fn(f)
}

/// Moved to `candle_func::jacobian::hvp_fn`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::hvp_fn")]
pub fn hvp_fn<F>(f: F) -> transforms::jacobian::HvpFn<F> {
    transforms::jacobian::hvp_fn(f)
}

/// Moved to `candle_func::jacobian::vhp_fn`.
#[doc(hidden)]
#[deprecated(since = "0.2.0", note = "moved to candle_func::jacobian::vhp_fn")]
pub fn vhp_fn<F>(f: F) -> transforms::jacobian::VhpFn<F> {
    transforms::jacobian::vhp_fn(f)
}

#[doc(hidden)]
#[allow(deprecated)]
pub use transforms::settings::warned;
