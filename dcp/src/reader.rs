//! [`DcpReader`]: lists and reads the tensors and bytes items of a DCP checkpoint.

use std::collections::HashMap;
use std::path::Path;

use super::error::{DcpError, Result, io_err};
use super::metadata::{
    ChunkStorageMetadata, ItemMetadata, Metadata, StorageInfo, TensorStorageMetadata,
};
use super::pickle::{self, Limits, Value};
use super::store::{CheckpointStore, LocalDir, PrefetchedSlice, StoreSlice};
use super::tensor_item::{self, ItemError, TensorItemLayout};
use super::transform::{self, Transform};
use crate::Dtype;

/// The metadata file name.
pub const METADATA_FILE: &str = ".metadata";

/// Caps for untrusted checkpoints.
#[derive(Debug, Clone, Copy)]
pub struct ReadOptions {
    /// Limits for unpickling `.metadata`.
    pub pickle: Limits,
    /// Largest bytes item (after decompression).
    pub max_bytes_item: u64,
    /// Slack above a chunk's value bytes allowed for its torch.save container after
    /// decompression (zip records, padding, and a storage larger than the chunk).
    pub item_overhead: u64,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            pickle: Limits::default(),
            max_bytes_item: 1 << 30,
            item_overhead: 64 << 20,
        }
    }
}

/// One chunk of a tensor, read: the box `offsets .. offsets + sizes` of the global tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkData {
    pub dtype: Dtype,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// Row-major little-endian values.
    pub data: Vec<u8>,
}

/// A whole tensor assembled from its chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Row-major little-endian values.
    pub data: Vec<u8>,
}

/// Where a chunk's values sit, for callers that copy byte ranges themselves.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkLocation {
    pub relative_path: String,
    /// The item's bytes in the file.
    pub item_offset: u64,
    pub item_length: u64,
    pub transforms: Vec<Transform>,
    /// For untransformed items: the parsed layout, with `storage.data_offset` relative to the
    /// item (`item_offset + layout.contiguous_range()` is a file range when contiguous).
    pub layout: Option<TensorItemLayout>,
}

/// A DCP checkpoint opened for reading.
pub struct DcpReader<S: CheckpointStore = LocalDir> {
    store: S,
    metadata: Metadata,
    options: ReadOptions,
    /// (fqn, chunk offsets or None for bytes) -> index into `metadata.storage_data`.
    storage: HashMap<(String, Option<Vec<u64>>), usize>,
}

impl DcpReader<LocalDir> {
    /// Opens the checkpoint directory `dir` (reads and checks `.metadata`).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::with_store(LocalDir::new(dir.as_ref()), ReadOptions::default())
    }
}

/// Parses `.metadata` bytes; `file` names the file in errors.
pub fn parse_metadata(bytes: &[u8], file: &str, limits: &Limits) -> Result<Metadata> {
    let value = pickle::unpickle_with_limits(bytes, limits).map_err(|source| DcpError::Pickle {
        file: file.to_string(),
        source,
    })?;
    Metadata::from_value(&value).map_err(|e| DcpError::Metadata {
        file: file.to_string(),
        msg: e.0,
    })
}

impl<S: CheckpointStore> DcpReader<S> {
    /// Opens the checkpoint in `store`.
    pub fn with_store(store: S, options: ReadOptions) -> Result<Self> {
        let file = store.describe(METADATA_FILE);
        let len = store.file_len(METADATA_FILE).map_err(io_err(&file))?;
        if len > options.pickle.max_input_bytes as u64 {
            return Err(DcpError::Metadata {
                file,
                msg: format!(
                    "{len} bytes is over the {}-byte limit for metadata",
                    options.pickle.max_input_bytes
                ),
            });
        }
        let bytes = store
            .read_range(METADATA_FILE, 0, len)
            .map_err(io_err(&file))?;
        let metadata = parse_metadata(&bytes, &file, &options.pickle)?;
        Self::from_metadata(store, metadata, options)
    }

