//! Synthetic runs for the snapshot tests, the frame benchmark and the image tests: written by
//! [`titan_obs_core::synth`] as real part files into a temporary directory and read back like any
//! run, so the TUI is exercised through the same reader and analysis as a real job.

use anyhow::{Context, Result};
use titan_obs_core::synth::{Straggler, SynthConfig, write_run};

use super::model::Timeline;
use super::source::timeline_from_run;

/// 4 ranks x 4 steps, 2 microbatches, rank 2 1.5x slow in forward_backward, validation at
/// step 3 and a checkpoint at step 4: small enough to read a snapshot of.
pub fn small() -> SynthConfig {
    SynthConfig {
        run_id: "small".into(),
        ranks: 4,
        steps: 4,
        spans_per_step: 15,
        stragglers: vec![Straggler {
            rank: 2,
            phase: titan_obs_core::vocab::titan::FORWARD_BACKWARD.into(),
            factor: 1.5,
        }],
        checkpoint_every: Some(4),
        validation_every: Some(3),
        seed: 7,
        ..Default::default()
    }
}

/// The benchmark's 10-million-span run: 256 ranks x 1002 steps x 39 spans, rank 77 1.3x slow.
pub fn ten_million() -> SynthConfig {
    SynthConfig {
        run_id: "ten_million".into(),
        ranks: 256,
        steps: 1002,
        spans_per_step: 39,
        steps_per_part: 501,
        stragglers: vec![Straggler {
            rank: 77,
            phase: titan_obs_core::vocab::titan::FORWARD_BACKWARD.into(),
            factor: 1.3,
        }],
        seed: 1,
        ..Default::default()
    }
}

/// Writes the run into a temporary directory and loads it as the TUI would.
pub fn timeline(cfg: &SynthConfig) -> Result<Timeline> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let run = dir.path().join(&cfg.run_id);
    let run = run.to_str().context("temporary path is not UTF-8")?;
    write_run(run, cfg)?;
    let loaded = titan_obs_core::load(run, &titan_obs_core::ReadOptions::default())?;
    Ok(timeline_from_run(&loaded, &cfg.run_id))
}
