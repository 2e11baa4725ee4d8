//! `titan-obs summary` from the summaries (`rank.summary` per rank, `part-<N>.summary` per
//! part) against the summary of every decoded span (`--exact`): counts, sums, minima, maxima,
//! stragglers, tagged steps and waits the same; p50/p95 within the sketches' relative error.
//! The rank summaries: written by every part writer (the recorder at each compaction), built
//! and cached for runs written before them, and a part they do not cover still counted.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use titan_obs_core::analysis::{StragglerOptions, Summary, metrics, summary};
use titan_obs_core::digest::{RANK_SUMMARY_FILE, SKETCH_ALPHA};
use titan_obs_core::synth::{Straggler, SynthConfig, write_run};
use titan_obs_core::{ReadOptions, Run};

fn load(run: &Path, digests: bool) -> Run {
    let opts = ReadOptions {
        digests,
        ..Default::default()
    };
    titan_obs_core::load(run.to_str().unwrap(), &opts).unwrap()
}

/// The metric lines both ways: the same steps and columns, values within float rounding
/// (means are summed part by part from the summaries).
fn metrics_agree(fast: &Run, exact: &Run) {
    let (f, e) = (metrics(fast), metrics(exact));
    assert!(!e.is_empty());
    assert_eq!(f.len(), e.len());
    for (a, b) in f.iter().zip(&e) {
        assert_eq!((a.step, a.validation), (b.step, b.validation));
        let keys = |l: &titan_obs_core::analysis::MetricsLine| -> Vec<String> {
            l.values.iter().map(|(k, _)| k.clone()).collect()
        };
        assert_eq!(keys(a), keys(b), "step {}", a.step);
        for ((k, x), (_, y)) in a.values.iter().zip(&b.values) {
            assert!((x - y).abs() <= 1e-9 * y.abs().max(1.0), "{k}: {x} vs {y}");
        }
    }
}

