//! Per-part summaries ("digests"): what `titan-obs summary` needs from a part, computed once
//! when the part is written and stored next to it as `part-<N>.summary`, so the summary of a
//! day-long job reads kilobytes per part instead of decoding every span.
//!
//! A [`PartDigest`] holds, for the one rank of its part: per phase the count, sum, min, max,
//! smallest depth, time inside steps and a DDSketch of the durations (mergeable; relative
//! error [`SKETCH_ALPHA`]); per (step, phase) the summed duration; per step the time in
//! top-level spans and the step's tags; the spans of tagged steps' own phases; every
//! collective with what the waits analysis needs. [`RunDigest`] merges the digests of a
//! whole run (in rank, part order) and `analysis::summary` computes the same [`Summary`] from
//! it as from the spans.
//!
//! A rank's parts' digests are also kept merged in one file per rank ([`rank`], [`rank_file`],
//! `obs/SCHEMA.md` "Per-rank summaries"), so a reader opens one file per rank instead of one
//! per part; [`local`] brings it up to date against a rank folder's parts.
//!
//! [`file`] reads and writes them (`obs/SCHEMA.md`, "Per-part summaries"); [`merged`] merges
//! them into a [`RunDigest`], whose per (phase, step, rank) times are [`cells::Cells`] (4 bytes
//! a cell, so a day-long 1024-rank job's fit in memory at once).
//!
//! [`Summary`]: crate::analysis::Summary

mod absorb;
pub mod cells;
pub mod figures;
pub mod file;
pub mod local;
pub mod merged;
pub mod node;
pub mod rank;
pub mod rank_file;
pub(crate) mod schedule;
pub mod timeline;

use std::collections::{BTreeMap, HashMap};

use sketches_ddsketch::{Config, DDSketch};

use crate::metric_lines::Acc;
use crate::roles::{StepRole, step_roles};
use crate::schema::Reduce;

pub use file::{
    decode, encode, from_footer, read_local, summary_file_name, summary_path, summary_shown,
    write_local,
};
pub use local::{RankSummarised, summarise_rank};
pub use merged::{CollectiveContext, RunCollective, RunDigest};
pub use rank::RankDigest;
pub use rank_file::RANK_SUMMARY_FILE;

use crate::footer::CompactedDamage;
use crate::record::NO_STEP;
use crate::tables::{NameId, PartData, RankInfo};
use crate::vocab;

/// Relative error of the duration quantiles: a quantile read from the sketches is within
/// 1% of the exact value of the same rank (DDSketch's guarantee, for durations from 1 ns to
/// ~10^17 ns with its 2048 bins).
pub const SKETCH_ALPHA: f64 = 0.01;
const SKETCH_BINS: u32 = 2048;

/// A new, empty duration sketch.
pub fn new_sketch() -> DDSketch {
    DDSketch::new(Config::new(SKETCH_ALPHA, SKETCH_BINS, 1e-9))
}

/// Whether a decoded sketch has [`new_sketch`]'s configuration (merging an empty sketch into
/// it checks that and changes nothing).
pub(crate) fn sketch_config_ok(s: &mut DDSketch) -> bool {
    s.merge(&new_sketch()).is_ok()
}

/// The nearest-rank q-quantile (the smallest value with at least q of the data at or below
/// it, as the exact statistics define it) from a sketch of `n` values, clamped to the exact
/// `[min, max]`.
pub fn sketch_quantile(s: &DDSketch, n: u64, q: f64, min: i64, max: i64) -> i64 {
    if n == 0 {
        return 0;
    }
    let k = crate::stats::nearest_rank_index(n as usize, q) as u64;
    sketch_at_rank(s, n, k, min, max)
}

