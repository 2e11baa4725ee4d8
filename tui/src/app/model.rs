//! The in-memory timeline the gantt draws from, built once per (re)load.
//!
//! Everything the renderer needs per frame is precomputed here: spans live in per-lane,
//! per-depth rows as sorted struct-of-arrays (within one row spans never overlap, so both
//! `start` and `end` are sorted and the visible window is two binary searches away), the
//! per-(phase, step) cross-rank spread for the selection panel, one collapsed row per phase,
//! and the per-step metric series. The phase table, stragglers and waits are
//! [`titan_obs_core::analysis::analyse_grouped`] over the same spans (under pipeline
//! parallelism within each stage's ranks), exactly what `titan-obs summary` computes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use titan_obs_core::PipelineSlot;
use titan_obs_core::analysis::{
    Analysis, OwnedSpans, RunShape, Straggler, StragglerOptions, analyse_grouped,
    phase_step_spread, rank_times,
};
use titan_obs_core::analysis::{HostLoad, HostLoads};
use titan_obs_core::vocab::{moe, titan, torch_pipelining};
pub use titan_obs_core::{NO_STEP, Reduce};

/// One phase at one step across ranks: min / median / max and who.
pub type PhaseSpread = titan_obs_core::analysis::Spread;

/// Nanoseconds relative to the run's origin (the earliest span start).
pub type Ns = i64;

/// Index into [`Timeline::phases`].
pub type PhaseId = u16;

/// Span flag: the analysis names this rank a straggler in this phase, and at this step its
/// time is above the cross-rank median.
pub const FLAG_STRAGGLER: u8 = 1;
/// Span flag: an error was recorded inside the span.
pub const FLAG_ERROR: u8 = 2;

/// The step value shown to users (`None` for spans outside any step).
pub fn step_label(step: u64) -> Option<u64> {
    (step != NO_STEP).then_some(step)
}

/// One span as read from a run, in absolute (epoch) nanoseconds.
#[derive(Debug, Clone)]
pub struct SpanInput<'a> {
    pub rank: u32,
    /// Recording thread id; each distinct thread of a rank gets its own lane.
    pub thread: u64,
    pub name: &'a str,
    pub step: Option<u64>,
    pub start_ns: i64,
    pub dur_ns: i64,
    pub depth: u8,
    pub tags: &'a [&'a str],
    pub error: bool,
}

/// A span's place in the timeline: lane, row within the lane, index within the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanRef {
    pub lane: u32,
    pub row: u16,
    pub ix: u32,
}

/// All spans of one (lane, depth) that do not overlap, sorted by start.
#[derive(Debug, Default, Clone)]
pub struct SpanRow {
    pub depth: u8,
    pub start: Vec<Ns>,
    pub end: Vec<Ns>,
    pub phase: Vec<PhaseId>,
    pub step: Vec<u64>,
    pub tagset: Vec<u16>,
    pub flags: Vec<u8>,
    /// The pipeline slots of the row's pipeline passes, by span index (sparse: most spans
    /// have none), in index order.
    pub pipeline: Vec<(u32, PipelineSlot)>,
}

/// A pipeline pass's label in torch's action notation, `<stage><pass><microbatch>` (`0F3`:
/// stage 0's forward of microbatch 3; `B` backward, `I` / `W` a split backward's input and
/// weight passes, `E` a validation forward); `None` for spans that are not passes.
pub fn pass_label(phase: &str, slot: PipelineSlot) -> Option<String> {
    let pass = match phase {
        titan::FORWARD => "F",
        titan::BACKWARD => "B",
        titan::BACKWARD_INPUT => "I",
        titan::BACKWARD_WEIGHT => "W",
        titan::EVAL_FORWARD => "E",
        other => torch_pipelining::parse_action(other)
            .map(|(_, c)| c)
            .filter(|c| torch_pipelining::is_pass(c))?,
    };
    Some(format!("{}{pass}{}", slot.stage, slot.microbatch))
}

