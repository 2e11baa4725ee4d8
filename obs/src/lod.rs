//! Level-of-detail timeline ("detail levels"): what a gantt draws of one part when zoomed
//! out, computed once when the part is written and stored next to it as `part-<N>.lod`, so a
//! viewer of a day-long job reads kilobytes per rank for its first frame instead of decoding
//! every span.
//!
//! For each row of a part (one recording thread at one nesting depth) and each level (time
//! buckets of 2^shift ns, [`LEVEL_SHIFTS`]), a [`Bucket`] per bucket that holds any span: the
//! phase that covers most of it, how much of it spans cover, its longest span, and the union
//! of the tags of the steps it touches. A level is kept for a row only where it has fewer
//! buckets than the row has spans (finer than that, the spans themselves are as small); the
//! coarsest level is always kept. The part's time range and each step's bounds come with it,
//! so a reader knows which parts a window needs without opening them.
//!
//! Times are in the rank's own clock (as in the part); [`PartDetail::clock_offset_ns`] puts
//! them on rank 0's clock.
//!
//! The file (`obs/SCHEMA.md`, "Detail levels"): magic, version, the byte length of the part it
//! describes, the body's length and CRC-32C, then the body (LEB128 integers, zigzag for signed
//! ones). A file that does not check out is an error naming it; readers fall back to the
//! part's spans.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};

use crate::part_files::PartFile;
use crate::record::NO_STEP;
use crate::tables::{Columns, PartData};

/// Bucket widths, finest first: 2^30 ns (~1.07 s), 2^33 (~8.6 s), 2^36 (~69 s), 2^39 (~9.2 min).
pub const LEVEL_SHIFTS: [u32; 4] = [30, 33, 36, 39];

/// A span covering more buckets than this at a level is not spread over that level (the level
/// is dropped for its row): bounds the work a damaged or absurd duration can cause.
const MAX_BUCKETS_PER_SPAN: i64 = 1 << 20;

const MAGIC: &[u8; 8] = b"TITANLOD";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 8 + 4;

/// The columns detail levels are made of.
pub(crate) const COLUMNS: Columns = Columns {
    start: true,
    thread: true,
    depth: true,
    links: false,
    tags: true,
    messages: false,
    pipeline: false,
};

/// What one time bucket of one row shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Bucket number: it covers `[index << shift, (index + 1) << shift)` ns (rank clock).
    pub index: i64,
    /// Index into [`PartDetail::names`] of the phase covering most of the bucket.
    pub phase: u32,
    /// Nanoseconds of the bucket covered by spans.
    pub covered_ns: i64,
    /// The longest span overlapping the bucket: its start, duration, phase and step.
    pub longest_start: i64,
    pub longest_dur: i64,
    pub longest_phase: u32,
    pub longest_step: u64,
    /// Bit mask over [`PartDetail::tags`] of the tags of the steps the bucket's spans are in.
    pub tags: u64,
}

/// One level of one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Level {
    pub shift: u32,
    /// Sorted by index.
    pub buckets: Vec<Bucket>,
}

/// One thread at one depth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetailRow {
    pub thread: u32,
    pub depth: u16,
    pub spans: u64,
    /// The coarsest level left out because it had as many buckets as the row has spans:
    /// at that resolution or finer, drawing the spans themselves costs no more.
    pub dense_shift: Option<u32>,
    /// The levels kept, finest first.
    pub levels: Vec<Level>,
}

impl DetailRow {
    /// Whether buckets of 2^`shift` ns are no smaller than the row's spans (draw the spans).
    pub fn spans_are_smaller(&self, shift: u32) -> bool {
        self.dense_shift.is_some_and(|d| d >= shift)
    }

    /// The finest kept level whose buckets are at least 2^`min_shift` ns wide, else the
    /// coarsest kept level.
    pub fn level(&self, min_shift: u32) -> Option<&Level> {
        self.levels
            .iter()
            .find(|l| l.shift >= min_shift)
            .or(self.levels.last())
    }
}

/// The detail levels of one part.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartDetail {
    pub rank: u32,
    pub clock_offset_ns: i64,
    /// Earliest span start and latest span end (rank clock); 0, 0 without spans.
    pub start_ns: i64,
    pub end_ns: i64,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    /// Sorted by (thread, depth).
    pub rows: Vec<DetailRow>,
    /// (step, first span start, last span end) of every step with spans, by step.
    pub steps: Vec<(u64, i64, i64)>,
    /// (step, bit mask over `tags`) of the tagged steps, by step.
    pub step_tags: Vec<(u64, u64)>,
}

