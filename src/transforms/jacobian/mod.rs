//! The Jacobian family, as `torch.func` has it: `jacfwd` (a `vmap` of
//! forward mode over the input basis), `jacrev` (a `vmap` of reverse mode
//! over the output basis), `hessian` (`jacfwd` of `jacrev`), and the
//! Hessian-vector products `hvp` (forward over reverse) and `vhp` (reverse
//! over reverse). Arguments and results are trees; a Jacobian has, for
//! each output leaf, a tree like the differentiated arguments whose leaves
//! are `[*out, *in]` ([`SymTree::Nest`]). All are [`Function`]s, so they
//! nest under `vmap` (per-example Jacobians) and each other.

use super::grad::{grad, Argnums, Aux, Plain, Wrt, Wrt2, Wrt3, Wrt4};
use super::jvp::named_jvp_fn;
use super::transformed::{Transform, Transformed};
use super::tree::{leaves_of, ArgList, SymTree};
use super::vmap::{vmap, Vmap};
use super::{ByRef, Function};
use crate::error::{CandleContext, Error, Result};
use crate::ir::options::Options;
use crate::trace::{Operand, Tracer};
use candle_core::Tensor;
use std::marker::PhantomData;

mod hvp;
pub use hvp::{hvp, hvp_fn, vhp, vhp_fn, HvpFn, HvpOf, VhpFn, VhpOf};

/// Whether a Jacobian's function returns its value alone ([`Plain`]) or
/// `(value, aux)` ([`Aux`], after `.has_aux()`), and how the result
/// carries the aux: `jacobian` or `(jacobian, aux)`, as `torch.func`.
pub trait JacMode<T> {
    /// The differentiated part of the function's result.
    type Main: SymTree;
    /// The auxiliary part (`()` for [`Plain`]).
    type Aux;
    /// The transform's result for a Jacobian of type `J`.
    type With<J: SymTree>: SymTree;
    /// Splits the function's result.
    fn split(t: T) -> (Self::Main, Self::Aux);
    /// Joins the Jacobian and the aux.
    fn join<J: SymTree>(j: J, aux: Self::Aux) -> Self::With<J>;
}

impl<T: SymTree> JacMode<T> for Plain {
    type Main = T;
    type Aux = ();
    type With<J: SymTree> = J;
    fn split(t: T) -> (T, ()) {
        (t, ())
    }
    fn join<J: SymTree>(j: J, _: ()) -> J {
        j
    }
}

impl<O: SymTree, A: SymTree> JacMode<(O, A)> for Aux {
    type Main = O;
    type Aux = A;
    type With<J: SymTree> = (J, A);
    fn split(t: (O, A)) -> (O, A) {
        t
    }
    fn join<J: SymTree>(j: J, aux: A) -> (J, A) {
        (j, aux)
    }
}

/// The arguments split into the differentiated leaves (in `argnums`
/// order) and the rest, and put back together.
struct Split {
    counts: Vec<usize>,
    sel: Vec<usize>,
}

impl Split {
    fn new(op: &'static str, leaves: &[Vec<Tracer>], sel: Vec<usize>) -> Result<Split> {
        if (1..sel.len()).any(|i| sel[..i].contains(&sel[i])) {
            return Err(Error::Tree {
                msg: format!("{op}: argnums {sel:?} name an argument twice"),
            });
        }
        let split = Split {
            counts: leaves.iter().map(Vec::len).collect(),
            sel,
        };
        for t in split.sel.iter().flat_map(|&i| &leaves[i]) {
            if !t.dtype().is_float() {
                return Err(Error::DType {
                    op,
                    dtypes: vec![t.dtype()],
                    msg:
                        "the Jacobian is taken with respect to floating-point tensors only (choose others with argnums)"
                            .into(),
                });
            }
        }
        Ok(split)
    }

