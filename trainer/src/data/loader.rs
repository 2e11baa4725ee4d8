//! Packs tokenized documents into `seq_len` samples and batches them, as torchtitan 0.3.0's
//! `HuggingFaceTextDataset` does:
//!
//! - every document becomes `BOS + ids + EOS` and is shifted **within itself**: its inputs are
//!   `tokens[..n-1]`, its labels `tokens[1..]`, so a document's last token never predicts the next
//!   document's first;
//! - each token carries its **position in its document** (0, 1, 2, ...); a sample that starts in
//!   the middle of a document has that document's positions renumbered from 0 (torchtitan's
//!   `_normalize_positions`), so every sample's first token has position 0. The model rotates by
//!   these positions and attends only within a document ([`crate::config::AttnBackend`]);
//! - data-parallel rank `r` of `n` reads the `r`-th **contiguous** shard of the dataset (Hugging
//!   Face `split_dataset_by_node` on a map-style dataset: the first `len % n` shards hold one more
//!   document);
//! - when the shard runs out, epoch `e` re-reads it in the order of `shuffle(seed=42 + e)`
//!   ([`super::shuffle`]).
//!
//! The position ([`LoaderState`]) holds torchtitan's fields (`sample_idx`, `epoch`, the three
//! buffers), as plain serde data so a checkpoint resumes the stream exactly.

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::{Result, bail};
use rayon::prelude::*;
use tch::{Device, Tensor};

use super::source::{Dataset, DocStream};
use super::tokenizer::TextTokenizer;

/// Where this rank's loader is in its shard (torchtitan's dataset `state_dict`), stored in
/// checkpoints in torchtitan's own format ([`LoaderState::to_torchtitan_pickle`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoaderState {
    /// Documents of this rank's shard read in this epoch.
    pub sample_idx: u64,
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Tokens read but not yet emitted in a sample: inputs, labels (the inputs shifted within
    /// each document) and positions in the document.
    pub inputs_buffer: Vec<u32>,
    pub labels_buffer: Vec<u32>,
    pub positions_buffer: Vec<u32>,
    /// dp rank and degree this state was written by (resuming on another layout is refused).
    pub dp_rank: u64,
    pub dp_world: u64,
    /// Samples and batches handed out since the loader started (torch's StatefulDataLoader
    /// counts them; torchtitan's checkpoints carry them).
    pub samples_yielded: u64,
    pub batches_yielded: u64,
}

impl LoaderState {
    /// torchtitan's `dataloader.dp_rank_<r>` value: the pickled `state_dict()` of torchdata's
    /// StatefulDataLoader (no workers) around the dataset's own state, so torchtitan resumes
    /// from titan-train's checkpoints with the same data position.
    pub fn to_torchtitan_pickle(&self) -> Vec<u8> {
        use titan_dcp::pickle::{Protocol, Value, pickle};
        let s = |k: &str| Value::str(k);
        let int = |v: u64| Value::Int(v as i64);
        let ids = |v: &[u32]| Value::List(v.iter().map(|&t| Value::Int(t.into())).collect());
        let dataset = Value::Dict(vec![
            (s("inputs_buffer"), ids(&self.inputs_buffer)),
            (s("labels_buffer"), ids(&self.labels_buffer)),
            (s("positions_buffer"), ids(&self.positions_buffer)),
            (s("sample_idx"), int(self.sample_idx)),
            (s("epoch"), int(self.epoch)),
        ]);
        let state = Value::Dict(vec![
            (s("_index_sampler_state"), Value::None),
            (
                s("_sampler_iter_state"),
                Value::Dict(vec![(s("samples_yielded"), int(self.samples_yielded))]),
            ),
            (s("_sampler_iter_yielded"), int(self.batches_yielded)),
            (s("_num_yielded"), int(self.batches_yielded)),
            (s("_IterableDataset_len_called"), Value::None),
            (s("_shared_seed"), Value::None),
            (
                s("fetcher_state"),
                Value::Dict(vec![
                    (s("dataset_iter_state"), Value::None),
                    (s("fetcher_ended"), Value::Bool(false)),
                ]),
            ),
            (s("dataset_state"), dataset),
            (s("_iterator_finished"), Value::Bool(false)),
        ]);
        pickle(&state, Protocol::new(4).expect("protocol 4 exists"))
    }

