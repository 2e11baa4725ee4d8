//! titan-cli: the one set of command-line conventions for titan's three binaries
//! (titan-train, titan-ckpt, titan-obs), so that a user who learned one knows the others.
//!
//! - [`Bin`]: a binary's name and its exit-code table, defined once per binary as a `const`.
//!   Every error/warning/note line goes through it ([`Bin::error`], [`Bin::warning`],
//!   [`Bin::note`]) in one form, `<binary>: error: <what>`, and its table renders into the
//!   binary's `--help` ([`Bin::exit_codes_help`], for clap's `after_help`).
//! - [`ExitCode`]: one row of that table (code and meaning); binaries name their codes as
//!   constants and return them, so a code's number and its documentation live in one place.
//! - [`Verbosity`]: `-v`/`-vv`/`-q` as a flattenable clap [`clap::Args`];
//!   [`Verbosity::init_logging`] sets up `tracing` on stderr, with `RUST_LOG` overriding.

use std::fmt::{self, Display, Write as _};

/// One exit code of a binary and what it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitCode {
    /// The process exit status.
    pub code: u8,
    /// What the code tells a script, as shown in `--help` ("usage or config error").
    pub meaning: &'static str,
}

impl ExitCode {
    pub const fn new(code: u8, meaning: &'static str) -> Self {
        Self { code, meaning }
    }

    /// The exit status as an `i32` (for functions that return `std::process::exit` codes).
    pub const fn as_i32(self) -> i32 {
        self.code as i32
    }
}

impl From<ExitCode> for std::process::ExitCode {
    fn from(c: ExitCode) -> Self {
        std::process::ExitCode::from(c.code)
    }
}

/// A binary: its name (the prefix of every message it prints) and its exit-code table.
#[derive(Debug, Clone, Copy)]
pub struct Bin {
    pub name: &'static str,
    pub exit_codes: &'static [ExitCode],
}

/// How serious a message line is; the word after the binary's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Warning,
    Note,
}

impl Severity {
    fn word(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        }
    }
}

impl Bin {
    pub const fn new(name: &'static str, exit_codes: &'static [ExitCode]) -> Self {
        Self { name, exit_codes }
    }

    /// `<binary>: <severity>: <what>`; continuation lines of a multi-line `what` are indented
    /// so each message stays one block.
    pub fn message(&self, severity: Severity, what: impl Display) -> String {
        let what = what.to_string();
        let mut lines = what.lines();
        let mut s = format!(
            "{}: {}: {}",
            self.name,
            severity.word(),
            lines.next().unwrap_or_default()
        );
        for line in lines {
            s.push_str("\n  ");
            s.push_str(line);
        }
        s
    }

    /// Prints `<binary>: error: <what>` on stderr.
    pub fn error(&self, what: impl Display) {
        eprintln!("{}", self.message(Severity::Error, what));
    }

    /// Prints `<binary>: warning: <what>` on stderr.
    pub fn warning(&self, what: impl Display) {
        eprintln!("{}", self.message(Severity::Warning, what));
    }

    /// Prints `<binary>: note: <what>` on stderr: something the user should know about the
    /// result (which checkpoint or model family was picked, a default assumed).
    pub fn note(&self, what: impl Display) {
        eprintln!("{}", self.message(Severity::Note, what));
    }

    /// The table for `--help`:
    ///
    /// ```text
    /// Exit codes:
    ///   0  success
    ///   2  usage or config error
    /// ```
    pub fn exit_codes_help(&self) -> String {
        let mut s = String::from("Exit codes:");
        for c in self.exit_codes {
            let _ = write!(s, "\n  {:<3} {}", c.code, c.meaning);
        }
        s
    }

    /// The help text after the options: the exit codes, then how logging is controlled.
    pub fn after_help(&self) -> String {
        format!("{}\n\n{}", self.exit_codes_help(), LOGGING_HELP)
    }
}

/// How every binary's logging is controlled (shown in `--help`).
pub const LOGGING_HELP: &str = "Logging (tracing, on stderr unless said otherwise): -v info, -vv debug, \
-q errors only (and no progress bars). RUST_LOG (e.g. RUST_LOG=debug, RUST_LOG=titan_obs_core=trace) overrides -v/-q.";

