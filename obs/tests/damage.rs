//! Damaged files: bit flips, truncation, garbage and huge numbers in journals, parts,
//! torchtitan JSONL and Chrome traces. Whatever the damage, loading never panics or hangs,
//! the other files' records all load, and a file whose records did not all load is named.

mod common;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::run_with_journal;
use titan_obs_core::synth::{SynthConfig, write_run};
use titan_obs_core::{ReadOptions, Run};

/// A small deterministic generator (xorshift64*), so a failure names a reproducible seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The ways a disk, a copy or a crash damages a file.
#[derive(Debug, Clone, Copy)]
enum Mutation {
    BitFlips,
    Truncate,
    Garbage,
    HugeNumber,
}

const MUTATIONS: [Mutation; 4] = [
    Mutation::BitFlips,
    Mutation::Truncate,
    Mutation::Garbage,
    Mutation::HugeNumber,
];

fn mutate(bytes: &[u8], m: Mutation, rng: &mut Rng) -> Vec<u8> {
    let mut out = bytes.to_vec();
    match m {
        Mutation::BitFlips => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
        }
        Mutation::Truncate => out.truncate(rng.below(out.len())),
        Mutation::Garbage => {
            let at = rng.below(out.len());
            let n = (1 + rng.below(64)).min(out.len() - at);
            for b in &mut out[at..at + n] {
                *b = rng.next() as u8;
            }
        }
        Mutation::HugeNumber => {
            let at = rng.below(out.len().saturating_sub(8));
            let huge: [u64; 4] = [u64::MAX, i64::MAX as u64, 1 << 62, 0x7FFF_FFFF];
            let v = huge[rng.below(huge.len())].to_le_bytes();
            let n = 8.min(out.len() - at);
            out[at..at + n].copy_from_slice(&v[..n]);
        }
    }
    out
}

/// Runs `f` on another thread: a panic or a run over 60 s fails the test with `what`.
fn guarded<T: Send + 'static>(what: String, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung (over 60 s)"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let _ = handle.join();
            panic!("{what}: panicked")
        }
    }
}

fn load(run: &Path) -> anyhow::Result<Run> {
    titan_obs_core::load(run.to_str().unwrap(), &ReadOptions::default())
}

/// Spans per rank in a loaded run.
fn spans_of(run: &Run, rank: u32) -> usize {
    run.spans.rank.iter().filter(|&&r| r == rank).count()
}

/// Every way the report can name a file.
fn named(run: &Run, file: &str) -> bool {
    let r = &run.report;
    r.corrupt_parts.iter().any(|c| c.path.contains(file))
        || r.damage.iter().any(|d| d.file.contains(file))
        || r.truncated_tails.iter().any(|t| t.contains(file))
        || r.bad_lines.iter().any(|b| b.file.contains(file))
        || r.open_spans.iter().any(|o| o.file.contains(file))
}

/// The damage test of one file: `cases` mutations of `file` inside `run`; after each, the
/// run loads, the spans of `other_rank` all load, and when spans were lost the file is named.
/// Returns the share of the damaged rank's spans that still loaded after single bit flips.
/// `named_as`: the file the report must name (a journal's, for damage to its checks file).
fn mutate_file(
    run: &Path,
    file: &Path,
    named_as: &str,
    other_rank: u32,
    cases: usize,
    seed: u64,
) -> f64 {
    let clean = load(run).unwrap();
    assert!(clean.report.is_complete(), "{:?}", clean.report);
    let all = clean.spans.len();
    let other = spans_of(&clean, other_rank);
    let original = std::fs::read(file).unwrap();
    let name = file.file_name().unwrap().to_str().unwrap().to_string();
    let damaged_rank_spans = all - other;
    let (mut kept, mut flipped) = (0usize, 0usize);
    let mut rng = Rng(seed);
    for case in 0..cases {
        let m = MUTATIONS[case % MUTATIONS.len()];
        let damaged = mutate(&original, m, &mut rng);
        std::fs::write(file, &damaged).unwrap();
        let what = format!("{name} case {case} ({m:?}, seed {seed})");
        let run_path = run.to_path_buf();
        let loaded = guarded(what.clone(), move || load(&run_path));
        let loaded = loaded.unwrap_or_else(|e| panic!("{what}: load failed: {e:#}"));
        assert_eq!(
            spans_of(&loaded, other_rank),
            other,
            "{what}: the undamaged rank lost spans"
        );
        if matches!(m, Mutation::BitFlips) {
            kept += loaded.spans.len() - other;
            flipped += damaged_rank_spans;
        }
        // A text log cut at a line end is a shorter log, not a damaged one.
        let clean_cut = matches!(m, Mutation::Truncate)
            && name.ends_with(".jsonl")
            && damaged.last().is_none_or(|&b| b == b'\n');
        if damaged != original && loaded.spans.len() != all && !clean_cut {
            // A footer whose run id was hit names another run: its records read as that run,
            // which every command names ("holds 2 runs ... pick one with --run ID").
            assert!(
                named(&loaded, named_as) || loaded.runs.several(),
                "{what}: {} of {all} spans loaded and the file is not named: {:?}",
                loaded.spans.len(),
                loaded.report
            );
        }
    }
    std::fs::write(file, &original).unwrap();
    kept as f64 / flipped.max(1) as f64
}

