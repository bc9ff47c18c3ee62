//! The plane-independent geometry of the CPU kernels: the convolution
//! geometry lifted to three spatial dims ([`Plan3`]) and the per-call
//! walk over one `(n, c)` plane that the loops in `cpu` follow ([`Lines`]).

use crate::ir::ConvGeom;
use crate::kernels::Elem;

/// The valid output range of one kernel tap along one spatial dim: output
/// index `o` reads input index `o * stride + off`, which is inside the input
/// exactly for `lo <= o < hi`. Precomputing this removes all bounds tests
/// from the inner loops.
#[derive(Clone, Copy, Debug)]
struct Tap {
    lo: usize,
    hi: usize,
    off: isize,
    stride: usize,
}

impl Tap {
    /// Input index read by output `o`, `None` when it falls in the padding.
    fn input(&self, o: usize) -> Option<usize> {
        (self.lo..self.hi)
            .contains(&o)
            .then(|| (o * self.stride) as isize + self.off)
            .map(|i| i as usize)
    }

    /// Input index read by output `lo` (only meaningful when `lo < hi`).
    fn first_input(&self) -> usize {
        ((self.lo * self.stride) as isize + self.off) as usize
    }
}

/// The geometry lifted to exactly three spatial dims (missing leading dims
/// get a trivial 1-tap window over a size-1 input) so one kernel serves 1-,
/// 2- and 3-d.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan3 {
    inp: [usize; 3],
    out: [usize; 3],
    kernel: [usize; 3],
    stride: [usize; 3],
    padding: [usize; 3],
    dilation: [usize; 3],
}

impl Plan3 {
    pub(super) fn new(g: &ConvGeom, spatial: &[usize], out: &[usize]) -> Self {
        let lift = |v: &[usize], fill: usize| {
            let mut a = [fill; 3];
            a[3 - v.len()..].copy_from_slice(v);
            a
        };
        Self {
            inp: lift(spatial, 1),
            out: lift(out, 1),
            kernel: lift(&g.kernel, 1),
            stride: lift(&g.stride, 1),
            padding: lift(&g.padding, 0),
            dilation: lift(&g.dilation, 1),
        }
    }

    /// Elements in one input plane, `prod(spatial)`.
    pub(super) fn in_len(&self) -> usize {
        self.inp.iter().product()
    }

    /// Output positions, `L`.
    pub(super) fn out_len(&self) -> usize {
        self.out.iter().product()
    }

    /// Elements of one channel's block of columns, `prod(kernel) * L`.
    pub(super) fn cols_len(&self) -> usize {
        self.kernel.iter().product::<usize>() * self.out_len()
    }

    /// Tap `k` of the window along `dim`.
    fn tap(&self, dim: usize, k: usize) -> Tap {
        let off = (k * self.dilation[dim]) as isize - self.padding[dim] as isize;
        let (stride, n_in) = (self.stride[dim], self.inp[dim] as isize);
        // lo: smallest o with o*stride + off >= 0; hi: number of o with o*stride + off < n_in.
        let hi = ((n_in - off).max(0) as usize).div_ceil(stride).min(self.out[dim]);
        let lo = ((-off).max(0) as usize).div_ceil(stride).min(hi);
        Tap { lo, hi, off, stride }
    }
}

/// Row re-layout that makes strided windows contiguous. With a w-stride
/// `s > 1`, each row of a plane is stored phase by phase: `x[0], x[s],
/// x[2s], .., x[1], x[1+s], ..`, so the elements `i, i+s, i+2s, ..` that one
/// line of the columns reads sit next to each other. One pass over the
/// (small) input plane buys `copy_from_slice` speed for every line.
pub(super) struct Phases {
    stride: usize,
    width: usize,
    /// Where each phase starts within a split row.
    starts: Vec<usize>,
}

impl Phases {
    fn new(stride: usize, width: usize) -> Self {
        let starts = (0..stride)
            .scan(0, |next, phase| {
                let start = *next;
                *next += width.saturating_sub(phase).div_ceil(stride);
                Some(start)
            })
            .collect();
        Self { stride, width, starts }
    }

