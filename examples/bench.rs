//! The benchmark suite: per-sample gradients, ensembles and the cost of
//! tracing, on the workloads of `../shared/peers` (PyTorch-tutorial CNN,
//! Opacus MNIST CNN, a conv3d net, an ensemble of 10 tutorial CNNs), with a
//! sweep over batch sizes and conv routes. Prints markdown tables of
//! medians, ratios measured in this run, and the interpreter's peak memory.
//!
//!     cargo run --release --example bench                 # everything
//!     cargo run --release --example bench -- --quick      # under two minutes
//!     cargo run --release --example bench -- --json       # one JSON object per line
//!     cargo run --release --example bench -- --only T,O   # T, O, C3D, ENS (or ENS_T, ENS_O, ENS_MLP), FWD, HO, NTK, LM, DP, SAMPLING, SWEEP
//!     cargo run --release --example bench -- --only SWEEP --svg docs/routes.svg
//!
//! With `CANDLE_FUNC_DEVICE=cuda` (built with `--features cuda`) the
//! models, data and runs are on the first GPU, each timing waiting for the
//! GPU's queue (`scripts/gpu_check.sh` runs it so).

mod common;

use candle_core::{DType, Tensor};
use candle_func::jacobian::hvp_fn;
use candle_func::nn::{self, functional_call, stack_params, Module, Reduction, Sequential};
use candle_func::tracer::Operand;
use candle_func::{grad, jacfwd, jacrev, jit, make_graph, vmap, ConvRoute, Schedule, Tracer};
use common::median_ms;
use common::models::{build_on, c3d, cnn_o, cnn_t, mlp, tiny_lm};
use std::collections::BTreeMap;

type Params = BTreeMap<String, Tensor>;
type Res<T> = Result<T, Box<dyn std::error::Error>>;

const ROUTES: [ConvRoute; 4] = [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop, ConvRoute::Auto];

struct Opts {
    reps: usize,
    quick: bool,
    json: bool,
    svg: Option<String>,
}

/// One measured variant of a workload.
struct Row {
    variant: String,
    ms: f64,
    peak_mib: Option<f64>,
}

/// The interpreter's peak live bytes for the graph a call runs.
fn peak_mib(g: &candle_func::Graph, inputs: &[Tensor]) -> Res<f64> {
    let (_, stats) = g.run_with_stats(inputs)?;
    Ok(stats.peak_bytes as f64 / (1 << 20) as f64)
}

fn report(o: &Opts, workload: &str, rows: &[Row], notes: &[String]) {
    if o.json {
        for r in rows {
            let peak = r.peak_mib.map(|p| format!("{p:.2}")).unwrap_or_else(|| "null".into());
            println!(
                r#"{{"workload": "{workload}", "variant": "{}", "median_ms": {:.3}, "peak_mib": {peak}}}"#,
                r.variant, r.ms
            );
        }
        return;
    }
    let base = rows[0].ms;
    println!(
        "\n### {workload}\n\n| variant | median ms | / {} | peak MiB |\n| --- | --- | --- | --- |",
        rows[0].variant
    );
    for r in rows {
        let peak = r.peak_mib.map(|p| format!("{p:.1}")).unwrap_or_else(|| "-".into());
        println!("| {} | {:.2} | {:.2} | {peak} |", r.variant, r.ms, r.ms / base);
    }
    for n in notes {
        println!("\n{n}");
    }
}

/// A variant to time: a closure that runs it once.
type Job<'a> = Box<dyn FnMut() -> Res<()> + 'a>;

/// Median milliseconds of each job over `reps` rounds, the jobs taking
/// turns within each round, so that load on a shared machine falls on all
/// variants alike rather than on whichever ran during a noisy spell. One
/// untimed call each first (it also traces and caches the graph), and in
/// every round one untimed call right before the timed one, so each job is
/// timed warm, with its own data in cache rather than the previous job's,
/// as the peers' scripts time theirs (warm-up calls, then the repetitions
/// back to back).
fn interleaved(reps: usize, jobs: &mut [Job]) -> Res<Vec<f64>> {
    for j in jobs.iter_mut() {
        j()?;
    }
    let mut times = vec![Vec::with_capacity(reps); jobs.len()];
    for _ in 0..reps.max(1) {
        for (j, t) in jobs.iter_mut().zip(times.iter_mut()) {
            j()?;
            common::sync();
            let s = std::time::Instant::now();
            j()?;
            common::sync();
            t.push(s.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(|a, b| a.total_cmp(b));
            t[t.len() / 2]
        })
        .collect())
}

fn flat_inputs(p: &Params, rest: &[&Tensor]) -> Vec<Tensor> {
    p.values().cloned().chain(rest.iter().map(|t| (*t).clone())).collect()
}

