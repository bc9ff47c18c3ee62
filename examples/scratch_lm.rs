mod common;
use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, BlockConfig, CrossEntropy, Module, NormKind};
use candle_func::{grad, make_graph, vmap, Tracer};
use std::collections::BTreeMap;
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev);
    let block = BlockConfig { dim: 64, heads: 4, ff: 256, causal: true, norm: NormKind::LayerNorm, act: nn::Activation::Gelu };
    let m = nn::gpt(64, 64, 2, block, vb)?;
    let p = m.params();
    let (b, t) = (32, 64);
    let xs = Tensor::rand(0f32, 64., (b, t), &dev)?.to_dtype(DType::U32)?;
    let ys = Tensor::rand(0f32, 64., (b, t), &dev)?.to_dtype(DType::U32)?;
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = nn::functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?;
        nn::cross_entropy_with(&logits, &y, CrossEntropy::default())
    };
    let batch_loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        let logits = nn::functional_call(&m, &p, &x)?;
        nn::cross_entropy_with(&logits, &y, CrossEntropy::default())
    };
    let per = vmap(grad(loss)).in_dims([None, Some(0), Some(0)]);
    let step = grad(batch_loss);
    let g = make_graph(&per, (&p, &xs, &ys))?;
    if std::env::var("PRINT").is_ok() { println!("{g}"); }
    let mut ins: Vec<Tensor> = p.values().cloned().collect();
    ins.push(xs.clone()); ins.push(ys.clone());
    for _ in 0..3 { g.run(&ins)?; }
    let mut tot = std::collections::HashMap::<usize, f64>::new();
    for _ in 0..5 { let (_, tm) = g.run_profiled(&ins)?; for (n, s) in tm { *tot.entry(n).or_default() += s / 5.0; } }
    let mut v: Vec<_> = tot.into_iter().collect();
    v.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    let all: f64 = v.iter().map(|x| x.1).sum();
    println!("per-sample total {:.2} ms, peak {:.1} MiB", all * 1e3, g.run_with_stats(&ins)?.1.peak_bytes as f64 / 1048576.0);
    let mut by: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
    for (n, s) in &v { let k = g.node(*n).map(|x| x.name().split('[').next().unwrap().to_string()).unwrap_or_default(); let e = by.entry(k).or_default(); e.0 += s; e.1 += 1; }
    let mut byv: Vec<_> = by.into_iter().collect(); byv.sort_by(|a, b| b.1.0.partial_cmp(&a.1.0).unwrap());
    for (k, (s, c)) in byv.iter().take(20) { println!("{:>8.3} ms {:>4}x {}", s * 1e3, c, k); }
    for (n, s) in v.iter().take(0) { println!("{:.3} ms  %{} {}", s * 1e3, n, g.node(*n).map(|x| format!("{} {:?} <- {:?}", x.name(), x.ty().shape, x.args())).unwrap_or_default()); }
    let t0 = std::time::Instant::now(); for _ in 0..5 { per.call((&p, &xs, &ys))?; } println!("vmap(grad) {:.2} ms", t0.elapsed().as_secs_f64() * 200.0);
    step.call((&p, &xs, &ys))?;
    let t0 = std::time::Instant::now(); for _ in 0..5 { step.call((&p, &xs, &ys))?; } println!("batched step {:.2} ms", t0.elapsed().as_secs_f64() * 200.0);
    Ok(())
}
