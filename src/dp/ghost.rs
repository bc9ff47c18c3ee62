//! Per-sample gradient norms without per-sample gradients ("ghost
//! clipping", Goodfellow 2015; Li et al. 2021; mixed per layer as in Bu et
//! al. 2022), as rules over a batched graph under construction.
//!
//! A linear layer's per-example weight gradient is a product,
//! `G_b = X_b Y_b` with `X_b = g_b^T: [m, K]` (output gradients) and `Y_b
//! = a_b: [K, n]` (activations; `K` the positions, 1 for a vector input).
//! Two identities avoid materialising `G: [B, m, n]`:
//!
//! * its squared norm is `||X Y||² = Σ_kl (X^T X)_kl (Y Y^T)_kl`: two Gram
//!   matrices of `K x K` per example (the "ghost norm");
//! * a weighted sum over the batch `Σ_b w_b X_b Y_b` is ONE product with
//!   the batch folded into the inner axis: `[m, (B K)] @ [(B K), n]`, the
//!   ordinary batched weight gradient with reweighted output gradients.
//!
//! The ghost norm costs `B K² (m + n)` multiply-adds where materialising
//! costs `B K m n`, so it is chosen when `K (m + n) < m n` (long sequences
//! on narrow layers materialise). An embedding's per-example gradient adds
//! rows `c_t` at ids: its squared norm is `Σ_v |Σ_{t: id_t = v} c_t|²`,
//! each example's positions grouped by id (`lookup_sq_norms`, `T log T +
//! T D` an example; Opacus counts repeated ids to the same end), chosen
//! when `T < V`, and its clipped sum is one index-add of the reweighted
//! rows. Other
//! per-example gradients (biases and norm scales, which are sums;
//! convolutions) are materialised here and their norms and weighted sums
//! read them. These functions only emit into the graph under
//! construction: the clipping transform (`clip.rs`) decides which to use
//! and warns.

use crate::error::Result;
use crate::ir::conv::ConvOp;
use crate::ir::ops::{Binary, IndexOp, Reduce, ShapeOp, Unary};
use crate::ir::views::{self, Step};
use crate::ir::{ConvGeom, Prim, VarId};
use crate::rules::Builder;
use candle_core::DType;

/// A shape-only step from a product to the per-example gradient, batch
/// axis kept first.
#[derive(Clone, Debug)]
enum View {
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    /// A cast: a half-precision compute copy's gradient reaching its f32
    /// master (mixed precision).
    Cast(DType),
}

/// A per-example gradient `G = views(P)`, `P_b = X_b Y_b` with `X: [B, m,
/// K]`, `Y: [B, K, n]` (any extra leading axes of the traced product, summed
/// over, already folded into `K`).
#[derive(Clone, Debug)]
pub(crate) struct Product {
    x: VarId,
    y: VarId,
    /// `G` as views of the product (or of its sum over extra axes).
    viewed: Viewed,
}

/// How a per-example gradient's norm and weighted sum are computed.
#[derive(Clone, Debug)]
pub(crate) enum Plan {
    /// From the Gram matrices and one folded product.
    Ghost(Product),
    /// From each example's rows summed by id (`lookup_sq_norms`), and one
    /// index-add.
    GhostLookup(Lookup),
    /// From norms computed a chunk of examples at a time, and one ordinary
    /// weight gradient of the reweighted output gradients.
    ConvChunked(ConvEach),
    /// From the materialised per-example gradient, read before its views
    /// (each example's entries are the same set, and the source is
    /// laid out contiguously).
    Materialise(Viewed),
}

/// A per-example gradient as views of a source value, the batch axis
/// first throughout.
#[derive(Clone, Debug)]
pub(crate) struct Viewed {
    src: VarId,
    views: Vec<View>,
}

impl Viewed {
    /// `g` as views of the value before them.
    pub(crate) fn of(b: &Builder, g: VarId) -> Viewed {
        let batch = b.dims(g).first().copied().unwrap_or(0);
        let (src, views) = strip_views(b, g, batch);
        Viewed { src, views }
    }