/// A bucket being filled: time per phase, longest span, tags.
#[derive(Default)]
struct Acc {
    phases: Vec<(u32, i64)>,
    covered: i64,
    longest: Option<(i64, i64, u32, u64)>,
    tags: u64,
}

impl Acc {
    fn add(&mut self, phase: u32, overlap: i64, span: (i64, i64, u32, u64), tags: u64) {
        self.covered = self.covered.saturating_add(overlap);
        match self.phases.iter_mut().find(|p| p.0 == phase) {
            Some(p) => p.1 = p.1.saturating_add(overlap),
            None => self.phases.push((phase, overlap)),
        }
        if self.longest.is_none_or(|l| span.1 > l.1) {
            self.longest = Some(span);
        }
        self.tags |= tags;
    }

    fn bucket(&self, index: i64, width: i64) -> Bucket {
        // Ties go to the phase seen first (the earliest), so the result does not depend on
        // hash order.
        let phase = self
            .phases
            .iter()
            .rev()
            .max_by_key(|p| p.1)
            .map_or(0, |p| p.0);
        let (longest_start, longest_dur, longest_phase, longest_step) =
            self.longest.unwrap_or((index, 0, phase, NO_STEP));
        Bucket {
            index,
            phase,
            covered_ns: self.covered.min(width),
            longest_start,
            longest_dur,
            longest_phase,
            longest_step,
            tags: self.tags,
        }
    }
}

/// One span of a row while levels are computed: (start, duration, phase, step, tag mask).
type RowSpan = (i64, i64, u32, u64, u64);

/// The level `shift` of one row's spans (any order); `None` when a span covers too many
/// buckets.
fn level_of(spans: &[RowSpan], shift: u32) -> Option<Level> {
    let width = 1i64 << shift;
    let mut acc: BTreeMap<i64, Acc> = BTreeMap::new();
    for &(start, dur, phase, step, tags) in spans {
        let end = start.saturating_add(dur.max(0));
        let (first, last) = (start >> shift, end.saturating_sub(1).max(start) >> shift);
        if last - first >= MAX_BUCKETS_PER_SPAN {
            return None;
        }
        for b in first..=last {
            // Saturating: a damaged start near i64::MAX must not overflow.
            let (a, z) = (b << shift, (b << shift).saturating_add(width));
            let overlap = end.min(z) - start.max(a);
            acc.entry(b)
                .or_default()
                .add(phase, overlap.max(0), (start, dur, phase, step), tags);
        }
    }
    Some(Level {
        shift,
        buckets: acc.iter().map(|(&i, a)| a.bucket(i, width)).collect(),
    })
}

