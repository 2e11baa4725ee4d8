//! The collective interface every backend implements, and its error type.
//!
//! Semantics follow torch.distributed: `all_reduce` works in place; `reduce_scatter` and
//! `all_gather` split a flat buffer into `size()` equal chunks in rank order (callers pad, as
//! FSDP does); `broadcast` copies the root's tensor into everyone's; `all_to_all` sends each rank
//! its own run of rows, of any length (expert parallelism's token exchange); `send_recv` runs a
//! batch of point-to-point sends and receives together (torch's `batch_isend_irecv`: the
//! pipeline's transfers). A failed collective leaves the group unusable: training stops with
//! the error.

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

/// One point-to-point transfer of a [`Collectives::send_recv`] batch: torch's `P2POp`. `peer`
/// is a rank of the group; the k-th send from rank a to rank b pairs with the k-th receive of
/// rank b from rank a, whatever batches they are in, and the two tensors must have the same
/// byte size.
#[derive(Clone, Copy)]
pub enum P2pOp<'a> {
    Send { tensor: &'a Tensor, peer: usize },
    Recv { tensor: &'a Tensor, peer: usize },
}

impl<'a> P2pOp<'a> {
    pub fn tensor(&self) -> &'a Tensor {
        match *self {
            P2pOp::Send { tensor, .. } | P2pOp::Recv { tensor, .. } => tensor,
        }
    }

    pub fn peer(&self) -> usize {
        match *self {
            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => peer,
        }
    }

    pub fn is_send(&self) -> bool {
        matches!(self, P2pOp::Send { .. })
    }
}

/// One collective of a group, as [`Collectives::queue`] takes it.
#[derive(Clone, Copy)]
pub enum CollectiveOp<'a> {
    AllReduce {
        tensor: &'a Tensor,
        op: ReduceOp,
    },
    ReduceScatter {
        output: &'a Tensor,
        input: &'a Tensor,
        op: ReduceOp,
    },
    AllGather {
        output: &'a Tensor,
        input: &'a Tensor,
    },
    Broadcast {
        tensor: &'a Tensor,
        root: usize,
    },
    AllToAll {
        output: &'a Tensor,
        input: &'a Tensor,
        output_splits: &'a [usize],
        input_splits: &'a [usize],
    },
    SendRecv {
        ops: &'a [P2pOp<'a>],
    },
}

impl CollectiveOp<'_> {
    /// torch.distributed's name of it.
    pub fn name(&self) -> &'static str {
        match self {
            CollectiveOp::AllReduce { .. } => "all_reduce",
            CollectiveOp::ReduceScatter { .. } => "reduce_scatter",
            CollectiveOp::AllGather { .. } => "all_gather",
            CollectiveOp::Broadcast { .. } => "broadcast",
            CollectiveOp::AllToAll { .. } => "all_to_all_single",
            CollectiveOp::SendRecv { .. } => "batch_isend_irecv",
        }
    }

    /// The bytes this rank passes in (a reduce-scatter's or all-gather's input, the tensor of
    /// the others, a batch's sends): what titan-obs's `*_bytes` scalars count.
    pub fn input_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        let t = match self {
            CollectiveOp::AllReduce { tensor, .. } | CollectiveOp::Broadcast { tensor, .. } => {
                tensor
            }
            CollectiveOp::ReduceScatter { input, .. }
            | CollectiveOp::AllGather { input, .. }
            | CollectiveOp::AllToAll { input, .. } => input,
            CollectiveOp::SendRecv { ops } => {
                return ops
                    .iter()
                    .filter(|op| op.is_send())
                    .map(|op| bytes(op.tensor()))
                    .sum();
            }
        };
        bytes(t)
    }

    /// Runs it with `c`'s blocking call.
    pub fn run(self, c: &mut (impl Collectives + ?Sized)) -> Result<(), CommError> {
        match self {
            CollectiveOp::AllReduce { tensor, op } => c.all_reduce(tensor, op),
            CollectiveOp::ReduceScatter { output, input, op } => {
                c.reduce_scatter(output, input, op)
            }
            CollectiveOp::AllGather { output, input } => c.all_gather(output, input),
            CollectiveOp::Broadcast { tensor, root } => c.broadcast(tensor, root),
            CollectiveOp::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => c.all_to_all(output, input, output_splits, input_splits),
            CollectiveOp::SendRecv { ops } => c.send_recv(ops),
        }
    }
}

