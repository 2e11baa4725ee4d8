//! The training loop, readable top to bottom: build (tokenizer, data, model, optimizer), then per
//! step: load microbatches, forward/backward, reduce, clip, step, log, validate.
//!
//! Everything that would touch other ranks goes through [`DataParallel`]; everything timed goes
//! through titan-obs spans with torchtitan's phase names.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use tch::{Device, Kind, Reduction, Tensor};
use titan_obs::Reduce;
use titan_obs::vocab::{self, titan};

use crate::checkpoint::{Checkpointer, TrainerState};
use crate::config::{self, DeviceChoice, DtypeName, JobConfig};
use crate::data::{Batch, Dataset, TextLoader, TextTokenizer};
use crate::lr_scheduler::LrSchedule;
use crate::metrics::{self, StepMetrics, ValidationMetrics};
use crate::model::{Llama, ModelArgs};
use crate::optim::{self, AdamW};
use crate::parallel::DataParallel;
use crate::precision::Precision;
use crate::tensorboard::EventWriter;

/// Labels with this value are not predicted (PyTorch's cross-entropy default).
pub const IGNORE_INDEX: i64 = -100;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub dump_folder: PathBuf,
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

/// The summed cross entropy of `logits` (B, S, V) against `labels` (B, S) over valid labels.
pub fn summed_cross_entropy(logits: &Tensor, labels: &Tensor) -> Tensor {
    let vocab = logits.size()[2];
    logits.reshape([-1, vocab]).cross_entropy_loss::<Tensor>(
        &labels.reshape([-1]),
        None,
        Reduction::Sum,
        IGNORE_INDEX,
        0.0,
    )
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
/// scripts and tests), appended as it happens; a resumed run continues the same file.
struct MetricsFile {
    file: std::fs::File,
    path: PathBuf,
}

impl MetricsFile {
    fn open(path: PathBuf) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file, path })
    }

    fn push<T: serde::Serialize>(&mut self, kind: &str, value: &T) -> Result<()> {
        use std::io::Write as _;
        let mut v = serde_json::to_value(value)?;
        v["kind"] = kind.into();
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
fn validate(
    model: &Llama,
    loader: &mut TextLoader,
    max_steps: Option<u64>,
    precision: Precision,
    dp: &mut dyn DataParallel,
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
            let loss = precision.run(device, || {
                summed_cross_entropy(&model.forward(&inputs, Some(&positions)), &labels)
            })?;
            loss_sum += loss.double_value(&[]);
            tokens += count_valid(&labels);
            batches += 1;
        }
        Ok(())
    })?;
    let mut reduced = [(loss_sum, Reduce::Sum), (tokens as f64, Reduce::Sum)];
    dp.reduce_metrics(&mut reduced)?;
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
pub fn run(cfg: &JobConfig, dp: &mut dyn DataParallel) -> Result<TrainSummary> {
    let world = *dp.world();
    if cfg.observability.enable {
        titan_obs::init_with(
            titan_obs::InitOptions {
                run: cfg.job.dump_folder.clone(),
                source: titan_obs::Source::Trainer,
                rank: world.rank as u32,
                local_rank: world.local_rank as u32,
                world_size: world.world_size as u32,
                flush_interval: std::time::Duration::from_secs_f64(
                    cfg.observability.flush_interval_s,
                ),
            },
            titan_obs::Tuning {
                rotate_interval: std::time::Duration::from_secs_f64(
                    cfg.observability.rotate_interval_s,
                ),
                ..Default::default()
            },
        )
        .context("starting titan-obs recording (observability.enable)")?;
    }
    let result = train(cfg, dp);
    if cfg.observability.enable {
        let _s = titan_obs::span("teardown");
        drop(_s);
        let finished = titan_obs::finish().context("flushing titan-obs records");
        if result.is_ok() {
            finished?;
        } else if let Err(e) = finished {
            tracing::warn!("{e:#}");
        }
    }
    result
}

