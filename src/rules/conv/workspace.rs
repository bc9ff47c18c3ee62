//! What each convolution primitive allocates besides its result while it
//! runs, as `cpu::run` dispatches: contiguous copies of strided operands,
//! padded inputs, im2col matrices (columns or rows), the shifted GEMMs'
//! wide cotangents and per-thread planes. The memory plan reads it; the
//! constants that pick a lowering are `cpu`'s own.

use super::cpu::{MIN_COLS_LEN, PER_EXAMPLE_GRAD_LEN, SQ_NORM_CHUNK};
use crate::ir::conv::ConvOp;
use crate::ir::ConvGeom;
use crate::ir::TensorType;
use crate::kernels::{max_threads, shift};
use crate::rules::facts::{Arg, Workspace};

/// Element counts multiplied, saturating.
fn prod(v: &[usize]) -> usize {
    v.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// Elements of one padded input plane (`S + 2p` per axis).
fn padded_plane(g: &ConvGeom, spatial: &[usize]) -> usize {
    prod(
        &spatial
            .iter()
            .zip(&g.padding)
            .map(|(&s, &p)| s + 2 * p)
            .collect::<Vec<_>>(),
    )
}

/// The geometry's sizes for an input `[N, Cin, *S]` and output channels.
struct Sizes {
    n: usize,
    cin: usize,
    cout: usize,
    /// one output plane
    l: usize,
    /// one padded input plane
    plane: usize,
    /// kernel taps
    k: usize,
    /// whether the input is padded (the shifted GEMMs copy it first)
    padded: bool,
}

impl Sizes {
    fn new(g: &ConvGeom, x: &[usize], cout: usize) -> Sizes {
        let spatial = &x[2.min(x.len())..];
        let out = g.out_spatial(spatial).unwrap_or_default();
        Sizes {
            n: x.first().copied().unwrap_or(0),
            cin: x.get(1).copied().unwrap_or(0),
            cout,
            l: prod(&out),
            plane: padded_plane(g, spatial),
            k: g.kernel_numel(),
            padded: g.padding.iter().any(|&p| p > 0),
        }
    }

    /// The padded input copy the shifted GEMMs read.
    fn padded_input(&self) -> usize {
        if self.padded {
            prod(&[self.n, self.cin, self.plane])
        } else {
            0
        }
    }

    /// The cotangent on the shifted GEMMs' wide layout.
    fn wide(&self) -> usize {
        prod(&[self.n, self.cout, self.plane])
    }

    /// The im2col matrix of `groups` groups: `N (Cin K) L` elements.
    fn cols(&self) -> usize {
        prod(&[self.n, self.cin, self.k, self.l])
    }
}

/// Bytes `op` allocates besides its result, on operands `args`.
pub(super) fn workspace(op: &ConvOp, args: &[Arg], out: &TensorType) -> Workspace {
    let es = out.dtype.size_in_bytes();
    let copies: usize = args.iter().map(Arg::copy_if_strided).sum();
    let dims = |i: usize| args.get(i).map(|a| a.ty.shape.as_slice()).unwrap_or(&[]);
    let elems = match op {
        ConvOp::Conv { geom, groups } => {
            let s = Sizes::new(geom, dims(0), dims(1).first().copied().unwrap_or(0));
            if shift::applies(geom, *groups, s.cin) {
                // the padded input, and each thread's wide output plane
                s.padded_input() + max_threads() * s.cout * s.plane
            } else if *groups == 1 && s.l >= MIN_COLS_LEN {
                s.cols()
            } else {
                // the rows (or columns), and the product before its layout
                s.cols() + out.elem_count()
            }
        }
        ConvOp::GradInput { geom, groups, spatial } => {
            let ct = dims(0);
            let (n, cout) = (ct.first().copied().unwrap_or(0), ct.get(1).copied().unwrap_or(0));
            let cin = dims(1).get(1).copied().unwrap_or(0) * groups;
            let s = Sizes::new(geom, &[&[n, cin], &spatial[..]].concat(), cout);
            if shift::applies(geom, *groups, dims(1).get(1).copied().unwrap_or(0)) {
                // the wide cotangent, and the padded gradient before its crop
                s.wide() + if s.padded { prod(&[n, cin, s.plane]) } else { 0 }
            } else {
                // the transposed cotangent, and the rows twice (the product
                // and its layout for fold)
                prod(&[n, cout, s.l]) + 2 * s.cols()
            }
        }
        ConvOp::GradWeight { geom, groups } => {
            let s = Sizes::new(geom, dims(0), dims(1).get(1).copied().unwrap_or(0));
            if shift::applies(geom, *groups, s.cin) {
                let parts = if s.n >= 2 * max_threads() { max_threads() } else { 1 };
                s.padded_input() + s.wide() + parts * out.elem_count()
            } else if *groups == 1 && s.l < PER_EXAMPLE_GRAD_LEN {
                s.cols() + prod(&[s.n, s.cout, s.l])
            } else {
                // the columns, the cotangent's copy, each example's
                // gradient and their concatenation
                s.cols() + prod(&[s.n, s.cout, s.l]) + 2 * prod(&[s.n, s.cout, s.cin / groups, s.k])
            }
        }
        ConvOp::GradWeightEach(geom) => each_elems(geom, dims(0), dims(1)),
        ConvOp::GradWeightSqNorms(geom) => {
            // a chunk of examples' gradients at a time, with their workspace
            let (x, ct) = (dims(0), dims(1));
            let per = prod(&[
                ct.get(1).copied().unwrap_or(0),
                x.get(1).copied().unwrap_or(0),
                geom.kernel_numel(),
            ]);
            let e = x.first().copied().unwrap_or(0);
            let chunk = (SQ_NORM_CHUNK / per.max(1)).clamp(1, e.max(1));
            let (xc, cc) = (with_lead(x, chunk), with_lead(ct, chunk));
            chunk * per + each_elems(geom, &xc, &cc)
        }
        // im2col and its adjoint write their result only
        ConvOp::Unfold(_) | ConvOp::UnfoldRows(_) | ConvOp::Fold { .. } => 0,
    };
    Workspace {
        copies,
        scratch: elems.saturating_mul(es),
    }
}

/// `dims` with its leading axis `n`.
fn with_lead(dims: &[usize], n: usize) -> Vec<usize> {
    let mut d = dims.to_vec();
    if let Some(first) = d.first_mut() {
        *first = n;
    }
    d
}

/// Elements `GradWeightEach` allocates besides its result.
fn each_elems(geom: &ConvGeom, x: &[usize], ct: &[usize]) -> usize {
    let s = Sizes::new(geom, x, ct.get(1).copied().unwrap_or(0));
    if shift::applies(geom, 1, s.cin) {
        s.padded_input() + s.wide()
    } else {
        s.cols() + prod(&[s.n, s.cout, s.l])
    }
}
