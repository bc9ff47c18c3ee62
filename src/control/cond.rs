//! `cond` and `switch`: one `cond` node, its branches traced apart on the
//! operands and chosen by an index (JAX's `cond_p` serves both).

use super::{align, emit, enclosing, leaves_of, rebuild, trace_nested};
use crate::error::{Error, Result};
use crate::ir::{Cond, Prim, TensorType};
use crate::rules::Outer;
use crate::trace::Tracer;
use crate::transforms::tree::{SymTree, TreeDef};
use candle_core::DType;
use std::sync::Arc;

/// `cond`: `on_true(operands)` where `pred` (a scalar; nonzero: true)
/// holds, else `on_false(operands)`, as JAX's `lax.cond`. The operands
/// and the values are trees. The branch not taken does not run. Both
/// branches give trees of the same structure, shapes and dtypes (leaves
/// of any dtypes, each a result of the node of its own type). Under `vmap` with a predicate per
/// example, each example's result and gradient are those of its own
/// branch under every schedule: batched, each branch some example takes
/// runs once on all rows, those of the examples not taking it replaced by
/// a taking example's (so a guard such as `i < 5` before `table[i]` holds
/// on every row it sees, and the branch not taken never puts a NaN in a
/// gradient, unlike JAX's `select`), a branch no example takes does not
/// run, and each example keeps its own result; under
/// `Schedule::PerExample` each example runs only its own branch. Pass
/// what the branches compute on as `operands`: an operation a branch
/// applies to a tracer it reads from outside is traced before the `cond`
/// and runs whatever the predicate.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::cond;
/// use candle_func::{vmap, Tracer};
/// let f = |x: Tracer| {
///     let neg = x.lt(0.0)?;
///     cond(&neg, |o: Tracer| o.neg(), |o: Tracer| o.sqr(), x)
/// };
/// let y = vmap(f).call(&Tensor::new(&[-2f32, 3.0], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [2.0, 9.0]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn cond<O: SymTree, R: SymTree>(
    pred: &Tracer,
    on_true: impl FnOnce(O) -> Result<R>,
    on_false: impl FnOnce(O) -> Result<R>,
    operands: O,
) -> Result<R> {
    if pred.rank() != 0 {
        return Err(Error::shape("cond", &[pred.dims()], "the predicate must be a scalar"));
    }
    // nonzero (NaN included, as `bool(nan)`) picks branch 1
    let index = pred.ne(0.0)?;
    let (ops, odef) = leaves_of(&operands);
    let fs: Vec<Box<Once<'_>>> = vec![on_leaves(&odef, on_false), on_leaves(&odef, on_true)];
    let (outs, rdef) = branches("cond", &index, fs, &ops)?;
    rebuild(&rdef, outs)
}

/// `f` on the leaves of a tree of structure `def`, giving its value's
/// leaves and structure.
fn on_leaves<'a, O: SymTree, R: SymTree>(def: &'a TreeDef, f: impl FnOnce(O) -> Result<R> + 'a) -> Box<Once<'a>> {
    Box::new(move |ins: &[Tracer]| Ok(leaves_of(&f(rebuild(def, ins.to_vec())?)?)))
}

