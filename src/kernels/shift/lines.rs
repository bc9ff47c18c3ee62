//! Kernel lines: the taps along the last kernel axis folded into the
//! GEMMs' inner dimension. With few input channels a tap's GEMM is too
//! thin (`k = Cin`: the conv3d net's second layer ran its 27 taps at
//! `k = 8`), and every GEMM reads and writes the whole wide output again.
//! Copying the input `kw` times, each copy shifted by one tap of the last
//! axis (`x3[(c, j)] = x[c]` shifted by `j`), turns the `kw` taps of one
//! line into ONE GEMM with `k = Cin kw`, and `prod(kernel) / kw` GEMMs in
//! all. The weight is laid out line by line to match (`[line, Cout, Cin
//! kw]`, a few kilobytes).

use super::super::Elem;
use super::Plan;

/// `x3 [Cin kw, plane]` of one example's `x [Cin, plane]`: row `(c, j)` is
/// channel `c` read `j * dilation` further on, zeros past the end (which
/// no line's GEMM reaches: every tap's reads end inside the plane).
pub(super) fn input<T: Elem>(x: &[T], p: &Plan) -> Vec<T> {
    let plane = p.plane();
    // one example's scratch (the outputs are allocated fallibly)
    let mut x3 = vec![T::default(); p.cin * p.fold * plane];
    for (r, row) in x3.chunks_exact_mut(plane).enumerate() {
        let (c, off) = (r / p.fold, (r % p.fold) * p.dil_last);
        let src = &x[c * plane + off..(c + 1) * plane];
        row[..src.len()].copy_from_slice(src);
    }
    x3
}

/// The weight `[Cout, Cin, taps]` as `[line, Cout, Cin kw]` (nested loops,
/// no division per element: this runs on every call).
pub(super) fn weight<T: Elem>(w: &[T], p: &Plan) -> candle_core::Result<Vec<T>> {
    let (kn, f) = (p.taps(), p.fold);
    let mut wf = Vec::with_capacity(p.lines() * p.cout * p.cin * f);
    for l in 0..p.lines() {
        for co in 0..p.cout {
            for c in 0..p.cin {
                let at = (co * p.cin + c) * kn + l * f;
                wf.extend_from_slice(&w[at..at + f]);
            }
        }
    }
    Ok(wf)
}

/// Adds `y3 [Cin kw, plane]` (each row's values belonging `j * dilation`
/// further on) into one example's input gradient `dx [Cin, plane]`.
pub(super) fn add_folded<T: Elem>(y3: &[T], p: &Plan, dx: &mut [T]) {
    let plane = p.plane();
    for (r, row) in y3.chunks_exact(plane).enumerate() {
        let (c, off) = (r / p.fold, (r % p.fold) * p.dil_last);
        let dst = &mut dx[c * plane + off..(c + 1) * plane];
        for (d, v) in dst.iter_mut().zip(row) {
            *d += *v;
        }
    }
}
