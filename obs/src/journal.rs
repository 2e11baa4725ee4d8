//! A rank's open journal: one Arrow IPC stream file (`journal-<N>.arrows`) that the recorder
//! appends a record batch to every `flush_interval`, and that is compacted into part N
//! (`part-<N>.parquet`) every `rotate_interval` and when recording finishes.
//!
//! The stream starts with the part schema, whose metadata is the footer ([`PartHeader`]
//! key-values, `titan.part` = N); every flush appends the batch's dictionaries and the batch
//! (zstd-compressed buffers) and flushes the file. A reader decodes up to the last complete
//! batch: a kill -9 mid-write leaves a torn tail that is reported, never an error.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use arrow_array::Array;
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::Int32Type;
use arrow_buffer::Buffer;
use arrow_ipc::reader::StreamDecoder;
use arrow_ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions, write_message,
};
use arrow_schema::{Schema, SchemaRef};

use crate::footer::{Footer, PartHeader};
use crate::guard::guarded;
use crate::ipc_check::{Message, MessageKind, next_message};
use crate::location::journal_file_name;
use crate::schema::{arrow_schema, col};

/// First bytes of a journal's checks file (`journal-<N>.checks`).
pub const CHECKS_MAGIC: &[u8; 8] = b"TOBSCRC1";
/// Every this many flushes the journal sends all dictionaries again (a *keyframe*); in
/// between, only the dictionaries that changed, as a plain Arrow stream does. A damaged
/// range costs the batches up to the next keyframe (16 s at the default 2 s flush) — a
/// batch after it may use a dictionary the damaged range replaced — instead of every
/// flush carrying ~2.6 KB of dictionaries.
pub const KEYFRAME_EVERY: u64 = 8;

/// One check: the journal offset just past the range it covers (u64 LE), the CRC-32C of the
/// range's bytes (u32 LE), and the CRC-32C of those 12 bytes (u32 LE), so a damaged check
/// is told from a damaged range.
const CHECK_LEN: usize = 16;

fn check_entry(end: u64, crc: u32) -> [u8; CHECK_LEN] {
    let mut e = [0u8; CHECK_LEN];
    e[..8].copy_from_slice(&end.to_le_bytes());
    e[8..12].copy_from_slice(&crc.to_le_bytes());
    let own = crc32c::crc32c(&e[..12]);
    e[12..].copy_from_slice(&own.to_le_bytes());
    e
}

/// The checks file of a journal: `journal-<N>.checks` next to `journal-<N>.arrows`.
pub fn checks_path(journal: &Path) -> PathBuf {
    journal.with_extension("checks")
}

