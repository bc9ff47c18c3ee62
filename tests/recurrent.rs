//! The recurrent layers (`nn::lstm`, `nn::gru`, `nn::rnn`) against
//! candle_nn's own LSTM and GRU (stacked and run both ways by hand) and a
//! plain loop of candle operations, variable lengths against truncated
//! sequences, one sequence under `vmap` against the batch-first call, the
//! graph against the sequence length, and bad input. PyTorch's own numbers
//! are in `tests/fixtures.rs` (`rnn/`).

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_func::nn::{self, Module, Params, Recurrent, RecurrentCell, RecurrentConfig};
use candle_func::{jit, make_graph, vmap, Error, Tracer};
use candle_nn::rnn::{Direction, GRUConfig, LSTMConfig, RNN};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_close, rand};

const B: usize = 3;
const T: usize = 7;
const I: usize = 4;
const H: usize = 5;

fn vb(map: &VarMap) -> VarBuilder<'_> {
    VarBuilder::from_varmap(map, DType::F32, &Device::Cpu)
}

/// `(outputs [B, T, D*H], h_n [L*D, B, H], c_n)` of ours on a batch.
fn ours(layer: &Recurrent, x: &Tensor, lengths: Option<&Tensor>) -> (Tensor, Tensor, Option<Tensor>) {
    let f = |x: Tracer, l: Vec<Tracer>| {
        let out = layer.run(&Params::own(), &x, l.first())?;
        Ok((out.output, out.h_n, out.c_n.into_iter().collect::<Vec<_>>()))
    };
    let l: Vec<Tensor> = lengths.into_iter().cloned().collect();
    let (o, h, c) = jit(f).call((x, &l)).unwrap();
    (o, h, c.into_iter().next())
}

/// candle's layer `l` over `x [B, T, in]`, backwards where asked: the
/// states `[B, T, H]` in the time order of `x`, and the last `(h, c)`.
fn candle_run<R: RNN>(
    l: &R,
    x: &Tensor,
    backward: bool,
    h_c: impl Fn(&R::State) -> (Tensor, Option<Tensor>),
) -> (Tensor, Tensor, Option<Tensor>) {
    let idx: Vec<u32> = if backward {
        (0..T as u32).rev().collect()
    } else {
        (0..T as u32).collect()
    };
    let idx = Tensor::new(idx.as_slice(), &Device::Cpu).unwrap();
    let states = l.seq(&x.index_select(&idx, 1).unwrap()).unwrap();
    let hs: Vec<Tensor> = states.iter().map(|s| h_c(s).0).collect();
    let hs = Tensor::stack(&hs, 1).unwrap().index_select(&idx, 1).unwrap();
    let (h, c) = h_c(states.last().unwrap());
    (hs, h, c)
}