impl PartDetail {
    /// The detail levels of a decoded part (decoded with at least [`COLUMNS`]).
    pub(crate) fn of_data(d: &PartData) -> PartDetail {
        let s = &d.spans;
        let n = s.rank.len();
        let col = |len: usize| len == n;
        let (has_start, has_thread, has_depth) = (
            col(s.start_ns.len()),
            col(s.thread.len()),
            col(s.depth.len()),
        );
        let mut rows: BTreeMap<(u32, u16), Vec<RowSpan>> = BTreeMap::new();
        let mut steps: BTreeMap<u64, (i64, i64)> = BTreeMap::new();
        let (mut start_ns, mut end_ns) = (i64::MAX, i64::MIN);
        // Only the names of spans (not of the part's scalars and instants), in order seen.
        let mut names: Vec<String> = Vec::new();
        let mut name_ids: HashMap<u32, u32> = HashMap::new();
        for i in 0..n {
            let start = if has_start { s.start_ns[i] } else { 0 };
            let dur = s.dur_ns[i].max(0);
            let end = start.saturating_add(dur);
            let step = s.step[i];
            let tags = d.step_tags.get(&step).copied().unwrap_or(0);
            let key = (
                if has_thread { s.thread[i] } else { 0 },
                if has_depth { s.depth[i] } else { 0 },
            );
            let name = *name_ids.entry(s.name[i]).or_insert_with(|| {
                names.push(d.names.get(s.name[i] as usize).cloned().unwrap_or_default());
                names.len() as u32 - 1
            });
            rows.entry(key)
                .or_default()
                .push((start, dur, name, step, tags));
            start_ns = start_ns.min(start);
            end_ns = end_ns.max(end);
            if step != NO_STEP {
                let b = steps.entry(step).or_insert((i64::MAX, i64::MIN));
                *b = (b.0.min(start), b.1.max(end));
            }
        }
        let rows = rows
            .into_iter()
            .map(|((thread, depth), spans)| {
                let mut levels: Vec<Level> = LEVEL_SHIFTS
                    .iter()
                    .filter_map(|&shift| level_of(&spans, shift))
                    .collect();
                // Keep the levels that are smaller than the spans (always one), and of levels
                // as small as a finer one only the finer: it draws the same bytes better.
                let coarsest = levels.pop();
                let dense_shift = levels
                    .iter()
                    .filter(|l| l.buckets.len() >= spans.len())
                    .map(|l| l.shift)
                    .max();
                levels.retain(|l| l.buckets.len() < spans.len());
                levels.extend(coarsest);
                levels.dedup_by(|coarser, finer| coarser.buckets.len() == finer.buckets.len());
                DetailRow {
                    thread,
                    depth,
                    spans: spans.len() as u64,
                    dense_shift,
                    levels,
                }
            })
            .collect();
        if n == 0 {
            (start_ns, end_ns) = (0, 0);
        }
        let mut step_tags: Vec<(u64, u64)> = d
            .step_tags
            .iter()
            .filter(|&(_, &m)| m != 0)
            .map(|(&s, &m)| (s, m))
            .collect();
        step_tags.sort_unstable();
        PartDetail {
            rank: d.info.rank,
            clock_offset_ns: d.info.clock_offset_ns,
            start_ns,
            end_ns,
            names,
            // The masks have 64 bits (and `decode` refuses more): a part with more tags keeps
            // the first 64, so its levels stay readable.
            tags: d.tags.iter().take(64).cloned().collect(),
            rows,
            steps: steps.into_iter().map(|(k, (a, b))| (k, a, b)).collect(),
            step_tags,
        }
    }

    /// Decodes a part's bytes and computes its detail levels.
    pub fn of_part(bytes: bytes::Bytes, rank: u32) -> Result<PartDetail> {
        let data = crate::decode::decode_part(bytes, rank, COLUMNS, 0)?;
        Ok(PartDetail::of_data(&data))
    }
}

/// The spans of one part by row (thread, depth), each row sorted by start: what a viewer
/// draws when zoomed in further than the finest level.
#[derive(Debug, Clone, Default)]
pub struct PartSpans {
    pub rank: u32,
    pub clock_offset_ns: i64,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    /// Step -> bit mask over `tags`.
    pub step_tags: HashMap<u64, u64>,
    pub rows: Vec<SpanRows>,
}

/// One row of [`PartSpans`], as columns.
#[derive(Debug, Clone, Default)]
pub struct SpanRows {
    pub thread: u32,
    pub depth: u16,
    pub start: Vec<i64>,
    pub dur: Vec<i64>,
    pub name: Vec<u32>,
    pub step: Vec<u64>,
    pub pipeline: Vec<Option<crate::PipelineSlot>>,
}

impl PartSpans {
    /// Decodes the spans of a part (local or in an object store).
    pub fn read(part: &PartFile) -> Result<PartSpans> {
        let bytes = part.read()?;
        let columns = Columns {
            pipeline: true,
            ..COLUMNS
        };
        let d = crate::decode::decode_part(bytes, part.rank, columns, 0)
            .with_context(|| format!("decoding {}", part.shown()))?;
        let s = &d.spans;
        let n = s.rank.len();
        let at = |v: &[u32], i: usize| v.get(i).copied().unwrap_or(0);
        let mut order: Vec<usize> = (0..n).collect();
        let key = |i: usize| {
            (
                at(&s.thread, i),
                s.depth.get(i).copied().unwrap_or(0),
                s.start_ns.get(i).copied().unwrap_or(0),
            )
        };
        order.sort_unstable_by_key(|&i| key(i));
        let mut rows: Vec<SpanRows> = Vec::new();
        for i in order {
            let (thread, depth, start) = key(i);
            if rows
                .last()
                .is_none_or(|r| (r.thread, r.depth) != (thread, depth))
            {
                rows.push(SpanRows {
                    thread,
                    depth,
                    ..Default::default()
                });
            }
            let r = rows.last_mut().expect("pushed");
            r.start.push(start);
            r.dur.push(s.dur_ns[i].max(0));
            r.name.push(s.name[i]);
            r.step.push(s.step[i]);
            r.pipeline.push(s.pipeline.get(i).copied().flatten());
        }
        Ok(PartSpans {
            rank: d.info.rank,
            clock_offset_ns: d.info.clock_offset_ns,
            names: d.names,
            tags: d.tags,
            step_tags: d.step_tags,
            rows,
        })
    }
}

