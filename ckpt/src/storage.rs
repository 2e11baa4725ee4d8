//! Where checkpoint bytes live: titan-storage's [`Root`] (a local directory or an object store
//! prefix) plus [`Location`], what a command-line argument names: a directory, or one file in it.

pub use titan_storage::{InFile, OutFile, Root, check_relative};

use crate::error::Result;

/// A location given on the command line: a root plus, when it named one file, that file.
#[derive(Debug, Clone)]
pub struct Location {
    pub root: Root,
    pub file: Option<String>,
}

impl Location {
    /// Parses a local path or a `s3://`, `gs://`, `az://`, `memory://`, `file://` URL. A path
    /// naming a file (locally: an existing file; on object stores: a name ending in
    /// `.safetensors`, `.json` or `.distcp`, or `.metadata`) becomes its parent root plus the
    /// file name (DCP files only to be refused by name, with their folder to pass instead).
    pub fn parse(s: &str) -> Result<Location> {
        let root = Root::parse(s)?;
        let is_file = |n: &str| {
            n.ends_with(".safetensors")
                || n.ends_with(".json")
                || n.ends_with(".distcp")
                || n == ".metadata"
        };
        Ok(match root.split_file(is_file) {
            Some((root, file)) => Location {
                root,
                file: Some(file),
            },
            None => Location { root, file: None },
        })
    }
}
