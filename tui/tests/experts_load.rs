//! Colouring experts spans by load (`e`): under expert parallelism each rank's
//! `moe/layer/<L>/experts` spans take the colour of how many tokens its experts got against an
//! even share, from the `moe/...` scalars the run recorded; other spans keep their phase's.

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::style::Color;
use titan_obs::app::input;
use titan_obs::app::model::{Reduce, SpanInput, SpanRef, Timeline, TimelineBuilder};
use titan_obs::app::palette::{load_index, phase_index};
use titan_obs::app::render::{self, Chrome};
use titan_obs::app::view::{Selection, View};
use titan_obs_core::vocab::moe;

const MS: i64 = 1_000_000;

/// 2 ranks, EP 2 over 4 experts (rank 0 hosts 0..2, rank 1 hosts 2..4), 2 steps of 100 ms;
/// layer 1's router sent 10, 10, 10 and 50 tokens to experts 0..4 on each logged step, so
/// rank 1's experts got 60 of 80 (1.5x an even share of 40) and rank 0's 20 (0.5x).
fn ep_run(with_hosting: bool) -> Timeline {
    let mut b = TimelineBuilder::new("ep2");
    for rank in 0..2u32 {
        for step in 1..=2u64 {
            let t0 = (step as i64 - 1) * 100 * MS;
            let span = |name, start: i64, dur: i64, depth| SpanInput {
                rank,
                thread: 1,
                name,
                step: Some(step),
                start_ns: t0 + start * MS,
                dur_ns: dur * MS,
                depth,
                tags: &[],
                error: false,
            };
            b.add_span(&span("step", 0, 90, 0));
            b.add_span(&span("forward", 0, 60, 1));
            // Rank 1's experts take longer: they got more tokens.
            b.add_span(&span(
                moe::experts_span(1),
                5,
                if rank == 1 { 40 } else { 15 },
                2,
            ));
            b.add_span(&span("all_to_all_single", 50, 5, 2));
            if with_hosting {
                b.add_scalar(
                    moe::first_expert_scalar(rank as usize),
                    step,
                    f64::from(rank * 2),
                    Reduce::Max,
                );
                b.add_scalar(moe::EXPERTS_PER_RANK, step, 2.0, Reduce::Max);
            }
            for (expert, n) in [10.0, 10.0, 10.0, 50.0].into_iter().enumerate() {
                // Each rank's router sent half of them.
                b.add_scalar(moe::tokens_scalar(1, expert), step, n / 2.0, Reduce::Sum);
            }
        }
    }
    b.finish()
}

/// The colours (fg of full cells, bg of named bars) of the gantt cells on the rows labelled
/// with `rank`'s lane, in screen order.
fn colours_of_rank(term: &Terminal<TestBackend>, rank: u32) -> Vec<Color> {
    let buf = term.backend().buffer();
    let mut current = None;
    let mut out = Vec::new();
    for y in 0..buf.area.height {
        let label: String = (0..6).map(|x| buf[(x, y)].symbol()).collect();
        let label = label.trim_start_matches(['▶', ' ']);
        if let Some(r) = label.strip_prefix('r') {
            current = r.split(' ').next().and_then(|n| n.parse::<u32>().ok());
        }
        if current != Some(rank) {
            continue;
        }
        for x in 12..buf.area.width {
            let c = &buf[(x, y)];
            match c.symbol() {
                "█" | "▐" | "▒" => out.push(c.fg),
                " " => {}
                _ => out.push(c.bg),
            }
        }
    }
    out
}

fn draw(term: &mut Terminal<TestBackend>, t: &Timeline, v: &mut View) -> String {
    term.draw(|f| {
        render::draw(f, t, v, &Chrome::default());
    })
    .unwrap();
    let buf = term.backend().buffer();
    let mut text = String::new();
    for y in 0..buf.area.height {
        for x in 0..buf.area.width {
            text.push_str(buf[(x, y)].symbol());
        }
        text.push('\n');
    }
    text
}

fn key(t: &Timeline, v: &mut View, c: char) {
    input::on_key(t, v, KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
}

#[test]
fn e_colours_each_ranks_experts_spans_by_its_experts_load() {
    let t = ep_run(true);
    let mut v = View::new(&t);
    let mut term = Terminal::new(TestBackend::new(160, 40)).unwrap();
    let (hot, idle) = (
        Color::Indexed(load_index(1.5)),
        Color::Indexed(load_index(0.5)),
    );
    assert_ne!(hot, idle);
    draw(&mut term, &t, &mut v);
    for rank in [0, 1] {
        let c = colours_of_rank(&term, rank);
        assert!(
            !c.contains(&hot) && !c.contains(&idle),
            "rank {rank}: {c:?}"
        );
    }
    key(&t, &mut v, 'e');
    let text = draw(&mut term, &t, &mut v);
    assert!(text.contains("experts load vs even share"), "{text}");
    let (r0, r1) = (colours_of_rank(&term, 0), colours_of_rank(&term, 1));
    assert!(
        r1.contains(&hot) && !r1.contains(&idle),
        "rank 1: {r1:?}\n{text}"
    );
    assert!(
        r0.contains(&idle) && !r0.contains(&hot),
        "rank 0: {r0:?}\n{text}"
    );
    // Other spans keep their phase's colour.
    let forward = Color::Indexed(phase_index("forward"));
    assert!(r0.contains(&forward) && r1.contains(&forward), "{text}");

    // The selected experts span says what its colour means.
    let lane = t.lanes.iter().position(|l| l.rank == 1).unwrap();
    let row = t.lanes[lane]
        .rows
        .iter()
        .position(|r| r.depth == 2)
        .unwrap();
    v.selected = Some(Selection::Span(SpanRef {
        lane: lane as u32,
        row: row as u16,
        ix: 0,
    }));
    let text = draw(&mut term, &t, &mut v);
    assert!(
        text.contains(
            "experts 2..4 of 4 on rank 1: 60 of the layer's 80 routed tokens, 1.50x an even share"
        ),
        "{text}"
    );

    // `e` again: phases' colours.
    key(&t, &mut v, 'e');
    draw(&mut term, &t, &mut v);
    assert!(!colours_of_rank(&term, 1).contains(&hot));
}

#[test]
fn e_says_why_when_the_run_recorded_no_expert_load() {
    let t = ep_run(false);
    let mut v = View::new(&t);
    let mut term = Terminal::new(TestBackend::new(160, 40)).unwrap();
    key(&t, &mut v, 'e');
    let text = draw(&mut term, &t, &mut v);
    assert!(!v.load_colours);
    assert!(
        text.contains(
            "no expert load to colour by: the run recorded none under expert parallelism"
        ),
        "{text}"
    );
}