    /// The selected arguments' leaves, then the others'.
    fn take(&self, leaves: Vec<Vec<Tracer>>) -> (Vec<Tracer>, Vec<Tracer>) {
        let sel = self.sel.iter().flat_map(|&i| leaves[i].clone()).collect();
        let rest = leaves
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !self.sel.contains(i))
            .flat_map(|(_, l)| l)
            .collect();
        (sel, rest)
    }

    /// The inverse of `take`.
    fn merge(&self, sel: Vec<Tracer>, rest: Vec<Tracer>) -> Vec<Vec<Tracer>> {
        let mut args: Vec<Vec<Tracer>> = vec![Vec::new(); self.counts.len()];
        let mut sel = sel.into_iter();
        for &i in &self.sel {
            args[i] = (&mut sel).take(self.counts[i]).collect();
        }
        let mut rest = rest.into_iter();
        for (i, arg) in args.iter_mut().enumerate() {
            if !self.sel.contains(&i) {
                *arg = (&mut rest).take(self.counts[i]).collect();
            }
        }
        args
    }
}

/// What a Jacobian transform of `F` (over `W`, in mode `M`) returns.
type JacOf<S, F, W, M> = <M as JacMode<<F as Function<S>>::Output>>::With<
    <<M as JacMode<<F as Function<S>>::Output>>::Main as SymTree>::Nest<<W as Argnums<S>>::Grads>,
>;

/// A Jacobian's function evaluated once at its arguments: the
/// differentiated leaves and the rest, the outputs and their structure,
/// and the aux; and the function again at other leaves.
struct Prepared<'a, S, F: Function<S>, M: JacMode<F::Output>>
where
    S: ArgList,
{
    f: &'a F,
    defs: Vec<super::tree::TreeDef>,
    split: Split,
    sel: Vec<Tracer>,
    rest: Vec<Tracer>,
    outs: Vec<Tracer>,
    out_def: super::tree::TreeDef,
    aux: M::Aux,
}

impl<'a, S: ArgList, F: Function<S>, M: JacMode<F::Output>> Prepared<'a, S, F, M> {
    fn new(op: &'static str, f: &'a F, args: S, argnums: Vec<usize>) -> Result<Self> {
        let (leaves, defs) = args.flatten_args();
        let split = Split::new(op, &leaves, argnums)?;
        let (sel, rest) = split.take(leaves);
        let (main, aux) = M::split(f.apply(S::unflatten_args(&defs, split.merge(sel.clone(), rest.clone()))?)?);
        let (outs, out_def) = leaves_of(&main);
        float_outputs(op, &outs)?;
        Ok(Prepared {
            f,
            defs,
            split,
            sel,
            rest,
            outs,
            out_def,
            aux,
        })
    }

    /// The Jacobian from its blocks (for each output leaf, each selected
    /// argument leaf's), with the aux.
    fn finish<W: Argnums<S>>(self, blocks: Vec<Tracer>) -> Result<JacOf<S, F, W, M>> {
        let def = self.out_def.graft(&W::def(&self.defs));
        let j = <M::Main as SymTree>::Nest::<W::Grads>::unflatten_from(&def, &mut blocks.into_iter())?;
        Ok(M::join(j, self.aux))
    }

    /// The output leaves at other argument leaves.
    fn outs_at(&self, sel: Vec<Tracer>, rest: Vec<Tracer>) -> Result<Vec<Tracer>> {
        let out = self
            .f
            .apply(S::unflatten_args(&self.defs, self.split.merge(sel, rest))?)?;
        Ok(leaves_of(&M::split(out).0).0)
    }
}

fn float_outputs(op: &'static str, outs: &[Tracer]) -> Result<()> {
    match outs.iter().find(|t| !t.dtype().is_float()) {
        Some(t) => Err(Error::DType {
            op,
            dtypes: vec![t.dtype()],
            msg: format!(
                "the function returns a {:?} tensor of shape {:?}: Jacobians of floating-point results only",
                t.dtype(),
                t.dims()
            ),
        }),
        None => Ok(()),
    }
}

