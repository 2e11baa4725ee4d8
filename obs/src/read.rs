//! Reading a run back: every rank's parts, decoded in parallel into typed columnar tables.
//!
//! [`load`] never fails because of one bad part or a missing rank: those are listed in
//! [`LoadReport`] and the rest is loaded. It fails only when the run location itself cannot
//! be read. Only the columns asked for in [`Columns`] are decoded; names and tags are
//! interned into run-wide dictionaries ([`Run::names`], [`Run::tags`]) so the tables hold
//! small integer ids.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use arrow::array::{
    Array, AsArray, DictionaryArray, Float64Array, Int64Array, StringArray, UInt16Array,
    UInt32Array, UInt64Array,
};
use arrow::datatypes::{Int32Type, UInt16Type, UInt32Type, UInt64Type};
use bytes::Bytes;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use rayon::prelude::*;

use object_store::ObjectStoreExt as _;

use crate::location::{Location, parse_part_file_name, parse_rank_dir_name};
use crate::record::NO_STEP;
use crate::schema::{Kind, Reduce, col, meta};

/// Index into [`Run::names`].
pub type NameId = u32;

/// A set of step tags: bit i = [`Run::tags`]`[i]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TagSet(pub u64);

impl TagSet {
    pub fn contains(self, tag: u32) -> bool {
        tag < 64 && self.0 & (1 << tag) != 0
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn iter(self) -> impl Iterator<Item = u32> {
        (0..64u32).filter(move |i| self.0 & (1 << i) != 0)
    }
}

/// Which optional columns to decode. Rank, kind, name, step, duration and value are always read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    /// `start_ns` (needed for timelines and exports).
    pub start: bool,
    /// `thread`.
    pub thread: bool,
    /// `depth`.
    pub depth: bool,
    /// `seq`, `parent` (the exact span tree).
    pub links: bool,
    /// `tags` (step tags; needed for checkpoint/validation step costs).
    pub tags: bool,
    /// `message` of error records.
    pub messages: bool,
}

impl Columns {
    pub const ALL: Columns = Columns {
        start: true,
        thread: true,
        depth: true,
        links: true,
        tags: true,
        messages: true,
    };
    /// What `summary` needs: durations per rank/phase/step, depth and step tags.
    pub const SUMMARY: Columns = Columns {
        start: false,
        thread: false,
        depth: true,
        links: false,
        tags: true,
        messages: false,
    };
    /// What `metrics` needs: scalars and step tags.
    pub const METRICS: Columns = Columns {
        start: false,
        thread: false,
        depth: false,
        links: false,
        tags: false,
        messages: false,
    };
}

/// Reading options.
#[derive(Clone)]
pub struct ReadOptions {
    pub columns: Columns,
    /// Add each rank's footer clock offset to its times, putting all ranks on rank 0's clock.
    pub align_clocks: bool,
    /// Called with the number of parts finished, as they finish (for progress bars).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            columns: Columns::ALL,
            align_clocks: true,
            progress: None,
        }
    }
}

impl ReadOptions {
    pub fn with_columns(columns: Columns) -> Self {
        ReadOptions {
            columns,
            ..Default::default()
        }
    }
}

/// Span records, one entry per span in every column (columns not asked for stay empty).
#[derive(Debug, Default, Clone)]
pub struct Spans {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    /// [`NO_STEP`] when recorded before the first step.
    pub step: Vec<u64>,
    pub dur_ns: Vec<i64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub depth: Vec<u16>,
    pub seq: Vec<u64>,
    /// Seq of the enclosing span in the same thread; 0 for top-level spans.
    pub parent: Vec<u64>,
}

impl Spans {
    /// Grows every column already in use to hold `n` spans in total.
    fn reserve(&mut self, n: usize) {
        fn r<T>(v: &mut Vec<T>, n: usize) {
            if !v.is_empty() {
                v.reserve_exact(n.saturating_sub(v.len()));
            }
        }
        r(&mut self.rank, n);
        r(&mut self.name, n);
        r(&mut self.step, n);
        r(&mut self.dur_ns, n);
        r(&mut self.start_ns, n);
        r(&mut self.thread, n);
        r(&mut self.depth, n);
        r(&mut self.seq, n);
        r(&mut self.parent, n);
    }

