//! Writing output files so that a reader never sees a partial file.

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory, flushed to disk, then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |e: std::io::Error| Error::Io { context: format!("writing {}", path.display()), source: e };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // tempfile creates 0600; outputs are ordinary files
        tmp.as_file().set_permissions(std::fs::Permissions::from_mode(0o644)).map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}
