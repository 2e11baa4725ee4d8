//! titan-train: a lean trainer of torchtitan's llama3, qwen3 and deepseek_v3 on libtorch
//! (through tch), numerically matching torchtitan and reading torchtitan's config files.
//!
//! - [`config`]: [`config::JobConfig`], torchtitan's TOML sections plus `--section.key` overrides;
//!   [`command_line`] reads both of torchtitan's command lines (TOML, and 0.3.0's
//!   `--module/--config` registry with its key names) onto it.
//! - [`model`]: the decoder ([`model::block`], [`model::Decoder`]) with torchtitan 0.3.0's
//!   parameter names, init and RoPE, knowing nothing of parallelism; [`names`]
//!   maps the older name generation; [`hf`] maps Hugging Face checkpoints onto it.
//! - [`data`]: tokenizer, document sources (.txt/.jsonl/.parquet, embedded default), packing loader
//!   with resumable [`data::LoaderState`].
//! - [`optim`] (AdamW with visible state, grad clipping) and [`lr_scheduler`].
//! - [`parallel`]: [`parallel::Mesh`], this rank's place on torchtitan's device mesh;
//!   [`parallelize`]: how the model is split over it ([`parallelize::parallelize`] builds
//!   [`parallelize::ParallelModel`]: FSDP2, tensor parallelism, pipeline, AC, float8), with
//!   [`autograd`] functions that run the collectives inside forward and backward.
//! - [`checkpoint`]: DCP saves/resume (torchtitan's layout), async saves, HF export.
//! - [`distributed`]: multi-process launcher, rendezvous store, collectives (cpu ring, nccl) and
//!   the mesh's process groups ([`distributed::DeviceMesh`]).
//! - [`float8`]: float8 linears with dynamic scaling (torchao's recipes), `[float8]`.
//! - [`precision`]: bf16 mixed precision (autocast) as torchtitan applies it; [`recompute`]:
//!   activation checkpointing (regions recomputed in backward), which [`parallelize`] applies per
//!   `[activation_checkpoint]`.
//! - [`memory_estimate`]: `--memory_estimation.enable`, per-rank memory by arithmetic.
//! - [`host_sync`]: the one, counted, way a value crosses from a tensor to the host;
//!   [`gpu_clock`]: on CUDA, the device work's spans also timed with CUDA events (titan-obs's
//!   GPU lane).
//! - [`train`]: the loop; [`metrics`]: console line, throughput, memory; [`tensorboard`]: event
//!   files.

/// The job configuration, its own crate at the bottom of the trainer (no libtorch).
pub use titan_train_config as config;
/// Both of torchtitan's command lines, read onto [`config::JobConfig`].
pub use titan_train_config::command_line;

pub mod autograd;
pub mod checkpoint;
pub mod console;
pub mod data;
pub mod distributed;
pub mod float8;
pub mod gpu_clock;
pub mod hf;
pub mod host_sync;
pub mod lr_scheduler;
pub mod memory_estimate;
pub mod metrics;
pub mod model;
pub mod names;
pub mod optim;
pub mod parallel;
pub mod parallelize;
pub mod precision;
pub mod recompute;
pub mod rng;
mod shim;
pub mod tensorboard;
pub mod train;
