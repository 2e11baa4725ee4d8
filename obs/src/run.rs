//! The in-memory model of a loaded run, whatever its format: the record tables of
//! [`crate::tables`] with names and tags interned into run-wide dictionaries, the run's
//! merged part summaries when read as summaries, the runs its location holds
//! ([`crate::runs`]), the [`LoadReport`] of what could not be read, and the [`Merger`] every
//! reader appends decoded parts ([`PartRead`]) through, keeping each run id's records apart.
//! Public as `titan_obs_core::read::*`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::digest::{PartDigest, RunDigest};
use crate::location::NotARun;
use crate::runs::{RunBrief, Runs, Tables, step_range};
use crate::tables::{
    Columns, Errors, Instants, NameId, PartData, RankInfo, RecordTable, Scalars, Spans, TagSet,
    intern,
};

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
    pub digest: Option<RunDigest>,
    /// The runs the location holds: the tables above hold one of them (see [`crate::runs`]).
    pub runs: Runs,
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

/// A part as the reader merges it: its records, or, read with [`ReadOptions::digests`], its
/// summary (the tables then hold none).
#[derive(Default)]
pub(crate) struct PartRead {
    pub(crate) data: PartData,
    pub(crate) digest: Option<Box<PartDigest>>,
}

impl From<PartData> for PartRead {
    fn from(data: PartData) -> Self {
        PartRead { data, digest: None }
    }
}

impl From<PartDigest> for PartRead {
    /// The summary with what the reader merges besides it (rank info, damage, step tags,
    /// dictionaries).
    fn from(digest: PartDigest) -> Self {
        PartRead {
            data: digest.part_data(),
            digest: Some(Box::new(digest)),
        }
    }
}

/// Run-wide interning of names and tags while parts are appended.
#[derive(Default, Clone)]
pub(crate) struct Merger {
    names: Vec<String>,
    name_ids: HashMap<String, u32>,
    tags: Vec<String>,
    tag_ids: HashMap<String, u32>,
}

impl Merger {
    /// Copies the run-wide dictionaries into `run` (after the last merge).
    pub(crate) fn publish(&self, run: &mut Run) {
        run.names.clone_from(&self.names);
        run.tags.clone_from(&self.tags);
        settle(run);
    }

    /// Appends `part` to the tables of its run (a location may hold several).
    pub(crate) fn merge(&mut self, run: &mut Run, part: PartRead, align: bool) {
        let (rank, run_id) = (part.data.info.rank, part.data.info.run_id.clone());
        merge_into_its_run(run, rank, &run_id, |run| {
            self.merge_tables(run, part, align)
        });
    }

    fn merge_tables(&mut self, run: &mut Run, part: PartRead, align: bool) {
        let PartRead {
            data: mut part,
            digest,
        } = part;
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
        if let Some(d) = &digest {
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

/// Exchanges the record tables of `run` with `t`.
fn swap_tables(run: &mut Run, t: &mut Tables) {
    std::mem::swap(&mut run.spans, &mut t.spans);
    std::mem::swap(&mut run.instants, &mut t.instants);
    std::mem::swap(&mut run.scalars, &mut t.scalars);
    std::mem::swap(&mut run.errors, &mut t.errors);
    std::mem::swap(&mut run.ranks, &mut t.ranks);
    std::mem::swap(&mut run.step_tags, &mut t.step_tags);
    std::mem::swap(&mut run.digest, &mut t.digest);
}

/// Merges one part's records through `merge` into the tables of the part's run: the shown
/// tables when it is the shown run, else that run's set-aside tables (swapped in and out).
pub(crate) fn merge_into_its_run(
    run: &mut Run,
    rank: u32,
    run_id: &str,
    merge: impl FnOnce(&mut Run),
) {
    let runs = &mut run.runs;
    if !runs.ids.iter().any(|id| id == run_id) {
        runs.ids.push(run_id.to_string());
    }
    match &runs.latest {
        Some((lowest, _)) if rank > *lowest => {}
        _ => runs.latest = Some((rank, run_id.to_string())),
    }
    let current = runs.current.get_or_insert_with(|| run_id.to_string());
    if current == run_id {
        merge(run);
        return;
    }
    let mut t = runs.others.remove(run_id).unwrap_or_default();
    swap_tables(run, &mut t);
    merge(run);
    swap_tables(run, &mut t);
    run.runs.others.insert(run_id.to_string(), t);
}

/// Shows `id` in the tables of `run` (the others are set aside).
fn show(run: &mut Run, id: &str) {
    let Some(current) = run.runs.current.clone() else {
        return;
    };
    if current == id {
        return;
    }
    let Some(mut t) = run.runs.others.remove(id) else {
        return;
    };
    swap_tables(run, &mut t);
    run.runs.others.insert(current, t);
    run.runs.current = Some(id.to_string());
}

/// Makes the report's world size and missing ranks the shown run's (a reader counts every
/// run's ranks).
fn fit_report(run: &mut Run) {
    let present: BTreeSet<u32> = run.ranks.keys().copied().collect();
    let world = run
        .ranks
        .values()
        .map(|i| i.world_size)
        .chain(present.last().map(|r| r + 1))
        .max()
        .unwrap_or(0);
    run.report.world_size = world;
    run.report.missing_ranks = (0..world).filter(|r| !present.contains(r)).collect();
}

/// After a read: shows the selected run, else the newest.
pub(crate) fn settle(run: &mut Run) {
    if !run.runs.several() {
        return;
    }
    let wanted = run
        .runs
        .pinned
        .clone()
        .or_else(|| run.runs.newest().map(str::to_string));
    if let Some(id) = wanted {
        show(run, &id);
    }
    fit_report(run);
}

impl Run {
    /// Shows the run `id` of this location (and keeps showing it after refreshes). Fails,
    /// naming the runs there are, when the location holds no run `id`.
    pub fn select_run(&mut self, id: &str) -> anyhow::Result<()> {
        if !self.runs.ids.iter().any(|r| r == id) {
            let known: Vec<&str> = self.runs.ids.iter().map(String::as_str).collect();
            return Err(NotARun(format!(
                "{} holds no run `{id}`; its runs (oldest first): {}",
                self.location,
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))
            .into());
        }
        self.runs.pinned = Some(id.to_string());
        show(self, id);
        if self.runs.several() {
            fit_report(self);
        }
        Ok(())
    }

    /// When the location holds several runs, which one is shown and which others there are:
    /// `RUN holds 2 runs; showing B (steps 1-3), the newest; the other: A (steps 1-5)`.
    pub fn runs_note(&self) -> Option<String> {
        if !self.runs.several() {
            return None;
        }
        let shown = self.shown_run()?;
        let others: Vec<String> = self.runs.others().iter().map(RunBrief::describe).collect();
        Some(format!(
            "{} holds {} runs; showing {}{}; the other{}: {}",
            self.location,
            self.runs.ids.len(),
            shown.describe(),
            if self.runs.pinned.is_some() {
                ""
            } else {
                ", the newest"
            },
            if others.len() == 1 { "" } else { "s" },
            others.join(", ")
        ))
    }

    /// The location's other runs (not shown), oldest first.
    pub fn other_runs(&self) -> Vec<RunBrief> {
        self.runs.others()
    }

    /// The run the tables hold, for messages.
    pub fn shown_run(&self) -> Option<RunBrief> {
        let id = self.runs.current()?;
        Some(RunBrief {
            id: id.to_string(),
            ranks: self.ranks.len(),
            steps: step_range(&self.spans.step, &self.scalars.step),
        })
    }
}
