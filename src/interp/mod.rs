//! The interpreter: runs a graph on candle tensors, on the inputs' device,
//! dropping every intermediate after its last use. Every computed node
//! runs through its primitive's rule; a primitive that holds sub-graphs
//! (`map`, `scan`, `cond`, `while_loop`) runs them through the runner the
//! interpreter hands it ([`Nested`]), so none is special here.
//!
//! Graphs reach it through one door, [`exec::Executable`]: the fixed
//! list of passes that prepares a graph to run ([`passes`]), its memory
//! plan worked out once and checked against the limit, and its seed.

pub(crate) mod exec;
pub(crate) mod passes;
mod prepared;

pub use prepared::Prepared;

use crate::env::mix;
use crate::error::{CandleContext, Error, Result};
use crate::ir::{Graph, Prim, TensorType};
use crate::kernels::Kx;
use crate::rules::{rule, Graphs, RunCx};
use candle_core::{Device, Tensor};
use std::collections::HashMap;

/// What a run held at its peak: the number of values alive at once and
/// their bytes (inputs and captured constants included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Most values held at the same time.
    pub peak_values: usize,
    /// Most bytes held at the same time: the buffers behind the live
    /// values, each counted once however many views of it are live (as
    /// far as the furthest view reaches into it).
    pub peak_bytes: usize,
    /// Bytes copied to lay out the operands of matrix products and
    /// convolutions (a transposed operand made row-major, a strided one
    /// contiguous) rather than to compute. Copies made inside other
    /// kernels (padding, pooling, elementwise operands) and inside
    /// candle's own operations are not counted.
    pub copied_bytes: usize,
}

/// Seconds each computed node took, as `(node, seconds)` in graph order.
pub type NodeTimes = Vec<(usize, f64)>;

/// Runs `g` on `inputs` (in the graph's input order) and returns its outputs.
/// Inputs must match the graph's input types; constants must live on the
/// inputs' device. `seed` seeds the graph's random draws.
#[cfg(test)]
fn run(g: &Graph, inputs: &[Tensor], seed: u64) -> Result<Vec<Tensor>> {
    let copies = crate::kernels::copies::Copies::default();
    let partners = crate::rules::memory::partners(g);
    run_inner(
        (g, &partners),
        inputs,
        seed,
        None,
        (&copies, crate::kernels::Path::Fast),
    )
    .map(|(outs, _)| outs)
}

/// A literal of `dtype`, filled on `device` itself (`Tensor::new` would
/// copy it from the host on every run, a wait on a GPU's queue).
fn scalar(x: f64, dtype: candle_core::DType, device: &Device) -> candle_core::Result<Tensor> {
    match dtype {
        candle_core::DType::F32 => Tensor::full(x as f32, (), device),
        candle_core::DType::F64 => Tensor::full(x, (), device),
        _ => Tensor::full(x, (), device)?.to_dtype(dtype),
    }
}