fn numel(t: &Tracer) -> usize {
    t.dims().iter().product()
}

/// The standard basis over all of `leaves`' elements, one block per leaf:
/// leaf `k` gets `[n, *dims_k]`, row `i` one-hot where element `i` of the
/// concatenated leaves falls in leaf `k` (`n` the total element count).
/// The `n x n` values are checked against the memory there is first (a
/// Jacobian with respect to a million parameters by `jacfwd` needs 4 TB).
fn basis(op: &'static str, leaves: &[Tracer]) -> Result<Vec<Tracer>> {
    let n: usize = leaves.iter().map(numel).sum();
    let bytes = leaves.iter().try_fold(0usize, |acc, t| {
        n.checked_mul(numel(t))?
            .checked_mul(t.dtype().size_in_bytes())?
            .checked_add(acc)
    });
    // the limit the call runs under (set on an enclosing transform), else
    // the machine's memory (`env`'s one meaning at trace time)
    let machine = leaves.first().map(|t| t.b.borrow().given.machine()).unwrap_or_default();
    let needed = bytes.unwrap_or(usize::MAX);
    if !machine.plan_fits(needed) {
        let limit = machine.trace_bytes().unwrap_or(usize::MAX);
        let msg = format!(
            "the standard basis of {n} x {n} elements needs {needed} bytes, more than the {limit} allowed; differentiate with respect to fewer elements (argnums), or use the other mode"
        );
        return Err(Error::unsupported("jacobian basis", op, msg));
    }
    let mut at = 0;
    let mut blocks = Vec::with_capacity(leaves.len());
    for t in leaves {
        let (k, dev) = (numel(t), t.device());
        // [n, k]: zeros above and below the identity of this leaf's rows
        let block = Tensor::zeros((at, k), t.dtype(), &dev)
            .and_then(|above| {
                let eye = Tensor::eye(k, t.dtype(), &dev)?;
                let below = Tensor::zeros((n - at - k, k), t.dtype(), &dev)?;
                Tensor::cat(&[&above, &eye, &below], 0)?.reshape([&[n], t.dims()].concat())
            })
            .op("jacobian basis")?;
        blocks.push(block.to_tracer(t)?);
        at += k;
    }
    Ok(blocks)
}

/// `[n, *out]` with the basis axis first, as `[*out, *in]` (`n` the
/// input's size): moves axis 0 to the end and splits it.
fn basis_last(t: Tracer, split: &[usize]) -> Result<Tracer> {
    let r = t.rank();
    let perm: Vec<usize> = (1..r).chain(std::iter::once(0)).collect();
    let moved = t.permute(&perm)?;
    let lead = moved.dims()[..r - 1].to_vec();
    moved.reshape([&lead[..], split].concat())
}

/// Zeros `[*out, *in]`: the Jacobian where either side has no elements
/// (a `vmap` over an empty basis has nothing to batch).
fn empty_block(out: &Tracer, inp: &Tracer) -> Result<Tracer> {
    Tensor::zeros([out.dims(), inp.dims()].concat(), out.dtype(), &out.device())
        .op("jacobian")?
        .to_tracer(out)
}

/// A `vmap` over the basis (the last argument), the rest unbatched, with
/// the Jacobian transform's options.
fn over_basis<G>(g: G, n_args: usize, chunk: Option<usize>, options: &Options) -> Vmap<G> {
    let mut dims = vec![None; n_args];
    dims.push(Some(0usize));
    let v = vmap(g).in_dims(dims).options(*options);
    match chunk {
        Some(k) => v.chunk_size(k),
        None => v,
    }
}

