//! Checkpointing for titan-train, laid out as torchtitan's CheckpointManager saves it and built on
//! titan-ckpt's DCP writer/reader (see [`state`] for the state keys).
//!
//! - [`Checkpointer::load`] before the loop: `checkpoint.load_step`, else the latest complete
//!   `step-N` under `{job.dump_folder}/{checkpoint.folder}`, else `initial_load_path` (DCP or HF).
//! - [`Checkpointer::after_step`] every step: saves every `interval` steps and at the last step.
//!   A save is staged into host memory ([`host`], span `checkpoint_stage`), then written and
//!   committed ([`save`], span `checkpoint_save`): inline, or on a background thread when
//!   `async_mode = "async"`, which the next save and [`Checkpointer::finish`] wait for.
//! - Commits are atomic ([`layout`]): `.step-N.partial` renamed to `step-N` after `.metadata`.
//! - The last save may be model-only, cast to `export_dtype`, and in HF safetensors ([`hf_export`]).
//! - `checkpoint.folder` may be an object-store URL ([`remote`]): saves are committed locally,
//!   then uploaded with a commit marker.
//! - Several ranks ([`Checkpointer::with_rank_sync`]): each writes `__{rank}_0.distcp` with what
//!   it owns (rank 0 the replicated state, every rank its dataloader position and its parts of
//!   sharded parameters and their optimizer state, as DCP chunks) into one shared partial
//!   directory; rank 0 merges the
//!   ranks' metadata into `.metadata` and commits ([`save::SaveGroup`]).

pub mod hf_export;
pub mod host;
pub mod layout;
pub mod load;
pub mod remote;
pub mod save;
pub mod state;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tch::Kind;

use crate::config;
use crate::parallel::{Mesh, RankSync};
pub use save::{SaveGroup, SaveReport};
pub use state::{LoadOptions, StageOptions, TrainCounters, TrainerState};

/// How saves are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncMode {
    Disabled,
    /// Staged to host memory, written by a background thread.
    Async,
}

impl From<config::AsyncModeName> for AsyncMode {
    fn from(name: config::AsyncModeName) -> Self {
        match name {
            config::AsyncModeName::Disabled => AsyncMode::Disabled,
            // Pinned staging buffers only matter for CUDA copies; host staging is the same path.
            config::AsyncModeName::Async | config::AsyncModeName::AsyncWithPinnedMem => {
                AsyncMode::Async
            }
        }
    }
}

/// Totals of the saves so far (how much save time async hid from training).
#[derive(Debug, Clone, Copy, Default)]
pub struct SaveTotals {
    pub saves: u64,
    /// Time training was blocked by saves (staging, plus writing when sync, plus waiting).
    pub blocked: Duration,
    /// Time spent writing files.
    pub written: Duration,
}

/// Saves and loads the training state per `[checkpoint]`.
pub struct Checkpointer {
    cfg: config::Checkpoint,
    root: PathBuf,
    world: Mesh,
    mode: AsyncMode,
    export_kind: Kind,
    counters: TrainCounters,
    pending: Option<JoinHandle<Result<SaveReport>>>,
    purger: Option<JoinHandle<()>>,
    totals: SaveTotals,
    /// `model.hf_assets_path`: its `model.safetensors.index.json` lays out the HF export.
    hf_assets: Option<PathBuf>,
    remote: Option<remote::Remote>,
    /// How the ranks meet to commit a save (None for one process).
    group: Option<SaveGroup>,
    /// The run saving: kept with every save, so a resume continues the run.
    run_id: Option<String>,
}

impl Checkpointer {
    /// Checks the `[checkpoint]` keys; `dump_folder` is `job.dump_folder`.
    pub fn new(cfg: &config::Checkpoint, dump_folder: &Path, world: Mesh) -> Result<Self> {
        let mode = AsyncMode::from(cfg.async_mode);
        let export_kind = crate::precision::kind(cfg.export_dtype);
        if cfg.enable && cfg.interval == 0 {
            bail!("checkpoint.interval must be at least 1");
        }
        let remote = if cfg.enable && remote::is_url(&cfg.folder) {
            Some(remote::Remote::parse(&cfg.folder)?)
        } else {
            None
        };
        // Remote saves are staged and committed locally, then uploaded.
        let root = match remote {
            Some(_) => dump_folder.join(".checkpoint-upload"),
            None => dump_folder.join(&cfg.folder),
        };
        Ok(Self {
            cfg: cfg.clone(),
            root,
            remote,
            world,
            mode,
            export_kind,
            counters: TrainCounters::default(),
            pending: None,
            purger: None,
            totals: SaveTotals::default(),
            hf_assets: None,
            group: None,
            run_id: None,
        })
    }

