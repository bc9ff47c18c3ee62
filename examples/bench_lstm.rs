//! Per-sample gradients of a one-layer LSTM classifier (vocabulary 1000,
//! embedding 64, hidden 128, 4 classes; B=64 sequences of T=64 tokens),
//! one variant per process so that the process's peak resident memory is
//! that variant's:
//!
//! * `psg`: every parameter's per-sample gradient (`vmap(grad)` through
//!   `nn::lstm`, one `scan` node each way);
//! * `dp`: their clipped sum by `dp::clipped_grad_sum` (ghost norms where
//!   a layer has them);
//! * `step`: the ordinary training step's gradient of the batch's mean
//!   loss (the model run on the batch, batch first).
//!
//! ```text
//! cargo run --release --example bench_lstm -- --variant psg --reps 5
//! ```
//!
//! `--bidirectional` runs the LSTM both ways (the classifier reads the
//! sum of the two directions' last states; no peer runs this variant): the
//! two directions' loops, and their gradients, run at once on two or more
//! threads.
//!
//! `--checkpoint K` makes the LSTM's loop keep one state in `K` for the
//! gradient and recompute the others (`Recurrent::with_checkpoint`; 0,
//! the default, leaves the choice to the loop).
//!
//! It prints `RESULT ours_<variant> median_ms .. first_ms .. peak_rss_mib ..
//! plan_mib ..`; `benches/peers/side_by_side_lstm.py` pairs it with
//! `bench_lstm.py` (Opacus 1.6's `DPLSTM`, and `torch.func`).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, cross_entropy, Module, Params, RecurrentConfig, Reduction};
use candle_func::{dp, grad, make_graph, vmap, Tracer};
use common::arg;
use std::collections::BTreeMap;

const B: usize = 64;
const T: usize = 64;
const V: usize = 1000;
const E: usize = 64;
const H: usize = 128;
const C: usize = 4;

/// The ids `bench_lstm.py` draws (the same recurrence) and the labels.
fn batch() -> candle_core::Result<(Tensor, Tensor)> {
    let mut ids = vec![0u32; B * T];
    let mut state: u64 = 12345;
    for id in ids.iter_mut() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *id = ((state >> 33) % V as u64) as u32;
    }
    let labels: Vec<u32> = (0..B as u32).map(|i| i % C as u32).collect();
    Ok((
        Tensor::from_vec(ids, (B, T), &Device::Cpu)?,
        Tensor::from_vec(labels, B, &Device::Cpu)?,
    ))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let variant: String = arg("--variant", "psg".to_string());
    let reps: usize = arg("--reps", 5);
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let emb = nn::embedding(V, E, vb.pp("emb"))?;
    let cfg = RecurrentConfig {
        bidirectional: std::env::args().any(|a| a == "--bidirectional"),
        ..RecurrentConfig::default()
    };
    let dirs = 1 + cfg.bidirectional as usize;
    let mut rnn = nn::lstm(E, H, cfg, vb.pp("rnn"))?;
    let checkpoint: usize = arg("--checkpoint", 0);
    if checkpoint > 0 {
        rnn = rnn.with_checkpoint(checkpoint);
    }
    let fc = nn::linear(H, C, vb.pp("fc"))?;
    let params: BTreeMap<String, Tensor> = [emb.params(), rnn.params(), fc.params()]
        .into_iter()
        .flatten()
        .collect();
    let (ids, ys) = batch()?;
    // logits of one sequence [T] ([C]) or of a batch [B, T] ([B, C])
    let logits = |p: &BTreeMap<String, Tracer>, ids: &Tracer| -> candle_func::Result<Tracer> {
        let p = Params::with(p);
        let h_n = rnn.run(&p, &emb.forward_with(&p, ids)?, None)?.h_n;
        // [D, (B), H] -> [(B), H]: the directions' last states summed
        fc.forward_with(&p, &h_n.narrow(0, 0, dirs)?.sum(0)?)
    };
    let one = |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| {
        cross_entropy(&logits(&p, &x)?.unsqueeze(0)?, &y.unsqueeze(0)?, Reduction::Mean)
    };
    let batch_loss =
        |p: BTreeMap<String, Tracer>, x: Tracer, y: Tracer| cross_entropy(&logits(&p, &x)?, &y, Reduction::Mean);
    let psg = vmap(grad(one)).in_dims([None, Some(0), Some(0)]);
    let clipped = dp::clipped_grad_sum(one, 1.0);
    let step = grad(batch_loss);
    let run = || -> candle_func::Result<()> {
        match variant.as_str() {
            "psg" => psg.call((&params, &ids, &ys)).map(|_| ()),
            "dp" => clipped.call((&params, &ids, &ys)).map(|_| ()),
            "step" => step.call((&params, &ids, &ys)).map(|_| ()),
            other => Err(candle_func::Error::Config {
                msg: format!("--variant {other}: one of psg, dp, step"),
            }),
        }
    };
    common::report(&variant, reps, run, || -> candle_func::Result<usize> {
        Ok(match variant.as_str() {
            "psg" => make_graph(&psg, (&params, &ids, &ys))?.planned_peak_bytes(),
            "step" => make_graph(&step, (&params, &ids, &ys))?.planned_peak_bytes(),
            _ => 0,
        })
    })?;
    Ok(())
}
