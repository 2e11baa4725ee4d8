//! Decoding record batches (from a Parquet part or a journal) into a [`PartData`]: the
//! footer into [`RankInfo`], the columns into typed tables, one function per record kind.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, UInt16Type, UInt32Type, UInt64Type};
use arrow_array::{
    Array, DictionaryArray, Float64Array, Int64Array, ListArray, StringArray, UInt16Array,
    UInt32Array, UInt64Array,
};
use arrow_array::{ArrowPrimitiveType, PrimitiveArray};
use bytes::Bytes;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReaderBuilder, RowSelection, RowSelector};
use parquet::file::metadata::FileMetaData;

use crate::footer::Footer;
use crate::journal::{JournalCursor, SkippedRange, thread_names};
use crate::record::NO_STEP;
use crate::schema::{Kind, PipelineSlot, Reduce, col};
use crate::tables::{Columns, PartData, RankInfo, RecordTable, SharedColumns};

/// The reader's view of a footer.
pub(crate) fn rank_info(footer: &Footer) -> RankInfo {
    RankInfo {
        header: footer.header.clone(),
        parts: 1,
    }
}

fn check_rank(footer: &Footer, dir_rank: u32) -> Result<()> {
    if footer.header.rank != dir_rank {
        bail!(
            "footer says rank {} but the file is in rank-{dir_rank}",
            footer.header.rank
        );
    }
    Ok(())
}

/// The columns [`Columns`] asks for, in schema order of need.
fn wanted_columns(c: Columns) -> Vec<&'static str> {
    let mut wanted = vec![
        col::KIND,
        col::NAME,
        col::STEP,
        col::DUR_NS,
        col::VALUE,
        col::REDUCE,
    ];
    if c.start {
        wanted.push(col::START_NS);
    }
    if c.thread {
        wanted.push(col::THREAD);
    }
    if c.depth {
        wanted.push(col::DEPTH);
    }
    if c.links {
        wanted.extend([col::SEQ, col::PARENT]);
    }
    if c.tags {
        wanted.push(col::TAGS);
    }
    if c.messages {
        wanted.push(col::MESSAGE);
    }
    wanted
}

/// Columns added after schema version 1: read when asked for and present, null otherwise.
fn wanted_if_present(c: Columns) -> Vec<&'static str> {
    if c.pipeline {
        vec![col::MICROBATCH, col::STAGE]
    } else {
        Vec::new()
    }
}

/// Decodes a Parquet part of `dir_rank`, skipping its first `skip_rows` rows (already read
/// from the journal it was compacted from).
pub(crate) fn decode_part(
    bytes: Bytes,
    dir_rank: u32,
    columns: Columns,
    skip_rows: u64,
) -> Result<PartData> {
    // The parquet reader validates what it reads, but a damaged file must never take the
    // whole analysis down: should it panic on one anyway, that part is reported corrupt.
    crate::guard::guarded(|| decode_part_unguarded(bytes, dir_rank, columns, skip_rows))
        .unwrap_or_else(|panic| bail!("the Parquet reader failed on it ({panic}): it is damaged"))
}

fn decode_part_unguarded(
    bytes: Bytes,
    dir_rank: u32,
    columns: Columns,
    skip_rows: u64,
) -> Result<PartData> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).context("invalid Parquet")?;
    let file_meta = builder.metadata().file_metadata();
    let total_rows = file_meta.num_rows().max(0) as usize;
    let footer = footer_of(file_meta)?;
    check_rank(&footer, dir_rank)?;
    let schema = builder.schema().clone();
    let mut roots = Vec::new();
    for w in wanted_columns(columns) {
        roots.push(
            schema
                .index_of(w)
                .map_err(|_| anyhow::anyhow!("column `{w}` is missing"))?,
        );
    }
    roots.extend(
        wanted_if_present(columns)
            .into_iter()
            .filter_map(|w| schema.index_of(w).ok()),
    );
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let mut builder = builder.with_projection(mask).with_batch_size(64 * 1024);
    let skip = (skip_rows as usize).min(total_rows);
    if skip > 0 {
        builder = builder.with_row_selection(RowSelection::from(vec![
            RowSelector::skip(skip),
            RowSelector::select(total_rows - skip),
        ]));
    }
    let reader = builder.build().context("opening the Parquet reader")?;
    let mut out = PartData {
        info: rank_info(&footer),
        damage: footer.damage.clone(),
        ..Default::default()
    };
    let mut dicts = Dicts::default();
    for batch in reader {
        let batch = batch.context("decoding a row group")?;
        decode_batch(&batch, footer.header.rank, columns, &mut dicts, &mut out)?;
    }
    Ok(out)
}

