//! Snapshot tests of the rendered gantt for a small fixed run (4 ranks x 4 steps, rank 2 1.5x
//! slow in forward_backward, the others waiting for it at the all_reduce), written by
//! titan_obs_core::synth and read back, driven through the same actions the keys call.

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use titan_obs::app::demo::{small, timeline};
use titan_obs::app::input::{self, Control};
use titan_obs::app::model::Timeline;
use titan_obs::app::render::{self, Chrome, Geometry};
use titan_obs::app::view::{Mode, RowRef, Selection, View};

struct Screen {
    t: Timeline,
    v: View,
    term: Terminal<TestBackend>,
    geo: Geometry,
}

impl Screen {
    fn new(w: u16, h: u16) -> Self {
        let t = timeline(&small()).unwrap();
        let v = View::new(&t);
        let term = Terminal::new(TestBackend::new(w, h)).unwrap();
        let mut s = Self {
            t,
            v,
            term,
            geo: Geometry::default(),
        };
        s.draw();
        s
    }

    fn draw(&mut self) -> String {
        let (t, v) = (&self.t, &mut self.v);
        let mut geo = Geometry::default();
        self.term
            .draw(|f| geo = render::draw(f, t, v, &Chrome::default()))
            .unwrap();
        self.geo = geo;
        self.text()
    }

