//! Models described by the fixtures' `arch` strings (grammar in
//! tests/fixtures/README.md), built from tracer operations.

use candle_func::{Result, Tracer};
use std::collections::BTreeMap;

/// One layer of an architecture.
#[derive(Clone, Debug, PartialEq)]
pub enum Layer {
    Conv {
        name: String,
        nd: usize,
        cin: usize,
        cout: usize,
        k: usize,
        s: usize,
        p: usize,
        d: usize,
        g: usize,
        bias: bool,
    },
    Linear {
        name: String,
        fin: usize,
        fout: usize,
        bias: bool,
    },
    GroupNorm {
        name: String,
        g: usize,
        c: usize,
    },
    Ln {
        name: String,
        d: usize,
    },
    Relu,
    Tanh,
    Gelu,
    GeluTanh,
    Silu,
    MaxPool {
        k: usize,
        s: usize,
    },
    AvgPool {
        k: usize,
        s: usize,
    },
    Flatten,
}

fn kwargs(args: &str) -> (Vec<String>, BTreeMap<String, String>) {
    let mut pos = Vec::new();
    let mut kw = BTreeMap::new();
    for a in args.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        match a.split_once('=') {
            Some((k, v)) => {
                kw.insert(k.trim().to_string(), v.trim().to_string());
            }
            None => pos.push(a.to_string()),
        }
    }
    (pos, kw)
}

fn num(kw: &BTreeMap<String, String>, key: &str, default: usize) -> usize {
    kw.get(key)
        .map(|v| v.parse().expect("integer argument"))
        .unwrap_or(default)
}

/// Parses an `arch` string; panics with the offending layer on bad input
/// (it is test data).
pub fn parse(arch: &str) -> Vec<Layer> {
    arch.split(';')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (name, op) = match l.split_once('=') {
                Some((n, rest)) if rest.contains('(') && !n.contains('(') => (n.trim().to_string(), rest.trim()),
                _ => (String::new(), l),
            };
            let (head, args) = match op.split_once('(') {
                Some((h, a)) => (h, a.trim_end_matches(')')),
                None => (op, ""),
            };
            let (pos, kw) = kwargs(args);
            let positional = |i: usize| pos.get(i).map(|v| v.parse::<usize>().expect("integer")).unwrap_or(0);
            let bias = kw.get("bias").map(|b| b == "true").unwrap_or(true);
            match head {
                "conv1d" | "conv2d" | "conv3d" => Layer::Conv {
                    name,
                    nd: head[4..5].parse().unwrap(),
                    cin: positional(0),
                    cout: positional(1),
                    k: num(&kw, "k", 1),
                    s: num(&kw, "s", 1),
                    p: num(&kw, "p", 0),
                    d: num(&kw, "d", 1),
                    g: num(&kw, "g", 1),
                    bias,
                },
                "linear" => Layer::Linear {
                    name,
                    fin: positional(0),
                    fout: positional(1),
                    bias,
                },
                "groupnorm" => Layer::GroupNorm {
                    name,
                    g: positional(0),
                    c: positional(1),
                },
                "layernorm" => Layer::Ln { name, d: positional(0) },
                "relu" => Layer::Relu,
                "tanh" => Layer::Tanh,
                "gelu" => Layer::Gelu,
                "gelu_tanh" => Layer::GeluTanh,
                "silu" => Layer::Silu,
                "maxpool2d" => Layer::MaxPool {
                    k: num(&kw, "k", 1),
                    s: num(&kw, "s", num(&kw, "k", 1)),
                },
                "avgpool2d" => Layer::AvgPool {
                    k: num(&kw, "k", 1),
                    s: num(&kw, "s", num(&kw, "k", 1)),
                },
                "flatten" => Layer::Flatten,
                other => panic!("unknown layer {other:?} in {l:?}"),
            }
        })
        .collect()
}

fn param<'a>(p: &'a BTreeMap<String, Tracer>, key: &str) -> &'a Tracer {
    p.get(key).unwrap_or_else(|| panic!("missing parameter {key}"))
}