    pub fn len(&self) -> usize {
        self.rank.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rank.is_empty()
    }
}

/// Instant (point event) records.
#[derive(Debug, Default, Clone)]
pub struct Instants {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub depth: Vec<u16>,
    pub parent: Vec<u64>,
}

/// Scalar records.
#[derive(Debug, Default, Clone)]
pub struct Scalars {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub value: Vec<f64>,
    pub reduce: Vec<Reduce>,
    pub start_ns: Vec<i64>,
}

/// Error records.
#[derive(Debug, Default, Clone)]
pub struct Errors {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub parent: Vec<u64>,
    pub message: Vec<String>,
}

/// Who a rank was, from its parts' footers.
#[derive(Debug, Clone, Default)]
pub struct RankInfo {
    pub rank: u32,
    pub run_id: String,
    pub source: String,
    pub host: String,
    pub pid: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub clock_offset_ns: i64,
    pub threads: BTreeMap<u32, String>,
    pub run_metadata: serde_json::Map<String, serde_json::Value>,
    pub parts: usize,
}

/// A part that could not be read, by name.
#[derive(Debug, Clone)]
pub struct CorruptPart {
    pub path: String,
    pub error: String,
}

/// What kind of files a run was read from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunFormat {
    /// titan's Parquet parts (`RUN/obs/rank-<R>/part-<N>.parquet`).
    #[default]
    Titan,
    /// torchtitan's structured-logger JSONL (`RUN/structured_logs/*.global_rank_<R>.*.jsonl`).
    Torchtitan,
    /// Chrome trace-event JSON (torchtitan's gantt, PyTorch profiler traces, titan's export).
    ChromeTrace,
}

impl RunFormat {
    pub fn describe(self) -> &'static str {
        match self {
            RunFormat::Titan => "titan parts",
            RunFormat::Torchtitan => "torchtitan structured logs",
            RunFormat::ChromeTrace => "Chrome trace",
        }
    }
}

/// A line of a text log that is not a record, by file and 1-based line number.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BadLine {
    pub file: String,
    pub line: u64,
    pub error: String,
}

/// A span whose end was never logged (the process crashed or is still inside it): shown
/// as lasting until the last record its process wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpenSpan {
    pub file: String,
    pub rank: u32,
    pub name: String,
    /// `None` outside steps.
    pub step: Option<u64>,
    pub start_ns: i64,
    /// Start to the process's last record.
    pub shown_dur_ns: i64,
}

/// Per-host clock offsets applied to a run whose records carry only each host's wall clock.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClockAlignment {
    /// How the offsets were found.
    pub method: String,
    /// The host the others were aligned to.
    pub reference_host: String,
    pub hosts: Vec<HostOffset>,
}

/// One host's offset: added to every time of its ranks.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HostOffset {
    pub host: String,
    pub ranks: Vec<u32>,
    pub offset_ns: i64,
    /// Steps whose start both this host and the reference host logged.
    pub steps_used: u64,
}

/// At most this many malformed lines are named one by one (all are counted).
pub const MAX_NAMED_BAD_LINES: usize = 100;

/// What was found and what was not.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub format: RunFormat,
    /// The largest world size any footer declares (0 when no part could be read).
    pub world_size: u32,
    /// Ranks below `world_size` with no readable part.
    pub missing_ranks: Vec<u32>,
    pub corrupt_parts: Vec<CorruptPart>,
    /// Parts (or JSONL / trace files) read.
    pub parts_read: usize,
    /// Records (rows, JSONL lines or trace events) read.
    pub rows_read: usize,
    /// Bytes of text logs parsed by the last read (for `--follow`: only what was new).
    pub bytes_parsed: u64,
    /// Malformed lines of text logs: all counted, the first [`MAX_NAMED_BAD_LINES`] named.
    pub malformed_lines: u64,
    pub bad_lines: Vec<BadLine>,
    /// Files whose last line is cut short (a running or killed writer): ignored, not an error.
    pub truncated_tails: Vec<String>,
    pub open_spans: Vec<OpenSpan>,
    /// Set when ranks on different hosts were put on one clock by the analysis.
    pub clock_alignment: Option<ClockAlignment>,
}

