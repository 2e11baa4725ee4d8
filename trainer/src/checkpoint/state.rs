//! The training state as torchtitan's CheckpointManager lays it out in DCP: a flat list of
//! state keys with their planner paths (where each sits in the nested state dict).
//!
//! - model: `<fqn>` at the top level (torchtitan flattens the model state dict into the root);
//! - optimizer: `optimizer.state.<fqn>.exp_avg` / `exp_avg_sq` / `step` (0-dim f32 tensor) and
//!   `optimizer.param_groups.<fqn>.<hparam>` (torch's `_flatten_optim_state_dict`), the q/k/v
//!   projections under torchtitan 0.3.0's fused `qkv_linear.wqkv.weight` (see [`names`]);
//! - lr_scheduler: `last_epoch` alone, as torchtitan 0.3.0's `LRSchedulersContainer` saves it;
//! - dataloader: `dataloader.dp_rank_<r>` (this rank's position, JSON bytes) and
//!   `dataloader.world_size`;
//! - train_state: `train_state.step` and `train_state.ntokens_seen`, pickled ints (torchtitan
//!   0.3.0's; 0-dim tensors from older writers are read too);
//! - rng_state: `rng_state.cpu.rank_<r>` (uint8, `torch.get_rng_state()`'s bytes) per rank.
//!
//! `<fqn>` is torchtitan 0.3.0's name (`layers.N.attention.qkv_linear.wq.weight`, `lm_head.weight`).
//! Loading also takes the older names (`layers.N.attention.wq.weight`, `output.weight`) that
//! earlier titan-train versions wrote, and torchtitan 0.3.0's fused `qkv_linear.wqkv` optimizer
//! state (split into the q/k/v rows), see [`crate::names`].

use anyhow::{Context, Result, bail};
use tch::{Device, Kind};
use titan_dcp::PathPart;
use titan_dcp::pickle::Value;

use super::host::HostTensor;
use crate::data::{LoaderState, PrefetchLoader};
use crate::lr_scheduler::LrSchedule;
use crate::names;
use crate::optim::{AdamW, ParamState};
use crate::parallelize::ParallelModel;
use crate::parallelize::Placement;
use titan_ckpt::adapter::{legacy_name, tables::LLAMA3};

pub const OPTIMIZER: &str = "optimizer";
pub const LR_SCHEDULER: &str = "lr_scheduler";
pub const DATALOADER: &str = "dataloader";
pub const TRAIN_STATE: &str = "train_state";
pub const RNG_STATE: &str = "rng_state";
/// The name `checkpoint.exclude_from_loading` uses for all model weights.
pub const MODEL: &str = "model";

/// What training hands to checkpointing: borrowed, never cloned.
pub struct TrainerState<'a> {
    pub model: &'a ParallelModel,
    pub optimizer: &'a mut AdamW,
    pub loader: &'a mut PrefetchLoader,
    pub schedule: &'a LrSchedule,
}

/// A staged value: a tensor in host memory or a picklable object.
#[derive(Debug, Clone)]
pub enum StagedValue {
    Tensor(HostTensor),
    Object(Value),
}

/// One state key, ready to be written by any thread.
#[derive(Debug, Clone)]
pub struct StagedItem {
    pub key: String,
    pub planner_path: Vec<PathPart>,
    pub value: StagedValue,
    /// For a tensor that is one rank's part of a larger one: (global shape, offsets).
    pub chunk_of: Option<(Vec<u64>, Vec<u64>)>,
}

/// Everything one rank writes for one checkpoint.
#[derive(Debug, Clone, Default)]
pub struct StagedState {
    pub step: u64,
    pub items: Vec<StagedItem>,
    /// The run saving it, written next to the data (see [`super::layout::RUN_ID_FILE`]).
    pub run_id: Option<String>,
}

impl StagedState {
    pub fn nbytes(&self) -> usize {
        self.items
            .iter()
            .map(|i| match &i.value {
                StagedValue::Tensor(t) => t.nbytes(),
                StagedValue::Object(_) => 0,
            })
            .sum()
    }

