//! DCP sharded safetensors, as torch's HuggingFaceStorageWriter writes with save_distributed=True:
//! `shard-RRRRR-model-IIIII-of-NNNNN.safetensors` per rank and output file, each entry holding
//! the rank's local chunk and `__metadata__.DCP_SHARDING_INFO` its offsets in the global tensor.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::DCP_SHARDING_INFO;
use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Format, TensorPlan};
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

/// The `__metadata__` of a DCP sharded safetensors file holding `chunks` (name and
/// `saved_offsets` in the global tensor), as torch's HuggingFaceStorageWriter writes it: the
/// offsets as JSON under [`DCP_SHARDING_INFO`], `DCP_VERSION` 1.0 and `format` pt. The one
/// builder of this header; [`read`] parses it.
pub fn sharding_metadata<'a>(
    chunks: impl IntoIterator<Item = (&'a str, Vec<u64>)>,
) -> BTreeMap<String, String> {
    let info: serde_json::Map<String, Value> = chunks
        .into_iter()
        .map(|(name, offsets)| {
            (
                name.to_string(),
                serde_json::json!({ "saved_offsets": offsets }),
            )
        })
        .collect();
    [
        (
            DCP_SHARDING_INFO.to_string(),
            Value::Object(info).to_string(),
        ),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("format".to_string(), "pt".to_string()),
    ]
    .into()
}

/// [`sharding_metadata`] of a file whose tensors are whole (every offset 0), given their shapes.
pub fn whole_tensors_metadata<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [u64])>,
) -> BTreeMap<String, String> {
    sharding_metadata(
        tensors
            .into_iter()
            .map(|(name, shape)| (name, vec![0u64; shape.len()])),
    )
}

/// Parses the [`DCP_SHARDING_INFO`] of `file`'s `__metadata__`; returns the lookup of an
/// entry's `saved_offsets` (checked against the entry's shape).
fn sharding_info(
    file: &str,
    metadata: &BTreeMap<String, String>,
) -> Result<impl Fn(&str, &[u64]) -> Result<Vec<u64>>> {
    let info = metadata.get(DCP_SHARDING_INFO).ok_or_else(|| {
        Error::invalid(
            file,
            format!(
                "no `{DCP_SHARDING_INFO}` in `__metadata__`: not a DCP sharded safetensors file"
            ),
        )
    })?;
    let info: Value = serde_json::from_str(info)
        .map_err(|e| Error::invalid(file, format!("malformed {DCP_SHARDING_INFO} JSON: {e}")))?;
    let file = file.to_string();
    Ok(move |name: &str, shape: &[u64]| {
        let offsets: Vec<u64> = info
            .get(name)
            .and_then(|v| v.get("saved_offsets"))
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                Error::tensor(
                    &file,
                    name,
                    format!("no integer `saved_offsets` in {DCP_SHARDING_INFO}"),
                )
            })?;
        if offsets.len() != shape.len() {
            return Err(Error::tensor(
                &file,
                name,
                format!("saved_offsets {offsets:?} do not match the chunk shape {shape:?}"),
            ));
        }
        Ok(offsets)
    })
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
        let offsets_of = sharding_info(&file.name, &header.metadata)?;
        for e in header.entries {
            let offsets = offsets_of(&e.name, &e.shape)?;
            let chunk = e.chunk(i, offsets);
            match tensors.get_mut(&e.name) {
                None => {
                    first_file.insert(e.name.clone(), i);
                    tensors.insert(
                        e.name.clone(),
                        TensorPlan {
                            dtype: e.dtype,
                            shape: Vec::new(),
                            chunks: vec![chunk],
                            scales: None,
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

/// The numbers of 1..=`last` not in `seen`, as shard names spell them (`00002, 00005`).
fn missing(seen: &BTreeSet<u32>, last: u32) -> String {
    let missing: Vec<String> = (1..=last)
        .filter(|i| !seen.contains(i))
        .map(|i| format!("{i:05}"))
        .collect();
    missing.join(", ")
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
        let missing = missing(&ranks, max);
        if !missing.is_empty() {
            return Err(Error::invalid(
                root.display(),
                format!(
                    "no shard files from rank(s) {missing} (shard-RRRRR-*): a shard is missing"
                ),
            ));
        }
    }
    if let Some(n) = count {
        let missing = missing(&indices, n);
        if !missing.is_empty() {
            return Err(Error::invalid(
                root.display(),
                format!("no shard file for model index {missing} of {n}: a shard is missing"),
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

    #[test]
    fn a_missing_rank_or_file_index_is_named() {
        let root = Root::local("/ckpt");
        let names = |v: &[(u32, u32)]| -> Vec<String> {
            v.iter().map(|&(r, i)| shard_name(r, i, 4)).collect()
        };
        let complete = names(&[(1, 1), (1, 2), (2, 3), (2, 4)]);
        assert!(check_shard_names(&root, &complete).is_ok());
        let err = check_shard_names(&root, &names(&[(1, 1), (3, 2), (3, 3), (3, 4)]));
        let err = err.unwrap_err().to_string();
        assert!(err.contains("no shard files from rank(s) 00002 "), "{err}");
        let err = check_shard_names(&root, &names(&[(1, 1), (2, 3)]));
        let err = err.unwrap_err().to_string();
        assert!(err.contains("model index 00002, 00004 of 4"), "{err}");
    }

    #[test]
    fn sharding_info_round_trips() {
        let md = sharding_metadata([("w", vec![4, 0]), ("b", vec![2])]);
        assert_eq!(md["DCP_VERSION"], "1.0");
        assert_eq!(md["format"], "pt");
        let offsets = sharding_info("f", &md).unwrap();
        assert_eq!(offsets("w", &[4, 8]).unwrap(), [4, 0]);
        assert_eq!(offsets("b", &[2]).unwrap(), [2]);
        assert!(offsets("w", &[4]).is_err());
        assert!(offsets("x", &[1]).is_err());
        let whole = whole_tensors_metadata([("w", &[3u64, 5][..])]);
        assert_eq!(
            sharding_info("f", &whole).unwrap()("w", &[3, 5]).unwrap(),
            [0, 0]
        );
        assert!(sharding_info("f", &BTreeMap::new()).is_err());
    }
}
