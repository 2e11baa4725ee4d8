//! Static gantt images (`titan-obs gantt RUN --svg OUT.svg --png OUT.png`) for reports and PRs.
//!
//! One scene of rectangles, lines and text is laid out once and written either as SVG or
//! rasterised to PNG with tiny-skia (text from an embedded 8x8 bitmap font, so no system fonts
//! are needed). Spans are aggregated per pixel column exactly like the terminal gantt, so the
//! image size depends on the window and the pixel width, not on the number of spans.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use font8x8::UnicodeFonts;

use super::cells::{self, Spread, Window};
use super::model::{Timeline, pass_label};
use super::palette::{STRAGGLER_INDEX, phase_index, rgb};
use super::units::{dur, nice_step, tick_label};

type Rgb = (u8, u8, u8);

/// What to draw.
#[derive(Debug, Clone)]
pub struct GanttImageOptions {
    /// Image width in pixels.
    pub width: u32,
    /// Only steps `first..=last` (inclusive), else the whole run.
    pub steps: Option<(u64, u64)>,
    /// One row per phase with the spread across ranks instead of one per rank/thread/depth.
    pub collapsed: bool,
    /// Hide spans nested deeper than this.
    pub max_depth: Option<u8>,
}

impl Default for GanttImageOptions {
    fn default() -> Self {
        Self {
            width: 1600,
            steps: None,
            collapsed: false,
            max_depth: None,
        }
    }
}

/// Lane rows above this make the image unreadably tall; `gantt` collapses instead.
pub const MAX_IMAGE_ROWS: usize = 600;

#[derive(Debug, Clone, PartialEq)]
enum Prim {
    Rect(Bar),
    Text {
        x: f32,
        y: f32,
        text: String,
        color: Rgb,
    },
}

impl Prim {
    /// A filled rectangle at (`x`, `y`), `w` x `h` pixels.
    fn bar(x: f32, y: f32, w: f32, h: f32, color: Rgb, alpha: f32) -> Prim {
        Prim::Rect(Bar {
            x,
            y,
            w,
            h,
            color,
            alpha,
        })
    }
}

/// A filled rectangle: position and size in pixels, colour and opacity.
#[derive(Debug, Clone, PartialEq)]
struct Bar {
    x: f32,
    y: f32,
    w: f32,
    h: f32,
    color: Rgb,
    alpha: f32,
}

/// A laid-out image.
#[derive(Debug, Clone)]
pub struct Scene {
    pub width: u32,
    pub height: u32,
    prims: Vec<Prim>,
}

const ROW_H: f32 = 12.0;
const LANE_GAP: f32 = 3.0;
/// Text is 8 px high (the bitmap font); SVG uses a matching monospace size.
const CHAR_W: f32 = 8.0;
const TEXT_H: f32 = 8.0;
const INK: Rgb = (30, 30, 30);
const GRID: Rgb = (225, 225, 225);
const STEP_LINE: Rgb = (160, 160, 160);
const TAG: Rgb = (175, 40, 160);

enum ImageRow<'a> {
    Span {
        label: String,
        row: &'a super::model::SpanRow,
        first_of_lane: bool,
    },
    Phase {
        label: String,
        row: &'a super::model::CollapsedRow,
    },
}

/// The time window an image of `t` shows: the whole run, or steps `a..=b` (`--steps`).
pub fn image_window(t: &Timeline, steps: Option<(u64, u64)>) -> anyhow::Result<Window> {
    Ok(match steps {
        None => Window {
            t0: 0,
            t1: t.end.max(1),
        },
        Some((a, b)) => {
            let (Some(ia), Some(ib)) = (t.step_index(a), t.step_index(b)) else {
                bail!(
                    "steps {a}..{b} are not in this run (it has steps {}..={})",
                    t.steps.first().map_or(0, |s| s.step),
                    t.steps.last().map_or(0, |s| s.step)
                );
            };
            if ia > ib {
                bail!("--steps {a}..{b}: the first step is after the last");
            }
            Window {
                t0: t.steps[ia].start,
                t1: t.steps[ib].end.max(t.steps[ia].start + 1),
            }
        }
    })
}

