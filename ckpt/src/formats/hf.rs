//! Hugging Face safetensors: one file, several files, or shards listed by
//! `model.safetensors.index.json`.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{HF_INDEX, MAX_INDEX_BYTES};
use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Format, TensorPlan};
use crate::safetensors;
use crate::storage::{Location, Root, check_relative};

/// An HF index: tensor name -> file name (relative, checked to stay inside the root).
pub fn read_index(root: &Root, rel: &str) -> Result<BTreeMap<String, String>> {
    let name = root.display_file(rel);
    let bytes = root.read_small(rel, MAX_INDEX_BYTES)?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::invalid(&name, format!("malformed index JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::invalid(&name, "index has no `weight_map` object"))?;
    let mut out = BTreeMap::new();
    for (fqn, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::tensor(&name, fqn, "weight_map entry is not a file name string")
        })?;
        check_relative(file, &format!("{name}: weight_map entry `{fqn}`"))?;
        out.insert(fqn.clone(), file.to_string());
    }
    Ok(out)
}

pub fn read(loc: &Location) -> Result<CheckpointPlan> {
    let root = &loc.root;
    let (files, wanted): (Vec<String>, Option<BTreeMap<String, String>>) = match &loc.file {
        Some(f) if f.ends_with(".json") => {
            let idx = read_index(root, f)?;
            (dedup(idx.values()), Some(idx))
        }
        Some(f) => (vec![f.clone()], None),
        None => {
            let listing = root.list()?;
            if listing.iter().any(|(f, _)| f == HF_INDEX) {
                let idx = read_index(root, HF_INDEX)?;
                (dedup(idx.values()), Some(idx))
            } else {
                let files: Vec<String> = listing
                    .into_iter()
                    .map(|(f, _)| f)
                    .filter(|f| f.ends_with(".safetensors"))
                    .collect();
                (files, None)
            }
        }
    };
    let mut tensors = BTreeMap::new();
    for (i, rel) in files.iter().enumerate() {
        let file = root.open(rel)?;
        let header = safetensors::read_header(&file)?;
        for e in header.entries {
            if let Some(w) = &wanted {
                match w.get(&e.name) {
                    Some(f) if f == rel => {}
                    _ => {
                        tracing::warn!(file = %file.name, tensor = %e.name, "tensor not listed for this file in the index; skipped");
                        continue;
                    }
                }
            }
            if tensors.contains_key(&e.name) {
                return Err(Error::tensor(
                    &file.name,
                    &e.name,
                    "tensor appears in more than one file",
                ));
            }
            let chunk = e.chunk(i, vec![0; e.shape.len()]);
            tensors.insert(
                e.name.clone(),
                TensorPlan {
                    dtype: e.dtype,
                    shape: e.shape,
                    chunks: vec![chunk],
                    scales: None,
                },
            );
        }
    }
    if let Some(w) = &wanted {
        for (fqn, f) in w {
            if !tensors.contains_key(fqn) {
                return Err(Error::tensor(
                    root.display_file(f),
                    fqn,
                    "listed in the index but not in this file",
                ));
            }
        }
    }
    Ok(CheckpointPlan {
        format: Format::Hf,
        root: root.clone(),
        files,
        tensors,
        bytes_items: BTreeMap::new(),
        dcp: None,
    })
}

fn dedup<'a>(it: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = it.cloned().collect();
    v.sort();
    v.dedup();
    v
}
