//! FSDP2 over the `dp_shard` group (HSDP with `dp_replicate`): each unit (a transformer block,
//! the embeddings, the final norm with the output) keeps its parameters as dim-0 shards, the
//! autograd leaves AdamW steps. [`FsdpUnit::gather`] all-gathers them in the parameter dtype in
//! one collective per unit, through an autograd function whose backward casts the gradients to
//! the reduce dtype and reduce-scatters them (then all-reduces across replicas), so each rank's
//! shards receive the summed gradient of their rows. With `reshard_after_forward` the gathered
//! parameters' memory is freed after the unit's forward ([`FsdpUnit::after_forward`]) and
//! gathered again, into the same tensors autograd saved, when the backward pass reaches the unit.
//!
//! Overlap: the gradient reduction of a unit runs in the background while backward goes on
//! through the units before it; [`FsdpUnit::finish_gradients`] waits for it at the end of the
//! step's backward passes. [`FsdpUnit::prefetch`] starts a unit's all-gather in the background (in issue order
//! with the group's other collectives, see [`crate::distributed::Group`]): the model prefetches the next
//! unit while the current one computes in forward, and the backward pass prefetches the previous
//! unit's re-gather while the current unit's backward runs. A prefetch is only ever consumed in
//! the pass that issued it (each forward drops leftovers first: the shards change in between).
//!
//! With one shard and one replica nothing is gathered: the unit hands out its parameters (cast
//! to the parameter dtype if that differs, as FSDP2's mixed precision policy does).

use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use super::Placement;
use crate::autograd::{self, Function};
use crate::distributed::{Group, Pending};

/// The groups and dtypes FSDP works with.
#[derive(Clone)]
pub struct FsdpMesh {
    pub shard: Group,
    pub replicate: Group,
    /// `mixed_precision_param`: the dtype parameters are gathered and computed in.
    pub param_kind: Kind,
    /// `mixed_precision_reduce`: the dtype gradients are reduced in.
    pub reduce_kind: Kind,
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

/// What the unit's autograd functions share.
struct UnitState {
    mesh: FsdpMesh,
    slots: Vec<Slot>,
    per_rank: i64,
    tensors: Mutex<UnitTensors>,
}

struct UnitTensors {
    /// The shards (autograd leaves).
    shards: Vec<Tensor>,
    /// The gathered parameters of the forward in flight (kept to free and refill them).
    gathered: Vec<Tensor>,
    /// An all-gather of the shards running in the background.
    prefetched: Option<Prefetch>,
    /// Gradient reductions running in the background, one per backward through the unit.
    reducing: Vec<Reduction>,
}

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
    reshard_after_forward: bool,
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

    fn tensors(&self) -> std::sync::MutexGuard<'_, UnitTensors> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fresh unsharded parameters in the parameter dtype (no autograd): from a finished
    /// prefetch of the current shards, or gathered now.
    fn unshard(&self, shards: &[Tensor], prefetched: Option<Prefetch>) -> Vec<Tensor> {
        if let Some(p) = prefetched {
            panic_on(p.pending.wait());
            return self.split_gathered(&p.recv);
        }
        self.unshard_as(shards, self.mesh.param_kind)
    }

    /// Fresh unsharded parameters from `shards` in `kind` (no autograd).
    fn unshard_as(&self, shards: &[Tensor], kind: Kind) -> Vec<Tensor> {
        if self.mesh.shard.size() == 1 {
            return shards
                .iter()
                .map(|s| s.detach().to_kind(kind).copy())
                .collect();
        }
        let (send, recv) = self.gather_buffers(shards, kind);
        panic_on(self.mesh.shard.all_gather(&recv, &send));
        self.split_gathered(&recv)
    }

    /// This rank's padded shards packed in one buffer, and the buffer the all-gather fills.
    fn gather_buffers(&self, shards: &[Tensor], kind: Kind) -> (Tensor, Tensor) {
        let device = shards[0].device();
        let send = Tensor::zeros([self.per_rank], (kind, device));
        for (slot, s) in self.slots.iter().zip(shards) {
            if slot.local_rows > 0 {
                send.narrow(0, slot.offset, slot.local_rows * slot.row_elems)
                    .copy_(&s.detach().reshape([-1]));
            }
        }
        let size = self.mesh.shard.size() as i64;
        let recv = Tensor::empty([size * self.per_rank], (kind, device));
        (send, recv)
    }

    /// The whole (TP-local) parameters out of every rank's packed shards.
    fn split_gathered(&self, recv: &Tensor) -> Vec<Tensor> {
        let size = self.mesh.shard.size() as i64;
        let per_rank = recv.view([size, self.per_rank]);
        self.slots
            .iter()
            .map(|slot| {
                let mut shape = slot.full.clone();
                shape[0] = size * slot.rows_per_shard;
                per_rank
                    .narrow(1, slot.offset, slot.rows_per_shard * slot.row_elems)
                    .reshape(shape.as_slice())
                    .narrow(0, 0, slot.full[0])
                    .contiguous()
            })
            .collect()
    }

    /// Starts gathering the current shards in the background (nothing if one is running or
    /// there is nothing to gather).
    fn prefetch(&self) {
        if self.mesh.shard.size() == 1 {
            return;
        }
        let mut t = self.tensors();
        if t.prefetched.is_some() {
            return;
        }
        let (send, recv) = tch::no_grad(|| self.gather_buffers(&t.shards, self.mesh.param_kind));
        let pending = self.mesh.shard.all_gather_async(&recv, &send);
        t.prefetched = Some(Prefetch {
            pending,
            recv,
            _send: send,
        });
    }

