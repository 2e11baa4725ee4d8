//! The checkpoint folder: `step-N` directories, each complete only once its `.metadata` exists.
//! Saves are written to `.step-N.partial` and renamed, so an interrupted save (crash, kill -9)
//! never looks like a checkpoint; the next save clears stale partial directories.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use titan_dcp::METADATA_FILE;

pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The file in a step's folder naming the titan run that saved it: a resume from that step
/// continues the run (its titan-obs records and metrics lines carry the same run id).
pub const RUN_ID_FILE: &str = "titan_run_id";

/// The run id a step folder's [`RUN_ID_FILE`] holds (`None`: saved before run ids were kept).
pub fn parse_run_id(bytes: &[u8]) -> Option<String> {
    let id = String::from_utf8_lossy(bytes).trim().to_string();
    (!id.is_empty()).then_some(id)
}

/// Where a save of `step` is written before it is committed.
pub fn partial_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".step-{step}.partial"))
}

/// Whether `dir` holds a complete DCP checkpoint or an HF export.
pub fn is_complete(dir: &Path) -> bool {
    dir.join(METADATA_FILE).is_file()
        || dir.join("model.safetensors.index.json").is_file()
        || dir.join("model.safetensors").is_file()
}

/// Steps of the complete checkpoints under `root`, ascending. A missing folder has none.
pub fn complete_steps(root: &Path) -> Result<Vec<u64>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(e).with_context(|| format!("listing checkpoints in {}", root.display()));
        }
    };
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing checkpoints in {}", root.display()))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(parse_step_dir)
            && is_complete(&entry.path())
        {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Removes partial directories left by interrupted saves.
pub fn clear_partials(root: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.starts_with(".step-") && n.ends_with(".partial"))
        {
            tracing::info!("removing the interrupted save {}", entry.path().display());
            std::fs::remove_dir_all(entry.path())
                .with_context(|| format!("removing {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Makes the partial save the checkpoint of `step` (replacing an older save of the same step).
pub fn commit(root: &Path, partial: &Path, step: u64) -> Result<PathBuf> {
    let dest = root.join(step_dir_name(step));
    if dest.exists() {
        std::fs::remove_dir_all(&dest).with_context(|| format!("replacing {}", dest.display()))?;
    }
    std::fs::rename(partial, &dest)
        .with_context(|| format!("renaming {} to {}", partial.display(), dest.display()))?;
    // The rename is durable once the folder's entry is on disk.
    if let Ok(dir) = std::fs::File::open(root) {
        let _ = dir.sync_all();
    }
    Ok(dest)
}

/// Deletes all but the newest `keep` complete checkpoints (0 keeps all). Returns those removed.
pub fn purge(root: &Path, keep: u64) -> Result<Vec<u64>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let steps = complete_steps(root)?;
    let n = steps.len().saturating_sub(keep as usize);
    let mut removed = Vec::new();
    for step in &steps[..n] {
        let dir = root.join(step_dir_name(*step));
        std::fs::remove_dir_all(&dir).with_context(|| format!("purging {}", dir.display()))?;
        removed.push(*step);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_steps_count_and_purge_keeps_newest() {
        let root = tempfile::tempdir().unwrap();
        for step in [5u64, 10, 15] {
            let d = root.path().join(step_dir_name(step));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(METADATA_FILE), b"x").unwrap();
        }
        // An interrupted save: data but no .metadata, and a partial dir.
        std::fs::create_dir_all(root.path().join("step-20")).unwrap();
        std::fs::create_dir_all(partial_dir(root.path(), 25)).unwrap();
        assert_eq!(complete_steps(root.path()).unwrap(), vec![5, 10, 15]);
        clear_partials(root.path()).unwrap();
        assert!(!partial_dir(root.path(), 25).exists());
        assert_eq!(purge(root.path(), 2).unwrap(), vec![5]);
        assert_eq!(complete_steps(root.path()).unwrap(), vec![10, 15]);
        assert!(
            complete_steps(&root.path().join("missing"))
                .unwrap()
                .is_empty()
        );
    }
}
