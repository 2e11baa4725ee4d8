//! Every input titan-obs opens, turned into one [`Run`]: titan's Parquet parts
//! ([`crate::incremental::load_parts`]), torchtitan's structured-logger JSONL ([`jsonl`]) and
//! Chrome trace-event JSON ([`chrome`]), local or on an object store.
//!
//! [`detect`] decides what a location holds; [`load`] reads it once; [`Follower`] keeps
//! a run open and, on each [`Follower::refresh`], reads only what was appended (new bytes of
//! the JSONL files, new files) — titan parts are re-listed and re-read when they changed.

pub(crate) mod chrome;
pub(crate) mod jsonl;
pub mod skew;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use object_store::ObjectStoreExt as _;
use rayon::prelude::*;

use crate::location::{Location, NotARun};
use crate::run::{LoadReport, Merger, ReadOptions, Run, RunFormat};
use crate::tables::PartData;
use crate::vocab::torchtitan as tt;

/// What a run location holds and where its files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detected {
    /// `RUN/obs/rank-<R>/part-<N>.parquet`.
    Titan,
    /// torchtitan structured logs: the folder (or prefix) holding the JSONL files, or one file.
    Torchtitan(Source),
    /// One trace file, or a folder of them.
    ChromeTrace(Source),
}

/// What every "not a run" message ends with: the three inputs titan-obs reads.
const WHAT_TO_PASS: &str = "pass a titan run (the folder holding obs/rank-<R>/part-<N>.parquet), \
     a torchtitan run (the folder holding structured_logs/<source>.global_rank_<R>.<stamp>.jsonl, \
     that folder, or one such file) or a Chrome trace (a .json or .json.gz file or a folder of them)";

/// A local path or an object store path under a [`Location`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Local(PathBuf),
    Object(object_store::path::Path),
}

fn is_jsonl(name: &str) -> bool {
    name.ends_with(tt::FILE_SUFFIX)
}

fn is_trace(name: &str) -> bool {
    name.ends_with(".json") || is_gzip_trace(name)
}

/// torch.profiler's `tensorboard_trace_handler` writes `*.pt.trace.json.gz`.
fn is_gzip_trace(name: &str) -> bool {
    name.ends_with(".json.gz")
}

/// A trace decompresses to at most this many times its compressed size (plus 64 MiB): JSON
/// traces compress 10-30x; a damaged length or a crafted file must not exhaust memory.
const MAX_GZIP_RATIO: u64 = 1000;

/// A `.json.gz` trace's JSON. Damage (a bad header, deflate stream or CRC, a cut) is an
/// error naming the file.
fn gunzip(bytes: &[u8], display: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let limit = bytes.len() as u64 * MAX_GZIP_RATIO + (64 << 20);
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .take(limit + 1)
        .read_to_end(&mut out)
        .with_context(|| format!("{display}: damaged gzip"))?;
    if out.len() as u64 > limit {
        bail!("{display}: decompresses to more than {limit} bytes (a damaged or crafted gzip)");
    }
    Ok(out)
}

/// Parses one Chrome trace file, gunzipping a `.json.gz`.
fn parse_trace(bytes: &[u8], display: &str) -> Result<chrome::Parsed> {
    if is_gzip_trace(display) {
        chrome::parse(&gunzip(bytes, display)?, display)
    } else {
        chrome::parse(bytes, display)
    }
}

