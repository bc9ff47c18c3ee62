//! Recurrent layers, PyTorch's `nn.RNN`, `nn.LSTM` and `nn.GRU`, built on
//! [`scan`](crate::loops::scan): one loop node per layer and direction whatever
//! the sequence length, so the graph does not grow with it and `vmap`,
//! `grad` and forward mode go through the loop's own rules.
//!
//! Parameter names and layouts are PyTorch's (`weight_ih_l0 [G*H, in]`,
//! `weight_hh_l0 [G*H, H]`, `bias_ih_l0`, `bias_hh_l0 [G*H]`, `_reverse`
//! for the backward direction; gates in PyTorch's order: LSTM `i f g o`,
//! GRU `r z n` with `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))`), so a
//! PyTorch `state_dict` loads unchanged. Each direction's input
//! projection `x W_ih^T + b_ih` is one product over the whole sequence
//! before the loop, as cuDNN does; the loop multiplies by `W_hh` only.
//!
//! Variable lengths: given each sequence's length, the state stops
//! changing after its last token, the outputs past it are zero, and the
//! backward direction starts at it, as `pack_padded_sequence` makes
//! PyTorch do. A length outside `1..=T` is an error when the graph runs.

use super::layers::full_name;
use super::{EagerCache, Module, Params};
use crate::control::{scan_with, ScanOptions};
use crate::error::{Error, Result};
use crate::trace::{Operand, Tracer};
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;

/// The recurrent cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecurrentCell {
    /// `h' = tanh(W_ih x + b_ih + W_hh h + b_hh)` (`nn.RNN`'s default).
    RnnTanh,
    /// The same with ReLU (`nonlinearity="relu"`).
    RnnRelu,
    /// PyTorch's LSTM (gates `i f g o`).
    Lstm,
    /// PyTorch's GRU (gates `r z n`).
    Gru,
}

impl RecurrentCell {
    /// Gates per hidden unit: the rows of `W_ih` are `gates * hidden`.
    pub fn gates(self) -> usize {
        match self {
            RecurrentCell::RnnTanh | RecurrentCell::RnnRelu => 1,
            RecurrentCell::Lstm => 4,
            RecurrentCell::Gru => 3,
        }
    }

    fn name(self) -> &'static str {
        match self {
            RecurrentCell::RnnTanh | RecurrentCell::RnnRelu => "rnn",
            RecurrentCell::Lstm => "lstm",
            RecurrentCell::Gru => "gru",
        }
    }
}

/// How many layers, and whether each runs both ways and has biases
/// (PyTorch's `num_layers`, `bidirectional`, `bias`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentConfig {
    /// Stacked layers, each reading the one below's outputs (default 1).
    pub layers: usize,
    /// A backward direction beside the forward one (default no).
    pub bidirectional: bool,
    /// Biases `bias_ih` and `bias_hh` (default yes).
    pub bias: bool,
}

impl Default for RecurrentConfig {
    fn default() -> Self {
        RecurrentConfig {
            layers: 1,
            bidirectional: false,
            bias: true,
        }
    }
}

/// A recurrent layer (`nn.RNN`, `nn.LSTM`, `nn.GRU`): see the module docs.
#[derive(Clone, Debug)]
pub struct Recurrent {
    cell: RecurrentCell,
    input: usize,
    hidden: usize,
    cfg: RecurrentConfig,
    /// The weights by their PyTorch names without the prefix.
    weights: BTreeMap<String, Tensor>,
    prefix: String,
    cache: EagerCache,
    /// Steps between the carries a gradient keeps (`ScanOptions::checkpoint`).
    checkpoint: Option<usize>,
}

/// What a recurrent layer computes: the last layer's outputs at every
/// step (`[T, D*H]`, or `[B, T, D*H]` for a batch; the directions side by
/// side, forward first) and each layer's and direction's final state
/// (`[L*D, H]` or `[L*D, B, H]`, PyTorch's `h_n` order), the LSTM's cell
/// state too.
#[derive(Clone, Debug)]
pub struct RecurrentOutput {
    /// The outputs at every step (zero past a sequence's length).
    pub output: Tracer,
    /// The final hidden states.
    pub h_n: Tracer,
    /// The LSTM's final cell states (`None` for the others).
    pub c_n: Option<Tracer>,
}

