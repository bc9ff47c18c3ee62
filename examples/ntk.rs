//! The empirical neural tangent kernel of a small CNN, as in the
//! torch.func NTK tutorial, two ways:
//!
//! * Jacobian contraction: each example's Jacobian of the logits with
//!   respect to all parameters (`vmap(jacrev)`), then
//!   `ntk[i, j, a, b] = <J(x1_i)[a], J(x2_j)[b]>`;
//! * NTK-vector products: for each pair of examples and each basis vector
//!   `e_a` of the logits, a VJP at `x1_i` (a gradient of `<f(x1_i), e_a>`)
//!   pushed forward at `x2_j` by a JVP, all under `vmap`; no Jacobian is
//!   stored.
//!
//! ```text
//! cargo run --release --example ntk
//! ```
//! Both give the same kernel; the times are medians of 5 runs.
mod common;

use candle_core::{Device, Tensor};
use candle_func::nn::Module;
use common::ntk::{by_contraction, by_products, cnn};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let (_vm, model) = common::models::build(cnn)?;
    let p = model.params();
    let (x1, x2) = (
        Tensor::randn(0f32, 1., (20, 3, 16, 16), &dev)?,
        Tensor::randn(0f32, 1., (5, 3, 16, 16), &dev)?,
    );
    // the code of both methods is in examples/common/ntk.rs
    let (full, vps) = (by_contraction(&model), by_products(&model));
    let k_full = full(&p, &x1, &x2)?;
    let k_vps = vps(&p, &x1, &x2)?;
    let diff = (&k_full - &k_vps)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = k_full.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    println!("empirical NTK [N1, N2, classes, classes] = {:?}", k_full.dims());
    println!("the two methods agree: max difference {diff:.2e} (scale {scale:.2e})");
    let t_full = common::median_ms(5, || full(&p, &x1, &x2).map(|_| ()))?;
    let t_vps = common::median_ms(5, || vps(&p, &x1, &x2).map(|_| ()))?;
    println!(
        "Jacobian contraction: {t_full:.1} ms; NTK-vector products: {t_vps:.1} ms ({})",
        common::allocator()
    );
    assert!(diff <= 1e-3 * scale.max(1.0), "the two NTKs differ");
    Ok(())
}