/// Per-sample gradients of `model` on a batch `xs` (shape `[B, *input]`).
fn per_sample(o: &Opts, tag: &str, model: &Sequential, xs: &Tensor, with_loop: bool) -> Res<()> {
    let b = xs.dims()[0];
    let ys = Tensor::from_vec(
        (0..b as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(),
        b,
        xs.device(),
    )?;
    let p = model.params();
    let step = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(&functional_call(model, &p, &x)?, &y, Reduction::Mean)
    });
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(
            &functional_call(model, &p, &x.unsqueeze(0)?)?,
            &y.unsqueeze(0)?,
            Reduction::Mean,
        )
    };
    let inputs = flat_inputs(&p, &[xs, &ys]);
    let fs: Vec<_> = ROUTES
        .iter()
        .map(|&route| vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).conv_route(route))
        .collect();
    let mut jobs: Vec<Job> = vec![Box::new(|| Ok(step.call((&p, xs, &ys)).map(|_| ())?))];
    for f in &fs {
        jobs.push(Box::new(|| Ok(f.call((&p, xs, &ys)).map(|_| ())?)));
    }
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let mut rows = vec![Row {
        variant: "batched gradient step".into(),
        ms: ms[0],
        peak_mib: Some(peak_mib(&make_graph(&step, (&p, xs, &ys))?, &inputs)?),
    }];
    let mut by_route = Vec::new();
    for ((route, f), &ms) in ROUTES.iter().zip(&fs).zip(&ms[1..]) {
        let peak = peak_mib(&make_graph(f, (&p, xs, &ys))?, &inputs)?;
        by_route.push((*route, ms));
        rows.push(Row {
            variant: format!("vmap(grad) {route:?}"),
            ms,
            peak_mib: Some(peak),
        });
    }
    let mut notes = Vec::new();
    if with_loop {
        let one = jit(grad(loss));
        let ms = median_ms(o.reps.min(3), || -> candle_func::Result<()> {
            for i in 0..b {
                one.call((&p, xs.get(i)?, ys.get(i)?))?;
            }
            Ok(())
        })?;
        rows.push(Row {
            variant: "per-example loop".into(),
            ms,
            peak_mib: None,
        });
        let best = by_route.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
        notes.push(format!("loop / best vmap(grad): {:.2}", ms / best));
    }
    notes.push(auto_note(&by_route));
    report(o, &format!("{tag}, B={b}: per-sample gradients"), &rows, &notes);
    Ok(())
}

/// Auto against the best and worst fixed route.
fn auto_note(by_route: &[(ConvRoute, f64)]) -> String {
    let fixed: Vec<f64> = by_route
        .iter()
        .filter(|r| r.0 != ConvRoute::Auto)
        .map(|r| r.1)
        .collect();
    let auto = by_route
        .iter()
        .find(|r| r.0 == ConvRoute::Auto)
        .map(|r| r.1)
        .unwrap_or(f64::NAN);
    let best = fixed.iter().copied().fold(f64::INFINITY, f64::min);
    let worst = fixed.iter().copied().fold(0.0, f64::max);
    format!(
        "Auto / best fixed route: {:.2}; Auto / worst: {:.2}",
        auto / best,
        auto / worst
    )
}

/// An ensemble workload: the architecture, its name, one example's shape.
struct Ensemble {
    arch: fn(candle_nn::VarBuilder) -> candle_func::Result<Sequential>,
    name: &'static str,
    example: &'static [usize],
}

const TUTORIAL: Ensemble = Ensemble {
    arch: cnn_t,
    name: "tutorial CNNs",
    example: &[1, 28, 28],
};
const OPACUS: Ensemble = Ensemble {
    arch: cnn_o,
    name: "Opacus MNIST CNNs",
    example: &[1, 28, 28],
};
const MLP: Ensemble = Ensemble {
    arch: mlp,
    name: "MLPs 784-128-128-10",
    example: &[784],
};

/// The vmapped ensembles timed beside the loop: the default (`Auto`
/// schedule and route), each schedule, and the batched graph by route.
fn ensemble_variants() -> Vec<(String, Schedule, Option<ConvRoute>)> {
    let mut v = vec![
        ("vmap default".to_string(), Schedule::Auto, None),
        ("vmap per example".to_string(), Schedule::PerExample, None),
        ("vmap convs per example".to_string(), Schedule::ConvsPerExample, None),
    ];
    for r in ROUTES {
        v.push((format!("vmap batched, {r:?}"), Schedule::Batched, Some(r)));
    }
    v
}

