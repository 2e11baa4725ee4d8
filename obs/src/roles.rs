//! Where a span's time counts in the step figures ([`StepRole`]): decided once, the same
//! way for the per-part summaries and for the analyses of spans, so both give the same step
//! times.

use crate::record::NO_STEP;
use crate::tables::NameId;

/// Where a span's time counts in the step figures (median step, tagged-step cost, `% step`).
///
/// A step's time is the step as the rank's main thread saw it: the main thread's top-level
/// spans of the step — its `step` span in titan-train and torchtitan runs, which hold the
/// step's checkpoint and validation too (a synthetic run puts those beside it). Spans
/// on a rank's other threads (FSDP's and the pipeline's background collectives) run
/// concurrently with the step: they are not more step time, and summing them into it made a
/// step look longer than it was and `% step` add up past 100% at depth 0 (issue 39).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepRole {
    /// Outside steps: no step number.
    Outside,
    /// The step's time: a top-level span of the step on the main thread.
    Step,
    /// Nested inside the step on the main thread.
    Main,
    /// On another thread of the rank, during a step.
    Concurrent,
}

impl StepRole {
    /// Counted in the phase's share of the step time.
    pub(crate) fn in_step_time(self) -> bool {
        matches!(self, StepRole::Step | StepRole::Main)
    }
}

/// Each span's [`StepRole`]. `thread` and `depth` may be empty (columns not read): without
/// threads every span is on the main thread; without depth only `step` spans are top level.
/// A rank's main thread is the thread of its first `step` span, else the lowest thread that
/// recorded a span inside a step.
pub(crate) fn step_roles(
    rank: &[u32],
    step: &[u64],
    name: &[NameId],
    thread: &[u32],
    depth: &[u16],
    step_name: Option<NameId>,
) -> Vec<StepRole> {
    use std::collections::HashMap;
    let n = rank.len();
    let has_thread = thread.len() == n;
    let has_depth = depth.len() == n;
    let is_step = |i: usize| Some(name[i]) == step_name;
    // Per rank: (found its `step` spans' thread, the main thread so far).
    let mut main: HashMap<u32, (bool, u32)> = HashMap::new();
    for i in 0..n {
        if step[i] == NO_STEP {
            continue;
        }
        let th = if has_thread { thread[i] } else { 0 };
        if is_step(i) {
            let m = main.entry(rank[i]).or_insert((true, th));
            if !m.0 {
                *m = (true, th);
            }
        } else {
            let m = main.entry(rank[i]).or_insert((false, th));
            if !m.0 {
                m.1 = m.1.min(th);
            }
        }
    }
    (0..n)
        .map(|i| {
            if step[i] == NO_STEP {
                return StepRole::Outside;
            }
            if is_step(i) {
                return StepRole::Step;
            }
            if has_thread && main.get(&rank[i]).is_some_and(|m| m.1 != thread[i]) {
                return StepRole::Concurrent;
            }
            if has_depth && depth[i] == 0 {
                StepRole::Step
            } else {
                StepRole::Main
            }
        })
        .collect()
}
