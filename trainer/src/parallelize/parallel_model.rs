//! The model as this rank holds and runs it, split by the plan ([`ParallelPlan`]): torchtitan's
//! `parallelize_llama` applied to [`crate::model`]'s decoder, which knows nothing of it.
//!
//! - Parameters: drawn whole by the model ([`model::draw_parameters`]), each rank keeping its
//!   [`Placement`] (the TP plan table and FSDP's dim-0 chunks), then grouped into FSDP units as
//!   torchtitan wraps them (the embeddings, each block, norm + output).
//! - Forward: [`ParallelModel::forward_stage`] runs a pipeline stage's units in order: each
//!   unit gathered (and the next prefetched) before the model's [`model::block`] runs over it,
//!   inside activation checkpointing when the policy says so, with [`model::Ops`] that enter
//!   and leave tensor parallelism's regions and run the linears in float8, with selective AC's
//!   kept matmuls, or with zero-bubble's deferred weight gradients.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};

use super::context_parallel::ContextParallel;
use super::expert_parallel::ExpertParallel;
use super::fsdp::{Float8Gather, FsdpUnit, Gathered, Reductions};
use super::kept::Kept;
use super::pipeline::StageModules;
use super::plan::{TpStyle, tp_style};
use super::tp::TensorParallel;
use super::weight_grad::{WeightGradStash, deferred_linear};
use super::{NormGroup, ParallelPlan, Placement};
use crate::config::{ActivationCheckpointing, AttnBackend};
use crate::data::Batch;
use crate::float8::{Float8Linear, Float8Training, Float8Weight, WeightSplit};
use crate::model::{
    self, Attend, BlockShape, ForwardContext, Layer, ModelArgs, Module, MoeBuffers, MoeRun, Ops,
    Weight, document_causal_mask, document_offsets, precompute_freqs_cis, probe_varlen_kernel,
};
use crate::recompute::{checkpoint, kept_linear};

/// The model: this rank's parameters by fqn (the whole tensors on one process, else the parts
/// [`ParallelPlan`] gives it), the FSDP units that gather them, and the RoPE table.
pub struct ParallelModel {
    pub args: ModelArgs,
    params: Vec<(String, Tensor)>,
    placements: Vec<Placement>,
    /// The pipeline stages this rank holds, by stage index (one stage, the whole model,
    /// without pipeline parallelism).
    stages: Vec<(usize, StageModules)>,
    embeddings: Option<FsdpUnit>,
    /// This rank's transformer blocks by global layer index, ascending.
    layers: Vec<(usize, FsdpUnit)>,
    /// Under expert parallelism, each MoE block's routed experts: a unit of their own, FSDP'd
    /// over `efsdp` (torchtitan's per-parameter mesh for them), by global layer index.
    expert_units: Vec<ExpertsUnit>,
    /// The final norm and the output projection.
    head: Option<FsdpUnit>,
    /// Every unit's gradient reductions in flight (both FSDP meshes share the queue).
    reductions: Reductions,
    /// The dtype parameters are gathered and computed in (FSDP's `mixed_precision_param`), and
    /// so the dtype of the hidden states.
    compute_kind: Kind,
    tp: TensorParallel,
    cp: ContextParallel,
    ep: ExpertParallel,
    freqs_cis: Tensor,
    checkpointing: ActivationCheckpointing,
    attn_backend: AttnBackend,
    /// Document-causal attention runs FlashAttention's varlen kernel: CUDA, bf16/fp16
    /// activations, and the kernel answered a probe.
    varlen_kernel: bool,
    /// The linears that multiply in float8 (`[float8]`); `None`: none.
    float8: Option<Arc<ModelFloat8>>,
    /// This rank's mixtures of experts' buffers by global layer index, ascending.
    moe: Vec<(usize, MoeBuffers)>,
    /// Training forward passes count the tokens each expert gets (torchtitan's
    /// `module.training`; validation turns it off).
    training: AtomicBool,
}

/// A block's routed experts under expert parallelism: their FSDP unit, where they sit among the
/// block's parameters (`w1_EFD`'s position: `w2_EDF` and `w3_EFD` follow), and their indices in
/// the model's parameter list.
struct ExpertsUnit {
    layer: usize,
    unit: FsdpUnit,
    at: usize,
    params: Vec<usize>,
}

/// What a forward pass is told of its tokens besides their ids, by the batch they come from.
#[derive(Clone, Copy, Default)]
pub struct TokenLayout<'a> {
    /// Each token's position in its document (B, S); `None`: each row one document from 0.
    pub positions: Option<&'a Tensor>,
    /// The documents' offsets and longest length as the loader counted them on the host: the
    /// varlen kernel then needs no read back from the device ([`document_offsets`] would make
    /// one per forward pass).
    pub documents: Option<(&'a Tensor, i64)>,
    /// Under context parallelism, this rank's queries over every rank's keys
    /// ([`Batch::cp_mask`]).
    pub cp_mask: Option<&'a Tensor>,
}

impl<'a> TokenLayout<'a> {
    /// Everything `batch` says of its tokens.
    pub fn of(batch: &'a Batch) -> Self {
        TokenLayout {
            positions: Some(&batch.positions),
            documents: Some((&batch.document_offsets, batch.longest_document)),
            cp_mask: batch.cp_mask.as_ref(),
        }
    }
}

/// Which linears of the model multiply in float8.
struct ModelFloat8 {
    /// Every block's, by global layer index.
    blocks: Vec<ModuleFloat8>,
    head: ModuleFloat8,
}

/// The float8 linears of one module (a transformer block, or the final norm and output layer)
/// by the position of their weight among the module's parameters (`None`: high precision).
#[derive(Clone, Default)]
struct ModuleFloat8 {
    by_position: Vec<Option<Float8Linear>>,
    /// One float8 linear over q, k and v fused as torchtitan 0.3.0's `wqkv` (rows grouped per
    /// kv head), with the positions of the three weights: one scale (tensorwise) or one per
    /// token (rowwise) spans q, k and v, as there. `None`: each is a linear by itself.
    fused_qkv: Option<(Float8Linear, [usize; 3])>,
    /// The module's float8 linears multiply the sequence in this many chunks, each with its
    /// own scales (the output layer under torchtitan 0.3.0's chunked loss; else 1).
    chunks: i64,
}

impl ModuleFloat8 {
    fn at(&self, position: usize) -> Option<&Float8Linear> {
        self.by_position.get(position)?.as_ref()
    }

    /// FSDP's float8 all-gather scale groups of the module's parameters: one per float8
    /// linear in parameter order, the fused q, k and v sharing one.
    fn scale_groups(&self) -> Vec<Option<usize>> {
        let mut next = 0;
        let mut group = || {
            next += 1;
            next - 1
        };
        let mut qkv_group = None;
        (0..self.by_position.len())
            .map(|at| match &self.fused_qkv {
                Some((_, positions)) if positions.contains(&at) => {
                    Some(*qkv_group.get_or_insert_with(&mut group))
                }
                _ => self.by_position[at].is_some().then(&mut group),
            })
            .collect()
    }
}

