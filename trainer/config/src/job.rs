//! The job configuration: torchtitan's sections and key names, loaded from a TOML file plus
//! command-line overrides (`--section.key value` or `--section.key=value`).
//!
//! Every section struct has torchtitan's defaults and denies unknown keys. Loading checks each key
//! of the file and of the overrides against the defaults (so a typo names the key and the file),
//! converts override strings by the type of the key, and deserializes with the key path attached to
//! any type error. Every problem is a [`ConfigError`], which `titan-train` reports with exit code 2.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Where the readable copy of the default config lives in the repository.
pub const DEFAULT_CONFIG_FILE: &str = "configs/debug_model.toml";
/// The config used when `--job.config_file` is not given, from any working directory: the
/// debug model sized for a CPU (the same bytes as [`DEFAULT_CONFIG_FILE`]).
pub const DEFAULT_CONFIG: &str = include_str!("../../../configs/debug_model.toml");

/// torchtitan's dtype names (`float32`, `bfloat16`, `float16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeName {
    Float32,
    Bfloat16,
    Float16,
}

impl DtypeName {
    pub fn name(self) -> &'static str {
        match self {
            DtypeName::Float32 => "float32",
            DtypeName::Bfloat16 => "bfloat16",
            DtypeName::Float16 => "float16",
        }
    }
}

/// Which activations the forward pass keeps for backward (`[activation_checkpoint]`); what is not
/// kept is recomputed in the backward pass (titan-train's `recompute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationCheckpointing {
    /// Keep everything autograd saves.
    #[default]
    None,
    /// Keep only each transformer block's input; recompute the whole block (`mode = full`).
    Full,
    /// Recompute whole blocks number N, 2N, 3N, ... counting from 1, keep the others
    /// (`mode = selective`, `selective_ac_option = N`, as torchtitan's per-layer SAC counts).
    EveryNthLayer(u64),
    /// torchtitan's per-op rule (`mode = selective`, `selective_ac_option = op`): keep each
    /// block's input and the outputs of its 1st, 3rd, 5th, ... matmul (wq, wv, w1, w2); backward
    /// recomputes the block from its input, taking those kept outputs instead of multiplying
    /// again, and recomputes the other matmuls, attention and the elementwise ops.
    Op,
}

impl ActivationCheckpointing {
    /// Whether layer `index` (from 0) is recomputed whole.
    pub fn whole_layer(self, index: usize) -> bool {
        match self {
            ActivationCheckpointing::Full => true,
            ActivationCheckpointing::EveryNthLayer(n) => (index as u64 + 1).is_multiple_of(n),
            ActivationCheckpointing::None | ActivationCheckpointing::Op => false,
        }
    }
}

/// Which tokens attend to which (`model.attn_backend`, torchtitan's `attn_backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnBackend {
    /// torchtitan's default: causal within each packed document (its FlexAttention with the
    /// block-causal mask); here SDPA with the same mask.
    #[default]
    Flex,
    /// torchtitan's `varlen` backend: the same document-causal attention.
    Varlen,
    /// Plain causal attention across the whole sample, documents included (torchtitan 0.3.0 no
    /// longer offers it for language models; RoPE still uses document positions).
    Sdpa,
}

impl AttnBackend {
    /// Whether attention stops at document boundaries.
    pub fn document_causal(self) -> bool {
        matches!(self, AttnBackend::Flex | AttnBackend::Varlen)
    }
}

/// A float8 training recipe (`recipe_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Float8Recipe {
    Tensorwise,
    Rowwise,
    RowwiseWithGwHp,
}

impl Float8Recipe {
    pub fn name(self) -> &'static str {
        match self {
            Float8Recipe::Tensorwise => "tensorwise",
            Float8Recipe::Rowwise => "rowwise",
            Float8Recipe::RowwiseWithGwHp => "rowwise_with_gw_hp",
        }
    }
}

/// `lr_scheduler.decay_type`: how the learning rate falls during the decay phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayType {
    Linear,
    Sqrt,
    Cosine,
}

/// `training.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA when available, else CPU.
    Auto,
    Cpu,
    Cuda,
}

/// `comm.backend` (titan-train's own key: torchtitan picks NCCL for CUDA and gloo for CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommBackend {
    /// NCCL when training on CUDA, the CPU backend otherwise.
    Auto,
    /// NCCL (CUDA devices only; one GPU per rank).
    Nccl,
    /// The TCP ring on host memory, as gloo: CUDA tensors are staged through the host, and
    /// ranks on a node with fewer GPUs than ranks share them (`local_rank % GPUs`).
    Cpu,
}

/// `checkpoint.async_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AsyncModeName {
    Disabled,
    Async,
    /// Pinned staging buffers only matter for CUDA copies; host staging is the same path here.
    AsyncWithPinnedMem,
}

/// `optimizer.implementation`: torchtitan's kernels. `fused` (the default) runs torch's fused
/// AdamW kernel; `for-loop` and `foreach` run torch's sequence of tensor ops, which rounds the
/// same for both (and differently from the fused kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerImpl {
    #[serde(rename = "for-loop")]
    ForLoop,
    #[serde(rename = "foreach")]
    Foreach,
    #[serde(rename = "fused")]
    Fused,
}

/// `parallelism.fsdp_reshard_after_forward`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReshardAfterForward {
    Default,
    Always,
    Never,
}

/// `activation_checkpoint.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcMode {
    None,
    Selective,
    Full,
}

/// `activation_checkpoint.selective_ac_option`: `"op"`, or a layer interval N as a string (as
/// torchtitan's files write it) or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectiveAcOption {
    Op,
    EveryNthLayer(std::num::NonZeroU64),
}

impl Serialize for SelectiveAcOption {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SelectiveAcOption::Op => s.serialize_str("op"),
            SelectiveAcOption::EveryNthLayer(n) => s.serialize_str(&n.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for SelectiveAcOption {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(i64),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Text(t) => t,
            Raw::Number(n) => n.to_string(),
        };
        if text == "op" {
            return Ok(SelectiveAcOption::Op);
        }
        text.parse::<std::num::NonZeroU64>()
            .map(SelectiveAcOption::EveryNthLayer)
            .map_err(|_| {
                serde::de::Error::custom(format!(
                    "`{text}` is neither `op` nor a layer interval of 1 or more"
                ))
            })
    }
}

/// `parallelism.context_parallel_load_balancer`: how context parallelism orders the sequence
/// before each rank takes its contiguous part (torchtitan's `headtail`, `ptrr`, or `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpLoadBalancer {
    /// The sequence in 2 x cp chunks; rank i holds chunks i and 2 cp - 1 - i (causal work
    /// evens out).
    #[default]
    HeadTail,
    /// Processing-time round-robin over the attention mask's 128-token blocks (document masks).
    Ptrr,
    /// Rank i holds the i-th contiguous part.
    None,
}

impl CpLoadBalancer {
    pub fn name(self) -> &'static str {
        match self {
            CpLoadBalancer::HeadTail => "headtail",
            CpLoadBalancer::Ptrr => "ptrr",
            CpLoadBalancer::None => "None",
        }
    }
}

