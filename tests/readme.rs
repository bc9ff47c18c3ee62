//! The README's "Bring a candle model" section is the guide whose code runs
//! as a doc-test (`docs/bring_a_candle_model.md`, `nn::candle_models`): the
//! same text, less the doc-test's hidden lines.

#[test]
fn the_readme_shows_the_tested_guide() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("docs/bring_a_candle_model.md")).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let visible: Vec<&str> = guide.lines().filter(|l| !l.starts_with("# ")).collect();
    let shown = visible.join("\n");
    assert!(
        readme.contains(&shown),
        "README.md's guide differs from docs/bring_a_candle_model.md"
    );
}