fn ensemble(o: &Opts, e: &Ensemble, own: bool) -> Res<()> {
    let (m, b) = (10, 64);
    let measured_before = candle_func::planner::schedule_choices().len();
    let built = (0..m)
        .map(|_| build_on(&common::device(), e.arch))
        .collect::<candle_func::Result<Vec<_>>>()?;
    let models: Vec<&Sequential> = built.iter().map(|(_, s)| s).collect();
    let stacked = stack_params(&models)?;
    let dev = common::device();
    let lead: Vec<usize> = if own { vec![m, b] } else { vec![b] };
    let x = Tensor::randn(0f32, 1., [&lead[..], e.example].concat(), &dev)?;
    let fwd = jit(|x: Tracer| models[0].forward(&x));
    let xi = |i: usize| -> candle_core::Result<Tensor> {
        if own {
            x.get(i)
        } else {
            Ok(x.clone())
        }
    };
    let runs: Vec<_> = models.iter().map(|mm| jit(move |x: Tracer| mm.forward(&x))).collect();
    let variants = ensemble_variants();
    let fs: Vec<_> = variants
        .iter()
        .map(|(_, schedule, route)| {
            let f = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(models[0], &p, &x))
                .in_dims([Some(0), if own { Some(0) } else { None }])
                .schedule(*schedule);
            match route {
                Some(r) => f.conv_route(*r),
                None => f,
            }
        })
        .collect();
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(fwd.call(xi(0)?).map(|_| ())?)),
        Box::new(|| {
            for (i, r) in runs.iter().enumerate() {
                r.call(xi(i)?)?;
            }
            Ok(())
        }),
    ];
    for f in &fs {
        jobs.push(Box::new(|| Ok(f.call((&stacked, &x)).map(|_| ())?)));
    }
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let (single, looped) = (ms[0], ms[1]);
    let mut rows = vec![Row {
        variant: format!("loop over the {m} models"),
        ms: looped,
        peak_mib: None,
    }];
    let mut by_route = Vec::new();
    for (((name, schedule, route), f), &t) in variants.iter().zip(&fs).zip(&ms[2..]) {
        let peak = peak_mib(&make_graph(f, (&stacked, &x))?, &flat_inputs(&stacked, &[&x]))?;
        if let (Schedule::Batched, Some(r)) = (schedule, route) {
            by_route.push((*r, t));
        }
        rows.push(Row {
            variant: name.clone(),
            ms: t,
            peak_mib: Some(peak),
        });
    }
    let choices = candle_func::planner::schedule_choices();
    let chosen = choices[measured_before.min(choices.len())..]
        .first()
        .map(|c| format!("{:?} (measured {:?})", c.chosen, c.timings_ms))
        .unwrap_or_else(|| "batched, unmeasured (a small program)".into());
    let notes = vec![
        format!(
            "one model alone: {single:.2} ms; the default vmap / loop: {:.2}",
            ms[2] / looped
        ),
        format!("what Auto ran: {chosen}"),
        auto_note(&by_route),
    ];
    let kind = if own { "a batch per model" } else { "one shared batch" };
    report(
        o,
        &format!("ensemble of {m} {}, forward, {kind} of {b}", e.name),
        &rows,
        &notes,
    );
    Ok(())
}

/// `vmap(|x| model.forward(x))` against the model's plain batched forward.
fn forward_overhead(o: &Opts) -> Res<()> {
    let (_vm, model) = build_on(&common::device(), cnn_o)?;
    let xs = Tensor::randn(0f32, 1., (256, 1, 28, 28), &common::device())?;
    let plain = jit(|x: Tracer| model.forward(&x));
    let mapped = vmap(|x: Tracer| model.forward(&x.unsqueeze(0)?)?.squeeze(0));
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(plain.call(&xs).map(|_| ())?)),
        Box::new(|| Ok(mapped.call(&xs).map(|_| ())?)),
    ];
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let rows = vec![
        Row {
            variant: "plain batched forward".into(),
            ms: ms[0],
            peak_mib: Some(peak_mib(&make_graph(&plain, &xs)?, std::slice::from_ref(&xs))?),
        },
        Row {
            variant: "vmap(|x| model.forward(x))".into(),
            ms: ms[1],
            peak_mib: Some(peak_mib(&make_graph(&mapped, &xs)?, std::slice::from_ref(&xs))?),
        },
    ];
    report(o, "Opacus MNIST CNN, B=256: forward", &rows, &[]);
    Ok(())
}