    fn push(&mut self, top: Option<&str>, key: String, value: StagedValue) {
        let (full, path) = match top {
            Some(top) => (
                format!("{top}.{key}"),
                vec![PathPart::Key(top.to_string()), PathPart::Key(key)],
            ),
            None => (key.clone(), vec![PathPart::Key(key)]),
        };
        self.items.push(StagedItem {
            key: full,
            planner_path: path,
            value,
            chunk_of: None,
        });
    }
}

/// The step's counters carried in `train_state`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainCounters {
    pub step: u64,
    pub ntokens_seen: u64,
}

/// What to stage.
#[derive(Debug, Clone, Copy)]
pub struct StageOptions {
    /// Only the model weights (seed checkpoints and `last_save_model_only`).
    pub model_only: bool,
    /// Cast the model weights (model-only saves: `export_dtype`).
    pub model_kind: Option<Kind>,
    /// This rank writes the replicated state (lr_scheduler, train_state, the loader's world).
    pub owns_replicated: bool,
    /// This rank is the first of the ranks holding its pipeline stage: it writes what they
    /// all hold alike, the model's buffers (`expert_bias_E`) and the optimizer's `step`s and
    /// param_groups of its parameters.
    pub first_of_stage: bool,
    /// Global rank (names this rank's RNG state).
    pub rank: u64,
    pub dp_rank: u64,
    pub dp_degree: u64,
    /// This rank writes its dp rank's dataloader position (the first of the ranks that read
    /// the same data: tensor-parallel ranks share it).
    pub writes_dataloader: bool,
}

/// The parameter a tied model's output layer shares, and the name torch also gives it.
const TIED_EMBEDDING: &str = "tok_embeddings.weight";
const TIED_OUTPUT: &str = "lm_head.weight";

/// Copies the state into host memory (the `stage` phase; the only part that must block training).
pub fn stage(
    state: &TrainerState<'_>,
    counters: TrainCounters,
    opts: StageOptions,
) -> Result<StagedState> {
    let mut out = StagedState {
        step: counters.step,
        items: Vec::new(),
        run_id: None,
    };
    // Every rank writes its own parts of the parameters (whole tensors on one process).
    let model = state.model;
    for ((fqn, p), placement) in model.named_parameters().iter().zip(model.placements()) {
        if !placement.writes || p.numel() == 0 {
            continue;
        }
        let t = HostTensor::from_tensor(p, opts.model_kind)
            .with_context(|| format!("staging model parameter `{fqn}`"))?;
        // A tied embedding is also `lm_head.weight` in torch's state dict (both names, one
        // tensor): torchtitan loads both keys, so both are written.
        let tied_output = (model.args.tie_embeddings && fqn == TIED_EMBEDDING)
            .then(|| StagedValue::Tensor(t.clone()));
        out.push(None, fqn.clone(), StagedValue::Tensor(t));
        out.items.last_mut().expect("pushed").chunk_of = chunk_of(placement);
        if let Some(value) = tied_output {
            out.push(None, TIED_OUTPUT.into(), value);
            out.items.last_mut().expect("pushed").chunk_of = chunk_of(placement);
        }
    }
    if opts.first_of_stage {
        for (fqn, b) in model.named_buffers() {
            let t = HostTensor::from_tensor(&b, opts.model_kind)
                .with_context(|| format!("staging model buffer `{fqn}`"))?;
            out.push(None, fqn, StagedValue::Tensor(t));
        }
    }
    if opts.model_only {
        return Ok(out);
    }
    stage_optimizer_state(&mut out, state)?;
    if opts.first_of_stage {
        stage_optimizer(&mut out, state, counters)?;
    }
    if opts.owns_replicated {
        stage_lr_scheduler(&mut out, counters.step);
        // Plain ints, as torchtitan 0.3.0's TrainState saves them (its loader refuses tensors).
        out.push(
            Some(TRAIN_STATE),
            "step".into(),
            StagedValue::Object(Value::Int(counters.step as i64)),
        );
        out.push(
            Some(TRAIN_STATE),
            "ntokens_seen".into(),
            StagedValue::Object(Value::Int(counters.ntokens_seen as i64)),
        );
        out.push(
            Some(DATALOADER),
            "world_size".into(),
            StagedValue::Object(Value::Int(opts.dp_degree as i64)),
        );
    }
    let rng = crate::rng::cpu_state()?;
    out.push(
        Some(RNG_STATE),
        format!("cpu.rank_{}", opts.rank),
        StagedValue::Tensor(HostTensor {
            dtype: titan_dcp::Dtype::U8,
            shape: vec![rng.len() as u64],
            data: rng,
        }),
    );
    // torchtitan's own format (a pickled StatefulDataLoader state), so either trainer resumes
    // the other's data position.
    if opts.writes_dataloader {
        let loader = state.loader.state().to_torchtitan_pickle();
        out.push(
            Some(DATALOADER),
            format!("dp_rank_{}", opts.dp_rank),
            StagedValue::Object(Value::Bytes(loader)),
        );
    }
    Ok(out)
}