    fn text(&self) -> String {
        let buf = self.term.backend().buffer();
        let mut out = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                out.push_str(buf[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    fn key(&mut self, code: KeyCode) -> Control {
        let c = input::on_key(
            &self.t,
            &mut self.v,
            KeyEvent::new(code, KeyModifiers::NONE),
        );
        self.draw();
        c
    }

    fn keys(&mut self, s: &str) {
        for ch in s.chars() {
            self.key(KeyCode::Char(ch));
        }
    }
}

#[test]
fn fit_all_shows_every_rank_steps_axis_and_legend() {
    let mut s = Screen::new(140, 44);
    let text = s.draw();
    insta::assert_snapshot!("fit_all", text);
    for r in [0, 1, 3] {
        assert!(
            text.contains(&format!("r{r} ")),
            "lane of rank {r} missing:\n{text}"
        );
    }
    // Rank 2 is marked as the rank the others waited for, in its lane and the title.
    assert!(text.contains("r2 late"), "{text}");
    assert!(text.contains("waiting on r2 (forward_backward)"), "{text}");
    // Steps numbered, with checkpoint (C) / validation (V) markers.
    for label in ["│1", "│2", "│3V", "│4C"] {
        assert!(text.contains(label), "step label {label} missing:\n{text}");
    }
    // Legend names the phases; the summary table and the metric charts are there.
    for name in ["forward_backward", "data_loading", "collect_dist_metrics"] {
        assert!(text.contains(name), "{name} missing");
    }
    assert!(text.contains("phases (all ranks, all steps)"));
    assert!(text.contains("loss_mean"));
    assert!(text.contains("tps_mean"));
}

#[test]
fn zoom_step_jump_and_selection() {
    let mut s = Screen::new(140, 44);
    // Jump to step 2: the window is that step, the cursor at its start.
    s.keys("g2");
    s.key(KeyCode::Enter);
    let step2 = s.t.steps[s.t.step_index(2).unwrap()].clone();
    assert!(s.v.window.t0 < step2.start && step2.end < s.v.window.t1);
    assert!(s.v.window.width() < (step2.end - step2.start) * 2);
    let text = s.draw();
    assert!(text.contains("step 2"), "{text}");
    insta::assert_snapshot!("step_2", text);

    // Zoom in around the cursor halves the window and keeps the cursor in view.
    let before = s.v.window.width();
    s.keys("+");
    assert!((s.v.window.width() - before / 2).abs() <= 1);
    assert!(s.v.window.t0 <= s.v.cursor && s.v.cursor < s.v.window.t1);
    s.keys("-");
    assert!((s.v.window.width() - before).abs() <= 2);

    // Move to rank 0's forward_backward row (depth 1) and select the span under the cursor.
    s.key(KeyCode::Down);
    for _ in 0..30 {
        s.key(KeyCode::Right);
    }
    s.key(KeyCode::Enter);
    let text = s.draw();
    let Some(Selection::Span(r)) = s.v.selected else {
        panic!("nothing selected:\n{text}")
    };
    let row = s.t.row(r);
    assert_eq!(s.t.phase_name(row.phase[r.ix as usize]), "forward_backward");
    assert!(
        text.contains("selected: forward_backward  rank 0  step 2"),
        "{text}"
    );
    assert!(
        text.contains("forward_backward at step 2 on 4 ranks: min"),
        "{text}"
    );
    insta::assert_snapshot!("selected", text);
}

#[test]
fn straggler_is_flagged_and_explained() {
    let mut s = Screen::new(140, 44);
    s.keys("g1");
    s.key(KeyCode::Enter);
    // Rank 2 is slow in forward_backward: select its step-1 span with the mouse.
    let lane = s.t.lanes.iter().position(|l| l.rank == 2).unwrap();
    let (row_ix, r) =
        s.v.rows
            .iter()
            .enumerate()
            .find_map(|(i, r)| match *r {
                RowRef::Span { lane: l, row }
                    if l as usize == lane && s.t.lanes[lane].rows[row as usize].depth == 1 =>
                {
                    Some((i, row as usize))
                }
                _ => None,
            })
            .unwrap();
    let sr = &s.t.lanes[lane].rows[r];
    let fb = (0..sr.len())
        .find(|&i| s.t.phase_name(sr.phase[i]) == "forward_backward" && sr.step[i] == 1)
        .unwrap();
    let mid = (sr.start[fb] + sr.end[fb]) / 2;
    let col = s.v.window.col_of(mid, s.v.cols) as u16;
    let g = s.geo.gantt;
    let screen_row = (row_ix - s.v.scroll) as u16;
    input::on_mouse(
        &s.t,
        &mut s.v,
        s.geo,
        MouseEvent {
            kind: MouseEventKind::Down(MouseButton::Left),
            column: g.x + col,
            row: g.y + screen_row,
            modifiers: KeyModifiers::NONE,
        },
    );
    let text = s.draw();
    assert!(
        text.contains("selected: forward_backward  rank 2"),
        "{text}"
    );
    assert!(text.contains("STRAGGLER: rank 2"), "{text}");
    // The bar itself is marked with '!' before its name.
    assert!(text.contains("!forward_backward"), "{text}");
}

#[test]
fn collapsed_mode_has_one_lane_per_phase() {
    let mut s = Screen::new(140, 44);
    s.keys("c");
    assert_eq!(s.v.mode, Mode::Collapsed);
    assert_eq!(s.v.rows.len(), s.t.collapsed.len());
    let text = s.draw();
    assert!(text.contains("collapsed: min/median/max across ranks"));
    insta::assert_snapshot!("collapsed", text);
    // Selecting a bar reports the spread across ranks.
    s.keys("g1");
    s.key(KeyCode::Enter);
    let fb =
        s.t.collapsed
            .iter()
            .position(|c| s.t.phase_name(c.phase) == "forward_backward")
            .unwrap();
    while s.v.cursor_row < fb {
        s.key(KeyCode::Down);
    }
    s.key(KeyCode::Tab);
    let text = s.draw();
    assert!(
        text.contains("selected: forward_backward  step 1  on 4 ranks"),
        "{text}"
    );
    assert!(text.contains("STRAGGLER: rank 2"), "{text}");
}

#[test]
fn help_overlay_and_quit() {
    let mut s = Screen::new(100, 40);
    s.keys("?");
    let text = s.draw();
    assert!(text.contains("keys (? or Esc closes)"));
    assert!(text.contains("jump to step N"));
    insta::assert_snapshot!("help", text);
    s.key(KeyCode::Esc);
    assert!(!s.v.help);
    assert_eq!(s.key(KeyCode::Char('q')), Control::Quit);
}

#[test]
fn help_box_fits_and_explains_every_mark() {
    for (w, h) in [(80, 24), (100, 40), (140, 44), (200, 50), (60, 40)] {
        let mut s = Screen::new(w, h);
        s.keys("?");
        let text = s.draw();
        // The whole box is on screen: both bottom corners drawn.
        assert!(
            text.contains('└') && text.contains('┘'),
            "{w}x{h}: box cut:\n{text}"
        );
        let lines: Vec<&str> = render::HELP
            .iter()
            .map(|(_, d)| *d)
            .chain(render::HELP_NOTES.iter().copied())
            .collect();
        for line in lines {
            if w >= 80 {
                // Wide enough for every line whole.
                assert!(text.contains(line), "{w}x{h}: `{line}` cut:\n{text}");
            } else {
                for word in line.split(' ') {
                    assert!(text.contains(word), "{w}x{h}: `{word}` missing:\n{text}");
                }
            }
        }
    }
    // The marks no key explains are explained.
    let notes = render::HELP_NOTES.join("\n");
    for mark in [
        "d1 d2 d3",
        "G gc",
        "rN late",
        "rN.tM",
        "rN.gpu",
        "0F3",
        "I/W",
        "C checkpoint",
        "V validation",
    ] {
        assert!(notes.contains(mark), "{mark}");
    }
}

#[test]
fn narrow_title_keeps_the_rank_the_others_wait_for() {
    for w in [80, 60] {
        let mut s = Screen::new(w, 24);
        let text = s.draw();
        let title = text.lines().next().unwrap();
        assert!(title.contains("waiting on r2"), "{w}: {title}");
    }
}

#[test]
fn next_and_previous_step_and_fit() {
    let mut s = Screen::new(120, 30);
    // The run starts with step 1, where the cursor starts.
    assert_eq!(s.t.step_at(s.v.cursor).unwrap().step, 1);
    s.keys("]");
    assert_eq!(s.t.step_at(s.v.cursor).unwrap().step, 2);
    s.keys("]]");
    assert_eq!(s.t.step_at(s.v.cursor).unwrap().step, 4);
    s.keys("[");
    assert_eq!(s.t.step_at(s.v.cursor).unwrap().step, 3);
    s.keys("f");
    assert!(s.v.window.t0 < 0 && s.v.window.t1 > s.t.end);
    s.keys("g99");
    s.key(KeyCode::Enter);
    assert!(s.draw().contains("no step 99 (steps 1..=4)"));
}

#[test]
fn small_terminal_hides_panels_but_keeps_the_gantt() {
    let mut s = Screen::new(80, 24);
    let text = s.draw();
    assert!(!text.contains("phases (all ranks"));
    assert!(text.contains("r0 "));
    insta::assert_snapshot!("small_terminal", text);
}
