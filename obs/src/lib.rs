//! titan-obs: record what every rank of a job does and when, and read it back for analysis.
//!
//! # Recording
//! A process-global recorder set up once by [`init`] (or [`init_with`]) and closed by
//! [`finish`]. Hot-path calls — [`span`] (a nestable per-thread guard), [`instant`],
//! [`scalar`], [`SpanGuard::error`] — append a fixed-size record to the calling thread's
//! pre-allocated single-producer ring (no lock, no allocation, no syscall: time comes from
//! the vDSO monotonic clock, names are `&'static str`). One background thread drains the
//! rings and appends one record batch every `flush_interval` to the rank's open [`journal`]
//! (`<run>/obs/rank-<R>/journal-<N>.arrows`, an Arrow IPC stream; kept in a local spool folder
//! for object_store URLs), so a kill -9 loses at most the last interval. Every
//! `rotate_interval` (default 600 s) and at [`finish`] the journal is compacted into one Parquet
//! (zstd) part `part-<N>.parquet`, written under a temporary name and renamed (or uploaded in
//! one PUT); a journal a killed process left behind is compacted by the next `init` of its
//! rank. [`set_step`] and [`add_step_tag`] are process-wide and attach to records.
//! [`set_clock_offset_ns`] stores this rank's clock offset to rank 0 in the part footers.
//!
//! Scalar naming: `scalar("training/loss", v, Reduce::Mean)` is shown by `titan-obs metrics`
//! as `training/loss_mean` (name + `_` + reduce), torchtitan's console format; scalars whose
//! name starts with `validation/` go on a `validate step:` line.
//!
//! # Schema
//! [`schema`] holds the typed columns (see `obs/SCHEMA.md`): [`Kind`], [`Source`], [`Reduce`],
//! column names and footer keys.
//!
//! # Reading
//! [`read::load`] loads every rank's parts of a run (local dir or URL) in parallel into a
//! [`read::Run`]: typed columnar tables ([`read::Spans`] with rank/thread/name/step/start/dur/
//! depth/seq/parent, [`read::Instants`], [`read::Scalars`], [`read::Errors`]), run-wide name and
//! tag dictionaries, per-(rank, step) tags, per-rank footer info, and a [`read::LoadReport`] of
//! missing ranks and corrupt parts (by path) — one bad part never fails the load.
//! [`read::Columns`] selects which optional columns to decode. A folder written by several
//! launches holds several runs (told apart by the footer's run id, see [`runs`]): the tables
//! hold the newest, or the one [`read::Run::select_run`] picks.
//!
//! # Other formats
//! [`ingest`] reads torchtitan 0.3.0's structured-logger JSONL (`RUN/structured_logs/`) and
//! Chrome trace-event JSON (torchtitan's gantt, PyTorch profiler traces) into the same
//! [`read::Run`]; [`read::load`] detects the format. [`ingest::Follower`] re-reads only what
//! was appended (`--follow`). [`vocab`] holds the phase, tag and field names the analysis
//! relies on, titan's and torchtitan's.
//!
//! # Synthetic runs
//! [`synth::write_run`] writes a real multi-rank run (ranks x steps x spans-per-step, injected
//! [`synth::Straggler`]s, checkpoint/validation steps, scalars) for benchmarks, tests and the TUI.
//!
//! # Analysis
//! [`analysis`] computes what the `titan-obs` commands print: [`analysis::summary`] (per-phase
//! statistics, stragglers, tagged steps), [`analysis::metrics`] (torchtitan's aggregated
//! per-step lines) and [`analysis::chrome`] (Chrome Trace Event JSON for Perfetto).
//!
//! # Layers
//! The modules import downward only (`tests/tests/layering.rs` checks it), bottom first:
//! 1. vocabulary: `schema`, `record`, `vocab`, `location`, `sidecar`, `guard`, `ipc_check`,
//!    `clock`, `ring`, `stats`, `metric_lines`;
//! 2. the part's footer and the record tables: `footer`, `tables`, `roles`;
//! 3. bytes to tables: `journal`, `decode`, `part_files`;
//! 4. summaries of a part: `digest`, `lod`;
//! 5. writing parts: `embedded`, `part`;
//! 6. the loaded run and its readers: `runs`, `run`, `incremental`, `ingest`, `read`;
//! 7. what stands on all of it: `analysis`, `convert`, `synth`, `recorder`.

pub mod analysis;
pub mod clock;
pub mod convert;
mod decode;
pub mod digest;
pub mod embedded;
pub mod footer;
mod guard;
mod incremental;
pub mod ingest;
mod ipc_check;
pub mod journal;
pub mod location;
pub mod lod;
pub mod metric_lines;
pub mod part;
pub mod part_files;
pub mod read;
mod record;
mod recorder;
mod ring;
mod roles;
mod run;
pub mod runs;
pub mod schema;
mod sidecar;
pub mod stats;
pub mod synth;
mod tables;
pub mod vocab;

pub use read::{Columns, LoadReport, ReadOptions, Run, RunFormat, load};
pub use record::NO_STEP;
pub use recorder::{
    InitOptions, SpanGuard, StepStamp, TimedSpan, Tuning, WriterStats, add_step_tag, error, finish,
    finish_with_stats, init, init_with, instant, pipeline_span, record_timed_span, scalar,
    set_clock_offset_ns, set_step, span, step_stamp, wait_drained,
};
pub use schema::{Kind, PipelineSlot, Reduce, Source};