/// Runs `g`, also reporting what it held at its peak and, when `times`
/// is given, the time each node took.
fn run_inner(
    (g, paired): (&Graph, &[Option<usize>]),
    inputs: &[Tensor],
    seed: u64,
    mut times: Option<&mut NodeTimes>,
    (copies, path): Kx,
) -> Result<(Vec<Tensor>, RunStats)> {
    check_inputs(g, inputs)?;
    let device = run_device(g, inputs);
    let last = g.last_uses();
    let mut vals: Vec<Option<Value>> = vec![None; g.nodes.len()];
    let (mut live, mut held, mut stats) = (0usize, Held::default(), RunStats::default());
    let copied_before = copies.bytes();
    // Pairs of independent loops (`paired`, found once when the graph was
    // prepared) run at once on the CPU's pool (not while profiling: each
    // node's time is its own).
    let together = device.is_cpu() && times.is_none() && rayon::current_num_threads() > 1;
    let partner = |v: usize| paired.get(v).copied().flatten().filter(|_| together);
    let mut early: Vec<Option<Value>> = vec![None; g.nodes.len()];
    let nested = Nested { copies, path };
    for (v, node) in g.nodes.iter().enumerate() {
        let ran_early = early[v].is_some();
        let t = match &node.prim {
            _ if node.prim.is_leaf() || matches!(node.prim, Prim::Get(_)) => read(g, v, inputs, &vals, &device)?,
            _ if ran_early => early[v]
                .take()
                .ok_or_else(|| Error::internal("run", "an early result"))?,
            _ => {
                let at = Step {
                    g,
                    v,
                    vals: &vals,
                    device: &device,
                    seed,
                    kx: (copies, path),
                    nested: &nested,
                };
                let (t, partner) = at.compute(partner(v), times.as_deref_mut())?;
                if let Some((u, w)) = partner {
                    w.each(|x| held.take(x));
                    early[u] = Some(w);
                }
                t
            }
        };
        if !ran_early {
            t.each(|x| held.take(x));
        }
        trace_node(g, v, held.bytes);
        vals[v] = Some(t);
        live += 1;
        stats.peak_values = stats.peak_values.max(live);
        stats.peak_bytes = stats.peak_bytes.max(held.bytes);
        for a in g.dead_at(v, &last) {
            if let Some(t) = vals[a].take() {
                live -= 1;
                // the caller holds its arguments, the graph its captured
                // tensors: their memory stays however early the run is
                // done with them
                if !g.nodes[a].prim.is_leaf() {
                    t.each(|x| held.release(x));
                }
            }
        }
    }
    let outs = g
        .outputs
        .iter()
        .map(|&o| match vals.get(o) {
            Some(Some(Value::One(t))) => Some(t.clone()),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::internal("run", "an output was not computed, or is a tuple"))?;
    stats.copied_bytes = copies.bytes() - copied_before;
    Ok((outs, stats))
}

/// What computing one node needs of its run.
struct Step<'a> {
    g: &'a Graph,
    v: usize,
    vals: &'a [Option<Value>],
    device: &'a Device,
    seed: u64,
    kx: Kx<'a>,
    nested: &'a Nested<'a>,
}

impl Step<'_> {
    /// Node `v` computed by its rule, and beside it on the pool its
    /// partner `u` where it has one (its value, kept for when the run gets
    /// to it); timed where `times` is given.
    #[allow(clippy::type_complexity)]
    fn compute(&self, u: Option<usize>, times: Option<&mut NodeTimes>) -> Result<(Value, Option<(usize, Value)>)> {
        let (g, v) = (self.g, self.v);
        let prim = &g.nodes[v].prim;
        let args = operands(g, self.vals, v)?;
        // a GPU's kernels run after the call that queues them returns: a
        // profile drains the queue around each node
        if times.is_some() {
            self.device.synchronize().op(&prim.name())?;
        }
        let start = std::time::Instant::now();
        let cx = |v: usize| RunCx {
            device: self.device,
            seed: mix(self.seed, v as u64),
            copies: self.kx.0,
            path: self.kx.1,
            graphs: self.nested,
        };
        let out = match u {
            Some(u) => {
                let uargs = operands(g, self.vals, u)?;
                let (t, w) = rayon::join(|| compute(g, v, &args, &cx(v)), || compute(g, u, &uargs, &cx(u)));
                (t?, Some((u, w?)))
            }
            None => (compute(g, v, &args, &cx(v))?, None),
        };
        if let Some(times) = times {
            self.device.synchronize().op(&prim.name())?;
            times.push((v, start.elapsed().as_secs_f64()));
        }
        Ok(out)
    }
}

