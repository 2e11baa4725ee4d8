//! Files inside a [`Root`](crate::Root): [`InFile`] for ranged reads, [`OutFile`] for writes that
//! appear only when complete.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use object_store::ObjectStore;
use object_store::ObjectStoreExt;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjPath;
use tokio::io::AsyncWriteExt;

use crate::block_cache;
use crate::error::{Result, StorageError};
use crate::runtime;

/// A file opened for ranged reads (`pread` locally, ranged GETs on object stores).
pub struct InFile {
    /// How to name this file in messages (full path or URL).
    pub name: String,
    pub size: u64,
    kind: InKind,
}

enum InKind {
    Local(File),
    Object {
        store: Arc<dyn ObjectStore>,
        path: ObjPath,
        /// The file's blocks in [`block_cache`].
        id: u64,
        /// The last read, to tell a run of nearby small reads from isolated ones.
        recent: Mutex<Recent>,
    },
}

/// Where the last read of an object-store file was, and how many reads in a row landed within
/// [`block_cache::SMALL_READ`] of the one before.
#[derive(Default)]
struct Recent {
    start: u64,
    end: u64,
    nearby: u32,
}

impl Recent {
    /// Records a read of `start..end`; whether it is the third or later of a run of reads each
    /// near the one before (then whole blocks are worth fetching; a large item's directory and
    /// the next item's head, read one after the other, are only two).
    fn in_run(&mut self, start: u64, end: u64) -> bool {
        let near = start + block_cache::SMALL_READ >= self.start
            && start <= self.end + block_cache::SMALL_READ;
        self.nearby = if near { self.nearby + 1 } else { 0 };
        (self.start, self.end) = (start, end);
        self.nearby >= 2
    }
}

impl InFile {
    pub(crate) fn local(name: String, file: File) -> Result<InFile> {
        let size = file
            .metadata()
            .map_err(|e| StorageError::io(&name, e))?
            .len();
        Ok(InFile {
            name,
            size,
            kind: InKind::Local(file),
        })
    }

    pub(crate) fn object(
        name: String,
        size: u64,
        store: Arc<dyn ObjectStore>,
        path: ObjPath,
    ) -> InFile {
        InFile {
            name,
            size,
            kind: InKind::Object {
                store,
                path,
                id: block_cache::next_file_id(),
                recent: Mutex::new(Recent::default()),
            },
        }
    }

    /// Reads exactly `buf.len()` bytes at `offset`; a range past the end is a "truncated" error.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.size {
            return Err(StorageError::invalid(
                &self.name,
                format!(
                    "truncated: needs bytes up to {end} but the file has {}",
                    self.size
                ),
            ));
        }
        if buf.is_empty() {
            return Ok(());
        }
        match &self.kind {
            InKind::Local(f) => f
                .read_exact_at(buf, offset)
                .map_err(|e| StorageError::io(&self.name, e)),
            InKind::Object {
                store,
                path,
                id,
                recent,
            } => {
                let get = |range: std::ops::Range<u64>| {
                    let want = range.end - range.start;
                    let bytes = runtime()
                        .block_on(store.get_range(path, range.clone()))
                        .map_err(|e| StorageError::store(&self.name, e))?;
                    if bytes.len() as u64 != want {
                        return Err(StorageError::invalid(
                            &self.name,
                            format!(
                                "short read: asked {want} bytes at {}, got {}",
                                range.start,
                                bytes.len()
                            ),
                        ));
                    }
                    Ok(bytes)
                };
                let in_run = recent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .in_run(offset, end);
                // A small read comes from the one or two blocks holding it when they are cached,
                // or worth fetching in a run; otherwise it is read as it is.
                let mut blocks = Vec::new();
                if (buf.len() as u64) < block_cache::SMALL_READ {
                    for index in offset / block_cache::BLOCK..=(end - 1) / block_cache::BLOCK {
                        let start = index * block_cache::BLOCK;
                        let block = match block_cache::cached(*id, index) {
                            Some(b) => b,
                            None if in_run => {
                                let b = get(start..(start + block_cache::BLOCK).min(self.size))?;
                                block_cache::insert(*id, index, b.clone());
                                b
                            }
                            None => {
                                blocks.clear();
                                break;
                            }
                        };
                        blocks.push((start, block));
                    }
                }
                if blocks.is_empty() {
                    buf.copy_from_slice(&get(offset..end)?);
                    return Ok(());
                }
                for (start, block) in blocks {
                    let from = offset.max(start);
                    let upto = end.min(start + block.len() as u64);
                    buf[(from - offset) as usize..(upto - offset) as usize]
                        .copy_from_slice(&block[(from - start) as usize..(upto - start) as usize]);
                }
                Ok(())
            }
        }
    }

    /// The descriptor of a local file (for `copy_file_range`), None on object stores.
    pub fn local_fd(&self) -> Option<RawFd> {
        match &self.kind {
            InKind::Local(f) => Some(f.as_raw_fd()),
            InKind::Object { .. } => None,
        }
    }
}

