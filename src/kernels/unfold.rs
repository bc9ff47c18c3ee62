//! im2col / col2im ("unfold" / "fold") for 1-, 2- and 3-d convolutions, and a
//! convolution built from them.
//!
//! Per-sample gradients of a convolution need the unfolded input explicitly
//! (the weight gradient of sample `n` is `grad_out[n] @ unfold(x)[n]^T`), so
//! the unfold is a first-class, fast operation here rather than a hidden step
//! inside a convolution kernel.
//!
//! Layouts follow PyTorch's `F.unfold` / `F.fold`, generalised to N-d:
//! `x: [N, C, *S]` unfolds to `[N, C * prod(kernel), L]` where
//! `L = prod(out_spatial)`; the row index is `(c, k0, k1, ..)` with `c`
//! outermost and the column index is the output position in row-major order.
//!
//! On the CPU, f32 and f64 go through hand-written kernels ([`CustomOp1`]s)
//! that are multi-threaded over the `N * C` planes. Every other device/dtype
//! goes through [`unfold_generic`] / [`fold_generic`], built from ordinary
//! candle ops, which give identical results. Both paths are differentiable:
//! the backward of `unfold` is `fold` and vice versa.

use super::{contiguous_slice, has_cpu_kernel, max_threads, output, zeroed, Elem, MIN_ELEMS_PER_THREAD};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

// ---------------------------------------------------------------------------
// Geometry
// ---------------------------------------------------------------------------

/// Window geometry of an N-d convolution (N = 1, 2 or 3; each Vec has length N).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    /// Kernel (window) size per spatial dim, each >= 1.
    pub kernel: Vec<usize>,
    /// Step between windows per spatial dim, each >= 1.
    pub stride: Vec<usize>,
    /// Zero padding added on both sides of each spatial dim.
    pub padding: Vec<usize>,
    /// Spacing between kernel taps per spatial dim, each >= 1.
    pub dilation: Vec<usize>,
}

impl ConvGeom {
    /// The same kernel/stride/padding/dilation in each of `ndim` spatial dims.
    pub fn uniform(ndim: usize, kernel: usize, stride: usize, padding: usize, dilation: usize) -> Self {
        Self {
            kernel: vec![kernel; ndim],
            stride: vec![stride; ndim],
            padding: vec![padding; ndim],
            dilation: vec![dilation; ndim],
        }
    }

    /// Number of spatial dimensions (the length of `kernel`).
    pub fn ndim(&self) -> usize {
        self.kernel.len()
    }

    /// Number of taps in one window, `prod(kernel)`.
    pub fn kernel_numel(&self) -> usize {
        self.kernel.iter().product()
    }

    /// Output spatial size for an input spatial size (PyTorch's formula:
    /// `(s + 2p - d(k-1) - 1)/stride + 1`), error if the window does not fit.
    pub fn out_spatial(&self, spatial: &[usize]) -> Result<Vec<usize>> {
        self.out_spatial_for("out_spatial", spatial)
    }

    /// [`Self::out_spatial`] with errors attributed to the calling operation.
    pub(crate) fn out_spatial_for(&self, op: &str, spatial: &[usize]) -> Result<Vec<usize>> {
        self.validate(op)?;
        if spatial.len() != self.ndim() {
            bail!(
                "{op}: spatial size {spatial:?} has {} dims but the geometry is {}-d ({self:?})",
                spatial.len(),
                self.ndim()
            )
        }
        (0..self.ndim())
            .map(|i| {
                let span = self.dilation[i] * (self.kernel[i] - 1) + 1;
                let padded = spatial[i] + 2 * self.padding[i];
                if padded < span {
                    bail!(
                        "{op}: window of span {span} (kernel {}, dilation {}) does not fit padded size {padded} \
                         in spatial dim {i} (input spatial {spatial:?}, {self:?})",
                        self.kernel[i],
                        self.dilation[i]
                    )
                }
                Ok((padded - span) / self.stride[i] + 1)
            })
            .collect()
    }

    /// Checks that the four vectors agree in length (1..=3) and that kernel,
    /// stride and dilation are positive.
    fn validate(&self, op: &str) -> Result<()> {
        let n = self.ndim();
        let lens = [self.stride.len(), self.padding.len(), self.dilation.len()];
        if !(1..=3).contains(&n) || lens.iter().any(|&l| l != n) {
            bail!("{op}: geometry vectors must all have length 1, 2 or 3, got {self:?}")
        }
        let positive = |v: &[usize]| v.iter().all(|&x| x > 0);
        if !positive(&self.kernel) || !positive(&self.stride) || !positive(&self.dilation) {
            bail!("{op}: kernel, stride and dilation must be positive, got {self:?}")
        }
        Ok(())
    }
}

/// Checks `x: [N, C, *S]` against `g`; returns the output spatial size.
pub(crate) fn check_input(op: &str, x: &Tensor, g: &ConvGeom) -> Result<Vec<usize>> {
    g.validate(op)?;
    if x.rank() != g.ndim() + 2 {
        bail!(
            "{op}: a {}-d geometry needs an input of rank {} ([N, C, *spatial]), got shape {:?}",
            g.ndim(),
            g.ndim() + 2,
            x.dims()
        )
    }
    g.out_spatial_for(op, &x.dims()[2..])
}

