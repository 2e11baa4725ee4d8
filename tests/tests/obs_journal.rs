//! titan-obs's journal: a recording rank appends batches to one open file and compacts it into
//! one Parquet part per rotate interval and at the end. kill -9 keeps every flushed batch (a
//! torn tail is reported, not an error) and the next process of the rank compacts it; parts
//! equal what was journaled; the incremental reader decodes only what is new (asserted on its
//! counters); old-layout parts still load. (Object stores getting only compacted parts is a
//! unit test in obs/src/recorder.rs: `memory://` lives in one process.)
//!
//! Recording processes are this test binary re-executed with `JOURNAL_CHILD_RUN` set, running
//! the ignored `journal_child` test.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use titan_obs_core::Reduce;
use titan_obs_core::read::{Columns, PartsReader, ReadOptions, Run};

const CHILD_ENV: &str = "JOURNAL_CHILD_RUN";

/// The recording child. `JOURNAL_CHILD_MODE=rate`: one instant per ms until killed;
/// `short`: ten steps of spans and scalars, then a clean finish.
#[test]
#[ignore = "helper process for the other tests"]
fn journal_child() {
    let Ok(run) = std::env::var(CHILD_ENV) else {
        return;
    };
    let env_ms = |k: &str, d: u64| std::env::var(k).map_or(d, |v| v.parse().unwrap());
    let rank = env_ms("JOURNAL_CHILD_RANK", 0) as u32;
    let world = env_ms("JOURNAL_CHILD_WORLD", 1) as u32;
    titan_tests::init_trainer_recorder(
        run,
        rank,
        world,
        Duration::from_millis(env_ms("JOURNAL_CHILD_FLUSH_MS", 2000)),
        Duration::from_millis(env_ms("JOURNAL_CHILD_ROTATE_MS", 600_000)),
    );
    match std::env::var("JOURNAL_CHILD_MODE").as_deref() {
        Ok("rate") => {
            let start = Instant::now();
            for i in 0u64.. {
                titan_obs_core::set_step(i / 100);
                titan_obs_core::instant("tick");
                if let Some(d) =
                    (start + Duration::from_millis(i + 1)).checked_duration_since(Instant::now())
                {
                    std::thread::sleep(d);
                }
            }
        }
        _ => {
            for step in 1..=10u64 {
                titan_obs_core::set_step(step);
                let _s = titan_obs_core::span("step");
                {
                    let _f = titan_obs_core::span("forward_backward");
                    std::thread::sleep(Duration::from_millis(3));
                }
                titan_obs_core::scalar("training/loss", 10.0 - step as f64, Reduce::Mean);
            }
        }
    }
    let stats = titan_obs_core::finish_with_stats().expect("finish");
    println!("parts={}", stats.parts);
}

fn child(run: &Path, mode: &str, rank: u32, world: u32, flush_ms: u64, rotate_ms: u64) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        titan_tests::test_name(module_path!(), "journal_child").as_str(),
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, run)
    .env("JOURNAL_CHILD_MODE", mode)
    .env("JOURNAL_CHILD_RANK", rank.to_string())
    .env("JOURNAL_CHILD_WORLD", world.to_string())
    .env("JOURNAL_CHILD_FLUSH_MS", flush_ms.to_string())
    .env("JOURNAL_CHILD_ROTATE_MS", rotate_ms.to_string())
    .stdout(Stdio::null());
    cmd
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn load(run: &Path) -> Run {
    titan_obs_core::load(run.to_str().unwrap(), &ReadOptions::default()).unwrap()
}

