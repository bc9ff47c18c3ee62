//! Trees of tensors (JAX's pytrees): a tensor, tuples of trees, `Vec`s of
//! trees and name -> tree maps. Transforms work on flat lists of leaves;
//! these traits flatten a user's arguments and rebuild a user's results.

use crate::error::{Error, Result};
use crate::trace::Tracer;
use candle_core::Tensor;
use std::collections::{BTreeMap, HashMap};
use std::vec::IntoIter;

/// The structure of a tree, without its leaves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TreeDef {
    /// One tensor.
    Leaf,
    /// A tuple of trees.
    Tuple(Vec<TreeDef>),
    /// A list of trees.
    List(Vec<TreeDef>),
    /// Named trees, in sorted key order.
    Map(Vec<(String, TreeDef)>),
}

impl TreeDef {
    /// Number of leaves.
    pub fn leaf_count(&self) -> usize {
        match self {
            TreeDef::Leaf => 1,
            TreeDef::Tuple(c) | TreeDef::List(c) => c.iter().map(TreeDef::leaf_count).sum(),
            TreeDef::Map(c) => c.iter().map(|(_, d)| d.leaf_count()).sum(),
        }
    }

    /// Each leaf's path in flattening order: map keys and tuple or list
    /// positions joined by dots (`fc1.weight`, `0.1`), empty for a bare
    /// tensor.
    pub(crate) fn leaf_paths(&self) -> Vec<String> {
        let join = |prefix: String, rest: Vec<String>| -> Vec<String> {
            rest.into_iter()
                .map(|r| {
                    if r.is_empty() {
                        prefix.clone()
                    } else {
                        format!("{prefix}.{r}")
                    }
                })
                .collect()
        };
        match self {
            TreeDef::Leaf => vec![String::new()],
            TreeDef::Tuple(c) | TreeDef::List(c) => c
                .iter()
                .enumerate()
                .flat_map(|(i, d)| join(i.to_string(), d.leaf_paths()))
                .collect(),
            TreeDef::Map(c) => c.iter().flat_map(|(k, d)| join(k.clone(), d.leaf_paths())).collect(),
        }
    }

    /// This structure with every leaf replaced by `inner`: the structure of
    /// [`SymTree::Nest`] (a Jacobian's, one `inner`-shaped block per leaf).
    pub(crate) fn graft(&self, inner: &TreeDef) -> TreeDef {
        match self {
            TreeDef::Leaf => inner.clone(),
            TreeDef::Tuple(c) => TreeDef::Tuple(c.iter().map(|d| d.graft(inner)).collect()),
            TreeDef::List(c) => TreeDef::List(c.iter().map(|d| d.graft(inner)).collect()),
            TreeDef::Map(c) => TreeDef::Map(c.iter().map(|(k, d)| (k.clone(), d.graft(inner))).collect()),
        }
    }
}

fn mismatch(want: &str, def: &TreeDef) -> Error {
    Error::Tree {
        msg: format!("expected {want}, found structure {def:?}"),
    }
}

fn next_leaf<L>(it: &mut IntoIter<L>) -> Result<L> {
    it.next().ok_or_else(|| Error::Tree {
        msg: "fewer leaves than the structure needs".into(),
    })
}

/// A tree of symbolic tensors: what traced functions take and return.
pub trait SymTree: Sized {
    /// The same structure with candle tensors as leaves.
    type Concrete;
    /// This structure with every leaf replaced by a tree of type `L`: how
    /// a Jacobian is shaped, as in `torch.func` (for each output leaf, a
    /// tree like the inputs whose leaves are `[*out, *in]`).
    type Nest<L: SymTree>: SymTree;
    /// Appends the leaves in order and returns the structure.
    fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef;
    /// Rebuilds a tree of this type from a structure and leaves.
    fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self>;
    /// Rebuilds the concrete mirror from a structure and tensors.
    fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Self::Concrete>;
}

/// A tree of candle tensors: what transformed functions are called with.
pub trait TensorTree {
    /// The same structure with symbolic leaves.
    type Sym: SymTree;
    /// Appends the leaves in order and returns the structure.
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef;
}

