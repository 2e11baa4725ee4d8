//! How the model is split over the device mesh, as torchtitan's `parallelize_llama` applies it:
//! tensor parallelism with the llama3 plan ([`tp`]), then FSDP2 over `dp_shard x cp` (and HSDP
//! over `dp_replicate`) per transformer block ([`fsdp`]), activation checkpointing, float8
//! linears, the pipeline's stages ([`pipeline`]) and context parallelism's sequence split
//! ([`context_parallel`]), over [`crate::model`]'s decoder, which knows none of them. [`ParallelModel`] is the model as a rank holds it: [`ParallelPlan`] says where each
//! parameter lives ([`Placement`]), and its forward pass runs the model's blocks with the
//! modules' ops; the training loop does not see the split.
//!
//! Placements, for a parameter of global shape `G`:
//! - TP (`tp_dim`): column-wise linears (`wq`, `wk`, `wv`, `w1`, `w3`, `lm_head`) and the
//!   vocab-sharded `tok_embeddings` split dim 0 into `tp` equal blocks; row-wise linears (`wo`,
//!   `w2`) split dim 1; norms are replicated.
//! - FSDP: the TP-local tensor's dim 0 is cut into `N = dp_shard x cp` chunks of `ceil(rows / N)`
//!   rows (the last ones shorter or empty: `torch.chunk`, as FSDP2), so each rank's part is one
//!   block of the global tensor at `offsets`.

pub mod context_parallel;
pub mod expert_parallel;
pub mod fsdp;
mod kept;
pub mod layout;
mod parallel_model;
pub mod pipeline;
pub mod plan;
pub mod tp;
pub mod weight_grad;

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};

use crate::config::{ConfigError, DtypeName, JobConfig, Parallelism, ReshardAfterForward};
use crate::distributed::DeviceMesh;
use crate::float8::{self, Float8Training};
use crate::model::ModelArgs;
use crate::parallel::Dim;
use crate::precision;
pub use parallel_model::{ParallelModel, TokenLayout};
use pipeline::{Pipeline, PipelineConfig, StageModules};
pub use plan::TpStyle;

/// torchtitan's `pipeline_llm` and `parallelize_llama` in one call: this rank's part of the
/// model `args` — its pipeline stages, split over `mesh` by the plan, with activation
/// checkpointing, the attention backend, `training.dtype` and float8 applied — and, under
/// pipeline parallelism (`pipeline`, from [`layout::check_layout`]), the schedule that drives
/// the stages. The stages are cut once, here, for both.
pub fn parallelize(
    args: ModelArgs,
    cfg: &JobConfig,
    mesh: &DeviceMesh,
    device: Device,
    pipeline: Option<&PipelineConfig>,
) -> Result<(ParallelModel, Option<Pipeline>)> {
    let plan = ParallelPlan::new(
        mesh,
        &cfg.parallelism,
        precision::param_kind(&cfg.training),
        precision::kind(cfg.training.mixed_precision_reduce),
    );
    let n_layers = args.n_layers as usize;
    let (stages, schedule) = match pipeline {
        None => (vec![(0, StageModules::whole(n_layers))], None),
        Some(p) => {
            let all = pipeline::split_stages(p, n_layers)
                .map_err(|e| config_error("parallelism.pipeline_parallel_degree", e))?;
            let pp_rank = mesh.mesh.coord(Dim::Pp);
            let local = all
                .iter()
                .cloned()
                .enumerate()
                .filter(|(s, _)| pipeline::rank_of_stage(*s, mesh.mesh.pp) == pp_rank)
                .collect();
            let microbatches = (cfg.training.local_batch_size / p.microbatch_size) as usize;
            let schedule = Pipeline::new(mesh, p, all, microbatches)
                .map_err(|e| config_error("parallelism.pipeline_parallel_schedule", e))?;
            tracing::info!(
                schedule = schedule.schedule.name(),
                stages = schedule.stages.len(),
                stages_on_this_rank = ?schedule.local_stages,
                microbatches,
                "pipeline parallelism"
            );
            (local, Some(schedule))
        }
    };
    let model = ParallelModel::new_stages(args, device, &plan, stages)
        .map_err(|e| config_error("parallelism.tensor_parallel_degree", e))?
        .with_checkpointing(cfg.activation_checkpoint.policy())
        .with_attn_backend(cfg.model.attn_backend, precision::param_kind(&cfg.training));
    if cfg.training.dtype != DtypeName::Float32 {
        model.cast_parameters(precision::kind(cfg.training.dtype));
    }
    let model = apply_float8(cfg, mesh, device, model)?;
    Ok((model, schedule))
}