    /// Uses already parsed metadata (checks that every chunk and bytes item has a storage entry
    /// and that every storage path stays inside the checkpoint).
    pub fn from_metadata(store: S, metadata: Metadata, options: ReadOptions) -> Result<Self> {
        let file = store.describe(METADATA_FILE);
        let mut storage = HashMap::with_capacity(metadata.storage_data.len());
        for (i, (idx, info)) in metadata.storage_data.iter().enumerate() {
            if let Some(why) = titan_storage::relative_path_problem(&info.relative_path) {
                return Err(DcpError::Metadata {
                    file,
                    msg: format!(
                        "item `{}`: relative path `{}` {why}; refusing to read outside the checkpoint",
                        idx.fqn, info.relative_path
                    ),
                });
            }
            storage.insert((idx.fqn.clone(), idx.offset.clone()), i);
        }
        for (fqn, item) in &metadata.state_dict_metadata {
            let missing = match item {
                ItemMetadata::Bytes => {
                    (!storage.contains_key(&(fqn.clone(), None))).then(String::new)
                }
                ItemMetadata::Tensor(t) => t
                    .chunks
                    .iter()
                    .find(|c| !storage.contains_key(&(fqn.clone(), Some(c.offsets.clone()))))
                    .map(|c| format!(" chunk at offsets {:?}", c.offsets)),
            };
            if let Some(what) = missing {
                return Err(DcpError::Metadata {
                    file,
                    msg: format!("`{fqn}`{what} has no storage entry"),
                });
            }
        }
        Ok(DcpReader {
            store,
            metadata,
            options,
            storage,
        })
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Tensors by fqn, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorStorageMetadata)> {
        self.metadata
            .state_dict_metadata
            .iter()
            .filter_map(|(k, v)| match v {
                ItemMetadata::Tensor(t) => Some((k.as_str(), t)),
                ItemMetadata::Bytes => None,
            })
    }

    /// Names of the bytes items, in file order.
    pub fn bytes_items(&self) -> impl Iterator<Item = &str> {
        self.metadata
            .state_dict_metadata
            .iter()
            .filter(|(_, v)| matches!(v, ItemMetadata::Bytes))
            .map(|(k, _)| k.as_str())
    }

    /// The metadata of tensor `fqn`.
    pub fn tensor(&self, fqn: &str) -> Result<&TensorStorageMetadata> {
        match self.metadata.item(fqn) {
            Some(ItemMetadata::Tensor(t)) => Ok(t),
            Some(ItemMetadata::Bytes) => Err(DcpError::Invalid(format!(
                "`{fqn}` is a bytes item, not a tensor"
            ))),
            None => Err(DcpError::Invalid(format!(
                "no tensor `{fqn}` in the checkpoint"
            ))),
        }
    }

    fn storage_info(&self, fqn: &str, offsets: Option<&[u64]>) -> &StorageInfo {
        let i = self.storage[&(fqn.to_string(), offsets.map(<[u64]>::to_vec))];
        &self.metadata.storage_data[i].1
    }

    fn chunk_meta(
        &self,
        fqn: &str,
        chunk: usize,
    ) -> Result<(&TensorStorageMetadata, &ChunkStorageMetadata)> {
        let t = self.tensor(fqn)?;
        let c = t.chunks.get(chunk).ok_or_else(|| {
            DcpError::Invalid(format!(
                "tensor `{fqn}` has {} chunks, no chunk {chunk}",
                t.chunks.len()
            ))
        })?;
        Ok((t, c))
    }

    fn item_error(&self, info: &StorageInfo, item: String) -> impl FnOnce(ItemError) -> DcpError {
        let file = self.store.describe(&info.relative_path);
        move |source| DcpError::Item { file, item, source }
    }

