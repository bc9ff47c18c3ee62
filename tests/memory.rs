//! The memory limit is a limit: every way a graph runs (a transform's
//! call, `vjp` and its pullback, `linearize` and its linear map) checks the
//! plan of what it is about to run against `Options::memory_limit` and
//! refuses with `Error::Memory` before any kernel runs.

use candle_core::{DType, Device, Tensor};
use candle_func::{custom_op, custom_op_with_rules, jit, linearize, vjp, CustomRules, Error, Options, Tracer};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A copy of `x` by a kernel that counts its runs in `runs`.
fn counted(name: &str, x: &Tracer, runs: &Arc<AtomicUsize>) -> candle_func::Result<Tracer> {
    let runs = runs.clone();
    custom_op(name, &[x], x.tensor_type().clone(), move |xs| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(xs[0].clone())
    })
}

/// Rows of `x` ([16]) broadcast to `[2^20, 16]` and exponentiated: a
/// 64 MiB temporary, summed back to `[16]`.
fn big(x: &Tracer) -> candle_func::Result<Tracer> {
    x.broadcast_as((1 << 20, 16))?.exp()?.sum(0)
}

fn is_memory(r: &candle_func::Result<impl std::fmt::Debug>) -> bool {
    matches!(r, Err(Error::Memory { .. }))
}

/// `x -> counted_fwd(x)`, whose VJP and JVP rules pass the cotangent or
/// tangent through `counted_bwd` and a 64 MiB temporary: a small forward
/// pass and a large reverse or tangent pass.
struct Probe {
    fwd: Arc<AtomicUsize>,
    bwd: Arc<AtomicUsize>,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            fwd: Arc::default(),
            bwd: Arc::default(),
        }
    }

    fn f(&self) -> impl Fn(Tracer) -> candle_func::Result<Tracer> + '_ {
        move |x: Tracer| {
            let (fwd, b1, b2) = (self.fwd.clone(), self.bwd.clone(), self.bwd.clone());
            let rules = CustomRules::new()
                .vjp(move |_, _, ct| Ok(vec![big(&counted("bwd", ct, &b1)?)?]))
                .jvp(move |_, t| big(&counted("tan", &t[0], &b2)?));
            custom_op_with_rules(
                "fwd",
                &[&x],
                x.tensor_type().clone(),
                move |xs| {
                    fwd.fetch_add(1, Ordering::SeqCst);
                    Ok(xs[0].clone())
                },
                rules,
            )
        }
    }

    fn runs(&self) -> (usize, usize) {
        (self.fwd.load(Ordering::SeqCst), self.bwd.load(Ordering::SeqCst))
    }
}

fn x() -> Tensor {
    Tensor::ones(16, DType::F32, &Device::Cpu).unwrap()
}

/// Forward fits in 1 MiB, the reverse pass (64 MiB) does not: `vjp` runs
/// the forward, and the pullback refuses before its kernels run; with a
/// limit of one byte `vjp` refuses before the forward runs.
#[test]
fn vjp_and_its_pullback_refuse_a_plan_over_the_limit_before_running() {
    let p = Probe::new();
    let f = jit(p.f()).options(Options::new().memory_limit(1 << 20));
    let (y, pullback) = vjp(&f, x()).unwrap();
    assert_eq!(y.dims(), &[16]);
    assert_eq!(p.runs(), (1, 0));
    let r = pullback.call(&x());
    assert!(is_memory(&r), "{r:?}");
    assert_eq!(p.runs(), (1, 0), "no backward kernel ran");
    // with room, the same pullback runs
    let roomy = jit(p.f()).options(Options::new().memory_limit(1 << 30));
    let (_, pullback) = vjp(&roomy, x()).unwrap();
    let (dx,) = pullback.call(&x()).unwrap();
    assert_eq!(dx.dims(), &[16]);
    assert_eq!(p.runs(), (2, 1));

    let tiny = jit(p.f()).options(Options::new().memory_limit(1));
    assert!(is_memory(&vjp(&tiny, x()).map(|(y, _)| y)));
    assert_eq!(p.runs(), (2, 1), "no forward kernel ran");
}

/// The same for `linearize` and its linear map (the tangent pass is the
/// large one).
#[test]
fn linearize_and_its_map_refuse_a_plan_over_the_limit_before_running() {
    let p = Probe::new();
    let f = jit(p.f()).options(Options::new().memory_limit(1 << 20));
    let (y, lin) = linearize(&f, x()).unwrap();
    assert_eq!(y.dims(), &[16]);
    assert_eq!(p.runs(), (1, 0));
    let r = lin.call(x());
    assert!(is_memory(&r), "{r:?}");
    assert_eq!(p.runs(), (1, 0), "no tangent kernel ran");
    let tiny = jit(p.f()).options(Options::new().memory_limit(1));
    assert!(is_memory(&linearize(&tiny, x()).map(|(y, _)| y)));
    assert_eq!(p.runs(), (1, 0), "no forward kernel ran");
}

/// A plain call, and `Graph::run` of the graph it runs, refuse the same way.
#[test]
fn calls_refuse_a_plan_over_the_limit_before_running() {
    let runs = Arc::new(AtomicUsize::new(0));
    let f = |x: Tracer| big(&counted("first", &x, &runs)?);
    let r = jit(f).options(Options::new().memory_limit(1 << 20)).call(x());
    assert!(is_memory(&r), "{r:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let g = candle_func::make_graph(&jit(f), x()).unwrap();
    assert!(g.planned_peak_bytes() >= 64 << 20, "{}", g.planned_peak_bytes());
    assert_eq!(g.run(&[x()]).unwrap()[0].dims(), &[16]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
