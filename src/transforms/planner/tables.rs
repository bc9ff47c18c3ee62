//! What `Auto` decided: two process-wide tables (convolution routes and
//! `vmap` schedules), saved to a file and loaded again, by the user
//! ([`save_auto_cache`], [`load_auto_cache`]) and by default across runs.
//!
//! By default every measured decision is written to a file named for this
//! machine (its CPU model and thread count) and the crate's version, in
//! `$XDG_CACHE_HOME/candle-func/` or `~/.cache/candle-func/`, and that file
//! is read before the first decision of a process: a program run again on
//! the same machine measures nothing it measured before (a first call of
//! the tutorial CNN's per-sample gradients took several seconds of
//! measuring). `CANDLE_FUNC_AUTO_CACHE` names another file, or `off`
//! keeps decisions in the process. A default file that cannot be read or
//! parsed is set aside with a warning, never an error.

use crate::error::{Error, Result};
use crate::ir::options::{ConvRoute, Schedule};
use crate::rules::plan::RunAs;
use crate::transforms::settings;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

/// One choice of the `Auto` route: the lowered operation, its batched
/// operand shapes, the candidates' measured times and the winner.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct AutoChoice {
    /// The batched operation (`conv2d[..]`, `conv2d_grad_weight[..]`, ...).
    pub op: String,
    /// The operands' shapes with the batch axis first, and the batch size.
    pub shapes: Vec<Vec<usize>>,
    /// Each candidate's time in milliseconds: the best of the rounds in
    /// which the candidates take turns, or the first (cold) run of one
    /// dropped as clearly slower after it; a candidate over the memory
    /// limit is not run, nor listed.
    pub timings_ms: Vec<(ConvRoute, f64)>,
    /// The fastest candidate.
    pub chosen: ConvRoute,
}

/// One choice of `Schedule::Auto` for a large program: the batch size, the
/// candidates' measured times and the winner.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ScheduleChoice {
    /// The batch size.
    pub size: usize,
    /// Equations in the per-example graph.
    pub equations: usize,
    /// Each candidate's time in milliseconds, as [`AutoChoice::timings_ms`]
    /// (the per-example schedule measured on a few examples and scaled to
    /// the batch); empty where measuring failed and the program runs
    /// batched.
    pub timings_ms: Vec<(Schedule, f64)>,
    /// The fastest candidate.
    pub chosen: Schedule,
}

/// A process-wide table of decisions in the order they were made, holding
/// at most `settings::auto_capacity()`: the least recently used goes first
/// (a scan; tables are read while tracing, not per call).
struct Table<C> {
    rows: Vec<(String, C, u64)>,
    tick: u64,
}

impl<C: Clone> Table<C> {
    const fn new() -> Self {
        Table {
            rows: Vec::new(),
            tick: 0,
        }
    }

    fn get(&mut self, key: &str) -> Option<C> {
        self.tick += 1;
        let now = self.tick;
        self.rows.iter_mut().find(|r| r.0 == key).map(|r| {
            r.2 = now;
            r.1.clone()
        })
    }

    fn put(&mut self, key: String, c: C) {
        self.tick += 1;
        self.rows.retain(|r| r.0 != key);
        self.rows.push((key, c, self.tick));
        while self.rows.len() > settings::auto_capacity() {
            let oldest = (0..self.rows.len()).min_by_key(|&i| self.rows[i].2).unwrap_or(0);
            self.rows.remove(oldest);
        }
    }

    fn all(&self) -> Vec<C> {
        self.rows.iter().map(|r| r.1.clone()).collect()
    }
}

static ROUTES: Mutex<Table<AutoChoice>> = Mutex::new(Table::new());
static SCHEDULES: Mutex<Table<ScheduleChoice>> = Mutex::new(Table::new());

/// What `Auto` chose so far in this process (and what was loaded), in the
/// order the choices were made; at most
/// [`auto_capacity`](crate::settings::auto_capacity) of them, the least
/// recently used dropped first.
pub fn auto_choices() -> Vec<AutoChoice> {
    ROUTES.lock().unwrap_or_else(|e| e.into_inner()).all()
}

/// What `Schedule::Auto` measured and chose so far in this process (and
/// what was loaded), in the order the choices were made (small programs,
/// run batched without measuring, are not listed).
pub fn schedule_choices() -> Vec<ScheduleChoice> {
    SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).all()
}

