//! Tensor parallelism with torchtitan's llama3 plan, as autograd functions over the `tp` group
//! (Megatron-LM's conjugate pairs):
//!
//! - column-wise linears take the whole sequence: [`TensorParallel::enter`] all-gathers the
//!   sequence-sharded activations (sequence parallel; backward reduce-scatters) or, without
//!   sequence parallelism, passes the replicated ones (backward all-reduces);
//! - row-wise linears give partial sums: [`TensorParallel::exit`] reduce-scatters them over the
//!   sequence (backward all-gathers) or all-reduces them (backward passes);
//! - the vocab-sharded embedding and output: [`TensorParallel::embedding`] looks up the ids of
//!   this rank's vocab rows, [`TensorParallel::cross_entropy_sum`] is the loss over
//!   vocab-sharded logits (torchtitan's loss parallel).
//!
//! With one tp rank every op is the plain one.

use tch::{Kind, Reduction, Tensor};

use super::kept::Kept;
use crate::autograd::{self, Function};
use crate::distributed::{Group, ReduceOp};

/// Labels with this value are not predicted (PyTorch's cross-entropy default).
pub const IGNORE_INDEX: i64 = -100;

/// A failed collective inside a forward or backward pass fails the step with its message (the
/// autograd shim turns the panic into the step's error).
pub(super) fn ok<E: std::fmt::Display>(r: Result<(), E>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// All-gathers `x` (B, s, ...) along dim 1 from every rank: (B, size * s, ...).
pub(super) fn gather_seq(group: &Group, x: &Tensor) -> Tensor {
    let size = group.size() as i64;
    let x = x.contiguous();
    let mut shape = x.size();
    let recv = Tensor::empty([size * x.numel() as i64], (x.kind(), x.device()));
    ok(group.all_gather(&recv, &x.reshape([-1])));
    let mut stacked = vec![size];
    stacked.extend_from_slice(&shape);
    let mut perm: Vec<i64> = (0..stacked.len() as i64).collect();
    perm.swap(0, 1);
    shape[1] *= size;
    recv.view(stacked.as_slice())
        .permute(perm.as_slice())
        .reshape(shape.as_slice())
}

/// Sums `x` (B, S, ...) over the ranks and keeps this rank's sequence block (B, S / size, ...).
pub(super) fn reduce_scatter_seq(group: &Group, x: &Tensor) -> Tensor {
    let size = group.size() as i64;
    let shape = x.size();
    let mut split = vec![shape[0], size, shape[1] / size];
    split.extend_from_slice(&shape[2..]);
    let mut perm: Vec<i64> = (0..split.len() as i64).collect();
    perm.swap(0, 1);
    let send = x
        .reshape(split.as_slice())
        .permute(perm.as_slice())
        .contiguous();
    let mut out_shape = shape.clone();
    out_shape[1] /= size;
    let recv = Tensor::empty(out_shape.as_slice(), (x.kind(), x.device()));
    ok(group.reduce_scatter(&recv, &send.reshape([-1])));
    recv
}

fn all_reduce(group: &Group, x: &Tensor) -> Tensor {
    let y = x.contiguous().copy();
    ok(group.all_reduce(&y, ReduceOp::Sum));
    y
}

/// Which collective pair one autograd function runs.
#[derive(Clone, Copy)]
enum Pair {
    /// forward identity, backward all-reduce.
    Copy,
    /// forward all-reduce, backward identity.
    Reduce,
    /// forward all-gather(seq), backward reduce-scatter(seq).
    Gather,
    /// forward reduce-scatter(seq), backward all-gather(seq).
    Scatter,
}

struct Collective {
    group: Group,
    pair: Pair,
    /// The forward's output, kept by selective activation checkpointing: the recompute
    /// returns it without communicating (the backward still runs the pair's collective).
    kept: Option<Tensor>,
}

impl Function for Collective {
    fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
        if let Some(kept) = self.kept.take() {
            return vec![kept];
        }
        let g = &self.group;
        vec![match self.pair {
            Pair::Copy => x[0].shallow_clone(),
            Pair::Reduce => all_reduce(g, &x[0]),
            Pair::Gather => gather_seq(g, &x[0]),
            Pair::Scatter => reduce_scatter_seq(g, &x[0]),
        }]
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        let g = &self.group;
        vec![match self.pair {
            Pair::Copy => all_reduce(g, &grads[0]),
            Pair::Reduce => grads[0].shallow_clone(),
            Pair::Gather => reduce_scatter_seq(g, &grads[0]),
            Pair::Scatter => gather_seq(g, &grads[0]),
        }]
    }
}

/// The tp group and whether activations between blocks are sequence-sharded.
#[derive(Clone)]
pub struct TensorParallel {
    group: Group,
    sequence_parallel: bool,
}

impl TensorParallel {
    pub fn new(group: Group, sequence_parallel: bool) -> Self {
        TensorParallel {
            group,
            sequence_parallel,
        }
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The tp process group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Whether activations between the column- and row-wise regions are split along the
    /// sequence (and the norms' gradients are partial sums over tp).
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel && self.size() > 1
    }

    /// The whole tensor from every rank's part `t` split along `dim`, outside autograd. A
    /// collective: every tp rank calls it.
    pub fn gather_dim(&self, t: &Tensor, dim: usize) -> Tensor {
        if self.size() == 1 {
            return t.shallow_clone();
        }
        let t = t.contiguous();
        let recv = Tensor::empty(
            [self.size() as i64 * t.numel() as i64],
            (t.kind(), t.device()),
        );
        ok(self.group.all_gather(&recv, &t.reshape([-1])));
        let mut stacked = vec![self.size() as i64];
        stacked.extend_from_slice(&t.size());
        let parts = recv.view(stacked.as_slice()).unbind(0);
        Tensor::cat(&parts, dim as i64)
    }