impl Drop for InFile {
    fn drop(&mut self) {
        if let InKind::Object { id, .. } = self.kind {
            block_cache::forget(id);
        }
    }
}

/// An output file that appears under its name only when [`OutFile::finish`] succeeds; dropped
/// unfinished, it leaves nothing behind.
pub struct OutFile {
    /// How to name this file in messages (full path or URL).
    pub name: String,
    kind: OutKind,
    done: bool,
}

enum OutKind {
    Local {
        file: File,
        tmp: PathBuf,
        dest: PathBuf,
    },
    Object(Mutex<ObjWriter>),
}

struct ObjWriter {
    writer: BufWriter,
    pos: u64,
}

impl OutFile {
    pub(crate) fn local(name: String, dest: PathBuf, size: Option<u64>) -> Result<OutFile> {
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| StorageError::io(parent.display(), e))?;
        }
        let file_name = dest
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let tmp = dest.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(|e| StorageError::io(tmp.display(), e))?;
        if let Some(n) = size {
            file.set_len(n)
                .map_err(|e| StorageError::io(tmp.display(), e))?;
        }
        Ok(OutFile {
            name,
            kind: OutKind::Local { file, tmp, dest },
            done: false,
        })
    }

    pub(crate) fn object(name: String, writer: BufWriter) -> OutFile {
        OutFile {
            name,
            kind: OutKind::Object(Mutex::new(ObjWriter { writer, pos: 0 })),
            done: false,
        }
    }

    /// Writes `data` at `offset`. Local files take positional writes in any order from any thread;
    /// object store uploads are sequential, so there `offset` must be where the last write ended.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &self.kind {
            OutKind::Local { file, .. } => file
                .write_all_at(data, offset)
                .map_err(|e| StorageError::io(&self.name, e)),
            OutKind::Object(w) => {
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                if offset != w.pos {
                    return Err(StorageError::invalid(
                        &self.name,
                        format!(
                            "internal: object store writes must be sequential (at {}, asked {offset})",
                            w.pos
                        ),
                    ));
                }
                runtime()
                    .block_on(w.writer.write_all(data))
                    .map_err(|e| StorageError::io(&self.name, e))?;
                w.pos += data.len() as u64;
                Ok(())
            }
        }
    }

    /// Whether positional writes may come in any order (local files).
    pub fn is_positional(&self) -> bool {
        matches!(self.kind, OutKind::Local { .. })
    }

    /// The descriptor of a local file (for `copy_file_range`), None on object stores.
    pub fn local_fd(&self) -> Option<RawFd> {
        match &self.kind {
            OutKind::Local { file, .. } => Some(file.as_raw_fd()),
            OutKind::Object(_) => None,
        }
    }

    /// Makes the file appear under its final name (fsync + rename / complete the upload).
    pub fn finish(mut self) -> Result<()> {
        match &mut self.kind {
            OutKind::Local { file, tmp, dest } => {
                file.sync_data()
                    .map_err(|e| StorageError::io(tmp.display(), e))?;
                std::fs::rename(&*tmp, &*dest).map_err(|e| StorageError::io(dest.display(), e))?;
            }
            OutKind::Object(w) => {
                let w = w.get_mut().unwrap_or_else(|e| e.into_inner());
                runtime()
                    .block_on(w.writer.shutdown())
                    .map_err(|e| StorageError::io(&self.name, e))?;
            }
        }
        self.done = true;
        Ok(())
    }
}

