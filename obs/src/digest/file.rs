//! The summary file (`obs/SCHEMA.md`, "Per-part summaries"): magic, version, the byte length of
//! the part it describes, the body's length and CRC-32C, then the body. Numbers in the body
//! are LEB128 varints (signed ones zigzag-coded), steps and times as deltas from the previous
//! entry: a summary is read for every part of a run, so its size is the summary's I/O.
//!
//! A file that does not check out is an error naming what is wrong (never a panic); one of an
//! older version is [`Outdated`], which the reader rebuilds from its part like a missing one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use sketches_ddsketch::DDSketch;

use super::{
    CollectiveDigest, PartDigest, PhaseDigest, PipelineDigest, PipelineStep, sketch_config_ok,
};
use crate::metric_lines::Acc;
use crate::schema::{Reduce, meta};
use crate::tables::{NameId, RankInfo};

const MAGIC: &[u8; 8] = b"TOBSSUM1";
/// 2: varint body, collectives' containers without their (own) step, the pipeline and
/// scalar sections.
// 3: step times and `% step` count the main thread only (issue 39); phases carry their
// time on other threads apart.
const VERSION: u32 = 3;
/// magic, version, part length, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 8 + 4;

/// A summary file written by an older version: not damage, just to be rebuilt.
#[derive(Debug)]
pub struct Outdated(pub u32);

impl std::fmt::Display for Outdated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "summary version {} (this reader: {VERSION})", self.0)
    }
}

