//! The closed set of primitives. Each family's parameter types are in
//! `ops.rs` / `conv.rs` beside this file; their rules are in `crate::rules`.

use super::conv::ConvOp;
use super::ops::{AttnOp, Binary, Compare, IndexOp, PlaceOp, PoolOp, Reduce, ShapeOp, Unary, Uniform};
use super::options::Opts;
use super::{Graph, TensorType};
use candle_core::Tensor;
use std::fmt;
use std::sync::Arc;

/// A primitive operation of the IR.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Prim {
    /// The k-th input of the graph.
    Input(usize),
    /// The k-th captured candle tensor of the graph.
    Const(usize),
    /// A scalar literal (shape `[]`) of the node's dtype.
    Scalar(f64),
    /// Elementwise unary maps (and dtype casts).
    Unary(Unary),
    /// Elementwise binary maps with numpy broadcasting.
    Binary(Binary),
    /// Elementwise comparisons with broadcasting, giving a `u8` mask.
    Compare(Compare),
    /// `where(mask, on_true, on_false)` with broadcasting.
    Where,
    /// Reductions over axes, and (log-)softmax along one axis.
    Reduce(Reduce),
    /// Reshape, permute, broadcast, narrow, concatenate.
    Shape(ShapeOp),
    /// index-select and gather.
    Index(IndexOp),
    /// Matrix product with broadcast leading (batch) axes.
    Matmul,
    /// Convolutions (1D/2D/3D) and unfold (im2col).
    Conv(ConvOp),
    /// Max and average pooling.
    Pool(PoolOp),
    /// Scaled dot-product attention and its gradient, fused.
    Attention(AttnOp),
    /// Result `k` of a primitive with several results (its one operand):
    /// a view of that result, read where the primitive wrote it.
    Get(usize),
    /// A per-example sub-graph mapped over a batch axis: the generic
    /// batching fallback and the conv `Loop` route.
    Map(Box<Map>),
    /// A loop over a sub-graph carrying a state (`scan`, and `fori_loop`
    /// built on it): one node whatever the trip count.
    Scan(Box<Scan>),
    /// One of several sub-graphs, chosen by a scalar index at run time
    /// (`cond`, `switch`).
    Cond(Box<Cond>),
    /// A sub-graph run while another says so (`while_loop`).
    While(Box<While>),
    /// A user-supplied candle function (no batching rule: maps under vmap).
    Custom(CustomOp),
    /// Random values, drawn anew at every run.
    Random(Uniform),
    /// A convolution or matrix product with its epilogue (bias, ReLU),
    /// made by the fusion pass (`interp::passes`) on graphs about to run.
    Fused(Box<Fused>),
    /// A result written in place piece by piece as the pieces are made: a
    /// concatenation lowered by the executable's passes (`interp::passes`),
    /// so its pieces are not all held beside it.
    Place(PlaceOp),
}

impl Prim {
    /// True for inputs, constants and literals: values that are not computed.
    pub(crate) fn is_leaf(&self) -> bool {
        matches!(self, Prim::Input(_) | Prim::Const(_) | Prim::Scalar(_))
    }

    /// The same primitive with every body `g` replaced by `f(g)`, in the
    /// order a map's or a scan's body, a cond's branches, a while
    /// loop's condition and body; `None` for the others. The one list of
    /// the primitives with bodies: the passes reach bodies through it.
    pub(crate) fn with_bodies(&self, mut f: impl FnMut(&Graph) -> Graph) -> Option<Prim> {
        let mut f = |g: &Arc<Graph>| Arc::new(f(g));
        Some(match self {
            Prim::Map(m) => Prim::Map(Box::new(Map {
                body: f(&m.body),
                ..(**m).clone()
            })),
            Prim::Scan(s) => Prim::Scan(Box::new(Scan {
                body: f(&s.body),
                ..(**s).clone()
            })),
            Prim::Cond(c) => Prim::Cond(Box::new(Cond {
                branches: c.branches.iter().map(&mut f).collect(),
            })),
            Prim::While(w) => Prim::While(Box::new(While {
                cond: f(&w.cond),
                body: f(&w.body),
            })),
            _ => return None,
        })
    }

    /// Whether it runs a body many times (a map, a scan, a while loop),
    /// and so may run beside another such loop.
    pub(crate) fn is_loop(&self) -> bool {
        matches!(self, Prim::Map(_) | Prim::Scan(_) | Prim::While(_))
    }

