//! Node figures (issue 42, `obs/SCHEMA.md` "Node figures"): `RUN/obs/node-<host>.figures`
//! holds what `titan-obs summary` needs from the ranks of one host, merged, in a size that
//! grows with the node's steps and ranks x phases, not with ranks x steps: a 16 384-rank job
//! is 2 048 files a reader merges one at a time, with no per-(phase, step, rank) cell held.
//!
//! What a node's figures hold, and what they give up:
//! - per phase the merged [`PhaseDigest`] (counts, sums, extremes, duration sketch): exact
//!   merges, as from the rank summaries;
//! - per step the slowest rank's step time, the number of ranks with one and their sum;
//!   per rank its last step with step time: exact (max and sum merge);
//! - per collective call (step, name, ordinal) the last arrival (start, rank, the phase it
//!   came from), how many ranks arrived and the time they waited for the node's last: the
//!   "waiting on" table comes out exactly as from the rank summaries;
//! - per tagged step the longest time a rank spent in the step's tag phases: exact;
//! - per rank and phase the distribution of its per-step times ([`StepTimes`], relative
//!   error [`super::SKETCH_ALPHA`]), each less the time in the collectives that start inside
//!   the phase (all of it: the part that was waiting for later ranks is not known per rank
//!   until every node is read). The straggler rule compares each rank's distribution with the
//!   pooled one of all ranks (see `analysis::figured`) instead of each step's cross-rank
//!   median; the steps in which a rank was the slowest are not known.
//!
//! Who writes it: [`super::node::update`], under the node's lock, from the rank summaries
//! its rollup holds, after each rank's part writer replaced its entry. Each rank's entry
//! records its folder's mtime and last part, as the rollup's do, so a reader can tell a rank
//! whose folder changed since ([`read_local`] then recomputes that node from its ranks'
//! summaries).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use rustc_hash::FxHashMap;

use super::file::{Reader, Writer, check_head, checked_body, framed};
use super::merged::{CollectiveContext, RunDigest};
use super::{PhaseDigest, RankDigest, SKETCH_ALPHA};
use crate::tables::{NameId, intern};
use crate::vocab;

/// Where readers start reading node figures by default (`summary --node-figures auto`, the
/// TUI's whole-run analysis): at 1024 ranks x 24 h the rank summaries take ~1.9 s (README),
/// growing with ranks x steps; below, the step-by-step straggler rule is cheap enough to keep.
pub const AUTO_FIGURES_RANKS: usize = 1024;

const MAGIC: &[u8; 8] = b"TOBSFIG1";
const VERSION: u32 = 1;
/// magic, version, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 4;
const SUFFIX: &str = ".figures";
/// Values below 1 ns fall in this bin (a zero-length phase).
const ZERO_KEY: i32 = i32::MIN;

/// The figures file of the node whose rollup is `rollup_name` (`node-<host>.summary`).
pub fn file_name(rollup_name: &str) -> String {
    let stem = rollup_name.strip_suffix(".summary").unwrap_or(rollup_name);
    format!("{stem}{SUFFIX}")
}

/// Whether `name` is a figures file's name.
pub fn is_figures_name(name: &str) -> bool {
    name.starts_with("node-") && name.ends_with(SUFFIX) && name.len() > 5 + SUFFIX.len()
}

/// The log-spaced bins of [`StepTimes`]: DDSketch's logarithmic mapping with the summaries'
/// relative error, so a bin's value is within [`SKETCH_ALPHA`] of every value in it.
struct Bins {
    gamma_ln: f64,
    gamma: f64,
}

impl Bins {
    fn new() -> Self {
        let gamma = (1.0 + SKETCH_ALPHA) / (1.0 - SKETCH_ALPHA);
        Bins {
            gamma_ln: gamma.ln(),
            gamma,
        }
    }
    fn key(&self, v: f64) -> i32 {
        if v < 1.0 {
            ZERO_KEY
        } else {
            (v.ln() / self.gamma_ln).floor() as i32
        }
    }
    fn value(&self, key: i32) -> f64 {
        if key == ZERO_KEY {
            0.0
        } else {
            (f64::from(key) * self.gamma_ln).exp() * (2.0 * self.gamma / (1.0 + self.gamma))
        }
    }
}

/// One rank's per-step times in one phase, as a histogram of log-spaced bins (a rank's steps
/// span a narrow range: tens of bins, not one cell per step).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    pub steps: u64,
    pub min_ns: i64,
    pub max_ns: i64,
    /// (bin key, count), keys ascending.
    pub bins: Vec<(i32, u64)>,
}

impl StepTimes {
    /// The histogram of `values`.
    pub fn of(values: impl IntoIterator<Item = i64>) -> Self {
        let b = Bins::new();
        let mut bins: BTreeMap<i32, u64> = BTreeMap::new();
        let (mut steps, mut min_ns, mut max_ns) = (0u64, i64::MAX, i64::MIN);
        for v in values {
            steps += 1;
            min_ns = min_ns.min(v);
            max_ns = max_ns.max(v);
            *bins.entry(b.key(v as f64)).or_default() += 1;
        }
        StepTimes {
            steps,
            min_ns,
            max_ns,
            bins: bins.into_iter().collect(),
        }
    }

    /// Adds one value.
    pub fn add(&mut self, v: i64) {
        let key = Bins::new().key(v as f64);
        match self.bins.binary_search_by_key(&key, |b| b.0) {
            Ok(i) => self.bins[i].1 += 1,
            Err(i) => self.bins.insert(i, (key, 1)),
        }
        (self.min_ns, self.max_ns) = if self.steps == 0 {
            (v, v)
        } else {
            (self.min_ns.min(v), self.max_ns.max(v))
        };
        self.steps += 1;
    }

    /// The nearest-rank `q`-quantile (as [`crate::stats::nearest_rank_index`] picks it),
    /// within [`SKETCH_ALPHA`]; 0 when empty.
    pub fn nearest_rank(&self, q: f64) -> i64 {
        if self.steps == 0 {
            return 0;
        }
        let k = crate::stats::nearest_rank_index(self.steps as usize, q) as u64;
        self.at_rank(k).round() as i64
    }

    /// `self` and `o` as one histogram.
    pub fn merge(&mut self, o: &StepTimes) {
        if o.steps == 0 {
            return;
        }
        let mut bins: BTreeMap<i32, u64> = self.bins.iter().copied().collect();
        for &(k, c) in &o.bins {
            *bins.entry(k).or_default() += c;
        }
        self.bins = bins.into_iter().collect();
        self.min_ns = if self.steps == 0 {
            o.min_ns
        } else {
            self.min_ns.min(o.min_ns)
        };
        self.max_ns = if self.steps == 0 {
            o.max_ns
        } else {
            self.max_ns.max(o.max_ns)
        };
        self.steps = self.steps.saturating_add(o.steps);
    }

