//! The layout checks that need the model's shapes and the mesh but no tensor: run by the
//! launcher before any rank starts and by every rank before it builds anything, so a degree
//! that cannot split the model is an exit-2 config error naming its own key, said once.

use anyhow::{Result, bail};

use crate::config::{self, ConfigError, JobConfig};
use crate::float8::Float8Training;
use crate::model::{Family, ModelArgs};
use crate::parallel::Mesh;
use crate::parallelize::pipeline::{self, PipelineConfig, Schedule};
use crate::parallelize::plan::{tp_local_shape, tp_style};

/// Checks that `cfg`'s model splits over `world` as torchtitan would split it, and returns the
/// pipeline settings when pipeline parallelism is on.
pub fn check_layout(cfg: &JobConfig, world: &Mesh) -> Result<Option<PipelineConfig>, ConfigError> {
    if cfg.checkpoint.create_seed_checkpoint && world.world_size != 1 {
        return Err(ConfigError::invalid(
            "checkpoint.create_seed_checkpoint",
            format!(
                "Must create seed checkpoint using a single device, to disable sharding (this job has {} ranks)",
                world.world_size
            ),
        ));
    }
    let args = ModelArgs::for_job(cfg)?;
    args.validate()
        .map_err(|e| ConfigError::invalid("model.flavor", e))?;
    // A schedule name is checked even where no pipeline runs: a typo is never meant.
    let schedule = Schedule::parse(&cfg.parallelism.pipeline_parallel_schedule)
        .map_err(|e| ConfigError::invalid("parallelism.pipeline_parallel_schedule", e))?;
    check_family(cfg, &args, world)?;
    check_tensor_parallel(cfg, &args, world.tp)?;
    check_expert_parallel(cfg, &args, world)?;
    microbatches(&cfg.training, world.dp_degree())
        .map_err(|e| ConfigError::invalid("training.global_batch_size", format!("{e:#}")))?;
    if world.pp <= 1 {
        return Ok(None);
    }
    let p = pipeline_config(&cfg.parallelism, world.pp, &cfg.training, schedule)?;
    pipeline::split_stages(&p, args.n_layers as usize).map_err(|e| {
        ConfigError::invalid("parallelism.pipeline_parallel_degree", format!("{e:#}"))
    })?;
    if schedule.splits_backward() {
        refuse_with_split_backward(cfg, schedule)?;
    }
    Ok(Some(p))
}

/// What titan-train does not build for a family yet (float8), and torchtitan's own refusal of
/// pipeline parallelism over tied embeddings.
fn check_family(cfg: &JobConfig, args: &ModelArgs, world: &Mesh) -> Result<(), ConfigError> {
    if args.family == Family::Llama3 {
        return Ok(());
    }
    let model = format!("{} {}", cfg.model.name, cfg.model.flavor);
    if args.tie_embeddings && world.pp > 1 {
        return Err(ConfigError::invalid(
            "parallelism.pipeline_parallel_degree",
            format!(
                "{model} ties its embeddings to the output layer, and weight tying is not \
                 supported with pipeline parallelism (as in torchtitan)"
            ),
        ));
    }
    if cfg.float8_enabled() {
        // The key that turned float8 on: a converter, or the older switch.
        let key = if cfg.model.converters.is_empty() {
            "float8.enable_float8_linear"
        } else {
            "model.converters"
        };
        return Err(ConfigError::invalid(
            key,
            format!(
                "titan-train trains {model} with FSDP, HSDP, DDP, tensor and pipeline \
                 parallelism, in DCP and HF checkpoints: float8 is llama3's so far"
            ),
        ));
    }
    Ok(())
}

/// Expert parallelism splits each MoE layer's routed experts evenly over `ep` ranks borrowed
/// from `dp_shard x cp x tp`, with FSDP over the rest (`efsdp`) and HSDP's replicas; what it
/// cannot split is refused naming its key.
pub fn check_expert_parallel(
    cfg: &JobConfig,
    args: &ModelArgs,
    world: &Mesh,
) -> Result<(), ConfigError> {
    let ep = world.ep;
    if ep <= 1 {
        return Ok(());
    }
    let key = "parallelism.expert_parallel_degree";
    let model = format!("{} {}", cfg.model.name, cfg.model.flavor);
    let Some(moe) = args.moe.as_ref() else {
        return Err(ConfigError::invalid(
            key,
            format!("{ep}: {model} has no mixture-of-experts layers to split"),
        ));
    };
    let experts = moe.num_experts as usize;
    if !experts.is_multiple_of(ep) {
        return Err(ConfigError::invalid(
            key,
            format!("{ep} does not divide {model}'s {experts} routed experts"),
        ));
    }
    // Under EP x TP each tp rank routes its own block of its (context-parallel) part of the
    // sequence.
    let (tp, cp, seq_len) = (world.tp, world.cp, cfg.training.seq_len as usize);
    if tp > 1 && !seq_len.is_multiple_of(tp * cp) {
        return Err(ConfigError::invalid(
            "training.seq_len",
            format!(
                "{seq_len} does not divide into parallelism.tensor_parallel_degree = {tp} x \
                 context_parallel_degree = {cp} blocks: with {key} = {ep} each tp rank routes \
                 its own block of the sequence"
            ),
        ));
    }
    if world.efsdp() * ep > experts {
        return Err(ConfigError::invalid(
            "parallelism.data_parallel_shard_degree",
            format!(
                "{} ranks would shard {model}'s {experts} experts ({key} = {ep} x {} FSDP \
                 shards): torchtitan then shards each expert's hidden dim, which titan-train \
                 does not build yet; use at most {experts} data_parallel_shard ranks",
                world.efsdp() * ep,
                world.efsdp()
            ),
        ));
    }
    Ok(())
}