    /// Replaces `t` (contiguous) by its elementwise maximum over the tp ranks, outside autograd:
    /// float8 scales of a tensor split over tp come from the whole tensor's amax. A collective.
    pub fn all_reduce_max(&self, t: &Tensor) {
        if self.size() > 1 {
            ok(self.group.all_reduce(t, ReduceOp::Max));
        }
    }

    fn run(&self, x: &Tensor, pair: Pair) -> Tensor {
        self.run_kept(x, pair, None)
    }

    fn run_kept(&self, x: &Tensor, pair: Pair, kept: Option<Tensor>) -> Tensor {
        if self.size() == 1 {
            return x.shallow_clone();
        }
        let f = Collective {
            group: self.group.clone(),
            pair,
            kept,
        };
        autograd::apply(f, &[x], 1).remove(0)
    }

    /// The input of column-wise linears: the whole sequence on every rank.
    pub fn enter(&self, x: &Tensor) -> Tensor {
        self.run(
            x,
            if self.sequence_parallel {
                Pair::Gather
            } else {
                Pair::Copy
            },
        )
    }

    /// The output of row-wise linears (partial sums): summed, sequence-sharded under SP.
    pub fn exit(&self, x: &Tensor) -> Tensor {
        self.run(
            x,
            if self.sequence_parallel {
                Pair::Scatter
            } else {
                Pair::Reduce
            },
        )
    }

    /// [`TensorParallel::exit`] in a block that selective activation checkpointing keeps the
    /// reduce-scatters of (`kept`): torchtitan's policy saves `reduce_scatter_tensor`'s output,
    /// so its recompute gives it back without communicating (an all-reduce, without sequence
    /// parallelism, is recomputed).
    pub(super) fn exit_keeping(&self, x: &Tensor, kept: Option<&Kept>) -> Tensor {
        if !self.sequence_parallel() {
            return self.exit(x);
        }
        Kept::keep_in(
            kept,
            "tensor-parallel reduce-scatter",
            || self.exit(x),
            |value| self.run_kept(x, Pair::Scatter, Some(value)),
        )
    }

    /// This rank's block of `x`'s sequence (dim 1, `S / tp` positions): what it routes under
    /// expert parallelism. The sequence divides by tp ([`crate::parallelize::layout`] checks).
    pub fn sequence_block(&self, x: &Tensor) -> Tensor {
        if self.size() == 1 {
            return x.shallow_clone();
        }
        let block = x.size()[1] / self.size() as i64;
        x.narrow(1, block * self.rank() as i64, block)
    }

    /// `x` (B, S / tp, D), this rank's [`TensorParallel::sequence_block`], in place in a
    /// (B, `seq_len`, D) tensor of zeros: its part of a sum over the tp ranks.
    pub fn pad_sequence_block(&self, x: &Tensor, seq_len: i64) -> Tensor {
        if self.size() == 1 {
            return x.shallow_clone();
        }
        let block = x.size()[1];
        let before = block * self.rank() as i64;
        x.constant_pad_nd([0, 0, before, seq_len - before - block])
    }

    /// Token embeddings from this rank's vocab rows `weight` (V / tp, D): ids outside them look
    /// up zeros, and the partial sums are combined as [`TensorParallel::exit`] does.
    pub fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Tensor {
        if self.size() == 1 {
            return Tensor::embedding(weight, ids, -1, false, false);
        }
        let rows = weight.size()[0];
        let local = ids - rows * self.rank() as i64;
        let outside = local.lt(0).logical_or(&local.ge(rows));
        let local = local.masked_fill(&outside, 0);
        let emb = Tensor::embedding(weight, &local, -1, false, false)
            .masked_fill(&outside.unsqueeze(-1), 0.0);
        self.exit(&emb)
    }

    /// The summed cross entropy of `logits` (B, S, V / tp: this rank's vocab columns) against
    /// `labels` (B, S) over valid labels, identical on every tp rank.
    pub fn cross_entropy_sum(&self, logits: &Tensor, labels: &Tensor) -> Tensor {
        let vocab = logits.size()[2];
        let logits = logits.reshape([-1, vocab]);
        let labels = labels.reshape([-1]);
        if self.size() == 1 {
            return logits.cross_entropy_loss::<Tensor>(
                &labels,
                None,
                Reduction::Sum,
                IGNORE_INDEX,
                0.0,
            );
        }
        // log-sum-exp over all ranks' columns, shifted by the global max (no gradient needed:
        // it cancels).
        let max = tch::no_grad(|| {
            let m = logits.amax([1], false).contiguous();
            ok(self.group.all_reduce(&m, ReduceOp::Max));
            m
        });
        let shifted = &logits - max.unsqueeze(1);
        let sum_exp = self.run(
            &shifted
                .exp()
                .sum_dim_intlist([1i64].as_slice(), false, Kind::Float),
            Pair::Reduce,
        );
        let valid = labels.ne(IGNORE_INDEX);
        let local = &labels - vocab * self.rank() as i64;
        let mine = local
            .ge(0)
            .logical_and(&local.lt(vocab))
            .logical_and(&valid);
        let index = local.masked_fill(&mine.logical_not(), 0).unsqueeze(1);
        let target = shifted.gather(1, &index, false).squeeze_dim(1) * mine.to_kind(Kind::Float);
        let target = self.run(&target, Pair::Reduce);
        ((sum_exp.log() - target) * valid.to_kind(Kind::Float)).sum(Kind::Float)
    }
}
