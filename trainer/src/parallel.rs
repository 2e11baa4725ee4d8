//! Who this process is in the job ([`World`]) and every place training touches other ranks
//! ([`DataParallel`]), with the single-process implementation ([`SingleProcess`]).
//!
//! The training loop calls only these touch points, so a multi-process backend (DDP,
//! ZeRO-2) plugs in by implementing the trait: `prepare` once the parameters exist, then per step
//! (a) the global valid-token count, (b) gradient reduction after backward, (c) the global
//! grad norm, (d) the optimizer step, (e) cross-rank metric reduction.

use std::sync::Arc;

use anyhow::{Result, bail};
use tch::Tensor;
use titan_obs::Reduce;

use crate::config::Parallelism;
use crate::optim::{self, AdamW};

/// This process's place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct World {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    /// Replicated data-parallel degree (DDP / HSDP replicas).
    pub dp_replicate: usize,
    /// Sharded data-parallel degree (FSDP / ZeRO shards).
    pub dp_shard: usize,
}

impl World {
    /// One process doing everything.
    pub fn single() -> Self {
        Self {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            dp_replicate: 1,
            dp_shard: 1,
        }
    }

    /// Resolves the degrees for `world_size` ranks with torchtitan's `ParallelDims` rule and
    /// messages: every degree but `data_parallel_shard_degree` is at least 1; -1 there takes the
    /// ranks the others leave; dp_replicate x dp_shard x cp x tp x pp must equal the world size.
    /// Checked on every launch path, one process included.
    pub fn new(
        cfg: &Parallelism,
        rank: usize,
        local_rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        let degrees = [
            (
                "data_parallel_replicate_degree",
                cfg.data_parallel_replicate_degree,
            ),
            ("context_parallel_degree", cfg.context_parallel_degree),
            ("tensor_parallel_degree", cfg.tensor_parallel_degree),
            ("pipeline_parallel_degree", cfg.pipeline_parallel_degree),
            ("expert_parallel_degree", cfg.expert_parallel_degree),
        ];
        for (key, d) in degrees {
            if d < 1 {
                bail!(
                    "parallelism.{key} is {d}: parallelism degree should be >= 1, except for \
                     data_parallel_shard_degree (-1: the ranks left over)"
                );
            }
        }
        let [dp_replicate, cp, tp, pp] = [
            cfg.data_parallel_replicate_degree,
            cfg.context_parallel_degree,
            cfg.tensor_parallel_degree,
            cfg.pipeline_parallel_degree,
        ]
        .map(|d| d as usize);
        let others = dp_replicate * cp * tp * pp;
        let dp_shard = match cfg.data_parallel_shard_degree {
            None if others > world_size => bail!(
                "invalid parallel dims: data_parallel_shard_degree -1 leaves no rank: \
                 dp_replicate({dp_replicate}) * cp({cp}) * tp({tp}) * pp({pp}) = {others} > \
                 WORLD_SIZE({world_size})"
            ),
            None => world_size / others,
            Some(s) => s as usize,
        };
        if others * dp_shard != world_size {
            bail!(
                "invalid parallel dims: dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * \
                 cp({cp}) * tp({tp}) * pp({pp}) != WORLD_SIZE({world_size})"
            );
        }
        Ok(Self {
            rank,
            local_rank,
            world_size,
            dp_replicate,
            dp_shard,
        })
    }

    /// Number of data-parallel ranks (every rank is a dp rank: titan-train has no TP/PP/CP).
    pub fn dp_degree(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// This rank's index among the dp ranks.
    pub fn dp_rank(&self) -> usize {
        self.rank
    }
}

/// Meeting points for work all ranks do outside collectives (a multi-rank checkpoint save).
/// Thread-safe: async saves meet on their writer threads.
pub trait RankSync: Send + Sync {
    /// Returns once every rank called `barrier` with the same `name` (unique per meeting).
    fn barrier(&self, name: &str) -> Result<()>;
}

/// The rows `[row_offset, row_offset + rows)` of one parameter's AdamW state that this rank
/// holds and checkpoints (ZeRO-2: the state is sharded along dim 0).
pub struct OptimizerShard {
    /// Index into the parameter list.
    pub param: usize,
    pub row_offset: i64,
    /// The rows of `exp_avg` / `exp_avg_sq`, shaped like the parameter's rows.
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// Optimizer steps taken (the same for every parameter).
    pub step: u64,
}

/// The places where training needs the other ranks.
pub trait DataParallel {
    fn world(&self) -> &World;

