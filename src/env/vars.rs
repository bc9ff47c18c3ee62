//! The environment variables the crate reads, each named and read here.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The variable that makes the CPU take candle's operations only (the path
/// every other device takes) when set to `1` or `true`, for a function
/// whose options do not say ([`Options::portable`](crate::Options::portable));
/// read once per process.
pub const PORTABLE_ENV: &str = "CANDLE_FUNC_PORTABLE";

/// The variable that sets the process-wide convolution route
/// (`grouped`, `unfold`, `loop`, `auto`), read whenever a transform
/// resolves a route it was not given.
pub const ROUTE_ENV: &str = "CANDLE_FUNC_CONV_ROUTE";

/// The variable that moves the default file of `Auto`'s decisions, or
/// turns it off (`off`).
pub const AUTO_CACHE_ENV: &str = "CANDLE_FUNC_AUTO_CACHE";

/// The variable that leaves glibc's malloc tuning alone (`system`).
const MALLOC_ENV: &str = "CANDLE_FUNC_MALLOC";

/// Whether `CANDLE_FUNC_PORTABLE` turns the portable path on (read once:
/// a process's kernels do not change path under it).
pub(crate) fn portable_var() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(PORTABLE_ENV).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on")))
}

/// The route variable's text: `None` when unset, an error message naming
/// the variable when it is not Unicode. Read on every call, so a program
/// may set it between transforms.
pub(crate) fn route_var() -> Option<Result<String, String>> {
    match std::env::var(ROUTE_ENV) {
        Ok(v) => Some(Ok(v)),
        Err(std::env::VarError::NotPresent) => None,
        Err(e) => Some(Err(format!("{ROUTE_ENV}: {e}"))),
    }
}

/// Whether malloc tuning is turned off (`CANDLE_FUNC_MALLOC=system`).
pub(super) fn malloc_system() -> bool {
    std::env::var(MALLOC_ENV).is_ok_and(|v| v.trim() == "system")
}

/// The file of `Auto`'s decisions the variables name: `Some(None)` where
/// `CANDLE_FUNC_AUTO_CACHE=off`, `Some(Some(file))` where it names one,
/// else `None` with the user's cache folder (`XDG_CACHE_HOME`, else
/// `~/.cache`) as the second value.
pub(crate) fn auto_cache_var() -> (Option<Option<PathBuf>>, Option<PathBuf>) {
    let named = match std::env::var(AUTO_CACHE_ENV) {
        Ok(v) if v.trim().eq_ignore_ascii_case("off") => Some(None),
        Ok(v) if !v.trim().is_empty() => Some(Some(PathBuf::from(v))),
        _ => None,
    };
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    (named, cache)
}
