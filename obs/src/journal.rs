//! A rank's open journal: one Arrow IPC stream file (`journal-<N>.arrows`) that the recorder
//! appends a record batch to every `flush_interval`, and that is compacted into part N
//! (`part-<N>.parquet`) every `rotate_interval` and when recording finishes.
//!
//! The stream starts with the part schema, whose metadata is the footer ([`PartHeader`]
//! key-values, `titan.part` = N); every flush appends the batch's dictionaries and the batch
//! (zstd-compressed buffers) and flushes the file. A reader decodes up to the last complete
//! batch: a kill -9 mid-write leaves a torn tail that is reported, never an error.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use arrow::array::{Array, AsArray};
use arrow::buffer::Buffer;
use arrow::datatypes::{Int32Type, Schema};
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow::record_batch::RecordBatch;

use crate::location::journal_file_name;
use crate::part::{Footer, PartHeader, encode_batches};
use crate::schema::{arrow_schema, col};

/// The journal being appended to.
pub struct JournalWriter {
    path: PathBuf,
    index: u64,
    clock_offset_ns: i64,
    writer: StreamWriter<BufWriter<File>>,
    rows: u64,
    batches: u64,
}

impl JournalWriter {
    /// Creates `dir/journal-<index>.arrows` with the footer in the stream's schema metadata.
    pub fn create(dir: &Path, index: u64, header: &PartHeader) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(journal_file_name(index));
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let metadata: HashMap<String, String> = header
            .key_values(index)
            .into_iter()
            .filter_map(|kv| Some((kv.key, kv.value?)))
            .collect();
        let schema = Schema::new(arrow_schema().fields().clone()).with_metadata(metadata);
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(arrow::ipc::CompressionType::ZSTD))
            .context("zstd IPC compression")?;
        let mut writer = StreamWriter::try_new_with_options(BufWriter::new(file), &schema, options)
            .with_context(|| format!("writing the schema of {}", path.display()))?;
        writer
            .flush()
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(JournalWriter {
            path,
            index,
            clock_offset_ns: header.clock_offset_ns,
            writer,
            rows: 0,
            batches: 0,
        })
    }

    /// Appends one batch and hands it to the OS (a kill -9 after this loses nothing of it).
    pub fn append(&mut self, batch: &RecordBatch) -> Result<()> {
        self.writer
            .write(batch)
            .and_then(|()| self.writer.flush())
            .with_context(|| format!("appending to {}", self.path.display()))?;
        self.rows += batch.num_rows() as u64;
        self.batches += 1;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The part this journal becomes.
    pub fn index(&self) -> u64 {
        self.index
    }
    /// The clock offset written into its footer.
    pub fn clock_offset_ns(&self) -> i64 {
        self.clock_offset_ns
    }
    pub fn rows(&self) -> u64 {
        self.rows
    }
    pub fn batches(&self) -> u64 {
        self.batches
    }
}

/// Decodes a journal incrementally: fed the file's bytes in order (all at once or as they
/// are appended), it yields each record batch once it is complete.
#[derive(Debug, Default)]
pub struct JournalCursor {
    decoder: StreamDecoder,
    /// Bytes fed so far (= the file offset to read from next).
    pub offset: u64,
    /// Offset just past the last complete record batch.
    pub complete: u64,
    pub batches: u64,
    pub rows: u64,
    footer: Option<Footer>,
    /// The stream's first 8 bytes (to size the schema message).
    head: Vec<u8>,
}

impl JournalCursor {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next bytes of the file; calls `on_batch` for every batch they complete.
    pub fn feed(
        &mut self,
        bytes: bytes::Bytes,
        mut on_batch: impl FnMut(RecordBatch),
    ) -> Result<()> {
        let start = self.offset;
        let len = bytes.len();
        if self.head.len() < 8 {
            let take = (8 - self.head.len()).min(len);
            self.head.extend_from_slice(&bytes[..take]);
        }
        let mut buffer = Buffer::from(bytes);
        while !buffer.is_empty() {
            let batch = self.decoder.decode(&mut buffer).with_context(|| {
                format!(
                    "decoding the journal at byte {}",
                    start + (len - buffer.len()) as u64
                )
            })?;
            if self.footer.is_none()
                && let Some(schema) = self.decoder.schema()
            {
                let kv: HashMap<String, String> = schema
                    .metadata()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                self.footer = Some(Footer::parse(&kv).context("the journal's footer")?);
            }
            if let Some(batch) = batch {
                self.complete = start + (len - buffer.len()) as u64;
                self.batches += 1;
                self.rows += batch.num_rows() as u64;
                on_batch(batch);
            }
        }
        self.offset = start + len as u64;
        Ok(())
    }

