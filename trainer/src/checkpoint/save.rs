//! Writing one staged state as a DCP checkpoint and committing it. Runs on the training thread
//! (sync) or on the background writer (async): it touches only host memory and files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use titan_dcp::pickle::Limits;
use titan_dcp::{
    DcpWriter, FileKey, Metadata, TensorChunk, WriteOptions, merge_rank_parts, metadata_bytes,
    parse_metadata, write_metadata_file,
};

use super::layout;
use super::state::{StagedState, StagedValue};
use crate::parallel::RankSync;

/// How a save went (for the log line and the benchmark).
#[derive(Debug, Clone)]
pub struct SaveReport {
    pub step: u64,
    pub dir: PathBuf,
    pub bytes: usize,
    /// Writing files and committing (hidden from training when async).
    pub write: Duration,
}

/// A test hook: `TITAN_CKPT_PAUSE_BEFORE_COMMIT_MS` sleeps after the data files are written and
/// before `.metadata`/the rename, so tests can kill a process in the middle of a save.
fn pause_before_commit() {
    if let Some(ms) = std::env::var("TITAN_CKPT_PAUSE_BEFORE_COMMIT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!("TITAN_CKPT_PAUSE_BEFORE_COMMIT_MS: pausing {ms} ms inside the save");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// The ranks of a multi-rank save: every rank writes its own data file into the shared partial
/// directory; rank 0 merges their metadata, writes `.metadata` and commits.
#[derive(Clone)]
pub struct SaveGroup {
    pub sync: Arc<dyn RankSync>,
    pub world_size: usize,
}

/// Writes `state` as this rank's `__{rank}_0.distcp` under a partial directory, then (rank 0,
/// once every rank of `group` has written) `.metadata`, and renames the directory to `step-N`.
/// `after_commit` runs on rank 0 before the other ranks are released (an upload).
pub fn write_and_commit(
    root: &Path,
    state: &StagedState,
    rank: u32,
    zstd_level: Option<i32>,
    group: Option<&SaveGroup>,
    after_commit: &dyn Fn(&Path) -> Result<()>,
) -> Result<SaveReport> {
    let start = Instant::now();
    let _s = titan_obs_core::span("checkpoint_save");
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let partial = layout::partial_dir(root, state.step);
    // A multi-rank partial directory is shared: stale ones were cleared at startup.
    if group.is_none() && partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("clearing {}", partial.display()))?;
    }
    let result = (|| -> Result<Option<Metadata>> {
        let mut w = DcpWriter::create(
            &partial,
            WriteOptions {
                zstd_level,
                fsync: true,
            },
        )
        .with_context(|| format!("creating {}", partial.display()))?;
        let file = FileKey { rank, k: 0 };
        // Objects first, then tensors, as torch orders a rank's items.
        for item in &state.items {
            if let StagedValue::Object(v) = &item.value {
                w.add_object(file, &item.key, v)
                    .with_context(|| format!("writing `{}`", item.key))?;
                w.set_planner_path(&item.key, item.planner_path.clone());
            }
        }
        for item in &state.items {
            if let StagedValue::Tensor(t) = &item.value {
                let zeros = vec![0u64; t.shape.len()];
                let (global, offsets) = match &item.chunk_of {
                    Some((global, offsets)) => (global.as_slice(), offsets.as_slice()),
                    None => (t.shape.as_slice(), zeros.as_slice()),
                };
                w.add_tensor_chunk(
                    file,
                    TensorChunk {
                        fqn: &item.key,
                        dtype: t.dtype,
                        global_shape: global,
                        offsets,
                        sizes: &t.shape,
                        data: &t.data,
                    },
                )
                .with_context(|| format!("writing `{}`", item.key))?;
                w.set_planner_path(&item.key, item.planner_path.clone());
            }
        }
        pause_before_commit();
        if group.is_some() {
            return Ok(Some(w.finish_rank_part().with_context(|| {
                format!("finishing rank {rank}'s files in {}", partial.display())
            })?));
        }
        w.finish()
            .with_context(|| format!("finishing {}", partial.display()))?;
        Ok(None)
    })();
    let part = match result {
        Ok(part) => part,
        Err(e) => {
            if group.is_none() {
                let _ = std::fs::remove_dir_all(&partial);
            }
            return Err(e);
        }
    };
    if rank == 0
        && let Some(id) = &state.run_id
    {
        let path = partial.join(layout::RUN_ID_FILE);
        std::fs::write(&path, id).with_context(|| format!("writing {}", path.display()))?;
    }
    let dir = match (group, part) {
        (Some(group), Some(part)) => {
            commit_group(root, &partial, state.step, rank, group, part, after_commit)?
        }
        _ => {
            let dir = layout::commit(root, &partial, state.step)?;
            after_commit(&dir)?;
            dir
        }
    };
    Ok(SaveReport {
        step: state.step,
        dir,
        bytes: state.nbytes(),
        write: start.elapsed(),
    })
}

fn part_file(partial: &Path, rank: u32) -> PathBuf {
    partial.join(format!(".rank-{rank}.metadata.part"))
}

/// Every rank publishes its part and meets the others; rank 0 merges the parts into
/// `.metadata`, commits, runs `after_commit`, then releases the others.
fn commit_group(
    root: &Path,
    partial: &Path,
    step: u64,
    rank: u32,
    group: &SaveGroup,
    part: Metadata,
    after_commit: &dyn Fn(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let path = part_file(partial, rank);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, metadata_bytes(&part))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    group
        .sync
        .barrier(&format!("checkpoint/step-{step}/written"))?;
    if rank == 0 {
        let mut parts = Vec::with_capacity(group.world_size);
        for r in 0..group.world_size as u32 {
            let path = part_file(partial, r);
            let bytes = std::fs::read(&path).with_context(|| {
                format!("reading rank {r}'s save metadata {} (is the checkpoint folder shared by all ranks?)", path.display())
            })?;
            parts.push(parse_metadata(
                &bytes,
                &path.display().to_string(),
                &Limits::default(),
            )?);
        }
        let merged = merge_rank_parts(partial, parts)?;
        write_metadata_file(partial, &merged, true)?;
        for r in 0..group.world_size as u32 {
            let _ = std::fs::remove_file(part_file(partial, r));
        }
        let dir = layout::commit(root, partial, step)?;
        after_commit(&dir)?;
    }
    group
        .sync
        .barrier(&format!("checkpoint/step-{step}/committed"))?;
    Ok(root.join(layout::step_dir_name(step)))
}
