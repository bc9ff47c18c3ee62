//! `scan` and `fori_loop`: one `scan` node (or, checkpointed, a scan of
//! segments and one of the steps left over).

use super::{check_carry, emit, enclosing, leaves_of, outer_tracer, rebuild, same_tree, trace_nested, types_of};
use crate::error::{Error, Result};
use crate::ir::{Prim, Scan, TensorType};
use crate::rules::{BuilderRef, Outer};
use crate::trace::{Operand, Tracer};
use crate::transforms::tree::SymTree;
use std::sync::Arc;

/// How a [`scan_with`] runs: backwards, or a number of steps with no
/// scanned operand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanOptions {
    reverse: bool,
    length: Option<usize>,
    checkpoint: Option<usize>,
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

    /// What the loop's gradient keeps of its carries: one every `steps`
    /// steps, the others recomputed from the one before them while the
    /// backward pass goes over them (checkpointing). The loop runs as
    /// segments of `steps` steps, each a loop itself: a gradient holds
    /// `T / steps + steps` carries rather than `T`, for running the body
    /// forward once more (`steps` near `sqrt(T)` holds fewest). `1`
    /// keeps every carry. Without this setting a loop keeps every carry
    /// unless they alone would take more than an eighth of the memory
    /// limit ([`Options::memory_limit`](crate::Options::memory_limit),
    /// else the memory the machine had available when the process first
    /// asked, read once, so a traced loop does not change with the
    /// machine's load), and then checkpoints every
    /// `ceil(sqrt(T))` steps. A value of `0` is an error.
    pub fn checkpoint(mut self, steps: usize) -> Self {
        self.checkpoint = Some(steps);
        self
    }
}

/// What a loop's body returns, as leaves: the next carry and this step's
/// outputs.
type Step = Result<(Vec<Tracer>, Vec<Tracer>)>;

/// `lax.scan`: runs `f(carry, xs[t])` for `t = 0..T`, each step's carry
/// the one the step before returned, and returns the final carry and each
/// output stacked over the steps (every leaf `[T, ..]`). The carry, the
/// scanned operands and the outputs are trees (a tracer, a tuple, a
/// vector, a map); every leaf of `xs` is scanned along its first axis
/// (all of one length `T`). Inside a traced function only; one node of
/// the graph whatever `T`, so the graph does not grow with the sequence.
/// Leaves may be of any dtypes, as in JAX: each goes round as itself, a
/// value of the loop's node of its own type. A body that returns a carry of
/// another structure, shape or dtype than it was given is an
/// [`Error::Shape`] naming the loop.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::scan;
/// use candle_func::{jit, Tracer};
/// // running sums and step counts: carry (s, n), output s + x
/// let f = |xs: Tracer| {
///     let zero = xs.narrow(0, 0, 1)?.squeeze(0)?.affine(0.0, 0.0)?;
///     let ((_, n), ys) = scan(|(s, n): (Tracer, Tracer), x: Tracer| {
///         let s = s.add(&x)?;
///         Ok(((s.clone(), n.affine(1.0, 1.0)?), s))
///     }, (zero.clone(), zero.sum_all()?), xs)?;
///     Ok((ys, n))
/// };
/// let xs = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu)?;
/// let (ys, n) = jit(f).call(&xs)?;
/// assert_eq!(ys.to_vec2::<f32>()?, [[1., 2.], [4., 6.], [9., 12.]]);
/// assert_eq!(n.to_scalar::<f32>()?, 3.0);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn scan<C: SymTree, X: SymTree, Y: SymTree>(
    f: impl FnOnce(C, X) -> Result<(C, Y)>,
    init: C,
    xs: X,
) -> Result<(C, Y)> {
    scan_with(f, init, xs, ScanOptions::new())
}

/// [`scan`] with [`ScanOptions`]: backwards, or a trip count with no
/// scanned operand (`xs` an empty tree, such as `()` or `Vec::new()`).
pub fn scan_with<C: SymTree, X: SymTree, Y: SymTree>(
    f: impl FnOnce(C, X) -> Result<(C, Y)>,
    init: C,
    xs: X,
    opts: ScanOptions,
) -> Result<(C, Y)> {
    let (init, cdef) = leaves_of(&init);
    let (xs, xdef) = leaves_of(&xs);
    let mut ydef = None;
    let body = |c: &[Tracer], x: &[Tracer]| -> Step {
        let (next, y) = f(rebuild(&cdef, c.to_vec())?, rebuild(&xdef, x.to_vec())?)?;
        let next = same_tree("scan", "the body's carry", &next, &cdef)?;
        let (y, def) = leaves_of(&y);
        ydef = Some(def);
        Ok((next, y))
    };
    let (carry, ys) = scan_leaves(body, &init, &xs, opts)?;
    let ydef = ydef.ok_or_else(|| Error::internal("scan", "the body was not traced"))?;
    Ok((rebuild(&cdef, carry)?, rebuild(&ydef, ys)?))
}