    /// Keeps `run_id` with every save ([`layout::RUN_ID_FILE`]).
    pub fn with_run_id(mut self, run_id: &str) -> Self {
        self.run_id = Some(run_id.to_string());
        self
    }

    /// The step [`Checkpointer::load`] resumes from: `checkpoint.load_step`, else the newest
    /// complete one; `None` for a fresh start.
    fn resume_step(&self) -> Result<Option<u64>> {
        if !self.cfg.enable {
            return Ok(None);
        }
        let steps = match &self.remote {
            Some(r) => r.complete_steps()?,
            None => layout::complete_steps(&self.root)?,
        };
        let Some(want) = self.cfg.load_step else {
            return Ok(steps.last().copied());
        };
        if !steps.contains(&want) {
            bail!(
                "checkpoint.load_step {want}: no complete checkpoint {}/{} (found steps {steps:?})",
                self.shown_root(),
                layout::step_dir_name(want)
            );
        }
        Ok(Some(want))
    }

    fn shown_root(&self) -> String {
        match &self.remote {
            Some(r) => r.display(),
            None => self.root.display().to_string(),
        }
    }

    /// The run id saved with the checkpoint a resume loads: a resume continues that run.
    /// `None` for a fresh start, or a checkpoint saved without one.
    pub fn resume_run_id(&self) -> Result<Option<String>> {
        let Some(step) = self.resume_step()? else {
            return Ok(None);
        };
        match &self.remote {
            Some(r) => r.run_id(step),
            None => {
                let path = self
                    .root
                    .join(layout::step_dir_name(step))
                    .join(layout::RUN_ID_FILE);
                match std::fs::read(&path) {
                    Ok(bytes) => Ok(layout::parse_run_id(&bytes)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
                }
            }
        }
    }

    /// How the ranks of a multi-rank job meet to commit saves (needed when world_size > 1;
    /// the checkpoint folder must be shared by all ranks, as torchtitan's is).
    pub fn with_rank_sync(mut self, sync: Option<Arc<dyn RankSync>>) -> Self {
        self.group = sync.map(|sync| SaveGroup {
            sync,
            world_size: self.world.world_size,
        });
        self
    }

    fn sync(&self, name: &str) -> Result<()> {
        match &self.group {
            Some(g) => g.sync.barrier(name),
            None => Ok(()),
        }
    }

    /// Uses `model.hf_assets_path`'s `model.safetensors.index.json` (when present) as the
    /// `fqn_to_index_mapping` of the HF export.
    pub fn with_hf_assets(mut self, hf_assets_path: &str) -> Self {
        self.hf_assets = (!hf_assets_path.is_empty()).then(|| PathBuf::from(hf_assets_path));
        self
    }

    /// `{job.dump_folder}/{checkpoint.folder}`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn totals(&self) -> SaveTotals {
        self.totals
    }

    /// Restores the state before training; returns the last completed step (0 for a fresh start).
    pub fn load(&mut self, state: &mut TrainerState<'_>) -> Result<u64> {
        if !self.cfg.enable {
            return Ok(0);
        }
        let _s = titan_obs_core::span("checkpoint_load");
        let start = Instant::now();
        if self.world.world_size > 1 {
            if self.group.is_none() {
                bail!(
                    "checkpointing {} ranks needs a way for them to meet (titan-train's distributed runtime)",
                    self.world.world_size
                );
            }
            // Multi-rank saves share partial directories: stale ones go before any rank writes.
            if self.world.rank == 0 && self.remote.is_none() {
                layout::clear_partials(&self.root)?;
            }
            self.sync("checkpoint/start")?;
        }
        let shown_root = self.shown_root();
        let chosen = self.resume_step()?;
        let dp_rank = self.world.dp_rank() as u64;
        let opts = LoadOptions {
            model_only: false,
            exclude: self.cfg.exclude_from_loading.clone(),
            dp_rank,
            dp_world: self.world.dp_degree() as u64,
            rank: self.world.rank as u64,
        };
        if let Some(step) = chosen {
            let dir = format!("{shown_root}/{}", layout::step_dir_name(step));
            let counters = match &self.remote {
                Some(r) => state::apply(&r.source(step)?, state, &opts),
                None => state::apply(&load::DcpSource::open(Path::new(&dir))?, state, &opts),
            }
            .with_context(|| format!("loading {dir}"))?;
            self.counters = counters;
            tracing::info!(
                step = counters.step,
                ntokens_seen = counters.ntokens_seen,
                seconds = start.elapsed().as_secs_f64(),
                "resumed from checkpoint {dir}"
            );
            return Ok(counters.step);
        }
        let Some(path) = self.cfg.initial_load_path.clone() else {
            tracing::info!("no checkpoint in {shown_root}: training from scratch");
            return Ok(0);
        };
        let dir = PathBuf::from(&path);
        if self.cfg.initial_load_in_hf {
            load::load_hf_model(&dir, state.model)
                .with_context(|| format!("checkpoint.initial_load_path {path}"))?;
        } else {
            let src = load::DcpSource::open(&dir)?;
            let opts = LoadOptions {
                model_only: self.cfg.initial_load_model_only,
                ..opts
            };
            self.counters = state::apply(&src, state, &opts)
                .with_context(|| format!("checkpoint.initial_load_path {path}"))?;
        }
        tracing::info!(
            step = self.counters.step,
            seconds = start.elapsed().as_secs_f64(),
            "loaded the initial checkpoint {path}"
        );
        Ok(self.counters.step)
    }