    /// The k-th smallest value (0-based), within [`SKETCH_ALPHA`], clamped to the exact
    /// extremes.
    fn at_rank(&self, k: u64) -> f64 {
        if k == 0 {
            return self.min_ns as f64;
        }
        if k + 1 >= self.steps {
            return self.max_ns as f64;
        }
        let b = Bins::new();
        let mut seen = 0u64;
        for &(key, c) in &self.bins {
            seen += c;
            if seen > k {
                return b.value(key).clamp(self.min_ns as f64, self.max_ns as f64);
            }
        }
        self.max_ns as f64
    }

    /// The median (the mean of the two middle values for an even count); NaN when empty.
    pub fn median(&self) -> f64 {
        match self.steps {
            0 => f64::NAN,
            n if n % 2 == 1 => self.at_rank(n / 2),
            n => (self.at_rank(n / 2 - 1) + self.at_rank(n / 2)) / 2.0,
        }
    }

    /// How many of the values lie in bins above the bin of `v` (values in `v`'s own bin are
    /// within [`SKETCH_ALPHA`] of it and do not count as above).
    pub fn above(&self, v: f64) -> u64 {
        if v < self.min_ns as f64 {
            return self.steps;
        }
        if v >= self.max_ns as f64 {
            return 0;
        }
        let key = Bins::new().key(v);
        self.bins
            .iter()
            .filter(|(k, _)| *k > key)
            .map(|(_, c)| c)
            .sum()
    }
}

/// One rank of a node's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankFigures {
    pub rank: u32,
    /// Its folder's mtime and last part when summarised (see [`super::node::Entry`]).
    pub dir_mtime_ns: u64,
    pub last_part: Option<u64>,
    /// The world size its parts' headers give.
    pub world_size: u32,
    /// Its last step with step time.
    pub last_step: Option<u64>,
    /// Per phase (the figures' name ids) that ran inside steps: its per-step times.
    pub phases: Vec<(NameId, StepTimes)>,
}

/// One step of a node (or, merged, of the job).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepFigures {
    /// The slowest rank's step time.
    pub wall_max: i64,
    /// Ranks with step time in this step, and the sum of their step times.
    pub ranks: u32,
    pub wall_sum: i64,
}

/// One collective call (the n-th call of a name in a step on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallFigures {
    /// Ranks that arrived.
    pub ranks: u32,
    /// The last arrival: its start (rank 0's clock) and rank (ties: the highest rank).
    pub last_start: i64,
    pub last_rank: u32,
    /// The phase the last rank came from ([`CollectiveContext::UNKNOWN`] when unknown).
    pub last_before: NameId,
    /// Sum over the ranks that arrived of (last start - their start).
    pub waited_ns: i64,
}

impl CallFigures {
    /// Folds in the same call on other ranks.
    pub fn merge(&mut self, o: &CallFigures) {
        let (mine, theirs) = (
            (self.last_start, self.last_rank),
            (o.last_start, o.last_rank),
        );
        let later = |a: i64, b: i64, n: u32| a.saturating_sub(b).saturating_mul(i64::from(n));
        if theirs > mine {
            self.waited_ns = self
                .waited_ns
                .saturating_add(later(o.last_start, self.last_start, self.ranks))
                .saturating_add(o.waited_ns);
            self.last_start = o.last_start;
            self.last_rank = o.last_rank;
            self.last_before = o.last_before;
        } else {
            self.waited_ns = self
                .waited_ns
                .saturating_add(o.waited_ns)
                .saturating_add(later(self.last_start, o.last_start, o.ranks));
        }
        self.ranks = self.ranks.saturating_add(o.ranks);
    }
}

/// A node's figures (or, merged, a job's), with its own name ids.
#[derive(Debug, Clone, Default)]
pub struct NodeFigures {
    /// The run the figures are of: the lowest rank's newest run id (ranks with records of
    /// another run are in `other_run_ranks`, not in the figures).
    pub run_id: String,
    pub names: Vec<String>,
    /// By rank.
    pub ranks: Vec<RankFigures>,
    /// Ranks with records of another run than `run_id`.
    pub other_run_ranks: Vec<u32>,
    pub spans: u64,
    pub errors: u64,
    /// Parts compacted from damaged journals, and spans that belong to pipeline schedules:
    /// a reader of figures leaves runs with either to the rank summaries, which report them.
    pub damaged_parts: u64,
    pub pipeline_spans: u64,
    /// By name id.
    pub phases: Vec<(NameId, PhaseDigest)>,
    pub steps: BTreeMap<u64, StepFigures>,
    /// By (step, collective name, ordinal).
    pub calls: BTreeMap<(u64, NameId, u32), CallFigures>,
    /// Per tagged step: its tags, and the longest time one rank spent in their phases.
    pub tagged: BTreeMap<u64, (BTreeSet<String>, i64)>,
    /// (rank, step, name, message): the parts' named error records.
    pub named_errors: Vec<(u32, u64, NameId, String)>,
}

/// A rank as the figures are built from it.
pub struct RankInput<'a> {
    pub rank: u32,
    pub dir_mtime_ns: u64,
    pub last_part: Option<u64>,
    pub digest: &'a RankDigest,
}

