//! The interactive loop: terminal setup and teardown, events, and `--follow` reloads.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::Context;
use crossterm::event::{self, DisableMouseCapture, EnableMouseCapture, Event};
use crossterm::execute;

use super::input::{self, Control};
use super::model::Timeline;
use super::render::{self, Chrome, Geometry};
use super::view::View;

/// Something that can (re)load a run's timeline.
pub trait TimelineSource {
    fn load(&mut self) -> anyhow::Result<Timeline>;
    /// A newer timeline when the run has new data since the last load, else `None`.
    fn reload_if_changed(&mut self) -> anyhow::Result<Option<Timeline>>;
    /// A few words on what has been read (e.g. "31 parts").
    fn describe(&self) -> String;
}

/// How often `--follow` looks for new parts.
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// What to print when started without a terminal.
pub fn no_terminal_message() -> String {
    let bin = crate::conventions::TITAN_OBS.name;
    format!(
        "{bin}: error: the interactive gantt needs a terminal (stdin and stdout must be a tty).\n\
         \n\
         Without one, use the non-interactive commands:\n\
         \x20 {bin} summary RUN            per-phase times across ranks and steps, stragglers\n\
         \x20 {bin} metrics RUN [--json|--csv]   per-step metrics (loss, tps, ...)\n\
         \x20 {bin} export RUN --chrome OUT.json  Chrome trace for Perfetto / chrome://tracing\n\
         \x20 {bin} gantt RUN --svg OUT.svg [--png OUT.png]   a static gantt image\n\
         \n\
         Over ssh, run `{bin} RUN` in a terminal (or tmux) to open the interactive view.\n"
    )
}

/// True when both stdin and stdout are terminals.
pub fn has_terminal() -> bool {
    std::io::stdin().is_terminal() && std::io::stdout().is_terminal()
}

/// Runs the interactive gantt until the user quits.
pub fn run(source: &mut dyn TimelineSource, follow: bool) -> anyhow::Result<()> {
    let mut timeline = source.load()?;
    let mut view = View::new(&timeline);
    let mut terminal = ratatui::try_init().context("cannot set up the terminal")?;
    execute!(std::io::stdout(), EnableMouseCapture).context("cannot enable mouse capture")?;
    let result = event_loop(&mut terminal, source, &mut timeline, &mut view, follow);
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    let _ = std::io::stdout().flush();
    result
}

fn event_loop(
    terminal: &mut ratatui::DefaultTerminal,
    source: &mut dyn TimelineSource,
    timeline: &mut Timeline,
    view: &mut View,
    follow: bool,
) -> anyhow::Result<()> {
    let mut geometry = Geometry::default();
    let mut last_check = Instant::now();
    let mut follow_note: Option<String> =
        follow.then(|| format!("following: {}", source.describe()));
    let mut dirty = true;
    loop {
        if dirty {
            let chrome = Chrome {
                follow: follow_note.clone(),
            };
            terminal.draw(|f| geometry = render::draw(f, timeline, view, &chrome))?;
            dirty = false;
        }
        let timeout = if follow {
            FOLLOW_INTERVAL.saturating_sub(last_check.elapsed())
        } else {
            Duration::from_secs(3600)
        };
        if event::poll(timeout)? {
            // Drain everything queued before redrawing: key repeat must not lag behind.
            loop {
                match event::read()? {
                    Event::Key(k) if input::on_key(timeline, view, k) == Control::Quit => {
                        return Ok(());
                    }
                    Event::Mouse(m) => input::on_mouse(timeline, view, geometry, m),
                    Event::Resize(..) => {}
                    _ => {}
                }
                if !event::poll(Duration::ZERO)? {
                    break;
                }
            }
            dirty = true;
        }
        if follow && last_check.elapsed() >= FOLLOW_INTERVAL {
            last_check = Instant::now();
            match source.reload_if_changed() {
                Ok(Some(t)) => {
                    *timeline = t;
                    view.on_reload(timeline);
                    follow_note = Some(format!("following: {}", source.describe()));
                    dirty = true;
                }
                Ok(None) => {}
                Err(e) => {
                    follow_note = Some(format!("following: reload failed: {e:#}"));
                    dirty = true;
                }
            }
        }
    }
}
