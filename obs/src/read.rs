//! Reading a run back: every rank's parts (and open journals), decoded in parallel into typed
//! columnar tables. [`load`] reads a run once; [`PartsReader`] keeps a titan run open and
//! decodes only what is new on each refresh (`--follow`); [`read_part`] hands one part back as
//! its footer and Arrow batches. The decoding itself (footer, one function per record kind) is
//! in `decode.rs`.
//!
//! [`load`] never fails because of one bad part or a missing rank: those are listed in
//! [`LoadReport`] and the rest is loaded. It fails only when the run location itself cannot
//! be read. Only the columns asked for in [`Columns`] are decoded; names and tags are
//! interned into run-wide dictionaries ([`Run::names`], [`Run::tags`]) so the tables hold
//! small integer ids.

use anyhow::Result;

pub use crate::decode::read_part;
pub use crate::incremental::{PartsReader, ReadCounters, load_parts};
pub use crate::run::*;
pub use crate::tables::*;

/// Loads a run in any format titan-obs reads: titan parts, torchtitan structured logs or
/// Chrome traces, local or on an object store (detected by [`crate::ingest::detect`]).
pub fn load(run: &str, opts: &ReadOptions) -> Result<Run> {
    crate::ingest::load(run, opts)
}
