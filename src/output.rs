//! Writing output files safely: all or nothing, and never over an input.
//!
//! [`write_atomic`] writes to a temporary file in the target's directory, flushes
//! it to disk, then renames it over the target, so a reader (or a crash, a full
//! disk, a kill) sees either the old file or the complete new one, never a
//! partial write. [`check_output`] refuses, before any work is done, an output
//! path that names one of the run's inputs.

use crate::{Error, Result};
use std::fs::File;
use std::path::Path;

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
    let io = |what: &str, e: std::io::Error| Error::Io {
        context: format!("{what} {}", path.display()),
        source: e,
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::Usage(format!("{} does not name a file", path.display())))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // What `File::create` would give (the umask applies), not tempfile's 0600.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder
        .tempfile_in(dir)
        .map_err(|e| io("cannot create a temporary file for", e))?;
    write(tmp.as_file_mut())?;
    tmp.as_file().sync_all().map_err(|e| io("cannot sync", e))?;
    tmp.persist(path)
        .map_err(|e| io("cannot rename the temporary file to", e.error))?;
    sync_dir(dir).map_err(|e| io("cannot sync the directory of", e))
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

    #[test]
    fn replaces_the_target_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.bin");
        std::fs::write(&p, b"old contents").unwrap();
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
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.bin");
        std::fs::write(&p, b"old contents").unwrap();
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
