//! Reading a titan run and keeping it open: [`PartsReader`] remembers every file it has read
//! (parts: done; journals: byte offset and batches) and on each [`PartsReader::refresh`]
//! decodes only what is new — new parts, and the bytes appended to open journals. A journal
//! that got compacted into its part is not read twice: the part's first rows (those the
//! journal already gave) are skipped.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use object_store::ObjectStoreExt as _;
use rayon::prelude::*;

use crate::decode::{decode_journal, decode_part};
use crate::journal::JournalCursor;
use crate::journal::checks_path;
use crate::location::{
    Location, parse_journal_file_name, parse_part_file_name, parse_rank_dir_name,
};
use crate::run::{CorruptPart, Damage, Merger, PartRead, ReadOptions, Run, RunFormat};
use crate::tables::PartData;

/// What was read: by one refresh ([`PartsReader::last`]) or in total ([`PartsReader::total`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadCounters {
    /// Parquet parts decoded (each at most once).
    pub parts_decoded: u64,
    /// Rows of parts skipped because their journal had already been read.
    pub part_rows_skipped: u64,
    /// Journal record batches decoded.
    pub journal_batches: u64,
    /// File bytes read (whole parts, appended journal bytes).
    pub bytes: u64,
    /// Records decoded.
    pub rows: u64,
    /// Node rollups read (`obs/node-<host>.summary`, [`crate::digest::node`]).
    pub rollups_read: u64,
    /// Ranks whose summary came from a node rollup (their folders stat'ed, not listed).
    pub ranks_rolled_up: u64,
    /// Object stores: the requests made, GETs and LIST pages (a LIST answers with at most
    /// 1 000 objects per request, S3's page size: counted as objects listed / 1 000, rounded
    /// up).
    pub requests: u64,
}

impl ReadCounters {
    fn add(&mut self, o: &ReadCounters) {
        self.parts_decoded += o.parts_decoded;
        self.part_rows_skipped += o.part_rows_skipped;
        self.journal_batches += o.journal_batches;
        self.bytes += o.bytes;
        self.rows += o.rows;
        self.rollups_read += o.rollups_read;
        self.ranks_rolled_up += o.ranks_rolled_up;
        self.requests += o.requests;
    }
}

/// What kind of file of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum FileKind {
    Part,
    Journal,
}

/// One listed file of a rank.
#[derive(Debug, Clone)]
struct Listed {
    rank: u32,
    index: u64,
    kind: FileKind,
    size: u64,
    /// Local path or URL, for messages (and the local path to read).
    display: String,
    object_path: Option<object_store::path::Path>,
}

struct Listing {
    rank_dirs: BTreeSet<u32>,
    files: Vec<Listed>,
    /// Local rank folders whose parts were listed by name only (not stat'ed here): their
    /// folder and part indices, summarised from the rank summary ([`Work::Rank`], which
    /// checks the covered parts' lengths).
    named_parts: BTreeMap<u32, (PathBuf, BTreeSet<u64>)>,
    /// Local rank folders that a node rollup still describes: their folder and entry (their
    /// journal, if any, is in `files`).
    rolled: BTreeMap<u32, (PathBuf, Rolled)>,
    /// Node rollups read, and those that did not check out (file, error).
    rollups_read: u64,
    /// Object stores: LIST requests (pages of 1 000 objects).
    list_requests: u64,
    /// Object stores: each rank's `rank.summary` object (its path and size).
    object_rank_summaries: BTreeMap<u32, (object_store::path::Path, u64)>,
    rollup_damage: Vec<(String, String)>,
    /// Local rank directories read (the others were unchanged since their last listing).
    dirs_read: u64,
}

/// Most bytes (by [`Work::weight`]) one chunk of a refresh reads once it holds a few items
/// per thread, and most items.
const CHUNK_BYTES: u64 = 8 << 20;
const CHUNK_MAX: usize = 4096;

/// What is known about (rank, part index).
enum Seen {
    /// The part was decoded (or found corrupt): never read again.
    Part,
    /// The journal was read up to its cursor.
    Journal {
        cursor: Box<JournalCursor>,
        display: String,
    },
    /// The journal could not be decoded (reported once); its part is still read in full.
    BadJournal,
}

/// How long a rank directory must have been unchanged before a listing of it is trusted while
/// its mtime stays the same (file timestamps come from a coarse clock; see
/// [`RankDirListing::still_valid`]).
const LISTING_QUIET: std::time::Duration = std::time::Duration::from_secs(1);

/// What the last listing of one local rank directory found, to skip reading the directory
/// again while it has not changed.
struct RankDirListing {
    /// The directory's mtime when listed. Adding, renaming or removing a file changes it;
    /// appending to a journal does not (journals are stat'ed on every refresh).
    mtime: std::time::SystemTime,
    /// When the listing started.
    listed_at: std::time::SystemTime,
    /// The parts and journals (name, kind, index) that were not yet known when listed.
    pending: Vec<(String, FileKind, u64)>,
}

impl RankDirListing {
    /// Whether a directory now at `mtime` still holds what this listing found. File
    /// timestamps come from a coarse clock (a few ms), so a change right after a listing can
    /// keep the mtime it saw: a listing is only trusted when the directory had been quiet for
    /// [`LISTING_QUIET`] before it.
    fn still_valid(&self, mtime: std::time::SystemTime) -> bool {
        mtime == self.mtime
            && self
                .listed_at
                .duration_since(self.mtime)
                .is_ok_and(|quiet| quiet > LISTING_QUIET)
    }
}

/// A titan run kept open for incremental reading.
pub struct PartsReader {
    location: Location,
    /// Local runs: the last listing of each rank directory.
    rank_dir_listings: HashMap<u32, RankDirListing>,
    run: Run,
    merger: Merger,
    seen: HashMap<(u32, u64), Seen>,
    rank_dirs: BTreeSet<u32>,
    ok_ranks: BTreeSet<u32>,
    world_size: u32,
    last: ReadCounters,
    total: ReadCounters,
    /// Local rank directories the last refresh read.
    last_dirs_read: u64,
    /// Ranks with a file in `seen`: the others are read whole from their rank summary when
    /// reading summaries.
    ranks_read: std::collections::HashSet<u32>,
}

