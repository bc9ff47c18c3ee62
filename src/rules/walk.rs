//! The graph walkers: re-emit a whole graph through each primitive's
//! batching rule ([`batch_graph`]) or forward and then through each VJP
//! rule in reverse ([`vjp_graph`]). The transforms call these; so do the
//! rules of primitives that hold a sub-graph (`map`, `scan`, `cond`,
//! `while`).

use super::control::map;
use super::{rule, BVal, BatchCx, Builder, Tan};
use crate::error::{Error, Result};
use crate::ir::ops::Binary;
use crate::ir::{Graph, Prim, TensorType, VarId};
use std::collections::HashMap;

/// Re-emits `g` into `cx.b` through the batching rules; `inputs` binds the
/// graph's inputs. Returns the batched outputs.
pub(crate) fn batch_graph(g: &Graph, cx: &mut BatchCx, inputs: &[BVal]) -> Result<Vec<BVal>> {
    batch_graph_shared(g, cx, inputs, &mut HashMap::new())
}

/// [`batch_graph`], with `shared` holding the values of operand-less nodes
/// that came out unbatched (a random draw under `Randomness::Same`): a
/// chunked map reuses them in every chunk, so all examples see one draw.
pub(crate) fn batch_graph_shared(
    g: &Graph,
    cx: &mut BatchCx,
    inputs: &[BVal],
    shared: &mut HashMap<usize, BVal>,
) -> Result<Vec<BVal>> {
    if inputs.len() != g.inputs.len() {
        return Err(Error::internal(
            "vmap",
            format!("{} inputs bound for a graph of {}", inputs.len(), g.inputs.len()),
        ));
    }
    let mut env: Vec<BVal> = vec![(usize::MAX, None); g.nodes.len()];
    for (k, &v) in g.inputs.iter().enumerate() {
        env[v] = inputs[k];
    }
    for (v, node) in g.nodes.iter().enumerate() {
        env[v] = match &node.prim {
            Prim::Input(_) => env[v],
            Prim::Const(k) => (cx.b.constant(&g.consts[*k]), None),
            Prim::Scalar(x) => (cx.b.scalar(*x, node.ty.dtype), None),
            prim if node.args.is_empty() => match shared.get(&v) {
                Some(&bv) => bv,
                None => {
                    let bv = batch_prim(cx, prim, &[])?;
                    check_batched(prim, cx, bv, &node.ty)?;
                    if bv.1.is_none() {
                        shared.insert(v, bv);
                    }
                    bv
                }
            },
            prim => {
                let args: Vec<BVal> = node.args.iter().map(|&a| env[a]).collect();
                if args.iter().all(|a| a.1.is_none()) {
                    let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
                    (cx.b.emit(prim.clone(), &ids)?, None)
                } else {
                    let out = batch_prim(cx, prim, &args)?;
                    check_batched(prim, cx, out, &node.ty)?;
                    out
                }
            }
        };
    }
    Ok(g.outputs.iter().map(|&o| env[o]).collect())
}

/// Batches `prim` with its own rule, or maps it over the examples when it
/// has none: an error in strict mode, else noted in the trace's context
/// (the transform warns once per primitive when the trace ends).
pub(crate) fn batch_prim(cx: &mut BatchCx, prim: &Prim, args: &[BVal]) -> Result<BVal> {
    if let Some(out) = rule(prim)?.batch(cx, args)? {
        return Ok(out);
    }
    let kind = prim.kind();
    if cx.opts.strict {
        return Err(Error::unsupported(
            kind,
            "vmap",
            "no batching rule for this case, and strict mode forbids the per-example loop",
        ));
    }
    cx.b.ctx.fallbacks.borrow_mut().push(kind);
    map::emit_map(cx, prim, args)
}

/// A batching rule must give the per-example type with the batch axis
/// inserted; anything else is a bug in the rule, reported as such.
fn check_batched(prim: &Prim, cx: &BatchCx, (v, bdim): BVal, per: &TensorType) -> Result<()> {
    let mut want = per.shape.clone();
    if let Some(d) = bdim {
        if d <= want.len() {
            want.insert(d, cx.size);
        }
    }
    let got = cx.b.ty(v);
    if got.shape != want || got.dtype != per.dtype {
        return Err(Error::internal(
            prim.name(),
            format!(
                "batching rule gave {:?}{:?}, expected {:?}{want:?}",
                got.dtype, got.shape, per.dtype
            ),
        ));
    }
    Ok(())
}

/// Re-emits `g` into `b` with its inputs bound to `inputs`; returns the id
/// of every node.
pub(crate) fn forward(g: &Graph, b: &mut Builder, inputs: &[VarId]) -> Result<Vec<VarId>> {
    forward_with(g, b, inputs, |_, _, _, _| Ok(()))
}