/// Removes a journal and its checks file (after compaction).
pub fn remove(journal: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(checks_path(journal)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::remove_file(journal)
}

/// The journal being appended to.
///
/// Every flush is one *range* of the stream — the dictionaries that changed (all of them
/// every [`KEYFRAME_EVERY`] flushes) and the batch — whose CRC-32C is appended to the checks
/// file before the range is appended to the journal: a reader that sees a range's bytes also
/// sees its check, and a damaged range costs the batches up to the next keyframe.
pub struct JournalWriter {
    path: PathBuf,
    index: u64,
    clock_offset_ns: i64,
    file: File,
    checks: File,
    schema: SchemaRef,
    options: IpcWriteOptions,
    /// The zstd compressor, kept between batches.
    context: IpcWriteContext,
    /// The dictionaries sent since the last keyframe.
    tracker: DictionaryTracker,
    /// Bytes written to the journal.
    len: u64,
    rows: u64,
    batches: u64,
}

impl JournalWriter {
    /// Creates `dir/journal-<index>.arrows` with the footer in the stream's schema metadata,
    /// and its checks file `journal-<index>.checks`.
    pub fn create(dir: &Path, index: u64, header: &PartHeader) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(journal_file_name(index));
        let create = |p: &Path| {
            File::options()
                .write(true)
                .create_new(true)
                .open(p)
                .with_context(|| format!("creating {}", p.display()))
        };
        // The checks file first: a reader that finds the journal finds its checks.
        let mut checks = create(&checks_path(&path))?;
        checks
            .write_all(CHECKS_MAGIC)
            .with_context(|| format!("writing the checks of {}", path.display()))?;
        let file = create(&path)?;
        let metadata: HashMap<String, String> = header
            .key_values(index)
            .into_iter()
            .filter_map(|kv| Some((kv.key, kv.value?)))
            .collect();
        let schema = std::sync::Arc::new(
            Schema::new(arrow_schema().fields().clone()).with_metadata(metadata),
        );
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(arrow_ipc::CompressionType::ZSTD))
            .context("zstd IPC compression")?;
        let mut w = JournalWriter {
            path,
            index,
            clock_offset_ns: header.clock_offset_ns,
            file,
            checks,
            schema,
            options,
            context: IpcWriteContext::default(),
            tracker: DictionaryTracker::new(false),
            len: 0,
            rows: 0,
            batches: 0,
        };
        let encoded = IpcDataGenerator::default().schema_to_bytes_with_dictionary_tracker(
            &w.schema,
            &mut w.tracker,
            &w.options,
        );
        let mut bytes = Vec::new();
        write_message(&mut bytes, encoded, &w.options).context("encoding the journal schema")?;
        w.commit(&bytes)
            .with_context(|| format!("writing the schema of {}", w.path.display()))?;
        Ok(w)
    }

    /// Appends one batch and hands it to the OS (a kill -9 after this loses nothing of it).
    pub fn append(&mut self, batch: &RecordBatch) -> Result<()> {
        let generator = IpcDataGenerator::default();
        if self.batches.is_multiple_of(KEYFRAME_EVERY) && self.batches > 0 {
            // A fresh tracker (its dictionary ids assigned by encoding the schema, as the
            // stream's were) sends every dictionary again: this range needs no earlier one.
            self.tracker = DictionaryTracker::new(false);
            generator.schema_to_bytes_with_dictionary_tracker(
                &self.schema,
                &mut self.tracker,
                &self.options,
            );
        }
        let (dictionaries, encoded) = generator
            .encode(batch, &mut self.tracker, &self.options, &mut self.context)
            .with_context(|| format!("encoding a batch for {}", self.path.display()))?;
        let mut bytes = Vec::new();
        for message in dictionaries.into_iter().chain(std::iter::once(encoded)) {
            write_message(&mut bytes, message, &self.options)
                .with_context(|| format!("encoding a batch for {}", self.path.display()))?;
        }
        self.commit(&bytes)
            .with_context(|| format!("appending to {}", self.path.display()))?;
        self.rows += batch.num_rows() as u64;
        self.batches += 1;
        Ok(())
    }

    /// Appends one range: its check first, then its bytes.
    fn commit(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let end = self.len + bytes.len() as u64;
        self.checks
            .write_all(&check_entry(end, crc32c::crc32c(bytes)))?;
        self.file.write_all(bytes)?;
        self.len = end;
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

/// A part of a journal that could not be decoded and was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRange {
    /// Offset of the damaged bytes in the journal.
    pub offset: u64,
    /// How many bytes were skipped.
    pub bytes: u64,
    /// What those bytes held, as far as can be told.
    pub lost: String,
    /// The same, counted.
    pub tally: Lost,
    /// Why they were skipped.
    pub reason: String,
}

/// One check read from the checks file: `crc` is `None` when the check itself is damaged
/// (its range is then decoded on the strength of the structural checks alone).
#[derive(Debug, Clone, Copy)]
struct Check {
    end: u64,
    crc: Option<u32>,
}

/// What is known about a journal's checks.
#[derive(Debug, Default)]
enum Checks {
    /// Nothing read yet.
    #[default]
    Unknown,
    /// A journal without a checks file (written before checks existed, or the file was
    /// lost): decoded message by message with structural checks, up to the first bad one.
    Absent,
    /// Read up to `read` bytes of the checks file; `staged` holds a partial entry.
    Present {
        read: u64,
        staged: Vec<u8>,
        queue: VecDeque<Check>,
        last_end: u64,
    },
}