fn stage_optimizer(
    out: &mut StagedState,
    state: &TrainerState<'_>,
    counters: TrainCounters,
) -> Result<()> {
    let hp = state.optimizer.hparams;
    // torch's param_groups hold the lr the scheduler set after this step: the next step's.
    let lr = state.schedule.lr_for_step(counters.step + 1);
    for (fqn, _) in state.model.named_parameters() {
        // The q/k/v projections are one parameter (`wqkv`) to torchtitan's optimizer: their
        // step and param_group go under its name once, with wq.
        let name = match names::fused_qkv(fqn) {
            Some((0, fused)) => fused,
            Some(_) => continue,
            None => fqn.clone(),
        };
        if let Some(s) = state.optimizer.state.get(fqn) {
            // torch.optim.AdamW keeps `step` as a 0-dim float32 tensor.
            let step = HostTensor::scalar_f32(s.step as f32);
            out.push(
                Some(OPTIMIZER),
                format!("state.{name}.step"),
                StagedValue::Tensor(step),
            );
        }
        // torch.optim.AdamW's param_group entries, as torch 2.13 names them.
        let group: [(&str, Value); 12] = [
            ("lr", Value::Float(lr)),
            (
                "betas",
                Value::Tuple(vec![Value::Float(hp.beta1), Value::Float(hp.beta2)]),
            ),
            ("eps", Value::Float(hp.eps)),
            ("weight_decay", Value::Float(hp.weight_decay)),
            ("amsgrad", Value::Bool(false)),
            ("foreach", Value::None),
            ("maximize", Value::Bool(false)),
            ("capturable", Value::Bool(false)),
            ("differentiable", Value::Bool(false)),
            ("fused", Value::None),
            ("decoupled_weight_decay", Value::Bool(true)),
            ("initial_lr", Value::Float(state.schedule.base_lr)),
        ];
        for (key, value) in group {
            out.push(
                Some(OPTIMIZER),
                format!("param_groups.{name}.{key}"),
                StagedValue::Object(value),
            );
        }
    }
    Ok(())
}

/// A part's place in its global tensor for DCP (`None`: the part is the whole tensor).
fn chunk_of(p: &Placement) -> Option<(Vec<u64>, Vec<u64>)> {
    let u = |v: &[i64]| v.iter().map(|&d| d as u64).collect::<Vec<u64>>();
    (!p.is_whole()).then(|| (u(&p.global), u(&p.offsets)))
}

