//! The node rollup (issue 42, `obs/SCHEMA.md` "Node rollups"): `RUN/obs/node-<host>.summary`
//! holds the rank summaries (`rank.summary`, [`super::rank_file`]) of every rank of one host,
//! so `summary` and the TUI's whole-run results read one file per node instead of one per rank.
//!
//! Who writes it: every rank's part writer ([`crate::part::PartSink`]), after it rewrote its
//! own `rank.summary`. The ranks of a node share the file, so each replaces its own entry under
//! an exclusive `flock` of `node-<host>.lock` (the ranks of one host write it, so the lock only
//! has to work within one machine — which `flock` does on any file system, Lustre and NFS
//! included) and writes the whole file under a temporary name, renamed into place: a reader
//! never sees half a file, and a rank killed while writing leaves the previous file and a
//! stray temporary. A damaged rollup is rebuilt by the next writer from its own entry (the
//! others' ranks are then read from their `rank.summary` until they write again).
//!
//! Each entry also records the rank folder's mtime after the writer's last change to it. A
//! reader trusts an entry while the folder still has that mtime, the next part does not exist
//! (what the rank's writer adds next: checked by name, so a part written inside the file
//! system's timestamp granularity is still seen; the next journal is read if it is there) and
//! every covered part has the length the entry lists; otherwise it reads the rank as before
//! (its folder listed, `rank.summary` checked against it). So the rollup saves listing the
//! folder and reading `rank.summary`, and never stands for a folder it does not describe.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};

use super::file::{Reader, Writer, check_head, checked_body, framed};

const MAGIC: &[u8; 8] = b"TOBSNOD1";
const VERSION: u32 = 1;
/// magic, version, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 4;
const PREFIX: &str = "node-";
const SUFFIX: &str = ".summary";

/// One rank's entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub rank: u32,
    /// The rank folder's mtime (ns since the epoch) after the writer's last change to it.
    pub dir_mtime_ns: u64,
    /// The last part its summary covers (the next part and journal are `last_part + 1`).
    pub last_part: Option<u64>,
    /// Its `rank.summary`, as encoded ([`super::rank_file::encode`]): decoded only when used.
    pub summary: Arc<Vec<u8>>,
}

/// The rollup's file name for the ranks of `host` (a rank without a host name — a converted
/// run — goes with the ranks of its group of 8).
pub fn file_name(host: &str, rank: u32) -> String {
    let clean: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect();
    if clean.is_empty() || clean.starts_with('.') {
        format!("{PREFIX}group{}{SUFFIX}", rank / 8)
    } else {
        format!("{PREFIX}{clean}{SUFFIX}")
    }
}

/// Whether `name` is a rollup's file name.
pub fn is_rollup_name(name: &str) -> bool {
    name.starts_with(PREFIX) && name.ends_with(SUFFIX) && name.len() > PREFIX.len() + SUFFIX.len()
}