/// Decodes a journal incrementally: fed the file's bytes in order (all at once or as they
/// are appended) and its checks, it yields each record batch once it is complete and
/// checked, and skips (and records in [`Self::take_damage`]) a range that is damaged.
#[derive(Debug, Default)]
pub struct JournalCursor {
    decoder: StreamDecoder,
    /// Bytes fed so far (= the file offset to read from next).
    pub offset: u64,
    /// Offset just past the last range decoded or skipped.
    pub complete: u64,
    pub batches: u64,
    pub rows: u64,
    footer: Option<Footer>,
    /// The journal's bytes from `complete` to `offset`, not yet decoded.
    staged: Vec<u8>,
    /// The schema message, to start a new decoder after a damaged range.
    schema_message: Vec<u8>,
    checks: Checks,
    /// An unchecked journal met a message it cannot decode: the rest is not read.
    stopped: bool,
    /// Every dictionary id the stream has sent.
    dictionary_ids: std::collections::BTreeSet<i64>,
    /// A range was skipped (at this offset): the ranges after it are decoded only from one
    /// that sends every dictionary again (a keyframe), since the skipped one may have
    /// replaced a dictionary that later ones use.
    resync_after: Option<u64>,
    damage: Vec<SkippedRange>,
}

impl JournalCursor {
    pub fn new() -> Self {
        Self::default()
    }

    /// The checks file's bytes to read next: from this offset to its end (`None` when the
    /// journal was found to have no checks file).
    pub fn checks_offset(&self) -> Option<u64> {
        match &self.checks {
            Checks::Unknown => Some(0),
            Checks::Absent => None,
            Checks::Present { read, .. } => Some(*read),
        }
    }

    /// Feeds the next bytes of the checks file (`None`: there is no checks file). Feed them
    /// before the journal bytes they cover: the writer appends a check before its range.
    pub fn feed_checks(&mut self, bytes: Option<&[u8]>) {
        let Some(mut bytes) = bytes else {
            if matches!(self.checks, Checks::Unknown) {
                self.checks = Checks::Absent;
            }
            return;
        };
        if matches!(self.checks, Checks::Unknown) {
            if bytes.len() < CHECKS_MAGIC.len() {
                // Not even the magic yet: the file was just created.
                return;
            }
            if &bytes[..CHECKS_MAGIC.len()] != CHECKS_MAGIC {
                self.damage.push(SkippedRange {
                    offset: 0,
                    bytes: 0,
                    lost: "nothing: the journal is read without its checks".into(),
                    tally: Lost::default(),
                    reason: "its checks file does not start with the checks magic".into(),
                });
                self.checks = Checks::Absent;
                return;
            }
            bytes = &bytes[CHECKS_MAGIC.len()..];
            self.checks = Checks::Present {
                read: CHECKS_MAGIC.len() as u64,
                staged: Vec::new(),
                queue: VecDeque::new(),
                last_end: 0,
            };
        }
        let Checks::Present {
            read,
            staged,
            queue,
            last_end,
        } = &mut self.checks
        else {
            return;
        };
        *read += bytes.len() as u64;
        staged.extend_from_slice(bytes);
        let whole = staged.len() / CHECK_LEN * CHECK_LEN;
        for e in staged[..whole].chunks_exact(CHECK_LEN) {
            let end = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
            let crc = u32::from_le_bytes(e[8..12].try_into().expect("4 bytes"));
            let own = u32::from_le_bytes(e[12..].try_into().expect("4 bytes"));
            let sound = own == crc32c::crc32c(&e[..12]) && end > *last_end;
            let after_damaged = queue.back().is_some_and(|c| c.end == u64::MAX);
            match (sound, after_damaged) {
                (true, false) => queue.push_back(Check {
                    end,
                    crc: Some(crc),
                }),
                // The range(s) of damaged checks end where this one does; what this check
                // covers starts at an unknown offset, so the whole stretch goes unchecked.
                (true, true) => *queue.back_mut().expect("checked") = Check { end, crc: None },
                (false, false) => queue.push_back(Check {
                    end: u64::MAX,
                    crc: None,
                }),
                (false, true) => {}
            }
            if sound {
                *last_end = end;
            }
        }
        staged.drain(..whole);
    }