/// One file's work in a refresh.
enum Work {
    Part {
        file: Listed,
        skip_rows: u64,
    },
    Journal {
        file: Listed,
        cursor: Box<JournalCursor>,
    },
    /// With [`ReadOptions::digests`], a local rank read for the first time: every part of it
    /// from its rank summary, brought up to date (see [`crate::digest::summarise_rank`]).
    Rank {
        rank: u32,
        dir: PathBuf,
        parts: BTreeSet<u64>,
        /// The rank's entry of a node rollup, which still describes its folder: used instead
        /// of `rank.summary` and the folder's listing (`parts` is then empty).
        rolled: Option<Rolled>,
    },
}

/// A rank's entry of a node rollup: the rollup file (for messages) and the entry.
#[derive(Clone)]
struct Rolled {
    file: PathBuf,
    entry: crate::digest::node::Entry,
}

impl Work {
    /// The file read; `None` for a rank summarised.
    fn file(&self) -> Option<&Listed> {
        match self {
            Work::Part { file, .. } | Work::Journal { file, .. } => Some(file),
            Work::Rank { .. } => None,
        }
    }

    /// The rank, and whether this is a whole rank's summary (merged before its files).
    fn order(&self) -> (u32, bool) {
        match self {
            Work::Part { file, .. } | Work::Journal { file, .. } => (file.rank, true),
            Work::Rank { rank, .. } => (*rank, false),
        }
    }

    /// About how many bytes reading it brings into memory (for chunking).
    fn weight(&self) -> u64 {
        match self {
            Work::Part { file, .. } => file.size,
            Work::Journal { file, cursor } => file.size.saturating_sub(cursor.offset),
            // A rank's merged summary, decoded: a day-long rank's is a few MB.
            Work::Rank { .. } => 4 << 20,
        }
    }

    /// Files this work stands for (for progress).
    fn files(&self) -> u64 {
        match self {
            Work::Rank { parts, rolled, .. } => rolled
                .as_ref()
                .and_then(|r| r.entry.last_part)
                .map_or(parts.len() as u64, |l| l + 1),
            _ => 1,
        }
    }
}

enum Done {
    Part {
        file: Listed,
        skip_rows: u64,
        result: Result<(PartRead, u64)>,
        /// A damaged summary file of the part, ignored: (file, error).
        digest_damage: Option<(String, String)>,
    },
    Journal {
        file: Listed,
        cursor: Box<JournalCursor>,
        result: Result<JournalDone>,
    },
    Rank {
        rank: u32,
        dir: PathBuf,
        parts: BTreeSet<u64>,
        summarised: crate::digest::RankSummarised,
        /// From a node rollup.
        rolled: bool,
    },
}

/// A journal read: what it decoded, its bytes, its batches and the damage it skipped.
struct JournalDone {
    data: PartRead,
    bytes: u64,
    batches: u64,
    damage: Vec<crate::journal::SkippedRange>,
}

/// A file's new bytes, and for a journal the new bytes of its checks file (`None` when it
/// has none).
#[derive(Default)]
struct Fetched {
    data: Bytes,
    checks: Option<Bytes>,
    /// With [`ReadOptions::digests`]: the part's summary file, when it checked out (then
    /// `data` is empty: the part itself was not read).
    digest: Option<crate::digest::PartDigest>,
    /// The part's summary file was there but damaged: why (its part is decoded instead).
    digest_damage: Option<String>,
    /// Object-store requests made for it.
    requests: u64,
}

impl PartsReader {
    /// Opens the titan run at `run` (local folder or object store URL); reads nothing yet.
    pub fn open(run: &str) -> Result<Self> {
        let location = Location::parse(run)?;
        Ok(PartsReader {
            location,
            run: Run {
                location: run.to_string(),
                ..Default::default()
            },
            merger: Merger::default(),
            rank_dir_listings: HashMap::new(),
            seen: HashMap::new(),
            rank_dirs: BTreeSet::new(),
            ok_ranks: BTreeSet::new(),
            world_size: 0,
            last: ReadCounters::default(),
            total: ReadCounters::default(),
            last_dirs_read: 0,
            ranks_read: Default::default(),
        })
    }

    /// Marks parts `0..=last` of each rank as read without reading them: refreshes then
    /// read only the journals and the parts after those (a viewer that draws the parts it
    /// listed from their detail levels, and follows what is appended).
    pub fn skip_parts_through(&mut self, last: &BTreeMap<u32, u64>) {
        for (&rank, &n) in last {
            self.ranks_read.insert(rank);
            for index in 0..=n {
                self.seen.insert((rank, index), Seen::Part);
            }
        }
    }

    /// Reads what is new since the last refresh. `at_end`: the writers are done, so bytes
    /// after a journal's last complete batch are a torn tail (reported in
    /// `report.truncated_tails`), not a batch still being written.
    pub fn refresh(&mut self, opts: &ReadOptions) -> Result<&Run> {
        self.refresh_with(opts, false)
    }

