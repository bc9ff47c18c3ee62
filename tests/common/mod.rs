//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_func::{jit, vmap, Function, Result, Tracer};

/// A unary test function.
pub type Un = fn(Tracer) -> Result<Tracer>;
/// A binary test function.
pub type Bin = fn(Tracer, Tracer) -> Result<Tracer>;

/// `f(x) = sum(tanh(x) x) + (sum x)^2 / n`: the scalar function the
/// composition tests differentiate every way (smooth, with a full Hessian).
pub fn tanh_dot_square(x: Tracer) -> Result<Tracer> {
    let n = x.elem_count() as f64;
    x.tanh()?
        .mul(&x)?
        .sum_all()?
        .add(&x.sum_all()?.sqr()?.affine(1.0 / n, 0.0)?)
}

/// Unary maps defined on all reals (log and recip moved away from zero),
/// shared by the loop-oracle and finite-difference tests.
pub fn unary_maps() -> Vec<(&'static str, Un)> {
    vec![
        ("neg", |x| x.neg()),
        ("exp", |x| x.exp()),
        ("log", |x| x.abs()?.affine(1.0, 0.5)?.log()),
        ("sqr", |x| x.sqr()),
        ("recip", |x| x.abs()?.affine(1.0, 0.5)?.recip()),
        ("abs", |x| x.abs()),
        ("relu", |x| x.relu()),
        ("tanh", |x| x.tanh()),
        ("erf", |x| x.erf()),
        ("gelu", |x| x.gelu()),
        ("sigmoid", |x| x.sigmoid()),
        ("affine", |x| x.affine(2.0, -1.0)),
        ("softmax", |x| x.softmax(-1)),
        ("log_softmax", |x| x.log_softmax(0)),
        ("sin", |x| x.affine(3.0, 0.0)?.sin()),
        ("cos", |x| x.affine(3.0, 0.0)?.cos()),
        ("silu", |x| x.affine(3.0, 0.0)?.silu()),
        ("gelu_tanh", |x| x.affine(3.0, 0.0)?.gelu_tanh()),
        ("leaky_relu", |x| x.leaky_relu(0.1)),
        ("elu", |x| x.affine(3.0, 0.0)?.elu(1.5)),
        ("softplus", |x| x.affine(3.0, 0.0)?.softplus()),
        ("clamp", |x| x.clamp(-0.5, 0.5)),
        ("cumsum", |x| x.cumsum(-1)),
        ("log1p", |x| x.affine(0.9, 0.0)?.log1p()),
    ]
}

/// Broadcasting arithmetic (the divisor moved away from zero).
pub fn arithmetic_ops() -> Vec<(&'static str, Bin)> {
    vec![
        ("add", |a, b| a.add(&b)),
        ("sub", |a, b| a.sub(&b)),
        ("mul", |a, b| a.mul(&b)),
        ("div", |a, b| a.div(&b.abs()?.affine(1.0, 0.5)?)),
        ("maximum", |a, b| a.maximum(&b)),
        ("minimum", |a, b| a.minimum(&b)),
    ]
}

/// A deterministic pseudo-random f32 tensor with values in [-1, 1).
pub fn rand(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Integer indices in `0..bound`, deterministic.
pub fn rand_idx(shape: &[usize], bound: usize, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed ^ 0x9e3779b97f4a7c15;
    let v: Vec<u32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % bound as u64) as u32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Every entry of `t`, flattened, as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `max |t|` in f64 (0 for an empty tensor).
pub fn max_abs(t: &Tensor) -> f64 {
    max_diff(t, &t.zeros_like().unwrap())
}

/// Largest absolute difference, after casting both to f64; panics on a
/// shape mismatch.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    if a.elem_count() == 0 {
        return 0.0;
    }
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Asserts `a` and `b` agree to `tol` absolute or relative to b's magnitude.
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    let d = max_diff(a, b);
    let scale = b
        .to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .map(|t| t.to_scalar::<f64>().unwrap())
        .unwrap_or(0.0)
        .max(1.0);
    assert!(
        d <= tol * scale,
        "{what}: max difference {d} exceeds {tol} (scale {scale})"
    );
}