/// Decides what `location` holds.
pub fn detect(location: &Location) -> Result<Detected> {
    match location {
        Location::Local(path) => detect_local(path),
        Location::Object { url, store, base } => {
            titan_storage::runtime().block_on(async {
                use futures::TryStreamExt;
                // A single object (a trace file or one JSONL file)?
                if !base.as_ref().is_empty() && store.head(base).await.is_ok() {
                    let name = base.filename().unwrap_or_default();
                    return Ok(if is_jsonl(name) {
                        Detected::Torchtitan(Source::Object(base.clone()))
                    } else {
                        Detected::ChromeTrace(Source::Object(base.clone()))
                    });
                }
                // One LIST: its folders and its objects.
                let listed = store
                    .list_with_delimiter(Some(base))
                    .await
                    .with_context(|| format!("listing {url}"))?;
                let listing: Vec<object_store::path::Path> = (listed.common_prefixes.into_iter())
                    .chain(listed.objects.into_iter().map(|m| m.location))
                    .collect();
                let names: Vec<&str> = listing.iter().filter_map(|p| p.filename()).collect();
                if names.contains(&"obs") {
                    return Ok(Detected::Titan);
                }
                if names.contains(&tt::STRUCTURED_LOGS_DIR) {
                    return Ok(Detected::Torchtitan(Source::Object(
                        base.clone().join(tt::STRUCTURED_LOGS_DIR),
                    )));
                }
                if names.iter().any(|n| is_jsonl(n)) {
                    return Ok(Detected::Torchtitan(Source::Object(base.clone())));
                }
                if names.iter().any(|n| is_trace(n)) {
                    return Ok(Detected::ChromeTrace(Source::Object(base.clone())));
                }
                let _ = store.list(Some(base)).try_next().await;
                bail!(
                    "{url} holds no titan run (obs/), torchtitan structured logs (structured_logs/*.jsonl) \
                     or Chrome trace (*.json, *.json.gz) (or wrong credentials/endpoint)"
                )
            })
        }
    }
}

fn detect_local(path: &Path) -> Result<Detected> {
    if !path.exists() {
        // Could not be read (exit 1, as titan-ckpt's missing paths): it may be a run yet to
        // start, or a mount that is not there.
        bail!("{} does not exist; {WHAT_TO_PASS}", path.display());
    }
    if path.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if is_jsonl(name) {
            return Ok(Detected::Torchtitan(Source::Local(path.to_path_buf())));
        }
        if is_trace(name) {
            return Ok(Detected::ChromeTrace(Source::Local(path.to_path_buf())));
        }
        return Err(NotARun(format!(
            "{} is not a run titan-obs can read (a file that is neither .jsonl nor .json / .json.gz); \
             {WHAT_TO_PASS}",
            path.display()
        ))
        .into());
    }
    if path.join("obs").is_dir() {
        return Ok(Detected::Titan);
    }
    if let Some(run) = titan_run_above(path) {
        return Err(NotARun(format!(
            "{} is inside the titan run {}: pass the run folder itself",
            path.display(),
            run.display()
        ))
        .into());
    }
    let logs = path.join(tt::STRUCTURED_LOGS_DIR);
    if logs.is_dir() {
        return Ok(Detected::Torchtitan(Source::Local(logs)));
    }
    let names: Vec<String> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    if names.iter().any(|n| is_jsonl(n)) {
        return Ok(Detected::Torchtitan(Source::Local(path.to_path_buf())));
    }
    if names.iter().any(|n| is_trace(n)) {
        return Ok(Detected::ChromeTrace(Source::Local(path.to_path_buf())));
    }
    Err(NotARun(format!(
        "{} is not a run titan-obs can read: no obs/, structured_logs/, .jsonl or .json in it; \
         {WHAT_TO_PASS}",
        path.display()
    ))
    .into())
}

/// The titan run a folder inside it belongs to: `RUN/obs` or `RUN/obs/rank-<R>` -> `RUN`.
fn titan_run_above(path: &Path) -> Option<PathBuf> {
    let name = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_owned);
    let obs = if name(path).as_deref() == Some("obs") {
        path.to_path_buf()
    } else if name(path).is_some_and(|n| n.starts_with("rank-")) {
        path.parent()
            .filter(|p| name(p).as_deref() == Some("obs"))?
            .to_path_buf()
    } else {
        return None;
    };
    let has_rank_dirs = std::fs::read_dir(&obs).ok()?.any(|e| {
        e.ok()
            .and_then(|e| e.file_name().into_string().ok())
            .is_some_and(|n| n.starts_with("rank-"))
    });
    // `obs` with a relative path has the empty path as parent: the current directory.
    let run = obs.parent()?;
    let run = if run.as_os_str().is_empty() {
        Path::new(".")
    } else {
        run
    };
    has_rank_dirs.then(|| run.to_path_buf())
}