impl SpanRow {
    /// Appends a span that starts at or after the end of the last one.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        start: Ns,
        end: Ns,
        phase: PhaseId,
        step: u64,
        tagset: u16,
        flags: u8,
        slot: Option<PipelineSlot>,
    ) {
        self.start.push(start);
        self.end.push(end);
        self.phase.push(phase);
        self.step.push(step);
        self.tagset.push(tagset);
        self.flags.push(flags);
        if let Some(slot) = slot {
            self.pipeline.push((self.start.len() as u32 - 1, slot));
        }
    }

    /// The pipeline slot of span `i`, if it is a pipeline pass.
    pub fn slot(&self, i: usize) -> Option<PipelineSlot> {
        let k = self
            .pipeline
            .binary_search_by_key(&(i as u32), |&(j, _)| j)
            .ok()?;
        Some(self.pipeline[k].1)
    }

    pub fn len(&self) -> usize {
        self.start.len()
    }

    pub fn is_empty(&self) -> bool {
        self.start.is_empty()
    }

    /// Index of the first span that ends after `t`.
    pub fn first_ending_after(&self, t: Ns) -> usize {
        self.end.partition_point(|&e| e <= t)
    }

    /// Index of the first span that starts at or after `t`.
    pub fn first_starting_at_or_after(&self, t: Ns) -> usize {
        self.start.partition_point(|&s| s < t)
    }

    /// The span covering time `t`, if any.
    pub fn at(&self, t: Ns) -> Option<usize> {
        let i = self.first_ending_after(t);
        (i < self.len() && self.start[i] <= t).then_some(i)
    }
}

/// One recording thread of one rank, drawn as one sub-row per nesting depth.
#[derive(Debug, Clone)]
pub struct Lane {
    pub rank: u32,
    pub thread: u64,
    /// Position of this thread among its rank's threads (0 = the first one seen).
    pub thread_ix: u32,
    pub rows: Vec<SpanRow>,
}

/// A training step: where it starts and ends across all ranks, and its tags.
#[derive(Debug, Clone)]
pub struct StepMark {
    pub step: u64,
    pub start: Ns,
    pub end: Ns,
    pub tags: Vec<u16>,
}

/// One phase at one step in collapsed mode: the spread of that phase across ranks.
#[derive(Debug, Clone, Copy)]
pub struct CollapsedBar {
    pub step: u64,
    /// Median over ranks of the phase's first start in the step.
    pub start: Ns,
    pub stats: PhaseSpread,
    /// The slowest rank here is a straggler of this phase (and above the median).
    pub straggler: bool,
}

impl CollapsedBar {
    pub fn is_straggler(&self) -> bool {
        self.straggler
    }
}

/// One phase as a single lane: min/median/max over ranks per step, sorted by start.
#[derive(Debug, Clone)]
pub struct CollapsedRow {
    pub phase: PhaseId,
    pub bars: Vec<CollapsedBar>,
    /// Longest bar (max duration); bounds the backward search for bars overlapping a time.
    pub max_len: Ns,
}

/// Per-step values of one scalar, reduced across ranks.
#[derive(Debug, Clone)]
pub struct MetricSeries {
    pub name: String,
    pub reduce: Reduce,
    pub points: Vec<(u64, f64)>,
}

impl MetricSeries {
    pub fn at_step(&self, step: u64) -> Option<f64> {
        self.points
            .binary_search_by_key(&step, |p| p.0)
            .ok()
            .map(|i| self.points[i].1)
    }
}

/// Everything the TUI and the static renderer show about one run.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// A name for the title bar (the run directory).
    pub title: String,
    /// Epoch nanoseconds of t = 0.
    pub origin_ns: i64,
    /// End of the last span, relative to the origin.
    pub end: Ns,
    pub phases: Vec<String>,
    /// Phases in display order (shallowest first, then by first appearance).
    pub phase_order: Vec<PhaseId>,
    pub tag_names: Vec<String>,
    /// Distinct tag combinations carried by spans; index 0 is the empty set.
    pub tagsets: Vec<Vec<u16>>,
    pub lanes: Vec<Lane>,
    pub ranks: Vec<u32>,
    pub steps: Vec<StepMark>,
    /// Cross-rank spread of each phase's per-rank time at each step.
    pub phase_step: HashMap<(PhaseId, u64), PhaseSpread>,
    pub collapsed: Vec<CollapsedRow>,
    /// Phase table, stragglers, tagged steps and waits: `titan-obs summary`'s analysis.
    pub analysis: Analysis,
    pub metrics: Vec<MetricSeries>,
    /// Under expert parallelism, each rank's experts' load per MoE layer and step, from
    /// `metrics` (see [`Timeline::set_metrics`]); empty otherwise.
    pub experts_load: HostLoads,
    pub span_count: usize,
    /// Problems met while reading (missing ranks, corrupt parts); shown, never fatal.
    pub warnings: Vec<String>,
    /// Ranks were missing, parts corrupt or lines malformed (`gantt --strict` exits 3).
    pub incomplete: bool,
}

