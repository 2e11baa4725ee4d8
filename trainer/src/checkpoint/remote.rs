//! Object-store destinations (`checkpoint.folder = "s3://bucket/run/ckpt"`, gs://, az://,
//! file://) through titan-storage. A save is committed locally first, then
//! uploaded (span `checkpoint_upload`): data files, `.metadata` last, then a `step-N.committed`
//! marker next to `step-N/`. Object stores have no atomic directory rename, so the marker is the
//! commit: a step without it (an interrupted upload) is never loaded.

use std::path::Path;

use anyhow::{Context, Result};
use titan_ckpt::dcp_store::RootStore;
use titan_dcp::{DcpReader, METADATA_FILE, ReadOptions};
use titan_storage::Root;

use super::layout;
use super::load::DcpSource;

const MARKER_SUFFIX: &str = ".committed";

/// The checkpoint folder in an object store.
#[derive(Clone)]
pub struct Remote {
    root: Root,
}

/// Whether `folder` names an object store (or file://) URL rather than a local path.
pub fn is_url(folder: &str) -> bool {
    folder.contains("://")
}

impl Remote {
    pub fn parse(url: &str) -> Result<Self> {
        let root = Root::parse(url).with_context(|| format!("checkpoint.folder `{url}`"))?;
        Ok(Self { root })
    }

    pub fn display(&self) -> String {
        self.root.display()
    }

    fn marker(step: u64) -> String {
        format!("{}{MARKER_SUFFIX}", layout::step_dir_name(step))
    }

    /// Committed steps, ascending.
    pub fn complete_steps(&self) -> Result<Vec<u64>> {
        let listing = match self.root.list() {
            Ok(l) => l,
            // A local (file://) folder that does not exist yet holds no checkpoint.
            Err(_) if self.root.local_dir().is_some_and(|d| !d.exists()) => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", self.root.display())),
        };
        let mut steps: Vec<u64> = listing
            .iter()
            .filter_map(|(name, _)| {
                name.strip_suffix(MARKER_SUFFIX)?
                    .strip_prefix("step-")?
                    .parse()
                    .ok()
            })
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// The run id saved with `step` (see [`layout::RUN_ID_FILE`]).
    pub fn run_id(&self, step: u64) -> Result<Option<String>> {
        let dir = self.root.join(&layout::step_dir_name(step))?;
        match dir.read_small(layout::RUN_ID_FILE, 1024) {
            Ok(bytes) => Ok(layout::parse_run_id(&bytes)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading the run id of {}", dir.display())),
        }
    }

    /// Uploads the committed local checkpoint `dir` as `step-N`, `.metadata` last, then the marker.
    pub fn upload(&self, dir: &Path, step: u64) -> Result<u64> {
        let _s = titan_obs_core::span("checkpoint_upload");
        let dest = self.root.join(&layout::step_dir_name(step))?;
        dest.create_dir_all()?;
        let total = dest
            .upload_dir(dir, METADATA_FILE)
            .with_context(|| format!("uploading {} to {}", dir.display(), dest.display()))?;
        self.root
            .write_small(&Self::marker(step), step.to_string().as_bytes())
            .with_context(|| format!("committing step {step} in {}", self.root.display()))?;
        Ok(total)
    }

    /// Deletes all but the newest `keep` committed steps (marker first, so a half-deleted step
    /// is never loaded).
    pub fn purge(&self, keep: u64) -> Result<Vec<u64>> {
        if keep == 0 {
            return Ok(Vec::new());
        }
        let steps = self.complete_steps()?;
        let n = steps.len().saturating_sub(keep as usize);
        for step in &steps[..n] {
            self.root.remove(&Self::marker(*step))?;
            let dir = self.root.join(&layout::step_dir_name(*step))?;
            for (name, _) in dir.list().unwrap_or_default() {
                dir.remove(&name)?;
            }
        }
        Ok(steps[..n].to_vec())
    }

    /// The committed checkpoint of `step` as a state source.
    pub fn source(&self, step: u64) -> Result<DcpSource<RootStore>> {
        let dir = self.root.join(&layout::step_dir_name(step))?;
        let shown = dir.display();
        let reader = DcpReader::with_store(RootStore::new(dir), ReadOptions::default())
            .with_context(|| format!("opening the DCP checkpoint {shown}"))?;
        Ok(DcpSource::new(reader, shown))
    }
}
