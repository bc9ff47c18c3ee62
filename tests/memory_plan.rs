//! The memory plan bounds what a run really holds. For each of the bench's
//! workloads a child process (this test binary, one workload each) builds
//! the workload's graph and inputs, returns freed memory to the system,
//! resets its resident high-water mark, runs the graph once, and reports
//! how far its resident memory rose (the process's own count, from
//! `/proc/self/status`) beside the plan's peak less the inputs already
//! resident. The plan must bound the rise within 10%, and 1 MiB for the
//! allocator's own bookkeeping (the plan counts the bytes the kernels ask
//! for, not how the allocator lays them out). It may overstate it, where
//! a kernel leaves pages of a zeroed buffer untouched (an index-add into
//! mostly zeros), but not by more than twice. The first run of a process
//! also faults in the kernels' per-thread buffers, which stay; it is
//! reported, not bounded.

#![cfg(target_os = "linux")]

#[path = "../examples/common/models.rs"]
mod models;

use candle_core::{Device, Tensor};
use candle_func::dp::clipped_grad_sum;
use candle_func::nn::{self, functional_call, stack_params, CrossEntropy, Module, Reduction, Sequential};
use candle_func::{grad, make_graph, vmap, ConvRoute, Graph, Schedule, Tracer};
use models::{build, c3d, cnn_o, cnn_t, mlp, tiny_lm};
use std::collections::BTreeMap;

type Params = BTreeMap<String, Tensor>;

/// The workloads, by name (the child's `WORKLOAD`).
const WORKLOADS: &[&str] = &[
    "tutorial_step",
    "tutorial_psg",
    "tutorial_psg_chunked",
    "opacus_psg",
    "c3d_psg",
    "ens_tutorial_shared",
    "ens_tutorial_own",
    "ens_tutorial_per_example",
    "ens_opacus_convs_per_example",
    "ens_mlp_shared",
    "opacus_forward",
    "lm_psg",
    "dp_tutorial",
    "dp_opacus",
    "dp_lm",
    "linear_psg_per_example",
];

fn labels(b: usize) -> Tensor {
    Tensor::from_vec(
        (0..b as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<u32>>(),
        b,
        &Device::Cpu,
    )
    .unwrap()
}

fn images(b: usize, shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1., [&[b], shape].concat(), &Device::Cpu).unwrap()
}

fn flat(p: &Params, rest: &[&Tensor]) -> Vec<Tensor> {
    p.values().cloned().chain(rest.iter().map(|t| (*t).clone())).collect()
}

/// Per-sample gradients of a CNN (`chunk`: in chunks of that many).
fn psg(m: &Sequential, xs: &Tensor, chunk: Option<usize>) -> (Graph, Vec<Tensor>) {
    let ys = labels(xs.dims()[0]);
    let loss = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        nn::cross_entropy(
            &functional_call(m, &p, &x.unsqueeze(0)?)?,
            &y.unsqueeze(0)?,
            Reduction::Mean,
        )
    };
    let f = vmap(grad(loss))
        .in_dims([None, Some(0), Some(0)])
        .conv_route(ConvRoute::Unfold)
        .schedule(Schedule::Batched);
    let f = match chunk {
        Some(k) => f.chunk_size(k),
        None => f,
    };
    let p = m.params();
    (make_graph(&f, (&p, xs, &ys)).unwrap(), flat(&p, &[xs, &ys]))
}

/// The DP clipping step of `loss` (one example's) with ghost norms.
fn dp(
    m: &impl Module,
    (xs, ys): (&Tensor, &Tensor),
    loss: impl Fn(&Tracer, &Tracer) -> candle_func::Result<Tracer> + Copy,
) -> (Graph, Vec<Tensor>) {
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        loss(&functional_call(m, &p, &x.unsqueeze(0)?)?, &y.unsqueeze(0)?)
    };
    let p = m.params();
    let g = make_graph(&clipped_grad_sum(one, 1.0), (&p, xs, ys)).unwrap();
    (g, flat(&p, &[xs, ys]))
}

/// Ten models' forward on one batch (`own`: a batch each) by `schedule`.
fn ensemble(
    arch: fn(candle_nn::VarBuilder) -> candle_func::Result<Sequential>,
    example: &[usize],
    own: bool,
    schedule: Schedule,
) -> (Graph, Vec<Tensor>) {
    let built: Vec<_> = (0..10).map(|_| build(arch).unwrap()).collect();
    let models: Vec<&Sequential> = built.iter().map(|(_, m)| m).collect();
    let stacked = stack_params(&models).unwrap();
    let x = if own {
        images(10, &[&[64], example].concat())
    } else {
        images(64, example)
    };
    let f = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(models[0], &p, &x))
        .in_dims([Some(0), own.then_some(0)])
        .conv_route(ConvRoute::Unfold)
        .schedule(schedule);
    (make_graph(&f, (&stacked, &x)).unwrap(), flat(&stacked, &[&x]))
}

