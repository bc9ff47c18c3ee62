//! A scan's VJP: a scan the other way over the carries each step read (a
//! result of the forward scan), whose body is one step's VJP (recomputing
//! the step's insides from its carries).
//!
//! The backward loop carries each float carry's cotangent and, for a float
//! operand every step reads whole, the sum of its cotangents so far, each
//! in its own dtype. A sum of products is better left out of the loop:
//! where a whole operand's cotangent in one step is a matrix product of
//! that step's values, seen through reshapes and permutes (`h_{t-1}^T g_t`
//! for a recurrent weight used as `h W^T`), the loop outputs the two
//! factors of every step and one product after it contracts over the steps
//! too: `sum_t A_t B_t = [A_1 .. A_T] [B_1; ..; B_T]` (`T m r -> m (T r)`).
//! Per example under `vmap` that is one batched product instead of `T`
//! rank-one updates of a `[B, m, n]` sum carried through the loop, and it
//! is the product the ghost-norm rules recognise.

use super::graph_of;
use crate::error::{Error, Result};
use crate::ir::ops::{Binary, ShapeOp};
use crate::ir::views::{self, Step};
use crate::ir::{Graph, Prim, Scan, TensorType, VarId};
use crate::rules::{walk, Builder, Cts};
use std::sync::Arc;

/// How an operand's cotangent leaves the backward loop.
#[derive(Clone, Debug, PartialEq)]
enum Route {
    /// None: a carry (its cotangent is carried), or not a float operand.
    None,
    /// Per step, as a stacked output (a scanned operand).
    Step,
    /// Summed in a carry of the backward loop (a whole operand).
    Summed,
    /// As the two factors of a product per step, stacked, then contracted
    /// over the steps and viewed through `views` (the shape operations
    /// between the product and the cotangent).
    Factors {
        a: Vec<usize>,
        b: Vec<usize>,
        views: Vec<ShapeOp>,
    },
}

/// The layout of the backward loop. Its carries: the float carries'
/// cotangents, then the sums. Its scanned operands: the carries read, the
/// forward scanned operands, the cotangents of the outputs that have one,
/// those of the carries read that have one. Its whole operands: the
/// forward ones. Its outputs besides its carries: the scanned operands'
/// cotangents, then the factors.
struct Layout {
    /// The float carries.
    floats: Vec<usize>,
    /// Each operand's route.
    routes: Vec<Route>,
    /// The outputs (by output index after the carries) with a cotangent.
    ys: Vec<usize>,
    /// The carries whose reads have a cotangent.
    reads: Vec<usize>,
}

/// The factors of a cotangent that is one product of two matrices seen
/// through shape operations: the product's operands and those views.
type Factors = (VarId, VarId, Vec<ShapeOp>);

/// A whole operand whose cotangent is one product per step: its index,
/// the factors' shapes, the views.
type Factored = (usize, Vec<usize>, Vec<usize>, Vec<ShapeOp>);