/// A folder's mtime in ns since the epoch.
pub fn mtime_ns(m: &std::fs::Metadata) -> u64 {
    (m.mtime() as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(m.mtime_nsec() as u64)
}

/// A rank folder's metadata when it still is as a writer left it: it has the mtime
/// `dir_mtime_ns` the writer recorded after its last change, and the part after `last_part`
/// is not there (one written within the file system's timestamp granularity leaves the mtime
/// as it was). The check behind trusting a rollup entry and a node's figures.
pub fn unchanged_folder(
    dir: &Path,
    dir_mtime_ns: u64,
    last_part: Option<u64>,
) -> Option<std::fs::Metadata> {
    let m = std::fs::metadata(dir).ok()?;
    let next = last_part.map_or(0, |l| l + 1);
    (mtime_ns(&m) == dir_mtime_ns && !dir.join(crate::location::part_file_name(next)).exists())
        .then_some(m)
}

/// Whether a rank folder is as a node file recorded it (`dir_mtime_ns`, `last_part`): no part
/// after the last, and either the recorded mtime ([`unchanged_folder`]) or, changed since, the
/// journal after the last part (a live rank opens it after it recorded; appending to it
/// leaves the mtime alone). `Some(live)`: as recorded, `live` when that journal is there.
pub fn recorded_folder(dir: &Path, dir_mtime_ns: u64, last_part: Option<u64>) -> Option<bool> {
    let next = last_part.map_or(0, |l| l + 1);
    let live = dir.join(crate::location::journal_file_name(next)).exists();
    let as_recorded = unchanged_folder(dir, dir_mtime_ns, last_part).is_some()
        || (live && !dir.join(crate::location::part_file_name(next)).exists());
    as_recorded.then_some(live)
}

/// Encodes a rollup (entries in rank order).
pub fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(
        entries.iter().map(|e| e.summary.len() + 16).sum(),
    ));
    w.u(entries.len() as u64);
    for e in entries {
        w.u(u64::from(e.rank));
        w.u(e.dir_mtime_ns);
        w.u(e.last_part.map_or(0, |l| l.saturating_add(1)));
        w.bytes(&e.summary);
    }
    framed(MAGIC, VERSION, &w.0)
}

/// Decodes a rollup: every count checked against the bytes there are, ranks unique. The rank
/// summaries inside are checked when decoded (each has its own checksum).
pub fn decode(bytes: &[u8]) -> Result<Vec<Entry>> {
    check_head(bytes, MAGIC, "node rollup", HEADER, VERSION)?;
    let body = checked_body(bytes, HEADER, 12)?;
    let mut r = Reader(body);
    let mut out: Vec<Entry> = Vec::new();
    for _ in 0..r.count(3)? {
        let rank = u32::try_from(r.u()?).context("rank out of range")?;
        ensure!(
            out.last().is_none_or(|l| rank > l.rank),
            "rank {rank} listed out of order"
        );
        let dir_mtime_ns = r.u()?;
        let last_part = r.u()?.checked_sub(1);
        let summary = Arc::new(r.bytes()?.to_vec());
        out.push(Entry {
            rank,
            dir_mtime_ns,
            last_part,
            summary,
        });
    }
    ensure!(r.0.is_empty(), "{} bytes after the last entry", r.0.len());
    Ok(out)
}

/// One rank's change to its node's files ([`update`]).
pub struct RankUpdate<'a> {
    pub rank: u32,
    /// Its folder's mtime now (0 on an object store, whose readers check the next part
    /// instead: [`crate::location::ObjectObs::next_parts_absent`]).
    pub dir_mtime_ns: u64,
    pub last_part: Option<u64>,
    /// Its encoded rank summary.
    pub summary: Vec<u8>,
    /// The summary is new (else only the folder changed since the rank's last update).
    pub summary_changed: bool,
    /// The parts put since the rank's last update, for the node's timeline.
    pub added: &'a [super::timeline::PartTimeline],
}

/// Where an object-store run's node files are published: the ranks of a node keep them in a
/// local folder they share (the spool, under the same lock), and the readers read the copies
/// the store holds beside the rank folders (`obs/node-<host>.figures`, `.timeline`).
pub trait Remote {
    /// The object `obs/<name>`; `None` when there is none.
    fn get(&self, name: &str) -> Result<Option<Vec<u8>>>;
    /// Writes the object `obs/<name>` (one PUT: readers see the old or the new whole).
    fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()>;
}

