//! A checkpoint folder written all at once: every file goes to a staging
//! folder beside the target, is flushed to disk, and the staging folder
//! then takes the target's place: in one atomic exchange on Linux, else
//! by two renames (the old folder aside, the new one in), between which
//! the target is briefly absent while both folders lie whole beside it.
//! Until then the old checkpoint is untouched and resumable; after it the
//! new one is whole.
//! A digest file (`checksums.sha256`, in `sha256sum`'s format) lists
//! every other file's SHA-256, so a truncated or edited file is caught
//! when the folder is read back.
//!
//! The digest detects accidents (a copy cut short, a stray edit, a disk
//! error); it is not a security boundary: whoever can write the folder
//! can rewrite the digest too.

use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The digest file's name.
pub(super) const DIGEST: &str = "checksums.sha256";

/// A checkpoint error of `what` naming `path`.
pub(super) fn io(what: &'static str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        what,
        msg: format!("{}: {e}", path.display()),
    }
}

/// [`io`] for a failure to make, rename or swap the folders, with why
/// the system may refuse it: the new folder is written beside the target.
fn placing(what: &'static str, path: &Path, e: std::io::Error) -> Error {
    #[cfg(unix)]
    let beside = matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::EBUSY | libc::EACCES | libc::EPERM | libc::EROFS)
    );
    #[cfg(not(unix))]
    let beside = e.kind() == std::io::ErrorKind::PermissionDenied;
    if !beside {
        return io(what, path, e);
    }
    io(
        what,
        path,
        format!(
            "{e} (a checkpoint is written to a new folder beside the target, then renamed into its place: \
             the parent folder must be writable and the target must not be a mount point; save into a \
             sub-folder of a mounted volume)"
        ),
    )
}

#[cfg(test)]
thread_local! {
    /// Where a test makes the save fail (each point listed): before
    /// writing the named file, at
    /// `"publish"` before the staging folder takes the target's place, at
    /// `"exchange"` (the one-step swap, so the two renames run instead),
    /// or at `"second rename"` (the second of those).
    pub(super) static FAIL_AT: std::cell::Cell<&'static [&'static str]> = const { std::cell::Cell::new(&[]) };
}

/// An injected failure at `point` (tests only; nothing otherwise).
fn fail_point(point: &str) -> std::io::Result<()> {
    #[cfg(test)]
    if FAIL_AT.with(|f| f.get()).contains(&point) {
        return Err(std::io::Error::other(format!("injected failure at {point}")));
    }
    let _ = point;
    Ok(())
}