/// The median as [`crate::stats::median_f64`] defines it (the mean of the two
/// middle values for an even count) from a sketch of `n` values; NaN when empty.
pub fn sketch_median(s: &DDSketch, n: u64, min: i64, max: i64) -> f64 {
    match n {
        0 => f64::NAN,
        n if n % 2 == 1 => sketch_at_rank(s, n, n / 2, min, max) as f64,
        n => {
            let lo = sketch_at_rank(s, n, n / 2 - 1, min, max) as f64;
            let hi = sketch_at_rank(s, n, n / 2, min, max) as f64;
            (lo + hi) / 2.0
        }
    }
}

/// The value of 0-based rank `k` of the `n` values a sketch holds (the ends exact).
fn sketch_at_rank(s: &DDSketch, n: u64, k: u64, min: i64, max: i64) -> i64 {
    if k + 1 >= n {
        return max;
    }
    if k == 0 {
        return min;
    }
    // The sketch reads rank floor(q' * (n - 1)): aim at the middle of rank k.
    let q2 = (k as f64 + 0.5) / (n - 1) as f64;
    let v = s.quantile(q2.min(1.0)).ok().flatten().unwrap_or(0.0);
    (v.round() as i64).clamp(min, max)
}

/// One phase's durations (span name) in a part, or merged over a run.
#[derive(Clone)]
pub struct PhaseDigest {
    pub min_depth: u16,
    pub count: u64,
    pub sum_ns: i64,
    pub min_ns: i64,
    pub max_ns: i64,
    /// Spans with a step number (what the straggler analysis compares).
    pub in_step: u64,
    /// Spans counted in the step time's shares ([`StepRole::in_step_time`]: the main
    /// thread's spans in the step), and their summed duration.
    pub in_step_main: u64,
    pub in_step_ns: i64,
    /// Spans on a rank's other threads during a step ([`StepRole::Concurrent`]), and their
    /// summed duration.
    pub concurrent: u64,
    pub concurrent_ns: i64,
    /// Smallest depth of the spans counted in `in_step_ns`, and in `concurrent_ns`
    /// (`u16::MAX`: none): the depth the summary shows beside the phase's `% step`.
    pub main_depth: u16,
    pub concurrent_depth: u16,
    pub sketch: DDSketch,
}

impl Default for PhaseDigest {
    fn default() -> Self {
        PhaseDigest {
            min_depth: u16::MAX,
            count: 0,
            sum_ns: 0,
            min_ns: i64::MAX,
            max_ns: i64::MIN,
            in_step: 0,
            in_step_main: 0,
            in_step_ns: 0,
            concurrent: 0,
            concurrent_ns: 0,
            main_depth: u16::MAX,
            concurrent_depth: u16::MAX,
            sketch: new_sketch(),
        }
    }
}

impl PhaseDigest {
    pub(crate) fn add(&mut self, dur: i64, depth: u16, in_step: bool, role: StepRole) {
        self.min_depth = self.min_depth.min(depth);
        self.count += 1;
        self.sum_ns = self.sum_ns.wrapping_add(dur);
        self.min_ns = self.min_ns.min(dur);
        self.max_ns = self.max_ns.max(dur);
        self.sketch.add(dur as f64);
        if in_step {
            self.in_step += 1;
        }
        if role.in_step_time() {
            self.in_step_main += 1;
            self.in_step_ns = self.in_step_ns.wrapping_add(dur);
            self.main_depth = self.main_depth.min(depth);
        } else if role == StepRole::Concurrent {
            self.concurrent += 1;
            self.concurrent_ns = self.concurrent_ns.wrapping_add(dur);
            self.concurrent_depth = self.concurrent_depth.min(depth);
        }
    }

    /// The depth the summary shows: where its `% step` was counted (main thread, else other
    /// threads), else its smallest depth anywhere.
    pub fn shown_depth(&self) -> u16 {
        if self.in_step_main > 0 {
            self.main_depth
        } else if self.concurrent > 0 {
            self.concurrent_depth
        } else {
            self.min_depth
        }
    }