/// An LSTM of `layers` layers (PyTorch's `nn.LSTM(input, hidden, ..)`),
/// its weights from `vb` under PyTorch's names, initialised as PyTorch
/// does (uniform in `±1/sqrt(hidden)`).
pub fn lstm(input: usize, hidden: usize, cfg: RecurrentConfig, vb: VarBuilder) -> Result<Recurrent> {
    Recurrent::new(RecurrentCell::Lstm, input, hidden, cfg, vb, None)
}

/// A GRU (PyTorch's `nn.GRU`); see [`lstm`].
pub fn gru(input: usize, hidden: usize, cfg: RecurrentConfig, vb: VarBuilder) -> Result<Recurrent> {
    Recurrent::new(RecurrentCell::Gru, input, hidden, cfg, vb, None)
}

/// A plain recurrent layer (PyTorch's `nn.RNN`, tanh or ReLU by `cell`);
/// see [`lstm`].
pub fn rnn(
    input: usize,
    hidden: usize,
    cell: RecurrentCell,
    cfg: RecurrentConfig,
    vb: VarBuilder,
) -> Result<Recurrent> {
    match cell {
        RecurrentCell::RnnTanh | RecurrentCell::RnnRelu => Recurrent::new(cell, input, hidden, cfg, vb, None),
        other => Err(Error::Config {
            msg: format!("nn::rnn takes RecurrentCell::RnnTanh or RecurrentCell::RnnRelu, not {other:?} (use nn::lstm or nn::gru)"),
        }),
    }
}

impl Recurrent {
    /// The layer with its weights from `vb`, made where missing (by the
    /// VarMap's initialiser) unless `existing` names the constructor that
    /// reads trained weights, which then refuses a missing one by name.
    fn new(
        cell: RecurrentCell,
        input: usize,
        hidden: usize,
        cfg: RecurrentConfig,
        vb: VarBuilder,
        existing: Option<&'static str>,
    ) -> Result<Recurrent> {
        if input == 0 || hidden == 0 || cfg.layers == 0 {
            return Err(Error::Config {
                msg: format!(
                    "{}: input size {input}, hidden size {hidden} and layers {} must be positive",
                    cell.name(),
                    cfg.layers
                ),
            });
        }
        let rows = cell.gates().checked_mul(hidden).ok_or_else(|| Error::Config {
            msg: format!("{}: {} gates of {hidden} overflow", cell.name(), cell.gates()),
        })?;
        let bound = 1.0 / (hidden as f64).sqrt();
        let init = Init::Uniform { lo: -bound, up: bound };
        let mut weights = BTreeMap::new();
        for layer in 0..cfg.layers {
            let fan_in = if layer == 0 { input } else { hidden * directions(&cfg) };
            for suffix in suffixes(&cfg) {
                let mut get = |name: &str, shape: &[usize]| -> Result<()> {
                    let key = format!("{name}_l{layer}{suffix}");
                    if let (Some(op), false) = (existing, vb.contains_tensor(&key)) {
                        return Err(Error::Model {
                            what: format!("weight {:?}", full_name(&vb.prefix(), &key)),
                            msg: format!(
                                "{op}: not in the VarBuilder, which would make new random weights in its \
                                 place: give the VarBuilder at the prefix candle's layers were built at"
                            ),
                        });
                    }
                    weights.insert(key.clone(), super::param(&vb, shape, &key, init)?);
                    Ok(())
                };
                get("weight_ih", &[rows, fan_in])?;
                get("weight_hh", &[rows, hidden])?;
                if cfg.bias {
                    get("bias_ih", &[rows])?;
                    get("bias_hh", &[rows])?;
                }
            }
        }
        Ok(Recurrent {
            cell,
            input,
            hidden,
            cfg,
            weights,
            prefix: vb.prefix(),
            cache: EagerCache::default(),
            checkpoint: None,
        })
    }

