//! Choices among lowerings. A rule with several ways to batch a primitive
//! (the conv routes) does not choose by itself when the options say `Auto`:
//! it describes the choice ([`Choice`]) and asks the [`Planner`] in its
//! context. The planner lives in `crate::transforms::planner` (it times
//! candidates, which rules may not); [`lower`] gives it each candidate's
//! graph to time.

use super::{walk, BVal, BatchCx, Builder, TraceCtx};
use crate::error::{Error, Result};
use crate::ir::options::{ConvRoute, Options, Opts, Schedule};
use crate::ir::{Graph, Prim, TensorType};
use candle_core::Device;

/// A batched primitive with several lowerings.
pub(crate) struct Choice<'a> {
    /// The per-example primitive being batched.
    pub(crate) prim: &'a Prim,
    /// The batched operands' types and batch axes.
    pub(crate) args: Vec<(TensorType, Option<usize>)>,
    /// The batch size.
    pub(crate) size: usize,
    /// The lowerings to choose from.
    pub(crate) candidates: &'a [ConvRoute],
    /// The options in force (their route is `Auto`).
    pub(crate) opts: &'a Opts,
    /// The device the graph will run on.
    pub(crate) device: &'a Device,
}

impl Choice<'_> {
    /// The operands' shapes with the batch axis first.
    pub(crate) fn batch_first_shapes(&self) -> Vec<Vec<usize>> {
        self.args
            .iter()
            .map(|(t, bd)| {
                let mut s = t.shape.clone();
                if let Some(d) = bd {
                    let b = s.remove(*d);
                    s.insert(0, b);
                }
                s
            })
            .collect()
    }
}

/// How a batched graph runs as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RunAs {
    /// The whole batch through one batched graph.
    Whole,
    /// Chunks of this many examples, each batched, concatenated.
    Chunks(usize),
    /// The unbatched graph once per example (a map of the whole graph).
    PerExample,
    /// The convolutional front per example, the rest batched
    /// (`Schedule::ConvsPerExample`).
    ConvsPerExample,
}

/// Decides what has more than one way to run: a lowering for a
/// [`Choice`], and the schedule of a whole batched graph.
pub(crate) trait Planner {
    /// One of `choice.candidates`.
    fn choose(&self, choice: &Choice) -> Result<ConvRoute>;

    /// How a map over `size` examples runs, before any measurement: the
    /// user's chunk size when it is smaller than the batch (a memory
    /// bound), else the schedule asked for (`Auto`: the batched graph).
    fn schedule(&self, opts: &Opts, size: usize) -> RunAs {
        match (opts.chunk_size, opts.schedule) {
            (Some(k), _) if k < size => RunAs::Chunks(k),
            (_, Schedule::PerExample) => RunAs::PerExample,
            (_, Schedule::ConvsPerExample) => RunAs::ConvsPerExample,
            _ => RunAs::Whole,
        }
    }
}

/// The planner of a context where every route is fixed: asked to choose,
/// it reports the bug (a fixed route never reaches a planner).
pub(crate) struct Fixed;

impl Planner for Fixed {
    fn choose(&self, choice: &Choice) -> Result<ConvRoute> {
        Err(Error::internal(
            choice.prim.name(),
            "a fixed-route lowering asked for a plan",
        ))
    }
}

