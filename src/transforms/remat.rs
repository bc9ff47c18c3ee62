//! Recomputing cheap values instead of holding them (rematerialisation),
//! where that lowers a graph's planned peak.
//!
//! A value read early and again much later is held in between. When it is
//! a cheap function of values that are held anyway around its late use (a
//! pooling or an elementwise map of an activation a backward pass still
//! needs), computing it a second time just before the late use holds less.
//! DP-SGD's book-keeping is the case that needs it: the clipped sum of the
//! Opacus CNN's second convolution reads that layer's input (a max-pool of
//! the first layer's activations) after every norm, so the input waited
//! through the whole backward while the activations it is pooled from
//! were live for most of it too.
//!
//! The pass is a plan, not a guess: a rewrite is kept only when
//! `interp::planned_peak` falls by at least [`MIN_GAIN`] of the peak, so a
//! graph whose peak lies elsewhere is left as it was (an ordinary training
//! step is), and the time it costs is one pass over a tensor the peak
//! already holds.

use crate::interp;
use crate::ir::ops::PoolOp;
use crate::ir::Prim;
use crate::ir::{Graph, Node};

/// The smallest fall of the planned peak, as a fraction of it, that pays
/// for recomputing: below it, the time is spent for nearly nothing.
const MIN_GAIN: f64 = 1.0 / 32.0;

/// Rewrites kept at most: each is a search over the graph's candidates.
const MAX_REWRITES: usize = 8;

/// Values cheap enough to compute twice: deterministic, one pass over
/// their operand (pooling forward, elementwise maps and casts).
fn cheap(prim: &Prim) -> bool {
    matches!(
        prim,
        Prim::Pool(PoolOp::MaxPool2d { .. } | PoolOp::AvgPool2d { .. }) | Prim::Unary(_)
    )
}

/// `g` with values recomputed before their late readers wherever that lowers
/// the planned peak by at least `MIN_GAIN`, best rewrite first.
pub(crate) fn rematerialise(g: Graph) -> Graph {
    // A node's random stream is seeded by its index: an inserted copy
    // would renumber the draws after it, so a seeded function's draws
    // would depend on whether the pass fired.
    if g.has_random() {
        return g;
    }
    let mut g = g;
    for _ in 0..MAX_REWRITES {
        let (peak, at) = interp::planned_peak_at(&g);
        let best = candidates(&g, at)
            .into_iter()
            .map(|(v, from)| recompute_before(&g, v, from))
            .map(|c| (interp::planned_peak(&c), c))
            .min_by_key(|(p, _)| *p);
        match best {
            Some((p, c)) if (p as f64) <= peak as f64 * (1.0 - MIN_GAIN) => g = c,
            _ => break,
        }
    }
    g
}

/// `(value, reader)` for each cheap value and each of its readers that
/// follows a gap over node `at` (the peak: a value not held there cannot
/// lower it) after the reader before it: the readers from there on could
/// read a copy made just before it. An output is held to the end, so it
/// is no candidate.
fn candidates(g: &Graph, at: usize) -> Vec<(usize, usize)> {
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); g.nodes.len()];
    for (v, n) in g.nodes.iter().enumerate() {
        for &a in &n.args {
            if readers[a].last() != Some(&v) {
                readers[a].push(v);
            }
        }
    }
    let mut out = Vec::new();
    for (v, r) in readers.iter().enumerate() {
        if cheap(&g.nodes[v].prim) && !g.outputs.contains(&v) {
            out.extend((1..r.len()).filter(|&k| r[k - 1] < at && at < r[k]).map(|k| (v, r[k])));
        }
    }
    out
}

/// `g` with a copy of node `v` inserted just before node `from`; `from`
/// and every later reader of `v` read the copy.
fn recompute_before(g: &Graph, v: usize, from: usize) -> Graph {
    let shift = |a: usize| if a >= from { a + 1 } else { a };
    let mut nodes: Vec<Node> = Vec::with_capacity(g.nodes.len() + 1);
    for (i, n) in g.nodes.iter().enumerate() {
        if i == from {
            nodes.push(g.nodes[v].clone()); // its operands all precede v
        }
        let mut n = n.clone();
        let copy = from; // the copy's index in the new graph
        n.args = n
            .args
            .iter()
            .map(|&a| if i >= from && a == v { copy } else { shift(a) })
            .collect();
        nodes.push(n);
    }
    Graph {
        nodes,
        inputs: g.inputs.iter().map(|&a| shift(a)).collect(),
        outputs: g.outputs.iter().map(|&a| shift(a)).collect(),
        ..g.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;
    use crate::transforms::make_graph_unfused;
    use candle_core::{DType, Device, Tensor};

    /// `y = pool(x)` read at once and again after a long stretch that
    /// keeps `x` alive anyway (`x` is read last): recomputing `y` there
    /// holds less, and the results are unchanged.
    #[test]
    fn recomputes_a_pool_held_across_a_gap_and_keeps_the_values() {
        let f = |x: Tracer| -> crate::Result<Tracer> {
            let y = x.max_pool2d(2)?; // [4, 8, 16, 16]
            let early = y.sum_all()?;
            // a long stretch of large temporaries while y waits
            let big = x.exp()?.affine(2.0, 1.0)?.sqrt()?;
            let mid = big.sum_all()?;
            let late = y.affine(3.0, 0.0)?.sum_all()?;
            let last = x.sum_all()?;
            early.add(&mid)?.add(&late)?.add(&last)
        };
        let x = Tensor::randn(0f32, 1., (4, 8, 32, 32), &Device::Cpu).unwrap();
        let g = make_graph_unfused(&f, &x).unwrap();
        let r = rematerialise(g.clone());
        assert!(interp::planned_peak(&r) < interp::planned_peak(&g));
        assert_eq!(r.nodes.len(), g.nodes.len() + 1);
        let (a, b) = (g.run(std::slice::from_ref(&x)).unwrap(), r.run(&[x]).unwrap());
        let d = (&a[0] - &b[0]).unwrap().abs().unwrap().to_dtype(DType::F64).unwrap();
        assert_eq!(d.to_scalar::<f64>().unwrap(), 0.0);
    }

    /// Without the gap, or when the operand would have to be held longer
    /// than the value, nothing changes.
    #[test]
    fn leaves_graphs_whose_peak_it_cannot_lower() {
        let x = Tensor::randn(0f32, 1., (4, 8, 32, 32), &Device::Cpu).unwrap();
        let short = |x: Tracer| -> crate::Result<Tracer> { x.max_pool2d(2)?.sum_all() };
        // y is small next to x, so holding x to recompute y would cost more
        let costly = |x: Tracer| -> crate::Result<Tracer> {
            let y = x.max_pool2d(4)?;
            let early = y.sum_all()?;
            let z = x.exp()?.sum_all()?; // x's last read
            let big = z.broadcast_as((64, 64, 64))?.exp()?.sum_all()?;
            early.add(&big)?.add(&y.sum_all()?)
        };
        for g in [
            make_graph_unfused(&short, &x).unwrap(),
            make_graph_unfused(&costly, &x).unwrap(),
        ] {
            let r = rematerialise(g.clone());
            assert_eq!(r.nodes.len(), g.nodes.len());
        }
    }
}