    /// The footer from the stream's schema, once the schema was read.
    pub fn footer(&self) -> Option<&Footer> {
        self.footer.as_ref()
    }

    /// Bytes after the last complete message that ends a batch (or the schema): a batch
    /// still being written, or a torn tail when the writer is gone.
    pub fn pending(&self) -> u64 {
        // The decoder finishes a message (the schema too) only when the next bytes arrive,
        // so a stream that is just its schema counts the schema as complete by its length.
        let schema_end = schema_message_len(&self.head)
            .filter(|&n| n <= self.offset)
            .unwrap_or(0);
        self.offset - self.complete.max(schema_end)
    }
}

/// Length of the schema message a stream starts with (continuation marker, length, flatbuffer).
fn schema_message_len(head: &[u8]) -> Option<u64> {
    let word = |i: usize| {
        head.get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    match word(0)? {
        0xFFFF_FFFF => Some(8 + word(4)? as u64),
        len => Some(4 + len as u64),
    }
}

/// A whole journal read from its file.
pub struct JournalContents {
    pub footer: Footer,
    pub batches: Vec<RecordBatch>,
    /// Bytes after the last complete batch (a torn tail after a kill -9), ignored.
    pub torn_bytes: u64,
}

/// Reads every complete batch of the journal at `path`.
pub fn read_journal(path: &Path) -> Result<JournalContents> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut cursor = JournalCursor::new();
    let mut batches = Vec::new();
    cursor
        .feed(bytes::Bytes::from(bytes), |b| batches.push(b))
        .with_context(|| format!("reading {}", path.display()))?;
    let torn_bytes = cursor.pending();
    if cursor.footer().is_none() && torn_bytes == 0 {
        // Just the schema: the decoder completes a message when more bytes come; an
        // end-of-stream marker is such bytes.
        cursor.feed(
            bytes::Bytes::from_static(&[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]),
            |_| (),
        )?;
    }
    let footer = cursor
        .footer()
        .cloned()
        .with_context(|| format!("{}: the journal's schema is cut short", path.display()))?;
    Ok(JournalContents {
        footer,
        torn_bytes,
        batches,
    })
}

/// Compacts a journal's batches into one Parquet part (same schema and footer as parts
/// written directly); thread names come from the records themselves.
pub fn compact(contents: &JournalContents, index: u64) -> Result<Vec<u8>> {
    let mut header = contents.footer.header.clone();
    for batch in &contents.batches {
        thread_names(batch, &mut header.threads);
    }
    encode_batches(&contents.batches, &header, index)
}