/// A collective the backend queued on the device without making the caller's stream wait
/// for it: torch's `Work` of an `async_op=True` call on NCCL. Until [`QueuedWork::wait`] the
/// collective may still be running, so its tensors must stay alive and untouched; dropping the
/// work waits as `wait` does (the memory of its tensors is only reused behind it).
pub trait QueuedWork: Send {
    /// Makes the stream tch's kernels run on wait for the collective: what is queued after
    /// sees its output. The host does not wait.
    fn wait(&mut self) -> Result<(), CommError>;
    /// Whether the collective has finished on the device (no wait).
    fn is_done(&self) -> Result<bool, CommError>;
    /// For a backend to find its own work among another group's (a chained collective).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What [`Collectives::queue`] did with a collective.
pub enum Issued {
    /// It ran to completion on the host (the `cpu` backend).
    Done,
    /// It is queued on the device.
    Queued(Box<dyn QueuedWork>),
}

/// [`Collectives::backend`] of the host ring (`cpu.rs`).
pub const CPU_BACKEND: &str = "cpu";
/// [`Collectives::backend`] of NCCL (`nccl.rs`), whose collectives run on the GPU.
pub const NCCL_BACKEND: &str = "nccl";

/// Collectives over a group of ranks. Tensors are CPU tensors for the `cpu` backend and CUDA
/// tensors for `nccl`; both ranks of a call must pass the same shapes and dtypes.
pub trait Collectives: Send {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Backend name ([`CPU_BACKEND`], [`NCCL_BACKEND`]).
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
    /// torch.distributed's `all_to_all_single` with splits: the first `input_splits[0]` rows
    /// of `input` (dim 0) go to rank 0, the next `input_splits[1]` to rank 1, ...; `output`
    /// receives `output_splits[s]` rows from each rank s, in rank order. Both tensors have the
    /// same dtype and row shape; rank s's `input_splits[d]` must equal rank d's
    /// `output_splits[s]` (exchange the counts first).
    fn all_to_all(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError>;
    /// torch.distributed's `batch_isend_irecv`, waited for: runs `ops` together, so no send of
    /// the batch waits for a receive issued after it (a send may wait for its receiver; see
    /// [`P2pOp`] for how transfers pair). Returns once every receive has its data and every
    /// send's tensor may be reused.
    fn send_recv(&mut self, ops: &[P2pOp<'_>]) -> Result<(), CommError>;
    /// Returns once every rank of the group has called it.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Whether [`Collectives::queue`] queues on the device (NCCL) rather than running the
    /// collective on the host before it returns.
    fn queues_on_device(&self) -> bool {
        false
    }

    /// Queues `op` behind `after` (a queued collective of another group of the same device,
    /// whose output `op` reads) and returns without waiting for it where the backend queues
    /// on the device ([`Issued::Queued`]); otherwise runs it now ([`Issued::Done`]; `after` must
    /// then have been waited for).
    fn queue(
        &mut self,
        op: CollectiveOp<'_>,
        after: Option<&dyn QueuedWork>,
    ) -> Result<Issued, CommError> {
        let _ = after;
        op.run(self)?;
        Ok(Issued::Done)
    }
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

/// Checks a point-to-point batch's peers against a group of `size` ranks.
pub(crate) fn check_peers(ops: &[P2pOp<'_>], size: usize) -> Result<(), CommError> {
    match ops.iter().find(|op| op.peer() >= size) {
        Some(op) => Err(CommError::BadArgument {
            op: "batch_isend_irecv",
            message: format!("peer {} is not a rank of this group of {size}", op.peer()),
        }),
        None => Ok(()),
    }
}

/// Checks an all-to-all's arguments: a split per rank, splits that add up to each tensor's rows,
/// the same dtype and row shape. Returns the elements per row.
pub(crate) fn check_all_to_all(
    output: &Tensor,
    input: &Tensor,
    output_splits: &[usize],
    input_splits: &[usize],
    size: usize,
) -> Result<usize, CommError> {
    const OP: &str = "all_to_all_single";
    let bad = |message: String| CommError::BadArgument { op: OP, message };
    for (what, splits) in [("input", input_splits), ("output", output_splits)] {
        if splits.len() != size {
            return Err(bad(format!(
                "{} {what} splits for a group of {size} ranks",
                splits.len()
            )));
        }
    }
    if input.kind() != output.kind() {
        return Err(bad(format!(
            "dtype mismatch: input {:?}, output {:?}",
            input.kind(),
            output.kind()
        )));
    }
    let (ins, outs) = (input.size(), output.size());
    if ins.is_empty() || outs.is_empty() || ins[1..] != outs[1..] {
        return Err(bad(format!(
            "input {ins:?} and output {outs:?} need one row shape after dim 0"
        )));
    }
    for (what, rows, splits) in [
        ("input", ins[0], input_splits),
        ("output", outs[0], output_splits),
    ] {
        let sum: usize = splits.iter().sum();
        if sum as i64 != rows {
            return Err(bad(format!(
                "the {what} splits {splits:?} add up to {sum} rows but the {what} has {rows}"
            )));
        }
    }
    Ok(ins[1..].iter().product::<i64>() as usize)
}
