//! The benchmark models of `../shared/peers/models.py`, as `nn` layers.
// Each example uses a few of them.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, Activation, ConvConfig, MaxPool2d, Sequential};
use candle_nn::{VarBuilder, VarMap};

/// The PyTorch per-sample-gradients tutorial's CNN: conv 1->32 k3, conv
/// 32->64 k3, max-pool 2, linear 9216->128->10 (28x28 inputs).
pub fn cnn_t(vb: VarBuilder) -> candle_func::Result<Sequential> {
    Ok(nn::seq()
        .add(nn::conv2d(1, 32, 3, Default::default(), vb.pp("conv1"))?)
        .add(Activation::Relu)
        .add(nn::conv2d(32, 64, 3, Default::default(), vb.pp("conv2"))?)
        .add(Activation::Relu)
        .add(MaxPool2d { kernel: 2, stride: 2 })
        .add(nn::Flatten)
        .add(nn::linear(9216, 128, vb.pp("fc1"))?)
        .add(Activation::Relu)
        .add(nn::linear(128, 10, vb.pp("fc2"))?))
}

/// The Opacus MNIST example's CNN: conv 1->16 k8 s2 p3, max-pool k2 s1,
/// conv 16->32 k4 s2, max-pool k2 s1, linear 512->32->10 (28x28 inputs).
pub fn cnn_o(vb: VarBuilder) -> candle_func::Result<Sequential> {
    let c1 = ConvConfig {
        padding: 3,
        stride: 2,
        ..Default::default()
    };
    let c2 = ConvConfig {
        stride: 2,
        ..Default::default()
    };
    Ok(nn::seq()
        .add(nn::conv2d(1, 16, 8, c1, vb.pp("conv1"))?)
        .add(Activation::Relu)
        .add(MaxPool2d { kernel: 2, stride: 1 })
        .add(nn::conv2d(16, 32, 4, c2, vb.pp("conv2"))?)
        .add(Activation::Relu)
        .add(MaxPool2d { kernel: 2, stride: 1 })
        .add(nn::Flatten)
        .add(nn::linear(512, 32, vb.pp("fc1"))?)
        .add(Activation::Relu)
        .add(nn::linear(32, 10, vb.pp("fc2"))?))
}

/// The conv3d net: conv3d 1->8 k3, conv3d 8->16 k3, linear to 10 (16^3 inputs).
pub fn c3d(vb: VarBuilder) -> candle_func::Result<Sequential> {
    Ok(nn::seq()
        .add(nn::conv3d(1, 8, 3, Default::default(), vb.pp("conv1"))?)
        .add(Activation::Relu)
        .add(nn::conv3d(8, 16, 3, Default::default(), vb.pp("conv2"))?)
        .add(Activation::Relu)
        .add(nn::Flatten)
        .add(nn::linear(16 * 12 * 12 * 12, 10, vb.pp("fc"))?))
}

/// The torch.func model-ensembling tutorial's MLP: 784 -> 128 -> 128 -> 10
/// with ReLUs (inputs `[B, 784]`).
pub fn mlp(vb: VarBuilder) -> candle_func::Result<Sequential> {
    Ok(nn::seq()
        .add(nn::linear(784, 128, vb.pp("fc1"))?)
        .add(Activation::Relu)
        .add(nn::linear(128, 128, vb.pp("fc2"))?)
        .add(Activation::Relu)
        .add(nn::linear(128, 10, vb.pp("fc3"))?))
}

/// `tiny_lm` at the size of `benches/peers/bench_lm.py` (V=64, D=64, H=4,
/// L=2, F=256, T=64), a GPT of `nn::gpt` with LayerNorm and GELU, and a
/// batch of `b` token sequences with their targets (`[b, 64]` each).
pub fn tiny_lm(b: usize) -> candle_func::Result<(VarMap, nn::Gpt, Tensor, Tensor)> {
    let (v, t) = (64, 64);
    let block = nn::BlockConfig {
        dim: 64,
        heads: 4,
        ff: 256,
        causal: true,
        norm: nn::NormKind::LayerNorm,
        act: Activation::Gelu,
    };
    let (vm, m) = build(|vb| nn::gpt(v, t, 2, block, vb))?;
    let ids = |k: u32| {
        Tensor::from_vec(
            (0..(b * t) as u32).map(|i| (i * k + 3) % v as u32).collect(),
            (b, t),
            &Device::Cpu,
        )
    };
    Ok((vm, m, ids(7)?, ids(13)?))
}

/// A model with fresh weights in its own `VarMap`, on the CPU.
pub fn build<M>(f: impl FnOnce(VarBuilder) -> candle_func::Result<M>) -> candle_func::Result<(VarMap, M)> {
    build_on(&Device::Cpu, f)
}

/// [`build`] on `dev`.
#[allow(dead_code)] // not every example that includes this file runs on a GPU
pub fn build_on<M>(
    dev: &Device,
    f: impl FnOnce(VarBuilder) -> candle_func::Result<M>,
) -> candle_func::Result<(VarMap, M)> {
    let vm = VarMap::new();
    let m = f(VarBuilder::from_varmap(&vm, DType::F32, dev))?;
    Ok((vm, m))
}