/// `-v`/`-vv` and `-q`, shared by every binary (flatten into the top-level parser).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::Args)]
pub struct Verbosity {
    /// More log output on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// No progress bars, only errors in the log; RUST_LOG overrides.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
}

impl Verbosity {
    /// The `tracing` filter directive for these flags, given the binary's default level.
    pub fn level(&self, default: Level) -> Level {
        if self.quiet {
            Level::Error
        } else {
            match self.verbose {
                0 => default,
                1 => default.max(Level::Info),
                _ => default.max(Level::Debug),
            }
        }
    }

    /// Logs to stderr at [`Verbosity::level`], unless `RUST_LOG` is set (then it decides).
    pub fn init_logging(&self, default: Level) {
        // A second init (tests calling a main twice) keeps the first subscriber.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(self.filter(default))
            .with_writer(std::io::stderr)
            .try_init();
    }

    /// The `tracing` filter: `RUST_LOG` when set, else [`Verbosity::level`] (for binaries that
    /// build their own subscriber, e.g. with colours off).
    pub fn filter(&self, default: Level) -> tracing_subscriber::EnvFilter {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(self.level(default).as_str()))
    }

    /// `-q` given: no progress bars.
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }
}

/// Log levels, least to most verbose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const OK: ExitCode = ExitCode::new(0, "success");
    const USAGE: ExitCode = ExitCode::new(2, "usage error");
    const DEMO: Bin = Bin::new("demo", &[OK, USAGE]);

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        verbosity: Verbosity,
        #[command(subcommand)]
        command: Option<Sub>,
    }

    #[derive(clap::Subcommand)]
    enum Sub {
        Run,
    }

    fn parse(args: &[&str]) -> Result<Verbosity, clap::Error> {
        Cli::try_parse_from(std::iter::once("demo").chain(args.iter().copied()))
            .map(|c| c.verbosity)
    }

    #[test]
    fn message_form_is_binary_severity_what() {
        assert_eq!(
            DEMO.message(Severity::Error, "cannot read x.parquet"),
            "demo: error: cannot read x.parquet"
        );
        assert_eq!(
            DEMO.message(Severity::Warning, "rank 3 is missing"),
            "demo: warning: rank 3 is missing"
        );
        assert_eq!(
            DEMO.message(Severity::Note, "a\nb"),
            "demo: note: a\n  b",
            "continuation lines are indented under the first"
        );
    }

    #[test]
    fn exit_codes_render_in_order_with_meanings() {
        assert_eq!(
            DEMO.exit_codes_help(),
            "Exit codes:\n  0   success\n  2   usage error"
        );
        assert!(DEMO.after_help().contains("RUST_LOG"));
        assert_eq!(USAGE.as_i32(), 2);
    }

    #[test]
    fn verbosity_flags_map_to_levels() {
        let v = parse(&[]).unwrap();
        assert_eq!(v.level(Level::Warn), Level::Warn);
        assert_eq!(v.level(Level::Info), Level::Info);
        assert_eq!(parse(&["-v"]).unwrap().level(Level::Warn), Level::Info);
        assert_eq!(parse(&["-vv"]).unwrap().level(Level::Warn), Level::Debug);
        assert_eq!(
            parse(&["-v", "-v", "-v"]).unwrap().level(Level::Warn),
            Level::Debug
        );
        // -v never lowers a binary whose default is already more verbose.
        assert_eq!(parse(&["-v"]).unwrap().level(Level::Debug), Level::Debug);
        let q = parse(&["-q"]).unwrap();
        assert!(q.is_quiet());
        assert_eq!(q.level(Level::Info), Level::Error);
    }

    #[test]
    fn verbosity_flags_are_global_and_exclusive() {
        assert_eq!(parse(&["run", "-vv"]).unwrap().verbose, 2);
        assert!(parse(&["run", "--quiet"]).unwrap().quiet);
        assert!(parse(&["-v", "-q"]).is_err(), "-v and -q contradict");
    }
}