    /// [`Self::refresh`] with explicit `at_end`.
    pub fn refresh_with(&mut self, opts: &ReadOptions, at_end: bool) -> Result<&Run> {
        // Parts already decoded are immutable: the listing skips them (no stat, no strings),
        // so a refresh costs the directory read plus what is new, not the run's history.
        // Reading summaries, a rank read for the first time is read from its rank summary:
        // its parts are listed by name only, checked against what that summary covers (the
        // covered parts' lengths are checked by `summarise_rank`, in the rank's own task).
        let seen = &self.seen;
        let ranks_read = &self.ranks_read;
        let whole_ranks = opts.digests && matches!(self.location, Location::Local(_));
        // The node rollups are read once, with the first refresh of a reader of summaries.
        let rollups = whole_ranks && opts.node_rollups && ranks_read.is_empty();
        let listing = list_files(
            &self.location,
            &mut self.rank_dir_listings,
            |rank, index| matches!(seen.get(&(rank, index)), Some(Seen::Part)),
            |rank| whole_ranks && !ranks_read.contains(&rank),
            rollups,
        )?;
        self.rank_dirs.extend(listing.rank_dirs.iter().copied());
        self.last_dirs_read = listing.dirs_read;
        let mut parts_listed: BTreeSet<(u32, u64)> = listing
            .files
            .iter()
            .filter(|f| f.kind == FileKind::Part)
            .map(|f| (f.rank, f.index))
            .collect();
        let mut work = Vec::new();
        for (rank, (dir, parts)) in listing.named_parts {
            parts_listed.extend(parts.iter().map(|&i| (rank, i)));
            work.push(Work::Rank {
                rank,
                dir,
                parts,
                rolled: None,
            });
        }
        for (rank, (dir, rolled)) in listing.rolled {
            work.push(Work::Rank {
                rank,
                dir,
                parts: BTreeSet::new(),
                rolled: Some(rolled),
            });
        }
        // Damaged node rollups and object-store rank summaries, with what each cost.
        const FROM_FOLDERS: &str = "nothing: its ranks were read from their folders";
        const FROM_PARTS: &str = "nothing: its parts' own summaries were read instead";
        let mut damaged_summaries: Vec<(String, String, &str)> = (listing.rollup_damage)
            .into_iter()
            .map(|(file, error)| (file, error, FROM_FOLDERS))
            .collect();
        let rollups_read = listing.rollups_read;
        let mut list_requests = listing.list_requests;
        let mut files = listing.files;
        // Object-store ranks read for the first time: from their rank summaries.
        let mut ranks_summarised = Vec::new();
        if let (true, Location::Object { store, url, .. }) = (opts.digests, &self.location) {
            let wanted: Vec<(u32, object_store::path::Path)> = (listing.object_rank_summaries)
                .into_iter()
                .filter(|(rank, _)| !self.ranks_read.contains(rank))
                .map(|(rank, (path, _))| (rank, path))
                .collect();
            if !wanted.is_empty() {
                let (done, gets, damaged) = object_rank_summaries(store, url, wanted, &mut files);
                ranks_summarised = done;
                list_requests += gets;
                damaged_summaries.extend(damaged.into_iter().map(|(f, e)| (f, e, FROM_PARTS)));
            }
        }
        for file in files {
            let key = (file.rank, file.index);
            match (file.kind, self.seen.get(&key)) {
                (_, Some(Seen::Part)) => {}
                (FileKind::Part, Some(Seen::Journal { cursor, .. })) => {
                    let skip_rows = cursor.rows;
                    work.push(Work::Part { file, skip_rows });
                }
                (FileKind::Part, _) => work.push(Work::Part { file, skip_rows: 0 }),
                // The part is complete: read it instead (in this refresh).
                (FileKind::Journal, _) if parts_listed.contains(&key) => {}
                (FileKind::Journal, Some(Seen::BadJournal)) => {}
                (FileKind::Journal, Some(Seen::Journal { cursor, .. })) => {
                    if file.size > cursor.offset {
                        let Some(Seen::Journal { cursor, .. }) = self.seen.remove(&key) else {
                            unreachable!()
                        };
                        work.push(Work::Journal { file, cursor });
                    }
                }
                (FileKind::Journal, None) => work.push(Work::Journal {
                    file,
                    cursor: Box::default(),
                }),
            }
        }
        // Rank by rank; a rank's summary before its journals (a stable sort: files keep the
        // listing's order).
        work.sort_by_key(Work::order);
        self.last = ReadCounters {
            rollups_read,
            requests: list_requests,
            ..Default::default()
        };
        for (file, error, lost) in damaged_summaries {
            self.run.report.damage.push(Damage {
                bytes: std::fs::metadata(&file).map_or(0, |m| m.len()),
                file,
                offset: 0,
                lost: lost.into(),
                error,
            });
        }
        // Before any part: a rank summary stands for a rank's first parts.
        for done in ranks_summarised {
            self.merge(done, opts);
        }
        // Decode in chunks: parallel within a chunk, merged (and freed) between chunks, so
        // peak memory is the tables plus one chunk of decoded files. A chunk holds at least
        // a few items per thread, and more while they are small (up to CHUNK_BYTES read):
        // a `--follow` refresh of every rank's journal is a few chunks, not one per 8 ranks.
        let min_chunk = rayon::current_num_threads().max(1) * 4;
        let total_files = work.len();
        let spans_before = self.run.spans.len();
        let mut done_files = 0usize;
        let mut first = true;
        let mut work = work.into_iter().peekable();
        while work.peek().is_some() {
            let (mut batch, mut bytes) = (Vec::new(), 0u64);
            while let Some(w) = work.peek() {
                let b = w.weight();
                if batch.len() >= min_chunk
                    && (bytes.saturating_add(b) > CHUNK_BYTES || batch.len() >= CHUNK_MAX)
                {
                    break;
                }
                bytes = bytes.saturating_add(b);
                batch.extend(work.next());
            }
            let fetched = self.fetch(batch, opts.digests)?;
            self.last.requests += fetched
                .iter()
                .map(|(_, f)| f.as_ref().map_or(0, |f| f.requests))
                .sum::<u64>();
            let decoded: Vec<Done> = fetched
                .into_par_iter()
                .map(|(w, bytes)| {
                    let files = w.files();
                    let done = decode(w, bytes, opts, at_end);
                    if let Some(cb) = &opts.progress {
                        cb(files);
                    }
                    done
                })
                .collect();
            done_files += decoded.len();
            for d in decoded {
                self.merge(d, opts);
            }
            if std::mem::take(&mut first) && done_files < total_files {
                // After the first chunk, reserve for the whole read (+5%) so the big columns
                // grow once instead of doubling (which would transiently need 2x the memory).
                // Only for a read that adds a lot to what is held: an exact reservation on
                // every small `--follow` refresh would copy the whole run each time, where
                // Vec's doubling copies it once per doubling.
                let added = (self.run.spans.len() - spans_before) as f64;
                let predicted = (added * total_files as f64 / done_files as f64 * 1.05) as usize;
                if predicted > spans_before / 2 {
                    self.run.spans.reserve(spans_before + predicted);
                }
            }
        }
        self.total.add(&self.last);
        self.publish(at_end);
        Ok(&self.run)
    }

