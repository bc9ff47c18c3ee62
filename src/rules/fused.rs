//! The fused product-and-epilogue primitive,
//! `relu?(permute?(reshape?(base(x, w))) + bias?)` (made by the fusion pass,
//! `interp::passes`, on graphs about to run). On the CPU the epilogue runs
//! in place on the product's output (`kernels::epilogue`), in the
//! product's own layout: the reshape is a view of the fresh output, and
//! the bias is read through the inverse of the permute, which is applied
//! to the result as a view last. Elsewhere, or for other dtypes, it runs
//! as the add and the ReLU it replaced, through their own rules.

use super::facts::{bytes, Arg, Facts, Storage, Workspace};
use super::{arity, broadcast_shapes, rule, BVal, BatchCx, Builder, Cts, Rule, RunCx};
use crate::error::{CandleContext, Error, Result};
use crate::ir::ops::{Binary, ShapeOp, Unary};
use crate::ir::{Fused, TensorType, VarId};
use crate::kernels::epilogue;
use candle_core::Tensor;

impl Fused {
    /// The product's rules and its own result type (before the view).
    fn product(&self, args: &[Arg]) -> Option<(&dyn Rule, TensorType)> {
        let r = rule(&self.base).ok()?;
        let types: Vec<&TensorType> = args.get(..2)?.iter().map(|a| a.ty).collect();
        Some((r, r.infer(&types).ok()?))
    }
}

impl Rule for Fused {
    fn infer(&self, args: &[&TensorType]) -> Result<TensorType> {
        arity("fused", args, 2 + usize::from(self.bias))?;
        let mut y = rule(&self.base)?.infer(&args[..2])?;
        if let Some(shape) = &self.view {
            y = ShapeOp::Reshape(shape.clone()).infer(&[&y])?;
        }
        if let Some(p) = &self.perm {
            y = ShapeOp::Permute(p.clone()).infer(&[&y])?;
        }
        if let Some(b) = args.get(2) {
            let (ys, bs) = (y.shape.as_slice(), b.shape.as_slice());
            if b.dtype != y.dtype || broadcast_shapes("fused", bs, ys)? != ys {
                return Err(Error::shape(
                    "fused",
                    &[ys, bs],
                    "the bias must broadcast to the product's shape",
                ));
            }
        }
        Ok(y)
    }

    fn facts(&self, args: &[Arg], _out: &TensorType) -> Facts {
        // the product's facts: an epilogue adds nothing a pass reads
        let base = self.product(args).map(|(r, ty)| r.facts(&args[..2], &ty));
        let base = base.unwrap_or(Facts::costly());
        Facts {
            epilogue: false,
            // a permuted result is a strided view of the product's buffer
            storage: if self.perm.is_some() {
                Storage::Strided
            } else {
                base.storage
            },
            ..base
        }
    }

    fn workspace(&self, args: &[Arg], out: &TensorType) -> Workspace {
        // the product's, and where the epilogue cannot run in place (off the
        // CPU, other dtypes) the add and the ReLU as separate results
        let base = self
            .product(args)
            .map_or(Workspace::NONE, |(r, ty)| r.workspace(&args[..2], &ty));
        let unfused = if matches!(out.dtype, candle_core::DType::F32 | candle_core::DType::F64) {
            0
        } else {
            usize::from(self.bias) + usize::from(self.relu)
        };
        Workspace {
            scratch: base.scratch.saturating_add(unfused.saturating_mul(bytes(out))),
            ..base
        }
    }

    fn run(&self, args: &[&Tensor], out: &TensorType, cx: &RunCx) -> Result<Tensor> {
        let name = self.name();
        let base = rule(&self.base)?;
        // the product's own type, then views of its fresh output
        let ty = base.infer(&[&TensorType::of(args[0]), &TensorType::of(args[1])])?;
        let mut y = base.run(&args[..2], &ty, cx)?;
        if let Some(shape) = &self.view {
            y = y.reshape(shape.as_slice()).op(&name)?;
        }
        let bias = args.get(2).copied();
        if epilogue::applies(&y, bias, cx.path) {
            // `y` is the product's fresh output, read by nothing else yet;
            // the bias is laid over it as the permute would lay it
            let bias = match (bias, &self.perm) {
                (Some(b), Some(p)) => Some(
                    b.broadcast_as(out.shape.as_slice())
                        .and_then(|b| b.permute(inverse(p)))
                        .op(&name)?,
                ),
                (b, _) => b.cloned(),
            };
            epilogue::apply(&y, bias.as_ref(), self.relu).op(&name)?;
            return match &self.perm {
                Some(p) => y.permute(p.as_slice()).op(&name),
                None => Ok(y),
            };
        }
        if let Some(p) = &self.perm {
            y = y.permute(p.as_slice()).op(&name)?;
        }
        let y = match bias {
            Some(b) => Binary::Add.run(&[&y, b], out, cx)?,
            None => y,
        };
        if self.relu {
            return Unary::Relu.run(&[&y], out, cx);
        }
        Ok(y)
    }

    fn batch(&self, _cx: &mut BatchCx, _args: &[BVal]) -> Result<Option<BVal>> {
        Err(Error::internal(
            "fused",
            "fused nodes are made after every transform and have no batching rule",
        ))
    }

    fn vjp(&self, _b: &mut Builder, _args: &[VarId], _out: VarId, _ct: VarId) -> Result<Option<Cts>> {
        Err(Error::internal(
            "fused",
            "fused nodes are made after every transform and have no VJP rule",
        ))
    }
}

/// The permutation that undoes `p`.
fn inverse(p: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; p.len()];
    for (i, &a) in p.iter().enumerate() {
        inv[a] = i;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Prim;
    use candle_core::DType;

    /// A bias that would grow the product, or of another dtype, is refused
    /// by name; the missing transform rules are errors, not panics.
    #[test]
    fn checks_its_operands_and_refuses_transforms() {
        let f = Fused {
            base: Prim::Matmul,
            view: None,
            perm: None,
            bias: true,
            relu: true,
        };
        let t = |s: &[usize], dt| TensorType::new(s.to_vec(), dt);
        let (x, w) = (t(&[6, 7], DType::F32), t(&[7, 4], DType::F32));
        assert_eq!(f.infer(&[&x, &w, &t(&[4], DType::F32)]).unwrap().shape, vec![6, 4]);
        for bad in [t(&[2, 6, 4], DType::F32), t(&[4], DType::F64), t(&[5], DType::F32)] {
            let e = f.infer(&[&x, &w, &bad]).unwrap_err().to_string();
            assert!(e.contains("fused"), "{e}");
        }
        assert!(f.infer(&[&x, &w]).is_err());
        let b = crate::rules::Builder::scratch(
            crate::ir::Options::new(),
            crate::rules::TraceCtx::new(candle_core::Device::Cpu, crate::rules::infer),
        );
        let mut b = b.borrow_mut();
        let v = b.input(x.clone());
        let e = f.vjp(&mut b, &[v, v], v, v).unwrap_err().to_string();
        assert!(e.contains("no VJP rule"), "{e}");
    }
}