/// [`scan_with`] on the leaves of the carry and the scanned operands.
fn scan_leaves(
    f: impl FnOnce(&[Tracer], &[Tracer]) -> Step,
    init: &[Tracer],
    xs: &[Tracer],
    opts: ScanOptions,
) -> Result<(Vec<Tracer>, Vec<Tracer>)> {
    let all: Vec<Tracer> = init.iter().chain(xs).cloned().collect();
    let outer = enclosing(&all).ok_or_else(|| {
        Error::shape(
            "scan",
            &[],
            "needs a carry or a scanned operand to know which trace it is in",
        )
    })?;
    let length = trip_count(xs, opts.length)?;
    // the body traced once, nested in the caller's trace: each carry leaf
    // and one step of each scanned operand in, next carries and outputs out
    let mut types = types_of(init);
    types.extend(xs.iter().map(|x| TensorType::new(x.dims()[1..].to_vec(), x.dtype())));
    let nc = init.len();
    let mut y_types = Vec::new();
    let (graph, captures) = trace_nested(&outer, &types, |ins| {
        let (next, ys) = f(&ins[..nc], &ins[nc..])?;
        check_carry("scan", init, &next)?;
        y_types = types_of(&ys);
        Ok([next, ys].concat())
    })?;
    if length == 0 {
        // no step runs: the carry as given, outputs with no rows
        let like = outer_tracer(&outer, init, xs)?;
        let empty = y_types
            .iter()
            .map(|t| {
                let shape = [&[0], &t.shape[..]].concat();
                candle_core::Tensor::zeros(shape, t.dtype, &like.device())?.to_tracer(&like)
            })
            .collect::<Result<Vec<_>>>();
        return Ok((init.to_vec(), empty?));
    }
    // operands in the caller's trace: the initial carries, the scanned
    // operands, then whatever the body read from outside
    let operands: Vec<Tracer> = init.iter().chain(xs).cloned().collect();
    let sc = Scan {
        body: Arc::new(graph.eliminate_dead_code()),
        carries: nc,
        scanned: xs.len(),
        length,
        reverse: opts.reverse,
        reads: true,
    };
    let carry_bytes: usize = init.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
    let every = segment_length(&outer, &opts, length, carry_bytes)?;
    let mut results = match every {
        Some(k) => segmented(&outer, sc, k, &operands, &captures)?,
        None => emit(&outer, Prim::Scan(Box::new(sc)), &operands, &[captures])?,
    };
    // final carries, then the stacked outputs (the carries read stay for a VJP)
    results.truncate(nc + y_types.len());
    let ys = results.split_off(nc);
    Ok((results, ys))
}

/// The steps per segment a scan of `steps` steps whose carry takes
/// `carry_bytes` runs in (`None`: one loop, every carry kept): the
/// options' choice, else `ceil(sqrt(T))` where the carries would take more
/// than an eighth of the memory limit.
fn segment_length(outer: &BuilderRef, opts: &ScanOptions, steps: usize, carry_bytes: usize) -> Result<Option<usize>> {
    let every = match opts.checkpoint {
        Some(0) => {
            return Err(Error::shape(
                "scan",
                &[],
                "ScanOptions::checkpoint(0): a checkpoint every 0 steps (1 keeps every carry)",
            ))
        }
        Some(k) => k,
        None => {
            let limit = outer.borrow().given.machine().trace_bytes();
            let held = steps.saturating_mul(carry_bytes);
            match limit {
                Some(l) if held > l / 8 => {
                    let root = steps.isqrt();
                    root + usize::from(root * root < steps)
                }
                _ => 1,
            }
        }
    };
    Ok((1 < every && every < steps).then_some(every))
}

