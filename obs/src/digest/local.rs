//! A local rank folder's summary brought up to date: its `rank.summary` when it still fits the
//! folder's parts, plus the parts written after it (from their own summaries, or decoded and
//! summarised when those are missing or damaged). The reader runs this for a rank the first
//! time it reads it; a part writer ([`crate::part::PartSink`]) for the rank it writes.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result};

use super::rank::RankDigest;
use super::{PartDigest, rank_file};

/// A rank folder summarised.
#[derive(Debug, Default)]
pub struct RankSummarised {
    pub digest: RankDigest,
    /// Summary files that did not check out (the rank's, or parts'), as (file, error): what
    /// they stood for was read from the parts instead.
    pub damaged: Vec<(String, String)>,
    /// Parts that could not be read, as (file, error): not in `digest`.
    pub corrupt: Vec<(String, String)>,
    /// Parts decoded (no summary of theirs could be used), and their bytes.
    pub decoded: u64,
    pub bytes: u64,
    /// Whether `digest` differs from the folder's `rank.summary`.
    pub changed: bool,
}

/// Summarises the parts `listed` of rank `rank`'s local folder `dir`: from `rank.summary`
/// when it fits them, the parts after it added. With `write`, a summary that changed is
/// written back (when nothing was damaged or corrupt: a damaged file is kept as evidence,
/// and a corrupt part must stay visible to the next reader); a folder that cannot be written
/// just goes without.
pub fn summarise_rank(
    dir: &Path,
    rank: u32,
    listed: &BTreeSet<u64>,
    write: bool,
) -> RankSummarised {
    let mut out = RankSummarised::default();
    match rank_file::read_local(dir) {
        // A covered part whose length changed was rewritten or damaged since: its own
        // summary (checked against the part's length) or the part itself says which.
        Ok(Some(d)) if d.fits(listed) && covered_lengths_match(&d, dir) => out.digest = d,
        Ok(_) => out.changed = true,
        Err(e) => {
            let file = rank_file::rank_summary_path(dir).display().to_string();
            out.damaged.push((file, format!("{e:#}")));
            out.changed = true;
        }
    }
    let covered = out.digest.covered_set();
    for &index in listed.iter().filter(|i| !covered.contains(i)) {
        let part = dir.join(crate::location::part_file_name(index));
        match part_digest(&part, rank) {
            Ok(p) => {
                if let Some(d) = p.summary_damage {
                    out.damaged.push(d);
                }
                if p.decoded {
                    out.decoded += 1;
                    out.bytes = out.bytes.saturating_add(p.len);
                }
                out.digest.add_part(index, p.len, p.digest);
                out.changed = true;
            }
            Err(e) => out
                .corrupt
                .push((part.display().to_string(), format!("{e:#}"))),
        }
    }
    if write
        && out.changed
        && out.damaged.is_empty()
        && out.corrupt.is_empty()
        && let Err(e) = rank_file::write_local(dir, &out.digest)
    {
        tracing::debug!("not caching the summary of {}: {e:#}", dir.display());
    }
    out
}

/// Whether every part `d` covers still has the length it was summarised at (one stat a part,
/// in parallel: no part is opened).
pub(crate) fn covered_lengths_match(d: &RankDigest, dir: &Path) -> bool {
    use rayon::prelude::*;
    let covered: Vec<_> = d.covered().collect();
    covered.par_iter().all(|p| {
        std::fs::metadata(dir.join(crate::location::part_file_name(p.index)))
            .is_ok_and(|m| m.len() == p.len)
    })
}

/// The indices of the parts in the local rank folder `dir`.
pub fn list_parts(dir: &Path) -> Result<BTreeSet<u64>> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| crate::location::parse_part_file_name(e.file_name().to_str()?))
        .collect())
}

/// One local part's digest, and how it was had.
pub struct PartSummarised {
    pub digest: PartDigest,
    pub len: u64,
    /// Decoded from the part (its summary missing, outdated or damaged).
    pub decoded: bool,
    /// Its summary file was damaged: (file, error).
    pub summary_damage: Option<(String, String)>,
}

/// The digest of the local part `part` of rank `rank`: from its summary file when that checks
/// out; otherwise decoded and summarised, and the summary cached beside it (unless a damaged
/// one is kept as evidence).
pub fn part_digest(part: &Path, rank: u32) -> Result<PartSummarised> {
    let len = std::fs::metadata(part)
        .with_context(|| format!("reading {}", part.display()))?
        .len();
    let summary_damage = match super::read_local(part, len) {
        Ok(Some(digest)) => {
            return Ok(PartSummarised {
                digest,
                len,
                decoded: false,
                summary_damage: None,
            });
        }
        Ok(None) => None,
        Err(e) => Some((super::summary_shown(part), format!("{e:#}"))),
    };
    let bytes = std::fs::read(part).with_context(|| format!("reading {}", part.display()))?;
    let data = crate::decode::decode_part(bytes.into(), rank, super::COLUMNS, 0)?;
    let digest = PartDigest::of_data(&data);
    if summary_damage.is_none()
        && let Err(e) = super::write_local(part, len, &digest)
    {
        tracing::debug!("not caching the summary of {}: {e:#}", part.display());
    }
    Ok(PartSummarised {
        digest,
        len,
        decoded: true,
        summary_damage,
    })
}
