//! The rank summary file (`obs/SCHEMA.md`, "Per-rank summaries"): magic, version, the body's
//! length and CRC-32C, then the body: per segment the parts it covers and its digest in the
//! per-part summary encoding. A file that does not check out is an error naming what is
//! wrong (never a panic); one of another version is [`super::file::Outdated`] (rebuilt).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};

use super::file::{Outdated, Reader, Writer, check_head, checked_body, framed};
use super::rank::{CoveredPart, RankDigest, Segment};

/// The rank summary's name in its rank folder (not a part's: listings do not take it for one).
pub const RANK_SUMMARY_FILE: &str = "rank.summary";

const MAGIC: &[u8; 8] = b"TOBSRNK1";
// 2: the part summaries inside are version 3 (issue 39's step time).
const VERSION: u32 = 2;
/// magic, version, body length, body CRC-32C.
const HEADER: usize = 8 + 4 + 8 + 4;

/// `rank.summary` in the rank folder `dir`.
pub fn rank_summary_path(dir: &Path) -> PathBuf {
    dir.join(RANK_SUMMARY_FILE)
}

/// Encodes a rank summary.
pub fn encode(d: &RankDigest) -> Result<Vec<u8>> {
    let mut w = Writer(Vec::with_capacity(64 * 1024));
    w.u(d.segments.len() as u64);
    let mut prev = 0u64;
    for s in &d.segments {
        w.u(s.parts.len() as u64);
        for p in &s.parts {
            w.u(p.index.wrapping_sub(prev));
            prev = p.index;
            w.u(p.len);
            if p.damage.is_empty() {
                w.bytes(&[]);
            } else {
                w.bytes(serde_json::to_string(&p.damage)?.as_bytes());
            }
        }
        w.bytes(&super::file::encode(&s.digest, 0)?);
    }
    Ok(framed(MAGIC, VERSION, &w.0))
}

/// Decodes a rank summary. Every count is checked against the bytes there are and part
/// indices must increase: a damaged file is an error, never a panic.
pub fn decode(bytes: &[u8]) -> Result<RankDigest> {
    check_head(bytes, MAGIC, "rank summary", HEADER, VERSION)?;
    let body = checked_body(bytes, HEADER, 12)?;
    let mut r = Reader(body);
    let mut d = RankDigest::default();
    let mut last: Option<u64> = None;
    for _ in 0..r.count(2)? {
        let mut parts = Vec::new();
        for _ in 0..r.count(3)? {
            let index = last.unwrap_or(0).wrapping_add(r.u()?);
            ensure!(
                last.is_none_or(|l| index > l),
                "part {index} listed after part {}",
                last.unwrap_or(0)
            );
            last = Some(index);
            let len = r.u()?;
            let damage = match r.bytes()? {
                [] => Vec::new(),
                json => serde_json::from_slice(json)
                    .with_context(|| format!("part {index}'s damage is not JSON"))?,
            };
            parts.push(CoveredPart { index, len, damage });
        }
        ensure!(!parts.is_empty(), "a segment without parts");
        let mut digest = super::file::decode(r.bytes()?, 0).context("a segment's digest")?;
        ensure!(digest.damage.is_empty(), "a segment's digest holds damage");
        digest.info.parts = parts.len();
        d.segments.push(Segment { parts, digest });
    }
    ensure!(r.0.is_empty(), "{} bytes after the last segment", r.0.len());
    Ok(d)
}

/// Reads the rank summary of the rank folder `dir`: `Ok(None)` when there is none or one of
/// another version; `Err` (naming the file) when it is damaged.
pub fn read_local(dir: &Path) -> Result<Option<RankDigest>> {
    let path = rank_summary_path(dir);
    let Some(bytes) = crate::sidecar::read_if_present(&path)? else {
        return Ok(None);
    };
    match decode(&bytes) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.is::<Outdated>() => Ok(None),
        Err(e) => Err(e.context(format!("{} is damaged", path.display()))),
    }
}

/// Writes the rank summary of the rank folder `dir` atomically.
pub fn write_local(dir: &Path, d: &RankDigest) -> Result<()> {
    crate::sidecar::write_atomic(&rank_summary_path(dir), &encode(d)?)
}