    /// Whether it has several results (read by [`Prim::Get`] nodes).
    pub(crate) fn is_tuple(&self) -> bool {
        matches!(self, Prim::Map(_) | Prim::Scan(_) | Prim::Cond(_) | Prim::While(_))
    }

    /// The types of its results, for a primitive with several (every one
    /// with a body: JAX's `multiple_results`); `None` for the others,
    /// which have one. Its node's own type is [`tuple_type`] of these,
    /// and [`Prim::Get`] nodes read them.
    pub(crate) fn results(&self) -> Option<Vec<TensorType>> {
        Some(match self {
            Prim::Map(m) => m.results(),
            Prim::Scan(s) => s.results(),
            Prim::Cond(c) => c.results(),
            Prim::While(w) => w.results(),
            _ => return None,
        })
    }

    /// A short name with the parameters, as the graph printer shows it.
    pub(crate) fn name(&self) -> String {
        match self {
            Prim::Input(k) => format!("input[{k}]"),
            Prim::Const(k) => format!("const[{k}]"),
            Prim::Scalar(v) => format!("scalar[{v}]"),
            Prim::Unary(u) => u.name(),
            Prim::Binary(b) => b.name().to_string(),
            Prim::Compare(c) => c.name().to_string(),
            Prim::Where => "where".to_string(),
            Prim::Reduce(r) => r.name(),
            Prim::Shape(s) => s.name(),
            Prim::Index(i) => i.name(),
            Prim::Matmul => "matmul".to_string(),
            Prim::Conv(c) => c.name(),
            Prim::Pool(p) => p.name(),
            Prim::Attention(a) => a.name(),
            Prim::Get(k) => format!("get[{k}]"),
            Prim::Map(m) => m.name(),
            Prim::Scan(s) => s.name(),
            Prim::Cond(c) => c.name(),
            Prim::While(w) => w.name(),
            Prim::Custom(c) => format!("custom[{}]", c.name),
            Prim::Random(r) => r.name(),
            Prim::Fused(f) => f.name(),
            Prim::Place(p) => p.name(),
        }
    }

    /// The family-level name without parameters (used for once-per-primitive
    /// warnings and error messages).
    pub(crate) fn kind(&self) -> String {
        let name = self.name();
        match name.find('[') {
            Some(i) => name[..i].to_string(),
            None => name,
        }
    }
}

/// `relu?(view(base(x, w)) + bias?)` as one primitive, operands `[x, w, bias?]`:
/// the epilogue runs on the product's output in place while it is still
/// fresh, instead of two more passes that each allocate a tensor as large.
/// Only the fusion pass (`interp::passes`) makes it, after every transform, so it has
/// no batching or VJP rule.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Fused {
    /// The product: `Prim::Conv(ConvOp::Conv { .. })` or `Prim::Matmul`.
    pub(crate) base: Prim,
    /// The shape the product is viewed as before its epilogue, where a
    /// reshape sat between them (a batching rule's `(B N) C .. -> B N C ..`).
    pub(crate) view: Option<Vec<usize>>,
    /// The permute after that reshape (a batching rule's `B N C -> B C N`):
    /// the epilogue still runs on the product's own layout, its bias read
    /// through the inverse permute, and the result is the permuted view.
    pub(crate) perm: Option<Vec<usize>>,
    /// Whether a bias (broadcast to the (viewed) product's shape) is added.
    pub(crate) bias: bool,
    /// Whether ReLU follows.
    pub(crate) relu: bool,
}

impl Fused {
    pub(crate) fn name(&self) -> String {
        let mut s = format!("fused[{}", self.base.name());
        if let Some(shape) = &self.view {
            s.push_str(&format!("+reshape{shape:?}"));
        }
        if let Some(p) = &self.perm {
            s.push_str(&format!("+permute{p:?}"));
        }
        if self.bias {
            s.push_str("+bias");
        }
        if self.relu {
            s.push_str("+relu");
        }
        s + "]"
    }
}

