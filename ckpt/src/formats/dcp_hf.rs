//! DCP sharded safetensors, as torch's HuggingFaceStorageWriter writes with save_distributed=True:
//! `shard-RRRRR-model-IIIII-of-NNNNN.safetensors` per rank and output file, each entry holding
//! the rank's local chunk and `__metadata__.DCP_SHARDING_INFO` its offsets in the global tensor.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::DCP_SHARDING_INFO;
use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Chunk, ChunkSource, Encoding, Format, TensorPlan};
use crate::safetensors;
use crate::storage::Root;

/// `(rank, file index, file count)` from `shard-RRRRR-model-IIIII-of-NNNNN.safetensors`
/// (rank 1-based as torch writes it).
pub fn parse_shard_name(name: &str) -> Option<(u32, u32, u32)> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (rank, rest) = rest.split_once("-model-")?;
    let (idx, n) = rest.split_once("-of-")?;
    Some((rank.parse().ok()?, idx.parse().ok()?, n.parse().ok()?))
}

/// The file torch writes for 1-based `rank` and output file `idx` of `n`.
pub fn shard_name(rank: u32, idx: u32, n: u32) -> String {
    format!("shard-{rank:05}-model-{idx:05}-of-{n:05}.safetensors")
}

pub fn read(root: &Root, only: Option<&str>) -> Result<CheckpointPlan> {
    let files: Vec<String> = match only {
        Some(f) => vec![f.to_string()],
        None => root
            .list()?
            .into_iter()
            .map(|(f, _)| f)
            .filter(|f| f.ends_with(".safetensors"))
            .collect(),
    };
    if only.is_none() {
        check_shard_names(root, &files)?;
    }
    let mut tensors: BTreeMap<String, TensorPlan> = BTreeMap::new();
    // Where each tensor was first seen, to name both files when shards disagree.
    let mut first_file: BTreeMap<String, usize> = BTreeMap::new();
    for (i, rel) in files.iter().enumerate() {
        let file = root.open(rel)?;
        let header = safetensors::read_header(&file)?;
        let info = header.metadata.get(DCP_SHARDING_INFO).ok_or_else(|| {
            Error::invalid(
                &file.name,
                format!(
                    "no `{DCP_SHARDING_INFO}` in `__metadata__`: not a DCP sharded safetensors file"
                ),
            )
        })?;
        let info: Value = serde_json::from_str(info).map_err(|e| {
            Error::invalid(
                &file.name,
                format!("malformed {DCP_SHARDING_INFO} JSON: {e}"),
            )
        })?;
        for e in header.entries {
            let offsets: Vec<u64> = info
                .get(&e.name)
                .and_then(|v| v.get("saved_offsets"))
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| {
                    Error::tensor(
                        &file.name,
                        &e.name,
                        format!("no integer `saved_offsets` in {DCP_SHARDING_INFO}"),
                    )
                })?;
            if offsets.len() != e.shape.len() {
                return Err(Error::tensor(
                    &file.name,
                    &e.name,
                    format!(
                        "saved_offsets {offsets:?} do not match the chunk shape {:?}",
                        e.shape
                    ),
                ));
            }
            let chunk = Chunk {
                offsets,
                sizes: e.shape.clone(),
                source: ChunkSource {
                    file: i,
                    begin: e.begin,
                    end: e.end,
                    encoding: Encoding::Raw,
                },
            };
            match tensors.get_mut(&e.name) {
                None => {
                    first_file.insert(e.name.clone(), i);
                    tensors.insert(
                        e.name.clone(),
                        TensorPlan {
                            dtype: e.dtype,
                            shape: Vec::new(),
                            chunks: vec![chunk],
                        },
                    );
                }
                Some(t) => {
                    let first = root.display_file(&files[first_file[&e.name]]);
                    if t.dtype != e.dtype {
                        return Err(Error::tensor(
                            &file.name,
                            &e.name,
                            format!("dtype {} disagrees with {} in {first}", e.dtype, t.dtype),
                        ));
                    }
                    if t.chunks[0].sizes.len() != e.shape.len() {
                        return Err(Error::tensor(
                            &file.name,
                            &e.name,
                            format!(
                                "chunk shape {:?} has a different rank than {:?} in {first}",
                                e.shape, t.chunks[0].sizes
                            ),
                        ));
                    }
                    t.chunks.push(chunk);
                }
            }
        }
    }
    // torch rebuilds the global shape as max(offset + size) per dimension; so do we.
    for t in tensors.values_mut() {
        let rank = t.chunks[0].sizes.len();
        t.shape = (0..rank)
            .map(|d| {
                t.chunks
                    .iter()
                    .map(|c| c.offsets[d] + c.sizes[d])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
    }
    Ok(CheckpointPlan {
        format: Format::DcpHf,
        root: root.clone(),
        files,
        tensors,
        bytes_items: BTreeMap::new(),
        dcp: None,
    })
}

/// A whole missing rank or output file index is invisible to coverage checks when it held the
/// end of every dimension, so check the file names: ranks 1..=R and indices 1..=N all present.
fn check_shard_names(root: &Root, files: &[String]) -> Result<()> {
    let mut ranks = BTreeSet::new();
    let mut indices = BTreeSet::new();
    let mut count = None;
    for f in files {
        let Some((r, i, n)) = parse_shard_name(f) else {
            continue;
        };
        if *count.get_or_insert(n) != n {
            return Err(Error::invalid(
                root.display_file(f),
                format!(
                    "says {n} output files but other shards say {}",
                    count.unwrap_or(0)
                ),
            ));
        }
        ranks.insert(r);
        indices.insert(i);
    }
    if let Some(&max) = ranks.iter().next_back() {
        let missing: Vec<String> = (1..=max)
            .filter(|r| !ranks.contains(r))
            .map(|r| format!("{r:05}"))
            .collect();
        if !missing.is_empty() {
            return Err(Error::invalid(
                root.display(),
                format!(
                    "no shard files from rank(s) {} (shard-RRRRR-*): a shard is missing",
                    missing.join(", ")
                ),
            ));
        }
    }
    if let Some(n) = count {
        let missing: Vec<String> = (1..=n)
            .filter(|i| !indices.contains(i))
            .map(|i| format!("{i:05}"))
            .collect();
        if !missing.is_empty() {
            return Err(Error::invalid(
                root.display(),
                format!(
                    "no shard file for model index {} of {n}: a shard is missing",
                    missing.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        assert_eq!(
            parse_shard_name("shard-00002-model-00001-of-00003.safetensors"),
            Some((2, 1, 3))
        );
        assert_eq!(
            shard_name(2, 1, 3),
            "shard-00002-model-00001-of-00003.safetensors"
        );
        assert_eq!(parse_shard_name("model-00001-of-00003.safetensors"), None);
    }
}