macro_rules! argnum_methods {
    ($ty:ident, $kind:ident) => {
        impl<F, W, M> $ty<F, W, M> {
            fn with<W2, M2>(self) -> $ty<F, W2, M2> {
                self.map(|k| $kind {
                    f: k.f,
                    chunk: k.chunk,
                    _sel: PhantomData,
                })
            }

            /// Differentiate with respect to argument `I` (default 0).
            pub fn argnum<const I: usize>(self) -> $ty<F, Wrt<I>, M> {
                self.with()
            }

            /// Differentiate with respect to arguments `I` and `J`: each
            /// output leaf's Jacobian is a pair.
            pub fn argnums<const I: usize, const J: usize>(self) -> $ty<F, Wrt2<I, J>, M> {
                self.with()
            }

            /// Differentiate with respect to arguments `I`, `J` and `K`.
            pub fn argnums3<const I: usize, const J: usize, const K: usize>(self) -> $ty<F, Wrt3<I, J, K>, M> {
                self.with()
            }

            /// Differentiate with respect to arguments `I`, `J`, `K`, `L`.
            pub fn argnums4<const I: usize, const J: usize, const K: usize, const L: usize>(
                self,
            ) -> $ty<F, Wrt4<I, J, K, L>, M> {
                self.with()
            }

            /// Computes the Jacobian's rows (or columns) `k` at a time, as
            /// `vmap`'s `chunk_size`, bounding memory (`torch.func`'s
            /// `chunk_size`; `k > 0`).
            pub fn chunk_size(self, k: usize) -> Self {
                self.edit(|kind| kind.chunk = Some(k))
            }
        }

        impl<F, W> $ty<F, W, Plain> {
            /// The function returns `(value, aux)`: the Jacobian is of
            /// the value, and the result becomes `(jacobian, aux)`.
            pub fn has_aux(self) -> $ty<F, W, Aux> {
                self.with()
            }
        }
    };
}

/// What [`jacfwd`] does: one JVP per input element, batched by `vmap`
/// (`chunk` of them at a time, if set).
pub struct JacfwdOf<F, W = Wrt<0>, M = Plain> {
    f: F,
    chunk: Option<usize>,
    _sel: PhantomData<fn() -> (W, M)>,
}

/// The Jacobian of `f` by forward mode, like `torch.func.jacfwd`: one JVP
/// per input element, batched by `vmap`; the cheaper direction where
/// inputs are fewer than outputs. Made by [`jacfwd`].
pub type Jacfwd<F, W = Wrt<0>, M = Plain> = Transformed<JacfwdOf<F, W, M>>;

/// See [`Jacfwd`]. With respect to argument 0 by default (choose others
/// with `argnum`/`argnums`); for each output leaf a tree like the
/// differentiated arguments, with leaves `[*out, *in]`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jacfwd, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let j = jacfwd(|x: Tracer| x.sqr()).call(&x)?;
/// assert_eq!(j.to_vec2::<f32>()?, vec![vec![2., 0.], vec![0., 4.]]);
/// // with respect to both arguments: a pair of Jacobians
/// let (ja, jb) = jacfwd(|a: Tracer, b: Tracer| a.mul(&b)).argnums::<0, 1>().call((&x, &x))?;
/// assert_eq!(jb.to_vec2::<f32>()?, vec![vec![1., 0.], vec![0., 2.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jacfwd<F>(f: F) -> Jacfwd<F> {
    Transformed::new(JacfwdOf {
        f,
        chunk: None,
        _sel: PhantomData,
    })
}

argnum_methods!(Jacfwd, JacfwdOf);

