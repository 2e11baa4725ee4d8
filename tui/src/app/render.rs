//! Drawing one frame: title, legend, step row, time axis, gantt lanes, selection details,
//! metrics charts, phase summary, status line and the help overlay.
//!
//! The gantt is written straight into the frame buffer; its cost is proportional to the
//! number of screen cells (see `cells`), never to the number of spans.

use ratatui::Frame;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Clear, Dataset, GraphType, Paragraph, Row, Table};

use super::cells::{self, Cell, CollapsedCell, Spread, Window};
use super::detail::FLAG_DETAIL;
use super::model::PhaseId;
use super::model::{FLAG_ERROR, FLAG_STRAGGLER, Ns, Timeline, pass_label, step_label};
use super::palette::{LOAD_SCALE, STRAGGLER, load_index, phase_color};
use super::units::{dur, nice_step, tick_label};
use super::view::{Mode, RowRef, Selection, View};
use titan_obs_core::vocab::Clock;

/// Things outside the timeline shown in the chrome.
#[derive(Debug, Default, Clone)]
pub struct Chrome {
    /// `--follow` status, e.g. "following: 12 parts".
    pub follow: Option<String>,
    /// How long the previous frame took to read what it showed and draw (runs drawn from
    /// detail levels, where zooming and scrolling read from disk).
    pub frame_ms: Option<f64>,
}

/// Where the gantt landed on screen (for mouse hit-testing).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// The time-proportional part of the lanes (labels excluded).
    pub gantt: Rect,
}

const DIM: Color = Color::Indexed(244);
const DETAILS_H: u16 = 3;

/// Draws a full frame and records the gantt size in `v` for cell-sized moves and paging.
pub fn draw(f: &mut Frame, t: &Timeline, v: &mut View, chrome: &Chrome) -> Geometry {
    let area = f.area();
    let panels = (v.show_metrics || v.show_summary) && area.height >= 30;
    let panel_h = if panels {
        (area.height / 3).clamp(8, 14)
    } else {
        0
    };
    let [
        title,
        legend,
        steps,
        axis,
        lanes,
        sep,
        details,
        panel,
        status,
    ] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(3),
        Constraint::Length(1),
        Constraint::Length(DETAILS_H),
        Constraint::Length(panel_h),
        Constraint::Length(1),
    ])
    .areas(area);

    let label_w = label_width(t, v).min(area.width / 3);
    let gantt = Rect {
        x: lanes.x + label_w,
        width: lanes.width.saturating_sub(label_w),
        ..lanes
    };
    v.cols = gantt.width.max(1) as usize;
    v.visible_rows = gantt.height.max(1) as usize;
    v.keep_cursor_row_visible();

    let buf = f.buffer_mut();
    draw_title(buf, title, t, v, chrome);
    draw_legend(buf, legend, t, v);
    draw_steps(buf, steps, label_w, t, v);
    draw_axis(buf, axis, label_w, v);
    draw_lanes(buf, lanes, label_w, t, v);
    draw_separator(buf, sep, v);
    draw_details(buf, details, t, v);
    if panels {
        draw_panels(f, panel, t, v);
    }
    draw_status(f.buffer_mut(), status, t, v, chrome);
    if v.help {
        draw_help(f, area);
    }
    Geometry { gantt }
}

fn label_width(t: &Timeline, v: &View) -> u16 {
    let w = match v.mode {
        Mode::Lanes => {
            let max_rank = t.ranks.last().copied().unwrap_or(0);
            let threads = t.threads_per_rank_max() > 1;
            let late = if t.late_rank().is_some() { 5 } else { 0 };
            format!("r{max_rank}").len() + if threads { 3 } else { 0 } + 5 + late
        }
        Mode::Collapsed => {
            t.collapsed
                .iter()
                .map(|c| t.phase_name(c.phase).chars().count())
                .max()
                .unwrap_or(4)
                .min(22)
                + 2
        }
    };
    w.max(8) as u16
}

