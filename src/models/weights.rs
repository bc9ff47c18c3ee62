//! Reading a safetensors file tensor by tensor, never whole.
//!
//! candle's `safetensors::load` reads the whole file into one buffer and
//! copies each tensor out of it, so loading a model holds its weights
//! twice at its peak (and an allocator that keeps freed memory, as
//! mimalloc does, holds the buffer's pages afterwards too). Mapping the
//! file instead needs `unsafe` and still counts every page read towards
//! the process's resident memory. Here the header is parsed and checked
//! first, then each float tensor is read through a small reusable buffer
//! straight into its own storage: the weights are held once, plus
//! `CHUNK` bytes. Integer tensors (position ids and the like, small) are
//! read whole and converted by candle.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

/// Bytes read at a time into a float tensor's storage.
const CHUNK: usize = 1 << 20;

/// The most header bytes accepted (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// One tensor's entry in the header.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    start: u64,
    end: u64,
}

fn bad(file: &Path, msg: impl Into<String>) -> Error {
    Error::Model {
        what: file.display().to_string(),
        msg: msg.into(),
    }
}

/// Every tensor of the safetensors file `path`, on `device`. With `vars`,
/// each float tensor becomes a training variable of that dtype, read
/// straight into the variable's storage where the file holds that dtype
/// (candle's `Var::from_tensor` would copy it once more).
pub(super) fn read(path: &Path, device: &Device, vars: Option<DType>) -> Result<HashMap<String, Tensor>> {
    let io = |e: std::io::Error| bad(path, format!("cannot be read: {e}"));
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let mut r = BufReader::with_capacity(CHUNK, file);
    let mut n = [0u8; 8];
    r.read_exact(&mut n)
        .map_err(|_| bad(path, format!("is {len} bytes, too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n > len - 8 {
        return Err(bad(
            path,
            format!("declares a {n}-byte header in a {len}-byte file: not safetensors, or truncated"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    r.read_exact(&mut header).map_err(io)?;
    let mut entries = entries(path, &header, len - 8 - n)?;
    entries.sort_by_key(|e| (e.start, e.end));
    tiled(path, &entries, len - 8 - n)?;
    let mut at = 0u64; // the position in the data section
    let mut out = HashMap::with_capacity(entries.len());
    for e in entries {
        if e.start != at {
            r.seek(SeekFrom::Current(e.start as i64 - at as i64)).map_err(io)?;
        }
        let t =
            read_tensor(&mut r, &e, device, vars).map_err(|err| bad(path, format!("tensor \"{}\": {err}", e.name)))?;
        at = e.end;
        out.insert(e.name, t);
    }
    Ok(out)
}

/// The entries (sorted by offset) tile the data section of `data` bytes
/// exactly, as the format requires: no tensor's bytes overlap another's
/// (one would alias the other's values), and no bytes lie between or after
/// them (a hole is a writer's error or a truncated header). An error names
/// the two tensors.
fn tiled(path: &Path, entries: &[Entry], data: u64) -> Result<()> {
    let mut prev: Option<&Entry> = None;
    for e in entries {
        let (end, before) = match prev {
            Some(p) => (p.end, format!("\"{}\" (bytes {}..{})", p.name, p.start, p.end)),
            None => (0, "the start of the data section".to_string()),
        };
        let this = format!("\"{}\" (bytes {}..{})", e.name, e.start, e.end);
        if e.start < end {
            return Err(bad(path, format!("tensors {before} and {this} overlap")));
        }
        if e.start > end {
            return Err(bad(
                path,
                format!("{} unused bytes lie between {before} and {this}", e.start - end),
            ));
        }
        prev = Some(e);
    }
    let end = prev.map_or(0, |p| p.end);
    if end != data {
        let last = prev.map_or("the header".to_string(), |p| format!("\"{}\"", p.name));
        return Err(bad(
            path,
            format!(
                "{} unused bytes lie after {last} at the end of the data section",
                data - end
            ),
        ));
    }
    Ok(())
}

/// The header's tensors, each checked: a dtype candle has, a shape whose
/// bytes are what its offsets span, inside the data section of `data`
/// bytes.
fn entries(path: &Path, header: &[u8], data: u64) -> Result<Vec<Entry>> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| bad(path, format!("has a header that is not a JSON object: {e}")))?;
    let mut out = Vec::with_capacity(map.len());
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        let field = |f: &str| {
            v.get(f)
                .ok_or_else(|| bad(path, format!("tensor \"{name}\" has no \"{f}\"")))
        };
        let dtype_name = field("dtype")?.as_str().unwrap_or_default().to_string();
        let dtype = dtype_of(&dtype_name).ok_or_else(|| {
            bad(
                path,
                format!("tensor \"{name}\" has dtype \"{dtype_name}\", which candle cannot hold"),
            )
        })?;
        let ints = |f: &str| -> Result<Vec<u64>> {
            field(f)?
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| {
                    bad(
                        path,
                        format!("tensor \"{name}\" has a \"{f}\" that is not a list of integers"),
                    )
                })
        };
        let shape: Vec<usize> = ints("shape")?
            .into_iter()
            .map(usize::try_from)
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                bad(
                    path,
                    format!("tensor \"{name}\" has a dimension too large for this machine"),
                )
            })?;
        let (start, end) = match ints("data_offsets")?[..] {
            [s, e] if s <= e && e <= data => (s, e),
            ref o => {
                return Err(bad(
                    path,
                    format!("tensor \"{name}\" spans bytes {o:?} of a {data}-byte data section"),
                ))
            }
        };
        let bytes = shape
            .iter()
            .try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d))
            .and_then(|b| u64::try_from(b).ok());
        if bytes != Some(end - start) {
            return Err(bad(
                path,
                format!(
                    "tensor \"{name}\" is {dtype_name} {shape:?} but spans {} bytes",
                    end - start
                ),
            ));
        }
        out.push(Entry {
            name,
            dtype,
            shape,
            start,
            end,
        });
    }
    Ok(out)
}

