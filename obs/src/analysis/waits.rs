//! Who made the others wait: the same collective matched across ranks, the rank that
//! arrived last, and the time every other rank spent waiting for it.
//!
//! A collective call is identified by (step, name, ordinal): the n-th `all_reduce` a rank
//! started in a step is the same call as every other rank's n-th `all_reduce` of that step
//! (every data-parallel rank runs the same sequence of collectives). A rank *arrives* when
//! its span starts (on rank 0's clock). The last rank to arrive made each other rank wait
//! `last_arrival - its_arrival`; the wait it caused is the sum of those. The phase it was
//! late from is the span that ended last on that rank before the collective began (the
//! shallowest one on a tie, so the whole `forward_backward` rather than its last
//! `backward`), not counting other collectives.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::table::SpanTable;
use crate::record::NO_STEP;
use crate::tables::NameId;
use crate::vocab;

/// One row of the "waiting on" table: a rank that arrived last at collectives after a phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Wait {
    pub rank: u32,
    /// The phase that ran on `rank` right before the collectives it was last at.
    pub phase: String,
    /// Steps in which this rank, coming from this phase, caused the most waiting.
    pub steps_last: u64,
    /// Sum over those collectives and the other ranks of (last arrival - their arrival).
    pub wait_caused_ns: i64,
}

/// The rank that made the others wait longest in one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepWait {
    pub step: u64,
    pub rank: u32,
    pub phase: String,
    /// Wait this rank caused in this step (all its late arrivals).
    pub wait_caused_ns: i64,
}

/// What [`collective_waits`] finds.
#[derive(Debug, Clone, Default)]
pub struct Waits {
    /// Sorted by wait caused, largest first.
    pub table: Vec<Wait>,
    /// One entry per step that had a matched collective, by step.
    pub per_step: Vec<StepWait>,
    /// (span index, time that rank waited in it for later ranks), for every collective span
    /// that waited at all.
    pub span_wait: Vec<(u32, i64)>,
}

/// One collective span: (step, name, ordinal) identifies the call across ranks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrival {
    pub(crate) step: u64,
    pub(crate) name: NameId,
    pub(crate) rank: u32,
    /// On rank 0's clock.
    pub(crate) start: i64,
    /// The caller's id of the span (its row in a span table, or in the per-part summaries).
    pub(crate) idx: u32,
}

/// One collective call matched across ranks: who arrived last and the wait it caused.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub(crate) step: u64,
    pub(crate) late_rank: u32,
    pub(crate) late_idx: u32,
    /// The last arrival's start (rank 0's clock).
    pub(crate) at: i64,
    pub(crate) caused: i64,
}

/// Matches collectives across ranks and accounts who waited for whom (empty when the run
/// has no collective spans or no start times).
pub fn collective_waits(t: &SpanTable) -> Waits {
    let is_coll: Vec<bool> = t
        .names
        .iter()
        .map(|n| vocab::collective::is_collective(n))
        .collect();
    if !t.has_start() || !is_coll.iter().any(|&c| c) {
        return Waits::default();
    }
    let arrivals: Vec<Arrival> = (0..t.len())
        .filter(|&i| t.step[i] != NO_STEP && is_coll[t.name[i] as usize])
        .map(|i| Arrival {
            step: t.step[i],
            name: t.name[i],
            rank: t.rank[i],
            start: t.start_ns[i],
            idx: i as u32,
        })
        .collect();
    let (calls, span_wait) = match_arrivals(arrivals);
    if calls.is_empty() {
        return Waits::default();
    }

    // The phase each late rank came from: needs that rank's spans of that step.
    let mut wanted: HashMap<(u32, u64), Vec<u32>> = HashMap::new();
    for c in &calls {
        wanted.entry((c.late_rank, c.step)).or_default();
    }
    for i in 0..t.len() {
        if is_coll[t.name[i] as usize] {
            continue;
        }
        if let Some(v) = wanted.get_mut(&(t.rank[i], t.step[i])) {
            v.push(i as u32);
        }
    }
    let phase_before = |c: &Call| -> String {
        let best = wanted[&(c.late_rank, c.step)]
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| t.start_ns[i] + t.dur_ns[i] <= c.at)
            .max_by_key(|&i| {
                let depth = if t.has_depth() { t.depth[i] } else { 0 };
                (t.start_ns[i] + t.dur_ns[i], std::cmp::Reverse(depth))
            });
        match best {
            Some(i) => t.names[t.name[i] as usize].clone(),
            None => "-".to_string(),
        }
    };
    account(&calls, span_wait, phase_before)
}

