//! Writing DCP checkpoints: [`DistcpFileWriter`] appends items to one `__{rank}_{k}.distcp`
//! stream; [`DcpWriter`] writes a whole directory (data files under temporary names, renamed
//! when complete, `.metadata` last).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::error::{DcpError, Result, io_err};
use super::metadata::{
    CheckpointId, ChunkStorageMetadata, ItemMetadata, Metadata, MetadataIndex, PathPart,
    PlannerData, StorageInfo, StorageMeta, TensorProperties, TensorStorageMetadata,
};
use super::pickle::{self, Global, Protocol, Value};
use super::reader::{METADATA_FILE, check_tiling};
use super::tensor_item;
use super::transform::{Encoder, Transform};
use crate::Dtype;

/// How items are written.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteOptions {
    /// `Some(level)` compresses every item with zstd (`"stream.zstd/1"`, torch uses level 3).
    pub zstd_level: Option<i32>,
    /// fsync data files and `.metadata` before renaming them.
    pub fsync: bool,
}

/// A `Write` that counts bytes, so item offsets are known without seeking.
struct Counting<W> {
    inner: W,
    pos: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.pos += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Appends DCP items to one data file stream.
pub struct DistcpFileWriter<W: Write> {
    out: Counting<W>,
    relative_path: String,
    zstd_level: Option<i32>,
    entries: Vec<(MetadataIndex, StorageInfo)>,
}

impl<W: Write> DistcpFileWriter<W> {
    /// Items will be recorded as stored in `relative_path` (e.g. `__0_0.distcp`).
    pub fn new(out: W, relative_path: impl Into<String>, zstd_level: Option<i32>) -> Self {
        DistcpFileWriter {
            out: Counting { inner: out, pos: 0 },
            relative_path: relative_path.into(),
            zstd_level,
            entries: Vec::new(),
        }
    }

    fn item<F>(&mut self, index: MetadataIndex, write: F) -> io::Result<StorageInfo>
    where
        F: FnOnce(&mut Encoder<&mut Counting<W>>) -> io::Result<()>,
    {
        let offset = self.out.pos;
        let mut enc = Encoder::new(&mut self.out, self.zstd_level)?;
        write(&mut enc)?;
        enc.finish()?;
        let info = StorageInfo {
            relative_path: self.relative_path.clone(),
            offset,
            length: self.out.pos - offset,
            transform_descriptors: self
                .zstd_level
                .map(|_| vec![Transform::Zstd.descriptor().to_string()]),
        };
        self.entries.push((index, info.clone()));
        Ok(info)
    }

    /// Writes one tensor chunk (row-major little-endian `data` of shape `sizes`) as a torch.save
    /// item; `index` is the chunk's position in the tensor's chunk list.
    pub fn write_tensor(
        &mut self,
        fqn: &str,
        offsets: &[u64],
        index: u64,
        dtype: Dtype,
        sizes: &[u64],
        data: &[u8],
    ) -> io::Result<StorageInfo> {
        let key = MetadataIndex {
            fqn: fqn.to_string(),
            offset: Some(offsets.to_vec()),
            index: Some(index),
        };
        self.item(key, |w| {
            tensor_item::write_tensor_item(w, dtype, sizes, data).map(|_| ())
        })
    }

    /// Writes a bytes item as given (DCP stores `torch.save(obj)` output here).
    pub fn write_bytes(&mut self, fqn: &str, data: &[u8]) -> io::Result<StorageInfo> {
        let key = MetadataIndex {
            fqn: fqn.to_string(),
            offset: None,
            index: None,
        };
        self.item(key, |w| w.write_all(data))
    }

    /// Bytes written so far.
    pub fn position(&self) -> u64 {
        self.out.pos
    }

    /// Flushes and returns the stream and the storage entries of every item written.
    pub fn finish(mut self) -> io::Result<(W, Vec<(MetadataIndex, StorageInfo)>)> {
        self.out.flush()?;
        Ok((self.out.inner, self.entries))
    }
}

/// Pickles `metadata` as torch's `pickle.dump` does (protocol 4).
pub fn metadata_bytes(metadata: &Metadata) -> Vec<u8> {
    pickle::pickle(&metadata.to_value(), Protocol::DEFAULT)
}

/// Writes `dir/.metadata` via a temporary file and a rename.
pub fn write_metadata_file(dir: &Path, metadata: &Metadata, fsync: bool) -> Result<()> {
    let path = dir.join(METADATA_FILE);
    let tmp = dir.join(format!("{METADATA_FILE}.tmp"));
    let bytes = metadata_bytes(metadata);
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&bytes)?;
        if fsync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        DcpError::Io {
            file: path.display().to_string(),
            source: e,
        }
    })
}

