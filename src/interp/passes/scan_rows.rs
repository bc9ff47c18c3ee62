//! A scan whose carries nothing reads keeps only its last. A scan's result
//! stacks every step's carry beside its outputs (`T L.. nc+ny`), since a
//! VJP reads them all; once every transform has run, a scan read only
//! through its outputs and its last row (a forward loop, or a VJP's own
//! backward loop) writes its outputs and then its last carry into one
//! vector instead (`Scan::every_carry`), and its readers read that: `T`
//! carries fewer held (an LSTM's `[T, B, 2H]` states).

use super::rewrite::View;
use crate::ir::ops::ShapeOp;
use crate::ir::{Graph, Prim, Scan, VarId};

/// How a reader reads a scan's rows `[T, L.., nc + ny]`.
#[derive(Clone, Copy)]
enum Read {
    /// `len` entries from `start` of the last axis, all outputs
    /// (`start >= nc`).
    Outputs { start: usize, len: usize },
    /// The row the last step wrote (`row`), `[1, L.., nc + ny]`.
    LastRow { row: usize },
}

/// How node `r` reads the scan `s` at `v`, where it reads it in a way
/// the last-carry form serves.
fn read(g: &View, s: &Scan, v: VarId, r: VarId) -> Option<Read> {
    let Prim::Shape(ShapeOp::Narrow { axis, start, len }) = *g.prim(r) else {
        return None;
    };
    let last_axis = g.ty(v).rank() - 1;
    let last_row = s.row(s.length - 1);
    match (axis, start) {
        (a, st) if a == last_axis && st >= s.carry => Some(Read::Outputs {
            start: st - s.carry,
            len,
        }),
        (0, st) if st == last_row && len == 1 => Some(Read::LastRow { row: st }),
        _ => None,
    }
}

/// The reads of each scan that can keep its last carry only (every
/// reader a `Read`, not an output), by node.
fn convertible(old: &Graph) -> Vec<Option<Vec<(VarId, Read)>>> {
    let g = View::new(old);
    let mut out = vec![None; old.nodes.len()];
    for (v, n) in old.nodes.iter().enumerate() {
        let Prim::Scan(s) = &n.prim else { continue };
        if !s.every_carry || s.carry == 0 || g.is_output(v) || g.readers(v).is_empty() {
            continue;
        }
        // a reader reading the scan twice is a reader of another kind
        out[v] = g
            .readers(v)
            .iter()
            .map(|&r| {
                (g.args(r).len() == 1)
                    .then(|| read(&g, s, v, r))
                    .flatten()
                    .map(|k| (r, k))
            })
            .collect();
    }
    out
}

/// `g` with every scan whose carries nothing reads keeping its last only.
pub(super) fn last_carry_only(old: &Graph) -> Graph {
    let found = convertible(old);
    if found.iter().all(Option::is_none) {
        return old.clone();
    }
    let mut g = Graph {
        consts: old.consts.clone(),
        ..Graph::default()
    };
    let mut remap: Vec<VarId> = Vec::with_capacity(old.nodes.len());
    // for a reader of a converted scan: how it reads it, and the scan's
    // new views (its outputs `[T, L.., ny]`, its last carry `[1, L.., nc]`)
    let mut reads: Vec<Option<(Read, VarId, VarId)>> = vec![None; old.nodes.len()];
    for (v, n) in old.nodes.iter().enumerate() {
        let args: Vec<VarId> = n.args.iter().map(|&a| remap[a]).collect();
        let to = match (&n.prim, &found[v], reads[v]) {
            (Prim::Scan(s), Some(rs), _) => {
                let rows = &n.ty; // T L.. P
                let r = rows.rank();
                let (t, lead) = (rows.shape[0], rows.shape[1..r - 1].to_vec());
                let l: usize = lead.iter().product();
                let ny = rows.shape[r - 1] - s.carry;
                let sc = Scan {
                    every_carry: false,
                    ..(**s).clone()
                };
                let flat = g.add_node(
                    Prim::Scan(Box::new(sc)),
                    args,
                    rows.with_shape(vec![t * l * ny + l * s.carry]),
                );
                // (T L.. ny) -> T L.. ny; (L.. nc) -> 1 L.. nc
                let view = |g: &mut Graph, start: usize, len: usize, shape: Vec<usize>| {
                    let narrow = Prim::Shape(ShapeOp::Narrow { axis: 0, start, len });
                    let part = g.add_node(narrow, vec![flat], rows.with_shape(vec![len]));
                    g.add_node(
                        Prim::Shape(ShapeOp::Reshape(shape.clone())),
                        vec![part],
                        rows.with_shape(shape),
                    )
                };
                let ys = view(&mut g, 0, t * l * ny, [&[t][..], &lead, &[ny]].concat());
                let carry = view(&mut g, t * l * ny, l * s.carry, [&[1][..], &lead, &[s.carry]].concat());
                for &(r, k) in rs {
                    reads[r] = Some((k, ys, carry));
                }
                flat
            }
            (_, _, Some((Read::Outputs { start, len }, ys, _))) => {
                let axis = n.ty.rank() - 1;
                g.add_node(
                    Prim::Shape(ShapeOp::Narrow { axis, start, len }),
                    vec![ys],
                    n.ty.clone(),
                )
            }
            (_, _, Some((Read::LastRow { row }, ys, carry))) => {
                // the last carry beside the last step's outputs
                let axis = n.ty.rank() - 1;
                let mut y_ty = n.ty.clone();
                y_ty.shape[axis] = g.ty(ys).shape[axis];
                if y_ty.shape[axis] == 0 {
                    carry
                } else {
                    let narrow = Prim::Shape(ShapeOp::Narrow {
                        axis: 0,
                        start: row,
                        len: 1,
                    });
                    let y = g.add_node(narrow, vec![ys], y_ty);
                    g.add_node(Prim::Shape(ShapeOp::Concat(axis)), vec![carry, y], n.ty.clone())
                }
            }
            _ => g.add_node(n.prim.clone(), args, n.ty.clone()),
        };
        remap.push(to);
    }
    g.inputs = old.inputs.iter().map(|&v| remap[v]).collect();
    g.outputs = old.outputs.iter().map(|&v| remap[v]).collect();
    g.eliminate_dead_code()
}
