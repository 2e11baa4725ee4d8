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

use crate::digest::merged::RankPipeline;
use crate::digest::schedule::{
    MicrobatchBackwards, RankSchedule, Role, add_backward, each_schedule_span,
};
use crate::digest::{PhaseDigest, PipelineStep, RunDigest};
use crate::run::Run;
use crate::stats::median_f64;
use crate::vocab::{titan, torch_pipelining};

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
    /// `(p-1)/(v*m+p-1)`: the bubble of GPipe, 1F1B and Interleaved1F1B with equal stages
    /// and free communication; None when the schedule split the backward into input and
    /// weight passes (zero bubble), whose weight passes fill that bubble, so the formula is
    /// not its ideal.
    pub ideal_bubble: Option<f64>,
    /// The backward ran as input- and weight-gradient passes (`backward_input` /
    /// `backward_weight`, torch's `I` / `W`): a zero-bubble schedule.
    pub split_backward: bool,
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
    /// Median of one microbatch's backward: its backward pass, or under a zero-bubble
    /// schedule its input and weight passes together (the microbatch's whole backward, as
    /// GPipe's and 1F1B's `backward` is).
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

/// The rank's pipeline window in a step: `forward_backward`, else the profiler step.
fn window(s: &PipelineStep) -> i64 {
    if s.window > 0 {
        s.window
    } else {
        s.profiler_step
    }
}

impl PipelineSummary {
    /// The ranks of each pipeline position: under pipeline parallelism a rank's times are
    /// compared with those of the ranks holding the same stages (see
    /// [`super::analyse_grouped`]), since stages differ by design.
    pub fn stage_groups(&self) -> Vec<Vec<u32>> {
        self.per_stage.iter().map(|s| s.ranks.clone()).collect()
    }
}

/// The groups a run's stragglers are found in ([`PipelineSummary::stage_groups`]); empty (all
/// ranks one group) when the run has no pipeline. What `summary` and the TUI both use.
pub fn stage_groups(run: &Run) -> Vec<Vec<u32>> {
    pipeline_summary(run)
        .map(|p| p.stage_groups())
        .unwrap_or_default()
}

/// The pipeline analysis of a run loaded with the `pipeline` columns; `None` when no span
/// carries a pipeline slot (not a pipeline run, or a file without the columns).
pub fn pipeline_summary(run: &Run) -> Option<PipelineSummary> {
    if let Some(d) = &run.digest {
        return digest_pipeline_summary(d, &run.names);
    }
    let mut ranks: BTreeMap<u32, RankSchedule> = BTreeMap::new();
    // Per-microbatch pass times, by rank: forwards, and backwards summed per microbatch.
    let mut passes: BTreeMap<u32, (Vec<f64>, MicrobatchBackwards)> = BTreeMap::new();
    each_schedule_span(&run.spans, &run.names, |i, role, step, slot| {
        let (rank, dur) = (run.spans.rank[i], run.spans.dur_ns[i]);
        ranks.entry(rank).or_default().add(role, step, dur, slot);
        let (f, b) = passes.entry(rank).or_default();
        match role {
            Role::Forward => f.push(dur as f64),
            Role::Backward => add_backward(b, step, slot, dur),
            _ => {}
        }
    })?;
    let passes: BTreeMap<u32, (Vec<f64>, Vec<f64>)> = passes
        .into_iter()
        .map(|(r, (f, b))| (r, (f, b.into_values().map(|v| v as f64).collect())))
        .collect();
    summarise(&ranks, split_backward(&run.names), |position| {
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for rank in position {
            if let Some((f, b)) = passes.get(rank) {
                fwd.extend(f);
                bwd.extend(b);
            }
        }
        (median_f64(&mut fwd), median_f64(&mut bwd))
    })
}

/// Whether the run's names hold a split backward's passes (titan's `backward_input` /
/// `backward_weight`, torch.distributed.pipelining's `I` / `W` actions).
fn split_backward(names: &[String]) -> bool {
    names.iter().any(|n| {
        n == titan::BACKWARD_INPUT
            || n == titan::BACKWARD_WEIGHT
            || torch_pipelining::parse_action(n).is_some_and(|(_, c)| c == "I" || c == "W")
    })
}

/// The pipeline analysis from a run's merged summaries: the same as from its spans, but the
/// per-microbatch pass medians come from the sketches (within
/// [`crate::digest::SKETCH_ALPHA`]).
fn digest_pipeline_summary(d: &RunDigest, names: &[String]) -> Option<PipelineSummary> {
    if d.pipeline.is_empty() {
        return None;
    }
    let ranks: BTreeMap<u32, RankSchedule> = d
        .pipeline
        .iter()
        .map(|(&r, p)| {
            (
                r,
                RankSchedule {
                    stages: p.stages.clone(),
                    microbatches: p.microbatches,
                    steps: p.steps.clone(),
                },
            )
        })
        .collect();
    summarise(&ranks, split_backward(names), |position| {
        let median = |pass: fn(&RankPipeline) -> &PhaseDigest| {
            let mut m = PhaseDigest::default();
            for r in position {
                if let Some(p) = d.pipeline.get(r) {
                    m.merge(pass(p));
                }
            }
            crate::digest::sketch_median(&m.sketch, m.count, m.min_ns, m.max_ns)
        };
        (median(|p| &p.forward), median(|p| &p.backward))
    })
}

/// The summary of the ranks' schedules; `pass_medians` gives the median forward and
/// backward pass of a pipeline position's ranks.
fn summarise(
    ranks: &BTreeMap<u32, RankSchedule>,
    split_backward: bool,
    pass_medians: impl Fn(&[u32]) -> (f64, f64),
) -> Option<PipelineSummary> {
    let stages_of_rank: BTreeMap<u32, &BTreeSet<u16>> = ranks
        .iter()
        .filter(|(_, r)| !r.stages.is_empty())
        .map(|(&rank, r)| (rank, &r.stages))
        .collect();
    if stages_of_rank.is_empty() {
        return None;
    }
    let microbatches = ranks.values().map(|r| r.microbatches).max().unwrap_or(0);
    // The pipeline's time in each step: the longest window over the ranks that ran passes.
    let mut pipeline_time: BTreeMap<u64, i64> = BTreeMap::new();
    for r in ranks.values() {
        for (&step, rs) in &r.steps {
            if rs.busy > 0 {
                let t = pipeline_time.entry(step).or_default();
                *t = (*t).max(window(rs));
            }
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
        .copied()
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
    let ideal_bubble = (!split_backward).then(|| (p - 1.0) / (v * m + p - 1.0));

    let per_stage: Vec<StageBubble> = positions
        .into_iter()
        .map(|(stages, position)| {
            let mut busy = Vec::new();
            let mut windows = Vec::new();
            let mut recvs = Vec::new();
            let mut bubbles = Vec::new();
            for rank in &position {
                for (step, rs) in ranks.get(rank).into_iter().flat_map(|r| &r.steps) {
                    let window = pipeline_time.get(step).copied().unwrap_or(0);
                    if window <= 0 || rs.busy <= 0 {
                        continue;
                    }
                    busy.push(rs.busy as f64);
                    windows.push(window as f64);
                    recvs.push(rs.recv as f64);
                    bubbles.push((1.0 - rs.busy as f64 / window as f64).max(0.0));
                }
            }
            let (forward_ns, backward_ns) = pass_medians(&position);
            StageBubble {
                stages,
                ranks: position,
                rank_steps: bubbles.len() as u64,
                forward_ns,
                backward_ns,
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
        split_backward,
        per_stage,
        slowest,
    })
}