/// Replaces rank `u.rank`'s entry of the rollup `obs/<name>` with its summary and folder
/// mtime, under the rollup's lock, then the node's figures: rebuilt from every entry when the
/// summary changed, else (the folder changed, not its summary) only this rank's mtime and last
/// part rewritten in them; then the node's timeline, with the parts added since the rank's
/// last update.
///
/// With `remote` (an object-store run; `obs` is then the node's spool folder), the figures and
/// timeline are also PUT to the store while the lock is held, so the store's copies change in
/// the order the node's ranks wrote. A writer's first update (`first`) checks the spool
/// against the store: a spool whose timeline is not the store's (left by another run to the
/// same URL, or the store's copy cleared) is dropped and the store's timeline taken instead,
/// so what a writer publishes never describes parts the store does not hold.
pub fn update(
    obs: &Path,
    name: &str,
    u: RankUpdate<'_>,
    remote: Option<&dyn Remote>,
    first: bool,
) -> Result<()> {
    let path = obs.join(name);
    let lock_path = path.with_extension("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    let _held =
        Flock::exclusive(&lock).with_context(|| format!("locking {}", lock_path.display()))?;
    let figures = super::figures::file_name(name);
    let timeline = super::timeline::file_name(name);
    if let (Some(remote), true) = (remote, first) {
        agree_with_store(obs, name, &figures, &timeline, remote, u.rank)?;
    }
    let mut entries = match crate::sidecar::read_if_present(&path)? {
        None => Vec::new(),
        Some(b) => decode(&b).unwrap_or_else(|e| {
            // Rebuilt from this rank's entry; the other ranks are read from their own
            // folders until they write again.
            tracing::warn!("{} is damaged ({e:#}): rewriting it", path.display());
            Vec::new()
        }),
    };
    let entry = Entry {
        rank: u.rank,
        dir_mtime_ns: u.dir_mtime_ns,
        last_part: u.last_part,
        summary: Arc::new(u.summary),
    };
    match entries.binary_search_by_key(&u.rank, |e| e.rank) {
        Ok(i) => entries[i] = entry,
        Err(i) => entries.insert(i, entry),
    }
    crate::sidecar::write_atomic_as(&path, &encode(&entries), u.rank)?;
    // Without figures a reader summarises the node's ranks from their folders: logged only.
    let restamped = !u.summary_changed
        && super::figures::restamp(obs, &figures, u.rank, u.dir_mtime_ns, u.last_part)
            .unwrap_or(false);
    if !restamped && let Err(e) = write_figures(obs, &figures, u.rank, &entries) {
        tracing::warn!("no node figures written for rank {}: {e:#}", u.rank);
    }
    // Without a timeline the TUI lists the node's rank folders: logged only.
    if let Err(e) = super::timeline::update(obs, &timeline, u.rank, u.dir_mtime_ns, u.added) {
        tracing::warn!("no node timeline written for rank {}: {e:#}", u.rank);
    }
    if let Some(remote) = remote {
        for file in [&figures, &timeline] {
            let published = crate::sidecar::read_if_present(&obs.join(file))
                .and_then(|b| b.map_or(Ok(()), |b| remote.put(file, b)));
            if let Err(e) = published {
                // Readers then read this node's ranks from their rank summaries.
                tracing::warn!("{file} not published for rank {}: {e:#}", u.rank);
            }
        }
    }
    Ok(())
}

/// Makes the node's spool folder `obs` agree with the store: when its timeline is not the
/// store's, its rollup, figures and timeline are removed and the store's timeline (if any)
/// is taken. (The rollup and figures are not kept on the store; the node's other ranks put
/// their entries back as they write, and readers read them from their rank summaries until
/// then.)
fn agree_with_store(
    obs: &Path,
    name: &str,
    figures: &str,
    timeline: &str,
    remote: &dyn Remote,
    rank: u32,
) -> Result<()> {
    let stored = remote.get(timeline)?;
    if crate::sidecar::read_if_present(&obs.join(timeline))? == stored {
        return Ok(());
    }
    for file in [name, figures, timeline] {
        match std::fs::remove_file(obs.join(file)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", obs.join(file).display()));
            }
            _ => {}
        }
    }
    if let Some(b) = stored {
        crate::sidecar::write_atomic_as(&obs.join(timeline), &b, rank)?;
    }
    Ok(())
}

