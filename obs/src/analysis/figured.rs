//! The summary of a run read as node figures ([`NodeFigures`], merged over the job): what
//! `titan-obs summary` shows of a job too large to hold a cell per (phase, step, rank).
//!
//! Exact as from the rank summaries: phase counts, sums, extremes, p50/p95 (the same
//! sketches), step times, tagged steps, ended-early ranks and the "waiting on" table (the
//! calls' last arrivals and waits merge exactly). Stragglers follow the same thresholds with
//! each rank's per-step time distribution in place of its per-step times: a rank is a
//! straggler in a phase when at least `min_share_of_steps` of its steps lie above the pooled
//! median of all ranks' steps, its median is at least `1 + min_excess_ratio` times that
//! median, and its median excess is at least `min_step_share` of the median step. Where the
//! per-step rule takes the time a rank waited for later ranks out of the phases around a
//! collective, the figures take out the collective's whole time (its transfer too: which
//! part was waiting is only known once every node is read); the steps in which a rank was
//! the slowest are not known (`None`).

use std::collections::{BTreeMap, HashMap};

use super::summary::{
    Analysis, Gathered, NodeFiguresRead, Straggler, StragglerOptions, Summary, assemble,
};
use super::table::RunShape;
use super::waits::{Call, account};
use crate::digest::figures::{JobFigures, NodeFigures, StepTimes};
use crate::digest::merged::CollectiveContext;
use crate::record::NO_STEP;
use crate::run::RunFormat;
use crate::tables::NameId;

/// The analysis of a job's merged figures.
pub fn analyse_figures(f: &NodeFigures, opts: &StragglerOptions) -> Analysis {
    let ranks: Vec<u32> = f.ranks.iter().map(|r| r.rank).collect();
    let n_ranks = ranks.len();
    let steps: Vec<u64> = f.steps.keys().copied().collect();
    let wall_max: Vec<i64> = f
        .steps
        .values()
        .map(|s| {
            if (s.ranks as usize) < n_ranks || s.ranks == 0 {
                s.wall_max.max(0)
            } else {
                s.wall_max
            }
        })
        .collect();
    let step_total = f
        .steps
        .values()
        .fold(0i64, |a, s| a.saturating_add(s.wall_sum));
    let last_step: Vec<Option<u64>> = f.ranks.iter().map(|r| r.last_step).collect();

    // Waits: every call with two ranks or more, in step order.
    let mut calls: Vec<Call> = Vec::new();
    let mut late_from: Vec<NameId> = Vec::new();
    for (&(step, _, _), c) in &f.calls {
        if c.ranks < 2 {
            continue;
        }
        late_from.push(c.last_before);
        calls.push(Call {
            step,
            late_rank: c.last_rank,
            late_idx: late_from.len() as u32 - 1,
            at: c.last_start,
            caused: c.waited_ns,
        });
    }
    let name_of = |id: NameId| -> String {
        if id == CollectiveContext::UNKNOWN {
            "-".to_string()
        } else {
            f.names
                .get(id as usize)
                .cloned()
                .unwrap_or_else(|| "-".into())
        }
    };
    let waits = if calls.is_empty() {
        Default::default()
    } else {
        account(&calls, Vec::new(), |c| {
            name_of(late_from[c.late_idx as usize])
        })
    };

    // Per phase: its statistics, and its stragglers by the distribution rule.
    let mut by_phase: HashMap<NameId, Vec<(u32, &StepTimes)>> = HashMap::new();
    for r in &f.ranks {
        for (id, t) in &r.phases {
            by_phase.entry(*id).or_default().push((r.rank, t));
        }
    }
    let per_phase = f
        .phases
        .iter()
        .map(|(id, p)| {
            let name = name_of(*id);
            let stats = super::digested::phase_stats(&name, p, step_total);
            let stragglers = match by_phase.get(id) {
                Some(ts) if p.in_step > 0 && n_ranks >= 2 && ts.len() >= 2 => {
                    distribution_stragglers(&name, ts, opts)
                }
                _ => Vec::new(),
            };
            (stats, stragglers)
        })
        .collect();

    // Tagged steps: the longest any rank spent in the step's tag phases (`assemble` takes
    // the maximum over ranks, so one entry per step says it).
    let mut tagged_phase = HashMap::new();
    let mut step_tags = BTreeMap::new();
    for (&step, (tags, len)) in &f.tagged {
        if let Some(&r) = ranks.first() {
            tagged_phase.insert((step, r), *len);
        }
        if !tags.is_empty() {
            step_tags.insert(step, tags.iter().cloned().collect());
        }
    }
    let shape = RunShape {
        ranks: ranks.clone(),
        step_tags,
    };
    assemble(
        Gathered {
            ranks: &ranks,
            steps: &steps,
            wall_max: &wall_max,
            per_phase,
            tagged_phase,
            waits,
            grouped: false,
            last_step: &last_step,
        },
        &shape,
        opts,
    )
}

