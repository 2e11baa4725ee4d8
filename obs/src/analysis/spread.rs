//! The spread of one phase across ranks at one step (min / median / max and who), what the
//! TUI's collapsed rows and details panel show.

use std::collections::HashMap;

use super::table::SpanTable;
use crate::stats::quantile_in_place;
use crate::tables::NameId;

/// One phase at one step across ranks; a rank's value is its total time in the phase at that
/// step (summed over threads and repeats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    pub min: i64,
    /// Nearest-rank median, like [`crate::stats::DurationStats::p50_ns`].
    pub median: i64,
    pub max: i64,
    pub min_rank: u32,
    pub max_rank: u32,
    /// How many ranks ran the phase at the step.
    pub ranks: u32,
    /// Median over ranks of the phase's first start in the step (needs start times).
    pub median_start: i64,
}

/// Each rank's (total time, first start) per (phase, step, rank).
pub type RankTimes = HashMap<(NameId, u64, u32), (i64, i64)>;

/// Every rank's total time and first start in each phase at each step (spans outside steps
/// are grouped under [`crate::NO_STEP`]).
pub fn rank_times(t: &SpanTable) -> RankTimes {
    let has_start = t.has_start();
    let mut out: RankTimes = HashMap::new();
    for i in 0..t.len() {
        let e = out
            .entry((t.name[i], t.step[i], t.rank[i]))
            .or_insert((0, i64::MAX));
        e.0 += t.dur_ns[i];
        if has_start {
            e.1 = e.1.min(t.start_ns[i]);
        }
    }
    out
}

/// The cross-rank spread of every (phase, step).
pub fn phase_step_spread(times: &RankTimes) -> HashMap<(NameId, u64), Spread> {
    // (phase, step) -> each rank's (total, rank, first start).
    type Ranks = Vec<(i64, u32, i64)>;
    let mut by_key: HashMap<(NameId, u64), Ranks> = HashMap::new();
    for (&(name, step, rank), &(total, start)) in times {
        by_key
            .entry((name, step))
            .or_default()
            .push((total, rank, start));
    }
    by_key
        .into_iter()
        .map(|(key, mut v)| {
            v.sort_unstable();
            let mut totals: Vec<i64> = v.iter().map(|x| x.0).collect();
            let mut starts: Vec<i64> = v.iter().map(|x| x.2).collect();
            let (lo, hi) = (v[0], v[v.len() - 1]);
            let spread = Spread {
                min: lo.0,
                median: quantile_in_place(&mut totals, 0.5),
                max: hi.0,
                min_rank: lo.1,
                max_rank: hi.1,
                ranks: v.len() as u32,
                median_start: quantile_in_place(&mut starts, 0.5),
            };
            (key, spread)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::table::OwnedSpans;

    #[test]
    fn spread_over_ranks() {
        // Phase 0 at step 1: rank 0 runs it twice (10 + 5), rank 1 once (30), rank 2 once (12).
        let mut spans = OwnedSpans::default();
        for (rank, dur, start) in [(0, 10, 100), (0, 5, 120), (1, 30, 101), (2, 12, 99)] {
            spans.push(rank, 1, 0, start, dur, 0);
        }
        let names = vec!["p".to_string()];
        let t = spans.table(&names);
        let s = phase_step_spread(&rank_times(&t))[&(0, 1)];
        assert_eq!(
            s,
            Spread {
                min: 12,
                median: 15,
                max: 30,
                min_rank: 2,
                max_rank: 1,
                ranks: 3,
                median_start: 100,
            }
        );
    }
}
