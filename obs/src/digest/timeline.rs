//! Node timelines (issue 42, `obs/SCHEMA.md` "Node timelines"): `RUN/obs/node-<host>.timeline`
//! holds what the TUI's gantt needs before it reads any part of a node's ranks: per rank its
//! parts with their time ranges and its lanes (thread, depth), and per step its bounds over
//! the node's ranks. Opening a 16 384-rank day then reads 2 048 small files, not 2.4 M part
//! names and the first and last part of every rank.
//!
//! Written by the node rollup's writer ([`super::node::update`], under the node's lock) from
//! the detail levels of the parts each rank put since its last entry ([`PartTimeline`]):
//! the file grows part by part, nothing is rebuilt. Each rank's entry records its folder's
//! mtime, so a reader can tell a rank whose folder changed since and list that folder
//! instead ([`read_local`], [`RankTimeline::describes`]), unless the change is the rank's next
//! journal (a live rank: the TUI's `--follow` reads it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, ensure};

use super::file::{Reader, Writer, check_head, checked_body, framed};
use crate::lod::PartDetail;

const MAGIC: &[u8; 8] = b"TOBSTLN1";
const VERSION: u32 = 1;
/// magic, version, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 4;
const SUFFIX: &str = ".timeline";
/// Tags a step's mask can name (the detail levels' masks are 64 bits too).
const MAX_TAGS: usize = 64;

/// The timeline file of the node whose rollup is `rollup_name` (`node-<host>.summary`).
pub fn file_name(rollup_name: &str) -> String {
    let stem = rollup_name.strip_suffix(".summary").unwrap_or(rollup_name);
    format!("{stem}{SUFFIX}")
}

/// Whether `name` is a timeline file's name.
pub fn is_timeline_name(name: &str) -> bool {
    name.starts_with("node-") && name.ends_with(SUFFIX) && name.len() > 5 + SUFFIX.len()
}

/// A part as a timeline records it: from its detail levels, times on rank 0's clock.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PartTimeline {
    pub index: u64,
    pub run_id: String,
    /// Earliest span start and latest span end.
    pub start_ns: i64,
    pub end_ns: i64,
    pub spans: u64,
    /// (thread, depth) of its rows.
    pub lanes: Vec<(u32, u16)>,
    /// (step, first start, last end, tag names) of its steps.
    pub steps: Vec<(u64, i64, i64, Vec<String>)>,
}

impl PartTimeline {
    /// Part `index` of run `run_id`, from its detail levels.
    pub fn of(index: u64, run_id: &str, d: &PartDetail) -> PartTimeline {
        let off = d.clock_offset_ns;
        let tags_of = |step: u64| -> Vec<String> {
            let mask = d
                .step_tags
                .binary_search_by_key(&step, |t| t.0)
                .map_or(0, |i| d.step_tags[i].1);
            (0..d.tags.len().min(MAX_TAGS))
                .filter(|&b| mask & (1 << b) != 0)
                .map(|b| d.tags[b].clone())
                .collect()
        };
        PartTimeline {
            index,
            run_id: run_id.to_string(),
            start_ns: d.start_ns.saturating_add(off),
            end_ns: d.end_ns.saturating_add(off),
            spans: d.rows.iter().map(|r| r.spans).fold(0, u64::saturating_add),
            lanes: d.rows.iter().map(|r| (r.thread, r.depth)).collect(),
            steps: d
                .steps
                .iter()
                .map(|&(s, a, z)| (s, a.saturating_add(off), z.saturating_add(off), tags_of(s)))
                .collect(),
        }
    }
}

/// One part of a rank: its index and time range (rank 0's clock).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PartRange {
    pub index: u64,
    pub start_ns: i64,
    pub end_ns: i64,
}

/// One rank of a node's timeline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankTimeline {
    pub rank: u32,
    /// Its folder's mtime after the writer's last change to it (see [`super::node::Entry`]).
    pub dir_mtime_ns: u64,
    /// The run of its parts (the first recorded).
    pub run_id: String,
    /// Some part is of another run: a reader lists the folder instead.
    pub mixed_runs: bool,
    pub spans: u64,
    /// (thread, depth), sorted.
    pub lanes: Vec<(u32, u16)>,
    /// By index.
    pub parts: Vec<PartRange>,
}

impl RankTimeline {
    /// The last part recorded.
    pub fn last_part(&self) -> Option<u64> {
        self.parts.last().map(|p| p.index)
    }

