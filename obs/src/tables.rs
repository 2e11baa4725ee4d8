//! The record tables every reader fills and every summary and analysis reads: typed
//! columnar tables ([`Spans`], [`Instants`], [`Scalars`], [`Errors`]) whose shared columns
//! every decoder and converter appends and reads through [`RecordTable`], per-rank
//! [`RankInfo`], and [`PartData`]: one decoded part (or a slice of another format's file) with
//! part-local name and tag ids. Public as `titan_obs_core::read::*`.

use std::collections::HashMap;

use crate::footer::{CompactedDamage, PartHeader};
use crate::schema::{PipelineSlot, Reduce};

/// Index into a run's (or a part's) name table (`Run::names`).
pub type NameId = u32;

/// A set of step tags: bit i = `Run::tags[i]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TagSet(pub u64);

impl TagSet {
    pub fn contains(self, tag: u32) -> bool {
        tag < 64 && self.0 & (1 << tag) != 0
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn iter(self) -> impl Iterator<Item = u32> {
        (0..64u32).filter(move |i| self.0 & (1 << i) != 0)
    }
}

/// Which optional columns to decode. Rank, kind, name, step, duration and value are always read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    /// `start_ns` (needed for timelines and exports).
    pub start: bool,
    /// `thread`.
    pub thread: bool,
    /// `depth`.
    pub depth: bool,
    /// `seq`, `parent` (the exact span tree).
    pub links: bool,
    /// `tags` (step tags; needed for checkpoint/validation step costs).
    pub tags: bool,
    /// `message` of error records.
    pub messages: bool,
    /// `microbatch`, `stage` of pipeline passes (null in files written before they existed).
    pub pipeline: bool,
}

impl Columns {
    pub const ALL: Columns = Columns {
        start: true,
        thread: true,
        depth: true,
        links: true,
        tags: true,
        messages: true,
        pipeline: true,
    };
    /// What `summary` needs: durations per rank/phase/step, depth, thread (a step's time is
    /// its rank's main thread's) and step tags.
    pub const SUMMARY: Columns = Columns {
        start: false,
        thread: true,
        depth: true,
        links: false,
        tags: true,
        messages: false,
        pipeline: true,
    };
    /// What `metrics` needs: scalars and step tags.
    pub const METRICS: Columns = Columns {
        start: false,
        thread: false,
        depth: false,
        links: false,
        tags: false,
        messages: false,
        pipeline: false,
    };
}

/// Span records, one entry per span in every column (columns not asked for stay empty).
#[derive(Debug, Default, Clone)]
pub struct Spans {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    /// [`crate::NO_STEP`] when recorded before the first step.
    pub step: Vec<u64>,
    pub dur_ns: Vec<i64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub depth: Vec<u16>,
    pub seq: Vec<u64>,
    /// Seq of the enclosing span in the same thread; 0 for top-level spans.
    pub parent: Vec<u64>,
    /// The pipeline schedule slot of a pipeline pass; `None` for every other span.
    pub pipeline: Vec<Option<PipelineSlot>>,
}

impl Spans {
    /// Grows every column already in use to hold `n` spans in total.
    pub(crate) fn reserve(&mut self, n: usize) {
        fn r<T>(v: &mut Vec<T>, n: usize) {
            if !v.is_empty() {
                v.reserve_exact(n.saturating_sub(v.len()));
            }
        }
        r(&mut self.rank, n);
        r(&mut self.name, n);
        r(&mut self.step, n);
        r(&mut self.dur_ns, n);
        r(&mut self.start_ns, n);
        r(&mut self.thread, n);
        r(&mut self.depth, n);
        r(&mut self.seq, n);
        r(&mut self.parent, n);
        r(&mut self.pipeline, n);
    }

    pub fn len(&self) -> usize {
        self.rank.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rank.is_empty()
    }
}

/// Instant (point event) records.
#[derive(Debug, Default, Clone)]
pub struct Instants {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub depth: Vec<u16>,
    pub parent: Vec<u64>,
}

/// Scalar records.
#[derive(Debug, Default, Clone)]
pub struct Scalars {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub value: Vec<f64>,
    pub reduce: Vec<Reduce>,
    pub start_ns: Vec<i64>,
}

/// Error records.
#[derive(Debug, Default, Clone)]
pub struct Errors {
    pub rank: Vec<u32>,
    pub name: Vec<NameId>,
    pub step: Vec<u64>,
    pub start_ns: Vec<i64>,
    pub thread: Vec<u32>,
    pub parent: Vec<u64>,
    pub message: Vec<String>,
}

/// The columns the four record tables share, for one record: who recorded it, what, in which
/// step, when, on which thread, how deep and under which span (its seq; 0: none). A table
/// without one of them ([`Scalars`]: thread, depth, parent; [`Errors`]: depth) leaves it out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedFields {
    pub rank: u32,
    pub name: NameId,
    pub step: u64,
    pub start_ns: i64,
    pub thread: u32,
    pub depth: u16,
    pub parent: u64,
}

/// One table's shared columns, to append to (`None`: the table has no such column).
pub(crate) struct SharedColumns<'a> {
    pub rank: &'a mut Vec<u32>,
    pub name: &'a mut Vec<NameId>,
    pub step: &'a mut Vec<u64>,
    pub start_ns: &'a mut Vec<i64>,
    pub thread: Option<&'a mut Vec<u32>>,
    pub depth: Option<&'a mut Vec<u16>>,
    pub parent: Option<&'a mut Vec<u64>>,
}

