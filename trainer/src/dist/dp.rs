//! Data parallelism over a `[dp_replicate, dp_shard]` mesh (torchtitan's order: global rank =
//! replicate_index * shard_degree + shard_index).
//!
//! - replicate only (DDP): gradients are flattened into ~25 MB buckets (last parameters first,
//!   as DDP fills them during backward) and sum-all-reduced; every rank steps the full optimizer.
//! - shard (ZeRO-2): each parameter is split along dim 0 into `shard` row blocks of
//!   `ceil(rows / shard)` rows (the last ones shorter or empty, as FSDP chunks); each rank's
//!   blocks are packed into one padded flat buffer of equal size on every rank. Gradients are
//!   reduce-scattered so each rank receives the sum of its own blocks, AdamW state and update
//!   live on that shard only, and the updated shards are all-gathered back into the parameters.
//! - both (HSDP): the reduce-scatter runs within the shard group, then the shard gradients are
//!   all-reduced across replicas.
//!
//! Gradients are sum-reduced, never averaged: the loss is divided by the global count of valid
//! tokens (see [`DataParallel::global_sum`]), as torchtitan does.

use tch::{Device, Kind, Tensor};

use super::comm::{Collectives, CommError, ReduceOp};
use super::runtime::Dist;

/// Data-parallel degrees (torchtitan's `parallelism.data_parallel_{replicate,shard}_degree`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DpDegrees {
    pub replicate: usize,
    pub shard: usize,
}

impl DpDegrees {
    /// Resolves torchtitan's `-1` ("the rest of the world") and checks the product.
    pub fn resolve(replicate: i64, shard: i64, world_size: usize) -> Result<DpDegrees, String> {
        let w = world_size as i64;
        let (r, s) = match (replicate, shard) {
            (r, -1) if r >= 1 && w % r == 0 => (r, w / r),
            (-1, s) if s >= 1 && w % s == 0 => (w / s, s),
            (r, s) if r >= 1 && s >= 1 => (r, s),
            _ => {
                return Err(format!(
                    "parallelism.data_parallel_replicate_degree = {replicate} and \
                     data_parallel_shard_degree = {shard} do not fit {world_size} ranks (use \
                     positive degrees whose product is the world size, at most one of them -1)"
                ));
            }
        };
        if r * s != w {
            return Err(format!(
                "parallelism.data_parallel_replicate_degree ({r}) x data_parallel_shard_degree \
                 ({s}) = {} but the job has {world_size} ranks",
                r * s
            ));
        }
        Ok(DpDegrees {
            replicate: r as usize,
            shard: s as usize,
        })
    }

    pub fn world(&self) -> usize {
        self.replicate * self.shard
    }
}

/// AdamW hyper-parameters for one step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

struct Bucket {
    /// (parameter index, element offset in the bucket, numel)
    members: Vec<(usize, i64, i64)>,
    flat: Tensor,
}

/// Where one parameter's row blocks sit in the per-rank shard buffer.
#[derive(Debug, Clone)]
struct ParamShard {
    rows: i64,
    row_elems: i64,
    rows_per_rank: i64,
    /// Element offset inside each rank's shard buffer.
    offset: i64,
}

impl ParamShard {
    /// Rows [lo, lo + n) of shard `i`.
    fn rows_of(&self, i: usize) -> (i64, i64) {
        let lo = (i as i64 * self.rows_per_rank).min(self.rows);
        let hi = ((i as i64 + 1) * self.rows_per_rank).min(self.rows);
        (lo, hi - lo)
    }
}

struct Zero {
    params: Vec<ParamShard>,
    /// Elements of one rank's shard (equal on every rank, padded).
    per_rank: i64,
    /// Staging buffer of shard * per_rank elements for reduce-scatter and all-gather.
    full: Tensor,
    /// This rank's reduced gradient shard.
    grad: Tensor,
    /// This rank's parameter shard and AdamW state.
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: i64,
}

/// The data-parallel runtime of one rank.
pub struct DataParallel {
    pub degrees: DpDegrees,
    pub replicate_index: usize,
    pub shard_index: usize,
    shard_group: Box<dyn Collectives>,
    replicate_group: Box<dyn Collectives>,
    buckets: Vec<Bucket>,
    zero: Option<Zero>,
    scalar_device: Device,
}

/// DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

impl DataParallel {
    /// Builds the groups and buffers for `params` (the model's parameters in a fixed order, the
    /// same on every rank) and makes every rank's parameters equal to global rank 0's.
    pub fn new(
        dist: &Dist,
        degrees: DpDegrees,
        params: &[Tensor],
        bucket_bytes: usize,
    ) -> Result<DataParallel, CommError> {
        let rank = dist.rank();
        if degrees.world() != dist.world_size() {
            return Err(CommError::Setup {
                rank,
                message: format!(
                    "data parallel degrees {degrees:?} do not cover the {} ranks",
                    dist.world_size()
                ),
            });
        }
        let replicate_index = rank / degrees.shard;
        let shard_index = rank % degrees.shard;
        let shard_members = (0..degrees.shard)
            .map(|s| replicate_index * degrees.shard + s)
            .collect();
        let replicate_members = (0..degrees.replicate)
            .map(|r| r * degrees.shard + shard_index)
            .collect();
        let shard_group = dist.new_group(&format!("dp_shard/{replicate_index}"), shard_members)?;
        let replicate_group =
            dist.new_group(&format!("dp_replicate/{shard_index}"), replicate_members)?;
        let scalar_device = if shard_group.backend() == "nccl" {
            Device::Cuda(dist.device_index)
        } else {
            Device::Cpu
        };
        let mut dp = DataParallel {
            degrees,
            replicate_index,
            shard_index,
            shard_group,
            replicate_group,
            buckets: Vec::new(),
            zero: None,
            scalar_device,
        };
        dp.broadcast_params(params)?;
        if degrees.shard > 1 {
            dp.zero = Some(dp.build_zero(params)?);
        } else {
            dp.buckets = build_buckets(params, bucket_bytes);
        }
        Ok(dp)
    }

    /// Whether the optimizer runs sharded (ZeRO-2) through [`DataParallel::sharded_adamw_step`].
    pub fn is_sharded(&self) -> bool {
        self.zero.is_some()
    }

    /// Number of data-parallel ranks.
    pub fn dp_size(&self) -> usize {
        self.degrees.world()
    }

    /// This rank's index among the data-parallel ranks (which slice of the global batch it reads).
    pub fn dp_rank(&self) -> usize {
        self.replicate_index * self.degrees.shard + self.shard_index
    }

    fn broadcast_params(&mut self, params: &[Tensor]) -> Result<(), CommError> {
        tch::no_grad(|| -> Result<(), CommError> {
            for p in params {
                if self.shard_group.size() > 1 {
                    self.shard_group.broadcast(p, 0)?;
                }
                if self.replicate_group.size() > 1 {
                    self.replicate_group.broadcast(p, 0)?;
                }
            }
            Ok(())
        })
    }

    fn build_zero(&mut self, params: &[Tensor]) -> Result<Zero, CommError> {
        let s = self.degrees.shard as i64;
        let kind = params.first().map(|p| p.kind()).unwrap_or(Kind::Float);
        let device = params.first().map(|p| p.device()).unwrap_or(Device::Cpu);
        let mut layout = Vec::with_capacity(params.len());
        let mut offset = 0i64;
        for (i, p) in params.iter().enumerate() {
            if p.kind() != kind {
                return Err(CommError::BadArgument {
                    op: "zero",
                    message: format!(
                        "parameter {i} is {:?} but the first is {kind:?}; sharding needs one dtype",
                        p.kind()
                    ),
                });
            }
            let size = p.size();
            let rows = size.first().copied().unwrap_or(1).max(1);
            let row_elems = if size.is_empty() {
                1
            } else {
                p.numel() as i64 / rows.max(1)
            };
            let rows_per_rank = (rows + s - 1) / s;
            layout.push(ParamShard {
                rows,
                row_elems,
                rows_per_rank,
                offset,
            });
            offset += rows_per_rank * row_elems;
        }
        let per_rank = offset;
        let opts = (kind, device);
        let full = Tensor::zeros([s * per_rank], opts);
        let param = Tensor::zeros([per_rank], opts);
        // This rank's rows of every parameter, as the optimizer's working copy.
        let me = self.shard_index;
        tch::no_grad(|| {
            for (p, l) in params.iter().zip(&layout) {
                let (lo, n) = l.rows_of(me);
                if n > 0 {
                    param.narrow(0, l.offset, n * l.row_elems).copy_(
                        &p.detach()
                            .reshape([-1])
                            .narrow(0, lo * l.row_elems, n * l.row_elems),
                    );
                }
            }
        });
        Ok(Zero {
            params: layout,
            per_rank,
            full,
            grad: Tensor::zeros([per_rank], opts),
            exp_avg: Tensor::zeros([per_rank], opts),
            exp_avg_sq: Tensor::zeros([per_rank], opts),
            param,
            step: 0,
        })
    }