fn draw_title(buf: &mut Buffer, area: Rect, t: &Timeline, v: &View, chrome: &Chrome) {
    let style = Style::new().bg(Color::Indexed(236)).fg(Color::White);
    buf.set_style(area, style);
    let mode = match v.mode {
        Mode::Lanes => "lanes",
        Mode::Collapsed => "collapsed: min/median/max across ranks",
    };
    // (priority, text): when the line is wider than the screen the lowest priorities go
    // first, so the finding (who the others wait for) outlives the counts and the mode.
    let mut parts: Vec<(u8, String)> = vec![
        (9, format!(" titan-obs  {}  ", t.title)),
        (
            1,
            format!(
                " {} ranks, {} lanes, {} spans, {} steps ",
                t.ranks.len(),
                t.lanes.len(),
                t.span_count,
                t.steps.len()
            ),
        ),
        (2, format!(" {mode} ")),
    ];
    if let Some((rank, phase)) = t.late_rank() {
        parts.push((8, format!(" waiting on r{rank} ({phase}) ")));
    }
    if let Some(f) = &chrome.follow {
        parts.push((7, format!(" {f} ")));
    }
    if !t.warnings.is_empty() {
        let mut w = format!(" ⚠ {}", t.warnings[0]);
        if t.warnings.len() > 1 {
            w.push_str(&format!(" (+{} more)", t.warnings.len() - 1));
        }
        parts.push((3, w));
    }
    let join = |parts: &[(u8, String)]| {
        parts
            .iter()
            .map(|(_, p)| p.as_str())
            .collect::<Vec<_>>()
            .join("│")
    };
    let mut text = join(&parts);
    while text.trim_end().chars().count() > area.width as usize && parts.len() > 1 {
        let lowest = (0..parts.len())
            .min_by_key(|&i| parts[i].0)
            .expect("non-empty");
        parts.remove(lowest);
        text = join(&parts);
    }
    buf.set_stringn(
        area.x,
        area.y,
        text,
        area.width as usize,
        style.add_modifier(Modifier::BOLD),
    );
}

fn draw_legend(buf: &mut Buffer, area: Rect, t: &Timeline, v: &View) {
    let mut x = area.x;
    let right = area.right();
    let put = |buf: &mut Buffer, s: &str, style: Style, x: &mut u16| {
        if *x >= right {
            return;
        }
        let (nx, _) = buf.set_stringn(*x, area.y, s, (right - *x) as usize, style);
        *x = nx;
    };
    for &p in &t.phase_order {
        let name = t.phase_name(p);
        put(buf, "█", Style::new().fg(phase_color(name)), &mut x);
        put(buf, &format!("{name} "), Style::new(), &mut x);
    }
    put(buf, "▓", Style::new().fg(STRAGGLER), &mut x);
    put(buf, "straggler ", Style::new(), &mut x);
    if v.load_colours {
        put(buf, "experts load vs even share: ", Style::new(), &mut x);
        for (_, index, label) in LOAD_SCALE {
            put(buf, "█", Style::new().fg(Color::Indexed(index)), &mut x);
            put(buf, &format!("{label} "), Style::new(), &mut x);
        }
    }
    if v.mode == Mode::Collapsed {
        put(buf, "█all ▓median ░max ", Style::new().fg(DIM), &mut x);
    }
}

/// One character per step tag on the step row.
fn tag_letter(tag: &str) -> char {
    match tag {
        "checkpoint" => 'C',
        "validation" => 'V',
        "gc" => 'G',
        _ => tag
            .chars()
            .next()
            .map(|c| c.to_ascii_uppercase())
            .unwrap_or('?'),
    }
}

fn draw_steps(buf: &mut Buffer, area: Rect, label_w: u16, t: &Timeline, v: &View) {
    buf.set_stringn(
        area.x,
        area.y,
        " step",
        label_w as usize,
        Style::new().fg(DIM),
    );
    let cols = v.cols;
    let x0 = area.x + label_w;
    let w = v.window;
    let lo = t.steps.partition_point(|s| s.end < w.t0);
    let hi = t.steps.partition_point(|s| s.start < w.t1);
    if lo >= hi {
        return;
    }
    // When steps are denser than the labels, label every k-th (k from 1/2/5 x 10^n).
    let visible = hi - lo;
    let k = nice_step(visible as f64 * 6.0 / cols.max(1) as f64) as usize;
    let mut next_free: i64 = 0;
    for s in &t.steps[lo..hi] {
        let col = w.col_of(s.start, cols);
        let tagged = !s.tags.is_empty();
        if !tagged && !(s.step as usize).is_multiple_of(k) {
            continue;
        }
        if col < next_free.max(0) || col >= cols as i64 {
            continue;
        }
        let mut label = format!("│{}", s.step);
        for &tag in &s.tags {
            label.push(tag_letter(&t.tag_names[tag as usize]));
        }
        let style = if tagged {
            Style::new()
                .fg(Color::Indexed(170))
                .add_modifier(Modifier::BOLD)
        } else {
            Style::new().fg(Color::Indexed(250))
        };
        let max = cols - col as usize;
        buf.set_stringn(x0 + col as u16, area.y, &label, max, style);
        next_free = col + label.chars().count() as i64 + 1;
    }
}

