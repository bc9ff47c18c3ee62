//! A checkpoint folder written all at once: every file goes to a staging
//! folder beside the target, is flushed to disk, and the staging folder
//! then takes the target's place in one rename. Until that rename the old
//! checkpoint is untouched and resumable; after it the new one is whole.
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

fn io(what: &'static str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        what,
        msg: format!("{}: {e}", path.display()),
    }
}

#[cfg(test)]
thread_local! {
    /// Where a test makes the save fail: before writing the named file, or
    /// at `"publish"` before the staging folder takes the target's place.
    pub(super) static FAIL_AT: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// An injected failure at `point` (tests only; nothing otherwise).
fn fail_point(point: &str) -> std::io::Result<()> {
    #[cfg(test)]
    if FAIL_AT.with(|f| f.get()) == Some(point) {
        return Err(std::io::Error::other(format!("injected failure at {point}")));
    }
    let _ = point;
    Ok(())
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
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A folder being written: its files go into a staging sibling of the
/// target until [`Staged::publish`]. Dropped unpublished, the staging
/// folder is removed and the target is as it was.
pub(super) struct Staged {
    target: PathBuf,
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

impl Staged {
    /// A new staging folder beside `target` (whose parent is created if
    /// missing).
    pub(super) fn new(target: &Path, what: &'static str) -> Result<Staged> {
        // a link to a folder: replace the folder it points to, not the link
        let target = match std::fs::canonicalize(target) {
            Ok(t) => t,
            Err(_) => target.to_path_buf(),
        };
        let name = target
            .file_name()
            .ok_or_else(|| io(what, &target, "is not a folder's name"))?
            .to_string_lossy()
            .into_owned();
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| io(what, &parent, e))?;
        let tag: u64 = rand::random();
        let staging = parent.join(format!(".{name}.saving-{}-{tag:016x}", std::process::id()));
        std::fs::create_dir(&staging).map_err(|e| io(what, &staging, e))?;
        Ok(Staged {
            target,
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
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(what, &path, e))?;
        self.names.push(name.to_string());
        Ok(())
    }

    /// Writes the digest of every file written so far, flushes the folder,
    /// and puts it in the target's place: an existing target is swapped
    /// out in one step where the system can (Linux), else moved aside
    /// first; then removed.
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
        let old = if self.target.exists() {
            Some(swap_in(&self.staging, &self.target).map_err(|e| io(what, &self.target, e))?)
        } else {
            std::fs::rename(&self.staging, &self.target).map_err(|e| io(what, &self.target, e))?;
            None
        };
        self.published = true;
        if let Some(parent) = self.target.parent() {
            sync_dir(parent).map_err(|e| io(what, parent, e))?;
        }
        if let Some(old) = old {
            std::fs::remove_dir_all(&old).map_err(|e| io(what, &old, e))?;
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Flushes a folder's entries (the names in it) to disk.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Puts `staging` at `target` where a folder already is, and returns
/// where the old folder now lies.
fn swap_in(staging: &Path, target: &Path) -> std::io::Result<PathBuf> {
    #[cfg(target_os = "linux")]
    if exchange(staging, target).is_ok() {
        // the names were swapped: the old checkpoint is at `staging`
        return Ok(staging.to_path_buf());
    }
    // Two renames: between them the target is briefly absent (the old
    // checkpoint whole at `aside`, the new one whole at `staging`).
    let mut aside = staging.as_os_str().to_owned();
    aside.push(".old");
    let aside = PathBuf::from(aside);
    std::fs::rename(target, &aside)?;
    if let Err(e) = std::fs::rename(staging, target) {
        let _ = std::fs::rename(&aside, target);
        return Err(e);
    }
    Ok(aside)
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