/// Groups arrivals into calls — the n-th call of a name that each rank started in a step is
/// one call — and returns the calls of two or more ranks, in step order, and (arrival idx,
/// time it waited for the last rank) for every arrival that waited.
pub(crate) fn match_arrivals(mut arrivals: Vec<Arrival>) -> (Vec<Call>, Vec<(u32, i64)>) {
    // Ordinal of each call within its (step, name, rank).
    arrivals.sort_unstable_by_key(|a| (a.step, a.name, a.rank, a.start, a.idx));
    let mut ordinal = vec![0u32; arrivals.len()];
    for i in 1..arrivals.len() {
        let (p, a) = (&arrivals[i - 1], &arrivals[i]);
        if (p.step, p.name, p.rank) == (a.step, a.name, a.rank) {
            ordinal[i] = ordinal[i - 1] + 1;
        }
    }
    let mut keyed: Vec<(u32, Arrival)> = ordinal.into_iter().zip(arrivals).collect();
    keyed.sort_unstable_by_key(|(o, a)| (a.step, a.name, *o, a.start, a.rank));

    let mut calls: Vec<Call> = Vec::new();
    let mut span_wait = Vec::new();
    for group in keyed.chunk_by(|(oa, a), (ob, b)| (a.step, a.name, oa) == (b.step, b.name, ob)) {
        if group.len() < 2 {
            continue;
        }
        // Sorted by start: the last element arrived last (ties: the highest rank).
        let last = group[group.len() - 1].1;
        let mut caused = 0i64;
        for (_, a) in &group[..group.len() - 1] {
            let w = last.start.saturating_sub(a.start);
            if w > 0 {
                span_wait.push((a.idx, w));
                caused = caused.saturating_add(w);
            }
        }
        calls.push(Call {
            step: last.step,
            late_rank: last.rank,
            late_idx: last.idx,
            at: last.start,
            caused,
        });
    }
    span_wait.sort_unstable();
    (calls, span_wait)
}

/// The "waiting on" table and the per-step worst rank from matched calls (in step order);
/// `phase_before` names the phase a late rank came from.
pub(crate) fn account(
    calls: &[Call],
    span_wait: Vec<(u32, i64)>,
    mut phase_before: impl FnMut(&Call) -> String,
) -> Waits {
    // Per (rank, phase) totals, and per step the rank that caused the most wait.
    let mut rows: BTreeMap<(u32, String), Wait> = BTreeMap::new();
    let mut per_step: Vec<StepWait> = Vec::new();
    for step_calls in calls.chunk_by(|a, b| a.step == b.step) {
        // (rank) -> (wait caused this step, the phase of its largest late arrival, its size).
        let mut by_rank: BTreeMap<u32, (i64, String, i64)> = BTreeMap::new();
        for c in step_calls {
            let phase = phase_before(c);
            let row = rows
                .entry((c.late_rank, phase.clone()))
                .or_insert_with(|| Wait {
                    rank: c.late_rank,
                    phase: phase.clone(),
                    steps_last: 0,
                    wait_caused_ns: 0,
                });
            row.wait_caused_ns = row.wait_caused_ns.saturating_add(c.caused);
            let e = by_rank.entry(c.late_rank).or_insert((0, phase.clone(), -1));
            e.0 = e.0.saturating_add(c.caused);
            if c.caused > e.2 {
                e.1 = phase;
                e.2 = c.caused;
            }
        }
        let (&rank, (caused, phase, _)) = by_rank
            .iter()
            .max_by_key(|(r, v)| (v.0, std::cmp::Reverse(**r)))
            .expect("a step with calls");
        if let Some(row) = rows.get_mut(&(rank, phase.clone())) {
            row.steps_last += 1;
        }
        per_step.push(StepWait {
            step: step_calls[0].step,
            rank,
            phase: phase.clone(),
            wait_caused_ns: *caused,
        });
    }
    let mut table: Vec<Wait> = rows.into_values().collect();
    table.sort_by(|a, b| {
        (std::cmp::Reverse(a.wait_caused_ns), a.rank, &a.phase).cmp(&(
            std::cmp::Reverse(b.wait_caused_ns),
            b.rank,
            &b.phase,
        ))
    });
    Waits {
        table,
        per_step,
        span_wait,
    }
}