fn workload(name: &str) -> (Graph, Vec<Tensor>) {
    let ce = |l: &Tracer, y: &Tracer| nn::cross_entropy(l, y, Reduction::Mean);
    let seq = |l: &Tracer, y: &Tracer| nn::cross_entropy_with(l, y, CrossEntropy::default());
    let mnist = [1, 28, 28];
    match name {
        "tutorial_step" => {
            let (_vm, m) = build(cnn_t).unwrap();
            let (xs, ys) = (images(64, &mnist), labels(64));
            let step = grad(|p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| ce(&functional_call(&m, &p, &x)?, &y));
            let p = m.params();
            (make_graph(&step, (&p, &xs, &ys)).unwrap(), flat(&p, &[&xs, &ys]))
        }
        "tutorial_psg" => psg(&build(cnn_t).unwrap().1, &images(64, &mnist), None),
        "tutorial_psg_chunked" => psg(&build(cnn_t).unwrap().1, &images(64, &mnist), Some(16)),
        "opacus_psg" => psg(&build(cnn_o).unwrap().1, &images(256, &mnist), None),
        "c3d_psg" => psg(&build(c3d).unwrap().1, &images(16, &[1, 16, 16, 16]), None),
        "ens_tutorial_shared" => ensemble(cnn_t, &mnist, false, Schedule::Batched),
        "ens_tutorial_own" => ensemble(cnn_t, &mnist, true, Schedule::Batched),
        "ens_tutorial_per_example" => ensemble(cnn_t, &mnist, false, Schedule::PerExample),
        "ens_opacus_convs_per_example" => ensemble(cnn_o, &mnist, true, Schedule::ConvsPerExample),
        "ens_mlp_shared" => ensemble(mlp, &[784], false, Schedule::Batched),
        "opacus_forward" => {
            let (_vm, m) = build(cnn_o).unwrap();
            let xs = images(256, &mnist);
            let f = vmap(|x: Tracer| m.forward(&x.unsqueeze(0)?)?.squeeze(0)).schedule(Schedule::Batched);
            (make_graph(&f, &xs).unwrap(), vec![xs])
        }
        "lm_psg" => {
            let (_vm, m, xs, ys) = tiny_lm(32).unwrap();
            let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
                seq(&functional_call(&m, &p, &x.unsqueeze(0)?)?.squeeze(0)?, &y)
            };
            let f = vmap(grad(one)).in_dims([None, Some(0), Some(0)]);
            let p = m.params();
            (make_graph(&f, (&p, &xs, &ys)).unwrap(), flat(&p, &[&xs, &ys]))
        }
        "dp_tutorial" => dp(&build(cnn_t).unwrap().1, (&images(64, &mnist), &labels(64)), ce),
        "dp_opacus" => dp(&build(cnn_o).unwrap().1, (&images(256, &mnist), &labels(256)), ce),
        "dp_lm" => {
            let (_vm, m, xs, ys) = tiny_lm(32).unwrap();
            let one = |l: &Tracer, y: &Tracer| seq(&l.squeeze(0)?, &y.squeeze(0)?);
            dp(&m, (&xs, &ys), one)
        }
        // the case: the per-example schedule's plan had counted
        // its result once where the run held it twice
        "linear_psg_per_example" => {
            let (w, xs) = (images(1024, &[1024]), images(64, &[1024]));
            let loss = |w: Tracer, x: Tracer| w.matmul(&x.unsqueeze(1)?)?.tanh()?.sum_all();
            let f = vmap(grad(loss)).in_dims([None, Some(0)]).schedule(Schedule::PerExample);
            (make_graph(&f, (&w, &xs)).unwrap(), vec![w, xs])
        }
        other => panic!("no workload {other:?}"),
    }
}

/// A field of `/proc/self/status`, in bytes.
fn status(field: &str) -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 1024
}

/// The child: one workload, one run, its figures on one line.
#[test]
#[ignore]
fn child() {
    let Ok(name) = std::env::var("WORKLOAD") else { return };
    let (g, inputs) = workload(&name);
    // the kernels warmed up (their threads and per-thread buffers, which
    // stay for the process), and freed memory returned
    let cold = status("VmRSS:");
    drop(g.run(&inputs).unwrap());
    let first = status("VmHWM:") - cold;
    let leaves: usize = inputs.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
    let plan = g.planned_peak_bytes();
    // SAFETY: glibc's malloc_trim only returns free heap memory to the
    // kernel; no live allocation is touched.
    unsafe {
        libc::malloc_trim(0);
    }
    let before = status("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap(); // VmHWM := VmRSS
    let outs = g.run(&inputs).unwrap();
    let hwm = status("VmHWM:");
    drop(outs);
    println!("RESULT {name} {plan} {leaves} {before} {hwm} {first}");
}

#[test]
fn plans_bound_the_resident_peak_of_every_bench_workload() {
    let exe = std::env::current_exe().unwrap();
    let mut bad = Vec::new();
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    for name in WORKLOADS {
        let out = std::process::Command::new(&exe)
            .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("WORKLOAD", name)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find_map(|l| l.split_once("RESULT ")).map(|(_, r)| r);
        let line =
            line.unwrap_or_else(|| panic!("{name}: no result\n{text}\n{}", String::from_utf8_lossy(&out.stderr)));
        let v: Vec<usize> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect();
        let (plan, leaves, before, hwm, first) = (v[0], v[1], v[2], v[3], v[4]);
        let (planned, real) = (plan.saturating_sub(leaves), hwm.saturating_sub(before));
        let ratio = planned as f64 / real.max(1) as f64;
        println!(
            "{name:<30} planned {:>8.1} MiB  resident rise {:>8.1} MiB  plan / real {ratio:.2}  (first run {:.1} MiB)",
            mib(planned),
            mib(real),
            mib(first)
        );
        // Overstatement is judged above 32 MiB only: glibc serves buffers
        // under its 2 MiB trim threshold from memory it kept, so a plan made
        // of such buffers can rise by anything from nothing to its size
        // (ens_mlp_shared: 0.7 MiB planned, 0.0 risen; lm_psg: 27.1
        // planned, 8.6 to 15.0 risen from run to run on one machine).
        let overstated = ratio > 2.0 && planned > 32 << 20;
        if (real as f64) > 1.10 * planned as f64 + (1 << 20) as f64 || overstated {
            bad.push(format!(
                "{name}: planned {:.1} MiB, real {:.1} MiB",
                mib(planned),
                mib(real)
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "plans that do not bound the resident peak within 10% (or overstate it twice):\n{}",
        bad.join("\n")
    );
}
