//! Zero-copy stacked parameters: a vmapped ensemble's batched matrix
//! products read the stacked weights in the layout `stack_params` makes,
//! with no per-call relayout (`RunStats::copied_bytes` counts what the
//! kernels copied to change a layout).

use candle_core::{DType, Device, Tensor};
use candle_func::nn::{self, functional_call, stack_params, Module, Sequential};
use candle_func::{make_graph, vmap, Schedule, Tracer};
use std::collections::BTreeMap;

fn mlp(vm: &candle_nn::VarMap) -> Sequential {
    let vb = candle_nn::VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu);
    nn::seq()
        .add(nn::linear(48, 32, vb.pp("fc1")).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::linear(32, 32, vb.pp("fc2")).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::linear(32, 10, vb.pp("fc3")).unwrap())
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

#[test]
fn an_mlp_ensemble_reads_its_stacked_weights_in_place() {
    let (m, b) = (10, 16);
    let vms: Vec<candle_nn::VarMap> = (0..m).map(|_| candle_nn::VarMap::new()).collect();
    let models: Vec<Sequential> = vms.iter().map(mlp).collect();
    let refs: Vec<&Sequential> = models.iter().collect();
    let stacked = stack_params(&refs).unwrap();
    let weights: usize = stacked.values().map(bytes).sum();
    // The products spread over threads when there are at least two per
    // thread; each then reads its model's (transposed) weight in place.
    let spread = m >= 2 * candle_core::utils::get_num_threads();
    for own in [true, false] {
        let x = if own {
            Tensor::randn(0f32, 1., (m, b, 48), &Device::Cpu).unwrap()
        } else {
            Tensor::randn(0f32, 1., (b, 48), &Device::Cpu).unwrap()
        };
        let f = vmap(|p: BTreeMap<String, Tracer>, x: Tracer| functional_call(refs[0], &p, &x))
            .in_dims([Some(0), own.then_some(0)])
            .schedule(Schedule::Batched);
        let g = make_graph(&f, (&stacked, &x)).unwrap();
        let mut inputs: Vec<Tensor> = stacked.values().cloned().collect();
        inputs.push(x.clone());
        let (outs, stats) = g.run_with_stats(&inputs).unwrap();
        // the same numbers as the models one by one
        for (i, model) in models.iter().enumerate() {
            let xi = if own { x.get(i).unwrap() } else { x.clone() };
            let want = model.forward_eager(&xi).unwrap();
            let d = (outs[0].get(i).unwrap() - want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-4);
        }
        if own && spread {
            assert_eq!(stats.copied_bytes, 0, "{g}");
        } else if spread {
            // one shared batch: at most the batch itself is relaid out
            assert!(
                stats.copied_bytes <= bytes(&x),
                "{} bytes copied: {g}",
                stats.copied_bytes
            );
        } else {
            assert!(stats.copied_bytes <= weights + bytes(&x), "{}", stats.copied_bytes);
        }
    }
}