    /// Reads torchtitan's pickled loader state (written by torchtitan or by
    /// [`LoaderState::to_torchtitan_pickle`]) without executing it: only its dicts, lists and
    /// numbers are read, with the unpickler's limits. `key` names it in errors.
    pub fn from_torchtitan_pickle(
        bytes: &[u8],
        dp_rank: u64,
        dp_world: u64,
        key: &str,
    ) -> Result<Self> {
        use titan_dcp::pickle::{Value, unpickle};
        let root = unpickle(bytes)
            .map_err(|e| anyhow::anyhow!("`{key}` is not a readable pickle: {e}"))?;
        fn get<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
            match v {
                Value::Dict(items) => items
                    .iter()
                    .find(|(k, _)| k.as_str() == Some(name))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        let Some(dataset) = get(&root, "dataset_state") else {
            bail!("`{key}` has no `dataset_state`: not a torchtitan text dataloader's state");
        };
        let count = |v: Option<&Value>, field: &str| -> Result<u64> {
            match v {
                None => Ok(0),
                Some(v) => v
                    .as_int()
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| anyhow::anyhow!("`{key}`: `{field}` is not a count")),
            }
        };
        let ids = |field: &str| -> Result<Vec<u32>> {
            // torchtitan's states before per-document positions lack that buffer (it warns and
            // starts it empty); the others are required.
            let Some(v) = get(dataset, field) else {
                if field == "positions_buffer" {
                    return Ok(Vec::new());
                }
                bail!("`{key}`: dataset_state has no `{field}`");
            };
            let Some(items) = v.as_seq() else {
                bail!("`{key}`: `{field}` is a {}, not a list", v.kind());
            };
            items
                .iter()
                .map(|t| {
                    t.as_int()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| {
                            anyhow::anyhow!("`{key}`: `{field}` holds a non-token {t:?}")
                        })
                })
                .collect()
        };
        let samples_yielded = count(
            get(&root, "_sampler_iter_state").and_then(|v| get(v, "samples_yielded")),
            "samples_yielded",
        )?;
        Ok(LoaderState {
            sample_idx: count(get(dataset, "sample_idx"), "sample_idx")?,
            epoch: count(get(dataset, "epoch"), "epoch")?,
            inputs_buffer: ids("inputs_buffer")?,
            labels_buffer: ids("labels_buffer")?,
            positions_buffer: ids("positions_buffer")?,
            dp_rank,
            dp_world,
            samples_yielded,
            batches_yielded: count(get(&root, "_num_yielded"), "_num_yielded")?,
        })
    }
}

/// One batch: `inputs`, `labels` and `positions`, each (B, seq_len) int64, with what the loop
/// and the model need to know of it counted on the host while the batch was still there, so
/// that nothing is read back from the device for it.
pub struct Batch {
    pub inputs: Tensor,
    pub labels: Tensor,
    /// Each token's position within its document (0 at every document start).
    pub positions: Tensor,
    /// Labels that count towards the loss (not `IGNORE_INDEX`): the loss denominator's share.
    pub valid_tokens: i64,
    /// Where each document starts in the packed (B * seq_len) tokens, then B * seq_len (int32,
    /// on the batch's device: the layout FlashAttention's varlen kernel takes).
    pub document_offsets: Tensor,
    /// The longest document's length (the varlen kernel's launch bound).
    pub longest_document: i64,
    /// Under context parallelism, set when the batch is split (the parallel plan's
    /// `ContextParallel::shard`): which of every rank's keys each of this rank's queries
    /// attends to (B, 1, S / cp, S).
    pub cp_mask: Option<Tensor>,
}

