//! Writing one staged state as a DCP checkpoint and committing it. Runs on the training thread
//! (sync) or on the background writer (async): it touches only host memory and files.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use titan_ckpt::dcp::{DcpWriter, FileKey, TensorChunk, WriteOptions};

use super::layout;
use super::state::{StagedState, StagedValue};

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

/// Writes `state` as this rank's `__{rank}_0.distcp` plus `.metadata` under a partial directory,
/// then renames it to `step-N`.
pub fn write_and_commit(
    root: &Path,
    state: &StagedState,
    rank: u32,
    zstd_level: Option<i32>,
) -> Result<SaveReport> {
    let start = Instant::now();
    let _s = titan_obs::span("checkpoint_save");
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let partial = layout::partial_dir(root, state.step);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("clearing {}", partial.display()))?;
    }
    let result = (|| -> Result<()> {
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
                w.add_tensor_chunk(
                    file,
                    TensorChunk {
                        fqn: &item.key,
                        dtype: t.dtype,
                        global_shape: &t.shape,
                        offsets: &zeros,
                        sizes: &t.shape,
                        data: &t.data,
                    },
                )
                .with_context(|| format!("writing `{}`", item.key))?;
                w.set_planner_path(&item.key, item.planner_path.clone());
            }
        }
        pause_before_commit();
        w.finish()
            .with_context(|| format!("finishing {}", partial.display()))?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    let dir = layout::commit(root, &partial, state.step)?;
    Ok(SaveReport {
        step: state.step,
        dir,
        bytes: state.nbytes(),
        write: start.elapsed(),
    })
}
