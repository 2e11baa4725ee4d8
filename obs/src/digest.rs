//! Per-part summaries ("digests"): what `titan-obs summary` needs from a part, computed once
//! when the part is written and stored next to it as `part-<N>.summary`, so the summary of a
//! day-long job reads kilobytes per part instead of decoding every span.
//!
//! A [`PartDigest`] holds, for the one rank of its part: per phase the count, sum, min, max,
//! smallest depth, time inside steps and a DDSketch of the durations (mergeable; relative
//! error [`SKETCH_ALPHA`]); per (step, phase) the summed duration; per step the time in
//! top-level spans and the step's tags; the spans of tagged steps' own phases; every
//! collective with what the waits analysis needs. [`RunDigest`] merges the digests of a
//! whole run (in rank, part order) and `analysis::summary` computes the same [`Summary`] from
//! it as from the spans.
//!
//! The file (`obs/SCHEMA.md`, "Per-part summaries"): magic, version, the byte length of the
//! part it describes, the body's length and CRC-32C, then the body. A file that does not
//! check out is named and ignored, and its part decoded instead.
//!
//! [`Summary`]: crate::analysis::Summary

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use rustc_hash::FxHashMap;
use sketches_ddsketch::{Config, DDSketch};

use crate::part::CompactedDamage;
use crate::record::NO_STEP;
use crate::run::{NameId, PartData, RankInfo};
use crate::vocab;

/// Relative error of the duration quantiles: a quantile read from the sketches is within
/// 1% of the exact value of the same rank (DDSketch's guarantee, for durations from 1 ns to
/// ~10^17 ns with its 2048 bins).
pub const SKETCH_ALPHA: f64 = 0.01;
const SKETCH_BINS: u32 = 2048;

/// A new, empty duration sketch.
pub fn new_sketch() -> DDSketch {
    DDSketch::new(Config::new(SKETCH_ALPHA, SKETCH_BINS, 1e-9))
}

/// The nearest-rank q-quantile (the smallest value with at least q of the data at or below
/// it, as the exact statistics define it) from a sketch of `n` values, clamped to the exact
/// `[min, max]`.
pub fn sketch_quantile(s: &DDSketch, n: u64, q: f64, min: i64, max: i64) -> i64 {
    if n == 0 {
        return 0;
    }
    let k = crate::analysis::stats::nearest_rank_index(n as usize, q) as u64;
    if k + 1 >= n {
        return max;
    }
    // The sketch reads rank floor(q' * (n - 1)): aim at the middle of rank k.
    let q2 = (k as f64 + 0.5) / (n - 1) as f64;
    let v = s.quantile(q2.min(1.0)).ok().flatten().unwrap_or(0.0);
    (v.round() as i64).clamp(min, max)
}

/// One phase's durations (span name) in a part, or merged over a run.
#[derive(Clone)]
pub struct PhaseDigest {
    pub min_depth: u16,
    pub count: u64,
    pub sum_ns: i64,
    pub min_ns: i64,
    pub max_ns: i64,
    /// Spans inside steps, and their summed duration.
    pub in_step: u64,
    pub in_step_ns: i64,
    pub sketch: DDSketch,
}

impl Default for PhaseDigest {
    fn default() -> Self {
        PhaseDigest {
            min_depth: u16::MAX,
            count: 0,
            sum_ns: 0,
            min_ns: i64::MAX,
            max_ns: i64::MIN,
            in_step: 0,
            in_step_ns: 0,
            sketch: new_sketch(),
        }
    }
}

impl PhaseDigest {
    fn add(&mut self, dur: i64, depth: u16, in_step: bool) {
        self.min_depth = self.min_depth.min(depth);
        self.count += 1;
        self.sum_ns = self.sum_ns.wrapping_add(dur);
        self.min_ns = self.min_ns.min(dur);
        self.max_ns = self.max_ns.max(dur);
        self.sketch.add(dur as f64);
        if in_step {
            self.in_step += 1;
            self.in_step_ns = self.in_step_ns.wrapping_add(dur);
        }
    }

