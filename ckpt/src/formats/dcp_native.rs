//! DCP native checkpoints (`.metadata` + `__R_K.distcp`), read and written through
//! [`titan_dcp`].
//!
//! Reading maps every chunk to a plan chunk: an untransformed item whose tensor is contiguous
//! becomes a raw byte range of the `.distcp` file (streamed like safetensors data); a zstd or
//! strided item is decoded by the DCP reader when its bytes are needed.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::{Arc, Mutex};

use crate::assemble::TensorReader;
use crate::error::{Error, Result};
use crate::plan::{BytesItem, CheckpointPlan, Chunk, ChunkSource, DcpHandle, Encoding, Format};
use crate::storage::{InFile, Root};
use crate::write::{EngineOptions, OutTensor};
use titan_dcp::{self, CheckpointStore, DcpReader, FileKey, PlannerData, ReadOptions, TensorChunk};

/// The DCP reader's view of a [`Root`] (local or object store), with opened files cached.
pub struct RootStore {
    root: Root,
    open: Mutex<HashMap<String, Arc<InFile>>>,
}

impl RootStore {
    pub fn new(root: Root) -> RootStore {
        RootStore {
            root,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, rel: &str) -> io::Result<Arc<InFile>> {
        let mut open = self.open.lock().expect("file cache lock");
        if let Some(f) = open.get(rel) {
            return Ok(f.clone());
        }
        let f = Arc::new(self.root.open(rel).map_err(to_io)?);
        open.insert(rel.to_string(), f.clone());
        Ok(f)
    }
}

fn to_io(e: titan_storage::StorageError) -> io::Error {
    match e {
        titan_storage::StorageError::Io { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

impl CheckpointStore for RootStore {
    fn describe(&self, relative_path: &str) -> String {
        self.root.display_file(relative_path)
    }

    fn file_len(&self, relative_path: &str) -> io::Result<u64> {
        Ok(self.file(relative_path)?.size)
    }

    fn read_range(&self, relative_path: &str, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let f = self.file(relative_path)?;
        if offset.checked_add(len).is_none_or(|e| e > f.size) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "range {offset}+{len} is past the end ({} bytes): truncated",
                    f.size
                ),
            ));
        }
        let mut buf = vec![0u8; len as usize];
        f.read_at(offset, &mut buf).map_err(to_io)?;
        Ok(buf)
    }
}

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

/// Decodes chunk `chunk` of `fqn` into its C-order little-endian bytes.
pub fn decode_chunk(dcp: &DcpHandle, fqn: &str, chunk: usize) -> Result<Vec<u8>> {
    Ok(dcp.0.read_chunk(fqn, chunk)?.data)
}

/// Decodes every transformed item and bytes item once, so `verify` catches corrupt archives
/// and zstd streams, not only inconsistent metadata.
pub fn check_items(plan: &CheckpointPlan) -> Result<()> {
    let Some(dcp) = &plan.dcp else { return Ok(()) };
    for t in plan.tensors.values() {
        for c in &t.chunks {
            if let Encoding::DcpItem { fqn, chunk } = &c.source.encoding {
                decode_chunk(dcp, fqn, *chunk)?;
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
    let inputs: Vec<InFile> = plan
        .files
        .iter()
        .map(|f| Ok(plan.root.open(f)?))
        .collect::<Result<_>>()?;
    let mut reader = TensorReader::new(plan, &inputs);
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
    let mut block = Vec::new();
    let mut converted = Vec::new();
    let mut tile = Vec::new();
    for t in tensors {
        let sources = crate::write::resolve_sources(plan, t)?;
        let in_dtype = sources.first().map(|(s, _)| s.dtype).unwrap_or(t.dtype);
        let rows = t.shape.first().copied().unwrap_or(1);
        let row_len: u64 = t.shape.iter().skip(1).product();
        let es = in_dtype.size() as u64;
        let per = (opts.window_bytes / (row_len * es).max(1)).max(1);
        if let Some(map) = t.row_map {
            map.check(&t.name, rows)?;
        }
        let mut r = 0;
        loop {
            let end = (r + per).min(rows);
            block.clear();
            match (t.row_map, t.transpose, sources.as_slice()) {
                (Some(map), _, [(src, _)]) => {
                    let mut row = vec![0u8; (row_len * es) as usize];
                    for out_row in r..end {
                        let in_row = map.source_row(out_row, rows);
                        reader.read(src, in_row * row_len..(in_row + 1) * row_len, &mut row)?;
                        block.extend_from_slice(&row);
                    }
                }
                (Some(_), _, _) | (None, Some(_), _) if sources.len() != 1 => {
                    return Err(Error::tensor(
                        plan.root.display(),
                        &t.name,
                        "internal: a RoPE row map or expert transpose needs exactly one source",
                    ));
                }
                (None, Some(tr), [(src, _)]) => {
                    block.resize(((end - r) * row_len * es) as usize, 0);
                    tr.read(
                        &mut reader,
                        src,
                        r * row_len..end * row_len,
                        &mut block,
                        &mut tile,
                    )?;
                }
                // No reordering: a copy, or experts concatenated.
                _ => {
                    let n = if t.shape.is_empty() {
                        1
                    } else {
                        (end - r) * row_len
                    };
                    let start = if t.shape.is_empty() { 0 } else { r * row_len };
                    block.resize((n * es) as usize, 0);
                    read_concat(&mut reader, &sources, start..start + n, &mut block)?;
                }
            }
            let data: &[u8] = if in_dtype == t.dtype {
                &block
            } else {
                crate::cast::convert(in_dtype, t.dtype, &block, &mut converted);
                &converted
            };
            let mut offsets = vec![0u64; t.shape.len()];
            let mut sizes = t.shape.clone();
            if !t.shape.is_empty() {
                offsets[0] = r;
                sizes[0] = end - r;
            }
            writer.add_tensor_chunk(
                key,
                TensorChunk {
                    fqn: &t.name,
                    dtype: t.dtype,
                    global_shape: &t.shape,
                    offsets: &offsets,
                    sizes: &sizes,
                    data,
                },
            )?;
            opts.progress.inc(block.len() as u64);
            r = end;
            if r >= rows {
                break;
            }
        }
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

/// Fills `out` with the elements `range` of the concatenation of `sources`.
fn read_concat(
    reader: &mut TensorReader,
    sources: &[(&crate::plan::TensorPlan, &crate::write::SourceSlice)],
    range: std::ops::Range<u64>,
    out: &mut [u8],
) -> Result<()> {
    let mut base = 0u64;
    let mut filled = 0usize;
    for (src, slice) in sources {
        let (s, e) = (range.start.max(base), range.end.min(base + slice.numel));
        if s < e {
            let es = src.dtype.size();
            let n = (e - s) as usize * es;
            let from = slice.offset + (s - base);
            reader.read_any(src, from..from + (e - s), &mut out[filled..filled + n])?;
            filled += n;
        }
        base += slice.numel;
    }
    Ok(())
}
