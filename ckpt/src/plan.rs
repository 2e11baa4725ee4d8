//! The checkpoint plan: one in-memory model of any input format.
//!
//! A plan maps each tensor's fully qualified name to its dtype, global shape and chunks; a chunk is
//! a box of the global tensor (offsets + sizes) plus where its bytes are (file, byte range,
//! encoding). Every reader in `formats` produces a plan, and every command works on plans.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::storage::Root;
use titan_dcp::Dtype;

/// Elements of a tensor of `shape`, or None when the count overflows u64 (a hostile header).
pub fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

/// The dtype a dequantized weight is written in unless `--dtype` says otherwise: the released
/// models were trained and published in bf16 (DeepSeek's own `fp8_cast_bf16.py` writes bf16).
pub const DEQUANT_DTYPE: Dtype = Dtype::BF16;

/// The block scales of one float8 weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockScales {
    /// The scale tensor's name in the checkpoint.
    pub name: String,
    pub tensor: TensorPlan,
    /// Rows x columns of the weight one scale covers.
    pub block: [u64; 2],
    /// Where the block size came from (for messages).
    pub block_from: &'static str,
}

/// A checkpoint format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// Hugging Face safetensors: one file, or shards plus model.safetensors.index.json.
    Hf,
    /// DCP sharded safetensors (torch HuggingFaceStorageWriter, save_distributed=True).
    DcpHf,
    /// DCP native: pickled `.metadata` plus `__R_K.distcp` files of torch.save items.
    Dcp,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::Hf, Format::DcpHf, Format::Dcp];

    /// The format's name (`--to`'s value).
    pub fn name(self) -> &'static str {
        match self {
            Format::Hf => "hf",
            Format::DcpHf => "dcp-hf",
            Format::Dcp => "dcp",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| format!("unknown format `{s}` (expected hf, dcp-hf or dcp)"))
    }
}

/// How a chunk's bytes are stored in its byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encoding {
    /// The chunk's elements in C order, little endian.
    Raw,
    /// A DCP native item (a torch.save archive, possibly behind transforms such as
    /// `stream.zstd/1`) decoded by [`titan_dcp`]: chunk `chunk` of tensor `fqn`.
    DcpItem { fqn: String, chunk: usize },
}

/// Where a chunk's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSource {
    /// Index into [`CheckpointPlan::files`].
    pub file: usize,
    pub begin: u64,
    pub end: u64,
    pub encoding: Encoding,
}

/// A box of a tensor stored in one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub source: ChunkSource,
}

impl Chunk {
    pub fn numel(&self) -> u64 {
        numel(&self.sizes).unwrap_or(0)
    }
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    /// The stored elements' dtype.
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub chunks: Vec<Chunk>,
    /// The block scales of a block-quantized float8 weight (`fp8::attach`), whose values are
    /// the float8 elements times their block's scale.
    pub scales: Option<Box<BlockScales>>,
}

impl TensorPlan {
    pub fn numel(&self) -> u64 {
        numel(&self.shape).unwrap_or(0)
    }

    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }

    /// The dtype of the tensor's values: a block-quantized weight's are
    /// [`DEQUANT_DTYPE`] (what its dequantized values are written in unless a dtype
    /// is asked for), any other tensor's are its stored dtype.
    pub fn value_dtype(&self) -> Dtype {
        match self.scales {
            Some(_) => DEQUANT_DTYPE,
            None => self.dtype,
        }
    }
}

/// A non-tensor item of a DCP native checkpoint (e.g. pickled dataloader state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BytesItem {
    /// The data file holding it.
    pub file: String,
}

/// A checkpoint read from storage.
#[derive(Debug, Clone)]
pub struct CheckpointPlan {
    pub format: Format,
    pub root: Root,
    /// Data files, relative to `root`.
    pub files: Vec<String>,
    pub tensors: BTreeMap<String, TensorPlan>,
    pub bytes_items: BTreeMap<String, BytesItem>,
    /// The DCP reader for DCP native checkpoints (decodes items).
    pub dcp: Option<crate::dcp_store::DcpHandle>,
}

impl CheckpointPlan {
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(TensorPlan::nbytes).sum()
    }

    /// Elements of every tensor (model, optimizer state, ...).
    pub fn total_elements(&self) -> u64 {
        self.tensors.values().map(TensorPlan::numel).sum()
    }

    /// Elements of the model's tensors only (see [`is_model_tensor`]).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|(n, _)| is_model_tensor(n))
            .map(|(_, t)| t.numel())
            .sum()
    }

    /// Opens every data file, in [`CheckpointPlan::files`]' order (what a `TensorReader` reads).
    pub fn open_files(&self) -> Result<Vec<crate::storage::InFile>> {
        self.files.iter().map(|f| Ok(self.root.open(f)?)).collect()
    }

    /// Checks that every tensor's chunks tile it exactly: each chunk inside the global shape, no
    /// two chunks overlapping, and together covering every element.
    pub fn check_coverage(&self) -> Result<()> {
        match self.tiling_errors().into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Every tensor whose chunks do not tile it ([`check_tiling`]), with its error, in name
    /// order (`verify` reports them all).
    pub fn tiling_errors(&self) -> Vec<(&str, Error)> {
        self.tensors
            .iter()
            .filter_map(|(name, t)| {
                check_tiling(name, t, &|i| self.root.display_file(&self.files[i]))
                    .err()
                    .map(|e| (name.as_str(), e))
            })
            .collect()
    }
}

