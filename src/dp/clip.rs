//! The clipping step of DP-SGD as one transform over a per-example loss:
//! each example's gradient norm, then the clipped sum `Σ_b min(1, C /
//! (||g_b|| + 1e-6)) g_b`, with per-sample gradients materialised only
//! where that is cheaper than the ghost form (`dp::ghost`).
//!
//! The clipped sum reuses the first pass ("book-keeping", Bu et al. 2022):
//! backpropagation is linear in each example's output cotangent, so the
//! reweighted backward's weight gradient is the first backward's output
//! gradients scaled by the clip factors, contracted with the same
//! activations: one product per layer, as in an ordinary training step.

use super::ghost::{self, Plan, Viewed};
use crate::error::{Error, Result};
use crate::ir::options::{Options, Schedule};
use crate::trace::Tracer;
use crate::transforms::dims::Dims;
use crate::transforms::grad::{value_and_grad, Nth};
use crate::transforms::transformed::{Transform, Transformed};
use crate::transforms::tree::{ArgList, SymTree, TreeDef};
use crate::transforms::vmap::vmap;
use crate::transforms::{settings, ByRef, Function};
use std::marker::PhantomData;

/// What [`clipped_grad_sum`] and [`per_sample_grad_norms`] do: the
/// per-example gradients of `loss`, their norms and (`M = Clipped`) their
/// clipped sum.
pub struct ClipOf<F, M = Clipped> {
    loss: F,
    max_norm: f64,
    /// Per-layer clipping: the group of each gradient leaf (in the tree's
    /// flattening order) and each group's bound; `None` clips the whole
    /// gradient to `max_norm`.
    groups: Option<(Vec<usize>, Vec<f64>)>,
    /// Automatic clipping's stability constant `γ`: each example scaled by
    /// `1 / (||g|| + γ)` instead of clipped.
    automatic: Option<f64>,
    ghost: bool,
    in_dims: Option<Dims>,
    mode: PhantomData<M>,
}

/// The clipped gradient sum of a per-example loss (see [`clipped_grad_sum`]),
/// or with `M = NormsOnly` its per-example gradient norms alone (see
/// [`per_sample_grad_norms`]).
pub type ClippedGradSum<F, M = Clipped> = Transformed<ClipOf<F, M>>;

/// [`ClippedGradSum`]'s default mode: the clipped sum, norms and losses.
pub struct Clipped;

/// [`ClippedGradSum`]'s mode for [`per_sample_grad_norms`]: norms and losses.
pub struct NormsOnly;

/// The per-example gradient norms of a per-example loss, without the
/// clipped sum.
pub type PerSampleGradNorms<F> = ClippedGradSum<F, NormsOnly>;

/// Each example's gradient norm over all parameters for `loss(params,
/// example..)`, a function of ONE example: called on a batch it returns
/// `(norms, losses)`, both `[B]`, computing per-sample gradients only
/// where a layer has no cheaper rule (ghost norms for linear layers on
/// vectors and sequences and for embeddings, chunked norms for
/// convolutions, see [`clipped_grad_sum`]). The same builder methods
/// apply (`in_dims`, `ghost`, `conv_route`, `options`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{dp, Tracer};
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let xs = Tensor::new(&[[1f32, 0.], [0., 10.]], &Device::Cpu)?;
/// // loss(w, x) = sum(w x): its gradient is [x, x] (rows), norm sqrt 2 |x|
/// let loss = |w: Tracer, x: Tracer| w.matmul(&x.unsqueeze(1)?)?.sum_all();
/// let (norms, _) = dp::per_sample_grad_norms(loss).call((&w, &xs))?;
/// let n = norms.to_vec1::<f32>()?;
/// assert!((n[0] - 2f32.sqrt()).abs() < 1e-5 && (n[1] - 200f32.sqrt()).abs() < 1e-4);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn per_sample_grad_norms<F>(loss: F) -> PerSampleGradNorms<F> {
    ClipOf::transform(loss, 1.0)
}

