//! The `/proc` readers (Linux; `None` elsewhere): the machine's memory,
//! the process's resident memory, the CPU's name.

use std::sync::OnceLock;

/// `MemAvailable` from `/proc/meminfo`, in bytes, read now.
pub(super) fn available() -> Option<usize> {
    kib_field("/proc/meminfo", "MemAvailable:")
}

/// The process's resident memory now (`VmRSS` of `/proc/self/status`),
/// in bytes, once the heap's free pages are returned.
pub(crate) fn resident_memory() -> Option<usize> {
    super::malloc::trim();
    resident_now()
}

/// The process's resident memory now, as it stands (no trim: the cheap
/// reading a trace log takes per node).
pub(crate) fn resident_now() -> Option<usize> {
    kib_field("/proc/self/status", "VmRSS:")
}

/// Whether the process `pid` is alive (Linux: `/proc/<pid>` exists;
/// `None` elsewhere, where it cannot be told).
pub(crate) fn process_alive(pid: u32) -> Option<bool> {
    cfg!(target_os = "linux").then(|| std::path::Path::new("/proc").join(pid.to_string()).exists())
}

/// The CPU's model name (`/proc/cpuinfo`), else the architecture; read
/// once per process.
pub(crate) fn cpu_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string())
    })
}

/// The kibibytes a `/proc` file states on the line starting `key`, in bytes.
fn kib_field(file: &str, key: &str) -> Option<usize> {
    let info = std::fs::read_to_string(file).ok()?;
    let line = info.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
