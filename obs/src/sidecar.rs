//! Files kept beside a local part (its summary, its detail levels): read when present,
//! written under a temporary name (`.<name>.tmp`) and renamed into place, so a reader never
//! sees half of one.

use std::path::Path;

use anyhow::{Context, Result};

/// The bytes of `path`; `Ok(None)` when there is no such file.
pub fn read_if_present(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_through(path, bytes, "tmp")
}

/// [`write_atomic`] through a temporary name of writer `writer`'s own: for files several
/// processes rewrite (a node's rollup and figures), so that should their lock not hold (a file
/// system without `flock`) they still never write into each other's temporary file.
pub fn write_atomic_as(path: &Path, bytes: &[u8], writer: u32) -> Result<()> {
    write_through(path, bytes, &format!("{writer}.tmp"))
}

fn write_through(path: &Path, bytes: &[u8], suffix: &str) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{suffix}"));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
