//! Tests of unfold, fold and conv_unfold against direct references, candle
//! and the generic path.

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
                    let g = ConvGeom::uniform(n, k, p, s, d);
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
            let got = unfold(&x, &g, Path::Fast).unwrap();
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
    let cols = unfold(&x, &ConvGeom::uniform(2, 2, 0, 1, 1), Path::Fast).unwrap();
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
            let ux = unfold(&x, &g, Path::Fast).unwrap();
            let y = randn(ux.dims(), DType::F64);
            let lhs = (&ux * &y).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            for fy in [
                fold(&y, &g, &dims[2..], Path::Fast).unwrap(),
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
        let a = fold(&y, &g, &dims[2..], Path::Fast).unwrap();
        let b = fold_generic(&y, &g, &dims[2..]).unwrap();
        assert!(max_diff(&a, &b) < 1e-5, "{g:?}");
    }
}

/// Big enough that `par_blocks` uses several threads (given >1 core).
#[test]
fn multithreaded_matches_generic() {
    let x = randn(&[16, 16, 32, 32], DType::F32);
    for stride in [1, 2] {
        let g = ConvGeom::uniform(2, 3, 1, stride, 1);
        let a = unfold(&x, &g, Path::Fast).unwrap();
        assert_eq!(max_diff(&a, &unfold_generic(&x, &g).unwrap()), 0.0);
        let f = fold(&a, &g, &[32, 32], Path::Fast).unwrap();
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
        (vec![1, 2, 2, 1, 3], ConvGeom::uniform(3, 2, 1, 3, 1)),
    ];
    for (dims, g) in cases {
        let x = randn(&dims, DType::F64);
        let ux = unfold(&x, &g, Path::Fast).unwrap();
        assert_eq!(max_diff(&ux, &naive_unfold(&x, &g)), 0.0, "{g:?}");
        let y = randn(ux.dims(), DType::F64);
        let fy = fold(&y, &g, &dims[2..], Path::Fast).unwrap();
        assert!(max_diff(&fy, &fold_generic(&y, &g, &dims[2..]).unwrap()) < 1e-12);
    }
}

#[test]
fn non_contiguous_inputs() {
    let g = ConvGeom::uniform(2, 3, 1, 2, 1);
    // Transposed (non-contiguous strides).
    let base = randn(&[2, 3, 8, 9], DType::F32);
    let xt = base.transpose(2, 3).unwrap();
    assert!(!xt.is_contiguous());
    let want = naive_unfold(&xt, &g);
    assert_eq!(max_diff(&unfold(&xt, &g, Path::Fast).unwrap(), &want), 0.0);
    // Contiguous but at a non-zero start offset.
    let big = randn(&[5, 3, 9, 8], DType::F64);
    let xo = big.narrow(0, 2, 2).unwrap();
    assert!(xo.is_contiguous() && xo.layout().start_offset() > 0);
    assert_eq!(
        max_diff(&unfold(&xo, &g, Path::Fast).unwrap(), &naive_unfold(&xo, &g)),
        0.0
    );
    // Non-contiguous columns for fold.
    let cols = unfold(&xo, &g, Path::Fast).unwrap();
    let cols_t = cols
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    assert!(!cols_t.is_contiguous());
    let a = fold(&cols_t, &g, &[9, 8], Path::Fast).unwrap();
    assert_eq!(max_diff(&a, &fold(&cols, &g, &[9, 8], Path::Fast).unwrap()), 0.0);
}

/// Dtypes without a kernel take the generic path with the same result.
#[test]
fn other_dtypes_fall_back() {
    let g = ConvGeom::uniform(2, 3, 1, 2, 2);
    let x = randn(&[2, 3, 9, 8], DType::F16);
    let got = unfold(&x, &g, Path::Fast).unwrap();
    assert_eq!(got.dtype(), DType::F16);
    let want = unfold(&x.to_dtype(DType::F32).unwrap(), &g, Path::Fast).unwrap();
    assert_eq!(max_diff(&got, &want), 0.0);
    let w = randn(&[4, 3, 3, 3], DType::F16);
    let y = conv_unfold(&x, &w, &g, 1, Path::Fast).unwrap();
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
                let g = ConvGeom::uniform(1, 3, p, s, d);
                let got = conv_unfold(&x, &w, &g, groups, Path::Fast).unwrap();
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
                let g = ConvGeom::uniform(2, 3, p, s, d);
                let got = conv_unfold(&x, &w, &g, groups, Path::Fast).unwrap();
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
                let got = conv_unfold(&x, &w, &g, groups, Path::Fast).unwrap();
                let want = naive_conv3d(&x, &w, &g, groups);
                assert!(max_diff(&got, &want) < conv_tol(dtype), "{g:?} groups {groups}");
            }
        }
    }
}

