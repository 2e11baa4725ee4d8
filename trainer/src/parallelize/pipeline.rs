//! Pipeline parallelism as torchtitan's `pipeline_llm` applies it: the model is cut into stages
//! ([`split_stages`], torchtitan's `_generate_llm_fqn_per_model_part` or the user's
//! `module_fqns_per_model_part`), stage `s` lives on pp rank `s % pp` (looped placement: one
//! stage per rank for single-stage schedules, several for interleaved ones), and a [`Schedule`]
//! orders each rank's forward and backward passes over the step's microbatches
//! ([`rank_actions`]). [`Pipeline::run`] executes that order: activations go to the next stage
//! and gradients to the previous one point to point over a group of the pp ranks, in batches
//! (torch's `batch_isend_irecv`; `ncclSend`/`ncclRecv` in one NCCL group) laid out on common
//! time steps as torch's multi-stage schedules lay them out ([`issued_steps`]); receives go into
//! buffers whose shapes are known ahead (no metadata round trip) and are waited for only by the
//! pass that reads them.
//!
//! [`simulate`] runs the orders as [`Pipeline::run`] issues their transfers, with sends that
//! wait for their receives (NCCL's, past its buffers): every schedule finishes, where sending
//! each tensor alone deadlocked 1F1B, Interleaved1F1B and InterleavedZeroBubble with two or
//! more microbatches (a rank sent an activation before it received a gradient while its peer
//! did the opposite; issue #34). [`Pipeline::new`] runs it for its own layout.
//!
//! The numerics are the one-process ones: every microbatch's loss is its summed cross entropy
//! over the step's global valid-token count, and each stage's gradients accumulate over the
//! microbatches in microbatch order (every schedule runs a stage's backward passes in that
//! order), as torchtitan's schedules with `scale_grads=False`.

use std::collections::HashMap;
use std::ops::Range;

use anyhow::{Context, Result, bail};
use tch::Tensor;

use titan_obs_core::PipelineSlot;
use titan_obs_core::vocab::titan;

use crate::distributed::{DeviceMesh, Group, P2pOp, Pending};
use crate::gpu_clock;
use crate::parallel::Dim;
use crate::parallelize::weight_grad::WeightGradStash;
use crate::parallelize::{ParallelModel, TokenLayout};

/// torchtitan's `parallelism.pipeline_parallel_schedule` names titan-train runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Every microbatch forward, then every backward.
    GPipe,
    /// `p - s` forwards to fill the pipeline, then one backward and one forward in turn.
    OneFOneB,
    /// Several stages per rank (looped), 1F1B over rounds of `pp` microbatches (Megatron's
    /// interleaved schedule, as torch's `ScheduleInterleaved1F1B` orders it).
    Interleaved1F1B,
    /// Interleaved1F1B with each backward split into an input-gradient pass, on the critical
    /// path, and a weight-gradient pass that fills the bubbles (the ZB1P schedule of the
    /// zero-bubble paper, as torch's `ScheduleInterleavedZeroBubble` orders it).
    InterleavedZeroBubble,
}

impl Schedule {
    pub const NAMES: [&'static str; 4] =
        ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"];

    pub fn parse(name: &str) -> Result<Self, String> {
        // torch's get_schedule_class matches case-insensitively.
        match name.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            "interleaved1f1b" => Ok(Schedule::Interleaved1F1B),
            "interleavedzerobubble" => Ok(Schedule::InterleavedZeroBubble),
            "loopedbfs" | "zbvzerobubble" | "dualpipev" => Err(format!(
                "schedule `{name}` is not implemented in titan-train; use one of {}",
                Self::NAMES.join(", ")
            )),
            _ => Err(format!(
                "unknown pipeline schedule `{name}`; titan-train runs {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "GPipe",
            Schedule::OneFOneB => "1F1B",
            Schedule::Interleaved1F1B => "Interleaved1F1B",
            Schedule::InterleavedZeroBubble => "InterleavedZeroBubble",
        }
    }

    /// Whether backward runs as separate input- and weight-gradient passes.
    pub fn splits_backward(self) -> bool {
        self == Schedule::InterleavedZeroBubble
    }

    /// Single-stage schedules hold one stage per rank; looped ones several.
    pub fn single_stage(self) -> bool {
        !matches!(
            self,
            Schedule::Interleaved1F1B | Schedule::InterleavedZeroBubble
        )
    }

    /// The bubble fraction of this schedule with equal stage times: (p-1)/(m+p-1) for one
    /// stage per rank, (p-1)/(v*m+p-1) with `v` stages per rank.
    pub fn ideal_bubble(self, pp: usize, microbatches: usize, stages_per_rank: usize) -> f64 {
        let (p, m, v) = (pp as f64, microbatches as f64, stages_per_rank as f64);
        (p - 1.0) / (v * m + p - 1.0)
    }
}

/// One contiguous piece of the model: a pipeline stage (torchtitan's model part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageModules {
    /// `tok_embeddings`.
    pub embeddings: bool,
    /// Transformer blocks by global index.
    pub layers: Range<usize>,
    /// `norm` and `lm_head` (and the loss).
    pub head: bool,
}

impl StageModules {
    /// The whole model as one stage.
    pub fn whole(n_layers: usize) -> Self {
        StageModules {
            embeddings: true,
            layers: 0..n_layers,
            head: true,
        }
    }
}

/// The pipeline settings torchtitan's `[parallelism]` holds.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub degree: usize,
    pub schedule: Schedule,
    pub microbatch_size: i64,
    pub layers_per_stage: Option<usize>,
    pub first_stage_less_layers: usize,
    pub last_stage_less_layers: usize,
    pub module_fqns_per_model_part: Option<Vec<Vec<String>>>,
}

/// How many stages the model is cut into: torchtitan's `_get_pipeline_metadata`.
pub fn num_stages(cfg: &PipelineConfig, n_layers: usize) -> Result<usize> {
    if let Some(parts) = &cfg.module_fqns_per_model_part {
        return Ok(parts.len());
    }
    let pp = cfg.degree;
    let Some(per_stage) = cfg.layers_per_stage else {
        return Ok(if cfg.schedule.single_stage() {
            pp
        } else {
            2 * pp
        });
    };
    if per_stage == 0 {
        bail!("parallelism.pipeline_parallel_layers_per_stage must be at least 1");
    }
    let total = n_layers + cfg.first_stage_less_layers + cfg.last_stage_less_layers;
    let stages = total.div_ceil(per_stage);
    let info = format!(
        "Model has {n_layers} layers with pipeline_parallel_layers_per_stage={per_stage}, \
         resulting in num_virtual_stages={stages} across {pp} PP ranks"
    );
    if !stages.is_multiple_of(pp) {
        bail!(
            "Number of virtual stages ({stages}) must be divisible by pipeline parallel size \
             ({pp}). {info}."
        );
    }
    let per_rank = stages / pp;
    if cfg.schedule.single_stage() && per_rank != 1 {
        bail!(
            "Single stage schedule requires exactly 1 stage per rank, but got {per_rank} stages \
             per rank. {info}."
        );
    }
    if !cfg.schedule.single_stage() && per_rank < 2 {
        bail!(
            "Multi-stage schedule requires at least 2 stages per rank, but got {per_rank} stages \
             per rank. {info}."
        );
    }
    Ok(stages)
}

/// The model's stages: `module_fqns_per_model_part` when given, else torchtitan's weighted even
/// split (`tok_embeddings` counts as `first_stage_less_layers` blocks, `norm` + `lm_head` as
/// `last_stage_less_layers`).
pub fn split_stages(cfg: &PipelineConfig, n_layers: usize) -> Result<Vec<StageModules>> {
    let stages = num_stages(cfg, n_layers)?;
    match &cfg.module_fqns_per_model_part {
        Some(parts) => parse_model_parts(parts, n_layers),
        None => generate_split(
            stages,
            n_layers,
            cfg.first_stage_less_layers,
            cfg.last_stage_less_layers,
        ),
    }
}

