//! Names with a meaning to the analysis, in one place: titan's phase and tag names and
//! torchtitan 0.3.0's spellings of the same things (its structured logger's record fields
//! and the phase/tag names its trainer, checkpointer and validator log).
//!
//! titan-obs never renames a phase: a torchtitan run shows `fwd_bwd`, a titan run
//! `forward_backward`. These constants are what the analysis looks names up by.

/// The top-level span around one training step (titan and torchtitan both call it `step`).
pub const STEP: &str = "step";

/// titan-train's phase and tag names.
pub mod titan {
    pub const DATA_LOADING: &str = "data_loading";
    /// A batch built on titan-train's background loader thread (`training.prefetch_batches`),
    /// overlapping the step; `data_loading` is then only the training thread's wait for it.
    pub const DATA_PREFETCH: &str = "data_prefetch";
    pub const FORWARD_BACKWARD: &str = "forward_backward";
    pub const MICROBATCH: &str = "microbatch";
    pub const FORWARD: &str = "forward";
    pub const BACKWARD: &str = "backward";
    pub const OPTIMIZER: &str = "optimizer";
    pub const CLIP: &str = "clip";
    pub const OPTIMIZER_STEP: &str = "optimizer_step";
    pub const LR: &str = "lr";
    pub const COLLECT_DIST_METRICS: &str = "collect_dist_metrics";
    /// Scalar, every step: the reads from a tensor to the host the trainer made in it (each
    /// a wait for the device on a GPU); `titan-obs summary` reports it per step (`host_syncs`),
    /// `metrics` leaves it out of its lines.
    pub const HOST_SYNCS: &str = "trainer/host_syncs";
    /// The scalar whose presence marks a step that logged its metrics.
    pub const LOSS: &str = "training/loss";
    /// Error record of a failure a rank reported to the job (a collective that failed, a
    /// peer that stopped answering), with the job's first failure when another rank's came
    /// first: `titan-obs summary` names it.
    pub const JOB_FAILURE: &str = "job_failure";
    /// Span and step tag of a garbage-collection pass.
    pub const GC: &str = "gc";
    /// Span and step tag of a checkpoint save.
    pub const CHECKPOINT: &str = "checkpoint";
    /// Span and step tag of a validation pass.
    pub const VALIDATION: &str = "validation";
    /// Activation checkpointing: a region's forward run again inside the backward pass.
    pub const RECOMPUTE: &str = "recompute";
    /// Context parallelism: attention's all-gather of every rank's keys and values (in
    /// forward and in a recompute), and the reduce-scatter of their gradients in backward.
    pub const CONTEXT_PARALLEL: &str = "context_parallel";
    /// Pipeline parallelism: a pass (`forward`/`backward`, with its microbatch and stage)
    /// waiting to receive its input from the neighbouring stage.
    pub const PIPELINE_RECV: &str = "pipeline_recv";
    /// Pipeline parallelism: the end of a step's schedule, waiting for the last sends.
    pub const PIPELINE_SEND: &str = "pipeline_send";
    /// Pipeline parallelism: a validation forward pass of one microbatch on one stage (not
    /// part of the training schedule's window).
    pub const EVAL_FORWARD: &str = "eval_forward";
    /// Zero-bubble pipeline schedules: a backward split into the input-gradient pass...
    pub const BACKWARD_INPUT: &str = "backward_input";
    /// ...and the weight-gradient pass that fills the bubbles.
    pub const BACKWARD_WEIGHT: &str = "backward_weight";
    /// The compute passes of a pipeline schedule; the rest of a rank's pipeline window
    /// (its `forward_backward` span) is the bubble.
    pub const PIPELINE_PASSES: [&str; 4] = [FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT];
    /// Every phase a pipeline schedule records per stage: under pipeline parallelism ranks run
    /// different stages by design, so these are compared per stage (the summary's pipeline
    /// section), not across ranks (stragglers).
    pub const PIPELINE_PHASES: [&str; 7] = [
        FORWARD,
        BACKWARD,
        BACKWARD_INPUT,
        BACKWARD_WEIGHT,
        PIPELINE_RECV,
        PIPELINE_SEND,
        EVAL_FORWARD,
    ];
}