/// This rank's parts of `exp_avg` / `exp_avg_sq` (shaped like its parameter parts): what torch's
/// DCP saves for the optimizer state of sharded (DTensor) parameters. The q/k/v projections'
/// state goes where torchtitan 0.3.0 keeps it, in its fused `qkv_linear.wqkv.weight` (rows
/// grouped per kv head): each part becomes the runs of fused rows it covers, so torchtitan
/// resumes titan-train's optimizer state.
fn stage_optimizer_state(out: &mut StagedState, state: &TrainerState<'_>) -> Result<()> {
    let model = state.model;
    let args = &model.args;
    for ((fqn, p), placement) in model.named_parameters().iter().zip(model.placements()) {
        let Some(s) = state.optimizer.state.get(fqn) else {
            continue;
        };
        if !placement.writes || p.numel() == 0 {
            continue;
        }
        for (name, t) in [("exp_avg", &s.exp_avg), ("exp_avg_sq", &s.exp_avg_sq)] {
            let Some((part, fused)) = names::fused_qkv(fqn) else {
                let host = HostTensor::from_tensor(t, None)
                    .with_context(|| format!("staging {name} of `{fqn}`"))?;
                out.push(
                    Some(OPTIMIZER),
                    format!("state.{fqn}.{name}"),
                    StagedValue::Tensor(host),
                );
                out.items.last_mut().expect("pushed").chunk_of = chunk_of(placement);
                continue;
            };
            let (hd, kv) = (args.head_dim(), args.kv_heads());
            let fused_rows = kv * (args.n_heads / kv + 2) * hd;
            let u = |v: i64| v as u64;
            let global = vec![u(fused_rows), u(placement.global[1])];
            let runs = names::fused_qkv_runs(
                part,
                placement.offsets[0],
                placement.local[0],
                args.n_heads,
                kv,
                hd,
            );
            for (row, fused_row, len) in runs {
                let rows = t.narrow(0, row - placement.offsets[0], len);
                let host = HostTensor::from_tensor(&rows, None)
                    .with_context(|| format!("staging {name} of `{fqn}`"))?;
                out.push(
                    Some(OPTIMIZER),
                    format!("state.{fused}.{name}"),
                    StagedValue::Tensor(host),
                );
                out.items.last_mut().expect("pushed").chunk_of =
                    Some((global.clone(), vec![u(fused_row), u(placement.offsets[1])]));
            }
        }
    }
    Ok(())
}

/// LambdaLR's `state_dict()` after `step` scheduler steps (the schedule itself is a pure
/// function of the step, so this is all it needs to resume).
fn stage_lr_scheduler(out: &mut StagedState, step: u64) {
    // torchtitan 0.3.0's LRSchedulersContainer saves `last_epoch` alone: its schedules are pure
    // functions of the step, and every other LambdaLR field is rebuilt from the config on load.
    out.push(
        Some(LR_SCHEDULER),
        "last_epoch".into(),
        StagedValue::Object(Value::Int(step as i64)),
    );
}

/// Reads state keys back, whatever stores them (a DCP reader in practice).
pub trait StateSource {
    fn has(&self, key: &str) -> bool;
    fn tensor(&self, key: &str) -> Result<HostTensor>;
    fn object(&self, key: &str) -> Result<Value>;
}

/// Which parts to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub model_only: bool,
    /// `checkpoint.exclude_from_loading`: `model`, `optimizer`, `lr_scheduler`, `dataloader`,
    /// `train_state`, or any state key prefix.
    pub exclude: Vec<String>,
    pub dp_rank: u64,
    /// Data-parallel ranks of this run (a dataloader state saved by another count is refused).
    pub dp_world: u64,
    pub rank: u64,
}

impl LoadOptions {
    fn excluded(&self, key: &str, top: &str) -> bool {
        self.exclude
            .iter()
            .any(|e| e == top || key == e || key.starts_with(&format!("{e}.")))
    }
}