/// `switch`: `branches[index](operands)`, as JAX's `lax.switch`: `index`
/// an integer scalar, clamped into `0..branches.len()`, and only that
/// branch runs. The operands and the values are trees; every branch
/// gives a tree of the same structure, shapes and dtypes. Under `vmap`
/// with an index per example, each example's result and gradient are its
/// own branch's, as for [`cond`]:
/// each branch some example takes runs once, batched, on rows that take
/// it or copy one that does.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::switch;
/// use candle_func::{vmap, Tracer};
/// // a per-example choice of activation
/// let f = |(k, x): (Tracer, Tracer)| {
///     switch(&k, &[&|o: Tracer| o.relu(), &|o: Tracer| o.tanh(), &|o: Tracer| o.neg()], x)
/// };
/// let k = Tensor::new(&[0u32, 2, 7], &Device::Cpu)?; // 7 is clamped to 2
/// let x = Tensor::new(&[-1f32, 3.0, 4.0], &Device::Cpu)?;
/// let y = vmap(f).call((&k, &x))?;
/// assert_eq!(y.to_vec1::<f32>()?, [0.0, -3.0, -4.0]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn switch<O: SymTree, R: SymTree>(index: &Tracer, branches: &[&Branch<'_, O, R>], operands: O) -> Result<R> {
    if index.rank() != 0 || index.dtype().is_float() {
        return Err(Error::shape(
            "switch",
            &[index.dims()],
            format!("the index must be an integer scalar, got {:?}", index.dtype()),
        ));
    }
    let n = branches.len();
    if n == 0 {
        return Err(Error::shape("switch", &[], "no branches"));
    }
    // JAX's clamp, in i64 (u8 and u32 hold no negatives; i64 may)
    let index = match index.dtype() {
        DType::I64 => index.clamp(0.0, (n - 1) as f64)?,
        _ => index.to_dtype(DType::I64)?.clamp(0.0, (n - 1) as f64)?,
    };
    let (ops, odef) = leaves_of(&operands);
    let fs: Vec<Box<Once<'_>>> = branches.iter().map(|&f| on_leaves(&odef, f)).collect();
    let (outs, rdef) = self::branches("switch", &index, fs, &ops)?;
    rebuild(&rdef, outs)
}

/// A branch of a [`switch`]: its operands to its values, both trees.
pub type Branch<'a, O, R> = dyn Fn(O) -> Result<R> + 'a;

/// A branch traced once on the operands' leaves: its values' leaves and
/// structure.
type Once<'a> = dyn FnOnce(&[Tracer]) -> Result<(Vec<Tracer>, TreeDef)> + 'a;

/// Emits a `cond` node of `fs` traced on `operands`, chosen by `index`
/// (an integer scalar already in range), for `op`.
fn branches(
    op: &'static str,
    index: &Tracer,
    fs: Vec<Box<Once<'_>>>,
    operands: &[Tracer],
) -> Result<(Vec<Tracer>, TreeDef)> {
    let all: Vec<Tracer> = std::iter::once(index.clone()).chain(operands.iter().cloned()).collect();
    let outer = enclosing(&all).ok_or_else(|| Error::internal(op, "no trace"))?;
    let types: Vec<TensorType> = operands.iter().map(|t| t.ty.clone()).collect();
    let mut traced = Vec::with_capacity(fs.len());
    for f in fs {
        let (mut outs, mut def) = (Vec::new(), None);
        let (g, caps) = trace_nested(&outer, &types, |ins| {
            let (got, d) = f(ins)?;
            if got.is_empty() {
                return Err(Error::shape(op, &[], "a branch gives no value"));
            }
            outs = got.iter().map(|t| t.ty.clone()).collect::<Vec<_>>();
            def = Some(d);
            Ok(got)
        })?;
        let def = def.ok_or_else(|| Error::internal(op, "a branch was not traced"))?;
        traced.push((g, caps, (outs, def)));
    }
    let first = traced[0].2.clone();
    if let Some((_, _, other)) = traced.iter().find(|(_, _, o)| *o != first) {
        let shapes: Vec<&[usize]> = first.0.iter().chain(&other.0).map(|t| t.shape.as_slice()).collect();
        return Err(Error::shape(
            op,
            &shapes,
            match first.1 == other.1 {
                true => format!(
                    "the branches give {:?} and {:?}: every branch must give the same shapes and dtypes",
                    first.0, other.0
                ),
                false => format!(
                    "the branches give trees of the structures {:?} and {:?}: every branch must give the same shapes and dtypes, in one structure",
                    first.1, other.1
                ),
            },
        ));
    }
    let def = first.1;
    // every branch takes the operands, then every branch's captures in
    // branch order (a branch ignores the others')
    let caps: Vec<Vec<Outer>> = traced.iter().map(|t| t.1.clone()).collect();
    let n = operands.len();
    let graphs = traced.into_iter().enumerate().map(|(k, (g, _, _))| {
        let before: Vec<Outer> = caps[..k].concat();
        let after: Vec<Outer> = caps[k + 1..].concat();
        Arc::new(align(g, n, &before, &after))
    });
    let c = Cond {
        branches: graphs.collect(),
    };
    let mut ops = vec![index.clone()];
    ops.extend_from_slice(operands);
    Ok((emit(&outer, Prim::Cond(Box::new(c)), &ops, &caps)?, def))
}