/// Writes the node's figures (`obs/<figures>`, [`super::figures`]) from the rank summaries of
/// its rollup, still under the rollup's lock. An entry that does not decode is left out: its
/// rank is then in no node's figures, and readers read it from its folder.
fn write_figures(obs: &Path, figures: &str, writer: u32, entries: &[Entry]) -> Result<()> {
    let decoded: Vec<(&Entry, super::RankDigest)> = entries
        .iter()
        .filter_map(|e| Some((e, super::rank_file::decode(&e.summary).ok()?)))
        .collect();
    let inputs: Vec<super::figures::RankInput<'_>> = decoded
        .iter()
        .map(|(e, d)| super::figures::RankInput {
            rank: e.rank,
            dir_mtime_ns: e.dir_mtime_ns,
            last_part: e.last_part,
            digest: d,
        })
        .collect();
    super::figures::write_local(obs, figures, writer, &inputs)
}

/// An exclusive `flock` held until dropped (and released by the kernel if the process dies).
struct Flock<'a>(&'a std::fs::File);

impl<'a> Flock<'a> {
    fn exclusive(f: &'a std::fs::File) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd as _;
        loop {
            // SAFETY: flock on a file descriptor this function borrows for the guard's life.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Flock(f));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd as _;
        // SAFETY: as above; closing the file would release it too.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The rollups of a local run, read: each rank's newest entry (a rank whose host changed
/// between launches can be in two; the reader's checks tell which still describes its folder),
/// and the rollups that did not check out, as (file, error).
#[derive(Debug, Default)]
pub struct Rollups {
    pub entries: HashMap<u32, (PathBuf, Entry)>,
    pub damaged: Vec<(String, String)>,
    /// Rollup files read.
    pub files: u64,
}

/// Reads the rollups `names` of the run's `obs` folder, in parallel.
pub fn read_all(obs: &Path, names: &[String]) -> Rollups {
    use rayon::prelude::*;
    let read: Vec<(PathBuf, Result<Vec<Entry>>)> = names
        .par_iter()
        .map(|n| {
            let path = obs.join(n);
            let got = std::fs::read(&path)
                .with_context(|| format!("reading {}", path.display()))
                .and_then(|b| decode(&b));
            (path, got)
        })
        .collect();
    let mut out = Rollups::default();
    for (path, got) in read {
        out.files += 1;
        match got {
            Ok(entries) => {
                for e in entries {
                    match out.entries.get(&e.rank) {
                        Some((_, have)) if have.dir_mtime_ns >= e.dir_mtime_ns => {}
                        _ => {
                            out.entries.insert(e.rank, (path.clone(), e));
                        }
                    }
                }
            }
            // Another version is not damage: its ranks are read from their folders.
            Err(e) if e.is::<super::file::Outdated>() => {}
            Err(e) => out
                .damaged
                .push((path.display().to_string(), format!("{e:#}"))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_damage() {
        let entries = vec![
            Entry {
                rank: 3,
                dir_mtime_ns: 17,
                last_part: None,
                summary: Arc::new(vec![1, 2, 3]),
            },
            Entry {
                rank: 9,
                dir_mtime_ns: u64::MAX,
                last_part: Some(143),
                summary: Arc::new(vec![]),
            },
        ];
        let bytes = encode(&entries);
        let back = decode(&bytes).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!((back[1].rank, back[1].dir_mtime_ns), (9, u64::MAX));
        assert_eq!((back[0].last_part, back[1].last_part), (None, Some(143)));
        assert_eq!(*back[0].summary, vec![1, 2, 3]);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(decode(&b).is_err(), "a flip at byte {i} went unnoticed");
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn names_are_safe_file_names() {
        assert_eq!(file_name("gpu-node-17", 5), "node-gpu-node-17.summary");
        assert_eq!(file_name("a/../b c", 5), "node-a_.._b_c.summary");
        assert_eq!(file_name("", 17), "node-group2.summary");
        assert_eq!(file_name("..", 17), "node-group2.summary");
        assert!(is_rollup_name(&file_name("h", 0)));
        assert!(!is_rollup_name("node-.summary"));
        assert!(!is_rollup_name("rank.summary"));
    }
}