/// The label value the loss ignores (torch's `CrossEntropyLoss` default, torchtitan's
/// `IGNORE_INDEX`).
const IGNORE_INDEX: i64 = -100;

/// Document starts in the flat `positions` (where a position is 0), then their count, and the
/// longest document: what [`Batch::document_offsets`] and [`Batch::longest_document`] hold.
pub fn document_starts(positions: &[i64]) -> (Vec<i32>, i64) {
    let mut offsets: Vec<i32> = positions
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == 0)
        .map(|(i, _)| i as i32)
        .collect();
    offsets.push(positions.len() as i32);
    let longest = offsets
        .windows(2)
        .map(|w| i64::from(w[1] - w[0]))
        .max()
        .unwrap_or(0);
    (offsets, longest)
}

/// One `seq_len` sample.
struct Sample {
    inputs: Vec<u32>,
    labels: Vec<u32>,
    positions: Vec<u32>,
}

/// The documents `[start, end)` that dp rank `rank` of `world` reads from a dataset of `len`
/// documents: Hugging Face `Dataset.shard(world, rank, contiguous=True)`.
pub fn contiguous_shard(len: u64, world: u64, rank: u64) -> (u64, u64) {
    let (div, rem) = (len / world, len % world);
    let start = div * rank + rank.min(rem);
    let end = start + div + u64::from(rank < rem);
    (start, end)
}

/// This rank's shard of the dataset, open at a document.
struct OpenShard {
    order: ShardOrder,
    /// Documents in this rank's shard.
    len: u64,
}

/// How an epoch reads the shard.
enum ShardOrder {
    /// Epoch 0: the stored order, streamed.
    Stored(DocStream),
    /// Later epochs: torchtitan re-shuffles the shard (`shuffle(seed=42 + epoch)`), so its
    /// documents are held in memory and visited in that permutation.
    Shuffled { docs: Vec<String>, order: Vec<u64> },
}

/// torchtitan's seed for epoch `e`'s shuffle (`HuggingFaceTextDataset.reloop`).
fn shuffle_seed(epoch: u64) -> u64 {
    // Saturating: a damaged checkpoint's epoch must not overflow.
    epoch.saturating_add(42)
}

/// A packing, batching loader over one dataset for one dp rank.
pub struct TextLoader {
    dataset: Dataset,
    tokenizer: Arc<TextTokenizer>,
    seq_len: usize,
    batch_size: usize,
    /// Restart at the beginning when the dataset ends (training) or stop (validation).
    infinite: bool,
    state: LoaderState,
    shard: Option<OpenShard>,
    /// The dataset's document count, read once (a pass over its files).
    total_docs: Option<u64>,
    /// Where reading is: ahead of `state` by the documents in `tokenized`.
    read: Cursor,
    /// Documents read and tokenized ahead (in parallel), not yet packed into samples.
    tokenized: VecDeque<TokenizedDoc>,
}

/// A document position in this rank's shard: torchtitan's `sample_idx` and `epoch`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Cursor {
    sample_idx: u64,
    epoch: u64,
}

/// A document's tokens, with where reading was once it was read (the loader's position once
/// it is packed).
struct TokenizedDoc {
    tokens: Vec<u32>,
    after: Cursor,
}

/// Documents tokenized together on the loader's thread pool: enough that a step's batch
/// rarely waits for one document, few enough that a resume re-reads little.
const TOKENIZE_AHEAD: usize = 64;

impl TextLoader {
    pub fn new(
        dataset: Dataset,
        tokenizer: Arc<TextTokenizer>,
        seq_len: usize,
        batch_size: usize,
        dp_rank: u64,
        dp_world: u64,
        infinite: bool,
    ) -> Self {
        Self {
            dataset,
            tokenizer,
            seq_len,
            batch_size,
            infinite,
            state: LoaderState {
                dp_rank,
                dp_world,
                ..LoaderState::default()
            },
            shard: None,
            total_docs: None,
            read: Cursor::default(),
            tokenized: VecDeque::new(),
        }
    }