/// The clipping step of DP-SGD for `loss(params, example..)`, a function of
/// ONE example (as under `vmap(grad(loss))`): called on a batch it returns
/// `(clipped, norms, losses)`:
///
/// * `clipped`: `Σ_b min(1, max_norm / (||g_b|| + 1e-6)) g_b`, shaped like
///   the parameters (Opacus's clipping factor);
/// * `norms`: `[B]`, each example's gradient norm over all parameters;
/// * `losses`: `[B]`, each example's loss.
///
/// Per-sample gradients are not materialised where a layer's ghost rule is
/// cheaper (linear layers on vectors and on sequences, see
/// `dp::ghost`): for a linear layer the norms come from Gram matrices
/// and the clipped sum from one product, as in an ordinary batched step.
/// `.ghost(false)` materialises every per-sample gradient (the reference).
/// The batch axis of each argument is given by [`ClippedGradSum::in_dims`]
/// (default: none for the parameters, 0 for the rest).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{dp, Tracer};
/// let w = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let xs = Tensor::new(&[[1f32, 0.], [0., 10.]], &Device::Cpu)?;
/// // loss(w, x) = sum(w x): its gradient is [x, x] (rows), norm sqrt 2 |x|
/// let loss = |w: Tracer, x: Tracer| w.matmul(&x.unsqueeze(1)?)?.sum_all();
/// let (clipped, norms, _) = dp::clipped_grad_sum(loss, 1.0).call((&w, &xs))?;
/// let n = norms.to_vec1::<f32>()?;
/// assert!((n[0] - 2f32.sqrt()).abs() < 1e-5 && (n[1] - 200f32.sqrt()).abs() < 1e-4);
/// // each example clipped to norm 1: [1, 0] / sqrt 2 + [0, 10] / sqrt 200
/// let c = clipped.to_vec2::<f32>()?;
/// assert!((c[0][0] - 0.5f32.sqrt()).abs() < 1e-5 && (c[0][1] - 0.5f32.sqrt()).abs() < 1e-5);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn clipped_grad_sum<F>(loss: F, max_norm: f64) -> ClippedGradSum<F> {
    ClipOf::transform(loss, max_norm)
}

impl<F, M> ClipOf<F, M> {
    fn transform(loss: F, max_norm: f64) -> ClippedGradSum<F, M> {
        Transformed::new(ClipOf {
            loss,
            max_norm,
            groups: None,
            automatic: None,
            ghost: true,
            in_dims: None,
            mode: PhantomData,
        })
    }
}

impl<F, M> ClippedGradSum<F, M> {
    /// The batch axis of each argument, as [`Vmap::in_dims`](crate::Vmap::in_dims) takes them
    /// (default: `None` for the parameters, 0 for every other argument).
    pub fn in_dims(self, dims: impl Into<Dims>) -> Self {
        self.edit(|k| k.in_dims = Some(dims.into()))
    }

    /// Whether layers with a ghost rule use it where it is cheaper
    /// (default); `false` materialises every per-sample gradient.
    pub fn ghost(self, on: bool) -> Self {
        self.edit(|k| k.ghost = on)
    }
}

impl<F> ClippedGradSum<F, Clipped> {
    /// Per-layer clipping (Opacus's `clipping="per_layer"`, generalised to
    /// groups): leaf `i` of the gradient tree (in its flattening order,
    /// sorted by name for a map) belongs to group `of_leaf[i]`, and each
    /// example's gradient restricted to group `k` is clipped to
    /// `bounds[k]` on its own. One example then moves the sum by at most
    /// `sqrt(Σ bounds²)`, the sensitivity the noise must be scaled to.
    /// `max_norm` is unused; `norms` stays the norm over all leaves. The
    /// lengths and bounds are checked when traced.
    pub fn per_group(self, of_leaf: Vec<usize>, bounds: Vec<f64>) -> Self {
        self.edit(|k| k.groups = Some((of_leaf, bounds)))
    }

    /// Automatic clipping (Bu et al. 2023, "Automatic Clipping: Differentially
    /// Private Deep Learning Made Easier and Stronger", AUTO-S): each
    /// example's gradient scaled by `1 / (||g|| + gamma)` instead of
    /// clipped, so every example's contribution has norm below 1 (the
    /// sensitivity) and there is no bound to tune. Ghost norms apply as
    /// for clipping. `max_norm` and per-layer groups are unused; `gamma`
    /// (0.01 in the paper) must be finite and positive, checked when traced.
    pub fn automatic(self, gamma: f64) -> Self {
        self.edit(|k| k.automatic = Some(gamma))
    }
}

impl<F, M> ClipOf<F, M> {
    /// The losses `[B]`, the per-example gradient leaves (batch axis 0)
    /// and the gradient tree's shape, from `vmap(value_and_grad(loss))`.
    fn per_example<S>(&self, options: &Options, args: S) -> Result<(Tracer, Vec<Tracer>, TreeDef)>
    where
        S: ArgList + Nth<0>,
        F: Function<S, Output = Tracer>,
    {
        positive_norm(self.max_norm)?;
        let dims = match &self.in_dims {
            Some(d) => d.clone(),
            None => Dims::Each((0..args.flatten_args().1.len()).map(|i| (i > 0).then_some(0)).collect()),
        };
        // vmap(value_and_grad(loss)) batched whole by default: the ghost
        // rules read the batched graph's products, which a per-example or
        // chunked schedule (when asked for) hides behind a loop, so that
        // every per-sample gradient is materialised
        let mut per = vmap(value_and_grad(ByRef(&self.loss)))
            .in_dims(dims)
            .schedule(options.schedule.unwrap_or(Schedule::Batched));
        if let Some(k) = options.chunk_size {
            per = per.chunk_size(k);
        }
        if let Some(r) = options.randomness {
            per = per.randomness(r);
        }
        let (losses, grads) = per.apply(args)?;
        let mut leaves = Vec::new();
        let def = grads.flatten_into(&mut leaves);
        if let Some(g) = leaves.iter().find(|g| g.ty.rank() == 0) {
            return Err(Error::shape(
                "clipped_grad_sum",
                &[&g.ty.shape],
                "a per-example gradient has no batch axis",
            ));
        }
        unreached(&leaves, &def)?;
        Ok((losses, leaves, def))
    }
}

