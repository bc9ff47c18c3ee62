//! The CPU loops of unfold and fold over contiguous `(n, c)` planes, spread
//! over threads by plane.

use super::plan::{Lines, Plan3, Run};
use crate::kernels::{max_threads, output, zeroed, Elem, MIN_ELEMS_PER_THREAD};

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
/// sizes), spread over up to `get_num_threads()` threads (`run_jobs`), each with
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
    let jobs: Vec<(&[T], &mut [T])> = src
        .chunks(per * src_block)
        .zip(dst.chunks_mut(per * dst_block))
        .collect();
    super::super::run_jobs(jobs, |(s, d)| run(s, d));
}

/// CPU unfold of `planes` contiguous `(n, c)` planes.
pub(super) fn unfold_cpu<T: Elem>(src: &[T], p: &Plan3, planes: usize) -> candle_core::Result<Vec<T>> {
    let mut dst = output(planes * p.cols_len())?;
    // An empty input plane unfolds to pure padding: already zeros.
    if p.in_len() > 0 && !dst.is_empty() {
        let lines = Lines::new(p);
        par_blocks(src, p.in_len(), &mut dst, p.cols_len(), |s, d, scratch| {
            unfold_plane(&lines, s, d, scratch)
        });
    }
    Ok(dst)
}

/// CPU fold into `planes` contiguous `(n, c)` planes.
pub(super) fn fold_cpu<T: Elem>(src: &[T], p: &Plan3, planes: usize) -> candle_core::Result<Vec<T>> {
    // Accumulates with `+=`: see `zeroed`.
    let mut dst = zeroed(planes * p.in_len())?;
    if !dst.is_empty() {
        let lines = Lines::new(p);
        par_blocks(src, p.cols_len(), &mut dst, p.in_len(), |s, d, scratch| {
            fold_plane(&lines, s, d, scratch)
        });
    }
    Ok(dst)
}