impl Serialize for CpLoadBalancer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for CpLoadBalancer {
    /// torchtitan's spellings and messages (`ParallelismConfig.__post_init__`, `cp_shard`).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        match text.as_deref() {
            Some("headtail") => Ok(CpLoadBalancer::HeadTail),
            Some("ptrr") => Ok(CpLoadBalancer::Ptrr),
            None | Some("None") | Some("none") => Ok(CpLoadBalancer::None),
            Some("") => Err(serde::de::Error::custom(
                "context_parallel_load_balancer cannot be an empty string. Use None to disable \
                 load balancing.",
            )),
            Some(other) => Err(serde::de::Error::custom(format!(
                "Invalid load_balancer_type '{other}'. Must be one of: 'headtail', 'ptrr', or None"
            ))),
        }
    }
}

/// The token block FlexAttention's block masks (and the `ptrr` load balancer) work in.
pub const CP_MASK_BLOCK: i64 = 128;

/// torchtitan's `-1` for "unset" in count keys, read as `None`; `Some(n)` otherwise.
mod minus_one_is_none {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<i64>::deserialize(d)? {
            None | Some(-1) => Ok(None),
            Some(n) if n >= 0 => Ok(Some(n as u64)),
            Some(n) => Err(D::Error::custom(format!(
                "{n} is neither -1 (unset) nor a count of 0 or more"
            ))),
        }
    }

    /// Unset is written as torchtitan's -1, so a resolved config reads back in torchtitan.
    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_i64(*n as i64),
            None => s.serialize_i64(-1),
        }
    }
}

/// A usage or configuration error: the user must change the command line or the config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("unknown config key `{key}` (from {origin}); known keys in [{section}]: {known}")]
    UnknownKey {
        key: String,
        origin: String,
        section: String,
        known: String,
    },
    #[error("unknown config section [{section}] (from {origin}); known sections: {known}")]
    UnknownSection {
        section: String,
        origin: String,
        known: String,
    },
    #[error("config key `{key}` (from {origin}): {message}")]
    BadValue {
        key: String,
        origin: String,
        message: String,
    },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error(
        "config key `{key}` = {value} is not supported by titan-train{note}; only its default {default} is accepted"
    )]
    Unsupported {
        key: String,
        value: String,
        default: String,
        note: String,
    },
    #[error("{0}")]
    Usage(String),
}

impl ConfigError {
    /// `key`'s value cannot work with the rest of the job, for `message`'s reason (what a check
    /// after parsing finds: a degree that does not split the model, a batch that does not
    /// divide).
    pub fn invalid(key: &str, message: impl std::fmt::Display) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.to_string(),
        }
    }
}

/// `[job]`: what the run is and where its outputs go.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Job {
    pub config_file: Option<String>,
    /// Every output of the run (checkpoints, observability records) goes under this folder.
    pub dump_folder: String,
    pub description: String,
    /// Log the resolved config at startup.
    pub print_config: bool,
}

impl Default for Job {
    fn default() -> Self {
        Self {
            config_file: None,
            dump_folder: "./outputs".into(),
            description: "default job".into(),
            print_config: false,
        }
    }
}

/// The `[model] name`s (torchtitan's `--module`s) titan-train trains.
pub const MODEL_NAMES: &[&str] = &["llama3", "qwen3", "deepseek_v3"];

/// `[model]`: which model and tokenizer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub flavor: String,
    /// Folder holding `tokenizer.json` (and optionally `tokenizer_config.json`); empty means the
    /// tokenizer embedded in titan-train.
    pub hf_assets_path: String,
    pub converters: Vec<String>,
    pub print_after_conversion: bool,
    /// torchtitan's `attn_backend`: `flex` and `varlen` attend causally within each packed
    /// document (torchtitan 0.3.0's only choices for language models); `sdpa` is plain causal
    /// attention across documents.
    pub attn_backend: AttnBackend,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            name: "llama3".into(),
            flavor: "debugmodel".into(),
            hf_assets_path: String::new(),
            converters: Vec::new(),
            print_after_conversion: false,
            attn_backend: AttnBackend::default(),
        }
    }
}

/// `[optimizer]`: AdamW hyper-parameters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Optimizer {
    pub name: String,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub implementation: OptimizerImpl,
    pub early_step_in_backward: bool,
}

impl Default for Optimizer {
    fn default() -> Self {
        Self {
            name: "AdamW".into(),
            lr: 8e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            implementation: OptimizerImpl::Fused,
            early_step_in_backward: false,
        }
    }
}

/// `[lr_scheduler]`: warmup, stable and decay phases.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LrScheduler {
    pub warmup_steps: u64,
    /// The schedule's length; unset (-1): `training.steps` (torchtitan 0.3.0's key). Keeping it
    /// fixed keeps the schedule when a resumed run trains longer.
    #[serde(with = "minus_one_is_none")]
    pub total_steps: Option<u64>,
    /// Fraction of the steps spent decaying; unset means every step after warmup decays.
    pub decay_ratio: Option<f64>,
    pub decay_type: DecayType,
    pub min_lr_factor: f64,
}

impl Default for LrScheduler {
    fn default() -> Self {
        Self {
            warmup_steps: 200,
            total_steps: None,
            decay_ratio: None,
            decay_type: DecayType::Linear,
            min_lr_factor: 0.0,
        }
    }
}

/// `[training]`: data, batch, steps.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Training {
    /// `default` (embedded) or a name for the files at `dataset_path`.
    pub dataset: String,
    /// A `.txt`, `.jsonl` or `.parquet` file, or a folder of them.
    pub dataset_path: Option<String>,
    pub local_batch_size: i64,
    /// Samples per optimizer step across all data-parallel ranks; unset (-1) means
    /// local_batch_size * dp degree (no gradient accumulation).
    #[serde(with = "minus_one_is_none")]
    pub global_batch_size: Option<u64>,
    pub seq_len: i64,
    /// Batches read, tokenized and packed ahead of the step on a background thread, so the
    /// training thread (and on a GPU, the kernels it queues) does not wait for them; 0 loads
    /// each batch on the training thread when the step asks for it. The batches are the same.
    pub prefetch_batches: u64,
    pub max_norm: f64,
    pub steps: u64,
    pub enable_cpu_offload: bool,
    /// torchtitan's `training.dtype`: `bfloat16` trains bf16 parameters, gradients and AdamW state
    /// (no fp32 master copy; RoPE and the logits stay fp32), as torchtitan 0.3.0 allows with
    /// any parallelism.
    pub dtype: DtypeName,
    /// With `dtype = float32`: the forward runs under autocast to this dtype (fp32 master
    /// weights); `float32` turns mixed precision off.
    pub mixed_precision_param: DtypeName,
    /// Gradient reductions across ranks (float32, the only value torchtitan 0.3.0 accepts).
    pub mixed_precision_reduce: DtypeName,
    pub gc_freq: u64,
    pub gc_debug: bool,
    pub device: DeviceChoice,
}