/// Adds the (thread id -> name) pairs a batch's `thread_name` dictionary uses.
pub fn thread_names(batch: &RecordBatch, out: &mut BTreeMap<u32, String>) {
    let Some(dict) = batch
        .column_by_name(col::THREAD_NAME)
        .and_then(|c| c.as_dictionary_opt::<Int32Type>())
    else {
        return;
    };
    let Some(values) = dict.values().as_string_opt::<i32>() else {
        return;
    };
    let mut seen = vec![false; values.len()];
    for k in dict.keys().iter().flatten() {
        if let Some(s) = seen.get_mut(k as usize)
            && !*s
        {
            *s = true;
            out.entry(k as u32)
                .or_insert_with(|| values.value(k as usize).to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::part::{PartBuilder, Row};
    use crate::schema::Kind;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReader;

    fn header() -> PartHeader {
        PartHeader {
            run_id: "j".into(),
            source: "trainer".into(),
            host: "h".into(),
            rank: 3,
            local_rank: 3,
            world_size: 4,
            pid: 7,
            clock_offset_ns: -42,
            threads: BTreeMap::new(),
            run_metadata: Default::default(),
        }
    }

    fn batch(builder: &mut PartBuilder, h: &PartHeader, from: u64, n: u64) -> RecordBatch {
        for seq in from..from + n {
            builder.push(&Row {
                thread: (seq % 2) as u32,
                seq,
                kind: if seq % 5 == 0 {
                    Kind::Scalar
                } else {
                    Kind::Span
                },
                name: ["forward", "backward", "optimizer"][(seq % 3) as usize],
                step: (seq > 2).then_some(seq / 7),
                start_ns: seq as i64 * 1000,
                dur_ns: (seq % 5 != 0).then_some(seq as i64),
                value: (seq % 5 == 0).then_some(seq as f64 / 3.0),
                reduce: (seq % 5 == 0).then_some(crate::Reduce::Max),
                depth: (seq % 3) as u16,
                parent: (seq % 3 != 0).then_some(seq - 1),
                tags: if seq % 7 == 0 { &["checkpoint"] } else { &[] },
                message: None,
            });
        }
        let mut h = h.clone();
        h.threads = BTreeMap::from([(0, "main".into()), (1, "dataloader".into())]);
        builder.finish(&h).unwrap()
    }

    /// Logical (dictionary-free) columns, so batches with different dictionaries compare.
    fn logical(batches: &[RecordBatch]) -> Vec<arrow::array::ArrayRef> {
        let schema = arrow_schema();
        let b: Vec<RecordBatch> = batches
            .iter()
            .map(|b| RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap())
            .collect();
        let all = arrow::compute::concat_batches(&schema, &b).unwrap();
        all.columns()
            .iter()
            .map(|c| match c.data_type() {
                arrow::datatypes::DataType::Dictionary(_, v) => arrow::compute::cast(c, v).unwrap(),
                _ => c.clone(),
            })
            .collect()
    }

    #[test]
    fn compaction_equals_the_journal_record_for_record() {
        let dir = tempfile::tempdir().unwrap();
        let h = header();
        let mut w = JournalWriter::create(dir.path(), 5, &h).unwrap();
        let mut builder = PartBuilder::new();
        let mut written = Vec::new();
        let mut from = 1;
        for n in [10, 1, 300, 57] {
            let b = batch(&mut builder, &h, from, n);
            from += n;
            w.append(&b).unwrap();
            written.push(b);
        }
        assert_eq!((w.batches(), w.rows()), (4, 368));
        let path = w.path().to_path_buf();
        drop(w);
        let contents = read_journal(&path).unwrap();
        assert_eq!(contents.torn_bytes, 0);
        assert_eq!(contents.footer.part, Some(5));
        assert_eq!(contents.footer.header.clock_offset_ns, -42);
        assert_eq!(logical(&contents.batches), logical(&written));
        let part = compact(&contents, 5).unwrap();
        let from_part: Vec<RecordBatch> =
            ParquetRecordBatchReader::try_new(bytes::Bytes::from(part.clone()), 1 << 20)
                .unwrap()
                .map(|b| b.unwrap())
                .collect();
        assert_eq!(logical(&from_part), logical(&written));
        // The same footer as a part written directly, with the threads the records name.
        let reader =
            parquet::file::serialized_reader::SerializedFileReader::new(bytes::Bytes::from(part))
                .unwrap();
        use parquet::file::reader::FileReader;
        let kv: HashMap<String, String> = reader
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .unwrap()
            .iter()
            .filter_map(|k| Some((k.key.clone(), k.value.clone()?)))
            .collect();
        let f = Footer::parse(&kv).unwrap();
        assert_eq!(f.part, Some(5));
        assert_eq!(
            (f.header.rank, f.header.world_size, f.header.pid),
            (3, 4, 7)
        );
        assert_eq!(
            f.header.threads,
            BTreeMap::from([(0, "main".into()), (1, "dataloader".into())])
        );
    }

    #[test]
    fn a_torn_tail_is_counted_not_an_error_and_feeding_in_pieces_works() {
        let dir = tempfile::tempdir().unwrap();
        let h = header();
        let mut w = JournalWriter::create(dir.path(), 0, &h).unwrap();
        let mut builder = PartBuilder::new();
        let after_schema = std::fs::metadata(w.path()).unwrap().len();
        w.append(&batch(&mut builder, &h, 1, 20)).unwrap();
        let after_one = std::fs::metadata(w.path()).unwrap().len();
        w.append(&batch(&mut builder, &h, 21, 20)).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        let bytes = std::fs::read(&path).unwrap();
        // Only the schema: complete, nothing pending.
        let mut c = JournalCursor::new();
        c.feed(
            bytes::Bytes::copy_from_slice(&bytes[..after_schema as usize]),
            |_| (),
        )
        .unwrap();
        assert_eq!((c.batches, c.pending()), (0, 0));
        std::fs::write(&path, &bytes[..after_schema as usize]).unwrap();
        let j = read_journal(&path).unwrap();
        assert_eq!(
            (j.batches.len(), j.torn_bytes, j.footer.header.rank),
            (0, 0, 3)
        );
        // Cut inside the second batch: one batch, the rest pending.
        let cut = bytes.len() - 9;
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let j = read_journal(&path).unwrap();
        assert_eq!(j.batches.len(), 1);
        assert_eq!(j.torn_bytes, cut as u64 - after_one);
        // Fed a byte at a time, the cursor yields the same batches.
        let mut c = JournalCursor::new();
        let mut n = 0;
        for b in &bytes {
            c.feed(bytes::Bytes::copy_from_slice(&[*b]), |_| n += 1)
                .unwrap();
        }
        assert_eq!((n, c.rows, c.pending()), (2, 40, 0));
    }
}