    /// Reads each work item's new bytes (whole parts; journals from their cursor).
    ///
    /// A journal's checks file is read after the journal was listed (its size known): the
    /// writer appends a check before its range, so every listed byte has its check.
    fn fetch(&self, work: Vec<Work>, digests: bool) -> Result<Vec<(Work, Result<Fetched>)>> {
        let range = |w: &Work| match w {
            Work::Part { file, .. } => 0..file.size,
            Work::Journal { file, cursor } => cursor.offset..file.size,
            Work::Rank { .. } => 0..0,
        };
        let checks_from = |w: &Work| match w {
            Work::Part { .. } | Work::Rank { .. } => None,
            Work::Journal { cursor, .. } => cursor.checks_offset(),
        };
        match &self.location {
            Location::Local(_) => Ok(work
                .into_par_iter()
                .map(|w| {
                    let r = range(&w);
                    let Some(file) = w.file() else {
                        // A rank summary is read where it is summarised, in `decode`.
                        return (w, Ok(Fetched::default()));
                    };
                    let fetched = (|| {
                        let mut digest_damage = None;
                        if let (true, Work::Part { file, skip_rows: 0 }) = (digests, &w) {
                            let part = std::path::Path::new(&file.display);
                            match crate::digest::read_local(part, file.size) {
                                Ok(Some(d)) => {
                                    return Ok(Fetched {
                                        data: Bytes::new(),
                                        checks: None,
                                        digest: Some(d),
                                        digest_damage: None,
                                        requests: 0,
                                    });
                                }
                                Ok(None) => {}
                                Err(e) => digest_damage = Some(format!("{e:#}")),
                            }
                        }
                        let checks = match checks_from(&w) {
                            Some(from) => read_local_checks(&file.display, from)?,
                            None => None,
                        };
                        let data = read_local(&file.display, r)?;
                        Ok(Fetched {
                            data,
                            checks,
                            digest: None,
                            digest_damage,
                            requests: 0,
                        })
                    })();
                    (w, fetched)
                })
                .collect()),
            Location::Object { store, .. } => {
                let rt = titan_storage::runtime();
                Ok(rt.block_on(async {
                    use futures::StreamExt;
                    futures::stream::iter(work)
                        .map(|w| {
                            let store = store.clone();
                            let r = range(&w);
                            let from = checks_from(&w);
                            let whole_part = matches!(w, Work::Part { skip_rows: 0, .. });
                            async move {
                                let Some(f) = w.file() else {
                                    return (w, Ok(Fetched::default()));
                                };
                                let path = f.object_path.clone().expect("object files have paths");
                                let fetched = async {
                                    let mut requests = 0;
                                    let mut digest_damage = None;
                                    // A part's summary is in its footer (issue 42): the end of
                                    // the part, one request, instead of the whole part.
                                    if digests && whole_part {
                                        let (got, n) =
                                            object_summary(store.as_ref(), &path, f.size).await;
                                        requests += n;
                                        match got {
                                            Ok(Some(d)) => {
                                                return Ok(Fetched {
                                                    data: Bytes::new(),
                                                    checks: None,
                                                    digest: Some(d),
                                                    digest_damage: None,
                                                    requests,
                                                });
                                            }
                                            Ok(None) => {}
                                            Err(e) => digest_damage = Some(format!("{e:#}")),
                                        }
                                    }
                                    let checks = match from {
                                        Some(from) => {
                                            let name =
                                                checks_path(std::path::Path::new(path.as_ref()));
                                            let cpath = object_store::path::Path::from(
                                                name.to_string_lossy().as_ref(),
                                            );
                                            requests += 1;
                                            match store.get(&cpath).await {
                                                Ok(g) => {
                                                    let b = g.bytes().await.with_context(|| {
                                                        format!("downloading {cpath}")
                                                    })?;
                                                    Some(b.slice((from as usize).min(b.len())..))
                                                }
                                                Err(object_store::Error::NotFound { .. }) => None,
                                                Err(e) => {
                                                    return Err(anyhow::Error::new(e)
                                                        .context(format!("downloading {cpath}")));
                                                }
                                            }
                                        }
                                        None => None,
                                    };
                                    requests += 1;
                                    let data = store
                                        .get_range(&path, r)
                                        .await
                                        .with_context(|| format!("downloading {}", f.display))?;
                                    Ok(Fetched {
                                        data,
                                        checks,
                                        digest: None,
                                        digest_damage,
                                        requests,
                                    })
                                }
                                .await;
                                (w, fetched)
                            }
                        })
                        .buffer_unordered(16)
                        .collect::<Vec<_>>()
                        .await
                }))
            }
        }
    }

