//! `vmap`'s `in_dims` and `out_dims`: one axis for everything, one per
//! top-level argument (or output), or a prefix tree per argument as JAX
//! and `torch.func` accept: an axis at a node applies to every leaf under
//! it, a sequence or a map descends into a tuple, list or map of the same
//! shape.

use super::tree::TreeDef;
use std::collections::BTreeMap;

/// Batch axes, one entry per top-level argument (or output); `None` means
/// not batched, negative axes count from the end. Built from a single
/// integer (the same axis everywhere), a list (`vmap(f).in_dims([None,
/// Some(0)])`), or a list of [`DimTree`]s for axes per leaf.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dims {
    /// The same axis for every argument.
    All(Option<isize>),
    /// One entry per top-level argument.
    Each(Vec<Option<isize>>),
    /// One prefix tree per top-level argument.
    Trees(Vec<DimTree>),
}

/// The batch axes of one argument as a prefix of its tree: an axis for a
/// whole subtree, or a sequence (matching a tuple or list) or a map
/// (matching a map, key for key) of subtrees.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_func::{vmap, DimTree, Tracer};
/// use std::collections::BTreeMap;
/// let dev = Device::Cpu;
/// // a weight shared by all examples, a bias per example
/// let p = BTreeMap::from([
///     ("w".to_string(), Tensor::ones(3, candle_core::DType::F32, &dev)?),
///     ("b".to_string(), Tensor::new(&[10f32, 20.], &dev)?),
/// ]);
/// let xs = Tensor::ones((2, 3), candle_core::DType::F32, &dev)?;
/// let f = |p: BTreeMap<String, Tracer>, x: Tracer| x.mul(&p["w"])?.sum_all()?.add(&p["b"]);
/// let dims = [DimTree::map([("w", None), ("b", Some(0))]), DimTree::from(0)];
/// let ys = vmap(f).in_dims(dims).call((&p, &xs))?;
/// assert_eq!(ys.to_vec1::<f32>()?, vec![13., 23.]);
/// # Ok::<(), candle_func::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DimTree {
    /// This axis for every leaf below (`None`: not batched).
    Axis(Option<isize>),
    /// One entry per element of a tuple or list.
    Seq(Vec<DimTree>),
    /// One entry per key of a map.
    Map(BTreeMap<String, DimTree>),
}

impl DimTree {
    /// One entry per element of a tuple or list.
    pub fn seq<D: Into<DimTree>>(items: impl IntoIterator<Item = D>) -> DimTree {
        DimTree::Seq(items.into_iter().map(Into::into).collect())
    }

    /// One entry per key of a map (every key of the argument's map).
    pub fn map<K: Into<String>, D: Into<DimTree>>(entries: impl IntoIterator<Item = (K, D)>) -> DimTree {
        DimTree::Map(entries.into_iter().map(|(k, d)| (k.into(), d.into())).collect())
    }

    /// Appends the axis of every leaf of `def`, in flattening order.
    fn expand(&self, def: &TreeDef, path: &str, out: &mut Vec<Option<isize>>) -> Result<(), String> {
        let at = |p: &str| {
            if path.is_empty() {
                "the argument".to_string()
            } else {
                format!("`{p}`")
            }
        };
        let sub = |k: &str| {
            if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            }
        };
        match (self, def) {
            (DimTree::Axis(d), _) => out.extend(std::iter::repeat_n(*d, def.leaf_count())),
            (DimTree::Seq(ds), TreeDef::Tuple(cs) | TreeDef::List(cs)) if ds.len() == cs.len() => {
                for (i, (d, c)) in ds.iter().zip(cs).enumerate() {
                    d.expand(c, &sub(&i.to_string()), out)?;
                }
            }
            (DimTree::Map(ds), TreeDef::Map(cs))
                if ds.len() == cs.len() && cs.iter().all(|(k, _)| ds.contains_key(k)) =>
            {
                for (k, c) in cs {
                    ds[k].expand(c, &sub(k), out)?;
                }
            }
            (DimTree::Seq(ds), _) => {
                return Err(format!(
                    "a sequence of {} entries given where {} is {}",
                    ds.len(),
                    at(path),
                    describe(def)
                ))
            }
            (DimTree::Map(ds), _) => {
                let keys: Vec<&String> = ds.keys().collect();
                return Err(format!(
                    "a map with keys {keys:?} given where {} is {}",
                    at(path),
                    describe(def)
                ));
            }
        }
        Ok(())
    }
}