/// The linears of a transformer block float8 may convert (torchtitan 0.3.0's module names
/// within the block), q, k and v first: what `Float8Training::converts` is asked about.
const FLOAT8_LINEARS: [&str; 7] = [
    "attention.qkv_linear.wq",
    "attention.qkv_linear.wk",
    "attention.qkv_linear.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
];

/// A transformer block of this rank's stage in one forward pass.
struct Block<'a> {
    /// Global layer index.
    index: usize,
    unit: &'a FsdpUnit,
    /// Its routed experts' unit under expert parallelism.
    experts: Option<&'a ExpertsUnit>,
    /// Position of its unit among the stage's units (embeddings first).
    at: usize,
    previous_recomputed: bool,
}

/// How a float8 linear's weight is split over tp, by the TP plan's style of its weight.
fn float8_split(style: TpStyle) -> WeightSplit {
    match style {
        TpStyle::Rows => WeightSplit::OutFeatures,
        TpStyle::Cols => WeightSplit::InFeatures,
        TpStyle::Replicated | TpStyle::ReplicatedPartialGrad => WeightSplit::Whole,
        // float8 converts linears (`FLOAT8_LINEARS`, lm_head), never grouped experts.
        TpStyle::ExpertRows | TpStyle::ExpertCols => {
            unreachable!("float8 converts linears, not grouped experts")
        }
    }
}

impl ParallelModel {
    /// Builds this rank's part of the model on `device` with torchtitan's initialisation (uses
    /// the global torch RNG: seed it first for reproducible weights). Each parameter is drawn
    /// whole, in registration order, and only this rank's part is kept: every layout gets the
    /// values one process gets, and no rank ever holds more than one whole parameter.
    pub fn new(args: ModelArgs, device: Device, plan: &ParallelPlan) -> Result<Self> {
        let whole = StageModules::whole(args.n_layers as usize);
        Self::new_stages(args, device, plan, vec![(0, whole)])
    }

