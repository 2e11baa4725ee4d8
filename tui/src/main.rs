//! titan-obs: look at where the time of a titan run went. Exit codes and message form:
//! [`titan_obs_tui::conventions`].

mod commands;

use clap::{Parser, Subcommand};
use titan_cli::{Level, Verbosity};
use titan_obs_tui::conventions::{FAILED, TITAN_OBS, USAGE};

/// Timing analysis of training runs: per-phase summaries with stragglers, torchtitan-style
/// aggregated metrics, Perfetto export and gantt charts. RUN is a titan run (the Parquet
/// parts every rank writes to RUN/obs/rank-<R>/part-<N>.parquet), a torchtitan run (its
/// structured logger's RUN/structured_logs/*.global_rank_<R>.*.jsonl), or a Chrome trace
/// (torchtitan's gantt JSON, a PyTorch profiler trace), local or on an object store.
///
/// `titan-obs RUN` opens the interactive gantt of every rank's timeline (needs a terminal).
#[derive(Parser)]
#[command(
    name = "titan-obs",
    version,
    args_conflicts_with_subcommands = true,
    after_help = TITAN_OBS.after_help()
)]
struct Cli {
    #[command(flatten)]
    verbosity: Verbosity,
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
    let mut cli = Cli::parse();
    cli.verbosity.init_logging(Level::Warn);
    let quiet = cli.verbosity.is_quiet();
    if let Some(run_args) = cli.command.as_mut().and_then(Command::run_args_mut) {
        run_args.quiet = quiet;
    }
    let result = match &cli.command {
        Some(Command::Summary(a)) => commands::summary::run(a),
        Some(Command::Metrics(a)) => commands::metrics::run(a),
        Some(Command::Export(a)) => commands::export::run(a),
        Some(Command::Synth(a)) => commands::synth::run(a),
        Some(Command::Import(a)) => commands::import::run(a),
        Some(Command::Gantt(a)) => Ok(titan_obs_tui::app::cli::gantt(a, quiet)),
        None if cli.run.is_some() => Ok(titan_obs_tui::app::cli::open(
            cli.run.as_deref().unwrap_or_default(),
            &cli.open,
        )),
        None => {
            use clap::CommandFactory;
            let _ = Cli::command().print_help();
            std::process::exit(USAGE.as_i32());
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            TITAN_OBS.error(format_args!("{e:#}"));
            std::process::exit(FAILED.as_i32());
        }
    }
}

impl Command {
    /// The options of the commands that read a run through `commands::load_run`.
    fn run_args_mut(&mut self) -> Option<&mut commands::RunArgs> {
        match self {
            Command::Summary(a) => Some(&mut a.run),
            Command::Metrics(a) => Some(&mut a.run),
            Command::Export(a) => Some(&mut a.run),
            Command::Import(a) => Some(&mut a.run),
            Command::Synth(_) | Command::Gantt(_) => None,
        }
    }
}