    pub(crate) fn merge(&mut self, o: &PhaseDigest) {
        self.min_depth = self.min_depth.min(o.min_depth);
        self.count = self.count.saturating_add(o.count);
        self.sum_ns = self.sum_ns.wrapping_add(o.sum_ns);
        self.min_ns = self.min_ns.min(o.min_ns);
        self.max_ns = self.max_ns.max(o.max_ns);
        self.in_step = self.in_step.saturating_add(o.in_step);
        self.in_step_main = self.in_step_main.saturating_add(o.in_step_main);
        self.in_step_ns = self.in_step_ns.wrapping_add(o.in_step_ns);
        self.concurrent = self.concurrent.saturating_add(o.concurrent);
        self.concurrent_ns = self.concurrent_ns.wrapping_add(o.concurrent_ns);
        self.main_depth = self.main_depth.min(o.main_depth);
        self.concurrent_depth = self.concurrent_depth.min(o.concurrent_depth);
        // Every sketch has the same configuration (checked when read), so this cannot fail.
        let _ = self.sketch.merge(&o.sketch);
    }
}

impl std::fmt::Debug for PhaseDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhaseDigest")
            .field("count", &self.count)
            .field("sum_ns", &self.sum_ns)
            .field("min_ns", &self.min_ns)
            .field("max_ns", &self.max_ns)
            .finish_non_exhaustive()
    }
}

/// One collective span of a part (a call the waits analysis matches across ranks).
#[derive(Debug, Clone)]
pub struct CollectiveDigest {
    pub step: u64,
    pub name: NameId,
    /// On this rank's clock (the reader adds the clock offset).
    pub start_ns: i64,
    /// The non-collective span of the same step that ended last before it started (the
    /// shallowest on a tie), as (end, depth, name); `None` when none in this part.
    pub before: Option<(i64, u16, NameId)>,
    /// The names of every span of its step in this part that it started inside
    /// (`start <= its start < end`, itself included): its wait is taken out of their time.
    pub containers: Vec<NameId>,
}

/// One step of a rank's pipeline schedule (see `schedule.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineStep {
    pub step: u64,
    /// Time in `forward_backward` (the rank's pipeline window).
    pub window: i64,
    /// Time in a profiler step (the window of a PyTorch trace).
    pub profiler_step: i64,
    /// Time in passes.
    pub busy: i64,
    /// Time receiving from a neighbouring stage.
    pub recv: i64,
}

/// What the pipeline analysis needs from a part whose spans carry pipeline slots.
#[derive(Debug, Clone, Default)]
pub struct PipelineDigest {
    /// The stages this rank ran passes of, sorted.
    pub stages: Vec<u16>,
    /// Largest microbatch + 1.
    pub microbatches: u32,
    /// Durations of one microbatch's forward pass, and backward pass.
    pub forward: PhaseDigest,
    pub backward: PhaseDigest,
    /// By step.
    pub steps: Vec<PipelineStep>,
}

/// What `summary` needs from one part (one rank); names and tags are part-local ids.
#[derive(Debug, Clone, Default)]
pub struct PartDigest {
    pub info: RankInfo,
    pub damage: Vec<CompactedDamage>,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub rows: u64,
    pub spans: u64,
    pub errors: u64,
    /// Spans that carry a pipeline slot (`microbatch`, `stage`).
    pub pipeline_spans: u64,
    /// (name, its durations).
    pub phases: Vec<(NameId, PhaseDigest)>,
    /// (step, name, summed duration) of the spans of each step.
    pub cells: Vec<(u64, NameId, i64)>,
    /// (step, its step time on this rank: [`StepRole::Step`] spans).
    pub walls: Vec<(u64, i64)>,
    /// (step, tag bit mask over `tags`).
    pub step_tags: Vec<(u64, u64)>,
    /// (step, name, start, end) of spans named like one of the part's tags or `<tag>_...`
    /// in a step (the candidates for tagged steps' own time), on this rank's clock.
    pub tag_spans: Vec<(u64, NameId, i64, i64)>,
    pub collectives: Vec<CollectiveDigest>,
    /// Per step, the non-collective span that ended last (end, depth, name): where the
    /// next part's first collectives of that step came from.
    pub last_ended: Vec<(u64, i64, u16, NameId)>,
    /// Parts with pipeline slots: their stages, passes and per-step windows. (A part of a
    /// pipeline run without any slot, such as a last part holding only the end of a step's
    /// window, adds nothing to the pipeline section.)
    pub pipeline: Option<PipelineDigest>,
    /// (step, name, reduce, values) of the part's scalars with a step, in the order each
    /// (step, name, reduce) was first recorded: what `metrics` aggregates.
    pub scalars: Vec<(u64, NameId, Reduce, Acc)>,
    /// The first [`NAMED_ERRORS`] error records of the part, as (step, name, message):
    /// `summary` names them (a failed run's error, such as the trainer's report of a rank
    /// that stopped, says what happened; a count alone does not).
    pub named_errors: Vec<(u64, NameId, String)>,
}

