//! titan-obs: record what every rank of a job does and when, and read it back for analysis.
//!
//! The recording side is a process-global recorder set up once by [`init`]; hot-path calls
//! ([`span`], [`instant`], [`scalar`], [`set_step`], [`add_step_tag`]) append to a thread-local
//! buffer that a background thread drains into per-rank Parquet part files
//! (`<run>/obs/rank-<R>/part-<N>.parquet`). The reading side loads those parts for the
//! `titan-obs` commands (summary, metrics, export, TUI).
//!
//! NOTE: this is the foundation skeleton: the public recording API below is the contract that
//! titan-train and titan-ckpt code against; issue 4 fills in the implementation.

use std::time::Duration;

/// Which program produced the records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Trainer,
    Validator,
    Ckpt,
}

/// How a scalar is reduced across ranks when metrics are aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Mean,
    Max,
    Min,
    Sum,
}

/// Where and as whom this process records.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Run location: a local directory or an object_store URL; parts go under `<run>/obs/`.
    pub run: String,
    pub source: Source,
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    /// A new part file is closed at least this often (torchtitan-style `observability.flush_interval_s`).
    pub flush_interval: Duration,
}

/// Starts recording for this process. Records made before `init` are dropped.
pub fn init(_opts: InitOptions) -> anyhow::Result<()> {
    Ok(())
}

/// Flushes every buffered record and closes the last part file. Call before exit.
pub fn finish() -> anyhow::Result<()> {
    Ok(())
}

/// A timed region; the span ends when the guard drops. Spans nest per thread.
#[must_use = "the span ends when this guard is dropped"]
pub struct SpanGuard {
    _private: (),
}

impl SpanGuard {
    /// Marks the span as failed with `message` (recorded as an `error` record inside it).
    pub fn error(&self, _message: &str) {}
}

/// Opens a span named `name` (a phase name such as `forward_backward`).
pub fn span(_name: &'static str) -> SpanGuard {
    SpanGuard { _private: () }
}

/// Records a point event.
pub fn instant(_name: &'static str) {}

/// Records a scalar metric for the current step, with its cross-rank reduction.
pub fn scalar(_name: &'static str, _value: f64, _reduce: Reduce) {}

/// Sets the current training step attached to subsequent records.
pub fn set_step(_step: u64) {}

/// Tags the current step (e.g. `checkpoint`, `validation`).
pub fn add_step_tag(_tag: &'static str) {}
