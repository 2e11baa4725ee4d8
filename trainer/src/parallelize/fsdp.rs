//! FSDP2 over the `dp_shard` group (HSDP with `dp_replicate`): each unit (a transformer block,
//! the embeddings, the final norm with the output) keeps its parameters as dim-0 shards, the
//! autograd leaves AdamW steps. [`FsdpUnit::gather`] all-gathers them in the parameter dtype in
//! one collective per unit, through an autograd function whose backward casts the gradients to
//! the reduce dtype and reduce-scatters them (then all-reduces across replicas), so each rank's
//! shards receive the summed gradient of their rows. With `reshard_after_forward` the gathered
//! parameters' memory is freed after the unit's forward ([`FsdpUnit::after_forward`]) and
//! gathered again, into the same tensors autograd saved, when the backward pass reaches the unit.
//! Under pipeline parallelism a unit that does not reshard after forward keeps its first gather
//! of a step for the step's other microbatches (FSDP2 under torch's pipeline schedules keeps a
//! stage unsharded until the step's last backward), until [`FsdpUnit::release`]; and every unit
//! sums its unsharded gradients over the step's microbatches, in the reduce dtype, and reduces
//! them once, after the last backward ([`FsdpUnit::reduce_accumulated`]), as torch's pipeline
//! stage does (`set_requires_gradient_sync(False)`, then `perform_reduce_grad`).
//!
//! Overlap: the gradient reduction of a unit runs in the background while backward goes on
//! through the units before it; [`Reductions::drain`] waits for it at the end of the
//! step's backward passes. [`FsdpUnit::prefetch`] starts a unit's all-gather in the background (in issue order
//! with the group's other collectives, see [`crate::distributed::Group`]): the model prefetches the next
//! unit while the current one computes in forward, and the backward pass prefetches the previous
//! unit's re-gather while the current unit's backward runs. A prefetch is only ever consumed in
//! the pass that issued it (each forward drops leftovers first: the shards change in between).
//!
//! With one shard and one replica nothing is gathered: the unit hands out its parameters (cast
//! to the parameter dtype if that differs, as FSDP2's mixed precision policy does). With one
//! shard and several replicas (DDP, `data_parallel_replicate_degree` alone) nothing is gathered
//! or copied either (the forward uses the parameters' own memory where the dtype is theirs), and
//! each unit's gradients, packed into one buffer (its bucket), are all-reduced in place over the
//! replicas in the background while backward goes on, as DDP's buckets are.
//!
//! Float8 all-gather (`float8.enable_fsdp_float8_all_gather`, torchao's
//! `WeightWithDynamicFloat8CastTensor`): the weights of tensorwise float8 linears are cast to
//! float8 on each rank before the gather, from the shard in its own dtype, with one scale per
//! weight taken from the whole weight's amax (a max all-reduce over the shard and tp groups, or
//! [`precompute_float8_scales`] once per optimizer step), and gathered as float8: a quarter of
//! the fp32 bytes, half of bf16's. The float8 linear multiplies the gathered values as they are
//! ([`Float8Weight`]); autograd still hands the weight's gradient, in high precision, to the
//! gather's backward through a placeholder of the weight's shape that holds no memory. Every
//! parameter of a unit is gathered in one collective, packed as bytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use super::Placement;
use super::tp::TensorParallel;
use crate::autograd::{self, Function};
use crate::distributed::{Group, Pending, ReduceOp};
use crate::float8::{Float8Weight, WEIGHT_KIND};

/// The groups and dtypes FSDP works with.
#[derive(Clone)]
pub struct FsdpMesh {
    pub shard: Group,
    pub replicate: Group,
    /// `mixed_precision_param`: the dtype parameters are gathered and computed in.
    pub param_kind: Kind,
    /// `mixed_precision_reduce`: the dtype gradients are reduced in.
    pub reduce_kind: Kind,
    /// Every unit's gradient reductions in flight, oldest first (one queue per model).
    pub reductions: Reductions,
}

/// How many gradient reductions may be in flight at once: the one a unit's backward just
/// started and the one before it, as FSDP2 keeps about two reduce-scatter states. Each holds its
/// unit's whole gradients in the reduce dtype (its send buffer), so holding every unit's until
/// the step ends costs a model's worth of fp32 gradients.
pub const REDUCTIONS_IN_FLIGHT: usize = 2;

/// The gradient reductions of a model's units in issue order. A finished one is added to its
/// unit's shards' gradients and its buffers freed as soon as a later unit starts one (or the
/// step's [`Reductions::drain`]); past [`REDUCTIONS_IN_FLIGHT`] the oldest is waited
/// for. Issue order is kept, so each shard's gradient sums its microbatches in order.
#[derive(Clone, Default)]
pub struct Reductions(Arc<Mutex<ReductionQueue>>);

