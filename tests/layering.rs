//! The crate's layers point down: each module imports only from the layers
//! below it, and the rules hold no timing, no interpreter call and no
//! global state. This test reads the sources and fails on a violation,
//! naming the file, the line and the layers involved.
//!
//! Bottom to top (`error` is shared by all):
//! `ir` ← `kernels` ← `rules` ← `interp` ← `trace`/`ops` ← `transforms` ←
//! `nn`, `dp` ← `lib.rs`.

use std::path::{Path, PathBuf};

/// The rank of each top-level module; a module may use any module of a
/// lower rank, and its own.
fn rank(module: &str) -> Option<usize> {
    Some(match module {
        "error" => 0,
        "ir" => 1,
        "kernels" => 2,
        "rules" => 3,
        "interp" => 4,
        "trace" | "ops" => 5,
        "transforms" => 6,
        "nn" | "dp" => 7,
        "lib" => 8,
        _ => return None,
    })
}

/// Names the crate root re-exports from the error module.
fn root_alias(name: &str) -> Option<&'static str> {
    match name {
        "Error" | "Result" => Some("error"),
        _ => None,
    }
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

/// The names a path continues with after `rest` (`a::..` -> `a`;
/// `{a::x, b, c::{..}}` -> `a`, `b`, `c`).
fn heads(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
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
/// `["rules", "conv", "batch"]`) up to the crate root.
fn references(line: &str, path: &[&str]) -> Vec<String> {
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
    out.into_iter()
        .map(|n| root_alias(&n).map(str::to_string).unwrap_or(n))
        .collect()
}

/// Every violation of the layer order in one file's source.
fn upward_imports(path: &[&str], src: &str) -> Vec<String> {
    let module = path.first().copied().unwrap_or("lib");
    let Some(own) = rank(module) else {
        return vec![format!("module {module} has no layer (add it to `rank`)")];
    };
    let mut bad = Vec::new();
    for (n, line) in code_lines(src) {
        let line = line.as_str();
        for target in references(line, path) {
            match rank(&target) {
                Some(r) if r > own || (r == own && target != module && own != 5 && own != 7) => bad.push(format!(
                    "line {n}: {module} (layer {own}) uses {target} (layer {r}): {}",
                    line.trim()
                )),
                _ => {}
            }
        }
    }
    bad
}

/// What rules may not contain: timing, running graphs, global state.
fn impure(src: &str) -> Vec<String> {
    let banned = [
        "std::time",
        "Instant",
        "crate::interp",
        "thread_local!",
        "OnceLock",
        "lazy_static",
    ];
    let mut bad = Vec::new();
    for (n, line) in code_lines(src) {
        let line = line.as_str();
        for b in banned {
            if line.contains(b) {
                bad.push(format!("line {n}: {b:?} in a rule: {}", line.trim()));
            }
        }
        let item = line
            .trim_start()
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub ");
        if item.starts_with("static ") {
            bad.push(format!("line {n}: a static in a rule: {}", line.trim()));
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
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let path = module_path_of(rel);
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = std::fs::read_to_string(f).unwrap();
        for v in upward_imports(&path, &text) {
            bad.push(format!("{}: {v}", rel.display()));
        }
        if path.first() == Some(&"rules") {
            for v in impure(&text) {
                bad.push(format!("{}: {v}", rel.display()));
            }
        }
    }
    assert!(bad.is_empty(), "the layers must point down:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_finds_upward_imports() {
    // A rule that imports a transform, a kernel that uses a rule, and
    // `super::` from a top-level module to a module above it.
    let rule = "use crate::transforms::vmap::Randomness;\nuse crate::ir::Prim;";
    assert_eq!(upward_imports(&["rules", "walk"], rule).len(), 1);
    assert_eq!(upward_imports(&["kernels"], "let x = crate::rules::rule(p);").len(), 1);
    assert_eq!(upward_imports(&["ir"], "use super::nn::Module;").len(), 1);
    // groups, and super chains that climb to the crate root
    let grouped = "use crate::{ir::Prim, transforms::settings as s, interp};";
    assert_eq!(upward_imports(&["rules", "walk"], grouped).len(), 2);
    let climb = "use super::super::super::interp;";
    assert_eq!(upward_imports(&["rules", "conv", "batch"], climb).len(), 1);
    assert!(upward_imports(&["rules", "conv", "batch"], "use super::super::walk;").is_empty());
    let spanning = "use crate::{\n    ir::Prim,\n    transforms::settings,\n};\nfn f() {}";
    assert_eq!(upward_imports(&["rules", "walk"], spanning).len(), 1);
    // comments and lower layers are fine
    let fine = "// crate::nn\nuse crate::rules::walk;\nuse crate::Error;\nuse crate::{error::Result, ir};";
    assert!(upward_imports(&["transforms", "vmap"], fine).is_empty());
    assert_eq!(impure("let t = std::time::Instant::now();").len(), 2);
    assert_eq!(impure("static SEED: AtomicU64 = AtomicU64::new(0);").len(), 1);
    assert_eq!(
        impure("    pub(crate) static X: u8 = 0;\nlet g = crate::interp::run(g);").len(),
        2
    );
    assert!(impure("fn name(&self) -> &'static str { \"x\" }").is_empty());
}
