//! The training loop, readable top to bottom: build (tokenizer, data, model, optimizer), then per
//! step: load microbatches, forward/backward, reduce, clip, step, log, validate.
//!
//! The model is split over the device mesh by the plan it is built with ([`ParallelPlan`]): its
//! collectives run inside forward and backward. The loop meets the other ranks only through
//! [`DeviceMesh`] for what is global by nature: the token count the loss is divided by, the
//! gradient norm, and metrics. Everything timed goes through titan-obs spans with torchtitan's
//! phase names.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use tch::{Device, Kind, Tensor};
use titan_obs_core::Reduce;
use titan_obs_core::vocab::{self, titan};

use crate::checkpoint::{Checkpointer, TrainerState};
use crate::config::{self, DeviceChoice, DtypeName, JobConfig};
use crate::console;
use crate::data::{Batch, Dataset, TextLoader, TextTokenizer};
use crate::distributed::{DeviceMesh, ReduceOp};
use crate::float8::{self, Float8Training};
use crate::lr_scheduler::LrSchedule;
use crate::metrics::{self, StepMetrics, ValidationMetrics};
use crate::model::{Llama, ModelArgs};
use crate::optim::{self, AdamW};
use crate::parallel::Dim;
use crate::parallelize::ParallelPlan;
use crate::parallelize::pipeline::{
    self, Microbatch, Pipeline, PipelineConfig, Schedule, StageModules,
};
use crate::precision;
use crate::tensorboard::EventWriter;

pub use crate::parallelize::tp::IGNORE_INDEX;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub dump_folder: PathBuf,
    /// This launch's run id (a resume continues the checkpoint's).
    pub run_id: String,
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub last_validation_loss: Option<f64>,
}

/// A config problem found while building the job: reported like config-file errors (exit 2).
fn config_error(key: &str, e: anyhow::Error) -> anyhow::Error {
    config::ConfigError::Invalid {
        key: key.into(),
        message: format!("{e:#}"),
    }
    .into()
}

/// Picks the device: CUDA `local_rank` when available (or demanded), else CPU.
pub fn select_device(training: &config::Training, local_rank: usize) -> Result<Device> {
    let cuda = tch::Cuda::is_available();
    match training.device {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda if !cuda => {
            bail!("training.device = cuda, but no CUDA device is available")
        }
        DeviceChoice::Cuda => Ok(Device::Cuda(local_rank)),
        DeviceChoice::Auto => Ok(if cuda {
            Device::Cuda(local_rank)
        } else {
            Device::Cpu
        }),
    }
}

/// Seeds torch's RNGs and pins what libtorch lets us pin for bit-identical runs.
pub fn set_determinism(debug: &config::Debug, device: Device) -> u64 {
    let seed = debug.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            & 0x7fff_ffff
    });
    tch::manual_seed(seed as i64);
    if device.is_cuda() {
        tch::Cuda::manual_seed_all(seed);
    }
    if debug.deterministic {
        // CPU kernels split reductions by thread count: a fixed count gives a fixed order.
        // cuDNN autotuning picks kernels by timing, which varies between runs.
        tch::set_num_threads(tch::get_num_threads());
        tch::Cuda::cudnn_set_benchmark(false);
    }
    seed
}

fn count_valid(labels: &Tensor) -> i64 {
    labels.ne(IGNORE_INDEX).sum(Kind::Int64).int64_value(&[])
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

/// Writes `text` to `path` through a temporary file and a rename (never half-written).
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// `metrics.jsonl`: one JSON line per logged step or validation (full-precision values for
/// scripts and tests), appended as it happens. Every line names its run (`run_id`): launches
/// in one dump folder append to the same file, and a resumed run continues its own id.
struct MetricsFile {
    file: std::fs::File,
    path: PathBuf,
    run_id: String,
}

impl MetricsFile {
    fn open(path: PathBuf, run_id: &str) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self {
            file,
            path,
            run_id: run_id.to_string(),
        })
    }

    fn push<T: serde::Serialize>(&mut self, kind: &str, value: &T) -> Result<()> {
        use std::io::Write as _;
        let mut v = serde_json::to_value(value)?;
        v["kind"] = kind.into();
        v["run_id"] = self.run_id.as_str().into();
        let mut line = serde_json::to_string(&v)?;
        line.push('\n');
        // One write per line: a reader never sees half a line from a crash mid-buffer.
        self.file
            .write_all(line.as_bytes())
            .with_context(|| format!("appending to {}", self.path.display()))
    }
}