impl SharedColumns<'_> {
    /// Moves `from`'s shared columns onto the ends of these (a table of the same kind), names
    /// through `name_map` (part-local to run-wide ids), start times shifted by `offset_ns`.
    pub(crate) fn append(self, from: SharedColumns, name_map: &[u32], offset_ns: i64) {
        self.rank.append(from.rank);
        self.name
            .extend(from.name.drain(..).map(|i| name_map[i as usize]));
        self.step.append(from.step);
        if offset_ns == 0 {
            self.start_ns.append(from.start_ns);
        } else {
            self.start_ns
                .extend(from.start_ns.drain(..).map(|t| t + offset_ns));
        }
        if let (Some(to), Some(from)) = (self.thread, from.thread) {
            to.append(from);
        }
        if let (Some(to), Some(from)) = (self.depth, from.depth) {
            to.append(from);
        }
        if let (Some(to), Some(from)) = (self.parent, from.parent) {
            to.append(from);
        }
    }

    /// Appends a record's shared fields to every shared column the table has.
    pub(crate) fn push(self, r: SharedFields) {
        self.rank.push(r.rank);
        self.name.push(r.name);
        self.step.push(r.step);
        self.start_ns.push(r.start_ns);
        if let Some(c) = self.thread {
            c.push(r.thread);
        }
        if let Some(c) = self.depth {
            c.push(r.depth);
        }
        if let Some(c) = self.parent {
            c.push(r.parent);
        }
    }
}

/// A record table: its shared columns, to append to or to read one record's.
pub(crate) trait RecordTable {
    fn shared_columns(&mut self) -> SharedColumns<'_>;
    /// Record `i`'s shared fields (0 for columns not read or not in the table).
    fn shared_at(&self, i: usize) -> SharedFields;
}

/// Implements [`RecordTable`] for a table with the named optional columns.
macro_rules! record_table {
    ($table:ty, thread: $thread:tt, depth: $depth:tt, parent: $parent:tt) => {
        impl RecordTable for $table {
            fn shared_columns(&mut self) -> SharedColumns<'_> {
                SharedColumns {
                    rank: &mut self.rank,
                    name: &mut self.name,
                    step: &mut self.step,
                    start_ns: &mut self.start_ns,
                    thread: record_table!(@mut self, thread, $thread),
                    depth: record_table!(@mut self, depth, $depth),
                    parent: record_table!(@mut self, parent, $parent),
                }
            }

            fn shared_at(&self, i: usize) -> SharedFields {
                SharedFields {
                    rank: self.rank[i],
                    name: self.name[i],
                    step: self.step[i],
                    start_ns: self.start_ns.get(i).copied().unwrap_or(0),
                    thread: record_table!(@at self, thread, $thread, i),
                    depth: record_table!(@at self, depth, $depth, i),
                    parent: record_table!(@at self, parent, $parent, i),
                }
            }
        }
    };
    (@mut $s:ident, $col:ident, true) => {
        Some(&mut $s.$col)
    };
    (@mut $s:ident, $col:ident, false) => {
        None
    };
    (@at $s:ident, $col:ident, true, $i:ident) => {
        $s.$col.get($i).copied().unwrap_or(0)
    };
    (@at $s:ident, $col:ident, false, $i:ident) => {
        0
    };
}

record_table!(Spans, thread: true, depth: true, parent: true);
record_table!(Instants, thread: true, depth: true, parent: true);
record_table!(Scalars, thread: false, depth: false, parent: false);
record_table!(Errors, thread: true, depth: false, parent: true);

/// Who a rank was, from its parts' footers: the footer's header (its fields read through
/// `Deref`: `info.run_id`), and how many of its parts were read.
#[derive(Debug, Clone, Default)]
pub struct RankInfo {
    pub header: PartHeader,
    pub parts: usize,
}

impl std::ops::Deref for RankInfo {
    type Target = PartHeader;
    fn deref(&self) -> &PartHeader {
        &self.header
    }
}

impl std::ops::DerefMut for RankInfo {
    fn deref_mut(&mut self) -> &mut PartHeader {
        &mut self.header
    }
}

/// One decoded part (or a slice of another format's file) with part-local name/tag ids:
/// what the reader's `Merger` appends to a `Run`.
#[derive(Default)]
pub(crate) struct PartData {
    pub(crate) info: RankInfo,
    pub(crate) rows: usize,
    pub(crate) names: Vec<String>,
    pub(crate) tags: Vec<String>,
    pub(crate) spans: Spans,
    pub(crate) instants: Instants,
    pub(crate) scalars: Scalars,
    pub(crate) errors: Errors,
    /// Step -> bit mask over `tags`.
    pub(crate) step_tags: HashMap<u64, u64>,
    /// Damage the file records about itself (a part's journal ranges dropped at compaction).
    pub(crate) damage: Vec<CompactedDamage>,
}

/// Id of `v` in `values`, appending it when new.
pub(crate) fn intern(values: &mut Vec<String>, ids: &mut HashMap<String, u32>, v: &str) -> u32 {
    if let Some(&id) = ids.get(v) {
        return id;
    }
    let id = values.len() as u32;
    values.push(v.to_string());
    ids.insert(v.to_string(), id);
    id
}