    /// Once, after the model is built: make every rank's parameters identical (broadcast from
    /// rank 0) and set up gradient buckets or shards.
    fn prepare(&mut self, _params: &[(String, Tensor)]) -> Result<()> {
        Ok(())
    }

    /// (a) Valid (non-ignored) label tokens of this step summed over all dp ranks: the loss
    /// denominator.
    fn global_valid_tokens(&mut self, local: i64) -> Result<i64>;

    /// (b) After all microbatches' backward: sum-reduce gradients across dp ranks (a sharded
    /// backend reduce-scatters and keeps its shard).
    fn reduce_gradients(&mut self, params: &[(String, Tensor)]) -> Result<()>;

    /// (c) The total 2-norm of the gradients over all ranks' (shards of) gradients.
    fn grad_norm(&mut self, params: &[(String, Tensor)]) -> Result<f64>;

    /// (d) One optimizer update at `lr` (a sharded backend updates its shard and all-gathers).
    fn optimizer_step(
        &mut self,
        optimizer: &mut AdamW,
        params: &[(String, Tensor)],
        lr: f64,
    ) -> Result<()>;

    /// (e) Reduces each metric across ranks in place with its reduction.
    fn reduce_metrics(&mut self, metrics: &mut [(f64, Reduce)]) -> Result<()>;

    /// Checkpointing: how ranks meet to commit a save (None: one process).
    fn rank_sync(&self) -> Option<Arc<dyn RankSync>> {
        None
    }

    /// Checkpointing: `Some` when the optimizer state is sharded across ranks instead of held
    /// by `AdamW`; the shards this rank writes (replicas of a shard write nothing).
    fn optimizer_shards(&self, _params: &[(String, Tensor)]) -> Option<Vec<OptimizerShard>> {
        None
    }

    /// Checkpointing: after a load put the full parameters and the optimizer state (loaded
    /// into `optimizer`) where the step uses them (a sharded backend takes its rows).
    fn adopt_loaded_state(
        &mut self,
        _optimizer: &mut AdamW,
        _params: &[(String, Tensor)],
    ) -> Result<()> {
        Ok(())
    }
}

/// The single-process implementation: every reduction is the identity.
pub struct SingleProcess {
    world: World,
}

impl SingleProcess {
    pub fn new() -> Self {
        Self {
            world: World::single(),
        }
    }
}

impl Default for SingleProcess {
    fn default() -> Self {
        Self::new()
    }
}

impl DataParallel for SingleProcess {
    fn world(&self) -> &World {
        &self.world
    }

    fn global_valid_tokens(&mut self, local: i64) -> Result<i64> {
        Ok(local)
    }

    fn reduce_gradients(&mut self, _params: &[(String, Tensor)]) -> Result<()> {
        Ok(())
    }

    fn grad_norm(&mut self, params: &[(String, Tensor)]) -> Result<f64> {
        let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
        Ok(optim::total_grad_norm(&tensors))
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut AdamW,
        params: &[(String, Tensor)],
        lr: f64,
    ) -> Result<()> {
        for (name, p) in params {
            optimizer.step_param(name, p, lr);
        }
        Ok(())
    }

    fn reduce_metrics(&mut self, _metrics: &mut [(f64, Reduce)]) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_degrees_resolve_like_torchtitan() {
        let mut cfg = Parallelism::default();
        let w = World::new(&cfg, 3, 1, 4).unwrap();
        assert_eq!((w.dp_replicate, w.dp_shard, w.dp_degree()), (1, 4, 4));
        cfg.data_parallel_replicate_degree = 2;
        let w = World::new(&cfg, 0, 0, 4).unwrap();
        assert_eq!((w.dp_replicate, w.dp_shard), (2, 2));
        cfg.data_parallel_shard_degree = Some(3);
        assert!(World::new(&cfg, 0, 0, 4).is_err());
    }
}