/// File name of part `index`'s detail levels.
pub fn detail_file_name(index: u64) -> String {
    format!("part-{index:06}.lod")
}

/// `part-<N>.lod` next to `part-<N>.parquet`.
pub fn detail_path(part: &Path) -> PathBuf {
    part.with_extension("lod")
}

fn put(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push(v as u8 | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

fn put_signed(b: &mut Vec<u8>, v: i64) {
    put(b, ((v << 1) ^ (v >> 63)) as u64);
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    put(b, s.len() as u64);
    b.extend_from_slice(s.as_bytes());
}

/// Encodes the detail levels of a part of `part_len` bytes.
pub fn encode(d: &PartDetail, part_len: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(1024);
    put(&mut b, u64::from(d.rank));
    for v in [d.clock_offset_ns, d.start_ns, d.end_ns] {
        put_signed(&mut b, v);
    }
    for list in [&d.names, &d.tags] {
        put(&mut b, list.len() as u64);
        for s in list {
            put_str(&mut b, s);
        }
    }
    put(&mut b, d.steps.len() as u64);
    let mut prev = 0u64;
    for &(step, a, z) in &d.steps {
        put(&mut b, step.wrapping_sub(prev));
        prev = step;
        put_signed(&mut b, a);
        // Wrapping both ways: a damaged part's extreme times must not overflow here.
        put_signed(&mut b, z.wrapping_sub(a));
    }
    put(&mut b, d.step_tags.len() as u64);
    for &(step, mask) in &d.step_tags {
        put(&mut b, step);
        put(&mut b, mask);
    }
    put(&mut b, d.rows.len() as u64);
    for r in &d.rows {
        put(&mut b, u64::from(r.thread));
        put(&mut b, u64::from(r.depth));
        put(&mut b, r.spans);
        put(&mut b, r.dense_shift.map_or(0, |s| u64::from(s) + 1));
        put(&mut b, r.levels.len() as u64);
        for l in &r.levels {
            put(&mut b, u64::from(l.shift));
            put(&mut b, l.buckets.len() as u64);
            let mut prev = 0i64;
            for k in &l.buckets {
                // Indices ascend and start times are near them: deltas keep them small.
                put_signed(&mut b, k.index - prev);
                prev = k.index;
                put(&mut b, u64::from(k.phase));
                put_signed(&mut b, k.covered_ns);
                put_signed(&mut b, k.longest_start - (k.index << l.shift));
                put_signed(&mut b, k.longest_dur);
                put(&mut b, u64::from(k.longest_phase));
                put(&mut b, k.longest_step);
                put(&mut b, k.tags);
            }
        }
    }
    let mut out = Vec::with_capacity(HEADER + b.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&part_len.to_le_bytes());
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&b).to_le_bytes());
    out.extend_from_slice(&b);
    out
}

/// LEB128 reads that fail, never panic, on bytes that run out or overflow.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn next(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.0.split_first().context("cut short")?;
            self.0 = rest;
            v |= u64::from(byte & 0x7f)
                .checked_shl(shift)
                .context("integer overflow")?;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        anyhow::bail!("integer longer than 64 bits")
    }

    fn signed(&mut self) -> Result<i64> {
        let v = self.next()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn small<T: TryFrom<u64>>(&mut self, what: &str) -> Result<T> {
        T::try_from(self.next()?).map_err(|_| anyhow::anyhow!("{what} out of range"))
    }

    /// A count of items of at least `min_bytes` each: no larger than the bytes left.
    fn count(&mut self, min_bytes: usize) -> Result<usize> {
        let n: usize = self.small("count")?;
        ensure!(
            n.saturating_mul(min_bytes) <= self.0.len(),
            "a count of {n} with {} bytes left",
            self.0.len()
        );
        Ok(n)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.count(1)?;
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(s.to_vec()).context("a name is not UTF-8")
    }
}

