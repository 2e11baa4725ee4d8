//! Building and writing one Parquet part file: typed rows -> Arrow columns -> zstd Parquet
//! whose footer ([`crate::footer`]) also holds the part's summary and detail levels
//! ([`crate::embedded`]), written under a temporary name and renamed into place (or uploaded in
//! one PUT), so a reader never sees half a part; a journal is compacted into its part here
//! ([`compact`]), and [`PartSink`] keeps the rank summary and the node rollup of what it puts.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use arrow_array::RecordBatch;
use arrow_array::builder::{
    Float64Builder, Int64Builder, ListBuilder, StringBuilder, StringDictionaryBuilder,
    UInt16Builder, UInt32Builder, UInt64Builder,
};
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, Int32Array, StringArray, UInt32Array};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use object_store::ObjectStoreExt as _;

use crate::footer::{CompactedDamage, Footer, PartHeader};
use crate::journal::JournalContents;
use crate::location::{
    Location, parse_journal_file_name, part_file_name, rank_dir, spool_rank_dir,
};
use crate::schema::{Kind, PipelineSlot, Reduce, arrow_schema, meta};

/// One row, borrowed: what the recorder and the synthetic generator both produce.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    pub thread: u32,
    pub seq: u64,
    pub kind: Kind,
    pub name: &'a str,
    pub step: Option<u64>,
    pub start_ns: i64,
    pub dur_ns: Option<i64>,
    pub value: Option<f64>,
    pub reduce: Option<Reduce>,
    pub depth: u16,
    pub parent: Option<u64>,
    pub tags: &'a [&'a str],
    pub message: Option<&'a str>,
    /// The pipeline schedule slot of a pipeline pass's span.
    pub pipeline: Option<PipelineSlot>,
}

impl<'a> Row<'a> {
    /// A span of thread 0 with no parent, tags, message or pipeline slot.
    pub fn span(
        seq: u64,
        name: &'a str,
        step: u64,
        start_ns: i64,
        dur_ns: i64,
        depth: u16,
    ) -> Self {
        Row {
            thread: 0,
            seq,
            kind: Kind::Span,
            name,
            step: Some(step),
            start_ns,
            dur_ns: Some(dur_ns),
            value: None,
            reduce: None,
            depth,
            parent: None,
            tags: &[],
            message: None,
            pipeline: None,
        }
    }
}

/// Accumulates rows of one part as Arrow columns.
pub struct PartBuilder {
    rows: usize,
    thread: UInt32Builder,
    thread_name: Vec<i32>,
    seq: UInt64Builder,
    kind: Vec<i32>,
    name: StringDictionaryBuilder<Int32Type>,
    step: UInt64Builder,
    start_ns: Int64Builder,
    dur_ns: Int64Builder,
    value: Float64Builder,
    reduce: Vec<Option<i32>>,
    depth: UInt16Builder,
    parent: UInt64Builder,
    tags: ListBuilder<StringBuilder>,
    message: StringBuilder,
    microbatch: UInt16Builder,
    stage: UInt16Builder,
}

const KINDS: [&str; 4] = ["span", "instant", "scalar", "error"];
const REDUCES: [&str; 4] = ["mean", "max", "min", "sum"];

fn kind_key(k: Kind) -> i32 {
    match k {
        Kind::Span => 0,
        Kind::Instant => 1,
        Kind::Scalar => 2,
        Kind::Error => 3,
    }
}

fn reduce_key(r: Reduce) -> i32 {
    match r {
        Reduce::Mean => 0,
        Reduce::Max => 1,
        Reduce::Min => 2,
        Reduce::Sum => 3,
    }
}