/// The stragglers of one phase: each rank's per-step times against the pooled median.
fn distribution_stragglers(
    name: &str,
    ranks: &[(u32, &StepTimes)],
    opts: &StragglerOptions,
) -> Vec<Straggler> {
    let mut pooled = StepTimes::default();
    for (_, t) in ranks {
        pooled.merge(t);
    }
    let reference = pooled.median();
    if reference.is_nan() || reference <= 0.0 {
        return Vec::new();
    }
    ranks
        .iter()
        .filter_map(|&(rank, t)| {
            let above = t.above(reference);
            if t.steps == 0 || (above as f64) < opts.min_share_of_steps * t.steps as f64 {
                return None;
            }
            let median = t.median();
            let ratio = median / reference;
            (ratio >= 1.0 + opts.min_excess_ratio).then(|| Straggler {
                phase: name.to_string(),
                rank,
                slowest_steps: None,
                above_median_steps: above,
                steps: t.steps,
                median_excess_ns: median - reference,
                median_ratio: ratio,
            })
        })
        .collect()
}

/// The summary of the run at `location` from its merged figures.
pub fn summary_of_figures(location: &str, job: &JobFigures, opts: &StragglerOptions) -> Summary {
    let f = &job.figures;
    let a = analyse_figures(f, opts);
    let world_size = f.ranks.iter().map(|r| r.world_size).max().unwrap_or(0);
    let present: std::collections::BTreeSet<u32> = f.ranks.iter().map(|r| r.rank).collect();
    let mut error_records: Vec<super::summary::ErrorRecord> = f
        .named_errors
        .iter()
        .map(|(rank, step, n, m)| super::summary::ErrorRecord {
            rank: *rank,
            step: (*step != NO_STEP).then_some(*step),
            name: f.names.get(*n as usize).cloned().unwrap_or_default(),
            message: m.clone(),
        })
        .collect();
    error_records.sort_by_key(|e| (e.rank, e.step));
    Summary {
        run: location.to_string(),
        ranks: a.ranks,
        world_size: world_size.max(a.ranks),
        steps: a.steps,
        spans: f.spans,
        errors: f.errors,
        error_records,
        ended_early: a.ended_early,
        median_step_ns: a.median_step_ns,
        phases: a.phases,
        stragglers: a.stragglers,
        tagged_steps: a.tagged_steps,
        waits: a.waits.table,
        missing_ranks: (0..world_size).filter(|r| !present.contains(r)).collect(),
        corrupt_parts: Vec::new(),
        damage: Vec::new(),
        format: RunFormat::Titan,
        malformed_lines: 0,
        bad_lines: Vec::new(),
        truncated_tails: Vec::new(),
        open_spans: Vec::new(),
        clock_alignment: None,
        pipeline: None,
        run_id: Some(f.run_id.clone()).filter(|id| !id.is_empty()),
        other_runs: Vec::new(),
        host_syncs: None,
        experts: Vec::new(),
        node_figures: Some(NodeFiguresRead {
            nodes: job.nodes_read,
            ranks_from_folders: job.ranks_recomputed,
            open_journals: job.open_journals,
        }),
    }
}
