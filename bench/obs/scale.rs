//! titan-obs at job scale: writes a simulated run in the journal layout (one Parquet part per
//! rank per rotate interval) or in the previous layout (one part per flush interval), and
//! times what readers do with it. Driven by bench/obs/scale.sh; prints one JSON line per
//! measurement.
//!
//!   obs_scale gen  RUN LAYOUT RANKS HOURS     LAYOUT = journal | journal-sparse |
//!                                             journal-sparse-top | old
//!   obs_scale load RUN RUNS                   headless load of what the TUI loads (all columns)
//!   obs_scale follow RUN RANKS RUNS           open journals on every rank, then time refreshes
//!                                             after one flush of every rank (the first lists
//!                                             every rank directory again: they just changed)
//!   obs_scale append RUN RANKS RUNS EVERY_S   open journals on every rank and append one flush
//!                                             to each every EVERY_S seconds (a TUI follows)
//!
//! The simulated job: a step every STEP_S seconds, SPANS spans and 2 scalars per step per
//! rank (forward_backward of rank 17 is 1.3x slower, and the others wait for it in all_reduce;
//! children inside their parents since issue 42's node figures), flush every 2 s, rotate every 600 s
//! (the defaults).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use rayon::prelude::*;
use titan_obs_core::footer::PartHeader;
use titan_obs_core::journal::JournalWriter;
use titan_obs_core::location::Location;
use titan_obs_core::part::{PartBuilder, PartSink, Row, encode};
use titan_obs_core::read::{PartsReader, ReadOptions};
use titan_obs_core::{Kind, Reduce};

const STEP_S: f64 = 30.0;
const FLUSH_S: f64 = 2.0;
const ROTATE_S: f64 = 600.0;
const START_NS: i64 = 1_750_000_000_000_000_000;
/// Ranks whose parts `journal-sparse-top` keeps whole.
const TOP_RANKS_KEPT: u32 = 64;
/// The rank whose forward_backward is 1.3x slower.
const SLOW_RANK: u32 = 17;
const PHASES: [(&str, u16, f64); 10] = [
    ("step", 0, 1.0),
    ("data_loading", 1, 0.05),
    ("forward_backward", 1, 0.6),
    ("forward", 2, 0.2),
    ("backward", 2, 0.4),
    ("all_reduce", 1, 0.1),
    ("optimizer", 1, 0.1),
    ("clip", 2, 0.02),
    ("optimizer_step", 2, 0.06),
    ("lr", 2, 0.01),
];

/// One simulated record (owned names are static).
struct Rec {
    kind: Kind,
    name: &'static str,
    step: u64,
    seq: u64,
    start_ns: i64,
    dur_ns: i64,
    value: f64,
    depth: u16,
    /// When the recorder would have drained it (span end).
    end_ns: i64,
}

/// The jitter of rank `rank`'s durations at `step` (small, deterministic).
fn jitter(rank: u32, step: u64) -> f64 {
    1.0 + (((rank as u64 * 7919 + step * 104_729) % 101) as f64 - 50.0) / 2000.0
}

/// How much slower rank `rank` is in phase `name`.
fn slowdown(rank: u32, name: &str) -> f64 {
    if rank == SLOW_RANK && name == "forward_backward" {
        1.3
    } else {
        1.0
    }
}

/// When rank `rank` starts the step's all_reduce, from the step's start: its phases before.
fn arrival(rank: u32, step: u64, step_ns: i64) -> i64 {
    PHASES
        .iter()
        .take_while(|(name, _, _)| *name != "all_reduce")
        .filter(|(_, depth, _)| *depth == 1)
        .map(|&(name, _, share)| {
            (step_ns as f64 * share * jitter(rank, step) * slowdown(rank, name)) as i64
        })
        .sum()
}

