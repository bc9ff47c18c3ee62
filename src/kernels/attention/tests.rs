//! The attention kernels against candle's operations, forward and backward.

use super::*;
use candle_core::Device;

fn rand(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    use rand::{Rng as _, SeedableRng};
    let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.sample(rand_distr::StandardNormal)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

fn diff(a: &Tensor, b: &Tensor) -> f64 {
    super::super::max_diff(&a.to_dtype(DType::F64).unwrap(), &b.to_dtype(DType::F64).unwrap()).unwrap()
}

/// The kernel against candle's operations: forward and backward, f32
/// and f64 (and bf16, widened to f32 around the f32 kernel, against
/// candle's operations in f32 rounded once: within bf16's rounding),
/// causal or not, with padding (one sequence all padding, so its
/// queries average every key), at lengths below, at and past a block,
/// and with the causal blocks' shortcut exercised.
#[test]
fn the_kernel_equals_candles_operations() {
    for dt in [DType::F64, DType::F32, DType::BF16] {
        let (tol, btol) = match dt {
            DType::F64 => (1e-12, 1e-11),
            DType::F32 => (2e-5, 2e-4),
            _ => (2e-2, 4e-2),
        };
        for (n, h, t, d) in [(2, 3, 5, 4), (1, 2, 64, 8), (2, 2, 150, 16)] {
            let (q, k, v, dout) = (
                rand(&[n, h, t, d], 1, dt),
                rand(&[n, h, t, d], 2, dt),
                rand(&[n, h, t, d], 3, dt),
                rand(&[n, h, t, d], 4, dt),
            );
            let mut keep = vec![1f32; n * t];
            // sequence 0 padded past its half
            keep[t / 2..t].iter_mut().for_each(|x| *x = 0.0);
            if n > 1 {
                for j in 0..t {
                    keep[t + j] = if j < 3 { 0.0 } else { 1.0 }; // left padding
                }
            }
            let keep = Tensor::from_vec(keep, (n, t), &Device::Cpu).unwrap();
            for causal in [false, true] {
                for mask in [None, Some(&keep)] {
                    let what = format!("{dt:?} {n} {h} {t} {d} causal {causal} mask {}", mask.is_some());
                    let fast = forward(&q, &k, &v, mask, causal, 0.3, Path::Fast).unwrap();
                    let slow = forward(&q, &k, &v, mask, causal, 0.3, Path::Portable).unwrap();
                    assert_eq!(fast.dtype(), dt);
                    assert!(diff(&fast, &slow) < tol, "forward {what}: {}", diff(&fast, &slow));
                    let args = [&q, &k, &v, &dout];
                    let gf = backward(args, mask, causal, 0.3, Path::Fast).unwrap();
                    let gs = backward(args, mask, causal, 0.3, Path::Portable).unwrap();
                    assert!(diff(&gf, &gs) < btol, "backward {what}: {}", diff(&gf, &gs));
                }
            }
        }
    }
}

/// NaN in a query reaches its row, and only its row.
#[test]
fn nan_reaches_its_row() {
    let q = rand(&[1, 1, 4, 2], 1, DType::F32);
    let mut v = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[2] = f32::NAN; // row 1
    let q = Tensor::from_vec(v, (1, 1, 4, 2), &Device::Cpu).unwrap();
    let k = rand(&[1, 1, 4, 2], 2, DType::F32);
    let o = forward(&q, &k, &k, None, false, 1.0, Path::Fast).unwrap();
    let rows = o.squeeze(0).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap();
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.iter().all(|x| x.is_nan()), i == 1, "row {i}: {r:?}");
    }
}