impl Drop for OutFile {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        match &mut self.kind {
            OutKind::Local { tmp, .. } => {
                let _ = std::fs::remove_file(&*tmp);
            }
            OutKind::Object(w) => {
                if let Ok(w) = w.get_mut() {
                    let _ = runtime().block_on(w.writer.abort());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::InKind;
    use crate::Root;

    #[test]
    fn unfinished_output_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::local(dir.path());
        let f = root.create("a.bin", Some(4)).unwrap();
        f.write_at(0, b"abcd").unwrap();
        drop(f);
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        let f = root.create("a.bin", Some(4)).unwrap();
        f.write_at(2, b"cd").unwrap();
        f.write_at(0, b"ab").unwrap();
        f.finish().unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), b"abcd");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn reads_past_the_end_are_truncation_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"0123").unwrap();
        let f = Root::local(dir.path()).open("f").unwrap();
        let mut buf = [0u8; 3];
        f.read_at(1, &mut buf).unwrap();
        assert_eq!(&buf, b"123");
        let err = f.read_at(2, &mut buf).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }

    #[test]
    fn object_uploads_appear_only_when_finished() {
        let root = Root::parse("memory://out-test/ckpt").unwrap();
        let f = root.create("big.bin", None).unwrap();
        f.write_at(0, b"ab").unwrap();
        assert!(f.write_at(5, b"x").is_err(), "non-sequential object write");
        drop(f);
        assert_eq!(root.size_of("big.bin").unwrap(), None);
        let f = root.create("big.bin", None).unwrap();
        f.write_at(0, b"ab").unwrap();
        f.write_at(2, b"cd").unwrap();
        f.finish().unwrap();
        assert_eq!(root.read_small("big.bin", 4).unwrap(), b"abcd");
    }

    #[test]
    fn small_object_reads_in_a_run_come_from_cached_blocks_isolated_ones_stay_exact() {
        use crate::block_cache::{BLOCK, cached_blocks};
        let root = Root::parse("memory://block-test/ckpt").unwrap();
        let len = 2 * BLOCK + 12_345;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let f = root.create("data.distcp", None).unwrap();
        f.write_at(0, &data).unwrap();
        f.finish().unwrap();
        let f = root.open("data.distcp").unwrap();
        let InKind::Object { id, .. } = f.kind else {
            panic!("memory:// is an object store")
        };
        let read = |offset: u64, n: usize| {
            let mut buf = vec![0u8; n];
            f.read_at(offset, &mut buf).unwrap();
            assert_eq!(
                buf,
                &data[offset as usize..offset as usize + n],
                "at {offset}+{n}"
            );
        };
        // Isolated small reads far apart (a scan of large items' heads and directories): exact.
        read(BLOCK + 500, 4096);
        read(2 * BLOCK + 12_000, 345);
        read(100, 300);
        assert_eq!(cached_blocks(id), 0, "isolated reads fetch no block");
        // A run of reads each near the one before (a load of small items): the third in a row
        // fetches the blocks it touches (here both sides of the edge), later ones come from them.
        // (Two in a row do not: a large item's directory and the next item's head are neighbours.)
        read(BLOCK - 5000, 1000);
        read(BLOCK - 3000, 1000);
        assert_eq!(cached_blocks(id), 0, "two nearby reads are not a run yet");
        read(BLOCK - 100, 300);
        assert_eq!(
            cached_blocks(id),
            2,
            "the run's third read fetched blocks 0 and 1"
        );
        read(BLOCK + 500, 50_000);
        // Cached blocks serve a later isolated read too; a large read goes to the store as it is.
        read(200, 20);
        read(3, (BLOCK + 5) as usize);
        assert_eq!(cached_blocks(id), 2);
        let mut buf = [0u8; 8];
        let err = f.read_at(len - 4, &mut buf).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        drop(f);
        assert_eq!(cached_blocks(id), 0, "a closed file's blocks are dropped");
    }
}