impl SymTree for Tracer {
    type Concrete = Tensor;
    type Nest<L: SymTree> = L;
    fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef {
        out.push(self.clone());
        TreeDef::Leaf
    }
    fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self> {
        match def {
            TreeDef::Leaf => next_leaf(leaves),
            d => Err(mismatch("a tensor", d)),
        }
    }
    fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Tensor> {
        match def {
            TreeDef::Leaf => next_leaf(leaves),
            d => Err(mismatch("a tensor", d)),
        }
    }
}

impl TensorTree for Tensor {
    type Sym = Tracer;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        out.push(self.clone());
        TreeDef::Leaf
    }
}

impl<T: TensorTree + ?Sized> TensorTree for &T {
    type Sym = T::Sym;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        (**self).flatten_into(out)
    }
}

macro_rules! tuple_trees {
    ($($t:ident $i:tt),+) => {
        impl<$($t: SymTree),+> SymTree for ($($t,)+) {
            type Concrete = ($($t::Concrete,)+);
            type Nest<L: SymTree> = ($($t::Nest<L>,)+);
            fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef {
                TreeDef::Tuple(vec![$(self.$i.flatten_into(out)),+])
            }
            fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self> {
                match def {
                    TreeDef::Tuple(c) if c.len() == [$($i),+].len() => Ok(($($t::unflatten_from(&c[$i], leaves)?,)+)),
                    d => Err(mismatch("a tuple", d)),
                }
            }
            fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Self::Concrete> {
                match def {
                    TreeDef::Tuple(c) if c.len() == [$($i),+].len() => Ok(($($t::concrete_from(&c[$i], leaves)?,)+)),
                    d => Err(mismatch("a tuple", d)),
                }
            }
        }

        impl<$($t: TensorTree),+> TensorTree for ($($t,)+) {
            type Sym = ($($t::Sym,)+);
            fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
                TreeDef::Tuple(vec![$(self.$i.flatten_into(out)),+])
            }
        }
    };
}

/// A tree's leaves, in order, and its structure.
pub(crate) fn leaves_of<T: SymTree>(t: &T) -> (Vec<Tracer>, TreeDef) {
    let mut out = Vec::new();
    let def = t.flatten_into(&mut out);
    (out, def)
}

/// The empty tree: a loop's body with no outputs, nothing scanned.
impl SymTree for () {
    type Concrete = ();
    type Nest<L: SymTree> = ();
    fn flatten_into(&self, _out: &mut Vec<Tracer>) -> TreeDef {
        TreeDef::Tuple(Vec::new())
    }
    fn unflatten_from(def: &TreeDef, _leaves: &mut IntoIter<Tracer>) -> Result<Self> {
        match def {
            TreeDef::Tuple(c) if c.is_empty() => Ok(()),
            d => Err(mismatch("()", d)),
        }
    }
    fn concrete_from(def: &TreeDef, _leaves: &mut IntoIter<Tensor>) -> Result<()> {
        match def {
            TreeDef::Tuple(c) if c.is_empty() => Ok(()),
            d => Err(mismatch("()", d)),
        }
    }
}

tuple_trees!(A 0, B 1);
tuple_trees!(A 0, B 1, C 2);
tuple_trees!(A 0, B 1, C 2, D 3);

impl<A: SymTree> SymTree for Vec<A> {
    type Concrete = Vec<A::Concrete>;
    type Nest<L: SymTree> = Vec<A::Nest<L>>;
    fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef {
        TreeDef::List(self.iter().map(|a| a.flatten_into(out)).collect())
    }
    fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self> {
        match def {
            TreeDef::List(c) => c.iter().map(|d| A::unflatten_from(d, leaves)).collect(),
            d => Err(mismatch("a list", d)),
        }
    }
    fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Self::Concrete> {
        match def {
            TreeDef::List(c) => c.iter().map(|d| A::concrete_from(d, leaves)).collect(),
            d => Err(mismatch("a list", d)),
        }
    }
}