impl Default for Training {
    fn default() -> Self {
        Self {
            dataset: "default".into(),
            dataset_path: None,
            local_batch_size: 8,
            global_batch_size: None,
            seq_len: 2048,
            prefetch_batches: 2,
            max_norm: 1.0,
            steps: 10000,
            enable_cpu_offload: false,
            dtype: DtypeName::Float32,
            mixed_precision_param: DtypeName::Bfloat16,
            mixed_precision_reduce: DtypeName::Float32,
            gc_freq: 50,
            gc_debug: false,
            device: DeviceChoice::Auto,
        }
    }
}

/// `[parallelism]`: degrees of each parallelism dimension.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Parallelism {
    pub data_parallel_replicate_degree: i64,
    /// Unset (-1) means "the ranks left over by the other degrees".
    #[serde(with = "minus_one_is_none")]
    pub data_parallel_shard_degree: Option<u64>,
    pub fsdp_reshard_after_forward: ReshardAfterForward,
    pub tensor_parallel_degree: i64,
    /// Tensor parallelism splits the activations between blocks along the sequence (and the
    /// norms run on sequence blocks), as torchtitan's default.
    pub enable_sequence_parallel: bool,
    /// Ranks the sequence is split over (attention gathers every rank's keys and values).
    pub context_parallel_degree: i64,
    pub context_parallel_load_balancer: CpLoadBalancer,
    pub pipeline_parallel_degree: i64,
    /// torch's schedule name (`GPipe`, `1F1B`, `Interleaved1F1B`).
    pub pipeline_parallel_schedule: String,
    /// A schedule read from a CSV file (not implemented: refused when set).
    pub pipeline_parallel_schedule_csv: String,
    /// Samples per pipeline microbatch: `local_batch_size / this` microbatches per step.
    pub pipeline_parallel_microbatch_size: i64,
    /// Blocks per (virtual) stage; unset: one stage per rank (two for looped schedules).
    pub pipeline_parallel_layers_per_stage: Option<u64>,
    /// How many blocks `tok_embeddings` counts as in the even split of the first stage.
    pub pipeline_parallel_first_stage_less_layers: u64,
    /// How many blocks `norm` + `lm_head` count as in the last stage.
    pub pipeline_parallel_last_stage_less_layers: u64,
    /// The modules of each stage by name (`tok_embeddings`, `layers.N`, `norm`, `lm_head`).
    pub module_fqns_per_model_part: Option<Vec<Vec<String>>>,
    /// Routed experts split over this many ranks, borrowed from `dp_shard x cp x tp`; tokens
    /// travel to their experts' ranks by all-to-all (MoE models).
    pub expert_parallel_degree: i64,
    pub enable_compiled_autograd: bool,
    pub disable_loss_parallel: bool,
}

impl Default for Parallelism {
    fn default() -> Self {
        Self {
            data_parallel_replicate_degree: 1,
            data_parallel_shard_degree: None,
            fsdp_reshard_after_forward: ReshardAfterForward::Default,
            tensor_parallel_degree: 1,
            enable_sequence_parallel: true,
            context_parallel_degree: 1,
            context_parallel_load_balancer: CpLoadBalancer::HeadTail,
            pipeline_parallel_degree: 1,
            pipeline_parallel_schedule: "1F1B".into(),
            pipeline_parallel_schedule_csv: String::new(),
            pipeline_parallel_microbatch_size: 1,
            pipeline_parallel_layers_per_stage: None,
            pipeline_parallel_first_stage_less_layers: 1,
            pipeline_parallel_last_stage_less_layers: 1,
            module_fqns_per_model_part: None,
            expert_parallel_degree: 1,
            enable_compiled_autograd: false,
            disable_loss_parallel: false,
        }
    }
}

/// `[checkpoint]`: saving and loading (DCP).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Checkpoint {
    pub enable: bool,
    /// Relative to `job.dump_folder`.
    pub folder: String,
    pub interval: u64,
    pub initial_load_path: Option<String>,
    pub initial_load_model_only: bool,
    pub initial_load_in_hf: bool,
    pub last_save_model_only: bool,
    pub last_save_in_hf: bool,
    pub export_dtype: DtypeName,
    pub async_mode: AsyncModeName,
    /// 0 keeps every checkpoint.
    pub keep_latest_k: u64,
    /// Unset (-1) loads the latest step.
    #[serde(with = "minus_one_is_none")]
    pub load_step: Option<u64>,
    pub exclude_from_loading: Vec<String>,
    pub enable_first_step_checkpoint: bool,
    pub create_seed_checkpoint: bool,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            enable: false,
            folder: "checkpoint".into(),
            interval: 500,
            initial_load_path: None,
            initial_load_model_only: true,
            initial_load_in_hf: false,
            last_save_model_only: true,
            last_save_in_hf: false,
            export_dtype: DtypeName::Float32,
            async_mode: AsyncModeName::Disabled,
            keep_latest_k: 10,
            load_step: None,
            exclude_from_loading: Vec::new(),
            enable_first_step_checkpoint: false,
            create_seed_checkpoint: false,
        }
    }
}

/// `[metrics]`: console metrics.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Metrics {
    pub log_freq: u64,
    pub enable_tensorboard: bool,
    pub disable_color_printing: bool,
    pub save_tb_folder: String,
    pub save_for_all_ranks: bool,
    pub enable_wandb: bool,
    /// Peak TFLOPS used for MFU; 0 means the GPU table (H100/A100/H200 bf16 dense) on CUDA and
    /// 1 TFLOPS on CPU, where no table applies.
    pub peak_tflops: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            log_freq: 10,
            enable_tensorboard: false,
            disable_color_printing: false,
            save_tb_folder: "tb".into(),
            save_for_all_ranks: false,
            enable_wandb: false,
            peak_tflops: 0.0,
        }
    }
}

/// `[validation]`: periodic loss on a held-out split.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Validation {
    pub enable: bool,
    pub dataset: String,
    pub dataset_path: Option<String>,
    /// Unset (-1): `training.local_batch_size`, as torchtitan 0.3.0's validator.
    #[serde(with = "minus_one_is_none")]
    pub local_batch_size: Option<u64>,
    /// Unset (-1): `training.seq_len`, as torchtitan 0.3.0's validator.
    #[serde(with = "minus_one_is_none")]
    pub seq_len: Option<u64>,
    pub freq: u64,
    /// Batches per validation; unset (-1) runs the whole split once.
    #[serde(with = "minus_one_is_none")]
    pub steps: Option<u64>,
}

impl Default for Validation {
    fn default() -> Self {
        Self {
            enable: false,
            dataset: "default_validation".into(),
            dataset_path: None,
            local_batch_size: None,
            seq_len: None,
            freq: 500,
            steps: None,
        }
    }
}

/// `[debug]`: seeding, determinism and forced expert balance.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Debug {
    pub seed: Option<u64>,
    pub deterministic: bool,
    pub deterministic_warn_only: bool,
    /// Mixture-of-experts routers pick experts round-robin instead of by score (every expert
    /// gets the same number of tokens; the weights are still the scores of those experts).
    pub moe_force_load_balance: bool,
}

