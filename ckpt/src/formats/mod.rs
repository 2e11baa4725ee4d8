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
    let format = detect(loc)?;
    tracing::info!(location = %loc.root.display(), %format, "reading checkpoint");
    let plan = match format {
        Format::Hf => hf::read(loc)?,
        Format::DcpHf => dcp_hf::read(&loc.root, loc.file.as_deref())?,
        Format::Dcp => dcp_native::read(&loc.root)?,
    };
    plan.check_coverage()?;
    Ok(plan)
}

/// Opens a path or URL given on the command line.
pub fn open_str(s: &str) -> Result<CheckpointPlan> {
    open(&Location::parse(s)?)
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