/// Which data file an item goes to: `__{rank}_{k}.distcp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct FileKey {
    pub rank: u32,
    pub k: u32,
}

impl FileKey {
    pub fn file_name(&self) -> String {
        format!("__{}_{}.distcp", self.rank, self.k)
    }
}

/// One chunk to write.
#[derive(Debug, Clone, Copy)]
pub struct TensorChunk<'a> {
    pub fqn: &'a str,
    pub dtype: Dtype,
    /// The whole tensor's shape.
    pub global_shape: &'a [u64],
    /// Where the chunk starts in the tensor, and its shape.
    pub offsets: &'a [u64],
    pub sizes: &'a [u64],
    /// Row-major little-endian values of the chunk.
    pub data: &'a [u8],
}

struct OpenFile {
    tmp: PathBuf,
    path: PathBuf,
    writer: DistcpFileWriter<BufWriter<File>>,
}

/// Writes a DCP checkpoint directory that `torch.distributed.checkpoint.load` reads.
pub struct DcpWriter {
    dir: PathBuf,
    options: WriteOptions,
    files: BTreeMap<FileKey, OpenFile>,
    items: Vec<(String, ItemMetadata)>,
    by_fqn: BTreeMap<String, usize>,
    planner_paths: BTreeMap<String, Vec<PathPart>>,
    finished: bool,
}

impl DcpWriter {
    /// Starts a checkpoint in `dir` (created if missing). Nothing under its final name appears
    /// until [`DcpWriter::finish`]; an existing checkpoint there is replaced then.
    pub fn create(dir: impl AsRef<Path>, options: WriteOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(io_err(dir.display()))?;
        Ok(DcpWriter {
            dir,
            options,
            files: BTreeMap::new(),
            items: Vec::new(),
            by_fqn: BTreeMap::new(),
            planner_paths: BTreeMap::new(),
            finished: false,
        })
    }

    fn file(&mut self, key: FileKey) -> Result<&mut DistcpFileWriter<BufWriter<File>>> {
        if !self.files.contains_key(&key) {
            let name = key.file_name();
            let path = self.dir.join(&name);
            let tmp = self.dir.join(format!(".{name}.tmp"));
            let f = File::create(&tmp).map_err(io_err(tmp.display()))?;
            let writer = DistcpFileWriter::new(
                BufWriter::with_capacity(1 << 20, f),
                name,
                self.options.zstd_level,
            );
            self.files.insert(key, OpenFile { tmp, path, writer });
        }
        Ok(&mut self.files.get_mut(&key).expect("inserted above").writer)
    }

    fn invalid(&self, msg: String) -> DcpError {
        DcpError::Invalid(format!("{}: {msg}", self.dir.display()))
    }

