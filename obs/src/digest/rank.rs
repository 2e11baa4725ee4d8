//! A rank's summary (`rank.summary`, `obs/SCHEMA.md` "Per-rank summaries"): the digests of
//! the rank's compacted parts merged, so `summary` reads one file per rank instead of one per
//! part. It names the parts it covers (index, byte length, the damage each was compacted
//! with), so a reader can tell whether it is up to date against a directory listing.
//!
//! Parts are merged into *segments*: consecutive parts of one run id and clock offset (a
//! folder can hold several runs, and a rank's clock offset can be set after its first parts).
//! A segment is merged into the run as one part would be.

use std::collections::BTreeSet;

use super::PartDigest;
use crate::footer::CompactedDamage;

/// One part a rank summary covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoveredPart {
    pub index: u64,
    /// The part's byte length when summarised.
    pub len: u64,
    /// The damage of the journal it was compacted from (its footer's `titan.damage`).
    pub damage: Vec<CompactedDamage>,
}

/// Consecutive parts of one run id and clock offset, and their digests merged.
#[derive(Debug, Clone)]
pub struct Segment {
    pub parts: Vec<CoveredPart>,
    /// `info.parts` is the number of parts; `damage` is empty (it is in `parts`).
    pub digest: PartDigest,
}

/// The merged digests of a rank's parts, in part order.
#[derive(Debug, Clone, Default)]
pub struct RankDigest {
    pub segments: Vec<Segment>,
}

impl RankDigest {
    /// Adds part `index` (`len` bytes), which comes after every part already here.
    pub fn add_part(&mut self, index: u64, len: u64, mut digest: PartDigest) {
        let damage = std::mem::take(&mut digest.damage);
        let part = CoveredPart { index, len, damage };
        digest.info.parts = 1;
        match self.segments.last_mut() {
            Some(s)
                if s.digest.info.run_id == digest.info.run_id
                    && s.digest.info.clock_offset_ns == digest.info.clock_offset_ns =>
            {
                s.digest.absorb(&digest);
                s.parts.push(part);
            }
            _ => self.segments.push(Segment {
                parts: vec![part],
                digest,
            }),
        }
    }

    /// The parts covered, in order.
    pub fn covered(&self) -> impl Iterator<Item = &CoveredPart> {
        self.segments.iter().flat_map(|s| &s.parts)
    }

    /// The index of the last part covered.
    pub fn last_index(&self) -> Option<u64> {
        self.covered().map(|p| p.index).last()
    }

    /// Whether this summary can stand for its parts in a folder holding the parts `listed`:
    /// every part it covers is still there, and every part it does not cover comes after
    /// its last (those are added to it). Otherwise (a part removed, one written out of order)
    /// the rank is summarised from its parts' own summaries.
    pub fn fits(&self, listed: &BTreeSet<u64>) -> bool {
        let covered = self.covered_set();
        let last = covered.last().copied();
        covered.is_subset(listed)
            && listed
                .iter()
                .all(|i| covered.contains(i) || last.is_none_or(|l| *i > l))
    }

    /// [`Self::fits`] for parts listed with their sizes (index -> bytes, an object store's
    /// listing): and every part it covers is listed with the size it was summarised at.
    pub fn fits_sized(&self, listed: &std::collections::BTreeMap<u64, u64>) -> bool {
        self.fits(&listed.keys().copied().collect())
            && self.covered().all(|p| listed.get(&p.index) == Some(&p.len))
    }

    /// The indices of the parts covered.
    pub fn covered_set(&self) -> BTreeSet<u64> {
        self.covered().map(|p| p.index).collect()
    }
}