/// Per-sample gradients of the Opacus CNN over batch sizes and routes, with
/// `chunk_size` bounding memory.
fn sweep(o: &Opts) -> Res<()> {
    let (_vm, model) = build_on(&common::device(), cnn_o)?;
    let p = model.params();
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(
            &functional_call(&model, &p, &x.unsqueeze(0)?)?,
            &y.unsqueeze(0)?,
            Reduction::Mean,
        )
    };
    let sizes: &[usize] = if o.quick {
        &[16, 64, 256]
    } else {
        &[16, 32, 64, 128, 256, 512]
    };
    let mut rows = Vec::new();
    let mut points: Vec<(ConvRoute, usize, f64)> = Vec::new();
    for &b in sizes {
        let xs = Tensor::randn(0f32, 1., (b, 1, 28, 28), &common::device())?;
        let ys = Tensor::zeros(b, DType::U32, &common::device())?;
        let inputs = flat_inputs(&p, &[&xs, &ys]);
        let routes = [ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop];
        let mut fs: Vec<_> = routes
            .iter()
            .map(|&route| vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).conv_route(route))
            .collect();
        fs.push(vmap(grad(loss)).in_dims([None, Some(0), Some(0)]).chunk_size(32));
        let mut jobs: Vec<Job> = Vec::new();
        for f in &fs {
            jobs.push(Box::new(|| Ok(f.call((&p, &xs, &ys)).map(|_| ())?)));
        }
        let ms = interleaved(o.reps, &mut jobs)?;
        drop(jobs);
        for (i, f) in fs.iter().enumerate() {
            let variant = match routes.get(i) {
                Some(route) => {
                    points.push((*route, b, ms[i]));
                    format!("B={b} {route:?}")
                }
                None => format!("B={b} Unfold, chunk_size 32"),
            };
            rows.push(Row {
                variant,
                ms: ms[i],
                peak_mib: Some(peak_mib(&make_graph(f, (&p, &xs, &ys))?, &inputs)?),
            });
        }
    }
    report(
        o,
        "sweep: Opacus MNIST CNN per-sample gradients by batch size and route",
        &rows,
        &[],
    );
    if let Some(path) = &o.svg {
        std::fs::write(path, chart(&points))?;
    }
    Ok(())
}

/// An SVG line chart of milliseconds per example against batch size, one
/// line per route (log-scaled batch axis).
fn chart(points: &[(ConvRoute, usize, f64)]) -> String {
    let (w, h, pad) = (640.0, 360.0, 56.0);
    let per = |&(_, b, ms): &(ConvRoute, usize, f64)| ms / b as f64;
    let ymax = points.iter().map(per).fold(0.0, f64::max) * 1.1;
    let bmin = points.iter().map(|p| p.1).min().unwrap_or(1) as f64;
    let bmax = points.iter().map(|p| p.1).max().unwrap_or(2) as f64;
    let x = |b: f64| pad + (b.ln() - bmin.ln()) / (bmax.ln() - bmin.ln()).max(1e-9) * (w - 2.0 * pad);
    let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
    let (bottom, right) = (h - pad, w - pad);
    let mut svg = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n");
    svg += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    svg += &format!(
        "<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">Opacus MNIST CNN per-sample gradients: ms per example</text>\n",
        w / 2.0
    );
    svg += &format!("<line x1=\"{pad}\" y1=\"{bottom}\" x2=\"{right}\" y2=\"{bottom}\" stroke=\"black\"/>\n");
    svg += &format!("<line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{bottom}\" stroke=\"black\"/>\n");
    let mut sizes: Vec<usize> = points.iter().map(|p| p.1).collect();
    sizes.dedup();
    for b in sizes {
        let xb = x(b as f64);
        svg += &format!(
            "<text x=\"{xb:.1}\" y=\"{}\" text-anchor=\"middle\">{b}</text>\n",
            bottom + 18.0
        );
    }
    for i in 0..=4 {
        let v = ymax * i as f64 / 4.0;
        svg += &format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.3}</text>\n",
            pad - 6.0,
            y(v) + 4.0
        );
    }
    let lines = [
        (ConvRoute::Grouped, "#1f77b4"),
        (ConvRoute::Unfold, "#d62728"),
        (ConvRoute::Loop, "#2ca02c"),
    ];
    for (k, (route, color)) in lines.iter().enumerate() {
        let pts: Vec<String> = points
            .iter()
            .filter(|p| p.0 == *route)
            .map(|p| format!("{:.1},{:.1}", x(p.1 as f64), y(per(p))))
            .collect();
        svg += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        );
        let ly = pad + 16.0 * k as f64;
        svg += &format!(
            "<text x=\"{}\" y=\"{ly}\" fill=\"{color}\">{route:?}</text>\n",
            right - 60.0
        );
    }
    svg += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">batch size</text>\n",
        w / 2.0,
        h - 12.0
    );
    svg + "</svg>\n"
}