    /// Whether [`Checkpointer::after_step`] saves at `step` (so callers build only then what
    /// only a save needs).
    pub fn saves_at(&self, step: u64, total_steps: u64) -> bool {
        self.cfg.enable
            && (step == total_steps
                || step.is_multiple_of(self.cfg.interval)
                || (step == 1 && self.cfg.enable_first_step_checkpoint))
    }

    /// Called after every optimizer step with the tokens that step consumed on all ranks.
    pub fn after_step(
        &mut self,
        step: u64,
        total_steps: u64,
        step_tokens: u64,
        state: &TrainerState<'_>,
    ) -> Result<()> {
        self.counters = TrainCounters {
            step,
            ntokens_seen: self.counters.ntokens_seen + step_tokens,
        };
        if !self.saves_at(step, total_steps) {
            return Ok(());
        }
        let last = step == total_steps;
        titan_obs_core::add_step_tag("checkpoint");
        if last && self.cfg.last_save_in_hf {
            self.wait_pending()?;
            let blocked = Instant::now();
            let sync = |name: &str| self.sync(&format!("checkpoint/step-{step}/{name}"));
            let dir = hf_export::export(
                &self.root,
                step,
                state.model,
                self.export_kind,
                self.world,
                self.hf_assets.as_deref(),
                &sync,
            )?;
            if self.world.rank == 0
                && let Some(r) = &self.remote
            {
                r.upload(&dir, step)?;
                std::fs::remove_dir_all(&dir)
                    .with_context(|| format!("removing {}", dir.display()))?;
            }
            sync("hf-committed")?;
            self.record(blocked.elapsed(), blocked.elapsed());
            tracing::info!(
                "saved the final model in HF safetensors to {}",
                dir.display()
            );
            return self.purge_in_background();
        }
        let model_only = last && self.cfg.last_save_model_only;
        self.save(state, model_only)
    }

    fn save(&mut self, state: &TrainerState<'_>, model_only: bool) -> Result<()> {
        // One save in flight at a time: the next save waits for the previous one (that wait
        // is counted in wait_pending).
        self.wait_pending()?;
        let blocked = Instant::now();
        if self.group.is_none() {
            layout::clear_partials(&self.root)?;
        }
        let mut staged = {
            let _s = titan_obs_core::span("checkpoint_stage");
            state::stage(
                state,
                self.counters,
                StageOptions {
                    model_only,
                    model_kind: model_only.then_some(self.export_kind),
                    owns_replicated: self.world.rank == 0,
                    first_of_stage: crate::parallel::Dim::ALL
                        .iter()
                        .all(|&d| d == crate::parallel::Dim::Pp || self.world.coord(d) == 0),
                    dp_rank: self.world.dp_rank() as u64,
                    rank: self.world.rank as u64,
                    dp_degree: self.world.dp_degree() as u64,
                    // One copy per data-parallel rank: not again from its cp, tp or pp peers.
                    writes_dataloader: [
                        crate::parallel::Dim::Cp,
                        crate::parallel::Dim::Tp,
                        crate::parallel::Dim::Pp,
                    ]
                    .iter()
                    .all(|&d| self.world.coord(d) == 0),
                },
            )?
        };
        staged.run_id.clone_from(&self.run_id);
        let root = self.root.clone();
        let rank = self.world.rank as u32;
        let remote = self.remote.clone();
        let group = self.group.clone();
        match self.mode {
            AsyncMode::Disabled => {
                let report = persist(&root, &staged, rank, self.remote.as_ref(), group.as_ref())?;
                self.record(blocked.elapsed(), report.write);
                log_saved(&report, blocked.elapsed(), false);
                self.purge_in_background()
            }
            AsyncMode::Async => {
                let stage_time = blocked.elapsed();
                self.pending = Some(
                    std::thread::Builder::new()
                        .name("titan-ckpt-writer".into())
                        .spawn(move || {
                            persist(&root, &staged, rank, remote.as_ref(), group.as_ref())
                        })
                        .context("starting the checkpoint writer thread")?,
                );
                self.totals.blocked += stage_time;
                tracing::info!(
                    step = self.counters.step,
                    blocked_s = stage_time.as_secs_f64(),
                    "checkpoint staged; writing in the background"
                );
                Ok(())
            }
        }
    }

