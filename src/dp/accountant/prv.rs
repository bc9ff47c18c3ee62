//! The privacy-loss-random-variable (PRV) accountant of Gopi, Lee and
//! Wutschitz (2021), "Numerical Composition of Differential Privacy",
//! computed the way Opacus 1.6's `PRVAccountant` computes it, so that the ε
//! reported here is Opacus's to well within 1%.
//!
//! The privacy loss of one step of the Poisson-subsampled Gaussian mechanism
//! is a random variable whose CDF has a closed form (the paper's
//! propositions B1 and B4). Composing `n` steps adds `n` independent copies,
//! so the composed distribution is the `n`-fold convolution of one step's.
//! The method:
//!
//! 1. picks a domain `[-L, L]` from RDP bounds on the tails (the paper's
//!    remark 5.6, as Opacus computes it) and a mesh fine enough for the
//!    error budget, `dt = eps_error / sqrt(n ln(12 / delta_error) / 2)`;
//! 2. truncates each step's PRV to the domain and discretises it to the
//!    mesh's bins, then shifts the grid so the discrete mean equals the
//!    continuous one (computed by quadrature);
//! 3. composes by one real FFT raised to the `n`-th power (a circular
//!    convolution, re-centred afterwards) and convolves different steps'
//!    results with each other;
//! 4. reads ε at δ off the composed distribution:
//!    `δ(ε) = Σ_{t ≥ ε} p(t) (1 - e^(ε - t))`, solved for ε on the grid,
//!    and reports the upper end `ε(δ - δ_err) + ε_err` of the error band, as
//!    Opacus does.

use super::fft::{power, Fft};
use crate::error::{Error, Result};
use realfft::num_complex::Complex;
use std::f64::consts::SQRT_2;

/// The error budget: Opacus's defaults are `eps_error = 0.01` and
/// `delta_error = delta / 1000`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Budget {
    pub eps_error: f64,
    pub delta_error: f64,
}

/// The largest grid the accountant will build: 2²⁴ points, about 0.5 GiB
/// of working memory for one run of identical steps and about 2 GiB to
/// convolve different runs (the padded spectra). The digits example needs
/// 250 000. A budget needing more (tens of millions of steps, or a tiny
/// `eps_error`) is refused with an error naming the size.
const MAX_POINTS: usize = 1 << 24;

/// The lower end, estimate and upper end of ε at `delta`; the upper end is
/// what Opacus's `get_epsilon` reports.
pub(super) fn epsilon(history: &[(f64, f64, usize)], delta: f64, budget: Budget) -> Result<[f64; 3]> {
    let live: Vec<(f64, f64, usize)> = history.iter().copied().filter(|&(_, q, n)| q > 0.0 && n > 0).collect();
    if live.is_empty() {
        // Nothing released depends on any one example.
        return Ok([0.0; 3]);
    }
    if live.iter().any(|&(sigma, _, _)| sigma == 0.0) {
        return Ok([f64::INFINITY; 3]);
    }
    let domain = domain(&live, budget)?;
    // One planner for the query: every run's FFTs share its plans.
    let mut fft = Fft::new();
    let mut composed: Option<Discrete> = None;
    for &(sigma, q, n) in &live {
        let one = Discrete::of(Prv { q, sigma }, &domain)?.self_composed(n, &mut fft);
        composed = Some(match composed {
            None => one,
            Some(c) => c.convolved(&one, &mut fft),
        });
    }
    composed.expect("live is not empty").epsilon(delta, budget)
}

/// One step's privacy loss: Poisson sampling at rate `q`, noise multiplier `sigma`.
#[derive(Clone, Copy, Debug)]
struct Prv {
    q: f64,
    sigma: f64,
}