impl LoadReport {
    pub fn is_complete(&self) -> bool {
        self.missing_ranks.is_empty() && self.corrupt_parts.is_empty() && self.malformed_lines == 0
    }

    /// Counts a malformed line, naming it while fewer than [`MAX_NAMED_BAD_LINES`] are named.
    pub fn add_bad_line(&mut self, bad: BadLine) {
        self.malformed_lines += 1;
        if self.bad_lines.len() < MAX_NAMED_BAD_LINES {
            self.bad_lines.push(bad);
        }
    }
}

/// A loaded run.
#[derive(Debug, Default, Clone)]
pub struct Run {
    pub location: String,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub spans: Spans,
    pub instants: Instants,
    pub scalars: Scalars,
    pub errors: Errors,
    pub ranks: BTreeMap<u32, RankInfo>,
    /// Union of the tags seen on any record of (rank, step).
    pub step_tags: BTreeMap<(u32, u64), TagSet>,
    pub report: LoadReport,
}

impl Run {
    pub fn name(&self, id: NameId) -> &str {
        &self.names[id as usize]
    }
    pub fn name_id(&self, name: &str) -> Option<NameId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| i as NameId)
    }
    pub fn tag_id(&self, tag: &str) -> Option<u32> {
        self.tags.iter().position(|t| t == tag).map(|i| i as u32)
    }
    /// Steps that any rank tagged with `tag`.
    pub fn steps_tagged(&self, tag: &str) -> BTreeSet<u64> {
        let Some(id) = self.tag_id(tag) else {
            return BTreeSet::new();
        };
        self.step_tags
            .iter()
            .filter(|(_, t)| t.contains(id))
            .map(|((_, s), _)| *s)
            .collect()
    }
    /// Tag names of (rank, step).
    pub fn tag_names(&self, rank: u32, step: u64) -> Vec<&str> {
        self.step_tags
            .get(&(rank, step))
            .map(|t| t.iter().map(|i| self.tags[i as usize].as_str()).collect())
            .unwrap_or_default()
    }
}

/// Loads a run in any format titan-obs reads: titan parts, torchtitan structured logs or
/// Chrome traces, local or on an object store (detected by [`crate::ingest::detect`]).
pub fn load(run: &str, opts: &ReadOptions) -> Result<Run> {
    crate::ingest::load(run, opts)
}