/// The scan `sc` over `operands` (the carries, the scanned operands; then
/// `captures`) run as segments of `k` steps (`Scan::segmented`), the
/// steps left over in a loop of their own after them (before them where it
/// runs backwards): its final carries and stacked outputs.
fn segmented(outer: &BuilderRef, sc: Scan, k: usize, operands: &[Tracer], captures: &[Outer]) -> Result<Vec<Tracer>> {
    let (nc, ns, steps, reverse) = (sc.carries, sc.scanned, sc.length, sc.reverse);
    let ny = sc.outputs();
    let segments = steps / k;
    let left = steps - segments * k;
    // the segments cover the first S k steps, or the last where it runs
    // backwards (which starts at the end)
    let (main, rest) = if reverse { (left, 0) } else { (0, segments * k) };
    let (given, ctx) = {
        let ob = outer.borrow();
        (ob.given, ob.ctx.clone())
    };
    let outer_sc = sc.segmented(k, segments, given, ctx)?;
    let mut ops = operands[..nc].to_vec();
    for x in &operands[nc..nc + ns] {
        // T .. -> S k ..
        let mut shape = vec![segments, k];
        shape.extend_from_slice(&x.dims()[1..]);
        ops.push(x.narrow(0, main, segments * k)?.reshape(shape)?);
    }
    let mut got = emit(outer, Prim::Scan(Box::new(outer_sc)), &ops, &[captures.to_vec()])?;
    got.truncate(nc + ny);
    // S k .. -> (S k) ..
    for y in &mut got[nc..] {
        let mut shape = vec![segments * k];
        shape.extend_from_slice(&y.dims()[2..]);
        *y = y.reshape(shape)?;
    }
    if left == 0 {
        return Ok(got);
    }
    let mut ops = got[..nc].to_vec();
    for x in &operands[nc..nc + ns] {
        ops.push(x.narrow(0, rest, left)?);
    }
    let tail = Scan { length: left, ..sc };
    let tail = emit(outer, Prim::Scan(Box::new(tail)), &ops, &[captures.to_vec()])?;
    let mut out = tail[..nc].to_vec();
    for (y, t) in got[nc..].iter().zip(&tail[nc..nc + ny]) {
        let parts = if reverse { [t, y] } else { [y, t] };
        out.push(Tracer::cat(&parts, 0)?);
    }
    Ok(out)
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

/// `fori_loop`: `carry = body(i, carry)` for `i` in `lower..upper` (an
/// `i64` scalar), as JAX's `lax.fori_loop`, the carry a tree. A `scan` of
/// `upper - lower` steps underneath, so reverse-differentiable (unlike
/// [`while_loop`](super::while_loop)); no step runs where `upper <= lower`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::loops::fori_loop;
/// use candle_func::{grad, Tracer};
/// // x^(2^3) by squaring three times; its derivative at 1.5
/// let f = |x: Tracer| fori_loop(0, 3, |_i: &Tracer, c: Tracer| c.sqr(), x);
/// let g = grad(f).call(&Tensor::new(1.5f64, &Device::Cpu)?)?;
/// assert!((g.to_scalar::<f64>()? - 8.0 * 1.5f64.powi(7)).abs() < 1e-9);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn fori_loop<C: SymTree>(
    lower: usize,
    upper: usize,
    body: impl FnOnce(&Tracer, C) -> Result<C>,
    init: C,
) -> Result<C> {
    let (init_leaves, _) = leaves_of(&init);
    let like = init_leaves
        .first()
        .ok_or_else(|| Error::shape("fori_loop", &[], "needs a carry"))?;
    if upper <= lower {
        return Ok(init);
    }
    // the indices are a scanned operand: a trip count past memory is an
    // error here, not an aborted allocation
    let n = upper - lower;
    crate::env::check_host_alloc("fori_loop", &format!("the indices {lower}..{upper}"), n, 8)?;
    if i64::try_from(upper - 1).is_err() {
        return Err(Error::shape(
            "fori_loop",
            &[],
            format!("index {} overflows i64", upper - 1),
        ));
    }
    let mut steps: Vec<i64> = crate::env::host_vec("fori_loop", "the indices", n)?;
    steps.extend((lower..upper).map(|i| i as i64));
    let idx = candle_core::Tensor::from_vec(steps, n, &like.device())?.to_tracer(like)?;
    let (carry, ()) = scan(|c: C, i: Tracer| Ok((body(&i, c)?, ())), init, idx)?;
    Ok(carry)
}
