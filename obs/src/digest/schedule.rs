//! A pipeline schedule as its spans show it, one rank at a time: what each span is to the
//! schedule ([`Role`]: the rank's window, a receive, a pass), and per rank the stages,
//! microbatches and per-step times ([`RankSchedule`]). A part's summary keeps its rank's
//! ([`part_pipeline`]); `analysis::pipeline` reads the same classification from a run's spans
//! or from the merged summaries, so both give the same figures.

use std::collections::{BTreeMap, BTreeSet};

use super::{PhaseDigest, PipelineDigest, PipelineStep};
use crate::record::NO_STEP;
use crate::roles::StepRole;
use crate::schema::PipelineSlot;
use crate::tables::{PartData, Spans};
use crate::vocab::{PROFILER_STEP, titan, torch_pipelining};

/// What a span is to the pipeline analysis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The rank's pipeline window (`forward_backward`).
    Window,
    /// A profiler step (the window of a PyTorch trace, which has no `forward_backward`).
    ProfilerStep,
    /// Waiting to receive from a neighbouring stage.
    Recv,
    /// One microbatch's pass: forward, or backward (whole, or a zero-bubble half).
    Forward,
    Backward,
    Other,
}

/// The roles of a name table's names.
pub(crate) struct Roles {
    window: Option<usize>,
    profiler_step: Option<usize>,
    recv: Option<usize>,
    forward: Option<usize>,
    backwards: Vec<Option<usize>>,
    /// Per name: a torch compute action, and whether it is a forward.
    torch_pass: Vec<Option<bool>>,
    torch_recv: Vec<bool>,
}

impl Roles {
    fn of(names: &[String]) -> Roles {
        let id = |name: &str| names.iter().position(|n| n == name);
        Roles {
            window: id(titan::FORWARD_BACKWARD),
            profiler_step: id(PROFILER_STEP),
            recv: id(titan::PIPELINE_RECV),
            forward: id(titan::FORWARD),
            backwards: titan::PIPELINE_PASSES[1..].iter().map(|n| id(n)).collect(),
            torch_pass: names
                .iter()
                .map(|n| {
                    torch_pipelining::parse_action(n)
                        .filter(|(_, c)| torch_pipelining::is_pass(c))
                        .map(|(_, c)| c == "F")
                })
                .collect(),
            torch_recv: names
                .iter()
                .map(|n| {
                    torch_pipelining::parse_action(n).is_some_and(|(_, c)| c.starts_with("RECV"))
                })
                .collect(),
        }
    }

    /// The role of a span named `name`; `slotted`: it carries a pipeline slot (receives and
    /// passes without one are not the schedule's).
    fn role(&self, name: usize, slotted: bool) -> Role {
        let n = Some(name);
        if n == self.window {
            Role::Window
        } else if n == self.profiler_step {
            Role::ProfilerStep
        } else if !slotted {
            Role::Other
        } else if n == self.recv || self.torch_recv.get(name).copied().unwrap_or(false) {
            Role::Recv
        } else if n == self.forward || self.torch_pass.get(name) == Some(&Some(true)) {
            Role::Forward
        } else if self.backwards.contains(&n) || self.torch_pass.get(name) == Some(&Some(false)) {
            Role::Backward
        } else {
            Role::Other
        }
    }
}

/// One rank's schedule: the stages it ran passes of, its microbatches and per step its
/// window, passes and receives.
#[derive(Debug, Clone, Default)]
pub struct RankSchedule {
    pub stages: BTreeSet<u16>,
    /// Largest microbatch + 1.
    pub microbatches: u32,
    pub steps: BTreeMap<u64, PipelineStep>,
}

impl RankSchedule {
    /// Adds a span of `role` (with its slot, for passes) in `step`.
    pub(crate) fn add(&mut self, role: Role, step: u64, dur: i64, slot: Option<PipelineSlot>) {
        let e = self.steps.entry(step).or_insert(PipelineStep {
            step,
            ..Default::default()
        });
        match role {
            Role::Window => e.window += dur,
            Role::ProfilerStep => e.profiler_step += dur,
            Role::Recv => e.recv += dur,
            Role::Forward | Role::Backward => {
                e.busy += dur;
                if let Some(slot) = slot {
                    self.stages.insert(slot.stage);
                    self.microbatches = self.microbatches.max(u32::from(slot.microbatch) + 1);
                }
            }
            Role::Other => {}
        }
    }
}

/// Calls `f(i, role, step, slot)` for every span `i` in a step that the pipeline analysis
/// reads (windows, receives, passes); `None` when no span carries a pipeline slot (not a
/// pipeline run, or read without the `pipeline` columns).
pub(crate) fn each_schedule_span(
    s: &Spans,
    names: &[String],
    mut f: impl FnMut(usize, Role, u64, Option<PipelineSlot>),
) -> Option<()> {
    if s.pipeline.len() != s.len() || s.pipeline.iter().all(Option::is_none) {
        return None;
    }
    let roles = Roles::of(names);
    for i in 0..s.len() {
        let step = s.step[i];
        if step == NO_STEP {
            continue;
        }
        let slot = s.pipeline[i];
        let role = roles.role(s.name[i] as usize, slot.is_some());
        if role != Role::Other {
            f(i, role, step, slot);
        }
    }
    Some(())
}

/// A microbatch's backward time per (step, stage, microbatch): its backward pass, or its
/// input and weight passes summed (issue 39: their median mixed 12.9 and 4.6 ms into 7.0).
pub(crate) type MicrobatchBackwards = BTreeMap<(u64, u16, u16), i64>;

pub(crate) fn add_backward(
    b: &mut MicrobatchBackwards,
    step: u64,
    slot: Option<PipelineSlot>,
    dur: i64,
) {
    let key = slot.map_or((step, u16::MAX, u16::MAX), |s| {
        (step, s.stage, s.microbatch)
    });
    let v = b.entry(key).or_default();
    *v = v.saturating_add(dur);
}

/// A part's pipeline digest (one rank): `None` when no span of it carries a pipeline slot.
pub(crate) fn part_pipeline(d: &PartData) -> Option<PipelineDigest> {
    let mut sched = RankSchedule::default();
    let (mut forward, mut backward) = (PhaseDigest::default(), PhaseDigest::default());
    let mut backwards = MicrobatchBackwards::new();
    each_schedule_span(&d.spans, &d.names, |i, role, step, slot| {
        let dur = d.spans.dur_ns[i];
        sched.add(role, step, dur, slot);
        match role {
            Role::Forward => forward.add(dur, 0, true, StepRole::Main),
            Role::Backward => add_backward(&mut backwards, step, slot, dur),
            _ => {}
        }
    })?;
    for dur in backwards.into_values() {
        backward.add(dur, 0, true, StepRole::Main);
    }
    Some(PipelineDigest {
        stages: sched.stages.into_iter().collect(),
        microbatches: sched.microbatches,
        forward,
        backward,
        steps: sched.steps.into_values().collect(),
    })
}