impl Prv {
    /// `P(loss ≤ t)`. The loss is at least `ln(1 - q)` (an example that was
    /// not sampled); above it, with `z = ln((e^t + q - 1) / q)`,
    /// `1 - q/2 erfc((2zσ² - 1) / (2√2σ)) - (1-q)/2 erfc((2zσ² + 1) / (2√2σ))`.
    fn cdf(&self, t: f64) -> f64 {
        let Prv { q, sigma } = *self;
        if t <= (-q).ln_1p() {
            return 0.0;
        }
        let z = ((t.exp() + q - 1.0) / q).ln();
        let s2 = 2.0 * z * sigma * sigma;
        let d = 2.0 * SQRT_2 * sigma;
        1.0 - q * libm::erfc((s2 - 1.0) / d) / 2.0 - (1.0 - q) * libm::erfc((s2 + 1.0) / d) / 2.0
    }
}

/// A symmetric grid `t_min + i dt`, `i < size`, with `t_min = -(size/2 - 1) dt`
/// before any shift; `size` is even. `shift` records how far the grid has
/// been moved right since (the mean corrections).
#[derive(Clone, Copy, Debug)]
struct Domain {
    t_min: f64,
    dt: f64,
    size: usize,
    shift: f64,
}

impl Domain {
    fn t(&self, i: usize) -> f64 {
        self.t_min + i as f64 * self.dt
    }

    fn t_max(&self) -> f64 {
        self.t(self.size - 1)
    }

    fn shifted(self, by: f64) -> Domain {
        Domain {
            t_min: self.t_min + by,
            shift: self.shift + by,
            ..self
        }
    }
}

/// The grid for the whole history: half-width `L` from RDP tail bounds, and
/// the mesh from the error budget and the total number of steps.
fn domain(live: &[(f64, f64, usize)], budget: Budget) -> Result<Domain> {
    let total = super::total_steps(live);
    let l = safe_half_width(live, total, budget);
    let dt = budget.eps_error / (total as f64 * (12.0 / budget.delta_error).ln() / 2.0).sqrt();
    if !l.is_finite() || !dt.is_finite() || dt <= 0.0 {
        return Err(Error::Accounting {
            op: "Accountant::epsilon",
            mechanism: "prv",
            msg: format!("no usable grid for {total} steps (half-width {l}, mesh {dt})"),
        });
    }
    // Aligned to the mesh: -K dt ..= K dt, 2K + 1 points, made even by one
    // more point on the right, as Opacus's `Domain.create_aligned` does.
    let k = (l / dt).ceil();
    let size = 2.0 * k + 2.0;
    if size > MAX_POINTS as f64 {
        return Err(Error::Accounting {
            op: "Accountant::epsilon",
            mechanism: "prv",
            msg: format!(
                "{total} steps at eps_error {} need a grid of {size:e} points \
                 (at most {MAX_POINTS}); raise eps_error",
                budget.eps_error
            ),
        });
    }
    Ok(Domain {
        t_min: -k * dt,
        dt,
        size: size as usize,
        shift: 0.0,
    })
}

/// Where the composed loss's tails carry less than the error budget: the
/// RDP ε of the whole history at `δ_err / 4`, and of each single step at
/// `δ_err / (8 n)`, plus a margin of 3 (the paper's remark 5.6 as its
/// authors' code and Opacus compute it).
fn safe_half_width(live: &[(f64, f64, usize)], total: usize, budget: Budget) -> f64 {
    let mut l = super::rdp::history_epsilon(live, budget.delta_error / 4.0).0;
    for &(sigma, q, _) in live {
        let one = super::rdp::history_epsilon(&[(sigma, q, 1)], budget.delta_error / (8.0 * total as f64)).0;
        l = l.max(one);
    }
    l.max(budget.eps_error) + 3.0
}

/// A discretised loss: `pmf[i]` is the mass at `domain.t(i)`.
struct Discrete {
    pmf: Vec<f64>,
    domain: Domain,
}