    /// The LSTM candle_nn's `layers` make (one per layer and direction, as
    /// candle stacks them, each told its `layer_idx` and `direction`),
    /// reading from `vb` (the one they were built from) the weights under
    /// the names candle gave them, which are PyTorch's: the two share
    /// them. `input` is the first layer's input size (candle's layers do
    /// not say it); an incomplete stack is an error naming what is missing,
    /// and so is a weight `vb` lacks (a `VarBuilder` at another prefix
    /// would otherwise make new random weights in place of the trained
    /// ones).
    pub fn from_candle_lstm(layers: &[&candle_nn::LSTM], input: usize, vb: VarBuilder) -> Result<Recurrent> {
        let found: Vec<(usize, bool, bool, usize)> = layers
            .iter()
            .map(|l| {
                let c = l.config();
                let hidden = candle_nn::rnn::RNN::zero_state(*l, 1)?.h().dims()[1];
                Ok((
                    c.layer_idx,
                    matches!(c.direction, candle_nn::rnn::Direction::Backward),
                    c.b_ih_init.is_some(),
                    hidden,
                ))
            })
            .collect::<Result<_>>()?;
        let cfg = stack_config("lstm", &found)?;
        Recurrent::new(
            RecurrentCell::Lstm,
            input,
            found[0].3,
            cfg,
            vb,
            Some("Recurrent::from_candle_lstm"),
        )
    }

    /// The GRU candle_nn's `gru` makes (one layer, forward: candle's GRU
    /// has no layer index or direction), reading its weights from `vb` as
    /// [`Recurrent::from_candle_lstm`] does.
    pub fn from_candle_gru(layer: &candle_nn::GRU, input: usize, vb: VarBuilder) -> Result<Recurrent> {
        let hidden = candle_nn::rnn::RNN::zero_state(layer, 1)?.h().dims()[1];
        let cfg = RecurrentConfig {
            bias: layer.config().b_ih_init.is_some(),
            ..RecurrentConfig::default()
        };
        Recurrent::new(
            RecurrentCell::Gru,
            input,
            hidden,
            cfg,
            vb,
            Some("Recurrent::from_candle_gru"),
        )
    }

    /// The layer with each direction's loop keeping one carry every `steps`
    /// steps for its gradient and recomputing the others
    /// ([`ScanOptions::checkpoint`]): for sequences whose states a
    /// gradient cannot hold. Without it, a loop checkpoints by itself only
    /// when its states would take more than an eighth of the memory limit.
    pub fn with_checkpoint(mut self, steps: usize) -> Self {
        self.checkpoint = Some(steps);
        self
    }

    /// The cell, input size, hidden size and configuration.
    pub fn shape(&self) -> (RecurrentCell, usize, usize, RecurrentConfig) {
        (self.cell, self.input, self.hidden, self.cfg)
    }

    /// Runs the layer on one sequence `x [T, in]` or a batch `[B, T, in]`
    /// (batch first), from zero states. `lengths` (a scalar for one
    /// sequence, `[B]` for a batch; any dtype) gives each sequence's
    /// length: the steps past it leave the state alone and output zeros.
    /// Each length must be a whole number in `1..=T`, as PyTorch's
    /// `pack_padded_sequence` requires: the values are checked when the
    /// graph runs (under `vmap`, `grad`, `jit` and eagerly alike), and any
    /// other (0, above `T`, negative, fractional, NaN) is an
    /// [`Error::Data`] naming it and its sequence, never clamped.
    pub fn run(&self, p: &Params, x: &Tracer, lengths: Option<&Tracer>) -> Result<RecurrentOutput> {
        let name = self.cell.name();
        let batched = match x.rank() {
            2 => false,
            3 => true,
            _ => return Err(Error::shape(name, &[x.dims()], "takes [T, in] or a batch [B, T, in]")),
        };
        if x.dims()[x.rank() - 1] != self.input {
            return Err(Error::shape(
                name,
                &[x.dims()],
                format!("the layer takes {} features per step", self.input),
            ));
        }
        if let Some(l) = lengths {
            let want: &[usize] = if batched { &x.dims()[..1] } else { &[] };
            if l.dims() != want {
                return Err(Error::shape(
                    name,
                    &[x.dims(), l.dims()],
                    format!("lengths must be {want:?}: one per sequence"),
                ));
            }
        }
        // time first: [T, in] or [T, B, in]
        let mut seq = if batched { x.transpose(0, 1)? } else { x.clone() };
        let steps = seq.dims()[0];
        let mask = match lengths {
            Some(l) => Some(step_mask(&seq, &l.checked_lengths(steps)?, steps)?),
            None => None,
        };
        let (mut hs, mut cs) = (Vec::new(), Vec::new());
        for layer in 0..self.cfg.layers {
            let mut outs = Vec::with_capacity(2);
            for (d, suffix) in suffixes(&self.cfg).into_iter().enumerate() {
                let w = |n: &str| -> Result<Option<Tracer>> {
                    let key = format!("{n}_l{layer}{suffix}");
                    self.weights
                        .get(&key)
                        .map(|t| p.get(&full_name(&self.prefix, &key), t, x))
                        .transpose()
                };
                let weights = Weights {
                    ih: w("weight_ih")?.ok_or_else(|| missing(&self.prefix, layer))?,
                    hh: w("weight_hh")?.ok_or_else(|| missing(&self.prefix, layer))?,
                    b_ih: w("bias_ih")?,
                    b_hh: w("bias_hh")?,
                };
                let (ys, h, c) = self.direction(&weights, &seq, mask.as_ref(), d == 1)?;
                outs.push(ys);
                hs.push(h);
                cs.extend(c);
            }
            seq = match outs.len() {
                1 => outs.remove(0),
                _ => Tracer::cat(&outs.iter().collect::<Vec<_>>(), seq.rank() - 1)?,
            };
        }
        let output = if batched { seq.transpose(0, 1)? } else { seq };
        let stack = |v: &[Tracer]| Tracer::stack(&v.iter().collect::<Vec<_>>(), 0);
        Ok(RecurrentOutput {
            output,
            h_n: stack(&hs)?,
            c_n: match self.cell {
                RecurrentCell::Lstm => Some(stack(&cs)?),
                _ => None,
            },
        })
    }