/// Reductions in flight, oldest first, each with the unit whose shards it reduces.
type ReductionQueue = VecDeque<(Arc<UnitState>, Reduction)>;

impl Reductions {
    fn queue(&self) -> std::sync::MutexGuard<'_, ReductionQueue> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Settles what has finished, and waits for the oldest while `REDUCTIONS_IN_FLIGHT` are in
    /// flight: a unit's backward calls it before it allocates its own reduction's buffers, so
    /// that no more than `REDUCTIONS_IN_FLIGHT` send buffers are ever alive (the memory
    /// estimate's count).
    fn make_room(&self) {
        Self::settle(self.queue(), REDUCTIONS_IN_FLIGHT - 1);
    }

    /// Queues `reduction` of `unit`, then settles what has finished.
    fn push(&self, unit: Arc<UnitState>, reduction: Reduction) {
        let mut queue = self.queue();
        queue.push_back((unit, reduction));
        Self::settle(queue, REDUCTIONS_IN_FLIGHT);
    }

    /// Adds finished reductions to their shards' gradients, oldest first, waiting for the
    /// oldest while more than `keep` are queued.
    fn settle(mut queue: std::sync::MutexGuard<'_, ReductionQueue>, keep: usize) {
        loop {
            let over = queue.len() > keep;
            let Some((_, oldest)) = queue.front_mut() else {
                break;
            };
            let done = match oldest.pending.try_result() {
                Some(result) => Some(result),
                None if over => None,
                None => break,
            };
            let (unit, r) = queue.pop_front().expect("the front was just seen");
            match done {
                Some(result) => panic_on(result),
                None => panic_on(r.pending.wait()),
            }
            unit.apply_reduced(&r.recv);
        }
    }

    /// Waits for every reduction in flight and adds each to its unit's shards' gradients: call
    /// after the last backward of a step, before reading gradients.
    pub fn drain(&self) {
        let mut queue = self.queue();
        while let Some((unit, r)) = queue.pop_front() {
            panic_on(r.pending.wait());
            unit.apply_reduced(&r.recv);
        }
    }
}

/// Where one parameter's shard sits in a unit's per-rank buffer.
#[derive(Debug, Clone)]
struct Slot {
    /// TP-local shape (what the gather rebuilds).
    full: Vec<i64>,
    rows_per_shard: i64,
    row_elems: i64,
    /// Element offset inside each rank's buffer.
    offset: i64,
    local_rows: i64,
}

/// Which of a unit's parameters FSDP gathers in float8, and what their amax spans.
#[derive(Clone)]
pub struct Float8Gather {
    /// Per parameter of the unit: the scale it is cast with, as an index into the unit's scales
    /// (parameters one float8 linear multiplies together, as q, k and v of a fused `wqkv`, share
    /// one), or `None`: gathered in the parameter dtype.
    pub scale_of: Vec<Option<usize>>,
    /// Tensor parallelism's group: a weight's amax spans its tp shards too.
    pub tp: TensorParallel,
}

impl Float8Gather {
    fn scales(&self) -> usize {
        self.scale_of.iter().flatten().max().map_or(0, |m| m + 1)
    }
}

/// Where each parameter sits in a rank's part of the gather buffer, which is bytes: parameters
/// of several dtypes (float8 weights next to norms) travel in one collective.
#[derive(Debug, Clone)]
struct GatherLayout {
    /// Per parameter: the dtype it is gathered in and its byte offset.
    kinds: Vec<Kind>,
    offsets: Vec<i64>,
    /// Bytes per rank.
    per_rank: i64,
}

/// Byte alignment of each parameter in the gather buffer (views of any dtype start aligned).
const GATHER_ALIGN: i64 = 16;

impl GatherLayout {
    fn new(slots: &[Slot], kinds: Vec<Kind>) -> Self {
        let mut offset = 0;
        let offsets = slots
            .iter()
            .zip(&kinds)
            .map(|(slot, kind)| {
                let at = offset;
                let bytes = slot.rows_per_shard * slot.row_elems * kind.elt_size_in_bytes() as i64;
                offset += (bytes as u64).div_ceil(GATHER_ALIGN as u64) as i64 * GATHER_ALIGN;
                at
            })
            .collect();
        GatherLayout {
            kinds,
            offsets,
            per_rank: offset,
        }
    }

    fn uniform(slots: &[Slot], kind: Kind) -> Self {
        Self::new(slots, vec![kind; slots.len()])
    }
}