    /// Builds the pipeline stages `stages` (index, modules) of the model, as [`ParallelModel::new`]
    /// builds the whole: every parameter is drawn in registration order, so each stage gets the
    /// values one process gets, and the parameters of other stages are dropped.
    pub fn new_stages(
        args: ModelArgs,
        device: Device,
        plan: &ParallelPlan,
        stages: Vec<(usize, StageModules)>,
    ) -> Result<Self> {
        args.validate()?;
        let has_embeddings = stages.iter().any(|(_, s)| s.embeddings);
        let has_head = stages.iter().any(|(_, s)| s.head);
        let has_layer = |i: usize| stages.iter().any(|(_, s)| s.layers.contains(&i));
        let tp = plan.tp.size() as i64;
        for (what, n) in [("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads())] {
            if n % tp != 0 {
                bail!(
                    "model {what} = {n} cannot be split over parallelism.tensor_parallel_degree = {tp}"
                );
            }
        }
        let mut params: Vec<(String, Tensor)> = Vec::new();
        let mut placements = Vec::new();
        model::draw_parameters(&args, device, |spec, full| {
            let keep = match spec.module {
                Module::Embeddings => has_embeddings,
                Module::Layer(i) => has_layer(i),
                Module::Head => has_head,
            };
            let placement = plan
                .placement_of(&spec.fqn, &spec.shape)
                .map_err(|e| anyhow::anyhow!("{}: {e}", spec.fqn))?;
            if !keep {
                // Another stage's parameter: drawn only to advance the RNG as one process does.
                return Ok(());
            }
            let local = placement.take_local(&full);
            params.push((spec.fqn, local.set_requires_grad(true)));
            placements.push(placement);
            Ok(())
        })?;
        // FSDP units as torchtitan wraps them: the embeddings, each block, norm + output. A
        // tied embedding is also the output layer: its unit stays gathered until the head has
        // run (torchtitan's tied unit reshards only under `reshard_after_forward = always`).
        let unit_of = |mesh, members: &[usize], last: bool| {
            FsdpUnit::new(
                mesh,
                members
                    .iter()
                    .map(|&i| params[i].1.shallow_clone())
                    .collect(),
                &members.iter().map(|&i| &placements[i]).collect::<Vec<_>>(),
                plan.unit_policy(last),
            )
        };
        let unit = |range: std::ops::Range<usize>, last: bool| {
            unit_of(&plan.fsdp, &range.collect::<Vec<_>>(), last)
        };
        let mut expert_units = Vec::new();
        let n = params.len();
        let first = usize::from(has_embeddings);
        let tied = args.tie_embeddings;
        if tied && has_embeddings != has_head {
            bail!("tied embeddings need the embeddings and the output layer on one pipeline stage");
        }
        let embeddings = has_embeddings.then(|| unit(0..1, tied));
        let mut start = first;
        let layers = (0..args.n_layers as usize)
            .filter(|&i| has_layer(i))
            .map(|i| {
                let range = start..start + args.layer_params(i);
                start = range.end;
                let (experts, dense): (Vec<usize>, Vec<usize>) =
                    range.clone().partition(|&j| placements[j].expert_parallel);
                if let Some(&first) = experts.first() {
                    expert_units.push(ExpertsUnit {
                        layer: i,
                        unit: unit_of(&plan.expert_fsdp, &experts, false),
                        at: first - range.start,
                        params: experts,
                    });
                }
                (i, unit_of(&plan.fsdp, &dense, false))
            })
            .collect();
        let moe = (0..args.n_layers as usize)
            .filter(|&i| has_layer(i))
            .filter_map(|i| Some((i, MoeBuffers::new(args.moe_layer(i)?, device))))
            .collect();
        let head_params = if tied { 1 } else { 2 };
        let head = has_head.then(|| unit(n - head_params..n, true));
        let freqs_cis = precompute_freqs_cis(&args, device);
        Ok(Self {
            args,
            params,
            placements,
            stages,
            embeddings,
            layers,
            expert_units,
            head,
            reductions: plan.fsdp.reductions.clone(),
            compute_kind: plan.fsdp.param_kind,
            tp: plan.tp.clone(),
            cp: plan.cp.clone(),
            ep: plan.ep.clone(),
            freqs_cis,
            checkpointing: ActivationCheckpointing::None,
            attn_backend: AttnBackend::default(),
            varlen_kernel: false,
            float8: None,
            moe,
            training: AtomicBool::new(true),
        })
    }

    /// Parameters by torchtitan fqn, in registration order.
    pub fn named_parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// The parameter named `fqn`.
    pub fn parameter(&self, fqn: &str) -> Option<&Tensor> {
        self.params.iter().find(|(n, _)| n == fqn).map(|(_, t)| t)
    }

    pub fn device(&self) -> Device {
        self.params[0].1.device()
    }

    /// Where each parameter's local part sits (same order as [`ParallelModel::named_parameters`]).
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The placement of parameter `fqn`.
    pub fn placement(&self, fqn: &str) -> Option<&Placement> {
        let i = self.params.iter().position(|(n, _)| n == fqn)?;
        Some(&self.placements[i])
    }

    /// Sets parameter `fqn` from the whole tensor `value` (its global shape): this rank keeps
    /// its part. The load path for checkpoints of any layout.
    pub fn set_parameter(&self, fqn: &str, value: &Tensor) -> Result<()> {
        let (Some(p), Some(placement)) = (self.parameter(fqn), self.placement(fqn)) else {
            bail!("the model has no parameter `{fqn}`");
        };
        if value.size() != placement.global {
            bail!(
                "parameter `{fqn}` has shape {:?} but the loaded tensor has {:?}",
                placement.global,
                value.size()
            );
        }
        tch::no_grad(|| {
            let mut p = p.shallow_clone();
            p.copy_(&placement.take_local(value));
        });
        Ok(())
    }

    /// The summed cross entropy of `logits` from [`ParallelModel::forward`] against `labels` over valid
    /// labels (over vocab-sharded logits under tensor parallelism).
    pub fn summed_cross_entropy(&self, logits: &Tensor, labels: &Tensor) -> Tensor {
        self.tp.cross_entropy_sum(logits, labels)
    }

    /// The whole parameters whose names `keep` accepts, in their own dtype, gathered one FSDP
    /// unit at a time. A collective: every rank calls it with the same model.
    pub fn full_parameters(&self, keep: impl Fn(&str) -> bool) -> Vec<(String, Tensor)> {
        // Each unit's parameters by index: the model's units hold them in order, except the
        // routed experts' units under expert parallelism.
        let expert_params: Vec<usize> = self
            .expert_units
            .iter()
            .flat_map(|e| e.params.iter().copied())
            .collect();
        let mut dense = (0..self.params.len()).filter(|i| !expert_params.contains(i));
        let mut fulls: Vec<(usize, Tensor)> = Vec::new();
        for unit in self.units() {
            for full in unit.full_masters() {
                let index = dense.next().expect("one parameter per unit slot");
                fulls.push((index, full));
            }
        }
        for experts in &self.expert_units {
            for (full, &index) in experts.unit.full_masters().into_iter().zip(&experts.params) {
                fulls.push((index, self.ep.gather_experts(&full)));
            }
        }
        fulls.sort_by_key(|(index, _)| *index);
        let mut out = Vec::new();
        for (index, full) in fulls {
            let (name, _) = &self.params[index];
            let full = match self.placements[index].tp_dim {
                Some(dim) => self.tp.gather_dim(&full, dim),
                None => full,
            };
            if keep(name) {
                out.push((name.clone(), full));
            }
        }
        out
    }

    /// This rank's gradients as torchtitan 0.3.0's parameters hold them, in its order, each with
    /// the ranks that hold its other parts ([`NormGroup`]): a block's q, k and v gradients are its one `wqkv`'s
    /// (fused in that layout when this rank holds whole rows of all three, as without FSDP
    /// sharding; else concatenated). What the gradient norm is taken over: the per-parameter
    /// norms are summed in this order, so one process's norm is torchtitan's bit for bit.
    pub fn grads_as_torchtitan_parameters(&self) -> Vec<(Tensor, NormGroup)> {
        let grad = |i: usize| {
            let p = &self.placements[i];
            let group = if p.expert_parallel {
                NormGroup::Experts
            } else if p.tp_dim.is_some() {
                NormGroup::FsdpTp
            } else {
                NormGroup::Fsdp
            };
            (self.params[i].1.grad(), group)
        };
        if self.args.mla.is_some() {
            // A latent attention's parameters are torchtitan's as they are.
            return (0..self.params.len()).map(grad).collect();
        }
        // Where each of this rank's blocks starts in the parameter list.
        let mut at = usize::from(self.embeddings.is_some());
        let block_starts: Vec<usize> = self
            .layers
            .iter()
            .map(|(index, _)| {
                at += self.args.layer_params(*index);
                at - self.args.layer_params(*index)
            })
            .collect();
        let kv_heads = self.args.kv_heads() / self.tp.size() as i64;
        let mut out = Vec::with_capacity(self.params.len());
        let mut i = 0;
        while i < self.params.len() {
            if !block_starts.contains(&i) {
                out.push(grad(i));
                i += 1;
                continue;
            }
            let (split, qkv) = (grad(i).1, [i, i + 1, i + 2].map(|j| grad(j).0));
            if qkv.iter().all(|g| g.defined()) {
                let whole = (i..i + 3).all(|j| {
                    let p = &self.placements[j];
                    p.local.first() == Some(&p.tp_local_rows)
                });
                let groups = if whole {
                    Some(kv_heads)
                } else {
                    self.whole_kv_groups([i, i + 1, i + 2])
                };
                let wqkv = match groups {
                    Some(groups) => crate::names::fuse_qkv(&qkv[0], &qkv[1], &qkv[2], groups),
                    None => Tensor::cat(&qkv.each_ref().map(|g| g.reshape([-1])), 0),
                };
                out.push((wqkv, split));
            }
            i += 3;
        }
        out
    }

    /// How many whole kv groups this rank's FSDP shards of a block's q, k and v (parameters
    /// `qkv`) cover, when they cover the same ones: then, fused, they are the rows of
    /// torchtitan's fused `wqkv` that its dim-0 shard on this rank holds (the data-parallel
    /// degree divides the kv heads), in its order — so their norm rounds as torchtitan's
    /// does. `None` under tensor parallelism or when the shards cut through a group.
    fn whole_kv_groups(&self, qkv: [usize; 3]) -> Option<i64> {
        if self.tp.size() > 1 {
            return None;
        }
        let [q, k, v] = qkv.map(|j| &self.placements[j]);
        let (hd, per_kv) = (
            self.args.head_dim(),
            self.args.n_heads / self.args.kv_heads(),
        );
        let (start, rows) = (k.offsets[0], k.local[0]);
        let aligned = rows > 0
            && rows % hd == 0
            && start % hd == 0
            && (v.offsets[0], v.local[0]) == (start, rows)
            && (q.offsets[0], q.local[0]) == (start * per_kv, rows * per_kv);
        aligned.then_some(rows / hd)
    }

    /// Waits for the FSDP gradient reductions the backward passes started and puts their results
    /// in the parameters' gradients: call once after the step's last backward.
    pub fn finish_gradients(&self) {
        // Pipeline parallelism: each unit's gradients, summed over the step's microbatches,
        // are reduced now, in one order on every rank of a shard group (the head's before the
        // blocks', as backward ended them; the experts' first).
        let all: Vec<&FsdpUnit> = self.all_units().collect();
        for unit in all.iter().rev() {
            unit.reduce_accumulated();
        }
        self.reductions.drain();
        self.release_gathered();
    }

    /// Lets go of the gathers units keep for a step (pipeline parallelism): at the end of the
    /// step's backward passes ([`ParallelModel::finish_gradients`]) and after passes with no
    /// backward (validation's).
    pub fn release_gathered(&self) {
        for unit in self.all_units() {
            unit.release();
        }
    }

    /// Every FSDP unit of this rank: [`ParallelModel::units`], then the experts' units.
    fn all_units(&self) -> impl Iterator<Item = &FsdpUnit> {
        let experts = self.expert_units.iter().map(|e| &e.unit);
        self.units().chain(experts)
    }

    /// This rank's FSDP units in model order: the embeddings, its blocks, norm + output.
    fn units(&self) -> impl Iterator<Item = &FsdpUnit> {
        self.embeddings
            .iter()
            .chain(self.layers.iter().map(|(_, u)| u))
            .chain(self.head.iter())
    }

    /// The pipeline stages this rank holds (index, modules).
    pub fn stages(&self) -> &[(usize, StageModules)] {
        &self.stages
    }

    /// Whether activations between blocks are sequence-sharded over tp.
    pub fn sequence_parallel(&self) -> bool {
        self.tp.sequence_parallel()
    }

    /// Converts every parameter to `kind` in place (the shallow clones the layers hold see it):
    /// `training.dtype = bfloat16` trains bf16 parameters, gradients and optimizer state, as
    /// torchtitan 0.3.0 does by building the model under that default dtype. The weights are
    /// the fp32 initialisation rounded to `kind`; RoPE and the logits stay fp32.
    pub fn cast_parameters(&self, kind: Kind) {
        tch::no_grad(|| {
            for (_, p) in &self.params {
                let mut p = p.shallow_clone();
                let cast = p.to_kind(kind);
                p.set_data(&cast);
            }
        });
    }

    /// Sets which activations [`ParallelModel::forward`] keeps for backward.
    pub fn with_checkpointing(mut self, policy: ActivationCheckpointing) -> Self {
        self.checkpointing = policy;
        self
    }

    pub fn checkpointing(&self) -> ActivationCheckpointing {
        self.checkpointing
    }

    /// Makes the linears `float8` converts (torchtitan's rule: [`Float8Training::converts`])
    /// multiply in float8; the others, and every parameter, stay as they are. Returns the
    /// converted linears' names too (for the log).
    pub fn with_float8(mut self, float8: Option<&Float8Training>) -> (Self, Vec<String>) {
        let Some(f8) = float8 else {
            self.float8 = None;
            return (self, Vec::new());
        };
        let a = &self.args;
        let (d, kv) = (a.dim, a.kv_heads() * a.head_dim());
        let mut converted = Vec::new();
        let tp = self.tp.group().clone();
        // Each linear's split over tp is the TP plan's for its weight.
        let mut take = |fqn: String, shape: &[i64]| {
            f8.converts(&fqn, shape[0], shape[1]).then(|| {
                let style = tp_style(&format!("{fqn}.weight"))
                    .expect("every linear has an entry in the tensor-parallel plan");
                converted.push(fqn);
                f8.linear(&tp, float8_split(style))
            })
        };
        let specs = a.parameters();
        let blocks: Vec<ModuleFloat8> = (0..a.n_layers as usize)
            .map(|i| {
                let block: Vec<_> = specs
                    .iter()
                    .filter(|s| s.module == Module::Layer(i))
                    .collect();
                let prefix = format!("layers.{i}.");
                // The linear each parameter is the weight of, if float8 may convert it.
                let linear = |fqn: &str| {
                    let name = fqn.strip_prefix(&prefix)?.strip_suffix(".weight")?;
                    FLOAT8_LINEARS
                        .contains(&name)
                        .then(|| format!("{prefix}{name}"))
                };
                let qkv: Vec<usize> = (0..block.len())
                    .filter(|&at| linear(&block[at].fqn).is_some_and(|n| n.contains("qkv_linear")))
                    .collect();
                // Fused unless a filter names q, k or v alone (the 16 rule is the fused one's).
                let fused = format!("{prefix}attention.qkv_linear.wqkv");
                let fuse = qkv.len() == 3
                    && f8.converts(&fused, d + 2 * kv, d)
                    && !qkv
                        .iter()
                        .any(|&at| f8.filtered(&linear(&block[at].fqn).unwrap_or_default()));
                let fused_qkv = fuse
                    .then(|| take(fused, &[d + 2 * kv, d]))
                    .flatten()
                    .map(|f| (f, [qkv[0], qkv[1], qkv[2]]));
                let by_position = (0..block.len())
                    .map(|at| {
                        let name = linear(&block[at].fqn)?;
                        if fused_qkv.is_some() && qkv.contains(&at) {
                            return None;
                        }
                        take(name, &block[at].shape)
                    })
                    .collect();
                ModuleFloat8 {
                    by_position,
                    fused_qkv,
                    chunks: 1,
                }
            })
            .collect();
        // The output layer's parameters: the final norm, then lm_head.
        let lm_head = take("lm_head".into(), &[a.vocab_size, d]);
        let head = ModuleFloat8 {
            by_position: vec![None, lm_head],
            fused_qkv: None,
            chunks: f8.lm_head_chunks,
        };
        if f8.fsdp_all_gather {
            self.gather_in_float8(&blocks, &head);
        }
        self.float8 = Some(Arc::new(ModelFloat8 { blocks, head }));
        (self, converted)
    }

    /// FSDP's float8 all-gather: each unit gathers the weights of its float8 linears in float8
    /// (q, k and v of a fused `wqkv` with one scale, as the one weight they are there).
    fn gather_in_float8(&mut self, blocks: &[ModuleFloat8], head: &ModuleFloat8) {
        let tp = self.tp.clone();
        let gather = |module: &ModuleFloat8| Float8Gather {
            scale_of: module.scale_groups(),
            tp: tp.clone(),
        };
        for (index, unit) in &mut self.layers {
            unit.gather_in_float8(gather(&blocks[*index]));
        }
        if let Some(unit) = &mut self.head {
            unit.gather_in_float8(gather(head));
        }
    }

    /// `precompute_float8_dynamic_scale_for_fsdp`: after the optimizer step, the scales the
    /// next step's float8 all-gathers cast with, in one collective. Every rank calls it.
    pub fn precompute_float8_scales(&self) {
        crate::parallelize::fsdp::precompute_float8_scales(&self.units().collect::<Vec<_>>());
    }

    /// Sets which tokens attend to which; `activations` is the dtype attention will compute in
    /// (FlashAttention's varlen kernel takes bf16/fp16 only).
    pub fn with_attn_backend(mut self, backend: AttnBackend, activations: Kind) -> Self {
        self.attn_backend = backend;
        // A latent attention's q/k and v widths differ: it runs SDPA (with the document mask).
        self.varlen_kernel = backend.document_causal()
            && self.args.mla.is_none()
            && matches!(activations, Kind::BFloat16 | Kind::Half)
            && probe_varlen_kernel(self.device());
        self
    }

    pub fn attn_backend(&self) -> AttnBackend {
        self.attn_backend
    }

    /// Logits (B, S, vocab) in fp32 for token ids (B, S) whose `positions` (B, S) in their
    /// documents come from the loader ([`crate::data::Batch`]); `None` treats each row as one
    /// document starting at position 0. Under tensor parallelism the logits are this rank's
    /// vocab columns (B, S, vocab / tp): take the loss with [`ParallelModel::summed_cross_entropy`].
    pub fn forward(&self, tokens: &Tensor, positions: Option<&Tensor>) -> Tensor {
        let layout = TokenLayout {
            positions,
            ..TokenLayout::default()
        };
        self.forward_with(tokens, layout)
    }

    /// [`ParallelModel::forward`] with everything the batch says of its tokens
    /// ([`TokenLayout`]).
    pub fn forward_with(&self, tokens: &Tensor, layout: TokenLayout<'_>) -> Tensor {
        let stage = self.stages[0].0;
        assert!(
            self.stages.len() == 1 && self.embeddings.is_some() && self.head.is_some(),
            "forward runs the whole model; under pipeline parallelism use forward_stage"
        );
        self.forward_stage(stage, tokens, layout, None)
    }

    /// This rank's part of a loaded batch: under context parallelism its part of every
    /// sequence with the mask over every rank's keys ([`ContextParallel::shard`]); else the
    /// batch as it is.
    pub fn shard_batch(&self, batch: Batch) -> Batch {
        self.cp.shard(batch, self.attn_backend.document_causal())
    }

    /// Runs pipeline stage `stage` of this rank: from token ids (B, S) on the stage holding
    /// the embeddings, else from the hidden states the previous stage produced
    /// ([`ParallelModel::hidden_shape`]); returns hidden states, or the logits (as
    /// [`ParallelModel::forward`]) on the stage holding the output. With `defer_weight_grads`, the
    /// linears' backward computes only input gradients and parks their weight gradients there
    /// (a zero-bubble schedule runs them later). `layout`: the tokens' positions, documents
    /// and context-parallel mask ([`TokenLayout`]).
    pub fn forward_stage(
        &self,
        stage: usize,
        input: &Tensor,
        layout: TokenLayout<'_>,
        defer_weight_grads: Option<&WeightGradStash>,
    ) -> Tensor {
        let positions = layout.positions;
        let modules = &self
            .stages
            .iter()
            .find(|(s, _)| *s == stage)
            .unwrap_or_else(|| panic!("this rank holds no pipeline stage {stage}"))
            .1;
        let shape = BlockShape::of(&self.args, self.tp.size() as i64);
        let seq_len = match (modules.embeddings, self.tp.sequence_parallel()) {
            // Sequence-parallel hidden states hold this rank's block of the sequence.
            (false, true) => input.size()[1] * self.tp.size() as i64,
            _ => input.size()[1],
        };
        let attend = self.attend(layout);
        let ctx = ForwardContext::new(&self.freqs_cis, seq_len, positions, attend);
        // The stage's units in forward order; a prefetch left from an earlier pass is stale.
        let layers: Vec<&(usize, FsdpUnit)> = self
            .layers
            .iter()
            .filter(|(i, _)| modules.layers.contains(i))
            .collect();
        let embeddings = self.embeddings.as_ref().filter(|_| modules.embeddings);
        let head = self.head.as_ref().filter(|_| modules.head);
        let units: Vec<&FsdpUnit> = embeddings
            .into_iter()
            .chain(layers.iter().map(|(_, u)| u))
            .chain(head)
            .collect();
        for unit in &units {
            unit.drop_prefetch();
        }
        // A tied embedding weight, gathered once for the embedding and the output layer.
        let mut tied_output = None;
        let mut h = match embeddings {
            Some(unit) => {
                let [weight]: [Tensor; 1] = unit.gather().params.try_into().expect("one weight");
                if let Some(next) = units.get(1) {
                    next.prefetch();
                }
                let h = self.tp.embedding(&weight, input);
                if self.args.tie_embeddings {
                    tied_output = Some((unit, weight));
                    h
                } else {
                    unit.after_forward(h, None)
                }
            }
            None => input.shallow_clone(),
        };
        let first_layer = usize::from(embeddings.is_some());
        for (k, (index, unit)) in layers.iter().enumerate() {
            let experts = self.expert_units.iter().find(|e| e.layer == *index);
            // The block before this one is recomputed in backward (checkpointed), so its unit
            // gathers again there.
            let previous_recomputed = k.checked_sub(1).is_some_and(|j| {
                self.checkpointing == ActivationCheckpointing::Op
                    || self.checkpointing.whole_layer(layers[j].0)
            });
            let block = Block {
                index: *index,
                unit,
                experts,
                at: first_layer + k,
                previous_recomputed,
            };
            h = self.run_block(&block, &units, &ctx, shape, h, defer_weight_grads);
        }
        match head {
            Some(head) => self.run_output(head, tied_output, h, shape, defer_weight_grads),
            None => h,
        }
    }

    /// How this forward pass's tokens attend: over every context-parallel rank's keys with
    /// the batch's mask, causal, or within their documents (the varlen kernel over the
    /// loader's offsets, else SDPA with the mask).
    fn attend(&self, layout: TokenLayout<'_>) -> Attend {
        if let Some(mask) = layout.cp_mask {
            return Attend::Masked(mask.shallow_clone());
        }
        let documents = layout.documents;
        match layout
            .positions
            .filter(|_| self.attn_backend.document_causal())
        {
            None => Attend::Causal,
            Some(p) if self.varlen_kernel => match documents {
                Some((offsets, longest)) => Attend::Varlen(offsets.shallow_clone(), longest),
                None => {
                    let (offsets, longest) = document_offsets(p);
                    Attend::Varlen(offsets, longest)
                }
            },
            Some(p) => Attend::Masked(document_causal_mask(p)),
        }
    }

    /// One transformer block of a forward pass over its FSDP unit: gathered (the next unit
    /// prefetched), run by the model with this rank's [`SplitOps`], inside activation
    /// checkpointing where the policy says, then the unit resharded per its policy.
    fn run_block(
        &self,
        block: &Block<'_>,
        units: &[&FsdpUnit],
        ctx: &ForwardContext,
        shape: BlockShape,
        h: Tensor,
        defer_weight_grads: Option<&WeightGradStash>,
    ) -> Tensor {
        let (index, at, unit) = (block.index, block.at, block.unit);
        let f8 = self
            .float8
            .as_ref()
            .map(|f| f.blocks[index].clone())
            .unwrap_or_default();
        // Gather the next unit while this block computes. A checkpointed block's closure
        // runs again in backward (the recompute), where the unit backward reaches next is
        // the one before: gather that one meanwhile, if it gathers in backward at all (it
        // is recomputed too, or it resharded after forward), as FSDP2's backward prefetch.
        let (next, previous) = (
            units.get(at + 1).map(|u| (*u).clone()),
            at.checked_sub(1).map(|p| units[p]),
        );
        let previous_gathers_in_backward =
            previous.filter(|p| p.reshards_after_forward() || block.previous_recomputed);
        let before = previous_gathers_in_backward.map(|u| (*u).clone());
        let (unit_, ctx_, tp_, cp_, ep_) = (
            unit.clone(),
            ctx.share(),
            self.tp.clone(),
            self.cp.clone(),
            self.ep.clone(),
        );
        let experts = block.experts.map(|e| (e.unit.clone(), e.at));
        // Set until the first run of the gather (the forward; a checkpointed block's second is
        // its recompute in backward).
        let in_forward = Arc::new(AtomicBool::new(true));
        let moe_layer = self.args.moe_layer(index).copied();
        let gather = move || {
            let Gathered {
                mut params,
                mut float8,
            } = unit_.gather();
            if let Some((unit, at)) = &experts {
                // The routed experts' tensors back in their place among the block's.
                let gathered = unit.gather();
                for (k, p) in gathered.params.into_iter().enumerate() {
                    params.insert(at + k, p);
                    float8.insert(at + k, None);
                }
            }
            let layer = Layer::from_params(params, &shape, moe_layer.as_ref());
            let prefetch = if in_forward.swap(false, Ordering::Relaxed) {
                &next
            } else {
                &before
            };
            if let Some(unit) = prefetch {
                unit.prefetch();
            }
            (layer, float8)
        };
        // A mixture of experts counts its tokens in a training forward pass, once: not in
        // the recompute activation checkpointing runs in backward.
        let moe = self.moe_state(index);
        let moe_ = moe.as_ref().map(|m| m.share());
        // A checkpointed block's recompute runs its linears deferring too: their weight
        // gradients wait for the schedule's weight pass as a plain block's do (the first run,
        // without autograd, parks nothing).
        let deferred = defer_weight_grads.cloned();
        if self.checkpointing == ActivationCheckpointing::Op {
            // The first run (forward) records the kept matmul and collective outputs, the
            // second (the recompute in backward) replays them. Each run gathers the block's
            // parameters.
            let kept = Mutex::new(None);
            let [out] = checkpoint(&[&h], move |i| {
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                let (matmuls, exchanges) = match kept.take() {
                    Some((m, x)) => (Some(m), Some(x)),
                    None => (None, None),
                };
                let matmuls = Matmuls::new(matmuls, f8.clone()).deferring(deferred.as_ref());
                let exchanges = Kept::new(exchanges);
                let (layer, gathered) = gather();
                let ops = SplitOps::new(&tp_, &cp_, &ep_, &matmuls, &gathered, Some(index))
                    .keeping(&exchanges);
                let out = model::block(&layer, shape, &ctx_, &ops, &i[0], moe_.as_ref());
                *kept = matmuls.into_recorded().zip(exchanges.into_recorded());
                [out]
            });
            out
        } else if self.checkpointing.whole_layer(index) {
            let [out] = checkpoint(&[&h], move |i| {
                let matmuls = Matmuls::plain(f8.clone()).deferring(deferred.as_ref());
                let (layer, gathered) = gather();
                let ops = SplitOps::new(&tp_, &cp_, &ep_, &matmuls, &gathered, Some(index));
                [model::block(
                    &layer,
                    shape,
                    &ctx_,
                    &ops,
                    &i[0],
                    moe_.as_ref(),
                )]
            });
            out
        } else {
            let (layer, gathered) = gather();
            let matmuls = Matmuls::plain(f8).deferring(defer_weight_grads);
            let ops = SplitOps::new(
                &self.tp,
                &self.cp,
                &self.ep,
                &matmuls,
                &gathered,
                Some(index),
            );
            let out = model::block(&layer, shape, ctx, &ops, &h, moe.as_ref());
            drop((layer, gathered));
            let out = match block.experts {
                Some(e) => e.unit.after_forward(out, None),
                None => out,
            };
            unit.after_forward(out, previous)
        }
    }

    /// The final norm and output layer over their FSDP unit (`tied`: the embedding's unit and
    /// weight, gathered since the embedding).
    fn run_output(
        &self,
        head: &FsdpUnit,
        tied_output: Option<(&FsdpUnit, Tensor)>,
        h: Tensor,
        shape: BlockShape,
        defer_weight_grads: Option<&WeightGradStash>,
    ) -> Tensor {
        let Gathered { params, float8 } = head.gather();
        // The output layer's parameters: the final norm, then lm_head (the embedding when tied).
        let (norm, lm_head) = match &tied_output {
            Some((_, embedding)) => {
                let [norm]: [Tensor; 1] = params.try_into().expect("the final norm");
                (norm, embedding.shallow_clone())
            }
            None => {
                let [norm, lm_head]: [Tensor; 2] = params.try_into().expect("two weights");
                (norm, lm_head)
            }
        };
        let lm_head = Weight {
            value: lm_head,
            at: 1,
        };
        let f8 = self
            .float8
            .as_ref()
            .map(|f| f.head.clone())
            .unwrap_or_default();
        let matmuls = Matmuls::plain(f8).deferring(defer_weight_grads);
        let logits = model::output(
            &h,
            &norm,
            &lm_head,
            &shape,
            &SplitOps::new(&self.tp, &self.cp, &self.ep, &matmuls, &float8, None),
        );
        match tied_output {
            // The tied unit's forward ends here: backward regathers it (when it reshards)
            // before the output layer's backward needs it.
            Some((unit, _)) => unit.after_forward(logits, None),
            None => logits,
        }
    }

    /// Layer `index`'s mixture-of-experts state for one forward pass (counting only in
    /// training), if it has one.
    fn moe_state(&self, index: usize) -> Option<MoeRun> {
        let (_, buffers) = self.moe.iter().find(|(i, _)| *i == index)?;
        Some(MoeRun::new(buffers, self.training.load(Ordering::Relaxed)))
    }

    /// Training (the default) or evaluation mode, as torch's `module.train()`/`eval()`: only
    /// training forward passes count the tokens each expert gets.
    pub fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// The persistent buffers checkpoints hold beside the parameters (torchtitan's
    /// `layers.N.moe.expert_bias_E`), whole on every rank holding the layer.
    pub fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.moe
            .iter()
            .filter_map(|(i, b)| {
                let bias = b.expert_bias.as_ref()?;
                Some((
                    format!("layers.{i}.moe.expert_bias_E"),
                    bias.shallow_clone(),
                ))
            })
            .collect()
    }

