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
    // Reading summaries, through the node rollups where they describe the rank folders.
    let opts = ReadOptions {
        digests,
        node_rollups: digests,
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
    let key = |s: &Summary| -> Vec<(String, u32, Option<u64>, u64, u64)> {
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
    synth_ranks(dir, 8)
}

/// `synth`'s run on `ranks` ranks (synth puts ranks 8n..8n+7 on host `node-<n>`).
fn synth_ranks(dir: &Path, ranks: u32) -> std::path::PathBuf {
    let run = dir.join("run");
    write_run(run.to_str().unwrap(), &synth_config(ranks)).unwrap();
    run
}

/// Issue 42, a live job: a rank's open journal (the one after its last part, which a live
/// rank opens after it published) leaves its node's figures trusted; the summary stops at its
/// last part and counts the journal. A part after the last is no journal: the node is read
/// from its ranks' folders.
#[test]
fn node_figures_take_a_live_rank_and_count_its_journal() {
    use titan_obs_core::digest::figures::read_local;
    let dir = tempfile::tempdir().unwrap();
    let run = synth_ranks(dir.path(), 16);
    let obs = run.join("obs");
    let shown = |job: &titan_obs_core::digest::figures::JobFigures| {
        let s = titan_obs_core::analysis::summary_of_figures("r", job, &Default::default());
        let mut v = serde_json::to_value(&s).unwrap();
        v.as_object_mut().unwrap().remove("node_figures");
        v
    };
    let before = read_local(&obs, 0).unwrap();
    let counts = |j: &titan_obs_core::digest::figures::JobFigures| {
        (j.nodes_read, j.ranks_recomputed, j.open_journals)
    };
    assert_eq!(counts(&before), (2, 0, 0));
    let last = 60u64.div_ceil(7) - 1;
    let journal = obs.join(format!("rank-4/journal-{:06}.arrows", last + 1));
    std::fs::write(&journal, b"appended").unwrap();
    let live = read_local(&obs, 0).unwrap();
    assert_eq!(counts(&live), (2, 0, 1));
    assert_eq!(shown(&live), shown(&before));
    let s = titan_obs_core::analysis::summary_of_figures("r", &live, &Default::default());
    assert_eq!(s.node_figures.unwrap().open_journals, 1);
    // Compacted into a part (a copy of its first here), with no next journal: node 0's
    // figures do not describe rank 4's folder.
    std::fs::remove_file(&journal).unwrap();
    std::fs::copy(
        obs.join("rank-4/part-000000.parquet"),
        obs.join(format!("rank-4/part-{:06}.parquet", last + 1)),
    )
    .unwrap();
    assert_eq!(counts(&read_local(&obs, 0).unwrap()), (1, 8, 0));
}

/// The run [`synth_ranks`] writes: rank 3 slow in `forward_backward`, rank 6 in `optimizer`.
fn synth_config(ranks: u32) -> SynthConfig {
    SynthConfig {
        ranks,
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
    }
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

/// The summary files in a run's rank folders (`rank.summary` and `part-<N>.summary`), sorted.
fn summaries(run: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for r in std::fs::read_dir(run.join("obs")).unwrap() {
        let r = r.unwrap().path();
        if !r.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(r).unwrap() {
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
    // The layout before issue 42 (summaries beside the parts), then without any summary.
    old_layout(&run);
    remove_rollups(&run);
    // The rank summaries brought up to date with the parts' new lengths.
    load(&run, true);
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
        std::fs::copy(
            obs.join(format!("part-{from:06}.parquet")),
            obs.join(format!("part-{to:06}.parquet")),
        )
        .unwrap();
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
    std::fs::remove_file(obs.join("part-000003.parquet")).unwrap();
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
    // The rank summaries are read: no node rollup stands for them.
    remove_rollups(&run);
    titan_obs_core::embedded::split_out(&run.join("obs/rank-0/part-000000.parquet")).unwrap();
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

/// Every part of a run in the layout before issue 42: its summary and detail levels beside it.
fn old_layout(run: &Path) {
    for r in std::fs::read_dir(run.join("obs")).unwrap() {
        let r = r.unwrap().path();
        if !r.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&r).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "parquet") {
                titan_obs_core::embedded::split_out(&p).unwrap();
            }
        }
    }
}

/// Removes a run's node rollups (a run written before them).
fn remove_rollups(run: &Path) {
    for f in std::fs::read_dir(run.join("obs")).unwrap() {
        let p = f.unwrap().path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("node-"))
        {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Reads `run` from its summaries once; the reader's counters and the folders it listed.
fn read_counts(run: &Path) -> (titan_obs_core::read::ReadCounters, u64) {
    let mut reader = titan_obs_core::read::PartsReader::open(run.to_str().unwrap()).unwrap();
    let opts = ReadOptions {
        digests: true,
        node_rollups: true,
        ..Default::default()
    };
    reader.refresh_with(&opts, true).unwrap();
    (reader.last(), reader.dirs_read())
}

/// Issue 42: a part is one file (its summary and detail levels in its footer), a rank folder
/// holds its parts and `rank.summary`, and each node's ranks are rolled up into one file
/// beside the rank folders, which `summary` reads instead of the rank folders: 2 files for
/// 16 ranks, the same figures as every span.
#[test]
fn a_part_is_one_file_and_summary_reads_one_rollup_per_node() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth_ranks(dir.path(), 16);
    let parts = 60u64.div_ceil(7);
    for rank in 0..16 {
        let mut want: Vec<String> = (0..parts).map(|i| format!("part-{i:06}.parquet")).collect();
        want.push(RANK_SUMMARY_FILE.into());
        assert_eq!(names(&run.join(format!("obs/rank-{rank}"))), want);
    }
    let top: Vec<String> = names(&run.join("obs"))
        .into_iter()
        .filter(|n| !n.starts_with("rank-"))
        .collect();
    assert_eq!(
        top,
        [
            "node-node-0.figures",
            "node-node-0.lock",
            "node-node-0.summary",
            "node-node-0.timeline",
            "node-node-1.figures",
            "node-node-1.lock",
            "node-node-1.summary",
            "node-node-1.timeline"
        ]
    );
    let (c, dirs) = read_counts(&run);
    assert_eq!(
        (c.rollups_read, c.ranks_rolled_up, dirs),
        (2, 16, 0),
        "{c:?}"
    );
    assert_eq!(c.parts_decoded, 0);
    let s = agree(&run);
    assert!(
        s.stragglers.iter().any(|x| x.rank == 3),
        "{:?}",
        s.stragglers
    );
    assert!(!s.waits.is_empty());

    // The layout before issue 42 (summaries and levels beside the parts, no rollups) reads
    // the same.
    let fast = format!(
        "{:?}",
        summary(&load(&run, true), &StragglerOptions::default())
    );
    old_layout(&run);
    remove_rollups(&run);
    assert_eq!(
        names(&run.join("obs/rank-4")).len() as u64,
        3 * parts + 1,
        "part, summary and levels apart"
    );
    let (c, _) = read_counts(&run);
    assert_eq!(
        (c.rollups_read, c.ranks_rolled_up, c.parts_decoded),
        (0, 0, 0)
    );
    let old = format!(
        "{:?}",
        summary(&load(&run, true), &StragglerOptions::default())
    );
    assert_eq!(fast, old);
    agree(&run);
}

/// The summary from node figures (one file per node, merged as the ranks write) against the
/// summary of every span (`--exact`): the same ranks, steps, phase counts and sums, tagged
/// steps, ended-early ranks and "waiting on" table; p50/p95 within the sketches' error; the
/// same stragglers, by the distribution rule, with their ratios close to the per-step ones.
fn figures_agree(run: &Path) -> titan_obs_core::digest::figures::JobFigures {
    use titan_obs_core::analysis::summary_of_figures;
    let opts = StragglerOptions::default();
    let job = titan_obs_core::digest::figures::read_local(&run.join("obs"), 0).unwrap();
    let fig = summary_of_figures(run.to_str().unwrap(), &job, &opts);
    let exact = summary(&load(run, false), &opts);
    assert_eq!(
        (fig.ranks, fig.world_size, fig.steps, fig.spans, fig.errors),
        (
            exact.ranks,
            exact.world_size,
            exact.steps,
            exact.spans,
            exact.errors
        )
    );
    assert_eq!(fig.median_step_ns, exact.median_step_ns);
    assert_eq!(fig.missing_ranks, exact.missing_ranks);
    assert_eq!(fig.ended_early, exact.ended_early);
    assert_eq!(fig.phases.len(), exact.phases.len());
    for (f, e) in fig.phases.iter().zip(&exact.phases) {
        assert_eq!(
            (&f.name, f.depth, f.stats.count, f.stats.total_ns),
            (&e.name, e.depth, e.stats.count, e.stats.total_ns)
        );
        assert_eq!(
            (f.stats.min_ns, f.stats.max_ns),
            (e.stats.min_ns, e.stats.max_ns)
        );
        assert_eq!(f.share_of_step, e.share_of_step, "{}", f.name);
        for (a, b) in [
            (f.stats.p50_ns, e.stats.p50_ns),
            (f.stats.p95_ns, e.stats.p95_ns),
        ] {
            assert!(
                ((a - b) as f64).abs() <= SKETCH_ALPHA * b.abs() as f64 + 1.0,
                "{}",
                f.name
            );
        }
    }
    let tagged = |s: &Summary| {
        s.tagged_steps
            .iter()
            .map(|t| {
                let mut tags = t.tags.clone();
                tags.sort();
                (t.step, tags, t.wall_ns, t.extra_ns, t.tagged_phase_ns)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(tagged(&fig), tagged(&exact));
    assert_eq!(fig.waits, exact.waits);
    let found = |s: &Summary| {
        let mut v: Vec<(String, u32)> = s
            .stragglers
            .iter()
            .map(|x| (x.phase.clone(), x.rank))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        found(&fig),
        found(&exact),
        "{:#?}\n{:#?}",
        fig.stragglers,
        exact.stragglers
    );
    for f in &fig.stragglers {
        let e = exact
            .stragglers
            .iter()
            .find(|e| (e.rank, &e.phase) == (f.rank, &f.phase))
            .unwrap();
        assert_eq!((f.slowest_steps, f.steps), (None, e.steps));
        assert!(
            (f.median_ratio - e.median_ratio).abs() <= 0.03 * e.median_ratio,
            "{f:?} {e:?}"
        );
        assert!(
            (f.median_excess_ns - e.median_excess_ns).abs() <= 0.1 * e.median_excess_ns,
            "{f:?} {e:?}"
        );
        assert!(
            f.above_median_steps.abs_diff(e.above_median_steps) <= e.steps / 10,
            "{f:?} {e:?}"
        );
    }
    assert!(fig.node_figures.is_some() && exact.node_figures.is_none());
    job
}

/// Issue 42: every node's ranks write one figures file beside their rollup, and `summary`
/// reads the job from those (4 files for 32 ranks), agreeing with every span; a node whose
/// rank folders changed since is summarised from its ranks' folders instead, and a run the
/// figures do not describe (several runs, a damaged figures file) is not read from them.
#[test]
fn node_figures_agree_with_every_span() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut cfg = synth_config(32);
    cfg.stragglers.push(Straggler {
        rank: 21,
        phase: "forward_backward".into(),
        factor: 1.25,
    });
    write_run(run.to_str().unwrap(), &cfg).unwrap();
    let figures: Vec<String> = names(&run.join("obs"))
        .into_iter()
        .filter(|n| n.ends_with(".figures"))
        .collect();
    assert_eq!(
        figures,
        [
            "node-node-0.figures",
            "node-node-1.figures",
            "node-node-2.figures",
            "node-node-3.figures"
        ]
    );
    let job = figures_agree(&run);
    assert_eq!((job.nodes_read, job.ranks_recomputed), (4, 0));
    let fig = titan_obs_core::analysis::summary_of_figures(
        run.to_str().unwrap(),
        &job,
        &StragglerOptions::default(),
    );
    let found: Vec<u32> = fig.stragglers.iter().map(|x| x.rank).collect();
    for r in [3, 6, 21] {
        assert!(found.contains(&r), "{:?}", fig.stragglers);
    }
    assert!(!fig.waits.is_empty() && !fig.tagged_steps.is_empty());

    // Rank 9 gets one more part (a copy of its first): node 1 is read from its ranks' folders.
    let parts = 60u64.div_ceil(7);
    let rank9 = run.join("obs/rank-9");
    std::fs::copy(
        rank9.join("part-000000.parquet"),
        rank9.join(format!("part-{parts:06}.parquet")),
    )
    .unwrap();
    let job = figures_agree(&run);
    assert_eq!((job.nodes_read, job.ranks_recomputed), (3, 8));

    // A damaged figures file: not read from figures at all (the rank summaries report it).
    let file = run.join("obs/node-node-2.figures");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let err = titan_obs_core::digest::figures::read_local(&run.join("obs"), 0).unwrap_err();
    assert!(err.to_string().contains("node-node-2.figures"), "{err}");
    // Fewer ranks than asked for: not read from figures.
    std::fs::remove_file(&file).unwrap();
    let err = titan_obs_core::digest::figures::read_local(&run.join("obs"), 1024).unwrap_err();
    assert!(err.to_string().contains("fewer than 1024"), "{err}");
    // Its ranks are in no figures file now: each read from its folder.
    let job = figures_agree(&run);
    assert_eq!((job.nodes_read, job.ranks_recomputed), (2, 16));
}

/// A rollup is used for a rank only while it describes the rank's folder: a part added behind
/// the writer's back (even within the file system's timestamp granularity: the folder's mtime
/// set back) makes that rank read from its folder; a damaged rollup is named and its ranks
/// read from their folders; a writer's stray temporary file is ignored.
#[test]
fn a_rollup_stands_only_for_the_folders_it_describes() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth_ranks(dir.path(), 16);
    let parts = 60u64.div_ceil(7);
    let spans = |run: &Path| summary(&load(run, true), &StragglerOptions::default()).spans;
    let before = spans(&run);

    // Rank 9 gets one more part (a copy of its first), its folder's mtime kept.
    let rank9 = run.join("obs/rank-9");
    let mtime = std::fs::metadata(&rank9).unwrap().modified().unwrap();
    std::fs::copy(
        rank9.join("part-000000.parquet"),
        rank9.join(format!("part-{parts:06}.parquet")),
    )
    .unwrap();
    std::fs::File::open(&rank9)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    assert_eq!(
        std::fs::metadata(&rank9).unwrap().modified().unwrap(),
        mtime
    );
    let (c, _) = read_counts(&run);
    assert_eq!((c.rollups_read, c.ranks_rolled_up), (2, 15), "{c:?}");
    agree(&run);
    assert!(spans(&run) > before, "the added part is counted");

    // A stray temporary (a writer killed while writing) changes nothing.
    std::fs::write(run.join("obs/.node-node-0.summary.3.tmp"), b"half a file").unwrap();
    let (c, _) = read_counts(&run);
    assert_eq!((c.rollups_read, c.ranks_rolled_up), (2, 15), "{c:?}");

    // A damaged rollup: named, its ranks read from their folders, the figures the same.
    let file = run.join("obs/node-node-0.summary");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let loaded = load(&run, true);
    assert!(
        loaded
            .report
            .damage
            .iter()
            .any(|d| d.file == file.display().to_string() && d.error.contains("checksum")),
        "{:?}",
        loaded.report.damage
    );
    let (c, _) = read_counts(&run);
    assert_eq!((c.rollups_read, c.ranks_rolled_up), (2, 7), "{c:?}");
    agree(&run);
}

/// The ranks of one node write their entries of its rollup at once (each after each of its
/// parts): under the rollup's lock none is lost.
#[test]
fn ranks_of_a_node_writing_at_once_lose_no_entry() {
    let dir = tempfile::tempdir().unwrap();
    let obs = dir.path().join("obs");
    let ranks = 8u32;
    let writes = 40u64;
    for r in 0..ranks {
        std::fs::create_dir_all(obs.join(format!("rank-{r}"))).unwrap();
    }
    std::thread::scope(|s| {
        for r in 0..ranks {
            let obs = &obs;
            s.spawn(move || {
                for i in 0..writes {
                    let body = vec![r as u8; 2000 + i as usize];
                    let part = titan_obs_core::digest::timeline::PartTimeline {
                        index: i,
                        run_id: "run".into(),
                        start_ns: i as i64 * 100 + i64::from(r),
                        end_ns: i as i64 * 100 + 50,
                        spans: 1,
                        lanes: vec![(0, 1)],
                        steps: vec![(
                            i,
                            i as i64 * 100 + i64::from(r),
                            i as i64 * 100 + 50,
                            vec![],
                        )],
                    };
                    let dir = obs.join(format!("rank-{r}"));
                    let u = titan_obs_core::digest::node::RankUpdate {
                        rank: r,
                        dir_mtime_ns: titan_obs_core::digest::node::mtime_ns(
                            &std::fs::metadata(&dir).unwrap(),
                        ),
                        last_part: Some(i),
                        summary: body,
                        summary_changed: true,
                        added: &[part],
                    };
                    titan_obs_core::digest::node::update(obs, "node-h.summary", u, None, false)
                        .unwrap();
                }
            });
        }
    });
    let entries =
        titan_obs_core::digest::node::decode(&std::fs::read(obs.join("node-h.summary")).unwrap())
            .unwrap();
    let got: Vec<(u32, Option<u64>, usize)> = entries
        .iter()
        .map(|e| (e.rank, e.last_part, e.summary.len()))
        .collect();
    let want: Vec<(u32, Option<u64>, usize)> = (0..ranks)
        .map(|r| (r, Some(writes - 1), 2000 + writes as usize - 1))
        .collect();
    assert_eq!(got, want);
    // The node's timeline, written under the same lock, holds every part of every rank and
    // each step's bounds over the ranks.
    let t = titan_obs_core::digest::timeline::decode(
        &std::fs::read(obs.join("node-h.timeline")).unwrap(),
    )
    .unwrap();
    assert_eq!(t.ranks.len(), ranks as usize);
    for r in &t.ranks {
        assert!(
            r.contiguous() && r.parts.len() == writes as usize,
            "rank {}",
            r.rank
        );
        assert_eq!(r.spans, writes);
    }
    let steps: Vec<(u64, (i64, i64, u64))> = t.steps.into_iter().collect();
    let want: Vec<(u64, (i64, i64, u64))> = (0..writes)
        .map(|i| (i, (i as i64 * 100, i as i64 * 100 + 50, 0)))
        .collect();
    assert_eq!(steps, want);
}
