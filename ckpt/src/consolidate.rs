//! Consolidation into HF safetensors: output file planning (an existing HF index or a maximum
//! shard size), the deterministic split of output files across ranks, and the index that rank 0
//! writes once every rank's files are complete.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::formats::HF_INDEX;
use crate::plan::CheckpointPlan;
use crate::storage::{Root, check_relative};
use crate::write::{self, EngineOptions, OutFilePlan, OutTensor};
use titan_dcp::Dtype;

/// How tensors are grouped into output files.
#[derive(Debug, Clone)]
pub enum FileLayout {
    /// Tensor name -> file name, e.g. from an existing `model.safetensors.index.json`.
    Mapping(BTreeMap<String, String>),
    /// Pack tensors in name order into files of at most this many bytes (a bigger tensor gets a
    /// file of its own).
    MaxShardSize(u64),
}

/// Which share of the output files this process writes.
#[derive(Debug, Clone, Copy)]
pub struct RankShare {
    pub rank: usize,
    pub world_size: usize,
    /// How long rank 0 waits for the other ranks' files before giving up.
    pub wait_timeout: Duration,
}

impl RankShare {
    pub fn single() -> RankShare {
        RankShare {
            rank: 0,
            world_size: 1,
            wait_timeout: Duration::from_secs(0),
        }
    }
}