/// `body` (a per-example graph) mapped over the batch axis `bdims[i]` of
/// each batched operand: one result per output of the body, each with the
/// batch axis first.
/// It carries the options of the transform that made it, so whatever
/// rewrites it later (batching, differentiation) honours the caller's
/// route, strict mode and randomness.
#[derive(Clone, Debug)]
pub(crate) struct Map {
    /// The per-example computation: one input per operand, any outputs.
    pub(crate) body: Arc<Graph>,
    /// The batch axis of each operand (`None`: shared by all examples).
    pub(crate) bdims: Vec<Option<usize>>,
    /// Number of examples.
    pub(crate) size: usize,
    /// The options of the transform that made the map.
    pub(crate) opts: Opts,
}

impl Map {
    /// Each output of the body stacked over the examples (`B out..`).
    pub(crate) fn results(&self) -> Vec<TensorType> {
        stacked(&self.body, &self.body.outputs, self.size)
    }

    pub(crate) fn name(&self) -> String {
        let inner: Vec<String> = self
            .body
            .nodes
            .iter()
            .filter(|n| !n.prim.is_leaf())
            .map(|n| n.prim.name())
            .collect();
        format!("map[size={},bdims={:?}]{{{}}}", self.size, self.bdims, inner.join("; "))
    }
}

impl PartialEq for Map {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.body, &other.body)
            && self.bdims == other.bdims
            && self.size == other.size
            && self.opts == other.opts
    }
}

/// `scan`: the body run `length` times, each step reading the carries the
/// step before wrote. Operands: the initial carries (`carries` of them),
/// the scanned operands `[length, ..]` (the body reads one step's slice)
/// and the operands every step reads whole. The body maps `(carries..,
/// slices.., whole..)` to `(next carries.., outputs..)`, each leaf of its
/// own type. The results, in order: the final carries; each output
/// stacked over the steps (`[length, ..]`, step `t` at row `t`, also when
/// `reverse` runs from the last row); and, where `reads`, the carries each
/// step read, stacked alike (what the VJP runs back over). Dead results go
/// by the primitive's own rule (`Many::prune`): an output nothing reads
/// leaves the body, and the stacked carries leave where no VJP reads them,
/// so a loop run forward holds its last carry only.
#[derive(Clone, Debug)]
pub(crate) struct Scan {
    pub(crate) body: Arc<Graph>,
    /// How many leading operands (and body outputs) are carries.
    pub(crate) carries: usize,
    /// How many operands after the carries are scanned.
    pub(crate) scanned: usize,
    /// The trip count (at least 1).
    pub(crate) length: usize,
    /// Whether the steps run from the last row to the first.
    pub(crate) reverse: bool,
    /// Whether the carries each step read are results too.
    pub(crate) reads: bool,
}

impl Scan {
    pub(crate) fn name(&self) -> String {
        let steps = self.body.nodes.iter().filter(|n| !n.prim.is_leaf()).count();
        let reads = if self.reads { "" } else { ",last carry only" };
        format!(
            "scan[length={},carries={},reverse={}{reads}]{{{steps} nodes}}",
            self.length, self.carries, self.reverse
        )
    }

    /// The row the step `i`-th in running order writes.
    pub(crate) fn row(&self, i: usize) -> usize {
        match self.reverse {
            true => self.length - 1 - i,
            false => i,
        }
    }

    /// The number of outputs a step gives besides its carries.
    pub(crate) fn outputs(&self) -> usize {
        self.body.outputs.len().saturating_sub(self.carries)
    }

    /// The final carries, the stacked outputs, then (where `reads`) the
    /// stacked carries read.
    pub(crate) fn results(&self) -> Vec<TensorType> {
        let b = &self.body;
        let carries: Vec<usize> = b.inputs.iter().take(self.carries).copied().collect();
        let mut out: Vec<TensorType> = carries.iter().map(|&c| b.ty(c).clone()).collect();
        out.extend(stacked(b, &b.outputs[self.carries.min(b.outputs.len())..], self.length));
        if self.reads {
            out.extend(stacked(b, &carries, self.length));
        }
        out
    }
}

impl PartialEq for Scan {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.body, &other.body)
            && (self.carries, self.scanned, self.length, self.reverse, self.reads)
                == (other.carries, other.scanned, other.length, other.reverse, other.reads)
    }
}

/// The types of `g`'s values `vs`, each stacked `n` times (`[n, ..]`).
fn stacked(g: &Graph, vs: &[usize], n: usize) -> Vec<TensorType> {
    vs.iter()
        .map(|&v| {
            let mut t = g.ty(v).clone();
            t.shape.insert(0, n);
            t
        })
        .collect()
}