    fn merge(&mut self, o: &PhaseDigest) {
        self.min_depth = self.min_depth.min(o.min_depth);
        self.count += o.count;
        self.sum_ns = self.sum_ns.wrapping_add(o.sum_ns);
        self.min_ns = self.min_ns.min(o.min_ns);
        self.max_ns = self.max_ns.max(o.max_ns);
        self.in_step += o.in_step;
        self.in_step_ns = self.in_step_ns.wrapping_add(o.in_step_ns);
        // Every sketch has the same configuration (checked when read), so this cannot fail.
        let _ = self.sketch.merge(&o.sketch);
    }
}

impl std::fmt::Debug for PhaseDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhaseDigest")
            .field("count", &self.count)
            .field("sum_ns", &self.sum_ns)
            .field("min_ns", &self.min_ns)
            .field("max_ns", &self.max_ns)
            .finish_non_exhaustive()
    }
}

/// One collective span of a part (a call the waits analysis matches across ranks).
#[derive(Debug, Clone)]
pub struct CollectiveDigest {
    pub step: u64,
    pub name: NameId,
    /// On this rank's clock (the reader adds the clock offset).
    pub start_ns: i64,
    /// The non-collective span of the same step that ended last before it started (the
    /// shallowest on a tie), as (end, depth, name); `None` when none in this part.
    pub before: Option<(i64, u16, NameId)>,
    /// The (name, step) of every span of its step in this part that it started inside
    /// (`start <= its start < end`, itself included): its wait is taken out of their time.
    pub containers: Vec<(NameId, u64)>,
}

/// What `summary` needs from one part (one rank); names and tags are part-local ids.
#[derive(Debug, Clone, Default)]
pub struct PartDigest {
    pub info: RankInfo,
    pub damage: Vec<CompactedDamage>,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub rows: u64,
    pub spans: u64,
    pub errors: u64,
    /// Spans that carry a pipeline slot (`microbatch`, `stage`): the pipeline analysis is
    /// not in the summary, so a run with any is analysed from its spans for it.
    pub pipeline_spans: u64,
    /// (name, its durations).
    pub phases: Vec<(NameId, PhaseDigest)>,
    /// (step, name, summed duration) of the spans of each step.
    pub cells: Vec<(u64, NameId, i64)>,
    /// (step, summed duration of its top-level spans).
    pub walls: Vec<(u64, i64)>,
    /// (step, tag bit mask over `tags`).
    pub step_tags: Vec<(u64, u64)>,
    /// (step, name, start, end) of spans named like one of the part's tags or `<tag>_...`
    /// in a step (the candidates for tagged steps' own time), on this rank's clock.
    pub tag_spans: Vec<(u64, NameId, i64, i64)>,
    pub collectives: Vec<CollectiveDigest>,
    /// Per step, the non-collective span that ended last (end, depth, name): where the
    /// next part's first collectives of that step came from.
    pub last_ended: Vec<(u64, i64, u16, NameId)>,
}