fn draw_axis(buf: &mut Buffer, area: Rect, label_w: u16, v: &View) {
    let cols = v.cols;
    let w = v.window;
    buf.set_stringn(
        area.x,
        area.y,
        " time",
        label_w as usize,
        Style::new().fg(DIM),
    );
    let x0 = area.x + label_w;
    let per_col = w.width() as f64 / cols.max(1) as f64;
    let step = nice_step(per_col * 12.0);
    let mut tick = w.t0.div_euclid(step) * step;
    if tick < w.t0 {
        tick += step;
    }
    let style = Style::new().fg(Color::Indexed(250));
    let mut next_free = 0i64;
    while tick < w.t1 {
        let col = w.col_of(tick, cols);
        if col >= next_free && col < cols as i64 {
            let label = format!("╷{}", tick_label(tick, step));
            buf.set_stringn(x0 + col as u16, area.y, &label, cols - col as usize, style);
            next_free = col + label.chars().count() as i64 + 1;
        }
        tick += step;
    }
    let c = w.col_of(v.cursor, cols);
    if (0..cols as i64).contains(&c) {
        buf[(x0 + c as u16, area.y)]
            .set_char('▼')
            .set_style(Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD));
    }
}

fn row_label(t: &Timeline, row: RowRef) -> String {
    match row {
        RowRef::Span { lane, row: r } => {
            let l = &t.lanes[lane as usize];
            if r == 0 {
                let multi = t
                    .lanes
                    .get(lane as usize + 1)
                    .is_some_and(|n| n.rank == l.rank)
                    || l.thread_ix > 0;
                // The lane of CUDA-event twins says it is the GPU's, not a host thread's.
                let gpu_lane = l
                    .rows
                    .first()
                    .and_then(|r| r.phase.first())
                    .is_some_and(|&p| Clock::of(t.phase_name(p)) == Clock::Gpu);
                let label = if gpu_lane {
                    format!("r{}.gpu", l.rank)
                } else if multi {
                    format!("r{}.t{}", l.rank, l.thread_ix)
                } else {
                    format!("r{}", l.rank)
                };
                // The rank the others waited for at collectives: marked once, on its first
                // lane (not on each of its threads').
                let first_lane = lane == 0 || t.lanes[lane as usize - 1].rank != l.rank;
                if first_lane && t.late_rank().is_some_and(|(r, _)| r == l.rank) {
                    format!("{label} late")
                } else {
                    label
                }
            } else {
                format!("  d{}", l.rows[r as usize].depth)
            }
        }
        RowRef::Phase(p) => t.phase_name(t.collapsed[p as usize].phase).to_string(),
    }
}