    /// Sums `values` over all data-parallel ranks.
    pub fn global_sum(&mut self, values: &[f64]) -> Result<Vec<f64>, CommError> {
        self.reduce_scalars(values, ReduceOp::Sum)
    }

    /// Reduces `values` over all data-parallel ranks (sum or max).
    pub fn reduce_scalars(&mut self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>, CommError> {
        let t = Tensor::from_slice(values)
            .to_kind(Kind::Double)
            .to_device(self.scalar_device);
        self.shard_group.all_reduce(&t, op)?;
        self.replicate_group.all_reduce(&t, op)?;
        let out: Vec<f64> = Vec::<f64>::try_from(&t.to_device(Device::Cpu)).unwrap_or_default();
        Ok(out)
    }

    /// Reduces gradients after backward: DDP all-reduce, or ZeRO-2 reduce-scatter into this
    /// rank's shard (then all-reduce across replicas for HSDP).
    pub fn reduce_gradients(&mut self, params: &[Tensor]) -> Result<(), CommError> {
        tch::no_grad(|| match &self.zero {
            None => self.all_reduce_buckets(params),
            Some(_) => self.reduce_scatter_grads(params),
        })
    }

    fn all_reduce_buckets(&mut self, params: &[Tensor]) -> Result<(), CommError> {
        if self.replicate_group.size() == 1 {
            return Ok(());
        }
        for b in &self.buckets {
            for &(i, off, n) in &b.members {
                let g = params[i].grad();
                let dst = b.flat.narrow(0, off, n);
                if g.defined() {
                    dst.shallow_clone().copy_(&g.reshape([-1]));
                } else {
                    // An unused parameter contributes zeros (its grad stays undefined).
                    let _ = dst.shallow_clone().zero_();
                }
            }
            self.replicate_group.all_reduce(&b.flat, ReduceOp::Sum)?;
            for &(i, off, n) in &b.members {
                let g = params[i].grad();
                if g.defined() {
                    g.shallow_clone()
                        .copy_(&b.flat.narrow(0, off, n).reshape(g.size()));
                }
            }
        }
        Ok(())
    }

    fn reduce_scatter_grads(&mut self, params: &[Tensor]) -> Result<(), CommError> {
        let zero = self.zero.as_mut().expect("sharded");
        let s = self.degrees.shard;
        for (p, l) in params.iter().zip(&zero.params) {
            let g = p.grad();
            let g = if g.defined() {
                g.reshape([-1])
            } else {
                Tensor::zeros([p.numel() as i64], (p.kind(), p.device()))
            };
            for i in 0..s {
                let (lo, n) = l.rows_of(i);
                if n > 0 {
                    zero.full
                        .narrow(0, i as i64 * zero.per_rank + l.offset, n * l.row_elems)
                        .copy_(&g.narrow(0, lo * l.row_elems, n * l.row_elems));
                }
            }
        }
        self.shard_group
            .reduce_scatter(&zero.grad, &zero.full, ReduceOp::Sum)?;
        if self.replicate_group.size() > 1 {
            self.replicate_group.all_reduce(&zero.grad, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// The global L2 norm of the (reduced) gradients: across shards for ZeRO-2 (squares summed in
    /// f64), of the full gradients for DDP (as torch computes it, in fp32).
    pub fn grad_norm(&mut self, params: &[Tensor]) -> Result<f64, CommError> {
        tch::no_grad(|| match &self.zero {
            Some(zero) => {
                let sq = zero
                    .grad
                    .to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .reshape([1])
                    .to_device(self.scalar_device);
                self.shard_group.all_reduce(&sq, ReduceOp::Sum)?;
                Ok(sq.double_value(&[0]).sqrt())
            }
            // Every rank holds the full reduced gradients: the norm as torch's clip_grad_norm_
            // computes it for DDP (fp32 norms per tensor, then their norm), so titan's DDP reports
            // torchtitan's DDP value, with no host sync per parameter.
            None => {
                let refs: Vec<&Tensor> = params.iter().collect();
                Ok(crate::optim::total_grad_norm(&refs))
            }
        })
    }

    /// torch's clip_grad_norm_: scales the gradients (this rank's shard, or the full gradients
    /// for DDP) by min(1, max_norm / (total_norm + 1e-6)); returns the total norm before clipping.
    pub fn clip_grad_norm(&mut self, params: &[Tensor], max_norm: f64) -> Result<f64, CommError> {
        let total = self.grad_norm(params)?;
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        if max_norm > 0.0 && coef < 1.0 {
            tch::no_grad(|| match &self.zero {
                Some(zero) => {
                    let _ = zero.grad.shallow_clone().f_mul_scalar_(coef);
                }
                None => {
                    for p in params {
                        let g = p.grad();
                        if g.defined() {
                            let _ = g.shallow_clone().f_mul_scalar_(coef);
                        }
                    }
                }
            });
        }
        Ok(total)
    }

    /// Scales this rank's gradient shard as clip_grad_norm_ would for a global norm of
    /// `total_norm` (a no-op unless sharded and the norm exceeds `max_norm`).
    pub fn scale_shard_grad(&mut self, max_norm: f64, total_norm: f64) {
        let coef = max_norm / (total_norm + 1e-6);
        if let (Some(zero), true) = (&self.zero, max_norm > 0.0 && coef < 1.0) {
            tch::no_grad(|| {
                let _ = zero.grad.shallow_clone().f_mul_scalar_(coef);
            });
        }
    }

    /// ZeRO-2's optimizer step: AdamW (torch's formula, decoupled weight decay) on this rank's
    /// shard, then the updated shards are all-gathered into every rank's parameters.
    pub fn sharded_adamw_step(
        &mut self,
        params: &[Tensor],
        hp: AdamWStep,
    ) -> Result<(), CommError> {
        let zero = self.zero.as_mut().ok_or_else(|| CommError::BadArgument {
            op: "sharded_adamw_step",
            message: "data_parallel_shard_degree is 1: use the trainer's optimizer".into(),
        })?;
        tch::no_grad(|| {
            zero.step += 1;
            let t = zero.step as i32;
            let mut p = zero.param.shallow_clone();
            let mut m = zero.exp_avg.shallow_clone();
            let mut v = zero.exp_avg_sq.shallow_clone();
            let g = &zero.grad;
            let _ = p.f_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
            let _ = m.f_lerp_(g, 1.0 - hp.beta1);
            let _ = v.f_mul_scalar_(hp.beta2);
            let _ = v.f_add_(&(g * g * (1.0 - hp.beta2)));
            let bc1 = 1.0 - hp.beta1.powi(t);
            let bc2_sqrt = (1.0 - hp.beta2.powi(t)).sqrt();
            let denom = v.sqrt() / bc2_sqrt + hp.eps;
            let _ = p.f_sub_(&(&m / &denom * (hp.lr / bc1)));
        });
        let zero = self.zero.as_mut().expect("sharded");
        self.shard_group.all_gather(&zero.full, &zero.param)?;
        let s = self.degrees.shard;
        tch::no_grad(|| {
            for (p, l) in params.iter().zip(&zero.params) {
                let flat = p.detach().view([-1]);
                for i in 0..s {
                    let (lo, n) = l.rows_of(i);
                    if n > 0 {
                        flat.narrow(0, lo * l.row_elems, n * l.row_elems)
                            .copy_(&zero.full.narrow(
                                0,
                                i as i64 * zero.per_rank + l.offset,
                                n * l.row_elems,
                            ));
                    }
                }
            }
        });
        Ok(())
    }

    /// ZeRO-2: the optimizer step count and this rank's rows of every parameter's AdamW state
    /// as `(param index, first row, exp_avg rows, exp_avg_sq rows)`, each shaped like the
    /// parameter's rows (views, not copies). `None` when the optimizer is not sharded.
    #[allow(clippy::type_complexity)]
    pub fn shard_state(
        &self,
        params: &[Tensor],
    ) -> Option<(i64, Vec<(usize, i64, Tensor, Tensor)>)> {
        let zero = self.zero.as_ref()?;
        let mut rows = Vec::new();
        for (i, (p, l)) in params.iter().zip(&zero.params).enumerate() {
            let (lo, n) = l.rows_of(self.shard_index);
            if n == 0 {
                continue;
            }
            let mut shape = p.size();
            if let Some(first) = shape.first_mut() {
                *first = n;
            }
            let view = |t: &Tensor| {
                t.narrow(0, l.offset, n * l.row_elems)
                    .view(shape.as_slice())
            };
            rows.push((i, lo, view(&zero.exp_avg), view(&zero.exp_avg_sq)));
        }
        Some((zero.step, rows))
    }

    /// ZeRO-2 after a checkpoint load: re-takes this rank's rows of the (reloaded) parameters
    /// and of the loaded full AdamW state (`None` for a parameter without state: zeros).
    pub fn load_shard_state(
        &mut self,
        params: &[Tensor],
        state: &[Option<(Tensor, Tensor)>],
        step: i64,
    ) -> Result<(), CommError> {
        let me = self.shard_index;
        let zero = self.zero.as_mut().ok_or_else(|| CommError::BadArgument {
            op: "load_shard_state",
            message: "data_parallel_shard_degree is 1: the trainer's optimizer holds the state"
                .into(),
        })?;
        tch::no_grad(|| {
            let _ = zero.exp_avg.zero_();
            let _ = zero.exp_avg_sq.zero_();
            for (i, (p, l)) in params.iter().zip(&zero.params).enumerate() {
                let (lo, n) = l.rows_of(me);
                if n == 0 {
                    continue;
                }
                let rows = |t: &Tensor| {
                    t.detach()
                        .reshape([-1])
                        .narrow(0, lo * l.row_elems, n * l.row_elems)
                        .to_kind(zero.param.kind())
                        .to_device(zero.param.device())
                };
                let dst = |t: &Tensor| t.narrow(0, l.offset, n * l.row_elems);
                dst(&zero.param).copy_(&rows(p));
                if let Some(Some((m, v))) = state.get(i) {
                    dst(&zero.exp_avg).copy_(&rows(m));
                    dst(&zero.exp_avg_sq).copy_(&rows(v));
                }
            }
        });
        zero.step = step;
        Ok(())
    }

    /// Blocks until every data-parallel rank arrives.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.shard_group.barrier()?;
        self.replicate_group.barrier()
    }
}

fn build_buckets(params: &[Tensor], bucket_bytes: usize) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut cur: Vec<(usize, i64, i64)> = Vec::new();
    let mut cur_elems = 0i64;
    let mut cur_opts = None;
    let flush = |cur: &mut Vec<(usize, i64, i64)>,
                 elems: i64,
                 opts: Option<(Kind, Device)>,
                 out: &mut Vec<Bucket>| {
        if let (false, Some(o)) = (cur.is_empty(), opts) {
            out.push(Bucket {
                members: std::mem::take(cur),
                flat: Tensor::zeros([elems], o),
            });
        }
    };
    // Reverse order: the last layers' gradients are ready first in backward (as in DDP).
    for (i, p) in params.iter().enumerate().rev() {
        let opts = (p.kind(), p.device());
        let n = p.numel() as i64;
        let bytes = (cur_elems + n) as usize * p.kind().elt_size_in_bytes();
        if !cur.is_empty() && (Some(opts) != cur_opts || bytes > bucket_bytes) {
            flush(&mut cur, cur_elems, cur_opts, &mut buckets);
            cur_elems = 0;
        }
        cur_opts = Some(opts);
        cur.push((i, cur_elems, n));
        cur_elems += n;
    }
    flush(&mut cur, cur_elems, cur_opts, &mut buckets);
    buckets
}