fn generate_split(
    stages: usize,
    n_layers: usize,
    input_weight: usize,
    output_weight: usize,
) -> Result<Vec<StageModules>> {
    if stages == 0 {
        bail!("Number of stages must be at least 1");
    }
    if stages == 1 {
        return Ok(vec![StageModules::whole(n_layers)]);
    }
    let effective = n_layers + input_weight + output_weight;
    if stages > effective {
        bail!("Number of stages ({stages}) cannot be greater than effective layers ({effective})");
    }
    let per_stage = effective / stages;
    let extra = effective % stages;
    if input_weight > per_stage {
        bail!(
            "parallelism.pipeline_parallel_first_stage_less_layers ({input_weight}) exceeds the \
             minimum layers per stage ({per_stage})"
        );
    }
    if output_weight > per_stage {
        bail!(
            "parallelism.pipeline_parallel_last_stage_less_layers ({output_weight}) exceeds the \
             minimum layers per stage ({per_stage})"
        );
    }
    let mut next = 0;
    let mut out = Vec::with_capacity(stages);
    for s in 0..stages {
        let mut count = per_stage + usize::from(s < extra);
        let (first, last) = (s == 0, s == stages - 1);
        if first {
            count -= input_weight;
        } else if last {
            count -= output_weight;
        }
        let end = (next + count).min(n_layers);
        out.push(StageModules {
            embeddings: first,
            layers: next..end,
            head: last,
        });
        next = end;
    }
    if next != n_layers {
        bail!("the stage split leaves layers {next}..{n_layers} in no stage");
    }
    Ok(out)
}

/// `module_fqns_per_model_part`: each part a list of `tok_embeddings`, `layers.N`, `norm`,
/// `lm_head` (or `output`), in model order, together covering the model once.
fn parse_model_parts(parts: &[Vec<String>], n_layers: usize) -> Result<Vec<StageModules>> {
    let key = "parallelism.module_fqns_per_model_part";
    let mut out = Vec::with_capacity(parts.len());
    let mut next_layer = 0usize;
    for (i, names) in parts.iter().enumerate() {
        let mut stage = StageModules {
            embeddings: false,
            layers: next_layer..next_layer,
            head: false,
        };
        let (mut norm, mut lm_head) = (false, false);
        for name in names {
            if stage.head {
                bail!("{key}: part {i}: `{name}` comes after the output layer");
            }
            match name.as_str() {
                "tok_embeddings" if i == 0 && stage.layers.is_empty() && !stage.embeddings => {
                    stage.embeddings = true
                }
                "tok_embeddings" => {
                    bail!("{key}: `tok_embeddings` must open the first part (found in part {i})")
                }
                "norm" if next_layer == n_layers => norm = true,
                "lm_head" | "output" if norm => lm_head = true,
                "norm" | "lm_head" | "output" => bail!(
                    "{key}: part {i}: `norm` and `lm_head` go together, after every layer, in \
                     the last part"
                ),
                other => {
                    let layer = other
                        .strip_prefix("layers.")
                        .and_then(|n| n.parse::<usize>().ok())
                        .with_context(|| {
                            format!(
                                "{key}: part {i}: unknown module `{other}` (expected \
                                 tok_embeddings, layers.N, norm, lm_head)"
                            )
                        })?;
                    if layer != next_layer || norm {
                        bail!(
                            "{key}: part {i}: `{other}` is out of order (expected layers.{next_layer})"
                        );
                    }
                    next_layer += 1;
                    stage.layers.end = next_layer;
                }
            }
            stage.head = norm && lm_head;
        }
        if norm && !lm_head {
            bail!("{key}: part {i}: `norm` without `lm_head`");
        }
        if !stage.embeddings && stage.layers.is_empty() && !stage.head {
            bail!("{key}: part {i} is empty");
        }
        out.push(stage);
    }
    if out.first().is_none_or(|s| !s.embeddings) || out.last().is_none_or(|s| !s.head) {
        bail!("{key}: the first part must hold tok_embeddings and the last norm and lm_head");
    }
    if next_layer != n_layers {
        bail!("{key}: layers {next_layer}..{n_layers} are in no part");
    }
    Ok(out)
}

/// A pass of one microbatch through one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    /// The whole backward.
    Backward,
    /// Zero-bubble: the input gradients (what the previous stage waits for).
    BackwardInput,
    /// Zero-bubble: the linears' weight gradients, after the same microbatch's input pass.
    BackwardWeight,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub pass: Pass,
    pub stage: usize,
    pub microbatch: usize,
}

/// The pp rank that holds `stage` (looped placement).
pub fn rank_of_stage(stage: usize, pp: usize) -> usize {
    stage % pp
}

/// The order in which pp rank `rank` runs its passes for `microbatches` microbatches over
/// `stages` stages, as torch's schedule of that name orders them.
pub fn rank_actions(
    schedule: Schedule,
    pp: usize,
    rank: usize,
    stages: usize,
    microbatches: usize,
) -> Vec<Action> {
    let m = microbatches;
    let act = |pass, stage, microbatch| Action {
        pass,
        stage,
        microbatch,
    };
    match schedule {
        Schedule::GPipe => {
            let s = rank;
            (0..m)
                .map(|mb| act(Pass::Forward, s, mb))
                .chain((0..m).map(|mb| act(Pass::Backward, s, mb)))
                .collect()
        }
        Schedule::OneFOneB => {
            let s = rank;
            let warmup = m.min(stages - s);
            let mut out: Vec<Action> = (0..warmup).map(|mb| act(Pass::Forward, s, mb)).collect();
            let (mut fwd, mut bwd) = (warmup, 0);
            while bwd < m {
                out.push(act(Pass::Backward, s, bwd));
                bwd += 1;
                if fwd < m {
                    out.push(act(Pass::Forward, s, fwd));
                    fwd += 1;
                }
            }
            out
        }
        Schedule::Interleaved1F1B | Schedule::InterleavedZeroBubble => {
            // torch's `_get_1f1b_rank_ops`: warmup forwards, then a forward and a backward per
            // op, then the backwards left. Zero bubble (`enable_zero_bubble`): one warmup
            // forward less per hop from the last rank, each backward an input pass, and from
            // the rank-th op on the weight pass of the oldest input pass; the remaining weight
            // passes last.
            let split = schedule.splits_backward();
            let local = stages / pp;
            let rounds = (m / pp).max(1);
            let per_round = m / rounds;
            let per_hop = if split { 1 } else { 2 };
            let warmup = ((local - 1) * per_round + per_hop * (pp - 1 - rank)).min(m * local);
            let total = m * local;
            let fwd_stage = |op: usize| ((op / per_round) % local) * pp + rank;
            let bwd_stage =
                |op: usize| (local - 1 - ((op - warmup) / per_round) % local) * pp + rank;
            let mut next_mb: HashMap<(Pass, usize), usize> = HashMap::new();
            let mut take = |pass: Pass, stage: usize| {
                let mb = next_mb.entry((pass, stage)).or_insert(0);
                *mb += 1;
                act(pass, stage, *mb - 1)
            };
            let mut out = Vec::with_capacity(3 * total);
            let mut input_ops = Vec::with_capacity(total);
            let mut weights_done = 0;
            for op in 0..total + warmup {
                if op < total {
                    out.push(take(Pass::Forward, fwd_stage(op)));
                }
                if op < warmup {
                    continue;
                }
                if !split {
                    out.push(take(Pass::Backward, bwd_stage(op)));
                    continue;
                }
                out.push(take(Pass::BackwardInput, bwd_stage(op)));
                input_ops.push(op);
                if op - warmup >= rank {
                    out.push(take(
                        Pass::BackwardWeight,
                        bwd_stage(input_ops[weights_done]),
                    ));
                    weights_done += 1;
                }
            }
            for &op in &input_ops[weights_done..] {
                out.push(take(Pass::BackwardWeight, bwd_stage(op)));
            }
            out
        }
    }
}

