//! Cross-rank statistics computed once per load: per-(phase, step) spread over ranks,
//! straggler flags, collapsed rows and the phase summary table.

use std::collections::{HashMap, HashSet};

use super::model::{
    CollapsedBar, CollapsedRow, FLAG_STRAGGLER, Lane, NO_STEP, Ns, PhaseId,
    STRAGGLER_MIN_EXCESS_NS, STRAGGLER_RATIO,
};

/// Spread of one phase's per-rank time at one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurStats {
    pub min: Ns,
    pub median: Ns,
    pub max: Ns,
    pub min_rank: u32,
    pub max_rank: u32,
    /// How many ranks ran this phase at this step.
    pub ranks: u32,
}

/// Whether a value is a straggler against the cross-rank median.
pub fn is_straggler(value: Ns, median: Ns) -> bool {
    value as f64 >= median as f64 * STRAGGLER_RATIO && value - median >= STRAGGLER_MIN_EXCESS_NS
}

/// One rank's time in one phase at one step (summed over that rank's threads and repeats).
#[derive(Debug, Clone, Copy)]
pub struct RankPhaseTime {
    pub rank: u32,
    pub total: Ns,
    pub first_start: Ns,
}

pub type PerRank = HashMap<(PhaseId, u32), Vec<RankPhaseTime>>;

pub fn per_rank_phase_step(lanes: &[Lane]) -> PerRank {
    let mut out: PerRank = HashMap::new();
    // Lanes are sorted by rank: accumulate one rank at a time so the local map stays small.
    let mut i = 0;
    while i < lanes.len() {
        let rank = lanes[i].rank;
        let mut local: HashMap<(PhaseId, u32), (Ns, Ns)> = HashMap::new();
        while i < lanes.len() && lanes[i].rank == rank {
            for row in &lanes[i].rows {
                for k in 0..row.len() {
                    let e = local
                        .entry((row.phase[k], row.step[k]))
                        .or_insert((0, Ns::MAX));
                    e.0 += row.end[k] - row.start[k];
                    e.1 = e.1.min(row.start[k]);
                }
            }
            i += 1;
        }
        for (key, (total, first_start)) in local {
            out.entry(key).or_default().push(RankPhaseTime {
                rank,
                total,
                first_start,
            });
        }
    }
    out
}

pub fn cross_rank_stats(per_rank: &PerRank) -> HashMap<(PhaseId, u32), DurStats> {
    per_rank
        .iter()
        .map(|(&key, times)| {
            let mut v: Vec<(Ns, u32)> = times.iter().map(|t| (t.total, t.rank)).collect();
            v.sort_unstable();
            let median = median_sorted(&v.iter().map(|x| x.0).collect::<Vec<_>>());
            let stats = DurStats {
                min: v[0].0,
                median,
                max: v[v.len() - 1].0,
                min_rank: v[0].1,
                max_rank: v[v.len() - 1].1,
                ranks: v.len() as u32,
            };
            (key, stats)
        })
        .collect()
}

fn median_sorted(v: &[Ns]) -> Ns {
    let n = v.len();
    if n == 0 {
        0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

/// Flags every span of a (rank, phase, step) whose total time is a straggler.
pub fn mark_stragglers(
    lanes: &mut [Lane],
    per_rank: &PerRank,
    stats: &HashMap<(PhaseId, u32), DurStats>,
) {
    let mut slow: HashSet<(PhaseId, u32, u32)> = HashSet::new();
    for (&(phase, step), times) in per_rank {
        let st = &stats[&(phase, step)];
        // Comparing a rank with itself says nothing.
        if st.ranks < 2 {
            continue;
        }
        for t in times {
            if is_straggler(t.total, st.median) {
                slow.insert((phase, step, t.rank));
            }
        }
    }
    if slow.is_empty() {
        return;
    }
    let slow_keys: HashSet<(PhaseId, u32)> = slow.iter().map(|&(p, s, _)| (p, s)).collect();
    for lane in lanes {
        for row in &mut lane.rows {
            for k in 0..row.len() {
                let key = (row.phase[k], row.step[k]);
                if slow_keys.contains(&key) && slow.contains(&(key.0, key.1, lane.rank)) {
                    row.flags[k] |= FLAG_STRAGGLER;
                }
            }
        }
    }
}

pub fn collapsed_rows(
    per_rank: &PerRank,
    stats: &HashMap<(PhaseId, u32), DurStats>,
    phase_order: &[PhaseId],
) -> Vec<CollapsedRow> {
    let mut by_phase: HashMap<PhaseId, Vec<CollapsedBar>> = HashMap::new();
    for (&(phase, step), times) in per_rank {
        let mut starts: Vec<Ns> = times.iter().map(|t| t.first_start).collect();
        starts.sort_unstable();
        by_phase.entry(phase).or_default().push(CollapsedBar {
            step,
            start: median_sorted(&starts),
            stats: stats[&(phase, step)],
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

/// One line of the phase summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseSummary {
    pub phase: PhaseId,
    pub count: u64,
    pub total: Ns,
    pub mean: Ns,
    pub p50: Ns,
    pub p95: Ns,
    pub max: Ns,
    /// Share of the total time of `step` spans (None when the run has no `step` phase).
    pub share_of_step: Option<f64>,
    /// How many (rank, step) pairs of this phase were stragglers.
    pub stragglers: u64,
}

pub fn phase_summary(
    lanes: &[Lane],
    n_phases: usize,
    step_phase: Option<&PhaseId>,
) -> Vec<PhaseSummary> {
    let mut durs: Vec<Vec<Ns>> = vec![Vec::new(); n_phases];
    let mut stragglers = vec![0u64; n_phases];
    for lane in lanes {
        for row in &lane.rows {
            for k in 0..row.len() {
                let p = row.phase[k] as usize;
                durs[p].push(row.end[k] - row.start[k]);
                if row.flags[k] & FLAG_STRAGGLER != 0 {
                    stragglers[p] += 1;
                }
            }
        }
    }
    let step_total: Option<Ns> = step_phase.map(|&p| durs[p as usize].iter().sum());
    let mut out: Vec<PhaseSummary> = durs
        .into_iter()
        .enumerate()
        .filter(|(_, d)| !d.is_empty())
        .map(|(p, mut d)| {
            let count = d.len() as u64;
            let total: Ns = d.iter().sum();
            let p50 = percentile(&mut d, 0.50);
            let p95 = percentile(&mut d, 0.95);
            let max = d.iter().copied().max().unwrap_or(0);
            PhaseSummary {
                phase: p as PhaseId,
                count,
                total,
                mean: total / count as Ns,
                p50,
                p95,
                max,
                share_of_step: step_total
                    .filter(|&t| t > 0)
                    .map(|t| total as f64 / t as f64),
                stragglers: stragglers[p],
            }
        })
        .collect();
    out.sort_by_key(|s| std::cmp::Reverse(s.total));
    out
}

/// Nearest-rank percentile (q in 0..=1); reorders `v`.
fn percentile(v: &mut [Ns], q: f64) -> Ns {
    let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    *v.select_nth_unstable(idx).1
}

/// The step value shown to users (`None` for spans outside any step).
pub fn step_label(step: u32) -> Option<u64> {
    (step != NO_STEP).then_some(step as u64)
}