/// Record batches about to be written as a part with `footer`, decoded as a reader decodes
/// the part: what the summary and detail levels embedded in it are made of, without reading
/// the encoded part back.
pub(crate) fn decode_batches(
    batches: &[RecordBatch],
    footer: &Footer,
    columns: Columns,
) -> Result<PartData> {
    let mut out = PartData {
        info: rank_info(footer),
        damage: footer.damage.clone(),
        ..Default::default()
    };
    let mut dicts = Dicts::default();
    for batch in batches {
        decode_batch(batch, footer.header.rank, columns, &mut dicts, &mut out)?;
    }
    Ok(out)
}

/// What one journal read decoded.
pub(crate) struct JournalRead {
    pub(crate) data: PartData,
    pub(crate) batches: u64,
    /// Damaged ranges skipped by this read.
    pub(crate) damage: Vec<SkippedRange>,
}

/// A part's footer, from its Parquet key-value metadata.
pub(crate) fn footer_of(meta: &FileMetaData) -> Result<Footer> {
    Footer::parse(&crate::footer::kv_map(meta))
}

/// A whole Parquet part as it was written: its footer and its record batches, every column
/// (one batch per row group). For tools and tests that handle a part's records as Arrow.
pub fn read_part(bytes: Bytes) -> Result<(Footer, Vec<RecordBatch>)> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).context("invalid Parquet")?;
    let footer = footer_of(builder.metadata().file_metadata())?;
    let batches = builder
        .with_batch_size(1 << 20)
        .build()
        .context("opening the Parquet reader")?
        .collect::<Result<Vec<_>, _>>()
        .context("decoding a row group")?;
    Ok((footer, batches))
}

/// Feeds the journal bytes that follow `cursor.offset` (and its checks file's new bytes) and
/// decodes every batch they complete. The footer comes from the stream's schema. `at_end`:
/// the writer is gone, so bytes without a check are decoded unchecked.
pub(crate) fn decode_journal(
    cursor: &mut JournalCursor,
    bytes: Bytes,
    checks: Option<Bytes>,
    dir_rank: u32,
    columns: Columns,
    at_end: bool,
) -> Result<JournalRead> {
    let mut batches = Vec::new();
    cursor.feed_checks(checks.as_deref());
    cursor.feed(bytes, |b| batches.push(b))?;
    if at_end {
        cursor.finish(|b| batches.push(b))?;
    }
    let damage = cursor.take_damage();
    let Some(footer) = cursor.footer() else {
        // Not even the schema yet: nothing to decode.
        return Ok(JournalRead {
            data: PartData::default(),
            batches: 0,
            damage,
        });
    };
    check_rank(footer, dir_rank)?;
    let mut out = PartData {
        info: rank_info(footer),
        ..Default::default()
    };
    let mut dicts = Dicts::default();
    for batch in &batches {
        thread_names(batch, &mut out.info.threads);
        decode_batch(batch, footer.header.rank, columns, &mut dicts, &mut out)?;
    }
    Ok(JournalRead {
        data: out,
        batches: batches.len() as u64,
        damage,
    })
}

/// Part-local name and tag ids, shared by the batches of one file.
#[derive(Default)]
struct Dicts {
    name_ids: HashMap<String, u32>,
    tag_ids: HashMap<String, u32>,
}

/// Optional column `name` as a primitive array of `T`, when asked for (`on`).
fn primitive<'a, T: ArrowPrimitiveType>(
    batch: &'a RecordBatch,
    on: bool,
    name: &str,
    type_name: &str,
) -> Result<Option<&'a PrimitiveArray<T>>> {
    if !on {
        return Ok(None);
    }
    batch
        .column_by_name(name)
        .with_context(|| format!("column `{name}` missing from batch"))?
        .as_primitive_opt::<T>()
        .with_context(|| format!("`{name}` is not {type_name}"))
        .map(Some)
}

/// A batch's columns, typed; optional ones are `None` when not asked for.
struct BatchColumns<'a> {
    kind_of_key: Vec<Kind>,
    kind_keys: &'a arrow_array::Int32Array,
    names: Vec<u32>,
    step: &'a UInt64Array,
    dur: &'a Int64Array,
    value: &'a Float64Array,
    reduce_keys: &'a arrow_array::Int32Array,
    /// Parsed lazily per key: a part whose rows are all non-scalars stores only nulls, and
    /// parquet may then hand back a placeholder dictionary (e.g. `[""]`) that no row uses.
    reduce_of_key: Vec<std::result::Result<Reduce, String>>,
    start: Option<&'a Int64Array>,
    thread: Option<&'a UInt32Array>,
    depth: Option<&'a UInt16Array>,
    seq: Option<&'a UInt64Array>,
    parent: Option<&'a UInt64Array>,
    tags: Option<&'a ListArray>,
    message: Option<&'a StringArray>,
    /// Asked for; `None` inside when the file predates the columns.
    pipeline: Option<Option<(&'a UInt16Array, &'a UInt16Array)>>,
}

