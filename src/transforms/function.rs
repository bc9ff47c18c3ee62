//! The traceable function: the [`Function`] trait, its closure impls, and
//! [`ByRef`], a borrowed function.

use super::tree::{ArgList, SymTree};
use crate::error::Result;
use crate::ir::options::Options;

/// A function that can be traced: given symbolic arguments (a tuple with
/// one tree per parameter) it records its computation and returns a tree of
/// symbolic results. Implemented for closures of one to four parameters
/// returning `Result<tree>`, and for every transform, so transforms nest:
/// `vmap(vmap(f))`, `vmap(jit(f))`. A transform of a `Send + Sync` function
/// is itself `Send + Sync`; closures that capture symbolic tensors of an
/// enclosing trace are not, and need not be.
pub trait Function<S: ArgList> {
    /// The symbolic result tree.
    type Output: SymTree;
    /// Records the function applied to `args`.
    fn apply(&self, args: S) -> Result<Self::Output>;

    /// The options this function sets for the transforms it nests, when it
    /// is the one called on tensors (none for a plain closure).
    fn own_options(&self) -> Options {
        Options::new()
    }
}

macro_rules! closure_functions {
    ($($a:ident),+) => {
        impl<F, R, $($a),+> Function<($($a,)+)> for F
        where
            F: Fn($($a),+) -> Result<R>,
            R: SymTree,
            $($a: SymTree),+
        {
            type Output = R;
            #[allow(non_snake_case)]
            fn apply(&self, ($($a,)+): ($($a,)+)) -> Result<R> {
                self($($a),+)
            }
        }
    };
}

/// Borrows a function as a function (transforms take theirs by value): what
/// a transform builds around a function it holds, anew at each trace.
pub(crate) struct ByRef<'a, F>(pub(crate) &'a F);

impl<S: ArgList, F: Function<S>> Function<S> for ByRef<'_, F> {
    type Output = F::Output;
    fn apply(&self, args: S) -> Result<F::Output> {
        self.0.apply(args)
    }

    fn own_options(&self) -> Options {
        self.0.own_options()
    }
}

closure_functions!(A);
closure_functions!(A, B);
closure_functions!(A, B, C);
closure_functions!(A, B, C, D);