    /// Auxiliary-loss-free load balancing before the optimizer step (torchtitan's step
    /// pre-hook): the token counts summed over the data-parallel ranks by `sum_over_dp` move
    /// each layer's `expert_bias` ([`model::moe::update_expert_bias`]). Nothing without experts.
    pub fn update_expert_bias(
        &self,
        sum_over_dp: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<()> {
        let layers: Vec<(&MoeBuffers, f64)> = self
            .moe
            .iter()
            .filter_map(|(i, b)| Some((b, self.args.moe_layer(*i)?.load_balance_coeff?)))
            .collect();
        model::moe::update_expert_bias(&layers, sum_over_dp)?;
        // Every layer restarts, balanced or not (the counts also feed the expert load).
        for (_, b) in &self.moe {
            b.restart_counts();
        }
        Ok(())
    }

    /// This rank's MoE layers (global indices, ascending) and the tokens its routers sent to
    /// each of their experts since the last optimizer step, (layers, experts) on the device: a
    /// copy, read before [`ParallelModel::update_expert_bias`] restarts the counts. `None`
    /// without MoE layers.
    pub fn expert_load(&self) -> Option<(Vec<usize>, Tensor)> {
        if self.moe.is_empty() {
            return None;
        }
        let counts: Vec<Tensor> = self
            .moe
            .iter()
            .map(|(_, b)| b.tokens_per_expert.shallow_clone())
            .collect();
        let layers = self.moe.iter().map(|(i, _)| *i).collect();
        Some((layers, tch::no_grad(|| Tensor::vstack(&counts))))
    }

    /// Under expert parallelism, the routed experts this rank hosts in every MoE layer:
    /// (first, how many). `None` without it (every rank holds every expert).
    pub fn hosted_experts(&self) -> Option<(usize, usize)> {
        let experts = self.args.moe.as_ref()?.num_experts as usize;
        let ep = self.ep.size();
        (ep > 1).then(|| (self.ep.rank() * experts / ep, experts / ep))
    }

    /// Shape and dtype of the hidden states between blocks for `batch` rows of `seq_len`
    /// tokens: what one pipeline stage sends the next (this rank's sequence block under
    /// sequence parallelism).
    pub fn hidden_shape(&self, batch: i64, seq_len: i64) -> (Vec<i64>, Kind) {
        let tp = self.tp.size() as i64;
        let seq = if self.tp.sequence_parallel() {
            seq_len / tp
        } else {
            seq_len
        };
        (vec![batch, seq, self.args.dim], self.compute_kind)
    }
}

/// A module's matmuls (`x.linear(w)`), counted per run as torchtitan's selective-AC policy
/// counts them: the odd-numbered ones are kept when recording and taken from the record when
/// replaying.
struct Matmuls {
    /// Under selective activation checkpointing, the record of the odd-numbered outputs.
    kept: Option<Kept>,
    count: Cell<usize>,
    float8: ModuleFloat8,
    /// Zero-bubble pipelines: the plain (not float8, not recorded) linears' weight gradients
    /// are parked here instead of computed in backward.
    deferred: Option<WeightGradStash>,
}

impl Matmuls {
    fn plain(float8: ModuleFloat8) -> Self {
        Self::with(None, float8)
    }

