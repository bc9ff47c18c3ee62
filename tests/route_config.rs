//! Route settings: per call, process-wide setter, environment variable and
//! default, in that order of precedence; an unknown value is an error. One
//! test, run alone in its binary, since the settings are process-wide.

mod common;

use candle_func::settings::{conv_route, set_conv_route, ROUTE_ENV};
use candle_func::{make_graph, vmap, ConvRoute, Error, Tracer};
use common::rand;

fn graph_for(route: Option<ConvRoute>) -> candle_func::Result<String> {
    let x = rand(&[3, 1, 2, 6, 6], 1);
    let w = rand(&[3, 4, 2, 3, 3], 2);
    let f = |x: Tracer, w: Tracer| x.conv2d(&w, 0, 1, 1, 1);
    let g = match route {
        Some(r) => make_graph(&vmap(f).conv_route(r), (&x, &w))?,
        None => make_graph(&vmap(f), (&x, &w))?,
    };
    Ok(g.to_string())
}

fn kind(g: &str) -> &'static str {
    if g.contains("map[") {
        "loop"
    } else if g.contains("unfold2d") || g.contains("unfold_rows2d") {
        "unfold"
    } else if g.contains(",g=3") {
        "grouped"
    } else {
        "unknown"
    }
}

#[test]
fn route_precedence() {
    std::env::remove_var(ROUTE_ENV);
    set_conv_route(None);
    assert_eq!(conv_route().unwrap(), ConvRoute::Unfold, "default");
    assert_eq!(kind(&graph_for(None).unwrap()), "unfold");

    std::env::set_var(ROUTE_ENV, "grouped");
    assert_eq!(kind(&graph_for(None).unwrap()), "grouped", "environment");
    std::env::set_var(ROUTE_ENV, "LOOP");
    assert_eq!(kind(&graph_for(None).unwrap()), "loop", "environment, any case");

    set_conv_route(Some(ConvRoute::Unfold));
    assert_eq!(
        kind(&graph_for(None).unwrap()),
        "unfold",
        "setter wins over environment"
    );
    assert_eq!(
        kind(&graph_for(Some(ConvRoute::Grouped)).unwrap()),
        "grouped",
        "per call wins"
    );

    set_conv_route(None);
    std::env::set_var(ROUTE_ENV, "diagonal");
    match graph_for(None) {
        Err(Error::Config { msg }) => assert!(msg.contains(ROUTE_ENV) && msg.contains("diagonal"), "{msg}"),
        other => panic!("an unknown route must be an error, got {other:?}"),
    }
    // a transform with its own route does not need the environment's
    assert_eq!(
        kind(&graph_for(Some(ConvRoute::Loop)).unwrap()),
        "loop",
        "per call, despite a bad environment"
    );
    std::env::remove_var(ROUTE_ENV);
}