/// The HF index JSON.
#[derive(Debug, Serialize)]
pub struct HfIndex {
    pub metadata: IndexMetadata,
    pub weight_map: BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub struct IndexMetadata {
    pub total_size: u64,
}

/// The metadata HF tools expect in safetensors files.
pub fn hf_metadata() -> BTreeMap<String, String> {
    [("format".to_string(), "pt".to_string())].into()
}

/// Groups `tensors` into HF output files. One file without a mapping is `model.safetensors`;
/// several are `model-IIIII-of-NNNNN.safetensors`.
pub fn plan_files(tensors: Vec<OutTensor>, layout: &FileLayout) -> Result<Vec<OutFilePlan>> {
    let mut groups: BTreeMap<String, Vec<OutTensor>> = BTreeMap::new();
    match layout {
        FileLayout::Mapping(map) => {
            let mut missing = Vec::new();
            for t in tensors {
                match map.get(&t.name) {
                    Some(f) => {
                        check_relative(f, "--index-from weight_map")?;
                        groups.entry(f.clone()).or_default().push(t)
                    }
                    None => missing.push(t.name),
                }
            }
            if !missing.is_empty() {
                return Err(Error::usage(format!(
                    "the --index-from mapping has no file for {} tensor(s): {}",
                    missing.len(),
                    preview(&missing)
                )));
            }
            let have: std::collections::BTreeSet<&String> =
                groups.values().flatten().map(|t| &t.name).collect();
            let extra: Vec<String> = map.keys().filter(|k| !have.contains(k)).cloned().collect();
            if !extra.is_empty() {
                return Err(Error::usage(format!(
                    "the --index-from mapping lists {} tensor(s) the checkpoint does not have: {}",
                    extra.len(),
                    preview(&extra)
                )));
            }
        }
        FileLayout::MaxShardSize(max) => {
            let mut bins: Vec<Vec<OutTensor>> = Vec::new();
            let mut cur = 0u64;
            for t in tensors {
                let n = t.nbytes();
                match bins.last_mut() {
                    Some(b) if cur + n <= *max || b.is_empty() => {
                        b.push(t);
                        cur += n;
                    }
                    _ => {
                        bins.push(vec![t]);
                        cur = n;
                    }
                }
            }
            let count = bins.len();
            for (i, b) in bins.into_iter().enumerate() {
                let name = if count == 1 {
                    "model.safetensors".to_string()
                } else {
                    format!("model-{:05}-of-{:05}.safetensors", i + 1, count)
                };
                groups.insert(name, b);
            }
        }
    }
    let md = hf_metadata();
    Ok(groups
        .into_iter()
        .map(|(name, ts)| OutFilePlan::safetensors(name, ts, &md))
        .collect())
}

fn preview(names: &[String]) -> String {
    let mut s = names
        .iter()
        .take(5)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 5 {
        s.push_str(&format!(", ... ({} more)", names.len() - 5));
    }
    s
}

/// Deterministic assignment of files to ranks: biggest first onto the least loaded rank (ties to
/// the lowest rank). Every rank computes the same answer from the same inputs.
pub fn assign(files: &[OutFilePlan], world_size: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by(|&a, &b| {
        files[b]
            .size
            .cmp(&files[a].size)
            .then(files[a].name.cmp(&files[b].name))
    });
    let mut load = vec![0u64; world_size.max(1)];
    let mut owner = vec![0; files.len()];
    for i in order {
        let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[i] = r;
        load[r] += files[i].size;
    }
    owner
}

/// The index over `files`.
pub fn index_for(files: &[OutFilePlan]) -> HfIndex {
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0;
    for f in files {
        for (t, _) in &f.tensors {
            weight_map.insert(t.name.clone(), f.name.clone());
            total_size += t.nbytes();
        }
    }
    HfIndex {
        metadata: IndexMetadata { total_size },
        weight_map,
    }
}

/// What a consolidation wrote (for the summary line).
#[derive(Debug, Serialize)]
pub struct Summary {
    pub files_written: Vec<String>,
    pub bytes_written: u64,
    pub index_written: bool,
}

/// Writes this rank's share of `files` and, on rank 0, the index once all shares are complete.
pub fn run(
    plan: &CheckpointPlan,
    out: &Root,
    files: &[OutFilePlan],
    write_index: bool,
    share: RankShare,
    opts: &EngineOptions,
) -> Result<Summary> {
    if share.rank >= share.world_size {
        return Err(Error::usage(format!(
            "--rank {} must be below --world-size {}",
            share.rank, share.world_size
        )));
    }
    if write_index && out.size_of(HF_INDEX)?.is_some() {
        return Err(Error::usage(format!(
            "{} already exists: consolidate into an empty directory",
            out.display_file(HF_INDEX)
        )));
    }
    let owners = assign(files, share.world_size);
    let mine: Vec<OutFilePlan> = files
        .iter()
        .zip(&owners)
        .filter(|(_, o)| **o == share.rank)
        .map(|(f, _)| f.clone())
        .collect();
    let bytes: u64 = mine.iter().map(|f| f.size).sum();
    opts.progress.set_length(
        mine.iter()
            .flat_map(|f| &f.tensors)
            .map(|(t, _)| t.input_bytes(plan))
            .sum(),
    );
    tracing::info!(
        rank = share.rank,
        files = mine.len(),
        bytes,
        "writing output files"
    );
    write::write_files(plan, out, &mine, opts)?;
    let mut index_written = false;
    if write_index && share.rank == 0 {
        let others: Vec<(String, u64)> = files
            .iter()
            .zip(&owners)
            .filter(|(_, o)| **o != 0)
            .map(|(f, _)| (f.name.clone(), f.size))
            .collect();
        if !others.is_empty() {
            tracing::info!(
                files = others.len(),
                "waiting for the other ranks' files before writing the index"
            );
            out.wait_for(&others, share.wait_timeout)?;
        }
        let index = index_for(files);
        let json = serde_json::to_vec_pretty(&index).expect("index JSON");
        out.write_small(HF_INDEX, &json)?;
        index_written = true;
    }
    Ok(Summary {
        files_written: mine.iter().map(|f| f.name.clone()).collect(),
        bytes_written: bytes,
        index_written,
    })
}

/// Output tensors for consolidation: same names, optionally a new dtype for float tensors.
pub fn consolidation_tensors(
    plan: &CheckpointPlan,
    dtype: Option<Dtype>,
) -> Result<Vec<OutTensor>> {
    plan.tensors
        .iter()
        .map(|(name, t)| {
            let to = match dtype {
                Some(d) if t.dtype.is_float() => d,
                _ => t.value_dtype(),
            };
            crate::cast::check(t.dtype, to)?;
            Ok(OutTensor::whole(name.clone(), name, t, to))
        })
        .collect()
}

/// Parses sizes like `5GB`, `500MB`, `2GiB`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad size `{s}` (e.g. 5GB, 500MB, 2GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" | "K" => 1e3,
        "MB" | "M" => 1e6,
        "GB" | "G" => 1e9,
        "TB" | "T" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "bad size unit in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    let v = (n * mult) as u64;
    if v == 0 {
        return Err(format!("size `{s}` must be positive"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, n: u64) -> OutTensor {
        OutTensor {
            name: name.into(),
            sources: vec![crate::write::SourceSlice {
                tensor: name.into(),
                offset: 0,
                numel: n,
            }],
            dtype: Dtype::U8,
            shape: vec![n],
            row_map: None,
            transpose: None,
            side_by_side: None,
        }
    }

    #[test]
    fn max_shard_size_packs_in_order() {
        let files = plan_files(
            vec![t("a", 6), t("b", 5), t("c", 20), t("d", 1)],
            &FileLayout::MaxShardSize(10),
        )
        .unwrap();
        let names: Vec<Vec<&str>> = files
            .iter()
            .map(|f| f.tensors.iter().map(|(t, _)| t.name.as_str()).collect())
            .collect();
        assert_eq!(names, vec![vec!["a"], vec!["b"], vec!["c"], vec!["d"]]);
        assert_eq!(files[0].name, "model-00001-of-00004.safetensors");
        let one = plan_files(vec![t("a", 6)], &FileLayout::MaxShardSize(10)).unwrap();
        assert_eq!(one[0].name, "model.safetensors");
    }

    #[test]
    fn mapping_must_match_the_checkpoint() {
        let map: BTreeMap<String, String> = [("a".to_string(), "x.safetensors".to_string())].into();
        assert!(
            plan_files(
                vec![t("a", 1), t("b", 1)],
                &FileLayout::Mapping(map.clone())
            )
            .is_err()
        );
        let bad: BTreeMap<String, String> =
            [("a".to_string(), "../x.safetensors".to_string())].into();
        assert!(plan_files(vec![t("a", 1)], &FileLayout::Mapping(bad)).is_err());
        assert_eq!(
            plan_files(vec![t("a", 1)], &FileLayout::Mapping(map)).unwrap()[0].name,
            "x.safetensors"
        );
    }

    #[test]
    fn assignment_is_balanced_and_deterministic() {
        let files = plan_files(
            (0..8).map(|i| t(&format!("t{i}"), 10 + i)).collect(),
            &FileLayout::MaxShardSize(1),
        )
        .unwrap();
        let a = assign(&files, 3);
        assert_eq!(a, assign(&files, 3));
        for r in 0..3 {
            assert!(a.contains(&r));
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("5XB").is_err());
    }
}
