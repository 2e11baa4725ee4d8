//! The analysis of a run read as per-part summaries ([`RunDigest`]): the same [`Analysis`]
//! as [`super::analyse`] computes from the spans, from the merged summaries. Counts, sums,
//! minima, maxima, stragglers, tagged steps and waits come out the same; p50/p95 come from
//! the sketches (within [`crate::digest::SKETCH_ALPHA`]). Where a step runs across two parts
//! of a rank (the journal rotated mid-step), a collective's wait is only taken out of the
//! spans of its own part that contain it.

use std::collections::HashMap;

use rayon::prelude::*;

use super::summary::{
    Analysis, Gathered, PhaseStats, Straggler, StragglerOptions, assemble, is_tag_phase,
    phase_stragglers, union_len,
};
use super::table::RunShape;
use super::waits::{Arrival, account, match_arrivals};
use crate::digest::{RunDigest, sketch_quantile};
use crate::run::NameId;

/// [`super::analyse`] over merged summaries; `names` are the run's names.
pub fn analyse_digest(
    d: &RunDigest,
    names: &[String],
    shape: &RunShape,
    opts: &StragglerOptions,
) -> Analysis {
    let ranks: Vec<u32> = shape.ranks.clone();
    let n_ranks = ranks.len();
    // Row position (ranks in merge order) -> column of the steps x ranks matrices.
    let rank_column: HashMap<u32, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let column: Vec<Option<usize>> = d
        .ranks
        .iter()
        .map(|r| rank_column.get(r).copied())
        .collect();
    let mut steps: Vec<u64> = d.cells.keys().map(|&(_, s)| s).collect();
    steps.sort_unstable();
    steps.dedup();
    let n_steps = steps.len();
    let step_pos: HashMap<u64, usize> = steps.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let step_name = names.iter().position(|n| n == crate::vocab::STEP);

    // Step time per (step, rank): top-level spans inside steps.
    let mut wall = vec![0i64; n_steps * n_ranks];
    for (step, row) in &d.walls {
        let Some(&si) = step_pos.get(step) else {
            continue;
        };
        for (&v, ri) in row.iter().zip(&column) {
            if let Some(ri) = ri {
                wall[si * n_ranks + ri] = v;
            }
        }
    }
    let step_total: i64 = match step_name.and_then(|id| d.phases.get(id).cloned().flatten()) {
        Some(p) => p.in_step_ns,
        None if step_name.is_some() => 0,
        None => wall.iter().sum(),
    };

    // Who waited for whom at collectives, and the wait to take out of each cell.
    let arrivals: Vec<Arrival> = d
        .collectives
        .iter()
        .enumerate()
        .map(|(i, c)| Arrival {
            step: c.step,
            name: c.name,
            rank: c.rank,
            start: c.start_ns,
            idx: i as u32,
        })
        .collect();
    let (calls, span_wait) = match_arrivals(arrivals);
    // (name, step) -> (rank, its wait inside spans of that name in that step).
    let mut waited: HashMap<(NameId, u64), Vec<(u32, i64)>> = HashMap::new();
    for &(idx, w) in &span_wait {
        let c = &d.collectives[idx as usize];
        let range = c.containers.start as usize..c.containers.end as usize;
        for &(name, step) in d.containers.get(range).unwrap_or_default() {
            waited.entry((name, step)).or_default().push((c.rank, w));
        }
    }
    let waits = if calls.is_empty() {
        Default::default()
    } else {
        account(&calls, span_wait, |c| {
            d.collectives[c.late_idx as usize]
                .before
                .and_then(|n| names.get(n as usize).cloned())
                .unwrap_or_else(|| "-".to_string())
        })
    };

    let per_phase: Vec<(PhaseStats, Vec<Straggler>)> = d
        .phases
        .par_iter()
        .enumerate()
        .filter_map(|(id, p)| Some((id as NameId, p.as_ref()?)))
        .map(|(id, p)| {
            let name = names.get(id as usize).cloned().unwrap_or_default();
            let stats = PhaseStats {
                name: name.clone(),
                depth: p.min_depth,
                count: p.count,
                total_ns: p.sum_ns,
                mean_ns: p.sum_ns as f64 / p.count.max(1) as f64,
                p50_ns: sketch_quantile(&p.sketch, p.count, 0.5, p.min_ns, p.max_ns),
                p95_ns: sketch_quantile(&p.sketch, p.count, 0.95, p.min_ns, p.max_ns),
                min_ns: p.min_ns,
                max_ns: p.max_ns,
                share_of_step: (p.in_step > 0 && step_total > 0)
                    .then(|| p.in_step_ns as f64 / step_total as f64),
            };
            if p.in_step == 0 || n_ranks < 2 {
                return (stats, Vec::new());
            }
            let mut cell = vec![-1i64; n_steps * n_ranks];
            for (si, &step) in steps.iter().enumerate() {
                let Some(row) = d.cells.get(&(id, step)) else {
                    continue;
                };
                let out = &mut cell[si * n_ranks..(si + 1) * n_ranks];
                for (&v, ri) in row.iter().zip(&column) {
                    if let (Some(ri), true) = (ri, v >= 0) {
                        out[*ri] = v;
                    }
                }
                for &(rank, w) in waited.get(&(id, step)).map_or(&[][..], Vec::as_slice) {
                    if let Some(&ri) = rank_column.get(&rank)
                        && out[ri] >= 0
                    {
                        out[ri] = out[ri].saturating_sub(w).max(0);
                    }
                }
            }
            let stragglers = phase_stragglers(&cell, &ranks, &name, opts);
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
            wall: &wall,
            per_phase,
            tagged_phase,
            waits,
        },
        shape,
        opts,
    )
}
