//! The training loop's distributed touch points ([`crate::parallel::DataParallel`]) on top of
//! [`super::dp::DataParallel`]: DDP, ZeRO-2 or HSDP depending on the degrees.

use anyhow::{Context, Result};
use tch::Tensor;
use titan_obs::Reduce;

use super::comm::ReduceOp;
use super::dp::{self, AdamWStep, DpDegrees};
use super::runtime::Dist;
use std::sync::Arc;

use crate::optim::AdamW;
use crate::parallel::{DataParallel, OptimizerShard, RankSync, World};

/// Multi-process data parallelism for the trainer. Built before the model; the groups and
/// buffers are created by [`DataParallel::prepare`] once the parameters exist.
pub struct DistributedDp {
    world: World,
    dist: Dist,
    max_norm: f64,
    bucket_bytes: usize,
    inner: Option<dp::DataParallel>,
    last_norm: f64,
}

impl DistributedDp {
    pub fn new(dist: Dist, world: World, max_norm: f64) -> Self {
        DistributedDp {
            world,
            dist,
            max_norm,
            bucket_bytes: dp::DEFAULT_BUCKET_BYTES,
            inner: None,
            last_norm: 0.0,
        }
    }

    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    fn inner(&mut self) -> Result<&mut dp::DataParallel> {
        self.inner
            .as_mut()
            .context("distributed data parallel used before prepare() saw the parameters")
    }

    fn tensors(params: &[(String, Tensor)]) -> Vec<Tensor> {
        params.iter().map(|(_, t)| t.shallow_clone()).collect()
    }
}

impl DataParallel for DistributedDp {
    fn world(&self) -> &World {
        &self.world
    }

    fn prepare(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        let degrees = DpDegrees {
            replicate: self.world.dp_replicate,
            shard: self.world.dp_shard,
        };
        let inner = dp::DataParallel::new(
            &self.dist,
            degrees,
            &Self::tensors(params),
            self.bucket_bytes,
        )?;
        self.inner = Some(inner);
        Ok(())
    }

    fn global_valid_tokens(&mut self, local: i64) -> Result<i64> {
        let sum = self.inner()?.global_sum(&[local as f64])?;
        Ok(sum[0].round() as i64)
    }

    fn reduce_gradients(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        let t = Self::tensors(params);
        self.inner()?.reduce_gradients(&t)?;
        Ok(())
    }

    fn grad_norm(&mut self, params: &[(String, Tensor)]) -> Result<f64> {
        let t = Self::tensors(params);
        let norm = self.inner()?.grad_norm(&t)?;
        self.last_norm = norm;
        Ok(norm)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut AdamW,
        params: &[(String, Tensor)],
        lr: f64,
    ) -> Result<()> {
        let (max_norm, last_norm) = (self.max_norm, self.last_norm);
        let inner = self.inner()?;
        if !inner.is_sharded() {
            // DDP: every rank holds the full reduced (and already clipped) gradients.
            for (name, p) in params {
                optimizer.step_param(name, p, lr);
            }
            return Ok(());
        }
        // ZeRO-2: the loop clipped the full local gradients, which are not what is stepped; clip
        // the reduced shard by the same global norm.
        inner.scale_shard_grad(max_norm, last_norm);
        let hp = optimizer.hparams;
        let t = Self::tensors(params);
        inner.sharded_adamw_step(
            &t,
            AdamWStep {
                lr,
                beta1: hp.beta1,
                beta2: hp.beta2,
                eps: hp.eps,
                weight_decay: hp.weight_decay,
            },
        )?;
        Ok(())
    }

    fn reduce_metrics(&mut self, metrics: &mut [(f64, Reduce)]) -> Result<()> {
        let n = self.world.dp_degree() as f64;
        let inner = self.inner()?;
        let sums: Vec<f64> = metrics
            .iter()
            .map(|&(v, r)| {
                if matches!(r, Reduce::Mean | Reduce::Sum) {
                    v
                } else {
                    0.0
                }
            })
            .collect();
        let maxes: Vec<f64> = metrics
            .iter()
            .map(|&(v, r)| match r {
                Reduce::Max => v,
                Reduce::Min => -v,
                _ => f64::MIN,
            })
            .collect();
        let sums = inner.reduce_scalars(&sums, ReduceOp::Sum)?;
        let maxes = inner.reduce_scalars(&maxes, ReduceOp::Max)?;
        for (i, (v, r)) in metrics.iter_mut().enumerate() {
            *v = match r {
                Reduce::Mean => sums[i] / n,
                Reduce::Sum => sums[i],
                Reduce::Max => maxes[i],
                Reduce::Min => -maxes[i],
            };
        }
        Ok(())
    }

    fn rank_sync(&self) -> Option<Arc<dyn RankSync>> {
        self.dist.store_barrier()
    }

    fn optimizer_shards(&self, params: &[(String, Tensor)]) -> Option<Vec<OptimizerShard>> {
        let inner = self.inner.as_ref()?;
        let (step, rows) = inner.shard_state(&Self::tensors(params))?;
        // Replicas of a shard (HSDP) hold the same rows: the first replica writes them.
        if inner.replicate_index != 0 {
            return Some(Vec::new());
        }
        Some(
            rows.into_iter()
                .map(|(param, row_offset, exp_avg, exp_avg_sq)| OptimizerShard {
                    param,
                    row_offset,
                    exp_avg,
                    exp_avg_sq,
                    step: step as u64,
                })
                .collect(),
        )
    }

    fn adopt_loaded_state(
        &mut self,
        optimizer: &mut AdamW,
        params: &[(String, Tensor)],
    ) -> Result<()> {
        let inner = self.inner()?;
        if !inner.is_sharded() {
            return Ok(());
        }
        // The loaded full state moves into this rank's shard; the trainer's AdamW stays empty.
        let step = optimizer.state.values().map(|s| s.step).max().unwrap_or(0);
        let state: Vec<Option<(Tensor, Tensor)>> = params
            .iter()
            .map(|(name, _)| {
                optimizer
                    .state
                    .remove(name)
                    .map(|s| (s.exp_avg, s.exp_avg_sq))
            })
            .collect();
        optimizer.state.clear();
        inner.load_shard_state(&Self::tensors(params), &state, step as i64)?;
        Ok(())
    }
}
