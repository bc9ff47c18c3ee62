//! Hand-written compute kernels that candle lacks or that per-sample
//! gradients need in explicit form.
//!
//! * [`unfold`]: im2col / col2im for 1-, 2- and 3-d windows and a
//!   convolution built on them (multi-threaded CPU kernels for f32/f64, a
//!   generic candle-op fallback everywhere else).

pub mod unfold;

pub use unfold::{conv_unfold, fold, fold_generic, unfold as unfold_nd, unfold_generic, ConvGeom};