    /// Feeds the next bytes of the journal; calls `on_batch` for every batch they complete.
    /// Damaged ranges are skipped and kept for [`Self::take_damage`]. An error means the
    /// journal cannot be read at all (its schema is damaged).
    pub fn feed(
        &mut self,
        bytes: bytes::Bytes,
        mut on_batch: impl FnMut(RecordBatch),
    ) -> Result<()> {
        self.offset += bytes.len() as u64;
        if self.stopped {
            return Ok(());
        }
        self.staged.extend_from_slice(&bytes);
        if matches!(self.checks, Checks::Unknown) {
            // Fed without looking for checks (a caller that reads only the journal).
            self.checks = Checks::Absent;
        }
        if let Checks::Present { queue, .. } = &mut self.checks {
            let mut ranges = Vec::new();
            while let Some(c) = queue.front() {
                if c.end > self.offset || c.end == u64::MAX {
                    break;
                }
                ranges.push(*c);
                queue.pop_front();
            }
            for c in ranges {
                if c.end <= self.complete {
                    // Bytes already read unchecked by `finish`.
                    continue;
                }
                let len = (c.end - self.complete) as usize;
                let range: Vec<u8> = self.staged.drain(..len).collect();
                let start = self.complete;
                self.complete = c.end;
                let crc = crc32c::crc32c(&range);
                match c.crc {
                    Some(want) if want != crc => {
                        self.skip(start, &range, "its checksum does not match".into())?
                    }
                    _ => self.decode_range(start, &range, &mut on_batch)?,
                }
            }
        } else {
            self.decode_unchecked(&mut on_batch)?;
        }
        Ok(())
    }

    /// The writer is gone: journal bytes that have no check (the checks file was cut short
    /// or its last checks are damaged) are decoded on the strength of the structural checks
    /// alone, and named. Without this they would be reported as a torn tail.
    pub fn finish(&mut self, mut on_batch: impl FnMut(RecordBatch)) -> Result<()> {
        let Checks::Present { queue, .. } = &mut self.checks else {
            return Ok(());
        };
        // A check for bytes the journal does not have: a range torn by a crash, not bytes
        // that lack a check.
        if queue.front().is_some_and(|c| c.end != u64::MAX) {
            return Ok(());
        }
        queue.clear();
        // After a skipped range the dictionaries are not known to be current: unchecked bytes
        // stay a torn tail.
        if self.staged.is_empty() || self.stopped || self.resync_after.is_some() {
            return Ok(());
        }
        let (start, unchecked) = (self.complete, self.staged.len() as u64);
        let rows_before = self.rows;
        self.decode_unchecked(&mut on_batch)?;
        let read = self.complete - start;
        if read > 0 && !self.stopped {
            self.damage.push(SkippedRange {
                offset: start,
                bytes: 0,
                lost: format!(
                    "nothing: {read} of its last {unchecked} bytes ({} records) had no check \
                     and were read unchecked",
                    self.rows - rows_before
                ),
                tally: Lost::default(),
                reason: "its checks file ends before the journal (cut short or damaged)".into(),
            });
        }
        Ok(())
    }

    /// Decodes the staged bytes message by message, up to the first one that cannot be
    /// decoded (the rest is then lost: without checks there is no telling where the next
    /// good batch starts).
    fn decode_unchecked(&mut self, on_batch: &mut impl FnMut(RecordBatch)) -> Result<()> {
        let staged = std::mem::take(&mut self.staged);
        let mut at = 0;
        loop {
            match next_message(&staged[at..]) {
                Message::Incomplete => break,
                Message::End { len } => {
                    at += len;
                    self.complete += len as u64;
                }
                Message::Complete { len, kind } => {
                    let start = self.complete;
                    let mut decoded = Vec::new();
                    if let Err(reason) =
                        self.decode_message(&staged[at..at + len], kind, &mut |b| decoded.push(b))
                    {
                        return self.stop(start, &staged[at..], reason);
                    }
                    for b in decoded {
                        self.batches += 1;
                        self.rows += b.num_rows() as u64;
                        on_batch(b);
                    }
                    at += len;
                    self.complete += len as u64;
                }
                Message::Invalid(reason) => {
                    let start = self.complete;
                    return self.stop(start, &staged[at..], reason);
                }
            }
        }
        self.staged = staged[at..].to_vec();
        Ok(())
    }

