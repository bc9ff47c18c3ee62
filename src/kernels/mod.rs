//! Hand-written compute kernels that candle lacks or that per-sample
//! gradients need in explicit form.
//!
//! * [`mod@unfold`]: im2col / col2im ([`unfold::unfold`] / [`unfold::fold`])
//!   for 1-, 2- and 3-d windows and a convolution built on them
//!   ([`unfold::conv_unfold`]): multi-threaded CPU kernels for f32/f64, a
//!   generic candle-op fallback everywhere else.

pub mod unfold;

// The function `unfold` shares its name with the module; they live in
// different namespaces, so both `kernels::unfold` paths work.
pub use unfold::{conv_unfold, fold, fold_generic, unfold, unfold_generic, ConvGeom};
