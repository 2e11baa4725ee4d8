//! What the user is looking at (window, cursor, rows, selection, panels) and the navigation
//! actions that change it. No terminal here: every action is a plain state transition, so
//! the snapshot tests drive exactly what the keys do.

use super::cells::Window;
use super::model::{Ns, SpanRef, Timeline};

/// Lanes per rank/thread/depth, or one lane per phase with the spread across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Lanes,
    Collapsed,
}

/// One screen row of the gantt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowRef {
    /// Row `row` of lane `lane`.
    Span { lane: u32, row: u16 },
    /// Index into `Timeline::collapsed`.
    Phase(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    Span(SpanRef),
    /// A collapsed bar: (collapsed row, bar index).
    Bar {
        row: u32,
        bar: u32,
    },
}

/// The whole interactive state except the data.
#[derive(Debug, Clone)]
pub struct View {
    pub window: Window,
    pub cursor: Ns,
    pub cursor_row: usize,
    /// First row shown.
    pub scroll: usize,
    pub mode: Mode,
    pub rows: Vec<RowRef>,
    pub selected: Option<Selection>,
    pub help: bool,
    pub show_metrics: bool,
    pub show_summary: bool,
    /// Experts spans coloured by their rank's experts' load instead of by phase (`e`).
    pub load_colours: bool,
    /// Digits typed after `g` (jump to step).
    pub prompt: Option<String>,
    /// One-line feedback (e.g. "no step 99").
    pub message: Option<String>,
    /// The window shows the whole run; `--follow` keeps it that way as the run grows.
    pub fit_all: bool,
    /// Gantt columns and rows at the last draw (for cell-sized moves and paging).
    pub cols: usize,
    pub visible_rows: usize,
}

impl View {
    pub fn new(t: &Timeline) -> Self {
        let mut v = Self {
            window: Window { t0: 0, t1: 1 },
            cursor: 0,
            cursor_row: 0,
            scroll: 0,
            mode: Mode::Lanes,
            rows: Vec::new(),
            selected: None,
            help: false,
            show_metrics: true,
            show_summary: true,
            load_colours: false,
            prompt: None,
            message: None,
            fit_all: true,
            cols: 80,
            visible_rows: 20,
        };
        v.rebuild_rows(t);
        v.fit(t);
        v
    }

    /// Colours experts spans by load, or by phase again; says so when the run recorded no
    /// expert load under expert parallelism.
    pub fn toggle_load_colours(&mut self, t: &Timeline) {
        if t.experts_load.is_empty() && !self.load_colours {
            self.message = Some(
                "no expert load to colour by: the run recorded none under expert parallelism"
                    .into(),
            );
            return;
        }
        self.load_colours = !self.load_colours;
        self.message = Some(if self.load_colours {
            "experts spans coloured by their rank's experts' load (e: back to phases)".into()
        } else {
            "experts spans coloured by phase".into()
        });
    }

    /// Recomputes the row list after a mode change or a reload.
    pub fn rebuild_rows(&mut self, t: &Timeline) {
        self.rows = match self.mode {
            Mode::Lanes => t
                .lanes
                .iter()
                .enumerate()
                .flat_map(|(li, lane)| {
                    (0..lane.rows.len()).map(move |r| RowRef::Span {
                        lane: li as u32,
                        row: r as u16,
                    })
                })
                .collect(),
            Mode::Collapsed => (0..t.collapsed.len() as u32).map(RowRef::Phase).collect(),
        };
        self.cursor_row = self.cursor_row.min(self.rows.len().saturating_sub(1));
        self.keep_cursor_row_visible();
    }

