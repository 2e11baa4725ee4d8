//! The non-interactive `titan-obs` commands: summary, metrics, export.
//!
//! Each loads the run through `titan_obs_core::read` (only the columns it needs), reports missing
//! ranks and corrupt parts on stderr by name, and carries on with what could be read.

pub mod export;
pub mod import;
pub mod metrics;
pub mod summary;
pub mod synth;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use titan_obs::conventions::{INCOMPLETE, OK, TITAN_OBS};
use titan_obs_core::read::{Columns, ReadOptions, Run};

/// Options every analysis command shares.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Run location: a titan run (RUN/obs/rank-<R>/part-<N>.parquet), a torchtitan run
    /// (RUN/structured_logs/*.global_rank_<R>.*.jsonl, or that folder, or one such file), or a
    /// Chrome trace (torchtitan's gantt JSON, a PyTorch profiler trace; a file or a folder of
    /// them). Local, or an object store URL (s3://bucket/run, gs://..., az://...; credentials
    /// and endpoint from AWS_*/GOOGLE_*/AZURE_* env vars).
    pub run: String,
    /// Exit with code 3 when ranks are missing or parts are corrupt (after printing the result).
    #[arg(long)]
    pub strict: bool,
    /// Do not align hosts' clocks (torchtitan runs: keep each host's wall clock; titan runs:
    /// do not add the recorded offsets).
    #[arg(long)]
    pub no_clock_align: bool,
    /// Which run of the location to read, by run id, when it holds several (each launch of
    /// titan-train in one dump folder is a run of its own). Default: the newest.
    #[arg(long = "run", value_name = "ID")]
    pub run_id: Option<String>,
    /// The global `-q`/`--quiet` (no progress bar), copied here by `main`.
    #[arg(skip)]
    pub quiet: bool,
}

/// Loads the run with a progress bar on stderr and prints what is missing or corrupt.
pub fn load_run(args: &RunArgs, columns: Columns) -> Result<Run> {
    load_run_with(args, columns, false)
}

/// [`load_run`]; `digests`: read titan parts' summaries instead of their records (see
/// `titan_obs_core::ReadOptions::digests`).
pub fn load_run_with(args: &RunArgs, columns: Columns, digests: bool) -> Result<Run> {
    let bar = if args.quiet || !console_is_tty() {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} reading parts: {pos} ({per_sec}) {elapsed}")
                .expect("valid template"),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        b
    };
    let progress = {
        let bar = bar.clone();
        Arc::new(move |n: u64| bar.inc(n)) as Arc<dyn Fn(u64) + Send + Sync>
    };
    let opts = ReadOptions {
        columns,
        align_clocks: !args.no_clock_align,
        progress: Some(progress),
        digests,
        // Opt-in for now: see `ReadOptions::node_rollups`.
        node_rollups: std::env::var_os("TITAN_OBS_NODE_ROLLUPS").is_some_and(|v| v == "1"),
    };
    let started = std::time::Instant::now();
    let run = titan_obs_core::read::load(&args.run, &opts);
    bar.finish_and_clear();
    let mut run = run?;
    if let Some(id) = &args.run_id {
        run.select_run(id)?;
    }
    tracing::debug!(
        "read {}: {} parts, {} ranks, {} spans in {:.3} s",
        run.location,
        run.report.parts_read,
        run.ranks.len(),
        run.spans.len(),
        started.elapsed().as_secs_f64()
    );
    report_problems(&run);
    if let Some(note) = run.runs_note() {
        TITAN_OBS.note(format_args!("{note}; pick one with --run ID"));
    }
    Ok(run)
}

fn console_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// Missing ranks and corrupt parts, by name, on stderr (warnings, then notes).
pub fn report_problems(run: &Run) {
    let r = &run.report;
    for c in &r.corrupt_parts {
        TITAN_OBS.warning(format_args!(
            "corrupt part {}: {} (skipped)",
            c.path, c.error
        ));
    }
    for d in &r.damage {
        TITAN_OBS.warning(format_args!(
            "{} is damaged at byte {} ({} bytes: {}): lost {}; the rest of it was read",
            d.file, d.offset, d.bytes, d.error, d.lost
        ));
    }
    if !r.missing_ranks.is_empty() {
        let loc = titan_obs_core::location::Location::parse(&run.location).ok();
        for &rank in &r.missing_ranks {
            let where_ = loc
                .as_ref()
                .map(|l| l.rank_display(rank))
                .unwrap_or_else(|| format!("rank-{rank}"));
            TITAN_OBS.warning(format_args!(
                "rank {rank} of {} is missing: no readable part in {where_}",
                r.world_size
            ));
        }
    }
    if r.parts_read == 0 {
        TITAN_OBS.warning(format_args!("no readable part in {}", run.location));
    }
    for b in &r.bad_lines {
        TITAN_OBS.warning(format_args!(
            "malformed line {}:{}: {} (skipped)",
            b.file, b.line, b.error
        ));
    }
    if r.malformed_lines > r.bad_lines.len() as u64 {
        TITAN_OBS.warning(format_args!(
            "{} more malformed lines (skipped)",
            r.malformed_lines - r.bad_lines.len() as u64
        ));
    }
    for t in &r.truncated_tails {
        TITAN_OBS.note(format_args!(
            "{t}: last line is cut short (a running or killed writer): ignored"
        ));
    }
    for o in &r.open_spans {
        TITAN_OBS.note(format_args!(
            "rank {} span `{}`{} never ended in {}: shown open until that process's last record ({})",
            o.rank,
            o.name,
            o.step.map(|s| format!(" (step {s})")).unwrap_or_default(),
            o.file,
            human_ns(o.shown_dur_ns as f64)
        ));
    }
    if let Some(a) = &r.clock_alignment {
        TITAN_OBS.note(clock_alignment_note(a));
    }
}

/// One line per aligned host: how titan-obs put hosts without a shared clock on one clock.
pub fn clock_alignment_note(a: &titan_obs_core::read::ClockAlignment) -> String {
    let mut s = format!(
        "hosts have no shared clock; aligned to {} on shared step starts:",
        a.reference_host
    );
    for h in &a.hosts {
        s.push_str(&format!(
            "\n{} (ranks {:?}): {:+.3} ms from {} steps",
            h.host,
            h.ranks,
            h.offset_ns as f64 / 1e6,
            h.steps_used
        ));
    }
    s
}

/// The process exit code after a command that printed its result.
pub fn exit_code(args: &RunArgs, run: &Run) -> i32 {
    if args.strict && !run.report.is_complete() {
        INCOMPLETE.as_i32()
    } else {
        OK.as_i32()
    }
}

/// `1.234 s`, `12.3 ms`, `456 us`, `789 ns`.
pub fn human_ns(ns: f64) -> String {
    let a = ns.abs();
    if a >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if a >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if a >= 1e3 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
pub fn write_atomically(
    path: &std::path::Path,
    write: impl FnOnce(&mut dyn std::io::Write) -> Result<()>,
) -> Result<()> {
    use anyhow::Context;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file_mut());
        write(&mut w)?;
        std::io::Write::flush(&mut w).with_context(|| format!("writing {}", path.display()))?;
    }
    tmp.persist(path)
        .with_context(|| format!("renaming the output into {}", path.display()))?;
    Ok(())
}