/// The collectives titan-train records as spans (trainer/src/distributed), one per call on every rank
/// of the group, named like torch.distributed's functions. Each span holds one scalar named
/// [`collective::bytes_scalar`] of it: the bytes this rank passed in (obs/SCHEMA.md).
pub mod collective {
    pub const ALL_REDUCE: &str = "all_reduce";
    pub const REDUCE_SCATTER: &str = "reduce_scatter";
    pub const ALL_GATHER: &str = "all_gather";
    pub const BROADCAST: &str = "broadcast";
    /// torch.distributed's all-to-all with splits (expert parallelism's token exchange).
    pub const ALL_TO_ALL: &str = "all_to_all_single";
    /// A batch of point-to-point sends and receives (torch's `batch_isend_irecv`: the
    /// pipeline's transfers). Not in [`ALL`]: its ranks are the batch's peers, not a whole
    /// group, so it is not matched across ranks as a call (the pipeline section reads the
    /// waits for it from `pipeline_recv`).
    pub const SEND_RECV: &str = "batch_isend_irecv";
    pub const ALL: [&str; 5] = [
        ALL_REDUCE,
        REDUCE_SCATTER,
        ALL_GATHER,
        BROADCAST,
        ALL_TO_ALL,
    ];

    /// Prefix of the bytes scalars.
    pub const BYTES_PREFIX: &str = "comm/";
    pub const ALL_REDUCE_BYTES: &str = "comm/all_reduce_bytes";
    pub const REDUCE_SCATTER_BYTES: &str = "comm/reduce_scatter_bytes";
    pub const ALL_GATHER_BYTES: &str = "comm/all_gather_bytes";
    pub const BROADCAST_BYTES: &str = "comm/broadcast_bytes";
    pub const ALL_TO_ALL_BYTES: &str = "comm/all_to_all_single_bytes";
    /// The bytes a batch sends.
    pub const SEND_RECV_BYTES: &str = "comm/batch_isend_irecv_bytes";

    /// Whether a span name is one of the collectives.
    pub fn is_collective(name: &str) -> bool {
        ALL.contains(&name)
    }

    /// The scalar carrying a collective span's payload bytes.
    pub fn bytes_scalar(name: &str) -> Option<&'static str> {
        Some(match name {
            ALL_REDUCE => ALL_REDUCE_BYTES,
            REDUCE_SCATTER => REDUCE_SCATTER_BYTES,
            ALL_GATHER => ALL_GATHER_BYTES,
            BROADCAST => BROADCAST_BYTES,
            ALL_TO_ALL => ALL_TO_ALL_BYTES,
            SEND_RECV => SEND_RECV_BYTES,
            _ => return None,
        })
    }
}

/// Mixture-of-experts load: titan-train records, on the steps it logs, the tokens each rank's
/// router sent to each expert of each MoE layer since the previous logged step, one scalar per
/// (layer, expert) named `moe/layer/<L>/expert/<E>/tokens`, reduced by sum over ranks.
/// `titan-obs summary` turns them into its experts section, `metrics` into the per-step
/// imbalance (`moe/max_over_mean`). Under expert parallelism also which rank hosts which
/// experts, and a span around each layer's local experts (see [`moe::experts_span`]).
pub mod moe {
    pub const PREFIX: &str = "moe/layer/";
    /// The derived per-step column of `titan-obs metrics`: the largest expert's tokens over the
    /// mean expert's, the worst layer's.
    pub const MAX_OVER_MEAN: &str = "moe/max_over_mean";

    /// The names made at run time, by what they name.
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    enum Made {
        Tokens(usize, usize),
        Experts(usize),
        FirstExpert(usize),
        HeldLayer(usize, usize),
    }

