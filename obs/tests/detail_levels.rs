//! Detail levels (`titan_obs_core::lod`): every writer puts them in every part's footer
//! (`part-<N>.lod` beside it before issue 42, still read), and they are exactly what a
//! reader builds from the part; a run written before them
//! gets them on first open (cached when the folder is writable); a damaged one is named,
//! left as evidence, and the part's own spans used instead.

use std::path::{Path, PathBuf};

use titan_obs_core::location::Location;
use titan_obs_core::lod::{self, PartDetail};
use titan_obs_core::part_files::{self, PartFile};
use titan_obs_core::synth::{SynthConfig, write_run};

fn synth(dir: &Path) -> PathBuf {
    synth_named(dir, "run", "synthetic")
}

fn synth_named(dir: &Path, name: &str, run_id: &str) -> PathBuf {
    let run = dir.join(name);
    let cfg = SynthConfig {
        run_id: run_id.into(),
        ranks: 3,
        steps: 40,
        spans_per_step: 12,
        steps_per_part: 9,
        checkpoint_every: Some(10),
        validation_every: None,
        ..Default::default()
    };
    write_run(run.to_str().unwrap(), &cfg).unwrap();
    run
}

fn parts(run: &Path) -> Vec<(u32, PathBuf)> {
    let listed = part_files::list(&Location::parse(run.to_str().unwrap()).unwrap()).unwrap();
    assert_eq!(listed.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    listed
        .into_values()
        .flatten()
        .map(|p| (p.rank, p.local_path().unwrap().to_path_buf()))
        .collect()
}

fn built(part: &Path, rank: u32) -> PartDetail {
    PartDetail::of_part(std::fs::read(part).unwrap().into(), rank).unwrap()
}

#[test]
fn every_part_has_the_detail_levels_a_reader_would_build() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let parts = parts(&run);
    assert_eq!(parts.len(), 3 * 40usize.div_ceil(9));
    let mut spans = 0;
    let mut tagged = 0;
    for (rank, p) in &parts {
        let len = std::fs::metadata(p).unwrap().len();
        let written = lod::read_local(p, len)
            .unwrap()
            .expect("the levels in the part's footer");
        assert_eq!(written, built(p, *rank), "{}", p.display());
        assert_eq!(written.rank, *rank);
        assert!(
            !written.names.iter().any(|n| n.contains("loss")),
            "only the names of spans, not of scalars: {:?}",
            written.names
        );
        assert!(written.start_ns < written.end_ns);
        spans += written.rows.iter().map(|r| r.spans).sum::<u64>();
        tagged += written.step_tags.len();
        for r in &written.rows {
            assert!(
                !r.levels.is_empty(),
                "every row has at least its coarsest level"
            );
        }
    }
    let loaded = titan_obs_core::load(run.to_str().unwrap(), &Default::default()).unwrap();
    assert_eq!(spans, loaded.spans.len() as u64, "every span counted once");
    assert_eq!(
        tagged,
        3 * 4,
        "steps 10, 20, 30, 40 are checkpoints on every rank"
    );
}

#[test]
fn a_run_written_before_gets_them_on_first_open_and_damage_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let (rank, part) = parts(&run)[4].clone();
    // The layout before issue 42: the levels in a file beside the part.
    titan_obs_core::embedded::split_out(&part).unwrap();
    let file = lod::detail_path(&part);
    let original = std::fs::read(&file).unwrap();

    // Written before detail levels existed: built from the part and cached.
    std::fs::remove_file(&file).unwrap();
    let o = lod::open(&PartFile::local(part.clone(), rank)).unwrap();
    assert!(o.built && o.damaged.is_none());
    assert_eq!(o.detail, built(&part, rank));
    assert_eq!(
        std::fs::read(&file).unwrap(),
        original,
        "cached as the writer wrote it"
    );
    let o = lod::open(&PartFile::local(part.clone(), rank)).unwrap();
    assert!(!o.built, "the second open reads the cache");

    // Damaged: named, the part's spans used, the damaged file left as it is.
    let mut bad = original.clone();
    let at = bad.len() - 5;
    bad[at] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    let o = lod::open(&PartFile::local(part.clone(), rank)).unwrap();
    let why = o.damaged.expect("damage is named");
    assert!(why.contains(&file.display().to_string()), "{why}");
    assert!(why.contains("checksum"), "{why}");
    assert_eq!(o.detail, built(&part, rank));
    assert_eq!(std::fs::read(&file).unwrap(), bad, "kept as evidence");

    // A detail file of another part (the part was rewritten since) is damage too.
    std::fs::write(&file, lod::encode(&o.detail, 1)).unwrap();
    let why = lod::open(&PartFile::local(part.clone(), rank))
        .unwrap()
        .damaged
        .unwrap();
    assert!(why.contains("rewritten since"), "{why}");

    // A part that cannot be read is an error naming it, never a panic.
    std::fs::write(&part, b"not parquet").unwrap();
    std::fs::remove_file(&file).unwrap();
    let e = lod::open(&PartFile::local(part.clone(), rank))
        .err()
        .expect("an unreadable part");
    assert!(
        format!("{e:#}").contains(&part.display().to_string()),
        "{e:#}"
    );
}