impl<A: TensorTree> TensorTree for Vec<A> {
    type Sym = Vec<A::Sym>;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        self.as_slice().flatten_into(out)
    }
}

impl<A: TensorTree> TensorTree for [A] {
    type Sym = Vec<A::Sym>;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        TreeDef::List(self.iter().map(|a| a.flatten_into(out)).collect())
    }
}

fn map_from<A, L>(
    def: &TreeDef,
    leaves: &mut IntoIter<L>,
    mut one: impl FnMut(&TreeDef, &mut IntoIter<L>) -> Result<A>,
) -> Result<Vec<(String, A)>> {
    match def {
        TreeDef::Map(c) => c.iter().map(|(k, d)| Ok((k.clone(), one(d, leaves)?))).collect(),
        d => Err(mismatch("a map", d)),
    }
}

impl<A: SymTree> SymTree for BTreeMap<String, A> {
    type Concrete = BTreeMap<String, A::Concrete>;
    type Nest<L: SymTree> = BTreeMap<String, A::Nest<L>>;
    fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef {
        TreeDef::Map(self.iter().map(|(k, a)| (k.clone(), a.flatten_into(out))).collect())
    }
    fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self> {
        Ok(map_from(def, leaves, A::unflatten_from)?.into_iter().collect())
    }
    fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Self::Concrete> {
        Ok(map_from(def, leaves, A::concrete_from)?.into_iter().collect())
    }
}

impl<A: SymTree> SymTree for HashMap<String, A> {
    type Concrete = HashMap<String, A::Concrete>;
    type Nest<L: SymTree> = HashMap<String, A::Nest<L>>;
    fn flatten_into(&self, out: &mut Vec<Tracer>) -> TreeDef {
        let mut keys: Vec<&String> = self.keys().collect();
        keys.sort();
        TreeDef::Map(
            keys.into_iter()
                .map(|k| (k.clone(), self[k].flatten_into(out)))
                .collect(),
        )
    }
    fn unflatten_from(def: &TreeDef, leaves: &mut IntoIter<Tracer>) -> Result<Self> {
        Ok(map_from(def, leaves, A::unflatten_from)?.into_iter().collect())
    }
    fn concrete_from(def: &TreeDef, leaves: &mut IntoIter<Tensor>) -> Result<Self::Concrete> {
        Ok(map_from(def, leaves, A::concrete_from)?.into_iter().collect())
    }
}

impl<A: TensorTree> TensorTree for BTreeMap<String, A> {
    type Sym = BTreeMap<String, A::Sym>;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        TreeDef::Map(self.iter().map(|(k, a)| (k.clone(), a.flatten_into(out))).collect())
    }
}

impl<A: TensorTree> TensorTree for HashMap<String, A> {
    type Sym = HashMap<String, A::Sym>;
    fn flatten_into(&self, out: &mut Vec<Tensor>) -> TreeDef {
        let mut keys: Vec<&String> = self.keys().collect();
        keys.sort();
        TreeDef::Map(
            keys.into_iter()
                .map(|k| (k.clone(), self[k].flatten_into(out)))
                .collect(),
        )
    }
}

/// The argument list of a traced function: a tuple with one symbolic tree
/// per parameter of the closure. `in_dims` has one entry per element.
pub trait ArgList: Sized {
    /// The same arguments with candle tensors as leaves.
    type Concrete;
    /// Leaves and structure of each argument.
    fn flatten_args(&self) -> (Vec<Vec<Tracer>>, Vec<TreeDef>);
    /// Rebuilds the arguments from structures and leaves.
    fn unflatten_args(defs: &[TreeDef], leaves: Vec<Vec<Tracer>>) -> Result<Self>;
    /// Rebuilds the concrete mirror from structures and tensors.
    fn concrete_from(defs: &[TreeDef], leaves: Vec<Vec<Tensor>>) -> Result<Self::Concrete>;
}

/// Concrete arguments for a function whose argument list is `S`: for a
/// one-parameter function any tensor tree, for more a tuple with one tree
/// per parameter.
pub trait CallArgs<S> {
    /// Leaves and structure of each argument.
    fn flatten_args(&self) -> (Vec<Vec<Tensor>>, Vec<TreeDef>);
}

