//! The interpreter: runs a graph on candle tensors, on the inputs' device,
//! dropping every intermediate after its last use.

use crate::error::{CandleContext, Error, Result};
use crate::ir::{Graph, Prim, TensorType};
use crate::rules::rule;
use candle_core::{Device, Tensor};

/// What a run held at its peak: the number of values alive at once and
/// their bytes (inputs and captured constants included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Most values held at the same time.
    pub peak_values: usize,
    /// Most bytes held at the same time (by size and dtype; views of one
    /// buffer count once each, so this is an upper bound).
    pub peak_bytes: usize,
}

/// Runs `g` on `inputs` (in the graph's input order) and returns its outputs.
/// Inputs must match the graph's input types; constants must live on the
/// inputs' device.
pub fn run(g: &Graph, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    run_with_stats(g, inputs).map(|(outs, _)| outs)
}

fn bytes(t: &TensorType) -> usize {
    t.elem_count() * t.dtype.size_in_bytes()
}

/// [`run`], also reporting the peak number and size of live values.
pub fn run_with_stats(g: &Graph, inputs: &[Tensor]) -> Result<(Vec<Tensor>, RunStats)> {
    run_inner(g, inputs, None)
}

/// Seconds each computed node took, as `(node, seconds)` in graph order.
pub type NodeTimes = Vec<(usize, f64)>;

/// [`run`], also returning the time each node took: where a graph spends
/// its time.
pub fn run_profiled(g: &Graph, inputs: &[Tensor]) -> Result<(Vec<Tensor>, NodeTimes)> {
    let mut times = Vec::new();
    let (outs, _) = run_inner(g, inputs, Some(&mut times))?;
    Ok((outs, times))
}

fn run_inner(g: &Graph, inputs: &[Tensor], mut times: Option<&mut NodeTimes>) -> Result<(Vec<Tensor>, RunStats)> {
    check_inputs(g, inputs)?;
    let device = run_device(g, inputs);
    let last = g.last_uses();
    let mut vals: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
    let (mut live, mut live_bytes, mut stats) = (0usize, 0usize, RunStats::default());
    for (v, node) in g.nodes.iter().enumerate() {
        let t = match &node.prim {
            Prim::Input(k) => inputs[*k].clone(),
            Prim::Const(k) => {
                let c = &g.consts[*k];
                if !c.device().same_device(&device) {
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
                c.clone()
            }
            Prim::Scalar(x) => Tensor::new(*x, &device)
                .and_then(|t| t.to_dtype(node.ty.dtype))
                .op("scalar")?,
            prim => {
                let args: Vec<&Tensor> = node
                    .args
                    .iter()
                    .map(|&a| vals[a].as_ref().expect("value freed before its last use"))
                    .collect();
                let start = std::time::Instant::now();
                let t = rule(prim)?.run(&args, &node.ty)?;
                if let Some(times) = times.as_mut() {
                    times.push((v, start.elapsed().as_secs_f64()));
                }
                check_result(prim, &t, &node.ty)?;
                t
            }
        };
        vals[v] = Some(t);
        live += 1;
        live_bytes += bytes(&node.ty);
        stats.peak_values = stats.peak_values.max(live);
        stats.peak_bytes = stats.peak_bytes.max(live_bytes);
        let mut dead: Vec<usize> = node.args.iter().copied().filter(|&a| last[a] == v).collect();
        if last[v] == 0 {
            dead.push(v); // never read (an unused input)
        }
        dead.sort_unstable();
        dead.dedup();
        for a in dead {
            if vals[a].take().is_some() {
                live -= 1;
                live_bytes -= bytes(&g.nodes[a].ty);
            }
        }
    }
    let outs = g
        .outputs
        .iter()
        .map(|&o| vals[o].clone().expect("output computed"))
        .collect();
    Ok((outs, stats))
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
        return Err(Error::unsupported(
            prim.name(),
            "run",
            format!(
                "internal error: computed {:?}{:?}, inferred {:?}{:?}",
                t.dtype(),
                t.dims(),
                ty.dtype,
                ty.shape
            ),
        ));
    }
    Ok(())
}
