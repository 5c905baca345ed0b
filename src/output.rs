//! Writing output files safely: all or nothing, and never over an input.
//!
//! [`write_atomic`] writes to a temporary file in the target's directory, flushes
//! it to disk, then renames it over the target, so a reader (or a crash, a full
//! disk, a kill) sees either the old file or the complete new one, never a
//! partial write. [`check_output`] refuses, before any work is done, an output
//! path that names one of the run's inputs.

use crate::{Error, Result};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Writes `path` atomically with `write`, which gets the new file (empty,
/// positioned at the start).
///
/// The file is created in `path`'s directory as `.{name}.XXXXXX.tmp`, synced,
/// and renamed to `path` (replacing a file, or a symbolic link, of that name);
/// the directory is synced after the rename. When `write` or any step fails
/// the temporary file is removed and `path` is untouched. A process killed
/// before the rename leaves `path` untouched and may leave the temporary file.
pub fn write_atomic<F>(path: &Path, write: F) -> Result<()>
where
    F: FnOnce(&mut File) -> Result<()>,
{
    let dest = Destination::new(path, "file")?;
    let mut builder = dest.temporary(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // What `File::create` would give (the umask applies), not tempfile's 0600.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let io = |what: &str, e| dest.io(what, e);
    let mut tmp = builder
        .tempfile_in(dest.dir)
        .map_err(|e| io("cannot create a temporary file for", e))?;
    write(tmp.as_file_mut())?;
    tmp.as_file().sync_all().map_err(|e| io("cannot sync", e))?;
    tmp.persist(path)
        .map_err(|e| io("cannot rename the temporary file to", e.error))?;
    sync_dir(dest.dir).map_err(|e| io("cannot sync the directory of", e))
}

/// Writes the directory `path` atomically with `write`, which fills a new
/// empty directory (it gets its path).
///
/// The directory is built as `.{name}.XXXXXX.tmp` beside `path`, its files
/// synced, then put in place: renamed to `path`, or, where `path` is an
/// existing directory, exchanged with it in one step (`renameat2` with
/// `RENAME_EXCHANGE` on Linux; elsewhere, or where the file system refuses
/// it, the old directory is first renamed aside) and the old one removed.
/// When `write` or any step before the exchange fails, the temporary
/// directory is removed and `path` is untouched; a process killed before
/// the exchange leaves `path` untouched and may leave the temporary directory.
///
/// The caller decides whether an existing `path` may be replaced
/// ([`check_output_dir`]).
pub fn write_dir_atomic<F>(path: &Path, write: F) -> Result<()>
where
    F: FnOnce(&Path) -> Result<()>,
{
    let dest = Destination::new(path, "directory")?;
    let io = |what: &str, e| dest.io(what, e);
    let tmp = dest
        .temporary(".tmp")
        .tempdir_in(dest.dir)
        .map_err(|e| io("cannot create a temporary directory for", e))?;
    // Errors name the directory being written, not only its temporary path.
    write(tmp.path()).map_err(|e| match e {
        Error::Io { context, source } => Error::Io {
            context: format!("cannot write {} ({context})", path.display()),
            source,
        },
        e => e,
    })?;
    for entry in std::fs::read_dir(tmp.path()).map_err(|e| io("cannot list", e))? {
        let file = entry.map_err(|e| io("cannot list", e))?.path();
        File::open(&file)
            .and_then(|f| f.sync_all())
            .map_err(|e| io("cannot sync", e))?;
    }
    sync_dir(tmp.path()).map_err(|e| io("cannot sync", e))?;
    if path.is_dir() {
        if exchange(tmp.path(), path).is_err() {
            // Not atomic: the old directory is aside for a moment.
            let aside = dest
                .temporary(".old")
                .tempdir_in(dest.dir)
                .map_err(|e| io("cannot create a temporary directory for", e))?;
            let old = aside.path().join("old");
            std::fs::rename(path, &old).map_err(|e| io("cannot move aside", e))?;
            if let Err(e) = std::fs::rename(tmp.path(), path) {
                let _ = std::fs::rename(&old, path);
                return Err(io("cannot rename the temporary directory to", e));
            }
        }
        // `tmp` now holds the old directory, removed when it drops.
    } else {
        let tmp = tmp.keep();
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(io("cannot rename the temporary directory to", e));
        }
    }
    sync_dir(dest.dir).map_err(|e| io("cannot sync the directory of", e))
}

/// The path an atomic write puts in place, and what its steps share.
struct Destination<'a> {
    path: &'a Path,
    /// The directory it is in (`.` for a bare name).
    dir: &'a Path,
    /// `.{name}.`: how the temporary files beside it begin.
    prefix: String,
}