/// What a point-to-point transfer carries across a stage boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Carries {
    /// From stage `boundary` to `boundary + 1`.
    Activations,
    /// From stage `boundary + 1` back to `boundary`.
    Gradients,
}

/// One transfer across a stage boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Transfer {
    carries: Carries,
    /// The lower stage of the boundary.
    boundary: usize,
    microbatch: usize,
}

impl Transfer {
    /// The stages it goes from and to.
    fn stages(&self) -> (usize, usize) {
        match self.carries {
            Carries::Activations => (self.boundary, self.boundary + 1),
            Carries::Gradients => (self.boundary + 1, self.boundary),
        }
    }

    /// `microbatch 1's activations from stage 0 to stage 1`, for messages.
    fn describe(&self) -> String {
        let what = match self.carries {
            Carries::Activations => "activations",
            Carries::Gradients => "gradients",
        };
        let (from, to) = self.stages();
        format!(
            "microbatch {}'s {what} from stage {from} to stage {to}",
            self.microbatch
        )
    }
}

/// One step of a rank's pipeline run, in the order [`Pipeline::run`] issues them.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Compute(Action),
    /// Transfers issued together as one batch (torch's `batch_isend_irecv`): what the pass
    /// just before sends (a rank runs one pass a time step), and what the neighbours send this
    /// rank at the same time step.
    Exchange {
        send: Option<Transfer>,
        recvs: Vec<Transfer>,
    },
}

/// What an action receives before it runs and sends after: a forward reads activations from
/// the previous stage (unless it is stage 0) and sends its output to the next (unless it is
/// the last); an (input) backward reads its output's gradient (unless it is the last stage)
/// and sends its input's gradient back (unless it is stage 0); a weight pass neither.
fn transfers_of(a: Action, stages: usize) -> (Option<Transfer>, Option<Transfer>) {
    let last = stages - 1;
    let transfer = |carries, boundary| Transfer {
        carries,
        boundary,
        microbatch: a.microbatch,
    };
    match a.pass {
        Pass::Forward => (
            (a.stage > 0).then(|| transfer(Carries::Activations, a.stage - 1)),
            (a.stage < last).then(|| transfer(Carries::Activations, a.stage)),
        ),
        Pass::Backward | Pass::BackwardInput => (
            (a.stage < last).then(|| transfer(Carries::Gradients, a.stage)),
            (a.stage > 0).then(|| transfer(Carries::Gradients, a.stage - 1)),
        ),
        Pass::BackwardWeight => (None, None),
    }
}

/// Every rank's steps (rank r runs `orders[r]`; stage s lives on rank `s % orders.len()`), as
/// torch's multi-stage schedules batch their transfers: the ranks' orders are laid out on
/// common time steps (each rank runs its next action at the first step its input was sent
/// at an earlier one), and at each time step a rank issues one batch of what its action sends
/// and what its neighbours' actions send it. The two ends of every transfer are in batches of
/// the same time step, so no batch waits for one issued after it, on any rank: nothing
/// deadlocks when a send waits for its receive (NCCL's do once a tensor no longer fits its
/// buffers), and the k-th transfer between two ranks is the k-th on both ends (how NCCL
/// pairs them). A rank waits for a batch only before the pass that reads what it received.
/// Errors if the orders cannot all run (an action waits for a transfer never sent).
fn issued_steps(orders: &[Vec<Action>], stages: usize) -> Result<Vec<Vec<Step>>, String> {
    let ranks = orders.len();
    let mut next = vec![0usize; ranks];
    let mut sent = std::collections::HashSet::new();
    let mut steps: Vec<Vec<Step>> = vec![Vec::new(); ranks];
    while (0..ranks).any(|r| next[r] < orders[r].len()) {
        // (from rank, to rank, transfer) sent at this time step.
        let mut now = Vec::new();
        let mut waiting = Vec::new();
        let mut ran = false;
        for r in 0..ranks {
            let Some(&a) = orders[r].get(next[r]) else {
                continue;
            };
            let (recv, send) = transfers_of(a, stages);
            if let Some(t) = recv.filter(|t| !sent.contains(t)) {
                waiting.push(format!("rank {r} waits for {}", t.describe()));
                continue;
            }
            steps[r].push(Step::Compute(a));
            next[r] += 1;
            ran = true;
            if let Some(t) = send {
                let (from, to) = t.stages();
                now.push((rank_of_stage(from, ranks), rank_of_stage(to, ranks), t));
            }
        }
        if !ran {
            return Err(format!(
                "the orders cannot run: every rank waits for a transfer no rank sends first ({})",
                waiting.join("; ")
            ));
        }
        for (r, steps) in steps.iter_mut().enumerate() {
            let send = now.iter().find(|n| n.0 == r).map(|n| n.2);
            let recvs: Vec<Transfer> = now.iter().filter(|n| n.1 == r).map(|n| n.2).collect();
            if send.is_some() || !recvs.is_empty() {
                steps.push(Step::Exchange { send, recvs });
            }
        }
        sent.extend(now.iter().map(|n| n.2));
    }
    Ok(steps)
}

/// Checks that a schedule's per-rank orders run as [`Pipeline::run`] issues them
/// ([`issued_steps`]) when a send waits for its receive, as NCCL's do once a tensor no longer
/// fits its buffers (and the cpu backend's once it fills the socket's): each rank's batches
/// run one after another on its group's stream, a batch starts once the rank has issued it
/// and its previous batch has completed, and completes once the batches holding the other
/// ends of its transfers have started; a rank waits for a batch only before the pass that
/// reads what it received, and for its last batches at the step's end. Transfers pair as
/// NCCL pairs them: the k-th send from rank a to rank b with b's k-th receive from a (a pair
/// of different transfers is an error). Returns the makespan and each rank's busy time with
/// forward cost 1 and backward cost 2 (the classic bubble model; a split backward's input
/// and weight passes 1 each; transfers free).
pub fn simulate(
    schedule: Schedule,
    pp: usize,
    stages: usize,
    microbatches: usize,
) -> Result<(u64, Vec<u64>), String> {
    let orders: Vec<Vec<Action>> = (0..pp)
        .map(|r| rank_actions(schedule, pp, r, stages, microbatches))
        .collect();
    simulate_steps(&issued_steps(&orders, stages)?, stages)
}

/// One end of the transfers from one rank to another: what NCCL pairs transfers on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct End {
    from: usize,
    to: usize,
    send: bool,
}

impl End {
    fn other(self) -> End {
        End {
            send: !self.send,
            ..self
        }
    }

    fn verb(self) -> &'static str {
        if self.send { "send" } else { "receive" }
    }
}

/// A transfer as a rank issued it: which, and in which of that rank's batches.
#[derive(Debug, Clone, Copy)]
struct Posted {
    transfer: Transfer,
    rank: usize,
    batch: usize,
}

/// A transfer of a batch: its end and its place among that end's transfers.
#[derive(Debug, Clone, Copy)]
struct Place {
    end: End,
    k: usize,
    transfer: Transfer,
}

/// One batch as [`simulate_steps`] follows it.
#[derive(Default, Clone)]
struct SimBatch {
    /// When the rank issued it, when its stream started it, when it completed.
    issued: Option<u64>,
    started: Option<u64>,
    completed: Option<u64>,
}