/// Tensor parallelism splits attention by heads and every other split weight evenly, takes the
/// loss over vocab-sharded logits, and under sequence parallelism the sequence too.
pub fn check_tensor_parallel(
    cfg: &JobConfig,
    args: &ModelArgs,
    tp: usize,
) -> Result<(), ConfigError> {
    if tp <= 1 {
        return Ok(());
    }
    let key = "parallelism.tensor_parallel_degree";
    for (what, n) in [("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads())] {
        if n % tp as i64 != 0 {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{tp} does not divide {} {}'s {what} = {n}: torchtitan's plan splits \
                     attention by heads",
                    cfg.model.name, cfg.model.flavor
                ),
            ));
        }
    }
    for spec in args.parameters() {
        let style = tp_style(&spec.fqn).map_err(|e| ConfigError::invalid(key, format!("{e:#}")))?;
        tp_local_shape(&spec.shape, style, tp as i64)
            .map_err(|e| ConfigError::invalid(key, format!("{}: {e:#}", spec.fqn)))?;
    }
    if cfg.parallelism.disable_loss_parallel {
        return Err(ConfigError::invalid(
            "parallelism.disable_loss_parallel",
            "titan-train's tensor parallelism always takes the loss over vocab-sharded logits \
             (torchtitan 0.3.0 has no other way)",
        ));
    }
    if cfg.parallelism.enable_sequence_parallel {
        let (_, val_seq_len) = cfg.validation.batch_shape(&cfg.training);
        for (seq_key, seq_len) in [
            ("training.seq_len", cfg.training.seq_len),
            ("validation.seq_len", val_seq_len as i64),
        ] {
            if seq_len % tp as i64 != 0 {
                return Err(ConfigError::invalid(
                    seq_key,
                    format!(
                        "{seq_len} is not a multiple of parallelism.tensor_parallel_degree = \
                         {tp}: sequence parallelism gives each tp rank an equal block of the \
                         sequence (or set parallelism.enable_sequence_parallel false)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The pipeline settings of `[parallelism]`, checked as torchtitan checks them.
fn pipeline_config(
    p: &config::Parallelism,
    degree: usize,
    training: &config::Training,
    schedule: Schedule,
) -> Result<PipelineConfig, ConfigError> {
    let key = "parallelism.pipeline_parallel_microbatch_size";
    let microbatch_size = p.pipeline_parallel_microbatch_size;
    if microbatch_size <= 0 {
        return Err(ConfigError::invalid(
            key,
            format!("must be at least 1, got {microbatch_size}"),
        ));
    }
    if training.local_batch_size % microbatch_size != 0 {
        return Err(ConfigError::invalid(
            key,
            format!(
                "Batch size {} must be divisible by microbatch_size {microbatch_size}. Update \
                 the config arguments for either batch_size or pipeline_parallel_microbatch_size.",
                training.local_batch_size
            ),
        ));
    }
    Ok(PipelineConfig {
        degree,
        schedule,
        microbatch_size,
        layers_per_stage: p.pipeline_parallel_layers_per_stage.map(|n| n as usize),
        first_stage_less_layers: p.pipeline_parallel_first_stage_less_layers as usize,
        last_stage_less_layers: p.pipeline_parallel_last_stage_less_layers as usize,
        module_fqns_per_model_part: p.module_fqns_per_model_part.clone(),
    })
}

/// What a split backward (zero-bubble) does not run with yet, refused naming the key: its
/// weight pass defers the linears' weight gradients, which float8's own backward does not.
/// (Under pipeline parallelism FSDP's and DDP's units sum their gradients over the step and
/// reduce them after the last weight pass, and a checkpointed block's recompute defers as a
/// plain block does, so data and context parallelism and activation checkpointing run with
/// it.)
fn refuse_with_split_backward(cfg: &JobConfig, schedule: Schedule) -> Result<(), ConfigError> {
    let name = schedule.name();
    let refuse = |key: &str, why: String| {
        Err(ConfigError::invalid(
            key,
            format!("{why}; schedule {name} runs without float8"),
        ))
    };
    if Float8Training::from_config(cfg).is_some() {
        return refuse(
            "float8.enable_float8_linear",
            format!("float8 linears are not implemented with {name}"),
        );
    }
    Ok(())
}

/// Number of microbatches per optimizer step (gradient accumulation), torchtitan's rule.
pub fn microbatches(training: &config::Training, dp_degree: usize) -> Result<usize> {
    let per_pass = training.local_batch_size as usize * dp_degree;
    let global = training.global_batch_size.map_or(per_pass, |g| g as usize);
    if global == 0 || !global.is_multiple_of(per_pass) {
        bail!(
            "training.global_batch_size {global} must be a positive multiple of local_batch_size {} x dp degree {dp_degree}",
            training.local_batch_size
        );
    }
    Ok(global / per_pass)
}
