//! The interpreter: runs a graph on candle tensors, on the inputs' device,
//! dropping every intermediate after its last use.

use crate::error::{CandleContext, Error, Result};
use crate::ir::{Graph, Prim, TensorType};
use crate::rules::rule;
use candle_core::{Device, Tensor};

/// Runs `g` on `inputs` (in the graph's input order) and returns its outputs.
/// Inputs must match the graph's input types; constants must live on the
/// inputs' device.
pub fn run(g: &Graph, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    check_inputs(g, inputs)?;
    let device = run_device(g, inputs);
    let last = g.last_uses();
    let mut vals: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
    for (v, node) in g.nodes.iter().enumerate() {
        let t = match &node.prim {
            Prim::Input(k) => inputs[*k].clone(),
            Prim::Const(k) => {
                let c = &g.consts[*k];
                if !c.device().same_device(&device) {
                    return Err(Error::Device {
                        op: "run",
                        msg: format!("a captured tensor of shape {:?} is on {:?}, the inputs on {:?}", c.dims(), c.device(), device),
                    });
                }
                c.clone()
            }
            Prim::Scalar(x) => Tensor::new(*x, &device).and_then(|t| t.to_dtype(node.ty.dtype)).op("scalar")?,
            prim => {
                let args: Vec<&Tensor> = node.args.iter().map(|&a| vals[a].as_ref().expect("value freed before its last use")).collect();
                let t = rule(prim)?.run(&args, &node.ty)?;
                check_result(prim, &t, &node.ty)?;
                t
            }
        };
        vals[v] = Some(t);
        for &a in &node.args {
            if last[a] == v {
                vals[a] = None;
            }
        }
        if last[v] == 0 {
            vals[v] = None; // never read (an unused input)
        }
    }
    Ok(g.outputs.iter().map(|&o| vals[o].clone().expect("output computed")).collect())
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
            format!("internal error: computed {:?}{:?}, inferred {:?}{:?}", t.dtype(), t.dims(), ty.dtype, ty.shape),
        ));
    }
    Ok(())
}