    fn record(&mut self, blocked: Duration, written: Duration) {
        self.totals.saves += 1;
        self.totals.blocked += blocked;
        self.totals.written += written;
    }

    /// Waits for the background save, if any; its error is this call's error.
    fn wait_pending(&mut self) -> Result<()> {
        let Some(handle) = self.pending.take() else {
            return Ok(());
        };
        let waited = Instant::now();
        let report = handle
            .join()
            .map_err(|_| anyhow::anyhow!("the checkpoint writer thread panicked"))??;
        let waited = waited.elapsed();
        self.totals.saves += 1;
        self.totals.blocked += waited;
        self.totals.written += report.write;
        log_saved(&report, waited, true);
        self.purge_in_background()
    }

    fn purge_in_background(&mut self) -> Result<()> {
        if self.cfg.keep_latest_k == 0 || self.world.rank != 0 {
            return Ok(());
        }
        if let Some(p) = self.purger.take() {
            let _ = p.join();
        }
        let (root, keep) = (self.root.clone(), self.cfg.keep_latest_k);
        let remote = self.remote.clone();
        self.purger = Some(
            std::thread::Builder::new()
                .name("titan-ckpt-purge".into())
                .spawn(move || {
                    match match &remote {
                        Some(r) => r.purge(keep),
                        None => layout::purge(&root, keep),
                    } {
                        Ok(removed) if !removed.is_empty() => {
                            tracing::info!(
                                "purged checkpoints of steps {removed:?} (keep_latest_k = {keep})"
                            )
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!("purging old checkpoints: {e:#}"),
                    }
                })
                .context("starting the checkpoint purge thread")?,
        );
        Ok(())
    }

    /// Waits for the last background save and purge; call once after the loop.
    pub fn finish(&mut self) -> Result<SaveTotals> {
        self.wait_pending()?;
        if let Some(p) = self.purger.take() {
            let _ = p.join();
        }
        if self.totals.saves > 0 {
            let hidden = self.totals.written.saturating_sub(self.totals.blocked);
            tracing::info!(
                saves = self.totals.saves,
                blocked_s = self.totals.blocked.as_secs_f64(),
                written_s = self.totals.written.as_secs_f64(),
                hidden_s = hidden.as_secs_f64(),
                "checkpoint totals (hidden = write time training did not wait for)"
            );
        }
        Ok(self.totals)
    }
}

/// Writes and commits `staged` locally (with the other ranks of `group`), then uploads it when
/// the folder is remote (the committing rank only).
fn persist(
    root: &Path,
    staged: &state::StagedState,
    rank: u32,
    remote: Option<&remote::Remote>,
    group: Option<&SaveGroup>,
) -> Result<SaveReport> {
    let upload = |dir: &Path| -> Result<()> {
        if let Some(r) = remote {
            r.upload(dir, staged.step)?;
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("removing the uploaded local copy {}", dir.display()))?;
        }
        Ok(())
    };
    let mut report = save::write_and_commit(root, staged, rank, None, group, &upload)?;
    if let Some(r) = remote {
        report.dir = PathBuf::from(format!(
            "{}/{}",
            r.display(),
            layout::step_dir_name(staged.step)
        ));
    }
    Ok(report)
}

fn log_saved(report: &SaveReport, blocked: Duration, background: bool) {
    tracing::info!(
        step = report.step,
        mib = report.bytes as f64 / (1u64 << 20) as f64,
        write_s = report.write.as_secs_f64(),
        blocked_s = blocked.as_secs_f64(),
        background,
        "saved checkpoint {}",
        report.dir.display()
    );
}