/// A config problem found while building: reported like config-file errors (exit 2).
fn config_error(key: &str, e: anyhow::Error) -> anyhow::Error {
    ConfigError::invalid(key, format!("{e:#}")).into()
}

/// Converts the linears `[float8]` selects (none when float8 is off), after checking that the
/// device can multiply in float8.
fn apply_float8(
    cfg: &JobConfig,
    mesh: &DeviceMesh,
    device: Device,
    model: ParallelModel,
) -> Result<ParallelModel> {
    let float8 = Float8Training::from_config(cfg);
    if let Some(f8) = &float8
        && let Err(e) = float8::probe(f8.backend, device)
    {
        bail!(config_error(
            "float8.emulate",
            anyhow::anyhow!(
                "float8 matmuls need torch._scaled_mm, which does not run on {device:?} \
                 ({e}); set float8.emulate true to multiply the float8 values in float32"
            )
        ));
    }
    let (model, converted) = model.with_float8(float8.as_ref());
    let Some(f8) = &float8 else {
        return Ok(model);
    };
    tracing::info!(
        "float8 training ({}, {}) of {} linears (the others in high precision): {}",
        f8.recipe.name(),
        match f8.backend {
            float8::Backend::ScaledMm => "torch._scaled_mm",
            float8::Backend::Emulated => "emulated",
        },
        converted.len(),
        converted.join(", ")
    );
    if f8.fsdp_all_gather {
        if mesh.fsdp.size() > 1 {
            tracing::info!(
                "FSDP gathers the float8 linears' weights in float8{}",
                if f8.precompute_scales {
                    ", with scales precomputed after each optimizer step"
                } else {
                    ""
                }
            );
        } else {
            tracing::warn!(
                "float8.enable_fsdp_float8_all_gather does nothing here: FSDP shards \
                 nothing (parallelism.data_parallel_shard_degree x context_parallel_degree \
                 is 1)"
            );
        }
    }
    Ok(model)
}

/// Which ranks hold the other parts of a gradient, so which sum its squared norm: torch's
/// `clip_grad_norm_` over DTensors, and torchtitan's `_clip_grad_norm_with_ep`, which takes the
/// experts' norm over their own mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormGroup {
    /// FSDP's shards (`dp_shard x cp`); whole over `tp`.
    Fsdp,
    /// FSDP's shards and tensor parallelism's parts.
    FsdpTp,
    /// A routed experts' tensor under expert parallelism: `efsdp x ep`.
    Experts,
}

/// Where one parameter's local part sits in the global tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub global: Vec<i64>,
    pub offsets: Vec<i64>,
    pub local: Vec<i64>,
    /// The dimension tensor parallelism splits (None: replicated over `tp`).
    pub tp_dim: Option<usize>,
    /// Replicated over `tp` with a partial gradient on every rank ([`TpStyle::grad_partial_over_tp`]).
    pub tp_partial_grad: bool,
    /// Rows of the TP-local tensor FSDP splits, and rows per FSDP shard (padded).
    pub tp_local_rows: i64,
    pub rows_per_shard: i64,
    /// This rank writes the part to checkpoints (the first replica, and for a parameter
    /// replicated over `tp` the first tp rank).
    pub writes: bool,
    /// A routed experts' tensor split over `ep` (dim 0, the experts) and sharded by FSDP over
    /// `efsdp`: its gradient is whole after the all-to-all's backward, and its norm is summed
    /// over the expert-parallel ranks.
    pub expert_parallel: bool,
}

impl Placement {
    /// Whether every tp rank holds the same values (not split over tp, and not one of expert
    /// parallelism's blocks, which the tp ranks of an `ep` group hold different ones of).
    pub fn tp_replicated(&self) -> bool {
        self.tp_dim.is_none() && !self.expert_parallel
    }

    /// Whether the local part is the whole tensor.
    pub fn is_whole(&self) -> bool {
        self.local == self.global
    }