fn draw_lanes(buf: &mut Buffer, area: Rect, label_w: u16, t: &Timeline, v: &View) {
    let cols = v.cols;
    let x0 = area.x + label_w;
    let w = v.window;
    let cursor_col = w.col_of(v.cursor, cols);
    let step_cols = step_boundary_cols(t, w, cols);
    let mut span_cells: Vec<Option<Cell>> = Vec::with_capacity(cols);
    let mut bar_cells: Vec<Option<CollapsedCell>> = Vec::with_capacity(cols);
    for screen_row in 0..area.height as usize {
        let ri = v.scroll + screen_row;
        let Some(&row) = v.rows.get(ri) else { break };
        let y = area.y + screen_row as u16;
        let is_cursor_row = ri == v.cursor_row;
        let label = row_label(t, row);
        let label_style = if is_cursor_row {
            Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD)
        } else {
            Style::new().fg(Color::Indexed(250))
        };
        buf.set_stringn(
            area.x,
            y,
            if is_cursor_row { "▶" } else { " " },
            1,
            label_style,
        );
        buf.set_stringn(area.x + 1, y, &label, label_w as usize - 2, label_style);
        for &c in &step_cols {
            buf[(x0 + c as u16, y)]
                .set_char('┊')
                .set_fg(Color::Indexed(238));
        }
        match row {
            RowRef::Span { lane, row: r } => {
                let sr = &t.lanes[lane as usize].rows[r as usize];
                cells::row_cells(sr, w, cols, &mut span_cells);
                let selected = match v.selected {
                    Some(Selection::Span(s)) if s.lane == lane && s.row == r => Some(s.ix),
                    _ => None,
                };
                let colours = SpanColours {
                    t,
                    load_of_rank: v.load_colours.then_some(t.lanes[lane as usize].rank),
                };
                paint_span_cells(buf, x0, y, &colours, sr, &span_cells, selected);
            }
            RowRef::Phase(p) => {
                let cr = &t.collapsed[p as usize];
                cells::collapsed_cells(cr, w, cols, &mut bar_cells);
                let color = phase_color(t.phase_name(cr.phase));
                let selected = match v.selected {
                    Some(Selection::Bar { row, bar }) if row == p => Some(bar),
                    _ => None,
                };
                for (c, cell) in bar_cells.iter().enumerate() {
                    let Some(cell) = cell else { continue };
                    let ch = match cell.spread {
                        Spread::AllRanks => '█',
                        Spread::ToMedian => '▓',
                        Spread::ToMax => '░',
                    };
                    let fg = if cell.straggler { STRAGGLER } else { color };
                    let b = &mut buf[(x0 + c as u16, y)];
                    b.set_char(ch).set_fg(fg).set_bg(Color::Reset);
                    if selected == Some(cell.bar) {
                        b.set_bg(Color::White);
                    }
                }
            }
        }
        if is_cursor_row && (0..cols as i64).contains(&cursor_col) {
            let b = &mut buf[(x0 + cursor_col as u16, y)];
            b.modifier.insert(Modifier::REVERSED);
            if b.symbol() == " " {
                b.set_char('│').set_fg(Color::Yellow);
            }
        }
    }
}

/// Columns of step starts, when steps are sparse enough for boundary lines to help.
fn step_boundary_cols(t: &Timeline, w: Window, cols: usize) -> Vec<usize> {
    let lo = t.steps.partition_point(|s| s.start < w.t0);
    let hi = t.steps.partition_point(|s| s.start < w.t1);
    if hi - lo > cols / 4 {
        return Vec::new();
    }
    t.steps[lo..hi]
        .iter()
        .map(|s| w.col_of(s.start, cols))
        .filter(|&c| (0..cols as i64).contains(&c))
        .map(|c| c as usize)
        .collect()
}

/// A span's colour: its phase's, or under load colouring an experts span's load's.
struct SpanColours<'a> {
    t: &'a Timeline,
    /// The lane's rank, when experts spans are coloured by load.
    load_of_rank: Option<u32>,
}

impl SpanColours<'_> {
    fn of(&self, phase: PhaseId, step: u64) -> Color {
        let load = self
            .load_of_rank
            .and_then(|rank| self.t.experts_load_at(rank, phase, step));
        match load {
            Some(load) => Color::Indexed(load_index(load.factor)),
            None => phase_color(self.t.phase_name(phase)),
        }
    }
}

fn paint_span_cells(
    buf: &mut Buffer,
    x0: u16,
    y: u16,
    colours: &SpanColours<'_>,
    row: &super::model::SpanRow,
    cells: &[Option<Cell>],
    selected: Option<u32>,
) {
    let mut c = 0;
    while c < cells.len() {
        let Some(cell) = cells[c] else {
            c += 1;
            continue;
        };
        // A run of cells filled by one span gets its name written into the bar.
        if let Some(ix) = cell.span {
            let mut end = c + 1;
            while end < cells.len() && cells[end].is_some_and(|n| n.span == Some(ix)) {
                end += 1;
            }
            let i = ix as usize;
            let t = colours.t;
            let color = colours.of(row.phase[i], row.step[i]);
            let flags = row.flags[i];
            let is_sel = selected == Some(ix);
            let (bg, fg) = if is_sel {
                (Color::White, Color::Black)
            } else {
                (color, Color::Black)
            };
            let mut name = String::new();
            if flags & FLAG_STRAGGLER != 0 {
                name.push('!');
            }
            if flags & FLAG_ERROR != 0 {
                name.push('✗');
            }
            // A pipeline pass says which stage and microbatch it ran (`0F3`), not just `forward`.
            match row
                .slot(i)
                .and_then(|slot| pass_label(t.phase_name(row.phase[i]), slot))
            {
                Some(label) => name.push_str(&label),
                None => name.push_str(t.phase_name(row.phase[i])),
            }
            let run = end - c;
            let straggler = flags & FLAG_STRAGGLER != 0;
            if run >= 3 {
                let truncated = name.chars().count() > run;
                let mut chars = name.chars();
                for cc in c..end {
                    let ch = if truncated && cc + 1 == end {
                        '…'
                    } else {
                        chars.next().unwrap_or(' ')
                    };
                    let b = &mut buf[(x0 + cc as u16, y)];
                    b.set_char(ch).set_fg(fg).set_bg(bg);
                    if straggler {
                        b.set_fg(STRAGGLER).modifier.insert(Modifier::BOLD);
                    }
                }
            } else {
                for cc in c..end {
                    let partial = cells[cc].is_some_and(|x| x.coverage < 0.5);
                    let b = &mut buf[(x0 + cc as u16, y)];
                    if is_sel {
                        b.set_char('█').set_fg(Color::White).set_bg(Color::Reset);
                    } else if straggler {
                        b.set_char('▓').set_fg(STRAGGLER).set_bg(color);
                    } else {
                        b.set_char(if partial { '▐' } else { '█' })
                            .set_fg(color)
                            .set_bg(Color::Reset);
                    }
                }
            }
            c = end;
            continue;
        }
        let color = colours.of(cell.phase, cell.step);
        let b = &mut buf[(x0 + c as u16, y)];
        if cell.straggler {
            b.set_char('▓').set_fg(STRAGGLER).set_bg(color);
        } else if cell.coverage >= 0.5 {
            b.set_char('█').set_fg(color).set_bg(Color::Reset);
        } else {
            b.set_char('▒').set_fg(color).set_bg(Color::Reset);
        }
        c += 1;
    }
}