/// The type of a node with several results: the bytes they take, as one
/// `u8` vector (what the memory plan holds for it until its last
/// [`Prim::Get`] is done; the results themselves are separate tensors).
pub(crate) fn tuple_type(results: &[TensorType]) -> TensorType {
    let bytes = results
        .iter()
        .map(|t| t.elem_count().saturating_mul(t.dtype.size_in_bytes()))
        .fold(0usize, usize::saturating_add);
    TensorType::new(vec![bytes], candle_core::DType::U8)
}

/// `cond` (JAX's `cond_p`, which `lax.switch` binds too): operands
/// `[index, operands..]`, `index` an integer scalar; the results are
/// `branches[index](operands..)`, the index clamped into the branches'
/// range, and no other branch runs. Every branch takes every operand and
/// gives values of the same types. The `cond` binder passes `pred != 0` as
/// the index of `[on_false, on_true]`; `switch` its own clamped index.
#[derive(Clone, Debug)]
pub(crate) struct Cond {
    pub(crate) branches: Vec<Arc<Graph>>,
}

impl Cond {
    /// The first branch's outputs (every branch gives the same types).
    pub(crate) fn results(&self) -> Vec<TensorType> {
        self.branches[0].output_types()
    }

    pub(crate) fn name(&self) -> String {
        let count = |g: &Arc<Graph>| g.nodes.iter().filter(|n| !n.prim.is_leaf()).count().to_string();
        let counts: Vec<String> = self.branches.iter().map(count).collect();
        format!("cond{{{} nodes}}", counts.join(" | "))
    }
}

impl PartialEq for Cond {
    fn eq(&self, other: &Self) -> bool {
        self.branches.len() == other.branches.len()
            && self
                .branches
                .iter()
                .zip(&other.branches)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

/// `while_loop`: operands `[carries.., whole..]` (the body's outputs say
/// how many carries); while `cond(carries.., whole..)` (a scalar, nonzero:
/// true) holds, `carries = body(carries.., whole..)`. The results are the
/// last carries.
#[derive(Clone, Debug)]
pub(crate) struct While {
    pub(crate) cond: Arc<Graph>,
    pub(crate) body: Arc<Graph>,
}

impl While {
    /// The number of carries.
    pub(crate) fn carries(&self) -> usize {
        self.body.outputs.len()
    }

    /// The carries' types.
    pub(crate) fn results(&self) -> Vec<TensorType> {
        self.body.output_types()
    }

    pub(crate) fn name(&self) -> String {
        let steps = self.body.nodes.iter().filter(|n| !n.prim.is_leaf()).count();
        format!("while{{{steps} nodes}}")
    }
}

impl PartialEq for While {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.cond, &other.cond) && Arc::ptr_eq(&self.body, &other.body)
    }
}

/// The function type of a custom primitive.
pub type CustomKernel = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync;

/// A candle function with declared operand and result types.
#[derive(Clone)]
pub(crate) struct CustomOp {
    pub(crate) name: String,
    pub(crate) f: Arc<CustomKernel>,
    pub(crate) ins: Vec<TensorType>,
    pub(crate) out: TensorType,
    /// The user's derivative and batching rules, traced (none by default).
    pub(crate) rules: CustomGraphs,
}

/// Makes the graph of a user's batching rule for operands of these types
/// (batch axis first).
pub(crate) type BatchGraphFn = dyn Fn(&[TensorType]) -> crate::error::Result<Graph> + Send + Sync;

/// A custom op's rules as graphs: `vjp` maps `(args.., out, ct)` to one
/// cotangent per operand, `jvp` maps `(args.., tangents..)` to the result's
/// tangent, and `batch` makes, per batch size, the graph from the batched
/// operands (batch axis first) to the batched result (batch axis first).
#[derive(Clone, Default)]
pub(crate) struct CustomGraphs {
    pub(crate) vjp: Option<Arc<Graph>>,
    pub(crate) jvp: Option<Arc<Graph>>,
    pub(crate) batch: Option<Arc<BatchGraphFn>>,
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({})", self.name)
    }
}

impl PartialEq for CustomOp {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.f, &other.f) && self.ins == other.ins && self.out == other.out
    }
}