/// One rank's records of one step, as the recorder writes them: children inside their
/// parent, and every rank's all_reduce ending together, after the last rank arrived (a rank
/// that arrives early spends the difference waiting in it).
fn step_records(rank: u32, ranks: u32, step: u64, seq: &mut u64, out: &mut Vec<Rec>) {
    let t0 = START_NS + (step as f64 * STEP_S * 1e9) as i64;
    let step_ns = (STEP_S * 0.9 * 1e9) as i64;
    let jitter = jitter(rank, step);
    // The last arrival: the slow rank's when there is one (its forward_backward is 1.3x,
    // more than any jitter), else the latest of the few ranks there are.
    let last = if ranks > SLOW_RANK {
        arrival(SLOW_RANK, step, step_ns)
    } else {
        (0..ranks)
            .map(|r| arrival(r, step, step_ns))
            .max()
            .unwrap_or(0)
    };
    let mut spans: Vec<(&'static str, u16, i64, i64)> = Vec::new();
    let (mut cursor, mut child) = (t0, t0);
    for (name, depth, share) in PHASES {
        let mut dur = (step_ns as f64 * share * jitter * slowdown(rank, name)) as i64;
        match depth {
            0 => continue,
            1 => {
                if name == "all_reduce" {
                    dur += t0 + last - cursor;
                }
                spans.push((name, depth, cursor, dur));
                child = cursor;
                cursor += dur;
            }
            _ => {
                spans.push((name, depth, child, dur));
                child += dur;
            }
        }
    }
    spans.insert(0, ("step", 0, t0, cursor - t0));
    for (name, depth, start, dur) in spans {
        *seq += 1;
        out.push(Rec {
            kind: Kind::Span,
            name,
            step,
            seq: *seq,
            start_ns: start,
            dur_ns: dur,
            value: 0.0,
            depth,
            end_ns: start + dur,
        });
    }
    for (name, v) in [
        ("training/loss", 10.0 / (1.0 + step as f64 / 100.0)),
        ("trainer_throughput/tps", 5000.0 * jitter),
    ] {
        *seq += 1;
        out.push(Rec {
            kind: Kind::Scalar,
            name,
            step,
            seq: *seq,
            start_ns: t0 + step_ns,
            dur_ns: 0,
            value: v,
            depth: 1,
            end_ns: t0 + step_ns,
        });
    }
}

fn header(rank: u32, ranks: u32) -> PartHeader {
    PartHeader {
        run_id: "scale".into(),
        source: "trainer".into(),
        host: format!("node-{}", rank / 8),
        rank,
        local_rank: rank % 8,
        world_size: ranks,
        pid: 10_000 + rank,
        clock_offset_ns: 0,
        threads: BTreeMap::from([(0, "main".to_string())]),
        run_metadata: Default::default(),
    }
}

fn push(builder: &mut PartBuilder, r: &Rec) {
    builder.push(&Row {
        thread: 0,
        seq: r.seq,
        kind: r.kind,
        name: r.name,
        step: Some(r.step),
        start_ns: r.start_ns,
        dur_ns: (r.kind == Kind::Span).then_some(r.dur_ns),
        value: (r.kind == Kind::Scalar).then_some(r.value),
        reduce: (r.kind == Kind::Scalar).then_some(Reduce::Mean),
        depth: r.depth,
        parent: None,
        tags: &[],
        message: None,
        pipeline: None,
    });
}

/// Writes one rank: a part per `window_s` of records (by drain time), like the recorder.
fn write_rank(
    location: &Location,
    rank: u32,
    ranks: u32,
    hours: f64,
    window_s: f64,
    sparse: bool,
) -> Result<(u64, u64)> {
    // The rank summary is written once, after the last part: what the recorder leaves.
    let sink = PartSink::new(location.clone(), rank)?.defer_rank_summary();
    let h = header(rank, ranks);
    let steps = (hours * 3600.0 / STEP_S) as u64;
    let window_ns = (window_s * 1e9) as i64;
    let mut builder = PartBuilder::new();
    let mut records = Vec::new();
    let mut seq = 0;
    let mut part = 0u64;
    let mut window = 0i64;
    let mut bytes = 0u64;
    let mut flush = |builder: &mut PartBuilder, part: &mut u64| -> Result<()> {
        if builder.is_empty() {
            return Ok(());
        }
        let batch = builder.finish(&h)?;
        let b = encode(&batch, &h, *part)?;
        bytes += b.len() as u64;
        sink.put(*part, b)?;
        *part += 1;
        Ok(())
    };
    for step in 0..steps {
        records.clear();
        step_records(rank, ranks, step, &mut seq, &mut records);
        records.sort_by_key(|r| r.end_ns);
        for r in &records {
            let w = (r.end_ns - START_NS) / window_ns;
            if w != window {
                flush(&mut builder, &mut part)?;
                window = w;
            }
            push(&mut builder, r);
        }
    }
    flush(&mut builder, &mut part)?;
    sink.finish_rank_summary()?;
    if sparse {
        punch_parts(location, rank, part)?;
    }
    Ok((part, bytes))
}

/// Frees the disk blocks of rank `rank`'s parts `0..parts`, keeping each file and its length
/// (and the rank folder's mtime): what `summary` reads from the rank summaries and node
/// figures stays as written, while a day at 16 384 ranks (~50 GB of parts) fits a small disk.
/// Only a reader of the parts' bytes (`--exact`, the TUI's detail levels) sees zeros.
fn punch_parts(location: &Location, rank: u32, parts: u64) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    let Location::Local(run) = location else {
        bail!("sparse parts need a local run");
    };
    for i in 0..parts {
        let path = run
            .join("obs")
            .join(format!("rank-{rank}"))
            .join(titan_obs_core::location::part_file_name(i));
        let f = std::fs::OpenOptions::new().write(true).open(&path)?;
        let len = f.metadata()?.len() as libc::off_t;
        // SAFETY: fallocate on a file descriptor owned by `f` for the duration of the call.
        let rc = unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                len,
            )
        };
        anyhow::ensure!(
            rc == 0,
            "punching {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn gen_run(run: &str, layout: &str, ranks: u32, hours: f64) -> Result<()> {
    // The ranks from which the parts' blocks are freed once summarised (`punch_parts`).
    let (window, punch_from) = match layout {
        "journal" => (ROTATE_S, None),
        "journal-sparse" => (ROTATE_S, Some(0)),
        // The first TOP_RANKS_KEPT ranks' parts kept whole: what the TUI's first frame and
        // its zoom read (the ranks at the top of the gantt), on a run larger than the disk.
        // Scrolled further down, the TUI would read parts of zeros.
        "journal-sparse-top" => (ROTATE_S, Some(TOP_RANKS_KEPT)),
        "old" => (FLUSH_S, None),
        other => {
            bail!("unknown layout `{other}` (journal, journal-sparse, journal-sparse-top or old)")
        }
    };
    let location = Location::parse(run)?;
    let t = Instant::now();
    let results: Vec<(u64, u64)> = (0..ranks)
        .into_par_iter()
        .map(|r| {
            let punch = punch_from.is_some_and(|from| r >= from);
            write_rank(&location, r, ranks, hours, window, punch)
        })
        .collect::<Result<_>>()?;
    let files: u64 = results.iter().map(|r| r.0).sum();
    let bytes: u64 = results.iter().map(|r| r.1).sum();
    let records = ranks as u64 * (hours * 3600.0 / STEP_S) as u64 * (PHASES.len() as u64 + 2);
    println!(
        "{{\"gen\":\"{layout}\",\"ranks\":{ranks},\"hours\":{hours},\"files\":{files},\"bytes\":{bytes},\"records\":{records},\"seconds\":{:.1}}}",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn load(run: &str, runs: usize) -> Result<()> {
    let mut times = Vec::new();
    let mut rows = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let r = titan_obs_core::load(run, &ReadOptions::default())?;
        times.push(t.elapsed().as_secs_f64());
        rows = r.report.rows_read;
    }
    println!(
        "{{\"load_all_columns_s\":{:.3},\"runs\":{runs},\"all\":{times:?},\"rows\":{rows}}}",
        median(times.clone())
    );
    Ok(())
}

/// An open journal on every rank, after its last part.
fn open_journals(location: &Location, ranks: u32) -> Result<Vec<(JournalWriter, PartHeader)>> {
    let mut journals = Vec::new();
    for rank in 0..ranks {
        let sink = PartSink::new(location.clone(), rank)?;
        let index = sink.next_part_index()?;
        let h = header(rank, ranks);
        journals.push((JournalWriter::create(sink.journal_dir(), index, &h)?, h));
    }
    Ok(journals)
}

/// Appends one flush to every journal: about FLUSH_S / STEP_S of a step's records (at least
/// one per rank) of step 1 000 000 + `i`.
fn append_flush(
    journals: &mut [(JournalWriter, PartHeader)],
    i: usize,
    seq: &mut u64,
) -> Result<()> {
    let mut builder = PartBuilder::new();
    let ranks = journals.len() as u32;
    for (rank, (j, h)) in journals.iter_mut().enumerate() {
        let mut recs = Vec::new();
        step_records(rank as u32, ranks, 1_000_000 + i as u64, seq, &mut recs);
        let n = ((recs.len() as f64 * FLUSH_S / STEP_S).ceil() as usize).max(1);
        for r in &recs[..n] {
            push(&mut builder, r);
        }
        j.append(&builder.finish(h)?)?;
    }
    Ok(())
}

/// Removes the journals [`open_journals`] made: leaves the run as it was.
fn remove_journals(dir: &std::path::Path, ranks: u32) -> Result<()> {
    for rank in 0..ranks {
        for e in std::fs::read_dir(dir.join(format!("obs/rank-{rank}")))? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "arrows") {
                titan_obs_core::journal::remove(&p)?;
            }
        }
    }
    Ok(())
}