/// Forward and reverse mode side by side: `jacfwd` against `jacrev` on a
/// map with few inputs and many outputs and on one with many inputs and
/// few outputs, and a Hessian-vector product (forward over reverse)
/// against one gradient of the same loss.
fn higher_order(o: &Opts) -> Res<()> {
    let dev = common::device();
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for (name, fin, fout) in [("R^16 -> R^1024", 16, 1024), ("R^1024 -> R^16", 1024, 16)] {
        let w = Tensor::randn(0f32, 1., (fout, fin), &dev)?;
        let x = Tensor::randn(0f32, 1., fin, &dev)?;
        let f = move |x: Tracer| x.unsqueeze(1)?.t()?.matmul(&w.t()?.to_tracer(&x)?)?.tanh()?.squeeze(0);
        let (fwd, rev) = (jit(jacfwd(f.clone())), jit(jacrev(f)));
        let mut jobs: Vec<Job> = vec![
            Box::new(|| Ok(fwd.call(&x).map(|_| ())?)),
            Box::new(|| Ok(rev.call(&x).map(|_| ())?)),
        ];
        let ms = interleaved(o.reps, &mut jobs)?;
        rows.push(Row {
            variant: format!("{name}: jacfwd"),
            ms: ms[0],
            peak_mib: None,
        });
        rows.push(Row {
            variant: format!("{name}: jacrev"),
            ms: ms[1],
            peak_mib: None,
        });
        notes.push(format!("{name}: jacfwd / jacrev {:.2}", ms[0] / ms[1]));
    }
    // an MLP loss of a batch of 64 inputs, 784-128-10
    let (w1, w2) = (
        Tensor::randn(0f32, 0.05, (128, 784), &dev)?,
        Tensor::randn(0f32, 0.1, (10, 128), &dev)?,
    );
    let loss = move |x: Tracer| -> candle_func::Result<Tracer> {
        let h = x.matmul(&w1.t()?.to_tracer(&x)?)?.tanh()?;
        h.matmul(&w2.t()?.to_tracer(&x)?)?.log_softmax(1)?.sum_all()
    };
    let x = Tensor::randn(0f32, 1., (64, 784), &dev)?;
    let v = Tensor::randn(0f32, 1., (64, 784), &dev)?;
    let (g, h) = (jit(grad(loss.clone())), jit(hvp_fn(loss)));
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(g.call(&x).map(|_| ())?)),
        Box::new(|| Ok(h.call((&x, &v)).map(|_| ())?)),
    ];
    let ms = interleaved(o.reps, &mut jobs)?;
    rows.push(Row {
        variant: "MLP loss, B=64: grad".into(),
        ms: ms[0],
        peak_mib: None,
    });
    rows.push(Row {
        variant: "MLP loss, B=64: hvp (forward over reverse)".into(),
        ms: ms[1],
        peak_mib: None,
    });
    notes.push(format!("hvp / grad: {:.2}", ms[1] / ms[0]));
    report(o, "higher-order transforms", &rows, &notes);
    Ok(())
}

/// Per-sample gradients of `tiny_lm` (a GPT of `nn::gpt`) at the size of
/// `benches/peers/bench_lm.py`: V=64, D=64, H=4, L=2, F=256, T=64, B=32.
fn lm(o: &Opts) -> Res<()> {
    use candle_func::nn::CrossEntropy;
    let b = 32;
    let (_vm, m, xs, ys) = tiny_lm(b)?;
    let p = m.params();
    let ce = CrossEntropy::default();
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy_with(&functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?, &y, ce)
    };
    let all = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy_with(&functional_call(&m, &p, &x)?, &y, ce)
    };
    let (step, per) = (grad(all), vmap(grad(one)).in_dims([None, Some(0), Some(0)]));
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(step.call((&p, &xs, &ys)).map(|_| ())?)),
        Box::new(|| Ok(per.call((&p, &xs, &ys)).map(|_| ())?)),
    ];
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let inputs = flat_inputs(&p, &[&xs, &ys]);
    let mut rows = vec![
        Row {
            variant: "batched gradient step".into(),
            ms: ms[0],
            peak_mib: Some(peak_mib(&make_graph(&step, (&p, &xs, &ys))?, &inputs)?),
        },
        Row {
            variant: "vmap(grad)".into(),
            ms: ms[1],
            peak_mib: Some(peak_mib(&make_graph(&per, (&p, &xs, &ys))?, &inputs)?),
        },
    ];
    let mut notes = vec![format!("vmap(grad) / batched step: {:.2}", ms[1] / ms[0])];
    if !o.quick {
        let g = jit(grad(one));
        let ms_loop = median_ms(o.reps.min(3), || -> candle_func::Result<()> {
            for i in 0..b {
                g.call((&p, xs.get(i)?, ys.get(i)?))?;
            }
            Ok(())
        })?;
        rows.push(Row {
            variant: "per-example loop".into(),
            ms: ms_loop,
            peak_mib: None,
        });
        notes.push(format!("loop / vmap(grad): {:.2}", ms_loop / ms[1]));
    }
    report(
        o,
        "tiny_lm (V=64, D=64, H=4, L=2, T=64), B=32: per-sample gradients",
        &rows,
        &notes,
    );
    Ok(())
}

