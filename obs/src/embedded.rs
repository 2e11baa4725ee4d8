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
//!
//! Here: the entries computed from a part's batches when it is encoded, and the tools that
//! move them out of a part ([`split_out`]). The base64 framing is `footer.rs`'s; reading the
//! entries back is the summaries' and detail levels' own (`digest::from_footer`,
//! `lod::from_footer`), below this module.

use anyhow::{Context, Result};
use arrow_array::RecordBatch;
use parquet::file::metadata::{KeyValue, ParquetMetaDataReader};

use crate::digest::PartDigest;
use crate::footer::{Footer, embed, key_values_of};
use crate::lod::PartDetail;
use crate::schema::meta;

/// The footer entries embedding the summary and detail levels of the part made of `batches`
/// with `footer`: computed from the batches as a reader computes them from the part.
pub(crate) fn key_values(batches: &[RecordBatch], footer: &Footer) -> Result<Vec<KeyValue>> {
    let data = crate::decode::decode_batches(batches, footer, crate::digest::COLUMNS)
        .context("summarising the part")?;
    let digest = PartDigest::of_data(&data);
    let detail = PartDetail::of_data(&data);
    Ok(vec![
        embed(meta::SUMMARY, &crate::digest::encode(&digest, 0)?),
        embed(meta::DETAIL, &crate::lod::encode(&detail, 0)),
    ])
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
    let digest = crate::digest::from_footer(&kv)?.context("no summary in its footer")?;
    let detail = crate::lod::from_footer(&kv)?.context("no detail levels in its footer")?;
    let plain = reencode(bytes, |kv| {
        kv.retain(|k| k.key != meta::SUMMARY && k.key != meta::DETAIL)
    })?;
    let len = plain.len() as u64;
    crate::sidecar::write_atomic(part, &plain)?;
    crate::digest::write_local(part, len, &digest)?;
    crate::lod::write_local(part, len, &detail)
}