fn draw_separator(buf: &mut Buffer, area: Rect, v: &View) {
    let style = Style::new().fg(Color::Indexed(240));
    let rows = v.rows.len();
    let shown_to = (v.scroll + v.visible_rows).min(rows);
    let text = format!(
        "── rows {}-{} of {} ",
        if rows == 0 { 0 } else { v.scroll + 1 },
        shown_to,
        rows
    );
    let line: String = text
        .chars()
        .chain(std::iter::repeat('─'))
        .take(area.width as usize)
        .collect();
    buf.set_stringn(area.x, area.y, line, area.width as usize, style);
}

fn draw_details(buf: &mut Buffer, area: Rect, t: &Timeline, v: &View) {
    let lines = match v.selected {
        Some(sel) => selection_lines(t, sel, true),
        None => match v.hit(t) {
            Some(sel) => {
                let mut l = selection_lines(t, sel, false);
                l.truncate(2);
                l.push("Enter or click selects · Tab/Shift-Tab walk the spans of this row".into());
                l
            }
            None => vec![
                format!(
                    "cursor {}{}",
                    dur(v.cursor),
                    t.step_at(v.cursor)
                        .map(|s| format!(" (step {})", s.step))
                        .unwrap_or_default()
                ),
                "move the cursor onto a span (arrows, or click) and press Enter to select it"
                    .into(),
            ],
        },
    };
    for (i, line) in lines.iter().take(area.height as usize).enumerate() {
        let style = if i == 0 && v.selected.is_some() {
            Style::new().add_modifier(Modifier::BOLD)
        } else {
            Style::new()
        };
        buf.set_stringn(
            area.x + 1,
            area.y + i as u16,
            line,
            area.width.saturating_sub(1) as usize,
            style,
        );
    }
}