impl std::error::Error for Outdated {}

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
    let mut w = Writer(Vec::with_capacity(2048));
    let info = serde_json::json!({
        "rank": d.info.rank, "run_id": d.info.run_id, "source": d.info.source,
        "host": d.info.host, "pid": d.info.pid, "local_rank": d.info.local_rank,
        "world_size": d.info.world_size, "clock_offset_ns": d.info.clock_offset_ns,
        "threads": d.info.threads, "run_metadata": d.info.run_metadata,
        "damage": d.damage,
    });
    w.bytes(serde_json::to_string(&info)?.as_bytes());
    w.strings(&d.names);
    w.strings(&d.tags);
    for v in [d.rows, d.spans, d.errors, d.pipeline_spans] {
        w.u(v);
    }
    w.phases(&d.phases);
    w.u(d.cells.len() as u64);
    let mut prev = 0u64;
    for &(s, n, v) in &d.cells {
        w.step(&mut prev, s);
        w.u(u64::from(n));
        w.i(v);
    }
    w.u(d.walls.len() as u64);
    let mut prev = 0u64;
    for &(s, v) in &d.walls {
        w.step(&mut prev, s);
        w.i(v);
    }
    w.u(d.step_tags.len() as u64);
    let mut prev = 0u64;
    for &(s, m) in &d.step_tags {
        w.step(&mut prev, s);
        w.u(m);
    }
    w.u(d.tag_spans.len() as u64);
    for &(s, n, a, e) in &d.tag_spans {
        w.u(s);
        w.u(u64::from(n));
        w.i(a);
        w.i(e.wrapping_sub(a));
    }
    w.u(d.collectives.len() as u64);
    let (mut prev, mut at) = (0u64, 0i64);
    for c in &d.collectives {
        w.step(&mut prev, c.step);
        w.u(u64::from(c.name));
        w.i(c.start_ns.wrapping_sub(at));
        at = c.start_ns;
        match c.before {
            Some((end, depth, name)) => {
                w.u(1);
                w.i(c.start_ns.wrapping_sub(end));
                w.u(u64::from(depth));
                w.u(u64::from(name));
            }
            None => w.u(0),
        }
        w.u(c.containers.len() as u64);
        for &n in &c.containers {
            w.u(u64::from(n));
        }
    }
    w.u(d.last_ended.len() as u64);
    for &(s, e, dp, n) in &d.last_ended {
        w.u(s);
        w.i(e);
        w.u(u64::from(dp));
        w.u(u64::from(n));
    }
    match &d.pipeline {
        None => w.u(0),
        Some(p) => {
            w.u(1);
            w.u(p.stages.len() as u64);
            for &s in &p.stages {
                w.u(u64::from(s));
            }
            w.u(u64::from(p.microbatches));
            w.phase(&p.forward);
            w.phase(&p.backward);
            w.u(p.steps.len() as u64);
            let mut prev = 0u64;
            for s in &p.steps {
                w.step(&mut prev, s.step);
                for v in [s.window, s.profiler_step, s.busy, s.recv] {
                    w.i(v);
                }
            }
        }
    }
    w.u(d.scalars.len() as u64);
    let mut prev = 0u64;
    for (step, name, reduce, acc) in &d.scalars {
        w.step(&mut prev, *step);
        w.u(u64::from(*name));
        w.u(reduce_code(*reduce));
        w.u(acc.count);
        for v in [acc.sum, acc.min, acc.max] {
            w.0.extend_from_slice(&v.to_le_bytes());
        }
    }
    w.u(d.named_errors.len() as u64);
    for (step, name, message) in &d.named_errors {
        w.u(*step);
        w.u(u64::from(*name));
        w.bytes(message.as_bytes());
    }
    let body = w.0;
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&part_len.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a summary file that must describe a part of `part_len` bytes. Every length and
/// id is checked against the bytes there are: a damaged file is an error, never a panic; a
/// file of another version is an [`Outdated`] error.
pub fn decode(bytes: &[u8], part_len: u64) -> Result<PartDigest> {
    check_head(bytes, MAGIC, "part summary", HEADER, VERSION)?;
    let described = le(bytes, 12..20);
    ensure!(
        described == part_len,
        "it describes a part of {described} bytes, the part has {part_len}"
    );
    let body = checked_body(bytes, HEADER, 20)?;
    let mut r = Reader(body);
    let info: serde_json::Value =
        serde_json::from_slice(r.bytes()?).context("rank info is not JSON")?;
    let field = |k: &str| info.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let num = |k: &str| field(k).as_u64().unwrap_or(0);
    let text = |k: &str| field(k).as_str().unwrap_or_default().to_string();
    let mut d = PartDigest {
        info: RankInfo {
            header: crate::footer::PartHeader {
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
            },
            parts: 1,
        },
        damage: serde_json::from_value(field("damage")).unwrap_or_default(),
        names: r.strings()?,
        tags: r.strings()?,
        rows: r.u()?,
        spans: r.u()?,
        errors: r.u()?,
        pipeline_spans: r.u()?,
        ..Default::default()
    };
    let names = d.names.len() as u64;
    let name = |r: &mut Reader| -> Result<NameId> {
        let n = r.u()?;
        ensure!(n < names, "name id {n} out of range");
        Ok(n as NameId)
    };
    for _ in 0..r.count(10)? {
        let id = name(&mut r)?;
        d.phases.push((id, r.phase()?));
    }
    let mut prev = 0u64;
    for _ in 0..r.count(3)? {
        let (s, n, v) = (r.step(&mut prev)?, name(&mut r)?, r.i()?);
        d.cells.push((s, n, v));
    }
    let mut prev = 0u64;
    for _ in 0..r.count(2)? {
        d.walls.push((r.step(&mut prev)?, r.i()?));
    }
    let mut prev = 0u64;
    for _ in 0..r.count(2)? {
        d.step_tags.push((r.step(&mut prev)?, r.u()?));
    }
    for _ in 0..r.count(4)? {
        let (s, n, a) = (r.u()?, name(&mut r)?, r.i()?);
        let e = a.wrapping_add(r.i()?);
        d.tag_spans.push((s, n, a, e));
    }
    let (mut prev, mut at) = (0u64, 0i64);
    for _ in 0..r.count(5)? {
        let (step, cname) = (r.step(&mut prev)?, name(&mut r)?);
        at = at.wrapping_add(r.i()?);
        let before = match r.u()? {
            0 => None,
            1 => {
                let end = at.wrapping_sub(r.i()?);
                let depth = r.u16()?;
                Some((end, depth, name(&mut r)?))
            }
            t => bail!("bad collective flag {t}"),
        };
        let mut containers = Vec::new();
        for _ in 0..r.count(1)? {
            containers.push(name(&mut r)?);
        }
        d.collectives.push(CollectiveDigest {
            step,
            name: cname,
            start_ns: at,
            before,
            containers,
        });
    }
    for _ in 0..r.count(4)? {
        let (s, e, dp, n) = (r.u()?, r.i()?, r.u16()?, name(&mut r)?);
        d.last_ended.push((s, e, dp, n));
    }
    d.pipeline = match r.u()? {
        0 => None,
        1 => {
            let mut stages = Vec::new();
            for _ in 0..r.count(1)? {
                stages.push(r.u16()?);
            }
            let microbatches = u32::try_from(r.u()?).context("microbatches out of range")?;
            let (forward, backward) = (r.phase()?, r.phase()?);
            let mut steps = Vec::new();
            let mut prev = 0u64;
            for _ in 0..r.count(5)? {
                steps.push(PipelineStep {
                    step: r.step(&mut prev)?,
                    window: r.i()?,
                    profiler_step: r.i()?,
                    busy: r.i()?,
                    recv: r.i()?,
                });
            }
            Some(PipelineDigest {
                stages,
                microbatches,
                forward,
                backward,
                steps,
            })
        }
        t => bail!("bad pipeline flag {t}"),
    };
    let mut prev = 0u64;
    for _ in 0..r.count(28)? {
        let (step, n) = (r.step(&mut prev)?, name(&mut r)?);
        let reduce = match r.u()? {
            0 => Reduce::Mean,
            1 => Reduce::Sum,
            2 => Reduce::Min,
            3 => Reduce::Max,
            c => bail!("bad reduce code {c}"),
        };
        let count = r.u()?;
        let acc = Acc {
            count,
            sum: r.f64()?,
            min: r.f64()?,
            max: r.f64()?,
        };
        d.scalars.push((step, n, reduce, acc));
    }
    for _ in 0..r.count(3)? {
        let (step, n) = (r.u()?, name(&mut r)?);
        let message = String::from_utf8_lossy(r.bytes()?).into_owned();
        d.named_errors.push((step, n, message));
    }
    ensure!(r.0.is_empty(), "{} bytes after the last section", r.0.len());
    Ok(d)
}