/// candle's dtype for a safetensors dtype name.
fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "U8" => DType::U8,
        "U32" => DType::U32,
        "I16" => DType::I16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        "F8_E4M3" => DType::F8E4M3,
        _ => return None,
    })
}

/// Why a tensor could not be read.
type Failed = Box<dyn std::error::Error>;

/// Reads `e` from `r`, which stands at its first byte.
fn read_tensor(
    r: &mut impl Read,
    e: &Entry,
    device: &Device,
    vars: Option<DType>,
) -> std::result::Result<Tensor, Failed> {
    let numel = e.shape.iter().product();
    let shape = e.shape.as_slice();
    // read as a variable directly where it stays in its own dtype
    let var = vars == Some(e.dtype);
    let t = match e.dtype {
        DType::F32 => chunked(r, numel, shape, device, var, |b| {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        })?,
        DType::F64 => chunked(r, numel, shape, device, var, |b| {
            f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
        })?,
        DType::F16 => chunked(r, numel, shape, device, var, |b| half::f16::from_le_bytes([b[0], b[1]]))?,
        DType::BF16 => chunked(r, numel, shape, device, var, |b| {
            half::bf16::from_le_bytes([b[0], b[1]])
        })?,
        dtype => {
            let mut bytes = vec![0u8; (e.end - e.start) as usize];
            r.read_exact(&mut bytes)?;
            Tensor::from_raw_buffer(&bytes, dtype, shape, device)?
        }
    };
    Ok(match vars {
        Some(dtype) if !var && e.dtype.is_float() => Var::from_tensor(&t.to_dtype(dtype)?)?.into_inner(),
        _ => t,
    })
}