impl Discrete {
    /// `prv` truncated to the domain's span and binned: each point gets the
    /// truncated mass within half a mesh of it; then the grid moves so that
    /// the discrete mean equals the truncated distribution's.
    fn of(prv: Prv, domain: &Domain) -> Result<Discrete> {
        let (lo, hi) = (domain.t_min, domain.t_max());
        let (c_lo, c_hi) = (prv.cdf(lo), prv.cdf(hi));
        let mass = c_hi - c_lo;
        let truncated = |t: f64| {
            if t < lo {
                0.0
            } else if t < hi {
                (prv.cdf(t) - c_lo) / mass
            } else {
                1.0
            }
        };
        let half = domain.dt / 2.0;
        let edges: Vec<f64> = (0..=domain.size)
            .map(|i| truncated(domain.t_min - half + i as f64 * domain.dt))
            .collect();
        let pmf: Vec<f64> = edges.windows(2).map(|w| w[1] - w[0]).collect();
        let mean_d: f64 = pmf.iter().enumerate().map(|(i, p)| domain.t(i) * p).sum();
        let mean_c = truncated_mean(&truncated, lo, hi);
        let shift = mean_c - mean_d;
        if !shift.is_finite() || shift.abs() >= half {
            return Err(Error::Accounting {
                op: "Accountant::epsilon",
                mechanism: "prv",
                msg: format!(
                    "the discrete mean ({mean_d:e}) is more than half a mesh \
                     ({half:e}) from the continuous one ({mean_c:e}) for q = {}, sigma = {}",
                    prv.q, prv.sigma
                ),
            });
        }
        Ok(Discrete {
            pmf,
            domain: domain.shifted(shift),
        })
    }

    /// The sum of `n` independent copies, on the same grid: the inverse FFT
    /// of the FFT to the `n`-th power is their circular convolution, whose
    /// index `j` holds the sum whose grid indices add to `j` (mod size).
    /// That sum's value is `n t_min + j dt`; rolling by `m` puts it at
    /// `t_min + (j + m) dt` when `m ≡ (n - 1) t_min / dt (mod size)`,
    /// which with `t_min = -(size/2 - 1) dt` is `n - 1`, plus `size/2` when
    /// `n` is even. Mass beyond the domain wraps around; the domain was
    /// chosen so that it is within the error budget.
    fn self_composed(self, n: usize, fft: &mut Fft) -> Discrete {
        let size = self.pmf.len();
        let mut spectrum = fft.forward(self.pmf);
        for c in &mut spectrum {
            *c = power(*c, n);
        }
        let circular = fft.inverse(&mut spectrum, size);
        let mut m = (n - 1) % size;
        if n.is_multiple_of(2) {
            m = (m + size / 2) % size;
        }
        let mut pmf = vec![0.0; size];
        for (j, p) in circular.into_iter().enumerate() {
            pmf[(j + m) % size] = p;
        }
        let domain = self.domain.shifted(self.domain.shift * (n as f64 - 1.0));
        Discrete { pmf, domain }
    }

    /// The sum of two independent losses on grids of one mesh and size: the
    /// linear convolution, cut to the centred window of the same size (the
    /// full result's index `i + size/2 - 1` is the value `t_min + i dt`).
    fn convolved(&self, other: &Discrete, fft: &mut Fft) -> Discrete {
        let size = self.pmf.len();
        let padded = |p: &[f64]| {
            let mut v = p.to_vec();
            v.resize(2 * size, 0.0);
            v
        };
        let a = fft.forward(padded(&self.pmf));
        let b = fft.forward(padded(&other.pmf));
        let mut prod: Vec<Complex<f64>> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
        let full = fft.inverse(&mut prod, 2 * size);
        let pmf = full[size / 2 - 1..size / 2 - 1 + size].to_vec();
        Discrete {
            pmf,
            domain: self.domain.shifted(other.domain.shift),
        }
    }