    /// An untransformed item, with its zip head and directory already fetched.
    fn prefetched<'a>(
        &'a self,
        info: &'a StorageInfo,
        what: &str,
    ) -> Result<PrefetchedSlice<'a, S>> {
        let slice = StoreSlice {
            store: &self.store,
            relative_path: &info.relative_path,
            start: info.offset,
            len: info.length,
        };
        PrefetchedSlice::new(slice).map_err(|e| DcpError::Io {
            file: self.store.describe(&info.relative_path),
            source: std::io::Error::new(
                e.kind(),
                format!("{what} at {}+{}: {e}", info.offset, info.length),
            ),
        })
    }

    /// Reads an item's bytes and undoes its transforms (`limit` bounds the decoded size).
    fn item_bytes(&self, info: &StorageInfo, what: &str, limit: u64, hint: u64) -> Result<Vec<u8>> {
        let file = self.store.describe(&info.relative_path);
        let transforms = transform::parse_descriptors(info.transform_descriptors.as_deref())
            .map_err(|msg| DcpError::Metadata {
                file: self.store.describe(METADATA_FILE),
                msg: format!("{what}: {msg}"),
            })?;
        if transforms.is_empty() && info.length > limit {
            return Err(DcpError::Invalid(format!(
                "{file}: {what} is {} bytes, over the limit of {limit}",
                info.length
            )));
        }
        let raw = self
            .store
            .read_range(&info.relative_path, info.offset, info.length)
            .map_err(|e| DcpError::Io {
                file: file.clone(),
                source: std::io::Error::new(
                    e.kind(),
                    format!("{what} at {}+{}: {e}", info.offset, info.length),
                ),
            })?;
        if transforms.is_empty() {
            return Ok(raw);
        }
        transform::decode_with_hint(&raw, &transforms, limit, hint).map_err(|e| DcpError::Item {
            file,
            item: what.to_string(),
            source: ItemError::Io(e),
        })
    }

    /// Where chunk `chunk` of `fqn` is, parsing the item's zip directory when it is stored
    /// untransformed (a few small reads).
    pub fn chunk_location(&self, fqn: &str, chunk: usize) -> Result<ChunkLocation> {
        let (_, c) = self.chunk_meta(fqn, chunk)?;
        let info = self.storage_info(fqn, Some(&c.offsets));
        let what = format!("tensor `{fqn}` chunk {chunk} (offsets {:?})", c.offsets);
        let transforms = transform::parse_descriptors(info.transform_descriptors.as_deref())
            .map_err(|msg| DcpError::Metadata {
                file: self.store.describe(METADATA_FILE),
                msg: format!("{what}: {msg}"),
            })?;
        let layout = if transforms.is_empty() {
            let slice = self.prefetched(info, &what)?;
            Some(tensor_item::parse_tensor_item(&slice).map_err(self.item_error(info, what))?)
        } else {
            None
        };
        Ok(ChunkLocation {
            relative_path: info.relative_path.clone(),
            item_offset: info.offset,
            item_length: info.length,
            transforms,
            layout,
        })
    }

    /// Reads chunk `chunk` of tensor `fqn`.
    pub fn read_chunk(&self, fqn: &str, chunk: usize) -> Result<ChunkData> {
        let (t, c) = self.chunk_meta(fqn, chunk)?;
        let info = self.storage_info(fqn, Some(&c.offsets));
        let what = format!("tensor `{fqn}` chunk {chunk} (offsets {:?})", c.offsets);
        let expect_bytes = c.numel() * t.properties.dtype.size() as u64;
        let transforms = transform::parse_descriptors(info.transform_descriptors.as_deref())
            .map_err(|msg| DcpError::Metadata {
                file: self.store.describe(METADATA_FILE),
                msg: format!("{what}: {msg}"),
            })?;
        let (layout, data) = if transforms.is_empty() {
            let slice = self.prefetched(info, &what)?;
            let layout = tensor_item::parse_tensor_item(&slice)
                .map_err(self.item_error(info, what.clone()))?;
            let data = layout
                .read_data(&slice)
                .map_err(self.item_error(info, what.clone()))?;
            (layout, data)
        } else {
            let limit = expect_bytes + self.options.item_overhead;
            let item = self.item_bytes(info, &what, limit, expect_bytes + 4096)?;
            let layout = tensor_item::parse_tensor_item(&item)
                .map_err(self.item_error(info, what.clone()))?;
            let data = layout
                .take_data(item)
                .map_err(self.item_error(info, what.clone()))?;
            (layout, data)
        };
        if layout.dtype != t.properties.dtype || layout.shape != c.sizes {
            return Err(DcpError::Item {
                file: self.store.describe(&info.relative_path),
                item: what,
                source: ItemError::Invalid(format!(
                    "item holds a {:?} {} tensor but the metadata says {:?} {}",
                    layout.shape,
                    layout.dtype.torch_name(),
                    c.sizes,
                    t.properties.dtype.torch_name()
                )),
            });
        }
        Ok(ChunkData {
            dtype: layout.dtype,
            offsets: c.offsets.clone(),
            sizes: c.sizes.clone(),
            data,
        })
    }

    /// Reads tensor `fqn` whole, assembling its chunks (which must tile it exactly).
    pub fn read_tensor(&self, fqn: &str) -> Result<TensorData> {
        let t = self.tensor(fqn)?;
        check_tiling(fqn, t)?;
        let es = t.properties.dtype.size();
        let numel: u64 = t.size.iter().product();
        if t.chunks.len() == 1 {
            // One chunk that tiles the tensor is the tensor: no copy.
            let chunk = self.read_chunk(fqn, 0)?;
            return Ok(TensorData {
                dtype: t.properties.dtype,
                shape: t.size.clone(),
                data: chunk.data,
            });
        }
        let mut out = vec![0u8; numel as usize * es];
        for i in 0..t.chunks.len() {
            let chunk = self.read_chunk(fqn, i)?;
            copy_box(
                &mut out,
                &t.size,
                &chunk.offsets,
                &chunk.sizes,
                &chunk.data,
                es,
            );
        }
        Ok(TensorData {
            dtype: t.properties.dtype,
            shape: t.size.clone(),
            data: out,
        })
    }

    /// Reads bytes item `fqn` as stored (a torch.save zip of a Python object; see
    /// [`DcpReader::read_object`]).
    pub fn read_bytes(&self, fqn: &str) -> Result<Vec<u8>> {
        match self.metadata.item(fqn) {
            Some(ItemMetadata::Bytes) => {}
            Some(ItemMetadata::Tensor(_)) => {
                return Err(DcpError::Invalid(format!(
                    "`{fqn}` is a tensor, not a bytes item"
                )));
            }
            None => {
                return Err(DcpError::Invalid(format!(
                    "no bytes item `{fqn}` in the checkpoint"
                )));
            }
        }
        let info = self.storage_info(fqn, None);
        self.item_bytes(
            info,
            &format!("bytes item `{fqn}`"),
            self.options.max_bytes_item,
            0,
        )
    }

    /// Reads bytes item `fqn` and unpickles the Python object torch.save'd into it (allow-list
    /// applies: plain values only).
    pub fn read_object(&self, fqn: &str) -> Result<Value> {
        let bytes = self.read_bytes(fqn)?;
        let info = self.storage_info(fqn, None);
        tensor_item::decode_torch_save_object(&bytes)
            .map_err(self.item_error(info, format!("bytes item `{fqn}`")))
    }
}