    /// Adds one chunk of a tensor to data file `file`.
    pub fn add_tensor_chunk(&mut self, file: FileKey, c: TensorChunk<'_>) -> Result<()> {
        let fqn = c.fqn;
        let ndim = c.global_shape.len();
        if c.offsets.len() != ndim || c.sizes.len() != ndim {
            return Err(self.invalid(format!(
                "tensor `{fqn}`: chunk offsets {:?} / sizes {:?} do not match the {ndim}-d shape {:?}",
                c.offsets, c.sizes, c.global_shape
            )));
        }
        if (0..ndim).any(|d| {
            c.offsets[d]
                .checked_add(c.sizes[d])
                .is_none_or(|e| e > c.global_shape[d])
        }) {
            return Err(self.invalid(format!(
                "tensor `{fqn}`: chunk at {:?} of size {:?} lies outside {:?}",
                c.offsets, c.sizes, c.global_shape
            )));
        }
        let nbytes = c.sizes.iter().product::<u64>() * c.dtype.size() as u64;
        if nbytes != c.data.len() as u64 {
            return Err(self.invalid(format!(
                "tensor `{fqn}`: chunk of size {:?} {} needs {nbytes} bytes, got {}",
                c.sizes,
                c.dtype.torch_name(),
                c.data.len()
            )));
        }
        let index = match self.by_fqn.get(fqn).map(|&i| &mut self.items[i].1) {
            Some(ItemMetadata::Tensor(t)) => {
                if t.properties.dtype != c.dtype || t.size != c.global_shape {
                    let msg = format!(
                        "tensor `{fqn}`: chunk is {} {:?} but earlier chunks are {} {:?}",
                        c.dtype.torch_name(),
                        c.global_shape,
                        t.properties.dtype.torch_name(),
                        t.size
                    );
                    return Err(self.invalid(msg));
                }
                if t.chunks.iter().any(|x| x.offsets == c.offsets) {
                    let msg = format!("tensor `{fqn}`: two chunks at offsets {:?}", c.offsets);
                    return Err(self.invalid(msg));
                }
                t.chunks.push(ChunkStorageMetadata {
                    offsets: c.offsets.to_vec(),
                    sizes: c.sizes.to_vec(),
                });
                t.chunks.len() - 1
            }
            Some(ItemMetadata::Bytes) => {
                return Err(self.invalid(format!("`{fqn}` was added as a bytes item")));
            }
            None => {
                self.by_fqn.insert(fqn.to_string(), self.items.len());
                self.items.push((
                    fqn.to_string(),
                    ItemMetadata::Tensor(TensorStorageMetadata {
                        properties: TensorProperties::new(c.dtype),
                        size: c.global_shape.to_vec(),
                        chunks: vec![ChunkStorageMetadata {
                            offsets: c.offsets.to_vec(),
                            sizes: c.sizes.to_vec(),
                        }],
                    }),
                ));
                0
            }
        };
        let dir = self.dir.clone();
        let w = self.file(file)?;
        w.write_tensor(fqn, c.offsets, index as u64, c.dtype, c.sizes, c.data)
            .map_err(io_err(dir.join(file.file_name()).display()))?;
        Ok(())
    }

    /// Adds a bytes item holding `data` as given (normally `torch.save(obj)` output).
    pub fn add_bytes(&mut self, file: FileKey, fqn: &str, data: &[u8]) -> Result<()> {
        if self.by_fqn.contains_key(fqn) {
            return Err(self.invalid(format!("`{fqn}` was already added")));
        }
        self.by_fqn.insert(fqn.to_string(), self.items.len());
        self.items.push((fqn.to_string(), ItemMetadata::Bytes));
        let dir = self.dir.clone();
        self.file(file)?
            .write_bytes(fqn, data)
            .map_err(io_err(dir.join(file.file_name()).display()))?;
        Ok(())
    }

    /// Adds a bytes item holding `torch.save(value)` for a plain Python value (a step counter,
    /// a list of floats, a dict of strings...).
    pub fn add_object(&mut self, file: FileKey, fqn: &str, value: &Value) -> Result<()> {
        let (bytes, _) = tensor_item::write_object_item(Vec::new(), value)
            .map_err(io_err(format!("bytes item `{fqn}`")))?;
        self.add_bytes(file, fqn, &bytes)
    }

    /// Records where `fqn` sits in the nested state dict (`planner_data`); the default is the
    /// fqn itself as a single key.
    pub fn set_planner_path(&mut self, fqn: &str, path: Vec<PathPart>) {
        self.planner_paths.insert(fqn.to_string(), path);
    }

    /// Checks every tensor is fully covered, completes and renames the data files, then writes
    /// `.metadata`; returns the metadata written.
    pub fn finish(mut self) -> Result<Metadata> {
        for (fqn, item) in &self.items {
            if let ItemMetadata::Tensor(t) = item {
                check_tiling(fqn, t).map_err(|e| self.invalid(e.to_string()))?;
            }
        }
        let metadata = self.finish_files()?;
        write_metadata_file(&self.dir, &metadata, self.options.fsync)?;
        Ok(metadata)
    }

    /// One rank's share of a multi-rank save: completes and renames this writer's data files and
    /// returns the metadata of its items only (chunks may cover part of a tensor). No
    /// `.metadata` is written: the coordinator merges every rank's part with
    /// [`merge_rank_parts`] and writes it.
    pub fn finish_rank_part(mut self) -> Result<Metadata> {
        self.finish_files()
    }