/// Lays out the gantt of `t` as a scene.
pub fn scene(t: &Timeline, opts: &GanttImageOptions) -> anyhow::Result<Scene> {
    if opts.width < 200 {
        bail!(
            "--width {} is too small; use at least 200 pixels",
            opts.width
        );
    }
    let window = image_window(t, opts.steps)?;
    let rows: Vec<ImageRow> = if opts.collapsed {
        t.collapsed
            .iter()
            .map(|c| ImageRow::Phase {
                label: t.phase_name(c.phase).to_string(),
                row: c,
            })
            .collect()
    } else {
        let multi_thread = t.threads_per_rank_max() > 1;
        let late = t.late_rank().map(|(r, _)| r);
        t.lanes
            .iter()
            .enumerate()
            .flat_map(|(ix, lane)| {
                // Once per rank, on its first lane (not on each of its threads').
                let first_lane = ix == 0 || t.lanes[ix - 1].rank != lane.rank;
                let mark = if first_lane && late == Some(lane.rank) {
                    " late"
                } else {
                    ""
                };
                lane.rows
                    .iter()
                    .filter(|r| opts.max_depth.is_none_or(|m| r.depth <= m))
                    .enumerate()
                    .map(move |(i, r)| ImageRow::Span {
                        label: match (i, multi_thread) {
                            (0, false) => format!("r{}{mark}", lane.rank),
                            (0, true) => format!("r{}.t{}{mark}", lane.rank, lane.thread_ix),
                            _ => format!(" d{}", r.depth),
                        },
                        row: r,
                        first_of_lane: i == 0,
                    })
            })
            .collect()
    };
    let label_w = rows
        .iter()
        .map(|r| match r {
            ImageRow::Span { label, .. } | ImageRow::Phase { label, .. } => label.chars().count(),
        })
        .max()
        .unwrap_or(4)
        .clamp(4, 24) as f32
        * CHAR_W
        + 12.0;
    let width = opts.width as f32;
    let plot_x = label_w;
    let plot_w = (width - label_w - 10.0).floor();
    let cols = plot_w as usize;
    let top = 44.0;
    let mut prims = Vec::new();
    let title = format!(
        "{}: {} ranks, {} spans, {} steps, {} shown{}",
        t.title,
        t.ranks.len(),
        t.span_count,
        t.steps.len(),
        dur(window.width()),
        if opts.collapsed {
            " (min/median/max across ranks per phase)"
        } else {
            ""
        }
    );
    prims.push(Prim::Text {
        x: 6.0,
        y: 6.0,
        text: title,
        color: INK,
    });

    // Rows first: their height decides where the grid and the legend go.
    let mut y = top;
    let mut row_ys = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        if i > 0
            && matches!(
                r,
                ImageRow::Span {
                    first_of_lane: true,
                    ..
                }
            )
        {
            y += LANE_GAP;
        }
        row_ys.push(y);
        y += ROW_H;
    }
    let plot_bottom = y;

    // Time grid and axis labels.
    let per_px = window.width() as f64 / cols.max(1) as f64;
    let tick = nice_step(per_px * 110.0);
    let mut tt = window.t0.div_euclid(tick) * tick;
    if tt < window.t0 {
        tt += tick;
    }
    while tt <= window.t1 {
        let x = plot_x + window.col_of(tt, cols) as f32;
        prims.push(Prim::bar(
            x,
            top - 4.0,
            1.0,
            plot_bottom - top + 4.0,
            GRID,
            1.0,
        ));
        prims.push(Prim::Text {
            x: x + 2.0,
            y: top - 14.0,
            text: tick_label(tt, tick),
            color: INK,
        });
        tt += tick;
    }

    // Step boundaries, numbers and tags.
    let lo = t.steps.partition_point(|s| s.end < window.t0);
    let hi = t.steps.partition_point(|s| s.start < window.t1);
    let visible = hi.saturating_sub(lo);
    let label_every = nice_step(visible as f64 * 40.0 / plot_w as f64) as usize;
    let draw_lines = visible <= cols / 4;
    let mut next_free = f32::MIN;
    for s in &t.steps[lo..hi] {
        let x = plot_x + window.col_of(s.start.max(window.t0), cols) as f32;
        if draw_lines {
            prims.push(Prim::bar(
                x,
                top - 2.0,
                1.0,
                plot_bottom - top + 2.0,
                STEP_LINE,
                0.7,
            ));
        }
        let tagged = !s.tags.is_empty();
        if (tagged || (s.step as usize).is_multiple_of(label_every)) && x >= next_free {
            let mut text = s.step.to_string();
            for &tag in &s.tags {
                text.push(match t.tag_names[tag as usize].as_str() {
                    "checkpoint" => 'C',
                    "validation" => 'V',
                    other => other.chars().next().unwrap_or('?').to_ascii_uppercase(),
                });
            }
            next_free = x + (text.chars().count() as f32 + 1.0) * CHAR_W;
            let color = if tagged { TAG } else { STEP_LINE };
            prims.push(Prim::Text {
                x: x + 2.0,
                y: top - 26.0 + 2.0,
                text,
                color,
            });
            if tagged {
                prims.push(Prim::bar(x - 1.0, top - 4.0, 3.0, 4.0, TAG, 1.0));
            }
        }
    }

    // The rows themselves. What was drawn in which colour feeds the legend, which names only
    // that: a phase outside the window or deeper than --max-depth has no swatch to explain.
    let mut drawn = vec![false; t.phases.len()];
    let mut straggler_drawn = false;
    let mut span_cells = Vec::with_capacity(cols);
    let mut bar_cells = Vec::with_capacity(cols);
    for (r, &ry) in rows.iter().zip(&row_ys) {
        let label = match r {
            ImageRow::Span { label, .. } | ImageRow::Phase { label, .. } => label,
        };
        prims.push(Prim::Text {
            x: 4.0,
            y: ry + 2.0,
            text: label.chars().take(24).collect(),
            color: INK,
        });
        // Merge neighbouring pixels with the same look into one rectangle.
        let mut runs: Vec<(usize, usize, Rgb, f32)> = Vec::new();
        let mut push = |c: usize, color: Rgb, alpha: f32| match runs.last_mut() {
            Some(last) if last.1 == c && last.2 == color && last.3 == alpha => last.1 = c + 1,
            _ => runs.push((c, c + 1, color, alpha)),
        };
        match r {
            ImageRow::Span { row, .. } => {
                cells::row_cells(row, window, cols, &mut span_cells);
                for (c, cell) in span_cells.iter().enumerate() {
                    let Some(cell) = cell else { continue };
                    let color = if cell.straggler {
                        straggler_drawn = true;
                        rgb(STRAGGLER_INDEX)
                    } else {
                        drawn[cell.phase as usize] = true;
                        rgb(phase_index(t.phase_name(cell.phase)))
                    };
                    let alpha = if cell.coverage >= 0.5 { 1.0 } else { 0.5 };
                    push(c, color, alpha);
                }
            }
            ImageRow::Phase { row, .. } => {
                cells::collapsed_cells(row, window, cols, &mut bar_cells);
                let base = rgb(phase_index(t.phase_name(row.phase)));
                for (c, cell) in bar_cells.iter().enumerate() {
                    let Some(cell) = cell else { continue };
                    straggler_drawn |= cell.straggler;
                    drawn[row.phase as usize] |= !cell.straggler;
                    let (color, alpha) = match (cell.spread, cell.straggler) {
                        (_, true) => (rgb(STRAGGLER_INDEX), 0.8),
                        (Spread::AllRanks, _) => (base, 1.0),
                        (Spread::ToMedian, _) => (base, 0.6),
                        (Spread::ToMax, _) => (base, 0.3),
                    };
                    push(c, color, alpha);
                }
            }
        }
        for (a, b, color, alpha) in runs {
            prims.push(Prim::bar(
                plot_x + a as f32,
                ry + 1.0,
                (b - a) as f32,
                ROW_H - 2.0,
                color,
                alpha,
            ));
        }
        // Pipeline passes wide enough for it carry their stage, pass and microbatch.
        if let ImageRow::Span { row, .. } = r {
            for &(i, slot) in &row.pipeline {
                let i = i as usize;
                let (start, end) = (row.start[i].max(window.t0), row.end[i].min(window.t1));
                if end <= start {
                    continue;
                }
                let Some(text) = pass_label(t.phase_name(row.phase[i]), slot) else {
                    continue;
                };
                let (a, b) = (window.col_of(start, cols), window.col_of(end, cols));
                if ((b - a) as f32) < text.chars().count() as f32 * CHAR_W + 2.0 {
                    continue;
                }
                prims.push(Prim::Text {
                    x: plot_x + a as f32 + 1.0,
                    y: ry + 2.0,
                    text,
                    color: INK,
                });
            }
        }
    }

    // Legend.
    let mut lx = plot_x;
    let mut ly = plot_bottom + 12.0;
    // (text, swatch colour; None: a note without a swatch).
    let mut entries: Vec<(String, Option<Rgb>)> = t
        .phase_order
        .iter()
        .filter(|&&p| drawn.get(p as usize).copied().unwrap_or(false))
        .map(|&p| {
            (
                t.phase_name(p).to_string(),
                Some(rgb(phase_index(t.phase_name(p)))),
            )
        })
        .collect();
    if straggler_drawn {
        entries.push((
            "straggler (as titan-obs summary), above the median".into(),
            Some(rgb(STRAGGLER_INDEX)),
        ));
    }
    // The headline of the analysis: who the others waited for, and after which phase. A
    // finding about the whole run, not a colour in the picture: no swatch.
    if let Some(w) = t.analysis.waits.table.first() {
        entries.push((
            format!(
                "waiting on r{} (late from {}{}, {} waited)",
                w.rank,
                w.phase,
                // A rank can cause the most wait over the run without being any one step's
                // latest: "last in 0 steps" read as a contradiction.
                if w.steps_last > 0 {
                    format!(", last in {} steps", w.steps_last)
                } else {
                    String::new()
                },
                dur(w.wait_caused_ns)
            ),
            None,
        ));
    }
    for (name, color) in entries {
        let swatch = if color.is_some() { 14.0 } else { 0.0 };
        let w = swatch + (name.chars().count() as f32 + 2.0) * CHAR_W;
        if lx + w > width - 10.0 && lx > plot_x {
            lx = plot_x;
            ly += 14.0;
        }
        if let Some(color) = color {
            prims.push(Prim::bar(lx, ly, 10.0, 10.0, color, 1.0));
        }
        prims.push(Prim::Text {
            x: lx + swatch,
            y: ly + 1.0,
            text: name,
            color: INK,
        });
        lx += w;
    }
    let height = (ly + 22.0).ceil() as u32;
    Ok(Scene {
        width: opts.width,
        height,
        prims,
    })
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The scene as an SVG document.
pub fn to_svg(scene: &Scene) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="10">"#,
        w = scene.width,
        h = scene.height
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for p in &scene.prims {
        match p {
            Prim::Rect(Bar {
                x,
                y,
                w,
                h,
                color,
                alpha,
            }) => {
                let _ = write!(
                    out,
                    r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="#{:02x}{:02x}{:02x}""##,
                    color.0, color.1, color.2
                );
                if *alpha < 1.0 {
                    let _ = write!(out, r#" fill-opacity="{alpha}""#);
                }
                out.push_str("/>\n");
            }
            Prim::Text { x, y, text, color } => {
                let _ = writeln!(
                    out,
                    r##"<text x="{x}" y="{}" fill="#{:02x}{:02x}{:02x}">{}</text>"##,
                    y + TEXT_H,
                    color.0,
                    color.1,
                    color.2,
                    xml_escape(text)
                );
            }
        }
    }
    out.push_str("</svg>\n");
    out
}