    /// Whether this entry describes the rank folder `dir` as it is: its parts run from
    /// `part-0`, are of one run, and the folder is as recorded (a live rank's included:
    /// [`super::node::recorded_folder`]).
    pub fn describes(&self, dir: &Path) -> bool {
        self.may_describe()
            && super::node::recorded_folder(dir, self.dir_mtime_ns, self.last_part()).is_some()
    }

    /// Whether this entry can describe a rank folder: its parts run from `part-0` and are of
    /// one run. The reader then checks the folder: a local one is as recorded
    /// ([`Self::describes`]), an object store's holds no part after the last
    /// ([`crate::location::ObjectObs::next_parts_absent`]).
    pub fn may_describe(&self) -> bool {
        self.last_part().is_some() && !self.mixed_runs && self.contiguous()
    }

    /// Whether its parts are `part-0` up to the last with none missing: what a rank folder
    /// written by one sink (or by one after another, each recording its parts) holds. A
    /// rank whose earlier parts were never recorded (a timeline started mid-run) is not.
    pub fn contiguous(&self) -> bool {
        self.parts
            .iter()
            .enumerate()
            .all(|(i, p)| p.index == i as u64)
    }
}

/// A node's timeline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeTimeline {
    /// The tag names steps' masks refer to.
    pub tags: Vec<String>,
    /// By rank.
    pub ranks: Vec<RankTimeline>,
    /// Step -> (first start, last end) over the node's ranks, and tag mask over `tags`.
    pub steps: BTreeMap<u64, (i64, i64, u64)>,
}

impl NodeTimeline {
    /// Records rank `rank`'s parts `added` (in index order; a part already recorded is
    /// replaced) and its folder's mtime.
    pub fn add(&mut self, rank: u32, dir_mtime_ns: u64, added: &[PartTimeline]) {
        let at = match self.ranks.binary_search_by_key(&rank, |r| r.rank) {
            Ok(i) => i,
            Err(i) => {
                self.ranks.insert(
                    i,
                    RankTimeline {
                        rank,
                        ..Default::default()
                    },
                );
                i
            }
        };
        let r = &mut self.ranks[at];
        r.dir_mtime_ns = dir_mtime_ns;
        let mut lanes: BTreeSet<(u32, u16)> = r.lanes.iter().copied().collect();
        for p in added {
            if r.run_id.is_empty() && r.parts.is_empty() {
                r.run_id.clone_from(&p.run_id);
            } else if p.run_id != r.run_id {
                r.mixed_runs = true;
            }
            r.spans = r.spans.saturating_add(p.spans);
            lanes.extend(p.lanes.iter().copied());
            let range = PartRange {
                index: p.index,
                start_ns: p.start_ns,
                end_ns: p.end_ns,
            };
            match r.parts.binary_search_by_key(&p.index, |q| q.index) {
                Ok(i) => r.parts[i] = range,
                Err(i) => r.parts.insert(i, range),
            }
            for (step, a, z, tags) in &p.steps {
                let mut mask = 0u64;
                for t in tags {
                    let id = match self.tags.iter().position(|x| x == t) {
                        Some(i) => i,
                        None => {
                            self.tags.push(t.clone());
                            self.tags.len() - 1
                        }
                    };
                    if id < MAX_TAGS {
                        mask |= 1 << id;
                    }
                }
                let e = self.steps.entry(*step).or_insert((*a, *z, 0));
                *e = (e.0.min(*a), e.1.max(*z), e.2 | mask);
            }
        }
        r.lanes = lanes.into_iter().collect();
    }

    /// Folds in another node's timeline (ranks not in both). Its ranks are appended, not
    /// sorted in: [`read_local`] sorts once, after the job's 2 048 files.
    pub fn merge(&mut self, mut o: NodeTimeline) {
        let ids: Vec<u32> = o
            .tags
            .iter()
            .map(|t| match self.tags.iter().position(|x| x == t) {
                Some(i) => i as u32,
                None => {
                    self.tags.push(t.clone());
                    (self.tags.len() - 1) as u32
                }
            })
            .collect();
        for (&step, &(a, z, m)) in &o.steps {
            let mask = (0..ids.len().min(MAX_TAGS))
                .filter(|&b| m & (1 << b) != 0 && (ids[b] as usize) < MAX_TAGS)
                .fold(0u64, |acc, b| acc | 1 << ids[b]);
            let e = self.steps.entry(step).or_insert((a, z, 0));
            *e = (e.0.min(a), e.1.max(z), e.2 | mask);
        }
        self.ranks.append(&mut o.ranks);
    }
}