/// Loads the run at `run` once, whatever its format.
pub fn load(run: &str, opts: &ReadOptions) -> Result<Run> {
    let location = Location::parse(run)?;
    match detect(&location)? {
        Detected::Titan => crate::incremental::load_parts(run, opts),
        Detected::Torchtitan(src) => {
            let mut r = TorchtitanReader::new(run, location, src)?;
            r.refresh(opts, true)?;
            Ok(r.into_run(opts.align_clocks))
        }
        Detected::ChromeTrace(src) => load_chrome(run, &location, &src, opts),
    }
}

/// One file of a text-format run: where it is and how big it was when listed.
#[derive(Debug, Clone)]
struct Listed {
    display: String,
    name: String,
    source: Source,
    size: u64,
}

fn list_files(location: &Location, src: &Source, keep: fn(&str) -> bool) -> Result<Vec<Listed>> {
    let mut out = Vec::new();
    match (src, location) {
        (Source::Local(p), _) if p.is_file() => {
            let size = std::fs::metadata(p)
                .with_context(|| format!("reading {}", p.display()))?
                .len();
            out.push(Listed {
                display: p.display().to_string(),
                name: p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                source: src.clone(),
                size,
            });
        }
        (Source::Local(dir), _) => {
            for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
                let e = e?;
                let Ok(name) = e.file_name().into_string() else {
                    continue;
                };
                if !keep(&name) {
                    continue;
                }
                // Follows symlinks (a folder of links to the real logs).
                let size = std::fs::metadata(e.path()).map(|m| m.len()).unwrap_or(0);
                out.push(Listed {
                    display: e.path().display().to_string(),
                    name,
                    source: Source::Local(e.path()),
                    size,
                });
            }
        }
        (Source::Object(prefix), Location::Object { url, store, base }) => {
            let rt = titan_storage::runtime();
            let shown = |p: &object_store::path::Path| {
                let rel = p.as_ref().strip_prefix(base.as_ref()).unwrap_or(p.as_ref());
                format!("{url}/{}", rel.trim_start_matches('/'))
            };
            if let Ok(meta) = rt.block_on(store.head(prefix)) {
                out.push(Listed {
                    display: shown(&meta.location),
                    name: meta.location.filename().unwrap_or_default().to_string(),
                    source: Source::Object(meta.location.clone()),
                    size: meta.size,
                });
            } else {
                let listing = rt
                    .block_on(store.list_with_delimiter(Some(prefix)))
                    .with_context(|| format!("listing {}", shown(prefix)))?;
                for m in listing.objects {
                    let name = m.location.filename().unwrap_or_default().to_string();
                    if !keep(&name) {
                        continue;
                    }
                    out.push(Listed {
                        display: shown(&m.location),
                        name,
                        source: Source::Object(m.location.clone()),
                        size: m.size,
                    });
                }
            }
        }
        (Source::Object(_), Location::Local(_)) => bail!("an object path under a local run"),
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The bytes `range` of a listed file.
fn read_range(location: &Location, f: &Listed, range: std::ops::Range<u64>) -> Result<Bytes> {
    match (&f.source, location) {
        (Source::Local(p), _) => {
            let file = std::fs::File::open(p).with_context(|| format!("opening {}", f.display))?;
            let len = range.end - range.start;
            if len == 0 {
                return Ok(Bytes::Empty);
            }
            // SAFETY: the map is read-only; a writer appending to the file does not change the
            // bytes mapped (a writer truncating it would: torchtitan's logger only appends).
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(range.start)
                    .len(len as usize)
                    .map(&file)
            }
            .with_context(|| format!("mapping {}", f.display))?;
            Ok(Bytes::Mapped(map))
        }
        (Source::Object(path), Location::Object { store, .. }) => {
            let rt = titan_storage::runtime();
            let b = rt
                .block_on(store.get_range(path, range))
                .with_context(|| format!("downloading {}", f.display))?;
            Ok(Bytes::Owned(b))
        }
        (Source::Object(_), Location::Local(_)) => bail!("an object path under a local run"),
    }
}