#[test]
fn a_stacked_bidirectional_lstm_equals_candle_nns_layers_run_both_ways() {
    let map = VarMap::new();
    let cfg = RecurrentConfig {
        layers: 2,
        bidirectional: true,
        bias: true,
    };
    let ours_layer = nn::lstm(I, H, cfg, vb(&map).pp("rnn")).unwrap();
    // candle's layers read the same variables, by PyTorch's names
    let candle = |layer, direction| {
        let c = LSTMConfig {
            layer_idx: layer,
            direction,
            ..LSTMConfig::default()
        };
        candle_nn::rnn::lstm(if layer == 0 { I } else { 2 * H }, H, c, vb(&map).pp("rnn")).unwrap()
    };
    let layers = [
        candle(0, Direction::Forward),
        candle(0, Direction::Backward),
        candle(1, Direction::Forward),
        candle(1, Direction::Backward),
    ];
    let x = rand(&[B, T, I], 1);
    let (out, h_n, c_n) = ours(&ours_layer, &x, None);
    let mut input = x.clone();
    let (mut hs, mut cs) = (Vec::new(), Vec::new());
    for pair in layers.chunks(2) {
        let mut outs = Vec::new();
        for (d, l) in pair.iter().enumerate() {
            let (o, h, c) = candle_run(l, &input, d == 1, |s| (s.h().clone(), Some(s.c().clone())));
            outs.push(o);
            hs.push(h);
            cs.push(c.unwrap());
        }
        input = Tensor::cat(&outs, 2).unwrap();
    }
    assert_close(&out, &input, 1e-5, "outputs");
    assert_close(&h_n, &Tensor::stack(&hs, 0).unwrap(), 1e-5, "h_n");
    assert_close(&c_n.unwrap(), &Tensor::stack(&cs, 0).unwrap(), 1e-5, "c_n");
    // from_candle: the same layer, sharing the same variables
    let refs: Vec<&candle_nn::LSTM> = layers.iter().collect();
    let converted = Recurrent::from_candle_lstm(&refs, I, vb(&map).pp("rnn")).unwrap();
    assert_eq!(converted.shape(), (RecurrentCell::Lstm, I, H, cfg));
    assert_close(&ours(&converted, &x, None).0, &out, 0.0, "from_candle");
    let msg = Recurrent::from_candle_lstm(&refs[..3], I, vb(&map).pp("rnn"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("layer 1 backward given 0 times"), "{msg}");
}

#[test]
fn a_gru_and_plain_rnns_equal_candle_and_a_loop_of_candle_operations() {
    let map = VarMap::new();
    let gru = nn::gru(I, H, RecurrentConfig::default(), vb(&map).pp("gru")).unwrap();
    let theirs = candle_nn::rnn::gru(I, H, GRUConfig::default(), vb(&map).pp("gru")).unwrap();
    let x = rand(&[B, T, I], 2);
    let (out, h_n, c_n) = ours(&gru, &x, None);
    let (hs, h, _) = candle_run(&theirs, &x, false, |s| (s.h().clone(), None));
    assert_close(&out, &hs, 1e-5, "gru outputs");
    assert_close(&h_n.squeeze(0).unwrap(), &h, 1e-5, "gru h_n");
    assert!(c_n.is_none());
    let converted = Recurrent::from_candle_gru(&theirs, I, vb(&map).pp("gru")).unwrap();
    assert_close(&ours(&converted, &x, None).0, &out, 0.0, "gru from_candle");
    for (cell, bias) in [(RecurrentCell::RnnTanh, true), (RecurrentCell::RnnRelu, false)] {
        let map = VarMap::new();
        let cfg = RecurrentConfig {
            bias,
            ..RecurrentConfig::default()
        };
        let layer = nn::rnn(I, H, cell, cfg, vb(&map).pp("rnn")).unwrap();
        let p = layer.params();
        assert_eq!(p.len(), if bias { 4 } else { 2 }, "{cell:?}: {:?}", p.keys());
        let (out, _, _) = ours(&layer, &x, None);
        let mut h = Tensor::zeros((B, H), DType::F32, &Device::Cpu).unwrap();
        let mut want = Vec::new();
        for t in 0..T {
            let mut a = (x
                .i((.., t, ..))
                .unwrap()
                .matmul(&p["rnn.weight_ih_l0"].t().unwrap())
                .unwrap()
                + h.matmul(&p["rnn.weight_hh_l0"].t().unwrap()).unwrap())
            .unwrap();
            if bias {
                a = a
                    .broadcast_add(&(&p["rnn.bias_ih_l0"] + &p["rnn.bias_hh_l0"]).unwrap())
                    .unwrap();
            }
            h = if cell == RecurrentCell::RnnTanh {
                a.tanh().unwrap()
            } else {
                a.relu().unwrap()
            };
            want.push(h.clone());
        }
        assert_close(&out, &Tensor::stack(&want, 1).unwrap(), 1e-5, &format!("{cell:?}"));
    }
}

#[test]
fn lengths_stop_each_sequence_and_one_sequence_under_vmap_equals_the_batch() {
    let map = VarMap::new();
    let cfg = RecurrentConfig {
        layers: 2,
        bidirectional: true,
        bias: true,
    };
    for layer in [
        nn::lstm(I, H, cfg, vb(&map).pp("l")).unwrap(),
        nn::gru(I, H, cfg, vb(&map).pp("g")).unwrap(),
    ] {
        let x = rand(&[B, T, I], 3);
        let lengths = Tensor::new(&[T as i64, 3, 1], &Device::Cpu).unwrap();
        let (out, h_n, _) = ours(&layer, &x, Some(&lengths));
        for (i, &len) in [T, 3, 1].iter().enumerate() {
            // the same sequence cut at its length, no lengths given
            let xi = x.narrow(0, i, 1).unwrap().narrow(1, 0, len).unwrap();
            let (o, h, _) = ours(&layer, &xi, None);
            assert_close(
                &out.narrow(0, i, 1).unwrap().narrow(1, 0, len).unwrap(),
                &o,
                1e-5,
                "outputs up to the length",
            );
            let past = out.narrow(0, i, 1).unwrap().narrow(1, len, T - len).unwrap();
            assert_eq!(common::max_abs(&past), 0.0, "zero outputs past the length");
            assert_close(
                &h_n.narrow(1, i, 1).unwrap(),
                &h,
                1e-5,
                "final states at the length, both ways",
            );
        }
        // one sequence per call under vmap: [T, I] and a scalar length
        let f = |x: Tracer, l: Tracer| {
            let out = layer.run(&Params::own(), &x, Some(&l))?;
            Ok((out.output, out.h_n))
        };
        let (vo, vh) = vmap(f).call((&x, &lengths)).unwrap();
        assert_close(&vo, &out, 1e-5, "vmap outputs");
        assert_close(&vh, &h_n.transpose(0, 1).unwrap(), 1e-5, "vmap h_n");
    }
}

#[test]
fn the_graph_does_not_grow_with_the_sequence_and_new_lengths_do_not_retrace() {
    let map = VarMap::new();
    let layer = nn::lstm(I, H, RecurrentConfig::default(), vb(&map).pp("rnn")).unwrap();
    let nodes = |t: usize| {
        let x = rand(&[t, I], 4);
        let len = Tensor::new(t as i64, &Device::Cpu).unwrap();
        let f = |x: Tracer, l: Tracer| layer.run(&Params::own(), &x, Some(&l))?.h_n.sum_all();
        make_graph(&candle_func::grad(f), (&x, &len)).unwrap().nodes().count()
    };
    assert_eq!(nodes(8), nodes(512), "one graph size for 8 and 512 steps");
    let f = jit(|x: Tracer, l: Tracer| Ok(layer.run(&Params::own(), &x, Some(&l))?.h_n));
    let x = rand(&[B, 16, I], 5);
    for lengths in [[16i64, 4, 9], [2, 16, 1]] {
        f.call((&x, &Tensor::new(&lengths, &Device::Cpu).unwrap())).unwrap();
    }
    assert_eq!(f.traced_signatures(), 1, "lengths are data, not a new signature");
}

#[test]
fn bad_shapes_and_settings_are_errors_naming_the_layer() {
    let map = VarMap::new();
    let layer = nn::lstm(I, H, RecurrentConfig::default(), vb(&map).pp("rnn")).unwrap();
    let call = |x: &Tensor, l: Option<&Tensor>| ours_result(&layer, x, l);
    let msg = call(&rand(&[B, T, I + 1], 6), None);
    assert!(msg.contains("lstm") && msg.contains("takes 4 features"), "{msg}");
    let msg = call(&rand(&[T], 6), None);
    assert!(msg.contains("[T, in] or a batch"), "{msg}");
    let msg = call(
        &rand(&[B, T, I], 6),
        Some(&Tensor::new(&[1i64, 2], &Device::Cpu).unwrap()),
    );
    assert!(msg.contains("one per sequence"), "{msg}");
    let map = VarMap::new();
    let err = nn::rnn(I, H, RecurrentCell::Lstm, RecurrentConfig::default(), vb(&map)).unwrap_err();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().contains("nn::lstm"),
        "{err}"
    );
    let err = nn::gru(I, 0, RecurrentConfig::default(), vb(&map)).unwrap_err();
    assert!(err.to_string().contains("hidden size 0"), "{err}");
    // a gate count times the hidden size past usize is an error, not a panic
    let err = nn::lstm(I, usize::MAX / 2, RecurrentConfig::default(), vb(&map)).unwrap_err();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().contains("overflow"),
        "{err}"
    );
}