impl<S, F> Transform<S> for ClipOf<F, Clipped>
where
    S: ArgList + Nth<0>,
    F: Function<S, Output = Tracer>,
{
    type Output = (<S as Nth<0>>::T, Tracer, Tracer);

    fn apply(&self, options: &Options, args: S) -> Result<Self::Output> {
        let (losses, leaves, def) = self.per_example(options, args)?;
        let flat = (vec![0; leaves.len()], vec![self.max_norm]);
        let (of_leaf, bounds) = match self.automatic {
            Some(_) => &flat,
            None => self.groups.as_ref().unwrap_or(&flat),
        };
        check_groups(of_leaf, bounds, leaves.len())?;
        let factor = match self.automatic {
            Some(gamma) => {
                super::positive("clipped_grad_sum", "automatic clipping's gamma", gamma, false)?;
                Factor::Automatic(gamma)
            }
            None => Factor::Clip,
        };
        let (sums, norms) = clip_leaves(&leaves, (of_leaf, bounds), self.ghost, factor)?;
        let clipped = <S as Nth<0>>::T::unflatten_from(&def, &mut sums.into_iter())?;
        Ok((clipped, norms, losses))
    }
}

impl<S, F> Transform<S> for ClipOf<F, NormsOnly>
where
    S: ArgList + Nth<0>,
    F: Function<S, Output = Tracer>,
{
    type Output = (Tracer, Tracer);

    fn apply(&self, options: &Options, args: S) -> Result<Self::Output> {
        let (losses, leaves, _) = self.per_example(options, args)?;
        let plans = plans(&leaves, self.ghost, true)?;
        let sq = leaves
            .iter()
            .zip(&plans)
            .map(|(g, plan)| sq_norm(g, plan))
            .collect::<Result<Vec<_>>>()?;
        Ok((total(&sq)?.sqrt()?, losses))
    }
}

/// An error naming the first parameter the loss never reaches: its
/// gradient would be zero whatever the data (a frozen layer left
/// trainable, an adapter the forward pass does not apply), which would
/// spend noise on it and train nothing.
fn unreached(leaves: &[Tracer], def: &TreeDef) -> Result<()> {
    let paths = def.leaf_paths();
    for (g, path) in leaves.iter().zip(&paths) {
        if ghost::structural_zero(&g.b.borrow(), g.id) {
            let name = if path.is_empty() {
                "the parameters"
            } else {
                path.as_str()
            };
            return Err(Error::privacy(
                "clipped_grad_sum",
                format!("parameter {name:?}"),
                "reached by the loss (freeze it, or use it in the loss)",
                "never reached: its gradient is zero whatever the data",
            ));
        }
    }
    Ok(())
}

/// An error unless every leaf has a group, every group a bound, and every
/// bound is finite and positive.
fn check_groups(of_leaf: &[usize], bounds: &[f64], leaves: usize) -> Result<()> {
    if of_leaf.len() != leaves || of_leaf.iter().any(|&k| k >= bounds.len()) {
        let expected = format!(
            "one group below {} (the bounds' count) for each of {leaves} gradient tensors",
            bounds.len()
        );
        return Err(Error::privacy(
            "clipped_grad_sum",
            "per_group",
            expected,
            format!("{of_leaf:?}"),
        ));
    }
    bounds.iter().try_for_each(|&c| positive_norm(c))
}

/// An error unless the clipping bound is finite and positive.
fn positive_norm(c: f64) -> Result<()> {
    super::positive("clipped_grad_sum", "max_norm", c, false)
}

