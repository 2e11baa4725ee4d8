//! The in-memory record a recording thread hands to the writer thread.

use crate::schema::{Kind, PipelineSlot, Reduce};

/// Marker for "no step set yet" (init phases before the first `set_step`).
pub const NO_STEP: u64 = u64::MAX;

/// One record as captured on the hot path: fixed size, no heap data except an error message.
///
/// Times are raw monotonic nanoseconds; the writer maps them to the Unix epoch. Names are
/// `&'static str`: the pointer is the intern key, the writer builds the dictionary.
#[derive(Debug)]
pub struct RawRecord {
    pub kind: Kind,
    pub reduce: Reduce,
    pub depth: u16,
    pub name: &'static str,
    pub seq: u64,
    /// Seq of the enclosing span of the same thread; 0 when top-level.
    pub parent: u64,
    pub step: u64,
    /// Bit i set = tag i of the process tag table applied to the step when recorded.
    pub tags: u64,
    pub start_mono: u64,
    pub dur_ns: u64,
    pub value: f64,
    pub message: Option<Box<str>>,
    pub pipeline: Option<PipelineSlot>,
}