    /// The recorder takes `'static` names: each is made once per process and kept (a model's
    /// layers x experts of them), and a name already made is found without formatting it
    /// again (the experts span is named on every MoE layer's forward).
    fn made(what: Made) -> &'static str {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static NAMES: OnceLock<Mutex<HashMap<Made, &'static str>>> = OnceLock::new();
        let mut names = NAMES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        names.entry(what).or_insert_with(|| {
            let name = match what {
                Made::Tokens(layer, expert) => format!("{PREFIX}{layer}/expert/{expert}/tokens"),
                Made::Experts(layer) => format!("{PREFIX}{layer}/experts"),
                Made::FirstExpert(rank) => format!("{EP_PREFIX}rank/{rank}/first_expert"),
                Made::HeldLayer(rank, layer) => format!("{EP_PREFIX}rank/{rank}/layer/{layer}"),
            };
            Box::leak(name.into_boxed_str())
        })
    }

    /// The scalar of `layer`'s `expert`.
    pub fn tokens_scalar(layer: usize, expert: usize) -> &'static str {
        made(Made::Tokens(layer, expert))
    }

    /// (layer, expert) of a name [`tokens_scalar`] made.
    pub fn parse(name: &str) -> Option<(u32, u32)> {
        let rest = name.strip_prefix(PREFIX)?.strip_suffix("/tokens")?;
        let (layer, expert) = rest.split_once("/expert/")?;
        Some((layer.parse().ok()?, expert.parse().ok()?))
    }

    /// Under expert parallelism: the span around the experts a rank hosts running over the
    /// tokens sent to them in `layer`'s forward, `moe/layer/<L>/experts`. The all-to-all that
    /// brings their outputs back follows it, so a rank late there because its experts had
    /// more tokens is late *from* this span in the waits analysis.
    pub fn experts_span(layer: usize) -> &'static str {
        made(Made::Experts(layer))
    }

    /// The layer of an [`experts_span`] name.
    pub fn parse_experts_span(name: &str) -> Option<u32> {
        name.strip_prefix(PREFIX)?
            .strip_suffix("/experts")?
            .parse()
            .ok()
    }

    /// Under expert parallelism, where the routed experts live: each rank records, on the
    /// steps it logs, the first routed expert it hosts (`moe/ep/rank/<R>/first_expert`) and
    /// how many it hosts ([`EXPERTS_PER_RANK`]): experts `[first, first + n)` of every MoE
    /// layer it holds ([`held_layer_scalar`]). Ranks that share an expert parallel index (its FSDP over `efsdp`, replicas)
    /// host the same experts.
    pub const EP_PREFIX: &str = "moe/ep/";
    pub const EXPERTS_PER_RANK: &str = "moe/ep/experts_per_rank";

    /// The first-expert scalar of `rank`.
    pub fn first_expert_scalar(rank: usize) -> &'static str {
        made(Made::FirstExpert(rank))
    }

    /// The rank of a [`first_expert_scalar`] name.
    pub fn parse_first_expert(name: &str) -> Option<u32> {
        name.strip_prefix(EP_PREFIX)?
            .strip_prefix("rank/")?
            .strip_suffix("/first_expert")?
            .parse()
            .ok()
    }

    /// Under expert parallelism with pipeline parallelism a rank holds only its stages' MoE
    /// layers: it also records, for each of them, `moe/ep/rank/<R>/layer/<L>` (1). A rank
    /// that recorded none of these (no pipeline parallelism, or a run from before them) hosts
    /// its experts in every MoE layer.
    pub fn held_layer_scalar(rank: usize, layer: usize) -> &'static str {
        made(Made::HeldLayer(rank, layer))
    }

    /// (rank, layer) of a [`held_layer_scalar`] name.
    pub fn parse_held_layer(name: &str) -> Option<(u32, u32)> {
        let (rank, layer) = name
            .strip_prefix(EP_PREFIX)?
            .strip_prefix("rank/")?
            .split_once("/layer/")?;
        Some((rank.parse().ok()?, layer.parse().ok()?))
    }

    /// The scalars titan-train records for these analyses, not metrics of their own (`titan-obs
    /// metrics` leaves them out).
    pub fn is_recorded_load(name: &str) -> bool {
        name.starts_with(PREFIX) || name.starts_with(EP_PREFIX)
    }
}

/// GPU time: on CUDA, titan-train also times its device work with CUDA events, as spans of
/// their own named `gpu:<phase>` (the GPU's twin of the host span of that phase) on a thread
/// of their own named `cuda:<device index>` (trainer/src/gpu_clock.rs). A host span covers
/// the host's call, which on a GPU returns once the work is enqueued; its twin covers the
/// device's stream from reaching the work to finishing it (waiting included).
pub mod gpu {
    /// Prefix of the twins' names.
    pub const PREFIX: &str = "gpu:";
    /// Prefix of the name of the thread that records them.
    pub const THREAD_PREFIX: &str = "cuda:";
    pub const FORWARD: &str = "gpu:forward";
    pub const BACKWARD: &str = "gpu:backward";
    pub const BACKWARD_INPUT: &str = "gpu:backward_input";
    pub const BACKWARD_WEIGHT: &str = "gpu:backward_weight";
    pub const EVAL_FORWARD: &str = "gpu:eval_forward";
    pub const OPTIMIZER: &str = "gpu:optimizer";
    pub const ALL_REDUCE: &str = "gpu:all_reduce";
    pub const REDUCE_SCATTER: &str = "gpu:reduce_scatter";
    pub const ALL_GATHER: &str = "gpu:all_gather";
    pub const BROADCAST: &str = "gpu:broadcast";