/// The text of the details panel for a span or a collapsed bar.
pub fn selection_lines(t: &Timeline, sel: Selection, selected: bool) -> Vec<String> {
    let head = if selected { "selected" } else { "under cursor" };
    match sel {
        Selection::Span(r) => {
            let lane = &t.lanes[r.lane as usize];
            let row = t.row(r);
            let i = r.ix as usize;
            let phase = row.phase[i];
            let name = t.phase_name(phase);
            let d = row.end[i] - row.start[i];
            let step = step_label(row.step[i]);
            let tags: Vec<&str> = t.tags_of(row.tagset[i]).collect();
            let mut l1 = format!(
                "{head}: {name}  rank {}{}  step {}  start {}  duration {}{}  depth {}  tags {}",
                lane.rank,
                if t.threads_per_rank_max() > 1 {
                    format!(" thread {}", lane.thread_ix)
                } else {
                    String::new()
                },
                step.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                dur(row.start[i]),
                dur(d),
                // Host spans are the default; a GPU twin says whose clock timed it.
                match Clock::of(name) {
                    Clock::Gpu => " (gpu clock)",
                    Clock::Host => "",
                },
                row.depth,
                if tags.is_empty() {
                    "-".to_string()
                } else {
                    tags.join(",")
                },
            );
            if row.flags[i] & FLAG_ERROR != 0 {
                l1.push_str("  ERROR recorded");
            }
            if row.flags[i] & FLAG_DETAIL != 0 {
                // A bucket of a detail level, not a span: say so, and how to see the spans.
                l1 = format!(
                    "{head}: mostly {name}  rank {}  {} covered from {}  (a detail level's \
                     bucket: zoom in for the spans)",
                    lane.rank,
                    dur(d),
                    dur(row.start[i]),
                );
            }
            let l2 = match t.phase_step.get(&(phase, row.step[i])) {
                Some(st) => {
                    let mut s = format!(
                        "{name} at {} on {} ranks: min {} (r{})  median {}  max {} (r{})",
                        step.map(|s| format!("step {s}"))
                            .unwrap_or_else(|| "init".into()),
                        st.ranks,
                        dur(st.min),
                        st.min_rank,
                        dur(st.median),
                        dur(st.max),
                        st.max_rank
                    );
                    if row.flags[i] & FLAG_STRAGGLER != 0
                        && let Some(x) = t.straggler(phase, lane.rank)
                    {
                        s.push_str(&straggler_note(x));
                    }
                    if let Some(w) = t
                        .analysis
                        .waits
                        .per_step
                        .iter()
                        .find(|w| w.step == row.step[i])
                        .filter(|_| titan_obs_core::vocab::collective::is_collective(name))
                    {
                        s.push_str(&format!(
                            "  ⧗ step {}: ranks waited {} for rank {} (late from {})",
                            w.step,
                            dur(w.wait_caused_ns),
                            w.rank,
                            w.phase
                        ));
                    }
                    s
                }
                None => String::new(),
            };
            let mut lines = vec![l1, l2];
            if let Some(load) = t.experts_load_at(lane.rank, phase, row.step[i]) {
                lines.push(format!(
                    "experts {}..{} of {} on rank {}: {:.0} of the layer's {:.0} routed tokens, \
                     {:.2}x an even share (counts of the logged step covering step {})",
                    load.first,
                    load.first + load.count,
                    load.experts,
                    lane.rank,
                    load.hosted_tokens,
                    load.layer_tokens,
                    load.factor,
                    row.step[i],
                ));
            }
            lines
        }
        Selection::Bar { row, bar } => {
            let cr = &t.collapsed[row as usize];
            let b = &cr.bars[bar as usize];
            let name = t.phase_name(cr.phase);
            let st = b.stats;
            let step = step_label(b.step)
                .map(|s| format!("step {s}"))
                .unwrap_or_else(|| "init".into());
            let mut l2 = format!(
                "min {} (r{})  median {}  max {} (r{})",
                dur(st.min),
                st.min_rank,
                dur(st.median),
                dur(st.max),
                st.max_rank
            );
            if b.is_straggler()
                && let Some(x) = t.straggler(cr.phase, st.max_rank)
            {
                l2.push_str(&straggler_note(x));
            }
            vec![
                format!(
                    "{head}: {name}  {step}  on {} ranks  median start {}",
                    st.ranks,
                    dur(b.start)
                ),
                l2,
            ]
        }
    }
}

/// What the details panel says about a straggler (the analysis's numbers, as in `summary`).
fn straggler_note(x: &titan_obs_core::analysis::Straggler) -> String {
    format!(
        "  ▲ STRAGGLER: rank {} above the median in {}/{} steps, median {:.2}x",
        x.rank, x.above_median_steps, x.steps, x.median_ratio
    )
}

fn draw_panels(f: &mut Frame, area: Rect, t: &Timeline, v: &View) {
    let (metrics, summary) = match (v.show_metrics, v.show_summary) {
        (true, true) => {
            let [a, b] =
                Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)])
                    .areas(area);
            (Some(a), Some(b))
        }
        (true, false) => (Some(area), None),
        (false, true) => (None, Some(area)),
        (false, false) => (None, None),
    };
    if let Some(a) = metrics {
        let [l, r] =
            Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(a);
        let step = t.step_at(v.cursor).map(|s| s.step);
        draw_metric(f, l, t, "loss", step);
        draw_metric(f, r, t, "tps", step);
    }
    if let Some(a) = summary {
        draw_summary(f, a, t);
    }
}