    /// Decodes a checked range (the schema, or a batch's dictionaries and the batch).
    fn decode_range(
        &mut self,
        start: u64,
        range: &[u8],
        on_batch: &mut impl FnMut(RecordBatch),
    ) -> Result<()> {
        let ids = dictionary_ids(range);
        if let Some(skipped) = self.resync_after {
            if !ids.is_superset(&self.dictionary_ids) {
                return self.skip(
                    start,
                    range,
                    format!(
                        "it may use dictionaries of the damaged range at byte {skipped} (read \
                         again from the next batch that resends them all)"
                    ),
                );
            }
            self.resync_after = None;
        }
        self.dictionary_ids.extend(ids);
        let mut at = 0;
        let mut decoded = Vec::new();
        while at < range.len() {
            let reason = match next_message(&range[at..]) {
                Message::Complete { len, kind } => {
                    match self.decode_message(&range[at..at + len], kind, &mut |b| decoded.push(b))
                    {
                        Ok(()) => {
                            at += len;
                            continue;
                        }
                        Err(reason) => reason,
                    }
                }
                Message::End { len } => {
                    at += len;
                    continue;
                }
                Message::Incomplete => "a message runs past the end of its checked range".into(),
                Message::Invalid(reason) => reason,
            };
            return self.skip(start, range, reason);
        }
        for b in decoded {
            self.batches += 1;
            self.rows += b.num_rows() as u64;
            on_batch(b);
        }
        Ok(())
    }

    /// Hands one well-formed message to the decoder; a message arrow rejects (or panics on)
    /// is an error, after which the decoder starts again from the schema.
    fn decode_message(
        &mut self,
        message: &[u8],
        kind: MessageKind,
        on_batch: &mut impl FnMut(RecordBatch),
    ) -> std::result::Result<(), String> {
        if kind == MessageKind::Schema {
            if self.footer.is_some() {
                return Err("a second schema in the stream".into());
            }
            self.schema_message = message.to_vec();
        } else if self.footer.is_none() {
            return Err("a batch before the stream's schema".into());
        }
        let mut buffer = Buffer::from(message.to_vec());
        let decoder = &mut self.decoder;
        let result = guarded(|| {
            let mut out = Vec::new();
            while !buffer.is_empty() {
                if let Some(b) = decoder.decode(&mut buffer)? {
                    out.push(b);
                }
            }
            Ok::<_, arrow_schema::ArrowError>(out)
        });
        let error = match result {
            Ok(Ok(batches)) => {
                if kind == MessageKind::Schema {
                    let footer = self.schema_footer().map_err(|e| format!("{e:#}"))?;
                    self.footer = Some(footer);
                }
                for b in batches {
                    on_batch(b);
                }
                return Ok(());
            }
            Ok(Err(e)) => e.to_string(),
            Err(panic) => format!("arrow's decoder failed on it ({panic})"),
        };
        self.restart_decoder();
        Err(error)
    }

    /// The footer from the schema message just read (the decoder completes a message with
    /// no body only when more bytes come, so the schema is read from the message itself).
    fn schema_footer(&self) -> Result<Footer> {
        let Message::Complete { .. } = next_message(&self.schema_message) else {
            bail!("the journal's schema message is damaged");
        };
        let prefix = if self.schema_message.starts_with(&[0xFF; 4]) {
            8
        } else {
            4
        };
        let meta_len = u32::from_le_bytes(
            self.schema_message[prefix - 4..prefix]
                .try_into()
                .expect("4 bytes"),
        ) as usize;
        let message =
            arrow_ipc::root_as_message(&self.schema_message[prefix..prefix + meta_len])
                .map_err(|e| anyhow::anyhow!("the journal's schema message is damaged: {e}"))?;
        let schema = message
            .header_as_schema()
            .context("the journal's schema message holds no schema")?;
        let schema = arrow_ipc::convert::try_fb_to_schema(schema)
            .context("the journal's schema message is damaged")?;
        let kv: HashMap<String, String> = schema
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Footer::parse(&kv).context("the journal's footer")
    }