    fn merge(&mut self, done: Done, opts: &ReadOptions) {
        if let Done::Part { file, .. } | Done::Journal { file, .. } = &done {
            self.ranks_read.insert(file.rank);
        }
        match done {
            Done::Rank {
                rank,
                dir,
                parts,
                summarised,
                rolled,
            } => {
                self.last.ranks_rolled_up += u64::from(rolled);
                self.merge_rank(rank, &dir, parts, summarised, opts)
            }
            Done::Part {
                file,
                skip_rows,
                result,
                digest_damage,
            } => {
                let key = (file.rank, file.index);
                if let Some((summary, error)) = digest_damage {
                    self.run.report.damage.push(Damage {
                        bytes: std::fs::metadata(&summary).map_or(0, |m| m.len()),
                        file: summary,
                        offset: 0,
                        lost: "nothing: its part was decoded instead".into(),
                        error,
                    });
                }
                let had_journal = matches!(self.seen.get(&key), Some(Seen::Journal { .. }));
                self.seen.insert(key, Seen::Part);
                match result {
                    Ok((mut part, bytes)) => {
                        self.last.parts_decoded += 1;
                        self.last.part_rows_skipped += skip_rows;
                        self.last.bytes += bytes;
                        self.last.rows += part.data.rows as u64;
                        // Damage its journal had when compacted; already reported when this
                        // reader read that journal.
                        let journal = crate::location::journal_file_name(file.index);
                        let damage = std::mem::take(&mut part.data.damage);
                        let damage = if had_journal { Vec::new() } else { damage };
                        self.run
                            .report
                            .damage
                            .extend(damage.into_iter().map(|d| Damage {
                                file: format!("{} (compacted from {journal})", file.display),
                                offset: d.offset,
                                bytes: d.bytes,
                                lost: d.lost,
                                error: d.error,
                            }));
                        if had_journal {
                            // Counted when its journal was first read.
                            part.data.info.parts = 0;
                        } else {
                            self.run.report.parts_read += 1;
                        }
                        self.add(part, opts);
                    }
                    Err(e) => self.run.report.corrupt_parts.push(CorruptPart {
                        path: file.display,
                        error: format!("{e:#}"),
                    }),
                }
            }
            Done::Journal {
                file,
                cursor,
                result,
            } => {
                let key = (file.rank, file.index);
                match result {
                    Ok(JournalDone {
                        data: mut part,
                        bytes,
                        batches,
                        damage,
                    }) => {
                        self.run
                            .report
                            .damage
                            .extend(damage.into_iter().map(|d| Damage {
                                file: file.display.clone(),
                                offset: d.offset,
                                bytes: d.bytes,
                                lost: d.lost,
                                error: d.reason,
                            }));
                        let first = cursor.batches == batches && batches > 0;
                        self.last.journal_batches += batches;
                        self.last.bytes += bytes;
                        self.last.rows += part.data.rows as u64;
                        if first {
                            self.run.report.parts_read += 1;
                        } else {
                            part.data.info.parts = 0;
                        }
                        if batches > 0 {
                            self.add(part, opts);
                        }
                        self.seen.insert(
                            key,
                            Seen::Journal {
                                cursor,
                                display: file.display,
                            },
                        );
                    }
                    Err(e) => {
                        self.seen.insert(key, Seen::BadJournal);
                        self.run.report.corrupt_parts.push(CorruptPart {
                            path: file.display,
                            error: format!("{e:#}"),
                        });
                    }
                }
            }
        }
    }

    /// Merges a rank read from its rank summary: its segments as parts, and what was damaged
    /// or corrupt, by name.
    fn merge_rank(
        &mut self,
        rank: u32,
        dir: &std::path::Path,
        parts: BTreeSet<u64>,
        s: crate::digest::RankSummarised,
        opts: &ReadOptions,
    ) {
        self.ranks_read.insert(rank);
        for index in parts {
            self.seen.insert((rank, index), Seen::Part);
        }
        for (file, error) in s.damaged {
            let lost = if file.ends_with(crate::digest::RANK_SUMMARY_FILE) {
                "nothing: its parts' own summaries were read instead"
            } else {
                "nothing: its part was decoded instead"
            };
            self.run.report.damage.push(Damage {
                bytes: std::fs::metadata(&file).map_or(0, |m| m.len()),
                file,
                offset: 0,
                lost: lost.into(),
                error,
            });
        }
        self.run.report.corrupt_parts.extend(
            s.corrupt
                .into_iter()
                .map(|(path, error)| CorruptPart { path, error }),
        );
        self.last.parts_decoded += s.decoded;
        self.last.bytes += s.bytes;
        for segment in s.digest.segments {
            for p in &segment.parts {
                let part = dir.join(crate::location::part_file_name(p.index));
                let journal = crate::location::journal_file_name(p.index);
                self.run
                    .report
                    .damage
                    .extend(p.damage.iter().map(|d| Damage {
                        file: format!("{} (compacted from {journal})", part.display()),
                        offset: d.offset,
                        bytes: d.bytes,
                        lost: d.lost.clone(),
                        error: d.error.clone(),
                    }));
            }
            self.run.report.parts_read += segment.parts.len();
            let part = PartRead::from(segment.digest);
            self.last.rows += part.data.rows as u64;
            self.add(part, opts);
        }
    }

    fn add(&mut self, mut part: PartRead, opts: &ReadOptions) {
        // `metrics` (none of the span columns) needs only the summaries' scalars: their span
        // sections are not merged (the largest part of a merged run's memory and time).
        if opts.columns == crate::tables::Columns::METRICS
            && let Some(d) = &mut part.digest
        {
            d.keep_only_scalars();
        }
        let info = &part.data.info;
        self.world_size = self.world_size.max(info.world_size);
        self.ok_ranks.insert(info.rank);
        self.rank_dirs.insert(info.rank);
        self.run.report.rows_read += part.data.rows;
        self.merger.merge(&mut self.run, part, opts.align_clocks);
    }

