//! The convolution route: how a convolution whose input and weight are both
//! batched is lowered under `vmap`. Chosen per call (`Vmap::conv_route`),
//! process-wide ([`set_conv_route`]) or by the environment variable
//! `CANDLE_FUNC_CONV_ROUTE=grouped|unfold|loop`; the per-call choice wins,
//! then the setter, then the variable, then the default (`Unfold`).

use crate::error::{Error, Result};
use std::str::FromStr;
use std::sync::RwLock;

/// How a convolution with batched input and batched weight is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ConvRoute {
    /// Fold the batch into the channels and call a grouped convolution with
    /// `groups = B * groups` (what `torch.func` and JAX do).
    Grouped,
    /// im2col, then one batched matmul per example and group (Opacus).
    #[default]
    Unfold,
    /// The unbatched convolution once per example, stacked: the correctness
    /// oracle, and the way to turn the convolution batching rule off.
    Loop,
}

/// Name of the environment variable that sets the process-wide route.
pub const ROUTE_ENV: &str = "CANDLE_FUNC_CONV_ROUTE";

impl FromStr for ConvRoute {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "grouped" => Ok(ConvRoute::Grouped),
            "unfold" => Ok(ConvRoute::Unfold),
            "loop" => Ok(ConvRoute::Loop),
            other => Err(Error::Config {
                msg: format!("unknown conv route {other:?}; expected grouped, unfold or loop"),
            }),
        }
    }
}

static PROCESS_ROUTE: RwLock<Option<ConvRoute>> = RwLock::new(None);

/// Sets the process-wide route (`None` returns to the environment variable
/// or the default). A route given to a transform with `.conv_route(..)` wins.
pub fn set_conv_route(route: Option<ConvRoute>) {
    *PROCESS_ROUTE.write().unwrap_or_else(|e| e.into_inner()) = route;
}

/// The process-wide route: the setter's, else the environment variable's
/// (an unknown value is an error), else the default.
pub fn conv_route() -> Result<ConvRoute> {
    if let Some(r) = *PROCESS_ROUTE.read().unwrap_or_else(|e| e.into_inner()) {
        return Ok(r);
    }
    match std::env::var(ROUTE_ENV) {
        Ok(v) => v.parse().map_err(|e: Error| Error::Config {
            msg: format!("{ROUTE_ENV}: {e}"),
        }),
        Err(std::env::VarError::NotPresent) => Ok(ConvRoute::default()),
        Err(e) => Err(Error::Config {
            msg: format!("{ROUTE_ENV}: {e}"),
        }),
    }
}

/// The route a transform uses: its own if set, else the process-wide one.
pub(crate) fn resolve(per_call: Option<ConvRoute>) -> Result<ConvRoute> {
    match per_call {
        Some(r) => Ok(r),
        None => conv_route(),
    }
}