    /// The GPU twin of a host phase, for the phases that are timed on the GPU too.
    pub fn twin(host_phase: &str) -> Option<&'static str> {
        use super::{collective as c, titan as t};
        Some(match host_phase {
            t::FORWARD => FORWARD,
            t::BACKWARD => BACKWARD,
            t::BACKWARD_INPUT => BACKWARD_INPUT,
            t::BACKWARD_WEIGHT => BACKWARD_WEIGHT,
            t::EVAL_FORWARD => EVAL_FORWARD,
            t::OPTIMIZER => OPTIMIZER,
            c::ALL_REDUCE => ALL_REDUCE,
            c::REDUCE_SCATTER => REDUCE_SCATTER,
            c::ALL_GATHER => ALL_GATHER,
            c::BROADCAST => BROADCAST,
            _ => return None,
        })
    }
}

/// The clock a span's times come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    /// The host's monotonic clock around the call (what every span of torchtitan's logs and
    /// titan's host spans use).
    Host,
    /// CUDA events on the device's stream ([`gpu`]).
    Gpu,
}

impl Clock {
    /// The clock of spans named `name`.
    pub fn of(name: &str) -> Clock {
        if name.starts_with(gpu::PREFIX) {
            Clock::Gpu
        } else {
            Clock::Host
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Clock::Host => "host",
            Clock::Gpu => "gpu",
        }
    }
}

/// torchtitan 0.3.0: its structured logger (`torchtitan/observability/structured_logger/`)
/// and the names its trainer logs (`torchtitan/trainer.py`, `components/`).
pub mod torchtitan {
    /// Folder under the job's `dump_folder` holding one JSONL file per process.
    pub const STRUCTURED_LOGS_DIR: &str = "structured_logs";
    /// `{source}.global_rank_{rank}.{YYYYmmdd-HHMMSS}-{6 chars}.jsonl`: the part between
    /// the source and the rank.
    pub const FILE_RANK_MARKER: &str = ".global_rank_";
    pub const FILE_SUFFIX: &str = ".jsonl";
    /// The trainer's `source` (torchtitan/train.py).
    pub const SOURCE_TRAINING: &str = "training";

    /// `log_type` of `_start`/`_end`/`_error` records.
    pub const LOG_TYPE_EVENT: &str = "event";
    /// `log_type` of `log_trace_instant` and `log_trace_scalar` records.
    pub const LOG_TYPE_INSTANT: &str = "instant";
    /// `log_type_name` of a `log_trace_scalar` record (the scalar's name is `event_name`).
    pub const METRIC_VALUE: &str = "metric_value";
    pub const START_SUFFIX: &str = "_start";
    pub const END_SUFFIX: &str = "_end";
    pub const ERROR_SUFFIX: &str = "_error";

    // Phases of torchtitan/trainer.py (`step` is [`super::STEP`]).
    pub const FWD_BWD: &str = "fwd_bwd";
    pub const OPTIM: &str = "optim";
    pub const FETCHING_BATCH: &str = "fetching_batch";
    pub const POST_DATALOADING_PROCESS: &str = "post_dataloading_process";
    pub const COLLECT_DIST_METRICS: &str = "collect_dist_metrics";
    pub const TORCH_DISTRIBUTED_INIT: &str = "torch_distributed_init";
    pub const MODEL_PARALLELISM_INIT: &str = "model_parallelism_init";
    /// Span and step tag of components/checkpointer/dcp.py's save.
    pub const CHECKPOINT_SAVE: &str = "checkpoint_save";
    pub const CHECKPOINT_LOAD: &str = "checkpoint_load";
    /// Span and step tag of components/validate.py.
    pub const EVAL: &str = "eval";
    /// The step tag the structured logger documents for garbage-collection steps.
    pub const GC: &str = "gc";
    // Instants.
    pub const STRUCTURED_LOGGER_STARTED: &str = "structured_logger_started";
    pub const TRAINING_START: &str = "training_start";
    // Scalars.
    pub const LOCAL_VALID_TOKENS: &str = "local_valid_tokens";
    pub const GLOBAL_VALID_TOKENS: &str = "global_valid_tokens";

