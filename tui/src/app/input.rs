//! Keys and mouse to view actions.

use crossterm::event::{
    KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};

use super::model::Timeline;
use super::render::Geometry;
use super::view::View;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Continue,
    Quit,
}

const ZOOM_STEP: f64 = 0.5;

pub fn on_key(t: &Timeline, v: &mut View, key: KeyEvent) -> Control {
    if key.kind == KeyEventKind::Release {
        return Control::Continue;
    }
    if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
        return Control::Quit;
    }
    v.message = None;
    if let Some(p) = v.prompt.as_mut() {
        match key.code {
            KeyCode::Char(c) if c.is_ascii_digit() => p.push(c),
            KeyCode::Backspace => {
                p.pop();
            }
            KeyCode::Enter => {
                let text = v.prompt.take().unwrap_or_default();
                match text.parse::<u64>() {
                    Ok(n) => {
                        v.goto_step(t, n);
                    }
                    Err(_) => v.message = Some(format!("not a step number: {text:?}")),
                }
            }
            KeyCode::Esc => v.prompt = None,
            _ => {}
        }
        return Control::Continue;
    }
    if v.help {
        // Any key closes the help; q still quits.
        v.help = false;
        return if key.code == KeyCode::Char('q') {
            Control::Quit
        } else {
            Control::Continue
        };
    }
    let shift = key.modifiers.contains(KeyModifiers::SHIFT);
    match key.code {
        KeyCode::Char('q') => return Control::Quit,
        KeyCode::Char('?') => v.help = true,
        KeyCode::Esc => v.selected = None,
        KeyCode::Left if shift => v.pan(-0.25),
        KeyCode::Right if shift => v.pan(0.25),
        KeyCode::Char('H') => v.pan(-0.25),
        KeyCode::Char('L') => v.pan(0.25),
        KeyCode::Left | KeyCode::Char('h') => v.move_cursor(-1),
        KeyCode::Right | KeyCode::Char('l') => v.move_cursor(1),
        KeyCode::Home => v.set_cursor(v.window.t0),
        KeyCode::End => v.set_cursor(v.window.t1 - 1),
        KeyCode::Up | KeyCode::Char('k') => v.move_row(-1),
        KeyCode::Down | KeyCode::Char('j') => v.move_row(1),
        KeyCode::PageUp => v.move_row(-(v.visible_rows as i64)),
        KeyCode::PageDown => v.move_row(v.visible_rows as i64),
        KeyCode::Char('+') | KeyCode::Char('=') | KeyCode::Char('i') => v.zoom(t, ZOOM_STEP),
        KeyCode::Char('-') | KeyCode::Char('o') => v.zoom(t, 1.0 / ZOOM_STEP),
        KeyCode::Char('f') | KeyCode::Char('0') => v.fit(t),
        KeyCode::Char(']') | KeyCode::Char('n') => v.step_by(t, 1),
        KeyCode::Char('[') | KeyCode::Char('p') => v.step_by(t, -1),
        KeyCode::Char('g') => v.prompt = Some(String::new()),
        KeyCode::Enter => v.select_at_cursor(t),
        KeyCode::Tab => v.select_neighbour(t, 1),
        KeyCode::BackTab => v.select_neighbour(t, -1),
        KeyCode::Char('c') => v.toggle_mode(t),
        KeyCode::Char('m') => v.show_metrics = !v.show_metrics,
        KeyCode::Char('s') => v.show_summary = !v.show_summary,
        KeyCode::Char('e') => v.toggle_load_colours(t),
        _ => {}
    }
    Control::Continue
}

pub fn on_mouse(t: &Timeline, v: &mut View, geo: Geometry, m: MouseEvent) {
    let g = geo.gantt;
    let inside = m.column >= g.x && m.column < g.right() && m.row >= g.y && m.row < g.bottom();
    match m.kind {
        MouseEventKind::Down(MouseButton::Left) if inside => {
            v.message = None;
            v.click(t, (m.column - g.x) as usize, (m.row - g.y) as usize);
        }
        MouseEventKind::ScrollUp if m.modifiers.contains(KeyModifiers::CONTROL) => {
            if inside {
                v.cursor = v.window.time_at((m.column - g.x) as usize, v.cols);
            }
            v.zoom(t, ZOOM_STEP);
        }
        MouseEventKind::ScrollDown if m.modifiers.contains(KeyModifiers::CONTROL) => {
            if inside {
                v.cursor = v.window.time_at((m.column - g.x) as usize, v.cols);
            }
            v.zoom(t, 1.0 / ZOOM_STEP);
        }
        MouseEventKind::ScrollUp => v.scroll_rows(-3),
        MouseEventKind::ScrollDown => v.scroll_rows(3),
        MouseEventKind::ScrollLeft => v.pan(-0.1),
        MouseEventKind::ScrollRight => v.pan(0.1),
        _ => {}
    }
}