/// Checks `cols: [N, C * prod(k), L]` against `g` and the target `spatial`
/// size; returns `(N, C, out_spatial)`.
fn check_cols(op: &str, cols: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<(usize, usize, Vec<usize>)> {
    let out = g.out_spatial_for(op, spatial)?;
    let (k, l) = (g.kernel_numel(), out.iter().product::<usize>());
    let &[n, ck, cl] = cols.dims() else {
        bail!(
            "{op}: expected columns of rank 3 [N, C*prod(kernel), L], got shape {:?}",
            cols.dims()
        )
    };
    if ck % k != 0 || cl != l {
        bail!(
            "{op}: columns of shape {:?} do not match kernel {:?} (prod {k}) and output spatial {out:?} \
             (L = {l}) for spatial size {spatial:?}",
            cols.dims(),
            g.kernel
        )
    }
    Ok((n, ck / k, out))
}

// ---------------------------------------------------------------------------
// CPU kernels
// ---------------------------------------------------------------------------

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
struct Plan3 {
    inp: [usize; 3],
    out: [usize; 3],
    kernel: [usize; 3],
    stride: [usize; 3],
    padding: [usize; 3],
    dilation: [usize; 3],
}

impl Plan3 {
    fn new(g: &ConvGeom, spatial: &[usize], out: &[usize]) -> Self {
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
    fn in_len(&self) -> usize {
        self.inp.iter().product()
    }

    /// Output positions, `L`.
    fn out_len(&self) -> usize {
        self.out.iter().product()
    }

    /// Elements of one channel's block of columns, `prod(kernel) * L`.
    fn cols_len(&self) -> usize {
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
struct Phases {
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
    fn split<T: Elem>(&self, plane: &[T], split: &mut [T]) {
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
    fn merge<T: Elem>(&self, split: &[T], plane: &mut [T]) {
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
struct Run {
    lo: usize,
    hi: usize,
    first: usize,
}

/// The plane-independent part of the walk over one `(n, c)` plane, computed
/// once per call so the per-plane loops are plain zips: for every `(kd, kh)`
/// tap pair and output `(od, oh)`, the start of the input row read (`None`
/// when that row is padding), and the runs along w.
struct Lines {
    /// `kernel[0] * kernel[1]` groups of `per_pair = out[0] * out[1]` entries.
    rows: Vec<Option<usize>>,
    per_pair: usize,
    runs: Vec<Run>,
    /// Present when the w-stride is > 1 (rows are then read phase-split).
    phases: Option<Phases>,
    in_w: usize,
    out_w: usize,
}

impl Lines {
    fn new(p: &Plan3) -> Self {
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
    fn row_len(&self) -> usize {
        self.per_pair * self.out_w
    }
}

/// Fills one line of the columns from one input row (zeros where the window
/// is in the padding).
fn gather_line<T: Elem>(line: &mut [T], row: Option<&[T]>, run: Run) {
    match row {
        Some(row) if run.lo < run.hi => {
            line[..run.lo].fill(T::default());
            line[run.hi..].fill(T::default());
            let len = run.hi - run.lo;
            line[run.lo..run.hi].copy_from_slice(&row[run.first..run.first + len]);
        }
        _ => line.fill(T::default()),
    }
}

/// Adds one line of the columns into one input row (the adjoint of
/// [`gather_line`]); the padding part of the line is dropped.
fn scatter_line<T: Elem>(row: &mut [T], line: &[T], run: Run) {
    let src = &line[run.lo..run.hi];
    for (d, s) in row[run.first..run.first + src.len()].iter_mut().zip(src) {
        *d += *s;
    }
}

/// Unfolds one `(n, c)` plane: `src` is the input plane, `dst` its
/// `prod(kernel) * L` columns; `scratch` holds the phase-split plane.
fn unfold_plane<T: Elem>(lines: &Lines, src: &[T], dst: &mut [T], scratch: &mut Vec<T>) {
    match &lines.phases {
        None => unfold_lines(lines, src, dst),
        Some(phases) => {
            scratch.resize(src.len(), T::default());
            phases.split(src, scratch);
            unfold_lines(lines, scratch, dst)
        }
    }
}

fn unfold_lines<T: Elem>(lines: &Lines, src: &[T], dst: &mut [T]) {
    let mut rows = dst.chunks_exact_mut(lines.row_len());
    for pair in lines.rows.chunks_exact(lines.per_pair) {
        for (&run, row) in lines.runs.iter().zip(&mut rows) {
            for (line, &r) in row.chunks_exact_mut(lines.out_w).zip(pair) {
                gather_line(line, r.map(|r| &src[r..r + lines.in_w]), run);
            }
        }
    }
}

/// Folds one `(n, c)` plane: `src` is its `prod(kernel) * L` columns, `dst`
/// the (zeroed) output plane; `scratch` accumulates the phase-split plane.
fn fold_plane<T: Elem>(lines: &Lines, src: &[T], dst: &mut [T], scratch: &mut Vec<T>) {
    match &lines.phases {
        None => fold_lines(lines, src, dst),
        Some(phases) => {
            scratch.clear();
            scratch.resize(dst.len(), T::default());
            fold_lines(lines, src, scratch);
            phases.merge(scratch, dst)
        }
    }
}

fn fold_lines<T: Elem>(lines: &Lines, src: &[T], dst: &mut [T]) {
    let mut rows = src.chunks_exact(lines.row_len());
    for pair in lines.rows.chunks_exact(lines.per_pair) {
        for (&run, row) in lines.runs.iter().zip(&mut rows) {
            for (line, &r) in row.chunks_exact(lines.out_w).zip(pair) {
                if let Some(r) = r {
                    scatter_line(&mut dst[r..r + lines.in_w], line, run);
                }
            }
        }
    }
}

/// Applies `f` to matching blocks of `src` and `dst` (both non-empty block
/// sizes), spread over up to `get_num_threads()` scoped threads, each with
/// its own scratch buffer. Blocks are independent `(n, c)` planes, so no
/// synchronisation is needed.
fn par_blocks<T: Elem>(
    src: &[T],
    src_block: usize,
    dst: &mut [T],
    dst_block: usize,
    f: impl Fn(&[T], &mut [T], &mut Vec<T>) + Sync,
) {
    let blocks = dst.len() / dst_block;
    let threads = max_threads()
        .min(blocks)
        .min((src.len() + dst.len()) / MIN_ELEMS_PER_THREAD)
        .max(1);
    let run = |s: &[T], d: &mut [T]| {
        let mut scratch = Vec::new();
        for (s, d) in s.chunks_exact(src_block).zip(d.chunks_exact_mut(dst_block)) {
            f(s, d, &mut scratch)
        }
    };
    let per = blocks.div_ceil(threads);
    let mut jobs = src.chunks(per * src_block).zip(dst.chunks_mut(per * dst_block));
    let Some((s0, d0)) = jobs.next() else { return };
    std::thread::scope(|scope| {
        for (s, d) in jobs {
            scope.spawn(|| run(s, d));
        }
        // The calling thread takes the first share instead of idling.
        run(s0, d0);
    });
}

/// CPU unfold of `planes` contiguous `(n, c)` planes.
fn unfold_cpu<T: Elem>(src: &[T], p: &Plan3, planes: usize) -> Vec<T> {
    let mut dst = output(planes * p.cols_len());
    // An empty input plane unfolds to pure padding: already zeros.
    if p.in_len() > 0 && !dst.is_empty() {
        let lines = Lines::new(p);
        par_blocks(src, p.in_len(), &mut dst, p.cols_len(), |s, d, scratch| {
            unfold_plane(&lines, s, d, scratch)
        });
    }
    dst
}

/// CPU fold into `planes` contiguous `(n, c)` planes.
fn fold_cpu<T: Elem>(src: &[T], p: &Plan3, planes: usize) -> Vec<T> {
    // Accumulates with `+=`: see `zeroed`.
    let mut dst = zeroed(planes * p.in_len());
    if !dst.is_empty() {
        let lines = Lines::new(p);
        par_blocks(src, p.cols_len(), &mut dst, p.in_len(), |s, d, scratch| {
            fold_plane(&lines, s, d, scratch)
        });
    }
    dst
}

/// Runs `kernel` on the f32/f64 storage (anything else is an error: the
/// wrappers send other dtypes down the generic path).
fn dispatch(
    op: &str,
    storage: &CpuStorage,
    layout: &Layout,
    p: &Plan3,
    planes: usize,
    kernel: Kernel,
) -> Result<CpuStorage> {
    Ok(match storage {
        CpuStorage::F32(v) => CpuStorage::F32(kernel.run(contiguous_slice(op, v, layout)?, p, planes)),
        CpuStorage::F64(v) => CpuStorage::F64(kernel.run(contiguous_slice(op, v, layout)?, p, planes)),
        s => bail!("{op}: no CPU kernel for dtype {:?}", s.dtype()),
    })
}

/// Which of the two kernels to run (a fn pointer cannot be generic over `T`).
#[derive(Clone, Copy)]
enum Kernel {
    Unfold,
    Fold,
}

impl Kernel {
    fn run<T: Elem>(self, src: &[T], p: &Plan3, planes: usize) -> Vec<T> {
        match self {
            Kernel::Unfold => unfold_cpu(src, p, planes),
            Kernel::Fold => fold_cpu(src, p, planes),
        }
    }
}

/// `unfold` as a candle op; its backward is `fold`.
struct UnfoldOp {
    geom: ConvGeom,
}

impl CustomOp1 for UnfoldOp {
    fn name(&self) -> &'static str {
        "unfold"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.dims();
        if dims.len() != self.geom.ndim() + 2 {
            bail!(
                "unfold: input of shape {dims:?} does not match geometry {:?}",
                self.geom
            )
        }
        let out = self.geom.out_spatial_for("unfold", &dims[2..])?;
        let p = Plan3::new(&self.geom, &dims[2..], &out);
        let (n, c) = (dims[0], dims[1]);
        let shape = Shape::from((n, c * self.geom.kernel_numel(), p.out_len()));
        Ok((dispatch("unfold", storage, layout, &p, n * c, Kernel::Unfold)?, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        fold(grad, &self.geom, &arg.dims()[2..]).map(Some)
    }
}

/// `fold` as a candle op; its backward is `unfold`.
struct FoldOp {
    geom: ConvGeom,
    spatial: Vec<usize>,
}

impl CustomOp1 for FoldOp {
    fn name(&self) -> &'static str {
        "fold"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.geom.out_spatial_for("fold", &self.spatial)?;
        let p = Plan3::new(&self.geom, &self.spatial, &out);
        let &[n, ck, l] = layout.dims() else {
            bail!("fold: expected columns of rank 3, got shape {:?}", layout.dims())
        };
        let k = self.geom.kernel_numel();
        if ck % k != 0 || l != p.out_len() {
            bail!(
                "fold: columns of shape {:?} do not match {:?}",
                layout.dims(),
                self.geom
            )
        }
        let c = ck / k;
        let mut shape = vec![n, c];
        shape.extend_from_slice(&self.spatial);
        Ok((
            dispatch("fold", storage, layout, &p, n * c, Kernel::Fold)?,
            Shape::from(shape),
        ))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        unfold(grad, &self.geom).map(Some)
    }
}

// ---------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------

/// im2col, PyTorch `F.unfold` semantics generalised to 1D/2D/3D:
/// `x: [N, C, *S]` (S has N spatial dims) -> `[N, C * prod(kernel), L]` where
/// `L = prod(out_spatial)`.
///
/// The row index is `(c, k0, k1, ..)` with `c` outermost (exactly torch's
/// order), the column is the output position in row-major order. Zero
/// padding. Differentiable (the backward is [`fold`]).
pub fn unfold(x: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    check_input("unfold", x, g)?;
    if has_cpu_kernel(x) {
        x.contiguous()?.apply_op1(UnfoldOp { geom: g.clone() })
    } else {
        unfold_generic(x, g)
    }
}

/// col2im, the adjoint of [`unfold`] (PyTorch `F.fold`):
/// `cols: [N, C*prod(k), L]` -> `[N, C, *spatial]`, summing overlapping
/// contributions. Differentiable (the backward is [`unfold`]).
pub fn fold(cols: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<Tensor> {
    check_cols("fold", cols, g, spatial)?;
    if has_cpu_kernel(cols) {
        let op = FoldOp {
            geom: g.clone(),
            spatial: spatial.to_vec(),
        };
        cols.contiguous()?.apply_op1(op)
    } else {
        fold_generic(cols, g, spatial)
    }
}

/// Convolution by unfold + matmul: `x: [N, Cin, *S]`,
/// `w: [Cout, Cin/groups, *kernel]` -> `[N, Cout, *out_spatial]`, any
/// `groups`, no bias.
///
/// Each group is ONE batched matmul `w_g [Cout/g, Cin/g*K] @ cols_g [N,
/// Cin/g*K, L]`, reading its rows of the shared unfold in place (no
/// block-diagonal weight, no per-group copy of the columns).
pub fn conv_unfold(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> Result<Tensor> {
    let out = check_input("conv_unfold", x, g)?;
    let (n, cin) = (x.dim(0)?, x.dim(1)?);
    let cout = check_weight(x, w, g, groups)?;
    let k = g.kernel_numel();
    let (cin_g, cout_g) = (cin / groups, cout / groups);
    let cols = unfold(x, g)?;
    let w = w.reshape((cout, cin_g * k))?;
    // The weight is broadcast over the batch (stride 0), so candle runs one
    // gemm per sample without copying it.
    let outs = (0..groups)
        .map(|i| {
            let wg = w.narrow(0, i * cout_g, cout_g)?;
            wg.broadcast_matmul(&cols.narrow(1, i * cin_g * k, cin_g * k)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // `cat` of a single tensor is free.
    Tensor::cat(&outs, 1)?.reshape([&[n, cout], out.as_slice()].concat())
}

/// Checks the weight of [`conv_unfold`]; returns `Cout`.
fn check_weight(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> Result<usize> {
    let cin = x.dim(1)?;
    let ok_rank = w.rank() == g.ndim() + 2 && w.dims()[2..] == g.kernel[..];
    if !ok_rank {
        bail!(
            "conv_unfold: weight of shape {:?} does not match [Cout, Cin/groups, *kernel] with kernel {:?}",
            w.dims(),
            g.kernel
        )
    }
    let (cout, cin_w) = (w.dim(0)?, w.dim(1)?);
    if groups == 0 || cin % groups != 0 || cout % groups != 0 || cin_w * groups != cin {
        bail!(
            "conv_unfold: input of shape {:?} and weight of shape {:?} do not fit groups = {groups} \
             (need Cin and Cout divisible by groups and weight dim 1 = Cin/groups)",
            x.dims(),
            w.dims()
        )
    }
    Ok(cout)
}

// ---------------------------------------------------------------------------
// Generic (any device, any dtype) implementations from candle ops
// ---------------------------------------------------------------------------

/// The kernel taps as multi-indices, in row-major order (torch's row order).
fn kernel_taps(g: &ConvGeom) -> Vec<Vec<usize>> {
    (0..g.kernel_numel())
        .map(|mut flat| {
            let mut tap = vec![0; g.ndim()];
            for (t, &k) in tap.iter_mut().zip(&g.kernel).rev() {
                *t = flat % k;
                flat /= k;
            }
            tap
        })
        .collect()
}

/// Elements `start, start + step, ..` (`len` of them) along `dim`. Candle
/// has no strided slice, so for `step > 1` the span is padded to
/// `len * step`, split into `(len, step)` and the first column kept.
fn strided_narrow(t: &Tensor, dim: usize, start: usize, len: usize, step: usize) -> Result<Tensor> {
    if step == 1 {
        return t.narrow(dim, start, len);
    }
    let span = t
        .narrow(dim, start, (len - 1) * step + 1)?
        .pad_with_zeros(dim, 0, step - 1)?;
    let mut dims = span.dims().to_vec();
    dims.splice(dim..=dim, [len, step]);
    span.reshape(dims)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// The adjoint of [`strided_narrow`]: places the `len` elements of `t`
/// along `dim` at `start, start + step, ..` of a zero axis of size `total`.
fn strided_embed(t: &Tensor, dim: usize, start: usize, step: usize, total: usize) -> Result<Tensor> {
    let len = t.dim(dim)?;
    let t = if step == 1 {
        t.clone()
    } else {
        let spread = t.unsqueeze(dim + 1)?.pad_with_zeros(dim + 1, 0, step - 1)?;
        let mut dims = t.dims().to_vec();
        dims[dim] = len * step;
        spread.reshape(dims)?.narrow(dim, 0, (len - 1) * step + 1)?
    };
    let span = t.dim(dim)?;
    t.pad_with_zeros(dim, start, total - start - span)
}

/// [`unfold`] built only from candle ops (pad, narrow, reshape, stack), for
/// devices and dtypes without a kernel. Same results as the kernel.
pub fn unfold_generic(x: &Tensor, g: &ConvGeom) -> Result<Tensor> {
    let out = check_input("unfold", x, g)?;
    let mut xp = x.clone();
    for (i, &p) in g.padding.iter().enumerate() {
        xp = xp.pad_with_zeros(2 + i, p, p)?;
    }
    let pieces = kernel_taps(g)
        .iter()
        .map(|tap| {
            (0..g.ndim()).try_fold(xp.clone(), |t, i| {
                strided_narrow(&t, 2 + i, tap[i] * g.dilation[i], out[i], g.stride[i])
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // [N, C, K, *out] -> [N, C*K, L]: c outer, tap inner, as torch.
    let (n, c) = (x.dim(0)?, x.dim(1)?);
    let l = out.iter().product::<usize>();
    Tensor::stack(&pieces, 2)?.reshape((n, c * g.kernel_numel(), l))
}

/// [`fold`] built only from candle ops, for devices and dtypes without a
/// kernel: each tap's columns are spread onto the padded image and summed,
/// then the padding is cut away. Same results as the kernel.
pub fn fold_generic(cols: &Tensor, g: &ConvGeom, spatial: &[usize]) -> Result<Tensor> {
    let (n, c, out) = check_cols("fold", cols, g, spatial)?;
    let cols = cols.reshape([&[n, c, g.kernel_numel()], out.as_slice()].concat())?;
    let padded: Vec<usize> = spatial.iter().zip(&g.padding).map(|(s, p)| s + 2 * p).collect();
    let mut acc = Tensor::zeros([&[n, c], padded.as_slice()].concat(), cols.dtype(), cols.device())?;
    for (flat, tap) in kernel_taps(g).iter().enumerate() {
        let piece = (0..g.ndim()).try_fold(cols.narrow(2, flat, 1)?.squeeze(2)?, |t, i| {
            strided_embed(&t, 2 + i, tap[i] * g.dilation[i], g.stride[i], padded[i])
        })?;
        acc = (acc + piece)?;
    }
    for (i, (&p, &s)) in g.padding.iter().zip(spatial).enumerate() {
        acc = acc.narrow(2 + i, p, s)?;
    }
    acc.contiguous()
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    const CPU: &Device = &Device::Cpu;

    fn randn(dims: &[usize], dtype: DType) -> Tensor {
        Tensor::randn(0f64, 1f64, dims, CPU).unwrap().to_dtype(dtype).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        values(a)
            .iter()
            .zip(values(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    fn geom(kernel: &[usize], stride: &[usize], padding: &[usize], dilation: &[usize]) -> ConvGeom {
        ConvGeom {
            kernel: kernel.to_vec(),
            stride: stride.to_vec(),
            padding: padding.to_vec(),
            dilation: dilation.to_vec(),
        }
    }

    /// Every uniform geometry over a grid of k/s/p/d that fits `spatial`,
    /// plus one with different values per dim.
    fn geometries(spatial: &[usize]) -> Vec<ConvGeom> {
        let n = spatial.len();
        let mut gs = vec![];
        for k in [1, 2, 3] {
            for s in [1, 2, 3] {
                for p in [0, 1, 2] {
                    for d in [1, 2] {
                        let g = ConvGeom::uniform(n, k, s, p, d);
                        if g.out_spatial(spatial).is_ok() {
                            gs.push(g);
                        }
                    }
                }
            }
        }
        let take = |v: [usize; 3]| v[..n].to_vec();
        gs.push(geom(
            &take([2, 3, 1]),
            &take([1, 2, 3]),
            &take([1, 0, 2]),
            &take([2, 1, 1]),
        ));
        gs
    }

    /// Calls `f` with every multi-index below `dims`, in row-major order.
    fn each_index(dims: &[usize], mut f: impl FnMut(&[usize])) {
        let total: usize = dims.iter().product();
        let mut idx = vec![0; dims.len()];
        for _ in 0..total {
            f(&idx);
            for i in (0..dims.len()).rev() {
                idx[i] += 1;
                if idx[i] < dims[i] {
                    break;
                }
                idx[i] = 0;
            }
        }
    }

    /// Row-major flat offset of `idx` in `dims`.
    fn offset(dims: &[usize], idx: &[usize]) -> usize {
        idx.iter().zip(dims).fold(0, |acc, (i, d)| acc * d + i)
    }

    /// Direct im2col: row (c, taps..), column = output position.
    fn naive_unfold(x: &Tensor, g: &ConvGeom) -> Tensor {
        let (xv, dims) = (values(x), x.dims().to_vec());
        let (n, c, sp) = (dims[0], dims[1], &dims[2..]);
        let out = g.out_spatial(sp).unwrap();
        let (k, l) = (g.kernel_numel(), out.iter().product::<usize>());
        let mut res = vec![0.0; n * c * k * l];
        for b in 0..n {
            for ch in 0..c {
                let mut row = 0;
                each_index(&g.kernel, |tap| {
                    let mut col = 0;
                    each_index(&out, |o| {
                        let mut pos = vec![];
                        for i in 0..sp.len() {
                            let p = (o[i] * g.stride[i] + tap[i] * g.dilation[i]) as isize - g.padding[i] as isize;
                            if p >= 0 && (p as usize) < sp[i] {
                                pos.push(p as usize);
                            }
                        }
                        if pos.len() == sp.len() {
                            let src = (b * c + ch) * sp.iter().product::<usize>() + offset(sp, &pos);
                            res[((b * c + ch) * k + row) * l + col] = xv[src];
                        }
                        col += 1;
                    });
                    row += 1;
                });
            }
        }
        Tensor::from_vec(res, (n, c * k, l), CPU).unwrap()
    }

    /// Direct 3-d grouped convolution.
    fn naive_conv3d(x: &Tensor, w: &Tensor, g: &ConvGeom, groups: usize) -> Tensor {
        let (xv, wv) = (values(x), values(w));
        let (xd, wd) = (x.dims().to_vec(), w.dims().to_vec());
        let out = g.out_spatial(&xd[2..]).unwrap();
        let (cin_g, cout_g) = (xd[1] / groups, wd[0] / groups);
        let od = [xd[0], wd[0], out[0], out[1], out[2]];
        let mut res = vec![0.0; od.iter().product()];
        each_index(&od, |o| {
            let ci0 = (o[1] / cout_g) * cin_g;
            let mut acc = 0.0;
            for ci in 0..cin_g {
                each_index(&g.kernel, |tap| {
                    let mut pos = vec![o[0], ci0 + ci];
                    for i in 0..3 {
                        let p = (o[2 + i] * g.stride[i] + tap[i] * g.dilation[i]) as isize - g.padding[i] as isize;
                        if p < 0 || p as usize >= xd[2 + i] {
                            return;
                        }
                        pos.push(p as usize);
                    }
                    let widx = offset(&wd, &[&[o[1], ci][..], tap].concat());
                    acc += xv[offset(&xd, &pos)] * wv[widx];
                });
            }
            res[offset(&od, o)] = acc;
        });
        Tensor::from_vec(res, od.to_vec(), CPU).unwrap()
    }

    fn input_dims(ndim: usize) -> Vec<usize> {
        match ndim {
            1 => vec![2, 3, 11],
            2 => vec![2, 3, 9, 8],
            _ => vec![2, 2, 6, 5, 7],
        }
    }

    fn check_unfold_against_naive(ndim: usize) {
        let dims = input_dims(ndim);
        for dtype in [DType::F32, DType::F64] {
            let x = randn(&dims, dtype);
            for g in geometries(&dims[2..]) {
                let got = unfold(&x, &g).unwrap();
                assert_eq!(got.dtype(), dtype);
                let want = naive_unfold(&x, &g);
                assert_eq!(max_diff(&got, &want), 0.0, "{g:?} {dtype:?}");
                let generic = unfold_generic(&x, &g).unwrap();
                assert_eq!(max_diff(&generic, &want), 0.0, "generic {g:?} {dtype:?}");
            }
        }
    }

    #[test]
    fn unfold_1d_matches_naive() {
        check_unfold_against_naive(1);
    }

    #[test]
    fn unfold_2d_matches_naive() {
        check_unfold_against_naive(2);
    }

    #[test]
    fn unfold_3d_matches_naive() {
        check_unfold_against_naive(3);
    }

    #[test]
    fn unfold_2d_shape_and_order_like_torch() {
        // torch: F.unfold(arange(1*2*3*3).view(1,2,3,3), 2) rows (c, ki, kj).
        let x = Tensor::arange(0f32, 18., CPU).unwrap().reshape((1, 2, 3, 3)).unwrap();
        let cols = unfold(&x, &ConvGeom::uniform(2, 2, 1, 0, 1)).unwrap();
        assert_eq!(cols.dims(), &[1, 8, 4]);
        let rows: Vec<Vec<f32>> = cols.squeeze(0).unwrap().to_vec2().unwrap();
        assert_eq!(rows[0], [0., 1., 3., 4.]);
        assert_eq!(rows[3], [4., 5., 7., 8.]);
        assert_eq!(rows[4], [9., 10., 12., 13.]);
    }

    /// <unfold(x), y> == <x, fold(y)> for both the kernel and the generic path.
    #[test]
    fn fold_is_adjoint_of_unfold() {
        for ndim in 1..=3 {
            let dims = input_dims(ndim);
            let x = randn(&dims, DType::F64);
            for g in geometries(&dims[2..]) {
                let ux = unfold(&x, &g).unwrap();
                let y = randn(ux.dims(), DType::F64);
                let lhs = (&ux * &y).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
                for fy in [
                    fold(&y, &g, &dims[2..]).unwrap(),
                    fold_generic(&y, &g, &dims[2..]).unwrap(),
                ] {
                    assert_eq!(fy.dims(), &dims[..]);
                    let rhs = (&x * &fy).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
                    assert!((lhs - rhs).abs() < 1e-10 * (1.0 + lhs.abs()), "{g:?}: {lhs} vs {rhs}");
                }
            }
        }
    }

    #[test]
    fn fold_kernel_matches_generic_f32() {
        let dims = input_dims(2);
        for g in geometries(&dims[2..]) {
            let out = g.out_spatial(&dims[2..]).unwrap();
            let y = randn(&[2, 3 * g.kernel_numel(), out.iter().product()], DType::F32);
            let a = fold(&y, &g, &dims[2..]).unwrap();
            let b = fold_generic(&y, &g, &dims[2..]).unwrap();
            assert!(max_diff(&a, &b) < 1e-5, "{g:?}");
        }
    }

    /// Big enough that `par_blocks` uses several threads (given >1 core).
    #[test]
    fn multithreaded_matches_generic() {
        let x = randn(&[16, 16, 32, 32], DType::F32);
        for stride in [1, 2] {
            let g = ConvGeom::uniform(2, 3, stride, 1, 1);
            let a = unfold(&x, &g).unwrap();
            assert_eq!(max_diff(&a, &unfold_generic(&x, &g).unwrap()), 0.0);
            let f = fold(&a, &g, &[32, 32]).unwrap();
            assert!(max_diff(&f, &fold_generic(&a, &g, &[32, 32]).unwrap()) < 1e-5);
        }
    }

    /// Rows narrower than the stride (some phases of the split rows are
    /// empty) and windows that mostly sit in the padding.
    #[test]
    fn narrow_inputs_with_large_strides() {
        let cases = [
            (vec![2, 3, 2], geom(&[1], &[3], &[2], &[1])),
            (vec![1, 2, 1], geom(&[2], &[4], &[3], &[2])),
            (vec![2, 2, 3, 2], geom(&[3, 2], &[2, 3], &[2, 2], &[1, 2])),
            (vec![1, 2, 2, 1, 3], ConvGeom::uniform(3, 2, 3, 1, 1)),
        ];
        for (dims, g) in cases {
            let x = randn(&dims, DType::F64);
            let ux = unfold(&x, &g).unwrap();
            assert_eq!(max_diff(&ux, &naive_unfold(&x, &g)), 0.0, "{g:?}");
            let y = randn(ux.dims(), DType::F64);
            let fy = fold(&y, &g, &dims[2..]).unwrap();
            assert!(max_diff(&fy, &fold_generic(&y, &g, &dims[2..]).unwrap()) < 1e-12);
        }
    }

    #[test]
    fn non_contiguous_inputs() {
        let g = ConvGeom::uniform(2, 3, 2, 1, 1);
        // Transposed (non-contiguous strides).
        let base = randn(&[2, 3, 8, 9], DType::F32);
        let xt = base.transpose(2, 3).unwrap();
        assert!(!xt.is_contiguous());
        let want = naive_unfold(&xt, &g);
        assert_eq!(max_diff(&unfold(&xt, &g).unwrap(), &want), 0.0);
        // Contiguous but at a non-zero start offset.
        let big = randn(&[5, 3, 9, 8], DType::F64);
        let xo = big.narrow(0, 2, 2).unwrap();
        assert!(xo.is_contiguous() && xo.layout().start_offset() > 0);
        assert_eq!(max_diff(&unfold(&xo, &g).unwrap(), &naive_unfold(&xo, &g)), 0.0);
        // Non-contiguous columns for fold.
        let cols = unfold(&xo, &g).unwrap();
        let cols_t = cols
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        assert!(!cols_t.is_contiguous());
        let a = fold(&cols_t, &g, &[9, 8]).unwrap();
        assert_eq!(max_diff(&a, &fold(&cols, &g, &[9, 8]).unwrap()), 0.0);
    }

    /// Dtypes without a kernel take the generic path with the same result.
    #[test]
    fn other_dtypes_fall_back() {
        let g = ConvGeom::uniform(2, 3, 2, 1, 2);
        let x = randn(&[2, 3, 9, 8], DType::F16);
        let got = unfold(&x, &g).unwrap();
        assert_eq!(got.dtype(), DType::F16);
        let want = unfold(&x.to_dtype(DType::F32).unwrap(), &g).unwrap();
        assert_eq!(max_diff(&got, &want), 0.0);
        let w = randn(&[4, 3, 3, 3], DType::F16);
        let y = conv_unfold(&x, &w, &g, 1).unwrap();
        assert_eq!(y.dtype(), DType::F16);
    }

    fn conv_tol(dtype: DType) -> f64 {
        if dtype == DType::F32 {
            1e-4
        } else {
            1e-10
        }
    }

    #[test]
    fn conv1d_matches_candle() {
        for dtype in [DType::F32, DType::F64] {
            let x = randn(&[3, 8, 17], dtype);
            for groups in [1, 2, 4] {
                let w = randn(&[8, 8 / groups, 3], dtype);
                for (s, p, d) in [(1, 0, 1), (2, 1, 1), (1, 2, 2), (3, 1, 2)] {
                    let g = ConvGeom::uniform(1, 3, s, p, d);
                    let got = conv_unfold(&x, &w, &g, groups).unwrap();
                    let want = x.conv1d(&w, p, s, d, groups).unwrap();
                    assert!(max_diff(&got, &want) < conv_tol(dtype), "{g:?} groups {groups}");
                }
            }
        }
    }

    #[test]
    fn conv2d_matches_candle() {
        for dtype in [DType::F32, DType::F64] {
            let x = randn(&[3, 8, 11, 10], dtype);
            for groups in [1, 2, 4] {
                let w = randn(&[12, 8 / groups, 3, 3], dtype);
                for (s, p, d) in [(1, 0, 1), (2, 1, 1), (1, 2, 2), (3, 1, 2)] {
                    let g = ConvGeom::uniform(2, 3, s, p, d);
                    let got = conv_unfold(&x, &w, &g, groups).unwrap();
                    let want = x.conv2d(&w, p, s, d, groups).unwrap();
                    assert!(max_diff(&got, &want) < conv_tol(dtype), "{g:?} groups {groups}");
                }
            }
        }
    }

    #[test]
    fn conv3d_matches_naive() {
        for dtype in [DType::F32, DType::F64] {
            let x = randn(&[2, 4, 6, 5, 7], dtype);
            for groups in [1, 2, 4] {
                let w = randn(&[4, 4 / groups, 2, 3, 2], dtype);
                for (s, p, d) in [(1, 0, 1), (2, 1, 1), (1, 1, 2)] {
                    let g = geom(&[2, 3, 2], &[s; 3], &[p; 3], &[d; 3]);
                    let got = conv_unfold(&x, &w, &g, groups).unwrap();
                    let want = naive_conv3d(&x, &w, &g, groups);
                    assert!(max_diff(&got, &want) < conv_tol(dtype), "{g:?} groups {groups}");
                }
            }
        }
    }

    /// Gradients flow through the kernel's backward (fold) like through
    /// candle's own conv2d. The input size is chosen so the stride divides
    /// evenly: candle 0.11's conv2d backward returns a wrongly sized input
    /// gradient otherwise (e.g. width 8, stride 2), which ours does not.
    #[test]
    fn conv_unfold_gradients_match_candle() {
        for groups in [1, 2] {
            let x = Var::from_tensor(&randn(&[2, 4, 9, 9], DType::F64)).unwrap();
            let w = Var::from_tensor(&randn(&[6, 4 / groups, 3, 3], DType::F64)).unwrap();
            let g = ConvGeom::uniform(2, 3, 2, 1, 1);
            let ours = conv_unfold(&x, &w, &g, groups)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap();
            let theirs = x.conv2d(&w, 1, 2, 1, groups).unwrap().sqr().unwrap().sum_all().unwrap();
            let (go, gt) = (ours.backward().unwrap(), theirs.backward().unwrap());
            for v in [&x, &w] {
                let (a, b) = (go.get(v).unwrap(), gt.get(v).unwrap());
                assert!(max_diff(a, b) < 1e-9, "groups {groups}");
            }
        }
    }

    /// fold's backward is unfold: d<fold(y), z>/dy = unfold(z).
    #[test]
    fn fold_gradient_is_unfold() {
        let g = ConvGeom::uniform(2, 3, 2, 1, 1);
        let z = randn(&[2, 3, 9, 8], DType::F64);
        let y = Var::from_tensor(&unfold(&randn(&[2, 3, 9, 8], DType::F64), &g).unwrap()).unwrap();
        let loss = (fold(&y, &g, &[9, 8]).unwrap() * &z).unwrap().sum_all().unwrap();
        let grad = loss.backward().unwrap();
        assert!(max_diff(grad.get(&y).unwrap(), &unfold(&z, &g).unwrap()) < 1e-12);
    }

    fn err(r: Result<Tensor>) -> String {
        r.expect_err("expected an error").to_string()
    }

    #[test]
    fn bad_shapes_are_errors() {
        let x = randn(&[2, 3, 5, 5], DType::F32);
        let g2 = ConvGeom::uniform(2, 3, 1, 0, 1);
        // Wrong rank.
        assert!(err(unfold(&x, &ConvGeom::uniform(1, 3, 1, 0, 1))).contains("unfold"));
        // Mismatched vector lengths, zero stride, too many dims.
        let mut bad = g2.clone();
        bad.padding = vec![0];
        assert!(err(unfold(&x, &bad)).contains("length"));
        assert!(err(unfold(&x, &ConvGeom::uniform(2, 3, 0, 0, 1))).contains("positive"));
        assert!(ConvGeom::uniform(4, 1, 1, 0, 1).out_spatial(&[1; 4]).is_err());
        // Window larger than the padded input.
        assert!(err(unfold(&x, &ConvGeom::uniform(2, 4, 1, 0, 2))).contains("does not fit"));
        assert!(err(unfold_generic(&x, &ConvGeom::uniform(2, 6, 1, 0, 1))).contains("does not fit"));
        // fold: wrong L, wrong rank, rows not a multiple of prod(kernel).
        let cols = unfold(&x, &g2).unwrap();
        assert!(err(fold(&cols, &g2, &[6, 5])).contains("fold"));
        assert!(err(fold(&x, &g2, &[5, 5])).contains("rank 3"));
        assert!(err(fold_generic(&cols.narrow(1, 0, 10).unwrap(), &g2, &[5, 5])).contains("fold"));
        // conv: channel/group mismatches and kernel mismatch.
        let w = randn(&[4, 3, 3, 3], DType::F32);
        assert!(err(conv_unfold(&x, &w, &g2, 3)).contains("groups"));
        assert!(err(conv_unfold(&x, &w, &g2, 0)).contains("groups"));
        assert!(err(conv_unfold(&x, &w, &ConvGeom::uniform(2, 2, 1, 0, 1), 1)).contains("kernel"));
    }

    #[test]
    fn out_spatial_formula() {
        let g = geom(&[3, 2], &[2, 1], &[1, 0], &[2, 1]);
        // (10 + 2 - 2*2 - 1)/2 + 1 = 4; (7 - 1 - 1)/1 + 1 = 6.
        assert_eq!(g.out_spatial(&[10, 7]).unwrap(), vec![4, 6]);
        // Padding alone can make room for an empty input.
        assert_eq!(ConvGeom::uniform(1, 1, 1, 1, 1).out_spatial(&[0]).unwrap(), vec![2]);
        let x = Tensor::zeros((1, 2, 0), DType::F32, CPU).unwrap();
        let cols = unfold(&x, &ConvGeom::uniform(1, 1, 1, 1, 1)).unwrap();
        assert_eq!(cols.dims(), &[1, 2, 2]);
    }
}
