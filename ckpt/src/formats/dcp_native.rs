//! DCP native checkpoints (`.metadata` + `__R_K.distcp`), read and written through
//! [`titan_dcp`].
//!
//! Reading maps every chunk to a plan chunk: an untransformed item whose tensor is contiguous
//! becomes a raw byte range of the `.distcp` file (streamed like safetensors data); a zstd or
//! strided item is decoded by the DCP reader when its bytes are needed.
//!
//! Writing runs the copy engine (`write::TensorCopier`, as for safetensors) into a [`DcpSink`]
//! that cuts each tensor into row chunks for `titan_dcp::DcpWriter`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::dcp_store::{DcpHandle, RootStore};
use crate::error::{Error, Result};
use crate::plan::{BytesItem, CheckpointPlan, Chunk, ChunkSource, Encoding, Format};
use crate::storage::Root;
use crate::write::{EngineOptions, OutTensor, TensorCopier, TensorSink};
use titan_dcp::{self, DcpReader, FileKey, PlannerData, ReadOptions, TensorChunk};

pub fn read(root: &Root) -> Result<CheckpointPlan> {
    let reader = DcpReader::with_store(RootStore::new(root.clone()), ReadOptions::default())?;
    let mut files: Vec<String> = Vec::new();
    let mut file_index: HashMap<String, usize> = HashMap::new();
    let mut index_of = |rel: &str| -> usize {
        *file_index.entry(rel.to_string()).or_insert_with(|| {
            files.push(rel.to_string());
            files.len() - 1
        })
    };
    let mut tensors = BTreeMap::new();
    for (fqn, t) in reader.tensors() {
        let dtype = t.properties.dtype;
        let es = dtype.size() as u64;
        let mut chunks = Vec::with_capacity(t.chunks.len());
        for (i, c) in t.chunks.iter().enumerate() {
            let loc = reader.chunk_location(fqn, i)?;
            let file = index_of(&loc.relative_path);
            let want = c.numel() * es;
            let raw = loc.layout.as_ref().and_then(|l| {
                let (off, len) = l.contiguous_range()?;
                (loc.transforms.is_empty()
                    && l.dtype == dtype
                    && len == want
                    && off + len <= loc.item_length)
                    .then_some((loc.item_offset + off, len))
            });
            let source = match raw {
                Some((begin, len)) => ChunkSource {
                    file,
                    begin,
                    end: begin + len,
                    encoding: Encoding::Raw,
                },
                None => ChunkSource {
                    file,
                    begin: loc.item_offset,
                    end: loc.item_offset + loc.item_length,
                    encoding: Encoding::DcpItem {
                        fqn: fqn.to_string(),
                        chunk: i,
                    },
                },
            };
            chunks.push(Chunk {
                offsets: c.offsets.clone(),
                sizes: c.sizes.clone(),
                source,
            });
        }
        tensors.insert(
            fqn.to_string(),
            crate::plan::TensorPlan {
                dtype,
                shape: t.size.clone(),
                chunks,
                scales: None,
            },
        );
    }
    let mut bytes_items = BTreeMap::new();
    for name in reader.bytes_items() {
        let file = reader
            .metadata()
            .storage_data
            .iter()
            .find(|(idx, _)| idx.fqn == name && idx.offset.is_none())
            .map(|(_, info)| info.relative_path.clone())
            .unwrap_or_default();
        bytes_items.insert(name.to_string(), BytesItem { file });
    }
    Ok(CheckpointPlan {
        format: Format::Dcp,
        root: root.clone(),
        files,
        tensors,
        bytes_items,
        dcp: Some(DcpHandle(Arc::new(reader))),
    })
}

/// Decodes every transformed item and bytes item once, so `verify` catches corrupt archives
/// and zstd streams, not only inconsistent metadata.
pub fn check_items(plan: &CheckpointPlan) -> Result<()> {
    let Some(dcp) = &plan.dcp else { return Ok(()) };
    for t in plan.tensors.values() {
        for c in &t.chunks {
            if let Encoding::DcpItem { fqn, chunk } = &c.source.encoding {
                dcp.decode_chunk(fqn, *chunk)?;
            }
        }
    }
    for name in plan.bytes_items.keys() {
        dcp.0.read_bytes(name)?;
    }
    Ok(())
}

/// How to write a DCP native checkpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct DcpOutput {
    /// zstd level for the `stream.zstd/1` transform (torch's ZStandard extension), or none.
    pub zstd_level: Option<i32>,
}

