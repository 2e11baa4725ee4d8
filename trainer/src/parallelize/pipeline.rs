//! Pipeline parallelism as torchtitan's `pipeline_llm` applies it: the model is cut into stages
//! ([`split_stages`], torchtitan's `_generate_llm_fqn_per_model_part` or the user's
//! `module_fqns_per_model_part`), stage `s` lives on pp rank `s % pp` (looped placement: one
//! stage per rank for single-stage schedules, several for interleaved ones), and a [`Schedule`]
//! orders each rank's forward and backward passes over the step's microbatches
//! ([`rank_actions`]). [`Pipeline::run`] executes that order: activations go to the next stage
//! and gradients to the previous one point to point, each direction of each stage boundary on a
//! process group of its own, sends in the background (in issue order) and receives into buffers
//! whose shapes are known ahead (no metadata round trip).
//!
//! [`simulate`] runs the orders as [`Pipeline::run`] issues their transfers. On the `nccl`
//! backend a send can wait for its receive ([`Sends::Blocking`]); there 1F1B, Interleaved1F1B
//! and InterleavedZeroBubble deadlock with two or more microbatches (a rank sends an activation
//! before it receives a gradient while its peer does the opposite), GPipe does not (issue #34).
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

use crate::distributed::{CommError, DeviceMesh, Group, Pending};
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

/// How a rank's sends hold up what it issues after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sends {
    /// A send never holds up its rank: the `cpu` backend, where [`Pipeline::run`]'s sends run
    /// on background threads that the step waits for only at its end.
    Buffered,
    /// A send holds up everything its rank issues after it until the peer has issued the
    /// matching receive: the `nccl` backend, where every collective makes the rank's default
    /// stream wait for its completion (the next receive's stream waits for that stream), the
    /// background thread may launch a send before the main thread's next receive, and NCCL
    /// completes a send without its receiver only while it fits NCCL's buffers.
    Blocking,
}

/// What a point-to-point transfer carries across a stage boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Carries {
    /// From stage `boundary` to `boundary + 1`.
    Activations,
    /// From stage `boundary + 1` back to `boundary`.
    Gradients,
}

/// One direction of one stage boundary: a process group of its own, whose transfers pair up
/// in issue order (the k-th send with the k-th receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct P2pLink {
    carries: Carries,
    /// The lower stage of the boundary.
    boundary: usize,
}

/// One operation of a rank's step, in the order [`Pipeline::run`] issues them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Microbatch `.1`'s tensor, received right before the pass that reads it.
    Recv(P2pLink, usize),
    Compute(Action),
    /// Microbatch `.1`'s tensor, sent right after the pass that made it.
    Send(P2pLink, usize),
}

/// A rank's actions as [`Pipeline::run`] issues them: a forward receives its input from the
/// previous stage (unless it is stage 0) and sends its output on (unless it is the last); a
/// (input) backward receives its output's gradient (unless it is the last stage) and sends its
/// input's gradient back (unless it is stage 0); a weight pass only computes.
fn issued_ops(actions: &[Action], stages: usize) -> Vec<Op> {
    let last = stages - 1;
    let link = |carries, boundary| P2pLink { carries, boundary };
    let mut ops = Vec::with_capacity(3 * actions.len());
    for &a in actions {
        let (recv, send) = match a.pass {
            Pass::Forward => (
                (a.stage > 0).then(|| link(Carries::Activations, a.stage - 1)),
                (a.stage < last).then(|| link(Carries::Activations, a.stage)),
            ),
            Pass::Backward | Pass::BackwardInput => (
                (a.stage < last).then(|| link(Carries::Gradients, a.stage)),
                (a.stage > 0).then(|| link(Carries::Gradients, a.stage - 1)),
            ),
            Pass::BackwardWeight => (None, None),
        };
        ops.extend(recv.map(|l| Op::Recv(l, a.microbatch)));
        ops.push(Op::Compute(a));
        ops.extend(send.map(|l| Op::Send(l, a.microbatch)));
    }
    ops
}

