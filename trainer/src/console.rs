//! What `titan-train` shows on its console: log lines that stay readable in [`WIDTH`] columns
//! (`HH:MM:SS  INFO message fields`, wrapped at spaces under the message), and on a terminal a
//! live step counter on stderr ([`Steps`], rank 0 only) that log lines print above instead of
//! through.

use std::io::{IsTerminal as _, Write as _};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// The widest a console line gets (a word longer than a line, such as a long path, is kept
/// whole).
pub const WIDTH: usize = 100;

/// The step counter being drawn, if any: log lines are written while it is hidden.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Set by `-q` (no progress bars, as in every titan tool).
static NO_STEP_COUNTER: AtomicBool = AtomicBool::new(false);

/// `-q`: [`Steps`] draws nothing.
pub fn hide_step_counter() {
    NO_STEP_COUNTER.store(true, Ordering::Relaxed);
}

fn bar() -> Option<ProgressBar> {
    BAR.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The columns a log line may use: [`WIDTH`], less the `[rankN]:` that a launcher (ours,
/// torchrun) puts before each line of a rank's output.
pub fn line_width() -> usize {
    match std::env::var("RANK") {
        Ok(rank) if !rank.is_empty() => WIDTH.saturating_sub(format!("[rank{rank}]:").len()),
        _ => WIDTH,
    }
}

/// The log line format: local time, level, the message and its fields, wrapped to `width`.
pub struct LineFormat {
    /// Colour the level (only when the logs go to a terminal).
    pub ansi: bool,
    /// Columns per line ([`line_width`]).
    pub width: usize,
}

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut body = String::new();
        // Where a debug line comes from helps; at info and above the message says it.
        if *meta.level() > Level::INFO {
            body.push_str(meta.target());
            body.push_str(": ");
        }
        ctx.field_format()
            .format_fields(Writer::new(&mut body), event)?;
        let time = chrono::Local::now().format("%H:%M:%S").to_string();
        let level = meta.level().as_str();
        let indent = time.len() + 7;
        let colour = match *meta.level() {
            Level::ERROR => "31",
            Level::WARN => "33",
            Level::INFO => "32",
            _ => "2",
        };
        if self.ansi {
            write!(writer, "{time} \x1b[{colour}m{level:>5}\x1b[0m ")?;
        } else {
            write!(writer, "{time} {level:>5} ")?;
        }
        for (i, line) in wrap(&body, self.width.saturating_sub(indent).max(20))
            .iter()
            .enumerate()
        {
            if i > 0 {
                write!(writer, "{:indent$}", "")?;
            }
            writeln!(writer, "{line}")?;
        }
        Ok(())
    }
}

/// `text` in lines of at most `width` characters: broken at double spaces (between the
/// `name: value` pairs of a metrics line) where they fit, else at single spaces. Its own line
/// breaks are kept; a word longer than `width` gets a line of its own.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for raw in text.lines() {
        let mut line = String::new();
        for segment in raw.split("  ") {
            let fits = |line: &str, add: &str, sep: usize| {
                line.is_empty() || line.chars().count() + sep + add.chars().count() <= width
            };
            if segment.chars().count() <= width {
                if !fits(&line, segment, 2) {
                    lines.push(std::mem::take(&mut line));
                }
                if !line.is_empty() {
                    line.push_str("  ");
                }
                line.push_str(segment);
                continue;
            }
            let mut sep = 2;
            for word in segment.split(' ') {
                if !fits(&line, word, sep) {
                    lines.push(std::mem::take(&mut line));
                }
                if !line.is_empty() {
                    line.push_str(&" ".repeat(sep));
                }
                line.push_str(word);
                sep = 1;
            }
        }
        lines.push(line);
    }
    if lines.is_empty() {
        lines.push(String::new());
    }
    lines
}

/// Log lines go to stdout, one write each, with the step counter hidden while they print.
pub struct ConsoleWriter;

impl<'a> MakeWriter<'a> for ConsoleWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::new())
    }
}

/// One formatted log event, written out when dropped.
pub struct LogLine(Vec<u8>);

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let write = || {
            let mut out = std::io::stdout().lock();
            // A closed stdout loses the log line; training goes on.
            let _ = out.write_all(&self.0).and_then(|()| out.flush());
        };
        match bar() {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }
}

/// Set by titan-train's launcher for global rank 0 when the launcher's stderr is a terminal:
/// that rank's stderr is then the launcher's pipe, so instead of drawing the step counter it
/// reports it in [`STEP_EVENT`] lines, which the launcher draws ([`follow_step_event`]).
pub const STEP_EVENTS_ENV: &str = "TITAN_STEP_EVENTS";

/// The start of a step-counter event line (`start DONE TOTAL`, `step N`, `loss X`, `end`). An
/// APC escape: a terminal that got one anyway would show nothing.
pub const STEP_EVENT: &str = "\x1b_titan-steps ";

/// The live step counter of rank 0 on a terminal (stderr): steps done of the total, rate, time
/// left and the last logged loss. Cleared when dropped.
pub struct Steps {
    shown: bool,
    /// Reported to the launcher as [`STEP_EVENT`] lines instead of drawn.
    events: bool,
    /// The step it started at: until one more is done there is no rate to tell the time
    /// left by (indicatif would say "~0s left").
    started_at: u64,
}