    /// The rows on screen (as of the last draw's size).
    pub fn visible_row_refs(&self) -> impl Iterator<Item = RowRef> + '_ {
        self.rows
            .iter()
            .skip(self.scroll)
            .take(self.visible_rows.max(1))
            .copied()
    }

    /// The selected span and its start, to find it again once its row is refilled (a run
    /// drawn from detail levels refills the rows on screen as the window moves).
    pub fn selected_span(&self, t: &Timeline) -> Option<(SpanRef, Ns)> {
        match self.selected {
            Some(Selection::Span(r)) => {
                let row = t.lanes.get(r.lane as usize)?.rows.get(r.row as usize)?;
                Some((r, *row.start.get(r.ix as usize)?))
            }
            _ => None,
        }
    }

    /// Selects again the span of `kept` by its start in its row; drops the selection when the
    /// row no longer holds it.
    pub fn reselect(&mut self, t: &Timeline, kept: Option<(SpanRef, Ns)>) {
        let Some((r, start)) = kept else { return };
        let row = t
            .lanes
            .get(r.lane as usize)
            .and_then(|l| l.rows.get(r.row as usize));
        self.selected = row
            .and_then(|row| row.start.binary_search(&start).ok())
            .map(|ix| Selection::Span(SpanRef { ix: ix as u32, ..r }));
    }

    /// Called after a reload (`--follow`): keeps the view, extends it if it showed everything.
    pub fn on_reload(&mut self, t: &Timeline) {
        self.rebuild_rows(t);
        if let Some(Selection::Span(r)) = self.selected {
            let valid = t
                .lanes
                .get(r.lane as usize)
                .and_then(|l| l.rows.get(r.row as usize))
                .is_some_and(|row| (r.ix as usize) < row.len());
            if !valid {
                self.selected = None;
            }
        }
        if self.fit_all {
            let cursor = self.cursor;
            self.fit(t);
            self.cursor = cursor.clamp(self.window.t0, self.window.t1);
        }
    }

    fn min_width(&self) -> Ns {
        self.cols.max(1) as Ns
    }

    /// Shows the whole run.
    pub fn fit(&mut self, t: &Timeline) {
        let len = t.end.max(1);
        let pad = (len / 50).max(1);
        self.window = Window {
            t0: -pad,
            t1: len + pad,
        };
        self.cursor = self.cursor.clamp(self.window.t0, self.window.t1);
        self.fit_all = true;
    }

    /// Zooms by `factor` (< 1 in, > 1 out) keeping the cursor at the same screen column.
    pub fn zoom(&mut self, t: &Timeline, factor: f64) {
        let w = self.window;
        let max_width = (t.end.max(1) as f64 * 1.5) as Ns + self.min_width();
        let new_width = ((w.width() as f64 * factor) as Ns).clamp(self.min_width(), max_width);
        let left = ((self.cursor - w.t0) as f64 / w.width() as f64 * new_width as f64) as Ns;
        let t0 = self.cursor - left;
        self.window = Window {
            t0,
            t1: t0 + new_width,
        };
        self.fit_all = false;
    }

    /// Moves the window by `frac` of its width (negative = left); the cursor moves with it.
    pub fn pan(&mut self, frac: f64) {
        let d = (self.window.width() as f64 * frac) as Ns;
        self.window.t0 += d;
        self.window.t1 += d;
        self.cursor += d;
        self.fit_all = false;
    }

    /// Moves the cursor by `cells` columns, panning when it leaves the window.
    pub fn move_cursor(&mut self, cells: i64) {
        let per_cell = (self.window.width() / self.cols.max(1) as Ns).max(1);
        self.set_cursor(self.cursor + cells * per_cell);
    }

    /// Puts the cursor at `t`, panning so that it stays visible.
    pub fn set_cursor(&mut self, t: Ns) {
        self.cursor = t;
        let w = self.window.width();
        if t < self.window.t0 {
            self.window.t0 = t - w / 10;
            self.window.t1 = self.window.t0 + w;
            self.fit_all = false;
        } else if t >= self.window.t1 {
            self.window.t1 = t + w / 10;
            self.window.t0 = self.window.t1 - w;
            self.fit_all = false;
        }
    }

    pub fn move_row(&mut self, delta: i64) {
        if self.rows.is_empty() {
            return;
        }
        let r = (self.cursor_row as i64 + delta).clamp(0, self.rows.len() as i64 - 1);
        self.cursor_row = r as usize;
        self.keep_cursor_row_visible();
    }

    /// Scrolls the rows without moving the cursor row off screen.
    pub fn scroll_rows(&mut self, delta: i64) {
        let max = self.rows.len().saturating_sub(self.visible_rows.max(1));
        self.scroll = (self.scroll as i64 + delta).clamp(0, max as i64) as usize;
        let last = self.scroll + self.visible_rows.max(1) - 1;
        self.cursor_row = self
            .cursor_row
            .clamp(self.scroll, last.min(self.rows.len().saturating_sub(1)));
    }

    pub fn keep_cursor_row_visible(&mut self) {
        let vis = self.visible_rows.max(1);
        if self.cursor_row < self.scroll {
            self.scroll = self.cursor_row;
        } else if self.cursor_row >= self.scroll + vis {
            self.scroll = self.cursor_row + 1 - vis;
        }
        let max = self.rows.len().saturating_sub(vis);
        self.scroll = self.scroll.min(max);
    }

    /// Shows step `step` with a small margin and puts the cursor at its start.
    pub fn goto_step(&mut self, t: &Timeline, step: u64) -> bool {
        let Some(i) = t.step_index(step) else {
            self.message = Some(match (t.steps.first(), t.steps.last()) {
                (Some(a), Some(b)) => format!("no step {step} (steps {}..={})", a.step, b.step),
                _ => "this run has no steps".to_string(),
            });
            return false;
        };
        self.show_step_ix(t, i);
        true
    }

    fn show_step_ix(&mut self, t: &Timeline, i: usize) {
        let s = &t.steps[i];
        let len = (s.end - s.start).max(self.min_width());
        let pad = (len / 20).max(1);
        self.window = Window {
            t0: s.start - pad,
            t1: s.end + pad,
        };
        self.cursor = s.start;
        self.fit_all = false;
        self.message = None;
    }

    /// The step the cursor is in, or the last one before it.
    fn cursor_step_ix(&self, t: &Timeline) -> Option<usize> {
        let i = t.steps.partition_point(|s| s.start <= self.cursor);
        i.checked_sub(1)
    }

    /// Next (`dir` = 1) or previous (-1) step relative to the cursor.
    pub fn step_by(&mut self, t: &Timeline, dir: i64) {
        if t.steps.is_empty() {
            self.message = Some("this run has no steps".to_string());
            return;
        }
        let target = match (self.cursor_step_ix(t), dir > 0) {
            (None, true) => 0,
            (None, false) => 0,
            (Some(i), true) => (i + 1).min(t.steps.len() - 1),
            (Some(i), false) => {
                // Within a step but past its start, "previous" first goes to this step's start.
                if self.cursor > t.steps[i].start && !self.window_shows_step(t, i) {
                    i
                } else {
                    i.saturating_sub(1)
                }
            }
        };
        self.show_step_ix(t, target);
    }

    fn window_shows_step(&self, t: &Timeline, i: usize) -> bool {
        let s = &t.steps[i];
        self.window.t0 <= s.start && s.end <= self.window.t1
    }

    /// The span (or collapsed bar) under the cursor, if any; a click slightly off a thin span
    /// still hits it (within one cell).
    pub fn hit(&self, t: &Timeline) -> Option<Selection> {
        let row = *self.rows.get(self.cursor_row)?;
        let slack = self.window.width() / self.cols.max(1) as Ns;
        match row {
            RowRef::Span { lane, row: r } => {
                let sr = &t.lanes[lane as usize].rows[r as usize];
                let ix = sr.at(self.cursor).or_else(|| {
                    let i = sr.first_ending_after(self.cursor - slack);
                    (i < sr.len() && sr.start[i] <= self.cursor + slack).then_some(i)
                })?;
                Some(Selection::Span(SpanRef {
                    lane,
                    row: r,
                    ix: ix as u32,
                }))
            }
            RowRef::Phase(p) => {
                let cr = &t.collapsed[p as usize];
                let lo = cr
                    .bars
                    .partition_point(|b| b.start < self.cursor - cr.max_len - slack);
                let hi = cr.bars.partition_point(|b| b.start <= self.cursor + slack);
                (lo..hi)
                    .filter(|&i| cr.bars[i].start + cr.bars[i].stats.max + slack >= self.cursor)
                    .min_by_key(|&i| (cr.bars[i].start - self.cursor).abs())
                    .map(|i| Selection::Bar {
                        row: p,
                        bar: i as u32,
                    })
            }
        }
    }

    pub fn select_at_cursor(&mut self, t: &Timeline) {
        self.selected = self.hit(t);
        if self.selected.is_none() {
            self.message = Some("nothing under the cursor".to_string());
        }
    }

    /// Selects the next (`dir` = 1) or previous span/bar in the cursor row and moves there.
    pub fn select_neighbour(&mut self, t: &Timeline, dir: i64) {
        let Some(&row) = self.rows.get(self.cursor_row) else {
            return;
        };
        let (starts, ends): (Vec<Ns>, Vec<Ns>);
        let (start_of, end_of): (&[Ns], &[Ns]) = match row {
            RowRef::Span { lane, row: r } => {
                let sr = &t.lanes[lane as usize].rows[r as usize];
                (&sr.start, &sr.end)
            }
            RowRef::Phase(p) => {
                let cr = &t.collapsed[p as usize];
                starts = cr.bars.iter().map(|b| b.start).collect();
                ends = cr.bars.iter().map(|b| b.start + b.stats.max).collect();
                (&starts, &ends)
            }
        };
        if start_of.is_empty() {
            return;
        }
        let current = match (self.selected, row) {
            (Some(Selection::Span(s)), RowRef::Span { lane, row: r })
                if s.lane == lane && s.row == r =>
            {
                Some(s.ix as usize)
            }
            (Some(Selection::Bar { row: a, bar }), RowRef::Phase(b)) if a == b => {
                Some(bar as usize)
            }
            _ => None,
        };
        let next = match current {
            Some(i) if dir > 0 => (i + 1).min(start_of.len() - 1),
            Some(i) => i.saturating_sub(1),
            None if dir > 0 => start_of
                .partition_point(|&s| s <= self.cursor)
                .min(start_of.len() - 1),
            None => start_of
                .partition_point(|&s| s < self.cursor)
                .saturating_sub(1),
        };
        self.selected = Some(match row {
            RowRef::Span { lane, row: r } => Selection::Span(SpanRef {
                lane,
                row: r,
                ix: next as u32,
            }),
            RowRef::Phase(p) => Selection::Bar {
                row: p,
                bar: next as u32,
            },
        });
        let (s, e) = (start_of[next], end_of[next]);
        // Bring the whole span into view when it is off screen.
        if s < self.window.t0 || e > self.window.t1 {
            let w = self.window.width().max(e - s + e.saturating_sub(s) / 5);
            let mid = s + (e - s) / 2;
            self.window = Window {
                t0: mid - w / 2,
                t1: mid - w / 2 + w,
            };
            self.fit_all = false;
        }
        self.cursor = s;
    }

    pub fn toggle_mode(&mut self, t: &Timeline) {
        self.mode = match self.mode {
            Mode::Lanes => Mode::Collapsed,
            Mode::Collapsed => Mode::Lanes,
        };
        self.selected = None;
        self.cursor_row = 0;
        self.scroll = 0;
        self.rebuild_rows(t);
    }

    /// Maps a click at gantt column `col` and row `row` (relative to the gantt area).
    pub fn click(&mut self, t: &Timeline, col: usize, row: usize) {
        if self.scroll + row >= self.rows.len() {
            return;
        }
        self.cursor_row = self.scroll + row;
        self.cursor = self.window.time_at(col, self.cols);
        self.select_at_cursor(t);
    }
}
