//! The closed set of primitives. Each family's parameters are defined next
//! to that family's rules in `crate::rules`.

use crate::rules::conv::ConvOp;
use crate::rules::custom::CustomOp;
use crate::rules::elementwise::{Binary, Compare, Unary};
use crate::rules::fallback::LoopPrim;
use crate::rules::index::IndexOp;
use crate::rules::pool::PoolOp;
use crate::rules::random::Uniform;
use crate::rules::reduce::Reduce;
use crate::rules::shape::ShapeOp;

/// A primitive operation of the IR.
#[derive(Clone, Debug, PartialEq)]
pub enum Prim {
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
    /// The generic batching fallback: another primitive run once per example.
    Loop(Box<LoopPrim>),
    /// A user-supplied candle function (no batching rule: loops under vmap).
    Custom(CustomOp),
    /// Random values, drawn anew at every run.
    Random(Uniform),
}

impl Prim {
    /// True for inputs, constants and literals: values that are not computed.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Prim::Input(_) | Prim::Const(_) | Prim::Scalar(_))
    }

    /// A short name with the parameters, as the graph printer shows it.
    pub fn name(&self) -> String {
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
            Prim::Loop(l) => l.name(),
            Prim::Custom(c) => format!("custom[{}]", c.name),
            Prim::Random(r) => r.name(),
        }
    }

    /// The family-level name without parameters (used for once-per-primitive
    /// warnings and error messages).
    pub fn kind(&self) -> String {
        let name = self.name();
        match name.find('[') {
            Some(i) => name[..i].to_string(),
            None => name,
        }
    }
}
