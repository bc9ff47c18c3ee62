//! im2col with one row per output position: `x: [N, C, *S]` ->
//! `[N, L, C * prod(kernel)]`, the transpose of [`unfold`](super::unfold())
//! (same column order: `c` outermost, then the kernel taps), and its
//! adjoint [`fold_rows`].
//!
//! Why a second layout: with rows, a convolution over a whole batch is ONE
//! GEMM, `[(N L), CK] @ [CK, Cout]`, and so are both of its gradients,
//! where the column layout needs one small GEMM per example. On this
//! crate's benchmark machine (AVX-512, 2 threads) the tutorial CNN's second
//! convolution ran at 223 GFLOP/s as one GEMM and at 91 GFLOP/s as 64
//! per-example GEMMs.

use super::unfold::{check_input, fold, unfold, ConvGeom};
use super::{contiguous_slice, has_cpu_kernel, output, par_blocks_mut, zeroed, Elem, Path};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// A tap in the padding, or a line of taps that is not one run.
const NONE: usize = usize::MAX;

/// For every output position `l` and kernel tap `k`, the offset in an input
/// plane that `(l, k)` reads, or `NONE` in the padding: `taps[l * K + k]`.
/// Each entry is a sum of one lookup per axis in a small table (the offset
/// along that axis of every output index and tap), filled axis by axis:
/// no division per entry (computing each entry's position by division
/// took 0.7 ms of a 0.75 ms unfold of one 16^3 example by a 3^3 kernel).
fn taps(g: &ConvGeom, spatial: &[usize], out: &[usize]) -> Vec<usize> {
    let nd = g.ndim();
    let mut stride = vec![1; nd];
    for d in (0..nd.saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * spatial[d + 1];
    }
    // table[d][o * kernel[d] + k]: the offset along axis d of output index o, tap k
    let table: Vec<Vec<usize>> = (0..nd)
        .map(|d| {
            let axis = |o: usize, k: usize| {
                let pos = (o * g.stride[d] + k * g.dilation[d]).checked_sub(g.padding[d]);
                pos.filter(|&p| p < spatial[d]).map_or(NONE, |p| p * stride[d])
            };
            (0..out[d])
                .flat_map(|o| (0..g.kernel[d]).map(move |k| axis(o, k)))
                .collect()
        })
        .collect();
    let axes = Axes {
        table,
        out,
        kernel: &g.kernel,
        kn: g.kernel_numel(),
    };
    let mut t = vec![NONE; out.iter().product::<usize>() * axes.kn];
    axes.fill(&mut t, 0, (0, 0), 0);
    t
}

/// The per-axis tables of [`taps`] and the sizes they index.
struct Axes<'a> {
    /// `table[d][o * kernel[d] + k]`: the offset along axis `d`, or `NONE`.
    table: Vec<Vec<usize>>,
    out: &'a [usize],
    kernel: &'a [usize],
    kn: usize,
}

impl Axes<'_> {
    /// Writes every entry whose indices along the axes before `d` are
    /// `(o, k)` (row-major so far) and whose offset so far is `offset`;
    /// entries with a tap in the padding along some axis stay `NONE`.
    fn fill(&self, t: &mut [usize], d: usize, (o, k): (usize, usize), offset: usize) {
        if d == self.out.len() {
            t[o * self.kn + k] = offset;
            return;
        }
        let kd = self.kernel[d];
        if d + 1 == self.out.len() {
            // the last axis: a plain loop instead of one call per entry
            for (od, row) in self.table[d].chunks_exact(kd).enumerate() {
                let at = (o * self.out[d] + od) * self.kn + k * kd;
                for (e, &a) in t[at..at + kd].iter_mut().zip(row) {
                    if a != NONE {
                        *e = offset + a;
                    }
                }
            }
            return;
        }
        for (od, row) in self.table[d].chunks_exact(kd).enumerate() {
            for (j, &a) in row.iter().enumerate() {
                if a != NONE {
                    self.fill(t, d + 1, (o * self.out[d] + od, k * kd + j), offset + a);
                }
            }
        }
    }
}

/// The taps in lines of the last kernel axis: for output position `o` and
/// line `j` (all kernel indices but the last), the input offset of the
/// line's first tap when the whole line lies inside the input and its taps
/// are adjacent (dilation 1 along the last axis), so it copies as a run;
/// `NONE` otherwise.
fn runs(g: &ConvGeom, taps: &[usize], l: usize) -> Vec<usize> {
    let kw = g.kernel[g.ndim() - 1];
    let adjacent = g.dilation[g.ndim() - 1] == 1;
    let kn = g.kernel_numel();
    let mut r = Vec::with_capacity(l * kn / kw);
    for o in 0..l {
        for line in taps[o * kn..(o + 1) * kn].chunks_exact(kw) {
            let whole = line.iter().all(|&t| t != NONE);
            r.push(if adjacent && whole { line[0] } else { NONE });
        }
    }
    r
}

