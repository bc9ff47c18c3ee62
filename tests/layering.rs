//! The crate's layers point down: each module imports only from the layers
//! below it, the rules hold no timing, no interpreter call, no global
//! state and no file or environment access, and the kernels keep no
//! mutable global state. This test reads the sources and fails on a
//! violation, naming the file, the line and the layers involved.
//!
//! Bottom to top (`error` is shared by all, `env` beside it is the machine
//! and the process), one module per layer:
//! `error` ← `env` ← `ir` ← `kernels` ← `rng` ← `trace` ← `rules` ← `interp` ← `ops` ←
//! `transforms` ← `control` ← `optim` ← `nn` ← `dp` ← `models` ← `lib.rs` (with
//! the root's re-exporting modules and the deprecated names). The layers
//! built on the transforms (`control`, `optim`, `nn`, `dp`, `models`) do not
//! see the interpreter at all, and only `env` reads the environment's
//! variables and `/proc`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The rank of each top-level module; a module may use any module of a
/// lower rank, and its own. No two modules share a rank, so no two can
/// use each other.
fn rank(module: &str) -> Option<usize> {
    Some(match module {
        "error" => 0,
        "env" => 1,
        "ir" => 2,
        "kernels" => 3,
        "rng" => 4,
        "trace" => 5,
        "rules" => 6,
        "interp" => 7,
        "ops" => 8,
        "transforms" => 9,
        "control" => 10,
        "optim" => 11,
        "nn" => 12,
        "dp" => 13,
        "models" => 14,
        "lib" | "deprecated" => 15,
        _ => return None,
    })
}

/// The module each name the crate root re-exports comes from (`Error` ->
/// `error`, `vmap` -> `transforms`), read from `lib.rs`'s top-level `pub
/// use` lines; the root's own modules map to themselves.
fn root_names(lib: &str) -> HashMap<String, String> {
    let mut names = HashMap::new();
    for (_, line) in code_lines(lib) {
        let l = line.trim();
        if let Some(m) = l.strip_prefix("pub mod ").and_then(|r| r.split([' ', ';', '{']).next()) {
            names.insert(m.to_string(), m.to_string());
        }
        let Some(rest) = l.strip_prefix("pub use ") else {
            continue;
        };
        let module: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let tail = &rest[module.len()..];
        let items = match tail.find('{') {
            Some(i) => tail[i + 1..].trim_end_matches(['}', ';']).to_string(),
            None => tail.rsplit("::").next().unwrap_or("").trim_end_matches(';').to_string(),
        };
        for item in items.split(',') {
            let name = item.split(" as ").last().unwrap_or("").trim();
            let name = name.rsplit("::").next().unwrap_or(name);
            // a glob's names are unknown here; a use of one is unplaceable
            if !name.is_empty() && name != "*" {
                names.insert(name.to_string(), module.clone());
            }
        }
    }
    names
}

/// The module path of a source file: `rules/conv/batch.rs` ->
/// `rules::conv::batch`, `rules/conv/mod.rs` -> `rules::conv`, `lib.rs`
/// -> the root.
fn module_path_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Code lines without comments (doc links name items of any layer), with
/// a path group that spans lines (`use crate::{\n a,\n b,\n};`) joined
/// into its first line.
fn code_lines(src: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut open = 0i64;
    for (i, l) in src.lines().enumerate() {
        if l.trim_start().starts_with("//") {
            continue;
        }
        let depth: i64 = l.matches('{').count() as i64 - l.matches('}').count() as i64;
        match out.last_mut() {
            Some((_, joined)) if open > 0 => {
                joined.push(' ');
                joined.push_str(l.trim());
            }
            _ => out.push((i + 1, l.to_string())),
        }
        // only path groups are joined: a line that opens one after `::`
        if open > 0 || l.contains("::{") {
            open = (open + depth).max(0);
        }
    }
    out
}

