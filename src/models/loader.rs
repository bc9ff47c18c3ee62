//! A [`Checkpoint`] served as a `candle_nn::VarBuilder` backend, so models
//! load the way `nn` layers and candle-transformers' models do —
//! `Struct::load(vb.pp("layers").pp(i), &cfg)` — and a model's parameters
//! are exactly the weights its structs read (the [`Record`]), never a list
//! kept by hand beside its fields.

use super::Checkpoint;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::VarBuilder;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The weights a model's structs read through a checkpoint's `VarBuilder`,
/// in the order read.
#[derive(Clone, Default)]
pub(crate) struct Record(Arc<Mutex<Vec<(String, Tensor)>>>);

impl Record {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, Tensor)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every weight read, by name.
    pub(crate) fn all(&self) -> BTreeMap<String, Tensor> {
        self.lock().iter().cloned().collect()
    }
}

struct Backend<'a> {
    ck: &'a Checkpoint,
}

/// Our error carried through candle's `Result` (the `VarBuilder` trait's
/// error type) and unwrapped again by `From<candle_core::Error>`, so a
/// missing weight is still an [`Error::Model`] naming it.
fn carry(e: Error) -> candle_core::Error {
    candle_core::Error::WrappedContext {
        wrapped: Box::new(e),
        context: String::new(),
    }
}

impl Backend<'_> {
    fn read(&self, name: &str, shape: Option<&Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.ck.stored(name, shape.map(Shape::dims))?;
        let t = t.to_dtype(dtype)?.to_device(dev)?;
        self.ck.mark_read(name);
        Ok(t)
    }
}

impl candle_nn::var_builder::SimpleBackend for Backend<'_> {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.read(name, Some(&s), dtype, dev).map_err(carry)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.read(name, None, dtype, dev).map_err(carry)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.ck.has(name)
    }
}

/// A `VarBuilder` that reads through another and keeps what it read.
struct Tap<'a> {
    inner: VarBuilder<'a>,
    record: Record,
}

impl Tap<'_> {
    fn keep(&self, name: &str, t: candle_core::Result<Tensor>) -> candle_core::Result<Tensor> {
        let t = t?;
        let mut v = self.record.lock();
        // a weight read twice (a tied head loaded by name) is one parameter
        if !v.iter().any(|(n, _)| n == name) {
            v.push((name.to_string(), t.clone()));
        }
        Ok(t)
    }
}

impl candle_nn::var_builder::SimpleBackend for Tap<'_> {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.keep(name, self.inner.get_with_hints_dtype(s, name, h, dtype))
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.keep(name, self.inner.get_unchecked_dtype(name, dtype))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// `vb` (its prefix, dtype and device) reading through a tap: what the
/// model built from it reads is kept in the [`Record`], its parameters.
pub(crate) fn recording(vb: VarBuilder<'_>) -> (VarBuilder<'_>, Record) {
    let record = Record::default();
    let (prefix, dtype, device) = (vb.prefix(), vb.dtype(), vb.device().clone());
    let tap = Tap {
        inner: vb.root(),
        record: record.clone(),
    };
    let out = VarBuilder::from_backend(Box::new(tap), dtype, device);
    let out = match prefix.is_empty() {
        true => out,
        false => out.pp(prefix),
    };
    (out, record)
}

impl Checkpoint {
    /// The checkpoint's weights as a `candle_nn::VarBuilder` in its compute
    /// dtype: `nn` layers (and candle_nn's) built from it read the
    /// checkpoint's tensors under their prefixed names instead of
    /// initialising new ones, so a custom head or a model of your own loads
    /// as this crate's models do. A weight that is missing or of another
    /// shape is an [`Error::Model`] naming it; what is read counts in
    /// [`Checkpoint::read_names`].
    ///
    /// ```no_run
    /// use candle_core::{DType, Device};
    /// use candle_func::models::Checkpoint;
    /// use candle_func::nn::{self, Module};
    /// let ck = Checkpoint::load("my-bert", DType::F32, &Device::Cpu)?;
    /// let vb = ck.var_builder();
    /// let pooler = nn::linear(384, 384, vb.pp("pooler").pp("dense"))?;
    /// assert!(pooler.params().contains_key("pooler.dense.weight"));
    /// # Ok::<(), candle_func::Error>(())
    /// ```
    pub fn var_builder(&self) -> VarBuilder<'_> {
        VarBuilder::from_backend(Box::new(Backend { ck: self }), self.dtype(), self.device().clone())
    }
}
