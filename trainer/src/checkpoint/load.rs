//! Reading checkpoints back: a DCP directory through titan-ckpt's reader, or HF safetensors
//! (model weights only, renamed and q/k-permuted to torchtitan's layout).

use std::path::Path;

use anyhow::{Context, Result, bail};
use tch::Tensor;
use titan_dcp::{CheckpointStore, DcpReader, ItemMetadata, LocalDir, pickle::Value};

use super::host::HostTensor;
use super::state::StateSource;
use crate::hf;
use crate::parallelize::ParallelModel;

/// A DCP checkpoint (local directory or object store) as a [`StateSource`].
pub struct DcpSource<S: CheckpointStore = LocalDir> {
    reader: DcpReader<S>,
    dir: String,
}

impl DcpSource<LocalDir> {
    pub fn open(dir: &Path) -> Result<Self> {
        let reader = DcpReader::open(dir)
            .with_context(|| format!("opening the DCP checkpoint {}", dir.display()))?;
        Ok(Self::new(reader, dir.display().to_string()))
    }
}

impl<S: CheckpointStore> DcpSource<S> {
    /// `dir` names the checkpoint in errors.
    pub fn new(reader: DcpReader<S>, dir: String) -> Self {
        Self { reader, dir }
    }
}

impl<S: CheckpointStore> StateSource for DcpSource<S> {
    fn has(&self, key: &str) -> bool {
        self.reader.metadata().item(key).is_some()
    }

    fn tensor(&self, key: &str) -> Result<HostTensor> {
        match self.reader.metadata().item(key) {
            Some(ItemMetadata::Tensor(_)) => {}
            Some(_) => bail!("`{key}` in {} is not a tensor", self.dir),
            None => bail!("{} has no `{key}`", self.dir),
        }
        let t = self
            .reader
            .read_tensor(key)
            .with_context(|| format!("reading `{key}` from {}", self.dir))?;
        Ok(HostTensor {
            dtype: t.dtype,
            shape: t.shape,
            data: t.data,
        })
    }

    fn object(&self, key: &str) -> Result<Value> {
        self.reader
            .read_object(key)
            .with_context(|| format!("reading `{key}` from {}", self.dir))
    }
}

/// Loads HF safetensors weights (`model.safetensors` or the files of
/// `model.safetensors.index.json`) from `dir` into `model`.
pub fn load_hf_model(dir: &Path, model: &ParallelModel) -> Result<()> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            bail!("{} has no weight_map", index.display());
        };
        let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        for n in &names {
            if n.contains('/') || n.contains("..") {
                bail!(
                    "{} names `{n}`, which is outside the checkpoint folder",
                    index.display()
                );
            }
        }
        names.iter().map(|n| dir.join(n)).collect()
    } else if dir.join("model.safetensors").is_file() {
        vec![dir.join("model.safetensors")]
    } else {
        bail!(
            "{} holds neither model.safetensors nor model.safetensors.index.json (checkpoint.initial_load_in_hf)",
            dir.display()
        );
    };
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for f in &files {
        let read =
            Tensor::read_safetensors(f).with_context(|| format!("reading {}", f.display()))?;
        tensors.extend(read);
    }
    let titan = hf::from_hf(tensors, &model.args)?;
    let mut missing: Vec<&str> = model
        .named_parameters()
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !titan.iter().any(|(t, _)| t == n))
        .collect();
    missing.truncate(5);
    if !missing.is_empty() {
        bail!("the HF checkpoint in {} lacks {missing:?}", dir.display());
    }
    let buffers = model.named_buffers();
    for (name, t) in &titan {
        // deepseek_v3's `e_score_correction_bias` is the routing bias buffer `expert_bias_E`.
        if let Some((_, b)) = buffers.iter().find(|(n, _)| n == name) {
            if b.size() != t.size() {
                bail!(
                    "HF tensor for `{name}` has shape {:?}, the model's {:?}",
                    t.size(),
                    b.size()
                );
            }
            tch::no_grad(|| b.shallow_clone().copy_(t));
            continue;
        }
        let p = model
            .parameter(name)
            .with_context(|| format!("HF weight `{name}` has no parameter in this model flavor"))?;
        model.set_parameter(name, &t.to_kind(p.kind()))?;
    }
    Ok(())
}