fn ours_result(layer: &Recurrent, x: &Tensor, lengths: Option<&Tensor>) -> String {
    let f = |x: Tracer, l: Vec<Tracer>| Ok(layer.run(&Params::own(), &x, l.first())?.output);
    let l: Vec<Tensor> = lengths.into_iter().cloned().collect();
    match jit(f).call((x, &l)) {
        Err(e @ Error::Shape { .. }) => e.to_string(),
        other => panic!("expected a shape error, got {:?}", other.map(|t| t.dims().to_vec())),
    }
}

/// Whether `g` holds a value `[b, ..]` of `per` elements per example.
fn has_per_sample(g: &candle_func::Graph, b: usize, per: usize) -> bool {
    g.nodes().filter(|n| !n.name().starts_with("broadcast")).any(|n| {
        let s = &n.ty().shape;
        s.len() >= 2 && s[0] == b && s[1..].iter().product::<usize>() == per
    })
}

#[test]
fn the_recurrent_weights_per_sample_norms_are_ghosted_and_equal_the_materialised_ones() {
    use candle_func::dp;
    use std::collections::BTreeMap;
    const V: usize = 20;
    const E2: usize = 8;
    const H2: usize = 16;
    const C: usize = 3;
    let map = VarMap::new();
    let emb = nn::embedding(V, E2, vb(&map).pp("emb")).unwrap();
    let rnn = nn::lstm(E2, H2, RecurrentConfig::default(), vb(&map).pp("rnn")).unwrap();
    let fc = nn::linear(H2, C, vb(&map).pp("fc")).unwrap();
    let p: BTreeMap<String, Tensor> = [emb.params(), rnn.params(), fc.params()]
        .into_iter()
        .flatten()
        .collect();
    let loss = |p: BTreeMap<String, Tracer>, ids: Tracer, y: Tracer| {
        let params = Params::with(&p);
        let h = rnn
            .run(&params, &emb.forward_with(&params, &ids)?, None)?
            .h_n
            .squeeze(0)?;
        let logits = fc.forward_with(&params, &h)?;
        nn::cross_entropy(&logits.unsqueeze(0)?, &y.unsqueeze(0)?, nn::Reduction::Mean)
    };
    let ids = Tensor::new(
        &[
            [1u32, 5, 7, 2, 19, 3],
            [4, 4, 0, 11, 6, 8],
            [9, 1, 1, 1, 13, 2],
            [0, 17, 3, 5, 5, 12],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let ys = Tensor::new(&[0u32, 2, 1, 2], &Device::Cpu).unwrap();
    let step = |ghost: bool| {
        dp::clipped_grad_sum(loss, 0.05)
            .ghost(ghost)
            .call((&p, &ids, &ys))
            .unwrap()
    };
    let ((ghost, gn, _), (full, fnorms, _)) = (step(true), step(false));
    assert_close(&gn, &fnorms, 1e-5 * common::max_abs(&fnorms), "per-sample norms");
    for (k, g) in &ghost {
        assert_close(
            g,
            &full[k],
            1e-5 * common::max_abs(&full[k]).max(1e-3),
            &format!("clipped sum {k}"),
        );
    }
    let graph =
        |ghost: bool| candle_func::make_graph(&dp::clipped_grad_sum(loss, 0.05).ghost(ghost), (&p, &ids, &ys)).unwrap();
    // W_hh [4H, H]: one product over the steps per example, ghosted
    let per = 4 * H2 * H2;
    assert!(
        !has_per_sample(&graph(true), 4, per),
        "no per-sample W_hh with ghost norms"
    );
    assert!(has_per_sample(&graph(false), 4, per), "a per-sample W_hh materialised");
}

#[test]
fn long_bf16_sequences_count_their_steps_and_padding_never_reaches_the_state() {
    let map = VarMap::new();
    let vb16 = VarBuilder::from_varmap(&map, DType::BF16, &Device::Cpu);
    let layer = nn::rnn(2, 3, RecurrentCell::RnnRelu, RecurrentConfig::default(), vb16.pp("r")).unwrap();
    let (t, len) = (300, 257);
    let x = rand(&[1, t, 2], 7)
        .affine(0.1, 0.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let lengths = Tensor::new(&[len as u32], &Device::Cpu).unwrap();
    let (_, h, _) = ours(&layer, &x, Some(&lengths));
    let (_, want, _) = ours(&layer, &x.narrow(1, 0, len).unwrap(), None);
    assert_close(
        &h.to_dtype(DType::F32).unwrap(),
        &want.to_dtype(DType::F32).unwrap(),
        0.0,
        "257 steps in bf16",
    );
    // NaN padding past the length: states and outputs stay finite
    let map = VarMap::new();
    let layer = nn::lstm(I, H, RecurrentConfig::default(), vb(&map).pp("l")).unwrap();
    let x = rand(&[1, T, I], 8);
    let nan = Tensor::full(f32::NAN, (1, T - 3, I), &Device::Cpu).unwrap();
    let padded = Tensor::cat(&[&x.narrow(1, 0, 3).unwrap(), &nan], 1).unwrap();
    let (out, h, _) = ours(&layer, &padded, Some(&Tensor::new(&[3u32], &Device::Cpu).unwrap()));
    let (_, want, _) = ours(&layer, &x.narrow(1, 0, 3).unwrap(), None);
    assert_close(&h, &want, 0.0, "the state at the length");
    assert_eq!(
        common::max_abs(&out.narrow(1, 3, T - 3).unwrap()),
        0.0,
        "zero outputs past it"
    );
}

#[test]
fn lengths_outside_one_to_t_are_data_errors_naming_the_sequence() {
    use candle_func::grad;
    let map = VarMap::new();
    let layer = nn::lstm(I, H, RecurrentConfig::default(), vb(&map).pp("l")).unwrap();
    let x = rand(&[B, T, I], 4);
    let run = |l: &Tensor| {
        let f = |x: Tracer, l: Tracer| Ok(layer.run(&Params::own(), &x, Some(&l))?.output);
        jit(f).call((&x, l))
    };
    let f64s = |v: &[f64]| Tensor::new(v, &Device::Cpu).unwrap();
    let cases: Vec<(Tensor, &str)> = vec![
        (
            Tensor::new(&[T as i64 + 1, 3, 1], &Device::Cpu).unwrap(),
            "length 8 of sequence 0",
        ),
        (
            Tensor::new(&[2u32, 0, 1], &Device::Cpu).unwrap(),
            "length 0 of sequence 1",
        ),
        (
            Tensor::new(&[2i64, 3, -1], &Device::Cpu).unwrap(),
            "length -1 of sequence 2",
        ),
        (f64s(&[2.5, 3.0, 1.0]), "length 2.5 of sequence 0"),
        (f64s(&[2.0, f64::NAN, 1.0]), "length NaN of sequence 1"),
    ];
    for (l, named) in &cases {
        let e = run(l).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Data {
                    op: "Recurrent::run",
                    ..
                }
            ) && e.to_string().contains(named),
            "{named}: {e}"
        );
    }
    // under vmap (a scalar length per example) and under grad the same
    let per_example = |x: Tracer, l: Tracer| Ok(layer.run(&Params::own(), &x, Some(&l))?.output);
    let e = vmap(per_example).call((&x, &cases[0].0)).unwrap_err();
    assert!(
        matches!(e, Error::Data { .. }) && e.to_string().contains("length 8"),
        "{e}"
    );
    let loss = |x: Tracer, l: Tracer| layer.run(&Params::own(), &x, Some(&l))?.output.sum_all();
    let e = grad(loss).call((&x, &cases[1].0)).unwrap_err();
    assert!(
        matches!(e, Error::Data { .. }) && e.to_string().contains("length 0"),
        "{e}"
    );
    // the whole range is accepted, in any dtype
    for l in [
        Tensor::new(&[T as u32, 1, 4], &Device::Cpu).unwrap(),
        f64s(&[T as f64, 1.0, 4.0]),
    ] {
        run(&l).unwrap();
    }
}

#[test]
fn a_candle_layer_read_at_the_wrong_prefix_is_an_error_naming_the_weight() {
    let map = VarMap::new();
    let lstm = candle_nn::rnn::lstm(I, H, LSTMConfig::default(), vb(&map).pp("enc")).unwrap();
    let before = map.all_vars().len();
    let e = Recurrent::from_candle_lstm(&[&lstm], I, vb(&map).pp("encoder")).unwrap_err();
    assert!(
        matches!(e, Error::Model { .. }) && e.to_string().contains("\"encoder.weight_ih_l0\""),
        "{e}"
    );
    assert_eq!(map.all_vars().len(), before, "no new random weights were made");
    let gru = candle_nn::rnn::gru(I, H, GRUConfig::default(), vb(&map).pp("g")).unwrap();
    let e = Recurrent::from_candle_gru(&gru, I, vb(&map)).unwrap_err();
    assert!(e.to_string().contains("\"weight_ih_l0\""), "{e}");
    // at the right prefix it reads the trained weights
    Recurrent::from_candle_lstm(&[&lstm], I, vb(&map).pp("enc")).unwrap();
    Recurrent::from_candle_gru(&gru, I, vb(&map).pp("g")).unwrap();
}