fn draw_metric(f: &mut Frame, area: Rect, t: &Timeline, needle: &str, step: Option<u64>) {
    let Some(m) = t.metric(needle) else {
        let p = Paragraph::new(format!("no `{needle}` scalar recorded"))
            .block(Block::bordered().title(needle.to_string()));
        f.render_widget(p, area);
        return;
    };
    let pts: Vec<(f64, f64)> = m.points.iter().map(|&(s, y)| (s as f64, y)).collect();
    let (x0, x1) = (
        pts.first().map_or(0.0, |p| p.0),
        pts.last().map_or(1.0, |p| p.0),
    );
    let (mut y0, mut y1) = pts
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.1), b.max(p.1))
        });
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    let title = match step.and_then(|s| m.at_step(s).map(|y| (s, y))) {
        Some((s, y)) => format!(
            "{}_{} · step {s}: {}",
            m.name,
            m.reduce.as_str(),
            fmt_value(y)
        ),
        None => format!("{}_{}", m.name, m.reduce.as_str()),
    };
    let cursor_line: Vec<(f64, f64)> = step
        .map(|s| vec![(s as f64, y0), (s as f64, y1)])
        .unwrap_or_default();
    let mut sets = vec![
        Dataset::default()
            .marker(symbols::Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(Color::Indexed(75)))
            .data(&pts),
    ];
    if !cursor_line.is_empty() {
        sets.push(
            Dataset::default()
                .marker(symbols::Marker::Braille)
                .graph_type(GraphType::Line)
                .style(Style::new().fg(Color::Yellow))
                .data(&cursor_line),
        );
    }
    let chart = Chart::new(sets)
        .block(Block::bordered().title(title))
        .x_axis(
            Axis::default()
                .bounds([x0, x1.max(x0 + 1.0)])
                .labels([format!("{x0:.0}"), format!("step {x1:.0}")])
                .style(Style::new().fg(DIM)),
        )
        .y_axis(
            Axis::default()
                .bounds([y0, y1])
                .labels([fmt_value(y0), fmt_value(y1)])
                .style(Style::new().fg(DIM)),
        );
    f.render_widget(chart, area);
}

fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

