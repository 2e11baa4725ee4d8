//! titan-dcp: PyTorch Distributed Checkpoint (DCP) files, read and written without libtorch or Python.
//!
//! This crate is the format library behind `titan-ckpt` and `titan-train`'s checkpoints; it has no
//! other titan dependency. Main types: [`DcpReader`] (open a checkpoint directory or any
//! [`CheckpointStore`], list tensors, read chunks, tensors and pickled objects), [`DcpWriter`] /
//! [`DistcpFileWriter`] + [`write_metadata_file`] (write one, from one process or one per rank),
//! [`Metadata`] (the `.metadata` model: tensors, chunks, storage entries), [`Dtype`] (torch dtypes),
//! [`pickle`] (the allow-list unpickler and the pickler) and [`torch_zip`] (torch.save zip items).
//!
//! The native format is torch's `FileSystemWriter` / `FileSystemReader`.
//!
//! A checkpoint directory holds `.metadata` (a pickle of
//! `torch.distributed.checkpoint.metadata.Metadata`) and data files `__{rank}_{k}.distcp`, each a
//! concatenation of items at `(offset, length)`: a tensor chunk is a complete `torch.save` zip,
//! a non-tensor value (step counter, list, ...) is `torch.save(obj)` bytes stored as-is. With
//! `_extensions=[ZStandard()]` every item is a zstd stream and its storage entry carries
//! `transform_descriptors == ["stream.zstd/1"]`.
//!
//! # Reading
//! ```no_run
//! use titan_dcp::DcpReader;
//! let r = DcpReader::open("ckpt/step-100")?;
//! for (fqn, t) in r.tensors() {
//!     println!("{fqn}: {:?} {} in {} chunks", t.size, t.properties.dtype, t.chunks.len());
//! }
//! let w = r.read_tensor("model.w")?;          // assembled from all chunks, row-major LE bytes
//! let c = r.read_chunk("model.w", 0)?;        // one chunk: offsets, sizes, bytes
//! let step = r.read_object("step")?;          // bytes item, unpickled (allow-list)
//! let raw = r.read_bytes("step")?;            // bytes item as stored
//! # Ok::<(), titan_dcp::DcpError>(())
//! ```
//! [`DcpReader::chunk_location`] gives the file byte range of an uncompressed contiguous chunk
//! so callers can stream-copy it without decoding. Storage is pluggable: implement
//! [`CheckpointStore`] (file length + ranged read by relative path) for an object store and use
//! [`DcpReader::with_store`]. Lower levels work on `&[u8]` / [`ReadAt`]:
//! [`parse_metadata`], [`tensor_item::parse_tensor_item`], [`torch_zip::TorchZip`],
//! [`transform::decode`].
//!
//! # Writing
//! ```no_run
//! use titan_dcp::{Dtype, DcpWriter, FileKey, TensorChunk, WriteOptions, pickle::Value};
//! let mut w = DcpWriter::create("out", WriteOptions { zstd_level: Some(3), fsync: true })?;
//! let rows0 = vec![0u8; 2 * 4 * 4];
//! w.add_tensor_chunk(FileKey { rank: 0, k: 0 }, TensorChunk {
//!     fqn: "w", dtype: Dtype::F32, global_shape: &[4, 4], offsets: &[0, 0], sizes: &[2, 4], data: &rows0,
//! })?;
//! # let rows1 = rows0.clone();
//! w.add_tensor_chunk(FileKey { rank: 1, k: 0 }, TensorChunk {
//!     fqn: "w", dtype: Dtype::F32, global_shape: &[4, 4], offsets: &[2, 0], sizes: &[2, 4], data: &rows1,
//! })?;
//! w.add_object(FileKey { rank: 0, k: 0 }, "step", &Value::Int(100))?;
//! let metadata = w.finish()?; // checks tiling, renames data files, writes .metadata last
//! # Ok::<(), titan_dcp::DcpError>(())
//! ```
//! Data files are written as `.__R_K.distcp.tmp` and renamed when complete; `.metadata` (via
//! `.metadata.tmp`) is written last, so a crashed write never looks like a checkpoint. For one
//! process per rank, use [`DistcpFileWriter`] on any `Write` and [`write_metadata_file`] on the
//! coordinator with the gathered storage entries.
//!
//! # Safety of untrusted input
//! `.metadata` and every `data.pkl` go through [`pickle::unpickle`]: an allow-list reader that
//! never imports or calls anything and caps input size, memo, stack, depth and output size. An
//! unknown global (`os.system`) is an error naming the global and the file. Zip directories,
//! record ranges, tensor views and zstd output sizes are bounds-checked; storage paths that
//! leave the checkpoint directory are refused.
//!
//! # What torch 2.13 actually writes (surprises)
//! * `.metadata` is protocol 4 with `FRAME`s; the layout is pickled as
//!   `torch.serialization._get_layout("torch.strided")`, the memory format as
//!   `_MEM_FORMAT_ENCODING(0)` inside a 5-tuple state; `BytesStorageMetadata` has no state;
//!   `MetadataIndex` of a bytes item has no `offset` key; `transform_descriptors` is absent
//!   (not empty) without extensions; `checkpoint_id` is a `pathlib.PosixPath`.
//! * Each item is a whole torch.save zip whose zip offsets start at the item (not the file);
//!   local headers have zero sizes (data descriptors, flags `0x0808`), data is 64-byte aligned by
//!   an `FB` extra field of `Z`s, and zip64 end records are always present.
//! * Bytes items are `torch.save(obj)` zips too (a step counter `7` is a 1261-byte zip with a
//!   5-byte `data.pkl`), written before the tensors of the same file.
//! * Replicated and non-distributed items are written by one rank only (dedup), so
//!   `__0_0.distcp` may lack items that rank 0 owned.

//!
//! # Performance
//! Reading and writing against torch's own `dcp.load` / `dcp.save` on the same files: see
//! `docs/benchmarks.md` (command `cargo bench -p titan-dcp`).

pub mod dtype;
pub mod error;
pub mod metadata;
pub mod pickle;
pub mod reader;
pub mod source;
pub mod store;
pub mod tensor_item;
pub mod torch_zip;
pub mod transform;
pub mod writer;

pub use dtype::Dtype;
pub use error::{DcpError, Result};
pub use metadata::{
    ChunkStorageMetadata, ItemMetadata, Metadata, MetadataIndex, PathPart, PlannerData,
    StorageInfo, TensorProperties, TensorStorageMetadata,
};
pub use reader::{
    ChunkData, ChunkLocation, DcpReader, METADATA_FILE, ReadOptions, TensorData, check_tiling,
    parse_metadata,
};
pub use source::ReadAt;
pub use store::{CheckpointStore, LocalDir};
pub use writer::{
    DcpWriter, DistcpFileWriter, FileKey, TensorChunk, WriteOptions, merge_rank_parts,
    metadata_bytes, write_metadata_file,
};
