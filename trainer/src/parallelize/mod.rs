//! How the model is split over the device mesh, as torchtitan's `parallelize_llama` applies it:
//! tensor parallelism with the llama3 plan ([`tp`]), then FSDP2 over `dp_shard` (and HSDP over
//! `dp_replicate`) per transformer block ([`fsdp`]). The model asks [`ParallelPlan`] where each
//! parameter lives ([`Placement`]) and calls the two modules' ops in its forward; the training
//! loop does not see the split.
//!
//! Placements, for a parameter of global shape `G`:
//! - TP (`tp_dim`): column-wise linears (`wq`, `wk`, `wv`, `w1`, `w3`, `lm_head`) and the
//!   vocab-sharded `tok_embeddings` split dim 0 into `tp` equal blocks; row-wise linears (`wo`,
//!   `w2`) split dim 1; norms are replicated.
//! - FSDP: the TP-local tensor's dim 0 is cut into `dp_shard` chunks of `ceil(rows / dp_shard)`
//!   rows (the last ones shorter or empty: `torch.chunk`, as FSDP2), so each rank's part is one
//!   block of the global tensor at `offsets`.

pub mod fsdp;
pub mod layout;
pub mod pipeline;
pub mod plan;
pub mod tp;
pub mod weight_grad;

use anyhow::Result;
use tch::{Kind, Tensor};

use crate::config::{Parallelism, ReshardAfterForward};
use crate::distributed::DeviceMesh;
use crate::parallel::Dim;
pub use plan::TpStyle;

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
}

impl Placement {
    /// Whether the local part is the whole tensor.
    pub fn is_whole(&self) -> bool {
        self.local == self.global
    }

    /// This rank's part of the global tensor `full`.
    pub fn take_local(&self, full: &Tensor) -> Tensor {
        let mut t = full.shallow_clone();
        for (d, (&off, &len)) in self.offsets.iter().zip(&self.local).enumerate() {
            if off != 0 || len != self.global[d] {
                t = t.narrow(d as i64, off, len);
            }
        }
        t.contiguous()
    }
}

/// The split of the whole model for this rank.
#[derive(Clone)]
pub struct ParallelPlan {
    pub tp: tp::TensorParallel,
    pub fsdp: fsdp::FsdpMesh,
    pub reshard_after_forward: ReshardAfterForward,
    /// Pipeline parallelism is on (FSDP's default then keeps gathered parameters between a
    /// stage's microbatches, as torchtitan).
    pub pipelined: bool,
    tp_rank: usize,
    shard_rank: usize,
    replicate_rank: usize,
}

impl ParallelPlan {
    /// The plan for `mesh`'s groups. `param_kind` is FSDP2's `mixed_precision_param` (the dtype
    /// the unsharded parameters compute in) and `reduce_kind` its `mixed_precision_reduce`.
    pub fn new(mesh: &DeviceMesh, cfg: &Parallelism, param_kind: Kind, reduce_kind: Kind) -> Self {
        ParallelPlan {
            tp: tp::TensorParallel::new(mesh.tp.clone(), cfg.enable_sequence_parallel),
            fsdp: fsdp::FsdpMesh {
                shard: mesh.dp_shard.clone(),
                replicate: mesh.dp_replicate.clone(),
                param_kind,
                reduce_kind,
                reductions: fsdp::Reductions::default(),
            },
            reshard_after_forward: cfg.fsdp_reshard_after_forward,
            pipelined: cfg.pipeline_parallel_degree > 1,
            tp_rank: mesh.mesh.coord(Dim::Tp),
            shard_rank: mesh.mesh.coord(Dim::DpShard),
            replicate_rank: mesh.mesh.coord(Dim::DpReplicate),
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
        self.placement(global, plan::tp_style(fqn)?)
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
}
