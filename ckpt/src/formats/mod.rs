//! Readers that turn each on-disk format into a [`CheckpointPlan`], and format detection.

pub mod dcp_hf;
pub mod dcp_native;
pub mod hf;

use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Format};
use crate::safetensors;
use crate::storage::{Location, Root};

/// The HF index file name.
pub const HF_INDEX: &str = "model.safetensors.index.json";
/// The DCP native metadata file name.
pub const DCP_METADATA: &str = ".metadata";
/// The `__metadata__` key holding DCP sharding offsets in dcp-hf files.
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";
/// Index and metadata files larger than this are refused.
pub const MAX_INDEX_BYTES: u64 = 100 * 1000 * 1000;

/// Detects the format at `loc` without reading more than one header.
pub fn detect(loc: &Location) -> Result<Format> {
    let root = &loc.root;
    if let Some(file) = &loc.file {
        if file.ends_with(".json") {
            return Ok(Format::Hf);
        }
        if file.ends_with(".distcp") || file == DCP_METADATA {
            // One file of a DCP checkpoint means nothing without the others and `.metadata`:
            // read as safetensors it gives a nonsense header length.
            return Err(Error::usage(format!(
                "{} is one file of a DCP checkpoint: pass its folder {}",
                root.display_file(file),
                root.display()
            )));
        }
        if !file.ends_with(".safetensors") {
            return Err(Error::usage(format!(
                "{}: not a checkpoint file titan-ckpt reads: pass a .safetensors file, an HF \
                 index (.json), or a checkpoint folder (dcp, dcp-hf, hf, or a run's step-N \
                 folders)",
                root.display_file(file)
            )));
        }
        let header = safetensors::read_header(&root.open(file)?)?;
        return Ok(if header.metadata.contains_key(DCP_SHARDING_INFO) {
            Format::DcpHf
        } else {
            Format::Hf
        });
    }
    let files = root.list()?;
    let has = |n: &str| files.iter().any(|(f, _)| f == n);
    if has(DCP_METADATA) {
        return Ok(Format::Dcp);
    }
    if has(HF_INDEX) {
        return Ok(Format::Hf);
    }
    let Some((first, _)) = files.iter().find(|(f, _)| f.ends_with(".safetensors")) else {
        let hint = if root.has_dir("sharded") {
            " (torchtitan keeps dcp-hf shards in the `sharded/` sub-directory: pass that)"
        } else {
            ""
        };
        return Err(Error::usage(format!(
            "{}: no checkpoint found: expected `.metadata` (dcp), `{HF_INDEX}` or `*.safetensors` files{hint}",
            root.display()
        )));
    };
    let header = safetensors::read_header(&root.open(first)?)?;
    Ok(if header.metadata.contains_key(DCP_SHARDING_INFO) {
        Format::DcpHf
    } else {
        Format::Hf
    })
}

/// Opens the checkpoint at `loc` (format detected), validating headers, offsets and coverage.
pub fn open(loc: &Location) -> Result<CheckpointPlan> {
    let mut plan = read(loc)?;
    plan.check_coverage()?;
    // FP8 releases: each float8 weight's `_scale_inv` tensor goes onto the weight's plan.
    crate::fp8::attach(&mut plan)?;
    Ok(plan)
}

/// Reads the checkpoint at `loc` (format detected, headers and offsets validated) without
/// checking that chunks tile their tensors: `verify` reports every tensor that does not, then
/// finishes [`open`]'s work with [`crate::fp8::attach`].
pub fn read(loc: &Location) -> Result<CheckpointPlan> {
    let format = detect(loc)?;
    tracing::info!(location = %loc.root.display(), %format, "reading checkpoint");
    match format {
        Format::Hf => hf::read(loc),
        Format::DcpHf => dcp_hf::read(&loc.root, loc.file.as_deref()),
        Format::Dcp => dcp_native::read(&loc.root),
    }
}

/// Opens a path or URL given on the command line (a folder of `step-N` checkpoints resolves to
/// its newest complete one, see [`resolve_steps`]).
pub fn open_str(s: &str) -> Result<CheckpointPlan> {
    open(&resolve_steps(Location::parse(s)?)?.0)
}

/// torchtitan's checkpoint folder name for step `n`.
fn step_of(dir: &str) -> Option<u64> {
    dir.strip_prefix("step-")?.parse().ok()
}

/// Whether `root` directly holds a checkpoint (DCP `.metadata`, an HF index or safetensors).
fn holds_checkpoint(files: &[(String, u64)]) -> bool {
    files
        .iter()
        .any(|(f, _)| f == DCP_METADATA || f == HF_INDEX || f.ends_with(".safetensors"))
}

/// When `loc` is a folder holding no checkpoint but `step-N` sub-folders (torchtitan's
/// `checkpoint/` folder) or a `checkpoint/` folder of them (the run folder), the newest complete
/// `step-N` (DCP `.metadata` written, which torchtitan and titan-train do last), as torchtitan's
/// `load_step = -1` picks. Returns the location to open and, when resolved, the step folder.
pub fn resolve_steps(loc: Location) -> Result<(Location, Option<String>)> {
    if loc.file.is_some() {
        return Ok((loc, None));
    }
    let mut root = loc.root.clone();
    let files = match root.list() {
        Ok(f) => f,
        Err(_) => return Ok((loc, None)),
    };
    if holds_checkpoint(&files) {
        return Ok((loc, None));
    }
    let mut dirs = root.list_dirs()?;
    if !dirs.iter().any(|d| step_of(d).is_some()) && dirs.iter().any(|d| d == "checkpoint") {
        root = root.join("checkpoint")?;
        dirs = root.list_dirs()?;
    }
    let mut steps: Vec<(u64, String)> = dirs
        .into_iter()
        .filter_map(|d| step_of(&d).map(|n| (n, d)))
        .collect();
    steps.sort();
    let mut skipped = Vec::new();
    for (_, dir) in steps.into_iter().rev() {
        let step_root = root.join(&dir)?;
        if holds_checkpoint(&step_root.list()?) {
            for s in &skipped {
                tracing::warn!(folder = %s, "incomplete checkpoint (no .metadata or safetensors); skipped");
            }
            let name = step_root.display();
            return Ok((
                Location {
                    root: step_root,
                    file: None,
                },
                Some(name),
            ));
        }
        skipped.push(root.display_file(&dir));
    }
    if !skipped.is_empty() {
        return Err(Error::usage(format!(
            "{}: no complete step-N checkpoint: {} lack `.metadata` (interrupted saves?)",
            root.display(),
            skipped.join(", ")
        )));
    }
    Ok((loc, None))
}

/// Output roots are directories; a file name there is a usage error.
pub fn output_root(s: &str) -> Result<Root> {
    let root = Root::parse(s)?;
    if let Some(dir) = root.local_dir()
        && dir.is_file()
    {
        return Err(Error::usage(format!(
            "output `{s}` is a file; give a directory"
        )));
    }
    Ok(root)
}
