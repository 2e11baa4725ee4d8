//! Helpers for titan's end-to-end tests: where the built binaries and the test Python live.
//!
//! The tests run the real binaries (`cargo build --workspace --bins` first; `scripts/test.sh`
//! does) and the Python from `.venv` that `scripts/setup.sh` creates.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (the folder holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives inside the workspace")
        .to_path_buf()
}

/// Path of a workspace binary built into the same target directory as this test.
///
/// Panics with an actionable message when it has not been built.
pub fn bin(name: &str) -> PathBuf {
    // Test executables live in <target>/<profile>/deps; binaries in <target>/<profile>.
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test binary is inside <target>/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run `cargo build --workspace --bins` first (scripts/test.sh does)",
        path.display()
    );
    path
}

/// The Python interpreter of `.venv` (with torch, safetensors, transformers, pyarrow).
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("TITAN_PYTHON") {
        return PathBuf::from(p);
    }
    let p = workspace_root().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing; run scripts/setup.sh first",
        p.display()
    );
    p
}

/// A `Command` for the `.venv` Python running `script` (a path relative to the workspace root).
pub fn python_script(script: &str) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(workspace_root().join(script));
    cmd
}