/// Emits the VJP of the scan `sc` (operands `args`, the tuple `out`, its
/// results' cotangents `cts`): the cotangent of each operand.
pub(super) fn emit(sc: &Scan, b: &mut Builder, args: &[VarId], out: VarId, cts: &[Option<VarId>]) -> Result<Cts> {
    if !sc.reads {
        return Err(Error::internal(
            "scan",
            "grad of a scan prepared to keep its last carry only",
        ));
    }
    // a first trace of the step's VJP finds the products to take out
    let probe = Layout::new(sc, cts, &[]);
    let (_, factors) = probe.body(sc, b)?;
    let layout = Layout::new(sc, cts, &factors);
    if layout.floats.is_empty() && layout.routes.iter().all(|r| *r == Route::None) {
        return Ok(vec![None; args.len()]);
    }
    let (graph, _) = layout.body(sc, b)?;
    let (nc, ns) = (sc.carries, sc.scanned);
    let mut operands = Vec::new();
    for &k in &layout.floats {
        operands.push(b.or_zeros(cts[k], args[k])?);
    }
    for k in layout.of(Route::Summed) {
        operands.push(b.zeros(sc.input_ty(k).shape.clone(), sc.input_ty(k).dtype)?);
    }
    for k in 0..nc {
        operands.push(b.get(out, sc.reads_at() + k)?);
    }
    operands.extend_from_slice(&args[nc..nc + ns]);
    operands.extend(layout.ys.iter().filter_map(|&y| cts[sc.ys_at() + y]));
    operands.extend(layout.reads.iter().filter_map(|&k| cts[sc.reads_at() + k]));
    operands.extend_from_slice(&args[nc + ns..]);
    let carries = layout.floats.len() + layout.of(Route::Summed).len();
    let back = Scan {
        body: Arc::new(graph),
        carries,
        scanned: nc + ns + layout.ys.len() + layout.reads.len(),
        length: sc.length,
        reverse: !sc.reverse,
        reads: true,
    };
    let got = b.emit_many(Prim::Scan(Box::new(back)), &operands)?;
    // the backward loop ends at the forward loop's first step
    let mut out: Cts = vec![None; args.len()];
    for (j, &k) in layout.floats.iter().enumerate() {
        out[k] = Some(got[j]);
    }
    for (j, k) in layout.of(Route::Summed).into_iter().enumerate() {
        out[k] = Some(got[layout.floats.len() + j]);
    }
    let mut at = carries;
    for k in layout.of(Route::Step) {
        out[k] = Some(got[at]);
        at += 1;
    }
    for (k, route) in layout.routes.iter().enumerate() {
        if let Route::Factors { views, .. } = route {
            out[k] = Some(contract(b, (got[at], got[at + 1]), sc.length, views)?);
            at += 2;
        }
    }
    Ok(out)
}

/// `sum_t A_t B_t` from the stacked factors (`A` `T m r`, `B` `T r n`),
/// viewed through `views`.
fn contract(b: &mut Builder, (fa, fb): (VarId, VarId), steps: usize, views: &[ShapeOp]) -> Result<VarId> {
    let (a, bs) = (b.dims(fa), b.dims(fb));
    let (m, r, n) = (a[1], a[2], bs[2]);
    // T m r -> m T r -> m (T r); T r n -> (T r) n
    let fa = b.permute(fa, vec![1, 0, 2])?;
    let fa = b.reshape(fa, vec![m, steps * r])?;
    let fb = b.reshape(fb, vec![steps * r, n])?;
    let mut v = b.emit(Prim::Matmul, &[fa, fb])?;
    for op in views {
        v = b.emit(Prim::Shape(op.clone()), &[v])?;
    }
    Ok(v)
}

/// Walks back from `v` through reshapes and permutes to a product of two
/// matrices.
fn factors_of(g: &Builder, v: VarId) -> Option<Factors> {
    let chain = views::follow_views(&g.nodes, v, usize::MAX, |_, s, _| {
        matches!(s, Step::Reshape(_) | Step::Permute(_))
    });
    let node = &g.nodes[chain.source];
    if node.prim != Prim::Matmul || node.args.iter().any(|&a| g.ty(a).rank() != 2) {
        return None;
    }
    // the links followed: reshapes and permutes only
    let ops = views::steps(&g.nodes, &chain)
        .filter_map(|s| match s {
            Step::Permute(p) => Some(ShapeOp::Permute(p.to_vec())),
            Step::Reshape(s) => Some(ShapeOp::Reshape(s.to_vec())),
            Step::Broadcast(_) | Step::Cast(_) => None,
        })
        .collect();
    Some((node.args[0], node.args[1], ops))
}

impl Layout {
    /// The layout for `sc` with its results' cotangents `cts`, taking the
    /// cotangents out as factors for the operands `factors` names (by
    /// operand index, with the factors' shapes and the views).
    fn new(sc: &Scan, cts: &[Option<VarId>], factors: &[Factored]) -> Layout {
        let (nc, ns) = (sc.carries, sc.scanned);
        let n = sc.body.inputs.len();
        let float = |k: usize| sc.input_ty(k).dtype.is_float();
        let routes = (0..n)
            .map(|k| match factors.iter().find(|f| f.0 == k) {
                _ if k < nc || !float(k) => Route::None,
                Some((_, a, b, views)) => Route::Factors {
                    a: a.clone(),
                    b: b.clone(),
                    views: views.clone(),
                },
                None if k < nc + ns => Route::Step,
                None => Route::Summed,
            })
            .collect();
        Layout {
            floats: (0..nc).filter(|&k| float(k)).collect(),
            routes,
            ys: (0..sc.outputs()).filter(|&y| cts[sc.ys_at() + y].is_some()).collect(),
            reads: (0..nc)
                .filter(|&k| float(k) && cts.get(sc.reads_at() + k).is_some_and(Option::is_some))
                .collect(),
        }
    }

