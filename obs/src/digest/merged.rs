//! Every part's digest of a run merged into one [`RunDigest`], with run-wide name ids.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use super::cells::Cells;
use super::{PartDigest, PhaseDigest, PipelineStep};
use crate::tables::NameId;

/// One collective of the run (its step is its key in [`RunDigest::collectives`]), on rank
/// 0's clock: 16 bytes, a day-long 1024-rank job has millions.
#[derive(Debug, Clone, Copy)]
pub struct RunCollective {
    pub rank: u32,
    /// Index into [`RunDigest::contexts`].
    pub context: u32,
    pub start_ns: i64,
}

/// What a collective is besides its rank and time (interned: a run has a few), with run-wide
/// name ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CollectiveContext {
    pub name: NameId,
    /// The phase the rank came from (see [`super::CollectiveDigest::before`]);
    /// [`CollectiveContext::UNKNOWN`] when unknown.
    pub before: NameId,
    /// Index into [`RunDigest::container_sets`].
    pub containers: u32,
}

impl CollectiveContext {
    pub const UNKNOWN: NameId = NameId::MAX;
}

/// One rank's pipeline schedule, merged over its parts.
#[derive(Debug, Clone, Default)]
pub struct RankPipeline {
    pub stages: BTreeSet<u16>,
    pub microbatches: u32,
    pub forward: PhaseDigest,
    pub backward: PhaseDigest,
    /// By step (a step written across two parts summed).
    pub steps: BTreeMap<u64, PipelineStep>,
}

/// Every part's digest of a run merged, with run-wide name ids (those of [`crate::Run::names`]).
#[derive(Debug, Clone, Default)]
pub struct RunDigest {
    /// Parts (or journal reads) merged (a rank summary's segment counts its parts).
    pub parts: u64,
    pub spans: u64,
    pub errors: u64,
    pub pipeline_spans: u64,
    /// By run-wide name id.
    pub phases: Vec<Option<PhaseDigest>>,
    /// The ranks merged, in the order first seen: the positions of `cells` and `walls`
    /// (not rank numbers: a damaged rank number must not size a row).
    pub ranks: Vec<u32>,
    rank_pos: FxHashMap<u32, u32>,
    /// The steps with spans, in the order first seen: the rows of `cells` and `walls`.
    pub steps: Vec<u64>,
    step_row: FxHashMap<u64, u32>,
    /// By run-wide name id: summed duration of the phase's spans per (step, rank).
    pub cells: Vec<Cells>,
    /// Time in top-level spans per (step, rank).
    pub walls: Cells,
    /// (step, rank, name, start, end) on rank 0's clock.
    pub tag_spans: Vec<(u64, u32, NameId, i64, i64)>,
    /// (rank, step, name, message) of the parts' named error records (up to
    /// [`super::NAMED_ERRORS`] a part).
    pub named_errors: Vec<(u32, u64, NameId, String)>,
    /// By step: its collectives, in merge order.
    pub collectives: FxHashMap<u64, Vec<RunCollective>>,
    /// The distinct contexts of the collectives.
    pub contexts: Vec<CollectiveContext>,
    context_ids: FxHashMap<CollectiveContext, u32>,
    /// The distinct name sets the collectives started inside (interned: a run has a few).
    pub container_sets: Vec<Vec<NameId>>,
    container_ids: FxHashMap<Vec<NameId>, u32>,
    /// The metric lines of the run's scalars (`titan-obs metrics`).
    pub metrics: crate::metric_lines::Lines,
    /// By rank: the pipeline schedule of ranks whose parts carry pipeline slots.
    pub pipeline: BTreeMap<u32, RankPipeline>,
    /// The rank merged last and its latest part's `last_ended` (run-wide names, rank 0's
    /// clock): parts of a rank are merged in order, so a collective without a phase before
    /// it in its own part takes the previous part's.
    prev: Option<(u32, LastEnded)>,
}

/// Per step: (end, depth, name) of the non-collective span that ended last.
type LastEnded = HashMap<u64, (i64, u16, NameId)>;

impl RunDigest {
    /// The row of `step` in `cells` and `walls`, added when new.
    fn row(&mut self, step: u64) -> u32 {
        let next = self.steps.len() as u32;
        let row = *self.step_row.entry(step).or_insert(next);
        if row == next {
            self.steps.push(step);
        }
        row
    }