/// The error records a part's summary keeps with their messages (and a run's summary names).
pub const NAMED_ERRORS: usize = 16;

impl PartDigest {
    /// The digest of decoded records (decoded with start times, depth and tags).
    pub(crate) fn of_data(d: &PartData) -> PartDigest {
        let s = &d.spans;
        let n = s.rank.len();
        let has_start = s.start_ns.len() == n;
        let has_depth = s.depth.len() == n;
        let depth = |i: usize| if has_depth { s.depth[i] } else { 0 };
        let start = |i: usize| if has_start { s.start_ns[i] } else { 0 };
        let is_coll: Vec<bool> = d
            .names
            .iter()
            .map(|n| vocab::collective::is_collective(n))
            .collect();
        let is_tag_phase: Vec<bool> = d
            .names
            .iter()
            .map(|n| d.tags.iter().any(|t| crate::vocab::is_tag_phase(n, t)))
            .collect();

        let mut phases: BTreeMap<NameId, PhaseDigest> = BTreeMap::new();
        let mut cells: BTreeMap<(u64, NameId), i64> = BTreeMap::new();
        let mut walls: BTreeMap<u64, i64> = BTreeMap::new();
        let mut tag_spans = Vec::new();
        let mut by_step: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let step_name = d.names.iter().position(|n| n == vocab::STEP);
        let roles = step_roles(
            &s.rank,
            &s.step,
            &s.name,
            &s.thread,
            &s.depth,
            step_name.map(|i| i as NameId),
        );
        for (i, &role) in roles.iter().enumerate() {
            let (name, dur, step) = (s.name[i], s.dur_ns[i], s.step[i]);
            phases
                .entry(name)
                .or_default()
                .add(dur, depth(i), step != NO_STEP, role);
            if step == NO_STEP {
                continue;
            }
            let cell = cells.entry((step, name)).or_default();
            *cell = cell.saturating_add(dur);
            if role == StepRole::Step {
                let wall = walls.entry(step).or_default();
                *wall = wall.saturating_add(dur);
            }
            if is_tag_phase.get(name as usize).copied().unwrap_or(false) {
                tag_spans.push((step, name, start(i), start(i).saturating_add(dur)));
            }
            by_step.entry(step).or_default().push(i);
        }

        let mut collectives = Vec::new();
        let mut last_ended = Vec::new();
        if has_start {
            for (&step, idx) in &by_step {
                let end = |i: usize| s.start_ns[i].saturating_add(s.dur_ns[i]);
                let coll = |i: usize| is_coll.get(s.name[i] as usize).copied().unwrap_or(false);
                if let Some(i) = idx
                    .iter()
                    .copied()
                    .filter(|&i| !coll(i))
                    .max_by_key(|&i| (end(i), std::cmp::Reverse(depth(i))))
                {
                    last_ended.push((step, end(i), depth(i), s.name[i]));
                }
                for &c in idx.iter().filter(|&&i| coll(i)) {
                    let at = s.start_ns[c];
                    let before = idx
                        .iter()
                        .copied()
                        .filter(|&i| !coll(i) && end(i) <= at)
                        .max_by_key(|&i| (end(i), std::cmp::Reverse(depth(i))))
                        .map(|i| (end(i), depth(i), s.name[i]));
                    let containers = idx
                        .iter()
                        .copied()
                        .filter(|&i| s.start_ns[i] <= at && at < end(i))
                        .map(|i| s.name[i])
                        .collect();
                    collectives.push(CollectiveDigest {
                        step,
                        name: s.name[c],
                        start_ns: at,
                        before,
                        containers,
                    });
                }
            }
        }
        let mut step_tags: Vec<(u64, u64)> = d.step_tags.iter().map(|(&s, &m)| (s, m)).collect();
        step_tags.sort_unstable();
        PartDigest {
            info: d.info.clone(),
            damage: d.damage.clone(),
            names: d.names.clone(),
            tags: d.tags.clone(),
            rows: d.rows as u64,
            spans: n as u64,
            errors: d.errors.rank.len() as u64,
            pipeline_spans: s.pipeline.iter().filter(|p| p.is_some()).count() as u64,
            phases: phases.into_iter().collect(),
            cells: cells.into_iter().map(|((s, n), v)| (s, n, v)).collect(),
            walls: walls.into_iter().collect(),
            step_tags,
            tag_spans,
            collectives,
            last_ended,
            pipeline: schedule::part_pipeline(d),
            scalars: scalar_cells(&d.scalars),
            named_errors: (0..d.errors.rank.len().min(NAMED_ERRORS))
                .map(|i| {
                    let e = &d.errors;
                    let message = e.message.get(i).cloned().unwrap_or_default();
                    (e.step[i], e.name[i], message)
                })
                .collect(),
        }
    }

