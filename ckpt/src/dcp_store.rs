//! The DCP reader's storage: [`RootStore`] lets `titan_dcp::DcpReader` read through a
//! titan-storage [`Root`] (local or object store), and [`DcpHandle`] is the shared reader a
//! checkpoint plan keeps to decode transformed items.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex};

use titan_dcp::{CheckpointStore, DcpReader};

use crate::error::Result;
use crate::storage::{InFile, Root};

/// The DCP reader's view of a [`Root`] (local or object store), with opened files cached.
pub struct RootStore {
    root: Root,
    open: Mutex<HashMap<String, Arc<InFile>>>,
}

impl RootStore {
    pub fn new(root: Root) -> RootStore {
        RootStore {
            root,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, rel: &str) -> io::Result<Arc<InFile>> {
        let mut open = self.open.lock().expect("file cache lock");
        if let Some(f) = open.get(rel) {
            return Ok(f.clone());
        }
        let f = Arc::new(self.root.open(rel).map_err(to_io)?);
        open.insert(rel.to_string(), f.clone());
        Ok(f)
    }
}

fn to_io(e: titan_storage::StorageError) -> io::Error {
    match e {
        titan_storage::StorageError::Io { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

impl CheckpointStore for RootStore {
    fn describe(&self, relative_path: &str) -> String {
        self.root.display_file(relative_path)
    }

    fn file_len(&self, relative_path: &str) -> io::Result<u64> {
        Ok(self.file(relative_path)?.size)
    }

    fn read_range(&self, relative_path: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let f = self.file(relative_path)?;
        if offset.checked_add(len).is_none_or(|e| e > f.size) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "range {offset}+{len} is past the end ({} bytes): truncated",
                    f.size
                ),
            ));
        }
        let mut buf = vec![0u8; len as usize];
        f.read_at(offset, &mut buf).map_err(to_io)?;
        Ok(buf)
    }
}

/// A shared DCP native reader over a plan's storage.
#[derive(Clone)]
pub struct DcpHandle(pub Arc<DcpReader<RootStore>>);

impl fmt::Debug for DcpHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DcpReader")
    }
}

impl DcpHandle {
    /// Decodes chunk `chunk` of `fqn` into its C-order little-endian bytes.
    pub fn decode_chunk(&self, fqn: &str, chunk: usize) -> Result<Vec<u8>> {
        Ok(self.0.read_chunk(fqn, chunk)?.data)
    }
}
