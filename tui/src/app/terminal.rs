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
    /// Sources that read what is on screen (a large run drawn from its detail levels): fills
    /// the timeline for the view before a frame; true when lanes or rows were added. Such a
    /// source stays on the UI thread.
    fn focus(&mut self, _t: &mut Timeline, _v: &View) -> bool {
        false
    }
    /// Whether [`Self::focus`] does anything (the source stays on the UI thread).
    fn draws_on_demand(&self) -> bool {
        false
    }
    /// Swaps in whole-run results computed in the background since the last call; true
    /// when there were any.
    fn poll_whole(&mut self, _t: &mut Timeline) -> bool {
        false
    }
    /// `--follow` for sources on the UI thread: appends what is new to `t` in place; true
    /// when anything was.
    fn follow_in_place(&mut self, _t: &mut Timeline) -> anyhow::Result<bool> {
        Ok(false)
    }
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
    let (reloads, mut on_ui) = if source.draws_on_demand() {
        (None, Some(source))
    } else if follow {
        (Some(Reloads::spawn(source)), None)
    } else {
        (None, None)
    };
    let mut terminal = ratatui::try_init().context("cannot set up the terminal")?;
    execute!(std::io::stdout(), EnableMouseCapture).context("cannot enable mouse capture")?;
    let result = event_loop(
        &mut terminal,
        Sources {
            reloads: reloads.as_ref(),
            on_ui: on_ui.as_deref_mut(),
            follow,
        },
        follow_note,
        &mut timeline,
        &mut view,
    );
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    let _ = std::io::stdout().flush();
    result
}

/// Where new data comes from while the loop runs: reloads from a worker thread, or a source
/// kept on this thread (drawing from detail levels; `follow` then refreshes it here).
struct Sources<'a> {
    reloads: Option<&'a Reloads>,
    on_ui: Option<&'a mut (dyn TimelineSource + Send + 'static)>,
    follow: bool,
}

fn event_loop(
    terminal: &mut ratatui::DefaultTerminal,
    mut sources: Sources<'_>,
    mut follow_note: Option<String>,
    timeline: &mut Timeline,
    view: &mut View,
) -> anyhow::Result<()> {
    let reloads = sources.reloads;
    let mut geometry = Geometry::default();
    let mut dirty = true;
    let mut frame_ms = None;
    loop {
        if let Some(src) = sources.on_ui.as_deref_mut() {
            if src.poll_whole(timeline) {
                view.rebuild_rows(timeline);
                dirty = true;
            }
            // The source reads on a worker of its own: this only takes what it sent.
            if sources.follow {
                match src.follow_in_place(timeline) {
                    Ok(true) => {
                        view.on_reload(timeline);
                        dirty = true;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        follow_note = Some(format!("following: refresh failed: {e:#}"));
                        dirty = true;
                    }
                }
                if dirty {
                    follow_note = Some(format!("following: {}", src.describe()));
                }
            }
        }
        if dirty {
            let chrome = Chrome {
                follow: follow_note.clone(),
                frame_ms,
            };
            let started = Instant::now();
            // A source drawing from detail levels reads what the view shows; the first draw
            // sizes the view, so a size change draws again.
            for _ in 0..2 {
                let before = (view.cols, view.visible_rows);
                if let Some(src) = sources.on_ui.as_deref_mut() {
                    let kept = view.selected_span(timeline);
                    if src.focus(timeline, view) {
                        view.rebuild_rows(timeline);
                    }
                    view.reselect(timeline, kept);
                }
                terminal.draw(|f| geometry = render::draw(f, timeline, view, &chrome))?;
                if sources.on_ui.is_none() || before == (view.cols, view.visible_rows) {
                    break;
                }
            }
            if sources.on_ui.is_some() {
                frame_ms = Some(started.elapsed().as_secs_f64() * 1e3);
            }
            dirty = false;
        }
        let timeout = if reloads.is_some() || sources.on_ui.is_some() {
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
