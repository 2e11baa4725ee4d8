//! Names that come from untrusted files (index files, checkpoint metadata, run listings) must
//! stay inside the directory they were found in. This is the one rule for that, used by
//! titan-storage's [`crate::Root`], titan-dcp's reader and titan-ckpt.

use std::path::{Component, Path};

use crate::error::{Result, StorageError};

/// Why `name` is not a plain relative path that stays inside its root, or `None` when it is.
/// Refused: the empty name, NUL, `\` and `:` (a Windows separator, drive or stream), absolute
/// paths, `..`, and empty or `.` components (`a//b`, `./x`, `x/`), which name the same file
/// twice.
pub fn relative_path_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("is empty");
    }
    if name.contains(['\0', '\\', ':']) {
        return Some("contains a NUL byte, `\\` or `:`");
    }
    if name.starts_with('/') || Path::new(name).is_absolute() {
        return Some("is absolute");
    }
    let parts = || name.split('/');
    if parts().any(|c| c == "..") {
        return Some("leaves its directory (`..`)");
    }
    if parts().any(|c| c.is_empty() || c == ".") {
        return Some("has an empty or `.` component");
    }
    if Path::new(name)
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Some("is not a plain relative path");
    }
    None
}

/// Checks that `name` (from an index file, metadata or a mapping named `origin`) passes
/// [`relative_path_problem`].
pub fn check_relative(name: &str, origin: &str) -> Result<()> {
    match relative_path_problem(name) {
        None => Ok(()),
        Some(why) => Err(StorageError::invalid(
            origin,
            format!(
                "path `{name}` {why}; it must be a relative path inside the checkpoint or run directory"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_must_stay_inside() {
        for ok in [
            "model-00001-of-00002.safetensors",
            "sub/x.safetensors",
            "__0_0.distcp",
            "sub/__1_0.distcp",
            "a.b/.hidden",
        ] {
            assert_eq!(relative_path_problem(ok), None, "{ok}");
            assert!(check_relative(ok, "idx").is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("/etc/passwd", "absolute"),
            ("../x.safetensors", "leaves"),
            ("a/../../b", "leaves"),
            ("./x", "`.` component"),
            ("a/./b", "`.` component"),
            ("a//b", "empty"),
            ("x/", "empty"),
            ("C:\\x", "`:`"),
            ("c:x", "`:`"),
            ("a\\..\\b", "`\\`"),
            ("a\0b", "NUL"),
        ] {
            let problem = relative_path_problem(bad).unwrap_or_else(|| panic!("{bad:?} passed"));
            assert!(problem.contains(why), "{bad:?}: {problem}");
            let err = check_relative(bad, "index.json").unwrap_err().to_string();
            assert!(err.contains("index.json") && err.contains(problem), "{err}");
        }
    }
}