    /// A fresh decoder that has read the schema again (a damaged range may have left the
    /// old one mid-message).
    fn restart_decoder(&mut self) {
        self.decoder = StreamDecoder::new();
        if self.schema_message.is_empty() {
            return;
        }
        let mut buffer = Buffer::from(self.schema_message.clone());
        let decoder = &mut self.decoder;
        let _ = guarded(|| {
            while !buffer.is_empty() {
                if decoder.decode(&mut buffer).is_err() {
                    break;
                }
            }
        });
    }

    /// Records a skipped checked range; a damaged schema range makes the journal unreadable.
    fn skip(&mut self, start: u64, range: &[u8], reason: String) -> Result<()> {
        if self.footer.is_none() {
            bail!(
                "its schema (the first {} bytes) is damaged: {reason}",
                range.len()
            );
        }
        let lost = Lost::of(range);
        match (self.resync_after, self.damage.last_mut()) {
            // A range skipped for the damage before it: one entry for the whole stretch.
            (Some(_), Some(last)) if last.offset + last.bytes == start => {
                last.bytes += range.len() as u64;
                last.tally.add(lost);
                last.lost = last.tally.to_string();
            }
            _ => self.damage.push(SkippedRange {
                offset: start,
                bytes: range.len() as u64,
                lost: lost.to_string(),
                tally: lost,
                reason,
            }),
        }
        if self.resync_after.is_none() {
            self.resync_after = Some(start);
        }
        Ok(())
    }

    /// Stops an unchecked journal at a message it cannot decode: the rest is lost.
    fn stop(&mut self, start: u64, rest: &[u8], reason: String) -> Result<()> {
        self.stopped = true;
        self.staged = Vec::new();
        if self.footer.is_none() {
            bail!("its schema is damaged: {reason}");
        }
        let tally = Lost::of(rest);
        self.damage.push(SkippedRange {
            offset: start,
            bytes: rest.len() as u64,
            lost: format!(
                "everything from this offset on ({tally}; the journal has no checks to find \
                 the next good batch by)"
            ),
            tally,
            reason,
        });
        self.complete = self.offset;
        Ok(())
    }

    /// Damage found since the last call.
    pub fn take_damage(&mut self) -> Vec<SkippedRange> {
        std::mem::take(&mut self.damage)
    }

    /// The footer from the stream's schema, once the schema was read.
    pub fn footer(&self) -> Option<&Footer> {
        self.footer.as_ref()
    }

    /// Bytes after the last complete range (or message, in a journal without checks): a
    /// batch still being written, or a torn tail when the writer is gone.
    pub fn pending(&self) -> u64 {
        self.offset - self.complete
    }
}

/// The dictionary ids a range sends (as far as its message headers can be read).
fn dictionary_ids(range: &[u8]) -> std::collections::BTreeSet<i64> {
    let mut ids = std::collections::BTreeSet::new();
    let mut at = 0;
    while at < range.len() {
        match next_message(&range[at..]) {
            Message::Complete { len, kind } => {
                if let MessageKind::Dictionary { id } = kind {
                    ids.insert(id);
                }
                at += len;
            }
            Message::End { len } => at += len,
            Message::Incomplete | Message::Invalid(_) => break,
        }
    }
    ids
}

/// What skipped bytes held, from the message headers that can still be read in them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lost {
    /// Record batches whose header could be read, and their records.
    pub batches: u64,
    pub records: u64,
    /// Stretches whose messages could not be read (how many records cannot be told).
    pub unreadable: u64,
}

impl Lost {
    fn of(range: &[u8]) -> Lost {
        let mut lost = Lost::default();
        let mut at = 0;
        while at < range.len() {
            match next_message(&range[at..]) {
                Message::Complete { len, kind } => {
                    if let MessageKind::Batch { rows } = kind {
                        lost.batches += 1;
                        lost.records += rows.max(0) as u64;
                    }
                    at += len;
                }
                Message::End { len } => at += len,
                Message::Incomplete | Message::Invalid(_) => {
                    lost.unreadable += 1;
                    break;
                }
            }
        }
        lost
    }

