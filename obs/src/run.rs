//! The in-memory model of a loaded run, whatever its format: typed columnar tables ([`Spans`],
//! [`Instants`], [`Scalars`], [`Errors`]) with names and tags interned into run-wide
//! dictionaries, per-rank [`RankInfo`], the [`LoadReport`] of what could not be read, and the
//! [`Merger`] every reader appends decoded [`PartData`] through. Public as `titan_obs_core::read::*`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::part::PartHeader;
use crate::schema::{PipelineSlot, Reduce};

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
    /// `microbatch`, `stage` of pipeline passes (null in files written before they existed).
    pub pipeline: bool,
}

impl Columns {
    pub const ALL: Columns = Columns {
        start: true,
        thread: true,
        depth: true,
        links: true,
        tags: true,
        messages: true,
        pipeline: true,
    };
    /// What `summary` needs: durations per rank/phase/step, depth, thread (a step's time is
    /// its rank's main thread's) and step tags.
    pub const SUMMARY: Columns = Columns {
        start: false,
        thread: true,
        depth: true,
        links: false,
        tags: true,
        messages: false,
        pipeline: true,
    };
    /// What `metrics` needs: scalars and step tags.
    pub const METRICS: Columns = Columns {
        start: false,
        thread: false,
        depth: false,
        links: false,
        tags: false,
        messages: false,
        pipeline: false,
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
    /// Titan runs: read each part's summary (`part-<N>.summary`, see [`crate::digest`])
    /// into [`Run::digest`] instead of its records, which stay empty; a part without a
    /// readable summary is decoded and summarised (and its summary written next to it when
    /// the location is writable). Other formats ignore it.
    pub digests: bool,
    /// With `digests`, local runs: take each rank from its node's rollup
    /// (`obs/node-<host>.summary`, [`crate::digest::node`]) where it still describes the rank's
    /// folder. Off by default: as read now (every rollup read whole before the ranks are
    /// merged) it measured slower and larger than the rank summaries at 4096 ranks x 6 h
    /// (docs/benchmarks.md, issue 42).
    pub node_rollups: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            columns: Columns::ALL,
            align_clocks: true,
            progress: None,
            digests: false,
            node_rollups: false,
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
    /// The pipeline schedule slot of a pipeline pass; `None` for every other span.
    pub pipeline: Vec<Option<PipelineSlot>>,
}

impl Spans {
    /// Grows every column already in use to hold `n` spans in total.
    pub(crate) fn reserve(&mut self, n: usize) {
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
        r(&mut self.pipeline, n);
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

/// The columns the four record tables share, for one record: who recorded it, what, in which
/// step, when, on which thread, how deep and under which span (its seq; 0: none). A table
/// without one of them ([`Scalars`]: thread, depth, parent; [`Errors`]: depth) leaves it out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedFields {
    pub rank: u32,
    pub name: NameId,
    pub step: u64,
    pub start_ns: i64,
    pub thread: u32,
    pub depth: u16,
    pub parent: u64,
}

/// One table's shared columns, to append to (`None`: the table has no such column).
pub(crate) struct SharedColumns<'a> {
    pub rank: &'a mut Vec<u32>,
    pub name: &'a mut Vec<NameId>,
    pub step: &'a mut Vec<u64>,
    pub start_ns: &'a mut Vec<i64>,
    pub thread: Option<&'a mut Vec<u32>>,
    pub depth: Option<&'a mut Vec<u16>>,
    pub parent: Option<&'a mut Vec<u64>>,
}

impl SharedColumns<'_> {
    /// Moves `from`'s shared columns onto the ends of these (a table of the same kind), names
    /// through `name_map` (part-local to run-wide ids), start times shifted by `offset_ns`.
    pub(crate) fn append(self, from: SharedColumns, name_map: &[u32], offset_ns: i64) {
        self.rank.append(from.rank);
        self.name
            .extend(from.name.drain(..).map(|i| name_map[i as usize]));
        self.step.append(from.step);
        if offset_ns == 0 {
            self.start_ns.append(from.start_ns);
        } else {
            self.start_ns
                .extend(from.start_ns.drain(..).map(|t| t + offset_ns));
        }
        if let (Some(to), Some(from)) = (self.thread, from.thread) {
            to.append(from);
        }
        if let (Some(to), Some(from)) = (self.depth, from.depth) {
            to.append(from);
        }
        if let (Some(to), Some(from)) = (self.parent, from.parent) {
            to.append(from);
        }
    }

    /// Appends a record's shared fields to every shared column the table has.
    pub(crate) fn push(self, r: SharedFields) {
        self.rank.push(r.rank);
        self.name.push(r.name);
        self.step.push(r.step);
        self.start_ns.push(r.start_ns);
        if let Some(c) = self.thread {
            c.push(r.thread);
        }
        if let Some(c) = self.depth {
            c.push(r.depth);
        }
        if let Some(c) = self.parent {
            c.push(r.parent);
        }
    }
}

/// A record table: its shared columns, to append to or to read one record's.
pub(crate) trait RecordTable {
    fn shared_columns(&mut self) -> SharedColumns<'_>;
    /// Record `i`'s shared fields (0 for columns not read or not in the table).
    fn shared_at(&self, i: usize) -> SharedFields;
}