    /// Records when `replay` is `None`, else replays it.
    fn new(replay: Option<VecDeque<Tensor>>, float8: ModuleFloat8) -> Self {
        Self::with(Some(Kept::new(replay)), float8)
    }

    fn with(kept: Option<Kept>, float8: ModuleFloat8) -> Self {
        Matmuls {
            kept,
            count: Cell::new(0),
            float8,
            deferred: None,
        }
    }

    fn deferring(mut self, stash: Option<&WeightGradStash>) -> Self {
        self.deferred = stash.cloned();
        self
    }

    /// `x.linear(w)`, in float8 when `f8` is set (with `w` gathered in float8 as `gathered`).
    fn linear(
        &self,
        x: &Tensor,
        w: &Tensor,
        gathered: Option<&Float8Weight>,
        f8: Option<&Float8Linear>,
    ) -> Tensor {
        self.count.set(self.count.get() + 1);
        let multiply = || match (f8, &self.deferred) {
            (Some(f8), _) => f8.apply_in_chunks(x, w, gathered, self.float8.chunks),
            (None, Some(stash)) => deferred_linear(x, w, stash),
            (None, None) => x.linear::<&Tensor>(w, None),
        };
        if self.count.get().is_multiple_of(2) {
            return multiply();
        }
        Kept::keep_in(self.kept.as_ref(), "matmul", multiply, |value| match f8 {
            Some(f8) => f8.apply_kept(x, w, gathered, &value),
            None => kept_linear(x, w, &value),
        })
    }