/// The summary of `run` both ways, checked to agree; returns the one from the summaries.
fn agree(run: &Path) -> Summary {
    let opts = StragglerOptions::default();
    let fast = load(run, true);
    assert!(fast.spans.is_empty(), "no span is decoded");
    assert!(fast.scalars.rank.is_empty(), "no scalar is decoded");
    assert!(fast.digest.is_some());
    let exact_run = load(run, false);
    metrics_agree(&fast, &exact_run);
    // What `metrics` reads: the summaries' scalar sections only.
    let scalars_only = ReadOptions {
        columns: titan_obs_core::Columns::METRICS,
        digests: true,
        ..Default::default()
    };
    let scalars_only = titan_obs_core::load(run.to_str().unwrap(), &scalars_only).unwrap();
    assert!(scalars_only.digest.as_ref().unwrap().phases.is_empty());
    metrics_agree(&scalars_only, &exact_run);
    let fast = summary(&fast, &opts);
    let exact = summary(&exact_run, &opts);
    assert_eq!(
        (fast.ranks, fast.steps, fast.spans, fast.errors),
        (exact.ranks, exact.steps, exact.spans, exact.errors)
    );
    assert_eq!(fast.median_step_ns, exact.median_step_ns);
    assert_eq!(fast.phases.len(), exact.phases.len());
    for (f, e) in fast.phases.iter().zip(&exact.phases) {
        assert_eq!(
            (
                &f.name,
                f.depth,
                f.stats.count,
                f.stats.total_ns,
                f.stats.min_ns,
                f.stats.max_ns
            ),
            (
                &e.name,
                e.depth,
                e.stats.count,
                e.stats.total_ns,
                e.stats.min_ns,
                e.stats.max_ns
            )
        );
        assert_eq!(f.stats.mean_ns, e.stats.mean_ns);
        assert_eq!(f.share_of_step, e.share_of_step, "{}", f.name);
        for (q, a, b) in [
            ("p50", f.stats.p50_ns, e.stats.p50_ns),
            ("p95", f.stats.p95_ns, e.stats.p95_ns),
        ] {
            // The sketch's bound, plus rounding to whole ns.
            let bound = SKETCH_ALPHA * b.abs() as f64 + 1.0;
            assert!(
                ((a - b) as f64).abs() <= bound,
                "{} {q}: {a} from the summaries, {b} exact",
                f.name
            );
        }
    }
    let key = |s: &Summary| -> Vec<(String, u32, u64, u64, u64)> {
        s.stragglers
            .iter()
            .map(|x| {
                (
                    x.phase.clone(),
                    x.rank,
                    x.slowest_steps,
                    x.above_median_steps,
                    x.steps,
                )
            })
            .collect()
    };
    assert_eq!(key(&fast), key(&exact));
    for (f, e) in fast.stragglers.iter().zip(&exact.stragglers) {
        assert_eq!(f.median_excess_ns, e.median_excess_ns);
        assert_eq!(f.median_ratio, e.median_ratio);
    }
    let tagged = |s: &Summary| {
        s.tagged_steps
            .iter()
            .map(|t| {
                (
                    t.step,
                    t.tags.clone(),
                    t.wall_ns,
                    t.extra_ns,
                    t.tagged_phase_ns,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(tagged(&fast), tagged(&exact));
    assert_eq!(fast.waits, exact.waits);
    fast
}

fn synth(dir: &Path) -> std::path::PathBuf {
    let run = dir.join("run");
    let cfg = SynthConfig {
        ranks: 8,
        steps: 60,
        spans_per_step: 30,
        steps_per_part: 7,
        stragglers: vec![
            Straggler {
                rank: 3,
                phase: "forward_backward".into(),
                factor: 1.3,
            },
            Straggler {
                rank: 6,
                phase: "optimizer".into(),
                factor: 1.6,
            },
        ],
        checkpoint_every: Some(10),
        validation_every: Some(4),
        ..Default::default()
    };
    write_run(run.to_str().unwrap(), &cfg).unwrap();
    run
}

#[test]
fn summaries_agree_with_every_span() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let s = agree(&run);
    // The run is what the test means it to be: stragglers, tagged steps, waits.
    assert!(
        s.stragglers.iter().any(|x| x.rank == 3),
        "{:?}",
        s.stragglers
    );
    assert!(
        s.stragglers.iter().any(|x| x.rank == 6),
        "{:?}",
        s.stragglers
    );
    assert!(s.tagged_steps.len() >= 10, "{:?}", s.tagged_steps);
    assert!(!s.waits.is_empty());
}

/// The summary files of a run (`rank.summary` and `part-<N>.summary`), sorted.
fn summaries(run: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for r in std::fs::read_dir(run.join("obs")).unwrap() {
        for f in std::fs::read_dir(r.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "summary") {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

fn rank_summary(run: &Path, rank: u32) -> PathBuf {
    run.join(format!("obs/rank-{rank}/{RANK_SUMMARY_FILE}"))
}

/// The part indices rank `rank`'s summary covers.
fn covered(run: &Path, rank: u32) -> Vec<u64> {
    assert!(rank_summary(run, rank).exists(), "no rank summary");
    covered_now(run, rank)
}

/// [`covered`]; none when there is no rank summary yet.
fn covered_now(run: &Path, rank: u32) -> Vec<u64> {
    let dir = rank_summary(run, rank).parent().unwrap().to_path_buf();
    titan_obs_core::digest::rank_file::read_local(&dir)
        .unwrap()
        .map(|d| d.covered().map(|p| p.index).collect())
        .unwrap_or_default()
}

#[test]
fn runs_written_before_summaries_get_them_on_first_open() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let written = summaries(&run);
    let parts = 60usize.div_ceil(7);
    assert_eq!(written.len(), 8 * (parts + 1), "one per part, one per rank");
    assert_eq!(covered(&run, 5), (0..parts as u64).collect::<Vec<_>>());
    let bytes: Vec<Vec<u8>> = written.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for p in &written {
        std::fs::remove_file(p).unwrap();
    }
    // The old layout opens, and its summaries (the parts', then the ranks') are built and
    // cached, the same as written.
    agree(&run);
    assert_eq!(summaries(&run), written);
    let rebuilt: Vec<Vec<u8>> = written.iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(
        rebuilt == bytes,
        "cached summaries differ from the written ones"
    );
    agree(&run);
}

/// A part written after its rank's summary (a writer killed between the two renames, or a
/// summary restored from elsewhere) is still counted, and the summary brought up to date; a
/// part removed, or one written before the summary's last, makes the rank read from its
/// parts' own summaries.
#[test]
fn parts_a_rank_summary_does_not_cover_are_still_counted() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let parts = 60u64.div_ceil(7);
    let file = rank_summary(&run, 2);
    let old = std::fs::read(&file).unwrap();
    // One more part of rank 2 (a copy of its first: the same records again), then its rank
    // summary as it was before.
    let copy = |from: u64, to: u64| {
        let obs = run.join("obs/rank-2");
        for ext in ["parquet", "summary", "lod"] {
            std::fs::copy(
                obs.join(format!("part-{from:06}.{ext}")),
                obs.join(format!("part-{to:06}.{ext}")),
            )
            .unwrap();
        }
    };
    copy(0, parts);
    std::fs::write(&file, &old).unwrap();
    let before = summary(&load(&run, false), &StragglerOptions::default()).spans;
    agree(&run);
    assert_eq!(
        covered(&run, 2),
        (0..=parts).collect::<Vec<_>>(),
        "brought up to date"
    );
    // A part removed: the summary no longer fits; the rank is read from its parts.
    let obs = run.join("obs/rank-2");
    for ext in ["parquet", "summary", "lod"] {
        std::fs::remove_file(obs.join(format!("part-000003.{ext}"))).unwrap();
    }
    let s = agree(&run);
    assert!(s.spans < before);
    assert!(!covered(&run, 2).contains(&3));
    // A part written with an index before the summary's last.
    copy(0, 3);
    agree(&run);
    assert!(covered(&run, 2).contains(&3));
    let loaded = load(&run, true);
    assert!(loaded.report.is_complete(), "{:?}", loaded.report);
}

/// A summary written by the previous version (1) is not damage: it is rebuilt from its part
/// and rewritten, quietly.
#[test]
fn summaries_of_an_older_version_are_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let one = run.join("obs/rank-0/part-000000.summary");
    // Read through the per-part summaries: without rank 0's summary.
    std::fs::remove_file(rank_summary(&run, 0)).unwrap();
    let bytes = std::fs::read(&one).unwrap();
    let mut old = bytes.clone();
    old[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&one, &old).unwrap();
    let loaded = load(&run, true);
    assert!(
        loaded.report.damage.is_empty(),
        "{:?}",
        loaded.report.damage
    );
    assert_eq!(std::fs::read(&one).unwrap(), bytes);
    agree(&run);
    // A rank summary of another version: rebuilt from the parts' summaries, quietly.
    let file = rank_summary(&run, 1);
    let bytes = std::fs::read(&file).unwrap();
    let mut old = bytes.clone();
    old[8..12].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&file, &old).unwrap();
    let loaded = load(&run, true);
    assert!(
        loaded.report.damage.is_empty(),
        "{:?}",
        loaded.report.damage
    );
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
}

#[test]
fn open_journals_are_summarised_as_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let (run, journal) = common::run_with_journal(dir.path());
    assert!(journal.exists());
    let fast = summary(&load(&run, true), &StragglerOptions::default());
    let exact = summary(&load(&run, false), &StragglerOptions::default());
    assert_eq!(fast.spans, exact.spans);
    for (f, e) in fast.phases.iter().zip(&exact.phases) {
        assert_eq!(
            (&f.name, f.stats.count, f.stats.total_ns, f.stats.max_ns),
            (&e.name, e.stats.count, e.stats.total_ns, e.stats.max_ns)
        );
    }
    // A journal is never cached: it is still growing.
    assert!(!journal.with_extension("summary").exists());
}

/// The recorder rewrites its rank's summary at each compaction: while it runs, the summary
/// covers the parts written so far, and after `finish` every part.
#[test]
fn the_recorder_writes_the_rank_summary_at_each_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    titan_obs_core::init_with(
        titan_obs_core::InitOptions {
            run: run.to_str().unwrap().into(),
            source: titan_obs_core::Source::Trainer,
            rank: 0,
            local_rank: 0,
            world_size: 1,
            flush_interval: Duration::from_millis(50),
        },
        titan_obs_core::Tuning {
            rotate_interval: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .unwrap();
    let parts = || titan_obs_core::digest::local::list_parts(&run.join("obs/rank-0")).unwrap();
    let start = Instant::now();
    let mut n = 0u64;
    let mut seen_while_running = 0usize;
    while start.elapsed() < Duration::from_millis(1500) {
        titan_obs_core::set_step(n / 10);
        let s = titan_obs_core::span("step");
        titan_obs_core::scalar("loss", n as f64, titan_obs_core::Reduce::Mean);
        n += 1;
        std::thread::sleep(Duration::from_millis(2));
        drop(s);
        // A compaction writes the part, then the rank summary: soon after a look at the
        // parts, the summary covers them.
        let before = parts();
        if before.len() >= 2 && n.is_multiple_of(25) {
            let deadline = Instant::now() + Duration::from_secs(10);
            let now = loop {
                let now = covered_now(&run, 0);
                if before.iter().all(|i| now.contains(i)) {
                    break now;
                }
                assert!(Instant::now() < deadline, "{before:?} {now:?}");
                std::thread::sleep(Duration::from_millis(10));
            };
            seen_while_running = seen_while_running.max(now.len());
        }
    }
    titan_obs_core::finish().unwrap();
    assert!(seen_while_running >= 2, "{seen_while_running}");
    let all: Vec<u64> = parts().into_iter().collect();
    assert!(all.len() > seen_while_running.min(2));
    assert_eq!(covered(&run, 0), all);
    let s = agree(&run);
    assert_eq!(s.spans, n);
}