impl NodeFigures {
    /// The figures of `ranks` (one node's, or any set of ranks).
    pub fn build(ranks: &[RankInput<'_>]) -> NodeFigures {
        let run_id = ranks
            .iter()
            .min_by_key(|r| r.rank)
            .and_then(|r| r.digest.segments.last())
            .map(|s| s.digest.info.run_id.clone())
            .unwrap_or_default();
        let mut names: Vec<String> = Vec::new();
        let mut name_ids: HashMap<String, u32> = HashMap::new();
        let mut d = RunDigest::default();
        let mut out = NodeFigures {
            run_id: run_id.clone(),
            ..Default::default()
        };
        // Per rank: its step tags by step.
        let mut step_tags: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
        let mut inputs: Vec<&RankInput<'_>> = Vec::new();
        for r in ranks {
            // A rank with records of another run: `summary` would name that run; the
            // figures leave such folders to the rank summaries.
            if r.digest
                .segments
                .iter()
                .any(|s| s.digest.info.run_id != run_id)
            {
                out.other_run_ranks.push(r.rank);
                continue;
            }
            inputs.push(r);
            for seg in &r.digest.segments {
                let p = &seg.digest;
                let map: Vec<u32> = p
                    .names
                    .iter()
                    .map(|n| intern(&mut names, &mut name_ids, n))
                    .collect();
                d.merge(p, &map, p.info.clock_offset_ns);
                out.damaged_parts +=
                    seg.parts.iter().filter(|c| !c.damage.is_empty()).count() as u64;
                for &(step, mask) in &p.step_tags {
                    let tags = (0..p.tags.len().min(64))
                        .filter(|&i| mask & (1 << i) != 0)
                        .map(|i| p.tags[i].clone());
                    step_tags.entry(step).or_default().extend(tags);
                }
            }
        }
        out.other_run_ranks.sort_unstable();
        out.spans = d.spans;
        out.errors = d.errors;
        out.pipeline_spans = d.pipeline_spans;
        out.phases = d
            .phases
            .iter()
            .enumerate()
            .filter_map(|(id, p)| Some((id as NameId, p.clone()?)))
            .collect();
        out.named_errors = std::mem::take(&mut d.named_errors);

        // Per rank position: its per-step times per phase, its last step.
        let n = d.ranks.len();
        // The collectives that start inside each phase: a phase's time is kept less theirs
        // (a rank that waits in an all_reduce for a late one is not slow; the late one is).
        let mut nested: BTreeMap<NameId, BTreeSet<NameId>> = BTreeMap::new();
        for c in &d.contexts {
            for &x in &d.container_sets[c.containers as usize] {
                nested.entry(x).or_default().insert(c.name);
            }
        }
        let mut per_rank: Vec<Vec<(NameId, Vec<i64>)>> = vec![Vec::new(); n];
        for (id, cells) in d.cells.iter().enumerate() {
            let in_step = d
                .phases
                .get(id)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.in_step > 0);
            if !in_step {
                continue;
            }
            let inside: Vec<&super::cells::Cells> = nested
                .get(&(id as NameId))
                .into_iter()
                .flatten()
                .filter_map(|&c| d.cells.get(c as usize))
                .collect();
            let mut by_pos: Vec<Vec<i64>> = vec![Vec::new(); n];
            cells.each(|row, pos, v| {
                let collectives = inside
                    .iter()
                    .filter_map(|c| c.get(row, pos))
                    .fold(0i64, i64::saturating_add);
                if let Some(col) = by_pos.get_mut(pos as usize) {
                    col.push(v.saturating_sub(collectives).max(0));
                }
            });
            for (pos, values) in by_pos.into_iter().enumerate() {
                if !values.is_empty() {
                    per_rank[pos].push((id as NameId, values));
                }
            }
        }
        let mut last_step: Vec<Option<u64>> = vec![None; n];
        d.walls.each(|row, pos, v| {
            let step = d.steps[row as usize];
            let s = out.steps.entry(step).or_default();
            s.wall_max = if s.ranks == 0 { v } else { s.wall_max.max(v) };
            s.ranks += 1;
            s.wall_sum = s.wall_sum.saturating_add(v);
            if let Some(l) = last_step.get_mut(pos as usize) {
                *l = (*l).max(Some(step));
            }
        });
        // Steps with spans but no step time (no `step` span) are steps all the same.
        for &step in &d.steps {
            out.steps.entry(step).or_default();
        }
        let input_of: HashMap<u32, &RankInput<'_>> = inputs.iter().map(|r| (r.rank, *r)).collect();
        for (pos, &rank) in d.ranks.iter().enumerate() {
            let Some(input) = input_of.get(&rank) else {
                continue;
            };
            let world_size = input
                .digest
                .segments
                .iter()
                .map(|s| s.digest.info.header.world_size)
                .max()
                .unwrap_or(0);
            out.ranks.push(RankFigures {
                rank,
                dir_mtime_ns: input.dir_mtime_ns,
                last_part: input.last_part,
                world_size,
                last_step: last_step[pos],
                phases: std::mem::take(&mut per_rank[pos])
                    .into_iter()
                    .map(|(id, v)| (id, StepTimes::of(v)))
                    .collect(),
            });
        }
        // A rank with no digest content still counts as a rank of the node.
        for r in &inputs {
            if !out.ranks.iter().any(|f| f.rank == r.rank) {
                out.ranks.push(RankFigures {
                    rank: r.rank,
                    dir_mtime_ns: r.dir_mtime_ns,
                    last_part: r.last_part,
                    ..Default::default()
                });
            }
        }
        out.ranks.sort_by_key(|r| r.rank);

        // Collective calls: the n-th call of a name a rank started in a step is one call.
        for (&step, colls) in &d.collectives {
            let mut arrivals: Vec<(NameId, u32, i64, NameId)> = colls
                .iter()
                .map(|c| {
                    let ctx: &CollectiveContext = &d.contexts[c.context as usize];
                    (ctx.name, c.rank, c.start_ns, ctx.before)
                })
                .collect();
            arrivals.sort_unstable_by_key(|&(name, rank, start, _)| (name, rank, start));
            let mut ordinal = 0u32;
            for i in 0..arrivals.len() {
                let (name, rank, start, before) = arrivals[i];
                ordinal = match i.checked_sub(1).map(|p| arrivals[p]) {
                    Some((pn, pr, _, _)) if (pn, pr) == (name, rank) => ordinal + 1,
                    _ => 0,
                };
                let one = CallFigures {
                    ranks: 1,
                    last_start: start,
                    last_rank: rank,
                    last_before: before,
                    waited_ns: 0,
                };
                out.calls
                    .entry((step, name, ordinal))
                    .and_modify(|c| c.merge(&one))
                    .or_insert(one);
            }
        }

        // Tagged steps: per rank the union of its spans of the step's tag phases.
        let mut tag_iv: BTreeMap<(u64, u32), Vec<(i64, i64)>> = BTreeMap::new();
        for &(step, rank, name, a, e) in &d.tag_spans {
            let (Some(tags), Some(n)) = (step_tags.get(&step), names.get(name as usize)) else {
                continue;
            };
            if tags.iter().any(|t| vocab::is_tag_phase(n, t)) {
                tag_iv.entry((step, rank)).or_default().push((a, e));
            }
        }
        for (step, tags) in step_tags {
            out.tagged.insert(step, (tags, 0));
        }
        for ((step, _), mut iv) in tag_iv {
            let len = crate::stats::union_len(&mut iv);
            if let Some(t) = out.tagged.get_mut(&step) {
                t.1 = t.1.max(len);
            }
        }
        out.names = names;
        out
    }

