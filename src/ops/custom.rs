//! Custom operations: a candle function inside a trace, optionally with
//! the user's own VJP, JVP and batching rules.

use crate::error::{Error, Result};
use crate::ir::{CustomKernel, CustomOp, Prim, TensorType};
use crate::trace::Tracer;
use std::sync::Arc;

/// Applies a candle function inside a trace (JAX's `pure_callback`): an escape
/// hatch for operations the crate lacks. `out` declares the result's shape
/// and dtype. It has no batching rule, so under `vmap` it runs once per
/// example (with a one-time warning; an error in strict mode).
pub fn custom_op(
    name: &str,
    args: &[&Tracer],
    out: TensorType,
    f: impl Fn(&[candle_core::Tensor]) -> candle_core::Result<candle_core::Tensor> + Send + Sync + 'static,
) -> Result<Tracer> {
    custom_op_with_rules(name, args, out, f, CustomRules::new())
}

type VjpRule = dyn Fn(&[Tracer], &Tracer, &Tracer) -> Result<Vec<Tracer>>;
type JvpRule = dyn Fn(&[Tracer], &[Tracer]) -> Result<Tracer>;
type BatchRule = dyn Fn(&[Tracer]) -> Result<Tracer> + Send + Sync;

/// Rules a user gives a [`custom_op_with_rules`], each written with
/// tracers (ordinary traced operations, constants allowed, no tracer of
/// the enclosing trace): JAX's `custom_vjp`, `custom_jvp` and
/// `custom_vmap`, or `torch.autograd.Function` with `vmap`.
#[derive(Default)]
pub struct CustomRules {
    vjp: Option<Box<VjpRule>>,
    jvp: Option<Box<JvpRule>>,
    batch: Option<Arc<BatchRule>>,
}

impl CustomRules {
    /// No rules: the op maps per example under `vmap` and is an error
    /// under `grad` and `jvp`.
    pub fn new() -> Self {
        Self::default()
    }

    /// The VJP: from the operands, the result and its cotangent, one
    /// cotangent per operand (each of its operand's shape).
    pub fn vjp(mut self, f: impl Fn(&[Tracer], &Tracer, &Tracer) -> Result<Vec<Tracer>> + 'static) -> Self {
        self.vjp = Some(Box::new(f));
        self
    }

    /// The JVP: from the operands and their tangents (zeros for an operand
    /// without one), the result's tangent.
    pub fn jvp(mut self, f: impl Fn(&[Tracer], &[Tracer]) -> Result<Tracer> + 'static) -> Self {
        self.jvp = Some(Box::new(f));
        self
    }

    /// The batching rule: from the operands with a batch axis first (an
    /// unbatched one broadcast), the result with the batch axis first.
    pub fn batch(mut self, f: impl Fn(&[Tracer]) -> Result<Tracer> + Send + Sync + 'static) -> Self {
        self.batch = Some(Arc::new(f));
        self
    }
}

/// `f`'s graph on fresh inputs of `types` in a trace of its own.
fn trace_rule(
    device: &candle_core::Device,
    types: &[TensorType],
    f: impl FnOnce(&[Tracer]) -> Result<Vec<Tracer>>,
) -> Result<crate::ir::Graph> {
    use crate::rules::{Builder, TraceCtx};
    let b = Builder::scratch(
        crate::ir::Options::new(),
        TraceCtx::new(device.clone(), crate::rules::infer),
    );
    let ins: Vec<Tracer> = types
        .iter()
        .map(|t| {
            let id = b.borrow_mut().input(t.clone());
            Tracer::new(&b, id)
        })
        .collect();
    let outs = f(&ins)?;
    if let Some(t) = outs.iter().find(|t| !std::rc::Rc::ptr_eq(&t.b, &b)) {
        return Err(Error::Trace {
            msg: format!("a custom rule returned {t:?}, a value of another trace (rules see only their arguments)"),
        });
    }
    let g = b.borrow().finish(outs.iter().map(|t| t.id).collect()).0;
    Ok(g)
}

/// [`custom_op`] with the user's derivative and batching rules (see
/// [`CustomRules`]): a fused candle kernel can then live inside
/// `vmap(grad(..))` and `jvp`. The rules are traced when the op is, and
/// their results checked against the operands' and result's types.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_func::{custom_op_with_rules, grad, vmap, CustomRules, Tracer};
/// // candle's softmax kernel as an opaque op, with its VJP and a batching rule
/// let softmax = |x: &Tracer| {
///     let rules = CustomRules::new()
///         .vjp(|_, y, ct| Ok(vec![y.mul(&ct.sub(&ct.mul(y)?.sum_keepdim(0)?)?)?]))
///         .batch(|xs| xs[0].softmax(-1));
///     custom_op_with_rules("softmax", &[x], x.tensor_type().clone(), |xs| {
///         candle_nn::ops::softmax_last_dim(&xs[0])
///     }, rules)
/// };
/// let xs = Tensor::new(&[[1f32, 2., 3.], [0., 0., 1.]], &Device::Cpu)?;
/// let g = vmap(grad(|x: Tracer| softmax(&x)?.sqr()?.sum_all())).call(&xs)?;
/// assert_eq!(g.dims(), &[2, 3]);
/// # Ok::<(), candle_func::Error>(())
/// ```
pub fn custom_op_with_rules(
    name: &str,
    args: &[&Tracer],
    out: TensorType,
    f: impl Fn(&[candle_core::Tensor]) -> candle_core::Result<candle_core::Tensor> + Send + Sync + 'static,
    rules: CustomRules,
) -> Result<Tracer> {
    let (first, rest) = args
        .split_first()
        .ok_or_else(|| Error::shape("custom", &[], "needs at least one operand"))?;
    let device = first.device();
    let ins: Vec<TensorType> = args.iter().map(|t| t.ty.clone()).collect();
    let mut graphs = crate::ir::CustomGraphs::default();
    if let Some(vjp) = rules.vjp {
        let mut types = ins.clone();
        types.extend([out.clone(), out.clone()]);
        let n = ins.len();
        let g = trace_rule(&device, &types, |t| vjp(&t[..n], &t[n], &t[n + 1]))?;
        if g.output_types() != ins {
            return Err(Error::shape(
                "custom",
                &[],
                format!(
                    "{name}: the VJP must return one cotangent per operand, typed {ins:?}, got {:?}",
                    g.output_types()
                ),
            ));
        }
        graphs.vjp = Some(Arc::new(g));
    }
    if let Some(jvp) = rules.jvp {
        let types = [ins.clone(), ins.clone()].concat();
        let n = ins.len();
        let g = trace_rule(&device, &types, |t| Ok(vec![jvp(&t[..n], &t[n..])?]))?;
        if g.output_types() != [out.clone()] {
            return Err(Error::shape(
                "custom",
                &[&out.shape],
                format!(
                    "{name}: the JVP must return the result's tangent, got {:?}",
                    g.output_types()
                ),
            ));
        }
        graphs.jvp = Some(Arc::new(g));
    }
    if let Some(batch) = rules.batch {
        let dev = device.clone();
        graphs.batch = Some(Arc::new(move |types: &[TensorType]| {
            trace_rule(&dev, types, |t| Ok(vec![batch(t)?]))
        }));
    }
    let f: Arc<CustomKernel> = Arc::new(f);
    let op = CustomOp {
        name: name.to_string(),
        f,
        ins,
        out,
        rules: graphs,
    };
    first.emit(Prim::Custom(op), rest)
}