/// The clipping step of DP-SGD (`dp::clipped_grad_sum`: per-example
/// norms and the clipped sum) with ghost rules and with every per-sample
/// gradient materialised, beside the ordinary batched gradient step of the
/// same model and batch: the tutorial CNN at B=64, the Opacus CNN at B=256
/// and `tiny_lm` at B=32.
fn dp_steps(o: &Opts) -> Res<()> {
    let dev = common::device();
    let labels = |b: usize| Tensor::from_vec((0..b as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(), b, &dev);
    let (vm_t, cnn_tut) = build_on(&common::device(), cnn_t)?;
    let (vm_o, cnn_op) = build_on(&common::device(), cnn_o)?;
    let conv = |m: &Sequential, b: usize| -> Res<(Params, Tensor, Tensor)> {
        Ok((m.params(), Tensor::randn(0f32, 1., (b, 1, 28, 28), &dev)?, labels(b)?))
    };
    let ce = |logits: &Tracer, y: &Tracer| nn::cross_entropy(logits, y, Reduction::Mean);
    dp_step(
        o,
        "PyTorch-tutorial CNN, B=64",
        (&vm_t, &cnn_tut),
        conv(&cnn_tut, 64)?,
        ce,
    )?;
    dp_step(o, "Opacus MNIST CNN, B=256", (&vm_o, &cnn_op), conv(&cnn_op, 256)?, ce)?;
    let (vm_l, lm, xs, ys) = tiny_lm(32)?;
    let seq = |logits: &Tracer, y: &Tracer| nn::cross_entropy_with(logits, y, nn::CrossEntropy::default());
    dp_step(
        o,
        "tiny_lm (V=64, D=64, H=4, L=2, T=64), B=32",
        (&vm_l, &lm),
        (lm.params(), xs, ys),
        seq,
    )?;
    Ok(())
}

/// One `dp_steps` model: `loss(logits, y)` of a batch for the ordinary
/// step, of a batch of one for the per-example losses. The training steps
/// update the model's `VarMap` (SGD, lr 1e-3); the DP steps run through
/// `dp::PrivacyEngine` with the batch as the whole data set (`q = 1`, one
/// pass of B), so each does exactly what `bench_dp.py`'s Opacus step does:
/// clip, one noise draw (`σ = 1`), the update.
fn dp_step<M: Module>(
    o: &Opts,
    tag: &str,
    (vm, m): (&candle_nn::VarMap, &M),
    (p, xs, ys): (Params, Tensor, Tensor),
    loss: impl Fn(&Tracer, &Tracer) -> candle_func::Result<Tracer> + Copy,
) -> Res<()> {
    use candle_func::dp::{clipped_grad_sum, DpConfig, PrivacyEngine};
    use candle_func::optim::Optimizer;
    let step = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| loss(&functional_call(m, &p, &x)?, &y));
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        loss(&functional_call(m, &p, &x.unsqueeze(0)?)?, &y.unsqueeze(0)?)
    };
    let (ghost, full) = (clipped_grad_sum(one, 1.0), clipped_grad_sum(one, 1.0).ghost(false));
    let b = xs.dims()[0];
    let trainer = |on: bool, physical: usize, secure: bool| {
        PrivacyEngine::new()
            .rng(candle_func::rng::Rng::seeded(0))
            .secure_mode(secure)
            .ghost(on)
            .physical_batch(physical)
            .make_private(
                one,
                vm,
                candle_func::optim::Sgd::new(vm, 1e-3, 0.0)?,
                (&xs, &ys),
                DpConfig::new(b, 1.0, 1.0),
            )
    };
    let (mut dp_ghost, mut dp_full) = (trainer(true, b, true)?, trainer(false, b, true)?);
    let mut dp_halves = trainer(true, b.div_ceil(2), true)?;
    let mut dp_single = trainer(true, b, false)?;
    let mut sgd = candle_func::optim::Sgd::new(vm, 1e-3, 0.0)?;
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(step.call((&p, &xs, &ys)).map(|_| ())?)),
        Box::new(|| Ok(sgd.step(&step.call((&p, &xs, &ys))?)?)),
        Box::new(|| Ok(ghost.call((&p, &xs, &ys)).map(|_| ())?)),
        Box::new(|| Ok(full.call((&p, &xs, &ys)).map(|_| ())?)),
        Box::new(|| Ok(dp_ghost.step().map(|_| ())?)),
        Box::new(|| Ok(dp_full.step().map(|_| ())?)),
        Box::new(|| Ok(dp_halves.step().map(|_| ())?)),
        Box::new(|| Ok(dp_single.step().map(|_| ())?)),
    ];
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let inputs = flat_inputs(&p, &[&xs, &ys]);
    let (hx, hy) = (xs.narrow(0, 0, b.div_ceil(2))?, ys.narrow(0, 0, b.div_ceil(2))?);
    let graph_peaks = [
        peak_mib(&make_graph(&step, (&p, &xs, &ys))?, &inputs)?,
        peak_mib(&make_graph(&ghost, (&p, &xs, &ys))?, &inputs)?,
        peak_mib(&make_graph(&full, (&p, &xs, &ys))?, &inputs)?,
        peak_mib(&make_graph(&ghost, (&p, &hx, &hy))?, &flat_inputs(&p, &[&hx, &hy]))?,
    ];
    // Outside the graphs, the updates hold parameter-sized temporaries:
    // one for SGD's step, one more for the noisy mean (drawn, added and
    // scaled in one pass).
    let p_mib = p.values().map(|t| t.elem_count() * 4).sum::<usize>() as f64 / (1 << 20) as f64;
    let peaks = [
        graph_peaks[0],
        graph_peaks[0] + p_mib,
        graph_peaks[1],
        graph_peaks[2],
        graph_peaks[1] + 2.0 * p_mib,
        graph_peaks[2] + 2.0 * p_mib,
        // and the first pass's sum while the second runs
        graph_peaks[3] + 3.0 * p_mib,
        graph_peaks[1] + 2.0 * p_mib,
    ];
    let names = [
        "batched gradient step",
        "batched training step (+ SGD)",
        "clipped sum, ghost",
        "clipped sum, materialised",
        "DP step, ghost (clip + noise + SGD)",
        "DP step, materialised",
        "DP step, ghost, two passes of B/2",
        "DP step, ghost, single-draw noise (not secure)",
    ];
    let rows: Vec<Row> = names
        .iter()
        .zip(ms.iter().zip(peaks))
        .map(|(n, (&ms, peak))| Row {
            variant: n.to_string(),
            ms,
            peak_mib: Some(peak),
        })
        .collect();
    let ratio = |i: usize, j: usize| format!("{:.2} time, {:.2} peak memory", ms[i] / ms[j], peaks[i] / peaks[j]);
    let notes = vec![
        format!("DP step, ghost / training step: {}", ratio(4, 1)),
        format!("DP step, materialised / training step: {}", ratio(5, 1)),
        format!("DP step, ghost, two passes of B/2 / training step: {}", ratio(6, 1)),
        format!("DP step, ghost, single-draw noise / training step: {}", ratio(7, 1)),
        format!("clipped sum, ghost / batched gradient step: {}", ratio(2, 0)),
        format!("parameters {p_mib:.1} MiB (the updates' temporaries are counted in multiples of it)"),
    ];
    report(o, &format!("{tag}: DP step"), &rows, &notes);
    Ok(())
}

