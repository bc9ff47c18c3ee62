//! `Auto`'s decisions are kept across runs by default: a process that
//! measured a schedule writes it to the decisions file, and the next
//! process on the machine reads it and measures nothing. (This
//! repository's `.cargo/config.toml` turns the default file off for its
//! own tests; this test names a file of its own for its child processes.)

use candle_core::{Device, Tensor};
use candle_func::planner::{schedule_choices, AUTO_CACHE_ENV};
use candle_func::{vmap, Tracer};

/// The child: one large vmap (Auto decides its schedule), then whether the
/// decision was measured here (a read one is the file's, to the digit).
#[test]
#[ignore]
fn child() {
    let Ok(file) = std::env::var(AUTO_CACHE_ENV) else {
        return;
    };
    // 256 examples of a [1024, 64] temporary: 64 MiB batched, measured
    let big = |x: Tracer| x.broadcast_as((1024, 64))?.exp()?.sum(0);
    let xs = Tensor::randn(0f32, 1., (256, 64), &Device::Cpu).unwrap();
    let before = std::fs::read_to_string(&file).unwrap_or_default();
    vmap(big).call(&xs).unwrap();
    let c = schedule_choices()
        .into_iter()
        .find(|c| c.size == 256)
        .expect("a decision");
    let (s, ms) = c.timings_ms[0];
    let read = before.contains(&format!("{s:?}={ms}"));
    println!("MEASURED {}", !read);
}

fn run_child(file: &std::path::Path) -> bool {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--ignored", "--nocapture"])
        .env(AUTO_CACHE_ENV, file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.split_once("MEASURED "))
        .map(|(_, r)| r.trim().to_string());
    line.unwrap_or_else(|| panic!("no result\n{text}\n{}", String::from_utf8_lossy(&out.stderr))) == "true"
}

#[test]
fn a_second_process_reads_the_first_ones_decisions() {
    let file = std::env::temp_dir().join(format!("candle-func-auto-{}/decisions.tsv", std::process::id()));
    assert!(run_child(&file), "the first process measures");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.lines().any(|l| l.starts_with("schedule\t")), "{text}");
    assert!(!run_child(&file), "the second process measures nothing");
    // a corrupt file is set aside with a warning: measured again, rewritten
    std::fs::write(&file, "garbage\n").unwrap();
    assert!(run_child(&file));
    assert!(std::fs::read_to_string(&file).unwrap().starts_with("schedule\t"));
    std::fs::remove_dir_all(file.parent().unwrap()).ok();
}