    /// Reading restarts at `state`'s position (what was read ahead is dropped).
    fn reread_from_state(&mut self) {
        self.read = Cursor {
            sample_idx: self.state.sample_idx,
            epoch: self.state.epoch,
        };
        self.tokenized.clear();
        self.shard = None;
    }

    /// The resumable position.
    pub fn state(&self) -> &LoaderState {
        &self.state
    }

    /// Resumes from a saved position (the shard is re-read up to it).
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        if (state.dp_rank, state.dp_world) != (self.state.dp_rank, self.state.dp_world) {
            bail!(
                "dataloader state was saved by dp rank {} of {}, but this is dp rank {} of {}",
                state.dp_rank,
                state.dp_world,
                self.state.dp_rank,
                self.state.dp_world
            );
        }
        let n = state.inputs_buffer.len();
        if state.labels_buffer.len() != n || state.positions_buffer.len() != n {
            bail!(
                "dataloader state has {} inputs, {} labels and {} positions buffered; they must be equal",
                n,
                state.labels_buffer.len(),
                state.positions_buffer.len()
            );
        }
        self.state = state;
        self.reread_from_state();
        Ok(())
    }

    /// Starts over at the beginning of the dataset (validation runs each time from the start).
    pub fn reset(&mut self) {
        let (r, w) = (self.state.dp_rank, self.state.dp_world);
        self.state = LoaderState {
            dp_rank: r,
            dp_world: w,
            ..LoaderState::default()
        };
        self.reread_from_state();
    }

    /// Opens this rank's shard at `sample_idx` of the current epoch.
    fn open_shard(&mut self) -> Result<OpenShard> {
        let total = match self.total_docs {
            Some(n) => n,
            None => *self.total_docs.insert(self.dataset.count_docs()?),
        };
        let (start, end) = contiguous_shard(total, self.state.dp_world, self.state.dp_rank);
        let len = end - start;
        let mut stream = self.dataset.open()?;
        let changed = || {
            anyhow::anyhow!(
                "the dataset ended before its counted {total} documents (changed on disk?)"
            )
        };
        let skip = if self.read.epoch == 0 {
            start + self.read.sample_idx.min(len)
        } else {
            start
        };
        for _ in 0..skip {
            stream.next_doc()?.ok_or_else(changed)?;
        }
        let order = if self.read.epoch == 0 {
            ShardOrder::Stored(stream)
        } else {
            let mut docs = Vec::with_capacity(len as usize);
            for _ in 0..len {
                docs.push(stream.next_doc()?.ok_or_else(changed)?);
            }
            ShardOrder::Shuffled {
                docs,
                order: super::shuffle::permutation(shuffle_seed(self.read.epoch), len),
            }
        };
        Ok(OpenShard { order, len })
    }

    /// The next document of this rank's shard, handling the end of the shard.
    fn next_doc(&mut self) -> Result<Option<String>> {
        let mut relooped_empty = false;
        loop {
            if self.shard.is_none() {
                self.shard = Some(self.open_shard()?);
            }
            let shard = self.shard.as_mut().expect("opened above");
            if self.read.sample_idx < shard.len {
                let doc = match &mut shard.order {
                    ShardOrder::Stored(stream) => stream.next_doc()?.ok_or_else(|| {
                        anyhow::anyhow!(
                            "the dataset ended inside dp rank {}'s shard (changed on disk?)",
                            self.state.dp_rank
                        )
                    })?,
                    // Each index comes once per epoch: the text can be moved out.
                    ShardOrder::Shuffled { docs, order } => {
                        std::mem::take(&mut docs[order[self.read.sample_idx as usize] as usize])
                    }
                };
                self.read.sample_idx += 1;
                return Ok(Some(doc));
            }
            if !self.infinite {
                return Ok(None);
            }
            if relooped_empty || shard.len == 0 {
                bail!(
                    "the dataset has no documents for dp rank {} of {}",
                    self.state.dp_rank,
                    self.state.dp_world
                );
            }
            relooped_empty = self.read.sample_idx == 0;
            self.read.epoch += 1;
            self.read.sample_idx = 0;
            self.shard = None;
            tracing::warn!(
                epoch = self.read.epoch,
                "dataset exhausted; re-looping in torchtitan's order for this epoch \
                 (shuffle seed {})",
                shuffle_seed(self.read.epoch)
            );
        }
    }

    /// The next document's tokens (moving the loader's position past it), or `None` when a
    /// finite dataset ends. Documents are read [`TOKENIZE_AHEAD`] at a time and tokenized in
    /// parallel: one thread tokenizing a batch of 2048-token samples takes longer than a GPU
    /// step on small models.
    fn next_tokens(&mut self) -> Result<Option<Vec<u32>>> {
        if self.tokenized.is_empty() {
            let mut docs = Vec::with_capacity(TOKENIZE_AHEAD);
            while docs.len() < TOKENIZE_AHEAD {
                let Some(doc) = self.next_doc()? else { break };
                docs.push((doc, self.read));
            }
            let tokenizer = &self.tokenizer;
            let tokenized: Vec<Result<TokenizedDoc>> = docs
                .into_par_iter()
                .map(|(doc, after)| {
                    Ok(TokenizedDoc {
                        tokens: tokenizer.encode(&doc)?,
                        after,
                    })
                })
                .collect();
            for doc in tokenized {
                self.tokenized.push_back(doc?);
            }
        }
        let Some(doc) = self.tokenized.pop_front() else {
            return Ok(None);
        };
        (self.state.sample_idx, self.state.epoch) = (doc.after.sample_idx, doc.after.epoch);
        Ok(Some(doc.tokens))
    }

    /// The next `seq_len` sample, or `None` when a finite dataset ends.
    fn next_sample(&mut self) -> Result<Option<Sample>> {
        let s = self.seq_len;
        while self.state.inputs_buffer.len() < s {
            let Some(tokens) = self.next_tokens()? else {
                return Ok(None);
            };
            if tokens.len() < 2 {
                continue;
            }
            let n = tokens.len() - 1;
            self.state.inputs_buffer.extend_from_slice(&tokens[..n]);
            self.state.labels_buffer.extend_from_slice(&tokens[1..]);
            self.state.positions_buffer.extend(0..n as u32);
        }
        let take = |buffer: &mut Vec<u32>| {
            let rest = buffer.split_off(s);
            std::mem::replace(buffer, rest)
        };
        let inputs = take(&mut self.state.inputs_buffer);
        let labels = take(&mut self.state.labels_buffer);
        let mut positions = take(&mut self.state.positions_buffer);
        normalize_positions(&mut positions);
        Ok(Some(Sample {
            inputs,
            labels,
            positions,
        }))
    }

    /// The next batch on `device`; a finite dataset's last batch may be smaller, then `None`.
    pub fn next_batch(&mut self, device: Device) -> Result<Option<Batch>> {
        Ok(self.next_host_batch()?.map(|b| b.to_device(device)))
    }

    /// The next batch, still on the host (no tch call: a background thread builds these, see
    /// [`super::PrefetchLoader`]), with this loader's position after it.
    pub fn next_host_batch(&mut self) -> Result<Option<HostBatch>> {
        let mut samples = Vec::with_capacity(self.batch_size);
        while samples.len() < self.batch_size {
            match self.next_sample()? {
                Some(w) => samples.push(w),
                None => break,
            }
        }
        if samples.is_empty() {
            return Ok(None);
        }
        self.state.samples_yielded += samples.len() as u64;
        self.state.batches_yielded += 1;
        let column = |pick: fn(&Sample) -> &Vec<u32>| -> Vec<i64> {
            samples
                .iter()
                .flat_map(|w| pick(w).iter().map(|&t| i64::from(t)))
                .collect()
        };
        let (inputs, labels, positions) = (
            column(|w| &w.inputs),
            column(|w| &w.labels),
            column(|w| &w.positions),
        );
        let valid_tokens = labels.iter().filter(|&&l| l != IGNORE_INDEX).count() as i64;
        let (document_offsets, longest_document) = document_starts(&positions);
        Ok(Some(HostBatch {
            shape: [samples.len() as i64, self.seq_len as i64],
            inputs,
            labels,
            positions,
            valid_tokens,
            document_offsets,
            longest_document,
            state_after: self.state.clone(),
        }))
    }
}