    /// `s` (one example's worth of the source, `[m, n]` or any shape with
    /// as many entries) through the views, each with the batch axis
    /// dropped.
    fn apply(&self, b: &mut Builder, s: VarId) -> Result<VarId> {
        let start = b.dims(self.src);
        let mut s = b.reshape(s, start[1..].to_vec())?;
        for view in &self.views {
            s = match view {
                View::Reshape(shape) => b.reshape(s, shape[1..].to_vec())?,
                View::Permute(perm) => b.permute(s, perm[1..].iter().map(|&a| a - 1).collect())?,
                View::Cast(dt) if b.ty(s).dtype == *dt => s,
                View::Cast(dt) => b.un(Unary::Cast(*dt), s)?,
            };
        }
        Ok(s)
    }

    /// `v` in the dtype the gradient is cast to at the end, where that is
    /// wider: under mixed precision a layer's norm and weighted sum are
    /// computed from its half-precision operands widened to f32 (what
    /// candle's half-precision products do inside anyway), so the norms
    /// that clip and the sums that are noised are f32's.
    fn widen(&self, b: &mut Builder, v: VarId) -> Result<VarId> {
        let last = self.views.iter().rev().find_map(|w| match w {
            View::Cast(dt) => Some(*dt),
            _ => None,
        });
        match last {
            Some(dt) if dt.size_in_bytes() > b.ty(v).dtype.size_in_bytes() && is_float(b.ty(v).dtype) => {
                b.un(Unary::Cast(dt), v)
            }
            _ => Ok(v),
        }
    }
}