fn local_dir(location: &Location) -> Result<std::path::PathBuf> {
    match location {
        Location::Local(dir) => Ok(dir.clone()),
        _ => bail!("follow runs on a local run"),
    }
}

/// Opens a journal on every rank after its last part, reads the run, then appends one flush
/// (the records of FLUSH_S seconds) to every journal and times each refresh. `tail`: the
/// parts are marked read without reading them (as the TUI's `--follow` worker does, which
/// draws them from their detail levels): the first refresh only lists the rank folders.
fn follow(run: &str, ranks: u32, runs: usize, tail: bool) -> Result<()> {
    let location = Location::parse(run)?;
    let dir = local_dir(&location)?;
    let mut journals = open_journals(&location, ranks)?;
    let opts = ReadOptions::default();
    let mut reader = PartsReader::open(run)?;
    if tail {
        let mut last = BTreeMap::new();
        for rank in 0..ranks {
            let parts =
                titan_obs_core::digest::local::list_parts(&dir.join(format!("obs/rank-{rank}")))?;
            if let Some(&n) = parts.last() {
                last.insert(rank, n);
            }
        }
        reader.skip_parts_through(&last);
    }
    let t = Instant::now();
    reader.refresh(&opts)?;
    let open_s = t.elapsed().as_secs_f64();
    let mut times = Vec::new();
    let mut last = Default::default();
    let mut dirs_read = Vec::new();
    let mut seq = 1u64 << 40;
    for i in 0..runs {
        append_flush(&mut journals, i, &mut seq)?;
        let t = Instant::now();
        reader.refresh(&opts)?;
        times.push(t.elapsed().as_secs_f64());
        last = reader.last();
        dirs_read.push(reader.dirs_read());
    }
    let rows = reader.run().report.rows_read;
    drop(journals);
    remove_journals(&dir, ranks)?;
    println!(
        "{{\"follow_open_s\":{open_s:.3},\"refresh_s\":{:.4},\"runs\":{runs},\"all\":{times:?},\"last\":{{\"bytes\":{},\"journal_batches\":{},\"parts_decoded\":{},\"rows\":{}}},\"rank_dirs_read\":{dirs_read:?},\"rows_in_run\":{rows}}}",
        median(times.clone()),
        last.bytes,
        last.journal_batches,
        last.parts_decoded,
        last.rows
    );
    Ok(())
}