#[test]
fn damaged_journals_are_named_never_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let (run, journal) = run_with_journal(dir.path());
    // The checks cost a damaged journal only its damaged batches: rank 0 keeps its part and
    // most of its journal after a few flipped bits (without them, the first bad batch ended
    // the journal, and arrow panicked on some).
    let kept = mutate_file(&run, &journal, "journal-000001.arrows", 1, 400, 0x5EED_0001);
    assert!(
        kept > 0.75,
        "only {kept:.2} of the damaged rank's spans kept"
    );
}

#[test]
fn journals_without_checks_still_open_and_damage_ends_them_named() {
    let dir = tempfile::tempdir().unwrap();
    let (run, journal) = run_with_journal(dir.path());
    // A journal written before checks existed: no checks file.
    std::fs::remove_file(titan_obs_core::journal::checks_path(&journal)).unwrap();
    mutate_file(&run, &journal, "journal-000001.arrows", 1, 300, 0x5EED_0002);
}

#[test]
fn a_damaged_checks_file_is_named_or_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let (run, journal) = run_with_journal(dir.path());
    mutate_file(
        &run,
        &titan_obs_core::journal::checks_path(&journal),
        "journal-000001.arrows",
        1,
        200,
        0x5EED_0003,
    );
}

#[test]
fn damaged_parts_are_named_never_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = run_with_journal(dir.path());
    let part = run.join("obs/rank-0/part-000000.parquet");
    mutate_file(&run, &part, "part-000000.parquet", 1, 300, 0x5EED_0004);
}