/// File content, mapped or downloaded.
enum Bytes {
    Empty,
    Mapped(memmap2::Mmap),
    Owned(bytes::Bytes),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Empty => &[],
            Bytes::Mapped(m) => m,
            Bytes::Owned(b) => b,
        }
    }
}

/// A torchtitan run kept open: per-file cursors and the closed records read so far.
pub struct TorchtitanReader {
    location: Location,
    src: Source,
    cursors: Vec<jsonl::FileCursor>,
    /// Closed records, names and tags of everything read so far.
    run: Run,
    merger: Merger,
}

/// What one [`TorchtitanReader::refresh`] read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Refresh {
    pub new_files: usize,
    pub bytes: u64,
    pub lines: u64,
}

impl Refresh {
    /// True when the refresh read anything.
    pub fn changed(&self) -> bool {
        self.new_files > 0 || self.bytes > 0 || self.lines > 0
    }
}

impl TorchtitanReader {
    fn new(run: &str, location: Location, src: Source) -> Result<Self> {
        Ok(TorchtitanReader {
            location,
            src,
            cursors: Vec::new(),
            run: Run {
                location: run.to_string(),
                ..Default::default()
            },
            merger: Merger::default(),
        })
    }

    /// Reads what was appended since the last call (new files from their start). With
    /// `at_end`, a last line without its newline is parsed (or reported as truncated);
    /// otherwise it waits for the writer to finish it.
    pub fn refresh(&mut self, opts: &ReadOptions, at_end: bool) -> Result<Refresh> {
        let listed = list_files(&self.location, &self.src, is_jsonl)?;
        if listed.is_empty() {
            bail!(
                "{}: no torchtitan structured-log files (*.jsonl) found",
                self.run.location
            );
        }
        let mut stats = Refresh::default();
        // Cursor per listed file, new files get new cursors.
        let mut work: Vec<(usize, Listed)> = Vec::new();
        for f in listed {
            let ix = match self.cursors.iter().position(|c| c.display == f.display) {
                Some(ix) => ix,
                None => {
                    let rank = tt::rank_of_file_name(&f.name).unwrap_or(u32::MAX);
                    let file_ix = self.cursors.len() as u64;
                    self.cursors
                        .push(jsonl::FileCursor::new(f.display.clone(), rank, file_ix));
                    stats.new_files += 1;
                    self.cursors.len() - 1
                }
            };
            if f.size > self.cursors[ix].offset {
                work.push((ix, f));
            }
        }
        // Files without a rank in their name get ranks after the named ones.
        let mut next_rank = self
            .cursors
            .iter()
            .filter(|c| c.rank != u32::MAX)
            .map(|c| c.rank + 1)
            .max()
            .unwrap_or(0);
        for c in &mut self.cursors {
            if c.rank == u32::MAX {
                c.rank = next_rank;
                next_rank += 1;
            }
        }
        // Parse in parallel a few files at a time (each file's text is mapped only while it
        // is parsed), merge in file order.
        let chunk = rayon::current_num_threads().max(1) * 2;
        let location = &self.location;
        for batch in work.chunks(chunk) {
            let mut cursors: Vec<(usize, jsonl::FileCursor)> = batch
                .iter()
                .map(|(ix, _)| (*ix, self.cursors[*ix].clone()))
                .collect();
            let results: Vec<Result<(PartData, jsonl::Parsed, LoadReport)>> = cursors
                .par_iter_mut()
                .zip(batch.par_iter())
                .map(|((_, cursor), (_, f))| {
                    let bytes = read_range(location, f, cursor.offset..f.size)?;
                    let mut report = LoadReport::default();
                    let (data, parsed) = cursor.parse(&bytes, at_end, &mut report);
                    if let Some(cb) = &opts.progress {
                        cb(1);
                    }
                    Ok((data, parsed, report))
                })
                .collect();
            for ((ix, cursor), result) in cursors.into_iter().zip(results) {
                let (data, parsed, report) = result?;
                self.cursors[ix] = cursor;
                stats.bytes += parsed.bytes;
                stats.lines += parsed.lines;
                let r = &mut self.run.report;
                r.rows_read += parsed.lines as usize;
                r.parts_read += data.info.parts;
                r.malformed_lines += report.malformed_lines;
                for b in report.bad_lines {
                    if r.bad_lines.len() < crate::run::MAX_NAMED_BAD_LINES {
                        r.bad_lines.push(b);
                    }
                }
                for t in report.truncated_tails {
                    if !r.truncated_tails.contains(&t) {
                        r.truncated_tails.push(t);
                    }
                }
                self.merger.merge(&mut self.run, data.into(), false);
            }
        }
        self.run.report.bytes_parsed = stats.bytes;
        Ok(stats)
    }