/// Loads every rank's parts of the titan run at `run` (local dir or object store URL).
pub fn load_parts(run: &str, opts: &ReadOptions) -> Result<Run> {
    let location = Location::parse(run)?;
    let listing = list_parts(&location)?;
    let mut run_out = Run {
        location: run.to_string(),
        ..Default::default()
    };
    let mut merger = Merger::default();
    let mut rank_dirs_seen: BTreeSet<u32> = listing.rank_dirs.clone();
    let mut ok_ranks: BTreeSet<u32> = BTreeSet::new();
    let mut world_size = 0u32;

    // Decode in chunks: parallel within a chunk, merged (and freed) between chunks, so peak
    // memory is the final tables plus one chunk of decoded parts.
    let chunk = rayon::current_num_threads().max(1) * 4;
    let runtime = match &location {
        Location::Object { .. } => Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?,
        ),
        Location::Local(_) => None,
    };
    let total_parts = listing.parts.len();
    let mut parts_done = 0usize;
    for parts in listing.parts.chunks(chunk) {
        let decoded: Vec<(PartRef, Result<PartData>)> = match &location {
            Location::Local(_) => parts
                .par_iter()
                .map(|p| {
                    let r = std::fs::read(&p.display)
                        .with_context(|| format!("reading {}", p.display))
                        .and_then(|b| decode_part(Bytes::from(b), p, opts));
                    if let Some(cb) = &opts.progress {
                        cb(1);
                    }
                    (p.clone(), r)
                })
                .collect(),
            Location::Object { store, .. } => {
                let rt = runtime.as_ref().expect("object runs have a runtime");
                let fetched: Vec<(PartRef, Result<Bytes>)> = rt.block_on(async {
                    use futures::StreamExt;
                    futures::stream::iter(parts.iter().cloned())
                        .map(|p| {
                            let store = store.clone();
                            async move {
                                let path = p.object_path.clone().expect("object parts have paths");
                                let r = async { store.get(&path).await?.bytes().await }
                                    .await
                                    .with_context(|| format!("downloading {}", p.display));
                                (p, r)
                            }
                        })
                        .buffer_unordered(16)
                        .collect()
                        .await
                });
                fetched
                    .into_par_iter()
                    .map(|(p, b)| {
                        let r = b.and_then(|b| decode_part(b, &p, opts));
                        if let Some(cb) = &opts.progress {
                            cb(1);
                        }
                        (p, r)
                    })
                    .collect()
            }
        };
        parts_done += decoded.len();
        for (part, result) in decoded {
            match result {
                Ok(data) => {
                    world_size = world_size.max(data.info.world_size);
                    ok_ranks.insert(data.info.rank);
                    rank_dirs_seen.insert(data.info.rank);
                    run_out.report.parts_read += 1;
                    run_out.report.rows_read += data.rows;
                    merger.merge(&mut run_out, data, opts.align_clocks);
                }
                Err(e) => run_out.report.corrupt_parts.push(CorruptPart {
                    path: part.display.clone(),
                    error: format!("{e:#}"),
                }),
            }
        }
        if parts_done == parts.len() && parts_done < total_parts {
            // After the first chunk, reserve for the whole run (+5%) so the big columns grow
            // once instead of doubling (which would transiently need 2x the memory).
            let scale = total_parts as f64 / parts_done as f64 * 1.05;
            run_out
                .spans
                .reserve((run_out.spans.len() as f64 * scale) as usize);
        }
    }
    let expected = world_size.max(rank_dirs_seen.iter().next_back().map_or(0, |r| r + 1));
    run_out.report.world_size = expected;
    run_out.report.missing_ranks = (0..expected).filter(|r| !ok_ranks.contains(r)).collect();
    merger.publish(&mut run_out);
    run_out.report.format = RunFormat::Titan;
    Ok(run_out)
}

/// One part to read.
#[derive(Debug, Clone)]
struct PartRef {
    rank: u32,
    /// Local path or URL, for messages (and the local path to read).
    display: String,
    object_path: Option<object_store::path::Path>,
}

struct Listing {
    rank_dirs: BTreeSet<u32>,
    parts: Vec<PartRef>,
}

fn list_parts(location: &Location) -> Result<Listing> {
    let mut rank_dirs = BTreeSet::new();
    let mut parts = Vec::new();
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
            for entry in
                std::fs::read_dir(&obs).with_context(|| format!("listing {}", obs.display()))?
            {
                let entry = entry?;
                let Some(rank) = entry.file_name().to_str().and_then(parse_rank_dir_name) else {
                    continue;
                };
                rank_dirs.insert(rank);
                let dir = entry.path();
                let mut files: Vec<(u64, String)> = std::fs::read_dir(&dir)
                    .with_context(|| format!("listing {}", dir.display()))?
                    .filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let n = parse_part_file_name(e.file_name().to_str()?)?;
                        Some((n, e.path().display().to_string()))
                    })
                    .collect();
                files.sort();
                parts.extend(files.into_iter().map(|(_, display)| PartRef {
                    rank,
                    display,
                    object_path: None,
                }));
            }
        }
        Location::Object { url, store, base } => {
            use futures::TryStreamExt;
            let prefix = base.clone().join("obs");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let metas: Vec<object_store::ObjectMeta> = rt
                .block_on(store.list(Some(&prefix)).try_collect())
                .with_context(|| format!("listing {url}/obs"))?;
            if metas.is_empty() {
                bail!(
                    "{url}/obs/ holds no objects: not a titan run (or wrong credentials/endpoint)"
                );
            }
            let mut found: Vec<(u32, u64, PartRef)> = Vec::new();
            for m in metas {
                let parts_of: Vec<&str> = m.location.as_ref().rsplitn(3, '/').collect();
                let [file, rank_dir, ..] = parts_of.as_slice() else {
                    continue;
                };
                let (Some(rank), Some(n)) =
                    (parse_rank_dir_name(rank_dir), parse_part_file_name(file))
                else {
                    continue;
                };
                rank_dirs.insert(rank);
                found.push((
                    rank,
                    n,
                    PartRef {
                        rank,
                        display: format!("{url}/obs/{rank_dir}/{file}"),
                        object_path: Some(m.location.clone()),
                    },
                ));
            }
            found.sort_by_key(|(r, n, _)| (*r, *n));
            parts = found.into_iter().map(|(_, _, p)| p).collect();
        }
    }
    // Interleave ranks so parallel chunks spread across ranks (and sort for determinism).
    parts.sort_by(|a, b| (a.rank, &a.display).cmp(&(b.rank, &b.display)));
    Ok(Listing { rank_dirs, parts })
}

