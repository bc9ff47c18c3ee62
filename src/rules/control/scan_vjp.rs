//! A scan's VJP: a scan the other way over the saved carries, whose body
//! is one step's VJP (recomputing the step's insides from its carry).
//!
//! The backward loop carries the carry's cotangent and, for an operand
//! every step reads whole, the sum of its cotangents so far. A sum of
//! products is better left out of the loop: where a whole operand's
//! cotangent in one step is a matrix product of that step's values, seen
//! through reshapes and permutes (`h_{t-1}^T g_t` for a recurrent weight
//! used as `h W^T`), the loop outputs the two factors of every step and
//! one product after it contracts over the steps too:
//! `sum_t A_t B_t = [A_1 .. A_T] [B_1; ..; B_T]` (`T m r -> m (T r)`).
//! Per example under `vmap` that is one batched product instead of `T`
//! rank-one updates of a `[B, m, n]` sum carried through the loop, and it
//! is the product the ghost-norm rules recognise.

use super::{flat, piece};
use crate::error::{Error, Result};
use crate::ir::ops::{Binary, ShapeOp};
use crate::ir::{Graph, Prim, Scan, TensorType, VarId};
use crate::rules::{walk, Builder, Cts};
use candle_core::DType;
use std::sync::Arc;

/// How an operand's cotangent leaves the backward loop.
#[derive(Clone, Debug, PartialEq)]
enum Route {
    /// None: not a float operand.
    None,
    /// Per step, at this offset of the step's outputs (a scanned operand).
    Step(usize),
    /// Summed in the carry, at this offset of the accumulators.
    Summed(usize),
    /// As the two factors of a product per step, at this offset of the
    /// step's outputs, then contracted over the steps and viewed through
    /// `views` (the shape operations between the product and the
    /// cotangent).
    Factors {
        at: usize,
        a: Vec<usize>,
        b: Vec<usize>,
        views: Vec<ShapeOp>,
    },
}

/// The layout of the backward loop: the carry's cotangent (`ncf`
/// entries, batch axes flattened too), then the accumulators (`nacc`);
/// per step, the scanned operands' cotangents, then the factors.
struct Layout {
    dtype: DType,
    ncf: usize,
    nacc: usize,
    routes: Vec<Route>,
}

/// Emits the VJP of the scan `sc` (operands `args`, result `out`, its
/// cotangent `ct`): the cotangent of each operand.
pub(super) fn emit(sc: &Scan, b: &mut Builder, args: &[VarId], out: VarId, ct: VarId) -> Result<Cts> {
    // a first trace of the step's VJP finds the products to take out
    let probe = Layout::new(sc, b, args, &[])?;
    let (_, factors) = probe.body(sc, b)?;
    let layout = Layout::new(sc, b, args, &factors)?;
    let (graph, _) = layout.body(sc, b)?;
    let cin = sc.carries_in(b, args[0], out)?;
    let mut operands = vec![b.zeros(vec![layout.ncf + layout.nacc], layout.dtype)?, cin];
    operands.extend_from_slice(&args[1..=sc.scanned]);
    operands.push(ct);
    operands.extend_from_slice(&args[1 + sc.scanned..]);
    let back = Scan {
        body: Arc::new(graph),
        carry: layout.ncf + layout.nacc,
        scanned: sc.scanned + 2,
        length: sc.length,
        reverse: !sc.reverse,
        every_carry: true,
    };
    let rows = back.emit(b, &operands)?;
    // the backward loop ends at the forward loop's first step
    let first = if sc.reverse { sc.length - 1 } else { 0 };
    let last = b.narrow(rows, 0, first, 1)?;
    let last = flat(b, last)?;
    let carry_shape = b.dims(args[0]);
    let mut cts: Cts = vec![Some(piece(b, last, 0, 0, &carry_shape)?)];
    let steps = layout.ncf + layout.nacc;
    for k in 1..args.len() {
        let shape = sc.input_ty(k).shape.clone();
        cts.push(match &layout.routes[k] {
            Route::None => None,
            Route::Step(at) => Some(piece(b, rows, 1, steps + at, &shape)?),
            Route::Summed(at) => Some(piece(b, last, 0, layout.ncf + at, &shape)?),
            Route::Factors { at, a, b: bs, views } => Some(contract(b, rows, steps + at, (a, bs), sc.length, views)?),
        });
        if let Some(c) = cts[k] {
            cts[k] = Some(b.cast(c, sc.input_ty(k).dtype)?);
        }
    }
    Ok(cts)
}

