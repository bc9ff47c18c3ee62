//! The convolution family: convolutions (1D, 2D, 3D; stride, padding,
//! dilation, groups), unfold / fold (im2col / col2im) and the two
//! convolution gradients, whose rules close the family under
//! differentiation.
//!
//! One room per concern: shape rules (`infer`), how each primitive runs on
//! candle and the CPU kernels (`cpu`), the batching rules with the conv
//! routes (`batch`), the VJP rules (`vjp`), and what each primitive
//! allocates while it runs (`workspace`).

mod batch;
mod cpu;
mod infer;
mod vjp;
mod workspace;

use super::facts::{Arg, Facts, Workspace};
use super::{multilinear_jvp, BVal, BatchCx, Builder, Cts, Rule, RunCx, Tan};
use crate::error::Result;
use crate::ir::conv::ConvOp;
use crate::ir::{ConvGeom, Prim, TensorType, VarId};
use candle_core::Tensor;

impl Rule for ConvOp {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        infer::infer(self, args)
    }

    fn facts(&self, _args: &[Arg], _out: &TensorType) -> Facts {
        Facts {
            epilogue: matches!(self, ConvOp::Conv { .. }),
            ..Facts::costly()
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        workspace::workspace(self, args, out)
    }

    fn run(&self, args: &[&Tensor], _out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        cpu::run(self, args, cx.copies, cx.path)
    }

    fn batch(&self, cx: &mut BatchCx, args: &[BVal]) -> Result<Option<BVal>> {
        batch::batch(self, cx, args).map(Some)
    }

    fn vjp(&self, b: &mut Builder, args: &[VarId], _out: VarId, ct: VarId) -> Result<Option<Cts>> {
        vjp::vjp(self, b, args, ct).map(Some)
    }

    fn jvp(&self, b: &mut Builder, args: &[VarId], tans: &[Tan], _out: VarId) -> Result<Option<Tan>> {
        if let ConvOp::GradWeightSqNorms(_) = self {
            return Ok(None); // quadratic: no multilinear rule
        }
        // a convolution and its gradients are bilinear in their two
        // operands; unfold and fold are linear
        let linear: &[usize] = if args.len() == 2 { &[0, 1] } else { &[0] };
        multilinear_jvp(b, &Prim::Conv(self.clone()), args, tans, linear).map(Some)
    }
}

/// The input-gradient primitive of a convolution with this geometry.
pub(super) fn grad_input(geom: &ConvGeom, groups: usize, spatial: Vec<usize>) -> Prim {
    Prim::Conv(ConvOp::GradInput {
        geom: geom.clone(),
        groups,
        spatial,
    })
}