/// The graph that batching `choice.prim` by `route` emits, on fresh inputs
/// of the choice's types, pruned: what a planner times.
pub(crate) fn lower(choice: &Choice, route: ConvRoute) -> Result<Graph> {
    let opts = Opts { route, ..*choice.opts };
    let scratch = Builder::scratch(
        Options::new(),
        TraceCtx::new(choice.device.clone(), crate::rules::infer),
    );
    let mut b = scratch.borrow_mut();
    let vals: Vec<BVal> = choice.args.iter().map(|(t, bd)| (b.input(t.clone()), *bd)).collect();
    let mut cx = BatchCx {
        b: &mut b,
        size: choice.size,
        opts: &opts,
        plan: &Fixed,
    };
    let out = walk::batch_prim(&mut cx, choice.prim, &vals)?;
    Ok(b.finish(vec![out.0]).0.eliminate_dead_code())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::conv::ConvOp;
    use crate::ir::ConvGeom;
    use candle_core::DType;
    use std::cell::RefCell;

    /// A planner that answers `Grouped` and remembers what it was asked.
    struct Recording(RefCell<Vec<(String, Vec<ConvRoute>, usize)>>);

    impl Planner for Recording {
        fn choose(&self, c: &Choice) -> Result<ConvRoute> {
            self.0.borrow_mut().push((c.prim.name(), c.candidates.to_vec(), c.size));
            Ok(ConvRoute::Grouped)
        }
    }

    fn conv() -> Prim {
        Prim::Conv(ConvOp::Conv {
            geom: ConvGeom::uniform(2, 3, 0, 1, 1),
            groups: 1,
        })
    }

    /// Batches a convolution with both operands batched (5 examples) under
    /// `route`; returns the primitives emitted.
    fn emitted(route: ConvRoute, plan: &dyn Planner) -> Result<Vec<String>> {
        let root = Builder::scratch(Options::new(), TraceCtx::new(Device::Cpu, crate::rules::infer));
        let mut b = root.borrow_mut();
        let x = b.input(TensorType::new(vec![5, 1, 2, 6, 6], DType::F32));
        let w = b.input(TensorType::new(vec![5, 4, 2, 3, 3], DType::F32));
        let opts = Opts {
            route,
            ..Opts::default()
        };
        let mut cx = BatchCx {
            b: &mut b,
            size: 5,
            opts: &opts,
            plan,
        };
        walk::batch_prim(&mut cx, &conv(), &[(x, Some(0)), (w, Some(0))])?;
        Ok(b.nodes.iter().map(|n| n.prim.name()).collect())
    }

    #[test]
    fn auto_asks_the_planner_and_a_fixed_route_does_not() {
        let plan = Recording(RefCell::new(Vec::new()));
        let names = emitted(ConvRoute::Auto, &plan).unwrap();
        assert!(
            names.iter().any(|n| n.starts_with("conv2d") && n.contains("g=5")),
            "{names:?}"
        );
        let asked = plan.0.borrow().clone();
        assert_eq!(asked.len(), 1);
        assert!(asked[0].0.starts_with("conv2d"));
        assert_eq!(asked[0].1, vec![ConvRoute::Grouped, ConvRoute::Unfold, ConvRoute::Loop]);
        assert_eq!(asked[0].2, 5);
        let names = emitted(ConvRoute::Unfold, &plan).unwrap();
        assert!(names.iter().any(|n| n.starts_with("unfold_rows")), "{names:?}");
        assert_eq!(plan.0.borrow().len(), 1, "a fixed route is not a question");
        // the fixed-route context reports a question as a bug
        assert!(matches!(emitted(ConvRoute::Auto, &Fixed), Err(Error::Internal { .. })));
    }

    #[test]
    fn lower_gives_each_candidates_graph() {
        let p = conv();
        let opts = Opts::default();
        let choice = Choice {
            prim: &p,
            args: vec![
                (TensorType::new(vec![5, 1, 2, 6, 6], DType::F32), Some(0)),
                (TensorType::new(vec![5, 4, 2, 3, 3], DType::F32), Some(0)),
            ],
            size: 5,
            candidates: &[ConvRoute::Grouped, ConvRoute::Loop],
            opts: &opts,
            device: &Device::Cpu,
        };
        let loop_graph = lower(&choice, ConvRoute::Loop).unwrap().to_string();
        assert!(loop_graph.contains("map["), "{loop_graph}");
        let grouped = lower(&choice, ConvRoute::Grouped).unwrap().to_string();
        assert!(grouped.contains("g=5") && !grouped.contains("map["), "{grouped}");
        assert_eq!(choice.batch_first_shapes()[1], vec![5, 4, 2, 3, 3]);
    }
}