/// `rank r waits to send microbatch 1's activations from stage 0 to stage 1`, for messages.
fn describe_wait(rank: usize, op: Op) -> String {
    let (verb, link, mb) = match op {
        Op::Send(l, mb) => ("send", l, mb),
        Op::Recv(l, mb) => ("receive", l, mb),
        Op::Compute(a) => return format!("rank {rank} at {a:?}"),
    };
    let (what, from, to) = match link.carries {
        Carries::Activations => ("activations", link.boundary, link.boundary + 1),
        Carries::Gradients => ("gradients", link.boundary + 1, link.boundary),
    };
    format!("rank {rank} waits to {verb} microbatch {mb}'s {what} from stage {from} to stage {to}")
}

/// Checks that a schedule's per-rank orders can run as [`Pipeline::run`] issues them:
/// whether every rank can finish when each receive blocks until its send was issued and, with
/// [`Sends::Blocking`], each send blocks until its receive was issued. Returns the makespan
/// and each rank's busy time with forward cost 1 and backward cost 2 (the classic bubble
/// model; a split backward's input and weight passes 1 each; transfers free).
pub fn simulate(
    schedule: Schedule,
    pp: usize,
    stages: usize,
    microbatches: usize,
    sends: Sends,
) -> Result<(u64, Vec<u64>), String> {
    let orders: Vec<Vec<Action>> = (0..pp)
        .map(|r| rank_actions(schedule, pp, r, stages, microbatches))
        .collect();
    simulate_orders(&orders, stages, sends)
}

