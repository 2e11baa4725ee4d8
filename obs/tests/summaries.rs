//! `titan-obs summary` from the per-part summaries (`part-<N>.summary`) against the summary
//! of every decoded span (`--exact`): counts, sums, minima, maxima, stragglers, tagged steps
//! and waits the same; p50/p95 within the sketches' relative error.

mod common;

use std::path::Path;

use titan_obs_core::analysis::{StragglerOptions, Summary, metrics, summary};
use titan_obs_core::digest::SKETCH_ALPHA;
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

#[test]
fn runs_written_before_summaries_get_them_on_first_open() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let summaries = |run: &Path| -> Vec<std::path::PathBuf> {
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
    };
    let written = summaries(&run);
    assert_eq!(written.len(), 8 * 60usize.div_ceil(7), "one per part");
    let bytes: Vec<Vec<u8>> = written.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for p in &written {
        std::fs::remove_file(p).unwrap();
    }
    // The old layout opens, and its summaries are built and cached, the same as written.
    agree(&run);
    assert_eq!(summaries(&run), written);
    let rebuilt: Vec<Vec<u8>> = written.iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(
        rebuilt == bytes,
        "cached summaries differ from the written ones"
    );
    agree(&run);
}

/// A summary written by the previous version (1) is not damage: it is rebuilt from its part
/// and rewritten, quietly.
#[test]
fn summaries_of_an_older_version_are_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let one = run.join("obs/rank-0/part-000000.summary");
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