/// `[observability]`: titan-obs recording of spans and scalars under `job.dump_folder`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Observability {
    pub enable: bool,
    pub flush_interval_s: f64,
    /// The rank's journal is compacted into one Parquet part this often (and at the end).
    pub rotate_interval_s: f64,
}

impl Default for Observability {
    fn default() -> Self {
        Self {
            enable: true,
            flush_interval_s: 2.0,
            rotate_interval_s: 600.0,
        }
    }
}

/// `[comm]`: the distributed runtime's timeouts (torchtitan's names).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Comm {
    /// Rendezvous, connection setup and the first collective must finish within this.
    pub init_timeout_seconds: i64,
    /// After the first step: a collective whose peers make no progress for this long fails,
    /// naming the rank it waited for.
    pub train_timeout_seconds: i64,
    /// Accepted for torchtitan config compatibility (its NCCL flight-recorder size); unused.
    pub trace_buf_size: i64,
    /// Which collectives backend the ranks use.
    pub backend: CommBackend,
}

impl Default for Comm {
    fn default() -> Self {
        Self {
            init_timeout_seconds: 300,
            train_timeout_seconds: 100,
            trace_buf_size: 20000,
            backend: CommBackend::Auto,
        }
    }
}

/// `[compile]`: torch.compile, which titan-train does not have (accepted only disabled).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Compile {
    pub enable: bool,
    pub components: Vec<String>,
    pub backend: String,
}

impl Default for Compile {
    fn default() -> Self {
        Self {
            enable: false,
            components: vec!["model".into(), "loss".into()],
            backend: "inductor".into(),
        }
    }
}

/// `[activation_checkpoint]`: recompute activations in the backward pass to save memory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ActivationCheckpoint {
    pub mode: AcMode,
    /// With `mode = selective`: `op` (keep matmul and attention inputs and outputs, recompute
    /// the elementwise work between them), or N (recompute every N-th layer whole).
    pub selective_ac_option: SelectiveAcOption,
}

impl Default for ActivationCheckpoint {
    fn default() -> Self {
        Self {
            mode: AcMode::None,
            selective_ac_option: SelectiveAcOption::EveryNthLayer(
                std::num::NonZeroU64::new(2).expect("2 is not zero"),
            ),
        }
    }
}

/// `[memory_estimation]`: print the per-rank memory estimate for the config and layout and exit
/// (titan-train's `memory_estimate`; no model is built, no rank started).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryEstimation {
    /// torchtitan's key (`enabled` in its older releases, read as the same key).
    pub enable: bool,
    /// Print one JSON object instead of the table.
    pub json: bool,
    /// torchtitan runs its estimate on fake tensors unless this is set; titan-train's is
    /// arithmetic and allocates nothing, fake or real: only false is accepted.
    pub disable_fake_mode: bool,
}

/// `[float8]`: float8 training of the linear layers (titan-train's `float8`), torchtitan's keys of
/// every generation: its first `[float8]` section (`enable_float8_linear`), the later one turned
/// on by `model.converters = ["float8"]`, and `[quantize.linear.float8]` (read as this section).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Float8 {
    /// The oldest switch; later torchtitan lists `float8` in `model.converters` instead.
    pub enable_float8_linear: bool,
    /// `tensorwise`, `rowwise` or `rowwise_with_gw_hp`; unset is tensorwise (torchtitan before
    /// 0.3.0 without a recipe).
    pub recipe_name: Option<Float8Recipe>,
    /// Linears whose fqn contains one of these strings stay in high precision (matched against
    /// both name generations: `lm_head`/`output`, `attention.qkv_linear.wq`/`attention.wq`).
    pub filter_fqns: Vec<String>,
    /// Multiply the dequantised float8 operands in f32 instead of `torch._scaled_mm` (the same
    /// float8 values; for hardware without float8 matmuls).
    pub emulate: bool,
    /// FSDP gathers the float8 linears' weights cast to float8 (tensorwise recipe only); without
    /// FSDP sharding there is nothing to gather and it does nothing (as in torchtitan).
    pub enable_fsdp_float8_all_gather: bool,
    /// The float8 all-gather's scales come from one all-reduce after each optimizer step
    /// instead of one per unit and gather (the same values). Needs the float8 all-gather.
    pub precompute_float8_dynamic_scale_for_fsdp: bool,
    /// Accepted at any value: titan-train always casts the weight again in backward (torchao
    /// 0.18 ignores the key too).
    pub force_recompute_fp8_weight_in_bwd: bool,
    /// titan-train's key: a float8 `lm_head` multiplies the sequence in this many chunks, each
    /// with its own scales, as torchtitan 0.3.0's chunked loss (`loss.num_chunks` 8) calls it;
    /// its `llama3_debugmodel_float8` sets 8.
    pub lm_head_chunks: u64,
}

impl Default for Float8 {
    fn default() -> Self {
        Self {
            enable_float8_linear: false,
            recipe_name: None,
            filter_fqns: Vec::new(),
            emulate: false,
            enable_fsdp_float8_all_gather: false,
            precompute_float8_dynamic_scale_for_fsdp: false,
            force_recompute_fp8_weight_in_bwd: false,
            lm_head_chunks: 1,
        }
    }
}

/// `model.converters` entries that turn float8 linears on (torchtitan's two spellings).
const FLOAT8_CONVERTERS: [&str; 2] = ["float8", "quantize.linear.float8"];

/// Sections torchtitan later nested under other tables: (its dotted name, titan's section).
/// `[quantize.linear.float8]` in a file and `--quantize.linear.float8.KEY` on the command line
/// set `[float8]`'s keys.
pub const NESTED_SECTIONS: &[(&str, &str)] = &[("quantize.linear.float8", "float8")];

/// `key` (`section.key`, or a nested section's dotted name and a key) in titan's sections.
pub fn unnest_key(key: &str) -> String {
    for (nested, section) in NESTED_SECTIONS {
        if let Some(rest) = key.strip_prefix(nested).and_then(|r| r.strip_prefix('.')) {
            return format!("{section}.{rest}");
        }
    }
    key.to_string()
}

/// Older torchtitan spellings a config file may use: (section, key, today's key).
const FILE_ALIASES: &[(&str, &str, &str)] = &[("memory_estimation", "enabled", "enable")];

impl Validation {
    /// Batch size and sequence length of a validation batch (unset: training's).
    pub fn batch_shape(&self, training: &Training) -> (usize, usize) {
        (
            self.local_batch_size
                .map_or(training.local_batch_size as usize, |v| v as usize),
            self.seq_len
                .map_or(training.seq_len as usize, |v| v as usize),
        )
    }
}

impl ActivationCheckpoint {
    /// What the model keeps for backward under this section.
    pub fn policy(&self) -> ActivationCheckpointing {
        match (self.mode, self.selective_ac_option) {
            (AcMode::None, _) => ActivationCheckpointing::None,
            (AcMode::Full, _) => ActivationCheckpointing::Full,
            (AcMode::Selective, SelectiveAcOption::Op) => ActivationCheckpointing::Op,
            (AcMode::Selective, SelectiveAcOption::EveryNthLayer(n)) => {
                ActivationCheckpointing::EveryNthLayer(n.get())
            }
        }
    }
}