/// Checks that `t`'s chunks tile the tensor: inside it, no two overlapping, volumes summing to
/// the tensor's (together: no gap).
pub fn check_tiling(fqn: &str, t: &TensorStorageMetadata) -> Result<()> {
    let numel: u64 = t.size.iter().product();
    for (i, a) in t.chunks.iter().enumerate() {
        for (j, b) in t.chunks.iter().enumerate().skip(i + 1) {
            let overlap = a.numel() > 0
                && b.numel() > 0
                && (0..t.size.len()).all(|d| {
                    a.offsets[d] < b.offsets[d] + b.sizes[d]
                        && b.offsets[d] < a.offsets[d] + a.sizes[d]
                });
            if overlap {
                return Err(DcpError::Invalid(format!(
                    "tensor `{fqn}`: chunks {i} (offsets {:?}) and {j} (offsets {:?}) overlap",
                    a.offsets, b.offsets
                )));
            }
        }
    }
    let covered: u64 = t.chunks.iter().map(ChunkStorageMetadata::numel).sum();
    if covered != numel {
        return Err(DcpError::Invalid(format!(
            "tensor `{fqn}`: chunks cover {covered} of {numel} elements (a shard is missing)"
        )));
    }
    Ok(())
}

/// Copies the row-major box `data` (shape `sizes`) into `out` (shape `shape`) at `offsets`.
pub fn copy_box(
    out: &mut [u8],
    shape: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    data: &[u8],
    es: usize,
) {
    let ndim = shape.len();
    if ndim == 0 {
        out[..es].copy_from_slice(&data[..es]);
        return;
    }
    if sizes.contains(&0) {
        return;
    }
    let strides = tensor_item::contiguous_strides(shape);
    let row = sizes[ndim - 1] as usize * es;
    let rows: u64 = sizes[..ndim - 1].iter().product();
    let mut idx = vec![0u64; ndim - 1];
    for r in 0..rows as usize {
        let dst: u64 = (0..ndim - 1)
            .map(|d| (offsets[d] + idx[d]) * strides[d])
            .sum::<u64>()
            + offsets[ndim - 1];
        let dst = dst as usize * es;
        out[dst..dst + row].copy_from_slice(&data[r * row..(r + 1) * row]);
        for d in (0..ndim - 1).rev() {
            idx[d] += 1;
            if idx[d] < sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_box_places_rows() {
        // 3x4 tensor, chunk rows 1..3, cols 2..4.
        let mut out = vec![0u8; 12];
        copy_box(&mut out, &[3, 4], &[1, 2], &[2, 2], &[1, 2, 3, 4], 1);
        assert_eq!(out, vec![0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 3, 4]);
    }
}