    /// `[lower, estimate, upper]` of ε at `delta` (Opacus's
    /// `DiscretePRV.compute_epsilon`).
    fn epsilon(&self, delta: f64, budget: Budget) -> Result<[f64; 3]> {
        let size = self.pmf.len();
        // Each tail sum below carries rounding of about one ulp per point.
        if f64::EPSILON * size as f64 > delta - budget.delta_error {
            return Err(Error::Accounting {
                op: "Accountant::epsilon",
                mechanism: "prv",
                msg: format!(
                    "delta {delta:e} is too small for a grid of {size} points \
                     (rounding would dominate); raise delta or eps_error"
                ),
            });
        }
        // Tail sums from the right: d1[i] = Σ_{j≥i} p_j, d2[i] = Σ_{j≥i} p_j e^{-t_j}.
        let mut d1 = vec![0.0; size];
        let mut d2 = vec![0.0; size];
        let (mut s1, mut s2) = (0.0, 0.0);
        for i in (0..size).rev() {
            s1 += self.pmf[i];
            s2 += self.pmf[i] * (-self.domain.t(i)).exp();
            d1[i] = s1;
            d2[i] = s2;
        }
        // -δ(ε = t_i), increasing in i.
        let neg_delta: Vec<f64> = (0..size).map(|i| self.domain.t(i).exp() * d2[i] - d1[i]).collect();
        let find = |target: f64| -> Result<f64> {
            let i = neg_delta.partition_point(|&x| x < -target);
            if i == 0 || i == size {
                return Err(Error::Accounting {
                    op: "Accountant::epsilon",
                    mechanism: "prv",
                    msg: format!("epsilon at delta {target:e} lies outside the grid"),
                });
            }
            Ok(((d1[i] - target) / d2[i]).ln())
        };
        Ok([
            find(delta + budget.delta_error)? - budget.eps_error,
            find(delta)?,
            find(delta - budget.delta_error)? + budget.eps_error,
        ])
    }
}

/// The mean of a distribution on `[lo, hi]` from its CDF `f`:
/// `∫ t dF = ∫_0^hi (1 - F) - ∫_lo^0 F` (here `lo < 0 < hi`), which keeps
/// the small mean free of the cancellation in `hi - ∫ F`.
fn truncated_mean(f: &dyn Fn(f64) -> f64, lo: f64, hi: f64) -> f64 {
    let upper = integrate(&|t| 1.0 - f(t), 0.0, hi);
    let lower = integrate(f, lo, 0.0);
    upper - lower
}

/// `∫_a^b f` by globally adaptive Gauss–Kronrod (7 and 15 points), as
/// QUADPACK's `qag` does: the panel with the largest error estimate is
/// halved until the estimates sum below 1e-14 (the mean's error is
/// multiplied by the number of steps when the grid moves) or 4000 panels
/// are in use, so rounding noise cannot make it loop.
fn integrate(f: &dyn Fn(f64) -> f64, a: f64, b: f64) -> f64 {
    const TOL: f64 = 1e-14;
    const MAX_PANELS: usize = 4000;
    // Start split where the loss density changes fastest (near 0), on a
    // logarithmic scale, so that no panel starts out too coarse.
    let mut points = vec![a, b];
    for k in -8..=2 {
        for sign in [-1.0, 1.0] {
            let p = sign * 10f64.powi(k);
            if p > a.min(b) && p < a.max(b) {
                points.push(p);
            }
        }
    }
    points.sort_by(f64::total_cmp);
    let panel = |lo: f64, hi: f64| {
        let (k, g) = kronrod(f, lo, hi);
        (lo, hi, k, (k - g).abs())
    };
    let mut panels: Vec<(f64, f64, f64, f64)> = points.windows(2).map(|w| panel(w[0], w[1])).collect();
    while panels.len() < MAX_PANELS && panels.iter().map(|p| p.3).sum::<f64>() > TOL {
        let worst = (0..panels.len())
            .max_by(|&i, &j| panels[i].3.total_cmp(&panels[j].3))
            .expect("at least one panel");
        let (lo, hi, _, _) = panels.swap_remove(worst);
        let mid = 0.5 * (lo + hi);
        panels.push(panel(lo, mid));
        panels.push(panel(mid, hi));
    }
    let sign = if a <= b { 1.0 } else { -1.0 };
    sign * panels.iter().map(|p| p.2).sum::<f64>()
}

