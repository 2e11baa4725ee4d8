//! Every collective a rank runs, recorded as a titan-obs span named like torch.distributed's
//! function (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`) with a scalar holding
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
    CollectiveOp, Collectives, CommError, Issued, NCCL_BACKEND, QueuedWork, ReduceOp,
};
use crate::gpu_clock;

/// A group whose collectives are recorded.
pub struct Recorded(pub Box<dyn Collectives>);

fn bytes(t: &Tensor) -> f64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as f64
}

/// Runs `f` inside a span `name` after recording the bytes scalar; on NCCL the span is timed
/// on the GPU too (`gpu_clock`), where the `cpu` backend's work is the host's alone.
fn recorded<T>(
    backend: &'static str,
    name: &'static str,
    bytes_scalar: &'static str,
    payload: f64,
    f: impl FnOnce() -> T,
) -> T {
    let _s = if backend == NCCL_BACKEND {
        gpu_clock::span(name)
    } else {
        gpu_clock::host_span(name)
    };
    titan_obs_core::scalar(bytes_scalar, payload, Reduce::Sum);
    f()
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
        recorded(
            self.0.backend(),
            names::ALL_REDUCE,
            names::ALL_REDUCE_BYTES,
            bytes(tensor),
            || self.0.all_reduce(tensor, op),
        )
    }

    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        recorded(
            self.0.backend(),
            names::REDUCE_SCATTER,
            names::REDUCE_SCATTER_BYTES,
            bytes(input),
            || self.0.reduce_scatter(output, input, op),
        )
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        recorded(
            self.0.backend(),
            names::ALL_GATHER,
            names::ALL_GATHER_BYTES,
            bytes(input),
            || self.0.all_gather(output, input),
        )
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        recorded(
            self.0.backend(),
            names::BROADCAST,
            names::BROADCAST_BYTES,
            bytes(tensor),
            || self.0.broadcast(tensor, root),
        )
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.0.barrier()
    }

    fn queues_on_device(&self) -> bool {
        self.0.queues_on_device()
    }

    /// The span covers the host's queuing alone (no GPU twin: the collective runs on the
    /// group's own stream, which the caller's stream waits for later, in `wait`).
    fn queue(
        &mut self,
        op: CollectiveOp<'_>,
        after: Option<&dyn QueuedWork>,
    ) -> Result<Issued, CommError> {
        if !self.0.queues_on_device() {
            // Run now, through the recorded blocking calls.
            op.run(self)?;
            return Ok(Issued::Done);
        }
        let name = op.name();
        let payload = match op {
            CollectiveOp::AllReduce { tensor, .. } | CollectiveOp::Broadcast { tensor, .. } => {
                bytes(tensor)
            }
            CollectiveOp::ReduceScatter { input, .. } | CollectiveOp::AllGather { input, .. } => {
                bytes(input)
            }
        };
        let _s = gpu_clock::host_span(name);
        if let Some(scalar) = names::bytes_scalar(name) {
            titan_obs_core::scalar(scalar, payload, Reduce::Sum);
        }
        self.0.queue(op, after)
    }
}