    /// One layer in one direction over `seq [T, (B,) in]`: the outputs
    /// `[T, (B,) H]` and the final states.
    fn direction(
        &self,
        w: &Weights,
        seq: &Tracer,
        mask: Option<&Tracer>,
        reverse: bool,
    ) -> Result<(Tracer, Tracer, Option<Tracer>)> {
        // the input projection of every step at once: T (B) in -> T (B) G*H
        let mut proj = seq.matmul(&w.ih.t()?)?;
        if let Some(b) = &w.b_ih {
            proj = proj.add(b)?;
        }
        let mut state_shape = seq.dims()[1..seq.rank() - 1].to_vec();
        state_shape.push(self.hidden);
        let zeros = Tensor::zeros(state_shape, seq.dtype(), &seq.device())?.to_tracer(seq)?;
        let init = match self.cell {
            RecurrentCell::Lstm => vec![zeros.clone(), zeros],
            _ => vec![zeros],
        };
        let mut xs = vec![proj];
        xs.extend(mask.cloned());
        let mut opts = ScanOptions::new();
        if reverse {
            opts = opts.reverse();
        }
        if let Some(k) = self.checkpoint {
            opts = opts.checkpoint(k);
        }
        let (last, ys) = scan_with(|c: Vec<Tracer>, x: Vec<Tracer>| self.step(w, &c, &x), init, xs, opts)?;
        let c = (self.cell == RecurrentCell::Lstm).then(|| last[1].clone());
        Ok((ys[0].clone(), last[0].clone(), c))
    }

    /// One step: the next states and the step's output, from the states
    /// `c`, the step's input projection and its mask (`1` inside the
    /// sequence, `0` past it: the states are kept and the output is zero).
    fn step(&self, w: &Weights, c: &[Tracer], x: &[Tracer]) -> Result<(Vec<Tracer>, Vec<Tracer>)> {
        let h = &c[0];
        // one state [H] is a row [1, H] to the product
        let mut hw = match h.rank() {
            1 => h.unsqueeze(0)?.matmul(&w.hh.t()?)?.squeeze(0)?,
            _ => h.matmul(&w.hh.t()?)?,
        };
        if let Some(b) = &w.b_hh {
            hw = hw.add(b)?;
        }
        let gate = |t: &Tracer, k: usize| t.narrow(t.rank() - 1, k * self.hidden, self.hidden);
        let xp = &x[0];
        let mut next = match self.cell {
            RecurrentCell::RnnTanh => vec![xp.add(&hw)?.tanh()?],
            RecurrentCell::RnnRelu => vec![xp.add(&hw)?.relu()?],
            RecurrentCell::Lstm => {
                let g = xp.add(&hw)?;
                let (i, f) = (gate(&g, 0)?.sigmoid()?, gate(&g, 1)?.sigmoid()?);
                let (cand, o) = (gate(&g, 2)?.tanh()?, gate(&g, 3)?.sigmoid()?);
                let cell = f.mul(&c[1])?.add(&i.mul(&cand)?)?;
                vec![o.mul(&cell.tanh()?)?, cell]
            }
            RecurrentCell::Gru => {
                let r = gate(xp, 0)?.add(&gate(&hw, 0)?)?.sigmoid()?;
                let z = gate(xp, 1)?.add(&gate(&hw, 1)?)?.sigmoid()?;
                let n = gate(xp, 2)?.add(&r.mul(&gate(&hw, 2)?)?)?.tanh()?;
                // (1 - z) n + z h = n + z (h - n)
                vec![n.add(&z.mul(&h.sub(&n)?)?)?]
            }
        };
        let mut out = next[0].clone();
        if let Some(m) = x.get(1) {
            // the mask [] or [B] against the states [H] or [B, H]; a
            // select, not a blend, so that whatever the padding makes
            // (inf, NaN) stays out of the state
            let m = m.unsqueeze(m.rank())?;
            for (s, old) in next.iter_mut().zip(c) {
                *s = m.where_cond(&*s, old)?;
            }
            out = m.where_cond(&next[0], 0.0)?;
        }
        Ok((next, vec![out]))
    }
}