/// Lowercase hex of `bytes`.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a file's bytes, in hex.
pub(super) fn sha256_of(path: &Path, what: &'static str) -> Result<String> {
    let mut f = File::open(path).map_err(|e| io(what, path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io(what, path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// A folder being written: its files go into a staging sibling of the
/// target until [`Staged::publish`]. Dropped unpublished, the staging
/// folder is removed and the target is as it was.
pub(super) struct Staged {
    target: PathBuf,
    parent: PathBuf,
    staging: PathBuf,
    names: Vec<String>,
    published: bool,
}

/// The files a checkpoint folder may hold: a folder with anything else in
/// it is not replaced, since replacing it would delete what is not ours.
pub(super) fn check_replaceable(target: &Path, ours: &[&str], what: &'static str) -> Result<()> {
    let entries = match std::fs::read_dir(target) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(what, target, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io(what, target, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !ours.contains(&name.as_ref()) && name != DIGEST {
            return Err(io(
                what,
                target,
                format!(
                    "holds {name:?}, which is not a file of a checkpoint ({ours:?}, {DIGEST}): \
                     save into a folder of its own (the whole folder is replaced)"
                ),
            ));
        }
    }
    Ok(())
}

/// The target's folder and name, the folder made if missing and resolved
/// (links followed), so that a relative or linked target is swapped where
/// it really lies.
pub(super) fn resolve(target: &Path, what: &'static str) -> Result<(PathBuf, String)> {
    let name = target
        .file_name()
        .ok_or_else(|| io(what, target, "is not a folder's name"))?
        .to_string_lossy()
        .into_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| placing(what, &parent, e))?;
    let parent = std::fs::canonicalize(&parent).map_err(|e| io(what, &parent, e))?;
    // a link to a folder: replace the folder it points to, not the link
    match std::fs::canonicalize(parent.join(&name)) {
        Ok(t) => {
            let name = t.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or(name);
            Ok((t.parent().map(Path::to_path_buf).unwrap_or(parent), name))
        }
        Err(_) => Ok((parent, name)),
    }
}

/// Removes the staging folders earlier saves into `name` left in `parent`
/// when their process died (a kill mid-save), where the target is whole
/// (a folder moved aside while the target is missing is the only copy of
/// a checkpoint, and stays). Linux only: a process is alive while
/// `/proc/<pid>` is.
fn remove_stale(parent: &Path, name: &str, target_whole: bool) {
    #[cfg(target_os = "linux")]
    {
        let prefix = format!(".{name}.saving-");
        let Ok(entries) = std::fs::read_dir(parent) else { return };
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = file.strip_prefix(&prefix) else {
                continue;
            };
            let pid = rest.split('-').next().unwrap_or_default();
            let dead = pid
                .parse::<u32>()
                .is_ok_and(|p| crate::env::process_alive(p) == Some(false));
            if dead && (target_whole || !file.ends_with(".old")) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let _ = (parent, name, target_whole);
}

/// A checkpoint an interrupted save moved aside from `target` (where two
/// renames replace a folder and the process died between them), to name
/// when `target` is missing.
pub(super) fn moved_aside(target: &Path) -> Option<PathBuf> {
    let name = target.file_name()?.to_string_lossy().into_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let prefix = format!(".{name}.saving-");
    std::fs::read_dir(parent).ok()?.flatten().map(|e| e.path()).find(|p| {
        let f = p
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        f.starts_with(&prefix) && f.ends_with(".old")
    })
}

impl Staged {
    /// A new staging folder beside `target` (whose parent is created if
    /// missing).
    pub(super) fn new(target: &Path, what: &'static str) -> Result<Staged> {
        let (parent, name) = resolve(target, what)?;
        let target = parent.join(&name);
        remove_stale(&parent, &name, target.exists());
        let tag: u64 = rand::random();
        let staging = parent.join(format!(".{name}.saving-{}-{tag:016x}", std::process::id()));
        std::fs::create_dir(&staging).map_err(|e| placing(what, &staging, e))?;
        Ok(Staged {
            target,
            parent,
            staging,
            names: Vec::new(),
            published: false,
        })
    }

    /// Writes the file `name` by `write` (given its path in the staging
    /// folder), then flushes it to disk.
    pub(super) fn file(
        &mut self,
        name: &str,
        what: &'static str,
        write: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<()> {
        let path = self.staging.join(name);
        fail_point(name).map_err(|e| io(what, &path, e))?;
        write(&path)?;
        // written to disk before the folder is published (opened for
        // writing: flushing needs it on some systems)
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(what, &path, e))?;
        self.names.push(name.to_string());
        Ok(())
    }

    /// Writes the digest of every file written so far, flushes the folder,
    /// and puts it in the target's place: an existing target is swapped
    /// out in one step where the system can (Linux), else moved aside
    /// first; then removed. Once the new folder is in place the save has
    /// succeeded: flushing the parent and removing the old folder are
    /// tried, and their failures logged, not returned.
    pub(super) fn publish(mut self, what: &'static str) -> Result<()> {
        let mut lines = String::new();
        for name in &self.names {
            let sum = sha256_of(&self.staging.join(name), what)?;
            lines.push_str(&format!("{sum}  {name}\n"));
        }
        let names = std::mem::take(&mut self.names);
        self.file(DIGEST, what, |p| {
            let mut f = File::create(p).map_err(|e| io(what, p, e))?;
            f.write_all(lines.as_bytes()).map_err(|e| io(what, p, e))
        })?;
        self.names = names;
        sync_dir(&self.staging).map_err(|e| io(what, &self.staging, e))?;
        fail_point("publish").map_err(|e| io(what, &self.target, e))?;
        let old = match self.target.exists() {
            true => Some(self.swap_in(what)?),
            false => {
                std::fs::rename(&self.staging, &self.target).map_err(|e| placing(what, &self.target, e))?;
                None
            }
        };
        self.published = true;
        if let Err(e) = sync_dir(&self.parent) {
            log::warn!("{what}: saved, but flushing {} failed: {e}", self.parent.display());
        }
        if let Some(old) = old {
            if let Err(e) = std::fs::remove_dir_all(&old) {
                log::warn!(
                    "{what}: saved, but the previous checkpoint at {} was not removed: {e}",
                    old.display()
                );
            }
        }
        Ok(())
    }

    /// Puts the staging folder at the target where a folder already is,
    /// and returns where the old folder now lies.
    fn swap_in(&mut self, what: &'static str) -> Result<PathBuf> {
        let (staging, target) = (&self.staging, &self.target);
        #[cfg(target_os = "linux")]
        if fail_point("exchange").and_then(|_| exchange(staging, target)).is_ok() {
            // the names were swapped: the old checkpoint is at `staging`
            return Ok(staging.to_path_buf());
        }
        // Two renames: between them the target is briefly absent (the old
        // checkpoint whole at `aside`, the new one whole at `staging`).
        let mut aside = staging.as_os_str().to_owned();
        aside.push(".old");
        let aside = PathBuf::from(aside);
        std::fs::rename(target, &aside).map_err(|e| placing(what, target, e))?;
        let second = fail_point("second rename").and_then(|_| std::fs::rename(staging, target));
        let Err(e) = second else { return Ok(aside) };
        if std::fs::rename(&aside, target).is_ok() {
            return Err(placing(what, target, e));
        }
        // neither folder is at the target: keep both, and say where
        self.published = true;
        Err(io(
            what,
            target,
            format!(
                "{e}; the previous checkpoint is at {} and the new one at {}: rename either to {}",
                aside.display(),
                staging.display(),
                target.display()
            ),
        ))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Flushes a folder's entries (the names in it) to disk, where the system
/// can open a folder to do so (Unix).
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    File::open(dir)?.sync_all()?;
    let _ = dir;
    Ok(())
}

/// Swaps two paths in one atomic step (`renameat2` with
/// `RENAME_EXCHANGE`); an error where the file system cannot.
#[cfg(target_os = "linux")]
pub(super) fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both arguments are valid NUL-terminated paths that outlive
    // the call, and AT_FDCWD makes them relative to the working folder as
    // `std::fs::rename` treats them; the call reads nothing else. Tested
    // by `checkpoint::tests::a_save_replaces_the_previous_folder_whole`.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Checks every file `checksums.sha256` in `dir` lists against its bytes,
/// and that it lists exactly `expected`. An error naming the file whose
/// digest differs, or what is missing.
pub(super) fn verify(dir: &Path, expected: &[&str], what: &'static str) -> Result<()> {
    let path = dir.join(DIGEST);
    let text = std::fs::read_to_string(&path).map_err(|e| io(what, &path, e))?;
    let mut listed = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (sum, name) = line
            .split_once("  ")
            .ok_or_else(|| io(what, &path, format!("line {line:?} is not `<sha256>  <file>`")))?;
        if !expected.contains(&name) {
            return Err(io(what, &path, format!("lists {name:?}, not a file of a checkpoint")));
        }
        let file = dir.join(name);
        let actual = sha256_of(&file, what)?;
        if actual != sum {
            return Err(io(
                what,
                &file,
                format!(
                    "its SHA-256 is {actual}, the digest says {sum}: the file was changed or cut short after the save"
                ),
            ));
        }
        listed.push(name);
    }
    if let Some(missing) = expected.iter().find(|n| !listed.contains(n)) {
        return Err(io(what, &path, format!("does not list {missing:?}")));
    }
    Ok(())
}