fn one<T: TensorTree + ?Sized>(t: &T, leaves: &mut Vec<Vec<Tensor>>, defs: &mut Vec<TreeDef>) {
    let mut l = Vec::new();
    defs.push(t.flatten_into(&mut l));
    leaves.push(l);
}

fn one_sym<T: SymTree>(t: &T, leaves: &mut Vec<Vec<Tracer>>, defs: &mut Vec<TreeDef>) {
    let mut l = Vec::new();
    defs.push(t.flatten_into(&mut l));
    leaves.push(l);
}

impl<C: TensorTree> CallArgs<(C::Sym,)> for C {
    fn flatten_args(&self) -> (Vec<Vec<Tensor>>, Vec<TreeDef>) {
        let (mut leaves, mut defs) = (Vec::new(), Vec::new());
        one(self, &mut leaves, &mut defs);
        (leaves, defs)
    }
}

macro_rules! arg_lists {
    ($n:expr; $($t:ident $c:ident $i:tt),+) => {
        impl<$($t: SymTree),+> ArgList for ($($t,)+) {
            type Concrete = ($($t::Concrete,)+);
            fn flatten_args(&self) -> (Vec<Vec<Tracer>>, Vec<TreeDef>) {
                let (mut leaves, mut defs) = (Vec::new(), Vec::new());
                $(one_sym(&self.$i, &mut leaves, &mut defs);)+
                (leaves, defs)
            }
            fn unflatten_args(defs: &[TreeDef], leaves: Vec<Vec<Tracer>>) -> Result<Self> {
                if defs.len() != $n || leaves.len() != $n {
                    return Err(Error::Tree { msg: format!("expected {} arguments, got {}", $n, defs.len()) });
                }
                let mut its: Vec<IntoIter<Tracer>> = leaves.into_iter().map(Vec::into_iter).collect();
                Ok(($($t::unflatten_from(&defs[$i], &mut its[$i])?,)+))
            }
            fn concrete_from(defs: &[TreeDef], leaves: Vec<Vec<Tensor>>) -> Result<Self::Concrete> {
                if defs.len() != $n || leaves.len() != $n {
                    return Err(Error::Tree { msg: format!("expected {} arguments, got {}", $n, defs.len()) });
                }
                let mut its: Vec<IntoIter<Tensor>> = leaves.into_iter().map(Vec::into_iter).collect();
                Ok(($($t::concrete_from(&defs[$i], &mut its[$i])?,)+))
            }
        }
    };
}

arg_lists!(1; A CA 0);
arg_lists!(2; A CA 0, B CB 1);
arg_lists!(3; A CA 0, B CB 1, C CC 2);
arg_lists!(4; A CA 0, B CB 1, C CC 2, D CD 3);

macro_rules! call_args {
    ($($c:ident $i:tt),+) => {
        impl<$($c: TensorTree),+> CallArgs<($($c::Sym,)+)> for ($($c,)+) {
            fn flatten_args(&self) -> (Vec<Vec<Tensor>>, Vec<TreeDef>) {
                let (mut leaves, mut defs) = (Vec::new(), Vec::new());
                $(one(&self.$i, &mut leaves, &mut defs);)+
                (leaves, defs)
            }
        }
    };
}

call_args!(A 0, B 1);
call_args!(A 0, B 1, C 2);
call_args!(A 0, B 1, C 2, D 3);

/// Whether `prefix` holds `name`: the name itself or a `.`-separated head
/// of it (`"fc1"` holds `fc1.weight`, not `fc10.weight`).
pub(crate) fn under(name: &str, prefix: &str) -> bool {
    name == prefix || name.strip_prefix(prefix).is_some_and(|r| r.starts_with('.'))
}

/// Whether two prefixes hold a parameter in common: one is the other or a
/// `.`-separated head of it (`fc` and `fc.weight`, not `fc` and `fc2`).
pub(crate) fn overlap(a: &str, b: &str) -> bool {
    under(a, b) || under(b, a)
}