    /// The run as read so far: closed records, open spans up to their process's last record,
    /// and (with `align`) hosts aligned on shared step starts.
    pub fn snapshot(&self, align: bool) -> Run {
        let mut run = self.run.clone();
        let mut merger = self.merger.clone();
        self.finish(&mut run, &mut merger, align);
        run
    }

    /// Like [`Self::snapshot`] without copying.
    pub fn into_run(mut self, align: bool) -> Run {
        let mut run = std::mem::take(&mut self.run);
        let mut merger = std::mem::take(&mut self.merger);
        self.finish(&mut run, &mut merger, align);
        run
    }

    fn finish(&self, run: &mut Run, merger: &mut Merger, align: bool) {
        for c in &self.cursors {
            let (data, open) = c.open_spans();
            if !open.is_empty() {
                merger.merge(run, data.into(), false);
                run.report.open_spans.extend(open);
            }
        }
        merger.publish(run);
        let world = run.ranks.keys().next_back().map_or(0, |r| r + 1);
        for info in run.ranks.values_mut() {
            info.world_size = world;
        }
        run.report.world_size = world;
        run.report.missing_ranks = (0..world).filter(|r| !run.ranks.contains_key(r)).collect();
        run.report.format = RunFormat::Torchtitan;
        if align {
            run.report.clock_alignment = skew::align_hosts(run);
        }
    }

    /// Bytes consumed so far per file (for tests and `--follow` diagnostics).
    pub fn offsets(&self) -> Vec<(String, u64)> {
        self.cursors
            .iter()
            .map(|c| (c.display.clone(), c.offset))
            .collect()
    }
}