/// What the unit's autograd functions share.
struct UnitState {
    mesh: FsdpMesh,
    slots: Vec<Slot>,
    /// Elements per rank of the gradient reduction (in the reduce dtype).
    per_rank: i64,
    /// How the forward's gathers pack the parameters.
    layout: GatherLayout,
    float8: Option<Float8Gather>,
    /// When the unit frees and reduces over a step.
    policy: UnitPolicy,
    tensors: Mutex<UnitTensors>,
}

struct UnitTensors {
    /// The shards (autograd leaves).
    shards: Vec<Tensor>,
    /// The gathered parameters of the forward in flight (kept to free and refill them).
    gathered: Vec<Tensor>,
    /// An all-gather of the shards running in the background.
    prefetched: Option<Prefetch>,
    /// Float8 all-gather: the scales of the shards' current values (one per scale group),
    /// computed by the first gather after they changed, or precomputed after the optimizer step.
    scales: Option<Tensor>,
    precomputed: Option<Tensor>,
    /// Float8 all-gather: the float8 weights of the last gather, by parameter.
    gathered_float8: Vec<Option<Float8Weight>>,
    /// With `keep_gathered_for_step`: the unsharded values the step's first gather made (as
    /// [`UnitState::unshard`] returns them), until [`FsdpUnit::release`] (the model calls it
    /// when the step's backward passes are done, and after validation).
    kept_for_step: Option<Vec<Tensor>>,
    /// With `reduce_once_per_step`: the unsharded gradients of the step's microbatches so far,
    /// summed in the reduce dtype and packed as the reduction sends them (its send buffer).
    accumulated: Option<Tensor>,
}

/// When a unit frees its gathered parameters and reduces its gradients: FSDP2's per-module
/// settings, which [`crate::parallelize::ParallelPlan::unit_policy`] chooses.
#[derive(Clone, Copy, Debug)]
pub struct UnitPolicy {
    /// FSDP2's `reshard_after_forward`: free the gathered parameters after the unit's forward
    /// and gather them again for its backward.
    pub reshard_after_forward: bool,
    /// Under pipeline parallelism (not resharded after forward): the first gather of a step is
    /// kept for the step's other microbatches, as FSDP2 under torch's pipeline schedules keeps
    /// a unit unsharded from its first forward to the step's end.
    pub keep_gathered_for_step: bool,
    /// Under pipeline parallelism: the gradients of the step's microbatches are summed
    /// unsharded and reduced once, after the last backward (torch's pipeline stage turns
    /// gradient sync off for its backwards and reduces in `perform_reduce_grad`).
    pub reduce_once_per_step: bool,
}

/// A gradient reduction running in the background.
struct Reduction {
    pending: Pending,
    /// This rank's reduced shards, packed as the gather packs them.
    recv: Tensor,
    /// Read by the background collective until it completes.
    _send: Tensor,
}

struct Prefetch {
    pending: Pending,
    recv: Tensor,
    /// Read by the background collective until it completes.
    _send: Tensor,
}

/// One FSDP unit.
#[derive(Clone)]
pub struct FsdpUnit {
    state: Arc<UnitState>,
}

