//! What every transform shares, written once: [`Transformed`] wraps what a
//! transform does (a [`Transform`]: `vmap`'s batching, `grad`'s reverse
//! pass, a Jacobian, ...) with its options and its per-signature graph
//! cache, and gives it `.call` on tensors, the option setters and
//! `traced_signatures`. Changing a transform (its options or its own
//! settings) starts a fresh cache, in one place.

use super::tree::{ArgList, CallArgs, SymTree};
use super::{call_concrete, Function, GraphCache};
use crate::error::Result;
use crate::ir::options::{ConvRoute, Options};

/// What a transform does to the function it holds: how it is recorded
/// inside an enclosing trace, given the transform's options. [`Transformed`]
/// adds what every transform shares; implement this (and wrap the value
/// with [`Transformed::new`]) to write a transform of your own.
pub trait Transform<S: ArgList> {
    /// The symbolic result tree.
    type Output: SymTree;
    /// Records the transformed function applied to `args`, under `options`
    /// (the transform's own, before the enclosing trace's are inherited).
    fn apply(&self, options: &Options, args: S) -> Result<Self::Output>;
}

/// A transformed function: what the transform does (`T`), its
/// [`Options`], and the graphs it traced, one per input signature
/// (shared safely between threads). Every transform of the crate is one
/// (`Vmap<F>` is `Transformed<VmapOf<F>>`, and so on): `.call` runs it on
/// tensors, [`Function::apply`] inside another trace.
pub struct Transformed<T> {
    kind: T,
    options: Options,
    cache: GraphCache,
}

impl<T> Transformed<T> {
    /// `kind` with no options set.
    pub fn new(kind: T) -> Self {
        Transformed {
            kind,
            options: Options::new(),
            cache: GraphCache::default(),
        }
    }

    /// Calls the transformed function on concrete tensors: traced once per
    /// input signature (shapes, dtypes, device, options), then run.
    pub fn call<S, C>(&self, args: C) -> Result<<<Self as Function<S>>::Output as SymTree>::Concrete>
    where
        S: ArgList,
        Self: Function<S>,
        C: CallArgs<S>,
    {
        call_concrete(self, &self.cache, &args)
    }

    /// Number of input signatures traced so far.
    pub fn traced_signatures(&self) -> usize {
        self.cache.len()
    }

    /// All options at once, replacing those set before. Options a
    /// transform has no use for (a `vmap`'s `chunk_size` on a `grad`) are
    /// an error when it is traced, never silently ignored.
    pub fn options(self, options: Options) -> Self {
        self.with_options(|_| options)
    }

    /// The convolution route of the transforms inside (wins over the
    /// process-wide setting and the environment variable).
    pub fn conv_route(self, route: ConvRoute) -> Self {
        self.with_options(|o| o.conv_route(route))
    }

    /// Strict mode: a primitive without a batching rule is an error instead
    /// of a warning and a per-example loop.
    pub fn strict(self, on: bool) -> Self {
        self.with_options(|o| o.strict(on))
    }

    /// The seed of the random draws (see [`Options::seed`]).
    pub fn seed(self, seed: u64) -> Self {
        self.with_options(|o| o.seed(seed))
    }

    /// The most bytes a call may hold at once (see
    /// [`Options::memory_limit`]).
    pub fn memory_limit(self, bytes: usize) -> Self {
        self.with_options(|o| o.memory_limit(bytes))
    }

    /// The bytes a call on `args` would hold at its peak by its plan, with
    /// this transform's options changed by `edit`: traced and planned,
    /// neither cached nor run (a caller choosing a batch size by the plan).
    pub(crate) fn planned_peak<S, C>(&self, args: C, edit: impl FnOnce(Options) -> Options) -> Result<usize>
    where
        S: ArgList,
        T: Transform<S>,
        C: CallArgs<S>,
    {
        let probe = Edited {
            kind: &self.kind,
            options: edit(self.options),
        };
        super::planned_peak_of(&probe, &args)
    }

    /// These options changed by `f`, with a fresh cache.
    pub(crate) fn with_options(mut self, f: impl FnOnce(Options) -> Options) -> Self {
        self.options = f(self.options);
        self.cache = GraphCache::default(); // a changed transform traces anew
        self
    }

    /// The transform's own settings changed by `f`, with a fresh cache.
    pub(crate) fn edit(mut self, f: impl FnOnce(&mut T)) -> Self {
        f(&mut self.kind);
        self.cache = GraphCache::default();
        self
    }

    /// The same options around another kind (a `grad` made to return its
    /// value too, say), with a fresh cache.
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Transformed<U> {
        Transformed {
            kind: f(self.kind),
            options: self.options,
            cache: GraphCache::default(),
        }
    }
}

/// A transform under other options, for [`Transformed::planned_peak`].
struct Edited<'a, T> {
    kind: &'a T,
    options: Options,
}

impl<S: ArgList, T: Transform<S>> Function<S> for Edited<'_, T> {
    type Output = T::Output;

    fn apply(&self, args: S) -> Result<T::Output> {
        self.kind.apply(&self.options, args)
    }

    fn own_options(&self) -> Options {
        self.options
    }
}

impl<S: ArgList, T: Transform<S>> Function<S> for Transformed<T> {
    type Output = T::Output;

    fn apply(&self, args: S) -> Result<T::Output> {
        self.kind.apply(&self.options, args)
    }

    fn own_options(&self) -> Options {
        self.options
    }
}
