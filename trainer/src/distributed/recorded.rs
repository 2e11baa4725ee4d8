//! Every collective a rank runs, recorded as a titan-obs span named like torch.distributed's
//! function (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `all_to_all_single`,
//! and `batch_isend_irecv` for a batch of point-to-point transfers) with a scalar holding
//! the bytes this rank passed in (`comm/<name>_bytes`, recorded inside the span). The analysis
//! matches the same call across ranks to tell who arrived last and who waited (obs/SCHEMA.md,
//! "Collectives").
//!
//! The span covers the host call: for the `cpu` backend the whole transfer; for `nccl`, what
//! the call blocks for, and its GPU twin `gpu:<name>` (`gpu_clock`) the device's time in it.

use tch::Tensor;
use titan_obs_core::Reduce;
use titan_obs_core::vocab::collective as names;

use super::comm::{
    CollectiveOp, Collectives, CommError, Issued, NCCL_BACKEND, P2pOp, QueuedWork, ReduceOp,
};
use crate::gpu_clock;

/// A group whose collectives are recorded.
pub struct Recorded(pub Box<dyn Collectives>);

/// Where a collective's time goes: the host's call alone, or also a GPU twin.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Timed {
    Host,
    HostAndGpu,
}

impl Recorded {
    /// Runs `op` inside a span named after it, after recording its bytes scalar (the bytes
    /// this rank passes in). A blocking NCCL call is timed on the GPU too (`gpu_clock`); the
    /// `cpu` backend's work is the host's alone, and a queued call's span covers its queuing
    /// (the collective runs on the group's stream, waited for later).
    fn recorded<T>(
        &mut self,
        op: CollectiveOp<'_>,
        timed: Timed,
        f: impl FnOnce(&mut dyn Collectives, CollectiveOp<'_>) -> T,
    ) -> T {
        let name = op.name();
        let payload = op.input_bytes() as f64;
        let _s = if timed == Timed::HostAndGpu && self.0.backend() == NCCL_BACKEND {
            gpu_clock::span(name)
        } else {
            gpu_clock::host_span(name)
        };
        if let Some(scalar) = names::bytes_scalar(name) {
            titan_obs_core::scalar(scalar, payload, Reduce::Sum);
        }
        f(self.0.as_mut(), op)
    }
}

impl Collectives for Recorded {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn backend(&self) -> &'static str {
        self.0.backend()
    }

    fn all_reduce(&mut self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        let op = CollectiveOp::AllReduce { tensor, op };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let op = CollectiveOp::ReduceScatter { output, input, op };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        let op = CollectiveOp::AllGather { output, input };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        let op = CollectiveOp::Broadcast { tensor, root };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn all_to_all(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        let op = CollectiveOp::AllToAll {
            output,
            input,
            output_splits,
            input_splits,
        };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn send_recv(&mut self, ops: &[P2pOp<'_>]) -> Result<(), CommError> {
        let op = CollectiveOp::SendRecv { ops };
        self.recorded(op, Timed::HostAndGpu, |c, op| op.run(c))
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.0.barrier()
    }

    fn queues_on_device(&self) -> bool {
        self.0.queues_on_device()
    }

    fn queue(
        &mut self,
        op: CollectiveOp<'_>,
        after: Option<&dyn QueuedWork>,
    ) -> Result<Issued, CommError> {
        // The cpu backend runs it now (its `queue` calls the blocking call); NCCL queues it.
        self.recorded(op, Timed::Host, |c, op| c.queue(op, after))
    }
}