/// The scene rasterised as PNG bytes.
pub fn to_png(scene: &Scene) -> anyhow::Result<Vec<u8>> {
    let mut pm = tiny_skia::Pixmap::new(scene.width, scene.height)
        .with_context(|| format!("cannot allocate a {}x{} image", scene.width, scene.height))?;
    pm.fill(tiny_skia::Color::WHITE);
    for p in &scene.prims {
        match p {
            Prim::Rect(bar) => {
                let Some(rect) = tiny_skia::Rect::from_xywh(bar.x, bar.y, bar.w, bar.h) else {
                    continue;
                };
                let mut paint = tiny_skia::Paint::default();
                let (color, alpha) = (bar.color, bar.alpha);
                paint.set_color_rgba8(color.0, color.1, color.2, (alpha * 255.0).round() as u8);
                paint.anti_alias = false;
                pm.fill_rect(rect, &paint, tiny_skia::Transform::identity(), None);
            }
            Prim::Text { x, y, text, color } => draw_text(&mut pm, *x, *y, text, *color),
        }
    }
    pm.encode_png().context("cannot encode the PNG")
}

fn draw_text(pm: &mut tiny_skia::Pixmap, x: f32, y: f32, text: &str, color: Rgb) {
    let (w, h) = (pm.width() as i64, pm.height() as i64);
    let data = pm.data_mut();
    for (i, ch) in text.chars().enumerate() {
        let glyph = font8x8::BASIC_FONTS
            .get(ch)
            .or_else(|| font8x8::LATIN_FONTS.get(ch))
            .or_else(|| font8x8::BOX_FONTS.get(ch))
            .unwrap_or([0; 8]);
        let gx = x as i64 + i as i64 * CHAR_W as i64;
        for (row, bits) in glyph.iter().enumerate() {
            for bit in 0..8 {
                if bits & (1 << bit) == 0 {
                    continue;
                }
                let (px, py) = (gx + bit, y as i64 + row as i64);
                if px < 0 || py < 0 || px >= w || py >= h {
                    continue;
                }
                let o = ((py * w + px) * 4) as usize;
                data[o..o + 4].copy_from_slice(&[color.0, color.1, color.2, 255]);
            }
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, so a reader never
/// sees a half-written image.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("{} is not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!(
            "cannot move {} into place as {}",
            tmp.display(),
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::demo::{small, timeline};

    #[test]
    fn svg_has_every_rank_axis_and_steps() {
        let t = timeline(&small()).unwrap();
        let s = to_svg(&scene(&t, &GanttImageOptions::default()).unwrap());
        assert!(s.starts_with("<svg"));
        for r in [0, 1, 3] {
            assert!(
                s.contains(&format!(">r{r}</text>")),
                "rank {r} lane missing"
            );
        }
        // Rank 2 (1.5x slow in forward_backward) is the one the others waited for.
        assert!(s.contains(">r2 late</text>"), "{s}");
        assert!(s.contains("waiting on r2 (late from forward_backward, last in 4 steps"));
        assert!(s.contains(">forward_backward</text>"));
        // Steps 3 (validation) and 4 (checkpoint) carry their tag letters.
        assert!(s.contains(">3V</text>"), "{s}");
        assert!(s.contains(">4C</text>"));
        // Its forward_backward spans are painted red.
        assert!(s.contains("fill=\"#ff0000\""));
    }

    #[test]
    fn legend_names_only_what_is_drawn() {
        let t = timeline(&small()).unwrap();
        // Top-level spans of step 2 only: no forward_backward (depth 1), so none of rank 2's
        // red either.
        let opts = GanttImageOptions {
            max_depth: Some(0),
            steps: Some((2, 2)),
            ..Default::default()
        };
        let s = to_svg(&scene(&t, &opts).unwrap());
        assert!(s.contains(">step</text>"), "{s}");
        for absent in [
            ">forward_backward</text>",
            ">microbatch</text>",
            ">optimizer_step</text>",
            "straggler (as titan-obs summary)",
            "fill=\"#ff0000\"",
        ] {
            assert!(!s.contains(absent), "{absent} in the legend of:\n{s}");
        }
    }

    #[test]
    fn png_is_a_png_of_the_scene_size() {
        let t = timeline(&small()).unwrap();
        let sc = scene(
            &t,
            &GanttImageOptions {
                width: 800,
                ..Default::default()
            },
        )
        .unwrap();
        let png = to_png(&sc).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
        assert_eq!((w, h), (sc.width, sc.height));
    }

    #[test]
    fn unknown_steps_are_an_error_naming_the_range() {
        let t = timeline(&small()).unwrap();
        let e = scene(
            &t,
            &GanttImageOptions {
                steps: Some((7, 9)),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("steps 1..=4"), "{e}");
    }
}