/// `numel` little-endian values of `T` read from `r` a chunk at a time into
/// one vector, which becomes the tensor's storage (on the CPU, uncopied),
/// a variable's where `var`.
fn chunked<T: candle_core::WithDType>(
    r: &mut impl Read,
    numel: usize,
    shape: &[usize],
    device: &Device,
    var: bool,
    from: impl Fn(&[u8]) -> T,
) -> std::result::Result<Tensor, Failed> {
    let size = std::mem::size_of::<T>();
    let mut values = Vec::with_capacity(numel);
    let mut buf = vec![0u8; CHUNK.min(numel * size)];
    let mut left = numel * size;
    while left > 0 {
        let k = left.min(buf.len());
        r.read_exact(&mut buf[..k])?;
        values.extend(buf[..k].chunks_exact(size).map(&from));
        left -= k;
    }
    Ok(match var {
        true => Var::from_vec(values, shape, device)?.into_inner(),
        false => Tensor::from_vec(values, shape, device)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("candle-func-weights-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("model.safetensors")
    }

    /// A file of every dtype the reader handles, written by candle.
    fn every_dtype(path: &Path) -> HashMap<String, Tensor> {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, 30., &dev)
            .unwrap()
            .affine(0.37, -3.)
            .unwrap()
            .reshape((5, 6))
            .unwrap();
        let mut m = HashMap::new();
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            m.insert(format!("w.{dtype:?}"), base.to_dtype(dtype).unwrap());
        }
        let ints = Tensor::arange(0u32, 7, &dev).unwrap();
        for dtype in [DType::U8, DType::U32, DType::I64] {
            m.insert(format!("i.{dtype:?}"), ints.to_dtype(dtype).unwrap());
        }
        m.insert("scalar".into(), Tensor::new(2.5f32, &dev).unwrap());
        candle_core::safetensors::save(&m, path).unwrap();
        m
    }

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.dtype() == b.dtype()
            && a.dims() == b.dims()
            && a.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
                == b.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
    }

    #[test]
    fn every_dtype_reads_as_candle_wrote_it_and_floats_as_variables_on_request() {
        let path = file("dtypes");
        let written = every_dtype(&path);
        let read_back = read(&path, &Device::Cpu, None).unwrap();
        assert_eq!(read_back.len(), written.len());
        for (name, t) in &written {
            assert!(same(t, &read_back[name]), "{name}");
            assert!(!read_back[name].is_variable(), "{name}");
        }
        let vars = read(&path, &Device::Cpu, Some(DType::F32)).unwrap();
        for (name, t) in &vars {
            let float = written[name].dtype().is_float();
            assert_eq!(t.is_variable(), float, "{name}");
            let want = if float {
                written[name].to_dtype(DType::F32).unwrap()
            } else {
                written[name].clone()
            };
            assert!(same(&want, t), "{name}");
        }
    }

    fn error_of(bytes: &[u8], tag: &str) -> String {
        let path = file(tag);
        std::fs::write(&path, bytes).unwrap();
        match read(&path, &Device::Cpu, None) {
            Err(Error::Model { what, msg }) => {
                assert!(what.contains("model.safetensors"), "{what}");
                msg
            }
            other => panic!("{tag}: expected a model error, got {:?}", other.map(|m| m.len())),
        }
    }

    fn with_header(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data));
        b
    }

    #[test]
    fn a_broken_file_is_an_error_naming_the_file_and_what_is_wrong() {
        let path = file("whole");
        every_dtype(&path);
        let whole = std::fs::read(&path).unwrap();
        let msg = error_of(&whole[..whole.len() - 1], "truncated");
        assert!(msg.contains("data section"), "{msg}");
        let msg = error_of(&whole[..5], "short");
        assert!(msg.contains("too short"), "{msg}");
        let msg = error_of(&u64::MAX.to_le_bytes(), "huge-header");
        assert!(msg.contains("header"), "{msg}");
        let msg = error_of(&with_header("[1, 2]", 0), "not-object");
        assert!(msg.contains("JSON object"), "{msg}");
        let t = |dtype: &str, shape: &str, offsets: &str| {
            format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
        };
        let msg = error_of(&with_header(&t("F32", "[2, 3]", "[0, 20]"), 20), "mismatch");
        assert!(msg.contains("\"t\" is F32 [2, 3] but spans 20 bytes"), "{msg}");
        let msg = error_of(&with_header(&t("C64", "[2]", "[0, 16]"), 16), "dtype");
        assert!(msg.contains("\"C64\""), "{msg}");
        let msg = error_of(&with_header(&t("F32", "[2]", "[8, 0]"), 8), "backwards");
        assert!(msg.contains("spans bytes [8, 0]"), "{msg}");
        let msg = error_of(&with_header(&t("F32", "[-2]", "[0, 8]"), 8), "negative");
        assert!(msg.contains("\"shape\""), "{msg}");
        let huge = format!("[{}, {}]", u64::MAX, u64::MAX);
        let msg = error_of(&with_header(&t("F32", &huge, "[0, 8]"), 8), "overflow");
        assert!(msg.contains("spans 8 bytes"), "{msg}");
    }

    #[test]
    fn tensors_that_overlap_or_leave_holes_are_errors_naming_both() {
        // two F32 [2] tensors, a at `a` and b at `b`, in `data` bytes
        let two = |a: &str, b: &str, data: usize| {
            let h = format!(
                r#"{{"a":{{"dtype":"F32","shape":[2],"data_offsets":{a}}},"b":{{"dtype":"F32","shape":[2],"data_offsets":{b}}}}}"#
            );
            with_header(&h, data)
        };
        let msg = error_of(&two("[0, 8]", "[4, 12]", 12), "overlap");
        assert!(
            msg.contains("\"a\" (bytes 0..8) and \"b\" (bytes 4..12) overlap"),
            "{msg}"
        );
        let msg = error_of(&two("[0, 8]", "[0, 8]", 8), "alias");
        assert!(msg.contains("overlap"), "{msg}");
        let msg = error_of(&two("[0, 8]", "[12, 20]", 20), "hole");
        assert!(
            msg.contains("4 unused bytes lie between \"a\" (bytes 0..8) and \"b\""),
            "{msg}"
        );
        let msg = error_of(&two("[4, 12]", "[12, 20]", 20), "hole-first");
        assert!(msg.contains("between the start of the data section and \"a\""), "{msg}");
        let msg = error_of(&two("[0, 8]", "[8, 16]", 20), "trailing");
        assert!(msg.contains("4 unused bytes lie after \"b\""), "{msg}");
        // tiled exactly, in either order in the header, it reads
        let path = file("tiled");
        std::fs::write(&path, two("[8, 16]", "[0, 8]", 16)).unwrap();
        assert_eq!(read(&path, &Device::Cpu, None).unwrap().len(), 2);
    }
}
