//! The convolution family's primitives: convolutions, unfold / fold and
//! the two convolution gradients. Their rules live in `crate::rules::conv`.

use super::ConvGeom;

/// Convolution-family primitives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ConvOp {
    /// `conv(x [N, Cin, *S], w [Cout, Cin/groups, *k]) -> [N, Cout, *O]`
    /// (PyTorch semantics, no bias; `geom.kernel` equals w's spatial dims).
    Conv {
        /// Window geometry; its length is the number of spatial dims.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
    },
    /// `unfold(x [N, C, *S]) -> [N, C * prod(k), L]` (PyTorch's `F.unfold`
    /// order: channel outermost, then kernel offsets).
    Unfold(ConvGeom),
    /// `unfold_rows(x [N, C, *S]) -> [N, L, C * prod(k)]`: unfold with one
    /// row per output position, so a batch of convolutions is one GEMM
    /// with a contiguous operand (`kernels::rows`).
    UnfoldRows(ConvGeom),
    /// col2im, the adjoint of unfold: `[N, C * prod(k), L] -> [N, C, *spatial]`.
    Fold {
        /// Window geometry.
        geom: ConvGeom,
        /// Spatial size of the result.
        spatial: Vec<usize>,
    },
    /// The gradient of `conv` with respect to its input, a transposed
    /// convolution: `(ct [N, Cout, *O], w [Cout, Cin/groups, *k]) -> [N, Cin, *spatial]`.
    GradInput {
        /// Window geometry of the forward convolution.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
        /// Spatial size of the forward input.
        spatial: Vec<usize>,
    },
    /// The gradient of `conv` with respect to its weight:
    /// `(x [N, Cin, *S], ct [N, Cout, *O]) -> [Cout, Cin/groups, *k]`,
    /// summed over the `N` examples.
    GradWeight {
        /// Window geometry of the forward convolution.
        geom: ConvGeom,
        /// Channel groups.
        groups: usize,
    },
    /// The weight gradient of an ungrouped `conv` for each example, not
    /// summed: `(x [E, Cin, *S], ct [E, Cout, *O]) -> [E, Cout, Cin, *k]`.
    /// The `Unfold` route's per-sample weight gradient.
    GradWeightEach(ConvGeom),
    /// Each example's squared weight-gradient norm, `||GradWeightEach[e]||²`:
    /// `(x [E, Cin, *S], ct [E, Cout, *O]) -> [E]`, computed a few examples
    /// at a time so the per-example gradients never all exist at once (the
    /// DP clipping step's norm of a convolution).
    GradWeightSqNorms(ConvGeom),
}

impl ConvOp {
    pub(crate) fn name(&self) -> String {
        match self {
            ConvOp::Conv { geom, groups } => {
                format!("conv{}d[{}{}]", geom.kernel.len(), geom_str(geom), groups_str(*groups))
            }
            ConvOp::Unfold(geom) => format!("unfold{}d[{}]", geom.kernel.len(), geom_str(geom)),
            ConvOp::UnfoldRows(geom) => format!("unfold_rows{}d[{}]", geom.kernel.len(), geom_str(geom)),
            ConvOp::Fold { geom, spatial } => {
                format!("fold{}d[{},size={spatial:?}]", geom.kernel.len(), geom_str(geom))
            }
            ConvOp::GradInput { geom, groups, spatial } => format!(
                "conv{}d_grad_input[{}{},size={spatial:?}]",
                geom.kernel.len(),
                geom_str(geom),
                groups_str(*groups)
            ),
            ConvOp::GradWeightEach(geom) => {
                format!("conv{}d_grad_weight_each[{}]", geom.kernel.len(), geom_str(geom))
            }
            ConvOp::GradWeightSqNorms(geom) => {
                format!("conv{}d_grad_weight_sq_norms[{}]", geom.kernel.len(), geom_str(geom))
            }
            ConvOp::GradWeight { geom, groups } => {
                format!(
                    "conv{}d_grad_weight[{}{}]",
                    geom.kernel.len(),
                    geom_str(geom),
                    groups_str(*groups)
                )
            }
        }
    }
}

pub(crate) fn geom_str(g: &ConvGeom) -> String {
    format!("k={:?},s={:?},p={:?},d={:?}", g.kernel, g.stride, g.padding, g.dilation)
}

pub(crate) fn groups_str(groups: usize) -> String {
    if groups == 1 {
        String::new()
    } else {
        format!(",g={groups}")
    }
}
