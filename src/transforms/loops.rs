//! Loops inside a traced function: [`scan`] (JAX's `lax.scan`), one node
//! of the graph whatever the trip count, under every transform.
//!
//! The body is traced once, in a trace nested in the caller's: its carry
//! and outputs are packed into one vector per step (so they share one
//! dtype), the values it reads from the enclosing trace (weights) become
//! operands every step reads whole, and the loop's rules
//! (`rules::scan`) batch and differentiate it.

use super::next_builder_id;
use crate::error::{Error, Result};
use crate::ir::{Prim, Scan, TensorType};
use crate::rules::Builder;
use crate::trace::{Operand, Tracer};
use std::sync::Arc;

/// How a [`scan_with`] runs: backwards, or a number of steps with no
/// scanned operand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanOptions {
    reverse: bool,
    length: Option<usize>,
}

impl ScanOptions {
    /// Forwards, the trip count from the scanned operands.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs from the last row of the scanned operands to the first (the
    /// outputs still stack in the rows' order), as JAX's `reverse=True`.
    pub fn reverse(mut self) -> Self {
        self.reverse = true;
        self
    }

    /// The trip count: needed where nothing is scanned, checked against
    /// the scanned operands' leading axis otherwise.
    pub fn length(mut self, steps: usize) -> Self {
        self.length = Some(steps);
        self
    }
}

/// What a loop's body returns: the next carry and this step's outputs.
type Step = Result<(Vec<Tracer>, Vec<Tracer>)>;

/// `lax.scan`: runs `f(carry, xs[t])` for `t = 0..T`, each step's carry
/// the one the step before returned, and returns the final carry and each
/// output stacked over the steps (`[T, ..]`). Every `xs` is scanned along
/// its first axis (all of one length `T`). Inside a traced function only;
/// one node of the graph whatever `T`, so the graph does not grow with
/// the sequence. The carry and the outputs share one dtype; a body that
/// returns a carry of another shape or dtype than it was given is an
/// [`Error::Shape`] naming the loop.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::scan;
/// use candle_func::{jit, Tracer};
/// // running sums: carry s, output s + x
/// let f = |xs: Tracer| {
///     let init = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 0.0)?;
///     let (_, ys) = scan(|c: &[Tracer], x: &[Tracer]| {
///         let s = c[0].add(&x[0])?;
///         Ok((vec![s.clone()], vec![s]))
///     }, &[init], &[xs])?;
///     Ok(ys[0].clone())
/// };
/// let xs = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu)?;
/// let ys = jit(f).call(&xs)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[1., 2.], [4., 6.], [9., 12.]]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn scan(
    f: impl FnOnce(&[Tracer], &[Tracer]) -> Step,
    init: &[Tracer],
    xs: &[Tracer],
) -> Result<(Vec<Tracer>, Vec<Tracer>)> {
    scan_with(f, init, xs, ScanOptions::new())
}

/// [`scan`] with [`ScanOptions`]: backwards, or a trip count with no
/// scanned operand (`xs` empty).
pub fn scan_with(
    f: impl FnOnce(&[Tracer], &[Tracer]) -> Step,
    init: &[Tracer],
    xs: &[Tracer],
    opts: ScanOptions,
) -> Result<(Vec<Tracer>, Vec<Tracer>)> {
    let all: Vec<Tracer> = init.iter().chain(xs).cloned().collect();
    let outer = super::innermost(&[all]).ok_or_else(|| {
        Error::shape(
            "scan",
            &[],
            "needs a carry or a scanned operand to know which trace it is in",
        )
    })?;
    let length = trip_count(xs, opts.length)?;
    let dtype = one_dtype(init, "the carry")?;
    // the body traced once, nested in the caller's trace
    let given = outer.borrow().given;
    let inner = Builder::child(&outer, next_builder_id(), given);
    let nc: usize = init.iter().map(Tracer::elem_count).sum();
    let packed_in = {
        let id = inner
            .borrow_mut()
            .input(TensorType::new(vec![nc], dtype.unwrap_or(candle_core::DType::F32)));
        Tracer::new(&inner, id)
    };
    let carry = unpack(&packed_in, init.iter().map(|t| t.dims().to_vec()))?;
    let steps = xs
        .iter()
        .map(|x| {
            let id = inner
                .borrow_mut()
                .input(TensorType::new(x.dims()[1..].to_vec(), x.dtype()));
            Tracer::new(&inner, id)
        })
        .collect::<Vec<_>>();
    let (next, ys) = f(&carry, &steps)?;
    check_carry(init, &next)?;
    let y_dtype = one_dtype(&ys, "the outputs")?;
    if let (Some(c), Some(y)) = (dtype, y_dtype) {
        if c != y {
            return Err(Error::shape(
                "scan",
                &[],
                format!("the carry is {c:?} and the outputs {y:?}: a loop's carry and outputs share one dtype"),
            ));
        }
    }
    let Some(dtype) = dtype.or(y_dtype) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let y_shapes: Vec<Vec<usize>> = ys.iter().map(|y| y.dims().to_vec()).collect();
    if length == 0 {
        // no step runs: the carry as given, outputs with no rows
        let like = &outer_tracer(&outer, init, xs)?;
        let empty = y_shapes
            .iter()
            .map(|s| candle_core::Tensor::zeros([&[0], &s[..]].concat(), dtype, &like.device())?.to_tracer(like))
            .collect::<Result<Vec<_>>>();
        return Ok((init.to_vec(), empty?));
    }
    let (graph, captures) = {
        let pieces: Vec<Tracer> = next.iter().chain(&ys).map(Tracer::flatten_all).collect::<Result<_>>()?;
        let packed = Tracer::cat(&pieces.iter().collect::<Vec<_>>(), 0)?;
        let mut bb = inner.borrow_mut();
        let out = bb.lift(&packed.outer())?;
        let (mut graph, captures) = bb.finish(vec![out]);
        // a loop with no carry reads none: its empty carry takes the
        // outputs' dtype, which was not known before the body ran
        let first = graph.inputs[0];
        graph.nodes[first].ty.dtype = dtype;
        (graph, captures)
    };
    // operands in the caller's trace: the packed initial carry, the
    // scanned operands, then whatever the body read from outside
    let like = outer_tracer(&outer, init, xs)?;
    let init_packed = match init.len() {
        0 => candle_core::Tensor::zeros(0, dtype, &like.device())?.to_tracer(&like)?,
        _ => {
            let flat: Vec<Tracer> = init.iter().map(Tracer::flatten_all).collect::<Result<_>>()?;
            Tracer::cat(&flat.iter().collect::<Vec<_>>(), 0)?
        }
    };
    let mut ob = outer.borrow_mut();
    let mut operands = vec![ob.lift(&init_packed.outer())?];
    for x in xs {
        operands.push(ob.lift(&x.outer())?);
    }
    for c in &captures {
        operands.push(ob.lift(c)?);
    }
    let sc = Scan {
        body: Arc::new(graph.eliminate_dead_code()),
        carry: nc,
        scanned: xs.len(),
        length,
        reverse: opts.reverse,
    };
    let rows = ob.emit(Prim::Scan(Box::new(sc)), &operands)?;
    drop(ob);
    let rows = Tracer::new(&outer, rows);
    // the final carry is in the row the last step wrote
    let last_row = if opts.reverse { 0 } else { length - 1 };
    let last = rows.narrow(0, last_row, 1)?.squeeze(0)?;
    let carry = unpack(&last.narrow(0, 0, nc)?, init.iter().map(|t| t.dims().to_vec()))?;
    let mut outs = Vec::with_capacity(ys.len());
    let mut at = nc;
    for s in y_shapes {
        let n: usize = s.iter().product();
        outs.push(rows.narrow(1, at, n)?.reshape([&[length], &s[..]].concat())?);
        at += n;
    }
    Ok((carry, outs))
}