/// The value of node `v` where no rule computes it: an input, a captured
/// tensor, a literal, or a result of a tuple (the tensor the tuple holds,
/// the same buffer).
fn read(g: &Graph, v: usize, inputs: &[Tensor], vals: &[Option<Value>], device: &Device) -> Result<Value> {
    let node = &g.nodes[v];
    Ok(Value::One(match &node.prim {
        // Detached: candle's autograd does not run through a graph (the
        // crate's transforms differentiate), and a value that kept its
        // candle history would keep every earlier step's tensors alive
        // through the outputs (a training loop over parameters made from
        // `Var`s grew by 13 MB a step).
        Prim::Input(k) => inputs
            .get(*k)
            .map(Tensor::detach)
            .ok_or_else(|| Error::internal("run", format!("input {k} of {}", inputs.len())))?,
        Prim::Const(k) => constant(g, *k, device)?,
        Prim::Scalar(x) => scalar(*x, node.ty.dtype, device).op("scalar")?,
        Prim::Get(k) => match vals.get(node.args[0]).and_then(Option::as_ref) {
            Some(Value::Many(ts)) if *k < ts.len() => ts[*k].clone(),
            _ => {
                return Err(Error::internal(
                    "get",
                    format!("no result {k} of node {}", node.args[0]),
                ))
            }
        },
        prim => return Err(Error::internal(prim.name(), "computed by its rule")),
    }))
}

/// The trace-level log of a run, a line a node: what it held then.
fn trace_node(g: &Graph, v: usize, held: usize) {
    if log::log_enabled!(log::Level::Trace) {
        let node = &g.nodes[v];
        log::trace!(
            "run: node {v} {} {:?}: {:.1} MiB held, {:.1} MiB resident",
            node.prim.name(),
            node.ty.shape,
            held as f64 / (1u64 << 20) as f64,
            resident_mib()
        );
    }
}

/// The process's resident memory in MiB (Linux; 0 elsewhere), for the
/// trace-level log of a run.
fn resident_mib() -> f64 {
    crate::env::resident_now().unwrap_or(0) as f64 / (1u64 << 20) as f64
}

/// The buffers behind the live values: for each, how many live values
/// view it and the bytes the furthest of them reaches.
#[derive(Default)]
struct Held {
    by_buffer: HashMap<usize, (usize, usize)>,
    bytes: usize,
}

impl Held {
    /// `t`'s buffer (its storage's address) and the bytes of it `t` spans.
    fn buffer(t: &Tensor) -> (usize, usize) {
        let (s, l) = t.storage_and_layout();
        let id = &*s as *const _ as *const () as usize;
        let extent = match l.dims().contains(&0) {
            true => 0,
            false => {
                l.start_offset()
                    + l.dims()
                        .iter()
                        .zip(l.stride())
                        .map(|(&d, &s)| (d - 1) * s)
                        .sum::<usize>()
                    + 1
            }
        };
        (id, extent.saturating_mul(t.dtype().size_in_bytes()))
    }

    fn take(&mut self, t: &Tensor) {
        let (id, b) = Self::buffer(t);
        let e = self.by_buffer.entry(id).or_insert((0, 0));
        e.0 += 1;
        if b > e.1 {
            self.bytes += b - e.1;
            e.1 = b;
        }
    }

    fn release(&mut self, t: &Tensor) {
        let (id, _) = Self::buffer(t);
        if let Some(e) = self.by_buffer.get_mut(&id) {
            e.0 -= 1;
            if e.0 == 0 {
                self.bytes -= e.1;
                self.by_buffer.remove(&id);
            }
        }
    }
}

fn constant(g: &Graph, k: usize, device: &Device) -> Result<Tensor> {
    let c = g
        .consts
        .get(k)
        .ok_or_else(|| Error::internal("run", format!("constant {k} of {}", g.consts.len())))?;
    if !c.device().same_device(device) {
        return Err(Error::Device {
            op: "run",
            msg: format!(
                "a captured tensor of shape {:?} is on {:?}, the inputs on {:?}",
                c.dims(),
                c.device(),
                device
            ),
        });
    }
    Ok(c.detach())
}

