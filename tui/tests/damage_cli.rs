//! A damaged journal through the CLI: `summary` names the damaged batch (file, offset, what
//! was lost) on stderr, in its text and in `--json`, reads the batches before it, and
//! `--strict` exits 3.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use titan_obs_core::footer::PartHeader;
use titan_obs_core::journal::{JournalWriter, checks_path};
use titan_obs_core::part::{PartBuilder, Row};
use titan_obs_core::schema::Kind;

fn titan_obs_core(args: &[&str]) -> Output {
    Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(args)
        .output()
        .expect("running titan-obs")
}

/// Rank 0 of a one-rank run: an open journal of `batches` batches of 10 steps each (a
/// `step` span per step), as a running (or killed) titan-train leaves it.
fn journal_run(run: &Path, batches: u64) -> PathBuf {
    let header = PartHeader {
        run_id: "damaged".into(),
        source: "trainer".into(),
        host: "h".into(),
        rank: 0,
        local_rank: 0,
        world_size: 1,
        pid: 1,
        clock_offset_ns: 0,
        threads: BTreeMap::from([(0, "main".into())]),
        run_metadata: Default::default(),
    };
    let dir = run.join("obs/rank-0");
    let mut w = JournalWriter::create(&dir, 0, &header).unwrap();
    let mut b = PartBuilder::new();
    for batch in 0..batches {
        for step in batch * 10..(batch + 1) * 10 {
            b.push(&Row {
                thread: 0,
                seq: step,
                kind: Kind::Span,
                name: "step",
                step: Some(step),
                start_ns: 1_750_000_000_000_000_000 + step as i64 * 1_000_000_000,
                dur_ns: Some(900_000_000),
                value: None,
                reduce: None,
                depth: 0,
                parent: None,
                tags: &[],
                message: None,
                pipeline: None,
            });
        }
        w.append(&b.finish(&header).unwrap()).unwrap();
    }
    w.path().to_path_buf()
}

#[test]
fn a_damaged_journal_batch_is_named_skipped_and_strict_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let journal = journal_run(&run, 5);
    let run_s = run.to_str().unwrap();
    let clean = titan_obs_core(&["summary", run_s, "--json", "--strict"]);
    assert_eq!(clean.status.code(), Some(0), "{clean:?}");
    // The third batch's range: from the end of the second check to the end of the third.
    let checks = std::fs::read(checks_path(&journal)).unwrap();
    let end = |i: usize| u64::from_le_bytes(checks[8 + 16 * i..16 + 16 * i].try_into().unwrap());
    let (from, to) = (end(2), end(3));
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes[(from + to) as usize / 2] ^= 0x40;
    std::fs::write(&journal, &bytes).unwrap();

    let out = titan_obs_core(&["summary", run_s, "--json", "--strict"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let damage = json["damage"].as_array().unwrap();
    assert_eq!(damage.len(), 1, "{json}");
    assert!(
        damage[0]["file"]
            .as_str()
            .unwrap()
            .ends_with("journal-000000.arrows")
    );
    assert_eq!(damage[0]["offset"].as_u64(), Some(from));
    // The batches after it may use its dictionaries: lost up to the next keyframe (after
    // the end of this short journal), in the same entry.
    assert!(to < bytes.len() as u64);
    assert_eq!(damage[0]["bytes"].as_u64(), Some(bytes.len() as u64 - from));
    assert_eq!(
        json["spans"].as_u64(),
        Some(20),
        "the batches before it load"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("journal-000000.arrows is damaged at byte"),
        "{stderr}"
    );

    let text = titan_obs_core(&["summary", run_s]);
    assert_eq!(text.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains(&format!("damaged (skipped): {}", journal.display())),
        "{stdout}"
    );
}

/// A bit flipped in the summary file `rel` (`remove` deleted first): `summary --strict`
/// names it and exits 3, and its figures are the clean run's.
fn damaged_summary_is_named_and_strict_exits_3(rel: &str, remove: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    let synth = titan_obs_core(&["synth", run_s, "--ranks", "2", "--steps", "20", "-q"]);
    assert!(synth.status.success(), "{synth:?}");
    let clean = titan_obs_core(&["summary", run_s, "--json", "--strict"]);
    assert_eq!(clean.status.code(), Some(0), "{clean:?}");
    // Read only where no node rollup stands for it (issue 42); a part's summary file only in
    // the layout before it (beside the part), still read.
    for e in std::fs::read_dir(run.join("obs")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("node-"))
        {
            std::fs::remove_file(p).unwrap();
        }
    }
    if let Some(part) = rel.strip_suffix(".summary").filter(|p| p.contains("part-")) {
        titan_obs_core::embedded::split_out(&run.join(format!("{part}.parquet"))).unwrap();
        let clean = titan_obs_core(&["summary", run_s, "--json", "--strict"]);
        assert_eq!(clean.status.code(), Some(0), "{clean:?}");
    }
    if let Some(r) = remove {
        std::fs::remove_file(run.join(r)).unwrap();
    }
    let summary = run.join(rel);
    let name = summary.file_name().unwrap().to_str().unwrap();
    let mut bytes = std::fs::read(&summary).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&summary, &bytes).unwrap();

    let out = titan_obs_core(&["summary", run_s, "--json", "--strict"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(rel), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let damage = json["damage"].as_array().unwrap();
    assert!(
        damage[0]["file"].as_str().unwrap().ends_with(name),
        "{damage:?}"
    );
    // Nothing was lost: what it stood for was read from the parts instead.
    let want: serde_json::Value = serde_json::from_slice(&clean.stdout).unwrap();
    assert_eq!(json["spans"], want["spans"]);
    assert_eq!(json["phases"], want["phases"]);
}

#[test]
fn a_damaged_part_summary_is_named_its_part_decoded_and_strict_exits_3() {
    // Without rank 1's summary, which would stand for its parts' summaries.
    damaged_summary_is_named_and_strict_exits_3(
        "obs/rank-1/part-000000.summary",
        Some("obs/rank-1/rank.summary"),
    );
}

#[test]
fn a_damaged_rank_summary_is_named_its_parts_read_and_strict_exits_3() {
    damaged_summary_is_named_and_strict_exits_3("obs/rank-1/rank.summary", None);
}
