//! The shifted-GEMM kernels against im2col, and what they refuse.
use super::*;
use crate::kernels::max_diff;
use crate::kernels::unfold::{conv_unfold, fold, unfold};
use candle_core::{DType, Device};

/// The forward against im2col + matmul, and both gradients against
/// their im2col forms, for 1-, 2- and 3-d kernels with padding and
/// dilation, batches above and below the threading threshold, f32 and
/// f64.
#[test]
fn matches_im2col() -> Result<()> {
    // (cases with fewer than FOLD_BELOW channels fold their kernel lines;
    // the one with 64 does not)
    let cases: [(ConvGeom, Vec<usize>, usize); 6] = [
        (ConvGeom::uniform(2, 3, 1, 1, 1), vec![2, 64, 5, 6], 3),
        (ConvGeom::uniform(2, 3, 0, 1, 1), vec![6, 8, 9, 7], 5),
        (ConvGeom::uniform(2, 3, 1, 1, 2), vec![1, 9, 8, 10], 3),
        (
            ConvGeom {
                kernel: vec![2, 3],
                stride: vec![1, 1],
                padding: vec![1, 0],
                dilation: vec![1, 1],
            },
            vec![2, 8, 5, 6],
            4,
        ),
        (ConvGeom::uniform(1, 4, 2, 1, 1), vec![5, 10, 12], 6),
        (ConvGeom::uniform(3, 2, 0, 1, 1), vec![4, 8, 4, 5, 3], 3),
    ];
    for dt in [DType::F32, DType::F64] {
        for (g, xs, cout) in &cases {
            let dev = &Device::Cpu;
            let x = Tensor::randn(0f32, 1., xs.as_slice(), dev)?.to_dtype(dt)?;
            let w = Tensor::randn(0f32, 1., [&[*cout, xs[1]], &g.kernel[..]].concat(), dev)?.to_dtype(dt)?;
            let y = conv(&x, &w, g)?;
            let want = conv_unfold(&x, &w, g, 1, Path::Fast)?;
            assert!(max_diff(&y, &want)? < 1e-4, "conv {g:?}");
            let ct = Tensor::randn(0f32, 1., y.dims(), dev)?.to_dtype(dt)?;
            // dx = fold(w^T @ ct), dw = sum_n ct @ unfold(x)^T
            let (n, l) = (xs[0], y.elem_count() / (xs[0] * cout));
            let w2 = w.reshape((*cout, ()))?;
            let c3 = ct.reshape((n, *cout, l))?;
            let cols = w2.t()?.broadcast_matmul(&c3)?;
            let dx_want = fold(&cols, g, &xs[2..], Path::Fast)?;
            assert!(
                max_diff(&grad_input(&ct, &w, g, &xs[2..])?, &dx_want)? < 1e-4,
                "dx {g:?}"
            );
            let each = c3.matmul(&unfold(&x, g, Path::Fast)?.transpose(1, 2)?)?;
            let each_want = each.reshape([&[n], w.dims()].concat())?;
            assert!(
                max_diff(&grad_weight_each(&x, &ct, g)?, &each_want)? < 1e-3,
                "dw each {g:?}"
            );
            let dw_want = each.sum(0)?.reshape(w.dims())?;
            assert!(max_diff(&grad_weight(&x, &ct, g)?, &dw_want)? < 1e-3, "dw {g:?}");
        }
    }
    Ok(())
}

#[test]
fn refuses_what_it_does_not_cover() -> Result<()> {
    let dev = &Device::Cpu;
    let x = Tensor::zeros((1, 8, 6, 6), DType::F32, dev)?;
    let w = Tensor::zeros((2, 8, 3, 3), DType::F32, dev)?;
    assert!(conv(&x, &w, &ConvGeom::uniform(2, 3, 0, 2, 1)).is_err()); // stride 2
    let x4 = Tensor::zeros((1, 4, 6, 6), DType::F32, dev)?;
    let w4 = Tensor::zeros((2, 4, 3, 3), DType::F32, dev)?;
    assert!(conv(&x4, &w4, &ConvGeom::uniform(2, 3, 0, 1, 1)).is_err()); // few channels
    assert!(!applies(&ConvGeom::uniform(2, 3, 0, 1, 1), 2, 16));
    Ok(())
}