    /// What a recording run kept, for the replay (`None` after a replay).
    fn into_recorded(self) -> Option<VecDeque<Tensor>> {
        self.kept.and_then(Kept::into_recorded)
    }
}

/// The model's [`Ops`] as this rank runs one module (a block or the output layer) in one run:
/// tensor parallelism's regions, and the module's [`Matmuls`] over its weights as its FSDP
/// unit gathered them (`gathered`: each parameter's float8 copy, when gathered in float8).
struct SplitOps<'a> {
    tp: &'a TensorParallel,
    cp: &'a ContextParallel,
    ep: &'a ExpertParallel,
    matmuls: &'a Matmuls,
    /// The collectives' outputs selective activation checkpointing keeps ([`Kept`]).
    exchanges: Option<&'a Kept>,
    gathered: &'a [Option<Float8Weight>],
    /// The block's global layer index (`None`: the output), for expert parallelism's span.
    layer: Option<usize>,
}

impl<'a> SplitOps<'a> {
    fn new(
        tp: &'a TensorParallel,
        cp: &'a ContextParallel,
        ep: &'a ExpertParallel,
        matmuls: &'a Matmuls,
        gathered: &'a [Option<Float8Weight>],
        layer: Option<usize>,
    ) -> Self {
        SplitOps {
            tp,
            cp,
            ep,
            matmuls,
            exchanges: None,
            gathered,
            layer,
        }
    }