impl<S, F, W, M> Transform<S> for JacfwdOf<F, W, M>
where
    S: ArgList,
    F: Function<S>,
    W: Argnums<S>,
    M: JacMode<F::Output>,
{
    type Output = JacOf<S, F, W, M>;

    fn apply(&self, options: &Options, args: S) -> Result<Self::Output> {
        options.check_not_vmap("jacfwd")?;
        let p = Prepared::<S, F, M>::new("jacfwd", &self.f, args, W::indices())?;
        let (sel, outs) = (&p.sel, &p.outs);
        // the outputs of f as a function of the selected leaves alone
        let g = |s: Vec<Tracer>| p.outs_at(s, p.rest.clone());
        let one = |s: Vec<Tracer>, u: Vec<Tracer>| {
            Function::apply(&named_jvp_fn(ByRef(&g), "jacfwd"), (s, u)).map(|(_, t)| t)
        };
        let n: usize = sel.iter().map(numel).sum();
        // cols[k]: [n, *out_k], one JVP per input element
        let cols: Vec<Tracer> = if n == 0 || outs.is_empty() {
            Vec::new()
        } else {
            Function::apply(
                &over_basis(one, 1, self.chunk, options),
                (sel.clone(), basis("jacfwd", sel)?),
            )?
        };
        let mut jac = Vec::with_capacity(outs.len() * sel.len());
        for (k, o) in outs.iter().enumerate() {
            let mut at = 0;
            for s in sel {
                jac.push(match cols.get(k) {
                    // [n_j, *out_k] -> [*out_k, *in_j]
                    Some(c) if numel(s) > 0 => basis_last(c.narrow(0, at, numel(s))?, s.dims())?,
                    _ => empty_block(o, s)?,
                });
                at += numel(s);
            }
        }
        p.finish::<W>(jac)
    }
}

/// What [`jacrev`] does: one VJP per output element, batched by `vmap`
/// (`chunk` of them at a time, if set).
pub struct JacrevOf<F, W = Wrt<0>, M = Plain> {
    f: F,
    chunk: Option<usize>,
    _sel: PhantomData<fn() -> (W, M)>,
}

/// The Jacobian of `f` by reverse mode, like `torch.func.jacrev`: one VJP
/// per output element, batched by `vmap` (the forward pass, unbatched,
/// runs once); the cheaper direction where outputs are fewer than inputs.
/// Made by [`jacrev`].
pub type Jacrev<F, W = Wrt<0>, M = Plain> = Transformed<JacrevOf<F, W, M>>;

/// See [`Jacrev`]; shaped as [`jacfwd`]'s result.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{jacrev, Tracer};
/// use std::collections::BTreeMap;
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let j = jacrev(|x: Tracer| x.sqr()?.sum_all()).call(&x)?;
/// assert_eq!(j.to_vec1::<f32>()?, vec![2., 4.]);
/// // a map of parameters in, a tensor out: a map of Jacobians
/// let p = BTreeMap::from([("w".to_string(), x.clone())]);
/// let f = |p: BTreeMap<String, Tracer>| p["w"].exp();
/// let j = jacrev(f).chunk_size(1).call(&p)?;
/// assert_eq!(j["w"].dims(), &[2, 2]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn jacrev<F>(f: F) -> Jacrev<F> {
    Transformed::new(JacrevOf {
        f,
        chunk: None,
        _sel: PhantomData,
    })
}

argnum_methods!(Jacrev, JacrevOf);

/// `sum_k <outs_k, cts_k>`: the scalar whose gradient is one VJP.
fn pairing(outs: &[Tracer], cts: &[Tracer]) -> Result<Tracer> {
    let mut total: Option<Tracer> = None;
    for (o, c) in outs.iter().zip(cts) {
        let d = o.mul(c)?.sum_all()?;
        total = Some(match total {
            Some(t) => t.add(&d.to_dtype(t.dtype())?)?,
            None => d,
        });
    }
    total.ok_or_else(|| Error::Tree {
        msg: "jacrev: the function returns no tensors".into(),
    })
}