    /// Brings the run's dictionaries and report up to date.
    fn publish(&mut self, at_end: bool) {
        let expected = self
            .world_size
            .max(self.rank_dirs.iter().next_back().map_or(0, |r| r + 1));
        let r = &mut self.run.report;
        r.world_size = expected;
        r.missing_ranks = (0..expected)
            .filter(|x| !self.ok_ranks.contains(x))
            .collect();
        r.format = RunFormat::Titan;
        r.bytes_parsed = self.last.bytes;
        r.truncated_tails = if at_end {
            self.seen
                .values()
                .filter_map(|s| match s {
                    Seen::Journal { cursor, display } if cursor.pending() > 0 => Some(format!(
                        "{display}: {} bytes after the last complete batch",
                        cursor.pending()
                    )),
                    _ => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        r.truncated_tails.sort();
        self.merger.publish(&mut self.run);
    }

    /// The run as read so far.
    pub fn run(&self) -> &Run {
        &self.run
    }

    /// Shows run `id` of the location, now and after every refresh ([`Run::select_run`]).
    pub fn select_run(&mut self, id: &str) -> anyhow::Result<()> {
        self.run.select_run(id)
    }

    /// The run as read so far, without copying.
    pub fn into_run(self) -> Run {
        self.run
    }

    /// What the last refresh read.
    pub fn last(&self) -> ReadCounters {
        self.last
    }

    /// How many local rank directories the last refresh listed: those unchanged since their
    /// last listing (and quiet for a second before it) are not read again.
    pub fn dirs_read(&self) -> u64 {
        self.last_dirs_read
    }

    /// What all refreshes read.
    pub fn total(&self) -> ReadCounters {
        self.total
    }
}

fn decode(work: Work, fetched: Result<Fetched>, opts: &ReadOptions, at_end: bool) -> Done {
    // A summary is made of start times, depths and tags whatever the caller asked for.
    let columns = if opts.digests {
        crate::digest::COLUMNS
    } else {
        opts.columns
    };
    let summarise = |data: PartData| -> PartRead {
        if opts.digests {
            crate::digest::PartDigest::of_data(&data).into()
        } else {
            data.into()
        }
    };
    match work {
        Work::Part { file, skip_rows } => {
            let mut digest_damage = None;
            let result = fetched.and_then(|f| {
                if let Some(d) = f.digest {
                    return Ok((d.into(), 0));
                }
                if let Some(e) = f.digest_damage {
                    let part = std::path::Path::new(&file.display);
                    digest_damage = Some((crate::digest::summary_shown(part), e));
                }
                let b = f.data;
                let n = b.len() as u64;
                let data = decode_part(b, file.rank, columns, skip_rows)?;
                if !opts.digests {
                    return Ok((data.into(), n));
                }
                let digest = crate::digest::PartDigest::of_data(&data);
                // Cache it next to a local part read whole (a run written before summaries
                // existed); a read-only location, or a damaged summary kept as evidence,
                // just goes without.
                if skip_rows == 0 && file.object_path.is_none() && digest_damage.is_none() {
                    let part = std::path::Path::new(&file.display);
                    if let Err(e) = crate::digest::write_local(part, n, &digest) {
                        tracing::debug!("not caching the summary of {}: {e:#}", file.display);
                    }
                }
                Ok((digest.into(), n))
            });
            Done::Part {
                file,
                skip_rows,
                result,
                digest_damage,
            }
        }
        Work::Rank {
            rank,
            dir,
            rolled: Some(rolled),
            ..
        } => match crate::digest::rank_file::decode(&rolled.entry.summary) {
            // As a rank summary: only while every part it covers has the length it lists
            // (one stat a part; a part truncated or rewritten in place, which leaves the
            // folder's mtime alone, is read again and named if damaged).
            Ok(digest) if crate::digest::local::covered_lengths_match(&digest, &dir) => {
                Done::Rank {
                    rank,
                    dir,
                    parts: digest.covered_set(),
                    summarised: crate::digest::RankSummarised {
                        digest,
                        ..Default::default()
                    },
                    rolled: true,
                }
            }
            // The entry does not check out or no longer fits: the rank is read from its
            // folder, as without one.
            got => {
                let listed = crate::digest::local::list_parts(&dir).unwrap_or_default();
                let mut summarised = crate::digest::summarise_rank(&dir, rank, &listed, true);
                if let Err(e) = got {
                    summarised.damaged.push((
                        format!("{} (rank {rank}'s entry)", rolled.file.display()),
                        format!("{e:#}"),
                    ));
                }
                Done::Rank {
                    rank,
                    dir,
                    parts: listed,
                    summarised,
                    rolled: false,
                }
            }
        },
        Work::Rank {
            rank,
            dir,
            parts,
            rolled: None,
        } => {
            let summarised = crate::digest::summarise_rank(&dir, rank, &parts, true);
            Done::Rank {
                rank,
                dir,
                parts,
                summarised,
                rolled: false,
            }
        }
        Work::Journal { file, mut cursor } => {
            let result = fetched.and_then(|f| {
                let n = f.data.len() as u64;
                decode_journal(&mut cursor, f.data, f.checks, file.rank, columns, at_end)
                    .map(|r| JournalDone {
                        data: summarise(r.data),
                        bytes: n,
                        batches: r.batches,
                        damage: r.damage,
                    })
                    .with_context(|| format!("reading {}", file.display))
            });
            Done::Journal {
                file,
                cursor,
                result,
            }
        }
    }
}

/// A local journal's checks file from `from` to its end; `None` when there is none.
fn read_local_checks(journal: &str, from: u64) -> Result<Option<Bytes>> {
    use std::io::{Read, Seek, SeekFrom};
    let path = checks_path(std::path::Path::new(journal));
    let mut f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut buf = Vec::new();
    f.seek(SeekFrom::Start(from))
        .and_then(|_| f.read_to_end(&mut buf))
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(Some(Bytes::from(buf)))
}

fn read_local(path: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).with_context(|| format!("reading {path}"))?;
    f.seek(SeekFrom::Start(range.start))
        .with_context(|| format!("reading {path}"))?;
    let mut buf = Vec::with_capacity((range.end - range.start) as usize);
    f.take(range.end - range.start)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading {path}"))?;
    Ok(Bytes::from(buf))
}

/// Lists the run's parts and journals, leaving out the parts `known(rank, index)` names.
/// Local rank directories that have not changed since their last listing (`listings`) are
/// not read again: only their journals and the files still pending are stat'ed, so a
/// refresh does not cost in proportion to the parts a long run has accumulated. The parts
/// of local ranks `by_name(rank)` picks are not stat'ed here: they are listed in
/// [`Listing::named_parts`].
fn list_files(
    location: &Location,
    listings: &mut HashMap<u32, RankDirListing>,
    known: impl Fn(u32, u64) -> bool + Sync,
    by_name: impl Fn(u32) -> bool + Sync,
    rollups: bool,
) -> Result<Listing> {
    let mut rank_dirs = BTreeSet::new();
    let mut files = Vec::new();
    let mut named_parts: BTreeMap<u32, (PathBuf, BTreeSet<u64>)> = BTreeMap::new();
    let mut rolled = BTreeMap::new();
    let mut rollups_read = 0;
    let mut list_requests = 0;
    let mut object_rank_summaries = BTreeMap::new();
    let mut rollup_damage = Vec::new();
    let mut dirs_read = 0;
    match location {
        Location::Local(run) => {
            let obs = run.join("obs");
            if !obs.is_dir() {
                if !run.exists() {
                    bail!("run directory {} does not exist", run.display());
                }
                bail!(
                    "{} has no obs/ directory: not a titan run (expected {}/obs/rank-<R>/part-<N>.parquet)",
                    run.display(),
                    run.display()
                );
            }
            let mut dirs = Vec::new();
            let mut rollup_names = Vec::new();
            for entry in
                std::fs::read_dir(&obs).with_context(|| format!("listing {}", obs.display()))?
            {
                let entry = entry?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                if crate::digest::node::is_rollup_name(name) {
                    rollup_names.push(name.to_string());
                    continue;
                }
                let Some(rank) = parse_rank_dir_name(name) else {
                    continue;
                };
                rank_dirs.insert(rank);
                dirs.push((rank, entry.path(), listings.remove(&rank)));
            }
            let mut roll = crate::digest::node::Rollups::default();
            if rollups && !rollup_names.is_empty() {
                roll = crate::digest::node::read_all(&obs, &rollup_names);
                rollups_read = roll.files;
                rollup_damage = std::mem::take(&mut roll.damaged);
            }
            // Rank folders in parallel: a refresh stats (and may list) every one of them.
            let listed: Vec<Result<RankDirListed>> = dirs
                .into_par_iter()
                .map(|(rank, dir, cached)| {
                    let by_name = by_name(rank);
                    let entry = roll
                        .entries
                        .get(&rank)
                        .filter(|_| by_name && cached.is_none());
                    if let Some((file, entry)) = entry
                        && let Some(l) = rolled_rank_dir(rank, &dir, file, entry)
                    {
                        return Ok(l);
                    }
                    list_rank_dir(rank, dir, cached, &known, by_name)
                })
                .collect();
            for l in listed {
                let l = l?;
                dirs_read += u64::from(l.read);
                files.extend(l.files);
                if let Some(parts) = l.named {
                    named_parts.insert(l.rank, (l.dir.clone(), parts));
                }
                if let Some(r) = l.rolled {
                    rolled.insert(l.rank, (l.dir, r));
                }
                listings.insert(l.rank, l.listing);
            }
        }
        Location::Object { url, store, base } => {
            use futures::TryStreamExt;
            let prefix = base.clone().join("obs");
            let metas: Vec<object_store::ObjectMeta> = titan_storage::runtime()
                .block_on(store.list(Some(&prefix)).try_collect())
                .with_context(|| format!("listing {url}/obs"))?;
            if metas.is_empty() {
                bail!(
                    "{url}/obs/ holds no objects: not a titan run (or wrong credentials/endpoint)"
                );
            }
            list_requests = (metas.len() as u64).div_ceil(1000);
            for m in metas {
                let parts_of: Vec<&str> = m.location.as_ref().rsplitn(3, '/').collect();
                let [file, rank_dir, ..] = parts_of.as_slice() else {
                    continue;
                };
                if *file == crate::digest::RANK_SUMMARY_FILE
                    && let Some(rank) = parse_rank_dir_name(rank_dir)
                {
                    object_rank_summaries.insert(rank, (m.location.clone(), m.size));
                    continue;
                }
                let (Some(rank), Some(index)) =
                    (parse_rank_dir_name(rank_dir), parse_part_file_name(file))
                else {
                    continue;
                };
                rank_dirs.insert(rank);
                if known(rank, index) {
                    continue;
                }
                files.push(Listed {
                    rank,
                    index,
                    kind: FileKind::Part,
                    size: m.size,
                    display: format!("{url}/obs/{rank_dir}/{file}"),
                    object_path: Some(m.location.clone()),
                });
            }
        }
    }
    // Rank by rank, in part order (deterministic tables); a part before its journal.
    files.sort_by_key(|f| (f.rank, f.index, f.kind));
    Ok(Listing {
        rank_dirs,
        files,
        named_parts,
        rolled,
        rollups_read,
        list_requests,
        object_rank_summaries,
        rollup_damage,
        dirs_read,
    })
}

/// Object-store ranks read for the first time from their `rank.summary` objects (one GET a
/// rank, a few at a time) instead of one footer GET per part: each summary that checks out
/// against the rank's parts listed (every part it covers is listed with the size it covers,
/// the others come after its last) stands for the parts it covers, which are taken out of
/// `files`. Returns the ranks so read, the GETs made, and the summaries that did not decode
/// (their ranks' parts are read as before).
fn object_rank_summaries(
    store: &Arc<dyn object_store::ObjectStore>,
    url: &str,
    wanted: Vec<(u32, object_store::path::Path)>,
    files: &mut Vec<Listed>,
) -> (Vec<Done>, u64, Vec<(String, String)>) {
    use futures::StreamExt;
    let requests = wanted.len() as u64;
    let mut got: Vec<(u32, Result<Bytes>)> = titan_storage::runtime().block_on(
        futures::stream::iter(wanted)
            .map(|(rank, path)| {
                let store = store.clone();
                async move {
                    let got = async { store.get(&path).await?.bytes().await }.await;
                    (rank, got.map_err(anyhow::Error::from))
                }
            })
            .buffer_unordered(16)
            .collect(),
    );
    // Ranks in order (they arrive as answered): merged rank by rank, as the parts are.
    got.sort_by_key(|g| g.0);
    let mut sizes: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
    for f in files.iter().filter(|f| f.kind == FileKind::Part) {
        sizes.entry(f.rank).or_default().insert(f.index, f.size);
    }
    let (mut done, mut damaged) = (Vec::new(), Vec::new());
    let mut covered_of: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for (rank, got) in got {
        let shown = format!("{url}/obs/rank-{rank}/{}", crate::digest::RANK_SUMMARY_FILE);
        let digest = match got.and_then(|b| crate::digest::rank_file::decode(&b)) {
            Ok(d) => d,
            Err(e) => {
                damaged.push((shown, format!("{e:#}")));
                continue;
            }
        };
        if !digest.fits_sized(sizes.get(&rank).unwrap_or(&BTreeMap::new())) {
            continue;
        }
        let covered = digest.covered_set();
        covered_of.insert(rank, covered.clone());
        done.push(Done::Rank {
            rank,
            dir: PathBuf::from(format!("{url}/obs/rank-{rank}")),
            parts: covered,
            summarised: crate::digest::RankSummarised {
                digest,
                ..Default::default()
            },
            rolled: false,
        });
    }
    files.retain(|f| {
        f.kind != FileKind::Part
            || !covered_of
                .get(&f.rank)
                .is_some_and(|c| c.contains(&f.index))
    });
    (done, requests, damaged)
}

/// A rank folder that its node rollup entry still describes, without listing it: the folder
/// has the mtime the entry recorded and the next part does not exist (the rank's writer adds
/// files in index order, so a part or journal made inside the timestamps' granularity is still
/// seen); its open journal, if any, is the next index. `None`: read the folder as without one.
fn rolled_rank_dir(
    rank: u32,
    dir: &std::path::Path,
    file: &std::path::Path,
    entry: &crate::digest::node::Entry,
) -> Option<RankDirListed> {
    let meta = crate::digest::node::unchanged_folder(dir, entry.dir_mtime_ns, entry.last_part)?;
    let next = entry.last_part.map_or(0, |l| l + 1);
    let journal_name = crate::location::journal_file_name(next);
    let journal = dir.join(&journal_name);
    let mut files = Vec::new();
    let mut pending = Vec::new();
    if let Ok(m) = std::fs::metadata(&journal) {
        pending.push((journal_name, FileKind::Journal, next));
        files.push(Listed {
            rank,
            index: next,
            kind: FileKind::Journal,
            size: m.len(),
            display: journal.display().to_string(),
            object_path: None,
        });
    }
    Some(RankDirListed {
        rank,
        dir: dir.to_path_buf(),
        listing: RankDirListing {
            mtime: meta.modified().ok()?,
            listed_at: std::time::SystemTime::now(),
            pending,
        },
        read: false,
        files,
        named: None,
        rolled: Some(Rolled {
            file: file.to_path_buf(),
            entry: entry.clone(),
        }),
    })
}

/// One local rank folder listed: its listing (to keep), whether it was read, its files
/// (stat'ed) and, when listed by name, its part indices.
struct RankDirListed {
    rank: u32,
    dir: PathBuf,
    listing: RankDirListing,
    read: bool,
    files: Vec<Listed>,
    named: Option<BTreeSet<u64>>,
    /// Described by its node rollup entry (not listed).
    rolled: Option<Rolled>,
}

/// Lists the local rank folder `dir`: read again unless `cached` is still valid; parts
/// `known` are dropped; with `by_name`, parts are not stat'ed but returned by index.
fn list_rank_dir(
    rank: u32,
    dir: PathBuf,
    cached: Option<RankDirListing>,
    known: &(impl Fn(u32, u64) -> bool + Sync),
    by_name: bool,
) -> Result<RankDirListed> {
    let mtime = std::fs::metadata(&dir).and_then(|m| m.modified()).ok();
    let (mut listing, read) = match (cached, mtime) {
        (Some(l), Some(m)) if l.still_valid(m) => (l, false),
        _ => {
            let listed_at = std::time::SystemTime::now();
            let mut pending = Vec::new();
            for e in std::fs::read_dir(&dir)
                .with_context(|| format!("listing {}", dir.display()))?
                .filter_map(|e| e.ok())
            {
                let name = e.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                if let Some(n) = parse_part_file_name(name) {
                    if !known(rank, n) {
                        pending.push((name.to_string(), FileKind::Part, n));
                    }
                } else if let Some(n) = parse_journal_file_name(name) {
                    pending.push((name.to_string(), FileKind::Journal, n));
                }
            }
            let l = RankDirListing {
                mtime: mtime.unwrap_or(std::time::UNIX_EPOCH),
                listed_at,
                pending,
            };
            (l, true)
        }
    };
    // Parts once known stay known: drop them from what is re-checked.
    listing
        .pending
        .retain(|(_, kind, index)| *kind == FileKind::Journal || !known(rank, *index));
    let mut files = Vec::new();
    let mut named: Option<BTreeSet<u64>> = None;
    for (name, kind, index) in &listing.pending {
        if by_name && *kind == FileKind::Part {
            named.get_or_insert_with(BTreeSet::new).insert(*index);
            continue;
        }
        let path = dir.join(name);
        // A journal may be removed (compacted) between listing and stat.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        files.push(Listed {
            rank,
            index: *index,
            kind: *kind,
            size: meta.len(),
            display: path.display().to_string(),
            object_path: None,
        });
    }
    Ok(RankDirListed {
        rank,
        dir,
        listing,
        read,
        files,
        named,
        rolled: None,
    })
}

