//! Small reads from object stores served from whole blocks, when the reads come in a run.
//!
//! Loading a DCP checkpoint makes several small reads per tensor item (a torch.save zip's head
//! and directory, then the data), in file order. As ranged GETs that is thousands of requests for
//! a checkpoint of a few hundred small tensors, each paying the store's latency (and, on some
//! servers, a read of the whole object). Once small reads land near each other (see
//! `InFile::read_at`), a read shorter than [`SMALL_READ`] is served from the aligned
//! [`BLOCK`]-byte block holding it, fetched once; isolated small reads (the heads and directories
//! of large items, read apart) stay exact, so scanning a large checkpoint's items does not fetch a
//! block per item. The blocks of every open file share one least-recently-used budget of
//! [`BUDGET`] bytes in the process, so memory stays bounded however many files a reader opens.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

/// The size of a cached block (the last block of a file is shorter).
pub(crate) const BLOCK: u64 = 8 << 20;
/// Reads shorter than this go through the cache.
pub(crate) const SMALL_READ: u64 = 1 << 20;
/// Bytes of blocks kept in the process, over all files.
pub(crate) const BUDGET: u64 = 64 << 20;

/// A process-unique id for a file's blocks (its entries are dropped with the file).
pub(crate) fn next_file_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Cached blocks, most recently used last.
struct Cache {
    blocks: VecDeque<((u64, u64), Bytes)>,
    bytes: u64,
}

static CACHE: Mutex<Cache> = Mutex::new(Cache {
    blocks: VecDeque::new(),
    bytes: 0,
});

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Block `index` of file `file` if it is cached (and now the most recently used).
pub(crate) fn cached(file: u64, index: u64) -> Option<Bytes> {
    let mut c = cache();
    let pos = c.blocks.iter().position(|(k, _)| *k == (file, index))?;
    let entry = c.blocks.remove(pos)?;
    let data = entry.1.clone();
    c.blocks.push_back(entry);
    Some(data)
}

/// Keeps block `index` of file `file`, dropping the least recently used blocks over the budget.
/// (Two readers of one missing block may both fetch it; the second copy is not kept.)
pub(crate) fn insert(file: u64, index: u64, data: Bytes) {
    let mut c = cache();
    if c.blocks.iter().any(|(k, _)| *k == (file, index)) {
        return;
    }
    c.bytes += data.len() as u64;
    c.blocks.push_back(((file, index), data));
    while c.bytes > BUDGET
        && let Some((_, old)) = c.blocks.pop_front()
    {
        c.bytes -= old.len() as u64;
    }
}

/// Forgets the blocks of a file that is being closed.
pub(crate) fn forget(file: u64) {
    let mut c = cache();
    let freed: u64 = c
        .blocks
        .iter()
        .filter(|((f, _), _)| *f == file)
        .map(|(_, data)| data.len() as u64)
        .sum();
    c.blocks.retain(|((f, _), _)| *f != file);
    c.bytes -= freed;
}

/// How many blocks of `file` are cached (for tests).
#[cfg(test)]
pub(crate) fn cached_blocks(file: u64) -> usize {
    cache()
        .blocks
        .iter()
        .filter(|((f, _), _)| *f == file)
        .count()
}
