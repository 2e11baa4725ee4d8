//! The analysis of a run read as per-part summaries ([`RunDigest`]): the same [`Analysis`]
//! as [`super::analyse`] computes from the spans, from the merged summaries. Counts, sums,
//! minima, maxima, stragglers, tagged steps and waits come out the same; p50/p95 come from
//! the sketches (within [`crate::digest::SKETCH_ALPHA`]). Where a step runs across two parts
//! of a rank (the journal rotated mid-step), a collective's wait is only taken out of the
//! spans of its own part that contain it.
//!
//! Memory: the merged cells (4 bytes each) and collectives are held once; the steps x ranks
//! matrix of a phase is built for that phase's stragglers only, and collectives are matched
//! one step at a time.

use std::collections::HashMap;

use super::summary::{
    Analysis, Gathered, PhaseStats, Straggler, StragglerOptions, assemble, phase_stragglers,
};
use super::table::RunShape;
use super::waits::{Arrival, Call, account, match_arrivals};
use crate::digest::cells::Cells;
use crate::digest::{PhaseDigest, RunCollective, RunDigest, sketch_quantile};
use crate::stats::DurationStats;
use crate::stats::union_len;
use crate::tables::NameId;
use crate::vocab::{Clock, is_tag_phase};

/// [`super::analyse_grouped`] over merged summaries; `names` are the run's names.
pub fn analyse_digest(
    d: &RunDigest,
    names: &[String],
    shape: &RunShape,
    groups: &[Vec<u32>],
    opts: &StragglerOptions,
) -> Analysis {
    let ranks: Vec<u32> = shape.ranks.clone();
    let n_ranks = ranks.len();
    // Rank position (ranks in merge order) -> column of the steps x ranks matrices.
    let rank_column: HashMap<u32, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let column: Vec<Option<usize>> = d
        .ranks
        .iter()
        .map(|r| rank_column.get(r).copied())
        .collect();
    // Steps in order, and each one's row in the digest's cells.
    let mut order: Vec<(u64, u32)> = d
        .steps
        .iter()
        .enumerate()
        .map(|(row, &s)| (s, row as u32))
        .collect();
    order.sort_unstable();
    let steps: Vec<u64> = order.iter().map(|&(s, _)| s).collect();
    let rows: Vec<u32> = order.iter().map(|&(_, r)| r).collect();
    let n_steps = steps.len();

    // Step row (first-seen order) -> position in `steps`.
    let mut si_of_row: Vec<Option<usize>> = vec![None; d.steps.len()];
    for (si, &row) in rows.iter().enumerate() {
        si_of_row[row as usize] = Some(si);
    }
    let cell_at = |row: u32, pos: u32| -> Option<(usize, usize)> {
        let si = si_of_row.get(row as usize).copied().flatten()?;
        let ri = column.get(pos as usize).copied().flatten()?;
        Some((si, ri))
    };

    // Per step: the slowest rank's step time (a rank without any counts as 0, as in the
    // span path's matrix).
    let mut wall_max = vec![i64::MIN; n_steps];
    let mut present = vec![0usize; n_steps];
    let mut wall_total = 0i64;
    let mut last_step: Vec<Option<u64>> = vec![None; n_ranks];
    d.walls.each(|row, pos, v| {
        if let Some((si, ri)) = cell_at(row, pos) {
            wall_max[si] = wall_max[si].max(v);
            present[si] += 1;
            wall_total = wall_total.saturating_add(v);
            last_step[ri] = last_step[ri].max(Some(steps[si]));
        }
    });
    for (m, &n) in wall_max.iter_mut().zip(&present) {
        if n < n_ranks || n == 0 {
            *m = (*m).max(0);
        }
    }
    // The step time is every rank's `StepRole::Step` spans: what the walls hold.
    let step_total = wall_total;

    // Who waited for whom at collectives, one step at a time; the waits to take out of the
    // cells of the phases around them, by container set (a run has a few: one per set, not
    // one per phase; rows: positions in `steps`; columns: rank columns).
    let step_index: HashMap<u64, u32> = steps
        .iter()
        .enumerate()
        .map(|(i, &s)| (s, i as u32))
        .collect();
    let mut coll_steps: Vec<u64> = d.collectives.keys().copied().collect();
    coll_steps.sort_unstable();
    let mut waited: Vec<Cells> = vec![Cells::default(); d.container_sets.len()];
    let mut calls: Vec<Call> = Vec::new();
    // The phase each call's late rank came from, by `Call::late_idx`.
    let mut late_from: Vec<NameId> = Vec::new();
    for step in coll_steps {
        let colls: &[RunCollective] = &d.collectives[&step];
        let arrivals: Vec<Arrival> = colls
            .iter()
            .enumerate()
            .map(|(i, c)| Arrival {
                step,
                name: d.contexts[c.context as usize].name,
                rank: c.rank,
                start: c.start_ns,
                idx: i as u32,
            })
            .collect();
        let (step_calls, span_wait) = match_arrivals(arrivals);
        if let Some(&si) = step_index.get(&step) {
            for (idx, w) in span_wait {
                let c = &colls[idx as usize];
                let Some(&ri) = rank_column.get(&c.rank) else {
                    continue;
                };
                let set = d.contexts[c.context as usize].containers;
                if let Some(cells) = waited.get_mut(set as usize) {
                    cells.add(si, ri as u32, w);
                }
            }
        }
        for mut call in step_calls {
            let late = &colls[call.late_idx as usize];
            late_from.push(d.contexts[late.context as usize].before);
            call.late_idx = late_from.len() as u32 - 1;
            calls.push(call);
        }
    }
    let waits = if calls.is_empty() {
        Default::default()
    } else {
        // The span path's per-span waits have no meaning here (no spans): left empty.
        account(&calls, Vec::new(), |c| {
            names
                .get(late_from[c.late_idx as usize] as usize)
                .cloned()
                .unwrap_or_else(|| "-".to_string())
        })
    };

    // One phase at a time: its steps x ranks matrix is the analysis's largest allocation.
    let per_phase: Vec<(PhaseStats, Vec<Straggler>)> = d
        .phases
        .iter()
        .enumerate()
        .filter_map(|(id, p)| Some((id as NameId, p.as_ref()?)))
        .map(|(id, p)| {
            let name = names.get(id as usize).cloned().unwrap_or_default();
            let stats = phase_stats(&name, p, step_total);
            if p.in_step == 0 || n_ranks < 2 {
                return (stats, Vec::new());
            }
            // This phase's steps x ranks matrix (-1 = not run), less the waits inside it.
            let mut cell = vec![-1i64; n_steps * n_ranks];
            if let Some(cells) = d.cells.get(id as usize) {
                cells.each(|row, pos, v| {
                    if let Some((si, ri)) = cell_at(row, pos) {
                        cell[si * n_ranks + ri] = v;
                    }
                });
            }
            for (set, w) in d.container_sets.iter().zip(&waited) {
                // A set naming the phase twice (nested spans of one name) takes it out twice.
                let times = set.iter().filter(|&&n| n == id).count() as i64;
                if times == 0 {
                    continue;
                }
                w.each(|si, ri, wait| {
                    let c = &mut cell[si as usize * n_ranks + ri as usize];
                    if *c >= 0 {
                        *c = c.saturating_sub(wait.saturating_mul(times)).max(0);
                    }
                });
            }
            let stragglers = phase_stragglers(&cell, &ranks, &name, groups, opts);
            (stats, stragglers)
        })
        .collect();

    // Tagged steps: the union of each rank's own spans of the step's tags.
    let mut tag_iv: HashMap<(u64, u32), Vec<(i64, i64)>> = HashMap::new();
    for &(step, rank, name, a, e) in &d.tag_spans {
        let Some(tags) = shape.step_tags.get(&step) else {
            continue;
        };
        let Some(n) = names.get(name as usize) else {
            continue;
        };
        if tags.iter().any(|t| is_tag_phase(n, t)) {
            tag_iv.entry((step, rank)).or_default().push((a, e));
        }
    }
    let tagged_phase = tag_iv
        .into_iter()
        .map(|(k, mut iv)| (k, union_len(&mut iv)))
        .collect();
    assemble(
        Gathered {
            ranks: &ranks,
            steps: &steps,
            wall_max: &wall_max,
            per_phase,
            tagged_phase,
            waits,
            grouped: !groups.is_empty(),
            last_step: &last_step,
        },
        shape,
        opts,
    )
}

/// A phase's statistics from its merged summary; `step_total` is every rank's step time.
pub(crate) fn phase_stats(name: &str, p: &PhaseDigest, step_total: i64) -> PhaseStats {
    PhaseStats {
        clock: Clock::of(name),
        name: name.to_string(),
        depth: p.shown_depth(),
        stats: DurationStats {
            count: p.count,
            total_ns: p.sum_ns,
            mean_ns: p.sum_ns as f64 / p.count.max(1) as f64,
            p50_ns: sketch_quantile(&p.sketch, p.count, 0.5, p.min_ns, p.max_ns),
            p95_ns: sketch_quantile(&p.sketch, p.count, 0.95, p.min_ns, p.max_ns),
            min_ns: p.min_ns,
            max_ns: p.max_ns,
        },
        share_of_step: (p.in_step_main > 0 && step_total > 0)
            .then(|| p.in_step_ns as f64 / step_total as f64),
        concurrent_share_of_step: (p.concurrent > 0 && step_total > 0)
            .then(|| p.concurrent_ns as f64 / step_total as f64),
    }
}