/// A node's value: one tensor, or a tuple's results.
#[derive(Clone)]
enum Value {
    One(Tensor),
    Many(Vec<Tensor>),
}

impl Value {
    /// Calls `f` on each tensor it holds.
    fn each(&self, mut f: impl FnMut(&Tensor)) {
        match self {
            Value::One(t) => f(t),
            Value::Many(ts) => ts.iter().for_each(f),
        }
    }
}

/// Node `v`'s operands, each still held (freed only after its last use).
fn operands<'a>(g: &Graph, vals: &'a [Option<Value>], v: usize) -> Result<Vec<&'a Tensor>> {
    g.nodes[v]
        .args
        .iter()
        .map(|&a| match vals.get(a) {
            Some(Some(Value::One(t))) => Some(t),
            _ => None,
        })
        .collect::<Option<Vec<&Tensor>>>()
        .ok_or_else(|| Error::internal(g.nodes[v].prim.name(), "an operand was freed before its last use"))
}

/// The runner of sub-graphs handed to the rules: a nested run of the
/// interpreter with the outer run's tally of copies and its path.
struct Nested<'a> {
    copies: &'a crate::kernels::copies::Copies,
    path: crate::kernels::Path,
}

impl Graphs for Nested<'_> {
    /// A body's run. Its loops pair where it has two or more (a body
    /// runs once per step or example, so the search is skipped where it
    /// cannot find a pair).
    fn run(&self, g: &Graph, inputs: &[Tensor], seed: u64) -> Result<Vec<Tensor>> {
        let loops = g.nodes.iter().filter(|n| n.prim.is_loop()).count();
        let paired = match loops >= 2 {
            true => crate::rules::memory::partners(g),
            false => Vec::new(),
        };
        run_inner((g, &paired), inputs, seed, None, (self.copies, self.path)).map(|(outs, _)| outs)
    }
}

/// Computes node `v` (not a leaf) on its operands and checks its result
/// (each of a tuple's).
fn compute(g: &Graph, v: usize, args: &[&Tensor], cx: &RunCx) -> Result<Value> {
    let node = &g.nodes[v];
    if let Some(types) = node.prim.results() {
        let many = rule(&node.prim)?
            .many()
            .ok_or_else(|| Error::internal(node.prim.name(), "a tuple without rules for its results"))?;
        let ts = many.run_many(args, cx)?;
        if ts.len() != types.len() {
            return Err(Error::internal(
                node.prim.name(),
                "another number of results than inferred",
            ));
        }
        for (t, ty) in ts.iter().zip(&types) {
            check_result(&node.prim, t, ty)?;
        }
        return Ok(Value::Many(ts));
    }
    let t = match &node.prim {
        // An empty result has no values to compute; candle's kernels
        // panic on some empty views (a concatenation of narrowed empty
        // tensors), so none run for one.
        prim if node.ty.elem_count() == 0 => {
            Tensor::zeros(node.ty.shape.as_slice(), node.ty.dtype, cx.device).op(&prim.name())?
        }
        prim => rule(prim)?.run(args, &node.ty, cx)?,
    };
    check_result(&node.prim, &t, &node.ty)?;
    Ok(Value::One(t))
}

fn check_inputs(g: &Graph, inputs: &[Tensor]) -> Result<()> {
    let want = g.input_types();
    let got: Vec<TensorType> = inputs.iter().map(TensorType::of).collect();
    if want != got {
        return Err(Error::Tree {
            msg: format!("the graph takes {want:?}, got {got:?}"),
        });
    }
    if let Some(first) = inputs.first() {
        if let Some(other) = inputs.iter().find(|t| !t.device().same_device(first.device())) {
            return Err(Error::Device {
                op: "run",
                msg: format!("inputs on {:?} and {:?}", first.device(), other.device()),
            });
        }
    }
    Ok(())
}