    fn finish_files(&mut self) -> Result<Metadata> {
        let mut storage_data = Vec::new();
        let files = std::mem::take(&mut self.files);
        let all_tmp: Vec<PathBuf> = files.values().map(|f| f.tmp.clone()).collect();
        let mut done = Vec::new();
        for (_, f) in files {
            let OpenFile { tmp, path, writer } = f;
            let result = (|| -> io::Result<Vec<(MetadataIndex, StorageInfo)>> {
                let (buf, entries) = writer.finish()?;
                let file = buf.into_inner().map_err(|e| e.into_error())?;
                if self.options.fsync {
                    file.sync_all()?;
                }
                Ok(entries)
            })();
            match result {
                Ok(entries) => {
                    storage_data.extend(entries);
                    done.push((tmp, path));
                }
                Err(e) => {
                    // Remaining writers are dropped (and flushed) here; then remove every file.
                    for t in &all_tmp {
                        let _ = std::fs::remove_file(t);
                    }
                    return Err(DcpError::Io {
                        file: path.display().to_string(),
                        source: e,
                    });
                }
            }
        }
        for (tmp, path) in &done {
            std::fs::rename(tmp, path).map_err(io_err(path.display()))?;
        }
        // Storage entries in chunk order per tensor, as torch lists them per rank.
        let planner = self
            .items
            .iter()
            .map(|(fqn, _)| {
                let path = self
                    .planner_paths
                    .get(fqn)
                    .cloned()
                    .unwrap_or_else(|| vec![PathPart::Key(fqn.clone())]);
                (fqn.clone(), path)
            })
            .collect();
        let abs = std::path::absolute(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let parts = abs
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        self.finished = true;
        Ok(Metadata {
            state_dict_metadata: std::mem::take(&mut self.items),
            planner_data: PlannerData::Flatten(planner),
            storage_data,
            storage_meta: Some(StorageMeta {
                checkpoint_id: Some(CheckpointId::Path {
                    class: Global::POSIX_PATH,
                    parts,
                }),
                save_id: Some(pseudo_uuid()),
                load_id: None,
                modules: Vec::new(),
            }),
            version: Some("1.0.0".to_string()),
        })
    }
}

/// Merges the per-rank parts of one save (from [`DcpWriter::finish_rank_part`], in rank order)
/// into the checkpoint's metadata, as torch's coordinator merges the ranks' write results:
/// chunks of one tensor from several ranks join, replicated items must be written by one rank,
/// and every tensor must be fully covered. `dir` names the checkpoint in errors.
pub fn merge_rank_parts(dir: &Path, parts: Vec<Metadata>) -> Result<Metadata> {
    let invalid = |msg: String| DcpError::Invalid(format!("{}: {msg}", dir.display()));
    let mut items: Vec<(String, ItemMetadata)> = Vec::new();
    let mut by_fqn: BTreeMap<String, usize> = BTreeMap::new();
    let mut planner: Vec<(String, Vec<PathPart>)> = Vec::new();
    let mut planned = std::collections::BTreeSet::new();
    let mut storage_data = Vec::new();
    let mut storage_meta = None;
    for (rank, part) in parts.into_iter().enumerate() {
        for (fqn, item) in part.state_dict_metadata {
            match (by_fqn.get(&fqn).map(|&i| &mut items[i].1), item) {
                (None, item) => {
                    by_fqn.insert(fqn.clone(), items.len());
                    items.push((fqn, item));
                }
                (Some(ItemMetadata::Tensor(have)), ItemMetadata::Tensor(t)) => {
                    if have.properties.dtype != t.properties.dtype || have.size != t.size {
                        return Err(invalid(format!(
                            "tensor `{fqn}`: rank {rank} wrote {} {:?}, an earlier rank {} {:?}",
                            t.properties.dtype.torch_name(),
                            t.size,
                            have.properties.dtype.torch_name(),
                            have.size
                        )));
                    }
                    for c in t.chunks {
                        if have.chunks.iter().any(|x| x.offsets == c.offsets) {
                            return Err(invalid(format!(
                                "tensor `{fqn}`: rank {rank} wrote the chunk at {:?} another rank wrote too",
                                c.offsets
                            )));
                        }
                        have.chunks.push(c);
                    }
                }
                (Some(_), _) => {
                    return Err(invalid(format!(
                        "`{fqn}` was written by rank {rank} and an earlier rank"
                    )));
                }
            }
        }
        if let PlannerData::Flatten(paths) = part.planner_data {
            for (fqn, path) in paths {
                if planned.insert(fqn.clone()) {
                    planner.push((fqn, path));
                }
            }
        }
        storage_data.extend(part.storage_data);
        storage_meta = storage_meta.or(part.storage_meta);
    }
    for (fqn, item) in &items {
        if let ItemMetadata::Tensor(t) = item {
            check_tiling(fqn, t).map_err(|e| invalid(e.to_string()))?;
        }
    }
    // Chunk indices are per rank in the parts; point them at the merged chunk lists.
    for (index, _) in &mut storage_data {
        if let (Some(offsets), Some(&i)) = (&index.offset, by_fqn.get(&index.fqn))
            && let ItemMetadata::Tensor(t) = &items[i].1
        {
            index.index = t
                .chunks
                .iter()
                .position(|c| &c.offsets == offsets)
                .map(|p| p as u64);
        }
    }
    Ok(Metadata {
        state_dict_metadata: items,
        planner_data: PlannerData::Flatten(planner),
        storage_data,
        storage_meta,
        version: Some("1.0.0".to_string()),
    })
}

impl Drop for DcpWriter {
    /// An unfinished checkpoint leaves nothing behind.
    fn drop(&mut self) {
        if !self.finished {
            for f in self.files.values() {
                let _ = std::fs::remove_file(&f.tmp);
            }
        }
    }
}

/// A random-looking UUID-4 string for `StorageMeta.save_id` (torch uses `uuid.uuid4()`).
fn pseudo_uuid() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    let a = h.finish();
    h.write_u32(std::process::id());
    let b = h.finish();
    let x = ((a as u128) << 64) | b as u128;
    let x = (x & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let s = format!("{x:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &s[..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DcpReader;

    fn rows(dir: &Path, rank: u32, lo: u64, n: u64, with_step: bool) -> Metadata {
        let mut w = DcpWriter::create(dir, WriteOptions::default()).unwrap();
        let file = FileKey { rank, k: 0 };
        let data: Vec<u8> = (0..n * 3)
            .flat_map(|i| ((lo * 3 + i) as f32).to_le_bytes())
            .collect();
        w.add_tensor_chunk(
            file,
            TensorChunk {
                fqn: "w",
                dtype: Dtype::F32,
                global_shape: &[5, 3],
                offsets: &[lo, 0],
                sizes: &[n, 3],
                data: &data,
            },
        )
        .unwrap();
        if with_step {
            w.add_object(file, "step", &Value::Int(7)).unwrap();
        }
        w.finish_rank_part().unwrap()
    }

    #[test]
    fn rank_parts_merge_into_one_readable_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let parts = vec![
            rows(dir.path(), 0, 0, 3, true),
            rows(dir.path(), 1, 3, 2, false),
        ];
        let merged = merge_rank_parts(dir.path(), parts).unwrap();
        write_metadata_file(dir.path(), &merged, false).unwrap();
        let r = DcpReader::open(dir.path()).unwrap();
        let t = r.read_tensor("w").unwrap();
        let want: Vec<u8> = (0..15).flat_map(|i| (i as f32).to_le_bytes()).collect();
        assert_eq!(t.data, want);
        assert_eq!(r.read_object("step").unwrap(), Value::Int(7));
    }

    #[test]
    fn merge_rejects_gaps_and_double_writes() {
        let dir = tempfile::tempdir().unwrap();
        let gap = merge_rank_parts(dir.path(), vec![rows(dir.path(), 0, 0, 3, false)]);
        assert!(gap.unwrap_err().to_string().contains("`w`"));
        let twice = merge_rank_parts(
            dir.path(),
            vec![
                rows(dir.path(), 0, 0, 3, true),
                rows(dir.path(), 1, 3, 2, true),
            ],
        );
        let msg = twice.unwrap_err().to_string();
        assert!(msg.contains("`step`") && msg.contains("rank 1"), "{msg}");
    }
}