/// A layer's four (or two) tensors in one direction.
struct Weights {
    ih: Tracer,
    hh: Tracer,
    b_ih: Option<Tracer>,
    b_hh: Option<Tracer>,
}

fn directions(cfg: &RecurrentConfig) -> usize {
    if cfg.bidirectional {
        2
    } else {
        1
    }
}

fn suffixes(cfg: &RecurrentConfig) -> Vec<&'static str> {
    if cfg.bidirectional {
        vec!["", "_reverse"]
    } else {
        vec![""]
    }
}

/// The configuration of candle's stack `found` (`(layer, backward, bias,
/// hidden)` per layer): every layer `0..L` once in each direction, of one
/// hidden size and one bias setting.
fn stack_config(cell: &str, found: &[(usize, bool, bool, usize)]) -> Result<RecurrentConfig> {
    let bad = |msg: String| Error::Config {
        msg: format!("{cell} from candle_nn: {msg}"),
    };
    let Some(&(_, _, bias, hidden)) = found.first() else {
        return Err(bad("no layers given".into()));
    };
    let layers = found.iter().map(|f| f.0).max().unwrap_or(0) + 1;
    let bidirectional = found.iter().any(|f| f.1);
    for layer in 0..layers {
        for backward in [false, true].into_iter().take(1 + bidirectional as usize) {
            let n = found.iter().filter(|f| (f.0, f.1) == (layer, backward)).count();
            if n != 1 {
                return Err(bad(format!(
                    "layer {layer} {} given {n} times (a stack has each layer once per direction)",
                    if backward { "backward" } else { "forward" }
                )));
            }
        }
    }
    if found.iter().any(|f| f.2 != bias || f.3 != hidden) {
        return Err(bad("layers of different hidden sizes or bias settings".into()));
    }
    Ok(RecurrentConfig {
        layers,
        bidirectional,
        bias,
    })
}

fn missing(prefix: &str, layer: usize) -> Error {
    Error::internal("recurrent", format!("{prefix}: layer {layer} without its weights"))
}

/// `[T]` or `[T, B]`: 1 (`u8`) where step `t` is inside the sequence, 0
/// past it. Compared in f32, whose integers are exact far beyond any
/// sequence (a bf16 step count is not past 256).
fn step_mask(seq: &Tracer, lengths: &Tracer, steps: usize) -> Result<Tracer> {
    let t = Tensor::arange(0u32, steps as u32, &seq.device())?
        .to_dtype(candle_core::DType::F32)?
        .to_tracer(seq)?;
    let len = lengths.to_dtype(candle_core::DType::F32)?;
    // T 1.. < .. : the steps down, the sequences across
    let t = t.reshape([&[steps][..], &vec![1; len.rank()]].concat())?;
    t.lt(&len.unsqueeze(0)?)
}

impl Module for Recurrent {
    /// The outputs at every step ([`Recurrent::run`] without lengths).
    fn forward_with(&self, p: &Params, x: &Tracer) -> Result<Tracer> {
        Ok(self.run(p, x, None)?.output)
    }

    fn params(&self) -> BTreeMap<String, Tensor> {
        self.weights
            .iter()
            .map(|(k, t)| (full_name(&self.prefix, k), t.clone()))
            .collect()
    }

    fn eager_cache(&self) -> Option<&EagerCache> {
        Some(&self.cache)
    }
}