/// For a viewer following the run (the TUI with `--follow`): opens a journal on every rank,
/// appends one flush to every journal every `every_s` seconds, `runs` times, then removes
/// the journals.
fn append(run: &str, ranks: u32, runs: usize, every_s: f64) -> Result<()> {
    let location = Location::parse(run)?;
    let dir = local_dir(&location)?;
    let mut journals = open_journals(&location, ranks)?;
    let mut seq = 1u64 << 41;
    for i in 0..runs {
        std::thread::sleep(std::time::Duration::from_secs_f64(every_s));
        append_flush(&mut journals, i, &mut seq)?;
        println!("{{\"appended\":{i}}}");
    }
    std::thread::sleep(std::time::Duration::from_secs_f64(every_s));
    drop(journals);
    remove_journals(&dir, ranks)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let arg = |i: usize| {
        args.get(i)
            .map(String::as_str)
            .context("missing argument (see bench/obs/scale.rs)")
    };
    match arg(0)? {
        "gen" => gen_run(arg(1)?, arg(2)?, arg(3)?.parse()?, arg(4)?.parse()?),
        "load" => load(arg(1)?, arg(2)?.parse()?),
        "follow" => follow(
            arg(1)?,
            arg(2)?.parse()?,
            arg(3)?.parse()?,
            arg(4).is_ok_and(|m| m == "tail"),
        ),
        "append" => append(
            arg(1)?,
            arg(2)?.parse()?,
            arg(3)?.parse()?,
            arg(4)?.parse()?,
        ),
        other => bail!("unknown command `{other}`"),
    }
}
