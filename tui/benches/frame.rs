//! Frame render time of the terminal gantt on a 10-million-span run (256 ranks x 1002 steps x
//! 39 spans, written by titan_obs_core::synth and read back once), at a 200x60 terminal: fit-all, one step, a deep zoom,
//! scrolled to the middle ranks, and the collapsed (per-phase) view. Target: < 16 ms a frame.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use titan_obs::app::demo::{ten_million, timeline};
use titan_obs::app::render::{self, Chrome};
use titan_obs::app::view::View;

fn frames(c: &mut Criterion) {
    let t0 = Instant::now();
    let t = timeline(&ten_million()).unwrap();
    eprintln!(
        "built a {}-span timeline ({} lanes, {} steps) in {:.1}s",
        t.span_count,
        t.lanes.len(),
        t.steps.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(t.span_count >= 10_000_000);
    let mut term = Terminal::new(TestBackend::new(200, 60)).unwrap();
    let chrome = Chrome::default();
    let mut g = c.benchmark_group("frame_200x60_10M_spans");
    g.sample_size(50);

    // One benchmark per view: the frame drawn again and again.
    let mut bench = |name: &str, mut v: View| {
        g.bench_function(name, |b| {
            b.iter(|| {
                term.draw(|f| {
                    black_box(render::draw(f, &t, &mut v, &chrome));
                })
                .unwrap();
            })
        });
    };

    bench("fit_all_lanes", View::new(&t));

    let mut v = View::new(&t);
    v.goto_step(&t, 500);
    bench("one_step_lanes", v);

    let mut v = View::new(&t);
    v.goto_step(&t, 500);
    for _ in 0..6 {
        v.zoom(&t, 0.5);
    }
    v.scroll_rows(600);
    bench("zoomed_scrolled_lanes", v);

    let mut v = View::new(&t);
    v.toggle_mode(&t);
    bench("fit_all_collapsed", v);
    g.finish();
}

criterion_group!(benches, frames);
criterion_main!(benches);