/// Runs the layers on a batch `x: [N, ...]` with parameters named
/// `<layer>.weight` / `<layer>.bias`.
pub fn forward(layers: &[Layer], p: &BTreeMap<String, Tracer>, x: &Tracer) -> Result<Tracer> {
    let mut h = x.clone();
    for layer in layers {
        h = match layer {
            Layer::Conv {
                name,
                nd,
                s,
                p: pad,
                d,
                g,
                bias,
                ..
            } => {
                let w = param(p, &format!("{name}.weight"));
                let y = match nd {
                    1 => h.conv1d(w, *pad, *s, *d, *g)?,
                    2 => h.conv2d(w, *pad, *s, *d, *g)?,
                    _ => h.conv3d(w, *pad, *s, *d, *g)?,
                };
                if *bias {
                    let b = param(p, &format!("{name}.bias"));
                    let mut shape = vec![b.dims()[0]];
                    shape.extend(vec![1; *nd]);
                    y.add(&b.reshape(shape)?)?
                } else {
                    y
                }
            }
            Layer::Linear { name, bias, .. } => {
                let y = h.matmul(&param(p, &format!("{name}.weight")).t()?)?;
                if *bias {
                    y.add(param(p, &format!("{name}.bias")))?
                } else {
                    y
                }
            }
            Layer::GroupNorm { name, g, c } => {
                // N C .. -> N G (C/G ..), standardised, back, then per channel
                let n = h.dims()[0];
                let grouped = h.reshape((n, *g, ()))?;
                let centred = grouped.sub(&grouped.mean_keepdim(2)?)?;
                let var = centred.sqr()?.mean_keepdim(2)?;
                let y = centred.div(&var.affine(1.0, 1e-5)?.sqrt()?)?.reshape(h.dims())?;
                let mut shape = vec![*c];
                shape.extend(vec![1; h.rank() - 2]);
                let w = param(p, &format!("{name}.weight")).reshape(shape.clone())?;
                y.mul(&w)?.add(&param(p, &format!("{name}.bias")).reshape(shape)?)?
            }
            Layer::Ln { name, .. } => {
                let last = h.rank() - 1;
                let centred = h.sub(&h.mean_keepdim(last)?)?;
                let var = centred.sqr()?.mean_keepdim(last)?;
                let y = centred.div(&var.affine(1.0, 1e-5)?.sqrt()?)?;
                y.mul(param(p, &format!("{name}.weight")))?
                    .add(param(p, &format!("{name}.bias")))?
            }
            Layer::Relu => h.relu()?,
            Layer::Tanh => h.tanh()?,
            Layer::Gelu => h.gelu()?,
            Layer::GeluTanh => h.gelu_tanh()?,
            Layer::Silu => h.silu()?,
            Layer::MaxPool { k, s } => h.max_pool2d_with_stride(*k, *s)?,
            Layer::AvgPool { k, s } => h.avg_pool2d_with_stride(*k, *s)?,
            Layer::Flatten => h.flatten_from(1)?,
        };
    }
    Ok(h)
}

/// Cross-entropy of one example's logits `[C]` against a label `[]` (i64).
pub fn cross_entropy(logits: &Tracer, y: &Tracer) -> Result<Tracer> {
    let lp = logits.log_softmax(0)?;
    lp.gather(&y.reshape((1,))?, 0)?.neg()?.squeeze(0)
}