/// The route decided before for `key`.
pub(crate) fn cached_route(key: &str) -> Option<ConvRoute> {
    load_default();
    ROUTES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .map(|c| c.chosen)
}

/// A route decided now for `key` (kept across runs where it was measured).
pub(crate) fn record_route(key: String, choice: AutoChoice) {
    log::debug!(
        "conv route auto: {} on {:?} -> {:?} (timings {:?})",
        choice.op,
        choice.shapes,
        choice.chosen,
        choice.timings_ms
    );
    ROUTES.lock().unwrap_or_else(|e| e.into_inner()).put(key, choice);
    save_default();
}

pub(crate) fn public(r: RunAs) -> Schedule {
    match r {
        RunAs::PerExample => Schedule::PerExample,
        RunAs::ConvsPerExample => Schedule::ConvsPerExample,
        _ => Schedule::Batched,
    }
}

/// The schedule decided before for `key`.
pub(crate) fn cached_schedule(key: &str) -> Option<RunAs> {
    load_default();
    SCHEDULES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(key)
        .map(|c| match c.chosen {
            Schedule::PerExample => RunAs::PerExample,
            Schedule::ConvsPerExample => RunAs::ConvsPerExample,
            _ => RunAs::Whole,
        })
}

/// A schedule decided now for `key` (kept across runs where it was
/// measured).
pub(crate) fn record_schedule(key: String, choice: ScheduleChoice) {
    log::debug!(
        "vmap schedule auto: batch of {} -> {:?} (timings {:?})",
        choice.size,
        choice.chosen,
        choice.timings_ms
    );
    let measured = !choice.timings_ms.is_empty();
    SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).put(key, choice);
    if measured {
        save_default();
    }
}

/// Remembers that measuring `key` failed: it runs batched, unmeasured.
pub(crate) fn record_unmeasured(key: String, size: usize) {
    let choice = ScheduleChoice {
        size,
        equations: 0,
        timings_ms: Vec::new(),
        chosen: Schedule::Batched,
    };
    record_schedule(key, choice);
}

/// One line of a decisions file, parsed.
enum Row {
    Route(String, AutoChoice),
    Schedule(String, ScheduleChoice),
}

fn times<T: std::fmt::Debug>(timings: &[(T, f64)]) -> String {
    let parts: Vec<String> = timings.iter().map(|(r, t)| format!("{r:?}={t}")).collect();
    parts.join(",")
}

/// Every decision (measured ones only, for schedules) as the file's text.
fn text() -> String {
    let mut text = String::new();
    for (key, c, _) in ROUTES.lock().unwrap_or_else(|e| e.into_inner()).rows.iter() {
        let line = format!(
            "route\t{key}\t{:?}\t{}\t{}\t{:?}\n",
            c.chosen,
            times(&c.timings_ms),
            c.op,
            c.shapes
        );
        text.push_str(&line);
    }
    for (key, c, _) in SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).rows.iter() {
        if !c.timings_ms.is_empty() {
            let line = format!(
                "schedule\t{key}\t{:?}\t{}\t{}\t{}\n",
                c.chosen,
                times(&c.timings_ms),
                c.size,
                c.equations
            );
            text.push_str(&line);
        }
    }
    text
}

/// The timings of a line, each a name the candidates parse and a finite,
/// non-negative time.
fn parse_times<T>(field: &str, parse: impl Fn(&str) -> Option<T>) -> Option<Vec<(T, f64)>> {
    field
        .split(',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            let (name, ms) = t.split_once('=')?;
            let ms: f64 = ms.parse().ok()?;
            (ms.is_finite() && ms >= 0.0).then_some(())?;
            Some((parse(name)?, ms))
        })
        .collect()
}

fn parse_schedule(s: &str) -> Option<Schedule> {
    match s {
        "Batched" => Some(Schedule::Batched),
        "PerExample" => Some(Schedule::PerExample),
        "ConvsPerExample" => Some(Schedule::ConvsPerExample),
        _ => None,
    }
}