fn panic_on<E: std::fmt::Display>(r: Result<(), E>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

impl UnitState {
    fn communicates(&self) -> bool {
        self.mesh.shard.size() > 1 || self.mesh.replicate.size() > 1
    }

    /// Whether `shards` (the unit's) are in another dtype than the parameters compute in (fp32
    /// master weights under `mixed_precision_param`): every gather is then a cast copy, even of
    /// one shard. Every shard or none: one already in the parameter dtype would be its own
    /// copy, and freeing that would free the shard. (Asked at each gather: `training.dtype =
    /// bfloat16` casts the shards after the units are built.)
    fn casts(&self, shards: &[Tensor]) -> bool {
        !shards.is_empty() && shards.iter().all(|s| s.kind() != self.mesh.param_kind)
    }

    /// Whether the gathered parameters are freed after the unit's forward: FSDP2's
    /// `reshard_after_forward`, where they are copies (gathered, or cast).
    fn frees_after_forward(&self, shards: &[Tensor]) -> bool {
        self.policy.reshard_after_forward && (self.mesh.shard.size() > 1 || self.casts(shards))
    }

    fn tensors(&self) -> std::sync::MutexGuard<'_, UnitTensors> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fresh unsharded parameters as the forward gathers them (no autograd): each in the
    /// parameter dtype, or a float8 weight's values in float8. From a finished prefetch of the
    /// current shards, or gathered now.
    fn unshard(&self, t: &mut UnitTensors, prefetched: Option<Prefetch>) -> Vec<Tensor> {
        if let Some(p) = prefetched {
            panic_on(p.pending.wait());
            return self.split_gathered(&p.recv, &self.layout);
        }
        let scales = self.float8_scales(t);
        self.gather_now(&t.shards, &self.layout, scales.as_ref())
    }

    /// Fresh unsharded parameters from `shards`, packed as `layout` says, float8 weights cast
    /// with `scales` (no autograd).
    fn gather_now(
        &self,
        shards: &[Tensor],
        layout: &GatherLayout,
        scales: Option<&Tensor>,
    ) -> Vec<Tensor> {
        // One shard (DDP: replicas alone): nothing to gather (and no float8 layout: see
        // `gather_in_float8`), and nothing to copy where the dtype is the parameter's: the
        // forward uses the shards' own memory (never freed after forward: a unit of one
        // shard does not reshard), as DDP's module uses its parameters.
        if self.mesh.shard.size() == 1 {
            return shards
                .iter()
                .zip(&layout.kinds)
                .map(|(s, &kind)| s.detach().to_kind(kind))
                .collect();
        }
        let (send, recv) = self.gather_buffers(shards, layout, scales);
        panic_on(self.mesh.shard.all_gather(&recv, &send));
        self.split_gathered(&recv, layout)
    }

    /// This rank's padded shards packed in one byte buffer as `layout` says, and the buffer
    /// the all-gather fills.
    fn gather_buffers(
        &self,
        shards: &[Tensor],
        layout: &GatherLayout,
        scales: Option<&Tensor>,
    ) -> (Tensor, Tensor) {
        let device = shards[0].device();
        let send = Tensor::zeros([layout.per_rank], (Kind::Uint8, device));
        for (i, (slot, s)) in self.slots.iter().zip(shards).enumerate() {
            if slot.local_rows == 0 {
                continue;
            }
            let kind = layout.kinds[i];
            let n = slot.local_rows * slot.row_elems;
            let mut at = send
                .narrow(0, layout.offsets[i], n * kind.elt_size_in_bytes() as i64)
                .view_dtype(kind);
            let value = s.detach().reshape([-1]);
            match self.scale_index(i).zip(scales) {
                Some((g, scales)) if kind == WEIGHT_KIND => {
                    at.copy_(&Float8Weight::cast(&value, &scales.get(g as i64)))
                }
                _ => at.copy_(&value),
            };
        }
        let size = self.mesh.shard.size() as i64;
        let recv = Tensor::empty([size * layout.per_rank], (Kind::Uint8, device));
        (send, recv)
    }

    /// The whole (TP-local) parameters out of every rank's packed shards.
    fn split_gathered(&self, recv: &Tensor, layout: &GatherLayout) -> Vec<Tensor> {
        let size = self.mesh.shard.size() as i64;
        let per_rank = recv.view([size, layout.per_rank]);
        self.slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let kind = layout.kinds[i];
                let n = slot.rows_per_shard * slot.row_elems;
                let mut shape = slot.full.clone();
                shape[0] = size * slot.rows_per_shard;
                per_rank
                    .narrow(1, layout.offsets[i], n * kind.elt_size_in_bytes() as i64)
                    .view_dtype(kind)
                    .reshape(shape.as_slice())
                    .narrow(0, 0, slot.full[0])
                    .contiguous()
            })
            .collect()
    }

    /// The scale group parameter `i` is gathered in float8 with, if it is.
    fn scale_index(&self, i: usize) -> Option<usize> {
        self.float8.as_ref().and_then(|f| f.scale_of[i])
    }

    /// This rank's amax of each scale group's weights (f32, one per group).
    fn local_amaxes(&self, shards: &[Tensor]) -> Option<Tensor> {
        let f8 = self.float8.as_ref()?;
        let device = shards[0].device();
        let amaxes = Tensor::zeros([f8.scales() as i64], (Kind::Float, device));
        for (i, s) in shards.iter().enumerate() {
            if let Some(g) = f8.scale_of[i]
                && s.numel() > 0
            {
                let amax = s.detach().abs().max().to_kind(Kind::Float);
                let mut slot = amaxes.get(g as i64);
                slot.copy_(&amax.maximum(&slot));
            }
        }
        Some(amaxes)
    }

    /// The float8 scales the next gather casts with: precomputed, cached since the shards last
    /// changed, or computed now from the amaxes of the whole weights (a collective).
    fn float8_scales(&self, t: &mut UnitTensors) -> Option<Tensor> {
        if let Some(p) = &t.precomputed {
            return Some(p.shallow_clone());
        }
        if let Some(s) = &t.scales {
            return Some(s.shallow_clone());
        }
        let amaxes = tch::no_grad(|| self.local_amaxes(&t.shards))?;
        let f8 = self.float8.as_ref()?;
        panic_on(self.mesh.shard.all_reduce(&amaxes, ReduceOp::Max));
        f8.tp.all_reduce_max(&amaxes);
        let scales = Float8Weight::scale_for(&amaxes);
        t.scales = Some(scales.shallow_clone());
        Some(scales)
    }

    /// Starts gathering the current shards in the background (nothing if one is running or
    /// there is nothing to gather).
    fn prefetch(&self) {
        if self.mesh.shard.size() == 1 {
            return;
        }
        let mut t = self.tensors();
        if t.prefetched.is_some() || t.kept_for_step.is_some() {
            return;
        }
        let scales = self.float8_scales(&mut t);
        let (send, recv) =
            tch::no_grad(|| self.gather_buffers(&t.shards, &self.layout, scales.as_ref()));
        let pending = self.mesh.shard.all_gather_async(&recv, &send);
        t.prefetched = Some(Prefetch {
            pending,
            recv,
            _send: send,
        });
    }

    /// Packs `grads` (the unit's unsharded gradients) into `send` (shard size x `per_rank`, the
    /// reduce dtype) as the reduce-scatter sends them: each rank's rows of every parameter in
    /// that rank's part, a short last part's padding left as it is. Adds to what `send` holds
    /// when `add` (in the reduce dtype: FSDP2 adds a param-dtype gradient to its reduce-dtype
    /// sum the same way), else overwrites (casting).
    fn pack_gradients(&self, send: &Tensor, grads: &[Tensor], add: bool) {
        for (slot, g) in self.slots.iter().zip(grads) {
            // A backward that reached only some of the unit's parameters (a zero-bubble weight
            // pass brings one linear's) adds nothing for the others.
            if !g.defined() {
                assert!(add, "a unit's first gradients come for all its parameters");
                continue;
            }
            let n = slot.rows_per_shard * slot.row_elems;
            let part = send.narrow(1, slot.offset, n);
            let flat = g.reshape([-1]);
            let numel = flat.numel() as i64;
            let (rows, rest) = (numel / n, numel % n);
            let put = |mut to: Tensor, from: Tensor| {
                if add {
                    let _ = to.g_add_(&from);
                } else {
                    to.copy_(&from);
                }
            };
            if rows > 0 {
                put(
                    part.narrow(0, 0, rows),
                    flat.narrow(0, 0, rows * n).view([rows, n]),
                );
            }
            if rest > 0 {
                put(
                    part.get(rows).narrow(0, 0, rest),
                    flat.narrow(0, rows * n, rest),
                );
            }
        }
    }

    /// Starts reducing the unsharded gradients of one backward in the background: cast to the
    /// reduce dtype, summed over the shard group (each rank keeps its rows), then over the
    /// replicas. The shards get them in [`Reductions::drain`].
    fn start_reduction(self: &Arc<Self>, grads: &[Tensor]) {
        self.mesh.reductions.make_room();
        let size = self.mesh.shard.size() as i64;
        let send = Tensor::zeros(
            [size, self.per_rank],
            (self.mesh.reduce_kind, grads[0].device()),
        );
        self.pack_gradients(&send, grads, false);
        self.reduce(send);
    }

    /// Adds one microbatch's unsharded gradients to the step's sum (reduced once, by
    /// [`FsdpUnit::reduce_accumulated`]).
    fn accumulate(&self, grads: &[Tensor]) {
        let size = self.mesh.shard.size() as i64;
        let mut t = self.tensors();
        // On the shards' device: a backward may bring no gradient for the first parameter.
        let device = t.shards[0].device();
        let sum = t.accumulated.get_or_insert_with(|| {
            Tensor::zeros([size, self.per_rank], (self.mesh.reduce_kind, device))
        });
        tch::no_grad(|| self.pack_gradients(sum, grads, true));
    }

    /// Starts the reduction of `send` (packed gradients, as [`UnitState::pack_gradients`]
    /// packs them) in the background and queues it.
    fn reduce(self: &Arc<Self>, send: Tensor) {
        let kind = self.mesh.reduce_kind;
        let size = self.mesh.shard.size() as i64;
        let device = send.device();
        let replicas = (self.mesh.replicate.size() > 1).then_some(&self.mesh.replicate);
        let reduction = match replicas {
            // DDP: the packed gradients are the unit's bucket, all-reduced in place over the
            // replicas (no reduce-scatter over a group of one, which would copy it once more).
            Some(replicate) if size == 1 => {
                let bucket = send.view([-1]);
                Reduction {
                    pending: replicate.all_reduce_async(&bucket, ReduceOp::Sum),
                    recv: bucket,
                    _send: send,
                }
            }
            _ => {
                let recv = Tensor::empty([self.per_rank], (kind, device));
                let pending =
                    self.mesh
                        .shard
                        .reduce_scatter_async(&recv, &send.view([-1]), replicas);
                Reduction {
                    pending,
                    recv,
                    _send: send,
                }
            }
        };
        self.mesh.reductions.push(Arc::clone(self), reduction);
    }

    /// Adds a finished reduction's result (this rank's rows of every parameter, packed as the
    /// gather packs them) to the shards' gradients.
    fn apply_reduced(&self, recv: &Tensor) {
        let shards: Vec<Tensor> = self
            .tensors()
            .shards
            .iter()
            .map(|s| s.shallow_clone())
            .collect();
        tch::no_grad(|| {
            for (slot, shard) in self.slots.iter().zip(&shards) {
                let mut shape = slot.full.clone();
                shape[0] = slot.local_rows;
                let g = recv
                    .narrow(0, slot.offset, slot.local_rows * slot.row_elems)
                    .view(shape.as_slice())
                    .to_kind(shard.kind());
                crate::optim::accumulate_grad(shard, &g);
            }
        });
    }
}