/// Asserts the scalars `got` and `want` agree to `tol` relative to the
/// larger magnitude (or absolute below 1).
pub fn close_to(what: &str, got: f64, want: f64, tol: f64) {
    let tol = tol * want.abs().max(got.abs()).max(1.0);
    assert!((got - want).abs() <= tol, "{what}: {got} vs {want}");
}

/// A batched argument: per-example `shape` with a batch of `b` inserted at
/// `dim` (`None`: an unbatched argument of the per-example shape).
pub fn batched(shape: &[usize], b: usize, dim: Option<isize>, seed: u64) -> Tensor {
    match dim {
        None => rand(shape, seed),
        Some(d) => {
            let mut s = shape.to_vec();
            let at = if d < 0 {
                (s.len() as isize + 1 + d) as usize
            } else {
                d as usize
            };
            s.insert(at, b);
            rand(&s, seed)
        }
    }
}

/// Example `i` of an argument batched at `dim`.
pub fn example(t: &Tensor, dim: Option<isize>, i: usize) -> Tensor {
    match dim {
        None => t.clone(),
        Some(d) => {
            let at = if d < 0 {
                (t.rank() as isize + d) as usize
            } else {
                d as usize
            };
            t.narrow(at, i, 1).unwrap().squeeze(at).unwrap()
        }
    }
}

/// The loop oracle for a one-argument function: `vmap(f)(x)` against
/// stacking `f` on each example.
pub fn oracle1<F>(f: F, x: &Tensor, dim: Option<isize>, b: usize, tol: f64)
where
    F: Fn(Tracer) -> Result<Tracer> + Send + Sync + Clone,
{
    let got = vmap(f.clone()).in_dims([dim]).call(x).unwrap();
    let one = jit(f);
    let parts: Vec<Tensor> = (0..b).map(|i| one.call(example(x, dim, i)).unwrap()).collect();
    assert_close(&got, &Tensor::stack(&parts, 0).unwrap(), tol, "vmap vs loop");
}

/// The loop oracle for two arguments.
pub fn oracle2<F>(f: F, xs: (&Tensor, &Tensor), dims: [Option<isize>; 2], b: usize, tol: f64)
where
    F: Fn(Tracer, Tracer) -> Result<Tracer> + Send + Sync + Clone,
{
    let got = vmap(f.clone()).in_dims(dims).call(xs).unwrap();
    let one = jit(f);
    let parts: Vec<Tensor> = (0..b)
        .map(|i| {
            one.call((example(xs.0, dims[0], i), example(xs.1, dims[1], i)))
                .unwrap()
        })
        .collect();
    assert_close(&got, &Tensor::stack(&parts, 0).unwrap(), tol, "vmap vs loop");
}

/// The loop oracle for three arguments.
pub fn oracle3<F>(f: F, xs: (&Tensor, &Tensor, &Tensor), dims: [Option<isize>; 3], b: usize, tol: f64)
where
    F: Fn(Tracer, Tracer, Tracer) -> Result<Tracer> + Send + Sync + Clone,
{
    let got = vmap(f.clone()).in_dims(dims).call(xs).unwrap();
    let one = jit(f);
    let parts: Vec<Tensor> = (0..b)
        .map(|i| {
            one.call((
                example(xs.0, dims[0], i),
                example(xs.1, dims[1], i),
                example(xs.2, dims[2], i),
            ))
            .unwrap()
        })
        .collect();
    assert_close(&got, &Tensor::stack(&parts, 0).unwrap(), tol, "vmap vs loop");
}

/// Keeps a function usable where a `Function` bound is needed in helpers.
pub fn is_function<S: candle_func::tree::ArgList, F: Function<S>>(_f: &F) {}
pub mod arch;