/// Span durations with the time each rank spent waiting for later ranks taken out: a span's
/// waiting is the waiting of every collective span of the same rank that starts inside it,
/// in `[start, end)` (itself included). A collective that starts exactly where a span ends
/// is the span's next sibling, not part of it: counting it took a `forward_backward`
/// followed at once by its `all_reduce` down to `forward_backward - wait` on every rank that
/// waited, and a 1.4x straggler read as 2.3x. `None` when nobody waited.
pub fn durations_without_waits(t: &SpanTable, waits: &Waits) -> Option<Vec<i64>> {
    if waits.span_wait.is_empty() || !t.has_start() {
        return None;
    }
    // Per rank: (start, cumulative wait up to and including it), sorted by start.
    let mut by_rank: HashMap<u32, Vec<(i64, i64)>> = HashMap::new();
    for &(idx, w) in &waits.span_wait {
        let i = idx as usize;
        by_rank
            .entry(t.rank[i])
            .or_default()
            .push((t.start_ns[i], w));
    }
    for v in by_rank.values_mut() {
        v.sort_unstable();
        let mut acc = 0;
        for e in v.iter_mut() {
            acc += e.1;
            e.1 = acc;
        }
    }
    let before = |v: &[(i64, i64)], t: i64| -> i64 {
        // Cumulative wait of collectives starting strictly before t.
        let k = v.partition_point(|e| e.0 < t);
        if k == 0 { 0 } else { v[k - 1].1 }
    };
    Some(
        (0..t.len())
            .map(|i| {
                let d = t.dur_ns[i];
                match by_rank.get(&t.rank[i]) {
                    None => d,
                    Some(v) => {
                        let s = t.start_ns[i];
                        // Saturating: a damaged part's huge times must not overflow.
                        let waited = before(v, s.saturating_add(d)).saturating_sub(before(v, s));
                        d.saturating_sub(waited).max(0)
                    }
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::table::OwnedSpans;

    /// Two ranks, 3 steps: `work` then `all_reduce`; rank 1's work takes 30 instead of 10,
    /// so rank 0 waits 20 in every all_reduce.
    fn two_ranks() -> OwnedSpans {
        let mut spans = OwnedSpans::default();
        for s in 0..3u64 {
            let t0 = s as i64 * 100;
            for r in 0..2u32 {
                let work = if r == 1 { 30 } else { 10 };
                let arrive = t0 + work;
                let end = t0 + 30 + 5;
                // step, work, all_reduce
                for (n, st, d, dp) in [
                    (0, t0, end - t0, 0),
                    (1, t0, work, 1),
                    (2, arrive, end - arrive, 1),
                ] {
                    spans.push(r, s, n, st, d, dp);
                }
            }
        }
        spans
    }

    #[test]
    fn names_the_late_rank_and_the_wait() {
        let spans = two_ranks();
        let names = vec!["step".into(), "work".into(), "all_reduce".into()];
        let t = spans.table(&names);
        let (rank, name, dur) = (&spans.rank, &spans.name, &spans.dur_ns);
        let w = collective_waits(&t);
        assert_eq!(
            w.table,
            vec![Wait {
                rank: 1,
                phase: "work".into(),
                steps_last: 3,
                wait_caused_ns: 60
            }]
        );
        assert_eq!(w.per_step.len(), 3);
        assert!(
            w.per_step
                .iter()
                .all(|s| s.rank == 1 && s.wait_caused_ns == 20)
        );
        // Without waits, rank 0's step is 15 (10 work + 5 transfer), rank 1's 35.
        let d = durations_without_waits(&t, &w).unwrap();
        let step_of = |r: u32| {
            (0..t.len())
                .find(|&i| rank[i] == r && name[i] == 0)
                .unwrap()
        };
        assert_eq!((dur[step_of(0)], d[step_of(0)]), (35, 15));
        assert_eq!((dur[step_of(1)], d[step_of(1)]), (35, 35));
        // `work` ends exactly where its all_reduce starts: the wait that follows is not
        // part of it, on the rank that waited as on the late one.
        let work_of = |r: u32| {
            (0..t.len())
                .find(|&i| rank[i] == r && name[i] == 1)
                .unwrap()
        };
        assert_eq!((d[work_of(0)], d[work_of(1)]), (10, 30));
    }
}