impl PartDigest {
    /// The digest of decoded records (decoded with start times, depth and tags).
    pub(crate) fn of_data(d: &PartData) -> PartDigest {
        let s = &d.spans;
        let n = s.rank.len();
        let has_start = s.start_ns.len() == n;
        let has_depth = s.depth.len() == n;
        let depth = |i: usize| if has_depth { s.depth[i] } else { 0 };
        let start = |i: usize| if has_start { s.start_ns[i] } else { 0 };
        let is_coll: Vec<bool> = d
            .names
            .iter()
            .map(|n| vocab::collective::is_collective(n))
            .collect();
        let is_tag_phase: Vec<bool> = d
            .names
            .iter()
            .map(|n| {
                d.tags
                    .iter()
                    .any(|t| crate::analysis::summary::is_tag_phase(n, t))
            })
            .collect();

        let mut phases: BTreeMap<NameId, PhaseDigest> = BTreeMap::new();
        let mut cells: BTreeMap<(u64, NameId), i64> = BTreeMap::new();
        let mut walls: BTreeMap<u64, i64> = BTreeMap::new();
        let mut tag_spans = Vec::new();
        let mut by_step: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for i in 0..n {
            let (name, dur, step) = (s.name[i], s.dur_ns[i], s.step[i]);
            phases
                .entry(name)
                .or_default()
                .add(dur, depth(i), step != NO_STEP);
            if step == NO_STEP {
                continue;
            }
            *cells.entry((step, name)).or_default() += dur;
            if depth(i) == 0 {
                *walls.entry(step).or_default() += dur;
            }
            if is_tag_phase.get(name as usize).copied().unwrap_or(false) {
                tag_spans.push((step, name, start(i), start(i).saturating_add(dur)));
            }
            by_step.entry(step).or_default().push(i);
        }

        let mut collectives = Vec::new();
        let mut last_ended = Vec::new();
        if has_start {
            for (&step, idx) in &by_step {
                let end = |i: usize| s.start_ns[i].saturating_add(s.dur_ns[i]);
                let coll = |i: usize| is_coll.get(s.name[i] as usize).copied().unwrap_or(false);
                if let Some(i) = idx
                    .iter()
                    .copied()
                    .filter(|&i| !coll(i))
                    .max_by_key(|&i| (end(i), std::cmp::Reverse(depth(i))))
                {
                    last_ended.push((step, end(i), depth(i), s.name[i]));
                }
                for &c in idx.iter().filter(|&&i| coll(i)) {
                    let at = s.start_ns[c];
                    let before = idx
                        .iter()
                        .copied()
                        .filter(|&i| !coll(i) && end(i) <= at)
                        .max_by_key(|&i| (end(i), std::cmp::Reverse(depth(i))))
                        .map(|i| (end(i), depth(i), s.name[i]));
                    let containers = idx
                        .iter()
                        .copied()
                        .filter(|&i| s.start_ns[i] <= at && at < end(i))
                        .map(|i| (s.name[i], s.step[i]))
                        .collect();
                    collectives.push(CollectiveDigest {
                        step,
                        name: s.name[c],
                        start_ns: at,
                        before,
                        containers,
                    });
                }
            }
        }
        let mut step_tags: Vec<(u64, u64)> = d.step_tags.iter().map(|(&s, &m)| (s, m)).collect();
        step_tags.sort_unstable();
        PartDigest {
            info: d.info.clone(),
            damage: d.damage.clone(),
            names: d.names.clone(),
            tags: d.tags.clone(),
            rows: d.rows as u64,
            spans: n as u64,
            errors: d.errors.rank.len() as u64,
            pipeline_spans: s.pipeline.iter().filter(|p| p.is_some()).count() as u64,
            phases: phases.into_iter().collect(),
            cells: cells.into_iter().map(|((s, n), v)| (s, n, v)).collect(),
            walls: walls.into_iter().collect(),
            step_tags,
            tag_spans,
            collectives,
            last_ended,
        }
    }

    /// The digest as a [`PartData`] holding no records: what the reader merges into a run
    /// (rank info, damage, step tags, dictionaries) with the digest attached.
    pub(crate) fn into_part_data(self) -> PartData {
        PartData {
            info: self.info.clone(),
            rows: self.rows as usize,
            names: self.names.clone(),
            tags: self.tags.clone(),
            step_tags: self.step_tags.iter().copied().collect(),
            damage: self.damage.clone(),
            digest: Some(Box::new(self)),
            ..Default::default()
        }
    }
}

// ---------------------------------------------------------------------------------------
// The file.

const MAGIC: &[u8; 8] = b"TOBSSUM1";
const VERSION: u32 = 1;
/// magic, version, part length, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 8 + 4;

/// The columns a summary is made of.
pub(crate) const COLUMNS: crate::run::Columns = crate::run::Columns {
    start: true,
    thread: false,
    depth: true,
    links: false,
    tags: true,
    messages: false,
    pipeline: true,
};

/// File name of part `index`'s summary.
pub fn summary_file_name(index: u64) -> String {
    format!("part-{index:06}.summary")
}