/// The summary in the footer of the object-store part `path` (`len` bytes), and the requests
/// it took: `Ok(None)` when the part has none (written before issue 42), `Err` when it is
/// damaged. A footer that cannot be read counts as none: the part is then read whole, and
/// named if it does not decode.
async fn object_summary(
    store: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
    len: u64,
) -> (Result<Option<crate::digest::PartDigest>>, u64) {
    use crate::footer::{FOOTER_READ, Tail};
    let mut want = len.min(FOOTER_READ);
    let mut requests = 0;
    loop {
        requests += 1;
        let Ok(tail) = store.get_range(path, len - want..len).await else {
            return (Ok(None), requests);
        };
        match crate::footer::parse_tail(&tail, len) {
            Ok(Tail::Footer(kv)) => {
                let got = crate::digest::from_footer(&kv)
                    .with_context(|| format!("the summary in {path} is damaged"));
                return (got, requests);
            }
            Ok(Tail::NeedMore(n)) if n > want && n <= len => want = n,
            _ => return (Ok(None), requests),
        }
    }
}

/// Loads every rank's parts (and open journals) of the titan run at `run` (local dir or
/// object store URL) once. Bytes after a journal's last complete batch are reported in
/// `report.truncated_tails`.
pub fn load_parts(run: &str, opts: &ReadOptions) -> Result<Run> {
    let mut reader = PartsReader::open(run)?;
    reader.refresh_with(opts, true)?;
    Ok(reader.into_run())
}