    /// This rank's part of the global tensor `full`: `full` itself (contiguous) when the part
    /// is the whole, else a copy in memory of its own.
    pub fn take_local(&self, full: &Tensor) -> Tensor {
        if self.is_whole() {
            return full.contiguous();
        }
        let mut t = full.shallow_clone();
        for (d, (&off, &len)) in self.offsets.iter().zip(&self.local).enumerate() {
            if off != 0 || len != self.global[d] {
                t = t.narrow(d as i64, off, len);
            }
        }
        // A copy, never a view: rows of a contiguous tensor are a contiguous view of it, which
        // would keep the whole tensor's storage alive behind the part (every FSDP or row-wise
        // TP rank would hold every parameter, and after a resume every AdamW moment, whole).
        let mut local = Tensor::empty(t.size().as_slice(), (t.kind(), t.device()));
        local.copy_(&t);
        local
    }
}

/// The split of the whole model for this rank.
#[derive(Clone)]
pub struct ParallelPlan {
    pub tp: tp::TensorParallel,
    pub cp: context_parallel::ContextParallel,
    pub fsdp: fsdp::FsdpMesh,
    /// Expert parallelism: the routed experts' ranks, and FSDP over `efsdp` for their tensors.
    pub ep: expert_parallel::ExpertParallel,
    pub expert_fsdp: fsdp::FsdpMesh,
    pub reshard_after_forward: ReshardAfterForward,
    /// Pipeline parallelism is on (FSDP's default then keeps gathered parameters between a
    /// stage's microbatches, as torchtitan).
    pub pipelined: bool,
    tp_rank: usize,
    shard_rank: usize,
    replicate_rank: usize,
    efsdp_rank: usize,
}

impl ParallelPlan {
    /// The plan for `mesh`'s groups. `param_kind` is FSDP2's `mixed_precision_param` (the dtype
    /// the unsharded parameters compute in) and `reduce_kind` its `mixed_precision_reduce`.
    pub fn new(mesh: &DeviceMesh, cfg: &Parallelism, param_kind: Kind, reduce_kind: Kind) -> Self {
        // One queue for both FSDP meshes: the reductions of a model run in issue order.
        let reductions = fsdp::Reductions::default();
        ParallelPlan {
            tp: tp::TensorParallel::new(mesh.tp.clone(), cfg.enable_sequence_parallel),
            cp: context_parallel::ContextParallel::new(
                mesh.cp.clone(),
                cfg.context_parallel_load_balancer,
            ),
            fsdp: fsdp::FsdpMesh {
                shard: mesh.fsdp.clone(),
                replicate: mesh.dp_replicate.clone(),
                param_kind,
                reduce_kind,
                reductions: reductions.clone(),
            },
            ep: expert_parallel::ExpertParallel::new(mesh.ep.clone(), mesh.mesh.ep_members()),
            expert_fsdp: fsdp::FsdpMesh {
                shard: mesh.efsdp.clone(),
                replicate: mesh.dp_replicate.clone(),
                param_kind,
                reduce_kind,
                reductions,
            },
            reshard_after_forward: cfg.fsdp_reshard_after_forward,
            pipelined: cfg.pipeline_parallel_degree > 1,
            tp_rank: mesh.mesh.coord(Dim::Tp),
            shard_rank: mesh.fsdp.rank(),
            replicate_rank: mesh.mesh.coord(Dim::DpReplicate),
            efsdp_rank: mesh.efsdp.rank(),
        }
    }

    /// One process: nothing split, no cast.
    pub fn single() -> Self {
        Self::new(
            &DeviceMesh::single(),
            &Parallelism::default(),
            Kind::Float,
            Kind::Float,
        )
    }

    /// Where this rank's part of parameter `fqn` of `global` shape sits, by the TP plan
    /// ([`plan::tp_style`]) and FSDP's dim-0 chunks.
    pub fn placement_of(&self, fqn: &str, global: &[i64]) -> Result<Placement> {
        let style = plan::tp_style(fqn)?;
        if self.ep.size() > 1 && matches!(style, TpStyle::ExpertRows | TpStyle::ExpertCols) {
            return self.expert_placement(global);
        }
        self.placement(global, style)
    }

    /// A routed experts' tensor (E, ..) under expert parallelism: this rank's `ep` block of
    /// experts, cut by FSDP over `efsdp` into dim-0 chunks (torchtitan's `Shard(0)` on the
    /// sparse mesh; tensor parallelism does not split experts with EP on).
    fn expert_placement(&self, global: &[i64]) -> Result<Placement> {
        let (ep, shards) = (self.ep.size() as i64, self.expert_fsdp.shard.size() as i64);
        let experts = global[0];
        if experts % ep != 0 {
            bail!(
                "{experts} experts cannot be split over parallelism.expert_parallel_degree = {ep}"
            );
        }
        let ep_rows = experts / ep;
        let rows_per_shard = (ep_rows + shards - 1) / shards;
        let lo = (self.efsdp_rank as i64 * rows_per_shard).min(ep_rows);
        let hi = (lo + rows_per_shard).min(ep_rows);
        let mut offsets = vec![0i64; global.len()];
        offsets[0] = self.ep.rank() as i64 * ep_rows + lo;
        let mut local = global.to_vec();
        local[0] = hi - lo;
        Ok(Placement {
            global: global.to_vec(),
            offsets,
            local,
            tp_dim: None,
            tp_partial_grad: false,
            tp_local_rows: ep_rows,
            rows_per_shard,
            writes: self.replicate_rank == 0,
            expert_parallel: true,
        })
    }