/// The whole job configuration, one field per torchtitan section.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    pub job: Job,
    pub model: Model,
    pub optimizer: Optimizer,
    pub lr_scheduler: LrScheduler,
    pub training: Training,
    pub parallelism: Parallelism,
    pub checkpoint: Checkpoint,
    pub metrics: Metrics,
    pub validation: Validation,
    pub debug: Debug,
    pub observability: Observability,
    pub comm: Comm,
    pub compile: Compile,
    pub activation_checkpoint: ActivationCheckpoint,
    pub float8: Float8,
    pub memory_estimation: MemoryEstimation,
}

/// One `--section.key value` from the command line, value still a string.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub key: String,
    pub value: String,
}

impl JobConfig {
    /// Builds the config from an optional (TOML text, its path) and overrides.
    pub fn from_parts(
        toml_file: Option<(&str, &Path)>,
        overrides: &[Override],
    ) -> Result<Self, ConfigError> {
        let schema = serde_json::to_value(JobConfig::default()).expect("defaults serialize");
        let Value::Object(schema) = schema else {
            unreachable!("JobConfig serializes to a map")
        };
        let mut merged = schema.clone();

        if let Some((text, path)) = toml_file {
            let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            let origin = path.display().to_string();
            for (section, body) in unnest_sections(table, &schema, &origin)? {
                let toml::Value::Table(body) = body else {
                    return Err(ConfigError::BadValue {
                        key: section,
                        origin,
                        message: "expected a [section] table".into(),
                    });
                };
                for (key, value) in body {
                    let key = FILE_ALIASES
                        .iter()
                        .find(|(s, k, _)| *s == section && *k == key)
                        .map_or(key, |(_, _, to)| to.to_string());
                    let full = format!("{section}.{key}");
                    check_known(&schema, &section, &key, &origin)?;
                    let json = serde_json::to_value(&value).map_err(|e| ConfigError::BadValue {
                        key: full.clone(),
                        origin: origin.clone(),
                        message: e.to_string(),
                    })?;
                    set(&mut merged, &section, &key, json);
                }
            }
        }

        for o in overrides {
            let origin = "the command line".to_string();
            let (section, key) = o.key.split_once('.').ok_or_else(|| {
                ConfigError::Usage(format!("option `--{}` is not `--section.key`", o.key))
            })?;
            check_known(&schema, section, key, &origin)?;
            let default = &schema[section][key];
            let value =
                convert_override(default, &o.value).map_err(|message| ConfigError::BadValue {
                    key: o.key.clone(),
                    origin: origin.clone(),
                    message,
                })?;
            set(&mut merged, section, key, value);
        }

        let cfg: JobConfig =
            serde_path_to_error::deserialize(Value::Object(merged)).map_err(|e| {
                ConfigError::Invalid {
                    key: e.path().to_string(),
                    message: e.inner().to_string(),
                }
            })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Context parallelism's conditions, in torchtitan 0.3.0's words: a sequence the load
    /// balancer can cut (2 x cp chunks; with sequence parallelism each chunk again over tp),
    /// an attention that can take another rank's keys, and `ptrr`'s attention-mask blocks.
    fn validate_context_parallel(&self) -> Result<(), ConfigError> {
        let p = &self.parallelism;
        let cp = p.context_parallel_degree;
        if cp <= 1 {
            return Ok(());
        }
        if self.model.attn_backend == AttnBackend::Varlen {
            return Err(ConfigError::invalid(
                "parallelism.context_parallel_degree",
                "Context Parallel only supports SDPA and FlexAttention. Varlen attention is not \
                 supported with CP (model.attn_backend is varlen)",
            ));
        }
        if p.context_parallel_load_balancer == CpLoadBalancer::Ptrr
            && !self.model.attn_backend.document_causal()
        {
            return Err(ConfigError::invalid(
                "parallelism.context_parallel_load_balancer",
                "PTRRLoadBalancer requires attention_masks to be a BlockMask or dict[str, \
                 BlockMask], but got None (model.attn_backend sdpa has no mask: use flex)",
            ));
        }
        let tp = if p.enable_sequence_parallel {
            p.tensor_parallel_degree.max(1)
        } else {
            1
        };
        let mut lengths = vec![("training.seq_len", self.training.seq_len)];
        if self.validation.enable {
            lengths.push((
                "validation.seq_len",
                self.validation.batch_shape(&self.training).1 as i64,
            ));
        }
        for (key, seq_len) in lengths {
            let divisor = tp * 2 * cp;
            if seq_len % divisor != 0 {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "Training sequence length ({seq_len}) must be divisible by {divisor} for \
                         the configured sequence/context parallelism."
                    ),
                ));
            }
            // PTRR deals the mask's 128-token blocks out to the ranks.
            let blocks = CP_MASK_BLOCK * cp;
            if p.context_parallel_load_balancer == CpLoadBalancer::Ptrr && seq_len % blocks != 0 {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{seq_len} is not a multiple of {blocks}: the ptrr load balancer deals \
                         attention-mask blocks of {CP_MASK_BLOCK} tokens to {cp} ranks \
                         (num_tasks {} must be divisible by group_size {cp})",
                        seq_len / CP_MASK_BLOCK
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks the values that types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message,
            })
        };
        self.refuse_unimplemented()?;
        if let Some(r) = self.lr_scheduler.decay_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return bad("lr_scheduler.decay_ratio", format!("{r} is not in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.lr_scheduler.min_lr_factor) {
            return bad(
                "lr_scheduler.min_lr_factor",
                format!("{} is not in [0, 1]", self.lr_scheduler.min_lr_factor),
            );
        }
        if self.optimizer.name != "AdamW" {
            return bad(
                "optimizer.name",
                format!("`{}` is not supported (only AdamW)", self.optimizer.name),
            );
        }
        if self.float8.enable_fsdp_float8_all_gather
            && self.float8_enabled()
            && self
                .float8
                .recipe_name
                .is_some_and(|r| r != Float8Recipe::Tensorwise)
        {
            return bad(
                "float8.enable_fsdp_float8_all_gather",
                "gathers tensorwise-scaled weights only (as torchao): set \
                 float8.recipe_name tensorwise, or turn the float8 all-gather off"
                    .into(),
            );
        }
        if !MODEL_NAMES.contains(&self.model.name.as_str()) {
            return bad(
                "model.name",
                format!(
                    "`{}` is not a model titan-train trains (it has: {})",
                    self.model.name,
                    MODEL_NAMES.join(", ")
                ),
            );
        }
        for (key, v) in [
            ("training.local_batch_size", self.training.local_batch_size),
            ("training.seq_len", self.training.seq_len),
            (
                "validation.local_batch_size",
                self.validation.local_batch_size.map_or(1, |v| v as i64),
            ),
            (
                "validation.seq_len",
                self.validation.seq_len.map_or(1, |v| v as i64),
            ),
        ] {
            if v < 1 {
                return bad(key, format!("{v} must be at least 1"));
            }
        }
        if self.checkpoint.create_seed_checkpoint && !self.checkpoint.enable {
            return bad(
                "checkpoint.create_seed_checkpoint",
                "Must enable checkpointing when creating a seed checkpoint (set checkpoint.enable)"
                    .into(),
            );
        }
        if self.training.prefetch_batches > 64 {
            return bad(
                "training.prefetch_batches",
                format!(
                    "{} batches ahead holds that many batches in memory; at most 64 (2 keeps \
                     the step fed)",
                    self.training.prefetch_batches
                ),
            );
        }
        if self.comm.backend == CommBackend::Nccl && self.training.device == DeviceChoice::Cpu {
            return bad(
                "comm.backend",
                "nccl runs collectives on CUDA tensors, but training.device is cpu: set \
                 comm.backend = \"cpu\" (or \"auto\"), or train on cuda"
                    .into(),
            );
        }
        if self.float8.lm_head_chunks == 0 {
            return bad("float8.lm_head_chunks", "must be at least 1".into());
        }
        if self.metrics.log_freq == 0 {
            return bad("metrics.log_freq", "must be at least 1".into());
        }
        if self.validation.enable && self.validation.freq == 0 {
            return bad("validation.freq", "must be at least 1".into());
        }
        for (key, value) in [
            ("training.dtype", self.training.dtype),
            (
                "training.mixed_precision_param",
                self.training.mixed_precision_param,
            ),
        ] {
            if value == DtypeName::Float16 {
                return bad(key, "float16 is not one of bfloat16, float32".into());
            }
        }
        self.validate_context_parallel()?;
        if self.training.mixed_precision_reduce != DtypeName::Float32 {
            return bad(
                "training.mixed_precision_reduce",
                format!(
                    "{} is not supported: torchtitan 0.3.0 reduces gradients in float32 only",
                    self.training.mixed_precision_reduce.name()
                ),
            );
        }
        for (key, v) in [
            (
                "observability.flush_interval_s",
                self.observability.flush_interval_s,
            ),
            (
                "observability.rotate_interval_s",
                self.observability.rotate_interval_s,
            ),
            (
                "comm.init_timeout_seconds",
                self.comm.init_timeout_seconds as f64,
            ),
            (
                "comm.train_timeout_seconds",
                self.comm.train_timeout_seconds as f64,
            ),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return bad(
                    key,
                    format!("{v} must be a number of seconds greater than 0"),
                );
            }
        }
        Ok(())
    }
}