/// Loads what `opts` allows into the trainer; returns the restored counters (zero when the
/// source is model-only or train_state is excluded).
pub fn apply(
    src: &dyn StateSource,
    state: &mut TrainerState<'_>,
    opts: &LoadOptions,
) -> Result<TrainCounters> {
    let device = state.model.device();
    for (fqn, p) in state.model.named_parameters() {
        if opts.excluded(fqn, MODEL) {
            continue;
        }
        let Some(key) = stored_name(src, fqn, |name| name.to_string()) else {
            bail!(
                "the checkpoint has no model weight `{fqn}`{} (is it a checkpoint of this model flavor?)",
                legacy_name(&LLAMA3, fqn).map_or(String::new(), |old| format!(" (nor `{old}`)"))
            );
        };
        let t = src
            .tensor(&key)?
            .to_tensor(device)
            .with_context(|| format!("model weight `{key}`"))?;
        let t = if t.kind() != p.kind() {
            t.to_kind(p.kind())
        } else {
            t
        };
        state.model.set_parameter(fqn, &t)?;
    }
    for (fqn, mut b) in state.model.named_buffers() {
        if opts.excluded(&fqn, MODEL) {
            continue;
        }
        if !src.has(&fqn) {
            bail!(
                "the checkpoint has no model buffer `{fqn}` (the experts' routing bias torchtitan \
                 saves with a mixture-of-experts model: is it a checkpoint of this model flavor?)"
            );
        }
        let t = src
            .tensor(&fqn)?
            .to_tensor(device)
            .with_context(|| format!("model buffer `{fqn}`"))?;
        if t.size() != b.size() {
            bail!(
                "model buffer `{fqn}` has shape {:?} but the checkpoint's has {:?}",
                b.size(),
                t.size()
            );
        }
        tch::no_grad(|| b.copy_(&t.to_kind(b.kind())));
    }
    let mut counters = TrainCounters::default();
    if opts.model_only {
        return Ok(counters);
    }
    let full = src.has(&format!("{TRAIN_STATE}.step"));
    if !full {
        bail!(
            "the checkpoint holds only model weights (saved with last_save_model_only or as a seed); \
             load it with checkpoint.initial_load_path + initial_load_model_only, or pick a full \
             checkpoint with checkpoint.load_step"
        );
    }
    if !opts.excluded("optimizer.", OPTIMIZER) {
        load_optimizer(src, state, device)?;
    }
    if !opts.excluded("train_state.", TRAIN_STATE) {
        counters.step = saved_count(src, &format!("{TRAIN_STATE}.step"))?;
        let tokens = format!("{TRAIN_STATE}.ntokens_seen");
        if src.has(&tokens) {
            counters.ntokens_seen = saved_count(src, &tokens)?;
        }
    }
    if !opts.excluded("dataloader.", DATALOADER) {
        let key = format!("{DATALOADER}.dp_rank_{}", opts.dp_rank);
        if !src.has(&key) {
            bail!(
                "the checkpoint has no dataloader state `{key}` for this dp rank (saved with fewer dp ranks?)"
            );
        }
        let Value::Bytes(bytes) = src.object(&key)? else {
            bail!("dataloader state `{key}` is not a bytes value");
        };
        let world_key = format!("{DATALOADER}.world_size");
        let saved_world = if src.has(&world_key) {
            match src.object(&world_key)? {
                Value::Int(w) => w as u64,
                other => bail!("`{world_key}` is {other:?}, not a count"),
            }
        } else {
            opts.dp_world
        };
        if saved_world != opts.dp_world {
            bail!(
                "the dataloader state was saved by {saved_world} data-parallel ranks and this run has {}: \
                 resharding it is not supported (torchtitan refuses it too); add \
                 `--checkpoint.exclude_from_loading dataloader` to start the data from its beginning",
                opts.dp_world
            );
        }
        if bytes.first() != Some(&0x80) {
            bail!(
                "dataloader state `{key}` is not a pickled torchtitan loader state (a titan-train \
                 checkpoint from before per-document packing?): add \
                 `--checkpoint.exclude_from_loading dataloader` to start the data from its beginning"
            );
        }
        let loader =
            LoaderState::from_torchtitan_pickle(&bytes, opts.dp_rank, opts.dp_world, &key)?;
        state.loader.load_state(loader)?;
    }
    // Checkpoints from torch/torchtitan have no RNG state: then the seed's stream goes on.
    let rng_key = format!("{RNG_STATE}.cpu.rank_{}", opts.rank);
    if !opts.excluded(&rng_key, RNG_STATE) && src.has(&rng_key) {
        let t = src.tensor(&rng_key)?;
        crate::rng::set_cpu_state(&t.data).with_context(|| format!("restoring `{rng_key}`"))?;
    }
    // lr_scheduler: the schedule is a pure function of train_state.step; its saved state is for
    // torch readers. Checked for consistency when present.
    let last_epoch = format!("{LR_SCHEDULER}.last_epoch");
    if !opts.excluded(&last_epoch, LR_SCHEDULER)
        && src.has(&last_epoch)
        && counters.step > 0
        && let Value::Int(e) = src.object(&last_epoch)?
        && e as u64 != counters.step
    {
        bail!(
            "lr_scheduler.last_epoch {e} disagrees with train_state.step {}",
            counters.step
        );
    }
    Ok(counters)
}