/// [`simulate`] for given per-rank steps (rank r runs `steps[r]`, stage s lives on rank
/// `s % steps.len()`).
fn simulate_steps(steps: &[Vec<Step>], stages: usize) -> Result<(u64, Vec<u64>), String> {
    let ranks = steps.len();
    let rank_of = |stage: usize| rank_of_stage(stage, ranks);
    // Each rank's batches, in order, and the batch of each of its steps.
    let batches_of: Vec<Vec<usize>> = steps
        .iter()
        .map(|s| {
            s.iter()
                .enumerate()
                .filter(|(_, s)| matches!(s, Step::Exchange { .. }))
                .map(|(i, _)| i)
                .collect()
        })
        .collect();
    let mut batches: Vec<Vec<SimBatch>> = batches_of
        .iter()
        .map(|b| vec![SimBatch::default(); b.len()])
        .collect();
    // The transfers issued at each end, in order.
    let mut channel: HashMap<End, Vec<Posted>> = HashMap::new();
    // Per rank and batch: its transfers' places, once issued.
    let mut places: Vec<Vec<Vec<Place>>> = batches_of
        .iter()
        .map(|b| vec![Vec::new(); b.len()])
        .collect();
    // The batch each rank received each transfer in.
    let mut received_in: Vec<HashMap<Transfer, usize>> = vec![HashMap::new(); ranks];
    let (mut next, mut clock, mut busy) = (vec![0; ranks], vec![0u64; ranks], vec![0u64; ranks]);
    let mut issued_batches = vec![0usize; ranks];
    loop {
        let mut progressed = false;
        // The hosts: each runs its steps until a pass needs a batch not yet complete.
        for r in 0..ranks {
            while let Some(step) = steps[r].get(next[r]) {
                match step {
                    Step::Compute(a) => {
                        let (recv, _) = transfers_of(*a, stages);
                        if let Some(t) = recv {
                            let Some(&b) = received_in[r].get(&t) else {
                                return Err(format!(
                                    "rank {r} runs {a:?} before it receives {}",
                                    t.describe()
                                ));
                            };
                            match batches[r][b].completed {
                                Some(done) => clock[r] = clock[r].max(done),
                                None => break,
                            }
                        }
                        let cost = match a.pass {
                            Pass::Forward | Pass::BackwardInput | Pass::BackwardWeight => 1,
                            Pass::Backward => 2,
                        };
                        clock[r] += cost;
                        busy[r] += cost;
                    }
                    Step::Exchange { send, recvs } => {
                        let b = issued_batches[r];
                        issued_batches[r] += 1;
                        batches[r][b].issued = Some(clock[r]);
                        let ends = send
                            .iter()
                            .map(|t| (t, true))
                            .chain(recvs.iter().map(|t| (t, false)));
                        for (&transfer, send) in ends {
                            let (from, to) = transfer.stages();
                            let (from, to) = (rank_of(from), rank_of(to));
                            let end = End { from, to, send };
                            let v = channel.entry(end).or_default();
                            v.push(Posted {
                                transfer,
                                rank: r,
                                batch: b,
                            });
                            let k = v.len() - 1;
                            places[r][b].push(Place { end, k, transfer });
                            if !send {
                                received_in[r].insert(transfer, b);
                            }
                        }
                    }
                }
                next[r] += 1;
                progressed = true;
            }
        }
        // The streams: start and complete what can.
        for r in 0..ranks {
            for b in 0..batches[r].len() {
                let prev_done = if b == 0 {
                    Some(0)
                } else {
                    batches[r][b - 1].completed
                };
                let batch = &batches[r][b];
                if batch.started.is_none()
                    && let (Some(at), Some(prev)) = (batch.issued, prev_done)
                {
                    batches[r][b].started = Some(at.max(prev));
                    progressed = true;
                }
                let Some(started) = batches[r][b].started else {
                    break;
                };
                if batches[r][b].completed.is_some() {
                    continue;
                }
                let mut done = Some(started);
                for place in &places[r][b] {
                    let other = channel.get(&place.end.other()).and_then(|v| v.get(place.k));
                    let Some(theirs) = other else {
                        done = None;
                        continue;
                    };
                    if theirs.transfer != place.transfer {
                        return Err(format!(
                            "the schedule pairs the wrong transfers: rank {r} issues a {} of {} \
                             where rank {} has {}",
                            place.end.verb(),
                            place.transfer.describe(),
                            theirs.rank,
                            theirs.transfer.describe()
                        ));
                    }
                    done = match (done, batches[theirs.rank][theirs.batch].started) {
                        (Some(d), Some(s)) => Some(d.max(s)),
                        _ => None,
                    };
                }
                if let Some(d) = done {
                    batches[r][b].completed = Some(d);
                    progressed = true;
                }
            }
        }
        let finished = (0..ranks)
            .all(|r| next[r] == steps[r].len() && batches[r].iter().all(|b| b.completed.is_some()));
        if finished {
            for (end, v) in &channel {
                let other = channel.get(&end.other()).map_or(0, Vec::len);
                if end.send && v.len() != other {
                    return Err(format!(
                        "rank {} sends rank {} {} transfers but it receives {other}",
                        end.from,
                        end.to,
                        v.len()
                    ));
                }
            }
            // A rank's step ends once its last batches are done.
            let span = (0..ranks)
                .map(|r| {
                    let last = batches[r].iter().filter_map(|b| b.completed).max();
                    clock[r].max(last.unwrap_or(0))
                })
                .max()
                .unwrap_or(0);
            return Ok((span, busy));
        }
        if !progressed {
            let stuck: Vec<String> = (0..ranks)
                .filter_map(|r| {
                    let b = batches[r].iter().position(|b| b.completed.is_none())?;
                    let waiting = places[r][b].iter().find(|p| {
                        channel
                            .get(&p.end.other())
                            .and_then(|v| v.get(p.k))
                            .is_none_or(|theirs| {
                                batches[theirs.rank][theirs.batch].started.is_none()
                            })
                    })?;
                    Some(format!(
                        "rank {r} waits to {} {}",
                        waiting.end.verb(),
                        waiting.transfer.describe()
                    ))
                })
                .collect();
            return Err(format!("the schedule deadlocks: {}", stuck.join("; ")));
        }
    }
}

/// The pipeline of this rank: its stages, its steps in order, and the group its transfers
/// go over.
pub struct Pipeline {
    pub schedule: Schedule,
    pub stages: Vec<StageModules>,
    /// The stages this rank holds (ascending).
    pub local_stages: Vec<usize>,
    pub microbatches: usize,
    /// The training step's passes and transfers ([`issued_steps`] of the schedule's order).
    steps: Vec<Step>,
    /// The pp group's ranks, for the transfers alone (nothing else is ordered with them).
    p2p: Group,
    /// The group rank of the pp rank that holds each stage.
    peer_of_stage: Vec<usize>,
    pp: usize,
}

/// One microbatch's data, as every stage of the pipeline reads it.
pub struct Microbatch<'a> {
    pub inputs: &'a Tensor,
    pub labels: &'a Tensor,
    /// Its positions, documents (`None`: the model finds them on the device, with a read back
    /// where it needs them) and context-parallel mask.
    pub layout: TokenLayout<'a>,
}

/// A forward whose backward has not run yet.
struct InFlight {
    /// The received hidden states (an autograd leaf), or None on the first stage.
    input: Option<Tensor>,
    /// Hidden states sent on, or the loss on the last stage.
    output: Tensor,
    /// Zero-bubble schedules: where the input pass parks the linears' weight gradients.
    weight_grads: Option<WeightGradStash>,
}