impl Timeline {
    pub fn phase_name(&self, p: PhaseId) -> &str {
        &self.phases[p as usize]
    }

    pub fn phase_id(&self, name: &str) -> Option<PhaseId> {
        self.phases
            .iter()
            .position(|n| n == name)
            .map(|i| i as PhaseId)
    }

    pub fn tags_of(&self, tagset: u16) -> impl Iterator<Item = &str> {
        self.tagsets[tagset as usize]
            .iter()
            .map(|&t| self.tag_names[t as usize].as_str())
    }

    pub fn row(&self, r: SpanRef) -> &SpanRow {
        &self.lanes[r.lane as usize].rows[r.row as usize]
    }

    /// Index into `steps` of step number `step`.
    pub fn step_index(&self, step: u64) -> Option<usize> {
        self.steps.binary_search_by_key(&step, |s| s.step).ok()
    }

    /// The step whose time range contains `t` (the last one starting at or before `t`).
    pub fn step_at(&self, t: Ns) -> Option<&StepMark> {
        let i = self.steps.partition_point(|s| s.start <= t);
        (i > 0).then(|| &self.steps[i - 1]).filter(|s| t <= s.end)
    }

    /// Sets the per-step metric series, and the expert load derived from them.
    pub fn set_metrics(&mut self, metrics: Vec<MetricSeries>) {
        self.experts_load = HostLoads::from_series(
            metrics
                .iter()
                .map(|m| (m.name.as_str(), m.points.as_slice())),
        );
        self.metrics = metrics;
    }

    /// Under expert parallelism, the load of `rank`'s experts in the MoE layer whose experts
    /// span is `phase`, at `step`.
    pub fn experts_load_at(&self, rank: u32, phase: PhaseId, step: u64) -> Option<HostLoad> {
        if self.experts_load.is_empty() || step == NO_STEP {
            return None;
        }
        let layer = moe::parse_experts_span(self.phase_name(phase))?;
        self.experts_load.at(rank, layer, step)
    }

    /// The training scalar called `needle` (`loss` finds `training/loss`, not `validation/loss`).
    pub fn metric(&self, needle: &str) -> Option<&MetricSeries> {
        let suffix = format!("/{needle}");
        self.metrics
            .iter()
            .find(|m| m.name == needle)
            .or_else(|| {
                self.metrics
                    .iter()
                    .find(|m| m.name.ends_with(&suffix) && !m.name.starts_with("validation/"))
            })
            .or_else(|| self.metrics.iter().find(|m| m.name.contains(needle)))
    }

    /// The analysis's straggler record of `rank` in `phase`, if it is one.
    pub fn straggler(&self, phase: PhaseId, rank: u32) -> Option<&Straggler> {
        let name = self.phase_name(phase);
        self.analysis
            .stragglers
            .iter()
            .find(|s| s.rank == rank && s.phase == name)
    }

    /// The rank that made the others wait most at collectives, and the phase it was late from.
    pub fn late_rank(&self) -> Option<(u32, &str)> {
        self.analysis
            .waits
            .table
            .first()
            .map(|w| (w.rank, w.phase.as_str()))
    }

    pub fn threads_per_rank_max(&self) -> u32 {
        self.lanes
            .iter()
            .map(|l| l.thread_ix + 1)
            .max()
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, Copy)]
struct RawSpan {
    start: i64,
    dur: i64,
    phase: PhaseId,
    depth: u8,
    error: bool,
    step: u64,
    tagset: u16,
    slot: Option<PipelineSlot>,
}

/// Collects spans, step tags and scalars, then precomputes a [`Timeline`].
#[derive(Default)]
pub struct TimelineBuilder {
    title: String,
    phases: Vec<String>,
    phase_ix: HashMap<String, PhaseId>,
    tag_names: Vec<String>,
    tag_ix: HashMap<String, u16>,
    tagsets: Vec<Vec<u16>>,
    tagset_ix: HashMap<Vec<u16>, u16>,
    lanes: BTreeMap<(u32, u64), Vec<RawSpan>>,
    step_tags: BTreeMap<u64, BTreeSet<u16>>,
    scalars: BTreeMap<String, (Reduce, BTreeMap<u64, Vec<f64>>)>,
    ranks: BTreeSet<u32>,
    warnings: Vec<String>,
    /// The ranks stragglers are compared within (pipeline stages; empty: all ranks).
    stage_groups: Vec<Vec<u32>>,
}