    /// The rank in a structured-log file name, e.g. 3 in
    /// `training.global_rank_3.20250101-120000-AB12CD.jsonl`.
    pub fn rank_of_file_name(name: &str) -> Option<u32> {
        let rest = name.strip_suffix(FILE_SUFFIX)?;
        let (_, after) = rest.split_once(FILE_RANK_MARKER)?;
        let digits = after.split('.').next()?;
        digits.parse().ok()
    }

    /// The rank in a name carrying `global_rank_<N>` anywhere (torchtitan's gantt names each
    /// process after its file, without the extension).
    pub fn rank_in_label(label: &str) -> Option<u32> {
        let (_, after) = label.split_once("global_rank_")?;
        let end = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        after[..end].parse().ok()
    }
}

/// `torch.distributed.pipelining`'s names in PyTorch profiler traces: its schedule runtime
/// (`Interleaved1F1B`, the zero-bubble schedules, ... as torchtitan runs them) wraps every action
/// in `record_function("PP:<action>")`, an action being `<stage><type><microbatch>`: `0F3` is
/// stage 0's forward of microbatch 3; `B` a full backward, `I` / `W` the input- and
/// weight-gradient halves of a split one; `RECV_F`, `SEND_B`, ... the communication.
pub mod torch_pipelining {
    use crate::schema::PipelineSlot;

    pub const ACTION_PREFIX: &str = "PP:";

    /// An action span's slot and computation type (`F`, `B`, `I`, `W`, `RECV_F`, ...).
    pub fn parse_action(name: &str) -> Option<(PipelineSlot, &str)> {
        let action = name.strip_prefix(ACTION_PREFIX)?;
        let stage_end = action.find(|c: char| !c.is_ascii_digit())?;
        let rest = &action[stage_end..];
        let type_end = rest.find(|c: char| c.is_ascii_digit())?;
        let slot = PipelineSlot {
            stage: action[..stage_end].parse().ok()?,
            microbatch: rest[type_end..].parse().ok()?,
        };
        Some((slot, &rest[..type_end]))
    }

    /// Whether an action's computation type is a compute pass (not communication).
    pub fn is_pass(computation: &str) -> bool {
        matches!(computation, "F" | "B" | "I" | "W")
    }
}

/// PyTorch profiler traces: the span `torch.profiler` records around each `prof.step()`,
/// named `ProfilerStep#<step>`; read as the phase [`PROFILER_STEP`] at that step.
pub const PROFILER_STEP_PREFIX: &str = "ProfilerStep#";
pub const PROFILER_STEP: &str = "ProfilerStep";

/// Whether span name `name` is the work of step tag `tag`: the span named like the tag, or
/// one of its sub-phases `<tag>_...`. titan-train tags a step `checkpoint` and records
/// `checkpoint_stage`/`checkpoint_save`; torchtitan tags and names both `checkpoint_save`.
pub(crate) fn is_tag_phase(name: &str, tag: &str) -> bool {
    name.strip_prefix(tag)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
}

#[cfg(test)]
mod tests {
    #[test]
    fn torch_pipelining_actions() {
        use super::torch_pipelining::{is_pass, parse_action};
        use crate::schema::PipelineSlot;
        let slot = |stage, microbatch| PipelineSlot { stage, microbatch };
        assert_eq!(parse_action("PP:0F3"), Some((slot(0, 3), "F")));
        assert_eq!(parse_action("PP:12W107"), Some((slot(12, 107), "W")));
        assert_eq!(parse_action("PP:1RECV_B5"), Some((slot(1, 5), "RECV_B")));
        assert!(is_pass("I") && !is_pass("RECV_B"));
        for not_one in ["PP:0RESHARD", "PP:F3", "forward", "PP:0F", "PP:99999999F1"] {
            assert_eq!(parse_action(not_one), None, "{not_one}");
        }
    }

    use super::torchtitan::*;

    #[test]
    fn ranks_from_names() {
        assert_eq!(
            rank_of_file_name("training.global_rank_3.20250101-120000-AB12CD.jsonl"),
            Some(3)
        );
        assert_eq!(rank_of_file_name("training.global_rank_x.jsonl"), None);
        assert_eq!(rank_of_file_name("other.jsonl"), None);
        assert_eq!(
            rank_in_label("training.global_rank_12.20250101-120000-AB12CD"),
            Some(12)
        );
        assert_eq!(rank_in_label("python"), None);
    }
}