impl Pipeline {
    /// The pipeline for this rank of `mesh`: connects the point-to-point groups of the stage
    /// boundaries it sits on (every rank of a pp group calls this with the same arguments).
    pub fn new(
        mesh: &DeviceMesh,
        cfg: &PipelineConfig,
        stages: Vec<StageModules>,
        microbatches: usize,
    ) -> Result<Self> {
        let pp = cfg.degree;
        let pp_members = mesh.mesh.group_members(&[Dim::Pp]);
        let my_pp = mesh.mesh.coord(Dim::Pp);
        if !stages.len().is_multiple_of(pp) {
            bail!(
                "parallelism.module_fqns_per_model_part: {} parts cannot be spread evenly over \
                 parallelism.pipeline_parallel_degree = {pp}",
                stages.len()
            );
        }
        let per_rank = stages.len() / pp;
        if cfg.schedule.single_stage() && per_rank != 1 {
            bail!(
                "schedule {} runs one stage per rank, but the model has {} stages for {pp} pp \
                 ranks",
                cfg.schedule.name(),
                stages.len()
            );
        }
        if !cfg.schedule.single_stage() && per_rank < 2 {
            bail!(
                "schedule {} needs at least 2 stages per rank; the model has {} stages for {pp} \
                 pp ranks",
                cfg.schedule.name(),
                stages.len()
            );
        }
        if !cfg.schedule.single_stage() && !microbatches.is_multiple_of((microbatches / pp).max(1))
        {
            bail!(
                "{} needs the number of microbatches ({microbatches}) to be a multiple of \
                 parallelism.pipeline_parallel_degree ({pp}) when it is larger",
                cfg.schedule.name()
            );
        }
        let local_stages: Vec<usize> = (0..stages.len())
            .filter(|&s| rank_of_stage(s, pp) == my_pp)
            .collect();
        let mut members = pp_members.clone();
        members.sort_unstable();
        let peer_of_stage = (0..stages.len())
            .map(|s| {
                let global = pp_members[rank_of_stage(s, pp)];
                members.iter().position(|&m| m == global).unwrap_or(0)
            })
            .collect();
        let p2p = mesh
            .new_group("pp_p2p", members)
            .context("connecting the pipeline's stages")?;
        let orders: Vec<Vec<Action>> = (0..pp)
            .map(|r| rank_actions(cfg.schedule, pp, r, stages.len(), microbatches))
            .collect();
        // Every rank of the pp group issues its transfers as this rank does: a schedule whose
        // transfers could pair wrongly or wait on each other stops here, not in a hang.
        let mut steps = issued_steps(&orders, stages.len())
            .and_then(|steps| simulate_steps(&steps, stages.len()).map(|_| steps))
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} with {} stages on {pp} pp ranks and {microbatches} microbatches cannot \
                     run: {e}",
                    cfg.schedule.name(),
                    stages.len()
                )
            })?;
        Ok(Pipeline {
            schedule: cfg.schedule,
            steps: steps.swap_remove(my_pp),
            stages,
            local_stages,
            microbatches,
            p2p,
            peer_of_stage,
            pp,
        })
    }

    /// Whether this rank holds the last stage (it computes the loss).
    pub fn has_last_stage(&self) -> bool {
        self.local_stages.contains(&(self.stages.len() - 1))
    }

    /// Runs one step's forward and backward passes over `microbatches` in the schedule's order
    /// and returns the sum of this rank's microbatch losses (each `summed CE / global_tokens`;
    /// 0 where this rank holds no last stage) as a 0-dim f64 tensor on the device, summed there
    /// in microbatch order: nothing is read back to the host (the loop reads it on steps that
    /// log). `global_tokens` is the step's valid-token count (a 0-dim tensor on the device, at
    /// least 1). Gradients accumulate into the parameters (FSDP's reductions are collected by
    /// the caller).
    pub fn run(
        &self,
        model: &ParallelModel,
        microbatches: &[Microbatch<'_>],
        global_tokens: &Tensor,
    ) -> Result<Tensor> {
        if microbatches.len() != self.microbatches {
            bail!(
                "the pipeline runs {} microbatches per step, got {}",
                self.microbatches,
                microbatches.len()
            );
        }
        let last = self.stages.len() - 1;
        let mut in_flight: HashMap<(usize, usize), InFlight> = HashMap::new();
        // Zero-bubble: weight gradients an input pass left for the weight pass.
        let mut parked: HashMap<(usize, usize), WeightGradStash> = HashMap::new();
        let mut transfers = Exchanges::new(self);
        let mut loss_sum = Tensor::zeros([], (tch::Kind::Double, global_tokens.device()));
        for step in &self.steps {
            let a = match step {
                Step::Exchange { send, recvs } => {
                    let buffer = |t: &Transfer| -> Result<(Transfer, Tensor)> {
                        let buf = match t.carries {
                            Carries::Activations => {
                                activation_buffer(model, &microbatches[t.microbatch])
                            }
                            // The gradient of what this stage's forward sent on.
                            Carries::Gradients => in_flight
                                .get(&(t.boundary, t.microbatch))
                                .context("the schedule receives a gradient before its forward")?
                                .output
                                .empty_like(),
                        };
                        Ok((*t, buf))
                    };
                    let recvs = recvs.iter().map(buffer).collect::<Result<Vec<_>>>()?;
                    transfers.exchange(*send, recvs)?;
                    continue;
                }
                Step::Compute(a) => *a,
            };
            let mb = &microbatches[a.microbatch];
            let slot = slot_of(a.stage, a.microbatch);
            match a.pass {
                Pass::Forward => {
                    let input = transfers
                        .take(a, self.stages.len())?
                        .map(|buf| buf.set_requires_grad(true));
                    let _span = gpu_clock::pipeline_span(titan::FORWARD, slot);
                    let weight_grads = self.schedule.splits_backward().then(WeightGradStash::new);
                    let output = catch(|| {
                        let x = input.as_ref().unwrap_or(mb.inputs);
                        let out = model.forward_stage(a.stage, x, mb.layout, weight_grads.as_ref());
                        if a.stage == last {
                            let ce = model.summed_cross_entropy(&out, mb.labels);
                            let tokens = global_tokens.to_kind(ce.kind());
                            ce / tokens
                        } else {
                            out
                        }
                    })
                    .with_context(|| format!("stage {} forward", a.stage))?;
                    if a.stage == last {
                        // Summed in f64 in microbatch order, as the loop's host sum was.
                        loss_sum += output.detach().to_kind(tch::Kind::Double);
                    } else {
                        transfers.hold(output.detach());
                    }
                    in_flight.insert(
                        (a.stage, a.microbatch),
                        InFlight {
                            input,
                            output,
                            weight_grads,
                        },
                    );
                }
                Pass::BackwardWeight => {
                    let _span = gpu_clock::pipeline_span(titan::BACKWARD_WEIGHT, slot);
                    parked
                        .remove(&(a.stage, a.microbatch))
                        .context("the schedule runs a weight pass before its input pass")?
                        .apply()
                        .with_context(|| format!("stage {} weight gradients", a.stage))?;
                }
                Pass::Backward | Pass::BackwardInput => {
                    let f = in_flight
                        .remove(&(a.stage, a.microbatch))
                        .context("the schedule runs a backward before its forward")?;
                    let output_grad = transfers.take(a, self.stages.len())?;
                    let name = match a.pass {
                        Pass::BackwardInput => titan::BACKWARD_INPUT,
                        _ => titan::BACKWARD,
                    };
                    let _span = gpu_clock::pipeline_span(name, slot);
                    let root = match output_grad {
                        None => f.output,
                        // d/d(out) of sum(out * grad) is exactly `grad`: backward from the
                        // stage's output with the next stage's input gradient.
                        Some(grad) => (&f.output * &grad).sum(f.output.kind()),
                    };
                    root.f_backward()
                        .map_err(|e| anyhow::anyhow!("stage {} backward: {e}", a.stage))?;
                    if let Some(input) = f.input {
                        transfers.hold(input.grad());
                    }
                    if let Some(stash) = f.weight_grads {
                        parked.insert((a.stage, a.microbatch), stash);
                    }
                }
            }
        }
        transfers.finish()?;
        Ok(loss_sum)
    }

    /// Forward passes only (validation; the caller disables autograd): every microbatch
    /// through this rank's stages in order, depth first. Returns the summed cross-entropy of
    /// this rank's last-stage outputs (0 where it holds no last stage), a 0-dim f64 tensor on
    /// the device that the caller reads once for the whole validation. Any number of
    /// microbatches of any size works: every rank sees the same batch, so receive shapes are
    /// known, and each pair of ranks issues its transfers in the same (microbatch) order.
    pub fn evaluate(
        &self,
        model: &ParallelModel,
        microbatches: &[Microbatch<'_>],
    ) -> Result<Tensor> {
        let last = self.stages.len() - 1;
        let device = microbatches
            .first()
            .map_or(tch::Device::Cpu, |mb| mb.inputs.device());
        let mut ce_sum = Tensor::zeros([], (tch::Kind::Double, device));
        let orders = validation_orders(self.pp, self.stages.len(), microbatches.len());
        let steps = issued_steps(&orders, self.stages.len()).map_err(|e| anyhow::anyhow!(e))?;
        let pp_rank = rank_of_stage(self.local_stages[0], self.pp);
        let mut transfers = Exchanges::new(self);
        for step in &steps[pp_rank] {
            let a = match step {
                Step::Exchange { send, recvs } => {
                    let recvs = recvs
                        .iter()
                        .map(|t| (*t, activation_buffer(model, &microbatches[t.microbatch])))
                        .collect();
                    transfers.exchange(*send, recvs)?;
                    continue;
                }
                Step::Compute(a) => *a,
            };
            let mb = &microbatches[a.microbatch];
            let input = transfers.take(a, self.stages.len())?;
            let _span =
                gpu_clock::pipeline_span(titan::EVAL_FORWARD, slot_of(a.stage, a.microbatch));
            let out = catch(|| {
                let x = input.as_ref().unwrap_or(mb.inputs);
                let out = model.forward_stage(a.stage, x, mb.layout, None);
                if a.stage == last {
                    model.summed_cross_entropy(&out, mb.labels)
                } else {
                    out
                }
            })
            .with_context(|| format!("stage {} forward", a.stage))?;
            if a.stage == last {
                ce_sum += out.to_kind(tch::Kind::Double);
            } else {
                transfers.hold(out);
            }
        }
        transfers.finish()?;
        Ok(ce_sum)
    }
}

/// Validation's order on each of `pp` ranks: every microbatch through the rank's stages in
/// turn, depth first.
fn validation_orders(pp: usize, stages: usize, microbatches: usize) -> Vec<Vec<Action>> {
    (0..pp)
        .map(|r| {
            (0..microbatches)
                .flat_map(|microbatch| {
                    (0..stages)
                        .filter(move |&s| rank_of_stage(s, pp) == r)
                        .map(move |stage| Action {
                            pass: Pass::Forward,
                            stage,
                            microbatch,
                        })
                })
                .collect()
        })
        .collect()
}

/// A buffer for a microbatch's hidden states as a stage receives them: its shape and dtype are
/// known on both ends (no metadata exchange).
fn activation_buffer(model: &ParallelModel, mb: &Microbatch<'_>) -> Tensor {
    let (rows, seq_len) = (mb.inputs.size()[0], mb.inputs.size()[1]);
    let (shape, kind) = model.hidden_shape(rows, seq_len);
    Tensor::empty(shape.as_slice(), (kind, mb.inputs.device()))
}

/// A pass's place in the schedule, as titan-obs tags it.
fn slot_of(stage: usize, microbatch: usize) -> PipelineSlot {
    // Schedules this long do not exist; saturate rather than wrap if one did.
    PipelineSlot {
        microbatch: microbatch.min(u16::MAX as usize) as u16,
        stage: stage.min(u16::MAX as usize) as u16,
    }
}

/// A batch that receives: what it receives into, and the tensor it sends (if it does), alive
/// until it is done.
struct Receiving {
    pending: Pending,
    recvs: Vec<(Transfer, Tensor)>,
    _sent: Option<Tensor>,
}

impl Receiving {
    /// Waits for it (the host on the cpu backend, the default stream on NCCL).
    fn wait(self) -> Result<Vec<(Transfer, Tensor)>> {
        let what: Vec<String> = self.recvs.iter().map(|(t, _)| t.describe()).collect();
        self.pending
            .wait()
            .with_context(|| format!("receiving {}", what.join(" and ")))?;
        Ok(self.recvs)
    }
}

/// The transfers of one run of the steps: the tensor the last pass left to send, the batches
/// still running, and what finished batches received.
struct Exchanges<'p> {
    pipeline: &'p Pipeline,
    held: Option<Tensor>,
    /// Batches that only send; their tensors stay alive until they are done.
    sending: Vec<(Pending, Tensor)>,
    /// Batches that receive, in issue order.
    receiving: std::collections::VecDeque<Receiving>,
    received: HashMap<Transfer, Tensor>,
}

