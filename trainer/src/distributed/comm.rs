//! The collective interface every backend implements, and its error type.
//!
//! Semantics follow torch.distributed: `all_reduce` works in place; `reduce_scatter` and
//! `all_gather` split a flat buffer into `size()` equal chunks in rank order (callers pad, as
//! FSDP does); `broadcast` copies the root's tensor into everyone's. A failed collective leaves
//! the group unusable: training stops with the error.

use std::io;
use std::time::Duration;

use tch::Tensor;

use super::store::StoreError;

/// How values from different ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// A failed collective or group setup. Messages name the rank at fault.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank}: rank {peer} closed the connection during {op} (did it exit or crash?)")]
    PeerClosed {
        rank: usize,
        peer: usize,
        op: &'static str,
    },
    #[error(
        "rank {rank}: rank {peer} made no progress for {timeout:?} during {op} (hung or dead? \
         raise comm.train_timeout_seconds if it is just slow)"
    )]
    PeerTimeout {
        rank: usize,
        peer: usize,
        op: &'static str,
        timeout: Duration,
    },
    #[error("rank {rank}: talking to rank {peer} during {op}: {source}")]
    PeerIo {
        rank: usize,
        peer: usize,
        op: &'static str,
        source: io::Error,
    },
    #[error("rank {rank}: rendezvous: {source}")]
    Store { rank: usize, source: StoreError },
    #[error("rank {rank}: setting up connections: {message}")]
    Setup { rank: usize, message: String },
    #[error("{op}: {message}")]
    BadArgument { op: &'static str, message: String },
    #[error("{own}\n  first failure reported in the job: {first}")]
    AfterPeerFailure { own: Box<CommError>, first: String },
    #[error(
        "{own}\n  that rank was itself waiting: the chain of waits ends at rank {end} (hung or dead?)"
    )]
    WaitChain { own: Box<CommError>, end: usize },
    #[error(
        "{own}\n  the job's failure notices could not be read ({why}): the store's host (the \
         launcher, or rank 0 in a by-hand launch) has exited or is unreachable; the other ranks' \
         logs say which failed first"
    )]
    NoticesUnreachable { own: Box<CommError>, why: String },
}

impl CommError {
    /// The peer rank this error blames, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            CommError::PeerClosed { peer, .. }
            | CommError::PeerTimeout { peer, .. }
            | CommError::PeerIo { peer, .. } => Some(*peer),
            CommError::AfterPeerFailure { own, .. } | CommError::NoticesUnreachable { own, .. } => {
                own.peer()
            }
            CommError::WaitChain { end, .. } => Some(*end),
            _ => None,
        }
    }
}

/// Collectives over a group of ranks. Tensors are CPU tensors for the `cpu` backend and CUDA
/// tensors for `nccl`; both ranks of a call must pass the same shapes and dtypes.
pub trait Collectives: Send {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Backend name (`cpu`, `nccl`).
    fn backend(&self) -> &'static str;
    /// Reduces `tensor` across the group, in place on every rank.
    fn all_reduce(&mut self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError>;
    /// Reduces `input` (numel = size * output numel) across the group; rank r receives chunk r.
    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Gathers every rank's `input` into `output` (numel = size * input numel), in rank order.
    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError>;
    /// Copies `root`'s `tensor` into every rank's `tensor`.
    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError>;
    /// Returns once every rank of the group has called it.
    fn barrier(&mut self) -> Result<(), CommError>;
}

/// Checks the size contract of reduce_scatter / all_gather: `big` = size * `small` elements.
pub(crate) fn check_split(
    op: &'static str,
    big: &Tensor,
    small: &Tensor,
    size: usize,
) -> Result<usize, CommError> {
    let (b, s) = (big.numel(), small.numel());
    if b != s * size {
        return Err(CommError::BadArgument {
            op,
            message: format!(
                "the full buffer has {b} elements but the per-rank buffer has {s} and the group has \
                 {size} ranks ({s} x {size} = {} expected)",
                s * size
            ),
        });
    }
    if big.kind() != small.kind() {
        return Err(CommError::BadArgument {
            op,
            message: format!("dtype mismatch: {:?} vs {:?}", big.kind(), small.kind()),
        });
    }
    Ok(s)
}