/// fold's backward is unfold: d<fold(y), z>/dy = unfold(z).
#[test]
fn fold_gradient_is_unfold() {
    let g = ConvGeom::uniform(2, 3, 1, 2, 1);
    let z = randn(&[2, 3, 9, 8], DType::F64);
    let y = Var::from_tensor(&unfold(&randn(&[2, 3, 9, 8], DType::F64), &g, Path::Fast).unwrap()).unwrap();
    let loss = (fold(&y, &g, &[9, 8], Path::Fast).unwrap() * &z)
        .unwrap()
        .sum_all()
        .unwrap();
    let grad = loss.backward().unwrap();
    assert!(max_diff(grad.get(&y).unwrap(), &unfold(&z, &g, Path::Fast).unwrap()) < 1e-12);
}

fn err(r: Result<Tensor>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn bad_shapes_are_errors() {
    let x = randn(&[2, 3, 5, 5], DType::F32);
    let g2 = ConvGeom::uniform(2, 3, 0, 1, 1);
    // Wrong rank.
    assert!(err(unfold(&x, &ConvGeom::uniform(1, 3, 0, 1, 1), Path::Fast)).contains("unfold"));
    // Mismatched vector lengths, zero stride, too many dims.
    let mut bad = g2.clone();
    bad.padding = vec![0];
    assert!(err(unfold(&x, &bad, Path::Fast)).contains("entries"));
    assert!(err(unfold(&x, &ConvGeom::uniform(2, 3, 0, 0, 1), Path::Fast)).contains("positive"));
    assert!(ConvGeom::uniform(4, 1, 0, 1, 1).out_spatial(&[1; 4]).is_err());
    // Window larger than the padded input.
    assert!(err(unfold(&x, &ConvGeom::uniform(2, 4, 0, 1, 2), Path::Fast)).contains("spans"));
    assert!(err(unfold_generic(&x, &ConvGeom::uniform(2, 6, 0, 1, 1))).contains("spans"));
    // fold: wrong L, wrong rank, rows not a multiple of prod(kernel).
    let cols = unfold(&x, &g2, Path::Fast).unwrap();
    assert!(err(fold(&cols, &g2, &[6, 5], Path::Fast)).contains("fold"));
    assert!(err(fold(&x, &g2, &[5, 5], Path::Fast)).contains("rank 3"));
    assert!(err(fold_generic(&cols.narrow(1, 0, 10).unwrap(), &g2, &[5, 5])).contains("fold"));
    // conv: channel/group mismatches and kernel mismatch.
    let w = randn(&[4, 3, 3, 3], DType::F32);
    assert!(err(conv_unfold(&x, &w, &g2, 3, Path::Fast)).contains("groups"));
    assert!(err(conv_unfold(&x, &w, &g2, 0, Path::Fast)).contains("groups"));
    assert!(err(conv_unfold(&x, &w, &ConvGeom::uniform(2, 2, 0, 1, 1), 1, Path::Fast)).contains("kernel"));
}

#[test]
fn out_spatial_formula() {
    let g = geom(&[3, 2], &[2, 1], &[1, 0], &[2, 1]);
    // (10 + 2 - 2*2 - 1)/2 + 1 = 4; (7 - 1 - 1)/1 + 1 = 6.
    assert_eq!(g.out_spatial(&[10, 7]).unwrap(), vec![4, 6]);
    // Padding alone can make room for an empty input.
    assert_eq!(ConvGeom::uniform(1, 1, 1, 1, 1).out_spatial(&[0]).unwrap(), vec![2]);
    let x = Tensor::zeros((1, 2, 0), DType::F32, CPU).unwrap();
    let cols = unfold(&x, &ConvGeom::uniform(1, 1, 1, 1, 1), Path::Fast).unwrap();
    assert_eq!(cols.dims(), &[1, 2, 2]);
}