fn load_chrome(run: &str, location: &Location, src: &Source, opts: &ReadOptions) -> Result<Run> {
    let files = list_files(location, src, is_trace)?;
    if files.is_empty() {
        bail!("{run}: no Chrome trace files (*.json, *.json.gz) found");
    }
    let multi = files.len() > 1;
    let parsed: Vec<(Listed, Result<chrome::Parsed>)> = files
        .into_par_iter()
        .map(|f| {
            let r = read_range(location, &f, 0..f.size).and_then(|b| parse_trace(&b, &f.display));
            if let Some(cb) = &opts.progress {
                cb(1);
            }
            (f, r)
        })
        .collect();
    let mut out = Run {
        location: run.to_string(),
        ..Default::default()
    };
    let mut merger = Merger::default();
    let mut next_rank = 0u32;
    // Files whose ranks are their own, by rank: one rank in two of them is two runs.
    let mut owner: HashMap<u32, String> = HashMap::new();
    let mut clashes: Vec<(String, String, u32)> = Vec::new();
    for (f, result) in parsed {
        match result {
            Ok(p) => {
                if p.ranked {
                    for part in &p.parts {
                        match owner.get(&part.info.rank) {
                            Some(other) if *other != f.display => {
                                clashes.push((other.clone(), f.display.clone(), part.info.rank))
                            }
                            _ => {
                                owner.insert(part.info.rank, f.display.clone());
                            }
                        }
                    }
                }
                out.report.parts_read += 1;
                out.report.rows_read += p.events;
                out.report.open_spans.extend(p.open);
                for mut part in p.parts {
                    // Files whose processes carry no rank of their own: one rank per process.
                    if multi && part.info.rank < next_rank && !out.ranks.is_empty() {
                        let r = next_rank;
                        relabel(&mut part, r);
                    }
                    next_rank = next_rank.max(part.info.rank + 1);
                    merger.merge(&mut out, part.into(), false);
                }
            }
            Err(e) => out.report.corrupt_parts.push(crate::run::CorruptPart {
                path: f.display,
                error: format!("{e:#}"),
            }),
        }
    }
    if out.report.parts_read == 0 {
        // Not one file parsed as a trace: the wrong input, not a trace with damage.
        let why: Vec<String> = out
            .report
            .corrupt_parts
            .iter()
            .take(3)
            .map(|c| format!("{}: {}", c.path, c.error))
            .collect();
        return Err(NotARun(format!(
            "{run} is not a Chrome trace ({}); {WHAT_TO_PASS}",
            why.join("; ")
        ))
        .into());
    }
    if let Some((a, b, rank)) = clashes.first() {
        // Traces of several runs (each naming its ranks): merging them would show one run of
        // every rank they hold, which never ran (issue 39: four 2-rank runs opened as one
        // 8-rank run). Which one to read is the caller's choice, as `--run ID` is for titan
        // runs; a trace file names no run id to pick by, so the file is what to pass.
        let files: BTreeSet<&str> = clashes
            .iter()
            .flat_map(|(a, b, _)| [a.as_str(), b.as_str()])
            .collect();
        return Err(NotARun(format!(
            "{run} holds Chrome traces of more than one run: {a} and {b} both hold rank {rank} \
             ({} files hold the same ranks: {}); pass one trace file, or a folder holding one \
             run's traces",
            files.len(),
            files.into_iter().collect::<Vec<_>>().join(", ")
        ))
        .into());
    }
    merger.publish(&mut out);
    let world = out.ranks.keys().next_back().map_or(0, |r| r + 1);
    out.report.world_size = world;
    out.report.format = RunFormat::ChromeTrace;
    if opts.align_clocks {
        out.report.clock_alignment = skew::align_hosts(&mut out);
    }
    Ok(out)
}

fn relabel(part: &mut PartData, rank: u32) {
    part.info.rank = rank;
    for v in [
        &mut part.spans.rank,
        &mut part.instants.rank,
        &mut part.scalars.rank,
        &mut part.errors.rank,
    ] {
        v.fill(rank);
    }
}

/// A run kept open for `--follow`: reads only what is new on each refresh.
pub enum Follower {
    /// torchtitan JSONL: incremental per file.
    Torchtitan(Box<TorchtitanReader>),
    /// titan parts and Chrome traces: re-read when their listing changes.
    Reload { run: String },
}

impl Follower {
    pub fn open(run: &str) -> Result<Follower> {
        let location = Location::parse(run)?;
        Ok(match detect(&location)? {
            Detected::Torchtitan(src) => {
                Follower::Torchtitan(Box::new(TorchtitanReader::new(run, location, src)?))
            }
            Detected::Titan | Detected::ChromeTrace(_) => Follower::Reload {
                run: run.to_string(),
            },
        })
    }

    /// Reads what is new and returns the run as it stands. `at_end`: the writers are done
    /// (a last line without its newline is parsed or reported, not waited for).
    pub fn refresh(&mut self, opts: &ReadOptions, at_end: bool) -> Result<(Run, Refresh)> {
        match self {
            Follower::Torchtitan(r) => {
                let stats = r.refresh(opts, at_end)?;
                Ok((r.snapshot(opts.align_clocks), stats))
            }
            Follower::Reload { run } => {
                let run = load(run, opts)?;
                let stats = Refresh {
                    new_files: 0,
                    bytes: 0,
                    lines: run.report.rows_read as u64,
                };
                Ok((run, stats))
            }
        }
    }

    /// Whether refreshes read only appended data.
    pub fn is_incremental(&self) -> bool {
        matches!(self, Follower::Torchtitan(_))
    }
}