/// All-gather in forward, reduce-scatter in backward. A weight gathered in float8 comes out as
/// a placeholder of its shape (no memory) and its float8 values go to `gathered_float8`.
struct AllGather(Arc<UnitState>);

impl Function for AllGather {
    fn forward(&mut self, _shards: &[Tensor]) -> Vec<Tensor> {
        let s = &self.0;
        let mut t = s.tensors();
        let prefetched = t.prefetched.take();
        let gathered = match &t.kept_for_step {
            // Aliases, not the kept tensors themselves: each microbatch's gather is an
            // autograd node of its own.
            Some(kept) => {
                // (A prefetch is not started while a gather is kept; one from before waits.)
                if let Some(p) = prefetched {
                    panic_on(p.pending.wait());
                }
                kept.iter().map(|g| g.detach()).collect()
            }
            None => {
                let gathered = s.unshard(&mut t, prefetched);
                if s.policy.keep_gathered_for_step {
                    t.kept_for_step = Some(gathered.iter().map(|g| g.detach()).collect());
                }
                gathered
            }
        };
        let scales = s.float8_scales(&mut t);
        let mut float8 = Vec::with_capacity(gathered.len());
        let out = gathered
            .into_iter()
            .enumerate()
            .map(|(i, g)| match s.scale_index(i).zip(scales.as_ref()) {
                Some((group, scales)) => {
                    let placeholder =
                        Float8Weight::placeholder(&g.size(), s.mesh.param_kind, g.device());
                    float8.push(Some(Float8Weight {
                        data: g,
                        scale: scales.get(group as i64),
                    }));
                    placeholder
                }
                None => {
                    float8.push(None);
                    g
                }
            })
            .collect();
        t.gathered_float8 = float8;
        out
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        // The unit's backward is done: its gathered parameters may go.
        let n = {
            let mut t = self.0.tensors();
            t.gathered.clear();
            t.shards.len()
        };
        // A unit that only casts (one shard, no replicas) has nothing to reduce: its gradients
        // go to the shards through autograd, cast to their dtype, which sums them over the
        // step's microbatches in fp32 as FSDP2's reduction would.
        if !self.0.communicates() {
            let t = self.0.tensors();
            return grads
                .iter()
                .zip(&t.shards)
                .map(|(g, s)| {
                    if g.defined() {
                        g.to_kind(s.kind())
                    } else {
                        Tensor::new()
                    }
                })
                .collect();
        }
        // The reduction runs while backward goes on (or, under pipeline parallelism, once
        // the step's backwards are done); the shards' gradients arrive in `Reductions::drain`,
        // so autograd gets none here.
        if self.0.policy.reduce_once_per_step {
            self.0.accumulate(grads);
        } else {
            self.0.start_reduction(grads);
        }
        (0..n).map(|_| Tensor::new()).collect()
    }
}