/// Decodes a detail file that must describe a part of `part_len` bytes. Every count, id and
/// shift is checked: a damaged file is an error, never a panic.
pub fn decode(bytes: &[u8], part_len: u64) -> Result<PartDetail> {
    ensure!(bytes.len() >= HEADER, "shorter than its header");
    ensure!(
        &bytes[..8] == MAGIC,
        "not a titan-obs detail file (bad magic)"
    );
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    ensure!(
        version == VERSION,
        "version {version} (this reader: {VERSION})"
    );
    ensure!(
        word(12) == part_len,
        "describes a part of {} bytes, the part has {part_len} (rewritten since)",
        word(12)
    );
    let body = &bytes[HEADER..];
    ensure!(
        word(20) == body.len() as u64,
        "body of {} bytes, {} expected",
        body.len(),
        word(20)
    );
    let crc = u32::from_le_bytes(bytes[28..32].try_into().expect("4 bytes"));
    ensure!(crc32c::crc32c(body) == crc, "checksum mismatch");
    let mut c = Cursor(body);
    let mut d = PartDetail {
        rank: c.small("rank")?,
        clock_offset_ns: c.signed()?,
        start_ns: c.signed()?,
        end_ns: c.signed()?,
        ..Default::default()
    };
    for list in [&mut d.names, &mut d.tags] {
        for _ in 0..c.count(1)? {
            list.push(c.string()?);
        }
    }
    ensure!(d.tags.len() <= 64, "{} tags (at most 64)", d.tags.len());
    let names = d.names.len() as u64;
    let mut step = 0u64;
    for _ in 0..c.count(3)? {
        step = step.wrapping_add(c.next()?);
        let a = c.signed()?;
        let z = a.wrapping_add(c.signed()?);
        d.steps.push((step, a, z));
    }
    for _ in 0..c.count(2)? {
        d.step_tags.push((c.next()?, c.next()?));
    }
    for _ in 0..c.count(5)? {
        let mut r = DetailRow {
            thread: c.small("thread")?,
            depth: c.small("depth")?,
            spans: c.next()?,
            dense_shift: match c.small::<u32>("level")? {
                0 => None,
                s => Some(s - 1),
            },
            levels: Vec::new(),
        };
        for _ in 0..c.count(2)? {
            let shift: u32 = c.small("shift")?;
            ensure!(LEVEL_SHIFTS.contains(&shift), "unknown level 2^{shift} ns");
            let mut buckets = Vec::new();
            let mut index = 0i64;
            for _ in 0..c.count(8)? {
                index = index.checked_add(c.signed()?).context("bucket overflows")?;
                let base = index.checked_shl(shift).context("bucket overflows")?;
                let k = Bucket {
                    index,
                    phase: c.small("phase")?,
                    covered_ns: c.signed()?,
                    longest_start: base.saturating_add(c.signed()?),
                    longest_dur: c.signed()?,
                    longest_phase: c.small("phase")?,
                    longest_step: c.next()?,
                    tags: c.next()?,
                };
                ensure!(
                    u64::from(k.phase) < names && u64::from(k.longest_phase) < names,
                    "phase id out of range"
                );
                buckets.push(k);
            }
            r.levels.push(Level { shift, buckets });
        }
        d.rows.push(r);
    }
    ensure!(c.0.is_empty(), "{} bytes after the last row", c.0.len());
    Ok(d)
}

/// The detail levels embedded in a part footer's key-values (issue 42, see `embedded.rs`):
/// `Ok(None)` when it has none; `Err` when they are damaged.
pub fn from_footer(kv: &HashMap<String, String>) -> Result<Option<PartDetail>> {
    let Some(bytes) = crate::footer::embedded(kv, crate::schema::meta::DETAIL)? else {
        return Ok(None);
    };
    // No context of its own: the TUI shows the message in its title bar, where it must stay
    // short; callers name the part.
    decode(&bytes, 0).map(Some)
}