impl TimelineBuilder {
    pub fn new(title: impl Into<String>) -> Self {
        let mut b = Self {
            title: title.into(),
            ..Self::default()
        };
        b.tagsets.push(Vec::new());
        b.tagset_ix.insert(Vec::new(), 0);
        b
    }

    /// Id of phase `name`, for [`Self::add_span_ids`].
    pub fn phase(&mut self, name: &str) -> PhaseId {
        if let Some(&p) = self.phase_ix.get(name) {
            return p;
        }
        let p = PhaseId::try_from(self.phases.len()).unwrap_or(PhaseId::MAX);
        self.phases.push(name.to_string());
        self.phase_ix.insert(name.to_string(), p);
        p
    }

    fn tag(&mut self, name: &str) -> u16 {
        if let Some(&t) = self.tag_ix.get(name) {
            return t;
        }
        let t = u16::try_from(self.tag_names.len()).unwrap_or(u16::MAX);
        self.tag_names.push(name.to_string());
        self.tag_ix.insert(name.to_string(), t);
        t
    }

    /// Id of a set of tags, for [`Self::add_span_ids`].
    pub fn tagset(&mut self, tags: &[&str]) -> u16 {
        if tags.is_empty() {
            return 0;
        }
        let mut ids: Vec<u16> = tags.iter().map(|t| self.tag(t)).collect();
        ids.sort_unstable();
        ids.dedup();
        if let Some(&s) = self.tagset_ix.get(&ids) {
            return s;
        }
        let s = u16::try_from(self.tagsets.len()).unwrap_or(u16::MAX);
        self.tagsets.push(ids.clone());
        self.tagset_ix.insert(ids, s);
        s
    }

    /// Declares a rank as part of the run even if it recorded nothing yet.
    pub fn add_rank(&mut self, rank: u32) {
        self.ranks.insert(rank);
    }

    pub fn add_span(&mut self, s: &SpanInput<'_>) {
        let phase = self.phase(s.name);
        let tagset = self.tagset(s.tags);
        let step = s.step.unwrap_or(NO_STEP);
        self.ranks.insert(s.rank);
        self.lanes
            .entry((s.rank, s.thread))
            .or_default()
            .push(RawSpan {
                start: s.start_ns,
                dur: s.dur_ns.max(0),
                phase,
                depth: s.depth,
                error: s.error,
                step,
                tagset,
                slot: None,
            });
    }

    /// Adds a span whose phase and tag set are already interned (the fast path for big runs).
    #[allow(clippy::too_many_arguments)]
    pub fn add_span_ids(
        &mut self,
        rank: u32,
        thread: u64,
        phase: PhaseId,
        tagset: u16,
        step: Option<u64>,
        start_ns: i64,
        dur_ns: i64,
        depth: u8,
        error: bool,
        slot: Option<PipelineSlot>,
    ) {
        let step = step.unwrap_or(NO_STEP);
        self.ranks.insert(rank);
        self.lanes.entry((rank, thread)).or_default().push(RawSpan {
            start: start_ns,
            dur: dur_ns.max(0),
            phase,
            depth,
            error,
            step,
            tagset,
            slot,
        });
    }

    /// Tags a step (e.g. `checkpoint`, `validation`); shown as a marker on the step row.
    pub fn add_step_tag(&mut self, step: u64, tag: &str) {
        let t = self.tag(tag);
        self.step_tags.entry(step).or_default().insert(t);
    }

    pub fn add_scalar(&mut self, name: &str, step: u64, value: f64, reduce: Reduce) {
        let entry = self
            .scalars
            .entry(name.to_string())
            .or_insert_with(|| (reduce, BTreeMap::new()));
        entry.1.entry(step).or_default().push(value);
    }

    pub fn add_warning(&mut self, w: impl Into<String>) {
        self.warnings.push(w.into());
    }

    /// Compares each rank only with the ranks of its group when finding stragglers: under
    /// pipeline parallelism, the ranks of its stage ([`titan_obs_core::analysis::stage_groups`]),
    /// as `titan-obs summary` does.
    pub fn compare_within(&mut self, groups: Vec<Vec<u32>>) {
        self.stage_groups = groups;
    }

