//! Where a graph spends its time (`examples/profile_graph.rs`, and
//! `--profile` on the transformer benchmarks): per-node timings over a few
//! runs, the slowest nodes, the time per primitive, and each product
//! shape's rate in GFLOP/s.

use candle_core::Tensor;
use candle_func::Graph;
use std::collections::BTreeMap;

/// Runs `g` once to warm up, then `runs` times with per-node timings, and
/// prints each node's median: the slowest nodes, the time per primitive,
/// and the products (`matmul`) by shape with their rate.
pub fn report(title: &str, g: &Graph, inputs: &[Tensor], runs: usize) -> candle_func::Result<()> {
    g.run(inputs)?; // warm-up
    let mut all = Vec::new();
    for _ in 0..runs.max(1) {
        all.push(g.run_profiled(inputs)?.1);
    }
    // each node's median over the runs, so one noisy run does not decide
    let times: Vec<(usize, f64)> = (0..all[0].len())
        .map(|i| {
            let mut t: Vec<f64> = all.iter().map(|r| r[i].1).collect();
            t.sort_by(f64::total_cmp);
            (all[0][i].0, t[t.len() / 2])
        })
        .collect();
    let sum: f64 = times.iter().map(|t| t.1).sum();
    println!(
        "\n## {title}: {:.2} ms over {} nodes\n\nslowest nodes:",
        sum * 1e3,
        times.len()
    );
    let mut by_node: Vec<(f64, String)> = times
        .iter()
        .filter_map(|&(v, t)| {
            g.node(v).map(|n| {
                // each operand as `producer [shape]`: which value a slow node reads
                let ops: Vec<String> = n
                    .args()
                    .iter()
                    .filter_map(|&a| g.node(a).map(|a| format!("{} {:?}", a.name(), a.ty().shape)))
                    .collect();
                (t, format!("{} -> {:?} <- {}", n.name(), n.ty().shape, ops.join(", ")))
            })
        })
        .collect();
    by_node.sort_by(|a, b| b.0.total_cmp(&a.0));
    for (t, what) in by_node.iter().take(15) {
        println!("{:>9.3} ms  {what}", t * 1e3);
    }
    let mut by_prim: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    // products by (operand shapes): seconds, count, flops
    let mut products: BTreeMap<String, (f64, usize, f64)> = BTreeMap::new();
    for (n, t) in times.iter().filter_map(|&(v, t)| g.node(v).map(|n| (n, t))) {
        let e = by_prim.entry(n.name()).or_default();
        e.0 += t;
        e.1 += 1;
        // plain products and those fused with their epilogue (operands
        // `[x, w, bias?]`: the first two are the product's)
        if n.name() == "matmul" || n.name().starts_with("fused[matmul") {
            let shapes: Vec<Vec<usize>> = n
                .args()
                .iter()
                .take(2)
                .filter_map(|&a| g.node(a).map(|a| a.ty().shape.clone()))
                .collect();
            let k = shapes.first().and_then(|s| s.last()).copied().unwrap_or(0);
            let flops = 2.0 * n.ty().shape.iter().product::<usize>() as f64 * k as f64;
            let e = products.entry(format!("{shapes:?}")).or_default();
            e.0 += t;
            e.1 += 1;
            e.2 += flops;
        }
    }
    let mut by_prim: Vec<_> = by_prim.into_iter().collect();
    by_prim.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    println!("\nby primitive:");
    for (name, (t, n)) in by_prim {
        println!("{:>9.3} ms  {:>5.1}%  {n:>3} x {name}", t * 1e3, 100. * t / sum);
    }
    let mut products: Vec<_> = products.into_iter().collect();
    products.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    if !products.is_empty() {
        let (t, f) = products
            .iter()
            .fold((0.0, 0.0), |acc, p| (acc.0 + p.1 .0, acc.1 + p.1 .2));
        println!(
            "\nproducts: {:.1} ms, {:.1} GFLOP/s overall; by operand shapes:",
            t * 1e3,
            f / t / 1e9
        );
        for (shapes, (t, n, f)) in products.iter().take(12) {
            println!("{:>9.3} ms  {:>7.1} GFLOP/s  {n:>3} x {shapes}", t * 1e3, f / t / 1e9);
        }
    }
    Ok(())
}