impl<S, F, W, M> Transform<S> for JacrevOf<F, W, M>
where
    S: ArgList,
    F: Function<S>,
    W: Argnums<S>,
    M: JacMode<F::Output>,
{
    type Output = JacOf<S, F, W, M>;

    fn apply(&self, options: &Options, args: S) -> Result<Self::Output> {
        options.check_not_vmap("jacrev")?;
        let p = Prepared::<S, F, M>::new("jacrev", &self.f, args, W::indices())?;
        let (sel, outs) = (&p.sel, &p.outs);
        // row i: the gradient of <f(x), e_i>, one per output element
        let row = |s: Vec<Tracer>, r: Vec<Tracer>, e: Vec<Tracer>| pairing(&p.outs_at(s, r)?, &e);
        let m: usize = outs.iter().map(numel).sum();
        // rows_j: [m, *in_j]
        let rows_j: Vec<Tracer> = if m == 0 || sel.is_empty() {
            Vec::new()
        } else {
            Function::apply(
                &over_basis(grad(row), 2, self.chunk, options),
                (sel.clone(), p.rest.clone(), basis("jacrev", outs)?),
            )?
        };
        let mut jac = Vec::with_capacity(outs.len() * sel.len());
        let mut at = 0;
        for o in outs {
            for (j, s) in sel.iter().enumerate() {
                jac.push(match rows_j.get(j) {
                    // [m_k, *in_j] -> [*out_k, *in_j]
                    Some(r) if numel(o) > 0 => r.narrow(0, at, numel(o))?.reshape([o.dims(), s.dims()].concat())?,
                    _ => empty_block(o, s)?,
                });
            }
            at += numel(o);
        }
        p.finish::<W>(jac)
    }
}

/// What [`hessian`] does: `jacfwd(jacrev(f))` with respect to the
/// arguments `W`.
pub struct HessianOf<F, W = Wrt<0>> {
    f: F,
    _sel: PhantomData<fn() -> W>,
}

/// The Hessian of `f`: `jacfwd(jacrev(f))` with respect to the same
/// arguments, as `torch.func.hessian`; for a scalar `f` of a tensor,
/// `[*in, *in]`; of a map of parameters, a map of maps. Made by
/// [`hessian`].
pub type Hessian<F, W = Wrt<0>> = Transformed<HessianOf<F, W>>;

/// See [`Hessian`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{hessian, Tracer};
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let h = hessian(|x: Tracer| x.sqr()?.sum_all()).call(&x)?;
/// assert_eq!(h.to_vec2::<f32>()?, vec![vec![2., 0.], vec![0., 2.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn hessian<F>(f: F) -> Hessian<F> {
    Transformed::new(HessianOf { f, _sel: PhantomData })
}

impl<F, W> Hessian<F, W> {
    /// With respect to argument `I` (default 0).
    pub fn argnum<const I: usize>(self) -> Hessian<F, Wrt<I>> {
        self.map(|k| HessianOf {
            f: k.f,
            _sel: PhantomData,
        })
    }

    /// With respect to arguments `I` and `J`: blocks `((H_ii, H_ij),
    /// (H_ji, H_jj))` per output leaf.
    pub fn argnums<const I: usize, const J: usize>(self) -> Hessian<F, Wrt2<I, J>> {
        self.map(|k| HessianOf {
            f: k.f,
            _sel: PhantomData,
        })
    }
}

/// The type of a Hessian: the Jacobian of a Jacobian.
type NestedTwice<O, G> = <<O as SymTree>::Nest<G> as SymTree>::Nest<G>;

impl<S, F, W> Transform<S> for HessianOf<F, W>
where
    S: ArgList,
    F: Function<S>,
    W: Argnums<S>,
{
    type Output = NestedTwice<F::Output, W::Grads>;

    fn apply(&self, options: &Options, args: S) -> Result<Self::Output> {
        let inner = Transformed::new(JacrevOf::<_, W, Plain> {
            f: ByRef(&self.f),
            chunk: None,
            _sel: PhantomData,
        });
        let outer = JacfwdOf::<_, W, Plain> {
            f: inner,
            chunk: None,
            _sel: PhantomData,
        };
        outer.apply(options, args)
    }
}
