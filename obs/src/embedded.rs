//! A part's summary and detail levels inside the part (issue 42): two entries of its Parquet
//! footer's key-value metadata, `titan.summary` and `titan.lod`, each the standard base64 of
//! the sidecar file's encoding (`obs/SCHEMA.md`, "Per-part summaries" and "Detail levels") made
//! for a part of length 0 — the file that holds them. A part is then one file: a day-long
//! rank leaves 144 parts and its `rank.summary`, not three files per part.
//!
//! Base64 because Parquet's key-value values are strings (UTF-8 in every reader); it costs a
//! third more than the binary sidecars, in a footer every reader of the part reads anyway.
//! Parts written before (`part-<N>.summary` / `.lod` beside them) are still read: readers look
//! for the sidecar first, then the footer.

use std::collections::HashMap;

use anyhow::{Context, Result};
use arrow::record_batch::RecordBatch;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use parquet::file::metadata::{KeyValue, ParquetMetaDataReader};

use crate::digest::PartDigest;
use crate::lod::PartDetail;
use crate::part::Footer;
use crate::schema::meta;

/// The footer entries embedding the summary and detail levels of the part made of `batches`
/// with `footer`: computed from the batches as a reader computes them from the part.
pub(crate) fn key_values(batches: &[RecordBatch], footer: &Footer) -> Result<Vec<KeyValue>> {
    let data = crate::decode::decode_batches(batches, footer, crate::digest::COLUMNS)
        .context("summarising the part")?;
    let digest = PartDigest::of_data(&data);
    let detail = PartDetail::of_data(&data);
    Ok(vec![
        KeyValue::new(
            meta::SUMMARY.to_string(),
            STANDARD.encode(crate::digest::encode(&digest, 0)?),
        ),
        KeyValue::new(
            meta::DETAIL.to_string(),
            STANDARD.encode(crate::lod::encode(&detail, 0)),
        ),
    ])
}

/// The summary in a part footer's key-values: `Ok(None)` when it has none (a part written
/// before them) or one of an older version (rebuilt from the part, as a missing one); `Err`
/// when it is damaged.
pub fn summary(kv: &HashMap<String, String>) -> Result<Option<PartDigest>> {
    let Some(bytes) = entry(kv, meta::SUMMARY)? else {
        return Ok(None);
    };
    match crate::digest::decode(&bytes, 0) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.is::<crate::digest::file::Outdated>() => Ok(None),
        Err(e) => Err(e.context(format!("its footer's `{}`", meta::SUMMARY))),
    }
}

/// The detail levels in a part footer's key-values: `Ok(None)` when it has none; `Err` when
/// they are damaged.
pub fn detail(kv: &HashMap<String, String>) -> Result<Option<PartDetail>> {
    let Some(bytes) = entry(kv, meta::DETAIL)? else {
        return Ok(None);
    };
    // No context of its own: the TUI shows the message in its title bar, where it must stay
    // short; callers name the part.
    crate::lod::decode(&bytes, 0).map(Some)
}

fn entry(kv: &HashMap<String, String>, key: &str) -> Result<Option<Vec<u8>>> {
    kv.get(key)
        .map(|v| {
            STANDARD
                .decode(v)
                .with_context(|| format!("its footer's `{key}` is not base64"))
        })
        .transpose()
}

/// The footer key-values of an encoded part held in memory.
pub(crate) fn key_values_of(part: &bytes::Bytes) -> Result<HashMap<String, String>> {
    let meta = crate::guard::guarded(|| {
        ParquetMetaDataReader::new()
            .parse_and_finish(part)
            .context("invalid Parquet footer")
    })
    .unwrap_or_else(|panic| anyhow::bail!("the Parquet reader failed on it ({panic})"))?;
    Ok(kv_map(meta.file_metadata()))
}

/// How much of the end of a part a footer read asks for first: footers are a few kB plus the
/// embedded summary and detail levels (~10 kB in the benchmark's parts; more with a large run
/// config), so one read usually holds the whole of it.
pub const FOOTER_READ: u64 = 64 << 10;

/// The end of a part, parsed.
pub enum Tail {
    /// The footer's key-values.
    Footer(HashMap<String, String>),
    /// The footer needs this many bytes from the end.
    NeedMore(u64),
}

/// Parses the footer in `tail`, the last bytes of a part of `len` bytes.
pub fn parse_tail(tail: &bytes::Bytes, len: u64) -> Result<Tail> {
    use parquet::errors::ParquetError;
    let mut reader = ParquetMetaDataReader::new();
    match crate::guard::guarded(|| reader.try_parse_sized(tail, len))
        .unwrap_or_else(|p| Err(ParquetError::General(p)))
    {
        Ok(()) => Ok(Tail::Footer(kv_map(reader.finish()?.file_metadata()))),
        Err(ParquetError::NeedMoreData(n)) => Ok(Tail::NeedMore(n as u64)),
        Err(e) => Err(e.into()),
    }
}

/// A footer's key-value metadata as a map (entries without a value left out).
pub(crate) fn kv_map(meta: &parquet::file::metadata::FileMetaData) -> HashMap<String, String> {
    meta.key_value_metadata()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|k| Some((k.key.clone(), k.value.clone()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// The part `part` written again with its footer's key-values edited by `edit` (the records
/// and the rest of the footer unchanged): for tools and tests, e.g. a part in the layout
/// before issue 42 (see [`split_out`]) or one whose embedded summary is damaged.
pub fn reencode(part: bytes::Bytes, edit: impl FnOnce(&mut Vec<KeyValue>)) -> Result<Vec<u8>> {
    use parquet::arrow::ArrowWriter;
    use parquet::basic::{Compression, ZstdLevel};
    use parquet::file::properties::WriterProperties;
    let meta = ParquetMetaDataReader::new()
        .parse_and_finish(&part)
        .context("invalid Parquet footer")?;
    let mut kv = meta
        .file_metadata()
        .key_value_metadata()
        .cloned()
        .unwrap_or_default();
    edit(&mut kv);
    let (_, batches) = crate::decode::read_part(part)?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_dictionary_enabled(true)
        .set_key_value_metadata(Some(kv))
        .build();
    let mut out = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut out, crate::schema::arrow_schema(), Some(props))?;
    for b in &batches {
        writer.write(&RecordBatch::try_new(
            crate::schema::arrow_schema(),
            b.columns().to_vec(),
        )?)?;
    }
    writer.close()?;
    Ok(out)
}

/// Turns the local part `part` into the layout before issue 42: its summary and detail levels
/// taken out of its footer and written beside it (`part-<N>.summary`, `part-<N>.lod`).
pub fn split_out(part: &std::path::Path) -> Result<()> {
    let bytes = bytes::Bytes::from(
        std::fs::read(part).with_context(|| format!("reading {}", part.display()))?,
    );
    let kv = key_values_of(&bytes)?;
    let digest = summary(&kv)?.context("no summary in its footer")?;
    let detail = detail(&kv)?.context("no detail levels in its footer")?;
    let plain = reencode(bytes, |kv| {
        kv.retain(|k| k.key != meta::SUMMARY && k.key != meta::DETAIL)
    })?;
    let len = plain.len() as u64;
    crate::sidecar::write_atomic(part, &plain)?;
    crate::digest::write_local(part, len, &digest)?;
    crate::lod::write_local(part, len, &detail)
}
