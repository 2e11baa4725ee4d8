//! Writing any loaded [`Run`] in titan's layout (`OUT/obs/rank-<R>/part-000000.parquet`):
//! `titan-obs import` turns a torchtitan run or a Chrome trace into parts that re-open fast
//! and that DuckDB/pyarrow query directly.

use anyhow::{Result, bail};
use rayon::prelude::*;

use crate::location::Location;
use crate::part::{PartBuilder, PartHeader, PartSink, Row, encode};
use crate::record::NO_STEP;
use crate::run::Run;
use crate::schema::Kind;

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

/// A row of `kind` named `name` at `step` (`NO_STEP`: none) with `tags`, every other field
/// empty: each table's rows fill in the columns it has.
fn bare<'a>(kind: Kind, name: &'a str, step: u64, tags: &'a [&'a str]) -> Row<'a> {
    Row {
        thread: 0,
        seq: 0,
        kind,
        name,
        step: (step != NO_STEP).then_some(step),
        start_ns: 0,
        dur_ns: None,
        value: None,
        reduce: None,
        depth: 0,
        parent: None,
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
    let header = PartHeader {
        run_id: if info.run_id.is_empty() {
            run.location.clone()
        } else {
            info.run_id.clone()
        },
        source: info.source.clone(),
        host: info.host.clone(),
        rank,
        local_rank: info.local_rank,
        world_size: world,
        pid: info.pid,
        clock_offset_ns: 0,
        threads: info.threads.clone(),
        run_metadata: info.run_metadata.clone(),
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
        b.push(&Row {
            thread: sp.thread[i],
            seq: if has_links { sp.seq[i] } else { i as u64 + 1 },
            start_ns: sp.start_ns[i],
            dur_ns: Some(sp.dur_ns[i]),
            depth: sp.depth[i],
            parent: if has_links {
                Some(sp.parent[i]).filter(|&p| p != 0)
            } else {
                None
            },
            pipeline: sp.pipeline.get(i).copied().flatten(),
            ..bare(Kind::Span, run.name(sp.name[i]), sp.step[i], &tags)
        });
    }
    let ins = &run.instants;
    for &i in &rows.instants {
        let i = i as usize;
        let tags = tags_of(ins.step[i]);
        b.push(&Row {
            thread: ins.thread.get(i).copied().unwrap_or(0),
            start_ns: ins.start_ns.get(i).copied().unwrap_or(0),
            depth: ins.depth.get(i).copied().unwrap_or(0),
            parent: ins.parent.get(i).copied().filter(|&p| p != 0),
            ..bare(Kind::Instant, run.name(ins.name[i]), ins.step[i], &tags)
        });
    }
    let sc = &run.scalars;
    for &i in &rows.scalars {
        let i = i as usize;
        let tags = tags_of(sc.step[i]);
        b.push(&Row {
            start_ns: sc.start_ns.get(i).copied().unwrap_or(0),
            value: Some(sc.value[i]),
            reduce: Some(sc.reduce[i]),
            ..bare(Kind::Scalar, run.name(sc.name[i]), sc.step[i], &tags)
        });
    }
    let er = &run.errors;
    for &i in &rows.errors {
        let i = i as usize;
        let tags = tags_of(er.step[i]);
        b.push(&Row {
            thread: er.thread.get(i).copied().unwrap_or(0),
            start_ns: er.start_ns.get(i).copied().unwrap_or(0),
            parent: er.parent.get(i).copied().filter(|&p| p != 0),
            message: er.message.get(i).map(String::as_str),
            ..bare(Kind::Error, run.name(er.name[i]), er.step[i], &tags)
        });
    }
    let records = b.len() as u64;
    let batch = b.finish(&header)?;
    let bytes = encode(&batch, &header, 0)?;
    let n = bytes.len() as u64;
    PartSink::new(location.clone(), rank)?.put(0, bytes)?;
    Ok((records, n))
}
