//! Shape rules of the convolution family, checked while tracing.

use crate::error::{Error, Result};
use crate::ir::conv::ConvOp;
use crate::ir::{ConvGeom, TensorType};
use crate::rules::{arity, checked_product, same_dtype};

/// The result type of `op(args)`.
pub(super) fn infer(op: &ConvOp, args: &[&TensorType]) -> Result<TensorType> {
    match op {
        ConvOp::Conv { geom, groups } => infer_conv(geom, *groups, args),
        ConvOp::Unfold(geom) => {
            arity("unfold", args, 1)?;
            let x = args[0].shape.as_slice();
            let l = checked_product("unfold", &[x], &out_spatial("unfold", geom, x)?)?;
            let ck = checked_product("unfold", &[x], &[x[1], geom.kernel_numel()])?;
            Ok(args[0].with_shape(vec![x[0], ck, l]))
        }
        ConvOp::UnfoldRows(geom) => {
            arity("unfold_rows", args, 1)?;
            let x = args[0].shape.as_slice();
            let l = checked_product("unfold_rows", &[x], &out_spatial("unfold_rows", geom, x)?)?;
            let ck = checked_product("unfold_rows", &[x], &[x[1], geom.kernel_numel()])?;
            Ok(args[0].with_shape(vec![x[0], l, ck]))
        }
        ConvOp::Fold { geom, spatial } => infer_fold(geom, spatial, args),
        ConvOp::GradInput { geom, groups, spatial } => infer_grad_input(geom, *groups, spatial, args),
        ConvOp::GradWeight { geom, groups } => infer_grad_weight(geom, *groups, args),
        ConvOp::GradWeightEach(geom) => {
            let w = infer_grad_weight(geom, 1, args)?;
            Ok(w.with_shape([&[args[0].shape[0]], &w.shape[..]].concat()))
        }
        ConvOp::GradWeightSqNorms(geom) => {
            let w = infer_grad_weight(geom, 1, args)?;
            Ok(w.with_shape(vec![args[0].shape[0]]))
        }
    }
}

pub(super) fn out_spatial(op: &'static str, geom: &ConvGeom, x: &[usize]) -> Result<Vec<usize>> {
    let nd = geom.kernel.len();
    if !(1..=3).contains(&nd) || x.len() != nd + 2 {
        return Err(Error::shape(
            op,
            &[x],
            format!("a {nd}-D window needs an input of rank {}", nd + 2),
        ));
    }
    geom.fit(&x[2..]).map_err(|why| Error::shape(op, &[x], why))
}

fn infer_conv(geom: &ConvGeom, groups: usize, args: &[&TensorType]) -> Result<TensorType> {
    arity("conv", args, 2)?;
    let dt = same_dtype("conv", args)?;
    if !dt.is_float() {
        return Err(Error::DType {
            op: "conv",
            dtypes: vec![dt],
            msg: "convolutions need floating-point operands".into(),
        });
    }
    let (x, w) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    if let Some(why) = conv_misfit(geom, groups, x, w) {
        return Err(Error::shape("conv", &[x, w], why));
    }
    let mut out = vec![x[0], w[0]];
    out.extend(out_spatial("conv", geom, x)?);
    Ok(TensorType::new(out, dt))
}

fn infer_fold(geom: &ConvGeom, spatial: &[usize], args: &[&TensorType]) -> Result<TensorType> {
    arity("fold", args, 1)?;
    let c = args[0].shape.as_slice();
    let k: usize = geom.kernel_numel();
    let o = geom.fit(spatial).map_err(|why| Error::shape("fold", &[c], why))?;
    let l = checked_product("fold", &[c], &o)?;
    if c.len() != 3 || k == 0 || !c[1].is_multiple_of(k) || c[2] != l || spatial.len() != geom.kernel.len() {
        return Err(Error::shape(
            "fold",
            &[c],
            format!("expected [N, C*{k}, {l}] for size {spatial:?}"),
        ));
    }
    Ok(args[0].with_shape([&[c[0], c[1] / k], spatial].concat()))
}

fn infer_grad_input(geom: &ConvGeom, groups: usize, spatial: &[usize], args: &[&TensorType]) -> Result<TensorType> {
    arity("conv_grad_input", args, 2)?;
    let dt = same_dtype("conv_grad_input", args)?;
    let (ct, w) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    let x = [
        &[
            ct.first().copied().unwrap_or(0),
            w.get(1).copied().unwrap_or(0).checked_mul(groups).ok_or_else(|| {
                Error::shape(
                    "conv_grad_input",
                    &[ct, w],
                    format!("{groups} groups overflow the channels"),
                )
            })?,
        ],
        spatial,
    ]
    .concat();
    let want = infer_conv(geom, groups, &[&TensorType::new(x.clone(), dt), args[1]])?;
    if want.shape != ct {
        return Err(Error::shape(
            "conv_grad_input",
            &[ct, w],
            format!("expected a cotangent of shape {:?}", want.shape),
        ));
    }
    Ok(TensorType::new(x, dt))
}

fn infer_grad_weight(geom: &ConvGeom, groups: usize, args: &[&TensorType]) -> Result<TensorType> {
    arity("conv_grad_weight", args, 2)?;
    let dt = same_dtype("conv_grad_weight", args)?;
    let (x, ct) = (args[0].shape.as_slice(), args[1].shape.as_slice());
    if x.len() < 2 || ct.len() < 2 || groups == 0 || x[1] % groups != 0 {
        return Err(Error::shape(
            "conv_grad_weight",
            &[x, ct],
            format!("bad operands for {groups} groups"),
        ));
    }
    let w = [&[ct[1], x[1] / groups], &geom.kernel[..]].concat();
    let want = infer_conv(geom, groups, &[args[0], &TensorType::new(w.clone(), dt)])?;
    if want.shape != ct {
        return Err(Error::shape(
            "conv_grad_weight",
            &[x, ct],
            format!("expected a cotangent of shape {:?}", want.shape),
        ));
    }
    Ok(TensorType::new(w, dt))
}

/// Why input `x` and weight `w` do not make a convolution, in the user's
/// terms (which size disagrees with which), or `None` if they do.
fn conv_misfit(geom: &ConvGeom, groups: usize, x: &[usize], w: &[usize]) -> Option<String> {
    let nd = geom.kernel.len();
    if w.len() != nd + 2 || x.len() != nd + 2 {
        // The usual cause under vmap: the closure sees one example, without
        // the N axis a convolution wants.
        let hint = if x.len() + 1 == nd + 2 {
            "; the input has no N axis: inside vmap the function sees one example, so add one with x.unsqueeze(0)"
        } else {
            ""
        };
        return Some(format!(
            "a {nd}-d convolution takes an input [N, C, ..{nd} dims] and a weight [Cout, C/groups, ..{nd} dims]{hint}"
        ));
    }
    if groups == 0 {
        return Some("groups must be positive, got 0".into());
    }
    if w[2..] != geom.kernel[..] {
        return Some(format!(
            "the weight's kernel {:?} is not the geometry's {:?}",
            &w[2..],
            geom.kernel
        ));
    }
    if w[1].checked_mul(groups) != Some(x[1]) {
        return Some(format!(
            "the input has {} channels but the weight takes {} per group x {groups} groups = {}",
            x[1],
            w[1],
            w[1].saturating_mul(groups)
        ));
    }
    if !w[0].is_multiple_of(groups) {
        return Some(format!(
            "the weight's {} output channels are not divisible by groups = {groups}",
            w[0]
        ));
    }
    None
}