impl Default for PartBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl PartBuilder {
    pub fn new() -> Self {
        PartBuilder {
            rows: 0,
            thread: UInt32Builder::new(),
            thread_name: Vec::new(),
            seq: UInt64Builder::new(),
            kind: Vec::new(),
            name: StringDictionaryBuilder::new(),
            step: UInt64Builder::new(),
            start_ns: Int64Builder::new(),
            dur_ns: Int64Builder::new(),
            value: Float64Builder::new(),
            reduce: Vec::new(),
            depth: UInt16Builder::new(),
            parent: UInt64Builder::new(),
            tags: ListBuilder::new(StringBuilder::new()).with_field(arrow_schema::Field::new(
                "item",
                arrow_schema::DataType::Utf8,
                false,
            )),
            message: StringBuilder::new(),
            microbatch: UInt16Builder::new(),
            stage: UInt16Builder::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Appends one row. `thread_key` indexes the header's thread list order (see `finish`).
    pub fn push(&mut self, row: &Row<'_>) {
        self.rows += 1;
        self.thread.append_value(row.thread);
        self.thread_name.push(row.thread as i32);
        self.seq.append_value(row.seq);
        self.kind.push(kind_key(row.kind));
        self.name.append_value(row.name);
        self.step.append_option(row.step);
        self.start_ns.append_value(row.start_ns);
        self.dur_ns.append_option(row.dur_ns);
        self.value.append_option(row.value);
        self.reduce.push(row.reduce.map(reduce_key));
        self.depth.append_value(row.depth);
        self.parent.append_option(row.parent);
        for t in row.tags {
            self.tags.values().append_value(t);
        }
        self.tags.append(true);
        self.message.append_option(row.message);
        self.microbatch
            .append_option(row.pipeline.map(|p| p.microbatch));
        self.stage.append_option(row.pipeline.map(|p| p.stage));
    }

    /// Turns the accumulated rows into a record batch and resets the builder.
    pub fn finish(&mut self, header: &PartHeader) -> Result<RecordBatch> {
        let n = self.rows;
        self.rows = 0;
        let constant = |v: &str| -> ArrayRef {
            Arc::new(
                DictionaryArray::<Int32Type>::try_new(
                    Int32Array::from(vec![0; n]),
                    Arc::new(StringArray::from(vec![v])),
                )
                .expect("constant dictionary"),
            )
        };
        let fixed_dict = |keys: Vec<i32>, values: &[&str]| -> ArrayRef {
            Arc::new(
                DictionaryArray::<Int32Type>::try_new(
                    Int32Array::from(keys),
                    Arc::new(StringArray::from(values.to_vec())),
                )
                .expect("fixed dictionary keys are in range"),
            )
        };
        // Thread names: keys are thread ids; the dictionary holds every id up to the largest.
        let max_thread = self.thread_name.iter().copied().max().unwrap_or(0).max(0) as u32;
        let thread_names: Vec<String> = (0..=max_thread)
            .map(|t| {
                header
                    .threads
                    .get(&t)
                    .cloned()
                    .unwrap_or_else(|| format!("thread-{t}"))
            })
            .collect();
        let thread_names_ref: Vec<&str> = thread_names.iter().map(String::as_str).collect();
        let reduce = std::mem::take(&mut self.reduce);
        let reduce: ArrayRef = Arc::new(
            DictionaryArray::<Int32Type>::try_new(
                Int32Array::from(reduce),
                Arc::new(StringArray::from(REDUCES.to_vec())),
            )
            .expect("reduce keys are in range"),
        );
        let columns: Vec<ArrayRef> = vec![
            constant(&header.run_id),
            constant(&header.source),
            constant(&header.host),
            Arc::new(UInt32Array::from(vec![header.rank; n])),
            Arc::new(UInt32Array::from(vec![header.local_rank; n])),
            Arc::new(UInt32Array::from(vec![header.pid; n])),
            Arc::new(self.thread.finish()),
            fixed_dict(std::mem::take(&mut self.thread_name), &thread_names_ref),
            Arc::new(self.seq.finish()),
            fixed_dict(std::mem::take(&mut self.kind), &KINDS),
            Arc::new(self.name.finish()),
            Arc::new(self.step.finish()),
            Arc::new(self.start_ns.finish()),
            Arc::new(self.dur_ns.finish()),
            Arc::new(self.value.finish()),
            reduce,
            Arc::new(self.depth.finish()),
            Arc::new(self.parent.finish()),
            Arc::new(self.tags.finish()),
            Arc::new(self.message.finish()),
            Arc::new(self.microbatch.finish()),
            Arc::new(self.stage.finish()),
        ];
        // A fresh dictionary builder per part: dictionaries must not grow across parts.
        self.name = StringDictionaryBuilder::new();
        RecordBatch::try_new(arrow_schema(), columns).context("building the part's record batch")
    }
}

/// Encodes a batch as one zstd Parquet file with the header in the footer.
pub fn encode(batch: &RecordBatch, header: &PartHeader, part: u64) -> Result<Vec<u8>> {
    encode_batches(std::slice::from_ref(batch), header, part)
}

/// Encodes batches (in order, as one part) as one zstd Parquet file with the header in the
/// footer. The batches' own schema metadata is dropped: the footer is the part's metadata.
pub fn encode_batches(batches: &[RecordBatch], header: &PartHeader, part: u64) -> Result<Vec<u8>> {
    encode_batches_noting(batches, header, part, &[])
}

/// [`encode_batches`] for a part compacted from a damaged journal: the ranges that were
/// dropped go into the footer (`titan.damage`), so every later reader names them.
pub fn encode_batches_noting(
    batches: &[RecordBatch],
    header: &PartHeader,
    part: u64,
    damage: &[CompactedDamage],
) -> Result<Vec<u8>> {
    let mut kv = header.key_values(part);
    if !damage.is_empty() {
        kv.push(KeyValue::new(
            meta::DAMAGE.to_string(),
            serde_json::to_string(damage).context("recording the journal's damage")?,
        ));
    }
    let schema = arrow_schema();
    let batches = batches
        .iter()
        .map(|b| RecordBatch::try_new(schema.clone(), b.columns().to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .context("a journal batch does not have the part schema")?;
    // The part's summary and detail levels go into its own footer (one file per part).
    let footer = Footer {
        header: header.clone(),
        part: Some(part),
        damage: damage.to_vec(),
    };
    kv.extend(crate::embedded::key_values(&batches, &footer)?);
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_dictionary_enabled(true)
        .set_max_row_group_row_count(Some(1 << 20))
        .set_key_value_metadata(Some(kv))
        .build();
    let size: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
    let mut out = Vec::with_capacity(size / 4 + 4096);
    let mut writer = ArrowWriter::try_new(&mut out, schema.clone(), Some(props))?;
    for batch in &batches {
        writer.write(batch)?;
    }
    writer.close()?;
    Ok(out)
}

/// Compacts a journal's batches into one Parquet part (same schema and footer as parts
/// written directly); thread names come from the records themselves. Damaged ranges that
/// were skipped are recorded in the part's footer.
pub fn compact(contents: &JournalContents, index: u64) -> Result<Vec<u8>> {
    let mut header = contents.footer.header.clone();
    for batch in &contents.batches {
        crate::journal::thread_names(batch, &mut header.threads);
    }
    let damage: Vec<CompactedDamage> = contents
        .damage
        .iter()
        .map(|d| CompactedDamage {
            offset: d.offset,
            bytes: d.bytes,
            lost: d.lost.clone(),
            error: d.reason.clone(),
        })
        .collect();
    encode_batches_noting(&contents.batches, &header, index, &damage)
}

/// Writes encoded parts of one rank to the run location, and knows where its journal lives.
pub struct PartSink {
    location: Location,
    rank: u32,
    /// Where this rank's journal is written: its rank folder for local runs, a local spool
    /// folder for object stores (see [`Self::with_spool`]).
    journal_dir: PathBuf,
    /// Local runs: the rank summary (`rank.summary`, see [`crate::digest::rank`]) kept up to
    /// date with the parts put.
    rank_summary: std::sync::Mutex<RankSummaryState>,
}

/// The rank summary a [`PartSink`] keeps: read from the folder at the first part it puts,
/// then each part added to it.
#[derive(Default)]
struct RankSummaryState {
    digest: Option<crate::digest::RankDigest>,
    /// Written by [`PartSink::finish_rank_summary`] instead of at every part.
    deferred: bool,
    /// Changed since last written.
    dirty: bool,
    /// Written to the node rollup at least once.
    rolled_up: bool,
    /// The parts put since the node timeline was last written (from their detail levels).
    pending: Vec<crate::digest::timeline::PartTimeline>,
}

/// An object store's `obs/` prefix, where a node's figures and timeline are published.
struct StoreRemote<'a> {
    store: &'a Arc<dyn object_store::ObjectStore>,
    obs: object_store::path::Path,
}

impl crate::digest::node::Remote for StoreRemote<'_> {
    fn get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let path = self.obs.clone().join(name);
        let got =
            titan_storage::runtime().block_on(async { self.store.get(&path).await?.bytes().await });
        match got {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {path}")),
        }
    }

    fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let path = self.obs.clone().join(name);
        titan_storage::runtime()
            .block_on(self.store.put(&path, bytes.into()))
            .with_context(|| format!("uploading {path}"))?;
        Ok(())
    }
}

