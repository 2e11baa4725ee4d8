//! What a viewer of a large run (local or on an object store) needs of every rank summary besides the analysis (which
//! the node figures give): each (phase, step)'s spread across ranks and the metric lines,
//! read one rank summary at a time (a few dozen decoded at once), in memory that grows with
//! phases x steps, not with ranks x phases x steps as a merged [`crate::digest::RunDigest`] does
//! (3.6 GB at 16 384 ranks x 24 h).
//!
//! A spread's extremes and their ranks are exact; its median is read from a histogram of the
//! ranks' times ([`StepTimes`], within [`crate::digest::SKETCH_ALPHA`]) instead of sorting
//! them.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use rayon::prelude::*;

use super::spread::Spread;
use crate::digest::figures::StepTimes;
use crate::digest::{RankSummarised, local, summarise_rank};
use crate::metric_lines::Lines;

/// Rank summaries decoded at once.
const RANKS_AT_ONCE: usize = 64;

/// Every (phase, step)'s spread across ranks and the metric lines of a local run's rank
/// summaries (each brought up to date against its folder, not written back), of run
/// `run_id` (every run when `None`).
#[derive(Debug, Default)]
pub struct Streamed {
    /// (phase, step, spread), by phase then step.
    pub spreads: Vec<(String, u64, Spread)>,
    /// Metric lines; name ids index `names`.
    pub metrics: Lines,
    pub names: Vec<String>,
    /// Rank summaries or parts that could not be read, as (file, error).
    pub damaged: Vec<(String, String)>,
}

/// One (phase, step) across the ranks read so far.
struct Cell {
    min: (i64, u32),
    max: (i64, u32),
    times: StepTimes,
}

/// Reads the rank summaries of the run at `location` ([`read_local`], [`read_object`]).
pub fn read(location: &crate::location::Location, run_id: Option<&str>) -> Result<Streamed> {
    match location {
        crate::location::Location::Local(run) => read_local(&run.join("obs"), run_id),
        crate::location::Location::Object { url, store, base } => {
            read_object(store, base, url, run_id)
        }
    }
}

/// Reads the rank summaries of the local run whose `obs` folder is `obs`.
pub fn read_local(obs: &Path, run_id: Option<&str>) -> Result<Streamed> {
    let dirs = crate::location::ObsFolder::list(obs)?.rank_dirs;
    let ranks: Vec<u32> = dirs.iter().map(|(r, _)| *r).collect();
    let dir_of: HashMap<u32, &std::path::PathBuf> = dirs.iter().map(|(r, d)| (*r, d)).collect();
    Ok(stream(&ranks, run_id, |chunk| {
        chunk
            .par_iter()
            .map(|rank| {
                let dir = dir_of[rank];
                let listed = local::list_parts(dir).unwrap_or_default();
                (*rank, summarise_rank(dir, *rank, &listed, false))
            })
            .collect()
    }))
}

/// Reads the rank summaries (`obs/rank-<R>/rank.summary`) of the object-store run at `base`
/// (`url` for messages), `RANKS_AT_ONCE` GETs at a time: each as its writer last left it
/// (a rank its node's figures describe has one covering at least their parts: the writer
/// puts it before it publishes them). A rank without one is named in `damaged`.
pub fn read_object(
    store: &std::sync::Arc<dyn object_store::ObjectStore>,
    base: &object_store::path::Path,
    url: &str,
    run_id: Option<&str>,
) -> Result<Streamed> {
    use futures::StreamExt;
    use object_store::ObjectStoreExt as _;
    let ranks = crate::location::ObjectObs::list(store, base, url)?.ranks;
    let rt = titan_storage::runtime();
    Ok(stream(&ranks, run_id, |chunk| {
        let gets = chunk.iter().map(|&rank| {
            let path =
                crate::location::stored_rank_dir(base, rank).join(crate::digest::RANK_SUMMARY_FILE);
            async move {
                let got = async { store.get(&path).await?.bytes().await }.await;
                let mut s = RankSummarised::default();
                match got
                    .map_err(anyhow::Error::from)
                    .and_then(|b| crate::digest::rank_file::decode(&b))
                {
                    Ok(d) => s.digest = d,
                    Err(e) => s.damaged.push((
                        format!("{url}/obs/rank-{rank}/{}", crate::digest::RANK_SUMMARY_FILE),
                        format!("{e:#}"),
                    )),
                }
                (rank, s)
            }
        });
        rt.block_on(
            futures::stream::iter(gets)
                .buffered(RANKS_AT_ONCE)
                .collect(),
        )
    }))
}

/// The spreads and metric lines of `ranks` (in rank order), their summaries read by
/// `read_chunk` [`RANKS_AT_ONCE`] at a time.
fn stream(
    ranks: &[u32],
    run_id: Option<&str>,
    read_chunk: impl Fn(&[u32]) -> Vec<(u32, RankSummarised)>,
) -> Streamed {
    let mut names: Vec<String> = Vec::new();
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut cells: HashMap<(u32, u64), Cell> = HashMap::new();
    let mut out = Streamed::default();
    for chunk in ranks.chunks(RANKS_AT_ONCE) {
        let read = read_chunk(chunk);
        for (rank, s) in read {
            out.damaged.extend(s.damaged);
            out.damaged.extend(s.corrupt);
            let segments = (s.digest.segments.iter())
                .filter(|g| run_id.is_none_or(|id| g.digest.info.run_id == id));
            // A rank's time in a phase at a step, over its segments (one, mostly).
            let mut times: HashMap<(u32, u64), i64> = HashMap::new();
            for g in segments {
                let d = &g.digest;
                let gid: Vec<u32> = (d.names.iter())
                    .map(|n| crate::tables::intern(&mut names, &mut ids, n))
                    .collect();
                for &(step, name, v) in &d.cells {
                    let e = times.entry((gid[name as usize], step)).or_default();
                    *e = e.saturating_add(v);
                }
                for (step, name, reduce, acc) in &d.scalars {
                    let validation = (d.names.get(*name as usize))
                        .is_some_and(|n| crate::metric_lines::is_validation(n));
                    out.metrics
                        .add(*step, validation, gid[*name as usize], *reduce, acc);
                }
            }
            for (key, t) in times {
                if t < 0 {
                    continue;
                }
                let c = cells.entry(key).or_insert_with(|| Cell {
                    min: (t, rank),
                    max: (t, rank),
                    times: StepTimes::default(),
                });
                // Ties: the lowest rank has the minimum, the highest the maximum (ranks come
                // in order), as a sort of (time, rank) would give them.
                if t < c.min.0 {
                    c.min = (t, rank);
                }
                if t >= c.max.0 {
                    c.max = (t, rank);
                }
                c.times.add(t);
            }
        }
    }
    let mut spreads: Vec<(String, u64, Spread)> = cells
        .into_iter()
        .map(|((name, step), c)| {
            let spread = Spread {
                min: c.min.0,
                median: c.times.nearest_rank(0.5),
                max: c.max.0,
                min_rank: c.min.1,
                max_rank: c.max.1,
                ranks: c.times.steps as u32,
                median_start: 0,
            };
            (names[name as usize].clone(), step, spread)
        })
        .collect();
    spreads.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    out.spreads = spreads;
    out.names = names;
    out
}
