//! Compiled kernels kept on disk between runs: NVRTC's PTX for a kernel
//! source, found again by a hash of everything that made it (the source,
//! the compile options, the compiler's version), so that only a machine's
//! first run compiles. The flash attention kernels take NVRTC about 16 s
//! (compute_90a, on one core of the build machine); the driver's own cache
//! (`~/.nv/ComputeCache`) keeps what it makes of the PTX, not the PTX.
//!
//! The directory is `$OOMFIX_CACHE_DIR/kernels`, else
//! `$XDG_CACHE_HOME/oomfix/kernels`, else `~/.cache/oomfix/kernels`;
//! `OOMFIX_CACHE_DIR` set but empty turns the cache off (as Triton's
//! `TRITON_CACHE_DIR` places its cache). A file is written to a temporary
//! name and renamed, so that ranks compiling at once never read half a
//! file; a cache that cannot be read or written only costs the compile.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The cache's directory, from the environment (`None`: turned off, or no
/// home to put it in).
pub(crate) fn directory() -> Option<PathBuf> {
    directory_from(|name| std::env::var_os(name))
}

/// [`directory`] with the environment's variables read by `var`.
fn directory_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name| var(name).filter(|v| !v.is_empty());
    let root = match var("OOMFIX_CACHE_DIR") {
        Some(dir) if dir.is_empty() => return None,
        Some(dir) => PathBuf::from(dir),
        None => set("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| set("HOME").map(|home| Path::new(&home).join(".cache")))?
            .join("oomfix"),
    };
    Some(root.join("kernels"))
}

/// The kernel made from `parts` (everything its output depends on): read
/// from `dir` when a run made it before, else `make`d and written there.
/// Only what `looks_whole` accepts is taken from a file (another is made
/// again and replaces it).
pub(crate) fn cached<E>(
    dir: Option<&Path>,
    parts: &[&[u8]],
    looks_whole: impl Fn(&str) -> bool,
    make: impl FnOnce() -> Result<String, E>,
) -> Result<String, E> {
    let Some(dir) = dir else {
        return make();
    };
    let path = dir.join(format!("{}.ptx", key(parts)));
    if let Ok(text) = std::fs::read_to_string(&path) {
        if looks_whole(&text) {
            return Ok(text);
        }
    }
    let made = make()?;
    // A failed write leaves the next run to compile again.
    let _ = write(dir, &path, &made);
    Ok(made)
}

/// The hex SHA-256 of `parts`, each length-prefixed (so that moving bytes
/// from one part to the next changes the key).
fn key(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn write(dir: &Path, path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    file.write_all(text.as_bytes())?;
    file.persist(path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn whole(text: &str) -> bool {
        text.starts_with("ptx")
    }

    /// The second ask of the same parts reads the file the first wrote; other
    /// parts make their own; a damaged file is made again.
    #[test]
    fn a_kernel_is_made_once_per_parts() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kernels");
        let made = Cell::new(0);
        let make = |text: &str| {
            made.set(made.get() + 1);
            Ok::<_, ()>(text.to_string())
        };
        let ask = |parts: &[&[u8]], text| cached(Some(&dir), parts, whole, || make(text));
        assert_eq!(ask(&[b"source", b"sm_90"], "ptx a"), Ok("ptx a".into()));
        assert_eq!(ask(&[b"source", b"sm_90"], "ptx b"), Ok("ptx a".into()));
        assert_eq!(made.get(), 1);
        assert_eq!(ask(&[b"source", b"sm_80"], "ptx c"), Ok("ptx c".into()));
        assert_eq!(ask(&[b"sourc", b"esm_90"], "ptx d"), Ok("ptx d".into()));
        assert_eq!(made.get(), 3);
        let path = dir.join(format!("{}.ptx", key(&[b"source", b"sm_90"])));
        std::fs::write(&path, "garbage").unwrap();
        assert_eq!(ask(&[b"source", b"sm_90"], "ptx e"), Ok("ptx e".into()));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "ptx e");
        // Nothing but the kernels is left in the directory.
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names.len(), 3, "{names:?}");
        assert!(names.iter().all(|n| n.ends_with(".ptx")), "{names:?}");
    }

    /// A failed compile is returned and writes nothing; without a directory
    /// (the cache turned off) every ask makes the kernel.
    #[test]
    fn failures_and_no_directory_write_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kernels");
        let failed = cached(Some(&dir), &[b"x"], whole, || Err::<String, _>("log"));
        assert_eq!(failed, Err("log"));
        assert!(!dir.exists());
        let made = Cell::new(0);
        for _ in 0..2 {
            let got = cached(None, &[b"x"], whole, || {
                made.set(made.get() + 1);
                Ok::<_, ()>("ptx".to_string())
            });
            assert_eq!(got, Ok("ptx".into()));
        }
        assert_eq!(made.get(), 2);
    }

    /// The directory follows OOMFIX_CACHE_DIR (turned off when empty), then
    /// XDG_CACHE_HOME, then HOME.
    #[test]
    fn the_directory_follows_the_environment() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            directory_from(move |name| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            })
        };
        let all = &[
            ("OOMFIX_CACHE_DIR", "/o"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(env(all), Some(PathBuf::from("/o/kernels")));
        assert_eq!(env(&[("OOMFIX_CACHE_DIR", ""), ("HOME", "/h")]), None);
        assert_eq!(
            env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            Some(PathBuf::from("/x/oomfix/kernels"))
        );
        assert_eq!(
            env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")]),
            Some(PathBuf::from("/h/.cache/oomfix/kernels"))
        );
        assert_eq!(env(&[]), None);
    }
}