impl<'a> BatchColumns<'a> {
    fn new(
        batch: &'a RecordBatch,
        c: Columns,
        dicts: &mut Dicts,
        names_out: &mut Vec<String>,
    ) -> Result<Self> {
        let get = |name: &str| {
            batch
                .column_by_name(name)
                .with_context(|| format!("column `{name}` missing from batch"))
        };
        let optional = |on: bool, name: &str| if on { get(name).map(Some) } else { Ok(None) };
        let kind_dict = get(col::KIND)?
            .as_dictionary_opt::<Int32Type>()
            .context("`kind` is not dictionary<int32, utf8>")?;
        let kind_values = kind_dict
            .values()
            .as_string_opt::<i32>()
            .context("`kind` values are not utf8")?;
        let reduce_dict = get(col::REDUCE)?
            .as_dictionary_opt::<Int32Type>()
            .context("`reduce` is not dictionary<int32, utf8>")?;
        let reduce_values = reduce_dict
            .values()
            .as_string_opt::<i32>()
            .context("`reduce` values are not utf8")?;
        Ok(BatchColumns {
            kind_of_key: (0..kind_values.len())
                .map(|i| kind_values.value(i).parse().map_err(anyhow::Error::msg))
                .collect::<Result<_>>()?,
            kind_keys: kind_dict.keys(),
            names: dict_to_local(get(col::NAME)?, &mut dicts.name_ids, names_out)?,
            step: get(col::STEP)?
                .as_primitive_opt::<UInt64Type>()
                .context("`step` is not uint64")?,
            dur: get(col::DUR_NS)?
                .as_any()
                .downcast_ref::<Int64Array>()
                .context("`dur_ns` is not int64")?,
            value: get(col::VALUE)?
                .as_any()
                .downcast_ref::<Float64Array>()
                .context("`value` is not float64")?,
            reduce_keys: reduce_dict.keys(),
            reduce_of_key: (0..reduce_values.len())
                .map(|i| reduce_values.value(i).parse())
                .collect(),
            start: primitive::<Int64Type>(batch, c.start, col::START_NS, "int64")?,
            thread: primitive::<UInt32Type>(batch, c.thread, col::THREAD, "uint32")?,
            depth: primitive::<UInt16Type>(batch, c.depth, col::DEPTH, "uint16")?,
            seq: primitive::<UInt64Type>(batch, c.links, col::SEQ, "uint64")?,
            parent: primitive::<UInt64Type>(batch, c.links, col::PARENT, "uint64")?,
            tags: optional(c.tags, col::TAGS)?
                .map(|a| a.as_list_opt::<i32>().context("`tags` is not list<utf8>"))
                .transpose()?,
            message: optional(c.messages, col::MESSAGE)?
                .map(|a| a.as_string_opt::<i32>().context("`message` is not utf8"))
                .transpose()?,
            pipeline: if c.pipeline {
                let present = |name| batch.column_by_name(name).is_some();
                Some(if present(col::MICROBATCH) && present(col::STAGE) {
                    Some((
                        primitive::<UInt16Type>(batch, true, col::MICROBATCH, "uint16")?
                            .context("microbatch")?,
                        primitive::<UInt16Type>(batch, true, col::STAGE, "uint16")?
                            .context("stage")?,
                    ))
                } else {
                    None
                })
            } else {
                None
            },
        })
    }

    fn kind(&self, i: usize) -> Result<Kind> {
        if self.kind_keys.is_null(i) {
            bail!("row {i}: `kind` is null");
        }
        self.kind_of_key
            .get(self.kind_keys.value(i) as usize)
            .copied()
            .context("`kind` key out of range")
    }

    fn step(&self, i: usize) -> u64 {
        if self.step.is_null(i) {
            NO_STEP
        } else {
            self.step.value(i)
        }
    }

    fn parent(&self, i: usize) -> Option<u64> {
        self.parent
            .map(|p| if p.is_null(i) { 0 } else { p.value(i) })
    }

    fn reduce(&self, i: usize) -> Result<Reduce> {
        if self.reduce_keys.is_null(i) {
            return Ok(Reduce::Mean);
        }
        self.reduce_of_key
            .get(self.reduce_keys.value(i) as usize)
            .context("`reduce` key out of range")?
            .clone()
            .map_err(anyhow::Error::msg)
    }

    /// Bit mask (over the part's tags) of row `i`'s step tags.
    fn tag_mask(&self, i: usize, dicts: &mut Dicts, tags_out: &mut Vec<String>) -> Result<u64> {
        let Some(tags) = self.tags else { return Ok(0) };
        if tags.is_null(i) || tags.value_length(i) == 0 {
            return Ok(0);
        }
        let list = tags.value(i);
        let list = list
            .as_string_opt::<i32>()
            .context("`tags` items are not utf8")?;
        let mut mask = 0u64;
        for t in list.iter().flatten() {
            let id = crate::tables::intern(tags_out, &mut dicts.tag_ids, t);
            if id < 64 {
                mask |= 1 << id;
            }
        }
        Ok(mask)
    }
}

