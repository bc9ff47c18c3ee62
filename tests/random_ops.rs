//! Random programs (sequences of operations with random, often bad,
//! parameters) on random shapes and dtypes, through `jit`, `vmap`, `grad`,
//! forward mode (`jvp`) and `vjp` with its pullback: each call gives a
//! result or an `Error` that is not `Error::Internal` (which means a bug
//! here), never a panic. `tests/random_dp.rs` does the same for DP
//! settings.
//!
//! CI runs the same 96 cases every time; `CANDLE_FUNC_FUZZ_CASES=20000
//! cargo test --release --test random_ops -- --nocapture` runs fresh ones
//! and prints the tally of results and errors by variant.

use candle_core::{DType, Device, Tensor};
use candle_func::{grad, jit, jvp, vjp, vmap, Error, Tracer};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One operation with its (random) parameters; axes may be out of range
/// and shapes may not fit, on purpose.
#[derive(Clone, Debug)]
enum Op {
    Unary(u8),
    Binary(u8),
    Reduce {
        kind: u8,
        axis: i8,
    },
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    Unsqueeze(u8),
    Squeeze(i8),
    Narrow {
        axis: i8,
        start: usize,
        len: usize,
    },
    Cast(u8),
    Matmul,
    Concat(i8),
    IndexSelect {
        axis: i8,
        index: Vec<u32>,
    },
    Pool {
        max: bool,
        k: usize,
    },
    Conv {
        k: usize,
        pad: usize,
        dil: usize,
    },
    Clip,
    /// sin, cos, silu, gelu (both), erf, softplus, log1p, elu, leaky relu,
    /// powf, clamp: the transformer and sequence models' maps
    Seq(u8),
    Tril(i8),
    Cumsum(i8),
    /// `y` as a `[vocab, dim]` table (or an error if it is not) and ids
    /// of shape `[2, n]`, some perhaps out of range
    Embedding(Vec<u32>),
    Gather {
        axis: i8,
        index: Vec<u32>,
    },
    /// `y` where `y > 0`, else `-y` (where_cond), or filled (masked_fill)
    Select(bool),
    Var(i8),
    Stack(u8),
    ConvT {
        k: usize,
        stride: usize,
        pad: usize,
    },
    Argmax(i8),
}

const DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::U8, DType::U32, DType::I64];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..12).prop_map(Op::Unary),
        (0u8..6).prop_map(Op::Binary),
        (0u8..4, -5i8..5).prop_map(|(kind, axis)| Op::Reduce { kind, axis }),
        prop::collection::vec(0usize..7, 0..4).prop_map(Op::Reshape),
        prop::collection::vec(0usize..5, 0..5).prop_map(Op::Permute),
        (0u8..6).prop_map(Op::Unsqueeze),
        (-5i8..5).prop_map(Op::Squeeze),
        (-4i8..4, 0usize..4, 0usize..4).prop_map(|(axis, start, len)| Op::Narrow { axis, start, len }),
        (0u8..5).prop_map(Op::Cast),
        Just(Op::Matmul),
        (-4i8..4).prop_map(Op::Concat),
        (-3i8..3, prop::collection::vec(0u32..6, 0..4)).prop_map(|(axis, index)| Op::IndexSelect { axis, index }),
        (any::<bool>(), 0usize..4).prop_map(|(max, k)| Op::Pool { max, k }),
        (1usize..4, 0usize..3, 1usize..3).prop_map(|(k, pad, dil)| Op::Conv { k, pad, dil }),
        Just(Op::Clip),
        (0u8..12).prop_map(Op::Seq),
        (-3i8..3).prop_map(Op::Tril),
        (-4i8..4).prop_map(Op::Cumsum),
        (-3i8..3, prop::collection::vec(0u32..6, 0..6)).prop_map(|(axis, index)| Op::Gather { axis, index }),
        prop::collection::vec(0u32..6, 0..3).prop_map(|mut ids| {
            ids.extend(ids.clone()); // [2, n]
            Op::Embedding(ids)
        }),
        any::<bool>().prop_map(Op::Select),
        (-4i8..4).prop_map(Op::Var),
        (0u8..5).prop_map(Op::Stack),
        (1usize..4, 1usize..3, 0usize..3).prop_map(|(k, stride, pad)| Op::ConvT { k, stride, pad }),
        (-4i8..4).prop_map(Op::Argmax),
    ]
}