/// The default spool folder of object-store runs' journals: `$TMPDIR/titan-obs-spool`.
pub fn default_spool_dir() -> PathBuf {
    std::env::temp_dir().join("titan-obs-spool")
}

impl PartSink {
    /// Prepares `<run>/obs/rank-<rank>/` (creating it for local runs).
    pub fn new(location: Location, rank: u32) -> Result<Self> {
        if let Location::Local(run) = &location {
            let dir = rank_dir(run, rank);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let journal_dir = match &location {
            Location::Local(run) => rank_dir(run, rank),
            Location::Object { url, .. } => spool_rank_dir(&default_spool_dir(), url, rank),
        };
        Ok(PartSink {
            location,
            rank,
            journal_dir,
            rank_summary: Default::default(),
        })
    }

    /// Writes the rank summary once, at [`Self::finish_rank_summary`], instead of after every
    /// part: for writers that put a rank's whole history at once (`synth`, the benchmark's
    /// generator), where rewriting it per part would cost the square of the rank's length.
    /// The file written is the one the recorder leaves after the same parts.
    pub fn defer_rank_summary(self) -> Self {
        self.lock_rank_summary().deferred = true;
        self
    }

    /// Writes the rank summary if parts were put since it was last written, then this rank's
    /// entry of its node's rollup (`obs/node-<host>.summary`, [`crate::digest::node`]); a
    /// rollup that cannot be written is only logged (readers then read the rank's folder).
    pub fn finish_rank_summary(&self) -> Result<()> {
        let mut st = self.lock_rank_summary();
        let st = &mut *st;
        let (true, Some(d)) = (st.dirty, &st.digest) else {
            return Ok(());
        };
        let bytes = crate::digest::rank_file::encode(d)?;
        match &self.location {
            Location::Local(run) => {
                let path = crate::digest::rank_file::rank_summary_path(&rank_dir(run, self.rank));
                crate::sidecar::write_atomic(&path, &bytes)?;
            }
            // An object store: the rank summary is one more object beside the parts.
            Location::Object { .. } => {
                self.put_beside(crate::digest::RANK_SUMMARY_FILE, bytes.clone())?
            }
        }
        let added = std::mem::take(&mut st.pending);
        self.roll_up(d, bytes, true, &added, !st.rolled_up);
        st.dirty = false;
        st.rolled_up = true;
        Ok(())
    }

    /// Records the rank folder's current state in the node rollup again: for a writer that
    /// changed the folder after its last part (the recorder, which removes the compacted
    /// journal after [`Self::put`]), so readers can trust the rollup for this rank without
    /// listing its folder.
    pub fn restamp_rollup(&self) {
        if !matches!(self.location, Location::Local(_)) {
            // The spool's journal is no part of what the store's readers check.
            return;
        }
        let st = self.lock_rank_summary();
        if let (true, false, Some(d)) = (st.rolled_up, st.dirty, &st.digest) {
            match crate::digest::rank_file::encode(d) {
                Ok(bytes) => self.roll_up(d, bytes, false, &[], false),
                Err(e) => tracing::warn!("no node rollup written for rank {}: {e:#}", self.rank),
            }
        }
    }

    /// Replaces this rank's entry of its node's rollup; `summary_changed`: its summary is new
    /// (else only its folder changed since the last entry); `added`: the parts put since the
    /// last entry, for the node's timeline; `first`: this sink's first entry. A local run's
    /// node files are in its `obs/` folder; an object-store run's in the spool folder the
    /// node's ranks share (the parent of their journal folders), published to the store.
    fn roll_up(
        &self,
        d: &crate::digest::RankDigest,
        encoded: Vec<u8>,
        summary_changed: bool,
        added: &[crate::digest::timeline::PartTimeline],
        first: bool,
    ) {
        use crate::digest::node;
        let host = d
            .segments
            .last()
            .map_or("", |s| s.digest.info.header.host.as_str());
        let name = node::file_name(host, self.rank);
        let rolled = (|| -> Result<()> {
            let update = |dir_mtime_ns| node::RankUpdate {
                rank: self.rank,
                dir_mtime_ns,
                last_part: d.last_index(),
                summary: encoded,
                summary_changed,
                added,
            };
            match &self.location {
                Location::Local(run) => {
                    let dir = rank_dir(run, self.rank);
                    let m = std::fs::metadata(&dir)
                        .with_context(|| format!("reading {}", dir.display()))?;
                    let u = update(node::mtime_ns(&m));
                    node::update(&run.join("obs"), &name, u, None, first)
                }
                Location::Object { store, base, .. } => {
                    let spool = self.journal_dir.parent().unwrap_or(&self.journal_dir);
                    std::fs::create_dir_all(spool)
                        .with_context(|| format!("creating {}", spool.display()))?;
                    let remote = StoreRemote {
                        store,
                        obs: base.clone().join("obs"),
                    };
                    node::update(spool, &name, update(0), Some(&remote), first)
                }
            }
        })();
        if let Err(e) = rolled {
            tracing::warn!("no node rollup written for rank {}: {e:#}", self.rank);
        }
    }

    fn lock_rank_summary(&self) -> std::sync::MutexGuard<'_, RankSummaryState> {
        self.rank_summary.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts the journal of an object-store run under `spool` instead of the default
    /// [`default_spool_dir`] (local runs keep it in their rank folder).
    pub fn with_spool(mut self, spool: &Path) -> Self {
        if let Location::Object { url, .. } = &self.location {
            self.journal_dir = spool_rank_dir(spool, url, self.rank);
        }
        self
    }

    /// The folder holding this rank's journal (created when the first journal is opened).
    pub fn journal_dir(&self) -> &Path {
        &self.journal_dir
    }

    /// Journals left in the journal folder (by a process that was killed), oldest first.
    pub fn leftover_journals(&self) -> Result<Vec<(u64, PathBuf)>> {
        let mut found: Vec<(u64, PathBuf)> = match std::fs::read_dir(&self.journal_dir) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter_map(|e| Some((parse_journal_file_name(e.file_name().to_str()?)?, e.path())))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(e).with_context(|| format!("listing {}", self.journal_dir.display()));
            }
        };
        found.sort();
        Ok(found)
    }

    /// Whether part `index` exists already.
    pub fn has_part(&self, index: u64) -> Result<bool> {
        match &self.location {
            Location::Local(run) => Ok(rank_dir(run, self.rank)
                .join(part_file_name(index))
                .exists()),
            Location::Object { store, base, .. } => {
                let path = crate::location::stored_rank_dir(base, self.rank)
                    .join(part_file_name(index).as_str());
                let rt = titan_storage::runtime();
                match rt.block_on(store.head(&path)) {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(e) => Err(e).with_context(|| {
                        format!(
                            "checking {}/{}",
                            self.location.rank_display(self.rank),
                            part_file_name(index)
                        )
                    }),
                }
            }
        }
    }

    /// The next unused part index (parts and journals from an earlier process of this rank
    /// are kept).
    pub fn next_part_index(&self) -> Result<u64> {
        let journals = self.leftover_journals()?.last().map(|(n, _)| *n);
        let existing = match &self.location {
            Location::Local(run) => {
                let dir = rank_dir(run, self.rank);
                std::fs::read_dir(&dir)
                    .with_context(|| format!("listing {}", dir.display()))?
                    .filter_map(|e| e.ok())
                    .filter_map(|e| crate::location::parse_part_file_name(e.file_name().to_str()?))
                    .max()
            }
            Location::Object { store, base, .. } => {
                use futures::TryStreamExt;
                let prefix = crate::location::stored_rank_dir(base, self.rank);
                let rt = titan_storage::runtime();
                let metas: Vec<object_store::ObjectMeta> = rt
                    .block_on(store.list(Some(&prefix)).try_collect())
                    .with_context(|| {
                        format!("listing {}", self.location.rank_display(self.rank))
                    })?;
                metas
                    .iter()
                    .filter_map(|m| crate::location::parse_part_file_name(m.location.filename()?))
                    .max()
            }
        };
        Ok(existing.max(journals).map_or(0, |n| n + 1))
    }

    /// Writes part `index` atomically, then the rank summary (`rank.summary`, local runs);
    /// returns where the part went. A part made by [`encode`] holds its summary and detail
    /// levels in its footer ([`crate::embedded`]); one without them (bytes made elsewhere)
    /// gets them beside it, as before issue 42 (`part-<N>.summary`, `part-<N>.lod`). A
    /// summary or detail file that cannot be made or written is only logged: readers build
    /// what is missing themselves.
    pub fn put(&self, index: u64, bytes: Vec<u8>) -> Result<String> {
        let bytes = bytes::Bytes::from(bytes);
        let at = self.put_part(index, bytes.clone())?;
        let len = bytes.len() as u64;
        let kv = crate::footer::key_values_of(&bytes);
        let embedded = kv
            .as_ref()
            .ok()
            .map(|kv| (crate::digest::from_footer(kv), crate::lod::from_footer(kv)));
        let (digest, detail) = match embedded {
            // Without its detail levels (never from `encode`) the part is in no node timeline:
            // the TUI then lists its rank's folder.
            Some((Ok(Some(digest)), detail)) => (Some(digest), detail.ok().flatten()),
            _ => {
                let digest = (self.put_summary(index, bytes.clone()))
                    .inspect_err(|e| tracing::warn!("no summary written for {at}: {e:#}"))
                    .ok();
                let detail = (self.put_detail(index, bytes))
                    .inspect_err(|e| tracing::warn!("no detail levels written for {at}: {e:#}"))
                    .ok();
                (digest, detail)
            }
        };
        if let Some(digest) = digest
            && let Err(e) = self.update_rank_summary(index, len, digest, detail.as_ref())
        {
            tracing::warn!("no rank summary written for {at}: {e:#}");
        }
        Ok(at)
    }

    /// Writes part `index`'s detail levels (`part-<N>.lod`, see [`crate::lod`]).
    fn put_detail(&self, index: u64, part: bytes::Bytes) -> Result<crate::lod::PartDetail> {
        let len = part.len() as u64;
        let detail = crate::lod::PartDetail::of_part(part, self.rank)?;
        let body = crate::lod::encode(&detail, len);
        self.put_beside(&crate::lod::detail_file_name(index), body)?;
        Ok(detail)
    }

    fn put_summary(&self, index: u64, part: bytes::Bytes) -> Result<crate::digest::PartDigest> {
        let len = part.len() as u64;
        let data = crate::decode::decode_part(part, self.rank, crate::digest::COLUMNS, 0)?;
        let digest = crate::digest::PartDigest::of_data(&data);
        let body = crate::digest::encode(&digest, len)?;
        self.put_beside(&crate::digest::summary_file_name(index), body)?;
        Ok(digest)
    }

    /// Adds part `index` (`len` bytes, summarised as `digest`, its detail levels `detail`)
    /// to the rank summary and writes it (unless deferred), and to the parts the node's
    /// timeline gets next. The first part a sink puts, or one out of order, brings the
    /// summary up to date with the folder first (on an object store: continues the rank
    /// summary there when it ends before this part; a reader checks what it covers against
    /// the parts listed).
    fn update_rank_summary(
        &self,
        index: u64,
        len: u64,
        digest: crate::digest::PartDigest,
        detail: Option<&crate::lod::PartDetail>,
    ) -> Result<()> {
        let Location::Local(run) = &self.location else {
            let mut st = self.lock_rank_summary();
            if let Some(d) = detail {
                let part = crate::digest::timeline::PartTimeline::of(index, &digest.info.run_id, d);
                st.pending.push(part);
            }
            match &mut st.digest {
                Some(d) if d.last_index().is_none_or(|l| index > l) => {
                    d.add_part(index, len, digest)
                }
                _ => {
                    // A writer that starts past part 0 continues the stored summary.
                    let stored = (index > 0).then(|| self.stored_rank_summary()).flatten();
                    let mut d = stored
                        .filter(|d| d.last_index().is_none_or(|l| index > l))
                        .unwrap_or_default();
                    d.add_part(index, len, digest);
                    st.digest = Some(d);
                }
            }
            st.dirty = true;
            if !st.deferred {
                drop(st);
                self.finish_rank_summary()?;
            }
            return Ok(());
        };
        let dir = rank_dir(run, self.rank);
        let mut st = self.lock_rank_summary();
        if let Some(d) = detail {
            let part = crate::digest::timeline::PartTimeline::of(index, &digest.info.run_id, d);
            st.pending.push(part);
        }
        match &mut st.digest {
            Some(d) if d.last_index().is_none_or(|l| index > l) => d.add_part(index, len, digest),
            _ => {
                let listed = crate::digest::local::list_parts(&dir)?;
                let s = crate::digest::summarise_rank(&dir, self.rank, &listed, false);
                st.digest = Some(s.digest);
            }
        }
        st.dirty = true;
        if !st.deferred {
            drop(st);
            self.finish_rank_summary()?;
        }
        Ok(())
    }

    /// The rank summary an earlier writer of this rank left on the object store (`None` when
    /// there is none or it does not decode: the new one starts empty).
    fn stored_rank_summary(&self) -> Option<crate::digest::RankDigest> {
        let Location::Object { store, base, .. } = &self.location else {
            return None;
        };
        let path = crate::location::stored_rank_dir(base, self.rank)
            .join(crate::digest::RANK_SUMMARY_FILE);
        let rt = titan_storage::runtime();
        let bytes = rt
            .block_on(async { store.get(&path).await?.bytes().await })
            .ok()?;
        crate::digest::rank_file::decode(&bytes).ok()
    }

    /// Writes a file beside this rank's parts: atomically in a local folder, in one PUT to
    /// an object store.
    fn put_beside(&self, name: &str, body: Vec<u8>) -> Result<()> {
        match &self.location {
            Location::Local(run) => {
                crate::sidecar::write_atomic(&rank_dir(run, self.rank).join(name), &body)
            }
            Location::Object { store, base, .. } => {
                let path = crate::location::stored_rank_dir(base, self.rank).join(name);
                titan_storage::runtime()
                    .block_on(store.put(&path, body.into()))
                    .with_context(|| format!("uploading {path}"))?;
                Ok(())
            }
        }
    }

    fn put_part(&self, index: u64, bytes: bytes::Bytes) -> Result<String> {
        let name = part_file_name(index);
        match &self.location {
            Location::Local(run) => {
                let dir = rank_dir(run, self.rank);
                let tmp = dir.join(format!(".{name}.tmp"));
                let dst = dir.join(&name);
                let mut f = std::fs::File::create(&tmp)
                    .with_context(|| format!("creating {}", tmp.display()))?;
                f.write_all(&bytes)
                    .with_context(|| format!("writing {}", tmp.display()))?;
                drop(f);
                std::fs::rename(&tmp, &dst)
                    .with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))?;
                Ok(dst.display().to_string())
            }
            Location::Object { store, base, .. } => {
                let path = crate::location::stored_rank_dir(base, self.rank).join(name.as_str());
                let rt = titan_storage::runtime();
                let shown = format!("{}/{}", self.location.rank_display(self.rank), name);
                rt.block_on(store.put(&path, bytes.into()))
                    .with_context(|| format!("uploading {shown}"))?;
                Ok(shown)
            }
        }
    }
}