/// Appends one batch's rows to `out`, each to the table of its kind.
fn decode_batch(
    batch: &RecordBatch,
    rank: u32,
    c: Columns,
    dicts: &mut Dicts,
    out: &mut PartData,
) -> Result<()> {
    let cols = BatchColumns::new(batch, c, dicts, &mut out.names)?;
    out.rows += batch.num_rows();
    for i in 0..batch.num_rows() {
        let step = cols.step(i);
        if step != NO_STEP {
            let mask = cols.tag_mask(i, dicts, &mut out.tags)?;
            if mask != 0 {
                *out.step_tags.entry(step).or_default() |= mask;
            }
        }
        match cols.kind(i)? {
            Kind::Span => push_span(&cols, i, rank, step, out),
            Kind::Instant => push_instant(&cols, i, rank, step, out),
            Kind::Scalar => push_scalar(&cols, i, rank, step, out)?,
            Kind::Error => push_error(&cols, i, rank, step, out),
        }
    }
    Ok(())
}

/// Appends record `i`'s shared columns (those read, see [`SharedColumns`]) to a table.
fn push_shared(t: SharedColumns, cols: &BatchColumns, i: usize, rank: u32, step: u64) {
    t.rank.push(rank);
    t.name.push(cols.names[i]);
    t.step.push(step);
    if let Some(a) = cols.start {
        t.start_ns.push(a.value(i));
    }
    if let (Some(a), Some(c)) = (cols.thread, t.thread) {
        c.push(a.value(i));
    }
    if let (Some(a), Some(c)) = (cols.depth, t.depth) {
        c.push(a.value(i));
    }
    if let (Some(p), Some(c)) = (cols.parent(i), t.parent) {
        c.push(p);
    }
}

fn push_span(cols: &BatchColumns, i: usize, rank: u32, step: u64, out: &mut PartData) {
    let t = &mut out.spans;
    push_shared(t.shared_columns(), cols, i, rank, step);
    t.dur_ns.push(if cols.dur.is_null(i) {
        0
    } else {
        cols.dur.value(i)
    });
    // `seq` and `parent` are read together (`Columns::links`).
    if let Some(q) = cols.seq {
        t.seq.push(q.value(i));
    }
    if let Some(columns) = cols.pipeline {
        t.pipeline.push(columns.and_then(|(mb, stage)| {
            (mb.is_valid(i) && stage.is_valid(i)).then(|| PipelineSlot {
                microbatch: mb.value(i),
                stage: stage.value(i),
            })
        }));
    }
}

fn push_instant(cols: &BatchColumns, i: usize, rank: u32, step: u64, out: &mut PartData) {
    push_shared(out.instants.shared_columns(), cols, i, rank, step);
}

fn push_scalar(
    cols: &BatchColumns,
    i: usize,
    rank: u32,
    step: u64,
    out: &mut PartData,
) -> Result<()> {
    let t = &mut out.scalars;
    push_shared(t.shared_columns(), cols, i, rank, step);
    t.value.push(if cols.value.is_null(i) {
        f64::NAN
    } else {
        cols.value.value(i)
    });
    t.reduce.push(cols.reduce(i)?);
    Ok(())
}

fn push_error(cols: &BatchColumns, i: usize, rank: u32, step: u64, out: &mut PartData) {
    let t = &mut out.errors;
    push_shared(t.shared_columns(), cols, i, rank, step);
    if let Some(m) = cols.message {
        t.message.push(if m.is_null(i) {
            String::new()
        } else {
            m.value(i).to_string()
        });
    }
}

/// Maps a dictionary<int32, utf8> column to part-local ids, interning new values.
fn dict_to_local(
    array: &Arc<dyn Array>,
    ids: &mut HashMap<String, u32>,
    values_out: &mut Vec<String>,
) -> Result<Vec<u32>> {
    let dict: &DictionaryArray<Int32Type> = array
        .as_dictionary_opt::<Int32Type>()
        .context("expected a dictionary<int32, utf8> column")?;
    let values = dict
        .values()
        .as_string_opt::<i32>()
        .context("dictionary values are not utf8")?;
    let map: Vec<u32> = (0..values.len())
        .map(|i| crate::tables::intern(values_out, ids, values.value(i)))
        .collect();
    let keys = dict.keys();
    let mut out = Vec::with_capacity(keys.len());
    for i in 0..keys.len() {
        if keys.is_null(i) {
            bail!("row {i}: dictionary column is null");
        }
        out.push(
            *map.get(keys.value(i) as usize)
                .context("dictionary key out of range")?,
        );
    }
    Ok(out)
}