/// Checks a summary file's length, magic (`what` it is) and version (another version is
/// [`Outdated`]).
pub(super) fn check_head(
    bytes: &[u8],
    magic: &[u8; 8],
    what: &str,
    header: usize,
    version: u32,
) -> Result<()> {
    ensure!(bytes.len() >= header, "shorter than its header");
    ensure!(&bytes[..8] == magic, "not a titan-obs {what} (bad magic)");
    let v = le(bytes, 8..12) as u32;
    if v != version {
        return Err(Outdated(v).into());
    }
    Ok(())
}

/// The little-endian number in `bytes[r]` (within a header already checked to be there).
pub(super) fn le(bytes: &[u8], r: std::ops::Range<usize>) -> u64 {
    bytes[r]
        .iter()
        .rev()
        .fold(0u64, |a, &b| (a << 8) | u64::from(b))
}

/// `magic`, `version` (u32 LE), the body's length (u64 LE) and CRC-32C (u32 LE), then `body`:
/// the framing [`check_head`] and [`checked_body`] read back (`len_at` 12).
pub(super) fn framed(magic: &[u8; 8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 4 + 8 + 4 + body.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The body after a header of `header` bytes, checked against the body length (u64 LE at
/// `len_at`) and CRC-32C (u32 LE after it) the header gives.
pub(super) fn checked_body(bytes: &[u8], header: usize, len_at: usize) -> Result<&[u8]> {
    let body_len = le(bytes, len_at..len_at + 8);
    let crc = le(bytes, len_at + 8..len_at + 12) as u32;
    let body = &bytes[header..];
    ensure!(
        body.len() as u64 == body_len,
        "body is {} bytes, the header says {body_len}",
        body.len()
    );
    ensure!(crc32c::crc32c(body) == crc, "its checksum does not match");
    Ok(body)
}

/// The summary embedded in a part footer's key-values (issue 42, see `embedded.rs`):
/// `Ok(None)` when it has none (a part written before them) or one of an older version
/// (rebuilt from the part, as a missing one); `Err` when it is damaged.
pub fn from_footer(kv: &HashMap<String, String>) -> Result<Option<PartDigest>> {
    let Some(bytes) = crate::footer::embedded(kv, meta::SUMMARY)? else {
        return Ok(None);
    };
    match decode(&bytes, 0) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.is::<Outdated>() => Ok(None),
        Err(e) => Err(e.context(format!("its footer's `{}`", meta::SUMMARY))),
    }
}

/// Reads `part`'s summary file: `Ok(None)` when there is none, or one of an older version
/// (the part is then summarised and the summary rewritten); `Err` (naming the file) when it
/// is damaged or does not describe the part.
///
/// A part without a summary file beside it has its summary in its footer (issue 42): read
/// from the end of the part. A part whose footer cannot be read counts as having none (it is
/// then decoded, and named corrupt if that fails too).
pub fn read_local(part: &Path, part_len: u64) -> Result<Option<PartDigest>> {
    let path = summary_path(part);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let file = crate::part_files::PartFile::local(part.to_path_buf(), 0);
            let Ok(kv) = file.footer_kv() else {
                return Ok(None);
            };
            return from_footer(&kv)
                .with_context(|| format!("the summary in {} is damaged", part.display()));
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    match decode(&bytes, part_len) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.is::<Outdated>() => Ok(None),
        Err(e) => Err(e.context(format!("{} is damaged", path.display()))),
    }
}

/// Where `part`'s summary is, for messages: its summary file when there is one, else the
/// part (whose footer holds it).
pub fn summary_shown(part: &Path) -> String {
    let beside = summary_path(part);
    if beside.exists() {
        beside.display().to_string()
    } else {
        part.display().to_string()
    }
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

fn reduce_code(r: Reduce) -> u64 {
    match r {
        Reduce::Mean => 0,
        Reduce::Sum => 1,
        Reduce::Min => 2,
        Reduce::Max => 3,
    }
}

/// Varint writes.
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn u(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    pub(super) fn i(&mut self, v: i64) {
        self.u(((v << 1) ^ (v >> 63)) as u64);
    }
    /// A step as the difference from the previous one (steps are written in order; one out
    /// of order still round-trips, as a wrapped difference).
    fn step(&mut self, prev: &mut u64, s: u64) {
        self.u(s.wrapping_sub(*prev));
        *prev = s;
    }
    pub(super) fn bytes(&mut self, v: &[u8]) {
        self.u(v.len() as u64);
        self.0.extend_from_slice(v);
    }
    pub(super) fn strings(&mut self, v: &[String]) {
        self.u(v.len() as u64);
        for s in v {
            self.bytes(s.as_bytes());
        }
    }
    /// A list of (name id, phase summary): the count, then each.
    pub(super) fn phases(&mut self, phases: &[(NameId, PhaseDigest)]) {
        self.u(phases.len() as u64);
        for (name, p) in phases {
            self.u(u64::from(*name));
            self.phase(p);
        }
    }
    pub(super) fn phase(&mut self, p: &PhaseDigest) {
        self.u(u64::from(p.min_depth));
        self.u(p.count);
        for v in [p.sum_ns, p.min_ns, p.max_ns] {
            self.i(v);
        }
        self.u(p.in_step);
        self.u(p.in_step_main);
        self.i(p.in_step_ns);
        self.u(p.concurrent);
        self.i(p.concurrent_ns);
        self.u(u64::from(p.main_depth));
        self.u(u64::from(p.concurrent_depth));
        self.bytes(&p.sketch.to_java_bytes());
    }
}

/// Bounds-checked varint reads.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn u(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for (i, &b) in self.0.iter().enumerate().take(10) {
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok(v);
            }
        }
        bail!("cut short or bad varint")
    }
    pub(super) fn i(&mut self) -> Result<i64> {
        let v = self.u()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }
    fn f64(&mut self) -> Result<f64> {
        ensure!(self.0.len() >= 8, "cut short");
        let (a, b) = self.0.split_at(8);
        self.0 = b;
        Ok(f64::from_le_bytes(a.try_into()?))
    }
    fn u16(&mut self) -> Result<u16> {
        u16::try_from(self.u()?).context("depth out of range")
    }
    fn step(&mut self, prev: &mut u64) -> Result<u64> {
        *prev = prev.wrapping_add(self.u()?);
        Ok(*prev)
    }
    /// A count of items of at least `min_size` bytes each: never more than the bytes left
    /// could hold (a damaged count must not allocate or loop for ever).
    pub(super) fn count(&mut self, min_size: usize) -> Result<u64> {
        let n = self.u()?;
        ensure!(
            n <= (self.0.len() / min_size.max(1)) as u64,
            "count {n} larger than the file could hold"
        );
        Ok(n)
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.count(1)? as usize;
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(super) fn strings(&mut self) -> Result<Vec<String>> {
        let n = self.count(1)?;
        (0..n)
            .map(|_| Ok(String::from_utf8(self.bytes()?.to_vec())?))
            .collect()
    }
    pub(super) fn phase(&mut self) -> Result<PhaseDigest> {
        let min_depth = self.u16()?;
        let count = self.u()?;
        let (sum_ns, min_ns, max_ns) = (self.i()?, self.i()?, self.i()?);
        let in_step = self.u()?;
        let in_step_main = self.u()?;
        let in_step_ns = self.i()?;
        let concurrent = self.u()?;
        let concurrent_ns = self.i()?;
        let main_depth = self.u16()?;
        let concurrent_depth = self.u16()?;
        let sk = self.bytes()?;
        let mut sketch = crate::guard::guarded(|| DDSketch::from_java_bytes(sk))
            .map_err(|p| anyhow::anyhow!("sketch decoder failed: {p}"))?
            .map_err(|e| anyhow::anyhow!("bad sketch: {e:?}"))?;
        ensure!(
            sketch_config_ok(&mut sketch),
            "a sketch with another configuration"
        );
        Ok(PhaseDigest {
            min_depth,
            count,
            sum_ns,
            min_ns,
            max_ns,
            in_step,
            in_step_main,
            in_step_ns,
            concurrent,
            concurrent_ns,
            main_depth,
            concurrent_depth,
            sketch,
        })
    }
}