/// How each per-example gradient is read: its ghost rule where it has one
/// and it pays (and `ghost` allows), else materialised. A gradient with no
/// rule at all warns once per primitive (an error in strict mode), as a
/// `vmap` fallback does.
///
/// With `norms_only` (no clipped sum to come) a convolution's norms are
/// always chunked: nothing waits for the clip factors.
fn plans(leaves: &[Tracer], ghost: bool, norms_only: bool) -> Result<Vec<Plan>> {
    leaves
        .iter()
        .map(|g| {
            let b = &mut *g.b.borrow_mut();
            let viewed = Viewed::of(b, g.id);
            if let Some(p) = ghost::product_of(b, &viewed)? {
                if ghost && p.ghost_pays(b) {
                    return Ok(Plan::Ghost(p));
                }
            } else if let Some(c) = ghost::conv_of(b, &viewed) {
                if ghost && (norms_only || c.chunking_pays(b)) {
                    return Ok(Plan::ConvChunked(c));
                }
            } else if let Some(l) = ghost::lookup_of(b, &viewed) {
                if ghost && l.ghost_pays(b) {
                    return Ok(Plan::GhostLookup(l));
                }
            } else if let Some(kind) = ghost::no_rule(b, &viewed) {
                if b.given.strict.unwrap_or_else(settings::strict) {
                    return Err(Error::unsupported(
                        kind.clone(),
                        "clipped_grad_sum",
                        "no per-sample norm rule (strict mode)",
                    ));
                }
                settings::warn_once(
                    format!("ghost-{kind}"),
                    format!("clipped_grad_sum: no ghost rule for {kind}; materialising its per-sample gradient"),
                );
            }
            Ok(Plan::Materialise(viewed))
        })
        .collect()
}

/// The squared norms `[B]` of one per-example gradient by its plan.
fn sq_norm(g: &Tracer, plan: &Plan) -> Result<Tracer> {
    // The borrow ends before Tracer::new borrows the builder again.
    let sq = ghost::sq_norm(&mut g.b.borrow_mut(), plan)?;
    Ok(Tracer::new(&g.b, sq))
}

/// The sum of squared norms, in the first one's dtype.
fn total(sq: &[Tracer]) -> Result<Tracer> {
    let (first, rest) = sq.split_first().ok_or_else(|| Error::Tree {
        msg: "clipped_grad_sum: the parameters have no tensors".into(),
    })?;
    rest.iter()
        .try_fold(first.clone(), |t, s| t.add(&s.to_dtype(t.ty.dtype)?))
}

/// How an example's weight follows from its norm.
#[derive(Clone, Copy)]
enum Factor {
    /// Opacus's clipping factor `min(1, C / (norm + 1e-6))`.
    Clip,
    /// Automatic clipping's `1 / (norm + γ)`.
    Automatic(f64),
}

/// Each example's weight from its norms, for the bound `c`.
fn clip_factor(norms: &Tracer, c: f64, factor: Factor) -> Result<Tracer> {
    match factor {
        Factor::Clip => norms.affine(1.0, 1e-6)?.recip()?.affine(c, 0.0)?.clamp(0.0, 1.0),
        Factor::Automatic(gamma) => norms.affine(1.0, gamma)?.recip(),
    }
}

/// The clipped sums of `leaves` (per-example gradients, batch axis 0), each
/// group `(of_leaf, bounds)` clipped on its own, and the per-example norms
/// over all leaves.
fn clip_leaves(
    leaves: &[Tracer],
    (of_leaf, bounds): (&[usize], &[f64]),
    ghost: bool,
    factor: Factor,
) -> Result<(Vec<Tracer>, Tracer)> {
    let plans = plans(leaves, ghost, false)?;
    // Each group's squared norms; a group without leaves clips nothing.
    let mut members: Vec<Vec<Tracer>> = vec![Vec::new(); bounds.len()];
    for ((g, plan), &k) in leaves.iter().zip(&plans).zip(of_leaf) {
        members[k].push(sq_norm(g, plan)?);
    }
    let group_sq: Vec<Option<Tracer>> = members
        .iter()
        .map(|m| (!m.is_empty()).then(|| total(m)).transpose())
        .collect::<Result<_>>()?;
    let factors: Vec<Option<Tracer>> = group_sq
        .iter()
        .zip(bounds)
        .map(|(sq, &c)| sq.as_ref().map(|sq| clip_factor(&sq.sqrt()?, c, factor)).transpose())
        .collect::<Result<_>>()?;
    let present: Vec<Tracer> = group_sq.into_iter().flatten().collect();
    let norms = total(&present)?.sqrt()?;
    let sums = leaves
        .iter()
        .zip(&plans)
        .zip(of_leaf)
        .map(|((g, plan), &k)| {
            // a leaf's group has it as a member, so a norm and a factor
            let factor = factors[k].as_ref().expect("the leaf's group has a norm");
            let w = factor.to_dtype(g.ty.dtype)?;
            let s = ghost::weighted_sum(&mut g.b.borrow_mut(), w.id, plan)?;
            Ok(Tracer::new(&g.b, s))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((sums, norms))
}
