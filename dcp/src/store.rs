//! Where a checkpoint's files live: the seam for plugging in object stores.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use super::source::ReadAt;

/// Read access to the files of one checkpoint directory, by path relative to it.
///
/// [`LocalDir`] reads a local folder; an object-store implementation maps `relative_path` to a
/// key under the checkpoint prefix and `read_range` to a ranged GET. Paths given to these
/// methods have already passed [`titan_storage::relative_path_problem`].
pub trait CheckpointStore {
    /// How `relative_path` is named in messages (a path or URL).
    fn describe(&self, relative_path: &str) -> String;
    /// The length of a file.
    fn file_len(&self, relative_path: &str) -> io::Result<u64>;
    /// Bytes `offset .. offset + len` of a file; a short file is an `UnexpectedEof` error.
    fn read_range(&self, relative_path: &str, offset: u64, len: u64) -> io::Result<Vec<u8>>;
}

/// A checkpoint directory on a local (or mounted) file system.
#[derive(Debug, Clone)]
pub struct LocalDir {
    root: PathBuf,
}

impl LocalDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalDir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn path(&self, relative_path: &str) -> PathBuf {
        self.root.join(relative_path)
    }
}

impl CheckpointStore for LocalDir {
    fn describe(&self, relative_path: &str) -> String {
        self.path(relative_path).display().to_string()
    }

    fn file_len(&self, relative_path: &str) -> io::Result<u64> {
        Ok(std::fs::metadata(self.path(relative_path))?.len())
    }

    fn read_range(&self, relative_path: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let file = File::open(self.path(relative_path))?;
        file.read_vec(offset, len)
    }
}

/// A byte range of a store's file, readable at any offset (small reads for zip directories).
pub struct StoreSlice<'a, S: CheckpointStore + ?Sized> {
    pub store: &'a S,
    pub relative_path: &'a str,
    pub start: u64,
    pub len: u64,
}

impl<S: CheckpointStore + ?Sized> ReadAt for StoreSlice<'_, S> {
    fn size(&self) -> u64 {
        self.len
    }

    /// One store read straight into the returned buffer (no bounce copy for large data).
    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the item",
            ));
        }
        self.store
            .read_range(self.relative_path, self.start + offset, len)
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the item",
            ));
        }
        let data =
            self.store
                .read_range(self.relative_path, self.start + offset, buf.len() as u64)?;
        buf.copy_from_slice(&data);
        Ok(())
    }
}

/// A [`StoreSlice`] whose first and last bytes are fetched once up front: a torch.save zip keeps
/// its small records before the tensor data and its directory after it, so parsing an item
/// costs two reads (two ranged GETs on an object store) instead of a dozen.
pub struct PrefetchedSlice<'a, S: CheckpointStore + ?Sized> {
    inner: StoreSlice<'a, S>,
    head: Vec<u8>,
    tail: Vec<u8>,
    tail_start: u64,
}

impl<'a, S: CheckpointStore + ?Sized> PrefetchedSlice<'a, S> {
    pub const HEAD: u64 = 4096;
    pub const TAIL: u64 = 22 + 0xFFFF + 4096;

    pub fn new(inner: StoreSlice<'a, S>) -> io::Result<Self> {
        let head_len = inner.len.min(Self::HEAD);
        let head = inner
            .store
            .read_range(inner.relative_path, inner.start, head_len)?;
        let tail_start = inner.len.saturating_sub(Self::TAIL).max(head_len);
        let tail = inner.store.read_range(
            inner.relative_path,
            inner.start + tail_start,
            inner.len - tail_start,
        )?;
        Ok(PrefetchedSlice {
            inner,
            head,
            tail,
            tail_start,
        })
    }
}

impl<S: CheckpointStore + ?Sized> ReadAt for PrefetchedSlice<'_, S> {
    fn size(&self) -> u64 {
        self.inner.len
    }

    fn read_vec(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let end = offset.saturating_add(len);
        if end <= self.head.len() as u64 || offset >= self.tail_start {
            let mut buf = vec![0u8; usize::try_from(len).map_err(io::Error::other)?];
            self.read_exact_at(offset, &mut buf)?;
            Ok(buf)
        } else {
            self.inner.read_vec(offset, len)
        }
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.inner.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the item",
            ));
        }
        let end = end.expect("checked");
        if end <= self.head.len() as u64 {
            buf.copy_from_slice(&self.head[offset as usize..end as usize]);
        } else if offset >= self.tail_start {
            let at = (offset - self.tail_start) as usize;
            buf.copy_from_slice(&self.tail[at..at + buf.len()]);
        } else {
            self.inner.read_exact_at(offset, buf)?;
        }
        Ok(())
    }
}