    fn add(&mut self, o: Lost) {
        self.batches += o.batches;
        self.records += o.records;
        self.unreadable += o.unreadable;
    }
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = |n: u64| if n == 1 { "" } else { "es" };
        match (self.batches, self.unreadable) {
            (0, _) => write!(f, "records (how many cannot be read)"),
            (b, 0) => write!(f, "{b} batch{} of {} records", plural(b), self.records),
            (b, _) => write!(
                f,
                "{b} batch{} of {} records and more whose count cannot be read",
                plural(b),
                self.records
            ),
        }
    }
}

/// A whole journal read from its file.
pub struct JournalContents {
    pub footer: Footer,
    pub batches: Vec<RecordBatch>,
    /// Bytes after the last complete batch (a torn tail after a kill -9), ignored.
    pub torn_bytes: u64,
    /// Damaged ranges that were skipped.
    pub damage: Vec<SkippedRange>,
}

/// Reads every complete, undamaged batch of the journal at `path` (checked against its
/// checks file when it has one).
pub fn read_journal(path: &Path) -> Result<JournalContents> {
    let checks = match std::fs::read(checks_path(path)) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(e).with_context(|| format!("reading the checks of {}", path.display()));
        }
    };
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut cursor = JournalCursor::new();
    let mut batches = Vec::new();
    cursor.feed_checks(checks.as_deref());
    cursor
        .feed(bytes::Bytes::from(bytes), |b| batches.push(b))
        .and_then(|()| cursor.finish(|b| batches.push(b)))
        .with_context(|| format!("reading {}", path.display()))?;
    let footer = cursor
        .footer()
        .cloned()
        .with_context(|| format!("{}: the journal's schema is cut short", path.display()))?;
    Ok(JournalContents {
        footer,
        torn_bytes: cursor.pending(),
        damage: cursor.take_damage(),
        batches,
    })
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
                pipeline: None,
            });
        }
        let mut h = h.clone();
        h.threads = BTreeMap::from([(0, "main".into()), (1, "dataloader".into())]);
        builder.finish(&h).unwrap()
    }

    /// Logical (dictionary-free) columns, so batches with different dictionaries compare.
    fn logical(batches: &[RecordBatch]) -> Vec<arrow_array::ArrayRef> {
        let schema = arrow_schema();
        let b: Vec<RecordBatch> = batches
            .iter()
            .map(|b| RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap())
            .collect();
        let all = arrow_select::concat::concat_batches(&schema, &b).unwrap();
        all.columns()
            .iter()
            .map(|c| match c.data_type() {
                // A dictionary column's values in row order (what a cast to its value type gives).
                arrow_schema::DataType::Dictionary(..) => {
                    let d = c.as_any_dictionary();
                    arrow_select::take::take(d.values(), d.keys(), None).unwrap()
                }
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
        let part = crate::part::compact(&contents, 5).unwrap();
        // The same footer as a part written directly, with the threads the records name.
        let (f, from_part) = crate::read::read_part(bytes::Bytes::from(part)).unwrap();
        assert_eq!(logical(&from_part), logical(&written));
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

    #[test]
    fn a_damaged_batch_is_skipped_by_its_check_and_the_next_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let h = header();
        let mut w = JournalWriter::create(dir.path(), 0, &h).unwrap();
        let mut builder = PartBuilder::new();
        let after_schema = std::fs::metadata(w.path()).unwrap().len();
        for from in [1, 21, 41] {
            // Each batch's names in a new order: its dictionaries are sent with it.
            w.append(&batch(&mut builder, &h, from, 20)).unwrap();
        }
        let path = w.path().to_path_buf();
        drop(w);
        let bytes = std::fs::read(&path).unwrap();
        let checks = std::fs::read(checks_path(&path)).unwrap();
        assert_eq!(checks.len(), CHECKS_MAGIC.len() + 4 * CHECK_LEN);
        // Checks first, then the journal a byte at a time: every batch, nothing pending.
        let mut c = JournalCursor::new();
        c.feed_checks(Some(&checks));
        let mut n = 0;
        for b in &bytes {
            c.feed(bytes::Bytes::copy_from_slice(&[*b]), |_| n += 1)
                .unwrap();
        }
        assert_eq!((n, c.rows, c.pending()), (3, 60, 0));
        assert!(c.take_damage().is_empty());
        // One flipped bit in the second batch: it is skipped, and so is the third, which may
        // use a dictionary the second sent (the next keyframe is batch KEYFRAME_EVERY).
        let second = u64::from_le_bytes(checks[8 + 16..8 + 24].try_into().unwrap());
        let mut damaged = bytes.clone();
        damaged[second as usize + 100] ^= 0x10;
        std::fs::write(&path, &damaged).unwrap();
        let j = read_journal(&path).unwrap();
        assert_eq!(j.batches.iter().map(|b| b.num_rows()).sum::<usize>(), 20);
        assert_eq!(j.damage.len(), 1);
        assert_eq!(
            (j.damage[0].offset, j.damage[0].bytes),
            (second, bytes.len() as u64 - second)
        );
        assert_eq!(j.damage[0].reason, "its checksum does not match");
        assert_eq!(j.damage[0].tally.records, 40, "{:?}", j.damage[0]);
        // A damaged check (not a damaged batch): nothing is lost, the batch is decoded
        // unchecked.
        std::fs::write(&path, &bytes).unwrap();
        let mut bad_checks = checks.clone();
        bad_checks[8 + 16 + 3] ^= 1;
        std::fs::write(checks_path(&path), &bad_checks).unwrap();
        let j = read_journal(&path).unwrap();
        assert_eq!((j.batches.len(), j.damage.len(), j.torn_bytes), (3, 0, 0));
        // A damaged schema range: the journal cannot be read, and says so.
        let mut damaged = bytes.clone();
        damaged[after_schema as usize / 2] ^= 1;
        std::fs::write(&path, &damaged).unwrap();
        std::fs::write(checks_path(&path), &checks).unwrap();
        let e = read_journal(&path).err().unwrap();
        assert!(format!("{e:#}").contains("schema"), "{e:#}");
        // Without its checks file (an older journal) it still opens in full.
        std::fs::write(&path, &bytes).unwrap();
        remove(&path).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let j = read_journal(&path).unwrap();
        assert_eq!((j.batches.len(), j.damage.len()), (3, 0));
    }

    #[test]
    fn after_a_damaged_batch_reading_resumes_at_the_next_keyframe() {
        let dir = tempfile::tempdir().unwrap();
        let h = header();
        let mut w = JournalWriter::create(dir.path(), 0, &h).unwrap();
        let mut builder = PartBuilder::new();
        let n = 2 * KEYFRAME_EVERY + 2;
        for i in 0..n {
            w.append(&batch(&mut builder, &h, 1 + 10 * i, 10)).unwrap();
        }
        let path = w.path().to_path_buf();
        drop(w);
        let checks = std::fs::read(checks_path(&path)).unwrap();
        let end = |i: u64| {
            let at = 8 + 16 * i as usize;
            u64::from_le_bytes(checks[at..at + 8].try_into().unwrap())
        };
        // Range 0 is the schema; batch i is range i + 1. Damage batch 1 (not a keyframe).
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(end(1) + end(2)) as usize / 2] ^= 0x80;
        std::fs::write(&path, &bytes).unwrap();
        let j = read_journal(&path).unwrap();
        // Batches 1..KEYFRAME_EVERY are lost, one entry naming the stretch; batch 0 and the
        // batches from the keyframe on are read.
        assert_eq!(j.batches.len() as u64, n - (KEYFRAME_EVERY - 1));
        assert_eq!(j.damage.len(), 1, "{:?}", j.damage);
        let d = &j.damage[0];
        assert_eq!((d.offset, d.bytes), (end(1), end(KEYFRAME_EVERY) - end(1)));
        assert_eq!(d.reason, "its checksum does not match");
        // The damaged batch's own header may be unreadable; the ones after it are counted.
        assert!(d.tally.records >= 10 * (KEYFRAME_EVERY - 2), "{d:?}");
        let seqs: Vec<u64> = j
            .batches
            .iter()
            .flat_map(|b| {
                b.column_by_name(col::SEQ)
                    .unwrap()
                    .as_primitive::<arrow_array::types::UInt64Type>()
                    .values()
                    .to_vec()
            })
            .collect();
        assert_eq!(seqs[..10], (1..=10).collect::<Vec<_>>());
        assert_eq!(seqs[10], 1 + 10 * KEYFRAME_EVERY);
    }
}