impl JobConfig {
    /// Settings given in `overrides` that do nothing because a key they depend on is off: one
    /// warning each, naming both keys (so a flag is never dropped in silence).
    pub fn ignored_settings(&self, overrides: &[Override]) -> Vec<String> {
        // (keys this covers, the key they need, what it must be, whether it is).
        let needs: &[(&str, &str, &str, bool)] = &[
            (
                "checkpoint.",
                "checkpoint.enable",
                "true",
                self.checkpoint.enable,
            ),
            (
                "validation.",
                "validation.enable",
                "true",
                self.validation.enable,
            ),
            (
                "metrics.save_tb_folder",
                "metrics.enable_tensorboard",
                "true",
                self.metrics.enable_tensorboard,
            ),
            (
                "observability.",
                "observability.enable",
                "true",
                self.observability.enable,
            ),
            (
                "activation_checkpoint.selective_ac_option",
                "activation_checkpoint.mode",
                "selective",
                self.activation_checkpoint.mode == AcMode::Selective,
            ),
            (
                "float8.",
                "float8.enable_float8_linear",
                "true (or `float8` in model.converters)",
                self.float8_enabled(),
            ),
            (
                "float8.precompute_float8_dynamic_scale_for_fsdp",
                "float8.enable_fsdp_float8_all_gather",
                "true",
                self.float8.enable_fsdp_float8_all_gather,
            ),
            (
                "parallelism.pipeline_parallel_",
                "parallelism.pipeline_parallel_degree",
                "> 1",
                self.parallelism.pipeline_parallel_degree > 1,
            ),
            (
                "parallelism.context_parallel_load_balancer",
                "parallelism.context_parallel_degree",
                "> 1",
                self.parallelism.context_parallel_degree > 1,
            ),
            (
                "parallelism.module_fqns_per_model_part",
                "parallelism.pipeline_parallel_degree",
                "> 1",
                self.parallelism.pipeline_parallel_degree > 1,
            ),
            (
                "training.mixed_precision_param",
                "training.dtype",
                "float32 (bfloat16 weights are not autocast)",
                self.training.dtype == DtypeName::Float32,
            ),
        ];
        let mut warnings = Vec::new();
        for o in overrides {
            for (covered, needed, value, on) in needs {
                if !on && o.key.starts_with(covered) && o.key != *needed {
                    warnings.push(format!(
                        "--{} has no effect: it needs {needed} {value}, which is not set",
                        o.key
                    ));
                }
            }
        }
        warnings
    }

    /// Whether the linears train in float8 (`[float8] enable_float8_linear`, or `float8` in
    /// `model.converters`).
    pub fn float8_enabled(&self) -> bool {
        self.float8.enable_float8_linear
            || self
                .model
                .converters
                .iter()
                .any(|c| FLOAT8_CONVERTERS.contains(&c.as_str()))
    }

    /// torchtitan keys titan-train does not implement: accepted at their defaults only, so a
    /// config that asks for them fails instead of training without them.
    fn refuse_unimplemented(&self) -> Result<(), ConfigError> {
        let d = JobConfig::default();
        let w = |v: &dyn std::fmt::Debug| format!("{v:?}");
        let checks: Vec<(&str, String, String, &str)> = vec![
            (
                "model.converters",
                w(&self
                    .model
                    .converters
                    .iter()
                    .filter(|c| !FLOAT8_CONVERTERS.contains(&c.as_str()))
                    .collect::<Vec<_>>()),
                w(&d.model.converters.iter().collect::<Vec<_>>()),
                " (of the converters it has float8 only: `float8` or `quantize.linear.float8`)",
            ),
            (
                "model.print_after_conversion",
                w(&self.model.print_after_conversion),
                w(&d.model.print_after_conversion),
                " (the float8 linears are listed in the log instead)",
            ),
            (
                "optimizer.early_step_in_backward",
                w(&self.optimizer.early_step_in_backward),
                w(&d.optimizer.early_step_in_backward),
                "",
            ),
            (
                "training.enable_cpu_offload",
                w(&self.training.enable_cpu_offload),
                w(&d.training.enable_cpu_offload),
                " (FSDP cpu offload)",
            ),
            (
                "training.gc_debug",
                w(&self.training.gc_debug),
                w(&d.training.gc_debug),
                " (Python's gc debugging has no counterpart)",
            ),
            (
                "parallelism.pipeline_parallel_schedule_csv",
                w(&self.parallelism.pipeline_parallel_schedule_csv),
                w(&d.parallelism.pipeline_parallel_schedule_csv),
                " (titan-train runs schedules by name: parallelism.pipeline_parallel_schedule)",
            ),
            (
                "parallelism.enable_compiled_autograd",
                w(&self.parallelism.enable_compiled_autograd),
                w(&d.parallelism.enable_compiled_autograd),
                " (no torch.compile)",
            ),
            (
                "compile.enable",
                w(&self.compile.enable),
                w(&d.compile.enable),
                " (no torch.compile)",
            ),
            (
                "metrics.enable_wandb",
                w(&self.metrics.enable_wandb),
                w(&d.metrics.enable_wandb),
                " (Weights & Biases cannot be reached from titan-train; use metrics.enable_tensorboard)",
            ),
            (
                "debug.deterministic_warn_only",
                w(&self.debug.deterministic_warn_only),
                w(&d.debug.deterministic_warn_only),
                "",
            ),
            (
                "comm.trace_buf_size",
                w(&self.comm.trace_buf_size),
                w(&d.comm.trace_buf_size),
                " (no NCCL flight recorder)",
            ),
            (
                "memory_estimation.disable_fake_mode",
                w(&self.memory_estimation.disable_fake_mode),
                w(&d.memory_estimation.disable_fake_mode),
                " (the estimate is arithmetic: it allocates no tensors, fake or real)",
            ),
        ];
        for (key, value, default, note) in checks {
            if value != default {
                return Err(ConfigError::Unsupported {
                    key: key.into(),
                    value,
                    default,
                    note: note.into(),
                });
            }
        }
        Ok(())
    }
}

