//! Facts about a primitive that the passes and the memory plan read:
//! whether its result is a view, whether it draws random numbers (or is
//! opaque user code), whether it is cheap to recompute, whether an
//! epilogue may be fused after it, whether it is safe to run on
//! measurement data, and the bytes its run allocates besides its result.
//! Every family answers them in its own file ([`super::Rule::facts`],
//! [`super::Rule::workspace`]); there are no defaults, so a new primitive
//! cannot be merged, recomputed or planned by a silent "no".

use super::rule;
use crate::ir::{Graph, Prim, TensorType};

/// How a primitive's result is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Storage {
    /// A new, contiguous buffer the size of the result.
    Fresh,
    /// A new buffer the size of the result, its values possibly strided
    /// (candle's concatenation off the leading axis of strided operands
    /// returns a transposed view of what it wrote).
    Strided,
    /// A view of operand 0's buffer; `contiguous` when a contiguous
    /// operand gives a contiguous view (a narrow of the leading axis does,
    /// a permute does not).
    View {
        /// Whether contiguity survives the view.
        contiguous: bool,
    },
    /// A view of operand 0 where that is contiguous, else a contiguous
    /// copy (a reshape of a strided view).
    ViewOrCopy,
}

/// What running a primitive does besides computing a function of its
/// operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// A function of its operands alone: equal nodes may be merged, and a
    /// value recomputed.
    Pure,
    /// Draws random numbers, seeded by the node's place in its graph:
    /// never merged, and a graph holding one takes a seed per run.
    Random,
    /// User code that may not be pure: never merged or recomputed, and
    /// never run on measurement data.
    Opaque,
}

/// The facts of one primitive at given operand types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Whether the result is a new buffer or a view.
    pub(crate) storage: Storage,
    /// Pure, random or opaque.
    pub(crate) effect: Effect,
    /// About one pass over its operands, so computing it twice is cheap: a
    /// candidate for rematerialisation.
    pub(crate) cheap: bool,
    /// A product that a bias add and a ReLU may be fused after.
    pub(crate) epilogue: bool,
    /// Safe to run on measurement data (standard normal floats, zero
    /// integers), as `Auto` does when it times candidates.
    pub(crate) measurable: bool,
}

impl Facts {
    /// A pure elementwise-like primitive with a fresh result: cheap to
    /// recompute, measurable, no epilogue.
    pub(crate) const fn cheap_map() -> Facts {
        Facts {
            storage: Storage::Fresh,
            effect: Effect::Pure,
            cheap: true,
            epilogue: false,
            measurable: true,
        }
    }

    /// A pure primitive with a fresh result that costs more than a pass
    /// over its operands (a reduction, an index, a product).
    pub(crate) const fn costly() -> Facts {
        Facts {
            storage: Storage::Fresh,
            effect: Effect::Pure,
            cheap: false,
            epilogue: false,
            measurable: true,
        }
    }
}

/// An operand as the memory plan sees it: its type, and whether its values
/// lie contiguously in memory (a transposed or broadcast view does not).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arg<'a> {
    /// Shape and dtype.
    pub(crate) ty: &'a TensorType,
    /// Whether the values are contiguous.
    pub(crate) contiguous: bool,
}

impl Arg<'_> {
    /// The operand's bytes.
    pub(crate) fn bytes(&self) -> usize {
        bytes(self.ty)
    }

    /// Its bytes if the run copies it to contiguous memory first, else 0.
    pub(crate) fn copy_if_strided(&self) -> usize {
        if self.contiguous {
            0
        } else {
            self.bytes()
        }
    }
}

/// What a primitive's run allocates besides its result, held while it
/// runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Workspace {
    /// Operands copied to another layout first (a strided operand made
    /// contiguous for a product).
    pub(crate) copies: usize,
    /// Buffers the kernel allocates for itself (an im2col matrix, a
    /// per-example map's body).
    pub(crate) scratch: usize,
}

impl Workspace {
    /// No allocation besides the result.
    pub(crate) const NONE: Workspace = Workspace { copies: 0, scratch: 0 };

    /// Copies of operands only.
    pub(crate) fn copies(bytes: usize) -> Workspace {
        Workspace {
            copies: bytes,
            scratch: 0,
        }
    }

    /// A kernel's own buffers only.
    pub(crate) fn scratch(bytes: usize) -> Workspace {
        Workspace {
            copies: 0,
            scratch: bytes,
        }
    }

    /// Both, in bytes.
    pub(crate) fn total(&self) -> usize {
        self.copies.saturating_add(self.scratch)
    }
}

/// The bytes of a value of type `t` (saturating).
pub(crate) fn bytes(t: &TensorType) -> usize {
    t.elem_count().saturating_mul(t.dtype.size_in_bytes())
}

/// The facts of node `v` of `g` (a computed node; leaves have none).
pub(crate) fn of_node(g: &Graph, v: usize) -> Option<Facts> {
    let n = &g.nodes[v];
    if n.prim.is_leaf() {
        return None;
    }
    // layouts are the memory plan's concern: contiguous operands here
    let args: Vec<Arg> = n
        .args
        .iter()
        .map(|&a| Arg {
            ty: g.ty(a),
            contiguous: true,
        })
        .collect();
    rule(&n.prim).ok().map(|r| r.facts(&args, &n.ty))
}

/// The strongest effect among `g`'s nodes (map bodies included): random
/// over opaque over pure.
pub(crate) fn effect_of(g: &Graph) -> Effect {
    let mut effect = Effect::Pure;
    for v in 0..g.nodes.len() {
        match of_node(g, v).map(|f| f.effect) {
            Some(Effect::Random) => return Effect::Random,
            Some(Effect::Opaque) => effect = Effect::Opaque,
            _ => {}
        }
    }
    effect
}

/// Whether running `g` draws random numbers (in a map's body too): only
/// such a run takes a seed from a random stream.
pub(crate) fn draws_random(g: &Graph) -> bool {
    effect_of(g) == Effect::Random
}

/// Whether every node of `g` is safe to run on measurement data.
pub(crate) fn measurable(g: &Graph) -> bool {
    (0..g.nodes.len()).all(|v| of_node(g, v).is_none_or(|f| f.measurable))
}

/// Whether node `v` must never be merged with an equal one: an input, a
/// random draw, user code.
pub(crate) fn unmergeable(g: &Graph, v: usize) -> bool {
    match &g.nodes[v].prim {
        Prim::Input(_) => true,
        p if p.is_leaf() => false,
        _ => of_node(g, v).is_none_or(|f| f.effect != Effect::Pure),
    }
}