/// Every record of a run as comparable tuples (kind, rank, name, step, start, dur, seq/value).
fn records(run: &Run) -> BTreeSet<(u8, u32, String, u64, i64, i64, u64)> {
    let mut out = BTreeSet::new();
    let s = &run.spans;
    for i in 0..s.len() {
        out.insert((
            0,
            s.rank[i],
            run.name(s.name[i]).into(),
            s.step[i],
            s.start_ns[i],
            s.dur_ns[i],
            s.seq[i],
        ));
    }
    let t = &run.instants;
    for i in 0..t.rank.len() {
        out.insert((
            1,
            t.rank[i],
            run.name(t.name[i]).into(),
            t.step[i],
            t.start_ns[i],
            0,
            t.parent[i],
        ));
    }
    let c = &run.scalars;
    for i in 0..c.rank.len() {
        out.insert((
            2,
            c.rank[i],
            run.name(c.name[i]).into(),
            c.step[i],
            c.start_ns[i],
            0,
            c.value[i].to_bits(),
        ));
    }
    out
}

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_short_run_leaves_one_part_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut kids: Vec<_> = (0..2)
        .map(|r| child(&run, "short", r, 2, 2000, 600_000).spawn().unwrap())
        .collect();
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    // One file per part (its summary and detail levels in its footer) and the rank's
    // summary; beside the rank folders, the node's rollup of both ranks' summaries, its
    // figures, its timeline and its lock (issue 42).
    for r in 0..2 {
        assert_eq!(
            files(&run.join(format!("obs/rank-{r}"))),
            ["part-000000.parquet", "rank.summary"]
        );
    }
    let top: Vec<String> = files(&run.join("obs"))
        .into_iter()
        .filter(|f| !f.starts_with("rank-"))
        .collect();
    assert_eq!(top.len(), 4, "{top:?}");
    assert!(
        top[0].starts_with("node-") && top[0].ends_with(".figures"),
        "{top:?}"
    );
    assert!(top[1].ends_with(".lock"), "{top:?}");
    assert!(top[2].ends_with(".summary"), "{top:?}");
    assert!(top[3].ends_with(".timeline"), "{top:?}");
    // The node's timeline (issue 42) describes both ranks' folders as the recorders left
    // them (after removing the journals they compacted): the TUI opens on it.
    let job = titan_obs_core::digest::timeline::read_local(&run.join("obs")).unwrap();
    assert_eq!(job.timeline.ranks.len(), 2);
    for (r, (rank, described)) in job.timeline.ranks.iter().zip(&job.ranks) {
        assert_eq!(r.rank, *rank);
        assert_eq!(r.parts.len(), 1);
        assert!(described, "{r:?}");
    }
    assert!(!job.timeline.steps.is_empty());
    // The node's figures (issue 42) describe both ranks' folders as the recorders left them.
    let job = titan_obs_core::digest::figures::read_local(&run.join("obs"), 0).unwrap();
    assert_eq!((job.nodes_read, job.ranks_recomputed), (1, 0));
    assert_eq!(job.figures.ranks.len(), 2);
    // Both ranks wrote their entries at once; `summary` reads them instead of the folders.
    let mut reader = PartsReader::open(run.to_str().unwrap()).unwrap();
    let digests = ReadOptions {
        digests: true,
        node_rollups: true,
        ..Default::default()
    };
    reader.refresh_with(&digests, true).unwrap();
    let c = reader.last();
    assert_eq!((c.rollups_read, c.ranks_rolled_up), (1, 2), "{c:?}");
    assert_eq!(reader.dirs_read(), 0);
    assert_eq!(reader.run().spans.len(), 0);
    let loaded = load(&run);
    assert!(loaded.report.is_complete());
    assert_eq!(loaded.spans.len(), 2 * 10 * 2);
    assert_eq!(loaded.scalars.rank.len(), 2 * 10);
    assert_eq!(job.figures.spans, loaded.spans.len() as u64);
}

