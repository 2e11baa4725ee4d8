//! A pipeline-parallel schedule seen from its timing records: per stage, the measured bubble
//! next to the schedule's ideal, and the slowest stage.
//!
//! titan-train records every pass of a pipeline schedule as a `forward` or `backward` span
//! tagged with its microbatch and (virtual) stage, inside the step's `forward_backward` span
//! (the rank's pipeline window); the time it waits for a neighbour's activations or gradients
//! is a `pipeline_recv` span of its own. A stage's **bubble** in a step is the share of the
//! step's pipeline time (the longest window of the step over the pipeline's ranks: they all
//! start the schedule together, after the step's token count is reduced) that it spent in no
//! pass: `1 - (forward + backward time) / pipeline time`. The ideal is the
//! schedule's with equal stages and free communication: `(p-1)/(v*m+p-1)` for `p` pipeline
//! ranks, `v` stages per rank and `m` microbatches (GPipe and 1F1B: `v = 1`).
//!
//! PyTorch profiler traces of `torch.distributed.pipelining` (torchtitan's PP with its profiler
//! on) are read the same way: the passes are its `PP:<stage>F<mb>` / `B` / `I` / `W` actions,
//! the receives its `RECV_F` / `RECV_B` actions, and the window the profiler step.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::stats::median_f64;
use crate::record::NO_STEP;
use crate::run::Run;
use crate::vocab::{PROFILER_STEP, titan, torch_pipelining};

/// The pipeline of a run, as its records show it.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineSummary {
    /// Stages in the model (`p * v`).
    pub stages: u32,
    /// Stages each pipeline rank holds (`v`; 1 for GPipe and 1F1B).
    pub stages_per_rank: u32,
    /// Pipeline ranks (`p`).
    pub pipeline_ranks: u32,
    /// Microbatches per pipeline pass (`m`).
    pub microbatches: u32,
    /// `(p-1)/(v*m+p-1)`: the bubble with equal stages and free communication.
    pub ideal_bubble: f64,
    /// One row per pipeline rank position (the ranks holding the same stages), by first stage.
    pub per_stage: Vec<StageBubble>,
    /// Index into `per_stage` of the stages with the most compute per step.
    pub slowest: usize,
}

/// The measured pipeline of the ranks that hold the same stages.
#[derive(Debug, Clone, Serialize)]
pub struct StageBubble {
    /// The (virtual) stages these ranks run.
    pub stages: Vec<u16>,
    pub ranks: Vec<u32>,
    /// Steps measured (rank-steps with a window and passes, over `ranks`).
    pub rank_steps: u64,
    /// Median of one microbatch's forward pass.
    pub forward_ns: f64,
    /// Median of one microbatch's backward pass.
    pub backward_ns: f64,
    /// Median per rank-step: time in passes.
    pub busy_ns: f64,
    /// Median per rank-step: the step's pipeline time (the longest `forward_backward` of the
    /// step over the ranks that ran passes).
    pub window_ns: f64,
    /// Median per rank-step: time waiting to receive from a neighbouring stage.
    pub recv_wait_ns: f64,
    /// Median per rank-step of `1 - busy / window`.
    pub bubble: f64,
}

#[derive(Default)]
struct RankStep {
    window: i64,
    profiler_step: i64,
    busy: i64,
    recv: i64,
}

impl RankStep {
    /// The rank's pipeline window: `forward_backward`, else the profiler step.
    fn window(&self) -> i64 {
        if self.window > 0 {
            self.window
        } else {
            self.profiler_step
        }
    }
}