impl<'p> Exchanges<'p> {
    fn new(pipeline: &'p Pipeline) -> Self {
        Exchanges {
            pipeline,
            held: None,
            sending: Vec::new(),
            receiving: Default::default(),
            received: HashMap::new(),
        }
    }

    /// The tensor the pass just computed, for the batch after it to send.
    fn hold(&mut self, t: Tensor) {
        self.held = Some(t);
    }

    /// What `a` reads from another stage (None for a pass that reads nothing): waits, on the
    /// host for the cpu backend and on the device for NCCL, for the batches up to the one
    /// that received it.
    fn take(&mut self, a: Action, stages: usize) -> Result<Option<Tensor>> {
        let Some(t) = transfers_of(a, stages).0 else {
            return Ok(None);
        };
        if !self.received.contains_key(&t) {
            let _wait =
                titan_obs_core::pipeline_span(titan::PIPELINE_RECV, slot_of(a.stage, a.microbatch));
            while !self.received.contains_key(&t) {
                let batch = self
                    .receiving
                    .pop_front()
                    .with_context(|| format!("{} was never received", t.describe()))?;
                self.received.extend(batch.wait()?);
            }
        }
        Ok(self.received.remove(&t))
    }

    /// Issues one batch: the held tensor for `send` (the pass just run made it) and `recvs`
    /// into their buffers. Nothing waits for it here.
    fn exchange(&mut self, send: Option<Transfer>, recvs: Vec<(Transfer, Tensor)>) -> Result<()> {
        let peers = &self.pipeline.peer_of_stage;
        let sent = match send {
            Some(t) => {
                let tensor = self
                    .held
                    .take()
                    .context("the pipeline sends before the pass that makes the tensor")?;
                Some((tensor, peers[t.stages().1]))
            }
            None => None,
        };
        let mut ops = Vec::with_capacity(1 + recvs.len());
        if let Some((tensor, peer)) = &sent {
            ops.push(P2pOp::Send {
                tensor,
                peer: *peer,
            });
        }
        for (t, buf) in &recvs {
            ops.push(P2pOp::Recv {
                tensor: buf,
                peer: peers[t.stages().0],
            });
        }
        // Sends that have finished free their tensors now, not at the step's end.
        let mut running = Vec::with_capacity(self.sending.len() + 1);
        for (mut pending, t) in self.sending.drain(..) {
            match pending.try_result() {
                Some(result) => result.context("sending to another pipeline stage")?,
                None => running.push((pending, t)),
            }
        }
        self.sending = running;
        let pending = self.pipeline.p2p.send_recv_async(&ops);
        drop(ops);
        let sent = sent.map(|(tensor, _)| tensor);
        match (recvs.is_empty(), sent) {
            (true, Some(tensor)) => self.sending.push((pending, tensor)),
            (true, None) => pending.wait().context("an empty pipeline batch")?,
            (false, _sent) => self.receiving.push_back(Receiving {
                pending,
                recvs,
                _sent,
            }),
        }
        Ok(())
    }

    /// Waits for the batches still running (the step's end).
    fn finish(self) -> Result<()> {
        let _wait = titan_obs_core::span(titan::PIPELINE_SEND);
        for batch in self.receiving {
            batch.wait()?;
        }
        for (pending, _) in self.sending {
            pending
                .wait()
                .context("sending to another pipeline stage")?;
        }
        Ok(())
    }
}

