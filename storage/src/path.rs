//! Names that come from untrusted files (index files, checkpoint metadata, run listings) must
//! stay inside the directory they were found in.

use std::path::{Component, Path};

use crate::error::{Result, StorageError};

/// Checks that `name` (from an index file, metadata or a mapping named `origin`) is a relative
/// path that stays inside its root: no absolute paths, no `..`, no empty components.
pub fn check_relative(name: &str, origin: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(StorageError::invalid(
            origin,
            format!(
                "path `{name}` {why}; it must be a relative path inside the checkpoint or run directory"
            ),
        ))
    };
    if name.is_empty() {
        return bad("is empty");
    }
    if name.contains('\0') || name.contains('\\') {
        return bad("contains a NUL byte or backslash");
    }
    if name.starts_with('/') || Path::new(name).is_absolute() {
        return bad("is absolute");
    }
    for c in Path::new(name).components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return bad("leaves its directory (`..`)"),
            _ => return bad("is not a plain relative path"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_must_stay_inside() {
        assert!(check_relative("model-00001-of-00002.safetensors", "idx").is_ok());
        assert!(check_relative("sub/x.safetensors", "idx").is_ok());
        for bad in [
            "../x.safetensors",
            "/etc/passwd",
            "a/../../b",
            "",
            "a\\..\\b",
        ] {
            let err = check_relative(bad, "index.json").unwrap_err().to_string();
            assert!(err.contains("index.json"), "{err}");
        }
    }
}