fn run_device(g: &Graph, inputs: &[Tensor]) -> Device {
    inputs
        .first()
        .or(g.consts.first())
        .map(|t| t.device().clone())
        .unwrap_or(Device::Cpu)
}

/// A rule that computes a result of another shape than it inferred is a bug
/// in this crate; report it rather than let it corrupt later results.
fn check_result(prim: &Prim, t: &Tensor, ty: &TensorType) -> Result<()> {
    if t.dims() != ty.shape.as_slice() || t.dtype() != ty.dtype {
        return Err(Error::internal(
            prim.name(),
            format!(
                "computed {:?}{:?}, inferred {:?}{:?}",
                t.dtype(),
                t.dims(),
                ty.dtype,
                ty.shape
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ops::Binary;
    use crate::ir::options::{Options, Opts};
    use crate::ir::Map;
    use crate::rules::{Builder, TraceCtx};
    use candle_core::DType;
    use std::sync::Arc;

    /// A map of `x_i * w` over the rows of `x`, `w` shared by all examples,
    /// and its VJP: the cotangent of `x` is `ct * w`, that of the shared
    /// `w` the sum over the examples of `ct_i * x_i`.
    #[test]
    fn a_maps_vjp_sums_a_shared_operands_cotangent() {
        let ctx = TraceCtx::new(Device::Cpu, crate::rules::infer);
        let body = {
            let sb = Builder::scratch(Options::new(), ctx.clone());
            let mut sb = sb.borrow_mut();
            let x = sb.input(TensorType::new(vec![3], DType::F32));
            let w = sb.input(TensorType::new(vec![3], DType::F32));
            let y = sb.emit(Prim::Binary(Binary::Mul), &[x, w]).unwrap();
            sb.finish(vec![y]).0
        };
        let m = Map {
            body: Arc::new(body),
            bdims: vec![Some(1), None],
            size: 4,
            opts: Opts::default(),
        };
        let root = Builder::scratch(Options::new(), ctx);
        let mut b = root.borrow_mut();
        let x = b.input(TensorType::new(vec![3, 4], DType::F32)); // examples on axis 1
        let w = b.input(TensorType::new(vec![3], DType::F32));
        let ct = b.input(TensorType::new(vec![4, 3], DType::F32));
        let tuple = b.emit_tuple(Prim::Map(Box::new(m.clone())), &[x, w]).unwrap();
        let out = b.get(tuple, 0).unwrap();
        let cts = crate::rules::rule(&Prim::Map(Box::new(m)))
            .unwrap()
            .many()
            .unwrap()
            .vjp_many(&mut b, &[x, w], tuple, &[Some(ct)])
            .unwrap()
            .unwrap();
        let maps = b.nodes[out + 1..]
            .iter()
            .filter(|n| matches!(n.prim, Prim::Map(_)))
            .count();
        assert_eq!(maps, 1, "both cotangents from one per-example forward and backward");
        let g = b.finish(vec![out, cts[0].unwrap(), cts[1].unwrap()]).0;
        let dev = Device::Cpu;
        let xv = Tensor::arange(0f32, 12., &dev).unwrap().reshape((3, 4)).unwrap();
        let wv = Tensor::new(&[1f32, -2., 3.], &dev).unwrap();
        let cv = Tensor::arange(1f32, 13., &dev).unwrap().reshape((4, 3)).unwrap();
        let r = run(&g, &[xv.clone(), wv.clone(), cv.clone()], 0).unwrap();
        let want_out = xv.t().unwrap().broadcast_mul(&wv).unwrap();
        let want_dx = cv.broadcast_mul(&wv).unwrap().t().unwrap();
        let want_dw = (cv * xv.t().unwrap()).unwrap().sum(0).unwrap();
        for (got, want) in r.iter().zip([want_out, want_dx, want_dw]) {
            let d = (got - &want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(got.dims(), want.dims());
            assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
        }
    }
}
