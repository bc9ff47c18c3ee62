//! A `custom_op` with the user's VJP, JVP and batching rule runs inside
//! `vmap(grad(..))` and `jvp` with the numbers of the same computation
//! written with traced operations; a rule of the wrong type is an error.

mod common;

use candle_func::{custom_op_with_rules, grad, jvp, make_graph, vmap, CustomRules, Error, Tracer};
use common::{assert_close, rand};

/// candle's fused softmax over the last axis as an opaque op, with rules.
fn fused_softmax(x: &Tracer) -> candle_func::Result<Tracer> {
    let rules = CustomRules::new()
        .vjp(|_, y, ct| Ok(vec![y.mul(&ct.sub(&ct.mul(y)?.sum_keepdim(-1)?)?)?]))
        .jvp(|xs, ts| {
            let y = xs[0].softmax(-1)?;
            y.mul(&ts[0].sub(&ts[0].mul(&y)?.sum_keepdim(-1)?)?)
        })
        // the kernel takes any leading axes: batched, it is the same op on
        // the batched operand
        .batch(|xs| fused_softmax(&xs[0]));
    custom_op_with_rules(
        "fused_softmax",
        &[x],
        x.tensor_type().clone(),
        |xs| candle_nn::ops::softmax_last_dim(&xs[0]),
        rules,
    )
}

fn loss_with(
    sm: fn(&Tracer) -> candle_func::Result<Tracer>,
) -> impl Fn(Tracer, Tracer) -> candle_func::Result<Tracer> + Clone {
    move |w: Tracer, x: Tracer| sm(&x.unsqueeze(0)?.matmul(&w)?)?.sqr()?.sum_all()
}

#[test]
fn user_rules_give_the_traced_numbers() {
    let w = rand(&[5, 7], 1);
    let xs = rand(&[6, 5], 2);
    let traced: fn(&Tracer) -> candle_func::Result<Tracer> = |x| x.softmax(-1);
    let (custom, plain) = (loss_with(fused_softmax), loss_with(traced));
    // per-sample gradients: the VJP rule under the batching rule
    let f = vmap(grad(custom.clone())).in_dims([None, Some(0)]);
    let g = make_graph(&f, (&w, &xs)).unwrap().to_string();
    assert!(
        g.contains("fused_softmax") && !g.contains("map["),
        "batched by the rule: {g}"
    );
    let (got, warnings) = candle_func::settings::capture_warnings(|| f.call((&w, &xs)));
    let got = got.unwrap();
    // batched by the rule, not by the loop fallback (which would warn)
    assert!(warnings.is_empty(), "{warnings:?}");
    let want = vmap(grad(plain.clone()))
        .in_dims([None, Some(0)])
        .call((&w, &xs))
        .unwrap();
    assert_close(&got, &want, 1e-5, "vmap(grad)");
    // forward mode: the JVP rule
    let x = rand(&[3, 7], 3);
    let u = rand(&[3, 7], 4);
    let (y1, t1) = jvp(&|x: Tracer| fused_softmax(&x), &x, &u).unwrap();
    let (y2, t2) = jvp(&|x: Tracer| x.softmax(-1), &x, &u).unwrap();
    assert_close(&y1, &y2, 1e-6, "value");
    assert_close(&t1, &t2, 1e-6, "tangent");
}

#[test]
fn rules_of_the_wrong_type_are_errors() {
    let x = rand(&[3, 4], 5);
    let bad = |x: Tracer| {
        let rules = CustomRules::new().vjp(|xs, _, _| Ok(vec![xs[0].sum(0)?]));
        custom_op_with_rules("bad", &[&x], x.tensor_type().clone(), |xs| xs[0].exp(), rules)
    };
    let r = candle_func::jit(bad).call(&x);
    match r {
        Err(Error::Shape { msg, .. }) => assert!(msg.contains("one cotangent per operand"), "{msg}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    // without rules: grad names the op
    let none =
        |x: Tracer| candle_func::custom_op("opaque", &[&x], x.tensor_type().clone(), |xs| xs[0].exp())?.sum_all();
    let e = grad(none).call(&x).unwrap_err().to_string();
    assert!(e.contains("opaque") && e.contains("no VJP rule"), "{e}");
}