/// Identity in forward; in backward, before the unit's own backward runs, gathers the unit's
/// parameters again into the tensors the forward freed (FSDP2's pre-backward unshard), then
/// starts gathering the unit before it (the next one backward reaches).
struct RegatherBeforeBackward {
    unit: Arc<UnitState>,
    previous: Option<Arc<UnitState>>,
}

impl Function for RegatherBeforeBackward {
    fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
        vec![x[0].shallow_clone()]
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        let (gathered, prefetched) = {
            let mut t = self.unit.tensors();
            let gathered: Vec<Tensor> = t.gathered.iter().map(|x| x.shallow_clone()).collect();
            (gathered, t.prefetched.take())
        };
        if !gathered.is_empty() {
            let fresh = tch::no_grad(|| {
                let mut t = self.unit.tensors();
                self.unit.unshard(&mut t, prefetched)
            });
            for (freed, value) in gathered.iter().zip(&fresh) {
                autograd::resize_storage(freed, value.numel() * value.kind().elt_size_in_bytes());
                autograd::copy_keep_version(freed, value);
            }
        }
        if let Some(previous) = &self.previous {
            previous.prefetch();
        }
        vec![grads[0].shallow_clone()]
    }
}

impl FsdpUnit {
    /// A unit over `shards` (the autograd leaves, each this rank's part per `placements`).
    pub fn new(
        mesh: &FsdpMesh,
        shards: Vec<Tensor>,
        placements: &[&Placement],
        policy: UnitPolicy,
    ) -> Self {
        let mut offset = 0;
        let slots: Vec<Slot> = placements
            .iter()
            .map(|p| {
                let mut full = p.local.clone();
                if let Some(first) = full.first_mut() {
                    *first = p.tp_local_rows;
                }
                let row_elems = full.iter().skip(1).product::<i64>();
                let slot = Slot {
                    row_elems,
                    rows_per_shard: p.rows_per_shard,
                    offset,
                    local_rows: p.local.first().copied().unwrap_or(1),
                    full,
                };
                offset += p.rows_per_shard * row_elems;
                slot
            })
            .collect();
        let layout = GatherLayout::uniform(&slots, mesh.param_kind);
        FsdpUnit {
            state: Arc::new(UnitState {
                mesh: mesh.clone(),
                slots,
                per_rank: offset,
                layout,
                float8: None,
                policy,
                tensors: Mutex::new(UnitTensors {
                    shards,
                    gathered: Vec::new(),
                    prefetched: None,
                    scales: None,
                    precomputed: None,
                    gathered_float8: Vec::new(),
                    kept_for_step: None,
                    accumulated: None,
                }),
            }),
        }
    }

