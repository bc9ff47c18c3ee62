//! The `Auto` conv route: it times each candidate once per signature,
//! keeps the fastest, gives the same numbers as the fixed routes, shows
//! its choices, and saves and reloads them.

mod common;

use candle_func::planner::{auto_choices, load_auto_cache, save_auto_cache};
use candle_func::{grad, vmap, ConvRoute, Tracer};
use common::{assert_close, rand};

#[test]
fn auto_picks_the_measured_fastest_and_agrees_with_fixed_routes() {
    let x = rand(&[4, 1, 3, 9, 9], 1);
    let w = rand(&[4, 5, 3, 3, 3], 2);
    let f = |x: Tracer, w: Tracer| x.conv2d(&w, 1, 2, 1, 1);
    let auto = vmap(f).conv_route(ConvRoute::Auto).call((&x, &w)).unwrap();
    let fixed = vmap(f).conv_route(ConvRoute::Loop).call((&x, &w)).unwrap();
    assert_close(&auto, &fixed, 1e-5, "auto vs loop");
    let choices = auto_choices();
    let c = choices
        .iter()
        .find(|c| c.op.starts_with("conv2d[") && c.shapes[0] == vec![4, 1, 3, 9, 9])
        .expect("a recorded choice");
    assert_eq!(c.timings_ms.len(), 3, "{c:?}");
    let fastest = c.timings_ms.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_eq!(c.chosen, fastest, "{c:?}");
    assert_ne!(c.chosen, ConvRoute::Auto);

    // per-sample gradients: the weight and input gradients are chosen too
    let xs = rand(&[6, 2, 7, 7], 3);
    let loss = |w: Tracer, x: Tracer| x.unsqueeze(0)?.conv2d(&w, 0, 1, 1, 1)?.tanh()?.sum_all();
    let w2 = rand(&[3, 2, 3, 3], 4);
    let a = vmap(grad(loss))
        .in_dims([None, Some(0)])
        .conv_route(ConvRoute::Auto)
        .call((&w2, &xs))
        .unwrap();
    let b = vmap(grad(loss))
        .in_dims([None, Some(0)])
        .conv_route(ConvRoute::Unfold)
        .call((&w2, &xs))
        .unwrap();
    assert_close(&a, &b, 1e-5, "auto per-sample gradients");
    assert!(auto_choices().iter().any(|c| c.op.starts_with("conv2d_grad_weight")));

    // saved choices reload
    let path = std::env::temp_dir().join(format!("candle_func_auto_{}.txt", std::process::id()));
    save_auto_cache(&path).unwrap();
    let n = load_auto_cache(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let schedules = candle_func::planner::schedule_choices();
    let measured = schedules.iter().filter(|c| !c.timings_ms.is_empty()).count();
    assert_eq!(n, auto_choices().len() + measured);
    std::fs::write(&path, "not a choice\n").unwrap();
    assert!(load_auto_cache(&path).is_err());
    std::fs::remove_file(&path).ok();
}