fn catch(f: impl FnOnce() -> Tensor) -> Result<Tensor> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .map_err(|panic| anyhow::anyhow!("{}", crate::autograd::panic_text(panic)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pp: usize, schedule: Schedule) -> PipelineConfig {
        PipelineConfig {
            degree: pp,
            schedule,
            microbatch_size: 1,
            layers_per_stage: None,
            first_stage_less_layers: 1,
            last_stage_less_layers: 1,
            module_fqns_per_model_part: None,
        }
    }

    fn layers(stages: &[StageModules]) -> Vec<Range<usize>> {
        stages.iter().map(|s| s.layers.clone()).collect()
    }

    #[test]
    fn split_follows_torchtitans_weighted_even_split() {
        // torchtitan 0.3.0 `_generate_llm_fqn_per_model_part(2, 6)`: [emb, 0, 1, 2], [3, 4, 5, norm, lm_head].
        let s = split_stages(&cfg(2, Schedule::OneFOneB), 6).unwrap();
        assert_eq!(layers(&s), vec![0..3, 3..6]);
        assert!(s[0].embeddings && !s[0].head && s[1].head && !s[1].embeddings);
        // 4 stages over 6 layers + 2 weights = 8 effective: 2 each.
        let s = split_stages(&cfg(4, Schedule::OneFOneB), 6).unwrap();
        assert_eq!(layers(&s), vec![0..1, 1..3, 3..5, 5..6]);
        // Interleaved on 2 ranks: 4 virtual stages.
        let s = split_stages(&cfg(2, Schedule::Interleaved1F1B), 6).unwrap();
        assert_eq!(s.len(), 4);
        // Uneven: 3 stages over 8 effective -> 3, 3, 2.
        let s = split_stages(&cfg(3, Schedule::GPipe), 6).unwrap();
        assert_eq!(layers(&s), vec![0..2, 2..5, 5..6]);
        let mut c = cfg(2, Schedule::OneFOneB);
        c.first_stage_less_layers = 0;
        c.last_stage_less_layers = 0;
        assert_eq!(layers(&split_stages(&c, 6).unwrap()), vec![0..3, 3..6]);
    }

    #[test]
    fn layers_per_stage_is_checked_as_torchtitan() {
        let mut c = cfg(2, Schedule::OneFOneB);
        c.layers_per_stage = Some(2);
        let e = num_stages(&c, 6).unwrap_err().to_string();
        assert!(e.contains("exactly 1 stage per rank"), "{e}");
        c.layers_per_stage = Some(4);
        assert_eq!(num_stages(&c, 6).unwrap(), 2);
        c.schedule = Schedule::Interleaved1F1B;
        c.layers_per_stage = Some(2);
        assert_eq!(num_stages(&c, 6).unwrap(), 4);
        c.layers_per_stage = Some(3);
        let e = num_stages(&c, 7).unwrap_err().to_string();
        assert!(e.contains("divisible by pipeline parallel size"), "{e}");
    }

    #[test]
    fn module_fqns_per_model_part_is_parsed_and_checked() {
        let parts = |v: &[&[&str]]| -> Option<Vec<Vec<String>>> {
            Some(
                v.iter()
                    .map(|p| p.iter().map(|s| s.to_string()).collect())
                    .collect(),
            )
        };
        let mut c = cfg(2, Schedule::OneFOneB);
        c.module_fqns_per_model_part = parts(&[
            &["tok_embeddings", "layers.0"],
            &["layers.1", "layers.2", "norm", "lm_head"],
        ]);
        let s = split_stages(&c, 3).unwrap();
        assert_eq!(layers(&s), vec![0..1, 1..3]);
        c.module_fqns_per_model_part = parts(&[&["tok_embeddings", "layers.1"], &["layers.0"]]);
        assert!(split_stages(&c, 2).is_err());
        c.module_fqns_per_model_part = parts(&[&["tok_embeddings", "layers.0"], &["attn"]]);
        let e = split_stages(&c, 1).unwrap_err().to_string();
        assert!(e.contains("unknown module `attn`"), "{e}");
        c.module_fqns_per_model_part = parts(&[&["tok_embeddings"], &["layers.0"]]);
        assert!(split_stages(&c, 1).is_err(), "no head");
    }

    /// Every schedule with the stages per rank the tests run it with.
    const SCHEDULES: [(Schedule, usize); 6] = [
        (Schedule::GPipe, 1),
        (Schedule::OneFOneB, 1),
        (Schedule::Interleaved1F1B, 2),
        (Schedule::Interleaved1F1B, 3),
        (Schedule::InterleavedZeroBubble, 2),
        (Schedule::InterleavedZeroBubble, 3),
    ];

    #[test]
    fn schedules_run_every_pass_once_in_microbatch_order() {
        for (schedule, per_rank) in SCHEDULES {
            let passes: &[Pass] = if schedule.splits_backward() {
                &[Pass::Forward, Pass::BackwardInput, Pass::BackwardWeight]
            } else {
                &[Pass::Forward, Pass::Backward]
            };
            for pp in 1..=4 {
                for m in [1, 2, 4, 8] {
                    if !schedule.single_stage() && m > pp && m % pp != 0 {
                        continue;
                    }
                    let stages = pp * per_rank;
                    let mut seen = std::collections::HashSet::new();
                    for r in 0..pp {
                        let acts = rank_actions(schedule, pp, r, stages, m);
                        let n = passes.len() * m * per_rank;
                        assert_eq!(acts.len(), n, "{schedule:?} pp{pp} m{m}");
                        for a in &acts {
                            assert_eq!(rank_of_stage(a.stage, pp), r);
                            assert!(seen.insert(*a), "{a:?} twice");
                        }
                        // Each stage's backwards run in microbatch order (gradients then
                        // accumulate as one process accumulates them).
                        for s in (0..stages).filter(|s| rank_of_stage(*s, pp) == r) {
                            for &pass in passes {
                                let mbs: Vec<usize> = acts
                                    .iter()
                                    .filter(|a| a.stage == s && a.pass == pass)
                                    .map(|a| a.microbatch)
                                    .collect();
                                assert_eq!(mbs, (0..m).collect::<Vec<_>>());
                            }
                        }
                    }
                    simulate(schedule, pp, stages, m)
                        .unwrap_or_else(|e| panic!("{schedule:?} pp{pp} m{m}: {e}"));
                }
            }
        }
    }

    #[test]
    fn simulated_bubbles_are_the_textbook_ones() {
        // Equal stages, F = 1 and B = 2: GPipe and 1F1B idle (p-1)/(m+p-1) of the makespan.
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for (pp, m) in [(2, 4), (4, 8), (4, 4)] {
                let (span, busy) = simulate(schedule, pp, pp, m).unwrap();
                let bubble = 1.0 - busy[0] as f64 / span as f64;
                let ideal = schedule.ideal_bubble(pp, m, 1);
                assert!(
                    (bubble - ideal).abs() < 1e-9,
                    "{schedule:?} {pp} {m}: {bubble} vs {ideal}"
                );
            }
        }
        // Interleaving shrinks it, and splitting the backward shrinks it further.
        let bubble = |schedule| {
            let (span, busy) = simulate(schedule, 4, 8, 8).unwrap();
            1.0 - busy[0] as f64 / span as f64
        };
        let interleaved = bubble(Schedule::Interleaved1F1B);
        assert!(interleaved < Schedule::OneFOneB.ideal_bubble(4, 8, 1));
        let zero_bubble = bubble(Schedule::InterleavedZeroBubble);
        assert!(zero_bubble < interleaved, "{zero_bubble} vs {interleaved}");
    }

    /// Per-rank orders written as `<stage><pass><microbatch>` (`0F1`: stage 0's forward of
    /// microbatch 1; passes F, B, I, W), as torch prints them.
    fn orders(ranks: &[&str]) -> Vec<Vec<Action>> {
        let action = |a: &str| {
            let at = a
                .find(|c: char| c.is_ascii_alphabetic())
                .expect("a pass letter");
            let pass = match &a[at..=at] {
                "F" => Pass::Forward,
                "B" => Pass::Backward,
                "I" => Pass::BackwardInput,
                "W" => Pass::BackwardWeight,
                other => panic!("no pass {other}"),
            };
            Action {
                pass,
                stage: a[..at].parse().unwrap(),
                microbatch: a[at + 1..].parse().unwrap(),
            }
        };
        ranks
            .iter()
            .map(|r| r.split_whitespace().map(action).collect())
            .collect()
    }

    /// Each transfer alone, right where its pass needs or makes it: a receive before the pass,
    /// a send after it (how titan issued them before issue #36).
    fn one_at_a_time(orders: &[Vec<Action>], stages: usize) -> Vec<Vec<Step>> {
        orders
            .iter()
            .map(|order| {
                let mut steps = Vec::new();
                for &a in order {
                    let (recv, send) = transfers_of(a, stages);
                    let alone = |t: Option<Transfer>, is_send: bool| {
                        t.map(|t| Step::Exchange {
                            send: is_send.then_some(t),
                            recvs: if is_send { vec![] } else { vec![t] },
                        })
                    };
                    steps.extend(alone(recv, false));
                    steps.push(Step::Compute(a));
                    steps.extend(alone(send, true));
                }
                steps
            })
            .collect()
    }

    /// 1F1B's order on 2 ranks, 2 microbatches, written out. Sent alone, rank 0's send of
    /// microbatch 1's activations waits for rank 1's receive, which rank 1 issues only after
    /// its send of microbatch 0's gradients, which waits for rank 0's receive, behind rank 0's
    /// send: a deadlock once the tensors no longer fit NCCL's buffers. Batched as the pipeline
    /// issues them, it finishes.
    #[test]
    fn a_send_that_waits_for_its_receive_deadlocks_unless_batched() {
        let one_f_one_b = orders(&["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]);
        let err = simulate_steps(&one_at_a_time(&one_f_one_b, 2), 2).unwrap_err();
        assert_eq!(
            err,
            "the schedule deadlocks: rank 0 waits to send microbatch 1's activations from stage \
             0 to stage 1; rank 1 waits to send microbatch 0's gradients from stage 1 to stage 0"
        );
        let steps = issued_steps(&one_f_one_b, 2).unwrap();
        simulate_steps(&steps, 2).unwrap();
        // Torch's time steps: rank 0 sends microbatch 1's activations at the step rank 1 runs
        // microbatch 0's forward, and receives microbatch 0's gradients at the next.
        let t = |carries, microbatch| Transfer {
            carries,
            boundary: 0,
            microbatch,
        };
        let (act, grad) = (Carries::Activations, Carries::Gradients);
        let exchange = |send: &[Transfer], recvs: &[Transfer]| Step::Exchange {
            send: send.first().copied(),
            recvs: recvs.to_vec(),
        };
        let [f0, f1, b0, b1] = one_f_one_b[0][..] else {
            panic!()
        };
        assert_eq!(
            steps[0],
            [
                Step::Compute(f0),
                exchange(&[t(act, 0)], &[]),
                Step::Compute(f1),
                exchange(&[t(act, 1)], &[]),
                exchange(&[], &[t(grad, 0)]),
                Step::Compute(b0),
                exchange(&[], &[t(grad, 1)]),
                Step::Compute(b1),
            ]
        );
        // GPipe's order finishes either way: each rank's receives come in the order its peer
        // sends.
        let gpipe = orders(&["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]);
        simulate_steps(&one_at_a_time(&gpipe, 2), 2).unwrap();
    }

    /// Transfers pair in issue order between two ranks, as NCCL pairs them: an order whose
    /// receives come in another microbatch order than the sends is refused, not run with the
    /// wrong tensors.
    #[test]
    fn transfers_pair_in_issue_order() {
        let one_f_one_b = orders(&["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]);
        let mut steps = issued_steps(&one_f_one_b, 2).unwrap();
        // Rank 1 runs its forwards in the other microbatch order, and receives microbatch 1's
        // activations where rank 0 sends microbatch 0's.
        for step in steps[1].iter_mut() {
            match step {
                Step::Exchange { recvs, .. } => {
                    for t in recvs
                        .iter_mut()
                        .filter(|t| t.carries == Carries::Activations)
                    {
                        t.microbatch = 1 - t.microbatch;
                    }
                }
                Step::Compute(a) if a.pass == Pass::Forward => a.microbatch = 1 - a.microbatch,
                Step::Compute(_) => {}
            }
        }
        let err = simulate_steps(&steps, 2).unwrap_err();
        assert!(err.contains("pairs the wrong transfers"), "{err}");
        // An order that waits for what no rank sends first cannot be laid out.
        let stuck = orders(&["0B0 0F0", "1F0 1B0"]);
        let err = issued_steps(&stuck, 2).unwrap_err();
        assert!(err.contains("every rank waits"), "{err}");
    }

    /// Every schedule titan runs finishes on every layout with sends that wait for their
    /// receives (NCCL past its buffers), as its steps are issued: training and validation
    /// (every microbatch through the rank's stages, depth first). Sent one at a time, every
    /// schedule but GPipe deadlocked past one microbatch (issue #34).
    #[test]
    fn every_schedule_finishes_when_sends_wait_for_their_receives() {
        for (schedule, per_rank) in SCHEDULES {
            for pp in 2..=4 {
                for m in [1, 2, 4, 8] {
                    if !schedule.single_stage() && m > pp && m % pp != 0 {
                        continue;
                    }
                    let stages = pp * per_rank;
                    simulate(schedule, pp, stages, m)
                        .unwrap_or_else(|e| panic!("{schedule:?} pp{pp} m{m}: {e}"));
                    let orders: Vec<Vec<Action>> = (0..pp)
                        .map(|r| rank_actions(schedule, pp, r, stages, m))
                        .collect();
                    let alone = simulate_steps(&one_at_a_time(&orders, stages), stages);
                    assert_eq!(
                        alone.is_err(),
                        schedule != Schedule::GPipe && m > 1,
                        "{schedule:?} pp{pp} m{m} one at a time: {alone:?}"
                    );
                    let validation = validation_orders(pp, stages, m);
                    let steps = issued_steps(&validation, stages).unwrap();
                    simulate_steps(&steps, stages)
                        .unwrap_or_else(|e| panic!("validation pp{pp} x{per_rank} m{m}: {e}"));
                }
            }
        }
    }

    #[test]
    fn zero_bubble_orders_are_torchs() {
        // torch 2.15's ScheduleInterleavedZeroBubble._calculate_single_rank_operations for 2
        // ranks, 4 stages, 4 microbatches (its None bubbles left out): `<stage><pass><mb>`.
        let torch = [
            "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 \
             0I2 0W2 0I3 0W3",
            "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 \
             3W3 1I3 1W2 1W3",
        ];
        for (rank, want) in torch.iter().enumerate() {
            let ours: Vec<String> = rank_actions(Schedule::InterleavedZeroBubble, 2, rank, 4, 4)
                .iter()
                .map(|a| {
                    let pass = match a.pass {
                        Pass::Forward => "F",
                        Pass::Backward => "B",
                        Pass::BackwardInput => "I",
                        Pass::BackwardWeight => "W",
                    };
                    format!("{}{pass}{}", a.stage, a.microbatch)
                })
                .collect();
            assert_eq!(ours.join(" "), *want, "rank {rank}");
        }
    }

    #[test]
    fn schedule_names_are_torchs() {
        assert_eq!(Schedule::parse("1F1B").unwrap(), Schedule::OneFOneB);
        assert_eq!(Schedule::parse("gpipe").unwrap(), Schedule::GPipe);
        assert_eq!(
            Schedule::parse("Interleaved1F1B").unwrap(),
            Schedule::Interleaved1F1B
        );
        assert_eq!(
            Schedule::parse("InterleavedZeroBubble").unwrap(),
            Schedule::InterleavedZeroBubble
        );
        assert!(
            Schedule::parse("ZBVZeroBubble")
                .unwrap_err()
                .contains("not implemented")
        );
        assert!(Schedule::parse("2F2B").unwrap_err().contains("unknown"));
    }
}