/// The same layers run eagerly with candle's own operations (so candle's
/// `backward()` can differentiate them); conv3d uses the crate's unfold
/// kernel, which carries a candle backward.
pub fn forward_eager(
    layers: &[Layer],
    p: &BTreeMap<String, candle_core::Tensor>,
    x: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    let mut h = x.clone();
    for layer in layers {
        h = match layer {
            Layer::Conv {
                name,
                nd,
                k: _,
                s,
                p: pad,
                d,
                g,
                bias,
                ..
            } => {
                let w = &p[&format!("{name}.weight")];
                let y = match nd {
                    1 => h.contiguous()?.conv1d(w, *pad, *s, *d, *g)?,
                    2 => h.contiguous()?.conv2d(w, *pad, *s, *d, *g)?,
                    _ => super::conv3d_direct(&h, w, *s, *pad, *d, *g)?,
                };
                if *bias {
                    let b = &p[&format!("{name}.bias")];
                    let mut shape = vec![1, b.dims()[0]];
                    shape.extend(vec![1; *nd]);
                    y.broadcast_add(&b.reshape(shape)?)?
                } else {
                    y
                }
            }
            Layer::Linear { name, bias, .. } => {
                let y = h.matmul(&p[&format!("{name}.weight")].t()?)?;
                if *bias {
                    y.broadcast_add(&p[&format!("{name}.bias")])?
                } else {
                    y
                }
            }
            Layer::GroupNorm { name, g, c } => {
                use candle_core::Module;
                let (w, b) = (&p[&format!("{name}.weight")], &p[&format!("{name}.bias")]);
                candle_nn::GroupNorm::new(w.clone(), b.clone(), *c, *g, 1e-5)?.forward(&h)?
            }
            Layer::Ln { name, .. } => {
                use candle_core::Module;
                let (w, b) = (&p[&format!("{name}.weight")], &p[&format!("{name}.bias")]);
                candle_nn::LayerNorm::new(w.clone(), b.clone(), 1e-5).forward(&h)?
            }
            Layer::Relu => h.relu()?,
            Layer::Tanh => h.tanh()?,
            // candle's `gelu` is the tanh approximation, `gelu_erf` the exact
            Layer::Gelu => h.gelu_erf()?,
            Layer::GeluTanh => h.gelu()?,
            Layer::Silu => candle_nn::ops::silu(&h)?,
            Layer::MaxPool { k, s } => h.max_pool2d_with_stride(*k, *s)?,
            Layer::AvgPool { k, s } => h.avg_pool2d_with_stride(*k, *s)?,
            Layer::Flatten => h.flatten_from(1)?,
        };
    }
    Ok(h)
}

/// The same architecture as `candle_func::nn` layers, with weights from
/// `vb` under the layer names (a PyTorch state dict loads unchanged).
pub fn build_nn(layers: &[Layer], vb: &candle_nn::VarBuilder) -> candle_func::Result<candle_func::nn::Sequential> {
    use candle_func::nn;
    let mut m = nn::seq();
    for l in layers {
        m = match l {
            Layer::Conv {
                name,
                nd,
                cin,
                cout,
                k,
                s,
                p,
                d,
                g,
                bias,
            } => {
                let cfg = nn::ConvConfig {
                    padding: *p,
                    stride: *s,
                    dilation: *d,
                    groups: *g,
                };
                let vb = vb.pp(name);
                m.add(match (nd, bias) {
                    (1, true) => nn::conv1d(*cin, *cout, *k, cfg, vb)?,
                    (1, false) => nn::conv1d_no_bias(*cin, *cout, *k, cfg, vb)?,
                    (2, true) => nn::conv2d(*cin, *cout, *k, cfg, vb)?,
                    (2, false) => nn::conv2d_no_bias(*cin, *cout, *k, cfg, vb)?,
                    (_, true) => nn::conv3d(*cin, *cout, *k, cfg, vb)?,
                    (_, false) => nn::conv3d_no_bias(*cin, *cout, *k, cfg, vb)?,
                })
            }
            Layer::Linear { name, fin, fout, bias } => m.add(if *bias {
                nn::linear(*fin, *fout, vb.pp(name))?
            } else {
                nn::linear_no_bias(*fin, *fout, vb.pp(name))?
            }),
            Layer::GroupNorm { name, g, c } => m.add(nn::group_norm(*g, *c, 1e-5, vb.pp(name))?),
            Layer::Ln { name, d } => m.add(nn::layer_norm(*d, 1e-5, vb.pp(name))?),
            Layer::Relu => m.add(nn::Activation::Relu),
            Layer::Tanh => m.add(nn::Activation::Tanh),
            Layer::Gelu => m.add(nn::Activation::Gelu),
            Layer::GeluTanh => m.add(nn::Activation::GeluTanh),
            Layer::Silu => m.add(nn::Activation::Silu),
            Layer::MaxPool { k, s } => m.add(nn::MaxPool2d { kernel: *k, stride: *s }),
            Layer::AvgPool { k, s } => m.add(nn::AvgPool2d { kernel: *k, stride: *s }),
            Layer::Flatten => m.add(nn::Flatten),
        };
    }
    Ok(m)
}