/// `part-<N>.summary` next to `part-<N>.parquet`.
pub fn summary_path(part: &Path) -> PathBuf {
    part.with_extension("summary")
}

/// Encodes a digest of a part of `part_len` bytes.
pub fn encode(d: &PartDigest, part_len: u64) -> Result<Vec<u8>> {
    let mut b = Vec::with_capacity(4096);
    let info = serde_json::json!({
        "rank": d.info.rank, "run_id": d.info.run_id, "source": d.info.source,
        "host": d.info.host, "pid": d.info.pid, "local_rank": d.info.local_rank,
        "world_size": d.info.world_size, "clock_offset_ns": d.info.clock_offset_ns,
        "threads": d.info.threads, "run_metadata": d.info.run_metadata,
        "damage": d.damage,
    });
    put_bytes(&mut b, serde_json::to_string(&info)?.as_bytes());
    put_strings(&mut b, &d.names);
    put_strings(&mut b, &d.tags);
    put_u64(&mut b, d.rows);
    put_u64(&mut b, d.spans);
    put_u64(&mut b, d.errors);
    put_u64(&mut b, d.pipeline_spans);
    put_u64(&mut b, d.phases.len() as u64);
    for (name, p) in &d.phases {
        put_u32(&mut b, *name);
        b.extend_from_slice(&p.min_depth.to_le_bytes());
        put_u64(&mut b, p.count);
        for v in [p.sum_ns, p.min_ns, p.max_ns] {
            put_i64(&mut b, v);
        }
        put_u64(&mut b, p.in_step);
        put_i64(&mut b, p.in_step_ns);
        put_bytes(&mut b, &p.sketch.to_java_bytes());
    }
    put_u64(&mut b, d.cells.len() as u64);
    for &(s, n, v) in &d.cells {
        put_u64(&mut b, s);
        put_u32(&mut b, n);
        put_i64(&mut b, v);
    }
    put_u64(&mut b, d.walls.len() as u64);
    for &(s, v) in &d.walls {
        put_u64(&mut b, s);
        put_i64(&mut b, v);
    }
    put_u64(&mut b, d.step_tags.len() as u64);
    for &(s, m) in &d.step_tags {
        put_u64(&mut b, s);
        put_u64(&mut b, m);
    }
    put_u64(&mut b, d.tag_spans.len() as u64);
    for &(s, n, a, e) in &d.tag_spans {
        put_u64(&mut b, s);
        put_u32(&mut b, n);
        put_i64(&mut b, a);
        put_i64(&mut b, e);
    }
    put_u64(&mut b, d.collectives.len() as u64);
    for c in &d.collectives {
        put_u64(&mut b, c.step);
        put_u32(&mut b, c.name);
        put_i64(&mut b, c.start_ns);
        match c.before {
            Some((end, depth, name)) => {
                b.push(1);
                put_i64(&mut b, end);
                b.extend_from_slice(&depth.to_le_bytes());
                put_u32(&mut b, name);
            }
            None => b.push(0),
        }
        put_u64(&mut b, c.containers.len() as u64);
        for &(n, s) in &c.containers {
            put_u32(&mut b, n);
            put_u64(&mut b, s);
        }
    }
    put_u64(&mut b, d.last_ended.len() as u64);
    for &(s, e, dp, n) in &d.last_ended {
        put_u64(&mut b, s);
        put_i64(&mut b, e);
        b.extend_from_slice(&dp.to_le_bytes());
        put_u32(&mut b, n);
    }
    let mut out = Vec::with_capacity(HEADER + b.len());
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, VERSION);
    put_u64(&mut out, part_len);
    put_u64(&mut out, b.len() as u64);
    put_u32(&mut out, crc32c::crc32c(&b));
    out.extend_from_slice(&b);
    Ok(out)
}

