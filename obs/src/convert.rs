//! Writing any loaded [`Run`] in titan's layout (`OUT/obs/rank-<R>/part-000000.parquet`):
//! `titan-obs import` turns a torchtitan run or a Chrome trace into parts that re-open fast
//! and that DuckDB/pyarrow query directly.

use anyhow::{Result, bail};
use rayon::prelude::*;

use crate::footer::PartHeader;
use crate::location::Location;
use crate::part::{PartBuilder, PartSink, Row, encode};
use crate::record::NO_STEP;
use crate::run::Run;
use crate::schema::Kind;
use crate::tables::{RecordTable, SharedFields};

/// What [`write_parts`] wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteStats {
    pub ranks: usize,
    pub records: u64,
    pub bytes: u64,
}

/// Record indices of one rank per table.
#[derive(Default)]
struct RankRows {
    spans: Vec<u32>,
    instants: Vec<u32>,
    scalars: Vec<u32>,
    errors: Vec<u32>,
}

/// Writes `run` (loaded with [`crate::Columns::ALL`]) as one part per rank under `out`.
/// Times are written as loaded (after any clock alignment), with a zero footer offset.
pub fn write_parts(run: &Run, out: &str) -> Result<WriteStats> {
    let sp = &run.spans;
    if sp.start_ns.len() != sp.len() || sp.thread.len() != sp.len() || sp.depth.len() != sp.len() {
        bail!("writing parts needs start, thread and depth columns (load with Columns::ALL)");
    }
    let location = Location::parse(out)?;
    if let Location::Local(p) = &location
        && p.join("obs").exists()
    {
        bail!(
            "{}/obs already exists: refusing to mix two runs' parts",
            p.display()
        );
    }
    let mut by_rank: std::collections::BTreeMap<u32, RankRows> = Default::default();
    for (i, &r) in sp.rank.iter().enumerate() {
        by_rank.entry(r).or_default().spans.push(i as u32);
    }
    for (i, &r) in run.instants.rank.iter().enumerate() {
        by_rank.entry(r).or_default().instants.push(i as u32);
    }
    for (i, &r) in run.scalars.rank.iter().enumerate() {
        by_rank.entry(r).or_default().scalars.push(i as u32);
    }
    for (i, &r) in run.errors.rank.iter().enumerate() {
        by_rank.entry(r).or_default().errors.push(i as u32);
    }
    let world = run
        .report
        .world_size
        .max(by_rank.keys().next_back().map_or(0, |r| r + 1));
    let results: Vec<Result<(u64, u64)>> = by_rank
        .into_par_iter()
        .map(|(rank, rows)| write_rank(run, &location, rank, world, &rows))
        .collect();
    let mut stats = WriteStats::default();
    for r in results {
        let (records, bytes) = r?;
        stats.ranks += 1;
        stats.records += records;
        stats.bytes += bytes;
    }
    Ok(stats)
}

/// A row of `kind` holding a record's shared fields (see [`SharedFields`]) and the tags of
/// its step, every other field empty: each table's rows fill in the columns it has.
fn bare<'a>(kind: Kind, run: &'a Run, r: SharedFields, tags: &'a [&'a str]) -> Row<'a> {
    Row {
        thread: r.thread,
        seq: 0,
        kind,
        name: run.name(r.name),
        step: (r.step != NO_STEP).then_some(r.step),
        start_ns: r.start_ns,
        dur_ns: None,
        value: None,
        reduce: None,
        depth: r.depth,
        parent: Some(r.parent).filter(|&p| p != 0),
        tags,
        message: None,
        pipeline: None,
    }
}

fn write_rank(
    run: &Run,
    location: &Location,
    rank: u32,
    world: u32,
    rows: &RankRows,
) -> Result<(u64, u64)> {
    let info = run.ranks.get(&rank).cloned().unwrap_or_default();
    // Times are already on rank 0's clock (the reader added each rank's offset).
    let header = PartHeader {
        run_id: if info.run_id.is_empty() {
            run.location.clone()
        } else {
            info.run_id.clone()
        },
        rank,
        world_size: world,
        clock_offset_ns: 0,
        ..info.header
    };
    let mut b = PartBuilder::new();
    let tags_of = |step: u64| -> Vec<&str> {
        if step == NO_STEP {
            Vec::new()
        } else {
            run.tag_names(rank, step)
        }
    };
    let sp = &run.spans;
    let has_links = sp.seq.len() == sp.len();
    for &i in &rows.spans {
        let i = i as usize;
        let tags = tags_of(sp.step[i]);
        let mut shared = sp.shared_at(i);
        if !has_links {
            shared.parent = 0;
        }
        b.push(&Row {
            seq: if has_links { sp.seq[i] } else { i as u64 + 1 },
            dur_ns: Some(sp.dur_ns[i]),
            pipeline: sp.pipeline.get(i).copied().flatten(),
            ..bare(Kind::Span, run, shared, &tags)
        });
    }
    let ins = &run.instants;
    for &i in &rows.instants {
        let i = i as usize;
        let tags = tags_of(ins.step[i]);
        b.push(&bare(Kind::Instant, run, ins.shared_at(i), &tags));
    }
    let sc = &run.scalars;
    for &i in &rows.scalars {
        let i = i as usize;
        let tags = tags_of(sc.step[i]);
        b.push(&Row {
            value: Some(sc.value[i]),
            reduce: Some(sc.reduce[i]),
            ..bare(Kind::Scalar, run, sc.shared_at(i), &tags)
        });
    }
    let er = &run.errors;
    for &i in &rows.errors {
        let i = i as usize;
        let tags = tags_of(er.step[i]);
        b.push(&Row {
            message: er.message.get(i).map(String::as_str),
            ..bare(Kind::Error, run, er.shared_at(i), &tags)
        });
    }
    let records = b.len() as u64;
    let batch = b.finish(&header)?;
    let bytes = encode(&batch, &header, 0)?;
    let n = bytes.len() as u64;
    PartSink::new(location.clone(), rank)?.put(0, bytes)?;
    Ok((records, n))
}
