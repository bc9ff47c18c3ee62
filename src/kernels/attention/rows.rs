//! The row operations of the attention kernel: the float types it
//! computes in, a row's maximum, exponentials and dot products.

use crate::kernels::fastmath::{exp, widest, Fused, Madd, Plain};
use crate::kernels::Elem;

/// The float types the kernel computes in.
pub(crate) trait Real: Elem + std::ops::Sub<Output = Self> + std::ops::Div<Output = Self> {
    /// The lowest finite value: what a hidden score becomes.
    const LOWEST: Self;
    /// 1.
    const ONE: Self;
    fn of(v: f64) -> Self;
    /// `row[j] = e^(row[j] - m)` for every `j`; their sum.
    fn exp_shifted(row: &mut [Self], m: Self) -> Self;
}

impl Real for f64 {
    const LOWEST: f64 = f64::MIN;
    const ONE: f64 = 1.0;
    fn of(v: f64) -> f64 {
        v
    }
    fn exp_shifted(row: &mut [f64], m: f64) -> f64 {
        let mut s = 0.0;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            s += *x;
        }
        s
    }
}

/// `row[j] = e^(row[j] - m)` by the vectorised `exp`, and the sum in
/// sixteen partial sums (vectorises where one running sum does not).
#[inline(always)]
fn exp_row<A: Madd>(row: &mut [f32], m: f32, sum: &mut f32) {
    let mut s = [0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for j in 0..16 {
            c[j] = exp::<A>(c[j] - m);
            s[j] += c[j];
        }
    }
    let mut tail = 0.0;
    for x in chunks.into_remainder() {
        *x = exp::<A>(*x - m);
        tail += *x;
    }
    *sum = s.iter().sum::<f32>() + tail;
}

impl Real for f32 {
    const LOWEST: f32 = f32::MIN;
    const ONE: f32 = 1.0;
    fn of(v: f64) -> f32 {
        v as f32
    }
    fn exp_shifted(row: &mut [f32], m: f32) -> f32 {
        let mut sum = 0.0;
        exp_row_widest(row, m, &mut sum);
        sum
    }
}

fn exp_row_widest(row: &mut [f32], m: f32, s: &mut f32) {
    widest!(exp_row(row: &mut [f32], m: f32, s: &mut f32))
}

/// Lanes of the partial maxima and sums below: one running value is a
/// chain of dependent operations that does not vectorise (float addition
/// is not associative, and NaN makes `max` order-dependent).
const LANES: usize = 16;

/// The largest of `x`, NaN skipped (a NaN score reaches every probability
/// of its row through its own `exp` and the sum, as in PyTorch).
#[inline(always)]
pub(super) fn row_max<T: Real>(x: &[T]) -> T {
    let pick = |a: T, v: T| if v > a { v } else { a };
    let mut m = [T::LOWEST; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            m[j] = pick(m[j], c[j]);
        }
    }
    chunks.remainder().iter().chain(&m).fold(T::LOWEST, |a, &v| pick(a, v))
}

/// `sum_j a_j b_j` in [`LANES`] partial sums.
#[inline(always)]
pub(super) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut s = [T::default(); LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..LANES {
            s[j] += x[j] * y[j];
        }
    }
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(T::default(), |t, (&x, &y)| t + x * y);
    s.iter().fold(tail, |t, &v| t + v)
}