/// Decodes a summary file that must describe a part of `part_len` bytes. Every length and
/// id is checked against the bytes there are: a damaged file is an error, never a panic.
pub fn decode(bytes: &[u8], part_len: u64) -> Result<PartDigest> {
    ensure!(bytes.len() >= HEADER, "shorter than its header");
    ensure!(
        &bytes[..8] == MAGIC,
        "not a titan-obs part summary (bad magic)"
    );
    let mut h = Reader(&bytes[8..HEADER]);
    let version = h.u32()?;
    ensure!(
        version == VERSION,
        "summary version {version} (this reader: {VERSION})"
    );
    let described = h.u64()?;
    ensure!(
        described == part_len,
        "it describes a part of {described} bytes, the part has {part_len}"
    );
    let body_len = h.u64()?;
    let crc = h.u32()?;
    let body = &bytes[HEADER..];
    ensure!(
        body.len() as u64 == body_len,
        "body is {} bytes, the header says {body_len}",
        body.len()
    );
    ensure!(crc32c::crc32c(body) == crc, "its checksum does not match");
    let mut r = Reader(body);
    let info: serde_json::Value =
        serde_json::from_slice(r.bytes()?).context("rank info is not JSON")?;
    let field = |k: &str| info.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let num = |k: &str| field(k).as_u64().unwrap_or(0);
    let text = |k: &str| field(k).as_str().unwrap_or_default().to_string();
    let mut d = PartDigest {
        info: RankInfo {
            rank: num("rank") as u32,
            run_id: text("run_id"),
            source: text("source"),
            host: text("host"),
            pid: num("pid") as u32,
            local_rank: num("local_rank") as u32,
            world_size: num("world_size") as u32,
            clock_offset_ns: field("clock_offset_ns").as_i64().unwrap_or(0),
            threads: serde_json::from_value(field("threads")).unwrap_or_default(),
            run_metadata: serde_json::from_value(field("run_metadata")).unwrap_or_default(),
            parts: 1,
        },
        damage: serde_json::from_value(field("damage")).unwrap_or_default(),
        names: r.strings()?,
        tags: r.strings()?,
        rows: r.u64()?,
        spans: r.u64()?,
        errors: r.u64()?,
        pipeline_spans: r.u64()?,
        ..Default::default()
    };
    let names = d.names.len() as u64;
    let name = |r: &mut Reader| -> Result<NameId> {
        let n = r.u32()?;
        ensure!(u64::from(n) < names, "name id {n} out of range");
        Ok(n)
    };
    for _ in 0..r.count(8)? {
        let id = name(&mut r)?;
        let min_depth = r.u16()?;
        let count = r.u64()?;
        let (sum_ns, min_ns, max_ns) = (r.i64()?, r.i64()?, r.i64()?);
        let in_step = r.u64()?;
        let in_step_ns = r.i64()?;
        let sk = r.bytes()?;
        let sketch = crate::guard::guarded(|| DDSketch::from_java_bytes(sk))
            .map_err(|p| anyhow::anyhow!("sketch decoder failed: {p}"))?
            .map_err(|e| anyhow::anyhow!("bad sketch: {e:?}"))?;
        ensure!(
            new_sketch().merge(&sketch).is_ok(),
            "a sketch with another configuration"
        );
        d.phases.push((
            id,
            PhaseDigest {
                min_depth,
                count,
                sum_ns,
                min_ns,
                max_ns,
                in_step,
                in_step_ns,
                sketch,
            },
        ));
    }
    for _ in 0..r.count(20)? {
        let (s, n, v) = (r.u64()?, name(&mut r)?, r.i64()?);
        d.cells.push((s, n, v));
    }
    for _ in 0..r.count(16)? {
        d.walls.push((r.u64()?, r.i64()?));
    }
    for _ in 0..r.count(16)? {
        d.step_tags.push((r.u64()?, r.u64()?));
    }
    for _ in 0..r.count(28)? {
        let (s, n, a, e) = (r.u64()?, name(&mut r)?, r.i64()?, r.i64()?);
        d.tag_spans.push((s, n, a, e));
    }
    for _ in 0..r.count(29)? {
        let (step, cname, start_ns) = (r.u64()?, name(&mut r)?, r.i64()?);
        let before = match r.u8()? {
            0 => None,
            1 => Some((r.i64()?, r.u16()?, name(&mut r)?)),
            t => bail!("bad collective flag {t}"),
        };
        let mut containers = Vec::new();
        for _ in 0..r.count(12)? {
            containers.push((name(&mut r)?, r.u64()?));
        }
        d.collectives.push(CollectiveDigest {
            step,
            name: cname,
            start_ns,
            before,
            containers,
        });
    }
    for _ in 0..r.count(22)? {
        let (s, e, dp, n) = (r.u64()?, r.i64()?, r.u16()?, name(&mut r)?);
        d.last_ended.push((s, e, dp, n));
    }
    ensure!(r.0.is_empty(), "{} bytes after the last section", r.0.len());
    Ok(d)
}

