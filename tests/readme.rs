//! The README and the chapters under `docs/` tell the truth about the
//! crate: their Rust code runs as doc-tests (`lib.rs` includes each file;
//! the guide is `nn::candle_models`), an excerpt marked `rust,ignore` is
//! the text of the file it names, every chapter is linked, the README's
//! list of the crate's root names the root's every export, and its speed
//! figures are those of the committed results file.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn chapters() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .collect();
    v.sort();
    v
}

/// A fenced block: its info string and its lines.
type Block = (String, Vec<String>);

/// The fenced blocks of a markdown text.
fn blocks(md: &str) -> Vec<Block> {
    let (mut out, mut open): (Vec<Block>, Option<Block>) = (vec![], None);
    for line in md.lines() {
        match (line.strip_prefix("```"), open.take()) {
            (Some(_), Some(b)) => out.push(b),
            (Some(info), None) => open = Some((info.trim().to_string(), vec![])),
            (None, Some(mut b)) => {
                b.1.push(line.to_string());
                open = Some(b);
            }
            (None, None) => {}
        }
    }
    out
}

#[test]
fn the_readme_is_a_first_read() {
    let readme = read("README.md");
    let n = readme.lines().count();
    assert!(n <= 250, "README.md has {n} lines; details belong in docs/");
    // code and tables included: a wider line wraps on a laptop's half screen
    let wide: Vec<(usize, usize)> = readme
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.chars().count()))
        .filter(|&(_, w)| w > 105)
        .collect();
    assert!(
        wide.is_empty(),
        "README.md lines over 105 characters (line, width): {wide:?}"
    );
}

#[test]
fn every_chapter_is_linked_and_its_code_runs() {
    let readme = read("README.md");
    let lib = read("src/lib.rs");
    let nn = read("src/nn/mod.rs");
    for ch in chapters() {
        assert!(readme.contains(&format!("(docs/{ch})")), "README.md links no docs/{ch}");
        let included = format!("include_str!(\"../docs/{ch}\")");
        let guide = format!("include_str!(\"../../docs/{ch}\")");
        assert!(
            lib.contains(&included) || nn.contains(&guide),
            "docs/{ch}'s code is not run as a doc-test (include it in lib.rs's doc_chapters)"
        );
    }
    assert!(lib.contains("include_str!(\"../README.md\")"));
    // rustdoc compiles an unlabelled block as Rust: label every block
    for file in std::iter::once("README.md".to_string()).chain(chapters().iter().map(|c| format!("docs/{c}"))) {
        for (info, _) in blocks(&read(&file)) {
            assert!(!info.is_empty(), "{file}: a code block without a language");
        }
    }
}

#[test]
fn an_ignored_excerpt_is_the_text_of_the_file_it_names() {
    for file in std::iter::once("README.md".to_string()).chain(chapters().iter().map(|c| format!("docs/{c}"))) {
        for (info, body) in blocks(&read(&file)) {
            if !info.contains("ignore") {
                continue;
            }
            let source = body[0]
                .strip_prefix("// ")
                .and_then(|s| s.split_whitespace().next())
                .unwrap_or_else(|| panic!("{file}: an ignored block must start with `// <file it is taken from>`"));
            let text = read(source);
            let lines: Vec<&str> = text.lines().map(str::trim).collect();
            for l in body[1..]
                .iter()
                .map(|l| l.trim())
                .filter(|l| !l.is_empty() && *l != "// ...")
            {
                assert!(lines.contains(&l), "{file}: `{l}` is not in {source}");
            }
        }
    }
}