/// Sizes of one call: `c` channels, `kn` taps, `l` output positions,
/// `plane` input elements per channel.
#[derive(Clone, Copy)]
struct Dims {
    c: usize,
    kn: usize,
    /// Taps per line of the last kernel axis.
    kw: usize,
    l: usize,
    plane: usize,
}

/// The precomputed offsets of one call.
struct Plan {
    taps: Vec<usize>,
    runs: Vec<usize>,
}

/// `[N, C, S] -> [N, L, C K]`, one output row per thread task.
fn unfold_rows_cpu<T: Elem>(x: &[T], d: Dims, p: &Plan, n: usize) -> candle_core::Result<Vec<T>> {
    let (row, lines) = (d.c * d.kn, d.kn / d.kw);
    let mut dst = output(n * d.l * row)?;
    par_blocks_mut(&mut dst, row, 2 * n * d.l * row, |r, out| {
        let (i, o) = (r / d.l, r % d.l);
        let taps = &p.taps[o * d.kn..(o + 1) * d.kn];
        let runs = &p.runs[o * lines..(o + 1) * lines];
        for (c, out) in out.chunks_exact_mut(d.kn).enumerate() {
            let plane = &x[(i * d.c + c) * d.plane..(i * d.c + c + 1) * d.plane];
            for ((out, run), taps) in out.chunks_exact_mut(d.kw).zip(runs).zip(taps.chunks_exact(d.kw)) {
                if *run != NONE {
                    // A loop, not copy_from_slice: runs are a few elements,
                    // too short to pay for a memcpy call.
                    for (dst, v) in out.iter_mut().zip(&plane[*run..*run + d.kw]) {
                        *dst = *v;
                    }
                } else {
                    for (dst, &q) in out.iter_mut().zip(taps) {
                        if q != NONE {
                            *dst = plane[q];
                        }
                    }
                }
            }
        }
    });
    Ok(dst)
}

/// `[N, L, C K] -> [N, C, S]`, summing overlaps; one input plane per task.
fn fold_rows_cpu<T: Elem>(src: &[T], d: Dims, p: &Plan, n: usize) -> candle_core::Result<Vec<T>> {
    let (row, lines) = (d.c * d.kn, d.kn / d.kw);
    let mut dst = zeroed(n * d.c * d.plane)?;
    par_blocks_mut(&mut dst, d.plane, 2 * src.len(), |q, plane| {
        let (i, c) = (q / d.c, q % d.c);
        for o in 0..d.l {
            let s = &src[(i * d.l + o) * row + c * d.kn..(i * d.l + o) * row + (c + 1) * d.kn];
            let taps = &p.taps[o * d.kn..(o + 1) * d.kn];
            let runs = &p.runs[o * lines..(o + 1) * lines];
            for ((s, run), taps) in s.chunks_exact(d.kw).zip(runs).zip(taps.chunks_exact(d.kw)) {
                if *run != NONE {
                    for (dst, v) in plane[*run..*run + d.kw].iter_mut().zip(s) {
                        *dst += *v;
                    }
                } else {
                    for (v, &t) in s.iter().zip(taps) {
                        if t != NONE {
                            plane[t] += *v;
                        }
                    }
                }
            }
        }
    });
    Ok(dst)
}

/// Which direction a [`RowsOp`] runs.
#[derive(Clone, Copy)]
enum Dir {
    Unfold,
    Fold,
}

/// `unfold_rows` / `fold_rows` as a candle op.
struct RowsOp {
    dir: Dir,
    geom: ConvGeom,
    /// The input's spatial size (for fold, the size to fold back into).
    spatial: Vec<usize>,
    channels: usize,
}

impl CustomOp1 for RowsOp {
    fn name(&self) -> &'static str {
        match self.dir {
            Dir::Unfold => "unfold_rows",
            Dir::Fold => "fold_rows",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let out = self.geom.out_spatial_for(op, &self.spatial)?;
        let taps = taps(&self.geom, &self.spatial, &out);
        let d = Dims {
            c: self.channels,
            kn: self.geom.kernel_numel(),
            kw: self.geom.kernel[self.geom.ndim() - 1],
            l: out.iter().product(),
            plane: self.spatial.iter().product(),
        };
        let p = Plan {
            runs: runs(&self.geom, &taps, d.l),
            taps,
        };
        let n = layout.dims()[0];
        let shape = match self.dir {
            Dir::Unfold => Shape::from((n, d.l, d.c * d.kn)),
            Dir::Fold => Shape::from([&[n, d.c], &self.spatial[..]].concat()),
        };
        let storage = match storage {
            CpuStorage::F32(v) => {
                let s = contiguous_slice(op, v, layout)?;
                CpuStorage::F32(match self.dir {
                    Dir::Unfold => unfold_rows_cpu(s, d, &p, n)?,
                    Dir::Fold => fold_rows_cpu(s, d, &p, n)?,
                })
            }
            CpuStorage::F64(v) => {
                let s = contiguous_slice(op, v, layout)?;
                CpuStorage::F64(match self.dir {
                    Dir::Unfold => unfold_rows_cpu(s, d, &p, n)?,
                    Dir::Fold => fold_rows_cpu(s, d, &p, n)?,
                })
            }
            s => bail!("{op}: no CPU kernel for dtype {:?}", s.dtype()),
        };
        Ok((storage, shape))
    }
}