/// Trains per `cfg` with the ranks behind `dp`. Init phases and per-step phases are recorded as
/// titan-obs spans; metrics go to the console, `metrics.jsonl` and titan-obs scalars.
pub fn train(cfg: &JobConfig, dp: &mut dyn DataParallel) -> Result<TrainSummary> {
    let world = *dp.world();
    let device = select_device(&cfg.training, world.local_rank)
        .map_err(|e| config_error("training.device", e))?;
    keep_freed_tensor_memory();
    let seed = set_determinism(&cfg.debug, device);
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
        "starting titan-train"
    );

    let tokenizer = {
        let _s = titan_obs::span("tokenizer");
        Arc::new(if cfg.model.hf_assets_path.is_empty() {
            TextTokenizer::embedded()?
        } else {
            TextTokenizer::from_dir(Path::new(&cfg.model.hf_assets_path))?
        })
    };

    let (dp_rank, dp_degree) = (world.dp_rank() as u64, world.dp_degree() as u64);
    let (mut train_loader, mut val_loader) = {
        let _s = titan_obs::span("dataloader");
        let t = &cfg.training;
        let train_set = Dataset::resolve(&t.dataset, t.dataset_path.as_deref(), "training")
            .map_err(|e| config_error("training.dataset", e))?;
        let train_loader = TextLoader::new(
            train_set,
            tokenizer.clone(),
            t.seq_len as usize,
            t.local_batch_size as usize,
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
        let _s = titan_obs::span("model_build");
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
        let model = Llama::new(args, device)?
            .with_checkpointing(cfg.activation_checkpoint.policy())
            .with_attn_backend(
                cfg.model.attn_backend,
                Precision::from_config(&cfg.training).activation_kind(cfg.training.dtype.kind()),
            );
        if cfg.training.dtype != DtypeName::Float32 {
            model.cast_parameters(cfg.training.dtype.kind());
        }
        model
    };
    let precision = Precision::from_config(&cfg.training);
    let (n_params, _) = model.args.num_params();
    let flops_per_token = model.args.flops_per_token(cfg.training.seq_len);
    tracing::info!(
        flavor = cfg.model.flavor,
        params = n_params,
        flops_per_token,
        mixed_precision = precision.describe(),
        activation_checkpointing = ?model.checkpointing(),
        attn_backend = ?model.attn_backend(),
        "model built"
    );

    let params: Vec<(String, Tensor)> = model
        .named_parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    {
        // Rank 0's initial weights to every rank; gradient buckets / ZeRO shards.
        let _s = titan_obs::span("parallelism");
        dp.prepare(&params)
            .context("setting up data parallelism (parallelism.*)")?;
    }
    let n_micro = microbatches(&cfg.training, world.dp_degree())
        .map_err(|e| config_error("training.global_batch_size", e))?;
    let (mut optimizer, schedule) = {
        let _s = titan_obs::span(titan::OPTIMIZER);
        (
            AdamW::new((&cfg.optimizer).into()),
            LrSchedule::new(&cfg.lr_scheduler, cfg.optimizer.lr, cfg.training.steps),
        )
    };
    let mut checkpointer = Checkpointer::new(&cfg.checkpoint, &dump_folder, world)?
        .with_hf_assets(&cfg.model.hf_assets_path)
        .with_rank_sync(dp.rank_sync());
    let resumed_step = {
        let _s = titan_obs::span(titan::CHECKPOINT);
        let step = checkpointer.load(&mut TrainerState {
            model: &model,
            optimizer: &mut optimizer,
            loader: &mut train_loader,
            schedule: &schedule,
            optimizer_shards: None,
        })?;
        if cfg.checkpoint.enable {
            // Loaded weights / AdamW state to where the step reads them (ZeRO-2 shards).
            dp.adopt_loaded_state(&mut optimizer, &params)?;
        }
        step
    };

    let peak_flops = metrics::peak_flops(device, cfg.metrics.peak_tflops);
    let mut metrics_file = if world.rank == 0 {
        Some(MetricsFile::open(dump_folder.join("metrics.jsonl"))?)
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
        steps: 0,
        first_loss: None,
        last_loss: None,
        last_validation_loss: None,
    };
    let mut window = metrics::ThroughputWindow::new(Instant::now());

    for step in resumed_step + 1..=cfg.training.steps {
        titan_obs::set_step(step);
        let step_span = titan_obs::span(vocab::STEP);
        let lr = optimizer.next_lr(schedule.lr_for_step(step));

        let batches: Vec<Batch> = {
            let _s = titan_obs::span(titan::DATA_LOADING);
            (0..n_micro)
                .map(|_| {
                    train_loader
                        .next_batch(device)?
                        .context("the training dataset yielded no batch")
                })
                .collect::<Result<_>>()?
        };
        let local_tokens: i64 = batches.iter().map(|b| count_valid(&b.labels)).sum();
        let global_tokens = dp.global_valid_tokens(local_tokens)?;
        let step_input_tokens = batches.iter().map(|b| b.inputs.numel() as i64).sum::<i64>();
        window.add_tokens(step_input_tokens);

        let mut local_loss = 0.0f64;
        {
            let _s = titan_obs::span(titan::FORWARD_BACKWARD);
            for batch in &batches {
                let _m = titan_obs::span(titan::MICROBATCH);
                let loss = {
                    let _f = titan_obs::span(titan::FORWARD);
                    // Sum over valid tokens / the GLOBAL count: summing gradients over ranks
                    // and microbatches then gives the mean over every token of the step.
                    precision.run(device, || {
                        let logits = model.forward(&batch.inputs, Some(&batch.positions));
                        summed_cross_entropy(&logits, &batch.labels) / global_tokens.max(1) as f64
                    })?
                };
                {
                    let _b = titan_obs::span(titan::BACKWARD);
                    loss.backward();
                }
                local_loss += loss.double_value(&[]);
            }
        }
        dp.reduce_gradients(&params)?;

        let grad_norm = {
            let _s = titan_obs::span(titan::OPTIMIZER);
            let grad_norm = {
                let _c = titan_obs::span(titan::CLIP);
                let norm = dp.grad_norm(&params)?;
                optim::clip_grads(&tensors, cfg.training.max_norm, norm);
                norm
            };
            {
                let _o = titan_obs::span(titan::OPTIMIZER_STEP);
                dp.optimizer_step(&mut optimizer, &params, lr)?;
                optim::clear_grads(&tensors);
            }
            {
                let _l = titan_obs::span(titan::LR);
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
            let _s = titan_obs::span(titan::COLLECT_DIST_METRICS);
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
                titan_obs::scalar(name, value, reduce);
            }
            let mut reduced = [
                (local_loss, Reduce::Sum),
                (grad_norm, Reduce::Max),
                (memory as f64, Reduce::Max),
                (tps, Reduce::Mean),
            ];
            dp.reduce_metrics(&mut reduced)?;
            let [loss, grad_norm, memory, tps] = reduced.map(|(v, _)| v);
            let m = per_rank(loss, grad_norm, memory, tps, global_tokens);
            if let Some(file) = metrics_file.as_mut() {
                tracing::info!("{}", m.console_line());
                file.push("train", &m)?;
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
            let _s = titan_obs::span(titan::VALIDATION);
            titan_obs::add_step_tag(titan::VALIDATION);
            let v = validate(
                &model,
                loader,
                cfg.validation.steps,
                precision,
                dp,
                step,
                device,
            )?;
            titan_obs::scalar("validation/loss", v.loss, Reduce::Mean);
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
            let _s = titan_obs::span(titan::GC);
            titan_obs::add_step_tag(titan::GC);
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
                optimizer_shards: if checkpointer.saves_at(step, cfg.training.steps) {
                    dp.optimizer_shards(&params)
                } else {
                    None
                },
            },
        )?;
        summary.steps = step;
        drop(step_span);
    }
    checkpointer.finish()?;
    Ok(summary)
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
        let got = summed_cross_entropy(&logits, &labels).double_value(&[]);
        let want = -(2.0f64.exp() / (1.0 + 1f64.exp() + 2f64.exp())).ln();
        assert!((got - want).abs() < 1e-6);
        assert_eq!(count_valid(&labels), 1);
    }
}