/// The counter's line before its first step, and after it.
const FIRST_STEP_TEMPLATE: &str =
    "{spinner} step {pos}/{len} [{bar:30}] {elapsed} elapsed, first step running  {msg}";
const TEMPLATE: &str =
    "{spinner} step {pos}/{len} [{bar:30}] {elapsed} elapsed, ~{eta} left  {msg}";

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("valid template")
        .progress_chars("=> ")
}

impl Steps {
    /// Starts counting at `done` steps of `total`; draws only when `draw` (rank 0), stderr
    /// is a terminal and `-q` was not given.
    pub fn start(done: u64, total: u64, draw: bool) -> Self {
        let wanted = draw && !NO_STEP_COUNTER.load(Ordering::Relaxed);
        if wanted && std::env::var_os(STEP_EVENTS_ENV).is_some() {
            step_event(&format!("start {done} {total}"));
            return Steps {
                shown: false,
                events: true,
                started_at: done,
            };
        }
        if !wanted || !std::io::stderr().is_terminal() {
            return Steps {
                shown: false,
                events: false,
                started_at: done,
            };
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        bar.set_style(style(FIRST_STEP_TEMPLATE));
        bar.set_position(done);
        // Steps resumed from a checkpoint are not this process's rate.
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(200));
        *BAR.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar);
        Steps {
            shown: true,
            events: false,
            started_at: done,
        }
    }

    /// `step` is done.
    pub fn step(&self, step: u64) {
        if self.events {
            step_event(&format!("step {step}"));
        }
        if let Some(bar) = self.shown.then(bar).flatten() {
            if step == self.started_at + 1 {
                bar.set_style(style(TEMPLATE));
            }
            bar.set_position(step);
        }
    }

    /// The last logged training loss, shown after the counter.
    pub fn loss(&self, loss: f64) {
        if self.events {
            step_event(&format!("loss {loss:.4}"));
        }
        if let Some(bar) = self.shown.then(bar).flatten() {
            bar.set_message(format!("loss {loss:.4}"));
        }
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        if self.events {
            step_event("end");
        }
        if let Some(bar) = BAR.lock().unwrap_or_else(|e| e.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// One [`STEP_EVENT`] line on stderr, whole.
fn step_event(what: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{STEP_EVENT}{what}").and_then(|()| err.flush());
}

/// The step counter the launcher draws for rank 0.
static FOLLOWED: Mutex<Option<Steps>> = Mutex::new(None);

/// The launcher's side of [`STEP_EVENTS_ENV`]: when `line` (of rank 0's stderr) is a
/// [`STEP_EVENT`], draws it on this process's stderr and returns true (the line is not to be
/// printed); other lines return false.
pub fn follow_step_event(line: &str) -> bool {
    let Some(event) = line.strip_prefix(STEP_EVENT) else {
        return false;
    };
    let mut followed = FOLLOWED.lock().unwrap_or_else(|e| e.into_inner());
    let mut words = event.split_whitespace();
    let number = |w: Option<&str>| w.and_then(|w| w.parse::<u64>().ok());
    match words.next() {
        Some("start") => {
            if let (Some(done), Some(total)) = (number(words.next()), number(words.next())) {
                *followed = Some(Steps::start(done, total, true));
            }
        }
        Some("step") => {
            if let (Some(steps), Some(n)) = (followed.as_ref(), number(words.next())) {
                steps.step(n);
            }
        }
        Some("loss") => {
            let loss = words.next().and_then(|w| w.parse::<f64>().ok());
            if let (Some(steps), Some(loss)) = (followed.as_ref(), loss) {
                steps.loss(loss);
            }
        }
        _ => *followed = None,
    }
    true
}

/// Writes `bytes` to stdout or stderr whole, above the step counter if one is drawn.
pub fn write_above(to_stderr: bool, bytes: &[u8]) {
    let write = || {
        let _ = if to_stderr {
            std::io::stderr().lock().write_all(bytes)
        } else {
            std::io::stdout().lock().write_all(bytes)
        };
    };
    match bar() {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_metrics_lines_between_pairs() {
        let line = "step:  1  training/loss_mean: 8.0280  training/grad_norm_max: 50810.5000  \
                    trainer_memory/reserved_gib_max: 0.19  trainer_throughput/tps_mean: 361.4";
        let lines = wrap(line, 60);
        assert_eq!(
            lines,
            [
                "step:  1  training/loss_mean: 8.0280",
                "training/grad_norm_max: 50810.5000",
                "trainer_memory/reserved_gib_max: 0.19",
                "trainer_throughput/tps_mean: 361.4",
            ]
        );
        assert!(lines.iter().all(|l| l.len() <= 60));
        // Fields of a structured line break at single spaces; long words stay whole.
        let lines = wrap(
            "model built flavor=debugmodel params=6139264 dp_shard=1 tp=1",
            30,
        );
        assert_eq!(
            lines,
            [
                "model built flavor=debugmodel",
                "params=6139264 dp_shard=1 tp=1"
            ]
        );
        assert_eq!(wrap(&"x".repeat(40), 30), ["x".repeat(40)]);
        assert_eq!(wrap("a\nb", 30), ["a", "b"]);
    }
}