    /// The analysis of the collected spans, and each (phase, step, rank)'s total time.
    fn analyse(&self) -> (Analysis, titan_obs_core::analysis::RankTimes) {
        let n: usize = self.lanes.values().map(Vec::len).sum();
        let mut spans = OwnedSpans::with_capacity(n);
        // A dense thread index per rank, in thread order (ids may be 64-bit): the analysis
        // tells a rank's main thread from its background threads by it.
        let mut last_rank = None;
        let mut thread_index = 0u32;
        for (&(r, _), raw) in &self.lanes {
            if last_rank == Some(r) {
                thread_index += 1;
            } else {
                (last_rank, thread_index) = (Some(r), 0);
            }
            for s in raw {
                spans.push_on(
                    r,
                    thread_index,
                    s.step,
                    u32::from(s.phase),
                    s.start,
                    s.dur,
                    u16::from(s.depth),
                );
            }
        }
        let table = spans.table(&self.phases);
        let shape = RunShape {
            ranks: self.ranks.iter().copied().collect(),
            step_tags: self
                .step_tags
                .iter()
                .filter(|(_, t)| !t.is_empty())
                .map(|(&s, t)| {
                    let names = t.iter().map(|&i| self.tag_names[i as usize].clone());
                    (s, names.collect())
                })
                .collect(),
        };
        let analysis = analyse_grouped(
            &table,
            &shape,
            &self.stage_groups,
            &StragglerOptions::default(),
        );
        (analysis, rank_times(&table))
    }

    /// Sorts, splits into rows and precomputes every statistic.
    pub fn finish(self) -> Timeline {
        let (analysis, times) = self.analyse();
        let origin = self
            .lanes
            .values()
            .flat_map(|v| v.iter().map(|s| s.start))
            .min()
            .unwrap_or(0);
        let span_count = self.lanes.values().map(Vec::len).sum();
        let mut thread_counter: HashMap<u32, u32> = HashMap::new();
        let mut lanes = Vec::with_capacity(self.lanes.len());
        for ((rank, thread), raw) in self.lanes {
            let thread_ix = {
                let c = thread_counter.entry(rank).or_insert(0);
                *c += 1;
                *c - 1
            };
            lanes.push(Lane {
                rank,
                thread,
                thread_ix,
                rows: build_rows(raw, origin),
            });
        }
        let end = lanes
            .iter()
            .flat_map(|l| l.rows.iter().filter_map(|r| r.end.last().copied()))
            .max()
            .unwrap_or(0);
        let steps = build_steps(&lanes, &self.step_tags);
        let phase_order = build_phase_order(&lanes, self.phases.len());
        let phase_step: HashMap<(PhaseId, u64), PhaseSpread> = phase_step_spread(&times)
            .into_iter()
            .map(|((name, step), s)| ((name as PhaseId, step), s))
            .collect();
        let stragglers: HashSet<(PhaseId, u32)> = analysis
            .stragglers
            .iter()
            .filter_map(|s| Some((*self.phase_ix.get(&s.phase)?, s.rank)))
            .collect();
        mark_stragglers(&mut lanes, &stragglers, &times, &phase_step);
        let collapsed = collapsed_rows(&phase_step, &stragglers, &phase_order, origin);
        let metrics = self
            .scalars
            .into_iter()
            .map(|(name, (reduce, by_step))| MetricSeries {
                name,
                reduce,
                points: by_step
                    .into_iter()
                    .map(|(step, vals)| (step, reduce.apply(&vals)))
                    .collect(),
            })
            .collect();
        let mut t = Timeline {
            title: self.title,
            origin_ns: origin,
            end,
            phases: self.phases,
            phase_order,
            tag_names: self.tag_names,
            tagsets: self.tagsets,
            lanes,
            ranks: self.ranks.into_iter().collect(),
            steps,
            phase_step,
            collapsed,
            analysis,
            metrics: Vec::new(),
            experts_load: HostLoads::default(),
            span_count,
            warnings: self.warnings,
            incomplete: false,
        };
        t.set_metrics(metrics);
        t
    }
}

/// Flags the spans of every (rank, phase) the analysis names a straggler at the steps where
/// that rank's time is above the cross-rank median.
fn mark_stragglers(
    lanes: &mut [Lane],
    stragglers: &HashSet<(PhaseId, u32)>,
    times: &titan_obs_core::analysis::RankTimes,
    spread: &HashMap<(PhaseId, u64), PhaseSpread>,
) {
    if stragglers.is_empty() {
        return;
    }
    for lane in lanes {
        let rank = lane.rank;
        for row in &mut lane.rows {
            for k in 0..row.len() {
                let (phase, step) = (row.phase[k], row.step[k]);
                if !stragglers.contains(&(phase, rank)) {
                    continue;
                }
                let mine = times.get(&(u32::from(phase), step, rank)).map(|t| t.0);
                let median = spread.get(&(phase, step)).map(|s| s.median);
                if let (Some(m), Some(med)) = (mine, median)
                    && m > med
                {
                    row.flags[k] |= FLAG_STRAGGLER;
                }
            }
        }
    }
}

