//! Where the trainer's examples come from: any [`Dataset`] that can fetch a
//! list of examples by index. Each step fetches only the examples it
//! sampled, so a data set need not fit in memory.

use super::users::Users;
use crate::error::{Error, Result};
use crate::transforms::tree::{TensorTree, TreeDef};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Examples the private trainer samples from
/// ([`PrivacyEngine::make_private_dataset`](super::PrivacyEngine::make_private_dataset)).
///
/// An example is a tree of tensors ([`Dataset::tree`]); `fetch` returns
/// the examples at some indices with each leaf stacked on a new axis 0, in
/// the tree's leaf order. The trainer asks for each pass's examples (the
/// physical batch, padding included, so indices may repeat), nothing more.
/// [`TensorDataset`] holds tensors in memory; [`SafetensorsDataset`] reads
/// rows from safetensors shards on disk.
pub trait Dataset: Send + Sync {
    /// The number of examples.
    fn len(&self) -> usize;

    /// Whether there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The structure of one example.
    fn tree(&self) -> TreeDef;

    /// One example's leaves: the shape (without the example axis) and
    /// dtype of each, in the tree's leaf order.
    fn shapes(&self) -> Vec<(Vec<usize>, DType)>;

    /// The device `fetch` puts its tensors on.
    fn device(&self) -> Device;

    /// The examples at `indices` (each `< len()`, repeats allowed): one
    /// tensor per leaf, `[indices.len(), ..shape]`.
    fn fetch(&self, indices: &[usize]) -> Result<Vec<Tensor>>;

    /// Bytes this data set holds in memory, for the trainer's memory plan
    /// (0 for data read from elsewhere).
    fn resident_bytes(&self) -> usize {
        0
    }

    /// What the ranks of a distributed run compare to agree that they hold
    /// the same data, one tensor per leaf: by default the first and last
    /// examples; [`TensorDataset`] all of them.
    fn fingerprint(&self) -> Result<Vec<Tensor>> {
        self.fetch(&[0, self.len().saturating_sub(1)])
    }
}

/// Each leaf's path in `def`, `"examples"` for a bare tensor (for
/// messages and saved state).
pub(crate) fn leaf_names(def: &TreeDef) -> Vec<String> {
    def.leaf_paths()
        .into_iter()
        .map(|p| if p.is_empty() { "examples".into() } else { p })
        .collect()
}

/// An error naming `op` unless `indices` are all below `n`.
fn check_indices(op: &'static str, indices: &[usize], n: usize) -> Result<()> {
    match indices.iter().find(|&&i| i >= n) {
        Some(i) => Err(Error::data(
            op,
            format!("example index {i} is out of range for {n} examples"),
        )),
        None => Ok(()),
    }
}

/// Examples held as tensors in memory (what `make_private` and
/// `make_private_examples` train on): each leaf of a tree of tensors with
/// the examples along axis 0.
#[derive(Clone, Debug)]
pub struct TensorDataset {
    leaves: Vec<(String, Tensor)>,
    def: TreeDef,
    n: usize,
}

impl TensorDataset {
    /// The examples of `data`, every leaf sharing a non-zero number of
    /// examples on axis 0.
    pub fn new<D: TensorTree + ?Sized>(data: &D) -> Result<TensorDataset> {
        let mut tensors = Vec::new();
        let def = data.flatten_into(&mut tensors);
        TensorDataset::from_leaves(leaf_names(&def).into_iter().zip(tensors).collect(), def)
    }

    /// `leaves` (each with its path, for messages) of the tree `def`.
    pub(crate) fn from_leaves(leaves: Vec<(String, Tensor)>, def: TreeDef) -> Result<TensorDataset> {
        let first = leaves.first().and_then(|(_, t)| t.dims().first().copied());
        let n = match first {
            Some(n) if n > 0 && leaves.iter().all(|(_, t)| t.dims().first() == Some(&n)) => n,
            _ => {
                let dims: Vec<&[usize]> = leaves.iter().map(|(_, t)| t.dims()).collect();
                let paths: Vec<&str> = leaves.iter().map(|(p, _)| p.as_str()).collect();
                return Err(Error::shape(
                    "make_private",
                    &dims,
                    format!(
                        "every example tensor ({paths:?}) needs the same, non-zero number of examples along axis 0"
                    ),
                ));
            }
        };
        Ok(TensorDataset { leaves, def, n })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.n
    }

    fn tree(&self) -> TreeDef {
        self.def.clone()
    }

    fn shapes(&self) -> Vec<(Vec<usize>, DType)> {
        self.leaves
            .iter()
            .map(|(_, t)| (t.dims()[1..].to_vec(), t.dtype()))
            .collect()
    }

    fn device(&self) -> Device {
        self.leaves[0].1.device().clone()
    }