#[test]
fn kill_9_keeps_every_flushed_batch_and_the_next_process_compacts_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let rank_dir = run.join("obs/rank-0");
    let flush_ms = 200;
    let mut kid = child(&run, "rate", 0, 1, flush_ms, 600_000)
        .spawn()
        .unwrap();
    let journal = rank_dir.join("journal-000000.arrows");
    wait_for(|| journal.exists(), "the journal");
    std::thread::sleep(Duration::from_millis(1500));
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    kid.kill().unwrap();
    assert!(!kid.wait().unwrap().success());
    // The journal and its checks (a CRC-32C per flush, obs/SCHEMA.md).
    assert_eq!(
        files(&rank_dir),
        ["journal-000000.arrows", "journal-000000.checks"]
    );

    // Every record up to the last flush: ticks 1..=n without a gap, the loss within one interval.
    let check = |loaded: &Run| {
        let t = &loaded.instants;
        // Instants carry no seq column; ticks are one per ms, so use their order in time.
        let mut starts = t.start_ns.clone();
        starts.sort();
        for w in starts.windows(2) {
            assert!(
                w[1] - w[0] < 50_000_000,
                "a gap of {} ms between ticks",
                (w[1] - w[0]) / 1_000_000
            );
        }
        let last = *starts.last().expect("ticks");
        let lost_ms = (killed_at - last) as f64 / 1e6;
        assert!(
            lost_ms <= flush_ms as f64 + 250.0,
            "lost the last {lost_ms:.0} ms"
        );
        t.rank.len()
    };
    let loaded = load(&run);
    assert!(
        loaded.report.corrupt_parts.is_empty(),
        "{:?}",
        loaded.report.corrupt_parts
    );
    let ticks = check(&loaded);
    assert!(ticks > 1000, "{ticks} ticks");

    // A torn tail (a batch cut short by the kill) is reported and ignored, not an error.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    std::io::Write::write_all(&mut f, &[0xFF, 0xFF, 0xFF, 0xFF, 0x40, 0x01, 0, 0, 1, 2, 3])
        .unwrap();
    drop(f);
    let torn = load(&run);
    // pyarrow reads the journal the same way: every complete batch, then the torn tail.
    let out = titan_tests::python_script("tests/python/obs_read_journal.py")
        .arg(&journal)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let py: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(py["rows"], ticks);
    assert_eq!(py["kinds"]["instant"], ticks);
    assert_eq!(
        (py["rank"].as_u64(), py["part"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(py["torn"], true);
    assert!(
        torn.report.corrupt_parts.is_empty(),
        "{:?}",
        torn.report.corrupt_parts
    );
    assert_eq!(
        torn.report.truncated_tails.len(),
        1,
        "{:?}",
        torn.report.truncated_tails
    );
    assert!(torn.report.truncated_tails[0].contains("journal-000000.arrows: 11 bytes"));
    assert_eq!(records(&torn), records(&loaded));
    let o = Command::new(titan_tests::bin("titan-obs"))
        .args(["summary", run.to_str().unwrap(), "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // The next process of rank 0 compacts the leftover journal (up to its last complete
    // batch) into part 0 and records into part 1.
    assert!(
        child(&run, "short", 0, 1, 2000, 600_000)
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(
        files(&rank_dir),
        ["part-000000.parquet", "part-000001.parquet", "rank.summary"]
    );
    let after = load(&run);
    assert!(after.report.is_complete(), "{:?}", after.report);
    assert!(after.report.truncated_tails.is_empty());
    assert_eq!(after.instants.rank.len(), ticks);
    let before: BTreeSet<_> = records(&loaded);
    assert!(before.is_subset(&records(&after)));
    assert_eq!(after.spans.len(), 20);
}

#[test]
fn rotation_makes_parts_equal_to_the_journal_and_follow_reads_only_new_data() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut kid = child(&run, "rate", 0, 1, 100, 700).spawn().unwrap();
    let rank_dir = run.join("obs/rank-0");
    wait_for(
        || rank_dir.join("journal-000000.arrows").exists(),
        "the journal",
    );
    let mut reader = PartsReader::open(run.to_str().unwrap()).unwrap();
    let opts = ReadOptions::with_columns(Columns::ALL);
    let start = Instant::now();
    let mut refreshes = Vec::new();
    while start.elapsed() < Duration::from_millis(2600) {
        let before = reader.run().instants.rank.len() as u64;
        reader.refresh(&opts).unwrap();
        let last = reader.last();
        let after = reader.run().instants.rank.len() as u64;
        // A refresh decodes only the new records: what it added, nothing twice.
        assert_eq!(last.rows, after - before, "{last:?}");
        refreshes.push(last);
        std::thread::sleep(Duration::from_millis(150));
    }
    kid.kill().unwrap();
    kid.wait().unwrap();
    let total = reader.total();
    let parts: Vec<String> = files(&rank_dir)
        .into_iter()
        .filter(|f| f.starts_with("part-") && f.ends_with(".parquet"))
        .collect();
    assert!(parts.len() >= 3, "rotation every 700 ms made {parts:?}");
    // Each part decoded once; its rows read from the journal before were skipped, not re-read.
    assert_eq!(total.parts_decoded as usize, parts.len(), "{total:?}");
    assert!(total.journal_batches >= 10, "{total:?}");
    assert!(total.part_rows_skipped > 0, "{total:?}");
    // Bytes read per refresh stay in proportion to the new data, not the run.
    let run_bytes: u64 = std::fs::read_dir(&rank_dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let late_max = refreshes[refreshes.len() / 2..]
        .iter()
        .map(|r| r.bytes)
        .max()
        .unwrap();
    assert!(
        late_max < run_bytes / 2,
        "a late refresh read {late_max} of {run_bytes} bytes"
    );

    // Record for record: the parts (read fresh) hold exactly what the journals gave the
    // follower, for every part the follower saw compacted.
    reader.refresh(&opts).unwrap();
    let followed = records(reader.run());
    let fresh = records(&load(&run));
    assert_eq!(
        followed.len(),
        reader.run().instants.rank.len(),
        "no record twice"
    );
    assert_eq!(followed, fresh);
}

#[test]
fn follow_counters_match_appended_batches_and_compaction_is_not_double_counted() {
    use titan_obs_core::footer::PartHeader;
    use titan_obs_core::journal::{JournalWriter, read_journal};
    use titan_obs_core::part::{PartBuilder, Row, compact};
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let rank_dir = run.join("obs/rank-0");
    let header = PartHeader {
        run_id: "j".into(),
        source: "trainer".into(),
        host: "h".into(),
        rank: 0,
        local_rank: 0,
        world_size: 1,
        pid: 1,
        clock_offset_ns: 0,
        threads: [(0, "main".to_string())].into(),
        run_metadata: Default::default(),
    };
    let mut journal = JournalWriter::create(&rank_dir, 0, &header).unwrap();
    let mut builder = PartBuilder::new();
    let mut seq = 0u64;
    let mut batch = |n: usize| {
        for _ in 0..n {
            seq += 1;
            builder.push(&Row {
                thread: 0,
                seq,
                kind: titan_obs_core::Kind::Span,
                name: if seq.is_multiple_of(2) {
                    "forward"
                } else {
                    "backward"
                },
                step: Some(seq / 10),
                start_ns: seq as i64 * 1000,
                dur_ns: Some(500),
                value: None,
                reduce: None,
                depth: 0,
                parent: None,
                tags: if seq.is_multiple_of(10) {
                    &["checkpoint"]
                } else {
                    &[]
                },
                message: None,
                pipeline: None,
            });
        }
        builder.finish(&header).unwrap()
    };
    let mut reader = PartsReader::open(run.to_str().unwrap()).unwrap();
    let opts = ReadOptions::default();
    reader.refresh(&opts).unwrap();
    assert_eq!(reader.run().spans.len(), 0);
    let mut size = std::fs::metadata(journal.path()).unwrap().len();
    for (round, n) in [100usize, 3, 250].into_iter().enumerate() {
        journal.append(&batch(n)).unwrap();
        let new_size = std::fs::metadata(journal.path()).unwrap().len();
        reader.refresh(&opts).unwrap();
        let last = reader.last();
        assert_eq!(
            last.bytes,
            new_size - size,
            "round {round}: the appended bytes"
        );
        assert_eq!(
            (last.journal_batches, last.rows, last.parts_decoded),
            (1, n as u64, 0)
        );
        size = new_size;
    }
    // A refresh with nothing new reads nothing.
    reader.refresh(&opts).unwrap();
    assert_eq!(reader.last(), Default::default());
    assert_eq!(reader.run().spans.len(), 353);

    // Compaction (row-for-row equality of the batches is a unit test in obs/src/journal.rs).
    let path: PathBuf = journal.path().to_path_buf();
    drop(journal);
    let contents = read_journal(&path).unwrap();
    assert_eq!(contents.torn_bytes, 0);
    let bytes = compact(&contents, 0).unwrap();
    std::fs::write(rank_dir.join("part-000000.parquet"), bytes).unwrap();
    // Part and journal side by side (a crash between rename and delete): the part is read,
    // only its rows the journal did not give.
    reader.refresh(&opts).unwrap();
    let last = reader.last();
    assert_eq!(
        (last.parts_decoded, last.part_rows_skipped, last.rows),
        (1, 353, 0)
    );
    std::fs::remove_file(&path).unwrap();
    reader.refresh(&opts).unwrap();
    assert_eq!(reader.last(), Default::default());
    assert_eq!(reader.run().spans.len(), 353);
    assert_eq!(reader.run().report.parts_read, 1);
    assert_eq!(reader.run().steps_tagged("checkpoint").len(), 35);
    assert_eq!(records(reader.run()), records(&load(&run)));
}

#[test]
fn follow_does_not_reread_quiet_rank_directories_and_finds_new_files() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 3,
        steps: 12,
        spans_per_step: 4,
        steps_per_part: 4,
        ..Default::default()
    };
    titan_obs_core::synth::write_run(run.to_str().unwrap(), &cfg).unwrap();
    let rank_dir = run.join("obs/rank-1");
    let mut parts: Vec<_> = std::fs::read_dir(&rank_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    parts.sort();
    let last_part = parts.pop().unwrap();
    let held = dir.path().join("held.parquet");
    std::fs::rename(&last_part, &held).unwrap();

    let mut reader = PartsReader::open(run.to_str().unwrap()).unwrap();
    let opts = ReadOptions::default();
    // Listings of directories changed within the last second are not trusted: wait so the
    // directories are quiet, then one refresh lists them all and later ones none.
    std::thread::sleep(std::time::Duration::from_millis(1200));
    reader.refresh(&opts).unwrap();
    assert_eq!(reader.dirs_read(), 3);
    let rows = reader.run().report.rows_read;
    reader.refresh(&opts).unwrap();
    assert_eq!(
        reader.dirs_read(),
        0,
        "unchanged directories are not read again"
    );
    assert_eq!(reader.last(), Default::default());

    // A part renamed into a quiet directory is found (the directory's mtime changed).
    std::fs::rename(&held, &last_part).unwrap();
    reader.refresh(&opts).unwrap();
    assert_eq!(reader.dirs_read(), 1);
    assert_eq!(reader.last().parts_decoded, 1);
    assert!(reader.run().report.rows_read > rows);
    assert_eq!(records(reader.run()), records(&load(&run)));
}

#[test]
fn old_layout_parts_and_a_journal_load_together() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // The previous layout: a part every few steps (the synthetic writer still writes it).
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 2,
        steps: 30,
        spans_per_step: 5,
        steps_per_part: 3,
        // The same run as the journal's process, which names none (its id is the folder's):
        // records of different runs are never read together.
        run_id: "run".into(),
        ..Default::default()
    };
    let stats = titan_obs_core::synth::write_run(run.to_str().unwrap(), &cfg).unwrap();
    // 10 parts (each holding its summary and detail levels) and the rank's summary.
    assert_eq!(files(&run.join("obs/rank-0")).len(), 11);
    let old = load(&run);
    assert!(old.report.is_complete());
    assert_eq!(old.spans.len() as u64, stats.spans);
    // A later process of rank 1 journals after them (killed before compacting).
    let mut kid = child(&run, "rate", 1, 2, 100, 600_000).spawn().unwrap();
    let journal = run.join("obs/rank-1/journal-000010.arrows");
    wait_for(|| journal.exists(), "the journal after the old parts");
    std::thread::sleep(Duration::from_millis(400));
    kid.kill().unwrap();
    kid.wait().unwrap();
    let both = load(&run);
    assert!(both.report.corrupt_parts.is_empty());
    assert_eq!(both.spans.len() as u64, stats.spans);
    let tick = both.name_id("tick").expect("the journal's ticks");
    let ticks: Vec<u32> = (0..both.instants.rank.len())
        .filter(|&i| both.instants.name[i] == tick)
        .map(|i| both.instants.rank[i])
        .collect();
    assert!(ticks.len() > 100, "{} ticks", ticks.len());
    assert!(ticks.iter().all(|&r| r == 1));
}