    /// Position of row element `i` within its split row.
    fn index(&self, i: usize) -> usize {
        self.starts[i % self.stride] + i / self.stride
    }

    /// Writes `plane` into `split` with every row phase-split.
    pub(super) fn split<T: Elem>(&self, plane: &[T], split: &mut [T]) {
        let rows = plane.chunks_exact(self.width);
        for (row, out) in rows.zip(split.chunks_exact_mut(self.width)) {
            for (phase, &start) in self.starts.iter().enumerate() {
                let phase_elems = row.iter().skip(phase).step_by(self.stride);
                for (o, x) in out[start..].iter_mut().zip(phase_elems) {
                    *o = *x;
                }
            }
        }
    }

    /// The inverse of [`Self::split`].
    pub(super) fn merge<T: Elem>(&self, split: &[T], plane: &mut [T]) {
        let rows = plane.chunks_exact_mut(self.width);
        for (row, src) in rows.zip(split.chunks_exact(self.width)) {
            for (phase, &start) in self.starts.iter().enumerate() {
                let phase_elems = row.iter_mut().skip(phase).step_by(self.stride);
                for (o, x) in phase_elems.zip(&src[start..]) {
                    *o = *x;
                }
            }
        }
    }
}

/// One kernel tap along w as a line loop needs it: outputs `lo..hi` of a
/// line read the `hi - lo` contiguous elements of the (phase-split when
/// strided) input row starting at `first`; the rest of the line is padding.
#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) first: usize,
}

/// The plane-independent part of the walk over one `(n, c)` plane, computed
/// once per call so the per-plane loops are plain zips: for every `(kd, kh)`
/// tap pair and output `(od, oh)`, the start of the input row read (`None`
/// when that row is padding), and the runs along w.
pub(super) struct Lines {
    /// `kernel[0] * kernel[1]` groups of `per_pair = out[0] * out[1]` entries.
    pub(super) rows: Vec<Option<usize>>,
    pub(super) per_pair: usize,
    pub(super) runs: Vec<Run>,
    /// Present when the w-stride is > 1 (rows are then read phase-split).
    pub(super) phases: Option<Phases>,
    pub(super) in_w: usize,
    pub(super) out_w: usize,
}

impl Lines {
    pub(super) fn new(p: &Plan3) -> Self {
        let [_, in_h, in_w] = p.inp;
        let mut rows = Vec::with_capacity(p.kernel[0] * p.kernel[1] * p.out[0] * p.out[1]);
        for kd in 0..p.kernel[0] {
            let td = p.tap(0, kd);
            for kh in 0..p.kernel[1] {
                let th = p.tap(1, kh);
                for od in 0..p.out[0] {
                    let id = td.input(od);
                    rows.extend((0..p.out[1]).map(|oh| id.zip(th.input(oh)).map(|(d, h)| (d * in_h + h) * in_w)));
                }
            }
        }
        let phases = (p.stride[2] > 1).then(|| Phases::new(p.stride[2], in_w));
        let runs = (0..p.kernel[2])
            .map(|kw| {
                let t = p.tap(2, kw);
                let first = match (&phases, t.lo < t.hi) {
                    (_, false) => 0,
                    (None, true) => t.first_input(),
                    (Some(ph), true) => ph.index(t.first_input()),
                };
                Run {
                    lo: t.lo,
                    hi: t.hi,
                    first,
                }
            })
            .collect();
        Self {
            rows,
            per_pair: p.out[0] * p.out[1],
            runs,
            phases,
            in_w,
            out_w: p.out[2],
        }
    }

    /// One channel's columns are `prod(kernel)` rows of `L` values, in the
    /// order (tap pair, w tap); each row is `per_pair` lines of `out_w`.
    pub(super) fn row_len(&self) -> usize {
        self.per_pair * self.out_w
    }
}