/// [`forward`], calling `each(b, v, args, out)` after re-emitting each
/// computed node `v` (its operands' and its own ids in `b`).
fn forward_with(
    g: &Graph,
    b: &mut Builder,
    inputs: &[VarId],
    mut each: impl FnMut(&mut Builder, usize, &[VarId], VarId) -> Result<()>,
) -> Result<Vec<VarId>> {
    if inputs.len() != g.inputs.len() {
        return Err(Error::internal(
            "grad",
            format!("{} inputs bound for a graph of {}", inputs.len(), g.inputs.len()),
        ));
    }
    let mut env = vec![usize::MAX; g.nodes.len()];
    for (k, &v) in g.inputs.iter().enumerate() {
        env[v] = inputs[k];
    }
    for (v, node) in g.nodes.iter().enumerate() {
        env[v] = match &node.prim {
            Prim::Input(_) => env[v],
            Prim::Const(k) => b.constant(&g.consts[*k]),
            Prim::Scalar(x) => b.scalar(*x, node.ty.dtype),
            prim => {
                let args: Vec<VarId> = node.args.iter().map(|&a| env[a]).collect();
                let out = b.emit(prim.clone(), &args)?;
                each(b, v, &args, out)?;
                out
            }
        };
    }
    Ok(env)
}

/// Emits the forward pass of `g` and then its reverse pass into `b`. `wrt`
/// marks the inputs to differentiate; `seeds` gives the cotangent of some
/// outputs. Returns the forward outputs and each input's cotangent (`None`
/// where no differentiated path reaches it).
pub(crate) fn vjp_graph(
    g: &Graph,
    b: &mut Builder,
    inputs: &[VarId],
    wrt: &[bool],
    seeds: &[(usize, VarId)],
) -> Result<(Vec<VarId>, Vec<Option<VarId>>)> {
    let env = forward(g, b, inputs)?;
    // Only nodes downstream of a differentiated input carry cotangents.
    let needs = g.downstream_of(wrt);
    let mut cts: Vec<Option<VarId>> = vec![None; g.nodes.len()];
    for &(o, seed) in seeds {
        accumulate(b, &mut cts, g.outputs[o], seed)?;
    }
    for (v, node) in g.nodes.iter().enumerate().rev() {
        let Some(ct) = cts[v] else { continue };
        if !needs[v] || node.prim.is_leaf() {
            continue;
        }
        let args: Vec<VarId> = node.args.iter().map(|&a| env[a]).collect();
        let arg_cts = rule(&node.prim)?
            .vjp(b, &args, env[v], ct)?
            .ok_or_else(|| no_rule(&node.prim))?;
        for (&a, g_a) in node.args.iter().zip(arg_cts) {
            if let (Some(g_a), true) = (g_a, needs[a]) {
                accumulate(b, &mut cts, a, g_a)?;
            }
        }
    }
    let outs = g.outputs.iter().map(|&o| env[o]).collect();
    Ok((outs, g.inputs.iter().map(|&v| cts[v]).collect()))
}

/// Emits `g`'s forward pass with its tangents (forward mode) into `b`:
/// the inputs bound to `inputs`, their tangents to `tans` (`None`: zero).
/// Returns the outputs and each output's tangent (`None` where zero).
pub(crate) fn jvp_graph(g: &Graph, b: &mut Builder, inputs: &[VarId], tans: &[Tan]) -> Result<(Vec<VarId>, Vec<Tan>)> {
    if tans.len() != g.inputs.len() {
        return Err(Error::internal("jvp", "tangents do not match the graph"));
    }
    let mut tan: Vec<Tan> = vec![None; g.nodes.len()];
    for (k, &v) in g.inputs.iter().enumerate() {
        tan[v] = tans[k];
    }
    let env = forward_with(g, b, inputs, |b, v, args, out| {
        let node = &g.nodes[v];
        let arg_tans: Vec<Tan> = node.args.iter().map(|&a| tan[a]).collect();
        if arg_tans.iter().any(Option::is_some) {
            tan[v] = rule(&node.prim)?.jvp(b, args, &arg_tans, out)?.ok_or_else(|| {
                Error::unsupported(node.prim.kind(), "jvp", format!("{} has no JVP rule", node.prim.name()))
            })?;
        }
        Ok(())
    })?;
    Ok((
        g.outputs.iter().map(|&o| env[o]).collect(),
        g.outputs.iter().map(|&o| tan[o]).collect(),
    ))
}

/// tinygrad's loud error: the primitive that has no derivative rule.
fn no_rule(prim: &Prim) -> Error {
    Error::unsupported(prim.kind(), "grad", format!("{} has no VJP rule", prim.name()))
}

fn accumulate(b: &mut Builder, cts: &mut [Option<VarId>], v: VarId, g: VarId) -> Result<()> {
    cts[v] = Some(match cts[v] {
        None => g,
        Some(prev) => b.bin(Binary::Add, prev, g)?,
    });
    Ok(())
}