/// A tracer of the caller's trace, to make constants next to.
fn outer_tracer(outer: &crate::rules::BuilderRef, init: &[Tracer], xs: &[Tracer]) -> Result<Tracer> {
    let t = init
        .iter()
        .chain(xs)
        .next()
        .ok_or_else(|| Error::internal("scan", "no operand"))?;
    let id = outer.borrow_mut().lift(&t.outer())?;
    Ok(Tracer::new(outer, id))
}

/// The vector `packed` cut into pieces of the given shapes.
fn unpack(packed: &Tracer, shapes: impl Iterator<Item = Vec<usize>>) -> Result<Vec<Tracer>> {
    let mut at = 0;
    shapes
        .map(|s| {
            let n: usize = s.iter().product();
            let t = packed.narrow(0, at, n)?.reshape(s)?;
            at += n;
            Ok(t)
        })
        .collect()
}

/// The number of steps: the scanned operands' common leading axis, or
/// `length` (which must agree with it).
fn trip_count(xs: &[Tracer], length: Option<usize>) -> Result<usize> {
    let shapes: Vec<&[usize]> = xs.iter().map(Tracer::dims).collect();
    let mut n = length;
    for x in xs {
        let Some(&t) = x.dims().first() else {
            return Err(Error::shape(
                "scan",
                &shapes,
                "a scanned operand is a scalar, with no axis to scan",
            ));
        };
        match n {
            Some(m) if m != t => {
                return Err(Error::shape(
                    "scan",
                    &shapes,
                    format!("scanned operands of {m} and {t} steps (each scans its first axis)"),
                ))
            }
            _ => n = Some(t),
        }
    }
    n.ok_or_else(|| Error::shape("scan", &[], "nothing scanned and no length given"))
}

/// The one dtype of `ts` (`None` where empty).
fn one_dtype(ts: &[Tracer], what: &str) -> Result<Option<candle_core::DType>> {
    let Some(first) = ts.first() else { return Ok(None) };
    match ts.iter().find(|t| t.dtype() != first.dtype()) {
        Some(t) => Err(Error::shape(
            "scan",
            &[],
            format!(
                "{what} mix {:?} and {:?}: a loop's carry and outputs share one dtype",
                first.dtype(),
                t.dtype()
            ),
        )),
        None => Ok(Some(first.dtype())),
    }
}

/// The body's carry must be the one it was given, leaf for leaf.
fn check_carry(init: &[Tracer], next: &[Tracer]) -> Result<()> {
    let shapes: Vec<&[usize]> = init.iter().chain(next).map(Tracer::dims).collect();
    if init.len() != next.len() {
        return Err(Error::shape(
            "scan",
            &shapes,
            format!("the body returned {} carries for {} given", next.len(), init.len()),
        ));
    }
    for (k, (a, b)) in init.iter().zip(next).enumerate() {
        if a.dims() != b.dims() || a.dtype() != b.dtype() {
            return Err(Error::shape(
                "scan",
                &shapes,
                format!(
                    "the body changed carry {k} from {:?} {:?} to {:?} {:?}: a loop's carry keeps its shape and dtype",
                    a.dtype(),
                    a.dims(),
                    b.dtype(),
                    b.dims()
                ),
            ));
        }
    }
    Ok(())
}
