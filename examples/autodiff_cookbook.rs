//! A short autodiff cookbook (after JAX's): the Jacobian of an MLP's logits
//! with respect to its input both ways, the Hessian of its loss, and a
//! Hessian-vector product without the Hessian, each checked against the
//! others.
//!
//! ```text
//! cargo run --release --example autodiff_cookbook
//! ```
mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::tracer::Operand;
use candle_func::{hessian, hvp, jacfwd, jacrev, jit, jvp, vmap, Tracer};

fn max_abs(t: &Tensor) -> candle_core::Result<f64> {
    t.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let (w1, w2) = (
        Tensor::randn(0f64, 0.3, (32, 8), &dev)?,
        Tensor::randn(0f64, 0.3, (3, 32), &dev)?,
    );
    // one example's logits: 8 inputs -> 32 tanh units -> 3 classes
    let logits = |x: Tracer| -> candle_func::Result<Tracer> {
        let h = w1.to_tracer(&x)?.matmul(&x.unsqueeze(1)?)?.tanh()?;
        w2.to_tracer(&x)?.matmul(&h)?.squeeze(1)
    };
    let loss = |x: Tracer| logits(x)?.log_softmax(0)?.narrow(0, 1, 1)?.neg()?.sum_all();
    let x = Tensor::randn(0f64, 1., 8, &dev)?;

    // Jacobians [3, 8]: reverse mode (3 VJPs) and forward mode (8 JVPs)
    let jr = jit(jacrev(logits)).call(&x)?;
    let jf = jit(jacfwd(logits)).call(&x)?;
    println!(
        "Jacobian {:?}: jacrev vs jacfwd differ by {:.1e}",
        jr.dims(),
        max_abs(&(&jr - &jf)?)?
    );

    // a JVP is one column combination of the Jacobian
    let u = Tensor::randn(0f64, 1., 8, &dev)?;
    let (_, ju) = jvp(&logits, &x, &u)?;
    let want = jr.matmul(&u.unsqueeze(1)?)?.squeeze(1)?;
    println!("J u by jvp vs by the Jacobian: {:.1e}", max_abs(&(&ju - &want)?)?);

    // the Hessian of the loss [8, 8], and H u without forming it
    let h = jit(hessian(loss)).call(&x)?;
    let hu = hvp(&loss, &x, &u)?;
    let want = h.matmul(&u.unsqueeze(1)?)?.squeeze(1)?;
    println!(
        "Hessian {:?}: symmetric to {:.1e}; hvp vs H u: {:.1e}",
        h.dims(),
        max_abs(&(&h - h.t()?)?)?,
        max_abs(&(&hu - &want)?)?
    );

    // per-example Jacobians of a batch, by vmap
    let xs = Tensor::randn(0f64, 1., (16, 8), &dev)?;
    let per = vmap(jacrev(logits)).call(&xs)?;
    let one = jit(jacrev(logits)).call(xs.get(5)?)?;
    println!(
        "per-example Jacobians {:?}: example 5 vs alone: {:.1e}",
        per.dims(),
        max_abs(&(per.get(5)? - one)?)?
    );
    Ok(())
}