/// Each code line with the inline modules (`mod tests {`) it sits in.
fn with_inline_modules(lines: Vec<(usize, String)>) -> Vec<(usize, String, Vec<String>)> {
    let (mut depth, mut open): (i64, Vec<(i64, String)>) = (0, Vec::new());
    let mut out = Vec::with_capacity(lines.len());
    for (n, line) in lines {
        out.push((n, line.clone(), open.iter().map(|m| m.1.clone()).collect()));
        let item = line
            .trim_start()
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub ");
        if let Some(name) = item.strip_prefix("mod ").filter(|r| r.trim_end().ends_with('{')) {
            let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            open.push((depth, name));
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        while open.last().is_some_and(|m| depth <= m.0) {
            open.pop();
        }
    }
    out
}

/// The names a path continues with after `rest` (`a::..` -> `a`;
/// `{a::x, b, c::{..}}` -> `a`, `b`, `c`).
fn heads(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        let s = s.trim_start();
        if s.starts_with('*') {
            return "*".into();
        }
        s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
    };
    if !rest.starts_with('{') {
        return vec![ident(rest)];
    }
    let (mut depth, mut items, mut start) = (0usize, Vec::new(), 1usize);
    for (i, c) in rest.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => {
                items.push(&rest[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 1 => {
                items.push(&rest[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.into_iter().map(ident).filter(|n| !n.is_empty()).collect()
}

/// The top-level modules a line refers to: through `crate::`, and through
/// a chain of `super::` that climbs from the file's module (`path`, e.g.
/// `["rules", "conv", "batch"]`) up to the crate root. A name the root
/// re-exports counts as the module it comes from (`roots`); a glob of the
/// root (`crate::*`) counts as `"*"`, which no layer may use.
fn references(line: &str, path: &[&str], roots: &HashMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < line.len() {
        let word_start = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let rest = &line[i..];
        if word_start && rest.starts_with("crate::") {
            out.extend(heads(&rest["crate::".len()..]));
            i += "crate::".len();
        } else if word_start && rest.starts_with("super::") {
            let mut k = 0;
            let mut r = rest;
            while let Some(t) = r.strip_prefix("super::") {
                k += 1;
                r = t;
            }
            if k == path.len() {
                out.extend(heads(r)); // the crate root
            }
            i += k * "super::".len();
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    out.into_iter().map(|n| roots.get(&n).cloned().unwrap_or(n)).collect()
}

/// Every violation of the layer order in one file's source: a use of a
/// higher layer, a glob of the crate root, or a crate-root name the
/// checker cannot place.
fn upward_imports(path: &[&str], src: &str, roots: &HashMap<String, String>) -> Vec<String> {
    let module = path.first().copied().unwrap_or("lib");
    let Some(own) = rank(module) else {
        return vec![format!("module {module} has no layer (add it to `rank`)")];
    };
    let mut bad = Vec::new();
    for (n, line, inline) in with_inline_modules(code_lines(src)) {
        let line = line.as_str();
        // `super::` inside an inline module (`mod tests { .. }`) climbs
        // from that module
        let nested: Vec<&str> = path.iter().copied().chain(inline.iter().map(String::as_str)).collect();
        for target in references(line, &nested, roots) {
            let why = match rank(&target) {
                _ if target == "*" => Some("a glob of the crate root, which hides each name's layer".to_string()),
                Some(r) if r > own => Some(format!("{target} (layer {r})")),
                Some(_) if target == "interp" && above_the_engine(module) => {
                    Some("interp, which the layers built on the transforms never see".to_string())
                }
                None if own < 13 && !target.is_empty() => {
                    Some(format!("{target}, a crate-root name the checker cannot place"))
                }
                _ => None,
            };
            if let Some(why) = why {
                bad.push(format!("line {n}: {module} (layer {own}) uses {why}: {}", line.trim()));
            }
        }
    }
    bad
}

/// Whether `module` is one of the layers built on the transforms, which
/// reach a graph's run only through them.
fn above_the_engine(module: &str) -> bool {
    matches!(module, "control" | "optim" | "nn" | "dp" | "models")
}

/// What only `env` may do: read the environment's variables and `/proc`.
fn machine_reads(src: &str) -> Vec<String> {
    let banned = ["env::var", "\"/proc", "var_os("];
    let mut bad = Vec::new();
    for (n, line) in code_lines(src) {
        if let Some(b) = banned.iter().find(|b| line.contains(*b)) {
            bad.push(format!("line {n}: {b} outside env: {}", line.trim()));
        }
    }
    bad
}

/// What rules may not contain: timing, running graphs, global state,
/// files and the environment (a rule's answer depends on its operands
/// alone).
fn impure(src: &str) -> Vec<String> {
    let banned = [
        "std::time",
        "Instant",
        "crate::interp",
        "thread_local!",
        "OnceLock",
        "lazy_static",
        "std::env",
        "std::fs",
        "env::var",
    ];
    let mut bad = Vec::new();
    for (n, line) in code_lines(src) {
        let line = line.as_str();
        for b in banned {
            if line.contains(b) {
                bad.push(format!("line {n}: {b:?} in a rule: {}", line.trim()));
            }
        }
        if is_static(line) {
            bad.push(format!("line {n}: a static in a rule: {}", line.trim()));
        }
    }
    bad
}

/// Whether a line declares a static item.
fn is_static(line: &str) -> bool {
    let item = line
        .trim_start()
        .trim_start_matches("pub(crate) ")
        .trim_start_matches("pub(super) ")
        .trim_start_matches("pub ");
    item.starts_with("static ")
}

/// What kernels may not keep: mutable global state (a thread-local, a
/// `static mut`, a static counter or lock). Write-once tables of constants
/// (`OnceLock`) are allowed.
fn mutable_globals(src: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for (n, line) in code_lines(src) {
        let l = line.as_str();
        let mutable = ["Atomic", "Mutex", "RwLock", "Cell<", "RefCell"];
        if l.contains("thread_local!")
            || l.contains("static mut ")
            || (is_static(l) && mutable.iter().any(|m| l.contains(m)))
        {
            bad.push(format!("line {n}: mutable global state in a kernel: {}", l.trim()));
        }
    }
    bad
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn layers_point_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 30, "found only {} source files", files.len());
    let roots = root_names(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    assert_eq!(roots.get("vmap").map(String::as_str), Some("transforms"), "{roots:?}");
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let path = module_path_of(rel);
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = std::fs::read_to_string(f).unwrap();
        for v in upward_imports(&path, &text, &roots) {
            bad.push(format!("{}: {v}", rel.display()));
        }
        let mut checks: Vec<String> = match path.first() {
            Some(&"rules") => impure(&text),
            Some(&"kernels" | &"rng") => mutable_globals(&text),
            _ => Vec::new(),
        };
        if path.first() != Some(&"env") {
            checks.extend(machine_reads(&text));
        }
        bad.extend(checks.into_iter().map(|v| format!("{}: {v}", rel.display())));
    }
    assert!(bad.is_empty(), "the layers must point down:\n{}", bad.join("\n"));
}

/// The root of a small crate for the checker's own tests.
fn roots() -> HashMap<String, String> {
    root_names("pub use error::{Error, Result};\npub use transforms::vmap::vmap;\npub use trace::Tracer;\npub mod nn;")
}

#[test]
fn the_checker_finds_upward_imports() {
    let r = roots();
    let up = |path: &[&str], src: &str| upward_imports(path, src, &r);
    // A rule that imports a transform, a kernel that uses a rule, and
    // `super::` from a top-level module to a module above it.
    let rule = "use crate::transforms::vmap::Randomness;\nuse crate::ir::Prim;";
    assert_eq!(up(&["rules", "walk"], rule).len(), 1);
    assert_eq!(up(&["kernels"], "let x = crate::rules::rule(p);").len(), 1);
    assert_eq!(up(&["ir"], "use super::nn::Module;").len(), 1);
    // groups, and super chains that climb to the crate root
    let grouped = "use crate::{ir::Prim, transforms::settings as s, interp};";
    assert_eq!(up(&["rules", "walk"], grouped).len(), 2);
    let climb = "use super::super::super::interp;";
    assert_eq!(up(&["rules", "conv", "batch"], climb).len(), 1);
    assert!(up(&["rules", "conv", "batch"], "use super::super::walk;").is_empty());
    let spanning = "use crate::{\n    ir::Prim,\n    transforms::settings,\n};\nfn f() {}";
    assert_eq!(up(&["rules", "walk"], spanning).len(), 1);
    // comments and lower layers are fine
    let fine = "// crate::nn\nuse crate::rules::walk;\nuse crate::Error;\nuse crate::{error::Result, ir};";
    assert!(up(&["transforms", "vmap"], fine).is_empty());
}

/// The holes the checker had: crate-root names other than `Error` and
/// `Result`, globs, and two modules of one rank using each other.
#[test]
fn the_checker_places_root_names_globs_and_same_rank_modules() {
    let r = roots();
    let up = |path: &[&str], src: &str| upward_imports(path, src, &r);
    // a root re-export is its module's layer
    assert_eq!(up(&["rules", "walk"], "use crate::vmap;").len(), 1);
    assert_eq!(up(&["kernels", "bmm"], "let t: crate::Tracer = x;").len(), 1);
    assert!(up(&["transforms", "grad"], "use crate::Tracer;").is_empty());
    // a root name the checker cannot place is a violation, not a pass
    assert_eq!(up(&["rules", "walk"], "use crate::Mystery;").len(), 1);
    // globs: of the root always, of a module by that module's layer
    assert_eq!(up(&["transforms", "vmap"], "use crate::*;").len(), 1);
    assert_eq!(up(&["ir"], "use super::*;").len(), 1);
    assert_eq!(up(&["rules", "walk"], "use crate::transforms::*;").len(), 1);
    assert!(up(&["rules", "walk"], "use crate::ir::*;").is_empty());
    // `super::*` in a module's own test module is that module
    assert!(up(&["kernels"], "mod tests {\n    use super::*;\n}").is_empty());
    // one module per rank: trace and ops, nn and dp, cannot both use each other
    assert_eq!(up(&["trace"], "use crate::ops::Axes;").len(), 1);
    assert!(up(&["ops"], "use crate::trace::Tracer;").is_empty());
    // the tracing room is below the rules that emit into its builders
    assert!(up(&["rules", "walk"], "use crate::trace::Builder;").is_empty());
    assert_eq!(up(&["trace", "builder"], "use crate::rules::infer;").len(), 1);
    assert_eq!(up(&["nn"], "use crate::dp::Sgd;").len(), 1);
    assert!(up(&["dp"], "use crate::nn::Module;").is_empty());
    // the control-flow binders: above the transforms whose traces they
    // nest in, below the layers built on them
    assert_eq!(up(&["control", "scan"], "use crate::nn::Linear;").len(), 1);
    assert_eq!(up(&["transforms", "vmap"], "use crate::control::scan;").len(), 1);
    assert!(up(&["control"], "use crate::transforms::tracing;").is_empty());
    assert!(up(&["nn", "recurrent"], "use crate::control::scan_with;").is_empty());
    // the machine's room is below everything but the error; the optimisers
    // below the layers; nothing built on the transforms sees the interpreter
    assert!(up(&["ir", "options"], "use crate::env::Machine;").is_empty());
    assert_eq!(up(&["env"], "use crate::ir::Options;").len(), 1);
    assert_eq!(up(&["optim"], "use crate::nn::Params;").len(), 1);
    assert!(up(&["nn", "lora"], "use crate::optim::Sgd;").is_empty());
    // the generator: on the kernels, under the random primitives' rules
    assert!(up(&["rules", "random"], "use crate::rng::Rng;").is_empty());
    assert_eq!(up(&["kernels", "attention"], "use crate::rng::Rng;").len(), 1);
    assert_eq!(
        up(&["dp", "budget"], "let m = crate::interp::exec::resident();").len(),
        1
    );
    assert_eq!(up(&["control", "scan"], "use crate::interp::Prepared;").len(), 1);
    assert!(up(&["transforms", "cache"], "use crate::interp::exec::Executable;").is_empty());
    assert_eq!(
        machine_reads("let v = std::env::var(\"X\");\nlet m = read(\"/proc/meminfo\");").len(),
        2
    );
}

#[test]
fn the_checker_finds_impure_rules_and_mutable_kernel_state() {
    assert_eq!(impure("let t = std::time::Instant::now();").len(), 2);
    assert_eq!(impure("static SEED: AtomicU64 = AtomicU64::new(0);").len(), 1);
    assert_eq!(
        impure("    pub(crate) static X: u8 = 0;\nlet g = crate::interp::run(g);").len(),
        2
    );
    assert!(impure("fn name(&self) -> &'static str { \"x\" }").is_empty());
    // files and the environment
    assert_eq!(impure("let v = std::env::var(\"X\");").len(), 2);
    assert_eq!(impure("let s = std::fs::read_to_string(p)?;").len(), 1);
    // kernels: the thread-local copy counter the crate once had, and its kin
    let counter = "thread_local! {\n    static COPIED: Cell<usize> = const { Cell::new(0) };\n}";
    assert!(!mutable_globals(counter).is_empty());
    assert_eq!(mutable_globals("static N: AtomicUsize = AtomicUsize::new(0);").len(), 1);
    assert_eq!(mutable_globals("static mut N: usize = 0;").len(), 1);
    assert!(mutable_globals("static THREADS: OnceLock<usize> = OnceLock::new();").is_empty());
}
