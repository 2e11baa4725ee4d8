//! Putting ranks on different hosts on one clock when the records carry only each host's
//! wall clock (torchtitan's `time_us`; there is no measured offset like titan's footers).
//!
//! Data-parallel ranks start each step together: the previous step ended in collectives that
//! every rank left at about the same moment. So the earliest `step` start of each host in
//! a step, compared with the reference host's (the host of the lowest rank), measures the
//! hosts' clock difference plus noise; the median over all shared steps is the host's offset.
//! Ranks on one host share its clock and get the same offset. Runs on one host, or without
//! `step` spans, are left as recorded.

use std::collections::{BTreeMap, HashMap};

use crate::record::NO_STEP;
use crate::run::{ClockAlignment, HostOffset, Run};
use crate::stats::median_f64;
use crate::vocab::STEP;

/// Aligns hosts in place and says how; `None` when there was nothing to align.
pub fn align_hosts(run: &mut Run) -> Option<ClockAlignment> {
    let mut host_of_rank: BTreeMap<u32, String> = BTreeMap::new();
    for (&rank, info) in &run.ranks {
        host_of_rank.insert(rank, info.host.clone());
    }
    let mut hosts: Vec<String> = host_of_rank.values().cloned().collect();
    hosts.sort();
    hosts.dedup();
    if hosts.len() < 2 {
        return None;
    }
    let step_id = run.name_id(STEP)?;
    let reference = host_of_rank.values().next()?.clone();
    // Earliest step start per (host, step).
    let mut first: HashMap<(&str, u64), i64> = HashMap::new();
    let sp = &run.spans;
    if sp.start_ns.len() != sp.len() {
        return None;
    }
    for i in 0..sp.len() {
        if sp.name[i] != step_id || sp.step[i] == NO_STEP {
            continue;
        }
        let Some(host) = host_of_rank.get(&sp.rank[i]) else {
            continue;
        };
        let e = first.entry((host.as_str(), sp.step[i])).or_insert(i64::MAX);
        *e = (*e).min(sp.start_ns[i]);
    }
    let mut offsets: BTreeMap<String, (i64, u64)> = BTreeMap::new();
    for host in &hosts {
        if *host == reference {
            offsets.insert(host.clone(), (0, 0));
            continue;
        }
        let mut diffs: Vec<f64> = first
            .iter()
            .filter(|((h, _), _)| h == host)
            .filter_map(|((_, step), &t)| {
                let r = first.get(&(reference.as_str(), *step))?;
                Some((r - t) as f64)
            })
            .collect();
        let n = diffs.len() as u64;
        let off = if diffs.is_empty() {
            0
        } else {
            median_f64(&mut diffs).round() as i64
        };
        offsets.insert(host.clone(), (off, n));
    }
    let offset_of_rank: HashMap<u32, i64> = host_of_rank
        .iter()
        .map(|(&r, h)| (r, offsets[h].0))
        .collect();
    let shift = |ranks: &[u32], times: &mut [i64]| {
        for (r, t) in ranks.iter().zip(times.iter_mut()) {
            *t += offset_of_rank.get(r).copied().unwrap_or(0);
        }
    };
    shift(&run.spans.rank, &mut run.spans.start_ns);
    shift(&run.instants.rank, &mut run.instants.start_ns);
    shift(&run.scalars.rank, &mut run.scalars.start_ns);
    shift(&run.errors.rank, &mut run.errors.start_ns);
    for open in &mut run.report.open_spans {
        open.start_ns += offset_of_rank.get(&open.rank).copied().unwrap_or(0);
    }
    for (rank, info) in run.ranks.iter_mut() {
        info.clock_offset_ns = offset_of_rank.get(rank).copied().unwrap_or(0);
    }
    Some(ClockAlignment {
        method: "per-host offset = median over steps of the difference between the host's and the \
                 reference host's earliest `step` start (data-parallel ranks start steps together)"
            .into(),
        reference_host: reference,
        hosts: offsets
            .into_iter()
            .map(|(host, (offset_ns, steps_used))| HostOffset {
                ranks: host_of_rank
                    .iter()
                    .filter(|(_, h)| **h == host)
                    .map(|(&r, _)| r)
                    .collect(),
                host,
                offset_ns,
                steps_used,
            })
            .collect(),
    })
}
