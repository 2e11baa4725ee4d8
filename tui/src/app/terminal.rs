//! The interactive loop: terminal setup and teardown, events, and `--follow` reloads.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, TryRecvError};
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

/// How often `--follow` looks for new parts (at least: see [`Reloads`]).
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// How often the event loop looks for a reloaded timeline while following.
const SWAP_INTERVAL: Duration = Duration::from_millis(100);

/// A reloaded timeline and the source's new description, or why the reload failed.
type Reload = Result<(Timeline, String), String>;

/// `--follow`'s reloads on a worker thread that owns the source. Building a large run's
/// timeline takes seconds (1024 ranks x 6 h: ~12 s), so it must not run on the thread that
/// reads keys: the event loop only swaps in what the worker sends. After a reload that took
/// `d`, the worker waits `max(FOLLOW_INTERVAL, d)`, so following keeps at most half a core busy.
struct Reloads {
    rx: Receiver<Reload>,
    stop: Arc<AtomicBool>,
    /// The worker is gone (it panicked): said once, then nothing more is looked for.
    gone: std::cell::Cell<bool>,
}

impl Reloads {
    fn spawn(mut source: Box<dyn TimelineSource + Send>) -> Self {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            let mut wait = FOLLOW_INTERVAL;
            loop {
                let wake = Instant::now() + wait;
                while Instant::now() < wake {
                    if stopped.load(Ordering::Relaxed) {
                        return;
                    }
                    std::thread::sleep(
                        SWAP_INTERVAL.min(wake.saturating_duration_since(Instant::now())),
                    );
                }
                let t = Instant::now();
                let reload = match source.reload_if_changed() {
                    Ok(Some(timeline)) => Some(Ok((timeline, source.describe()))),
                    Ok(None) => None,
                    Err(e) => Some(Err(format!("{e:#}"))),
                };
                wait = FOLLOW_INTERVAL.max(t.elapsed());
                if let Some(r) = reload
                    && (stopped.load(Ordering::Relaxed) || tx.send(r).is_err())
                {
                    return;
                }
            }
        });
        Reloads {
            rx,
            stop,
            gone: std::cell::Cell::new(false),
        }
    }

    /// The newest reload sent since the last call, if any.
    fn newest(&self) -> Option<Reload> {
        if self.gone.get() {
            return None;
        }
        let mut newest = None;
        loop {
            match self.rx.try_recv() {
                Ok(r) => newest = Some(r),
                Err(TryRecvError::Empty) => return newest,
                Err(TryRecvError::Disconnected) => {
                    self.gone.set(true);
                    return newest.or(Some(Err("the reload thread stopped".into())));
                }
            }
        }
    }
}

impl Drop for Reloads {
    fn drop(&mut self) {
        // The worker may be in the middle of a long rebuild: it sees the flag when done and
        // exits without sending; nobody waits for it.
        self.stop.store(true, Ordering::Relaxed);
    }
}

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

/// Runs the interactive gantt until the user quits. With `follow`, the source is reloaded on
/// a worker thread ([`Reloads`]).
pub fn run(mut source: Box<dyn TimelineSource + Send>, follow: bool) -> anyhow::Result<()> {
    let mut timeline = source.load()?;
    let mut view = View::new(&timeline);
    let follow_note = follow.then(|| format!("following: {}", source.describe()));
    let reloads = follow.then(|| Reloads::spawn(source));
    let mut terminal = ratatui::try_init().context("cannot set up the terminal")?;
    execute!(std::io::stdout(), EnableMouseCapture).context("cannot enable mouse capture")?;
    let result = event_loop(
        &mut terminal,
        reloads.as_ref(),
        follow_note,
        &mut timeline,
        &mut view,
    );
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    let _ = std::io::stdout().flush();
    result
}

fn event_loop(
    terminal: &mut ratatui::DefaultTerminal,
    reloads: Option<&Reloads>,
    mut follow_note: Option<String>,
    timeline: &mut Timeline,
    view: &mut View,
) -> anyhow::Result<()> {
    let mut geometry = Geometry::default();
    let mut dirty = true;
    loop {
        if dirty {
            let chrome = Chrome {
                follow: follow_note.clone(),
            };
            terminal.draw(|f| geometry = render::draw(f, timeline, view, &chrome))?;
            dirty = false;
        }
        let timeout = if reloads.is_some() {
            SWAP_INTERVAL
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
        match reloads.and_then(Reloads::newest) {
            Some(Ok((t, describe))) => {
                *timeline = t;
                view.on_reload(timeline);
                follow_note = Some(format!("following: {describe}"));
                dirty = true;
            }
            Some(Err(e)) => {
                follow_note = Some(format!("following: reload failed: {e}"));
                dirty = true;
            }
            None => {}
        }
    }
}