    /// Gathers the weights `float8` names in float8 (the float8 all-gather). Call before the
    /// unit's first gather; nothing changes for a unit whose shard group is one rank (nothing
    /// is gathered: replicas alone, as DDP, keep casting in the layer).
    pub fn gather_in_float8(&mut self, float8: Float8Gather) {
        if self.state.mesh.shard.size() == 1 || float8.scales() == 0 {
            return;
        }
        let state = Arc::get_mut(&mut self.state)
            .expect("the float8 all-gather is set before the unit's first gather");
        assert_eq!(
            float8.scale_of.len(),
            state.slots.len(),
            "one entry per parameter"
        );
        let kinds = float8
            .scale_of
            .iter()
            .map(|g| match g {
                Some(_) => WEIGHT_KIND,
                None => state.mesh.param_kind,
            })
            .collect();
        state.layout = GatherLayout::new(&state.slots, kinds);
        state.float8 = Some(float8);
    }

    /// Whether the unit gathers some weights in float8.
    pub fn gathers_float8(&self) -> bool {
        self.state.float8.is_some()
    }

    /// The unit's unsharded parameters, connected to the shards through autograd.
    pub fn gather(&self) -> Gathered {
        let s = &self.state;
        let shards: Vec<Tensor> = s
            .tensors()
            .shards
            .iter()
            .map(|t| t.shallow_clone())
            .collect();
        // One process's parameters in their own dtype: the forward computes with the shards.
        if !s.communicates() && !s.casts(&shards) {
            return Gathered {
                float8: vec![None; shards.len()],
                params: shards,
            };
        }
        let refs: Vec<&Tensor> = shards.iter().collect();
        let params = autograd::apply(AllGather(s.clone()), &refs, refs.len());
        let mut t = s.tensors();
        let float8 = std::mem::take(&mut t.gathered_float8);
        // Under no_grad (validation, a checkpointed region's first run) nothing is saved to free.
        // Nothing to free with one shard in the parameter dtype (the forward uses the shards'
        // memory); a cast copy is freed as a gather is, as FSDP2 on one rank frees its
        // unsharded parameters.
        if s.frees_after_forward(&shards) && params.first().is_some_and(|t| t.requires_grad()) {
            // What holds the gathered memory: a float8 weight's values, not its placeholder.
            t.gathered = params
                .iter()
                .zip(&float8)
                .map(|(p, f8)| match f8 {
                    Some(w) => w.data.shallow_clone(),
                    None => p.shallow_clone(),
                })
                .collect();
        }
        Gathered { params, float8 }
    }

    /// The unit's whole (TP-local) parameters in their own dtype, outside autograd. A
    /// collective: every rank of the shard group calls it.
    pub fn full_masters(&self) -> Vec<Tensor> {
        let shards: Vec<Tensor> = self
            .state
            .tensors()
            .shards
            .iter()
            .map(|t| t.detach())
            .collect();
        let kind = shards.first().map_or(Kind::Float, |t| t.kind());
        let layout = GatherLayout::uniform(&self.state.slots, kind);
        self.state.gather_now(&shards, &layout, None)
    }

