//! The graph walkers: re-emit a whole graph through each primitive's
//! batching rule ([`batch_graph`]) or forward and then through each VJP
//! rule in reverse ([`vjp_graph`]). The transforms call these; so do the
//! rules of primitives that hold a sub-graph (`map`, `scan`, `cond`,
//! `while`). A primitive with several results goes through its
//! [`Many`](super::Many) rules, its values, tangents and cotangents one
//! per result, which its `get` nodes read and feed.

use super::control::map;
use super::{rule, BVal, BatchCx, Builder, Cts, Many, Tan};
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
    // each tuple's results, batched
    let mut many: HashMap<usize, Vec<BVal>> = HashMap::new();
    for (v, node) in g.nodes.iter().enumerate() {
        env[v] = match &node.prim {
            Prim::Input(_) => env[v],
            Prim::Get(k) => result(&many, node.args[0], *k)?,
            prim if prim.is_tuple() => {
                let args: Vec<BVal> = node.args.iter().map(|&a| env[a]).collect();
                many.insert(v, batch_tuple(cx, prim, &args)?);
                (usize::MAX, None)
            }
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

/// Result `k` of the tuple `t` among `many`.
fn result<T: Copy>(many: &HashMap<usize, Vec<T>>, t: usize, k: usize) -> Result<T> {
    many.get(&t)
        .and_then(|rs| rs.get(k))
        .copied()
        .ok_or_else(|| Error::internal("get", format!("no result {k} of node {t}")))
}

/// The rules of a primitive with several results.
fn many_of(prim: &Prim) -> Result<&dyn Many> {
    rule(prim)?
        .many()
        .ok_or_else(|| Error::internal(prim.name(), "a tuple without rules for its results"))
}

/// A primitive with several results batched: the same primitive where no
/// operand is batched, else its rule's results, each checked.
fn batch_tuple(cx: &mut BatchCx, prim: &Prim, args: &[BVal]) -> Result<Vec<BVal>> {
    let types = prim.results().unwrap_or_default();
    if args.iter().all(|a| a.1.is_none()) {
        let ids: Vec<VarId> = args.iter().map(|a| a.0).collect();
        let outs = cx.b.emit_many(prim.clone(), &ids)?;
        return Ok(outs.into_iter().map(|o| (o, None)).collect());
    }
    let outs = many_of(prim)?.batch_many(cx, args)?;
    if outs.len() != types.len() {
        return Err(Error::internal(
            prim.name(),
            "a batching rule gave another number of results",
        ));
    }
    for (&o, ty) in outs.iter().zip(&types) {
        check_batched(prim, cx, o, ty)?;
    }
    Ok(outs)
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
            Prim::Get(k) => {
                let out = b.get(env[node.args[0]], *k)?;
                each(b, v, &[env[node.args[0]]], out)?;
                out
            }
            prim => {
                let args: Vec<VarId> = node.args.iter().map(|&a| env[a]).collect();
                let out = match prim.is_tuple() {
                    true => b.emit_tuple(prim.clone(), &args)?,
                    false => b.emit(prim.clone(), &args)?,
                };
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
    // each tuple's results' cotangents, gathered from its `get`s (which
    // come after it, so are met first going back)
    let mut result_cts: HashMap<usize, Vec<Option<VarId>>> = HashMap::new();
    for (v, node) in g.nodes.iter().enumerate().rev() {
        if !needs[v] || node.prim.is_leaf() {
            continue;
        }
        if let Prim::Get(k) = node.prim {
            if let Some(ct) = cts[v] {
                let t = node.args[0];
                let n = g.nodes[t].prim.results().map_or(0, |r| r.len());
                let slot = &mut result_cts.entry(t).or_insert_with(|| vec![None; n])[k];
                *slot = Some(match *slot {
                    None => ct,
                    Some(prev) => b.bin(Binary::Add, prev, ct)?,
                });
            }
            continue;
        }
        let args: Vec<VarId> = node.args.iter().map(|&a| env[a]).collect();
        let arg_cts: Cts = match (node.prim.is_tuple(), cts[v]) {
            (true, _) => match result_cts.remove(&v) {
                Some(rcts) => many_of(&node.prim)?
                    .vjp_many(b, &args, env[v], &rcts)?
                    .ok_or_else(|| no_rule(&node.prim))?,
                None => continue,
            },
            (false, Some(ct)) => rule(&node.prim)?
                .vjp(b, &args, env[v], ct)?
                .ok_or_else(|| no_rule(&node.prim))?,
            (false, None) => continue,
        };
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
    // each tuple's results' tangents, which its `get`s read
    let mut many: HashMap<usize, Vec<Tan>> = HashMap::new();
    let env = forward_with(g, b, inputs, |b, v, args, out| {
        let node = &g.nodes[v];
        let no_jvp = || Error::unsupported(node.prim.kind(), "jvp", format!("{} has no JVP rule", node.prim.name()));
        if let Prim::Get(k) = node.prim {
            tan[v] = many.get(&node.args[0]).and_then(|ts| ts.get(k).copied().flatten());
            return Ok(());
        }
        let arg_tans: Vec<Tan> = node.args.iter().map(|&a| tan[a]).collect();
        if !arg_tans.iter().any(Option::is_some) {
            return Ok(());
        }
        match node.prim.is_tuple() {
            true => {
                let ts = many_of(&node.prim)?
                    .jvp_many(b, args, &arg_tans, out)?
                    .ok_or_else(no_jvp)?;
                many.insert(v, ts);
            }
            false => tan[v] = rule(&node.prim)?.jvp(b, args, &arg_tans, out)?.ok_or_else(no_jvp)?,
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