    /// Where this rank's part of a parameter of `global` shape placed by `style` sits.
    pub fn placement(&self, global: &[i64], style: TpStyle) -> Result<Placement> {
        let tp = self.tp.size() as i64;
        let tp_dim = style.dim().filter(|_| tp > 1);
        let mut local = plan::tp_local_shape(global, style, tp)?;
        let mut offsets = vec![0i64; global.len()];
        if let Some(d) = tp_dim {
            offsets[d] = self.tp_rank as i64 * local[d];
        }
        let tp_local_rows = local.first().copied().unwrap_or(1);
        let shards = self.fsdp.shard.size() as i64;
        let rows_per_shard = (tp_local_rows + shards - 1) / shards;
        if !local.is_empty() {
            let lo = (self.shard_rank as i64 * rows_per_shard).min(tp_local_rows);
            let hi = (lo + rows_per_shard).min(tp_local_rows);
            offsets[0] += lo;
            local[0] = hi - lo;
        }
        Ok(Placement {
            global: global.to_vec(),
            offsets,
            local,
            tp_dim,
            tp_partial_grad: tp > 1 && style.grad_partial_over_tp(),
            tp_local_rows,
            rows_per_shard,
            writes: self.replicate_rank == 0 && (tp_dim.is_some() || self.tp_rank == 0),
            expert_parallel: false,
        })
    }

    /// FSDP2's `reshard_after_forward` for a unit: the policy, except that by default (and with
    /// `never`) the final norm and output are kept (torchtitan: FSDP would prefetch them at
    /// once for backward), and by default nothing is resharded under pipeline parallelism
    /// (torchtitan: it would all-gather again for every microbatch).
    pub fn reshards(&self, last_unit: bool) -> bool {
        match self.reshard_after_forward {
            ReshardAfterForward::Always => true,
            ReshardAfterForward::Never => false,
            ReshardAfterForward::Default => !last_unit && !self.pipelined,
        }
    }

    /// How an FSDP unit frees and reduces over a step: FSDP2's `reshard_after_forward`
    /// ([`ParallelPlan::reshards`]); under pipeline parallelism a unit that does not reshard
    /// after forward keeps its first gather of a step for the step's other microbatches (FSDP2
    /// under torch's pipeline schedules does not reshard after backward either until the step's
    /// last one), and every unit reduces its gradients once a step (torch's stage turns gradient
    /// sync off for its backwards and reduces after the last).
    pub fn unit_policy(&self, last_unit: bool) -> fsdp::UnitPolicy {
        let reshard_after_forward = self.reshards(last_unit);
        fsdp::UnitPolicy {
            reshard_after_forward,
            keep_gathered_for_step: self.pipelined && !reshard_after_forward,
            reduce_once_per_step: self.pipelined,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's part owns memory of its own size: a dim-0 part (FSDP's shard, a column-wise
    /// TP weight) is not a view keeping the whole tensor's storage alive, nor is a dim-1 part.
    #[test]
    fn a_part_holds_only_its_own_bytes() {
        let full = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([4, 6]);
        for (offsets, local) in [([2, 0], [2, 6]), ([0, 3], [4, 3])] {
            let placement = Placement {
                global: vec![4, 6],
                offsets: offsets.to_vec(),
                local: local.to_vec(),
                tp_dim: None,
                tp_partial_grad: false,
                tp_local_rows: 4,
                rows_per_shard: 2,
                writes: true,
                expert_parallel: false,
            };
            let part = placement.take_local(&full);
            let want = full
                .narrow(0, offsets[0], local[0])
                .narrow(1, offsets[1], local[1]);
            assert!(part.equal(&want), "{offsets:?}");
            assert_eq!(
                crate::autograd::storage_nbytes(&part),
                12 * 4,
                "{offsets:?}: the part's storage"
            );
        }
    }
}