/// Encodes a timeline: times as differences from the previous one (a part's start from the
/// previous part's end, its end from its start), so a day's 2 880 steps of 8 ranks take
/// tens of kB.
pub fn encode(t: &NodeTimeline) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(
        64 + t.steps.len() * 12
            + t.ranks
                .iter()
                .map(|r| 32 + r.parts.len() * 12)
                .sum::<usize>(),
    ));
    w.strings(&t.tags);
    w.u(t.ranks.len() as u64);
    for r in &t.ranks {
        w.u(u64::from(r.rank));
        w.u(r.dir_mtime_ns);
        w.bytes(r.run_id.as_bytes());
        w.u(u64::from(r.mixed_runs));
        w.u(r.spans);
        w.u(r.lanes.len() as u64);
        for &(thread, depth) in &r.lanes {
            w.u(u64::from(thread));
            w.u(u64::from(depth));
        }
        w.u(r.parts.len() as u64);
        let (mut index, mut end) = (0u64, 0i64);
        for p in &r.parts {
            w.u(p.index.wrapping_sub(index));
            w.i(p.start_ns.wrapping_sub(end));
            w.i(p.end_ns.wrapping_sub(p.start_ns));
            (index, end) = (p.index, p.end_ns);
        }
    }
    w.u(t.steps.len() as u64);
    let (mut prev, mut start) = (0u64, 0i64);
    for (&step, &(a, z, mask)) in &t.steps {
        w.u(step.wrapping_sub(prev));
        w.i(a.wrapping_sub(start));
        w.i(z.wrapping_sub(a));
        w.u(mask);
        (prev, start) = (step, a);
    }
    framed(MAGIC, VERSION, &w.0)
}