/// Top-level state entries torchtitan saves next to the model (`optimizer`, `lr_scheduler`,
/// `dataloader`, `train_state`: torchtitan's checkpointer keys) and titan-train's `rng_state`.
pub const NON_MODEL_PREFIXES: [&str; 5] = [
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
    "rng_state",
];

/// Whether `name` is a model tensor rather than training state.
pub fn is_model_tensor(name: &str) -> bool {
    !NON_MODEL_PREFIXES.iter().any(|p| {
        name.strip_prefix(p)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

/// Checks that `t`'s chunks tile its global shape exactly; errors name the tensor and a file.
pub fn check_tiling(name: &str, t: &TensorPlan, file_of: &dyn Fn(usize) -> String) -> Result<()> {
    let rank = t.shape.len();
    let total = t.numel();
    let mut covered: u64 = 0;
    for c in &t.chunks {
        if c.offsets.len() != rank || c.sizes.len() != rank {
            return Err(Error::tensor(
                file_of(c.source.file),
                name,
                format!(
                    "chunk has {} offsets and {} sizes but the tensor has {rank} dimensions",
                    c.offsets.len(),
                    c.sizes.len()
                ),
            ));
        }
        for d in 0..rank {
            if c.offsets[d]
                .checked_add(c.sizes[d])
                .is_none_or(|e| e > t.shape[d])
            {
                return Err(Error::tensor(
                    file_of(c.source.file),
                    name,
                    format!(
                        "chunk at offsets {:?} with sizes {:?} lies outside the global shape {:?}",
                        c.offsets, c.sizes, t.shape
                    ),
                ));
            }
        }
        covered = covered.saturating_add(c.numel());
    }
    // Overlaps: sweep along dim 0 so that only chunks sharing rows are compared.
    let mut order: Vec<&Chunk> = t.chunks.iter().filter(|c| c.numel() > 0).collect();
    if rank > 0 {
        order.sort_by_key(|c| c.offsets[0]);
    }
    for (i, a) in order.iter().enumerate() {
        for b in &order[i + 1..] {
            if rank > 0 && b.offsets[0] >= a.offsets[0] + a.sizes[0] {
                break;
            }
            let overlap = (0..rank).all(|d| {
                a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d]
            });
            if overlap {
                return Err(Error::tensor(
                    file_of(b.source.file),
                    name,
                    format!(
                        "chunk at offsets {:?} sizes {:?} overlaps the chunk at offsets {:?} sizes {:?} in {}",
                        b.offsets,
                        b.sizes,
                        a.offsets,
                        a.sizes,
                        file_of(a.source.file)
                    ),
                ));
            }
        }
    }
    if covered != total {
        let where_ = t
            .chunks
            .first()
            .map(|c| file_of(c.source.file))
            .unwrap_or_else(|| "checkpoint".into());
        return Err(Error::tensor(
            where_,
            name,
            format!(
                "chunks cover {covered} of {total} elements of shape {:?}{}: a shard is missing",
                t.shape,
                first_gap(t)
                    .map(|g| format!(" (first gap at index {g:?})"))
                    .unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

/// The first uncovered position along dim 0 when chunks span whole rows (a common case worth
/// naming in the error); None otherwise.
fn first_gap(t: &TensorPlan) -> Option<Vec<u64>> {
    if t.shape.is_empty() {
        return None;
    }
    let mut starts: Vec<(u64, u64)> = t
        .chunks
        .iter()
        .map(|c| (c.offsets[0], c.offsets[0] + c.sizes[0]))
        .collect();
    starts.sort();
    let mut pos = 0;
    for (b, e) in starts {
        if b > pos {
            break;
        }
        pos = pos.max(e);
    }
    (pos < t.shape[0]).then(|| {
        let mut idx = vec![0; t.shape.len()];
        idx[0] = pos;
        idx
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(offsets: &[u64], sizes: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            source: ChunkSource {
                file: 0,
                begin: 0,
                end: 0,
                encoding: Encoding::Raw,
            },
        }
    }

    fn plan(shape: &[u64], chunks: Vec<Chunk>) -> TensorPlan {
        TensorPlan {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            chunks,
            scales: None,
        }
    }

    #[test]
    fn tiling_accepts_exact_and_rejects_gaps_overlaps() {
        let f = |_| "f".to_string();
        let ok = plan(
            &[4, 6],
            vec![chunk(&[0, 0], &[4, 3]), chunk(&[0, 3], &[4, 3])],
        );
        check_tiling("w", &ok, &f).unwrap();
        let gap = plan(&[4, 6], vec![chunk(&[0, 0], &[2, 6])]);
        let e = check_tiling("w", &gap, &f).unwrap_err().to_string();
        assert!(
            e.contains("`w`") && e.contains("missing") && e.contains("[2, 0]"),
            "{e}"
        );
        let overlap = plan(
            &[4, 6],
            vec![chunk(&[0, 0], &[3, 6]), chunk(&[2, 0], &[2, 6])],
        );
        assert!(
            check_tiling("w", &overlap, &f)
                .unwrap_err()
                .to_string()
                .contains("overlaps")
        );
        let outside = plan(&[4, 6], vec![chunk(&[0, 0], &[5, 6])]);
        assert!(
            check_tiling("w", &outside, &f)
                .unwrap_err()
                .to_string()
                .contains("outside")
        );
        check_tiling("s", &plan(&[], vec![chunk(&[], &[])]), &f).unwrap();
    }
}