fn draw_summary(f: &mut Frame, area: Rect, t: &Timeline) {
    let header = Row::new([
        "phase", "count", "total", "mean", "p50", "p95", "max", "%step", "slow",
    ])
    .style(Style::new().add_modifier(Modifier::BOLD));
    let rows: Vec<Row> = t
        .analysis
        .phases
        .iter()
        .map(|s| {
            let name = s.name.as_str();
            let slow = t.analysis.straggler_ranks(name);
            let slow = if slow.is_empty() {
                "-".to_string()
            } else {
                slow.iter()
                    .map(|r| format!("r{r}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            Row::new(vec![
                Line::from(vec![
                    Span::styled("█ ", Style::new().fg(phase_color(name))),
                    Span::raw(name.to_string()),
                ]),
                Line::from(s.stats.count.to_string()),
                Line::from(dur(s.stats.total_ns)),
                Line::from(dur(s.stats.mean_ns as Ns)),
                Line::from(dur(s.stats.p50_ns)),
                Line::from(dur(s.stats.p95_ns)),
                Line::from(dur(s.stats.max_ns)),
                Line::from(s.share_label("")),
                Line::from(slow),
            ])
        })
        .collect();
    let widths = [
        Constraint::Fill(1),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(6),
        Constraint::Length(8),
    ];
    let table = Table::new(rows, widths)
        .header(header)
        .block(Block::bordered().title("phases (all ranks, all steps)"));
    f.render_widget(table, area);
}

fn draw_status(buf: &mut Buffer, area: Rect, t: &Timeline, v: &View, chrome: &Chrome) {
    let style = Style::new().bg(Color::Indexed(236)).fg(Color::White);
    buf.set_style(area, style);
    let left = if let Some(p) = &v.prompt {
        format!(" jump to step: {p}▏ (Enter to go, Esc to cancel)")
    } else if let Some(m) = &v.message {
        format!(" {m}")
    } else {
        let w = v.window;
        format!(
            " window {} – {} ({})  cursor {}{}",
            tick_label(w.t0, nice_step(w.width() as f64 / 100.0)),
            tick_label(w.t1, nice_step(w.width() as f64 / 100.0)),
            dur(w.width()),
            dur(v.cursor),
            t.step_at(v.cursor)
                .map(|s| format!(" step {}", s.step))
                .unwrap_or_default()
        )
    };
    let left = match chrome.frame_ms {
        Some(ms) => format!("{left}  frame {ms:.0} ms"),
        None => left,
    };
    let right =
        " ←→ move  +/- zoom  [ ] step  g jump  f fit  Enter select  c collapse  ? help  q quit ";
    buf.set_stringn(area.x, area.y, &left, area.width as usize, style);
    let rw = right.chars().count() as u16;
    let lw = left.chars().count() as u16;
    if area.width > lw + rw {
        buf.set_stringn(
            area.right() - rw,
            area.y,
            right,
            rw as usize,
            style.fg(Color::Indexed(250)),
        );
    }
}

/// Key reference shown by `?`.
pub const HELP: &[(&str, &str)] = &[
    ("← → / h l", "move the cursor one column"),
    ("H L / Shift+← →", "pan a quarter window"),
    ("↑ ↓ / k j", "move between lanes"),
    ("PgUp PgDn / wheel", "scroll lanes"),
    ("+ = i / - o", "zoom in / out around the cursor"),
    ("f / 0", "fit the whole run"),
    ("] / n, [ / p", "next / previous step"),
    ("g N Enter", "jump to step N"),
    ("Enter / click", "select the span under the cursor"),
    ("Tab / Shift+Tab", "select next / previous span in the lane"),
    ("Esc", "clear selection, close help"),
    (
        "c",
        "collapse: one lane per phase, min/median/max over ranks",
    ),
    (
        "m / s / e",
        "toggle metrics / phase summary / experts coloured by load",
    ),
    ("?", "this help"),
    ("q / Ctrl+C", "quit"),
];

/// What the help box says below the keys: the marks on screen that no key explains.
pub const HELP_NOTES: &[&str] = &[
    "rN: rank N's top-level spans; d1 d2 d3: its spans nested 1, 2, 3 deep",
    "rN.tM: thread M of rank N (t0 main); rN.gpu: its CUDA-event GPU time",
    "rN late: the rank the others waited for (title: waiting on rN)",
    "0F3: stage 0's forward of microbatch 3; B backward, I/W halves, E eval",
    "▓ red: a straggler's span (as `titan-obs summary`), above the median",
    "step row: C checkpoint, V validation, G gc (garbage collection)",
];

/// Width of the key column of the help box: the longest key and two spaces.
fn help_key_width() -> usize {
    HELP.iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0)
        + 2
}

/// The help box's lines, each at most `width` columns: descriptions wrap under their
/// description column, notes under their first character, so nothing is cut at any width.
fn help_lines(width: usize) -> Vec<Line<'static>> {
    let kw = help_key_width();
    let mut lines = Vec::new();
    for (k, d) in HELP {
        let text_w = width.saturating_sub(kw + 1).max(8);
        for (i, part) in wrap_words(d, text_w).into_iter().enumerate() {
            let key = if i == 0 { *k } else { "" };
            lines.push(Line::from(vec![
                Span::styled(format!(" {key:<kw$}"), Style::new().fg(Color::Yellow)),
                Span::raw(part),
            ]));
        }
    }
    lines.push(Line::from(""));
    for note in HELP_NOTES {
        for (i, part) in wrap_words(note, width.saturating_sub(3).max(8))
            .into_iter()
            .enumerate()
        {
            let indent = if i == 0 { " " } else { "   " };
            lines.push(Line::from(format!("{indent}{part}")));
        }
    }
    lines
}

/// Greedy word wrap into lines of at most `width` characters (a longer word is split).
fn wrap_words(text: &str, width: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for word in text.split(' ') {
        let mut word: Vec<char> = word.chars().collect();
        while word.len() > width {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            out.push(word.drain(..width).collect());
        }
        let n = cur.chars().count();
        if n > 0 && n + 1 + word.len() > width {
            out.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.extend(word);
    }
    out.push(cur);
    out
}

fn draw_help(f: &mut Frame, area: Rect) {
    // As wide as the longest line needs, at most the screen; then as tall as the lines
    // wrapped to that width need. Only a screen too small for the wrapped text cuts it.
    let widest = help_lines(usize::MAX / 2)
        .iter()
        .map(Line::width)
        .max()
        .unwrap_or(0);
    let w = (widest as u16 + 3).min(area.width);
    let lines = help_lines(w.saturating_sub(3) as usize);
    let h = (lines.len() as u16 + 2).min(area.height);
    let r = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(" keys (? or Esc closes) ")),
        r,
    );
}