    /// The operands of one route, in order.
    fn of(&self, route: Route) -> Vec<usize> {
        let same = |r: &Route| std::mem::discriminant(r) == std::mem::discriminant(&route);
        (0..self.routes.len()).filter(|&k| same(&self.routes[k])).collect()
    }

    /// One backward step (its inputs as [`Layout`] lists them): the
    /// previous step's carries' cotangents (plus those of the carries read
    /// there), the sums plus this step's cotangents, this step's scanned
    /// cotangents and the factors. Also says which whole operands'
    /// cotangents are one product (for the layout's second pass).
    fn body(&self, sc: &Scan, b: &Builder) -> Result<(Graph, Vec<Factored>)> {
        let (nc, ns) = (sc.carries, sc.scanned);
        let n = sc.body.inputs.len();
        let summed = self.of(Route::Summed);
        let outs = sc.body.output_types();
        let groups: [Vec<TensorType>; 7] = [
            self.floats.iter().map(|&k| sc.input_ty(k).clone()).collect(),
            summed.iter().map(|&k| sc.input_ty(k).clone()).collect(),
            (0..nc + ns).map(|k| sc.input_ty(k).clone()).collect(),
            self.ys.iter().map(|&y| outs[nc + y].clone()).collect(),
            self.reads.iter().map(|&k| sc.input_ty(k).clone()).collect(),
            (nc + ns..n).map(|k| sc.input_ty(k).clone()).collect(),
            Vec::new(),
        ];
        let types: Vec<TensorType> = groups.iter().flatten().cloned().collect();
        let mut found = Vec::new();
        let graph = graph_of(b, &types, |sb, ins| {
            let mut rest = ins;
            let mut take = |n: usize| {
                let (head, tail) = rest.split_at(n);
                rest = tail;
                head.to_vec()
            };
            let (gc, acc, xs, cty, ctr) = (
                take(groups[0].len()),
                take(groups[1].len()),
                take(groups[2].len()),
                take(groups[3].len()),
                take(groups[4].len()),
            );
            let body_ins: Vec<VarId> = xs.iter().copied().chain(take(groups[5].len())).collect();
            // the seeds: the next carries' cotangents and this step's outputs'
            let mut seeds: Vec<(usize, VarId)> = self.floats.iter().copied().zip(gc.iter().copied()).collect();
            seeds.extend(self.ys.iter().map(|&y| nc + y).zip(cty.iter().copied()));
            let wrt: Vec<bool> = (0..n)
                .map(|k| self.floats.contains(&k) || self.routes[k] != Route::None)
                .collect();
            let (_, cts) = walk::vjp_graph(&sc.body, sb, &body_ins, &wrt, &seeds)?;
            let mut next = Vec::new();
            for &k in &self.floats {
                let mut g = sb.or_zeros(cts[k], body_ins[k])?;
                if let Some(j) = self.reads.iter().position(|&r| r == k) {
                    g = sb.bin(Binary::Add, g, ctr[j])?;
                }
                next.push(g);
            }
            for (j, &k) in summed.iter().enumerate() {
                let g = sb.or_zeros(cts[k], body_ins[k])?;
                next.push(sb.bin(Binary::Add, acc[j], g)?);
            }
            for k in self.of(Route::Step) {
                next.push(sb.or_zeros(cts[k], body_ins[k])?);
            }
            // in operand order, as the layout placed them
            for k in self.of(Route::Factors {
                a: vec![],
                b: vec![],
                views: vec![],
            }) {
                let (fa, fb, _) = cts[k]
                    .and_then(|c| factors_of(sb, c))
                    .ok_or_else(|| Error::internal("scan", "a factored cotangent is no longer a product"))?;
                next.extend([fa, fb]);
            }
            // whole float operands whose cotangent is one product
            found = (nc + ns..n)
                .filter(|&k| sc.input_ty(k).dtype.is_float())
                .filter_map(|k| {
                    let (fa, fb, views) = factors_of(sb, cts[k]?)?;
                    Some((k, sb.dims(fa), sb.dims(fb), views))
                })
                .collect();
            Ok(next)
        })?;
        Ok((graph, found))
    }
}
