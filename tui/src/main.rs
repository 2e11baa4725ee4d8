//! titan-obs: look at where the time of a titan run went.
//!
//! Exit codes: 0 success; 1 the run could not be read or the output not written; 2 usage
//! error; 3 with `--strict`, the result was printed but ranks were missing or parts corrupt.

mod commands;

use clap::{Parser, Subcommand};

/// Timing analysis of training runs: per-phase summaries with stragglers, torchtitan-style
/// aggregated metrics, Perfetto export and gantt charts. RUN is a titan run (the Parquet
/// parts every rank writes to RUN/obs/rank-<R>/part-<N>.parquet), a torchtitan run (its
/// structured logger's RUN/structured_logs/*.global_rank_<R>.*.jsonl), or a Chrome trace
/// (torchtitan's gantt JSON, a PyTorch profiler trace), local or on an object store.
///
/// `titan-obs RUN` opens the interactive gantt of every rank's timeline (needs a terminal).
#[derive(Parser)]
#[command(name = "titan-obs", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Run to open in the interactive gantt (directory or object store URL).
    run: Option<String>,
    #[command(flatten)]
    open: titan_obs_tui::app::cli::OpenArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Per phase across ranks and steps: count, total, mean, p50, p95, max, share of step
    /// time; stragglers per phase; checkpoint/validation steps and their cost.
    Summary(commands::summary::SummaryArgs),
    /// Aggregated per-step metric lines (`step:  1  training/loss_mean: 8.028 ...`).
    Metrics(commands::metrics::MetricsArgs),
    /// Export the run (`--chrome OUT.json` for Perfetto / chrome://tracing).
    Export(commands::export::ExportArgs),
    /// Write a synthetic multi-rank run (for demos and benchmarks).
    Synth(commands::synth::SynthArgs),
    /// Write a torchtitan run or Chrome trace in titan's Parquet layout (OUT/obs/rank-<R>/...).
    Import(commands::import::ImportArgs),
    /// Write a static gantt of the run (`--svg OUT.svg`, `--png OUT.png`) for reports and PRs.
    Gantt(titan_obs_tui::app::cli::GanttArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TITAN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Some(Command::Summary(a)) => commands::summary::run(a),
        Some(Command::Metrics(a)) => commands::metrics::run(a),
        Some(Command::Export(a)) => commands::export::run(a),
        Some(Command::Synth(a)) => commands::synth::run(a),
        Some(Command::Import(a)) => commands::import::run(a),
        Some(Command::Gantt(a)) => Ok(titan_obs_tui::app::cli::gantt(a)),
        None if cli.run.is_some() => Ok(titan_obs_tui::app::cli::open(
            cli.run.as_deref().unwrap_or_default(),
            &cli.open,
        )),
        None => {
            use clap::CommandFactory;
            let _ = Cli::command().print_help();
            std::process::exit(2);
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