/// Decodes a timeline: every count checked against the bytes there are, ranks and parts in
/// order, each part's end at or after its start.
pub fn decode(bytes: &[u8]) -> Result<NodeTimeline> {
    check_head(bytes, MAGIC, "node timeline", HEADER, VERSION)?;
    let mut r = Reader(checked_body(bytes, HEADER, 12)?);
    let tags = r.strings()?;
    let mut ranks: Vec<RankTimeline> = Vec::new();
    for _ in 0..r.count(8)? {
        let rank = u32::try_from(r.u()?).context("rank out of range")?;
        ensure!(
            ranks.last().is_none_or(|l| rank > l.rank),
            "rank {rank} listed out of order"
        );
        let dir_mtime_ns = r.u()?;
        let run_id = String::from_utf8(r.bytes()?.to_vec()).context("run id")?;
        let mixed_runs = r.u()? != 0;
        let spans = r.u()?;
        let lanes = (0..r.count(2)?)
            .map(|_| {
                let thread = u32::try_from(r.u()?).context("thread out of range")?;
                let depth = u16::try_from(r.u()?).context("depth out of range")?;
                Ok((thread, depth))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut parts: Vec<PartRange> = Vec::new();
        let (mut index, mut end) = (0u64, 0i64);
        for n in 0..r.count(3)? {
            let gap = r.u()?;
            ensure!(n == 0 || gap > 0, "rank {rank}: parts out of order");
            index = index.checked_add(gap).context("part index out of range")?;
            let start_ns = end.wrapping_add(r.i()?);
            let len = r.i()?;
            ensure!(len >= 0, "rank {rank}: part {index} ends before it starts");
            end = start_ns.checked_add(len).context("part end out of range")?;
            parts.push(PartRange {
                index,
                start_ns,
                end_ns: end,
            });
        }
        ranks.push(RankTimeline {
            rank,
            dir_mtime_ns,
            run_id,
            mixed_runs,
            spans,
            lanes,
            parts,
        });
    }
    let mut steps = BTreeMap::new();
    let (mut step, mut start) = (0u64, 0i64);
    for n in 0..r.count(4)? {
        let d = r.u()?;
        ensure!(n == 0 || d > 0, "steps out of order");
        step = step.checked_add(d).context("step out of range")?;
        start = start.wrapping_add(r.i()?);
        let len = r.i()?;
        ensure!(len >= 0, "step {step} ends before it starts");
        let end = start.checked_add(len).context("step end out of range")?;
        steps.insert(step, (start, end, r.u()?));
    }
    ensure!(r.0.is_empty(), "{} bytes after the last step", r.0.len());
    Ok(NodeTimeline { tags, ranks, steps })
}

/// Adds rank `rank`'s parts `added` and its folder's mtime to the timeline `obs/<name>`,
/// under the node rollup's lock. A missing or damaged file is started anew: the parts the
/// node's ranks put before are then in no timeline, and a reader, finding a rank whose parts
/// do not run from `part-0`, lists that rank's folder instead.
pub fn update(
    obs: &Path,
    name: &str,
    rank: u32,
    dir_mtime_ns: u64,
    added: &[PartTimeline],
) -> Result<()> {
    let path = obs.join(name);
    let mut t = match crate::sidecar::read_if_present(&path)? {
        None => NodeTimeline::default(),
        Some(b) => decode(&b).unwrap_or_else(|e| {
            tracing::warn!("{} is damaged ({e:#}): rewriting it", path.display());
            NodeTimeline::default()
        }),
    };
    t.add(rank, dir_mtime_ns, added);
    crate::sidecar::write_atomic_as(&path, &encode(&t), rank)
}

/// A run's node timelines, merged, and its rank folders with whether they describe them.
#[derive(Debug, Default)]
pub struct JobTimeline {
    pub timeline: NodeTimeline,
    /// Every rank folder of `obs/`, by rank, and whether its entry describes it: the entry
    /// [`RankTimeline::may_describe`] and the folder is as it recorded (a local folder:
    /// [`RankTimeline::describes`]; an object store's: no part after the last).
    pub ranks: Vec<(u32, bool)>,
    /// Timeline files that could not be read, with why (their ranks are read from their
    /// folders).
    pub damaged: Vec<String>,
}

/// The run at `location`'s node timelines ([`read_local`], [`read_object`]).
pub fn read(location: &crate::location::Location) -> Result<JobTimeline> {
    match location {
        crate::location::Location::Local(run) => read_local(&run.join("obs")),
        crate::location::Location::Object { url, store, base } => read_object(store, base, url),
    }
}

/// The files' timelines merged (`read`: each file's, or why it could not be read), ranks in
/// order; a rank in two files is kept from neither (its host changed between launches: its
/// folder is read instead).
fn merged(
    read: impl IntoIterator<Item = (String, Result<NodeTimeline>)>,
) -> (NodeTimeline, Vec<String>) {
    let mut timeline = NodeTimeline::default();
    let mut damaged = Vec::new();
    for (shown, t) in read {
        match t {
            Ok(t) => timeline.merge(t),
            Err(e) => damaged.push(format!("{shown}: {e:#}")),
        }
    }
    timeline.ranks.sort_unstable_by_key(|r| r.rank);
    let twice: BTreeSet<u32> = (timeline.ranks.windows(2))
        .filter(|w| w[0].rank == w[1].rank)
        .map(|w| w[0].rank)
        .collect();
    timeline.ranks.retain(|r| !twice.contains(&r.rank));
    (timeline, damaged)
}

/// Reads every node timeline of the local run whose `obs` folder is `obs` (in parallel) and
/// lists its rank folders.
pub fn read_local(obs: &Path) -> Result<JobTimeline> {
    use rayon::prelude::*;
    let listed = crate::location::ObsFolder::list(obs)?;
    let read: Vec<(String, Result<NodeTimeline>)> = listed
        .files_named(is_timeline_name)
        .par_iter()
        .map(|path| {
            let t = std::fs::read(path)
                .map_err(anyhow::Error::from)
                .and_then(|b| decode(&b));
            (path.display().to_string(), t)
        })
        .collect();
    let (timeline, damaged) = merged(read);
    let entries: std::collections::HashMap<u32, &RankTimeline> =
        timeline.ranks.iter().map(|r| (r.rank, r)).collect();
    let ranks = (listed.rank_dirs.par_iter())
        .map(|(rank, dir)| (*rank, entries.get(rank).is_some_and(|e| e.describes(dir))))
        .collect();
    Ok(JobTimeline {
        timeline,
        ranks,
        damaged,
    })
}

/// Timeline objects read at once.
const OBJECTS_AT_ONCE: usize = 16;

/// Reads every node timeline of the object-store run at `base` (`url` for messages): `obs/`
/// listed with a delimiter, each `node-<host>.timeline` read, and the ranks they may describe
/// checked (a HEAD each).
pub fn read_object(
    store: &std::sync::Arc<dyn object_store::ObjectStore>,
    base: &object_store::path::Path,
    url: &str,
) -> Result<JobTimeline> {
    use futures::StreamExt;
    use object_store::ObjectStoreExt as _;
    let listed = crate::location::ObjectObs::list(store, base, url)?;
    let files = listed.files_named(is_timeline_name);
    let rt = titan_storage::runtime();
    let read: Vec<(String, Result<NodeTimeline>)> = rt.block_on(
        futures::stream::iter(files.into_iter().map(|path| async move {
            let got = async { store.get(&path).await?.bytes().await }.await;
            let t = got.map_err(anyhow::Error::from).and_then(|b| decode(&b));
            (format!("{url}/obs/{}", path.filename().unwrap_or("")), t)
        }))
        .buffer_unordered(OBJECTS_AT_ONCE)
        .collect(),
    );
    let (timeline, damaged) = merged(read);
    let folders: BTreeSet<u32> = listed.ranks.iter().copied().collect();
    let candidates: Vec<(u32, Option<u64>)> = (timeline.ranks.iter())
        .filter(|r| folders.contains(&r.rank) && r.may_describe())
        .map(|r| (r.rank, r.last_part()))
        .collect();
    let absent = rt.block_on(crate::location::ObjectObs::next_parts_absent(
        store,
        base,
        &candidates,
    ));
    let described: BTreeSet<u32> = (candidates.iter().zip(absent))
        .filter(|(_, a)| *a)
        .map(|((r, _), _)| *r)
        .collect();
    Ok(JobTimeline {
        timeline,
        ranks: (listed.ranks.iter())
            .map(|&r| (r, described.contains(&r)))
            .collect(),
        damaged,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(index: u64, run: &str, start: i64, steps: &[(u64, i64, i64, &[&str])]) -> PartTimeline {
        PartTimeline {
            index,
            run_id: run.into(),
            start_ns: start,
            end_ns: start + 100,
            spans: 3,
            lanes: vec![(0, 1), (0, 2)],
            steps: steps
                .iter()
                .map(|&(s, a, z, t)| (s, a, z, t.iter().map(|x| x.to_string()).collect()))
                .collect(),
        }
    }

    fn sample() -> NodeTimeline {
        let mut t = NodeTimeline::default();
        t.add(
            3,
            7,
            &[
                part(0, "r", 1_750_000_000_000_000_000, &[(0, 5, 50, &[])]),
                part(1, "r", 1_750_000_000_000_000_100, &[(1, 60, 90, &["eval"])]),
            ],
        );
        t.add(1, 9, &[part(0, "r", -40, &[(0, 2, 40, &["ckpt", "eval"])])]);
        t
    }

    #[test]
    fn round_trips_and_merges_steps_over_ranks() {
        let t = sample();
        assert_eq!(t.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(t.steps[&0], (2, 50, 0b11));
        assert_eq!(t.tags, ["eval", "ckpt"]);
        assert_eq!(decode(&encode(&t)).unwrap(), t);
        let r = &t.ranks[1];
        assert!(r.contiguous() && !r.mixed_runs);
        assert_eq!((r.spans, r.last_part()), (6, Some(1)));
    }

    #[test]
    fn a_part_of_another_run_or_a_gap_is_marked() {
        let mut t = sample();
        t.add(3, 8, &[part(3, "other", 500, &[])]);
        let r = &t.ranks[1];
        assert!(r.mixed_runs && !r.contiguous());
    }

    #[test]
    fn merges_nodes_with_their_own_tag_ids() {
        let mut a = NodeTimeline::default();
        a.add(0, 1, &[part(0, "r", 0, &[(4, 10, 20, &["x"])])]);
        let mut b = NodeTimeline::default();
        b.add(
            8,
            1,
            &[part(0, "r", 0, &[(4, 5, 30, &["y"]), (5, 40, 50, &["x"])])],
        );
        a.merge(b);
        assert_eq!(a.tags, ["x", "y"]);
        assert_eq!(a.steps[&4], (5, 30, 0b11));
        assert_eq!(a.steps[&5], (40, 50, 0b1));
        assert_eq!(a.ranks.len(), 2);
    }

    #[test]
    fn refuses_every_damaged_byte() {
        let bytes = encode(&sample());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x41;
            assert!(decode(&b).is_err(), "byte {i} flipped was accepted");
        }
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "cut at {n} was accepted");
        }
    }
}