/// The DP step with each sampling scheme on the Opacus MNIST CNN: N = 1024
/// examples, expected batch 256 (q = 1/4), physical batch 64, ghost
/// clipping, one noise draw; every scheme's passes have the same shape, so
/// one trace and one planned peak serve them all.
fn dp_sampling(o: &Opts) -> Res<()> {
    use candle_func::dp::{DpConfig, PrivacyEngine, Sampling};
    let dev = common::device();
    let (vm, cnn) = build_on(&dev, cnn_o)?;
    let n = 1024;
    let xs = Tensor::randn(0f32, 1., (n, 1, 28, 28), &dev)?;
    let ys = Tensor::from_vec((0..n as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(), n, &dev)?;
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(
            &functional_call(&cnn, &p, &x.unsqueeze(0)?)?,
            &y.unsqueeze(0)?,
            Reduction::Mean,
        )
    };
    // the cap three standard deviations above the expected 256
    let schemes = [
        ("Poisson", Sampling::Poisson),
        ("without replacement, B = 256", Sampling::WithoutReplacement),
        (
            "truncated Poisson, cap 298",
            Sampling::TruncatedPoisson {
                dataset_size: n,
                max_batch: 298,
            },
        ),
    ];
    let mut trainers = schemes
        .iter()
        .map(|&(_, s)| {
            PrivacyEngine::new()
                .rng(candle_func::rng::Rng::seeded(0))
                .sampling(s)
                .physical_batch(64)
                .make_private(
                    one,
                    &vm,
                    candle_func::optim::Sgd::new(&vm, 1e-3, 0.0)?,
                    (&xs, &ys),
                    DpConfig::new(256, 1.0, 1.0),
                )
        })
        .collect::<candle_func::Result<Vec<_>>>()?;
    let mut jobs: Vec<Job> = trainers
        .iter_mut()
        .map(|t| Box::new(move || Ok(t.step().map(|_| ())?)) as Job)
        .collect();
    let ms = interleaved(o.reps, &mut jobs)?;
    drop(jobs);
    let rows: Vec<Row> = schemes
        .iter()
        .zip(&ms)
        .map(|(&(v, _), &ms)| Row {
            variant: v.into(),
            ms,
            peak_mib: None,
        })
        .collect();
    let traces: Vec<usize> = trainers.iter().map(|t| t.traced_signatures()).collect();
    let notes = vec![
        format!(
            "without replacement / Poisson: {:.2}; truncated / Poisson: {:.2}",
            ms[1] / ms[0],
            ms[2] / ms[0]
        ),
        format!("traced signatures per trainer: {traces:?} (one pass shape, so one planned peak)"),
    ];
    report(
        o,
        "Opacus MNIST CNN, N=1024, expected batch 256, physical 64: DP step by sampling",
        &rows,
        &notes,
    );
    Ok(())
}