    fn fetch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        check_indices("TensorDataset::fetch", indices, self.n)?;
        let ids = indices
            .iter()
            .map(|&i| {
                u32::try_from(i).map_err(|_| Error::data("TensorDataset::fetch", format!("index {i} exceeds u32")))
            })
            .collect::<Result<Vec<u32>>>()?;
        let ids = Tensor::from_vec(ids, indices.len(), &self.device())?;
        self.leaves.iter().map(|(_, t)| Ok(t.index_select(&ids, 0)?)).collect()
    }

    fn resident_bytes(&self) -> usize {
        self.leaves
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    fn fingerprint(&self) -> Result<Vec<Tensor>> {
        Ok(self.leaves.iter().map(|(_, t)| t.clone()).collect())
    }
}

/// One leaf in one shard: where its rows start in the file and how long
/// a row is.
#[derive(Clone, Debug)]
struct Column {
    start: u64,
    row_bytes: usize,
}

/// Examples read lazily from safetensors shards on disk: every shard holds
/// the same named tensors (`"xs"`, `"ys"`, …) with its examples along
/// axis 0 and the same shape and dtype otherwise; the examples are the
/// shards' rows in order. An example is a map from those names to its
/// rows (a loss takes `BTreeMap<String, Tracer>`). Only the rows a step
/// asks for are read, with one seek and read per row and leaf.
#[derive(Debug)]
pub struct SafetensorsDataset {
    shards: Vec<(PathBuf, Vec<Column>, usize)>,
    names: Vec<String>,
    shapes: Vec<(Vec<usize>, DType)>,
    offsets: Vec<usize>,
    device: Device,
}

/// A tensor in a safetensors header: dtype, shape, and byte range from
/// the start of the data.
type Entry = (DType, Vec<usize>, u64, u64);