    /// The bytes the gathered parameters of the forward in flight hold now, if the unit keeps
    /// them to free (0 once freed after forward).
    #[cfg(test)]
    pub fn gathered_bytes(&self) -> Option<usize> {
        let t = self.state.tensors();
        (!t.gathered.is_empty())
            .then(|| t.gathered.iter().map(crate::autograd::storage_nbytes).sum())
    }

    /// Whether the unit frees its gathered parameters after forward (and gathers them again
    /// when backward reaches it).
    pub fn reshards_after_forward(&self) -> bool {
        let s = &self.state;
        s.frees_after_forward(&s.tensors().shards)
    }

    /// Starts gathering this unit's parameters in the background, for its next
    /// [`FsdpUnit::gather`] in the same pass.
    pub fn prefetch(&self) {
        self.state.prefetch();
    }

    /// Under pipeline parallelism: starts reducing the gradients the step's microbatches
    /// summed (nothing if the unit has none). Call after the step's last backward, before
    /// [`Reductions::drain`]; a collective: every rank of the shard group calls it for
    /// its units in the same order.
    pub fn reduce_accumulated(&self) {
        let Some(sum) = self.state.tensors().accumulated.take() else {
            return;
        };
        self.state.mesh.reductions.make_room();
        self.state.reduce(sum);
    }

    /// Lets go of a gather kept for the step, and of the float8 scales it was cast with: call
    /// when the step's passes are done (the shards change before the next gather).
    pub fn release(&self) {
        let mut t = self.state.tensors();
        t.kept_for_step = None;
        t.scales = None;
    }

    /// Waits for and drops a prefetch no gather took, and the float8 scales computed for it
    /// (the shards may have changed since). Precomputed scales stay, and so do the scales of a
    /// gather kept for the step (its shards have not changed: [`FsdpUnit::release`] drops them).
    pub fn drop_prefetch(&self) {
        let leftover = {
            let mut t = self.state.tensors();
            if t.kept_for_step.is_none() {
                t.scales = None;
            }
            t.prefetched.take()
        };
        if let Some(p) = leftover {
            panic_on(p.pending.wait());
        }
    }

    /// After the unit's forward: frees the gathered parameters (when resharding) and returns
    /// `out` wrapped so that the backward pass gathers them again before it needs them, and then
    /// starts gathering `previous` (the unit backward reaches next).
    pub fn after_forward(&self, out: Tensor, previous: Option<&FsdpUnit>) -> Tensor {
        let s = &self.state;
        let t = s.tensors();
        if t.gathered.is_empty() {
            return out;
        }
        for g in &t.gathered {
            autograd::resize_storage(g, 0);
        }
        drop(t);
        let regather = RegatherBeforeBackward {
            unit: s.clone(),
            previous: previous.map(|p| p.state.clone()),
        };
        autograd::apply(regather, &[&out], 1).remove(0)
    }
}

/// A unit's gathered parameters: each in the parameter dtype, or for a weight gathered in
/// float8 a placeholder of its shape (the gradient's way back to the shard) and its float8
/// values in `float8`.
pub struct Gathered {
    pub params: Vec<Tensor>,
    pub float8: Vec<Option<Float8Weight>>,
}

/// `precompute_float8_dynamic_scale_for_fsdp`: after the optimizer step, the float8 scales of
/// every weight `units` gather in float8, from one max all-reduce over the shard group (and one
/// over tp) for all of them; the units' gathers use them until the next call. A collective:
/// every rank of the shard group calls it with its units in the same order.
pub fn precompute_float8_scales(units: &[&FsdpUnit]) {
    let units: Vec<&FsdpUnit> = units
        .iter()
        .copied()
        .filter(|u| u.gathers_float8())
        .collect();
    let Some(first) = units.first() else {
        return;
    };
    let amaxes: Vec<Tensor> = tch::no_grad(|| {
        units
            .iter()
            .map(|u| {
                let t = u.state.tensors();
                u.state
                    .local_amaxes(&t.shards)
                    .expect("the unit gathers in float8")
            })
            .collect()
    });
    let all = Tensor::cat(&amaxes, 0);
    let state = &first.state;
    panic_on(state.mesh.shard.all_reduce(&all, ReduceOp::Max));
    if let Some(f8) = &state.float8 {
        f8.tp.all_reduce_max(&all);
    }
    let scales = Float8Weight::scale_for(&all);
    let mut at = 0;
    for (unit, amax) in units.iter().zip(&amaxes) {
        let n = amax.size()[0];
        let mut t = unit.state.tensors();
        t.precomputed = Some(scales.narrow(0, at, n).copy());
        t.scales = None;
        at += n;
    }
}