/// torchtitan structured-logger lines for `rank`: `steps` steps of fetching_batch, fwd_bwd
/// and optim, with a loss scalar.
fn jsonl(rank: u32, steps: u64) -> String {
    let mut out = String::new();
    let mut t = 1_000_000u64;
    let mut seq = 0;
    let mut line = |out: &mut String, step: u64, t: u64, fields: String| {
        out.push_str(&format!(
            "{{\"rank\": {rank}, \"global_rank\": {rank}, \"local_rank\": {rank}, \"source\": \"training\", \"host_name\": \"h\", \"pid\": 7, \"step\": {step}, \"time_us\": {t}, \"seq_id\": {seq}, {fields}}}\n"
        ));
        seq += 1;
    };
    for step in 1..=steps {
        line(
            &mut out,
            step,
            t,
            r#""log_type": "event", "log_type_name": "step_start""#.into(),
        );
        let start = t;
        for (phase, ms) in [("fetching_batch", 2), ("fwd_bwd", 30), ("optim", 5)] {
            line(
                &mut out,
                step,
                t,
                format!(r#""log_type": "event", "log_type_name": "{phase}_start""#),
            );
            t += ms * 1000;
            line(
                &mut out,
                step,
                t,
                format!(r#""log_type": "event", "log_type_name": "{phase}_end", "value": {ms}.0"#),
            );
        }
        line(&mut out, step, t, r#""log_type": "instant", "log_type_name": "metric_value", "event_name": "loss", "value": 2.5"#.into());
        let ms = (t - start) as f64 / 1000.0;
        line(
            &mut out,
            step,
            t,
            format!(r#""log_type": "event", "log_type_name": "step_end", "value": {ms}"#),
        );
        t += 1000;
    }
    out
}

#[test]
fn damaged_torchtitan_logs_are_named_never_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("run/structured_logs");
    std::fs::create_dir_all(&logs).unwrap();
    for rank in 0..2 {
        std::fs::write(
            logs.join(format!(
                "training.global_rank_{rank}.20261125-120000-abcdef.jsonl"
            )),
            jsonl(rank, 20),
        )
        .unwrap();
    }
    let file = logs.join("training.global_rank_0.20261125-120000-abcdef.jsonl");
    let name = "training.global_rank_0.20261125-120000-abcdef.jsonl";
    mutate_file(&dir.path().join("run"), &file, name, 1, 300, 0x5EED_0005);
}

/// A two-rank synthetic run exported as one Chrome trace per rank (`.json` or `.json.gz`).
fn traces(dir: &Path, gz: bool) -> PathBuf {
    let run = dir.join("titan");
    let cfg = SynthConfig {
        ranks: 2,
        steps: 6,
        spans_per_step: 8,
        ..Default::default()
    };
    write_run(run.to_str().unwrap(), &cfg).unwrap();
    let out = dir.join("traces");
    std::fs::create_dir_all(&out).unwrap();
    for rank in 0..2u32 {
        // One rank's run: its parts alone.
        let one = dir.join(format!("rank{rank}"));
        let from = run.join(format!("obs/rank-{rank}"));
        let to = one.join(format!("obs/rank-{rank}"));
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        let loaded = load(&one).unwrap();
        let mut json = Vec::new();
        titan_obs_core::analysis::chrome::write_chrome(&loaded, &mut json).unwrap();
        if gz {
            use std::io::Write;
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(&json).unwrap();
            std::fs::write(
                out.join(format!("rank{rank}.pt.trace.json.gz")),
                enc.finish().unwrap(),
            )
            .unwrap();
        } else {
            std::fs::write(out.join(format!("rank{rank}.json")), json).unwrap();
        }
    }
    out
}

#[test]
fn gzipped_chrome_traces_read_like_plain_ones() {
    let dir = tempfile::tempdir().unwrap();
    let plain = load(&traces(&dir.path().join("a"), false)).unwrap();
    let gz = load(&traces(&dir.path().join("b"), true)).unwrap();
    assert!(plain.spans.len() > 80, "{}", plain.spans.len());
    assert_eq!(plain.spans.len(), gz.spans.len());
    assert_eq!(plain.spans.dur_ns, gz.spans.dur_ns);
    assert_eq!(gz.report.format, titan_obs_core::RunFormat::ChromeTrace);
}

#[test]
fn damaged_chrome_traces_are_named_never_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let out = traces(&dir.path().join("a"), false);
    mutate_file(
        &out,
        &out.join("rank0.json"),
        "rank0.json",
        1,
        200,
        0x5EED_0006,
    );
    let out = traces(&dir.path().join("b"), true);
    let gz = "rank0.pt.trace.json.gz";
    mutate_file(&out, &out.join(gz), gz, 1, 200, 0x5EED_0007);
}

#[test]
fn damage_dropped_at_compaction_is_named_by_the_part() {
    let dir = tempfile::tempdir().unwrap();
    let (run, journal) = run_with_journal(dir.path());
    let checks = std::fs::read(titan_obs_core::journal::checks_path(&journal)).unwrap();
    // Damage the second batch (the third range: schema, batch 1, batch 2).
    let end = |i: usize| u64::from_le_bytes(checks[8 + 16 * i..16 + 16 * i].try_into().unwrap());
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes[(end(1) + end(2)) as usize / 2] ^= 4;
    std::fs::write(&journal, &bytes).unwrap();
    // What the next process of the rank does with a journal left behind.
    let contents = titan_obs_core::journal::read_journal(&journal).unwrap();
    assert_eq!(contents.damage.len(), 1);
    let part = titan_obs_core::part::compact(&contents, 1).unwrap();
    std::fs::write(run.join("obs/rank-0/part-000001.parquet"), part).unwrap();
    titan_obs_core::journal::remove(&journal).unwrap();
    let loaded = load(&run).unwrap();
    let d = &loaded.report.damage;
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(
        d[0].file
            .ends_with("part-000001.parquet (compacted from journal-000001.arrows)"),
        "{d:?}"
    );
    // From the damaged batch to the next keyframe (batch KEYFRAME_EVERY, range + 1).
    let keyframe = titan_obs_core::journal::KEYFRAME_EVERY as usize;
    assert_eq!((d[0].offset, d[0].bytes), (end(1), end(keyframe) - end(1)));
    assert!(!loaded.report.is_complete());
}

/// 200 mutations of the summary file `rel` of a run with an open journal; after each, the
/// summary is the clean run's (what the file stood for was read from the parts instead) and
/// the file is named, unless only its version changed (an outdated file is rebuilt quietly).
/// `before_each` prepares the run for each case.
fn damaged_summary_cases(rel: &str, seed: u64, before_each: impl Fn(&Path)) {
    use titan_obs_core::analysis::{StragglerOptions, summary};
    let dir = tempfile::tempdir().unwrap();
    let (run, _) = run_with_journal(dir.path());
    // The summary files damaged here are read only where no node rollup stands for them;
    // per-part ones only in the layout before issue 42 (beside their parts), still read.
    remove_rollups(&run);
    if rel.ends_with("part-000000.summary") {
        titan_obs_core::embedded::split_out(&run.join("obs/rank-0/part-000000.parquet")).unwrap();
    }
    let opts = ReadOptions {
        digests: true,
        ..Default::default()
    };
    let load_digests = |run: &Path| titan_obs_core::load(run.to_str().unwrap(), &opts);
    let clean = load_digests(&run).unwrap();
    assert!(clean.report.is_complete(), "{:?}", clean.report);
    let want = summary(&clean, &StragglerOptions::default());
    let file = run.join(rel);
    let name = file.file_name().unwrap().to_str().unwrap().to_string();
    let original = std::fs::read(&file).unwrap();
    let mut rng = Rng(seed);
    for case in 0..200 {
        before_each(&run);
        let m = MUTATIONS[case % MUTATIONS.len()];
        let damaged = mutate(&original, m, &mut rng);
        std::fs::write(&file, &damaged).unwrap();
        let what = format!("{rel} case {case} ({m:?})");
        let (run_path, opts) = (run.clone(), opts.clone());
        let loaded = guarded(what.clone(), move || {
            titan_obs_core::load(run_path.to_str().unwrap(), &opts)
        })
        .unwrap_or_else(|e| panic!("{what}: load failed: {e:#}"));
        let got = summary(&loaded, &StragglerOptions::default());
        // What it stood for was read from the parts: nothing is lost.
        assert_eq!(got.spans, want.spans, "{what}");
        for (g, w) in got.phases.iter().zip(&want.phases) {
            assert_eq!(
                (
                    &g.name,
                    g.stats.count,
                    g.stats.total_ns,
                    g.stats.min_ns,
                    g.stats.max_ns
                ),
                (
                    &w.name,
                    w.stats.count,
                    w.stats.total_ns,
                    w.stats.min_ns,
                    w.stats.max_ns
                ),
                "{what}"
            );
        }
        let outdated = damaged.len() >= 12 && damaged[8..12] != original[8..12];
        if damaged != original && !outdated {
            assert!(
                named(&loaded, &name),
                "{what}: not named: {:?}",
                loaded.report
            );
            assert!(!loaded.report.is_complete(), "{what}");
        }
    }
}

#[test]
fn damaged_summaries_are_named_and_their_parts_decoded() {
    // Without the rank summary, which would stand for the part's summary.
    damaged_summary_cases("obs/rank-0/part-000000.summary", 0x5EED_0008, |run| {
        let _ = std::fs::remove_file(run.join("obs/rank-0/rank.summary"));
    });
}

#[test]
fn damaged_rank_summaries_are_named_and_their_parts_read() {
    damaged_summary_cases("obs/rank-0/rank.summary", 0x5EED_0009, |_| {});
}

/// Removes the run's node rollups (`obs/node-*`).
fn remove_rollups(run: &Path) {
    for e in std::fs::read_dir(run.join("obs")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("node-"))
        {
            std::fs::remove_file(p).unwrap();
        }
    }
}
