//! Hot-path cost of recording, next to torchtitan's approach (one JSON line per record through
//! a buffered writer) for the same record.
//!
//! `span_enter_exit` times only the recording thread: records are made in chunks smaller than
//! the thread's ring and the writer thread drains between chunks, outside the timed region
//! (it runs on another core in a real job).

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use titan_obs_core::{InitOptions, Reduce, Source};

const CHUNK: u64 = 4096;

fn timed_in_chunks(iters: u64, mut body: impl FnMut()) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let t = Instant::now();
        for _ in 0..n {
            body();
        }
        total += t.elapsed();
        left -= n;
        assert!(
            titan_obs_core::wait_drained(Duration::from_secs(10)),
            "writer fell behind"
        );
    }
    total
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    titan_obs_core::init(InitOptions {
        run: dir.path().join("run").display().to_string(),
        source: Source::Trainer,
        rank: 0,
        local_rank: 0,
        world_size: 1,
        flush_interval: Duration::from_secs(2),
    })
    .unwrap();
    titan_obs_core::set_step(1);
    let mut g = c.benchmark_group("record");
    g.bench_function("span_enter_exit", |b| {
        b.iter_custom(|iters| {
            timed_in_chunks(iters, || {
                let _s = titan_obs_core::span(black_box("forward_backward"));
            })
        })
    });
    g.bench_function("nested_span_enter_exit", |b| {
        let _outer = titan_obs_core::span("step");
        b.iter_custom(|iters| {
            timed_in_chunks(iters, || {
                let _s = titan_obs_core::span(black_box("forward"));
            })
        })
    });
    g.bench_function("scalar", |b| {
        b.iter_custom(|iters| {
            timed_in_chunks(iters, || {
                titan_obs_core::scalar(black_box("training/loss"), 1.5, Reduce::Mean)
            })
        })
    });
    g.bench_function("instant", |b| {
        b.iter_custom(|iters| timed_in_chunks(iters, || titan_obs_core::instant(black_box("tick"))))
    });

    // torchtitan's way, in Rust: time the region, then write one JSON line per record
    // through a BufWriter to a file.
    let file = std::fs::File::create(dir.path().join("trace.jsonl")).unwrap();
    let mut out = std::io::BufWriter::new(file);
    let anchor_wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    let anchor = Instant::now();
    let mut seq = 0u64;
    g.bench_function("jsonl_bufwriter_span", |b| {
        b.iter(|| {
            let start = Instant::now();
            let name = black_box("forward_backward");
            let end = Instant::now();
            seq += 1;
            let rec = serde_json::json!({
                "rank": 0,
                "thread": 0,
                "seq": seq,
                "kind": "span",
                "name": name,
                "step": 1,
                "start_ns": anchor_wall + start.duration_since(anchor).as_nanos() as i64,
                "dur_ns": end.duration_since(start).as_nanos() as i64,
                "depth": 0,
            });
            serde_json::to_writer(&mut out, &rec).unwrap();
            out.write_all(b"\n").unwrap();
        })
    });
    g.finish();
    out.flush().unwrap();
    titan_obs_core::finish().unwrap();
}

criterion_group!(benches, bench);
criterion_main!(benches);
