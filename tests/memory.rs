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

/// One example's work: `x` ([16]) spread over a `[4096, 16]` temporary
/// (256 KiB), summed back. A batch of 64 holds 16 MiB of temporaries.
fn spread(x: Tracer) -> candle_func::Result<Tracer> {
    x.broadcast_as((4096, 16))?.exp()?.sum(0)
}

fn batch() -> Tensor {
    Tensor::randn(0f32, 1., (64, 16), &Device::Cpu).unwrap()
}

/// Over the limit as a whole batch, a vmap with no chunk size runs in the
/// largest chunks that fit, with the numbers of the whole batch; strict
/// mode keeps the error, which suggests chunks; and the chunk size it
/// suggests works when set by hand.
#[test]
fn a_vmap_over_the_limit_chunks_itself_to_fit() {
    use candle_func::Schedule;
    let xs = batch();
    let want = candle_func::vmap(spread).call(&xs).unwrap();
    let limit = 4 << 20;
    let f = candle_func::vmap(spread)
        .schedule(Schedule::Batched)
        .memory_limit(limit);
    let got = f.call(&xs).unwrap();
    assert_eq!(got.dims(), &[64, 16]);
    let d = (&got - &want).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    let g = candle_func::make_graph(&f, &xs).unwrap();
    assert!(g.planned_peak_bytes() <= limit, "{}", g.planned_peak_bytes());
    assert!(
        g.nodes().filter(|n| n.name().starts_with("exp")).count() > 1,
        "chunks: {g}"
    );

    let strict = candle_func::vmap(spread)
        .schedule(Schedule::Batched)
        .memory_limit(limit)
        .strict(true);
    let e = strict.call(&xs).unwrap_err();
    assert!(matches!(e, Error::Memory { op: "call", .. }), "{e}");
    assert!(e.to_string().contains("chunk_size"), "{e}");
    let by_hand = strict.chunk_size(4).call(&xs).unwrap();
    let d = (&by_hand - &want).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
}

/// Where the arguments and results alone exceed the limit, no chunking
/// can help, and the error says so instead of suggesting it.
#[test]
fn the_memory_error_suggests_what_can_work() {
    let xs = batch();
    let e = candle_func::vmap(spread).memory_limit(1024).call(&xs).unwrap_err();
    match &e {
        Error::Memory { floor, limit, .. } => assert!(floor > limit, "{e}"),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("no schedule fits"), "{e}");
    assert!(!e.to_string().contains("chunk_size"), "{e}");
}

/// `Schedule::Auto` on a large program measures no candidate whose plan
/// exceeds the limit: over the limit as a whole batch, it measures the
/// per-example schedule alone; with a limit nothing fits, the call is
/// refused without a measurement.
#[test]
fn auto_measures_nothing_over_the_limit() {
    use candle_func::planner::schedule_choices;
    use candle_func::Schedule;
    // 256 examples of a [1024, 64] temporary: 64 MiB batched
    let big = |x: Tracer| x.broadcast_as((1024, 64))?.exp()?.sum(0);
    let xs = Tensor::randn(0f32, 1., (256, 64), &Device::Cpu).unwrap();
    // this test's decisions (others run beside it)
    let decided = |before: usize| {
        let all = schedule_choices();
        all[before.min(all.len())..]
            .iter()
            .filter(|c| c.size == 256)
            .cloned()
            .collect::<Vec<_>>()
    };
    let before = schedule_choices().len();
    let got = candle_func::vmap(big).memory_limit(4 << 20).call(&xs).unwrap();
    assert_eq!(got.dims(), &[256, 64]);
    let mine = decided(before);
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert!(
        mine[0].timings_ms.iter().all(|(s, _)| *s != Schedule::Batched),
        "{mine:?}"
    );
    assert!(!mine[0].timings_ms.is_empty(), "{mine:?}");
    let before = schedule_choices().len();
    let e = candle_func::vmap(big).memory_limit(1).call(&xs).unwrap_err();
    assert!(matches!(e, Error::Memory { .. }), "{e}");
    assert!(
        decided(before).iter().all(|c| c.timings_ms.is_empty()),
        "{:?}",
        decided(before)
    );
}