    /// Under selective activation checkpointing: keeps (or replays) the outputs of the
    /// collectives torchtitan's policy saves in `exchanges`.
    fn keeping(mut self, exchanges: &'a Kept) -> Self {
        self.exchanges = Some(exchanges);
        self
    }

    fn gathered(&self, at: usize) -> Option<&Float8Weight> {
        self.gathered.get(at)?.as_ref()
    }
}

impl Ops for SplitOps<'_> {
    fn enter(&self, x: &Tensor) -> Tensor {
        self.tp.enter(x)
    }

    fn exit(&self, x: &Tensor) -> Tensor {
        self.tp.exit_keeping(x, self.exchanges)
    }

    fn keys_values(&self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        self.cp.gather(k, v)
    }

    fn routed_experts(
        &self,
        routed: &Tensor,
        per_expert: &Tensor,
        experts: &dyn Fn(&Tensor, &Tensor) -> Tensor,
    ) -> Tensor {
        self.ep
            .routed_experts(self.layer, routed, per_expert, experts, self.exchanges)
    }

    /// Under expert parallelism with tensor parallelism every tp rank routes its own block of
    /// the sequence (torchtitan's EP x TP: the router's and routed experts' input `Shard(1)`).
    fn routed_tokens(&self, x: &Tensor) -> Tensor {
        if self.ep.size() > 1 {
            self.tp.sequence_block(x)
        } else {
            x.shallow_clone()
        }
    }

    /// ... and its output is its block of a sum over tp (`Shard(1)` to `Partial`).
    fn routed_output(&self, out: &Tensor, seq_len: i64) -> Tensor {
        if self.ep.size() > 1 {
            self.tp.pad_sequence_block(out, seq_len)
        } else {
            out.shallow_clone()
        }
    }

    fn linear(&self, x: &Tensor, w: &Weight) -> Tensor {
        let f8 = self.matmuls.float8.at(w.at);
        self.matmuls.linear(x, &w.value, self.gathered(w.at), f8)
    }

    /// With float8 on all three, one linear over torchtitan 0.3.0's fused `wqkv` (counted as
    /// one matmul).
    fn fused_qkv(&self, x: &Tensor, w: [&Weight; 3], shape: &BlockShape) -> Option<[Tensor; 3]> {
        let (f8, _) = self.matmuls.float8.fused_qkv.as_ref()?;
        let (b, s, _) = x.size3().expect("hidden states are (B, S, dim)");
        let (kvh, hd) = (shape.kv_heads, shape.head_dim);
        let per_kv = shape.n_heads / kvh;
        let fuse = |w: [&Tensor; 3]| crate::names::fuse_qkv(w[0], w[1], w[2], kvh);
        // Gathered in float8, the three share one scale: their values fuse as they are.
        let float8 = match w.map(|w| self.gathered(w.at)) {
            [Some(fq), Some(fk), Some(fv)] => Some(Float8Weight {
                data: fuse([&fq.data, &fk.data, &fv.data]),
                scale: fq.scale.shallow_clone(),
            }),
            _ => None,
        };
        let value = fuse(w.map(|w| &w.value));
        let qkv = self
            .matmuls
            .linear(x, &value, float8.as_ref(), Some(f8))
            .view([b, s, kvh, per_kv + 2, hd]);
        let part = |start: i64, len: i64| qkv.narrow(3, start, len).reshape([b, s, kvh * len * hd]);
        Some([part(0, per_kv), part(per_kv, 1), part(per_kv + 1, 1)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Decoder;

    fn args(family: &str, flavor: &str) -> ModelArgs {
        let mut args = ModelArgs::of(family, flavor).unwrap();
        args.n_layers = args.n_layers.min(2);
        args.max_seq_len = 16;
        args
    }

    /// The model's gradients after its backward passes: the reductions collected, a copy of
    /// each parameter's gradient.
    fn gradients(model: &ParallelModel) -> Vec<Tensor> {
        model.finish_gradients();
        model
            .named_parameters()
            .iter()
            .map(|(_, p)| p.grad().copy())
            .collect()
    }

    /// A zero-bubble schedule's input pass parks every linear's weight gradient, in checkpointed
    /// blocks too (their recompute defers as a plain block does), and the weight pass gives the
    /// gradients of a plain backward, bit for bit.
    #[test]
    fn checkpointed_blocks_defer_their_weight_gradients() {
        use crate::parallelize::weight_grad::WeightGradStash;
        let _generator = crate::rng::global_generator();
        let args = args("llama3", "debugmodel");
        let tokens = Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 8, 4]).view([1, 8]);
        let layout = TokenLayout {
            positions: None,
            documents: None,
            cp_mask: None,
        };
        for policy in [
            ActivationCheckpointing::None,
            ActivationCheckpointing::Full,
            ActivationCheckpointing::Op,
        ] {
            let run = |defer: bool| {
                tch::manual_seed(3);
                let model = ParallelModel::new(args.clone(), Device::Cpu, &ParallelPlan::single())
                    .unwrap()
                    .with_checkpointing(policy);
                let stash = WeightGradStash::new();
                let logits = model.forward_stage(0, &tokens, layout, defer.then_some(&stash));
                logits.square().sum(Kind::Float).backward();
                let parked = stash.len();
                stash.apply().unwrap();
                (parked, gradients(&model))
            };
            let (parked, deferred) = run(true);
            // Each block's 7 linears and lm_head; selective op AC keeps the 1st, 3rd, 5th and
            // 7th matmul's output, whose replay computes its weight gradient at once.
            let per_block = match policy {
                ActivationCheckpointing::Op => 3,
                _ => 7,
            };
            let want = per_block * args.n_layers as usize + 1;
            assert_eq!(parked, want, "{policy:?}: linears parked");
            let (_, plain) = run(false);
            for (a, b) in deferred.iter().zip(&plain) {
                assert!(a.equal(b), "{policy:?}");
            }
        }
    }

    /// One process with bf16 parameters over fp32 master weights frees each block's cast copy
    /// after the block's forward and casts again for its backward, as FSDP2 on one rank does
    /// (before, the matmuls kept every block's copy until backward); the gradients are those of
    /// keeping the copies, bit for bit.
    #[test]
    fn one_process_frees_its_cast_copies_after_forward() {
        use crate::config::{Parallelism, ReshardAfterForward};
        use crate::distributed::DeviceMesh;
        let _generator = crate::rng::global_generator();
        let args = args("llama3", "debugmodel");
        let run = |policy| {
            let parallelism = Parallelism {
                fsdp_reshard_after_forward: policy,
                ..Parallelism::default()
            };
            let plan = ParallelPlan::new(
                &DeviceMesh::single(),
                &parallelism,
                Kind::BFloat16,
                Kind::Float,
            );
            tch::manual_seed(3);
            let model = ParallelModel::new(args.clone(), Device::Cpu, &plan).unwrap();
            let tokens = Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 8, 4]).view([1, 8]);
            let logits = model.forward(&tokens, None);
            let held: Vec<Option<usize>> = model
                .layers
                .iter()
                .map(|(_, unit)| unit.gathered_bytes())
                .collect();
            logits.square().sum(Kind::Float).backward();
            (held, gradients(&model))
        };
        let (freed, grads) = run(ReshardAfterForward::Default);
        assert_eq!(freed, vec![Some(0); args.n_layers as usize]);
        let (kept, kept_grads) = run(ReshardAfterForward::Never);
        assert_eq!(kept, vec![None; args.n_layers as usize], "nothing to free");
        for (a, b) in grads.iter().zip(&kept_grads) {
            assert_eq!(a.kind(), Kind::Float);
            assert!(a.equal(b));
        }
    }

    /// On one process the split model is the model: the same parameters from the same seed, and
    /// the same logits and gradients bit for bit, for every family (dense, q/k norms and tied
    /// embeddings, latent attention with experts), with and without documents.
    #[test]
    fn one_process_runs_the_decoder_bit_for_bit() {
        let _generator = crate::rng::global_generator();
        for (family, flavor) in [
            ("llama3", "debugmodel"),
            ("qwen3", "debugmodel"),
            ("qwen3", "debugmodel_moe"),
            ("deepseek_v3", "debugmodel"),
        ] {
            let args = args(family, flavor);
            tch::manual_seed(3);
            let decoder = Decoder::new(args.clone(), Device::Cpu).unwrap();
            tch::manual_seed(3);
            let split = ParallelModel::new(args.clone(), Device::Cpu, &ParallelPlan::single())
                .unwrap()
                .with_attn_backend(AttnBackend::Flex, Kind::Float);
            let names =
                |p: &[(String, Tensor)]| p.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            assert_eq!(
                names(decoder.named_parameters()),
                names(split.named_parameters())
            );
            for ((n, a), (_, b)) in decoder
                .named_parameters()
                .iter()
                .zip(split.named_parameters())
            {
                assert!(a.equal(b), "{family}: {n} drawn differently");
            }
            let tokens = Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 8, 4]).view([1, 8]);
            let positions = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2, 3, 0]).view([1, 8]);
            for docs in [None, Some(&positions)] {
                let run = |logits: Tensor, params: &[(String, Tensor)]| {
                    logits.square().sum(Kind::Float).backward();
                    let grads: Vec<Tensor> = params
                        .iter()
                        .map(|(_, p)| {
                            let g = p.grad();
                            let out = g.copy();
                            let _ = p.grad().zero_();
                            out
                        })
                        .collect();
                    (logits.detach(), grads)
                };
                let (want, want_grads) =
                    run(decoder.forward(&tokens, docs), decoder.named_parameters());
                let (got, got_grads) = run(split.forward(&tokens, docs), split.named_parameters());
                assert!(
                    got.equal(&want),
                    "{family} documents {}: logits",
                    docs.is_some()
                );
                for (i, (g, w)) in got_grads.iter().zip(&want_grads).enumerate() {
                    let name = &split.named_parameters()[i].0;
                    assert!(
                        g.equal(w),
                        "{family} documents {}: {name}'s gradient",
                        docs.is_some()
                    );
                }
            }
        }
    }
}