    /// Folds `o` (figures of other ranks) into `self`, mapping its names.
    pub fn merge(&mut self, o: &NodeFigures) {
        let mut ids: HashMap<String, u32> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i as u32))
            .collect();
        let map: Vec<NameId> = o
            .names
            .iter()
            .map(|n| intern(&mut self.names, &mut ids, n))
            .collect();
        let g = |n: NameId| {
            if n == CollectiveContext::UNKNOWN {
                n
            } else {
                map.get(n as usize)
                    .copied()
                    .unwrap_or(CollectiveContext::UNKNOWN)
            }
        };
        self.spans = self.spans.saturating_add(o.spans);
        self.errors = self.errors.saturating_add(o.errors);
        self.damaged_parts = self.damaged_parts.saturating_add(o.damaged_parts);
        self.pipeline_spans = self.pipeline_spans.saturating_add(o.pipeline_spans);
        self.other_run_ranks.extend(&o.other_run_ranks);
        let mut phases: BTreeMap<NameId, PhaseDigest> =
            std::mem::take(&mut self.phases).into_iter().collect();
        for (id, p) in &o.phases {
            phases.entry(g(*id)).or_default().merge(p);
        }
        self.phases = phases.into_iter().collect();
        self.ranks.extend(o.ranks.iter().map(|r| RankFigures {
            phases: r.phases.iter().map(|(id, t)| (g(*id), t.clone())).collect(),
            ..r.clone()
        }));
        for (&step, s) in &o.steps {
            let e = self.steps.entry(step).or_default();
            if s.ranks > 0 {
                e.wall_max = if e.ranks == 0 {
                    s.wall_max
                } else {
                    e.wall_max.max(s.wall_max)
                };
            }
            e.ranks = e.ranks.saturating_add(s.ranks);
            e.wall_sum = e.wall_sum.saturating_add(s.wall_sum);
        }
        for (&(step, name, ordinal), c) in &o.calls {
            let c = CallFigures {
                last_before: g(c.last_before),
                ..*c
            };
            self.calls
                .entry((step, g(name), ordinal))
                .and_modify(|m| m.merge(&c))
                .or_insert(c);
        }
        for (&step, (tags, len)) in &o.tagged {
            let e = self.tagged.entry(step).or_default();
            e.0.extend(tags.iter().cloned());
            e.1 = e.1.max(*len);
        }
        self.named_errors.extend(
            o.named_errors
                .iter()
                .map(|(r, s, n, m)| (*r, *s, g(*n), m.clone())),
        );
    }
}

/// Encodes a node's figures.
pub fn encode(f: &NodeFigures) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.bytes(f.run_id.as_bytes());
    w.strings(&f.names);
    for v in [f.spans, f.errors, f.damaged_parts, f.pipeline_spans] {
        w.u(v);
    }
    w.u(f.other_run_ranks.len() as u64);
    for &r in &f.other_run_ranks {
        w.u(u64::from(r));
    }
    w.u(f.ranks.len() as u64);
    for r in &f.ranks {
        w.u(u64::from(r.rank));
        w.u(r.dir_mtime_ns);
        w.u(r.last_part.map_or(0, |l| l.saturating_add(1)));
        w.u(u64::from(r.world_size));
        w.u(r.last_step.map_or(0, |l| l.saturating_add(1)));
        w.u(r.phases.len() as u64);
        for (id, t) in &r.phases {
            w.u(u64::from(*id));
            w.u(t.steps);
            w.i(t.min_ns);
            w.i(t.max_ns);
            w.u(t.bins.len() as u64);
            let mut prev = 0i64;
            for &(k, c) in &t.bins {
                // Keys ascend: the first as is, then differences.
                w.i(i64::from(k).wrapping_sub(prev));
                prev = i64::from(k);
                w.u(c);
            }
        }
    }
    w.phases(&f.phases);
    w.u(f.steps.len() as u64);
    let (mut prev_step, mut prev_wall) = (0u64, 0i64);
    for (&step, s) in &f.steps {
        w.u(step.wrapping_sub(prev_step));
        prev_step = step;
        w.i(s.wall_max.wrapping_sub(prev_wall));
        prev_wall = s.wall_max;
        w.u(u64::from(s.ranks));
        w.i(s
            .wall_sum
            .wrapping_sub(s.wall_max.wrapping_mul(i64::from(s.ranks))));
    }
    w.u(f.calls.len() as u64);
    let (mut prev_step, mut prev_start) = (0u64, 0i64);
    for (&(step, name, ordinal), c) in &f.calls {
        w.u(step.wrapping_sub(prev_step));
        prev_step = step;
        w.u(u64::from(name));
        w.u(u64::from(ordinal));
        w.u(u64::from(c.ranks));
        w.i(c.last_start.wrapping_sub(prev_start));
        prev_start = c.last_start;
        w.u(u64::from(c.last_rank));
        w.u(u64::from(c.last_before));
        w.i(c.waited_ns);
    }
    w.u(f.tagged.len() as u64);
    for (&step, (tags, len)) in &f.tagged {
        w.u(step);
        w.strings(&tags.iter().cloned().collect::<Vec<_>>());
        w.i(*len);
    }
    w.u(f.named_errors.len() as u64);
    for (rank, step, name, message) in &f.named_errors {
        w.u(u64::from(*rank));
        w.u(*step);
        w.u(u64::from(*name));
        w.bytes(message.as_bytes());
    }
    framed(MAGIC, VERSION, &w.0)
}