/// A 3D convolution (PyTorch semantics, no bias) from candle's own ops:
/// the depth axis zero-padded, then each output depth plane the sum over
/// the kernel's depth taps of candle's conv2d. The reference for conv3d
/// (candle has none), differentiable by candle's autodiff.
pub fn conv3d_direct(
    x: &Tensor,
    w: &Tensor,
    stride: usize,
    pad: usize,
    dil: usize,
    groups: usize,
) -> candle_core::Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (d, kd) = (x.dims()[2], w.dims()[2]);
    let x = x.pad_with_zeros(2, pad, pad)?;
    let od = (d + 2 * pad - dil * (kd - 1) - 1) / stride + 1;
    let mut planes = Vec::with_capacity(od);
    for o in 0..od {
        let mut acc: Option<Tensor> = None;
        for t in 0..kd {
            let xs = x.narrow(2, o * stride + t * dil, 1)?.squeeze(2)?.contiguous()?;
            let wt = w.narrow(2, t, 1)?.squeeze(2)?.contiguous()?;
            let y = xs.conv2d(&wt, pad, stride, dil, groups)?;
            acc = Some(match acc {
                None => y,
                Some(a) => (a + y)?,
            });
        }
        planes.push(acc.expect("a kernel has at least one tap"));
    }
    Tensor::stack(&planes, 2)
}

/// `shape` filled with values in [-2, 2) hashed from `seed` and the index:
/// the same on every platform and process (the DP tests' data and weights).
pub fn hashed_values(seed: u64, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((h >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// A `VarMap` holding `vars` (name, shape), the `i`-th filled with
/// [`hashed_values`]`(seed + i, shape)`.
pub fn varmap_of(vars: &[(&str, &[usize])], seed: u64) -> candle_nn::VarMap {
    let vm = candle_nn::VarMap::new();
    let mut data = vm.data().lock().unwrap();
    for (i, (name, shape)) in vars.iter().enumerate() {
        let t = hashed_values(seed + i as u64, shape);
        data.insert(name.to_string(), candle_core::Var::from_tensor(&t).unwrap());
    }
    drop(data);
    vm
}

/// A `VarMap` holding one f32 vector of zeros, `name` `[n]`.
pub fn zeros_varmap(name: &str, n: usize) -> candle_nn::VarMap {
    let vm = candle_nn::VarMap::new();
    let w = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
    vm.data()
        .lock()
        .unwrap()
        .insert(name.into(), candle_core::Var::from_tensor(&w).unwrap());
    vm
}

/// A two-layer net's variables, `l` (4 -> 3, tanh) and `m` (3 -> 2), in a
/// fresh `VarMap`, for [`two_layer_loss`].
pub fn two_layer_model() -> candle_nn::VarMap {
    varmap_of(&[("l.weight", &[3, 4]), ("l.bias", &[3]), ("m.weight", &[2, 3])], 10)
}

/// One example's loss: squared error of the two-layer net.
pub fn two_layer_loss(p: std::collections::BTreeMap<String, Tracer>, x: Tracer, y: Tracer) -> Result<Tracer> {
    let h = x.unsqueeze(0)?.broadcast_matmul(&p["l.weight"].t()?)?;
    let h = h.broadcast_add(&p["l.bias"])?.tanh()?;
    let out = h.broadcast_matmul(&p["m.weight"].t()?)?;
    out.sub(&y.unsqueeze(0)?)?.sqr()?.sum_all()
}

/// An in-process [`dp::collective::Collective`] of one rank (every
/// collective is the identity), which can claim another rank's parameter
/// hash differs, or a rank outside its size.
pub struct OneRank {
    pub lie: bool,
    pub rank: usize,
}

impl candle_func::dp::collective::Collective for OneRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        1 + self.lie as usize
    }
    fn broadcast_u64(&self, _: &mut Vec<u64>) -> candle_func::Result<()> {
        Ok(())
    }
    fn broadcast_f64(&self, _: &mut [f64]) -> candle_func::Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f32(&self, _: &mut [f32]) -> candle_func::Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> candle_func::Result<()> {
        Ok(())
    }
    fn all_gather_u64(&self, v: u64) -> candle_func::Result<Vec<u64>> {
        Ok(if self.lie { vec![v, v ^ 1] } else { vec![v] })
    }
}