    /// Starts reducing the unsharded gradients in the background: cast to the reduce dtype,
    /// summed over the shard group (each rank keeps its rows), then over the replicas. The
    /// shards get them in [`FsdpUnit::finish_gradients`].
    fn start_reduction(&self, grads: &[Tensor]) {
        let kind = self.mesh.reduce_kind;
        let size = self.mesh.shard.size() as i64;
        let device = grads[0].device();
        let send = Tensor::zeros([size, self.per_rank], (kind, device));
        for (slot, g) in self.slots.iter().zip(grads) {
            let n = slot.rows_per_shard * slot.row_elems;
            let padded = Tensor::zeros([size * n], (kind, device));
            padded
                .narrow(0, 0, g.numel() as i64)
                .copy_(&g.reshape([-1]));
            send.narrow(1, slot.offset, n)
                .copy_(&padded.view([size, n]));
        }
        let recv = Tensor::empty([self.per_rank], (kind, device));
        let replicas = (self.mesh.replicate.size() > 1).then_some(&self.mesh.replicate);
        let pending = self
            .mesh
            .shard
            .reduce_scatter_async(&recv, &send.view([-1]), replicas);
        self.tensors().reducing.push(Reduction {
            pending,
            recv,
            _send: send,
        });
    }

    /// Waits for the background reductions and adds their results to the shards' gradients.
    fn finish_reductions(&self) {
        let (reducing, shards) = {
            let mut t = self.tensors();
            let shards: Vec<Tensor> = t.shards.iter().map(|s| s.shallow_clone()).collect();
            (std::mem::take(&mut t.reducing), shards)
        };
        for r in reducing {
            panic_on(r.pending.wait());
            tch::no_grad(|| {
                for (slot, shard) in self.slots.iter().zip(&shards) {
                    let mut shape = slot.full.clone();
                    shape[0] = slot.local_rows;
                    let g = r
                        .recv
                        .narrow(0, slot.offset, slot.local_rows * slot.row_elems)
                        .view(shape.as_slice())
                        .to_kind(shard.kind());
                    crate::optim::accumulate_grad(shard, &g);
                }
            });
        }
    }
}

/// All-gather in forward, reduce-scatter in backward.
struct AllGather(Arc<UnitState>);

impl Function for AllGather {
    fn forward(&mut self, shards: &[Tensor]) -> Vec<Tensor> {
        let prefetched = self.0.tensors().prefetched.take();
        self.0.unshard(shards, prefetched)
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        // The unit's backward is done: its gathered parameters may go.
        let n = {
            let mut t = self.0.tensors();
            t.gathered.clear();
            t.shards.len()
        };
        // The reduction runs while backward goes on; the shards' gradients arrive in
        // `finish_gradients`, so autograd gets none here.
        self.0.start_reduction(grads);
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
        let (shards, gathered, prefetched) = {
            let mut t = self.unit.tensors();
            let clone = |v: &[Tensor]| v.iter().map(|x| x.shallow_clone()).collect::<Vec<_>>();
            (clone(&t.shards), clone(&t.gathered), t.prefetched.take())
        };
        if !gathered.is_empty() {
            let fresh = tch::no_grad(|| self.unit.unshard(&shards, prefetched));
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
        reshard_after_forward: bool,
    ) -> Self {
        let mut offset = 0;
        let slots = placements
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
        let communicates = mesh.shard.size() > 1;
        FsdpUnit {
            state: Arc::new(UnitState {
                mesh: mesh.clone(),
                slots,
                per_rank: offset,
                tensors: Mutex::new(UnitTensors {
                    shards,
                    gathered: Vec::new(),
                    prefetched: None,
                    reducing: Vec::new(),
                }),
            }),
            reshard_after_forward: reshard_after_forward && communicates,
        }
    }

    /// The unit's unsharded parameters, connected to the shards through autograd.
    pub fn gather(&self) -> Vec<Tensor> {
        let s = &self.state;
        let shards: Vec<Tensor> = s
            .tensors()
            .shards
            .iter()
            .map(|t| t.shallow_clone())
            .collect();
        if !s.communicates() {
            return shards
                .iter()
                .map(|p| {
                    if p.kind() == s.mesh.param_kind {
                        p.shallow_clone()
                    } else {
                        p.to_kind(s.mesh.param_kind)
                    }
                })
                .collect();
        }
        let refs: Vec<&Tensor> = shards.iter().collect();
        let full = autograd::apply(AllGather(s.clone()), &refs, refs.len());
        // Under no_grad (validation, a checkpointed region's first run) nothing is saved to free.
        if self.reshard_after_forward && full.first().is_some_and(|t| t.requires_grad()) {
            s.tensors().gathered = full.iter().map(|t| t.shallow_clone()).collect();
        }
        full
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
        self.state.unshard_as(&shards, kind)
    }

    /// Starts gathering this unit's parameters in the background, for its next
    /// [`FsdpUnit::gather`] in the same pass.
    pub fn prefetch(&self) {
        self.state.prefetch();
    }

    /// Waits for the gradient reductions the backward passes started and adds them to the
    /// shards' gradients. Call after the last backward of a step, before reading gradients.
    pub fn finish_gradients(&self) {
        self.state.finish_reductions();
    }

    /// Waits for and drops a prefetch no gather took (the shards may have changed since).
    pub fn drop_prefetch(&self) {
        let leftover = self.state.tensors().prefetched.take();
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