    /// Adds one part's digest. `name_map` maps its names to run-wide ids; `offset` is added to
    /// its times (its rank's clock offset, or 0).
    pub(crate) fn merge(&mut self, d: &PartDigest, name_map: &[u32], offset: i64) {
        let rank = d.info.rank;
        let g = |n: NameId| name_map.get(n as usize).copied().unwrap_or(0);
        self.parts = self.parts.saturating_add(d.info.parts.max(1) as u64);
        // Counts decoded from summary files: saturating, as a damaged one may hold anything.
        self.spans = self.spans.saturating_add(d.spans);
        self.errors = self.errors.saturating_add(d.errors);
        self.pipeline_spans = self.pipeline_spans.saturating_add(d.pipeline_spans);
        for (name, p) in &d.phases {
            let id = g(*name) as usize;
            if self.phases.len() <= id {
                self.phases.resize(id + 1, None);
            }
            self.phases[id]
                .get_or_insert_with(Default::default)
                .merge(p);
        }
        let next = self.ranks.len() as u32;
        let pos = *self.rank_pos.entry(rank).or_insert(next);
        if pos == next {
            self.ranks.push(rank);
        }
        // Cells come sorted by step: one row lookup per step.
        let mut last: Option<(u64, u32)> = None;
        for &(step, name, dur) in &d.cells {
            let row = match last {
                Some((s, r)) if s == step => r,
                _ => self.row(step),
            };
            last = Some((step, row));
            let id = g(name) as usize;
            if self.cells.len() <= id {
                self.cells.resize_with(id + 1, Default::default);
            }
            self.cells[id].add(row, pos, dur);
        }
        for &(step, dur) in &d.walls {
            let row = self.row(step);
            self.walls.add(row, pos, dur);
        }
        self.named_errors.extend(
            d.named_errors
                .iter()
                .map(|(s, n, m)| (rank, *s, g(*n), m.clone())),
        );
        for &(step, name, a, e) in &d.tag_spans {
            self.tag_spans.push((
                step,
                rank,
                g(name),
                a.saturating_add(offset),
                e.saturating_add(offset),
            ));
        }
        let prev = match &self.prev {
            Some((r, m)) if *r == rank => Some(m),
            _ => None,
        };
        let mut set: Vec<NameId> = Vec::new();
        for c in &d.collectives {
            let at = c.start_ns.saturating_add(offset);
            let before = c.before.map(|(_, _, n)| g(n)).or_else(|| {
                prev.and_then(|m| m.get(&c.step))
                    .filter(|(end, _, _)| *end <= at)
                    .map(|&(_, _, n)| n)
            });
            set.clear();
            set.extend(c.containers.iter().map(|&n| g(n)));
            let containers = match self.container_ids.get(&set) {
                Some(&id) => id,
                None => {
                    let id = self.container_sets.len() as u32;
                    self.container_sets.push(set.clone());
                    self.container_ids.insert(set.clone(), id);
                    id
                }
            };
            let ctx = CollectiveContext {
                name: g(c.name),
                before: before.unwrap_or(CollectiveContext::UNKNOWN),
                containers,
            };
            let next = self.contexts.len() as u32;
            let context = *self.context_ids.entry(ctx).or_insert(next);
            if context == next {
                self.contexts.push(ctx);
            }
            self.collectives
                .entry(c.step)
                .or_default()
                .push(RunCollective {
                    rank,
                    context,
                    start_ns: at,
                });
        }
        let mut last: LastEnded = match self.prev.take() {
            Some((r, m)) if r == rank => m,
            _ => HashMap::new(),
        };
        for &(step, end, depth, name) in &d.last_ended {
            let v = (end.saturating_add(offset), depth, g(name));
            let e = last.entry(step).or_insert(v);
            if (v.0, std::cmp::Reverse(v.1)) > (e.0, std::cmp::Reverse(e.1)) {
                *e = v;
            }
        }
        // Only the latest steps matter to the next part.
        if last.len() > 64 {
            let mut steps: Vec<u64> = last.keys().copied().collect();
            steps.sort_unstable();
            for s in &steps[..steps.len() - 64] {
                last.remove(s);
            }
        }
        self.prev = Some((rank, last));
        for (step, name, reduce, acc) in &d.scalars {
            let validation = d
                .names
                .get(*name as usize)
                .is_some_and(|n| crate::metric_lines::is_validation(n));
            self.metrics.add(*step, validation, g(*name), *reduce, acc);
        }
        if let Some(p) = &d.pipeline {
            let r = self.pipeline.entry(rank).or_default();
            r.stages.extend(p.stages.iter().copied());
            r.microbatches = r.microbatches.max(p.microbatches);
            r.forward.merge(&p.forward);
            r.backward.merge(&p.backward);
            for s in &p.steps {
                let e = r.steps.entry(s.step).or_insert(PipelineStep {
                    step: s.step,
                    ..Default::default()
                });
                e.window = e.window.saturating_add(s.window);
                e.profiler_step = e.profiler_step.saturating_add(s.profiler_step);
                e.busy = e.busy.saturating_add(s.busy);
                e.recv = e.recv.saturating_add(s.recv);
            }
        }
    }
}