/// Returns freed heap memory to the OS: the Rust counterpart of torchtitan's periodic `gc`.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: glibc's malloc_trim only releases free heap pages; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Keeps freed CPU tensor memory in the heap for the next step instead of handing it back to
/// the OS at every free.
///
/// Every step allocates and frees the same activation and gradient buffers. With glibc's
/// defaults, blocks over the (dynamic) mmap threshold are fresh mmaps and the heap top is
/// trimmed as soon as it is free, so each step page-faults its whole working set in again:
/// measured on the debug model (batch 8 x 256, 25 steps), 1.75M page faults against plain
/// PyTorch's 0.54M. The freed memory is still returned every `training.gc_freq` steps.
fn keep_freed_tensor_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; glibc accepts these values (the mmap
    // threshold's maximum is 32 MiB on 64-bit).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// Mean loss over the validation split: summed CE over all batches and dp ranks / valid tokens.
/// Under pipeline parallelism each batch runs forward through the stages in microbatches of
/// the training's microbatch size; the last stage's CE is summed over the pp group.
fn validate(
    model: &Llama,
    pipeline: Option<(&Pipeline, i64)>,
    loader: &mut TextLoader,
    max_steps: Option<u64>,
    mesh: &DeviceMesh,
    step: u64,
    device: Device,
) -> Result<ValidationMetrics> {
    let start = Instant::now();
    loader.reset();
    let (mut loss_sum, mut tokens) = (0.0f64, 0i64);
    let mut batches = 0u64;
    tch::no_grad(|| -> Result<()> {
        while max_steps.is_none_or(|max| batches < max) {
            let Some(Batch {
                inputs,
                labels,
                positions,
            }) = loader.next_batch(device)?
            else {
                break;
            };
            loss_sum += match pipeline {
                Some((pipeline, microbatch_size)) => {
                    let chunk = |t: &Tensor| t.split(microbatch_size, 0);
                    let (inputs, labels, positions) =
                        (chunk(&inputs), chunk(&labels), chunk(&positions));
                    let microbatches: Vec<Microbatch<'_>> = (0..inputs.len())
                        .map(|i| Microbatch {
                            inputs: &inputs[i],
                            labels: &labels[i],
                            positions: &positions[i],
                        })
                        .collect();
                    pipeline
                        .evaluate(model, &microbatches)
                        .with_context(|| format!("validation at step {step}"))?
                }
                None => forward_pass(step, || {
                    model.summed_cross_entropy(&model.forward(&inputs, Some(&positions)), &labels)
                })?
                .double_value(&[]),
            };
            tokens += count_valid(&labels);
            batches += 1;
        }
        Ok(())
    })?;
    if pipeline.is_some() {
        // The last stage computed the CE: every stage reports it.
        loss_sum = mesh.reduce_scalars(&mesh.pp, &[loss_sum], ReduceOp::Sum)?[0];
    }
    let mut reduced = [(loss_sum, Reduce::Sum), (tokens as f64, Reduce::Sum)];
    mesh.reduce_metrics(&mut reduced)?;
    let (loss_sum, tokens) = (reduced[0].0, reduced[1].0 as i64);
    if tokens == 0 {
        bail!("the validation dataset yielded no tokens (validation.seq_len too long for it?)");
    }
    Ok(ValidationMetrics {
        step,
        loss: loss_sum / tokens as f64,
        tokens,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Runs a whole job: starts titan-obs recording under `job.dump_folder` (when
/// `observability.enable`), trains, and flushes the records, also when training fails.
pub fn run(cfg: &JobConfig, mesh: &DeviceMesh) -> Result<TrainSummary> {
    let world = mesh.mesh;
    let run_id = run_id(cfg, mesh)?;
    if cfg.observability.enable {
        titan_obs_core::init_with(
            titan_obs_core::InitOptions {
                run: cfg.job.dump_folder.clone(),
                source: titan_obs_core::Source::Trainer,
                rank: world.rank as u32,
                local_rank: world.local_rank as u32,
                world_size: world.world_size as u32,
                flush_interval: std::time::Duration::from_secs_f64(
                    cfg.observability.flush_interval_s,
                ),
            },
            titan_obs_core::Tuning {
                rotate_interval: std::time::Duration::from_secs_f64(
                    cfg.observability.rotate_interval_s,
                ),
                run_id: Some(run_id.clone()),
                ..Default::default()
            },
        )
        .context("starting titan-obs recording (observability.enable)")?;
    }
    let result = train(cfg, mesh, &run_id);
    if cfg.observability.enable {
        let _s = titan_obs_core::span("teardown");
        drop(_s);
        let finished = titan_obs_core::finish().context("flushing titan-obs records");
        if result.is_ok() {
            finished?;
        } else if let Err(e) = finished {
            tracing::warn!("{e:#}");
        }
    }
    result
}

/// This launch's run id: the one saved with the checkpoint it resumes from (a resume continues
/// its run), else a fresh one that rank 0 draws for every rank.
fn run_id(cfg: &JobConfig, mesh: &DeviceMesh) -> Result<String> {
    // Every rank joins the broadcast, resuming or not, so none waits on a collective alone.
    let seed = mesh.agree_seed(titan_obs_core::runs::draw_run_seed())?;
    let resumed = Checkpointer::new(&cfg.checkpoint, Path::new(&cfg.job.dump_folder), mesh.mesh)?
        .resume_run_id()?;
    Ok(resumed.unwrap_or_else(|| titan_obs_core::runs::run_id_from_seed(seed)))
}

/// Trains per `cfg` with the ranks behind `dp`. Init phases and per-step phases are recorded as
/// titan-obs spans; metrics go to the console, `metrics.jsonl` and titan-obs scalars.
pub fn train(cfg: &JobConfig, mesh: &DeviceMesh, run_id: &str) -> Result<TrainSummary> {
    let world = mesh.mesh;
    let device = select_device(&cfg.training, world.local_rank)
        .map_err(|e| config_error("training.device", e))?;
    keep_freed_tensor_memory();
    let seed = set_determinism(&cfg.debug, device);
    // Every rank draws the model from rank 0's seed and keeps its part.
    let seed = mesh.agree_seed(seed)?;
    set_determinism(
        &config::Debug {
            seed: Some(seed),
            ..cfg.debug.clone()
        },
        device,
    );
    let dump_folder = PathBuf::from(&cfg.job.dump_folder);
    std::fs::create_dir_all(&dump_folder)
        .with_context(|| format!("creating job.dump_folder {}", dump_folder.display()))?;
    if world.rank == 0 {
        let resolved = toml::to_string(cfg).context("serializing the resolved config")?;
        write_atomic(&dump_folder.join("config.toml"), &resolved)?;
    }
    tracing::info!(
        device = ?device,
        seed,
        rank = world.rank,
        world_size = world.world_size,
        threads = tch::get_num_threads(),
        run_id,
        "starting titan-train"
    );

    let tokenizer = {
        let _s = titan_obs_core::span("tokenizer");
        Arc::new(if cfg.model.hf_assets_path.is_empty() {
            TextTokenizer::embedded()?
        } else {
            TextTokenizer::from_dir(Path::new(&cfg.model.hf_assets_path))?
        })
    };

    // Pipeline parallelism: each step's local batch runs as microbatches through the stages
    // (torchtitan's loader then yields `pipeline_parallel_microbatch_size` samples a batch).
    let pipeline_cfg = (world.pp > 1)
        .then(|| pipeline_config(&cfg.parallelism, world.pp, &cfg.training))
        .transpose()?;
    if let Some(p) = pipeline_cfg
        .as_ref()
        .filter(|p| p.schedule.splits_backward())
    {
        refuse_with_split_backward(cfg, world.dp_degree(), p.schedule)?;
    }
    let loader_batch = pipeline_cfg
        .as_ref()
        .map_or(cfg.training.local_batch_size, |p| p.microbatch_size);
    let (dp_rank, dp_degree) = (world.dp_rank() as u64, world.dp_degree() as u64);
    let (mut train_loader, mut val_loader) = {
        let _s = titan_obs_core::span("dataloader");
        let t = &cfg.training;
        let train_set = Dataset::resolve(&t.dataset, t.dataset_path.as_deref(), "training")
            .map_err(|e| config_error("training.dataset", e))?;
        let train_loader = TextLoader::new(
            train_set,
            tokenizer.clone(),
            t.seq_len as usize,
            loader_batch as usize,
            dp_rank,
            dp_degree,
            true,
        );
        let v = &cfg.validation;
        let (val_batch, val_seq_len) = v.batch_shape(t);
        let val_loader = if v.enable {
            let set = Dataset::resolve(&v.dataset, v.dataset_path.as_deref(), "validation")
                .map_err(|e| config_error("validation.dataset", e))?;
            Some(TextLoader::new(
                set,
                tokenizer.clone(),
                val_seq_len,
                val_batch,
                dp_rank,
                dp_degree,
                false,
            ))
        } else {
            None
        };
        (train_loader, val_loader)
    };

    let model = {
        let _s = titan_obs_core::span("model_build");
        let mut args =
            ModelArgs::flavor(&cfg.model.flavor).map_err(|e| config_error("model.flavor", e))?;
        if tokenizer.vocab_size() as i64 > args.vocab_size {
            bail!(
                "the tokenizer has {} ids but model flavor {} has vocab_size {}",
                tokenizer.vocab_size(),
                cfg.model.flavor,
                args.vocab_size
            );
        }
        let (_, val_seq_len) = cfg.validation.batch_shape(&cfg.training);
        args.max_seq_len = cfg.training.seq_len.max(val_seq_len as i64);
        let plan = ParallelPlan::new(
            mesh,
            &cfg.parallelism,
            precision::param_kind(&cfg.training),
            cfg.training.mixed_precision_reduce.kind(),
        );
        let stages = match &pipeline_cfg {
            None => vec![(0, StageModules::whole(args.n_layers as usize))],
            Some(p) => {
                let all = pipeline::split_stages(p, args.n_layers as usize)
                    .map_err(|e| config_error("parallelism.pipeline_parallel_degree", e))?;
                let pp_rank = world.coord(Dim::Pp);
                all.into_iter()
                    .enumerate()
                    .filter(|(s, _)| pipeline::rank_of_stage(*s, world.pp) == pp_rank)
                    .collect()
            }
        };
        let model = Llama::new_stages(args, device, &plan, stages)
            .map_err(|e| config_error("parallelism.tensor_parallel_degree", e))?
            .with_checkpointing(cfg.activation_checkpoint.policy())
            .with_attn_backend(cfg.model.attn_backend, precision::param_kind(&cfg.training));
        if cfg.training.dtype != DtypeName::Float32 {
            model.cast_parameters(cfg.training.dtype.kind());
        }
        let float8 = Float8Training::from_config(cfg);
        if let Some(f8) = &float8
            && let Err(e) = float8::probe(f8.backend, device)
        {
            bail!(config_error(
                "float8.emulate",
                anyhow::anyhow!(
                    "float8 matmuls need torch._scaled_mm, which does not run on {device:?} \
                     ({e}); set float8.emulate true to multiply the float8 values in float32"
                )
            ));
        }
        let (model, converted) = model.with_float8(float8.as_ref());
        if let Some(f8) = &float8 {
            tracing::info!(
                "float8 training ({}, {}) of {} linears (the others in high precision): {}",
                f8.recipe.name(),
                match f8.backend {
                    float8::Backend::ScaledMm => "torch._scaled_mm",
                    float8::Backend::Emulated => "emulated",
                },
                converted.len(),
                converted.join(", ")
            );
            if f8.fsdp_all_gather {
                if world.dp_shard > 1 {
                    tracing::info!(
                        "FSDP gathers the float8 linears' weights in float8{}",
                        if f8.precompute_scales {
                            ", with scales precomputed after each optimizer step"
                        } else {
                            ""
                        }
                    );
                } else {
                    tracing::warn!(
                        "float8.enable_fsdp_float8_all_gather does nothing here: FSDP shards \
                         nothing (parallelism.data_parallel_shard_degree is 1)"
                    );
                }
            }
        }
        model
    };
    if world.tp > 1 && cfg.parallelism.disable_loss_parallel {
        bail!(config_error(
            "parallelism.disable_loss_parallel",
            anyhow::anyhow!(
                "titan-train's tensor parallelism always takes the loss over vocab-sharded \
                 logits (torchtitan 0.3.0 has no other way)"
            )
        ));
    }
    let (n_params, _) = model.args.num_params();
    let flops_per_token = model.args.flops_per_token(cfg.training.seq_len);
    // What this rank holds of the model: its parameter parts, and as many again for their
    // gradients and twice that for AdamW's moments (in the parameters' dtype).
    let (local_params, local_bytes) =
        model
            .named_parameters()
            .iter()
            .fold((0i64, 0usize), |(n, b), (_, t)| {
                (
                    n + t.numel() as i64,
                    b + t.numel() * t.kind().elt_size_in_bytes(),
                )
            });
    tracing::info!(
        flavor = cfg.model.flavor,
        params = n_params,
        params_on_this_rank = local_params,
        model_state_mib_on_this_rank = (4 * local_bytes) as f64 / (1 << 20) as f64,
        flops_per_token,
        param_dtype = ?precision::param_kind(&cfg.training),
        dp_replicate = world.dp_replicate,
        dp_shard = world.dp_shard,
        tp = world.tp,
        activation_checkpointing = ?model.checkpointing(),
        attn_backend = ?model.attn_backend(),
        "model built"
    );

    let pipeline = match &pipeline_cfg {
        None => None,
        Some(p) => {
            let stages = pipeline::split_stages(p, model.args.n_layers as usize)?;
            let microbatches = (cfg.training.local_batch_size / p.microbatch_size) as usize;
            let pipeline = Pipeline::new(mesh, p, stages, microbatches)
                .map_err(|e| config_error("parallelism.pipeline_parallel_schedule", e))?;
            tracing::info!(
                schedule = pipeline.schedule.name(),
                stages = pipeline.stages.len(),
                stages_on_this_rank = ?pipeline.local_stages,
                microbatches,
                "pipeline parallelism"
            );
            Some(pipeline)
        }
    };

    let params: Vec<(String, Tensor)> = model
        .named_parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let n_micro = microbatches(&cfg.training, world.dp_degree())
        .map_err(|e| config_error("training.global_batch_size", e))?;
    let (mut optimizer, schedule) = {
        let _s = titan_obs_core::span(titan::OPTIMIZER);
        (
            AdamW::new((&cfg.optimizer).into()),
            LrSchedule::new(&cfg.lr_scheduler, cfg.optimizer.lr, cfg.training.steps),
        )
    };
    let mut checkpointer = Checkpointer::new(&cfg.checkpoint, &dump_folder, world)?
        .with_hf_assets(&cfg.model.hf_assets_path)
        .with_rank_sync(mesh.rank_sync())
        .with_run_id(run_id);
    let resumed_step = {
        let _s = titan_obs_core::span(titan::CHECKPOINT);
        checkpointer.load(&mut TrainerState {
            model: &model,
            optimizer: &mut optimizer,
            loader: &mut train_loader,
            schedule: &schedule,
        })?
    };

    let peak_flops = metrics::peak_flops(device, cfg.metrics.peak_tflops);
    let mut metrics_file = if world.rank == 0 {
        Some(MetricsFile::open(
            dump_folder.join("metrics.jsonl"),
            run_id,
        )?)
    } else {
        None
    };
    let mut tensorboard =
        if cfg.metrics.enable_tensorboard && (world.rank == 0 || cfg.metrics.save_for_all_ranks) {
            let dir = EventWriter::run_dir(
                &dump_folder,
                &cfg.metrics.save_tb_folder,
                cfg.metrics.save_for_all_ranks.then_some(world.rank),
            );
            let writer = EventWriter::create(&dir).context("metrics.enable_tensorboard")?;
            tracing::info!("TensorBoard events in {}", writer.path().display());
            Some(writer)
        } else {
            None
        };
    let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
    let mut summary = TrainSummary {
        dump_folder: dump_folder.clone(),
        run_id: run_id.to_string(),
        steps: 0,
        first_loss: None,
        last_loss: None,
        last_validation_loss: None,
    };
    let mut window = metrics::ThroughputWindow::new(Instant::now());
    // A live step counter on rank 0's terminal; log lines print above it.
    let progress = console::Steps::start(resumed_step, cfg.training.steps, world.rank == 0);

    for step in resumed_step + 1..=cfg.training.steps {
        titan_obs_core::set_step(step);
        let step_span = titan_obs_core::span(vocab::STEP);
        let lr = optimizer.next_lr(schedule.lr_for_step(step));

        // Under pipeline parallelism each accumulation step is the pipeline's microbatches.
        let per_pass = pipeline.as_ref().map_or(1, |p| p.microbatches);
        let batches: Vec<Batch> = {
            let _s = titan_obs_core::span(titan::DATA_LOADING);
            (0..n_micro * per_pass)
                .map(|_| {
                    train_loader
                        .next_batch(device)?
                        .context("the training dataset yielded no batch")
                })
                .collect::<Result<_>>()?
        };
        let local_tokens: i64 = batches.iter().map(|b| count_valid(&b.labels)).sum();
        let global_tokens = mesh.global_valid_tokens(local_tokens)?;
        let step_input_tokens = batches.iter().map(|b| b.inputs.numel() as i64).sum::<i64>();
        window.add_tokens(step_input_tokens);

        let mut local_loss = 0.0f64;
        if let Some(pipeline) = &pipeline {
            let _s = titan_obs_core::span(titan::FORWARD_BACKWARD);
            for pass in batches.chunks(per_pass) {
                let microbatches: Vec<Microbatch<'_>> = pass
                    .iter()
                    .map(|b| Microbatch {
                        inputs: &b.inputs,
                        labels: &b.labels,
                        positions: &b.positions,
                    })
                    .collect();
                local_loss += pipeline
                    .run(&model, &microbatches, global_tokens)
                    .with_context(|| format!("step {step}"))?;
            }
            // The last stage computed the loss: every stage reports it (and stops on it).
            local_loss = mesh.reduce_scalars(&mesh.pp, &[local_loss], ReduceOp::Sum)?[0];
        } else {
            let _s = titan_obs_core::span(titan::FORWARD_BACKWARD);
            for batch in &batches {
                let _m = titan_obs_core::span(titan::MICROBATCH);
                let loss = {
                    let _f = titan_obs_core::span(titan::FORWARD);
                    // Sum over valid tokens / the GLOBAL count: summing gradients over ranks
                    // and microbatches then gives the mean over every token of the step.
                    forward_pass(step, || {
                        let logits = model.forward(&batch.inputs, Some(&batch.positions));
                        model.summed_cross_entropy(&logits, &batch.labels)
                            / global_tokens.max(1) as f64
                    })?
                };
                {
                    let _b = titan_obs_core::span(titan::BACKWARD);
                    // A collective that fails in backward (a rank died) fails the pass.
                    loss.f_backward()
                        .map_err(|e| anyhow::anyhow!("step {step}: backward: {e}"))?;
                }
                local_loss += loss.double_value(&[]);
            }
        }
        // FSDP's gradient reductions ran behind backward: collect them (a failed collective
        // fails the step, naming it).
        let _ = forward_pass(step, || {
            model.finish_gradients();
            Tensor::new()
        })
        .context("reducing gradients")?;
        // Sequence-parallel norms saw part of the sequence: sum their gradients over tp.
        reduce_partial_grads(mesh, &model)?;

        let grad_norm = {
            let _s = titan_obs_core::span(titan::OPTIMIZER);
            let grad_norm = {
                let _c = titan_obs_core::span(titan::CLIP);
                let norm = grad_norm(mesh, &model)?;
                optim::clip_grads(&tensors, cfg.training.max_norm, norm)?;
                norm
            };
            {
                let _o = titan_obs_core::span(titan::OPTIMIZER_STEP);
                for (name, p) in &params {
                    optimizer.step_param(name, p, lr)?;
                }
                optim::clear_grads(&tensors);
                if cfg.float8_enabled()
                    && cfg.float8.enable_fsdp_float8_all_gather
                    && cfg.float8.precompute_float8_dynamic_scale_for_fsdp
                {
                    model.precompute_float8_scales();
                }
            }
            {
                let _l = titan_obs_core::span(titan::LR);
                // The schedule is a pure function of the step; next step's lr is computed at
                // its start. Kept as a phase for torchtitan parity.
            }
            grad_norm
        };

        if !local_loss.is_finite() {
            step_span.error(&format!("loss is {local_loss}"));
            bail!("step {step}: loss is {local_loss}; lower optimizer.lr or check the data");
        }

        if step == 1 || step % cfg.metrics.log_freq == 0 || step == cfg.training.steps {
            let _s = titan_obs_core::span(titan::COLLECT_DIST_METRICS);
            let tps = window.tokens_per_second(Instant::now());
            let (rss, peak_rss) = metrics::rss_bytes();
            let memory = if device.is_cuda() {
                metrics::cuda_process_memory_bytes().unwrap_or(0)
            } else {
                rss
            };
            let gib = (1u64 << 30) as f64;
            let per_rank =
                |loss: f64, grad_norm: f64, memory: f64, tps: f64, tokens: i64| StepMetrics {
                    step,
                    loss,
                    grad_norm,
                    lr,
                    memory_gib: memory / gib,
                    peak_rss_gib: peak_rss as f64 / gib,
                    tps,
                    tflops: flops_per_token * tps / 1e12,
                    mfu_pct: 100.0 * flops_per_token * tps / peak_flops,
                    tokens,
                    on_cuda: device.is_cuda(),
                };
            // titan-obs gets this rank's values (its own mean loss, tps, memory) and reduces
            // them across ranks later; the console shows the cross-rank reductions now.
            let own_loss = local_loss * global_tokens as f64 / local_tokens.max(1) as f64;
            let own = per_rank(own_loss, grad_norm, memory as f64, tps, local_tokens);
            for (name, value, reduce) in own.scalars() {
                titan_obs_core::scalar(name, value, reduce);
            }
            let mut reduced = [
                (local_loss, Reduce::Sum),
                (grad_norm, Reduce::Max),
                (memory as f64, Reduce::Max),
                (tps, Reduce::Mean),
            ];
            mesh.reduce_metrics(&mut reduced)?;
            let [loss, grad_norm, memory, tps] = reduced.map(|(v, _)| v);
            let m = per_rank(loss, grad_norm, memory, tps, global_tokens);
            if let Some(file) = metrics_file.as_mut() {
                tracing::info!("{}", m.console_line());
                file.push("train", &m)?;
                progress.loss(m.loss);
            }
            if let Some(tb) = tensorboard.as_mut() {
                tb.scalars(step, &m.console_scalars())?;
            }
            summary.first_loss.get_or_insert(m.loss);
            summary.last_loss = Some(m.loss);
            window.restart(Instant::now());
        }

        if let Some(loader) = val_loader.as_mut()
            && step % cfg.validation.freq == 0
        {
            let _s = titan_obs_core::span(titan::VALIDATION);
            titan_obs_core::add_step_tag(titan::VALIDATION);
            let staged = pipeline
                .as_ref()
                .zip(pipeline_cfg.as_ref())
                .map(|(p, c)| (p, c.microbatch_size));
            let v = validate(
                &model,
                staged,
                loader,
                cfg.validation.steps,
                mesh,
                step,
                device,
            )?;
            titan_obs_core::scalar("validation/loss", v.loss, Reduce::Mean);
            if let Some(file) = metrics_file.as_mut() {
                tracing::info!("{}", v.console_line());
                file.push("validation", &v)?;
            }
            if let Some(tb) = tensorboard.as_mut() {
                tb.scalars(step, &v.console_scalars())?;
            }
            summary.last_validation_loss = Some(v.loss);
            // Validation time is not training time: the next logged throughput leaves it out
            // (its tokens are the steps' since the last logged step).
            window.exclude(std::time::Duration::from_secs_f64(v.seconds));
        }

        if cfg.training.gc_freq > 0 && step % cfg.training.gc_freq == 0 {
            let _s = titan_obs_core::span(titan::GC);
            titan_obs_core::add_step_tag(titan::GC);
            release_free_memory();
        }
        checkpointer.after_step(
            step,
            cfg.training.steps,
            step_input_tokens as u64 * world.dp_degree() as u64,
            &TrainerState {
                model: &model,
                optimizer: &mut optimizer,
                loader: &mut train_loader,
                schedule: &schedule,
            },
        )?;
        summary.steps = step;
        progress.step(step);
        drop(step_span);
    }
    checkpointer.finish()?;
    Ok(summary)
}

/// Runs a forward pass, turning a failure inside it (a collective whose peer died: the model's
/// ops fail as tch's do, by panicking) into an error naming the step.
fn forward_pass(step: u64, f: impl FnOnce() -> Tensor) -> Result<Tensor> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        anyhow::anyhow!(
            "step {step}: forward: {}",
            crate::autograd::panic_text(panic)
        )
    })
}

/// Sums over the tp ranks the gradients that are partial there: the norms' under sequence
/// parallelism (each rank normalised its part of the sequence).
fn reduce_partial_grads(mesh: &DeviceMesh, model: &Llama) -> Result<()> {
    if !model.sequence_parallel() {
        return Ok(());
    }
    let grads: Vec<Tensor> = model
        .named_parameters()
        .iter()
        .zip(model.placements())
        .filter(|(_, p)| p.tp_dim.is_none())
        .map(|((_, t), _)| t.grad())
        .filter(|g| g.defined())
        .collect();
    if grads.is_empty() {
        return Ok(());
    }
    tch::no_grad(|| -> Result<()> {
        let flat = Tensor::cat(
            &grads.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(),
            0,
        );
        mesh.tp.all_reduce(&flat, ReduceOp::Sum)?;
        let mut at = 0;
        for g in &grads {
            let n = g.numel() as i64;
            g.shallow_clone().copy_(&flat.narrow(0, at, n).view_as(g));
            at += n;
        }
        Ok(())
    })
}

/// The pipeline settings of `[parallelism]`, checked as torchtitan checks them.
fn pipeline_config(
    p: &config::Parallelism,
    degree: usize,
    training: &config::Training,
) -> Result<PipelineConfig> {
    let schedule = Schedule::parse(&p.pipeline_parallel_schedule)
        .map_err(|e| config_error("parallelism.pipeline_parallel_schedule", anyhow::anyhow!(e)))?;
    let microbatch_size = p.pipeline_parallel_microbatch_size;
    if microbatch_size <= 0 {
        bail!(config_error(
            "parallelism.pipeline_parallel_microbatch_size",
            anyhow::anyhow!("must be at least 1, got {microbatch_size}")
        ));
    }
    if training.local_batch_size % microbatch_size != 0 {
        bail!(config_error(
            "parallelism.pipeline_parallel_microbatch_size",
            anyhow::anyhow!(
                "Batch size {} must be divisible by microbatch_size {microbatch_size}. Update \
                 the config arguments for either batch_size or pipeline_parallel_microbatch_size.",
                training.local_batch_size
            )
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
/// weight pass hands each linear's gradient to the parameter itself, which FSDP's and DDP's
/// per-unit reductions, the activation-checkpoint recompute and float8's own backward would not
/// see.
fn refuse_with_split_backward(cfg: &JobConfig, dp_degree: usize, schedule: Schedule) -> Result<()> {
    let name = schedule.name();
    let refuse = |key: &str, why: String| -> Result<()> {
        bail!(config_error(
            key,
            anyhow::anyhow!(
                "{why}; schedule {name} runs with pipeline and tensor parallelism only"
            )
        ))
    };
    if dp_degree > 1 {
        refuse(
            "parallelism.data_parallel_shard_degree",
            format!("data parallelism ({dp_degree} replicas) is not implemented with {name}"),
        )?;
    }
    if cfg.activation_checkpoint.mode != config::AcMode::None {
        refuse(
            "activation_checkpoint.mode",
            format!("activation checkpointing is not implemented with {name}"),
        )?;
    }
    if Float8Training::from_config(cfg).is_some() {
        refuse(
            "float8.enable_float8_linear",
            format!("float8 linears are not implemented with {name}"),
        )?;
    }
    Ok(())
}

/// The total 2-norm of all gradients over the mesh, as torch's `clip_grad_norm_` computes it
/// for sharded parameters: fp32 norms of the local parts, their squares summed over the ranks
/// that hold different parts (`dp_shard`, and `tp` for tp-split parameters).
fn grad_norm(mesh: &DeviceMesh, model: &Llama) -> Result<f64> {
    let grads = model.grads_as_torchtitan_parameters();
    let local = |split: bool| -> f64 {
        let part: Vec<Tensor> = grads
            .iter()
            .filter(|(_, s)| *s == split)
            .map(|(g, _)| g.shallow_clone())
            .collect();
        optim::total_grad_norm(&part).powi(2)
    };
    if mesh.mesh.world_size == 1 {
        let all: Vec<Tensor> = grads.into_iter().map(|(g, _)| g).collect();
        return Ok(optim::total_grad_norm(&all));
    }
    let sums = mesh.reduce_scalars(&mesh.dp_shard, &[local(true), local(false)], ReduceOp::Sum)?;
    let split = mesh.reduce_scalars(&mesh.tp, &[sums[0]], ReduceOp::Sum)?;
    // Each pipeline stage's squared norm, summed over the stages (torchtitan's pp_mesh sum).
    let stages = mesh.reduce_scalars(&mesh.pp, &[split[0] + sums[1]], ReduceOp::Sum)?;
    Ok(stages[0].sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microbatch_count_follows_global_batch() {
        let mut t = config::Training {
            local_batch_size: 4,
            ..Default::default()
        };
        assert_eq!(microbatches(&t, 1).unwrap(), 1);
        t.global_batch_size = Some(16);
        assert_eq!(microbatches(&t, 2).unwrap(), 2);
        t.global_batch_size = Some(10);
        assert!(microbatches(&t, 1).is_err());
    }

    #[test]
    fn cross_entropy_ignores_masked_labels() {
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 0.5, 0.5, 0.5]).view([1, 2, 3]);
        let labels = Tensor::from_slice(&[2i64, IGNORE_INDEX]).view([1, 2]);
        let got =
            crate::parallelize::tp::TensorParallel::new(crate::distributed::Group::solo(), false)
                .cross_entropy_sum(&logits, &labels)
                .double_value(&[]);
        let want = -(2.0f64.exp() / (1.0 + 1f64.exp() + 2f64.exp())).ln();
        assert!((got - want).abs() < 1e-6);
        assert_eq!(count_valid(&labels), 1);
    }
}