impl<'a> Destination<'a> {
    /// `path`; a usage error when it names no `kind` (a file or a directory).
    fn new(path: &'a Path, kind: &str) -> Result<Destination<'a>> {
        let name = path
            .file_name()
            .ok_or_else(|| Error::Usage(format!("{} does not name a {kind}", path.display())))?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let prefix = format!(".{}.", name.to_string_lossy());
        Ok(Destination { path, dir, prefix })
    }

    /// Makes temporary files or directories named `.{name}.XXXXXX{suffix}`.
    fn temporary<'s>(&'s self, suffix: &'s str) -> tempfile::Builder<'s, 's> {
        let mut builder = tempfile::Builder::new();
        builder.prefix(&self.prefix).suffix(suffix);
        builder
    }

    /// The error of the step `what` (`cannot sync`, ...) on the path.
    fn io(&self, what: &str, source: std::io::Error) -> Error {
        Error::Io {
            context: format!("{what} {}", self.path.display()),
            source,
        }
    }
}

/// Swaps two directories in one step.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths, relative to the working directory.
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

/// No atomic exchange outside Linux: the caller renames in two steps.
#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Checks, before a run starts, that the directory `output` can be written
/// by [`write_dir_atomic`]: its parent exists, it is not a file, an existing
/// directory holds `marker` (it is an earlier output of the same kind, which
/// may be replaced), and it neither is nor contains any of `inputs`, nor lies
/// inside one of them (compared after resolving links). Inputs also listed in
/// `replaceable` (a checkpoint being resumed and the files read from it) are
/// exempt: replacing them is the point.
pub fn check_output_dir(
    output: &Path,
    marker: &str,
    inputs: &[&Path],
    replaceable: &[&Path],
) -> Result<()> {
    let parent = output
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if output.file_name().is_none() || !parent.is_dir() {
        return Err(Error::Usage(format!(
            "cannot write {}: {} is not a directory",
            output.display(),
            parent.display()
        )));
    }
    if output.exists() && !output.is_dir() {
        return Err(Error::Usage(format!(
            "cannot write {}: it is a file, and the output is a directory",
            output.display()
        )));
    }
    let Ok(out) = output.canonicalize() else {
        return Ok(()); // does not exist yet
    };
    let canonical = |p: &&Path| p.canonicalize().ok();
    let replaceable: Vec<PathBuf> = replaceable.iter().filter_map(canonical).collect();
    for input in inputs {
        if let Some(i) = canonical(input).filter(|i| !replaceable.contains(i)) {
            if i.starts_with(&out) || out.starts_with(&i) {
                return Err(Error::Usage(format!(
                    "refusing to write {}: it is, holds or lies in an input of this run ({})",
                    output.display(),
                    input.display()
                )));
            }
        }
    }
    if !replaceable.contains(&out) && !out.join(marker).is_file() {
        return Err(Error::Usage(format!(
            "refusing to replace the directory {}: it holds no {marker}, so it is not an earlier output",
            output.display()
        )));
    }
    Ok(())
}