/// One of the sequence models' elementwise maps.
fn seq(y: &Tracer, i: u8) -> candle_func::Result<Tracer> {
    match i {
        0 => y.sin(),
        1 => y.cos(),
        2 => y.silu(),
        3 => y.gelu(),
        4 => y.gelu_tanh(),
        5 => y.erf(),
        6 => y.softplus(),
        7 => y.log1p(),
        8 => y.elu(1.0),
        9 => y.leaky_relu(0.1),
        10 => y.powf(2.5),
        _ => y.clamp(-1.0, 2.0),
    }
}

/// A `u32` tensor of `index`, shaped as `y` with `axis` of the index's
/// length (gather's index; the shape may not fit, on purpose).
fn gather_index(y: &Tracer, axis: i8, index: &[u32]) -> candle_func::Result<Tensor> {
    let mut shape = y.dims().to_vec();
    if let Some(d) = usize::try_from(axis).ok().and_then(|a| shape.get_mut(a)) {
        *d = index.len();
    }
    let n: usize = shape.iter().product();
    let v: Vec<u32> = (0..n)
        .map(|i| index.get(i % index.len().max(1)).copied().unwrap_or(0))
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

fn apply(x: Tracer, ops: &[Op]) -> candle_func::Result<Tracer> {
    let mut y = x;
    for op in ops {
        y = match op {
            Op::Unary(i) => match i {
                0 => y.neg()?,
                1 => y.exp()?,
                2 => y.log()?,
                3 => y.sqrt()?,
                4 => y.sqr()?,
                5 => y.abs()?,
                6 => y.relu()?,
                7 => y.tanh()?,
                8 => y.sigmoid()?,
                9 => y.recip()?,
                10 => y.softmax(-1)?,
                _ => y.log_softmax(0)?,
            },
            Op::Binary(i) => match i {
                0 => y.add(&y)?,
                1 => y.sub(&y)?,
                2 => y.mul(&y)?,
                3 => y.div(&y)?,
                4 => y.maximum(&y.neg()?)?,
                _ => y.minimum(&y)?,
            },
            Op::Reduce { kind, axis } => {
                let a = *axis as isize;
                match kind {
                    0 => y.sum(a)?,
                    1 => y.max(a)?,
                    2 => y.mean(a)?,
                    _ => y.sum_all()?,
                }
            }
            Op::Reshape(s) => y.reshape(s.clone())?,
            Op::Permute(p) => y.permute(p)?,
            Op::Unsqueeze(a) => y.unsqueeze(*a as usize)?,
            Op::Squeeze(a) => y.squeeze(*a as isize)?,
            Op::Narrow { axis, start, len } => y.narrow(*axis as isize, *start, *len)?,
            Op::Cast(i) => y.to_dtype(DTYPES[*i as usize])?,
            Op::Matmul => y.matmul(&y.t()?)?,
            Op::Concat(a) => Tracer::cat(&[&y, &y], *a as isize)?,
            Op::IndexSelect { axis, index } => {
                let idx = Tensor::new(index.as_slice(), &Device::Cpu).map_err(Error::from)?;
                y.index_select(&idx, *axis as isize)?
            }
            Op::Pool { max: true, k } => y.max_pool2d(*k)?,
            Op::Pool { max: false, k } => y.avg_pool2d(*k)?,
            Op::Conv { k, pad, dil } => {
                let c = y.dims().get(1).copied().unwrap_or(1);
                let w = Tensor::ones((2, c, *k, *k), y.dtype(), &Device::Cpu).map_err(Error::from)?;
                y.conv2d(&w, *pad, 1, *dil, 1)?
            }
            Op::Clip => y.affine(0.5, 0.25)?,
            Op::Seq(i) => seq(&y, *i)?,
            Op::Tril(k) => y.tril(*k as i64)?,
            Op::Cumsum(a) => y.cumsum(*a as isize)?,
            Op::Embedding(ids) => {
                let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
                    .and_then(|t| t.reshape((2, ids.len() / 2)))
                    .map_err(Error::from)?;
                y.embedding(&ids)?
            }
            Op::Gather { axis, index } => y.gather(&gather_index(&y, *axis, index)?, *axis as isize)?,
            Op::Select(true) => y.gt(0.0)?.where_cond(&y, &y.neg()?)?,
            Op::Select(false) => y.masked_fill(&y.lt(0.0)?, f64::NEG_INFINITY)?,
            Op::Var(a) => y.var_keepdim(*a as isize)?,
            Op::Stack(a) => Tracer::stack(&[&y, &y], *a as usize)?,
            Op::ConvT { k, stride, pad } => {
                let c = y.dims().get(1).copied().unwrap_or(1);
                let w = Tensor::ones((c, 2, *k, *k), y.dtype(), &Device::Cpu).map_err(Error::from)?;
                y.conv_transpose2d(&w, *pad, 0, *stride, 1, 1)?
            }
            Op::Argmax(a) => y.argmax(*a as isize)?,
        };
    }
    Ok(y)
}

fn input() -> impl Strategy<Value = (usize, Vec<usize>, u64)> {
    // empty axes now and then, mostly sizes the kernels compute with
    let dim = prop_oneof![1 => Just(0usize), 6 => 1usize..6];
    (0usize..5, prop::collection::vec(dim, 0..5), any::<u64>())
}

fn make(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    // small values, a few of them NaN or zero for the float dtypes
    let v: Vec<f64> = (0..n as u64)
        .map(|i| {
            let h = seed.wrapping_add(i).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            match h % 17 {
                0 => f64::NAN,
                1 => 0.0,
                r => r as f64 - 8.0,
            }
        })
        .collect();
    let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
    match dtype {
        DType::F32 | DType::F64 => t.to_dtype(dtype).unwrap(),
        // integer dtypes: non-negative values (NaN casts to 0)
        _ => t.abs().unwrap().to_dtype(dtype).unwrap(),
    }
}

/// One transform's call on the case.
type Run<'a> = Box<dyn Fn() -> candle_func::Result<Tensor> + 'a>;

/// The error variant's name, for the tally.
fn variant(e: &Error) -> String {
    let d = format!("{e:?}");
    d.split([' ', '{', '(']).next().unwrap_or("?").to_string()
}

#[test]
fn random_programs_give_a_result_or_an_error() {
    let asked: Option<u32> = std::env::var("CANDLE_FUNC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    let cases = asked.unwrap_or(96);
    let tally: RefCell<BTreeMap<String, usize>> = RefCell::new(BTreeMap::new());
    let count = |k: String| *tally.borrow_mut().entry(k).or_default() += 1;
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    // CI's modest run is the same every time; a run that asks for a case
    // count draws fresh programs
    let mut runner = match asked {
        Some(_) => TestRunner::new(config),
        None => TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha)),
    };
    // panics inside the calls are caught and reported as failures; keep
    // their default messages off the output
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = runner.run(
        &(input(), prop::collection::vec(op(), 1..6)),
        |((dt, shape, seed), ops)| {
            let x = make(DTYPES[dt], &shape, seed);
            let runs: [(&str, Run); 5] = [
                ("jit", Box::new(|| jit(|x: Tracer| apply(x, &ops)).call(&x))),
                ("vmap", Box::new(|| vmap(|x: Tracer| apply(x, &ops)).call(&x))),
                (
                    "grad",
                    Box::new(|| grad(|x: Tracer| apply(x, &ops)?.to_dtype(DType::F32)?.sum_all()).call(&x)),
                ),
                // forward mode, along the input itself
                ("jvp", Box::new(|| Ok(jvp(&|x: Tracer| apply(x, &ops), &x, &x)?.1))),
                // reverse mode with a pullback called on ones
                (
                    "vjp",
                    Box::new(|| {
                        let (y, pullback) = vjp(&|x: Tracer| apply(x, &ops), &x)?;
                        Ok(pullback.call(&y.ones_like()?)?.0)
                    }),
                ),
            ];
            for (name, run) in runs {
                match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(Ok(_)) => count(format!("{name}: result")),
                    Ok(Err(e @ Error::Internal { .. })) => {
                        count("internal errors".into());
                        return Err(TestCaseError::fail(format!(
                            "{name} hit a bug on {:?} {shape:?} with {ops:?}: {e}",
                            DTYPES[dt]
                        )));
                    }
                    Ok(Err(e)) => count(format!("{name}: Error::{}", variant(&e))),
                    Err(_) => {
                        count("panics".into());
                        return Err(TestCaseError::fail(format!(
                            "{name} panicked on {:?} {shape:?} with {ops:?}",
                            DTYPES[dt]
                        )));
                    }
                }
            }
            Ok(())
        },
    );
    std::panic::set_hook(hook);
    println!("{cases} cases: {:#?}", tally.borrow());
    result.unwrap();
}