/// Writes `tensors` (and the plan's bytes items) as a DCP native checkpoint in the local
/// directory `out`. Each tensor is stored as row blocks of at most the engine's window, so memory
/// stays bounded; torch's `dcp.load` reassembles any chunking.
pub fn write(
    plan: &CheckpointPlan,
    out: &Root,
    tensors: &[OutTensor],
    output: DcpOutput,
    opts: &EngineOptions,
) -> Result<()> {
    // DCP files are written locally (torch.save zip items, `.metadata` from what was written);
    // an object store destination gets them uploaded afterwards, `.metadata` last.
    let staging;
    let dir = match out.local_dir() {
        Some(d) => d,
        None => {
            staging = tempfile::Builder::new()
                .prefix("titan-ckpt-dcp-")
                .tempdir()
                .map_err(|e| Error::io("a local staging directory for the DCP output", e))?;
            staging.path()
        }
    };
    let inputs = plan.open_files()?;
    let mut copier = TensorCopier::new(plan, &inputs, opts);
    let mut writer = titan_dcp::DcpWriter::create(
        dir,
        titan_dcp::WriteOptions {
            zstd_level: output.zstd_level,
            fsync: true,
        },
    )?;
    let key = FileKey { rank: 0, k: 0 };
    let planner_paths: HashMap<&str, &Vec<titan_dcp::PathPart>> =
        match plan.dcp.as_ref().map(|d| &d.0.metadata().planner_data) {
            Some(PlannerData::Flatten(paths)) => {
                paths.iter().map(|(k, v)| (k.as_str(), v)).collect()
            }
            _ => HashMap::new(),
        };
    opts.progress
        .set_length(tensors.iter().map(|t| t.input_bytes(plan)).sum());
    let mut pending = Vec::new();
    for t in tensors {
        let mut sink = DcpSink {
            writer: &mut writer,
            key,
            tensor: t,
            row_bytes: t.shape.iter().skip(1).product::<u64>() * t.dtype.size() as u64,
            window: opts.window_bytes.max(1),
            next_row: 0,
            pending: std::mem::take(&mut pending),
        };
        copier.write_tensor(t, &mut sink)?;
        sink.finish()?;
        pending = sink.pending;
        if t.whole_source() == Some(t.name.as_str())
            && let Some(path) = planner_paths.get(t.name.as_str())
        {
            writer.set_planner_path(&t.name, (*path).clone());
        }
    }
    if let Some(dcp) = &plan.dcp {
        for name in plan.bytes_items.keys() {
            let bytes = dcp.0.read_bytes(name)?;
            writer.add_bytes(key, name, &bytes)?;
            if let Some(path) = planner_paths.get(name.as_str()) {
                writer.set_planner_path(name, (*path).clone());
            }
        }
    }
    writer.finish()?;
    if out.local_dir().is_none() {
        out.upload_dir(dir, titan_dcp::METADATA_FILE)?;
    }
    Ok(())
}

/// How DCP output is named in messages (it is staged before it gets a name).
const DCP_OUTPUT: &str = "the DCP output";

/// The copy engine's output into a DCP writer: the tensor's bytes arrive in order and leave as
/// chunks of whole rows (dim 0) of about the engine's window, so memory stays bounded and torch's
/// `dcp.load` reassembles them.
struct DcpSink<'w, 't> {
    writer: &'w mut titan_dcp::DcpWriter,
    key: FileKey,
    tensor: &'t OutTensor,
    /// Bytes of one row (a 0-d tensor is one row of one element).
    row_bytes: u64,
    window: u64,
    /// The first row not written yet; `pending` holds the bytes from there.
    next_row: u64,
    pending: Vec<u8>,
}

impl DcpSink<'_, '_> {
    fn written(&self) -> u64 {
        self.next_row * self.row_bytes.max(1)
    }

    /// Writes the first `n` pending bytes as the chunk at `offsets` of size `sizes`.
    fn add_chunk(&mut self, offsets: &[u64], sizes: &[u64], n: usize) -> Result<()> {
        let t = self.tensor;
        self.writer.add_tensor_chunk(
            self.key,
            TensorChunk {
                fqn: &t.name,
                dtype: t.dtype,
                global_shape: &t.shape,
                offsets,
                sizes,
                data: &self.pending[..n],
            },
        )?;
        Ok(())
    }

    /// Writes the whole rows in `pending` as one chunk.
    fn flush_rows(&mut self) -> Result<()> {
        let t = self.tensor;
        if t.shape.is_empty() {
            return Ok(());
        }
        // Rows of zero bytes (a 0 in a later dim) all go in one chunk.
        let rows = (self.pending.len() as u64)
            .checked_div(self.row_bytes)
            .unwrap_or(t.shape[0] - self.next_row);
        if rows == 0 {
            return Ok(());
        }
        let n = (rows * self.row_bytes) as usize;
        let mut offsets = vec![0u64; t.shape.len()];
        let mut sizes = t.shape.clone();
        offsets[0] = self.next_row;
        sizes[0] = rows;
        self.add_chunk(&offsets, &sizes, n)?;
        self.pending.drain(..n);
        self.next_row += rows;
        Ok(())
    }

    /// Writes what is left; every row must have arrived.
    fn finish(&mut self) -> Result<()> {
        let t = self.tensor;
        if t.shape.is_empty() {
            self.add_chunk(&[], &[], self.pending.len())?;
            self.pending.clear();
            return Ok(());
        }
        self.flush_rows()?;
        if self.next_row != t.shape[0] || !self.pending.is_empty() {
            return Err(Error::tensor(
                DCP_OUTPUT,
                &t.name,
                format!(
                    "internal: {} of {} rows written to the DCP output",
                    self.next_row, t.shape[0]
                ),
            ));
        }
        Ok(())
    }
}

impl TensorSink for DcpSink<'_, '_> {
    fn put(&mut self, pos: u64, data: &[u8]) -> Result<()> {
        let expected = self.written() + self.pending.len() as u64;
        if pos != expected {
            return Err(Error::tensor(
                DCP_OUTPUT,
                &self.tensor.name,
                format!("internal: DCP output takes bytes in order (at {expected}, got {pos})"),
            ));
        }
        self.pending.extend_from_slice(data);
        if self.pending.len() as u64 >= self.window {
            self.flush_rows()?;
        }
        Ok(())
    }
}