/// The pipeline analysis of a run loaded with the `pipeline` columns; `None` when no span
/// carries a pipeline slot (not a pipeline run, or a file without the columns).
pub fn pipeline_summary(run: &Run) -> Option<PipelineSummary> {
    let s = &run.spans;
    if s.pipeline.len() != s.len() || s.pipeline.iter().all(Option::is_none) {
        return None;
    }
    let id = |name: &str| run.names.iter().position(|n| n == name);
    let forward = id(titan::FORWARD);
    // Backward passes: whole, or a zero-bubble schedule's input and weight halves.
    let backwards: Vec<Option<usize>> = titan::PIPELINE_PASSES[1..].iter().map(|n| id(n)).collect();
    let (window, recv) = (id(titan::FORWARD_BACKWARD), id(titan::PIPELINE_RECV));
    // A PyTorch profiler trace of torch.distributed.pipelining has no `forward_backward`:
    // its pipeline time is the profiler step, and its passes are the `PP:` compute actions.
    let profiler_step = id(PROFILER_STEP);
    // Per name: a torch compute action, and whether it is a forward.
    let torch_pass: Vec<Option<bool>> = run
        .names
        .iter()
        .map(|n| {
            torch_pipelining::parse_action(n)
                .filter(|(_, c)| torch_pipelining::is_pass(c))
                .map(|(_, c)| c == "F")
        })
        .collect();
    let torch_recv: Vec<bool> = run
        .names
        .iter()
        .map(|n| torch_pipelining::parse_action(n).is_some_and(|(_, c)| c.starts_with("RECV")))
        .collect();

    let mut stages_of_rank: BTreeMap<u32, BTreeSet<u16>> = BTreeMap::new();
    let mut microbatches = 0u32;
    let mut per_rank_step: BTreeMap<(u32, u64), RankStep> = BTreeMap::new();
    // Per-microbatch pass times, by rank.
    let mut passes: BTreeMap<u32, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for i in 0..s.len() {
        let (rank, step, name) = (s.rank[i], s.step[i], Some(s.name[i] as usize));
        if step == NO_STEP {
            continue;
        }
        let dur = s.dur_ns[i];
        if name == window {
            per_rank_step.entry((rank, step)).or_default().window += dur;
            continue;
        }
        if name == profiler_step {
            per_rank_step.entry((rank, step)).or_default().profiler_step += dur;
            continue;
        }
        let Some(slot) = s.pipeline[i] else { continue };
        let n = s.name[i] as usize;
        if name == recv || torch_recv[n] {
            per_rank_step.entry((rank, step)).or_default().recv += dur;
        } else if name == forward || backwards.contains(&name) || torch_pass[n].is_some() {
            stages_of_rank.entry(rank).or_default().insert(slot.stage);
            microbatches = microbatches.max(u32::from(slot.microbatch) + 1);
            per_rank_step.entry((rank, step)).or_default().busy += dur;
            let (f, b) = passes.entry(rank).or_default();
            let is_forward = name == forward || torch_pass[n] == Some(true);
            if is_forward { f } else { b }.push(dur as f64);
        }
    }
    if stages_of_rank.is_empty() {
        return None;
    }
    // The pipeline's time in each step: the longest window over the ranks that ran passes.
    let mut pipeline_time: BTreeMap<u64, i64> = BTreeMap::new();
    for (&(_, step), rs) in &per_rank_step {
        if rs.busy > 0 {
            let t = pipeline_time.entry(step).or_default();
            *t = (*t).max(rs.window());
        }
    }
    // Ranks holding the same stages are one pipeline position (its dp/tp replicas).
    let mut positions: BTreeMap<Vec<u16>, Vec<u32>> = BTreeMap::new();
    for (rank, stages) in &stages_of_rank {
        positions
            .entry(stages.iter().copied().collect())
            .or_default()
            .push(*rank);
    }
    let stages = stages_of_rank
        .values()
        .flatten()
        .collect::<BTreeSet<_>>()
        .len() as u32;
    let stages_per_rank = positions.keys().map(Vec::len).max().unwrap_or(1) as u32;
    let pipeline_ranks = (stages / stages_per_rank.max(1)).max(1);
    let (p, v, m) = (
        f64::from(pipeline_ranks),
        f64::from(stages_per_rank),
        f64::from(microbatches),
    );
    let ideal_bubble = (p - 1.0) / (v * m + p - 1.0);

    let per_stage: Vec<StageBubble> = positions
        .into_iter()
        .map(|(stages, ranks)| {
            let mut busy = Vec::new();
            let mut windows = Vec::new();
            let mut recvs = Vec::new();
            let mut bubbles = Vec::new();
            let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
            for &rank in &ranks {
                for (&(_, step), rs) in per_rank_step.range((rank, 0)..=(rank, u64::MAX)) {
                    let window = pipeline_time.get(&step).copied().unwrap_or(0);
                    if window <= 0 || rs.busy <= 0 {
                        continue;
                    }
                    busy.push(rs.busy as f64);
                    windows.push(window as f64);
                    recvs.push(rs.recv as f64);
                    bubbles.push((1.0 - rs.busy as f64 / window as f64).max(0.0));
                }
                if let Some((f, b)) = passes.get(&rank) {
                    fwd.extend(f);
                    bwd.extend(b);
                }
            }
            StageBubble {
                stages,
                ranks,
                rank_steps: bubbles.len() as u64,
                forward_ns: median_f64(&mut fwd),
                backward_ns: median_f64(&mut bwd),
                busy_ns: median_f64(&mut busy),
                window_ns: median_f64(&mut windows),
                recv_wait_ns: median_f64(&mut recvs),
                bubble: median_f64(&mut bubbles),
            }
        })
        .collect();
    let slowest = per_stage
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.busy_ns.total_cmp(&b.1.busy_ns))
        .map_or(0, |(i, _)| i);
    Some(PipelineSummary {
        stages,
        stages_per_rank,
        pipeline_ranks,
        microbatches,
        ideal_bubble,
        per_stage,
        slowest,
    })
}