/// A structure in words, for errors.
fn describe(def: &TreeDef) -> String {
    match def {
        TreeDef::Leaf => "a tensor".into(),
        TreeDef::Tuple(c) => format!("a tuple of {}", c.len()),
        TreeDef::List(c) => format!("a list of {}", c.len()),
        TreeDef::Map(c) => format!("a map with keys {:?}", c.iter().map(|(k, _)| k).collect::<Vec<_>>()),
    }
}

/// Which top-level entry a dims tree does not fit (none: the count of
/// entries is wrong), and why.
pub(crate) type Misfit = (Option<usize>, String);

impl Dims {
    /// The axis of every leaf, per top-level entry of `defs` (arguments or
    /// outputs); on a mismatch the entry's index (none when the count of
    /// entries is wrong, which is no one entry's fault) and why.
    pub(crate) fn per_leaf(&self, defs: &[&TreeDef], what: &str) -> Result<Vec<Vec<Option<isize>>>, Misfit> {
        let count = |n: usize| -> Result<(), Misfit> {
            match n == defs.len() {
                true => Ok(()),
                false => Err((None, format!("{n} entries given for {} {what}", defs.len()))),
            }
        };
        match self {
            Dims::All(d) => Ok(defs.iter().map(|def| vec![*d; def.leaf_count()]).collect()),
            Dims::Each(v) => {
                count(v.len())?;
                Ok(defs.iter().zip(v).map(|(def, d)| vec![*d; def.leaf_count()]).collect())
            }
            Dims::Trees(v) => {
                count(v.len())?;
                let mut all = Vec::with_capacity(defs.len());
                for (i, (def, d)) in defs.iter().zip(v).enumerate() {
                    let mut leaves = Vec::with_capacity(def.leaf_count());
                    d.expand(def, "", &mut leaves).map_err(|m| (Some(i), m))?;
                    all.push(leaves);
                }
                Ok(all)
            }
        }
    }
}

/// An axis as `isize`; one beyond `isize` (a `usize` above `isize::MAX`)
/// becomes `isize::MAX`, out of range for every tensor, rather than
/// wrapping to a negative axis that counts from the end.
fn wide<T: TryInto<isize>>(d: T) -> isize {
    d.try_into().unwrap_or(isize::MAX)
}

macro_rules! dims_from_int {
    ($($t:ty),+) => {$(
        impl From<$t> for Dims {
            fn from(d: $t) -> Dims { Dims::All(Some(wide(d))) }
        }
        impl<const N: usize> From<[Option<$t>; N]> for Dims {
            fn from(d: [Option<$t>; N]) -> Dims { Dims::Each(d.iter().map(|x| x.map(wide)).collect()) }
        }
        impl<const N: usize> From<[$t; N]> for Dims {
            fn from(d: [$t; N]) -> Dims { Dims::Each(d.iter().map(|&v| Some(wide(v))).collect()) }
        }
        impl From<Vec<Option<$t>>> for Dims {
            fn from(d: Vec<Option<$t>>) -> Dims { Dims::Each(d.iter().map(|x| x.map(wide)).collect()) }
        }
        impl From<$t> for DimTree {
            fn from(d: $t) -> DimTree { DimTree::Axis(Some(wide(d))) }
        }
        impl From<Option<$t>> for DimTree {
            fn from(d: Option<$t>) -> DimTree { DimTree::Axis(d.map(wide)) }
        }
    )+};
}

dims_from_int!(i32, i64, isize, usize);

impl<const N: usize> From<[DimTree; N]> for Dims {
    fn from(d: [DimTree; N]) -> Dims {
        Dims::Trees(d.into())
    }
}

impl From<Vec<DimTree>> for Dims {
    fn from(d: Vec<DimTree>) -> Dims {
        Dims::Trees(d)
    }
}