/// A batch as the loader builds it on the host, before it goes to the device.
pub struct HostBatch {
    /// (B, seq_len).
    shape: [i64; 2],
    inputs: Vec<i64>,
    labels: Vec<i64>,
    positions: Vec<i64>,
    valid_tokens: i64,
    document_offsets: Vec<i32>,
    longest_document: i64,
    /// The loader's position once this batch is handed out: what a checkpoint taken after
    /// training on it must store, however far ahead a background loader has read since.
    pub state_after: LoaderState,
}

impl HostBatch {
    /// The batch on `device`: pinned, non-blocking copies on CUDA ([`crate::host_sync::upload`]).
    pub fn to_device(self, device: Device) -> Batch {
        let upload = |v: &[i64]| crate::host_sync::upload(v, &self.shape, device);
        Batch {
            inputs: upload(&self.inputs),
            labels: upload(&self.labels),
            positions: upload(&self.positions),
            valid_tokens: self.valid_tokens,
            document_offsets: crate::host_sync::upload(
                &self.document_offsets,
                &[self.document_offsets.len() as i64],
                device,
            ),
            longest_document: self.longest_document,
            cp_mask: None,
        }
    }
}

/// Renumbers the positions of a document continued from the previous sample so that it starts
/// at 0 here too (torchtitan's `_normalize_positions`): the model sees each sample's first token
/// as a document start.
fn normalize_positions(positions: &mut [u32]) {
    let offset = positions.first().copied().unwrap_or(0);
    if offset == 0 {
        return;
    }
    for p in positions.iter_mut() {
        if *p == 0 {
            break;
        }
        *p -= offset;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loader(rank: u64, world: u64, infinite: bool) -> TextLoader {
        let tok = Arc::new(TextTokenizer::embedded().unwrap());
        TextLoader::new(
            Dataset::DefaultValidation,
            tok,
            32,
            2,
            rank,
            world,
            infinite,
        )
    }

    /// What the loader counts on the host is what the model would read back from the device.
    #[test]
    fn host_counts_match_the_batch_on_the_device() {
        let mut l = loader(0, 1, true);
        for _ in 0..3 {
            let b = l.next_batch(Device::Cpu).unwrap().unwrap();
            let (offsets, longest) = crate::model::document_offsets(&b.positions);
            assert_eq!(
                Vec::<i32>::try_from(&b.document_offsets).unwrap(),
                Vec::<i32>::try_from(&offsets).unwrap()
            );
            assert_eq!(b.longest_document, longest);
            assert_eq!(
                b.valid_tokens,
                b.labels
                    .ne(IGNORE_INDEX)
                    .sum(tch::Kind::Int64)
                    .int64_value(&[])
            );
        }
        assert_eq!(document_starts(&[0, 1, 2, 0, 1, 0]), (vec![0, 3, 5, 6], 3));
        // A sample that continues a document from the previous one starts at position 0 too.
        assert_eq!(document_starts(&[0, 0]), (vec![0, 1, 2], 1));
    }

    fn rows(t: &Tensor) -> Vec<Vec<i64>> {
        (0..t.size()[0])
            .map(|i| Vec::<i64>::try_from(&t.get(i)).unwrap())
            .collect()
    }

    /// The torchtitan stream written out plainly: per document, inputs/labels shifted within the
    /// document and positions from 0, concatenated, cut into `seq_len` samples.
    fn reference(l: &TextLoader, docs: &[String], seq_len: usize) -> Vec<[Vec<i64>; 3]> {
        let (mut i, mut t, mut p) = (Vec::new(), Vec::new(), Vec::new());
        for doc in docs {
            let ids: Vec<i64> = l
                .tokenizer
                .encode(doc)
                .unwrap()
                .iter()
                .map(|&x| x as i64)
                .collect();
            let n = ids.len() - 1;
            i.extend_from_slice(&ids[..n]);
            t.extend_from_slice(&ids[1..]);
            p.extend(0..n as i64);
        }
        let mut out = Vec::new();
        let mut at = 0;
        while at + seq_len <= i.len() {
            let mut pos = p[at..at + seq_len].to_vec();
            let off = pos[0];
            for x in pos.iter_mut() {
                if *x == 0 {
                    break;
                }
                *x -= off;
            }
            out.push([
                i[at..at + seq_len].to_vec(),
                t[at..at + seq_len].to_vec(),
                pos,
            ]);
            at += seq_len;
        }
        out
    }

    #[test]
    fn samples_shift_within_documents_with_document_positions() {
        let mut l = loader(0, 1, false);
        let want = reference(&l, &Dataset::DefaultValidation.read_all().unwrap(), 32);
        let mut got = Vec::new();
        while let Some(b) = l.next_batch(Device::Cpu).unwrap() {
            assert_eq!(b.inputs.size(), b.positions.size());
            for ((i, t), p) in rows(&b.inputs)
                .into_iter()
                .zip(rows(&b.labels))
                .zip(rows(&b.positions))
            {
                got.push([i, t, p]);
            }
        }
        assert_eq!(got.len(), want.len());
        assert_eq!(got, want);
        let bos = l.tokenizer.bos_id.unwrap() as i64;
        let eos = l.tokenizer.eos_id.unwrap() as i64;
        // No label is a BOS (that would be a document predicting the next one's first token) and
        // every EOS label ends a document: the next input is a BOS at position 0.
        for [i, t, p] in &got {
            assert_eq!(p[0], 0);
            assert!(!t.contains(&bos));
            for k in 0..31 {
                if t[k] == eos {
                    assert_eq!((i[k + 1], p[k + 1]), (bos, 0));
                } else {
                    assert_eq!(p[k + 1], p[k] + 1, "positions count up within a document");
                }
            }
        }
    }

    #[test]
    fn positions_of_a_continued_document_restart_at_zero() {
        let mut p = vec![5, 6, 7, 0, 1, 2];
        normalize_positions(&mut p);
        assert_eq!(p, [0, 1, 2, 0, 1, 2]);
        let mut q = vec![0, 1, 0];
        normalize_positions(&mut q);
        assert_eq!(q, [0, 1, 0]);
    }

    #[test]
    fn shards_are_contiguous_like_hugging_face() {
        // Dataset.shard(contiguous=True): 10 rows over 3 ranks -> 4, 3, 3.
        assert_eq!(contiguous_shard(10, 3, 0), (0, 4));
        assert_eq!(contiguous_shard(10, 3, 1), (4, 7));
        assert_eq!(contiguous_shard(10, 3, 2), (7, 10));
        assert_eq!(contiguous_shard(7, 1, 0), (0, 7));
        // Rank 1 of 2 reads exactly the second half of the documents.
        let all = Dataset::DefaultValidation.read_all().unwrap();
        let mut l = loader(1, 2, false);
        let (start, _) = contiguous_shard(all.len() as u64, 2, 1);
        let want = reference(&l, &all[start as usize..], 32);
        let first = l.next_batch(Device::Cpu).unwrap().unwrap();
        assert_eq!(rows(&first.inputs)[0], want[0][0]);
    }

    #[test]
    fn resume_from_state_continues_identically() {
        let mut a = loader(0, 1, true);
        for _ in 0..3 {
            a.next_batch(Device::Cpu).unwrap();
        }
        let saved = a.state().to_torchtitan_pickle();
        let restore = |rank, world| LoaderState::from_torchtitan_pickle(&saved, rank, world, "k");
        let take = |l: &mut TextLoader| {
            let b = l.next_batch(Device::Cpu).unwrap().unwrap();
            (rows(&b.inputs), rows(&b.labels), rows(&b.positions))
        };
        let want: Vec<_> = (0..4).map(|_| take(&mut a)).collect();
        let mut b = loader(0, 1, true);
        b.load_state(restore(0, 1).unwrap()).unwrap();
        let got: Vec<_> = (0..4).map(|_| take(&mut b)).collect();
        assert_eq!(got, want);
        let mut wrong = loader(1, 2, true);
        assert!(wrong.load_state(restore(0, 1).unwrap()).is_err());
    }

    #[test]
    fn torchtitans_pickled_state_round_trips() {
        let mut a = loader(1, 2, true);
        for _ in 0..3 {
            a.next_batch(Device::Cpu).unwrap();
        }
        let bytes = a.state().to_torchtitan_pickle();
        let back = LoaderState::from_torchtitan_pickle(&bytes, 1, 2, "k").unwrap();
        assert_eq!(&back, a.state());
        assert_eq!((back.samples_yielded, back.batches_yielded), (6, 3));
        let err = LoaderState::from_torchtitan_pickle(b"{}", 1, 2, "dataloader.dp_rank_1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("dataloader.dp_rank_1"), "{err}");
    }

    #[test]
    fn dp_ranks_split_documents_and_finite_loader_ends() {
        let count = |rank, world| {
            let mut l = loader(rank, world, false);
            while l.next_batch(Device::Cpu).unwrap().is_some() {}
            l.state().sample_idx
        };
        let all = count(0, 1);
        assert_eq!(count(0, 2) + count(1, 2), all);
        assert!(count(0, 2) > 0 && count(1, 2) > 0);
    }

    #[test]
    fn later_epochs_read_the_shard_in_torchtitans_shuffled_order() {
        let all = Dataset::DefaultValidation.read_all().unwrap();
        let (start, end) = contiguous_shard(all.len() as u64, 2, 1);
        let shard = &all[start as usize..end as usize];
        let mut l = loader(1, 2, true);
        l.load_state(LoaderState {
            epoch: 1,
            ..l.state().clone()
        })
        .unwrap();
        let order = crate::data::shuffle::permutation(43, shard.len() as u64);
        let shuffled: Vec<String> = order.iter().map(|&i| shard[i as usize].clone()).collect();
        let want = reference(&l, &shuffled, 32);
        let b = l.next_batch(Device::Cpu).unwrap().unwrap();
        assert_eq!(
            rows(&b.inputs),
            vec![want[0][0].clone(), want[1][0].clone()]
        );
        // Resuming mid-epoch 1 continues the same permutation.
        let saved = l.state().clone();
        let next = l.next_batch(Device::Cpu).unwrap().unwrap();
        let mut r = loader(1, 2, true);
        r.load_state(saved).unwrap();
        let again = r.next_batch(Device::Cpu).unwrap().unwrap();
        assert_eq!(rows(&again.inputs), rows(&next.inputs));
    }

    #[test]
    fn infinite_loader_wraps_around() {
        let mut l = loader(0, 1, true);
        let mut batches = 0;
        while l.state().epoch == 0 {
            l.next_batch(Device::Cpu).unwrap().unwrap();
            batches += 1;
            assert!(batches < 100_000);
        }
        assert_eq!(l.state().epoch, 1);
    }
}