/// `sum_t A_t B_t` from the stacked factors in `rows` (`A_t` `[m, r]` at
/// `at`, then `B_t` `[r, n]`), viewed through `views`.
fn contract(
    b: &mut Builder,
    rows: VarId,
    at: usize,
    (a, bs): (&[usize], &[usize]),
    steps: usize,
    views: &[ShapeOp],
) -> Result<VarId> {
    let (m, r, n) = (a[0], a[1], bs[1]);
    let fa = piece(b, rows, 1, at, a)?; // T m r
    let fb = piece(b, rows, 1, at + m * r, bs)?; // T r n
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

/// The factors of a cotangent that is one product of two matrices seen
/// through shape operations: the product's operands and those views.
type Factors = (VarId, VarId, Vec<ShapeOp>);

/// A whole operand whose cotangent is one product per step: its index,
/// the factors' shapes, the views.
type Factored = (usize, Vec<usize>, Vec<usize>, Vec<ShapeOp>);

/// Walks back from `v` through reshapes and permutes to a product of two
/// matrices.
fn factors_of(g: &Builder, v: VarId) -> Option<Factors> {
    let mut views = Vec::new();
    let mut at = v;
    loop {
        let node = &g.nodes[at];
        match &node.prim {
            Prim::Shape(op @ (ShapeOp::Reshape(_) | ShapeOp::Permute(_))) => {
                views.push(op.clone());
                at = node.args[0];
            }
            Prim::Matmul if node.args.iter().all(|&a| g.ty(a).rank() == 2) => {
                views.reverse();
                return Some((node.args[0], node.args[1], views));
            }
            _ => return None,
        }
    }
}

impl Layout {
    /// The layout for `sc`'s operands, taking the cotangents out as
    /// factors for the operands `factors` names (by operand index, with
    /// the factors' shapes and the views).
    fn new(sc: &Scan, b: &Builder, args: &[VarId], factors: &[Factored]) -> Result<Layout> {
        let dtype = b.ty(args[0]).dtype;
        if !dtype.is_float() {
            return Err(Error::unsupported("scan", "grad", format!("a loop carrying {dtype:?}")));
        }
        let ncf = b.ty(args[0]).elem_count();
        let (mut nacc, mut nys) = (0, 0);
        let mut routes = vec![Route::None; args.len()];
        for (k, route) in routes.iter_mut().enumerate().skip(1) {
            let ty = sc.input_ty(k);
            if !ty.dtype.is_float() {
                continue;
            }
            // a float operand of another dtype than the carry (f32 weights
            // beside a carry widened to f64) has its cotangent carried in
            // the carry's dtype and converted back after the loop
            *route = if k <= sc.scanned {
                nys += ty.elem_count();
                Route::Step(nys - ty.elem_count())
            } else if factors.iter().any(|f| f.0 == k) {
                Route::None // placed below, after the scanned cotangents
            } else {
                nacc += ty.elem_count();
                Route::Summed(nacc - ty.elem_count())
            };
        }
        for (k, a, bs, views) in factors {
            routes[*k] = Route::Factors {
                at: nys,
                a: a.clone(),
                b: bs.clone(),
                views: views.clone(),
            };
            nys += a.iter().product::<usize>() + bs.iter().product::<usize>();
        }
        Ok(Layout {
            dtype,
            ncf,
            nacc,
            routes,
        })
    }

    /// One backward step: `(packed, carry read, steps.., ct, whole..)` to
    /// the carry-read's cotangent, the accumulators plus this step's
    /// summed cotangents, this step's scanned cotangents and the factors.
    /// Also says which whole operands' cotangents are one product (for the
    /// layout's second pass).
    fn body(&self, sc: &Scan, b: &Builder) -> Result<(Graph, Vec<Factored>)> {
        let scratch = Builder::scratch(b.given, b.ctx.clone());
        let mut sb = scratch.borrow_mut();
        let n = sc.body.inputs.len();
        let packed = sb.input(TensorType::new(vec![self.ncf + self.nacc], self.dtype));
        let mut ins = vec![sb.input(sc.input_ty(0).clone())];
        for k in 1..=sc.scanned {
            ins.push(sb.input(sc.input_ty(k).clone()));
        }
        let out_ty = sc.body.ty(sc.body.outputs[0]).clone();
        let ct = sb.input(out_ty.clone());
        for k in sc.scanned + 1..n {
            ins.push(sb.input(sc.input_ty(k).clone()));
        }
        // this step's value's cotangent: its own, plus the next step's
        // carry cotangent on the carry's entries
        let g = piece(&mut sb, packed, 0, 0, &sc.input_ty(0).shape)?;
        let last = out_ty.rank() - 1;
        let g = match out_ty.shape[last] > sc.carry {
            true => {
                let mut rest = out_ty.shape.clone();
                rest[last] -= sc.carry;
                let z = sb.zeros(rest, self.dtype)?;
                sb.concat(&[g, z], last)?
            }
            false => g,
        };
        let seed = sb.bin(Binary::Add, ct, g)?;
        let wrt: Vec<bool> = (0..n).map(|k| k == 0 || self.routes[k] != Route::None).collect();
        let (_, cts) = walk::vjp_graph(&sc.body, &mut sb, &ins, &wrt, &[(0, seed)])?;
        let ct_of = |sb: &mut Builder, k: usize| -> Result<VarId> {
            let c = sb.or_zeros(cts[k], ins[k])?;
            let c = flat(sb, c)?;
            sb.cast(c, self.dtype)
        };
        let mut parts = vec![ct_of(&mut sb, 0)?];
        let summed: Vec<usize> = (1..n).filter(|&k| matches!(self.routes[k], Route::Summed(_))).collect();
        if !summed.is_empty() {
            let acc = sb.narrow(packed, 0, self.ncf, self.nacc)?;
            let step = summed.iter().map(|&k| ct_of(&mut sb, k)).collect::<Result<Vec<_>>>()?;
            let step = sb.concat(&step, 0)?;
            parts.push(sb.bin(Binary::Add, acc, step)?);
        }
        for k in (1..n).filter(|&k| matches!(self.routes[k], Route::Step(_))) {
            parts.push(ct_of(&mut sb, k)?);
        }
        // in operand order, as the layout placed them
        for k in (1..n).filter(|&k| matches!(self.routes[k], Route::Factors { .. })) {
            let (fa, fb, _) = cts[k]
                .and_then(|c| factors_of(&sb, c))
                .ok_or_else(|| Error::internal("scan", "a factored cotangent is no longer a product"))?;
            parts.push(flat(&mut sb, fa)?);
            parts.push(flat(&mut sb, fb)?);
        }
        // whole float operands whose cotangent is one product
        let found = (sc.scanned + 1..n)
            .filter(|&k| sc.input_ty(k).dtype == self.dtype)
            .filter_map(|k| {
                let (fa, fb, views) = factors_of(&sb, cts[k]?)?;
                Some((k, sb.dims(fa), sb.dims(fb), views))
            })
            .collect();
        let out = sb.concat(&parts, 0)?;
        Ok((sb.finish(vec![out]).0.eliminate_dead_code(), found))
    }
}