/// The file's sections with [`NESTED_SECTIONS`] read as titan's (`[quantize.linear.float8]` as
/// `[float8]`); a nested table titan has no section for is an unknown section named in full.
fn unnest_sections(
    table: toml::Table,
    schema: &Map<String, Value>,
    origin: &str,
) -> Result<Vec<(String, toml::Value)>, ConfigError> {
    let mut out = Vec::new();
    for (section, body) in table {
        let nested = NESTED_SECTIONS
            .iter()
            .any(|(n, _)| n.split('.').next() == Some(section.as_str()));
        if schema.contains_key(&section) || !nested {
            out.push((section, body));
            continue;
        }
        // Walk down to the tables that hold values; each must be a nested section titan has.
        let mut stack = vec![(section, body)];
        while let Some((path, value)) = stack.pop() {
            let toml::Value::Table(t) = value else {
                return Err(ConfigError::UnknownKey {
                    key: path,
                    origin: origin.into(),
                    section: "quantize".into(),
                    known: NESTED_SECTIONS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            };
            if let Some((_, to)) = NESTED_SECTIONS.iter().find(|(n, _)| *n == path) {
                out.push((to.to_string(), toml::Value::Table(t)));
                continue;
            }
            if !NESTED_SECTIONS
                .iter()
                .any(|(n, _)| n.starts_with(&format!("{path}.")))
            {
                return Err(ConfigError::UnknownSection {
                    section: path,
                    origin: origin.into(),
                    known: NESTED_SECTIONS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            for (k, v) in t {
                stack.push((format!("{path}.{k}"), v));
            }
        }
    }
    Ok(out)
}

fn check_known(
    schema: &Map<String, Value>,
    section: &str,
    key: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    let Some(Value::Object(keys)) = schema.get(section) else {
        return Err(ConfigError::UnknownSection {
            section: section.into(),
            origin: origin.into(),
            known: schema.keys().cloned().collect::<Vec<_>>().join(", "),
        });
    };
    if !keys.contains_key(key) {
        return Err(ConfigError::UnknownKey {
            key: format!("{section}.{key}"),
            origin: origin.into(),
            section: section.into(),
            known: keys.keys().cloned().collect::<Vec<_>>().join(", "),
        });
    }
    Ok(())
}

fn set(merged: &mut Map<String, Value>, section: &str, key: &str, value: Value) {
    if let Some(Value::Object(keys)) = merged.get_mut(section) {
        keys.insert(key.to_string(), value);
    }
}

/// Converts a command-line string to the JSON type of the key's default value.
fn convert_override(default: &Value, raw: &str) -> Result<Value, String> {
    match default {
        Value::Bool(_) => match raw {
            "true" | "True" | "1" => Ok(Value::Bool(true)),
            "false" | "False" | "0" => Ok(Value::Bool(false)),
            _ => Err(format!("expected true or false, got `{raw}`")),
        },
        Value::Number(n) if n.is_f64() => raw
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("expected a number, got `{raw}`")),
        Value::Number(_) => raw
            .parse::<i64>()
            .map(|v| Value::Number(v.into()))
            .map_err(|_| format!("expected an integer, got `{raw}`")),
        Value::String(_) => Ok(Value::String(raw.to_string())),
        // torchtitan's list options are comma-separated on the command line.
        Value::Array(_) => Ok(Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_string()))
                .collect(),
        )),
        // Optional keys (unset by default): read the value as a TOML literal, else a string.
        Value::Null | Value::Object(_) => {
            if raw == "none" || raw == "None" {
                return Ok(Value::Null);
            }
            match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
                Ok(mut t) => serde_json::to_value(t.remove("v")).map_err(|e| e.to_string()),
                Err(_) => Ok(Value::String(raw.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command_line::CommandLine;

    fn ov(args: &[&str]) -> Vec<Override> {
        crate::command_line::parse(args.iter().map(|s| s.to_string()).collect())
            .unwrap()
            .overrides
    }

    #[test]
    fn defaults_match_torchtitan() {
        let c = JobConfig::from_parts(None, &[]).unwrap();
        assert_eq!(c.optimizer.lr, 8e-4);
        assert_eq!(c.optimizer.beta2, 0.95);
        assert_eq!(c.training.max_norm, 1.0);
        assert_eq!(c.parallelism.data_parallel_shard_degree, None);
        assert_eq!(c.checkpoint.keep_latest_k, 10);
        assert_eq!(c.checkpoint.export_dtype, DtypeName::Float32);
        assert_eq!(c.training.mixed_precision_param, DtypeName::Bfloat16);
        assert_eq!(c.lr_scheduler.decay_ratio, None);
    }

    /// The loader's read-ahead and the collectives backend: titan-train's own keys, with what
    /// they cannot be refused naming the key.
    #[test]
    fn prefetch_and_backend_keys() {
        let c = JobConfig::from_parts(None, &[]).unwrap();
        assert_eq!(
            (c.training.prefetch_batches, c.comm.backend),
            (2, CommBackend::Auto)
        );
        let c = JobConfig::from_parts(
            None,
            &ov(&[
                "--training.prefetch_batches",
                "0",
                "--comm.backend",
                "cpu",
                "--training.device",
                "cuda",
            ]),
        )
        .unwrap();
        assert_eq!(
            (c.training.prefetch_batches, c.comm.backend),
            (0, CommBackend::Cpu)
        );
        for (args, key) in [
            (
                &["--training.prefetch_batches", "65"][..],
                "training.prefetch_batches",
            ),
            (
                &["--comm.backend", "nccl", "--training.device", "cpu"][..],
                "comm.backend",
            ),
        ] {
            let err = JobConfig::from_parts(None, &ov(args)).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if k == key),
                "{args:?}: {err}"
            );
        }
        let err = JobConfig::from_parts(None, &ov(&["--comm.backend", "gloo"])).unwrap_err();
        assert!(err.to_string().contains("comm.backend"), "{err}");
    }

    #[test]
    fn file_then_overrides_both_spellings() {
        let toml = "[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n";
        let c = JobConfig::from_parts(
            Some((toml, Path::new("x.toml"))),
            &ov(&[
                "--training.steps",
                "7",
                "--debug.seed=42",
                "--debug.deterministic",
                "--lr_scheduler.decay_ratio",
                "0.8",
                "--job.description",
                "123",
            ]),
        )
        .unwrap();
        assert_eq!(c.training.steps, 7);
        assert_eq!(c.training.seq_len, 64);
        assert_eq!(c.optimizer.lr, 1.0);
        assert_eq!(c.debug.seed, Some(42));
        assert!(c.debug.deterministic);
        assert_eq!(c.lr_scheduler.decay_ratio, Some(0.8));
        assert_eq!(c.job.description, "123");
    }

    #[test]
    fn unknown_key_names_it() {
        let err = JobConfig::from_parts(None, &ov(&["--training.stepz", "3"])).unwrap_err();
        assert!(err.to_string().contains("`training.stepz`"), "{err}");
        let err = JobConfig::from_parts(Some(("[trainin]\nsteps = 1\n", Path::new("f.toml"))), &[])
            .unwrap_err();
        assert!(err.to_string().contains("[trainin]"), "{err}");
        assert!(err.to_string().contains("f.toml"), "{err}");
    }

    #[test]
    fn wrong_type_names_key() {
        let err = JobConfig::from_parts(None, &ov(&["--training.steps", "ten"])).unwrap_err();
        assert!(err.to_string().contains("`training.steps`"), "{err}");
        let err = JobConfig::from_parts(
            Some(("[training]\nsteps = \"ten\"\n", Path::new("f.toml"))),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("training.steps"), "{err}");
        let err =
            JobConfig::from_parts(None, &ov(&["--lr_scheduler.decay_ratio", "x"])).unwrap_err();
        assert!(
            err.to_string().contains("lr_scheduler.decay_ratio"),
            "{err}"
        );
    }

    #[test]
    fn embedded_default_is_the_debug_config() {
        let c = JobConfig::load(&CommandLine::default()).unwrap();
        assert_eq!((c.training.seq_len, c.training.steps), (256, 50));
        assert_eq!(c.model.flavor, "debugmodel");
        let file = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(DEFAULT_CONFIG_FILE),
        )
        .unwrap();
        assert_eq!(file, DEFAULT_CONFIG);
    }

    #[test]
    fn minus_one_is_unset_and_counts_are_typed() {
        let toml = "[training]\nglobal_batch_size = -1\n[checkpoint]\nload_step = 4\n";
        let c = JobConfig::from_parts(Some((toml, Path::new("f.toml"))), &[]).unwrap();
        assert_eq!(c.training.global_batch_size, None);
        assert_eq!(c.checkpoint.load_step, Some(4));
        let c = JobConfig::from_parts(None, &ov(&["--validation.steps", "-1"])).unwrap();
        assert_eq!(c.validation.steps, None);
        let err = JobConfig::from_parts(None, &ov(&["--checkpoint.load_step", "-2"])).unwrap_err();
        assert!(err.to_string().contains("checkpoint.load_step"), "{err}");
    }

    #[test]
    fn enum_values_are_checked_at_parse_time() {
        for (key, value) in [
            ("--lr_scheduler.decay_type", "cosin"),
            ("--training.device", "tpu"),
            ("--checkpoint.async_mode", "sometimes"),
            ("--checkpoint.export_dtype", "int8"),
            ("--training.mixed_precision_param", "fp8"),
            ("--activation_checkpoint.mode", "partial"),
        ] {
            let err = JobConfig::from_parts(None, &ov(&[key, value])).unwrap_err();
            assert!(err.to_string().contains(&key[2..]), "{key}: {err}");
        }
        let c = JobConfig::from_parts(None, &ov(&["--checkpoint.async_mode", "async"])).unwrap();
        assert_eq!(c.checkpoint.async_mode, AsyncModeName::Async);
    }

    #[test]
    fn activation_checkpointing_options() {
        for (value, policy) in [
            ("op", ActivationCheckpointing::Op),
            ("3", ActivationCheckpointing::EveryNthLayer(3)),
        ] {
            let c = JobConfig::from_parts(
                None,
                &ov(&[
                    "--activation_checkpoint.mode",
                    "selective",
                    "--activation_checkpoint.selective_ac_option",
                    value,
                ]),
            )
            .unwrap();
            assert_eq!(c.activation_checkpoint.policy(), policy);
        }
        let toml = "[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 4\n";
        let c = JobConfig::from_parts(Some((toml, Path::new("ac.toml"))), &[]).unwrap();
        assert_eq!(
            c.activation_checkpoint.policy(),
            ActivationCheckpointing::EveryNthLayer(4)
        );
        let c =
            JobConfig::from_parts(None, &ov(&["--activation_checkpoint.mode", "full"])).unwrap();
        assert_eq!(
            c.activation_checkpoint.policy(),
            ActivationCheckpointing::Full
        );
        for bad in ["x", "0", "-2", "1.5"] {
            let err = JobConfig::from_parts(
                None,
                &ov(&["--activation_checkpoint.selective_ac_option", bad]),
            )
            .unwrap_err();
            assert!(
                err.to_string()
                    .contains("activation_checkpoint.selective_ac_option"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_load_balancer_without_context_parallelism_is_named_as_ignored() {
        let o = ov(&["--parallelism.context_parallel_load_balancer", "ptrr"]);
        let cfg = JobConfig::from_parts(None, &o).unwrap();
        let w = cfg.ignored_settings(&o);
        assert!(
            w.iter().any(
                |w| w.contains("context_parallel_load_balancer has no effect")
                    && w.contains("parallelism.context_parallel_degree > 1")
            ),
            "{w:?}"
        );
        let o = ov(&[
            "--parallelism.context_parallel_load_balancer",
            "ptrr",
            "--parallelism.context_parallel_degree",
            "2",
            "--training.seq_len",
            "256",
        ]);
        let cfg = JobConfig::from_parts(None, &o).unwrap();
        assert!(cfg.ignored_settings(&o).is_empty());
    }

    #[test]
    fn unimplemented_keys_are_refused_unless_default() {
        for (key, value) in [
            ("--compile.enable", "true"),
            ("--metrics.enable_wandb", "true"),
            ("--training.enable_cpu_offload", "true"),
            ("--model.converters", "mx"),
            ("--parallelism.pipeline_parallel_schedule_csv", "s.csv"),
        ] {
            let err = JobConfig::from_parts(None, &ov(&[key, value])).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Unsupported { key: k, .. } if *k == key[2..]),
                "{key}: {err}"
            );
            assert!(
                err.to_string().contains("not supported by titan-train"),
                "{err}"
            );
        }
        // At their defaults they are accepted (torchtitan's own files spell them out).
        JobConfig::from_parts(
            None,
            &ov(&[
                "--compile.enable=false",
                "--training.enable_cpu_offload",
                "false",
            ]),
        )
        .unwrap();
    }
}