/// The names `src/lib.rs` exports at the root: its top-level `pub use`
/// items and `pub mod`s (not those inside the re-exporting modules, nor the
/// deprecated aliases).
fn root_names() -> Vec<String> {
    let lib = read("src/lib.rs");
    let (mut names, mut depth, mut stmt) = (Vec::new(), 0i32, String::new());
    for line in lib.lines().filter(|l| !l.trim_start().starts_with("//")) {
        let t = line.trim();
        if depth == 0 && (t.starts_with("pub use") || !stmt.is_empty()) {
            stmt.push_str(t);
            if t.ends_with(';') {
                if !stmt.contains("deprecated::") {
                    let list = stmt.rsplit("::").next().unwrap().trim_end_matches(';');
                    let list = list.trim_start_matches('{').trim_end_matches('}');
                    // a renamed re-export (`Prepared as Graph`) is its new name
                    let named = list.split(',').map(|n| n.rsplit(" as ").next().unwrap_or(n).trim());
                    names.extend(named.map(str::to_string).filter(|n| !n.is_empty()));
                }
                stmt.clear();
            }
        } else if depth == 0 && t.starts_with("pub mod ") {
            names.push(t["pub mod ".len()..].trim_end_matches([';', '{', ' ']).to_string());
        }
        depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
    }
    names
}

#[test]
fn the_readme_shows_the_final_root() {
    let readme = read("README.md");
    let section = readme
        .split("## The crate's root")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has no \"The crate's root\" section");
    let names = root_names();
    assert!(
        names.len() > 20 && names.iter().any(|n| n == "vmap") && names.iter().any(|n| n == "dp"),
        "{names:?}"
    );
    for n in &names {
        assert!(
            section.contains(&format!("`{n}`")),
            "the README's root list omits `{n}`"
        );
    }
}

/// A markdown table row's cells, trimmed.
fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// The README's speed figures are those of the committed results file,
/// as `scripts/readme_figures.py write` puts them: the sitting (date, CPU,
/// peers, commit, rounds) in the sentence, one row per figure with its
/// median at each thread count, and each figure the ratio of that name
/// the side-by-side script measured in that sitting.
#[test]
fn the_readme_figures_are_the_committed_results() {
    let readme = read("README.md");
    let doc: serde_json::Value = serde_json::from_str(&read("benches/results/readme.json")).unwrap();
    let (_, rest) = readme
        .split_once("<!-- figures: benches/results/readme.json -->")
        .expect("README.md has no figures block");
    let (block, _) = rest
        .split_once("<!-- /figures -->")
        .expect("the figures block is not closed");
    let prose = block.split_whitespace().collect::<Vec<_>>().join(" ");
    let field = |k: &str| {
        doc[k]
            .as_str()
            .unwrap_or_else(|| panic!("readme.json has no {k}"))
            .to_string()
    };
    for said in [
        field("date"),
        field("cpu"),
        field("peers"),
        format!("commit {}", field("commit")),
    ] {
        assert!(
            prose.contains(&said),
            "the figures' sentence does not say {said:?}:\n{prose}"
        );
    }
    assert!(prose.contains(&format!("medians of {} paired rounds", doc["rounds"])));
    let threads: Vec<u64> = doc["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let rows: Vec<Vec<String>> = block
        .lines()
        .filter(|l| l.starts_with('|') && !l.contains("---"))
        .map(cells)
        .collect();
    let heads: Vec<String> = threads
        .iter()
        .map(|&t| format!("{t} thread{}", if t > 1 { "s" } else { "" }))
        .collect();
    assert_eq!(
        rows[0][1..],
        heads[..],
        "the table's columns are not the sitting's thread counts"
    );
    let figures = doc["figures"].as_array().unwrap();
    assert_eq!(rows.len() - 1, figures.len(), "one row per figure");
    let measured = doc["all_ratios"].as_array().unwrap();
    for (row, fig) in rows[1..].iter().zip(figures) {
        assert_eq!(row[0], fig["label"].as_str().unwrap());
        for (k, &t) in threads.iter().enumerate() {
            let median = fig["median"][k].as_f64().unwrap();
            assert_eq!(row[1 + k], format!("{median:.2}"), "{} at {t} thread(s)", row[0]);
            // the figure is the script's own ratio of that sitting
            let from = measured
                .iter()
                .find(|r| r["script"] == fig["script"] && r["ratio"] == fig["ratio"] && r["threads"] == t)
                .unwrap_or_else(|| panic!("no measured {} at {t} thread(s)", fig["ratio"]));
            assert!((from["median"].as_f64().unwrap() - median).abs() < 1e-4, "{}", row[0]);
        }
    }
}