/// Makes a rename in `dir` durable.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Directories cannot be opened for syncing outside Unix; the rename is still atomic.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Checks, before a run starts, that `output` can be written: its directory
/// exists, it is not a directory, and it is not the same file as any of
/// `inputs` (compared after resolving links).
pub fn check_output(output: &Path, inputs: &[&Path]) -> Result<()> {
    let dir = output
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "cannot write {}: {} is not a directory",
            output.display(),
            dir.display()
        )));
    }
    if output.is_dir() {
        return Err(Error::Usage(format!(
            "cannot write {}: it is a directory",
            output.display()
        )));
    }
    let Ok(out) = output.canonicalize() else {
        return Ok(());
    }; // does not exist yet
    match inputs
        .iter()
        .find(|i| i.canonicalize().is_ok_and(|i| i == out))
    {
        Some(input) => Err(Error::Usage(format!(
            "refusing to write {}: it is an input of this run ({})",
            output.display(),
            input.display()
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A directory holding `out.bin`, of `old contents`.
    fn old_file() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.bin");
        std::fs::write(&p, b"old contents").unwrap();
        (dir, p)
    }

    #[test]
    fn replaces_the_target_whole() {
        let (dir, p) = old_file();
        write_atomic(&p, |f| {
            f.write_all(b"new").map_err(|e| Error::Io {
                context: "test".into(),
                source: e,
            })
        })
        .unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(entries(dir.path()), ["out.bin"]);
    }

    #[test]
    fn a_failing_writer_leaves_the_target_and_no_temporary_file() {
        let (dir, p) = old_file();
        let mut seen = None;
        let err = write_atomic(&p, |f| {
            f.write_all(b"partial").unwrap();
            f.sync_all().unwrap();
            seen = Some(entries(dir.path()));
            Err(Error::Usage("writer failed".into()))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "writer failed");
        // While writing, the data went to a separate file, not the target.
        let seen = seen.unwrap();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(
            seen.iter()
                .any(|n| n.starts_with(".out.bin.") && n.ends_with(".tmp")),
            "{seen:?}"
        );
        assert_eq!(std::fs::read(&p).unwrap(), b"old contents");
        assert_eq!(entries(dir.path()), ["out.bin"]);
    }

    #[test]
    fn a_missing_directory_is_an_error_and_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("no/such/dir/out.bin");
        assert!(write_atomic(&p, |_| Ok(())).is_err());
        assert!(check_output(&p, &[])
            .unwrap_err()
            .to_string()
            .contains("is not a directory"));
    }

    #[test]
    fn a_directory_is_replaced_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ck");
        let fill = |text: &'static str| {
            move |d: &Path| {
                std::fs::write(d.join("a"), text).unwrap();
                Ok(())
            }
        };
        write_dir_atomic(&p, fill("one")).unwrap();
        write_dir_atomic(&p, fill("two")).unwrap();
        assert_eq!(std::fs::read_to_string(p.join("a")).unwrap(), "two");
        let err = write_dir_atomic(&p, |d| {
            std::fs::write(d.join("a"), "three").unwrap();
            Err(Error::Runtime("writer failed".into()))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "writer failed");
        assert_eq!(std::fs::read_to_string(p.join("a")).unwrap(), "two");
        assert_eq!(entries(dir.path()), ["ck"]);
    }

    #[test]
    fn only_an_earlier_output_directory_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ck");
        std::fs::create_dir(&out).unwrap();
        let input = out.join("data.bin");
        std::fs::write(&input, b"x").unwrap();
        let e = check_output_dir(&out, "state.json", &[&input], &[]).unwrap_err();
        assert!(e.to_string().contains("refusing to write"), "{e}");
        let e = check_output_dir(&out, "state.json", &[], &[]).unwrap_err();
        assert!(e.to_string().contains("holds no state.json"), "{e}");
        std::fs::write(out.join("state.json"), b"{}").unwrap();
        check_output_dir(&out, "state.json", &[], &[]).unwrap();
        check_output_dir(&out, "state.json", &[&out, &input], &[&out, &input]).unwrap();
        assert!(check_output_dir(&out, "state.json", &[&out, &input], &[&out]).is_err());
        assert!(check_output_dir(&input, "state.json", &[], &[]).is_err());
        assert!(check_output_dir(&dir.path().join("no/ck"), "state.json", &[], &[]).is_err());
    }

    #[test]
    fn inputs_are_refused_as_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("model.safetensors");
        std::fs::write(&input, b"x").unwrap();
        let other = dir.path().join("ck.safetensors");
        check_output(&other, &[&input]).unwrap();
        let same = dir.path().join(".").join("model.safetensors");
        let e = check_output(&same, &[&other, &input])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("refusing to write") && e.contains("model.safetensors"),
            "{e}"
        );
        assert!(check_output(dir.path(), &[])
            .unwrap_err()
            .to_string()
            .contains("is a directory"));
    }
}