fn is_float(dt: DType) -> bool {
    matches!(dt, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

impl Product {
    /// `(B, m, K, n)`.
    fn dims(&self, b: &Builder) -> (usize, usize, usize, usize) {
        let (x, y) = (b.dims(self.x), b.dims(self.y));
        (x[0], x[1], x[2], y[2])
    }

    /// Whether the Gram form is cheaper than materialising.
    pub(crate) fn ghost_pays(&self, b: &Builder) -> bool {
        let (_, m, k, n) = self.dims(b);
        (k as u128) * (m as u128 + n as u128) < (m as u128) * (n as u128)
    }
}

/// The view chain from `v` back to the node it views, while each step keeps
/// axis 0 (of size `batch`) as the batch: `(source, views outermost first)`.
fn strip_views(b: &Builder, v: VarId, batch: usize) -> (VarId, Vec<View>) {
    let chain = views::follow_views(&b.nodes, v, usize::MAX, |link, step, _| {
        let src = b.nodes[link].args[0];
        let keeps = b.dims(src).first() == Some(&batch) && b.dims(link).first() == Some(&batch);
        keeps
            && match step {
                Step::Reshape(_) => true,
                Step::Permute(p) => p[0] == 0,
                Step::Cast(_) => is_float(b.ty(src).dtype),
                Step::Broadcast(_) => false,
            }
    });
    // the links followed: reshapes, permutes and casts only
    let found = views::steps(&b.nodes, &chain)
        .filter_map(|s| match s {
            Step::Reshape(s) => Some(View::Reshape(s.to_vec())),
            Step::Permute(p) => Some(View::Permute(p.to_vec())),
            Step::Cast(dt) => Some(View::Cast(dt)),
            Step::Broadcast(_) => None,
        })
        .collect();
    (chain.source, found)
}

/// A per-example gradient (batch axis 0, `viewed` from [`Viewed::of`]) as
/// a product, if it is one: views of a matrix product over the batch whose
/// extra leading axes, if any, are all summed.
pub(crate) fn product_of(b: &mut Builder, viewed: &Viewed) -> Result<Option<Product>> {
    let Some(&batch) = b.dims(viewed.src).first() else {
        return Ok(None);
    };
    let mut p = viewed.src;
    // `Σ_e` over all extra leading axes of the product (keeping them or not)
    let mut summed = false;
    if let Prim::Reduce(Reduce::Sum { axes, .. }) = &b.nodes[p].prim {
        let src = b.nodes[p].args[0];
        let r = b.ty(src).rank();
        if r < 4 || *axes != (1..r - 2).collect::<Vec<_>>() {
            return Ok(None);
        }
        (p, summed) = (src, true);
    }
    if b.nodes[p].prim != Prim::Matmul {
        return Ok(None);
    }
    let (x, y) = (b.nodes[p].args[0], b.nodes[p].args[1]);
    let (xs, ys) = (b.dims(x), b.dims(y));
    let r = xs.len();
    if r < 3 || ys.len() != r || xs[..r - 2] != ys[..r - 2] || xs[0] != batch || (r > 3 && !summed) {
        return Ok(None);
    }
    let (m, k, n) = (xs[r - 2], xs[r - 1], ys[r - 1]);
    let e: usize = xs[1..r - 2].iter().product();
    // X: B E.. m k -> B m E.. k -> B m (E k); Y: B E.. k n -> B (E k) n
    let mut perm: Vec<usize> = vec![0, r - 2];
    perm.extend(1..r - 2);
    perm.push(r - 1);
    let x = b.permute(x, perm)?;
    let x = b.reshape(x, vec![batch, m, e * k])?;
    let y = b.reshape(y, vec![batch, e * k, n])?;
    let (x, y) = (viewed.widen(b, x)?, viewed.widen(b, y)?);
    Ok(Some(Product {
        x,
        y,
        viewed: viewed.clone(),
    }))
}

/// A per-example embedding gradient, `G_b[v] = Σ_t [id_bt = v] c_bt`:
/// rows `c: [B, T, D]` added at ids `[B, T]` (or `[T]`, one list for every
/// example) into `V` rows.
#[derive(Clone, Debug)]
pub(crate) struct Lookup {
    rows: VarId,
    ids: VarId,
    size: usize,
    viewed: Viewed,
}

impl Lookup {
    /// Whether the ghost norm is cheaper than writing the `V x D`
    /// gradient of each example: `T < V` (summing each group of equal
    /// ids' rows costs `T D` an example, and `T log T` to find the groups:
    /// `lookup_sq_norms`).
    pub(crate) fn ghost_pays(&self, b: &Builder) -> bool {
        b.dims(self.rows)[1] < self.size
    }
}

/// A per-example gradient (`viewed`) as an embedding's, if it is one: an
/// index-add of `[B, T, D]` rows along axis 1 at shared ids `[T]`, or a
/// scatter-add at per-example ids `[B, T]` broadcast over `D` (what the
/// batching rules make of an embedding's VJP).
pub(crate) fn lookup_of(b: &Builder, viewed: &Viewed) -> Option<Lookup> {
    let n = &b.nodes[viewed.src];
    let (rows, idx) = (*n.args.first()?, *n.args.get(1)?);
    let rd = b.dims(rows);
    if rd.len() != 3 {
        return None;
    }
    let (ids, size) = match n.prim {
        Prim::Index(IndexOp::IndexAdd { axis: 1, size }) if b.dims(idx) == [rd[1]] => (idx, size),
        Prim::Index(IndexOp::ScatterAdd { axis: 1, size }) => {
            // idx: ids [B, T] -> [B, T, 1] -> broadcast over D
            let bc = &b.nodes[idx];
            let Prim::Shape(ShapeOp::Broadcast(_)) = bc.prim else {
                return None;
            };
            let r = &b.nodes[bc.args[0]];
            let Prim::Shape(ShapeOp::Reshape(_)) = r.prim else {
                return None;
            };
            let ids = r.args[0];
            (b.dims(bc.args[0]) == [rd[0], rd[1], 1] && b.dims(ids) == rd[..2]).then_some((ids, size))?
        }
        _ => return None,
    };
    Some(Lookup {
        rows,
        ids,
        size,
        viewed: viewed.clone(),
    })
}

/// A per-example convolution weight gradient, `G_b = ct_b @ unfold(x_b)^T`
/// (`GradWeightEach` of `x: [B, Cin, S..]`, `ct: [B, Cout, O..]`, one input
/// per example). Its squared norm costs the same products as `G` itself
/// (the Gram form needs `L x L` matrices of the output positions `L`,
/// larger than `G` for the usual convolution), so the norms are taken a
/// chunk of examples at a time; the weighted sum is the ordinary weight
/// gradient of `w_b ct_b`. Nothing batch-sized is held but the norms.
#[derive(Clone, Debug)]
pub(crate) struct ConvEach {
    x: VarId,
    ct: VarId,
    geom: ConvGeom,
    viewed: Viewed,
}

impl ConvEach {
    /// Whether chunked norms hold less than materialising: until the clip
    /// factors are known the weighted sum needs either `G` (`Cout Cin k`
    /// entries an example, after which the layer's input and output
    /// gradient can go) or the output gradient and the input (`Cout L +
    /// Cin S`); the smaller is kept. (Both cost the same products.)
    pub(crate) fn chunking_pays(&self, b: &Builder) -> bool {
        let (xd, cd) = (b.dims(self.x), b.dims(self.ct));
        let (cin, cout) = (xd[1], cd[1]);
        let (s, l): (usize, usize) = (xd[2..].iter().product(), cd[2..].iter().product());
        let taps: usize = self.geom.kernel.iter().product();
        cout * cin * taps >= cout * l + cin * s
    }
}

/// A per-example gradient (`viewed`) as a convolution's, if it is one.
pub(crate) fn conv_of(b: &Builder, viewed: &Viewed) -> Option<ConvEach> {
    let n = &b.nodes[viewed.src];
    let Prim::Conv(ConvOp::GradWeightEach(geom)) = &n.prim else {
        return None;
    };
    Some(ConvEach {
        x: n.args[0],
        ct: n.args[1],
        geom: geom.clone(),
        viewed: viewed.clone(),
    })
}

/// Swaps the last two of three axes.
fn swap(b: &mut Builder, v: VarId) -> Result<VarId> {
    b.permute(v, vec![0, 2, 1])
}

/// Each example's squared gradient norm, `[B]`.
pub(crate) fn sq_norm(b: &mut Builder, plan: &Plan) -> Result<VarId> {
    match plan {
        // Σ_kl (X^T X)_kl (Y Y^T)_kl: B K K Gram matrices
        Plan::Ghost(p) => {
            let xt = swap(b, p.x)?;
            let gx = b.emit(Prim::Matmul, &[xt, p.x])?;
            let yt = swap(b, p.y)?;
            let gy = b.emit(Prim::Matmul, &[p.y, yt])?;
            let prod = b.bin(Binary::Mul, gx, gy)?;
            b.sum_axes(prod, vec![1, 2], false)
        }
        // Σ_v |Σ_{t: id_t = v} c_t|²: each group of equal ids' rows
        // summed once (no B T T Gram matrix, no B V D table)
        Plan::GhostLookup(l) => {
            let rd = b.dims(l.rows);
            // shared ids [T] -> [B, T]
            let ids = match b.dims(l.ids).len() {
                1 => {
                    let i = b.reshape(l.ids, vec![1, rd[1]])?;
                    b.broadcast(i, rd[..2].to_vec())?
                }
                _ => l.ids,
            };
            let rows = l.viewed.widen(b, l.rows)?;
            b.emit(Prim::Index(IndexOp::LookupSqNorms { size: l.size }), &[rows, ids])
        }
        Plan::ConvChunked(c) => {
            let (x, ct) = (c.viewed.widen(b, c.x)?, c.viewed.widen(b, c.ct)?);
            b.emit(Prim::Conv(ConvOp::GradWeightSqNorms(c.geom.clone())), &[x, ct])
        }
        // each row's dot product with itself, [B, 1, R] @ [B, R, 1]: no
        // squared copy of the per-example gradients
        Plan::Materialise(v) => {
            let rows = flat_rows(b, v.src)?;
            let rows = v.widen(b, rows)?;
            let (batch, r) = (b.dims(rows)[0], b.dims(rows)[1]);
            let row = b.reshape(rows, vec![batch, 1, r])?;
            // the same entries as a column: a reshape, so no copy is laid out
            let col = b.reshape(rows, vec![batch, r, 1])?;
            let dot = b.emit(Prim::Matmul, &[row, col])?;
            b.reshape(dot, vec![batch])
        }
    }
}

/// `Σ_b w_b G_b` for weights `w: [B]`, shaped as one example's gradient.
pub(crate) fn weighted_sum(b: &mut Builder, w: VarId, plan: &Plan) -> Result<VarId> {
    let batch = b.dims(w)[0];
    match plan {
        Plan::Ghost(p) => {
            let (_, m, k, n) = p.dims(b);
            // (w X): B m K -> m B K -> m (B K); Y: B K n -> (B K) n
            let w3 = b.reshape(w, vec![batch, 1, 1])?;
            let wx = b.bin(Binary::Mul, p.x, w3)?;
            let wx = b.permute(wx, vec![1, 0, 2])?;
            let wx = b.reshape(wx, vec![m, batch * k])?;
            let y = b.reshape(p.y, vec![batch * k, n])?;
            let s = b.emit(Prim::Matmul, &[wx, y])?;
            p.viewed.apply(b, s)
        }
        // (w c) rows added at the ids of every example: one index-add
        Plan::GhostLookup(l) => {
            let (t, d) = (b.dims(l.rows)[1], b.dims(l.rows)[2]);
            let w3 = b.reshape(w, vec![batch, 1, 1])?;
            let rows = l.viewed.widen(b, l.rows)?;
            let wc = b.bin(Binary::Mul, rows, w3)?;
            let wc = b.reshape(wc, vec![batch * t, d])?;
            let ids = b.broadcast(l.ids, vec![batch, t])?;
            let ids = b.reshape(ids, vec![batch * t])?;
            let op = IndexOp::IndexAdd { axis: 0, size: l.size };
            let s = b.emit(Prim::Index(op), &[wc, ids])?;
            l.viewed.apply(b, s)
        }
        // Σ_b w_b ct_b @ unfold(x_b)^T = the weight gradient of (w ct):
        // B Cout O.. scaled by B 1 1.., then [Cout, Cin, k..]
        Plan::ConvChunked(c) => {
            let rank = b.ty(c.ct).rank();
            let wb = b.reshape(w, [vec![batch], vec![1; rank - 1]].concat())?;
            let (x, ct) = (c.viewed.widen(b, c.x)?, c.viewed.widen(b, c.ct)?);
            let wct = b.bin(Binary::Mul, ct, wb)?;
            let op = ConvOp::GradWeight {
                geom: c.geom.clone(),
                groups: 1,
            };
            let s = b.emit(Prim::Conv(op), &[x, wct])?;
            c.viewed.apply(b, s)
        }
        // [1, B] @ [B, R]: one pass over the per-example gradients
        Plan::Materialise(v) => {
            let rows = flat_rows(b, v.src)?;
            let rows = v.widen(b, rows)?;
            let w = b.reshape(w, vec![1, batch])?;
            let s = b.emit(Prim::Matmul, &[w, rows])?;
            v.apply(b, s)
        }
    }
}

/// `v: B ..` as `[B, R]`.
fn flat_rows(b: &mut Builder, v: VarId) -> Result<VarId> {
    let d = b.dims(v);
    let r = d[1..].iter().product();
    b.reshape(v, vec![d[0], r])
}

/// The primitive making a per-example gradient (`viewed`), by name, when
/// it is not one whose gradient is meant to be materialised (sums: biases
/// and norm scales; convolutions' weight gradients; index additions:
/// embeddings) nor a product.
pub(crate) fn no_rule(b: &Builder, viewed: &Viewed) -> Option<String> {
    match &b.nodes[viewed.src].prim {
        Prim::Matmul | Prim::Reduce(Reduce::Sum { .. }) | Prim::Conv(_) | Prim::Index(_) => None,
        // a parameter the loss does not read, or reads as itself
        p if p.is_leaf() => None,
        p => Some(p.name()),
    }
}

/// Whether `v` is zero by construction: a zero literal through shape
/// changes and casts, what a gradient is for an input the loss never
/// reaches (and no data can make anything else).
pub(crate) fn structural_zero(b: &Builder, v: VarId) -> bool {
    views::is_literal(&b.nodes, v, 0.0, |_| true)
}