/// A counter of `train_state`: a 0-dim tensor (older torchtitan, titan-train) or a plain int
/// object (torchtitan 0.3.0).
fn saved_count(src: &dyn StateSource, key: &str) -> Result<u64> {
    let value = match src.tensor(key) {
        Ok(t) => t.scalar_value()?,
        Err(tensor_err) => match src.object(key) {
            Ok(Value::Int(v)) => v as f64,
            Ok(other) => bail!("`{key}` is {other:?}, not a count"),
            Err(_) => return Err(tensor_err),
        },
    };
    if !(value >= 0.0 && value.fract() == 0.0) {
        bail!("`{key}` is {value}, not a count");
    }
    Ok(value as u64)
}

/// The name `fqn` has in `src` as `key(name)`: torchtitan 0.3.0's or the older one.
fn stored_name(src: &dyn StateSource, fqn: &str, key: impl Fn(&str) -> String) -> Option<String> {
    std::iter::once(fqn.to_string())
        .chain(legacy_name(&LLAMA3, fqn))
        .find(|name| src.has(&key(name)))
}

fn load_optimizer(
    src: &dyn StateSource,
    state: &mut TrainerState<'_>,
    device: Device,
) -> Result<()> {
    state.optimizer.state.clear();
    state.optimizer.resumed_lr = None;
    let args = &state.model.args;
    let state_key = |name: &str, field: &str| format!("{OPTIMIZER}.state.{name}.{field}");
    for (fqn, p) in state.model.named_parameters() {
        // This parameter's own state (titan-train's names of either generation), or its rows of
        // torchtitan 0.3.0's fused `wqkv` state.
        let (name, part) = match stored_name(src, fqn, |n| state_key(n, "exp_avg")) {
            Some(name) => (name, None),
            None => match names::fused_qkv(fqn) {
                Some((part, fused)) if src.has(&state_key(&fused, "exp_avg")) => {
                    (fused, Some(part))
                }
                // A parameter that never had a gradient has no optimizer state (as in torch).
                _ => continue,
            },
        };
        let read = |field: &str| -> Result<tch::Tensor> {
            let key = state_key(&name, field);
            let t = src.tensor(&key)?.to_tensor(device)?;
            let t = match part {
                Some(part) => names::split_fused_qkv(&t, part, args.n_heads, args.kv_heads()),
                None => t,
            };
            let placement = state
                .model
                .placement(fqn)
                .context("a parameter without placement")?;
            if t.size() != placement.global {
                bail!(
                    "`{key}` gives shape {:?} for `{fqn}`, the parameter has {:?}",
                    t.size(),
                    placement.global
                );
            }
            Ok(placement.take_local(&t).to_kind(p.kind()))
        };
        let exp_avg = read("exp_avg")?;
        let exp_avg_sq = read("exp_avg_sq")?;
        let step = src.tensor(&state_key(&name, "step"))?.scalar_value()? as u64;
        state.optimizer.state.insert(
            fqn.clone(),
            ParamState {
                step,
                exp_avg,
                exp_avg_sq,
            },
        );
    }
    // The lr torch's optimizer takes its next step with (the same in every param group here).
    let lr = state
        .model
        .named_parameters()
        .iter()
        .flat_map(|(fqn, _)| {
            std::iter::once(fqn.to_string())
                .chain(legacy_name(&LLAMA3, fqn))
                .chain(names::fused_qkv(fqn).map(|(_, fused)| fused))
        })
        .map(|name| format!("{OPTIMIZER}.param_groups.{name}.lr"))
        .find(|key| src.has(key));
    if let Some(key) = lr {
        match src.object(&key)? {
            Value::Float(lr) => state.optimizer.resumed_lr = Some(lr),
            Value::Int(lr) => state.optimizer.resumed_lr = Some(lr as f64),
            other => bail!("`{key}` is {other:?}, not a learning rate"),
        }
    }
    Ok(())
}