/// Reads `part`'s summary file: `Ok(None)` when there is none, `Err` (naming the file) when
/// it is damaged or does not describe the part.
pub fn read_local(part: &Path, part_len: u64) -> Result<Option<PartDigest>> {
    let path = summary_path(part);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    decode(&bytes, part_len)
        .map(Some)
        .with_context(|| format!("{} is damaged", path.display()))
}

/// Writes `part`'s summary file under a temporary name and renames it into place.
pub fn write_local(part: &Path, part_len: u64, d: &PartDigest) -> Result<()> {
    let path = summary_path(part);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, encode(d, part_len)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_i64(b: &mut Vec<u8>, v: i64) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    put_u64(b, v.len() as u64);
    b.extend_from_slice(v);
}
fn put_strings(b: &mut Vec<u8>, v: &[String]) {
    put_u64(b, v.len() as u64);
    for s in v {
        put_bytes(b, s.as_bytes());
    }
}

/// Bounds-checked little-endian reads.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(
            self.0.len() >= n,
            "cut short ({n} bytes wanted, {} left)",
            self.0.len()
        );
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into()?))
    }
    /// A count of items of at least `min_size` bytes each: never more than the bytes left
    /// could hold (a damaged count must not allocate or loop for ever).
    fn count(&mut self, min_size: usize) -> Result<u64> {
        let n = self.u64()?;
        ensure!(
            n <= (self.0.len() / min_size.max(1)) as u64,
            "count {n} larger than the file could hold"
        );
        Ok(n)
    }
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.count(1)?;
        self.take(n as usize)
    }
    fn strings(&mut self) -> Result<Vec<String>> {
        let n = self.count(8)?;
        (0..n)
            .map(|_| Ok(String::from_utf8(self.bytes()?.to_vec())?))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// Merging a run's digests.

/// One collective of the run, on rank 0's clock, with run-wide name ids.
#[derive(Debug, Clone)]
pub struct RunCollective {
    pub rank: u32,
    pub step: u64,
    pub name: NameId,
    pub start_ns: i64,
    /// The phase the rank came from (see [`CollectiveDigest::before`]); `None` when unknown.
    pub before: Option<NameId>,
    /// Range into [`RunDigest::containers`].
    pub containers: std::ops::Range<u32>,
}

/// Every part's digest of a run merged, with run-wide name ids (those of [`crate::Run::names`]).
#[derive(Debug, Clone, Default)]
pub struct RunDigest {
    /// Parts (or journal reads) merged.
    pub parts: u64,
    pub spans: u64,
    pub errors: u64,
    pub pipeline_spans: u64,
    /// By run-wide name id.
    pub phases: Vec<Option<PhaseDigest>>,
    /// The ranks merged, in the order first seen: rows of `cells` and `walls` are indexed
    /// by position here (not by rank number: a damaged rank number must not size a row).
    pub ranks: Vec<u32>,
    rank_pos: FxHashMap<u32, u32>,
    /// (name, step) -> summed duration per rank position (-1 = not run).
    pub cells: FxHashMap<(NameId, u64), Vec<i64>>,
    /// step -> time in top-level spans per rank position.
    pub walls: FxHashMap<u64, Vec<i64>>,
    /// (step, rank, name, start, end) on rank 0's clock.
    pub tag_spans: Vec<(u64, u32, NameId, i64, i64)>,
    pub collectives: Vec<RunCollective>,
    pub containers: Vec<(NameId, u64)>,
    /// The rank merged last and its latest part's `last_ended` (run-wide names, rank 0's
    /// clock): parts of a rank are merged in order, so a collective without a phase before
    /// it in its own part takes the previous part's.
    prev: Option<(u32, LastEnded)>,
}

/// Per step: (end, depth, name) of the non-collective span that ended last.
type LastEnded = HashMap<u64, (i64, u16, NameId)>;

fn put_rank(v: &mut Vec<i64>, pos: u32, fill: i64) -> &mut i64 {
    let r = pos as usize;
    if v.len() <= r {
        v.resize(r + 1, fill);
    }
    &mut v[r]
}

impl RunDigest {
    /// Adds one part's digest. `name_map` maps its names to run-wide ids; `offset` is added to
    /// its times (its rank's clock offset, or 0).
    pub(crate) fn merge(&mut self, d: &PartDigest, name_map: &[u32], offset: i64) {
        let rank = d.info.rank;
        let g = |n: NameId| name_map.get(n as usize).copied().unwrap_or(0);
        self.parts += 1;
        self.spans += d.spans;
        self.errors += d.errors;
        self.pipeline_spans += d.pipeline_spans;
        for (name, p) in &d.phases {
            let id = g(*name) as usize;
            if self.phases.len() <= id {
                self.phases.resize(id + 1, None);
            }
            self.phases[id]
                .get_or_insert_with(Default::default)
                .merge(p);
        }
        let next = self.ranks.len() as u32;
        let pos = *self.rank_pos.entry(rank).or_insert(next);
        if pos == next {
            self.ranks.push(rank);
        }
        for &(step, name, dur) in &d.cells {
            let row = self.cells.entry((g(name), step)).or_default();
            let c = put_rank(row, pos, -1);
            *c = if *c < 0 { dur } else { c.saturating_add(dur) };
        }
        for &(step, dur) in &d.walls {
            let c = put_rank(self.walls.entry(step).or_default(), pos, 0);
            *c = c.saturating_add(dur);
        }
        for &(step, name, a, e) in &d.tag_spans {
            self.tag_spans.push((
                step,
                rank,
                g(name),
                a.saturating_add(offset),
                e.saturating_add(offset),
            ));
        }
        let prev = match &self.prev {
            Some((r, m)) if *r == rank => Some(m),
            _ => None,
        };
        for c in &d.collectives {
            let at = c.start_ns.saturating_add(offset);
            let before = c.before.map(|(_, _, n)| g(n)).or_else(|| {
                prev.and_then(|m| m.get(&c.step))
                    .filter(|(end, _, _)| *end <= at)
                    .map(|&(_, _, n)| n)
            });
            let from = self.containers.len() as u32;
            self.containers
                .extend(c.containers.iter().map(|&(n, s)| (g(n), s)));
            self.collectives.push(RunCollective {
                rank,
                step: c.step,
                name: g(c.name),
                start_ns: at,
                before,
                containers: from..self.containers.len() as u32,
            });
        }
        let mut last: LastEnded = match self.prev.take() {
            Some((r, m)) if r == rank => m,
            _ => HashMap::new(),
        };
        for &(step, end, depth, name) in &d.last_ended {
            let v = (end.saturating_add(offset), depth, g(name));
            let e = last.entry(step).or_insert(v);
            if (v.0, std::cmp::Reverse(v.1)) > (e.0, std::cmp::Reverse(e.1)) {
                *e = v;
            }
        }
        // Only the latest steps matter to the next part.
        if last.len() > 64 {
            let mut steps: Vec<u64> = last.keys().copied().collect();
            steps.sort_unstable();
            for s in &steps[..steps.len() - 64] {
                last.remove(s);
            }
        }
        self.prev = Some((rank, last));
    }
}