/// One line: `route`/`schedule`, then its fields (a line of the older
/// format, a route without the first field, is read too).
fn parse_line(line: &str) -> Option<Row> {
    let parts: Vec<&str> = line.split('\t').collect();
    let (kind, f) = match parts.first() {
        Some(&"route") | Some(&"schedule") => (parts[0], &parts[1..]),
        _ => ("route", &parts[..]),
    };
    if f.len() != 5 || f[0].trim().is_empty() {
        return None;
    }
    match kind {
        "route" => {
            let chosen: ConvRoute = f[1].parse().ok()?;
            // `Auto` is what is being decided, not a decision
            if chosen == ConvRoute::Auto || f[3].trim().is_empty() {
                return None;
            }
            let timings_ms = parse_times(f[2], |r| r.parse().ok())?;
            let choice = AutoChoice {
                op: f[3].to_string(),
                shapes: Vec::new(),
                timings_ms,
                chosen,
            };
            Some(Row::Route(f[0].to_string(), choice))
        }
        _ => {
            let choice = ScheduleChoice {
                chosen: parse_schedule(f[1])?,
                timings_ms: parse_times(f[2], parse_schedule)?,
                size: f[3].parse().ok()?,
                equations: f[4].parse().ok()?,
            };
            Some(Row::Schedule(f[0].to_string(), choice))
        }
    }
}

/// Every line of `text` parsed, or the first that does not parse (nothing
/// is taken from a file with a bad line).
fn parse(text: &str) -> std::result::Result<Vec<Row>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| parse_line(line).ok_or_else(|| line.to_string()))
        .collect()
}

fn take(rows: Vec<Row>) -> usize {
    let n = rows.len();
    for row in rows {
        match row {
            Row::Route(k, c) => ROUTES.lock().unwrap_or_else(|e| e.into_inner()).put(k, c),
            Row::Schedule(k, c) => SCHEDULES.lock().unwrap_or_else(|e| e.into_inner()).put(k, c),
        }
    }
    n
}

/// Writes `Auto`'s decisions (routes, and measured schedules) to a text
/// file, one per line, to reload with [`load_auto_cache`] so a later
/// process skips the measurements.
pub fn save_auto_cache(path: impl AsRef<Path>) -> Result<()> {
    write(path.as_ref(), &text()).map_err(|e| Error::Checkpoint {
        what: "save_auto_cache",
        msg: format!("{}: {e}", path.as_ref().display()),
    })
}

/// Reads decisions written by [`save_auto_cache`] (or kept by default, see
/// the module docs); they take the place of measurements for the same
/// programs and signatures. All or nothing: a malformed line is an error
/// naming it, and no line of the file is taken.
pub fn load_auto_cache(path: impl AsRef<Path>) -> Result<usize> {
    let text = std::fs::read_to_string(path.as_ref()).map_err(|e| Error::Checkpoint {
        what: "load_auto_cache",
        msg: format!("{}: {e}", path.as_ref().display()),
    })?;
    let rows = parse(&text).map_err(|line| Error::Checkpoint {
        what: "load_auto_cache",
        msg: format!("{}: malformed line {line:?} (nothing loaded)", path.as_ref().display()),
    })?;
    Ok(take(rows))
}

/// Writes `text` to `path` whole: to a file beside it, then renamed over
/// it, so a reader never sees half of it.
fn write(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// The default decisions file (see the module docs), if there is one.
fn default_file() -> Option<PathBuf> {
    match crate::env::auto_cache_var() {
        (Some(named), _) => named,
        (None, cache) => Some(cache?.join("candle-func").join(format!("auto-{}.tsv", machine()))),
    }
}

/// What a decision depends on besides its program: the CPU, the number of
/// threads the kernels use, the crate's version.
fn machine() -> String {
    let id = format!(
        "{}|{}|{}",
        crate::env::cpu_name(),
        crate::kernels::max_threads(),
        env!("CARGO_PKG_VERSION")
    );
    // FNV-1a: the same name in every process and build
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("{hash:016x}")
}

static LOADED: Once = Once::new();

/// Reads the default file once per process, before the first decision is
/// looked up.
fn load_default() {
    LOADED.call_once(|| {
        let Some(path) = default_file() else { return };
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        match parse(&text) {
            Ok(rows) => {
                let n = take(rows);
                log::debug!("auto: {n} decisions from {}", path.display());
            }
            Err(line) => {
                settings::warn_once(
                    format!("auto-cache-{}", path.display()),
                    format!(
                        "auto: {} has a malformed line {line:?}; measuring again (the file will be rewritten)",
                        path.display()
                    ),
                );
            }
        }
    });
}

/// Writes every decision to the default file (a failure is warned about
/// once: decisions then stay in the process).
fn save_default() {
    let Some(path) = default_file() else { return };
    if let Err(e) = write(&path, &text()) {
        settings::warn_once(
            format!("auto-cache-write-{}", path.display()),
            format!("auto: could not keep decisions in {}: {e}", path.display()),
        );
    }
}
