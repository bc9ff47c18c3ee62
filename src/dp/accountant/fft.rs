//! Real FFTs for the accountants that compose privacy-loss distributions
//! numerically (PRV and PLD): a planner that keeps its plans, and powers of
//! complex numbers for `n`-fold self-convolution.

use realfft::num_complex::Complex;
use realfft::RealFftPlanner;

/// `c^n` by repeated squaring.
pub(super) fn power(mut c: Complex<f64>, mut n: usize) -> Complex<f64> {
    let mut acc = Complex::new(1.0, 0.0);
    while n > 0 {
        if n & 1 == 1 {
            acc *= c;
        }
        c *= c;
        n >>= 1;
    }
    acc
}

/// Real FFTs of any length, each length planned once (realfft's planner
/// caches its plans).
pub(super) struct Fft(RealFftPlanner<f64>);

impl Fft {
    pub(super) fn new() -> Fft {
        Fft(RealFftPlanner::new())
    }

    /// The spectrum of `x` (`len / 2 + 1` bins); `x` is the plan's scratch.
    pub(super) fn forward(&mut self, mut x: Vec<f64>) -> Vec<Complex<f64>> {
        let fft = self.0.plan_fft_forward(x.len());
        let mut out = fft.make_output_vec();
        fft.process(&mut x, &mut out).expect("buffers come from the plan");
        out
    }

    /// The inverse of [`Fft::forward`], normalised (realfft leaves the
    /// factor `1/len` to us).
    pub(super) fn inverse(&mut self, spectrum: &mut [Complex<f64>], len: usize) -> Vec<f64> {
        let fft = self.0.plan_fft_inverse(len);
        // The DC and (even length) Nyquist bins of a real signal's spectrum
        // are real; rounding in the power can leave a tiny imaginary part
        // there, which realfft refuses.
        spectrum[0].im = 0.0;
        if len.is_multiple_of(2) {
            spectrum[len / 2].im = 0.0;
        }
        let mut out = fft.make_output_vec();
        fft.process(spectrum, &mut out).expect("buffers come from the plan");
        let scale = 1.0 / len as f64;
        out.iter_mut().for_each(|v| *v *= scale);
        out
    }
}