/// Reads `part`'s detail file: `Ok(None)` when there is none, `Err` (naming the file) when it
/// is damaged or does not describe the part.
/// A part without a detail file beside it has its levels in its footer (issue 42); a part
/// whose footer cannot be read counts as having none.
pub fn read_local(part: &Path, part_len: u64) -> Result<Option<PartDetail>> {
    let path = detail_path(part);
    let Some(bytes) = crate::sidecar::read_if_present(&path)? else {
        let file = PartFile::local(part.to_path_buf(), 0);
        let Ok(kv) = file.footer_kv() else {
            return Ok(None);
        };
        return from_footer(&kv)
            .with_context(|| format!("the detail levels in {} are damaged", part.display()));
    };
    decode(&bytes, part_len)
        .map(Some)
        .with_context(|| format!("{} is damaged", path.display()))
}

/// Writes `part`'s detail file under a temporary name and renames it into place.
pub fn write_local(part: &Path, part_len: u64, d: &PartDetail) -> Result<()> {
    crate::sidecar::write_atomic(&detail_path(part), &encode(d, part_len))
}

/// One part's detail levels as a reader got them.
pub struct Opened {
    pub detail: PartDetail,
    /// The detail file was damaged (named, with why): these were built from the part.
    pub damaged: Option<String>,
    /// The part had no detail file (a run written before them): built, and cached next to it
    /// when it is a local part in a writable folder.
    pub built: bool,
}

/// The detail levels of a part (local or in an object store): its `.lod` file, or, when that
/// is missing or damaged, built from the part's spans (and cached beside a local part when it
/// was missing and the folder is writable; a damaged file is left as evidence). Fails only
/// when the part itself cannot be read.
pub fn open(part: &PartFile) -> Result<Opened> {
    // The footer first (issue 42: one read from the end of the part, one request on an
    // object store, which learns the size of a part not listed); a part written before holds
    // none, and has them beside it.
    let found = match part.footer_kv() {
        Ok(kv) if kv.contains_key(crate::schema::meta::DETAIL) => {
            from_footer(&kv).with_context(|| format!("{}: levels damaged", part.shown()))
        }
        _ => part.read_beside("lod").and_then(|b| match b {
            Some(b) => decode(&b, part.byte_len()?)
                .map(Some)
                .with_context(|| format!("{} is damaged", part.beside_shown("lod"))),
            None => Ok(None),
        }),
    };
    let damaged = match found {
        Ok(Some(detail)) => {
            return Ok(Opened {
                detail,
                damaged: None,
                built: false,
            });
        }
        Ok(None) => None,
        Err(e) => Some(format!("{e:#}")),
    };
    let detail = PartDetail::of_part(part.read()?, part.rank)
        .with_context(|| format!("decoding {}", part.shown()))?;
    if damaged.is_none()
        && let Some(path) = part.local_path()
        && let Err(e) = part
            .byte_len()
            .and_then(|len| write_local(path, len, &detail))
    {
        tracing::debug!("not caching the detail levels of {}: {e:#}", path.display());
    }
    Ok(Opened {
        detail,
        damaged,
        built: true,
    })
}