/// Implements [`RecordTable`] for a table with the named optional columns.
macro_rules! record_table {
    ($table:ty, thread: $thread:tt, depth: $depth:tt, parent: $parent:tt) => {
        impl RecordTable for $table {
            fn shared_columns(&mut self) -> SharedColumns<'_> {
                SharedColumns {
                    rank: &mut self.rank,
                    name: &mut self.name,
                    step: &mut self.step,
                    start_ns: &mut self.start_ns,
                    thread: record_table!(@mut self, thread, $thread),
                    depth: record_table!(@mut self, depth, $depth),
                    parent: record_table!(@mut self, parent, $parent),
                }
            }

            fn shared_at(&self, i: usize) -> SharedFields {
                SharedFields {
                    rank: self.rank[i],
                    name: self.name[i],
                    step: self.step[i],
                    start_ns: self.start_ns.get(i).copied().unwrap_or(0),
                    thread: record_table!(@at self, thread, $thread, i),
                    depth: record_table!(@at self, depth, $depth, i),
                    parent: record_table!(@at self, parent, $parent, i),
                }
            }
        }
    };
    (@mut $s:ident, $col:ident, true) => {
        Some(&mut $s.$col)
    };
    (@mut $s:ident, $col:ident, false) => {
        None
    };
    (@at $s:ident, $col:ident, true, $i:ident) => {
        $s.$col.get($i).copied().unwrap_or(0)
    };
    (@at $s:ident, $col:ident, false, $i:ident) => {
        0
    };
}

record_table!(Spans, thread: true, depth: true, parent: true);
record_table!(Instants, thread: true, depth: true, parent: true);
record_table!(Scalars, thread: false, depth: false, parent: false);
record_table!(Errors, thread: true, depth: false, parent: true);

/// Who a rank was, from its parts' footers: the footer's header (its fields read through
/// `Deref`: `info.run_id`), and how many of its parts were read.
#[derive(Debug, Clone, Default)]
pub struct RankInfo {
    pub header: PartHeader,
    pub parts: usize,
}

impl std::ops::Deref for RankInfo {
    type Target = PartHeader;
    fn deref(&self) -> &PartHeader {
        &self.header
    }
}

impl std::ops::DerefMut for RankInfo {
    fn deref_mut(&mut self) -> &mut PartHeader {
        &mut self.header
    }
}

/// A part that could not be read, by name.
#[derive(Debug, Clone)]
pub struct CorruptPart {
    pub path: String,
    pub error: String,
}

/// Bytes of a file that could not be decoded and were skipped (the rest of the file was
/// read): which file, where, and what was lost.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Damage {
    pub file: String,
    /// Offset of the skipped bytes in the file.
    pub offset: u64,
    pub bytes: u64,
    /// What the skipped bytes held, as far as can be told (e.g. `a batch of 812 records`).
    pub lost: String,
    /// Why they were skipped (e.g. `its checksum does not match`).
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
    /// Damaged stretches of files that were skipped while the rest of each file was read.
    pub damage: Vec<Damage>,
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
        self.missing_ranks.is_empty()
            && self.corrupt_parts.is_empty()
            && self.damage.is_empty()
            && self.malformed_lines == 0
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
    /// The parts' summaries merged, when read with [`ReadOptions::digests`].
    pub digest: Option<crate::digest::RunDigest>,
    /// The runs the location holds: the tables above hold one of them (see [`crate::runs`]).
    pub runs: crate::runs::Runs,
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
    /// Damage the file records about itself (a part's journal ranges dropped at compaction).
    pub(crate) damage: Vec<crate::part::CompactedDamage>,
    /// Read with [`ReadOptions::digests`]: the part's summary (the tables stay empty).
    pub(crate) digest: Option<Box<crate::digest::PartDigest>>,
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
        crate::runs::settle(run);
    }

    /// Appends `part` to the tables of its run (a location may hold several).
    pub(crate) fn merge(&mut self, run: &mut Run, part: PartData, align: bool) {
        let (rank, run_id) = (part.info.rank, part.info.run_id.clone());
        crate::runs::merge_into_its_run(run, rank, &run_id, |run| {
            self.merge_tables(run, part, align)
        });
    }

    fn merge_tables(&mut self, run: &mut Run, mut part: PartData, align: bool) {
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
        if let Some(d) = &part.digest {
            run.digest
                .get_or_insert_with(Default::default)
                .merge(d, &name_map, offset);
        }
        let (s, t) = (&mut part.spans, &mut run.spans);
        t.shared_columns()
            .append(s.shared_columns(), &name_map, offset);
        t.dur_ns.append(&mut s.dur_ns);
        t.seq.append(&mut s.seq);
        t.pipeline.append(&mut s.pipeline);

        run.instants
            .shared_columns()
            .append(part.instants.shared_columns(), &name_map, offset);

        let (s, t) = (&mut part.scalars, &mut run.scalars);
        t.shared_columns()
            .append(s.shared_columns(), &name_map, offset);
        t.value.append(&mut s.value);
        t.reduce.append(&mut s.reduce);

        let (s, t) = (&mut part.errors, &mut run.errors);
        t.shared_columns()
            .append(s.shared_columns(), &name_map, offset);
        t.message.append(&mut s.message);

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
                info.threads.extend(part.info.header.threads);
                info.world_size = info.world_size.max(part.info.header.world_size);
            }
            None => {
                run.ranks.insert(rank, part.info);
            }
        }
    }
}
