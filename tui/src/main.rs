//! titan-obs: look at where the time of a titan run went. Exit codes and message form:
//! [`titan_obs::conventions`].

mod commands;

use clap::{Parser, Subcommand};
use titan_cli::{Level, Verbosity};
use titan_obs::conventions::{FAILED, TITAN_OBS, USAGE};

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
    open: titan_obs::app::cli::OpenArgs,
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
    Gantt(titan_obs::app::cli::GanttArgs),
}

fn main() {
    if let Some(message) = misspelt_command(std::env::args_os().skip(1)) {
        TITAN_OBS.error(message);
        std::process::exit(USAGE.as_i32());
    }
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
        Some(Command::Gantt(a)) => Ok(titan_obs::app::cli::gantt(a, quiet)),
        None if cli.run.is_some() => Ok(titan_obs::app::cli::open(
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
            let code = if titan_obs_core::location::is_not_a_run(&e) {
                USAGE
            } else {
                FAILED
            };
            std::process::exit(code.as_i32());
        }
    }
}

/// The message for a command line whose first word is neither a command nor an existing
/// path but reads like a misspelt command (`titan-obs summry RUN`). Without this, clap takes
/// the word for the RUN of the interactive view and complains about the real RUN as an
/// unexpected `[RUN]` argument, or the view reports a missing folder.
fn misspelt_command(args: impl Iterator<Item = std::ffi::OsString>) -> Option<String> {
    use clap::CommandFactory;
    let args: Vec<String> = args.filter_map(|a| a.into_string().ok()).collect();
    let mut words = args.iter().filter(|a| !a.starts_with('-'));
    let first = words.next()?;
    let more = words.next().is_some();
    let cmd = Cli::command();
    let commands: Vec<&str> = cmd
        .get_subcommands()
        .map(|c| c.get_name())
        .filter(|n| *n != "help")
        .collect();
    if commands.contains(&first.as_str())
        || first == "help"
        || first.contains(['/', '.', ':'])
        || std::path::Path::new(first).exists()
    {
        return None;
    }
    let closest = commands
        .iter()
        .map(|c| (edit_distance(first, c), *c))
        .min()
        .filter(|(d, _)| *d <= 2);
    let list = commands.join(", ");
    match closest {
        Some((_, c)) => Some(format!(
            "`{first}` is not a command (did you mean `{c}`? titan-obs {c} RUN); the commands \
             are {list}, and `titan-obs RUN` opens the interactive view"
        )),
        // Two words where the first is no command and no path: a command was meant.
        None if more => Some(format!(
            "`{first}` is not a command or an existing path; the commands are {list}, and \
             `titan-obs RUN` opens the interactive view"
        )),
        None => None,
    }
}

/// Levenshtein distance (insertions, deletions, substitutions) between two short words.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> impl Iterator<Item = std::ffi::OsString> {
        s.split_whitespace()
            .map(std::ffi::OsString::from)
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn misspelt_commands_are_named() {
        let m = misspelt_command(words("summry outputs/demo")).unwrap();
        assert!(m.contains("did you mean `summary`"), "{m}");
        let m = misspelt_command(words("-q exprot run")).unwrap();
        assert!(m.contains("did you mean `export`"), "{m}");
        let m = misspelt_command(words("sumry")).unwrap();
        assert!(m.contains("`summary`"), "{m}");
        // A word far from every command, followed by a run: still not taken for the RUN.
        let m = misspelt_command(words("analyse outputs/demo")).unwrap();
        assert!(m.contains("the commands are summary, metrics"), "{m}");
    }

    #[test]
    fn commands_and_runs_are_left_to_clap() {
        for ok in [
            "summary outputs/demo",
            "outputs/demo",
            "run.json",
            "s3://bucket/run",
            "--follow outputs/demo",
            "help",
            "",
            "somerun",
        ] {
            assert_eq!(misspelt_command(words(ok)), None, "{ok}");
        }
        assert_eq!(edit_distance("summry", "summary"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