/// Interns names of several parts into one run-wide list.
#[derive(Default, Debug, Clone)]
pub struct Names {
    pub list: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Names {
    pub fn id(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        let i = self.list.len() as u32;
        self.list.push(name.to_string());
        self.ids.insert(name.to_string(), i);
        i
    }

    /// Run-wide ids of a part's names.
    pub fn map(&mut self, names: &[String]) -> Vec<u32> {
        names.iter().map(|n| self.id(n)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::{RecordTable, SharedFields};

    fn data(spans: &[(u32, u16, i64, i64, &str, u64)]) -> PartData {
        let mut d = PartData::default();
        d.info.rank = 3;
        d.info.clock_offset_ns = 7;
        d.tags = vec!["checkpoint".into()];
        d.step_tags.insert(2, 1);
        for &(thread, depth, start, dur, name, step) in spans {
            let id = match d.names.iter().position(|n| n == name) {
                Some(i) => i as u32,
                None => {
                    d.names.push(name.into());
                    d.names.len() as u32 - 1
                }
            };
            d.spans.shared_columns().push(SharedFields {
                rank: 3,
                name: id,
                step,
                start_ns: start,
                thread,
                depth,
                parent: 0,
            });
            d.spans.dur_ns.push(dur);
        }
        d
    }

    const S: i64 = 1 << 30;

    /// A damaged part's extreme times and more tags than a mask holds still give levels that
    /// encode and decode (no overflow, no file `decode` refuses).
    #[test]
    fn extreme_times_and_many_tags_stay_readable() {
        let mut d = data(&[
            (0, 0, i64::MIN, 0, "step", 1),
            (0, 0, i64::MAX - 5, 5, "step", 1),
            (0, 1, 0, i64::MAX, "forward", 2),
        ]);
        d.tags = (0..70).map(|i| format!("tag{i}")).collect();
        let detail = PartDetail::of_data(&d);
        assert_eq!(detail.tags.len(), 64);
        let bytes = encode(&detail, 1234);
        let back = decode(&bytes, 1234).unwrap();
        assert_eq!(back.steps, detail.steps);
        assert_eq!(back.tags, detail.tags);
    }

    #[test]
    fn buckets_hold_the_dominant_phase_coverage_longest_span_and_tags() {
        // Depth 0: two steps of ~2 buckets each at 2^30; depth 1: many short spans.
        let mut spans = vec![(0, 0, 0, 2 * S, "step", 1), (0, 0, 2 * S, 2 * S, "step", 2)];
        for i in 0..32 {
            let name = if i % 4 == 0 { "data" } else { "fwd" };
            spans.push((0, 1, i * S / 8, S / 8, name, 1 + (i >= 16) as u64));
        }
        let d = PartDetail::of_data(&data(&spans));
        assert_eq!((d.start_ns, d.end_ns), (0, 4 * S));
        assert_eq!(d.steps, vec![(1, 0, 2 * S), (2, 2 * S, 4 * S)]);
        assert_eq!(d.rows.len(), 2);
        // Depth 0 has two spans: 2^33 is the finest level with fewer buckets (one); the
        // coarser ones are as small and left out.
        let top = &d.rows[0];
        assert_eq!(top.levels.len(), 1);
        assert_eq!(top.levels[0].shift, 33);
        assert_eq!(top.level(39).map(|l| l.shift), Some(33));
        assert_eq!(top.dense_shift, Some(30), "2^30 has 4 buckets for 2 spans");
        assert!(top.spans_are_smaller(30) && !top.spans_are_smaller(33));
        assert_eq!(d.step_tags, vec![(2, 1)]);
        let b = top.levels[0].buckets[0];
        assert_eq!(b.covered_ns, 4 * S);
        assert_eq!(b.tags, 1, "step 2 is tagged");
        // Depth 1: 32 spans; 2^30 has 4 buckets (< 40) and is kept.
        let fine = top_level(&d.rows[1], 30);
        assert_eq!(fine.buckets.len(), 4);
        let k = fine.buckets[0];
        assert_eq!(d.names[k.phase as usize], "fwd", "fwd covers 3/4 of it");
        assert_eq!(k.covered_ns, S);
        assert_eq!(k.tags, 0);
        assert_eq!(fine.buckets[3].tags, 1);
    }

    fn top_level(r: &DetailRow, shift: u32) -> &Level {
        r.levels.iter().find(|l| l.shift == shift).expect("level")
    }

    #[test]
    fn encode_decode_round_trips_and_damage_is_an_error() {
        let spans: Vec<_> = (0..50)
            .map(|i| (i % 2, 1, i as i64 * S / 3, S / 4, "fwd", i as u64 / 5))
            .collect();
        let d = PartDetail::of_data(&data(&spans));
        let bytes = encode(&d, 1234);
        assert_eq!(decode(&bytes, 1234).unwrap(), d);
        assert!(
            decode(&bytes, 1235)
                .unwrap_err()
                .to_string()
                .contains("1234")
        );
        for at in [0, 9, 30, HEADER + 3, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(decode(&bad, 1234).is_err(), "flip at {at} not caught");
        }
        assert!(decode(&bytes[..bytes.len() - 2], 1234).is_err());
        assert!(decode(&bytes[..10], 1234).is_err());
    }

    #[test]
    fn a_span_over_too_many_buckets_drops_only_the_fine_levels() {
        let d = PartDetail::of_data(&data(&[(0, 0, 0, i64::MAX / 2, "huge", 0)]));
        let shifts: Vec<u32> = d.rows[0].levels.iter().map(|l| l.shift).collect();
        assert_eq!(shifts, Vec::<u32>::new(), "even 2^39 is too fine for it");
        assert_eq!(d.rows[0].level(0), None);
        let d = PartDetail::of_data(&data(&[(0, 0, 0, 3 * S, "long", 0)]));
        assert_eq!(
            d.rows[0].level(0).map(|l| l.shift),
            Some(39),
            "one span: no level is smaller"
        );
    }
}