/// im2col with one row per output position: `x: [N, C, *S]` ->
/// `[N, L, C * prod(kernel)]`, equal to `unfold(x).transpose(1, 2)`.
pub fn unfold_rows(x: &Tensor, g: &ConvGeom, path: Path) -> Result<Tensor> {
    check_input("unfold_rows", x, g)?;
    if !has_cpu_kernel(x, path) {
        return unfold(x, g, path)?.transpose(1, 2)?.contiguous();
    }
    let op = RowsOp {
        dir: Dir::Unfold,
        geom: g.clone(),
        spatial: x.dims()[2..].to_vec(),
        channels: x.dims()[1],
    };
    x.contiguous()?.apply_op1_no_bwd(&op)
}

/// The adjoint of [`unfold_rows`]: `rows: [N, L, C * prod(kernel)]` ->
/// `[N, C, *spatial]`, summing overlapping windows.
pub fn fold_rows(rows: &Tensor, g: &ConvGeom, spatial: &[usize], path: Path) -> Result<Tensor> {
    let out = g.out_spatial_for("fold_rows", spatial)?;
    let (kn, l) = (g.kernel_numel(), out.iter().product::<usize>());
    let ok = rows.rank() == 3 && rows.dims()[1] == l && rows.dims()[2].is_multiple_of(kn);
    if !ok {
        bail!(
            "fold_rows: expected rows [N, {l}, C * {kn}] for spatial size {spatial:?} and {g:?}, got {:?}",
            rows.dims()
        )
    }
    if !has_cpu_kernel(rows, path) {
        return fold(&rows.transpose(1, 2)?.contiguous()?, g, spatial, path);
    }
    let op = RowsOp {
        dir: Dir::Fold,
        geom: g.clone(),
        spatial: spatial.to_vec(),
        channels: rows.dims()[2] / kn,
    };
    rows.contiguous()?.apply_op1_no_bwd(&op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::max_diff;
    use candle_core::{DType, Device};

    /// Rows are the transposed columns, and fold_rows is fold of the
    /// transposed rows, over 1-, 2- and 3-d geometries with stride,
    /// padding and dilation, f32 and f64.
    #[test]
    fn rows_are_transposed_columns() -> Result<()> {
        let cases: [(ConvGeom, Vec<usize>); 5] = [
            (ConvGeom::uniform(1, 3, 1, 2, 1), vec![2, 3, 11]),
            (ConvGeom::uniform(2, 3, 0, 1, 1), vec![2, 3, 7, 6]),
            (
                ConvGeom {
                    kernel: vec![2, 3],
                    stride: vec![2, 1],
                    padding: vec![1, 2],
                    dilation: vec![1, 2],
                },
                vec![3, 2, 8, 9],
            ),
            (ConvGeom::uniform(2, 8, 3, 2, 1), vec![2, 1, 28, 28]),
            (ConvGeom::uniform(3, 2, 1, 1, 1), vec![1, 2, 4, 5, 3]),
        ];
        for dt in [DType::F32, DType::F64] {
            for (g, shape) in &cases {
                let x = Tensor::randn(0f32, 1., shape.as_slice(), &Device::Cpu)?.to_dtype(dt)?;
                let rows = unfold_rows(&x, g, Path::Fast)?;
                let cols = unfold(&x, g, Path::Fast)?;
                assert_eq!(max_diff(&rows, &cols.transpose(1, 2)?)?, 0.0, "{g:?}");
                let r = Tensor::randn(0f32, 1., rows.dims(), &Device::Cpu)?.to_dtype(dt)?;
                let want = fold(&r.transpose(1, 2)?.contiguous()?, g, &shape[2..], Path::Fast)?;
                assert!(
                    max_diff(&fold_rows(&r, g, &shape[2..], Path::Fast)?, &want)? < 1e-5,
                    "{g:?}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_are_errors() -> Result<()> {
        let g = ConvGeom::uniform(2, 3, 0, 1, 1);
        let x = Tensor::zeros((1, 1, 2, 2), DType::F32, &Device::Cpu)?;
        assert!(unfold_rows(&x, &g, Path::Fast).is_err());
        let rows = Tensor::zeros((1, 5, 9), DType::F32, &Device::Cpu)?;
        assert!(fold_rows(&rows, &g, &[4, 4], Path::Fast).is_err()); // L is 4, not 5
        Ok(())
    }
}