/// Decodes a node's figures: counts checked against the bytes there are, name ids against
/// the names, ranks unique and in order.
pub fn decode(bytes: &[u8]) -> Result<NodeFigures> {
    check_head(bytes, MAGIC, "node figures file", HEADER, VERSION)?;
    let body = checked_body(bytes, HEADER, 12)?;
    let mut r = Reader(body);
    let u32_of =
        |v: u64, what: &str| u32::try_from(v).with_context(|| format!("{what} out of range"));
    let run_id = String::from_utf8(r.bytes()?.to_vec()).context("run id is not UTF-8")?;
    let names = r.strings()?;
    let n_names = names.len() as u64;
    let name = |v: u64| -> Result<NameId> {
        ensure!(v < n_names, "name id {v} out of range ({n_names} names)");
        Ok(v as NameId)
    };
    let (spans, errors, damaged_parts, pipeline_spans) = (r.u()?, r.u()?, r.u()?, r.u()?);
    let other_run_ranks = (0..r.count(1)?)
        .map(|_| u32_of(r.u()?, "rank"))
        .collect::<Result<Vec<_>>>()?;
    let mut ranks: Vec<RankFigures> = Vec::new();
    for _ in 0..r.count(6)? {
        let rank = u32_of(r.u()?, "rank")?;
        ensure!(
            ranks.last().is_none_or(|l| rank > l.rank),
            "rank {rank} listed out of order"
        );
        let dir_mtime_ns = r.u()?;
        let last_part = r.u()?.checked_sub(1);
        let world_size = u32_of(r.u()?, "world size")?;
        let last_step = r.u()?.checked_sub(1);
        let mut phases = Vec::new();
        for _ in 0..r.count(5)? {
            let id = name(r.u()?)?;
            let steps = r.u()?;
            let (min_ns, max_ns) = (r.i()?, r.i()?);
            let mut bins = Vec::new();
            let mut prev = 0i64;
            let mut total = 0u64;
            for _ in 0..r.count(2)? {
                let k = prev.wrapping_add(r.i()?);
                ensure!(
                    bins.is_empty() || k > prev,
                    "rank {rank}: bins out of order"
                );
                prev = k;
                let key = i32::try_from(k).context("bin out of range")?;
                let c = r.u()?;
                total = total.saturating_add(c);
                bins.push((key, c));
            }
            ensure!(
                total == steps,
                "rank {rank}: its bins hold {total} steps, not {steps}"
            );
            ensure!(
                steps == 0 || min_ns <= max_ns,
                "rank {rank}: its step times' minimum {min_ns} is above their maximum {max_ns}"
            );
            phases.push((
                id,
                StepTimes {
                    steps,
                    min_ns,
                    max_ns,
                    bins,
                },
            ));
        }
        ranks.push(RankFigures {
            rank,
            dir_mtime_ns,
            last_part,
            world_size,
            last_step,
            phases,
        });
    }
    let mut phases = Vec::new();
    for _ in 0..r.count(8)? {
        let id = name(r.u()?)?;
        phases.push((id, r.phase()?));
    }
    let mut steps = BTreeMap::new();
    let (mut step, mut wall) = (0u64, 0i64);
    for _ in 0..r.count(4)? {
        step = step.wrapping_add(r.u()?);
        wall = wall.wrapping_add(r.i()?);
        let n = u32_of(r.u()?, "rank count")?;
        let sum = r.i()?.wrapping_add(wall.wrapping_mul(i64::from(n)));
        steps.insert(
            step,
            StepFigures {
                wall_max: wall,
                ranks: n,
                wall_sum: sum,
            },
        );
    }
    let mut calls = BTreeMap::new();
    let (mut step, mut start) = (0u64, 0i64);
    for _ in 0..r.count(8)? {
        step = step.wrapping_add(r.u()?);
        let nm = name(r.u()?)?;
        let ordinal = u32_of(r.u()?, "ordinal")?;
        let n = u32_of(r.u()?, "rank count")?;
        start = start.wrapping_add(r.i()?);
        let last_rank = u32_of(r.u()?, "rank")?;
        let before = r.u()?;
        let last_before = if before == u64::from(CollectiveContext::UNKNOWN) {
            CollectiveContext::UNKNOWN
        } else {
            name(before)?
        };
        let waited_ns = r.i()?;
        calls.insert(
            (step, nm, ordinal),
            CallFigures {
                ranks: n,
                last_start: start,
                last_rank,
                last_before,
                waited_ns,
            },
        );
    }
    let mut tagged = BTreeMap::new();
    for _ in 0..r.count(3)? {
        let step = r.u()?;
        let tags = r.strings()?.into_iter().collect();
        tagged.insert(step, (tags, r.i()?));
    }
    let mut named_errors = Vec::new();
    for _ in 0..r.count(4)? {
        let rank = u32_of(r.u()?, "rank")?;
        let step = r.u()?;
        let nm = name(r.u()?)?;
        let message = String::from_utf8_lossy(r.bytes()?).into_owned();
        named_errors.push((rank, step, nm, message));
    }
    ensure!(r.0.is_empty(), "{} bytes after the last entry", r.0.len());
    Ok(NodeFigures {
        run_id,
        names,
        ranks,
        other_run_ranks,
        spans,
        errors,
        damaged_parts,
        pipeline_spans,
        phases,
        steps,
        calls,
        tagged,
        named_errors,
    })
}