/// [`simulate`] for given per-rank orders (rank r runs `orders[r]`).
fn simulate_orders(
    orders: &[Vec<Action>],
    stages: usize,
    sends: Sends,
) -> Result<(u64, Vec<u64>), String> {
    let ranks = orders.len();
    let ops: Vec<Vec<Op>> = orders.iter().map(|o| issued_ops(o, stages)).collect();
    // Each transfer's place on its link: the k-th send of a link pairs with its k-th receive.
    let places: Vec<Vec<usize>> = ops
        .iter()
        .map(|ops| {
            let mut count: HashMap<(P2pLink, bool), usize> = HashMap::new();
            ops.iter()
                .map(|op| match *op {
                    Op::Send(l, _) | Op::Recv(l, _) => {
                        let n = count.entry((l, matches!(op, Op::Send(..)))).or_insert(0);
                        *n += 1;
                        *n - 1
                    }
                    Op::Compute(_) => 0,
                })
                .collect()
        })
        .collect();
    // Per (link, is a send): when each of its transfers was issued, and for which microbatch.
    let mut issued: HashMap<(P2pLink, bool), Vec<(u64, usize)>> = HashMap::new();
    let mut next = vec![0usize; ranks];
    let mut clock = vec![0u64; ranks];
    let mut busy = vec![0u64; ranks];
    loop {
        let mut progressed = false;
        for r in 0..ranks {
            while let Some(&op) = ops[r].get(next[r]) {
                match op {
                    Op::Compute(a) => {
                        let cost = match a.pass {
                            Pass::Forward | Pass::BackwardInput | Pass::BackwardWeight => 1,
                            Pass::Backward => 2,
                        };
                        clock[r] += cost;
                        busy[r] += cost;
                    }
                    Op::Send(link, mb) | Op::Recv(link, mb) => {
                        let is_send = matches!(op, Op::Send(..));
                        let k = places[r][next[r]];
                        let mine = issued.entry((link, is_send)).or_default();
                        if mine.len() == k {
                            mine.push((clock[r], mb));
                        }
                        if !(is_send && sends == Sends::Buffered) {
                            // Wait for the other end of the pair to be issued.
                            let Some(&(at, theirs)) =
                                issued.get(&(link, !is_send)).and_then(|v| v.get(k))
                            else {
                                break;
                            };
                            if theirs != mb {
                                return Err(format!(
                                    "the schedule pairs the wrong microbatches: {} while the \
                                     other end is at microbatch {theirs}",
                                    describe_wait(r, op)
                                ));
                            }
                            clock[r] = clock[r].max(at);
                        }
                    }
                }
                next[r] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(&ops).all(|(n, o)| *n == o.len()) {
            // Every send was received (a send without its receive would hang the step's end).
            for ((link, is_send), v) in &issued {
                let other = issued.get(&(*link, !is_send)).map_or(0, Vec::len);
                if *is_send && v.len() != other {
                    return Err(format!(
                        "{} sends on {link:?} but {other} receives",
                        v.len()
                    ));
                }
            }
            return Ok((clock.into_iter().max().unwrap_or(0), busy));
        }
        if !progressed {
            let stuck: Vec<String> = (0..ranks)
                .filter_map(|r| ops[r].get(next[r]).map(|&op| describe_wait(r, op)))
                .collect();
            return Err(format!("the schedule deadlocks: {}", stuck.join("; ")));
        }
    }
}

/// One direction of one stage boundary: the ranks at both ends and the group between them.
struct Link {
    group: Group,
    /// Group rank of the sending end.
    root: usize,
}

/// The pipeline of this rank: its stages, its passes in order, and its links.
pub struct Pipeline {
    pub schedule: Schedule,
    pub stages: Vec<StageModules>,
    /// The stages this rank holds (ascending).
    pub local_stages: Vec<usize>,
    pub microbatches: usize,
    actions: Vec<Action>,
    /// Activations from stage `s` to `s + 1`, keyed by `s`.
    forward_links: HashMap<usize, Link>,
    /// Gradients from stage `s + 1` back to `s`, keyed by `s`.
    backward_links: HashMap<usize, Link>,
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
        let mut forward_links = HashMap::new();
        let mut backward_links = HashMap::new();
        // Every rank walks the boundaries in the same order, so the groups two ranks share are
        // created in the same order on both.
        for s in 0..stages.len() - 1 {
            let (from, to) = (rank_of_stage(s, pp), rank_of_stage(s + 1, pp));
            if from != my_pp && to != my_pp {
                continue;
            }
            let (a, b) = (pp_members[from], pp_members[to]);
            let members = if a < b { vec![a, b] } else { vec![b, a] };
            let pos = |r: usize| members.iter().position(|&m| m == r).unwrap_or(0);
            let group = mesh
                .new_group(&format!("pp_fwd{s}"), members.clone())
                .with_context(|| format!("connecting pipeline stages {s} -> {}", s + 1))?;
            forward_links.insert(
                s,
                Link {
                    group,
                    root: pos(a),
                },
            );
            let group = mesh
                .new_group(&format!("pp_bwd{s}"), members.clone())
                .with_context(|| format!("connecting pipeline stages {} -> {s}", s + 1))?;
            backward_links.insert(
                s,
                Link {
                    group,
                    root: pos(b),
                },
            );
        }
        let actions = rank_actions(cfg.schedule, pp, my_pp, stages.len(), microbatches);
        Ok(Pipeline {
            schedule: cfg.schedule,
            stages,
            local_stages,
            microbatches,
            actions,
            forward_links,
            backward_links,
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
        // Sends run in the background; their tensors stay alive until they are done.
        let mut sends: Vec<(Pending, Tensor)> = Vec::new();
        let mut loss_sum = Tensor::zeros([], (tch::Kind::Double, global_tokens.device()));
        for a in &self.actions {
            let mb = &microbatches[a.microbatch];
            // Schedules this long do not exist; saturate rather than wrap if one did.
            let slot = PipelineSlot {
                microbatch: a.microbatch.min(u16::MAX as usize) as u16,
                stage: a.stage.min(u16::MAX as usize) as u16,
            };
            let (rows, seq_len) = (mb.inputs.size()[0], mb.inputs.size()[1]);
            match a.pass {
                Pass::Forward => {
                    let input = if a.stage == 0 {
                        None
                    } else {
                        let _wait = titan_obs_core::pipeline_span(titan::PIPELINE_RECV, slot);
                        let (shape, kind) = model.hidden_shape(rows, seq_len);
                        let buf = Tensor::empty(shape.as_slice(), (kind, mb.inputs.device()));
                        self.receive(&self.forward_links, a.stage - 1, &buf)
                            .with_context(|| {
                                format!(
                                    "receiving microbatch {}'s activations for stage {}",
                                    a.microbatch, a.stage
                                )
                            })?;
                        Some(buf.set_requires_grad(true))
                    };
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
                        let sent = output.detach();
                        sends.push((self.send(&self.forward_links, a.stage, &sent), sent));
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
                    let output_grad = if a.stage == last {
                        None
                    } else {
                        let _wait = titan_obs_core::pipeline_span(titan::PIPELINE_RECV, slot);
                        let grad = f.output.empty_like();
                        self.receive(&self.backward_links, a.stage, &grad)
                            .with_context(|| {
                                format!(
                                    "receiving microbatch {}'s gradients for stage {}",
                                    a.microbatch, a.stage
                                )
                            })?;
                        Some(grad)
                    };
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
                    // Sends that have finished free their tensors now, not at the step's end.
                    let mut kept = Vec::with_capacity(sends.len());
                    for (mut pending, t) in sends.drain(..) {
                        match pending.try_result() {
                            Some(result) => result.context("sending to another pipeline stage")?,
                            None => kept.push((pending, t)),
                        }
                    }
                    sends = kept;
                    if let Some(input) = f.input {
                        let grad = input.grad();
                        sends.push((self.send(&self.backward_links, a.stage - 1, &grad), grad));
                    }
                    if let Some(stash) = f.weight_grads {
                        parked.insert((a.stage, a.microbatch), stash);
                    }
                }
            }
        }
        let _wait = titan_obs_core::span(titan::PIPELINE_SEND);
        for (pending, _) in sends {
            pending
                .wait()
                .context("sending to the next pipeline stage")?;
        }
        Ok(loss_sum)
    }

    /// Forward passes only (validation; the caller disables autograd): every microbatch
    /// through this rank's stages in order, depth first. Returns the summed cross-entropy of
    /// this rank's last-stage outputs (0 where it holds no last stage), a 0-dim f64 tensor on
    /// the device that the caller reads once for the whole validation. Any number of
    /// microbatches of any size works: every rank sees the same batch, so receive shapes are
    /// known, and each boundary's sends and receives run in the same (microbatch) order.
    pub fn evaluate(
        &self,
        model: &ParallelModel,
        microbatches: &[Microbatch<'_>],
    ) -> Result<Tensor> {
        let last = self.stages.len() - 1;
        let mut sends: Vec<(Pending, Tensor)> = Vec::new();
        let device = microbatches
            .first()
            .map_or(tch::Device::Cpu, |mb| mb.inputs.device());
        let mut ce_sum = Tensor::zeros([], (tch::Kind::Double, device));
        for (i, mb) in microbatches.iter().enumerate() {
            let (rows, seq_len) = (mb.inputs.size()[0], mb.inputs.size()[1]);
            for &stage in &self.local_stages {
                let slot = PipelineSlot {
                    microbatch: i.min(u16::MAX as usize) as u16,
                    stage: stage.min(u16::MAX as usize) as u16,
                };
                let input = if stage == 0 {
                    None
                } else {
                    let _wait = titan_obs_core::pipeline_span(titan::PIPELINE_RECV, slot);
                    let (shape, kind) = model.hidden_shape(rows, seq_len);
                    let buf = Tensor::empty(shape.as_slice(), (kind, mb.inputs.device()));
                    self.receive(&self.forward_links, stage - 1, &buf)
                        .with_context(|| {
                            format!("receiving microbatch {i}'s activations for stage {stage}")
                        })?;
                    Some(buf)
                };
                let _span = gpu_clock::pipeline_span(titan::EVAL_FORWARD, slot);
                let out = catch(|| {
                    let x = input.as_ref().unwrap_or(mb.inputs);
                    let out = model.forward_stage(stage, x, mb.layout, None);
                    if stage == last {
                        model.summed_cross_entropy(&out, mb.labels)
                    } else {
                        out
                    }
                })
                .with_context(|| format!("stage {stage} forward"))?;
                if stage == last {
                    ce_sum += out.to_kind(tch::Kind::Double);
                } else {
                    sends.push((self.send(&self.forward_links, stage, &out), out));
                }
            }
        }
        let _wait = titan_obs_core::span(titan::PIPELINE_SEND);
        for (pending, _) in sends {
            pending
                .wait()
                .context("sending to the next pipeline stage")?;
        }
        Ok(ce_sum)
    }

    fn send(&self, links: &HashMap<usize, Link>, boundary: usize, t: &Tensor) -> Pending {
        let link = &links[&boundary];
        link.group.broadcast_async(t, link.root)
    }

    fn receive(
        &self,
        links: &HashMap<usize, Link>,
        boundary: usize,
        t: &Tensor,
    ) -> Result<(), CommError> {
        let link = &links[&boundary];
        link.group.broadcast(t, link.root)
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
                    simulate(schedule, pp, stages, m, Sends::Buffered)
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
                let (span, busy) = simulate(schedule, pp, pp, m, Sends::Buffered).unwrap();
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
            let (span, busy) = simulate(schedule, 4, 8, 8, Sends::Buffered).unwrap();
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

    /// 1F1B's order on 2 ranks, 2 microbatches, written out: rank 0 sends microbatch 1's
    /// activations before it receives microbatch 0's gradients, and rank 1 sends those
    /// gradients before it receives microbatch 1's activations. It finishes only when a send
    /// does not wait for its receive.
    #[test]
    fn a_send_that_waits_for_its_receive_can_deadlock() {
        let one_f_one_b = orders(&["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]);
        simulate_orders(&one_f_one_b, 2, Sends::Buffered).unwrap();
        let err = simulate_orders(&one_f_one_b, 2, Sends::Blocking).unwrap_err();
        assert_eq!(
            err,
            "the schedule deadlocks: rank 0 waits to send microbatch 1's activations from stage \
             0 to stage 1; rank 1 waits to send microbatch 0's gradients from stage 1 to stage 0"
        );
        // GPipe's order on the same ranks finishes either way: each rank's receives come in
        // the order its peer sends.
        let gpipe = orders(&["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]);
        simulate_orders(&gpipe, 2, Sends::Blocking).unwrap();
    }

    /// Receives pair with sends in issue order on each link: an order whose receives come in
    /// another microbatch order than the sends is not run with the wrong tensors.
    #[test]
    fn transfers_pair_in_issue_order() {
        let swapped = orders(&["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"]);
        let err = simulate_orders(&swapped, 2, Sends::Buffered).unwrap_err();
        assert!(err.contains("pairs the wrong microbatches"), "{err}");
    }

    /// What titan's schedules do on the `nccl` backend, where a send can wait for its receive
    /// (issue #34): GPipe always finishes; 1F1B, Interleaved1F1B and InterleavedZeroBubble
    /// finish only with one microbatch: with two or more, a rank sends an activation before it
    /// receives a gradient while its peer does the opposite (see
    /// `a_send_that_waits_for_its_receive_can_deadlock`), and the step hangs once the tensors
    /// no longer fit NCCL's buffers. This records that finding; it changes when the runtime
    /// posts its transfers otherwise (torch batches each step's sends and receives).
    #[test]
    fn blocking_sends_deadlock_every_schedule_but_gpipe_past_one_microbatch() {
        for (schedule, per_rank) in SCHEDULES {
            for pp in 2..=4 {
                for m in [1, 2, 4, 8] {
                    if !schedule.single_stage() && m > pp && m % pp != 0 {
                        continue;
                    }
                    let got = simulate(schedule, pp, pp * per_rank, m, Sends::Blocking);
                    let deadlocks = schedule != Schedule::GPipe && m > 1;
                    match got {
                        Err(e) => assert!(
                            deadlocks && e.starts_with("the schedule deadlocks: "),
                            "{schedule:?} pp{pp} m{m}: {e}"
                        ),
                        Ok(_) => assert!(!deadlocks, "{schedule:?} pp{pp} m{m} finishes"),
                    }
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
