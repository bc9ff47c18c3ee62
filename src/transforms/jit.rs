//! [`jit`]: a function traced once per signature and run untransformed.

use super::transformed::{Transform, Transformed};
use super::tree::ArgList;
use super::Function;
use crate::error::Result;
use crate::ir::options::Options;

/// What [`jit`] does: nothing to the function but trace it once per input
/// signature and run it.
pub struct JitOf<F> {
    f: F,
}

/// The function traced once per input signature and run by the interpreter,
/// with no transform (JAX's `jit`): a way to run a traced model on concrete
/// tensors, and the per-example oracle that `vmap` is tested against. Its
/// options (route, strict mode, seed, memory limit) are inherited by the
/// transforms inside.
pub type Jit<F> = Transformed<JitOf<F>>;

/// Wraps `f` so it can be called on concrete tensors (see [`Jit`]).
pub fn jit<F>(f: F) -> Jit<F> {
    Transformed::new(JitOf { f })
}

impl<S: ArgList, F: Function<S>> Transform<S> for JitOf<F> {
    type Output = F::Output;
    fn apply(&self, options: &Options, args: S) -> Result<F::Output> {
        // Inside another trace a jit is transparent; its options apply when
        // it is the function called on tensors.
        options.check_not_vmap("jit")?;
        self.f.apply(args)
    }
}