    /// Drops everything but the counts and the scalars (what `metrics` reads).
    pub(crate) fn keep_only_scalars(&mut self) {
        self.phases = Vec::new();
        self.cells = Vec::new();
        self.walls = Vec::new();
        self.tag_spans = Vec::new();
        self.collectives = Vec::new();
        self.last_ended = Vec::new();
        self.pipeline = None;
    }

    /// The digest as a [`PartData`] holding no records: what the reader merges into a run
    /// beside the digest (rank info, damage, step tags, dictionaries).
    pub(crate) fn part_data(&self) -> PartData {
        PartData {
            info: self.info.clone(),
            rows: self.rows as usize,
            names: self.names.clone(),
            tags: self.tags.clone(),
            step_tags: self.step_tags.iter().copied().collect(),
            damage: self.damage.clone(),
            ..Default::default()
        }
    }
}

/// A part's scalars per (step, name, reduce), in first-recorded order (as `metrics` reads
/// them: steps without a number and NaN values left out).
fn scalar_cells(sc: &crate::tables::Scalars) -> Vec<(u64, NameId, Reduce, Acc)> {
    let mut at: HashMap<(u64, NameId, Reduce), usize> = HashMap::new();
    let mut out: Vec<(u64, NameId, Reduce, Acc)> = Vec::new();
    for i in 0..sc.rank.len() {
        let (step, v) = (sc.step[i], sc.value[i]);
        if step == NO_STEP || v.is_nan() {
            continue;
        }
        let key = (step, sc.name[i], sc.reduce[i]);
        let k = *at.entry(key).or_insert_with(|| {
            out.push((key.0, key.1, key.2, Acc::default()));
            out.len() - 1
        });
        out[k].3.add(v);
    }
    out
}

/// The columns a summary is made of.
pub(crate) const COLUMNS: crate::tables::Columns = crate::tables::Columns {
    start: true,
    // The step time is the main thread's (`StepRole`).
    thread: true,
    depth: true,
    links: false,
    tags: true,
    // Error records' messages (`named_errors`).
    messages: true,
    pipeline: true,
};