/// One decoded part (or a slice of another format's file) with part-local name/tag ids:
/// what [`Merger`] appends to a [`Run`].
#[derive(Default)]
pub(crate) struct PartData {
    pub(crate) info: RankInfo,
    pub(crate) rows: usize,
    pub(crate) names: Vec<String>,
    pub(crate) tags: Vec<String>,
    pub(crate) spans: Spans,
    pub(crate) instants: Instants,
    pub(crate) scalars: Scalars,
    pub(crate) errors: Errors,
    /// Step -> bit mask over `tags`.
    pub(crate) step_tags: HashMap<u64, u64>,
}

fn footer_value<'a>(kv: &'a HashMap<String, String>, key: &str) -> Result<&'a str> {
    kv.get(key)
        .map(String::as_str)
        .with_context(|| format!("footer metadata key `{key}` is missing (not a titan part?)"))
}

// The row loop's index walks a dozen parallel columns at once.
#[allow(clippy::needless_range_loop)]
fn decode_part(bytes: Bytes, part: &PartRef, opts: &ReadOptions) -> Result<PartData> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).context("invalid Parquet")?;
    let kv: HashMap<String, String> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|k| Some((k.key.clone(), k.value.clone()?)))
                .collect()
        })
        .unwrap_or_default();
    let rank: u32 = footer_value(&kv, meta::RANK)?
        .parse()
        .context("footer `titan.rank` is not a number")?;
    if rank != part.rank {
        bail!(
            "footer says rank {rank} but the part is in rank-{}",
            part.rank
        );
    }
    let info = RankInfo {
        rank,
        run_id: footer_value(&kv, meta::RUN_ID)?.to_string(),
        source: footer_value(&kv, meta::SOURCE)?.to_string(),
        host: kv.get(meta::HOST).cloned().unwrap_or_default(),
        pid: kv.get(meta::PID).and_then(|v| v.parse().ok()).unwrap_or(0),
        local_rank: kv
            .get(meta::LOCAL_RANK)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        world_size: footer_value(&kv, meta::WORLD_SIZE)?
            .parse()
            .context("footer `titan.world_size` is not a number")?,
        clock_offset_ns: kv
            .get(meta::CLOCK_OFFSET_NS)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        threads: kv
            .get(meta::THREADS)
            .and_then(|v| serde_json::from_str::<BTreeMap<String, String>>(v).ok())
            .map(|m| {
                m.into_iter()
                    .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
                    .collect()
            })
            .unwrap_or_default(),
        run_metadata: kv
            .get(meta::RUN_METADATA)
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or_default(),
        parts: 1,
    };

    let c = opts.columns;
    let mut wanted = vec![
        col::KIND,
        col::NAME,
        col::STEP,
        col::DUR_NS,
        col::VALUE,
        col::REDUCE,
    ];
    if c.start {
        wanted.push(col::START_NS);
    }
    if c.thread {
        wanted.push(col::THREAD);
    }
    if c.depth {
        wanted.push(col::DEPTH);
    }
    if c.links {
        wanted.extend([col::SEQ, col::PARENT]);
    }
    if c.tags {
        wanted.push(col::TAGS);
    }
    if c.messages {
        wanted.push(col::MESSAGE);
    }
    let schema = builder.schema().clone();
    let mut roots = Vec::new();
    for w in &wanted {
        let idx = schema
            .index_of(w)
            .map_err(|_| anyhow::anyhow!("column `{w}` is missing"))?;
        roots.push(idx);
    }
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(64 * 1024)
        .build()
        .context("opening the Parquet reader")?;

    let mut out = PartData {
        info,
        rows: 0,
        names: Vec::new(),
        tags: Vec::new(),
        spans: Spans::default(),
        instants: Instants::default(),
        scalars: Scalars::default(),
        errors: Errors::default(),
        step_tags: HashMap::new(),
    };
    let mut name_ids: HashMap<String, u32> = HashMap::new();
    let mut tag_ids: HashMap<String, u32> = HashMap::new();
    for batch in reader {
        let batch = batch.context("decoding a row group")?;
        let n = batch.num_rows();
        out.rows += n;
        let get = |name: &str| {
            batch
                .column_by_name(name)
                .with_context(|| format!("column `{name}` missing from batch"))
        };
        // Kind dictionaries are tiny; map their values once per batch.
        let kind_dict = get(col::KIND)?
            .as_dictionary_opt::<Int32Type>()
            .context("`kind` is not dictionary<int32, utf8>")?;
        let kind_values = kind_dict
            .values()
            .as_string_opt::<i32>()
            .context("`kind` values are not utf8")?;
        let kind_of_key: Vec<Kind> = (0..kind_values.len())
            .map(|i| kind_values.value(i).parse().map_err(anyhow::Error::msg))
            .collect::<Result<_>>()?;
        let kind_keys = kind_dict.keys();
        let names = dict_to_local(get(col::NAME)?, &mut name_ids, &mut out.names)?;
        let step = get(col::STEP)?
            .as_primitive_opt::<UInt64Type>()
            .context("`step` is not uint64")?;
        let dur = get(col::DUR_NS)?
            .as_any()
            .downcast_ref::<Int64Array>()
            .context("`dur_ns` is not int64")?;
        let value = get(col::VALUE)?
            .as_any()
            .downcast_ref::<Float64Array>()
            .context("`value` is not float64")?;
        let reduce_dict = get(col::REDUCE)?
            .as_dictionary_opt::<Int32Type>()
            .context("`reduce` is not dictionary<int32, utf8>")?;
        let reduce_values = reduce_dict
            .values()
            .as_string_opt::<i32>()
            .context("`reduce` values are not utf8")?;
        // Parsed lazily per key: a part whose rows are all non-scalars stores only nulls, and
        // parquet may then hand back a placeholder dictionary (e.g. `[""]`) that no row uses.
        let reduce_of_key: Vec<std::result::Result<Reduce, String>> = (0..reduce_values.len())
            .map(|i| reduce_values.value(i).parse())
            .collect();
        let start = if c.start {
            Some(
                get(col::START_NS)?
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .context("`start_ns` is not int64")?,
            )
        } else {
            None
        };
        let thread: Option<&UInt32Array> = if c.thread {
            Some(
                get(col::THREAD)?
                    .as_primitive_opt::<UInt32Type>()
                    .context("`thread` is not uint32")?,
            )
        } else {
            None
        };
        let depth: Option<&UInt16Array> = if c.depth {
            Some(
                get(col::DEPTH)?
                    .as_primitive_opt::<UInt16Type>()
                    .context("`depth` is not uint16")?,
            )
        } else {
            None
        };
        let (seq, parent): (Option<&UInt64Array>, Option<&UInt64Array>) = if c.links {
            (
                Some(
                    get(col::SEQ)?
                        .as_primitive_opt::<UInt64Type>()
                        .context("`seq` is not uint64")?,
                ),
                Some(
                    get(col::PARENT)?
                        .as_primitive_opt::<UInt64Type>()
                        .context("`parent` is not uint64")?,
                ),
            )
        } else {
            (None, None)
        };
        let tags = if c.tags {
            Some(
                get(col::TAGS)?
                    .as_list_opt::<i32>()
                    .context("`tags` is not list<utf8>")?,
            )
        } else {
            None
        };
        let message: Option<&StringArray> = if c.messages {
            Some(
                get(col::MESSAGE)?
                    .as_string_opt::<i32>()
                    .context("`message` is not utf8")?,
            )
        } else {
            None
        };

        let step_at = |i: usize| {
            if step.is_null(i) {
                NO_STEP
            } else {
                step.value(i)
            }
        };
        for i in 0..n {
            if kind_keys.is_null(i) {
                bail!("row {i}: `kind` is null");
            }
            let kind = *kind_of_key
                .get(kind_keys.value(i) as usize)
                .context("`kind` key out of range")?;
            let s = step_at(i);
            let name = names[i];
            if let Some(tags) = tags
                && s != NO_STEP
                && !tags.is_null(i)
                && tags.value_length(i) > 0
            {
                {
                    let list = tags.value(i);
                    let list = list
                        .as_string_opt::<i32>()
                        .context("`tags` items are not utf8")?;
                    let mut mask = 0u64;
                    for t in list.iter().flatten() {
                        let id = match tag_ids.get(t) {
                            Some(&id) => id,
                            None => {
                                let id = out.tags.len() as u32;
                                out.tags.push(t.to_string());
                                tag_ids.insert(t.to_string(), id);
                                id
                            }
                        };
                        if id < 64 {
                            mask |= 1 << id;
                        }
                    }
                    *out.step_tags.entry(s).or_default() |= mask;
                }
            }
            match kind {
                Kind::Span => {
                    let t = &mut out.spans;
                    t.rank.push(rank);
                    t.name.push(name);
                    t.step.push(s);
                    t.dur_ns.push(if dur.is_null(i) { 0 } else { dur.value(i) });
                    if let Some(a) = start {
                        t.start_ns.push(a.value(i));
                    }
                    if let Some(a) = thread {
                        t.thread.push(a.value(i));
                    }
                    if let Some(d) = depth {
                        t.depth.push(d.value(i));
                    }
                    if let (Some(q), Some(p)) = (seq, parent) {
                        t.seq.push(q.value(i));
                        t.parent.push(if p.is_null(i) { 0 } else { p.value(i) });
                    }
                }
                Kind::Instant => {
                    let t = &mut out.instants;
                    t.rank.push(rank);
                    t.name.push(name);
                    t.step.push(s);
                    if let Some(a) = start {
                        t.start_ns.push(a.value(i));
                    }
                    if let Some(a) = thread {
                        t.thread.push(a.value(i));
                    }
                    if let Some(d) = depth {
                        t.depth.push(d.value(i));
                    }
                    if let Some(p) = parent {
                        t.parent.push(if p.is_null(i) { 0 } else { p.value(i) });
                    }
                }
                Kind::Scalar => {
                    let t = &mut out.scalars;
                    t.rank.push(rank);
                    t.name.push(name);
                    t.step.push(s);
                    t.value.push(if value.is_null(i) {
                        f64::NAN
                    } else {
                        value.value(i)
                    });
                    let r = if reduce_dict.keys().is_null(i) {
                        Reduce::Mean
                    } else {
                        reduce_of_key
                            .get(reduce_dict.keys().value(i) as usize)
                            .context("`reduce` key out of range")?
                            .clone()
                            .map_err(anyhow::Error::msg)?
                    };
                    t.reduce.push(r);
                    if let Some(a) = start {
                        t.start_ns.push(a.value(i));
                    }
                }
                Kind::Error => {
                    let t = &mut out.errors;
                    t.rank.push(rank);
                    t.name.push(name);
                    t.step.push(s);
                    if let Some(a) = start {
                        t.start_ns.push(a.value(i));
                    }
                    if let Some(a) = thread {
                        t.thread.push(a.value(i));
                    }
                    if let Some(p) = parent {
                        t.parent.push(if p.is_null(i) { 0 } else { p.value(i) });
                    }
                    if let Some(m) = message {
                        t.message.push(if m.is_null(i) {
                            String::new()
                        } else {
                            m.value(i).to_string()
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Maps a dictionary<int32, utf8> column to part-local ids, interning new values.
fn dict_to_local(
    array: &Arc<dyn Array>,
    ids: &mut HashMap<String, u32>,
    values_out: &mut Vec<String>,
) -> Result<Vec<u32>> {
    let dict: &DictionaryArray<Int32Type> = array
        .as_dictionary_opt::<Int32Type>()
        .context("expected a dictionary<int32, utf8> column")?;
    let values = dict
        .values()
        .as_string_opt::<i32>()
        .context("dictionary values are not utf8")?;
    let map: Vec<u32> = (0..values.len())
        .map(|i| {
            let v = values.value(i);
            match ids.get(v) {
                Some(&id) => id,
                None => {
                    let id = values_out.len() as u32;
                    values_out.push(v.to_string());
                    ids.insert(v.to_string(), id);
                    id
                }
            }
        })
        .collect();
    let keys = dict.keys();
    let mut out = Vec::with_capacity(keys.len());
    for i in 0..keys.len() {
        if keys.is_null(i) {
            bail!("row {i}: dictionary column is null");
        }
        out.push(
            *map.get(keys.value(i) as usize)
                .context("dictionary key out of range")?,
        );
    }
    Ok(out)
}

/// Run-wide interning of names and tags while parts are appended.
#[derive(Default, Clone)]
pub(crate) struct Merger {
    names: Vec<String>,
    name_ids: HashMap<String, u32>,
    tags: Vec<String>,
    tag_ids: HashMap<String, u32>,
}

/// Id of `v` in `values`, appending it when new.
pub(crate) fn intern(values: &mut Vec<String>, ids: &mut HashMap<String, u32>, v: &str) -> u32 {
    if let Some(&id) = ids.get(v) {
        return id;
    }
    let id = values.len() as u32;
    values.push(v.to_string());
    ids.insert(v.to_string(), id);
    id
}

impl Merger {
    /// Copies the run-wide dictionaries into `run` (after the last merge).
    pub(crate) fn publish(&self, run: &mut Run) {
        run.names.clone_from(&self.names);
        run.tags.clone_from(&self.tags);
    }

    pub(crate) fn merge(&mut self, run: &mut Run, part: PartData, align: bool) {
        let name_map: Vec<u32> = part
            .names
            .iter()
            .map(|n| intern(&mut self.names, &mut self.name_ids, n))
            .collect();
        let tag_map: Vec<u32> = part
            .tags
            .iter()
            .map(|t| intern(&mut self.tags, &mut self.tag_ids, t))
            .collect();
        let offset = if align { part.info.clock_offset_ns } else { 0 };
        let rank = part.info.rank;
        let shift = |v: Vec<i64>| -> Vec<i64> {
            if offset == 0 {
                v
            } else {
                v.into_iter().map(|t| t + offset).collect()
            }
        };
        let remap =
            |v: Vec<u32>| -> Vec<u32> { v.into_iter().map(|i| name_map[i as usize]).collect() };

        let s = part.spans;
        let t = &mut run.spans;
        t.rank.extend(s.rank);
        t.name.extend(remap(s.name));
        t.step.extend(s.step);
        t.dur_ns.extend(s.dur_ns);
        t.start_ns.extend(shift(s.start_ns));
        t.thread.extend(s.thread);
        t.depth.extend(s.depth);
        t.seq.extend(s.seq);
        t.parent.extend(s.parent);

        let s = part.instants;
        let t = &mut run.instants;
        t.rank.extend(s.rank);
        t.name.extend(remap(s.name));
        t.step.extend(s.step);
        t.start_ns.extend(shift(s.start_ns));
        t.thread.extend(s.thread);
        t.depth.extend(s.depth);
        t.parent.extend(s.parent);

        let s = part.scalars;
        let t = &mut run.scalars;
        t.rank.extend(s.rank);
        t.name.extend(remap(s.name));
        t.step.extend(s.step);
        t.value.extend(s.value);
        t.reduce.extend(s.reduce);
        t.start_ns.extend(shift(s.start_ns));

        let s = part.errors;
        let t = &mut run.errors;
        t.rank.extend(s.rank);
        t.name.extend(remap(s.name));
        t.step.extend(s.step);
        t.start_ns.extend(shift(s.start_ns));
        t.thread.extend(s.thread);
        t.parent.extend(s.parent);
        t.message.extend(s.message);

        for (step, mask) in part.step_tags {
            let mut global = 0u64;
            for (local, &g) in tag_map.iter().enumerate() {
                if mask & (1 << local) != 0 && g < 64 {
                    global |= 1 << g;
                }
            }
            run.step_tags.entry((rank, step)).or_default().0 |= global;
        }

        match run.ranks.get_mut(&rank) {
            Some(info) => {
                info.parts += part.info.parts;
                info.threads.extend(part.info.threads);
                info.world_size = info.world_size.max(part.info.world_size);
            }
            None => {
                run.ranks.insert(rank, part.info);
            }
        }
    }
}