/// One collapsed row per phase, bars sorted by start.
pub(crate) fn collapsed_rows(
    spread: &HashMap<(PhaseId, u64), PhaseSpread>,
    stragglers: &HashSet<(PhaseId, u32)>,
    phase_order: &[PhaseId],
    origin: i64,
) -> Vec<CollapsedRow> {
    let mut by_phase: HashMap<PhaseId, Vec<CollapsedBar>> = HashMap::new();
    for (&(phase, step), s) in spread {
        by_phase.entry(phase).or_default().push(CollapsedBar {
            step,
            start: s.median_start - origin,
            stats: *s,
            straggler: s.max > s.median && stragglers.contains(&(phase, s.max_rank)),
        });
    }
    phase_order
        .iter()
        .filter_map(|&phase| {
            let mut bars = by_phase.remove(&phase)?;
            bars.sort_unstable_by_key(|b| (b.start, b.step));
            let max_len = bars.iter().map(|b| b.stats.max).max().unwrap_or(0);
            Some(CollapsedRow {
                phase,
                bars,
                max_len,
            })
        })
        .collect()
}

/// Splits one thread's spans into non-overlapping rows, one or more per depth.
///
/// Properly nested spans of one thread never overlap at the same depth, so normally there is
/// exactly one row per depth; an overlap (clock adjustments, a misbehaving recorder) opens an
/// extra row for that depth instead of breaking the sorted-ends invariant binary search relies on.
fn build_rows(mut raw: Vec<RawSpan>, origin: i64) -> Vec<SpanRow> {
    raw.sort_unstable_by_key(|s| (s.depth, s.start));
    let mut rows: Vec<SpanRow> = Vec::new();
    let mut first_row_of_depth = 0;
    let mut current_depth = None;
    for s in raw {
        if current_depth != Some(s.depth) {
            current_depth = Some(s.depth);
            first_row_of_depth = rows.len();
        }
        let start = s.start - origin;
        let end = start + s.dur;
        let row_ix = (first_row_of_depth..rows.len())
            .find(|&r| rows[r].end.last().is_none_or(|&e| e <= start))
            .unwrap_or_else(|| {
                rows.push(SpanRow {
                    depth: s.depth,
                    ..SpanRow::default()
                });
                rows.len() - 1
            });
        let flags = if s.error { FLAG_ERROR } else { 0 };
        rows[row_ix].push(start, end, s.phase, s.step, s.tagset, flags, s.slot);
    }
    rows
}

fn build_steps(lanes: &[Lane], step_tags: &BTreeMap<u64, BTreeSet<u16>>) -> Vec<StepMark> {
    let mut bounds: BTreeMap<u64, (Ns, Ns)> = BTreeMap::new();
    for lane in lanes {
        for row in &lane.rows {
            for i in 0..row.len() {
                if row.step[i] == NO_STEP {
                    continue;
                }
                let b = bounds.entry(row.step[i]).or_insert((Ns::MAX, Ns::MIN));
                b.0 = b.0.min(row.start[i]);
                b.1 = b.1.max(row.end[i]);
            }
        }
    }
    bounds
        .into_iter()
        .map(|(step, (start, end))| StepMark {
            step,
            start,
            end,
            tags: step_tags
                .get(&step)
                .map(|t| t.iter().copied().collect())
                .unwrap_or_default(),
        })
        .collect()
}

fn build_phase_order(lanes: &[Lane], n: usize) -> Vec<PhaseId> {
    let mut first: Vec<(u8, Ns)> = vec![(u8::MAX, Ns::MAX); n];
    for lane in lanes {
        for row in &lane.rows {
            for i in 0..row.len() {
                let f = &mut first[row.phase[i] as usize];
                // Rows are sorted by start, so the first occurrence per row is the earliest.
                if (row.depth, row.start[i]) < *f {
                    *f = (row.depth, row.start[i]);
                }
            }
        }
    }
    let mut order: Vec<PhaseId> = (0..n as PhaseId).collect();
    order.sort_by_key(|&p| first[p as usize]);
    order
}
