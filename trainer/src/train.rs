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
use titan_obs_core::vocab::{self, moe, titan};

use crate::checkpoint::{Checkpointer, TrainerState};
use crate::config::{self, DeviceChoice, JobConfig};
use crate::console;
use crate::data::{Batch, Dataset, PrefetchLoader, TextLoader, TextTokenizer};
use crate::distributed::{DeviceMesh, ReduceOp};
use crate::gpu_clock;
use crate::host_sync;
use crate::lr_scheduler::LrSchedule;
use crate::metrics::{self, StepMetrics, ValidationMetrics};
use crate::model::ModelArgs;
use crate::optim::{self, AdamW};
use crate::parallelize::layout::{check_layout, microbatches};
use crate::parallelize::pipeline::{Microbatch, Pipeline, PipelineConfig};
use crate::parallelize::{NormGroup, ParallelModel, TokenLayout, parallelize};
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
    config::ConfigError::invalid(key, format!("{e:#}")).into()
}

/// Picks the device: CUDA `local_rank` when available (or demanded), else CPU. Over the cpu
/// backend (`comm.backend = "cpu"`) ranks beyond the node's GPUs share them round-robin; NCCL
/// needs a GPU per rank.
pub fn select_device(
    training: &config::Training,
    comm: &config::Comm,
    local_rank: usize,
) -> Result<Device> {
    let cuda = tch::Cuda::is_available();
    let gpu = || -> Result<Device> {
        let count = tch::Cuda::device_count().max(1) as usize;
        if local_rank < count {
            Ok(Device::Cuda(local_rank))
        } else if comm.backend == config::CommBackend::Cpu {
            Ok(Device::Cuda(local_rank % count))
        } else {
            bail!(
                "local rank {local_rank} has no GPU of its own: this node has {count}; run at \
                 most {count} ranks per node, or set comm.backend = \"cpu\" to let ranks share \
                 GPUs (host-staged collectives)"
            )
        }
    };
    match training.device {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda if !cuda => {
            bail!("training.device = cuda, but no CUDA device is available")
        }
        DeviceChoice::Cuda => gpu(),
        DeviceChoice::Auto if cuda => gpu(),
        DeviceChoice::Auto => Ok(Device::Cpu),
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
    model: &ParallelModel,
    pipeline: Option<(&Pipeline, i64)>,
    loader: &mut PrefetchLoader,
    max_steps: Option<u64>,
    mesh: &DeviceMesh,
    step: u64,
    device: Device,
) -> Result<ValidationMetrics> {
    let start = Instant::now();
    loader.reset()?;
    // Summed on the device and read once at the end (torchtitan's validator reads once too).
    let mut loss_sum = Tensor::zeros([], (Kind::Double, device));
    let mut tokens = 0i64;
    let mut batches = 0u64;
    // torchtitan's `model.eval()`: what only training does (the experts' token counts) is off.
    model.set_training(false);
    let passes = tch::no_grad(|| -> Result<()> {
        while max_steps.is_none_or(|max| batches < max) {
            let Some(batch) = loader.next_batch(device)? else {
                break;
            };
            // The whole sequences' tokens, once per context-parallel group: the reduction
            // below sums over data x context ranks.
            if mesh.cp.rank() == 0 {
                tokens += batch.valid_tokens;
            }
            let batch = model.shard_batch(batch);
            loss_sum += match pipeline {
                Some((pipeline, microbatch_size)) => {
                    let chunk = |t: &Tensor| t.split(microbatch_size, 0);
                    let (inputs, labels, positions) = (
                        chunk(&batch.inputs),
                        chunk(&batch.labels),
                        chunk(&batch.positions),
                    );
                    let masks = batch.cp_mask.as_ref().map(chunk);
                    // The loader's document offsets are the whole batch's: each microbatch's
                    // are found on the device (a read per forward; validation only).
                    let microbatches: Vec<Microbatch<'_>> = (0..inputs.len())
                        .map(|i| Microbatch {
                            inputs: &inputs[i],
                            labels: &labels[i],
                            layout: TokenLayout {
                                positions: Some(&positions[i]),
                                documents: None,
                                cp_mask: masks.as_ref().map(|m| &m[i]),
                            },
                        })
                        .collect();
                    pipeline
                        .evaluate(model, &microbatches)
                        .with_context(|| format!("validation at step {step}"))?
                }
                None => forward_pass(step, || {
                    let logits = model.forward_with(&batch.inputs, TokenLayout::of(&batch));
                    model.summed_cross_entropy(&logits, &batch.labels)
                })?
                .to_kind(Kind::Double),
            };
            batches += 1;
        }
        Ok(())
    });
    model.set_training(true);
    // Under pipeline parallelism the units kept their gathers for the passes.
    model.release_gathered();
    passes?;
    let mut loss_sum = host_sync::read_f64(&loss_sum, "validation loss");
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
    // Before the model and the data exist: every tensor they allocate is counted.
    metrics::count_cpu_tensor_bytes().map_err(|e| anyhow::anyhow!("counting tensor bytes: {e}"))?;
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
    // The GPU lane's last spans, once the device has run them, before the parts close.
    gpu_clock::finish();
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
///
/// Read top to bottom: build the job ([`Job::build`]: device, data, model, pipeline, optimizer,
/// checkpoint), then each step loads its microbatches, runs forward/backward
/// ([`Job::forward_backward`]), reduces and clips the gradients and steps the optimizer
/// ([`Job::optimizer_step`]), logs ([`Job::log_step`]), validates and checkpoints.
pub fn train(cfg: &JobConfig, mesh: &DeviceMesh, run_id: &str) -> Result<TrainSummary> {
    let mut job = Job::build(cfg, mesh, run_id)?;
    let mut summary = TrainSummary {
        dump_folder: job.dump_folder.clone(),
        run_id: run_id.to_string(),
        steps: 0,
        first_loss: None,
        last_loss: None,
        last_validation_loss: None,
    };
    if cfg.checkpoint.create_seed_checkpoint {
        // torchtitan's seed checkpoint: the initialised model saved as the last step 0 (model
        // only unless `last_save_model_only = false`, in `last_save_*`'s format and dtype), no
        // step trained; a full one holds the optimizer state torch's DCP initialises.
        job.optimizer
            .init_state_as_torch_checkpoints_do(&job.params);
        job.checkpoint_after(0, 0, 0)?;
        job.checkpointer.finish()?;
        tracing::info!("Created seed checkpoint");
        return Ok(summary);
    }
    let mut window = metrics::ThroughputWindow::new(Instant::now());
    // A live step counter on rank 0's terminal; log lines print above it.
    let progress = console::Steps::start(job.resumed_step, cfg.training.steps, mesh.mesh.rank == 0);

    // Reads before the first step (building, loading a checkpoint) belong to no step.
    host_sync::take();
    for step in job.resumed_step + 1..=cfg.training.steps {
        titan_obs_core::set_step(step);
        let step_span = titan_obs_core::span(vocab::STEP);
        let lr = job.optimizer.next_lr(job.schedule.lr_for_step(step));

        let batches = job.load_batches()?;
        // Counted by the loader on the host: no read back from the device.
        let local_tokens: i64 = batches.iter().map(|b| b.valid_tokens).sum();
        let global_tokens = job.global_tokens(local_tokens)?;
        let step_input_tokens = batches.iter().map(|b| b.inputs.numel() as i64).sum::<i64>();
        window.add_tokens(step_input_tokens);
        // Counted before context parallelism keeps this rank's part of each sequence, as
        // torchtitan counts them (and divides throughput by cp x tp x pp).
        let batches: Vec<Batch> = batches
            .into_iter()
            .map(|b| job.model.shard_batch(b))
            .collect();

        // The loss and the norm stay on the device; only a step that logs reads them (as
        // torchtitan, whose loop reads nothing on the others): the host runs ahead of the GPU.
        let local_loss = job.forward_backward(&batches, &global_tokens.tensor, step)?;
        let grad_norm = job.optimizer_step(lr)?;

        if step == 1 || step % cfg.metrics.log_freq == 0 || step == cfg.training.steps {
            let local_loss = job.read_loss(&local_loss)?;
            if !local_loss.is_finite() {
                step_span.error(&format!("loss is {local_loss}"));
                bail!("step {step}: loss is {local_loss}; lower optimizer.lr or check the data");
            }
            let grad_norm = host_sync::read_f64(&grad_norm, "grad norm");
            let global_tokens = match global_tokens.host {
                Some(n) => n,
                None => host_sync::read_i64(&global_tokens.tensor, "global tokens"),
            };
            let logged = job.log_step(
                StepFigures {
                    step,
                    lr,
                    local_loss,
                    grad_norm,
                    local_tokens,
                    global_tokens,
                },
                &window,
                &progress,
            )?;
            summary.first_loss.get_or_insert(logged);
            summary.last_loss = Some(logged);
            window.restart(Instant::now());
        }
        if job.val_loader.is_some() && step % cfg.validation.freq == 0 {
            let v = job.validate(step)?;
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
        job.checkpoint_after(
            step,
            cfg.training.steps,
            step_input_tokens as u64 * mesh.mesh.dp_degree() as u64,
        )?;
        // This step's reads to the host, for `titan-obs summary` (0 unless it logged or
        // validated).
        titan_obs_core::scalar(host_sync::SCALAR, host_sync::take() as f64, Reduce::Max);
        summary.steps = step;
        progress.step(step);
        drop(step_span);
    }
    job.checkpointer.finish()?;
    Ok(summary)
}

/// Everything one rank trains with, built once by [`Job::build`].
struct Job<'a> {
    cfg: &'a JobConfig,
    mesh: &'a DeviceMesh,
    device: Device,
    dump_folder: PathBuf,
    model: ParallelModel,
    /// Under pipeline parallelism: the schedule that drives the model, and its settings.
    pipeline: Option<(Pipeline, PipelineConfig)>,
    /// The model's parameters (shallow clones) as the optimizer and clipping address them.
    params: Vec<(String, Tensor)>,
    optimizer: AdamW,
    schedule: LrSchedule,
    train_loader: PrefetchLoader,
    val_loader: Option<PrefetchLoader>,
    checkpointer: Checkpointer,
    resumed_step: u64,
    /// Gradient-accumulation microbatches per step (each a pipeline pass under PP).
    accumulation: usize,
    flops_per_token: f64,
    peak_flops: f64,
    /// Rank 0's `metrics.jsonl`.
    metrics_file: Option<MetricsFile>,
    /// Mixture-of-experts runs: this rank's MoE layers and the tokens its routers sent to each
    /// expert since the last logged step (summed on the device; recorded for titan-obs when a
    /// step logs).
    expert_load: Option<(Vec<usize>, Tensor)>,
    tensorboard: Option<EventWriter>,
}

/// A step's valid-token count over the data-parallel ranks: the loss denominator.
struct GlobalTokens {
    /// A 0-dim int64 on the device, at least 1 (the loss is divided by it there, as
    /// torchtitan divides by its device tensor).
    tensor: Tensor,
    /// The count, where the host knows it without a read (one data-parallel rank).
    host: Option<i64>,
}

/// One step's figures before they are reduced over the mesh for the log.
struct StepFigures {
    step: u64,
    lr: f64,
    /// This rank's share of the step's mean loss (summed over the mesh it is the mean).
    local_loss: f64,
    grad_norm: f64,
    local_tokens: i64,
    global_tokens: i64,
}

impl<'a> Job<'a> {
    /// Builds the job: device and seed, data, model (split by the plan), pipeline, optimizer
    /// and schedule, then loads the checkpoint to resume from, if any.
    fn build(cfg: &'a JobConfig, mesh: &'a DeviceMesh, run_id: &str) -> Result<Self> {
        let world = mesh.mesh;
        let (device, dump_folder) = prepare_process(cfg, mesh, run_id)?;
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
        let pipeline_cfg = check_layout(cfg, &world)?;
        let loader_batch = pipeline_cfg
            .as_ref()
            .map_or(cfg.training.local_batch_size, |p| p.microbatch_size);
        let (mut train_loader, val_loader) = {
            let _s = titan_obs_core::span("dataloader");
            build_loaders(cfg, mesh, &tokenizer, loader_batch as usize)?
        };
        let (model, pipeline) = {
            let _s = titan_obs_core::span("model_build");
            build_model(cfg, mesh, device, &tokenizer, pipeline_cfg.as_ref())?
        };
        let flops_per_token = model.args.flops_per_token(cfg.training.seq_len);
        log_model(cfg, mesh, &model, flops_per_token);
        let pipeline = pipeline.zip(pipeline_cfg);

        let params: Vec<(String, Tensor)> = model
            .named_parameters()
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let accumulation = microbatches(&cfg.training, world.dp_degree())
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
        // A seed checkpoint is made from the initialised model alone (torchtitan loads nothing).
        let seeding = cfg.checkpoint.create_seed_checkpoint;
        let resumed_step = if seeding {
            0
        } else {
            let _s = titan_obs_core::span(titan::CHECKPOINT);
            checkpointer.load(&mut TrainerState {
                model: &model,
                optimizer: &mut optimizer,
                loader: &mut train_loader,
                schedule: &schedule,
            })?
        };
        let (metrics_file, tensorboard) = if seeding {
            (None, None)
        } else {
            open_metric_outputs(cfg, mesh, &dump_folder, run_id)?
        };
        Ok(Job {
            cfg,
            mesh,
            device,
            dump_folder,
            model,
            pipeline,
            params,
            optimizer,
            schedule,
            train_loader,
            val_loader,
            checkpointer,
            resumed_step,
            accumulation,
            flops_per_token,
            peak_flops: metrics::peak_flops(device, cfg.metrics.peak_tflops),
            metrics_file,
            tensorboard,
            expert_load: None,
        })
    }

    /// Hands the checkpointer the state after `step` of `total_steps` (it saves when due).
    fn checkpoint_after(&mut self, step: u64, total_steps: u64, step_tokens: u64) -> Result<()> {
        self.checkpointer.after_step(
            step,
            total_steps,
            step_tokens,
            &TrainerState {
                model: &self.model,
                optimizer: &mut self.optimizer,
                loader: &mut self.train_loader,
                schedule: &self.schedule,
            },
        )
    }

    /// The step's batches: `accumulation` microbatches, each a pipeline pass's microbatches
    /// under pipeline parallelism.
    fn load_batches(&mut self) -> Result<Vec<Batch>> {
        let per_pass = self.pipeline.as_ref().map_or(1, |(p, _)| p.microbatches);
        let _s = titan_obs_core::span(titan::DATA_LOADING);
        (0..self.accumulation * per_pass)
            .map(|_| {
                self.train_loader
                    .next_batch(self.device)?
                    .context("the training dataset yielded no batch")
            })
            .collect()
    }

    /// The step's valid tokens over the data-parallel ranks from this rank's `local` count:
    /// summed on the device (an all-reduce of a device tensor, read nowhere), or known on the
    /// host with one data-parallel rank.
    fn global_tokens(&self, local: i64) -> Result<GlobalTokens> {
        let dp = &self.mesh.dp;
        if dp.size() == 1 {
            return Ok(GlobalTokens {
                tensor: host_sync::upload(&[local.max(1)], &[], self.device),
                host: Some(local),
            });
        }
        let tensor = host_sync::upload(&[local], &[], self.device);
        dp.all_reduce(&tensor, ReduceOp::Sum)?;
        Ok(GlobalTokens {
            tensor: tensor.clamp_min(1),
            host: None,
        })
    }

    /// This rank's part of the step's mean loss, read to the host (a step that logs): under
    /// pipeline parallelism the last stage's, which every stage then reports.
    fn read_loss(&self, local_loss: &Tensor) -> Result<f64> {
        let loss = host_sync::read_f64(local_loss, "loss");
        if self.pipeline.is_none() {
            return Ok(loss);
        }
        Ok(self
            .mesh
            .reduce_scalars(&self.mesh.pp, &[loss], ReduceOp::Sum)?[0])
    }

    /// Forward and backward over the step's batches, then the gradients' reductions; returns
    /// this rank's part of the step's mean loss, a 0-dim f64 on the device (the microbatches'
    /// losses summed there in f64, in order; 0 on pipeline ranks without the last stage).
    /// `global_tokens` divides each microbatch's summed loss ([`GlobalTokens::tensor`]).
    fn forward_backward(
        &self,
        batches: &[Batch],
        global_tokens: &Tensor,
        step: u64,
    ) -> Result<Tensor> {
        let (model, mesh) = (&self.model, self.mesh);
        let mut local_loss = Tensor::zeros([], (Kind::Double, self.device));
        if let Some((pipeline, _)) = &self.pipeline {
            let _s = titan_obs_core::span(titan::FORWARD_BACKWARD);
            for pass in batches.chunks(pipeline.microbatches) {
                let microbatches: Vec<Microbatch<'_>> = pass
                    .iter()
                    .map(|b| Microbatch {
                        inputs: &b.inputs,
                        labels: &b.labels,
                        layout: TokenLayout::of(b),
                    })
                    .collect();
                local_loss += pipeline
                    .run(model, &microbatches, global_tokens)
                    .with_context(|| format!("step {step}"))?;
            }
        } else {
            let _s = titan_obs_core::span(titan::FORWARD_BACKWARD);
            for batch in batches {
                let _m = titan_obs_core::span(titan::MICROBATCH);
                let loss = {
                    let _f = gpu_clock::span(titan::FORWARD);
                    // Sum over valid tokens / the GLOBAL count: summing gradients over ranks
                    // and microbatches then gives the mean over every token of the step.
                    forward_pass(step, || {
                        let logits = model.forward_with(&batch.inputs, TokenLayout::of(batch));
                        let ce = model.summed_cross_entropy(&logits, &batch.labels);
                        let tokens = global_tokens.to_kind(ce.kind());
                        ce / tokens
                    })?
                };
                {
                    let _b = gpu_clock::span(titan::BACKWARD);
                    // A collective that fails in backward (a rank died) fails the pass.
                    loss.f_backward()
                        .map_err(|e| anyhow::anyhow!("step {step}: backward: {e}"))?;
                }
                // In f64 and in order, as the host sum this replaces: the logged loss is the
                // same to the last bit.
                local_loss += loss.detach().to_kind(Kind::Double);
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
        reduce_partial_grads(mesh, model)?;
        Ok(local_loss)
    }

    /// Clips the gradients by their norm over the mesh and steps AdamW at `lr`; returns the
    /// norm before clipping, a 0-dim tensor on the device (clipping multiplies by a coefficient
    /// computed there, so nothing is read).
    fn optimizer_step(&mut self, lr: f64) -> Result<Tensor> {
        let cfg = self.cfg;
        let tensors: Vec<&Tensor> = self.params.iter().map(|(_, t)| t).collect();
        let _s = gpu_clock::span(titan::OPTIMIZER);
        let grad_norm = {
            let _c = titan_obs_core::span(titan::CLIP);
            let norm = grad_norm(self.mesh, &self.model, self.device)?;
            let coef = optim::clip_coefficient(cfg.training.max_norm, &norm)?;
            optim::clip_grads(&tensors, &coef)?;
            norm
        };
        {
            let _o = titan_obs_core::span(titan::OPTIMIZER_STEP);
            if let Some((layers, counts)) = self.model.expert_load() {
                match &mut self.expert_load {
                    Some((_, load)) => *load += counts,
                    None => self.expert_load = Some((layers, counts)),
                }
            }
            // torchtitan's step pre-hook: the experts' token counts of every data- and
            // context-parallel rank move their routing biases; under expert parallelism with
            // tensor parallelism each tp rank routed its own tokens, and those add up first.
            let (dp, tp) = (&self.mesh.dp_cp, &self.mesh.tp);
            let per_tp_rank = self.mesh.mesh.ep > 1 && tp.size() > 1;
            self.model.update_expert_bias(|counts| {
                if per_tp_rank {
                    tp.all_reduce(counts, ReduceOp::Sum)?;
                }
                if dp.size() > 1 {
                    dp.all_reduce(counts, ReduceOp::Sum)?;
                }
                Ok(())
            })?;
            self.optimizer.step(&self.params, lr)?;
            optim::clear_grads(&tensors);
            if cfg.float8_enabled()
                && cfg.float8.enable_fsdp_float8_all_gather
                && cfg.float8.precompute_float8_dynamic_scale_for_fsdp
            {
                self.model.precompute_float8_scales();
            }
        }
        {
            let _l = titan_obs_core::span(titan::LR);
            // The schedule is a pure function of the step; next step's lr is computed at
            // its start. Kept as a phase for torchtitan parity.
        }
        Ok(grad_norm)
    }

    /// This rank's expert load since the last logged step to titan-obs: one scalar per (layer,
    /// expert), summed over ranks by the analysis (`titan-obs summary`'s experts section). One
    /// read to the host, on a step that logs.
    fn record_expert_load(&mut self) {
        let Some((layers, load)) = self.expert_load.take() else {
            return;
        };
        let experts = load.size()[1] as usize;
        let values = host_sync::read_f64s(&load.reshape([-1]), "expert load");
        // Where this rank's experts live, for the summary's hosting rank of a hot expert.
        if let Some((first, hosted)) = self.model.hosted_experts() {
            let rank = self.mesh.mesh.rank;
            titan_obs_core::scalar(moe::first_expert_scalar(rank), first as f64, Reduce::Max);
            titan_obs_core::scalar(moe::EXPERTS_PER_RANK, hosted as f64, Reduce::Max);
            // Under pipeline parallelism a rank hosts them only in its stages' layers.
            if self.mesh.mesh.pp > 1 {
                for &layer in &layers {
                    titan_obs_core::scalar(moe::held_layer_scalar(rank, layer), 1.0, Reduce::Max);
                }
            }
        }
        // Without expert parallelism every tp rank routes the same tokens: one of them counts.
        if self.mesh.mesh.ep == 1 && self.mesh.tp.rank() != 0 {
            return;
        }
        for (l, layer) in layers.iter().enumerate() {
            for e in 0..experts {
                titan_obs_core::scalar(
                    moe::tokens_scalar(*layer, e),
                    values[l * experts + e],
                    Reduce::Sum,
                );
            }
        }
    }

    /// A logged step: this rank's figures to titan-obs, their reductions over the mesh to the
    /// console, `metrics.jsonl` and TensorBoard. Returns the logged (mean) loss.
    fn log_step(
        &mut self,
        f: StepFigures,
        window: &metrics::ThroughputWindow,
        progress: &console::Steps,
    ) -> Result<f64> {
        let _s = titan_obs_core::span(titan::COLLECT_DIST_METRICS);
        self.record_expert_load();
        // torchtitan's per-GPU figures: a data-parallel rank's tokens shared by its cp x tp x pp
        // ranks (its `non_data_parallel_size`).
        let model_parallel = self.mesh.mesh.cp * self.mesh.mesh.tp * self.mesh.mesh.pp;
        let tps = window.tokens_per_second(Instant::now(), model_parallel);
        let (rss, peak_rss) = metrics::rss_bytes();
        let on_cuda = self.device.is_cuda();
        // On CUDA the caching allocator's peak reserved bytes since the last log (torchtitan's
        // console figure); on CPU the process's resident memory (named `rss` where recorded).
        // Then the peak of live tensor bytes: active blocks on CUDA, counted CPU tensors.
        let (memory, tensor_peak) = match self.device {
            Device::Cuda(index) => match metrics::cuda_memory(index) {
                Ok(m) => {
                    if m.alloc_retries > 0 {
                        tracing::warn!("{} CUDA memory allocation retries", m.alloc_retries);
                    }
                    if m.ooms > 0 {
                        tracing::warn!("{} CUDA OOM errors thrown", m.ooms);
                    }
                    tracing::debug!(
                        max_active_gib = m.max_active as f64 / (1u64 << 30) as f64,
                        max_reserved_gib = m.max_reserved as f64 / (1u64 << 30) as f64,
                        max_reserved_pct = 100.0 * m.max_reserved as f64 / m.capacity.max(1) as f64,
                        "CUDA memory"
                    );
                    (m.max_reserved, m.max_active)
                }
                Err(e) => {
                    tracing::warn!("CUDA memory statistics: {e}");
                    (0, 0)
                }
            },
            _ => (rss, metrics::cpu_tensor_bytes().1),
        };
        let gib = (1u64 << 30) as f64;
        let (flops_per_token, peak_flops) = (self.flops_per_token, self.peak_flops);
        let per_rank =
            |loss: f64, grad_norm: f64, memory: f64, tensor_peak: f64, tps: f64, tokens: i64| {
                StepMetrics {
                    step: f.step,
                    loss,
                    grad_norm,
                    lr: f.lr,
                    memory_gib: memory / gib,
                    peak_rss_gib: peak_rss as f64 / gib,
                    tensor_peak_gib: tensor_peak / gib,
                    tps,
                    tflops: flops_per_token * tps / 1e12,
                    mfu_pct: 100.0 * flops_per_token * tps / peak_flops,
                    tokens,
                    on_cuda,
                }
            };
        // titan-obs gets this rank's values (its own mean loss, tps, memory) and reduces
        // them across ranks later; the console shows the cross-rank reductions now.
        // Under context parallelism a rank's loss covers its part of each sequence: about
        // 1 / cp of the valid tokens the loader counted.
        let own_tokens = (f.local_tokens as f64 / self.mesh.mesh.cp as f64).max(1.0);
        let own_loss = f.local_loss * f.global_tokens as f64 / own_tokens;
        let own = per_rank(
            own_loss,
            f.grad_norm,
            memory as f64,
            tensor_peak as f64,
            tps,
            f.local_tokens,
        );
        for (name, value, reduce) in own.scalars(model_parallel) {
            titan_obs_core::scalar(name, value, reduce);
        }
        let mut reduced = [
            (f.local_loss, Reduce::Sum),
            (f.grad_norm, Reduce::Max),
            (memory as f64, Reduce::Max),
            (tensor_peak as f64, Reduce::Max),
            (tps, Reduce::Mean),
        ];
        self.mesh.reduce_metrics(&mut reduced)?;
        let [loss, grad_norm, memory, tensor_peak, tps] = reduced.map(|(v, _)| v);
        let m = per_rank(loss, grad_norm, memory, tensor_peak, tps, f.global_tokens);
        if let Some(file) = self.metrics_file.as_mut() {
            tracing::info!("{}", m.console_line());
            file.push("train", &m)?;
            progress.loss(m.loss);
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.scalars(f.step, &m.console_scalars())?;
        }
        Ok(m.loss)
    }

    /// Runs validation at `step` and logs it (the job has a validation loader).
    fn validate(&mut self, step: u64) -> Result<ValidationMetrics> {
        let _s = titan_obs_core::span(titan::VALIDATION);
        titan_obs_core::add_step_tag(titan::VALIDATION);
        let staged = self.pipeline.as_ref().map(|(p, c)| (p, c.microbatch_size));
        let loader = self
            .val_loader
            .as_mut()
            .expect("validate runs only with a validation loader");
        let v = validate(
            &self.model,
            staged,
            loader,
            self.cfg.validation.steps,
            self.mesh,
            step,
            self.device,
        )?;
        titan_obs_core::scalar("validation/loss", v.loss, Reduce::Mean);
        if let Some(file) = self.metrics_file.as_mut() {
            tracing::info!("{}", v.console_line());
            file.push("validation", &v)?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.scalars(step, &v.console_scalars())?;
        }
        Ok(v)
    }
}

/// This process's device, seed (rank 0's for all, so every rank draws the same model) and
/// dump folder, with the resolved config written there by rank 0.
fn prepare_process(cfg: &JobConfig, mesh: &DeviceMesh, run_id: &str) -> Result<(Device, PathBuf)> {
    let world = mesh.mesh;
    let device = select_device(&cfg.training, &cfg.comm, world.local_rank)
        .map_err(|e| config_error("training.device", e))?;
    keep_freed_tensor_memory();
    if let (Device::Cuda(index), true) = (device, cfg.observability.enable) {
        // titan-obs's GPU lane: the device work's spans timed with CUDA events too. A device
        // whose events fail loses the lane, not the run.
        if let Err(e) = gpu_clock::start(index) {
            tracing::warn!("GPU timing (titan-obs's GPU lane) is off: {e}");
        }
    }
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
    Ok((device, dump_folder))
}

/// The training loader (this dp rank's share, `batch` samples a batch) and the validation
/// loader when `validation.enable`.
fn build_loaders(
    cfg: &JobConfig,
    mesh: &DeviceMesh,
    tokenizer: &Arc<TextTokenizer>,
    batch: usize,
) -> Result<(PrefetchLoader, Option<PrefetchLoader>)> {
    let (dp_rank, dp_degree) = (mesh.mesh.dp_rank() as u64, mesh.mesh.dp_degree() as u64);
    let t = &cfg.training;
    let train_set = Dataset::resolve(&t.dataset, t.dataset_path.as_deref(), "training")
        .map_err(|e| config_error("training.dataset", e))?;
    let train_loader = TextLoader::new(
        train_set,
        tokenizer.clone(),
        t.seq_len as usize,
        batch,
        dp_rank,
        dp_degree,
        true,
    );
    let ahead = t.prefetch_batches as usize;
    let train_loader = PrefetchLoader::new(train_loader, ahead);
    let v = &cfg.validation;
    if !v.enable {
        return Ok((train_loader, None));
    }
    let (val_batch, val_seq_len) = v.batch_shape(t);
    let set = Dataset::resolve(&v.dataset, v.dataset_path.as_deref(), "validation")
        .map_err(|e| config_error("validation.dataset", e))?;
    let val_loader = TextLoader::new(
        set,
        tokenizer.clone(),
        val_seq_len,
        val_batch,
        dp_rank,
        dp_degree,
        false,
    );
    Ok((train_loader, Some(PrefetchLoader::new(val_loader, ahead))))
}

/// This rank's part of the model, split by the plan over the mesh ([`parallelize()`]), after
/// checking that the tokenizer's ids fit the model's vocabulary.
fn build_model(
    cfg: &JobConfig,
    mesh: &DeviceMesh,
    device: Device,
    tokenizer: &TextTokenizer,
    pipeline_cfg: Option<&PipelineConfig>,
) -> Result<(ParallelModel, Option<Pipeline>)> {
    let args = ModelArgs::for_job(cfg)?;
    if tokenizer.vocab_size() as i64 > args.vocab_size {
        bail!(
            "the tokenizer has {} ids but model flavor {} has vocab_size {}",
            tokenizer.vocab_size(),
            cfg.model.flavor,
            args.vocab_size
        );
    }
    parallelize(args, cfg, mesh, device, pipeline_cfg)
}

/// Logs the model built: its size, what this rank holds of it, and the layout.
fn log_model(cfg: &JobConfig, mesh: &DeviceMesh, model: &ParallelModel, flops_per_token: f64) {
    let world = mesh.mesh;
    let (n_params, _) = model.args.num_params();
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
}

/// Rank 0's `metrics.jsonl`, and the TensorBoard writer where `[metrics]` asks for one.
fn open_metric_outputs(
    cfg: &JobConfig,
    mesh: &DeviceMesh,
    dump_folder: &Path,
    run_id: &str,
) -> Result<(Option<MetricsFile>, Option<EventWriter>)> {
    let rank = mesh.mesh.rank;
    let metrics_file = if rank == 0 {
        Some(MetricsFile::open(
            dump_folder.join("metrics.jsonl"),
            run_id,
        )?)
    } else {
        None
    };
    let m = &cfg.metrics;
    let tensorboard = if m.enable_tensorboard && (rank == 0 || m.save_for_all_ranks) {
        let dir = EventWriter::run_dir(
            dump_folder,
            &m.save_tb_folder,
            m.save_for_all_ranks.then_some(rank),
        );
        let writer = EventWriter::create(&dir).context("metrics.enable_tensorboard")?;
        tracing::info!("TensorBoard events in {}", writer.path().display());
        Some(writer)
    } else {
        None
    };
    Ok((metrics_file, tensorboard))
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

/// Sums over the tp ranks the gradients that are partial there: every replicated weight's under
/// sequence parallelism (each rank normalised its part of the sequence), and on every tp layout
/// those applied to a rank's own heads (qwen3's q/k norms); only of weights the tp ranks hold
/// alike ([`crate::parallelize::Placement::tp_replicated`]: not expert parallelism's experts).
fn reduce_partial_grads(mesh: &DeviceMesh, model: &ParallelModel) -> Result<()> {
    let sequence_parallel = model.sequence_parallel();
    let grads: Vec<Tensor> = model
        .named_parameters()
        .iter()
        .zip(model.placements())
        .filter(|(_, p)| p.tp_replicated() && (sequence_parallel || p.tp_partial_grad))
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

/// The total 2-norm of all gradients over the mesh, as torch's `clip_grad_norm_` computes it
/// for sharded parameters: fp32 norms of the local parts, their squares summed over the ranks
/// that hold different parts (`dp_shard x cp`, and `tp` for tp-split parameters; `efsdp x ep`
/// for the routed experts under expert parallelism), then over the
/// pipeline stages. A 0-dim tensor on `device` (fp32 on one process; f64 from the sums over
/// ranks, which add the squares in f64 as the host sums this replaces did): the reductions are
/// all-reduces of device tensors, and nothing is read to the host.
fn grad_norm(mesh: &DeviceMesh, model: &ParallelModel, device: Device) -> Result<Tensor> {
    let grads = model.grads_as_torchtitan_parameters();
    let local = |group: NormGroup| -> Result<Tensor> {
        let part: Vec<Tensor> = grads
            .iter()
            .filter(|(_, g)| *g == group)
            .map(|(g, _)| g.shallow_clone())
            .collect();
        if part.iter().all(|g| !g.defined()) {
            // Made on the device: a copy from the host could wait for the GPU.
            return Ok(Tensor::zeros([1], (Kind::Double, device)));
        }
        Ok(optim::total_grad_norm(&part)?
            .to_device(device)
            .to_kind(Kind::Double)
            .square()
            .view([1]))
    };
    if mesh.mesh.world_size == 1 {
        let all: Vec<Tensor> = grads.into_iter().map(|(g, _)| g).collect();
        return Ok(optim::total_grad_norm(&all)?.to_device(device));
    }
    let all_reduce = |group: &crate::distributed::Group, t: &Tensor| -> Result<()> {
        if group.size() > 1 {
            group.all_reduce(t, ReduceOp::Sum)?;
        }
        Ok(())
    };
    // [split, replicated] squares in one tensor, as one reduction over FSDP's ranks.
    let sums = Tensor::cat(&[local(NormGroup::FsdpTp)?, local(NormGroup::Fsdp)?], 0);
    all_reduce(&mesh.fsdp, &sums)?;
    let split = sums.narrow(0, 0, 1).copy();
    all_reduce(&mesh.tp, &split)?;
    let mut stages = split + sums.narrow(0, 1, 1);
    if mesh.mesh.ep > 1 {
        // The routed experts' squares over their own ranks (torchtitan's
        // `_clip_grad_norm_with_ep`: the experts' norm and the others', combined).
        let experts = local(NormGroup::Experts)?;
        all_reduce(&mesh.efsdp, &experts)?;
        all_reduce(&mesh.ep, &experts)?;
        stages += experts;
    }
    // Each pipeline stage's squared norm, summed over the stages (torchtitan's pp_mesh sum).
    all_reduce(&mesh.pp, &stages)?;
    Ok(stages.sqrt().view([]))
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
    }
}