/// A folder holding two runs (a second launch): readers that open parts one at a time keep
/// the newest run's parts (the lowest rank's last part's run), or the one asked for; a run
/// that is not there is an error naming the runs that are.
#[test]
fn keep_run_picks_the_newest_run_or_the_one_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth_named(dir.path(), "run", "first");
    // The second launch wrote only ranks 0 and 1, after the first's parts.
    let second = synth_named(dir.path(), "second", "second");
    for rank in 0..2 {
        let from = second.join(format!("obs/rank-{rank}"));
        for e in std::fs::read_dir(&from).unwrap().flatten() {
            let name = e.file_name().into_string().unwrap();
            // The parts and the files beside them; not the second run's rank summary.
            let Some((index, ext)) = name.strip_prefix("part-").and_then(|n| n.split_once('.'))
            else {
                continue;
            };
            let index: u64 = index.parse().unwrap();
            let to = run.join(format!("obs/rank-{rank}/part-{:06}.{ext}", index + 100));
            std::fs::copy(e.path(), to).unwrap();
        }
    }
    let location = Location::parse(run.to_str().unwrap()).unwrap();
    let per_rank = 40usize.div_ceil(9);
    let counts = |id: Option<&str>| {
        let mut listed = part_files::list(&location).unwrap();
        let kept = part_files::keep_run(run.to_str().unwrap(), &mut listed, id).unwrap();
        let counts: Vec<(u32, usize)> = listed.iter().map(|(&r, p)| (r, p.len())).collect();
        (kept, counts)
    };
    assert_eq!(
        counts(None),
        (
            Some("second".to_string()),
            vec![(0, per_rank), (1, per_rank)]
        ),
        "the newest run, on the ranks it has"
    );
    assert_eq!(
        counts(Some("first")),
        (
            Some("first".to_string()),
            vec![(0, per_rank), (1, per_rank), (2, per_rank)]
        )
    );
    let mut listed = part_files::list(&location).unwrap();
    let e = part_files::keep_run(run.to_str().unwrap(), &mut listed, Some("third"))
        .expect_err("no run third");
    let e = format!("{e:#}");
    assert!(
        e.contains("third") && e.contains("first") && e.contains("second"),
        "{e}"
    );
}

/// Issue 42: the levels in a part's footer, damaged (one base64 character changed): named
/// (the part and its footer's key), and the part's spans used instead.
#[test]
fn damaged_levels_in_a_footer_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = synth(dir.path());
    let (rank, part) = parts(&run)[2].clone();
    let bytes = std::fs::read(&part).unwrap();
    let bad = titan_obs_core::embedded::reencode(bytes.into(), |kv| {
        let lod = kv.iter_mut().find(|k| k.key == "titan.lod").unwrap();
        let v = lod.value.as_mut().unwrap();
        let at = v.len() / 2;
        let c = if &v[at..=at] == "A" { "B" } else { "A" };
        v.replace_range(at..=at, c);
    })
    .unwrap();
    std::fs::write(&part, &bad).unwrap();
    let o = lod::open(&PartFile::local(part.clone(), rank)).unwrap();
    let why = o.damaged.expect("damage is named");
    assert!(why.contains(&part.display().to_string()), "{why}");
    assert!(why.contains("levels damaged"), "{why}");
    assert_eq!(o.detail, built(&part, rank));
}