/// The 15-point Kronrod and embedded 7-point Gauss estimates of `∫_a^b f`.
fn kronrod(f: &dyn Fn(f64) -> f64, a: f64, b: f64) -> (f64, f64) {
    // Abscissae on [0, 1) (descending; the centre last) and weights, from
    // QUADPACK's qk15; the Gauss points are the odd-indexed abscissae.
    const X: [f64; 8] = [
        0.991_455_371_120_812_6,
        0.949_107_912_342_758_5,
        0.864_864_423_359_769_1,
        0.741_531_185_599_394_4,
        0.586_087_235_467_691_1,
        0.405_845_151_377_397_2,
        0.207_784_955_007_898_5,
        0.0,
    ];
    const WK: [f64; 8] = [
        0.022_935_322_010_529_22,
        0.063_092_092_629_978_55,
        0.104_790_010_322_250_2,
        0.140_653_259_715_525_9,
        0.169_004_726_639_267_9,
        0.190_350_578_064_785_4,
        0.204_432_940_075_298_9,
        0.209_482_141_084_727_8,
    ];
    const WG: [f64; 4] = [
        0.129_484_966_168_869_7,
        0.279_705_391_489_276_7,
        0.381_830_050_505_118_9,
        0.417_959_183_673_469_4,
    ];
    let (c, h) = (0.5 * (a + b), 0.5 * (b - a));
    let (mut k, mut g) = (0.0, 0.0);
    for i in 0..8 {
        let v = if i == 7 {
            f(c)
        } else {
            f(c - h * X[i]) + f(c + h * X[i])
        };
        k += WK[i] * v;
        if i % 2 == 1 {
            g += WG[i / 2] * v;
        }
    }
    (k * h, g * h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kronrod_is_exact_on_polynomials() {
        // K15 integrates degree 22 exactly, G7 degree 13.
        for deg in [0, 1, 4, 13, 22] {
            let f = |x: f64| x.powi(deg);
            let want = (2f64.powi(deg + 1) - (-1f64).powi(deg + 1)) / (deg + 1) as f64;
            let (k, g) = kronrod(&f, -1.0, 2.0);
            assert!(
                (k - want).abs() < 1e-12 * want.abs().max(1.0),
                "deg {deg}: {k} vs {want}"
            );
            if deg <= 13 {
                assert!(
                    (g - want).abs() < 1e-12 * want.abs().max(1.0),
                    "deg {deg}: {g} vs {want}"
                );
            }
        }
        let e = integrate(&|x: f64| (-x * x).exp(), -10.0, 10.0);
        assert!((e - std::f64::consts::PI.sqrt()).abs() < 1e-13, "{e}");
    }

    #[test]
    fn cdf_is_a_distribution() {
        let prv = Prv { q: 0.05, sigma: 1.0 };
        assert_eq!(prv.cdf(-1.0), 0.0);
        assert!(prv.cdf(30.0) > 1.0 - 1e-12);
        let mut prev = 0.0;
        for i in 0..2000 {
            let c = prv.cdf(-0.1 + i as f64 * 0.005);
            assert!(c >= prev - 1e-15 && c <= 1.0, "{c}");
            prev = c;
        }
    }

    #[test]
    fn self_composition_matches_repeated_convolution() {
        // The FFT power and the roll agree with explicit convolutions.
        let budget = Budget {
            eps_error: 0.05,
            delta_error: 1e-8,
        };
        let live = [(1.0, 0.2, 3)];
        let d = domain(&live, budget).unwrap();
        for n in [2, 3] {
            let fft = &mut Fft::new();
            let by_power = Discrete::of(Prv { q: 0.2, sigma: 1.0 }, &d)
                .unwrap()
                .self_composed(n, fft);
            let one = Discrete::of(Prv { q: 0.2, sigma: 1.0 }, &d).unwrap();
            let mut by_conv = Discrete::of(Prv { q: 0.2, sigma: 1.0 }, &d).unwrap();
            for _ in 1..n {
                by_conv = by_conv.convolved(&one, fft);
            }
            let worst = by_power
                .pmf
                .iter()
                .zip(&by_conv.pmf)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "n = {n}: {worst}");
            assert!((by_power.domain.t_min - by_conv.domain.t_min).abs() < 1e-12);
        }
    }
}