/// Writes the figures of the ranks `ranks` (decoded from their node's rollup) as `obs/<name>`.
pub fn write_local(obs: &Path, name: &str, writer: u32, ranks: &[RankInput<'_>]) -> Result<()> {
    crate::sidecar::write_atomic_as(&obs.join(name), &encode(&NodeFigures::build(ranks)), writer)
}

/// Sets rank `rank`'s folder mtime and last part in the figures `obs/<name>` (its folder
/// changed, not its summary: the recorder removed the journal it compacted), without
/// rebuilding them. `Ok(false)` when the file is missing, does not decode or lacks the rank:
/// the caller rebuilds it.
pub fn restamp(
    obs: &Path,
    name: &str,
    rank: u32,
    dir_mtime_ns: u64,
    last_part: Option<u64>,
) -> Result<bool> {
    let Some(bytes) = crate::sidecar::read_if_present(&obs.join(name))? else {
        return Ok(false);
    };
    let Ok(mut f) = decode(&bytes) else {
        return Ok(false);
    };
    let Some(r) = f.ranks.iter_mut().find(|r| r.rank == rank) else {
        return Ok(false);
    };
    (r.dir_mtime_ns, r.last_part) = (dir_mtime_ns, last_part);
    crate::sidecar::write_atomic_as(&obs.join(name), &encode(&f), rank)?;
    Ok(true)
}

/// A local run's figures, merged: from each node's figures file where every rank it lists
/// still has the folder it describes, else from the ranks' summaries (brought up to date
/// against their folders, as the reader does), with how many files of each kind were read.
#[derive(Debug)]
pub struct JobFigures {
    pub figures: NodeFigures,
    /// Figures files read and trusted.
    pub nodes_read: u64,
    /// Ranks read from their folders instead (their node's figures stale, or missing).
    pub ranks_recomputed: u64,
    /// Ranks with an open journal (a live job), whose records since their last part the
    /// figures do not hold: the summary stops at each rank's last part.
    pub open_journals: u64,
}

/// Why a local run's figures are not used: the caller reads the run as before.
#[derive(Debug)]
pub struct NotUsable(pub String);

impl std::fmt::Display for NotUsable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The figures of the run at `location` ([`read_local`], [`read_object`]; `seen_last` is the
/// latter's).
pub fn read(
    location: &crate::location::Location,
    min_ranks: usize,
    seen_last: &BTreeMap<u32, u64>,
) -> std::result::Result<JobFigures, NotUsable> {
    match location {
        crate::location::Location::Local(run) => {
            let obs = run.join("obs");
            if !obs.is_dir() {
                return Err(NotUsable(format!(
                    "{} is not a titan run's folder",
                    run.display()
                )));
            }
            read_local(&obs, min_ranks)
        }
        crate::location::Location::Object { url, store, base } => {
            read_object(store, base, url, min_ranks, seen_last)
        }
    }
}

/// The figures of the local run whose `obs` folder is `obs`: `Err(NotUsable)` when it has
/// none, fewer than `min_ranks` rank folders, or holds what the figures leave to the rank
/// summaries (several runs, damaged or corrupt parts or summaries, pipeline schedules). Open
/// journals (a live job) are not read: the figures stop at each rank's last part, and
/// [`JobFigures::open_journals`] counts them.
pub fn read_local(obs: &Path, min_ranks: usize) -> std::result::Result<JobFigures, NotUsable> {
    use rayon::prelude::*;
    let not = |why: String| NotUsable(why);
    let listed = crate::location::ObsFolder::list(obs).map_err(|e| not(format!("{e:#}")))?;
    let files = listed.files_named(is_figures_name);
    let rank_dirs = listed.rank_dirs;
    if files.is_empty() {
        return Err(not("no node figures".into()));
    }
    if rank_dirs.len() < min_ranks {
        return Err(not(format!(
            "{} ranks, fewer than {min_ranks}",
            rank_dirs.len()
        )));
    }
    let dir_of: FxHashMap<u32, &PathBuf> = rank_dirs.iter().map(|(r, p)| (*r, p)).collect();

    // Each file read, checked against its rank folders and, when they are as it describes
    // them, merged into its thread's accumulator; so only a few files' figures are decoded
    // at a time, not the job's 2 048.
    let fold = files
        .par_iter()
        .try_fold(Merged::default, |mut acc, path| {
            let f = std::fs::read(path)
                .with_context(|| format!("reading {}", path.display()))
                .and_then(|b| decode(&b))
                .with_context(|| path.display().to_string())
                .map_err(|e| not(format!("{e:#}")))?;
            let described: Vec<Option<bool>> = (f.ranks.iter())
                .map(|r| dir_of.get(&r.rank).and_then(|dir| recorded(dir, r)))
                .collect();
            let fresh = described.iter().all(Option::is_some);
            if fresh {
                acc.open_journals += described.iter().filter(|l| **l == Some(true)).count() as u64;
            }
            acc.take(f, fresh)?;
            Ok(acc)
        })
        .try_reduce(Merged::default, |mut a, b| {
            a.absorb(b)?;
            Ok(a)
        })?;
    let mut acc = fold;
    let groups = acc.ranks_to_recompute(rank_dirs.iter().map(|(r, _)| *r))?;
    let recomputed = groups
        .par_iter()
        .map(|ranks| figures_of_folders(ranks, &dir_of))
        .try_fold(Merged::default, |mut acc, f| {
            let (f, open) = f?;
            acc.open_journals += open;
            acc.add(f)?;
            Ok(acc)
        })
        .try_reduce(Merged::default, |mut a, b| {
            a.absorb(b)?;
            Ok(a)
        })?;
    acc.absorb(recomputed)?;
    acc.finish()
}

/// Node figures files of an object store read at once (each then checks its ranks, a HEAD
/// each, [`crate::location::ObjectObs::next_parts_absent`]).
const OBJECTS_AT_ONCE: usize = 8;

/// The figures of the object-store run `<base>` (`url` for messages), as [`read_local`]
/// reads a local run's: `obs/` listed with a delimiter (its rank folders and node files, not
/// the parts), each node's figures read (`obs/node-<host>.figures`, published by its ranks'
/// writers) and trusted when every rank it lists is a listed folder with no part after the
/// last it covers (a HEAD each); the ranks of the other nodes, and those in none, are read
/// from their rank summaries (`rank.summary`), which must cover exactly the parts listed.
/// `seen_last`: ranks whose last part the caller found moments ago with none after it (the
/// TUI's open, from its timelines' HEADs or its listing): a rank whose figures end at that
/// part is not checked again.
pub fn read_object(
    store: &std::sync::Arc<dyn object_store::ObjectStore>,
    base: &object_store::path::Path,
    url: &str,
    min_ranks: usize,
    seen_last: &BTreeMap<u32, u64>,
) -> std::result::Result<JobFigures, NotUsable> {
    use futures::{StreamExt, TryStreamExt};
    use object_store::ObjectStoreExt as _;
    let not = |why: String| NotUsable(why);
    let listed =
        crate::location::ObjectObs::list(store, base, url).map_err(|e| not(format!("{e:#}")))?;
    let files = listed.files_named(is_figures_name);
    if files.is_empty() {
        return Err(not("no node figures".into()));
    }
    if listed.ranks.len() < min_ranks {
        return Err(not(format!(
            "{} ranks, fewer than {min_ranks}",
            listed.ranks.len()
        )));
    }
    let rank_folders: BTreeSet<u32> = listed.ranks.iter().copied().collect();
    let rt = titan_storage::runtime();
    // Each file read, its ranks checked, and merged when they are as it says: a few files'
    // figures decoded at a time, not the job's 2 048.
    let checked = files.into_iter().map(|path| {
        let rank_folders = &rank_folders;
        async move {
            let read = async { store.get(&path).await?.bytes().await }.await;
            let f = read
                .map_err(anyhow::Error::from)
                .and_then(|b| decode(&b))
                .map_err(|e| {
                    not(format!(
                        "{url}/obs/{}: {e:#}",
                        path.filename().unwrap_or("")
                    ))
                })?;
            let listed_all = f.ranks.iter().all(|r| rank_folders.contains(&r.rank));
            let lasts: Vec<(u32, Option<u64>)> = (f.ranks.iter())
                .filter(|r| r.last_part.is_none() || seen_last.get(&r.rank) != r.last_part.as_ref())
                .map(|r| (r.rank, r.last_part))
                .collect();
            let fresh = listed_all
                && crate::location::ObjectObs::next_parts_absent(store, base, &lasts)
                    .await
                    .into_iter()
                    .all(|absent| absent);
            Ok::<_, NotUsable>((f, fresh))
        }
    });
    let mut acc = rt.block_on(
        futures::stream::iter(checked)
            .buffer_unordered(OBJECTS_AT_ONCE)
            .try_fold(Merged::default(), |mut acc, (f, fresh)| async move {
                acc.take(f, fresh)?;
                Ok(acc)
            }),
    )?;
    for ranks in acc.ranks_to_recompute(listed.ranks.iter().copied())? {
        let ranks: Vec<u32> = ranks
            .into_iter()
            .filter(|r| rank_folders.contains(r))
            .collect();
        let f = rt.block_on(figures_of_objects(store, base, url, &ranks))?;
        acc.add(f)?;
    }
    acc.finish()
}

/// The figures of object-store ranks `ranks` from their rank summaries: each rank's folder
/// listed and its `rank.summary` read, which must cover exactly the parts listed (with their
/// sizes); otherwise the figures are not usable and the run is read as usual.
async fn figures_of_objects(
    store: &std::sync::Arc<dyn object_store::ObjectStore>,
    base: &object_store::path::Path,
    url: &str,
    ranks: &[u32],
) -> std::result::Result<NodeFigures, NotUsable> {
    use futures::{StreamExt, TryStreamExt};
    use object_store::ObjectStoreExt as _;
    let not = |why: String| NotUsable(why);
    let read = ranks.iter().map(|&rank| {
        let folder = crate::location::stored_rank_dir(base, rank);
        async move {
            let shown = format!("{url}/obs/rank-{rank}");
            let metas: Vec<object_store::ObjectMeta> = (store.list(Some(&folder)).try_collect())
                .await
                .map_err(|e| not(format!("listing {shown}: {e}")))?;
            let parts: BTreeMap<u64, u64> = (metas.iter())
                .filter_map(|m| {
                    let index = crate::location::parse_part_file_name(m.location.filename()?)?;
                    Some((index, m.size))
                })
                .collect();
            let summary = folder.clone().join(super::RANK_SUMMARY_FILE);
            let bytes = async { store.get(&summary).await?.bytes().await }
                .await
                .map_err(|e| not(format!("{shown}/{}: {e}", super::RANK_SUMMARY_FILE)))?;
            let d = super::rank_file::decode(&bytes)
                .map_err(|e| not(format!("{shown}/{}: {e:#}", super::RANK_SUMMARY_FILE)))?;
            if !(d.fits_sized(&parts) && d.covered().count() == parts.len()) {
                return Err(not(format!(
                    "{shown}/{} does not cover the folder's parts",
                    super::RANK_SUMMARY_FILE
                )));
            }
            Ok((rank, d))
        }
    });
    let digests: Vec<(u32, RankDigest)> = futures::stream::iter(read)
        .buffered(OBJECTS_AT_ONCE)
        .try_collect()
        .await?;
    let inputs: Vec<RankInput<'_>> = digests
        .iter()
        .map(|(rank, d)| RankInput {
            rank: *rank,
            dir_mtime_ns: 0,
            last_part: d.last_index(),
            digest: d,
        })
        .collect();
    Ok(NodeFigures::build(&inputs))
}

/// Figures merged by one reader thread.
#[derive(Default)]
struct Merged {
    job: Option<NodeFigures>,
    nodes_read: u64,
    /// The ranks of the files not merged (stale), and of every file read.
    stale: Vec<Vec<u32>>,
    listed: Vec<u32>,
    /// Ranks read from their folders.
    ranks_recomputed: u64,
    /// Ranks read with an open journal (not read).
    open_journals: u64,
}

impl Merged {
    /// Takes a node's figures read: merged when its ranks are as it describes them (`fresh`),
    /// else its ranks kept to be read from their folders.
    fn take(&mut self, f: NodeFigures, fresh: bool) -> std::result::Result<(), NotUsable> {
        let ranks = (f.ranks.iter().map(|r| r.rank)).chain(f.other_run_ranks.iter().copied());
        let ranks: Vec<u32> = ranks.collect();
        self.listed.extend(&ranks);
        if fresh {
            self.nodes_read += 1;
            self.add(f)
        } else {
            self.stale.push(ranks);
            Ok(())
        }
    }

    /// Once every file is read: the ranks to read from their folders, in groups (the ranks of
    /// each stale node, and each of the run's `ranks` in no node); refused when a rank is in
    /// two files (its host changed between launches: which holds its records?).
    fn ranks_to_recompute(
        &mut self,
        ranks: impl Iterator<Item = u32>,
    ) -> std::result::Result<Vec<Vec<u32>>, NotUsable> {
        self.listed.sort_unstable();
        if let Some(w) = self.listed.windows(2).find(|w| w[0] == w[1]) {
            return Err(NotUsable(format!("rank {} is in two nodes' figures", w[0])));
        }
        let mut groups = std::mem::take(&mut self.stale);
        for rank in ranks {
            if self.listed.binary_search(&rank).is_err() {
                groups.push(vec![rank]);
            }
        }
        self.ranks_recomputed = groups.iter().map(Vec::len).sum::<usize>() as u64;
        Ok(groups)
    }

    /// The job's figures, ranks in order.
    fn finish(self) -> std::result::Result<JobFigures, NotUsable> {
        let mut figures = self.job.ok_or_else(|| NotUsable("no ranks".into()))?;
        figures.ranks.sort_by_key(|r| r.rank);
        Ok(JobFigures {
            figures,
            nodes_read: self.nodes_read,
            ranks_recomputed: self.ranks_recomputed,
            open_journals: self.open_journals,
        })
    }

    /// Merges `f` in; refuses, as soon as one node shows them, what the figures leave to the
    /// rank summaries.
    fn add(&mut self, f: NodeFigures) -> std::result::Result<(), NotUsable> {
        if !f.other_run_ranks.is_empty() {
            return Err(NotUsable("ranks of more than one run".into()));
        }
        if f.damaged_parts > 0 || f.pipeline_spans > 0 {
            return Err(NotUsable("damaged parts or pipeline schedules".into()));
        }
        let Some(j) = &mut self.job else {
            self.job = Some(f);
            return Ok(());
        };
        if !f.ranks.is_empty() {
            if j.ranks.is_empty() {
                j.run_id.clone_from(&f.run_id);
            } else if f.run_id != j.run_id {
                return Err(NotUsable("ranks of more than one run".into()));
            }
        }
        j.merge(&f);
        Ok(())
    }

    fn absorb(&mut self, o: Merged) -> std::result::Result<(), NotUsable> {
        self.nodes_read += o.nodes_read;
        self.open_journals += o.open_journals;
        self.stale.extend(o.stale);
        self.listed.extend(o.listed);
        match o.job {
            Some(j) => self.add(j),
            None => Ok(()),
        }
    }
}

/// The figures of `ranks` from their folders' rank summaries (brought up to date against
/// their parts, not written back; an open journal is not read), and how many have an open
/// journal.
fn figures_of_folders(
    ranks: &[u32],
    dir_of: &FxHashMap<u32, &PathBuf>,
) -> std::result::Result<(NodeFigures, u64), NotUsable> {
    let not = |why: String| NotUsable(why);
    let mut digests = Vec::new();
    let mut open = 0;
    for &rank in ranks {
        let Some(dir) = dir_of.get(&rank) else {
            continue;
        };
        let listed = super::local::list_parts(dir)
            .map_err(|e| not(format!("listing {}: {e:#}", dir.display())))?;
        let s = super::summarise_rank(dir, rank, &listed, false);
        if !s.damaged.is_empty() || !s.corrupt.is_empty() {
            return Err(not(format!("rank {rank} has damaged or corrupt files")));
        }
        open += u64::from(has_journal(dir, s.digest.last_index()));
        let mtime = std::fs::metadata(dir).map_or(0, |m| super::node::mtime_ns(&m));
        digests.push((rank, mtime, s.digest));
    }
    let inputs: Vec<RankInput<'_>> = digests
        .iter()
        .map(|(rank, mtime, d)| RankInput {
            rank: *rank,
            dir_mtime_ns: *mtime,
            last_part: d.last_index(),
            digest: d,
        })
        .collect();
    Ok((NodeFigures::build(&inputs), open))
}

/// Whether a rank folder is as its figures recorded it, and then whether it is live
/// ([`super::node::recorded_folder`]: a live rank's open journal is not in them).
fn recorded(dir: &Path, r: &RankFigures) -> Option<bool> {
    super::node::recorded_folder(dir, r.dir_mtime_ns, r.last_part)
}

/// Whether the journal after part `last` is in `dir`.
fn has_journal(dir: &Path, last: Option<u64>) -> bool {
    let next = last.map_or(0, |l| l + 1);
    dir.join(crate::location::journal_file_name(next)).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object-store run's figures: a rank with a part after the last its figures cover is
    /// found by its HEAD (and, its rank summary not covering that part either, the figures are
    /// not used), unless the caller says it saw that rank end at the figures' last part.
    #[test]
    fn stored_figures_check_each_rank_unless_its_last_part_was_seen() {
        use object_store::ObjectStoreExt as _;
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::synth::SynthConfig {
            ranks: 16,
            steps: 30,
            steps_per_part: 10,
            ..Default::default()
        };
        let url = "memory://figures-seen-last/run";
        crate::synth::write_run_spooled(url, &cfg, Some(&dir.path().join("spool"))).unwrap();
        let crate::location::Location::Object { store, base, .. } =
            crate::location::Location::parse(url).unwrap()
        else {
            unreachable!()
        };
        let none = BTreeMap::new();
        let read = |seen: &BTreeMap<u32, u64>| read_object(&store, &base, url, 0, seen);
        let job = read(&none).unwrap();
        assert_eq!((job.nodes_read, job.ranks_recomputed), (2, 0));
        let rt = titan_storage::runtime();
        let rank3 = base.clone().join("obs").join("rank-3");
        let first = rt
            .block_on(async {
                store
                    .get(&rank3.clone().join("part-000000.parquet"))
                    .await?
                    .bytes()
                    .await
            })
            .unwrap();
        rt.block_on(store.put(&rank3.clone().join("part-000003.parquet"), first.into()))
            .unwrap();
        assert!(read(&none).is_err(), "rank 3's extra part went unseen");
        let seen: BTreeMap<u32, u64> = (0..16).map(|r| (r, 2)).collect();
        let job = read(&seen).unwrap();
        assert_eq!((job.nodes_read, job.ranks_recomputed), (2, 0));
    }

    #[test]
    fn step_times_median_and_above_are_within_the_sketch_error() {
        let v: Vec<i64> = (0..1001).map(|i| 1_000_000 + i * 1000).collect();
        let t = StepTimes::of(v.iter().copied());
        assert_eq!(t.steps, 1001);
        let m = t.median();
        assert!((m - 1_500_000.0).abs() <= 1_500_000.0 * SKETCH_ALPHA, "{m}");
        // Values in the bin of 1.5e6 (2% wide: 30 of them here) do not count as above it.
        let above = t.above(1_500_000.0) as f64;
        assert!((470.0..=500.0).contains(&above), "{above}");
        assert_eq!(t.above(0.0), 1001);
        assert_eq!(t.above(3e6), 0);
        let mut a = StepTimes::of(v[..500].iter().copied());
        a.merge(&StepTimes::of(v[500..].iter().copied()));
        assert_eq!(a, t);
    }

    #[test]
    fn calls_merge_to_the_same_wait_in_any_grouping() {
        // Arrivals (start, rank): the wait is sum(last - start) = 4 + 3 + 0 + 9 = 16 at 10.
        let arrivals = [(6i64, 0u32), (7, 1), (10, 2), (1, 3)];
        let one = |(s, r): (i64, u32)| CallFigures {
            ranks: 1,
            last_start: s,
            last_rank: r,
            last_before: r,
            waited_ns: 0,
        };
        for split in 1..arrivals.len() {
            let mut a = one(arrivals[0]);
            for &x in &arrivals[1..split] {
                a.merge(&one(x));
            }
            let mut b = one(arrivals[split]);
            for &x in &arrivals[split + 1..] {
                b.merge(&one(x));
            }
            a.merge(&b);
            assert_eq!(
                (a.ranks, a.last_start, a.last_rank, a.waited_ns),
                (4, 10, 2, 16)
            );
            assert_eq!(a.last_before, 2);
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let mut f = NodeFigures {
            run_id: "r1".into(),
            names: vec!["step".into(), "all_reduce".into()],
            spans: 40,
            ..Default::default()
        };
        f.ranks.push(RankFigures {
            rank: 4,
            dir_mtime_ns: 99,
            last_part: Some(2),
            world_size: 8,
            last_step: Some(17),
            phases: vec![(0, StepTimes::of([5, 6, 700_000]))],
        });
        f.phases.push((1, PhaseDigest::default()));
        f.steps.insert(
            17,
            StepFigures {
                wall_max: 30,
                ranks: 2,
                wall_sum: 55,
            },
        );
        f.calls.insert(
            (17, 1, 0),
            CallFigures {
                ranks: 2,
                last_start: 1_800_000_000_000_000_000,
                last_rank: 4,
                last_before: CollectiveContext::UNKNOWN,
                waited_ns: 12,
            },
        );
        f.tagged
            .insert(17, (BTreeSet::from(["checkpoint".to_string()]), 8));
        f.named_errors.push((4, 17, 0, "boom".into()));
        let bytes = encode(&f);
        let back = decode(&bytes).unwrap();
        assert_eq!(back.ranks, f.ranks);
        assert_eq!(
            (back.steps.clone(), back.calls.clone(), back.tagged.clone()),
            (f.steps.clone(), f.calls.clone(), f.tagged.clone())
        );
        assert_eq!(back.named_errors, f.named_errors);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(decode(&b).is_err(), "a flip at byte {i} went unnoticed");
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        // Well framed but inconsistent: a minimum above the maximum is refused, not clamped
        // into a panic when a median is read.
        f.ranks[0].phases[0].1.min_ns = 800_000;
        let err = decode(&encode(&f)).unwrap_err().to_string();
        assert!(
            err.contains("minimum 800000 is above their maximum"),
            "{err}"
        );
    }
}