/// The torch.func NTK tutorial's two methods (`examples/common/ntk.rs`) on
/// the shapes of `benches/peers/bench_higher_order.py`.
fn ntk(o: &Opts) -> Res<()> {
    let dev = common::device();
    let (_vm, model) = build_on(&common::device(), common::ntk::cnn)?;
    let p = model.params();
    let (x1, x2) = (
        Tensor::randn(0f32, 1., (20, 3, 16, 16), &dev)?,
        Tensor::randn(0f32, 1., (5, 3, 16, 16), &dev)?,
    );
    let (full, vps) = (common::ntk::by_contraction(&model), common::ntk::by_products(&model));
    let mut jobs: Vec<Job> = vec![
        Box::new(|| Ok(full(&p, &x1, &x2).map(|_| ())?)),
        Box::new(|| Ok(vps(&p, &x1, &x2).map(|_| ())?)),
    ];
    let ms = interleaved(o.reps, &mut jobs)?;
    let rows = [("Jacobian contraction", ms[0]), ("NTK-vector products", ms[1])].map(|(v, ms)| Row {
        variant: v.into(),
        ms,
        peak_mib: None,
    });
    report(o, "empirical NTK, CNN, 20 x 5 images", &rows, &[]);
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').map(str::to_string).collect());
    let want = |k: &str| only.as_ref().is_none_or(|o| o.iter().any(|x| x == k));
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let svg = args
        .iter()
        .position(|a| a == "--svg")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let o = Opts {
        reps: reps.unwrap_or(if quick { 3 } else { 11 }),
        quick,
        json,
        svg,
    };
    if !json {
        println!(
            "candle-func benchmarks: f32, {} threads, median of {}, {}",
            candle_core::utils::get_num_threads(),
            o.reps,
            common::allocator()
        );
    }
    let dev = common::device();
    if want("T") {
        let (_vm, m) = build_on(&common::device(), cnn_t)?;
        per_sample(
            &o,
            "PyTorch-tutorial CNN",
            &m,
            &Tensor::randn(0f32, 1., (64, 1, 28, 28), &dev)?,
            !quick,
        )?;
    }
    if want("O") {
        let (_vm, m) = build_on(&common::device(), cnn_o)?;
        for b in [64, 256] {
            per_sample(
                &o,
                "Opacus MNIST CNN",
                &m,
                &Tensor::randn(0f32, 1., (b, 1, 28, 28), &dev)?,
                true,
            )?;
        }
    }
    if want("C3D") {
        let (_vm, m) = build_on(&common::device(), c3d)?;
        per_sample(
            &o,
            "conv3d net",
            &m,
            &Tensor::randn(0f32, 1., (16, 1, 16, 16, 16), &dev)?,
            !quick,
        )?;
    }
    for (key, e) in [("ENS_T", &TUTORIAL), ("ENS_O", &OPACUS), ("ENS_MLP", &MLP)] {
        if want("ENS") || want(key) {
            ensemble(&o, e, false)?;
            ensemble(&o, e, true)?;
        }
    }
    if want("FWD") {
        forward_overhead(&o)?;
    }
    if want("HO") {
        higher_order(&o)?;
    }
    if want("NTK") {
        ntk(&o)?;
    }
    if want("LM") {
        lm(&o)?;
    }
    if want("DP") {
        dp_steps(&o)?;
    }
    if want("SAMPLING") {
        dp_sampling(&o)?;
    }
    if want("SWEEP") {
        sweep(&o)?;
    }
    Ok(())
}
