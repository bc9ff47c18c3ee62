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
//! The pass is a plan, not a guess: a rewrite is kept only when the
//! planned peak (`rules::memory`) falls by at least [`MIN_GAIN`] of it, so a
//! graph whose peak lies elsewhere is left as it was (an ordinary training
//! step is), and the time it costs is one pass over a tensor the peak
//! already holds.

use super::rewrite::{rebuild, Arg, Emitted, Plan, Rewrite};
use crate::ir::Graph;
use crate::rules::facts::{self, Effect};
use crate::rules::memory::{planned_peak, planned_peak_at};

/// The smallest fall of the planned peak, as a fraction of it, that pays
/// for recomputing: below it, the time is spent for nearly nothing.
const MIN_GAIN: f64 = 1.0 / 32.0;

/// Rewrites kept at most: each is a search over the graph's candidates.
const MAX_REWRITES: usize = 8;

/// Values cheap enough to compute twice: pure, about one pass over their
/// operands (each primitive's fact: a pooling forward, an elementwise map).
fn cheap(g: &Graph, v: usize) -> bool {
    facts::of_node(g, v).is_some_and(|f| f.cheap && f.effect == Effect::Pure)
}

/// `g` with values recomputed before their late readers wherever that lowers
/// the planned peak by at least `MIN_GAIN`, best rewrite first.
pub(crate) fn rematerialise(g: Graph) -> Graph {
    // A node's random stream is seeded by its index: an inserted copy
    // would renumber the draws after it, so a seeded function's draws
    // would depend on whether the pass fired.
    if facts::draws_random(&g) {
        return g;
    }
    let mut g = g;
    for _ in 0..MAX_REWRITES {
        let (peak, at) = planned_peak_at(&g);
        let best = candidates(&g, at)
            .into_iter()
            .map(|(v, from)| recompute_before(&g, v, from))
            .map(|c| (planned_peak(&c), c))
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
        if cheap(g, v) && !g.outputs.contains(&v) {
            out.extend((1..r.len()).filter(|&k| r[k - 1] < at && at < r[k]).map(|k| (v, r[k])));
        }
    }
    out
}

/// `g` with a copy of node `v` inserted just before node `from`; `from`
/// and every later reader of `v` read the copy.
fn recompute_before(g: &Graph, v: usize, from: usize) -> Graph {
    let mut plan = Plan::new(g.nodes.len());
    let read_copy = |r: usize, copy: Arg| -> Emitted {
        let (prim, args, ty) = Rewrite::same(g, r);
        let args = args
            .into_iter()
            .zip(&g.nodes[r].args)
            .map(|(a, &old)| if old == v { copy } else { a })
            .collect();
        (prim, args, ty)
    };
    // the copy (its operands all precede v), then `from` reading it
    plan.set(
        from,
        Rewrite {
            nodes: vec![Rewrite::same(g, v), read_copy(from, Arg::New(0))],
            place: Arg::New(1),
        },
    );
    for r in from + 1..g.nodes.len() {
        if g.nodes[r].args.contains(&v) {
            plan.set(r, Rewrite::emit(vec![read_copy(r, Arg::At(from, 0))]));
        }
    }
    rebuild(g, plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::exec::Executable;
    use crate::interp::passes::prepare_through;
    use crate::ir::ops::{Binary, PoolOp, Unary};
    use crate::ir::{Options, Prim, TensorType};
    use crate::rules::{Builder, TraceCtx};
    use candle_core::{DType, Device, Tensor};

    /// A graph of one input `[4, 8, 32, 32]` built by `f` (simplified, as a
    /// traced graph is before the passes that prepare it to run).
    fn graph(f: impl Fn(&mut Builder, usize) -> crate::Result<usize>) -> Graph {
        let b = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = b.borrow_mut();
        let x = b.input(TensorType::new(vec![4, 8, 32, 32], DType::F32));
        let y = f(&mut b, x).unwrap();
        prepare_through(&b.finish(vec![y]).0, "merge common")
    }

    fn pool(b: &mut Builder, x: usize, k: usize) -> crate::Result<usize> {
        let w = (k, k);
        b.emit(Prim::Pool(PoolOp::MaxPool2d { kernel: w, stride: w }), &[x])
    }

    fn total(b: &mut Builder, x: usize) -> crate::Result<usize> {
        let axes = (0..b.ty(x).rank()).collect();
        b.sum_axes(x, axes, false)
    }

    /// `y = pool(x)` read at once and again after a long stretch that
    /// keeps `x` alive anyway (`x` is read last): recomputing `y` there
    /// holds less, and the results are unchanged.
    #[test]
    fn recomputes_a_pool_held_across_a_gap_and_keeps_the_values() {
        let g = graph(|b, x| {
            let y = pool(b, x, 2)?; // [4, 8, 16, 16]
            let early = total(b, y)?;
            // a long stretch of large temporaries while y waits
            let big = b.un(Unary::Exp, x)?;
            let big = b.un(Unary::Affine(2.0, 1.0), big)?;
            let big = b.un(Unary::Sqrt, big)?;
            let mid = total(b, big)?;
            let late = b.un(Unary::Affine(3.0, 0.0), y)?;
            let late = total(b, late)?;
            let last = total(b, x)?;
            let s = b.bin(Binary::Add, early, mid)?;
            let s = b.bin(Binary::Add, s, late)?;
            b.bin(Binary::Add, s, last)
        });
        let r = rematerialise(g.clone());
        assert!(planned_peak(&r) < planned_peak(&g));
        assert_eq!(r.nodes.len(), g.nodes.len() + 1);
        let x = Tensor::randn(0f32, 1., (4, 8, 32, 32), &Device::Cpu).unwrap();
        // run as they are (preparing them again would merge the copy back)
        let run = |g: Graph| {
            Executable::prepared(g, Default::default())
                .run(std::slice::from_ref(&x))
                .unwrap()
        };
        let (a, b) = (run(g), run(r));
        let d = (&a[0] - &b[0]).unwrap().abs().unwrap().to_dtype(DType::F64).unwrap();
        assert_eq!(d.to_scalar::<f64>().unwrap(), 0.0);
    }

    /// Without the gap, or when the operand would have to be held longer
    /// than the value, nothing changes.
    #[test]
    fn leaves_graphs_whose_peak_it_cannot_lower() {
        let short = graph(|b, x| {
            let y = pool(b, x, 2)?;
            total(b, y)
        });
        // y is small next to x, so holding x to recompute y would cost more
        let costly = graph(|b, x| {
            let y = pool(b, x, 4)?;
            let early = total(b, y)?;
            let z = b.un(Unary::Exp, x)?; // x's last read
            let z = total(b, z)?;
            let big = b.broadcast(z, vec![64, 64, 64])?;
            let big = b.un(Unary::Exp, big)?;
            let big = total(b, big)?;
            let late = total(b, y)?;
            let s = b.bin(Binary::Add, early, big)?;
            b.bin(Binary::Add, s, late)
        });
        for g in [short, costly] {
            let r = rematerialise(g.clone());
            assert_eq!(r.nodes.len(), g.nodes.len());
        }
    }
}