/// The header of a safetensors file: each tensor's entry, where the data
/// starts, and the file's length.
fn read_header(path: &Path) -> Result<(BTreeMap<String, Entry>, u64, u64)> {
    let bad = |msg: String| Error::data("SafetensorsDataset::open", format!("{}: {msg}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let file_len = f.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| bad(e.to_string()))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(bad(format!("a header of {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(|e| bad(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let obj = v.as_object().ok_or_else(|| bad("the header is not an object".into()))?;
    let mut out = BTreeMap::new();
    for (name, t) in obj.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let dtype = match t["dtype"].as_str() {
            Some("F32") => DType::F32,
            Some("F64") => DType::F64,
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            Some("U32") => DType::U32,
            Some("U8") => DType::U8,
            Some("I64") => DType::I64,
            other => {
                return Err(bad(format!(
                    "tensor {name:?} has dtype {other:?}, not one candle reads"
                )))
            }
        };
        let shape: Option<Vec<usize>> = t["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        let range: Option<Vec<u64>> = t["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect());
        match (shape, range.as_deref()) {
            (Some(shape), Some(&[begin, end])) => {
                out.insert(name.clone(), (dtype, shape, begin, end));
            }
            _ => return Err(bad(format!("tensor {name:?} has no shape or data_offsets"))),
        }
    }
    Ok((out, 8 + len, file_len))
}

impl SafetensorsDataset {
    /// The examples of `shards` (in order), each example the rows of the
    /// tensors `names`, fetched onto `device`. An error names the shard and
    /// tensor when one is missing, has no example axis, or disagrees with
    /// the first shard in shape (beyond axis 0) or dtype, or when its byte
    /// range does not match its shape.
    pub fn open(shards: &[impl AsRef<Path>], names: &[&str], device: &Device) -> Result<SafetensorsDataset> {
        const OP: &str = "SafetensorsDataset::open";
        if shards.is_empty() || names.is_empty() {
            return Err(Error::data(OP, "at least one shard and one tensor name"));
        }
        let mut names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        let mut shapes: Option<Vec<(Vec<usize>, DType)>> = None;
        let (mut offsets, mut total) = (vec![0], 0usize);
        for path in shards {
            let path = path.as_ref();
            let (header, data_start, file_len) = read_header(path)?;
            let mut columns = Vec::new();
            let mut here = Vec::new();
            let mut rows = None;
            for name in &names {
                let bad = |msg: String| Error::data(OP, format!("{}: tensor {name:?} {msg}", path.display()));
                let (dtype, shape, begin, end) = header.get(name).ok_or_else(|| bad("is missing".into()))?;
                let Some((&n, rest)) = shape.split_first() else {
                    return Err(bad("has no example axis".into()));
                };
                if *rows.get_or_insert(n) != n {
                    return Err(bad(format!(
                        "has {n} rows where the shard's first tensor has {}",
                        rows.unwrap_or(0)
                    )));
                }
                // every size from the file is checked: a bad header is an
                // error, never an overflow
                let row_bytes = rest.iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
                let want = row_bytes.and_then(|r| r.checked_mul(n)).map(|w| w as u64);
                let (Some(row_bytes), true) = (row_bytes, want.is_some() && end.checked_sub(*begin) == want) else {
                    return Err(bad(format!("holds bytes {begin}..{end}, not those of shape {shape:?}")));
                };
                let start = data_start.checked_add(*begin);
                if start.is_none() || data_start.checked_add(*end).is_none_or(|e| e > file_len) {
                    return Err(bad(format!("runs past the end of the file ({file_len} bytes)")));
                }
                here.push((rest.to_vec(), *dtype));
                columns.push(Column {
                    start: start.unwrap_or_default(),
                    row_bytes,
                });
            }
            match &shapes {
                None => shapes = Some(here),
                Some(first) if *first != here => {
                    return Err(Error::data(
                        OP,
                        format!(
                            "{}: examples shaped {here:?}, the first shard's {first:?}",
                            path.display()
                        ),
                    ))
                }
                Some(_) => {}
            }
            let rows = rows.unwrap_or(0);
            total = total
                .checked_add(rows)
                .ok_or_else(|| Error::data(OP, "the shards' rows overflow usize"))?;
            offsets.push(total);
            out.push((path.to_path_buf(), columns, rows));
        }
        if total == 0 {
            return Err(Error::data(OP, "the shards hold no examples"));
        }
        Ok(SafetensorsDataset {
            shards: out,
            names,
            shapes: shapes.unwrap_or_default(),
            offsets,
            device: device.clone(),
        })
    }
}

impl Dataset for SafetensorsDataset {
    fn len(&self) -> usize {
        *self.offsets.last().unwrap_or(&0)
    }

    fn tree(&self) -> TreeDef {
        TreeDef::Map(self.names.iter().map(|n| (n.clone(), TreeDef::Leaf)).collect())
    }

    fn shapes(&self) -> Vec<(Vec<usize>, DType)> {
        self.shapes.clone()
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn fetch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        const OP: &str = "SafetensorsDataset::fetch";
        check_indices(OP, indices, self.len())?;
        let mut bytes: Vec<Vec<u8>> = self.shapes.iter().map(|_| Vec::new()).collect();
        let mut files: BTreeMap<usize, std::fs::File> = BTreeMap::new();
        for &i in indices {
            // the shard holding example i, and its row there
            let shard = self.offsets.partition_point(|&o| o <= i) - 1;
            let (path, columns, _) = &self.shards[shard];
            let row = (i - self.offsets[shard]) as u64;
            let io = |e: std::io::Error| Error::data(OP, format!("{}: {e}", path.display()));
            let f = match files.entry(shard) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => v.insert(std::fs::File::open(path).map_err(io)?),
            };
            for (col, out) in columns.iter().zip(&mut bytes) {
                let at = out.len();
                out.resize(at + col.row_bytes, 0);
                f.seek(SeekFrom::Start(col.start + row * col.row_bytes as u64))
                    .map_err(io)?;
                f.read_exact(&mut out[at..]).map_err(io)?;
            }
        }
        self.shapes
            .iter()
            .zip(bytes)
            .map(|((shape, dtype), b)| {
                let dims: Vec<usize> = std::iter::once(indices.len()).chain(shape.iter().copied()).collect();
                Ok(Tensor::from_raw_buffer(&b, *dtype, &dims, &self.device)?)
            })
            .collect()
    }
}

/// The data set the trainer samples from, with its size and leaf paths.
pub(super) struct Examples {
    pub(super) source: Box<dyn Dataset>,
    pub(super) n: usize,
    pub(super) paths: Vec<String>,
    /// The examples' users, under user-level DP.
    pub(super) users: Option<Users>,
}

impl Examples {
    /// `source`, checked to hold examples and to describe as many leaves as
    /// its tree has.
    pub(super) fn new(source: Box<dyn Dataset>) -> Result<Examples> {
        let (n, def, shapes) = (source.len(), source.tree(), source.shapes());
        if n == 0 || shapes.len() != def.leaf_count() {
            return Err(Error::data(
                "make_private",
                format!(
                    "the data set has {n} examples and {} leaf shapes for a tree of {} leaves",
                    shapes.len(),
                    def.leaf_count()
                ),
            ));
        }
        let paths = leaf_names(&def);
        Ok(Examples {
            source,
            n,
            paths,
            users: None,
        })
    }

    /// What is sampled: the users, or the examples.
    pub(super) fn units(&self) -> usize {
        self.users.as_ref().map_or(self.n, Users::len)
    }

    /// Each leaf's path and `[N, ..shape]`.
    pub(super) fn dims(&self) -> Vec<(String, Vec<usize>)> {
        let shapes = self.source.shapes();
        self.paths
            .iter()
            .zip(shapes)
            .map(|(p, (s, _))| (p.clone(), std::iter::once(self.n).chain(s).collect()))
            .collect()
    }

    /// What ranks compare to agree on the data ([`Dataset::fingerprint`]),
    /// under the leaves' paths and the count.
    pub(super) fn probe(&self) -> Result<Vec<(String, Tensor)>> {
        let prints = self.source.fingerprint()?;
        Ok(self
            .paths
            .iter()
            .map(|p| format!("{p} of {}", self.n))
            .zip(prints)
            .collect())
    }
}
