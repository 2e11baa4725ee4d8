//! The `cpu` backend: [`Collectives`] on CPU tensors over the TCP ring of [`super::ring`].

use std::sync::Arc;

use tch::{Kind, Tensor};

use super::comm::{
    Collectives, CommError, P2pOp, ReduceOp, check_all_to_all, check_peers, check_split,
};
use super::connect::{SocketOptions, connect_ring};
use super::elem::Elem;
use super::failure::{FAILURE_KEY, FailureBoard, Posted};
use super::ring::Ring;
use super::store::TcpStore;

/// A group of ranks running collectives on CPU tensors.
pub struct CpuGroup {
    ring: Ring,
    failures: Option<Arc<FailureBoard>>,
}

impl CpuGroup {
    /// Connects the ring of `members` (global ranks; this process is `members[me]`). Every member
    /// must call this with the same `name` and `members`.
    pub fn connect(
        failures: Arc<FailureBoard>,
        store_host: &str,
        name: &str,
        members: Vec<usize>,
        me: usize,
        opts: &SocketOptions,
    ) -> Result<CpuGroup, CommError> {
        let (next, prev) = if members.len() > 1 {
            let (n, p) = connect_ring(&failures.store, name, &members, me, opts, store_host)?;
            (Some(n), Some(p))
        } else {
            (None, None)
        };
        Ok(CpuGroup {
            ring: Ring::new(me, members, next, prev, opts.segment_bytes, opts.timeout),
            failures: Some(failures),
        })
    }

    /// Posts this failure to the store unless another rank posted first, and, if one did, adds
    /// that first failure to the error (the root cause is usually there, not here).
    fn report(&self, err: CommError) -> CommError {
        let Some(failures) = &self.failures else {
            return err;
        };
        let err = follow_waits(&failures.store, err);
        match failures.post(&err.to_string()) {
            Posted::First => err,
            Posted::After(first) => CommError::AfterPeerFailure {
                own: Box::new(err),
                first,
            },
            Posted::Unreachable(why) => CommError::NoticesUnreachable {
                own: Box::new(err),
                why,
            },
        }
    }

    /// A group of just this process: every collective is a local no-op (or copy).
    pub fn single() -> CpuGroup {
        CpuGroup {
            ring: Ring::new(
                0,
                vec![0],
                None,
                None,
                1 << 20,
                std::time::Duration::from_secs(1),
            ),
            failures: None,
        }
    }

    /// Sets how long a collective waits for a peer that makes no progress.
    pub fn set_timeout(&mut self, timeout: std::time::Duration) -> std::io::Result<()> {
        self.ring.set_timeout(timeout)
    }

    fn global_rank(&self) -> usize {
        self.ring.members[self.ring.rank]
    }
}

/// A contiguous host tensor with `t`'s values: `t` itself where it is one, else a copy. A CUDA
/// tensor is staged through host memory as gloo stages it (the copy out waits for the kernels
/// that wrote it, the copy back is ordered before the kernels that read it): so ranks that
/// share a GPU, or have no NCCL, still train on CUDA tensors.
fn staged(op: &'static str, t: &Tensor) -> Tensor {
    if t.device().is_cuda() {
        crate::host_sync::to_host(t, op).contiguous()
    } else if t.is_contiguous() {
        t.shallow_clone()
    } else {
        t.contiguous()
    }
}

/// Copies what a collective wrote into `work` (from [`staged`]) back into `t`.
fn unstage(t: &Tensor, work: &Tensor) {
    if work.data_ptr() != t.data_ptr() {
        t.shallow_clone().copy_(work);
    }
}

/// The bytes of a contiguous host tensor.
///
/// # Safety
/// `t` is contiguous, on the host, alive while the slice is, and nothing else reads or writes
/// it meanwhile (collectives work in place, as torch.distributed's do).
#[allow(clippy::mut_from_ref)]
unsafe fn bytes_of(t: &Tensor) -> &mut [u8] {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract; `len` bytes from the tensor's data pointer.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<u8>(), len) }
}

/// Runs `f` on the bytes of `t`, through a contiguous host copy if needed ([`staged`]).
fn with_bytes<R>(
    op: &'static str,
    t: &Tensor,
    f: impl FnOnce(&mut [u8], Elem) -> Result<R, CommError>,
) -> Result<R, CommError> {
    let elem = Elem::from_kind(t.kind()).ok_or_else(|| CommError::BadArgument {
        op,
        message: format!("unsupported dtype {:?}", t.kind()),
    })?;
    let work = staged(op, t);
    // SAFETY: `work` is a contiguous host tensor this call borrows exclusively.
    let result = f(unsafe { bytes_of(&work) }, elem)?;
    unstage(t, &work);
    Ok(result)
}

impl Collectives for CpuGroup {
    fn rank(&self) -> usize {
        self.ring.rank
    }

    fn size(&self) -> usize {
        self.ring.size
    }

    fn backend(&self) -> &'static str {
        super::comm::CPU_BACKEND
    }

    fn all_reduce(&mut self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        let r = with_bytes("all_reduce", tensor, |b, e| self.ring.all_reduce(b, e, op));
        r.map_err(|e| self.report(e))
    }

    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let k = check_split("reduce_scatter", input, output, self.size())? as i64;
        // The ring reduces in place; the caller's input stays untouched, as in torch.
        let work = input.reshape([-1]).copy();
        let r = with_bytes("reduce_scatter", &work, |b, e| {
            self.ring.reduce_scatter(b, e, op)
        });
        r.map_err(|e| self.report(e))?;
        let mine = work.narrow(0, self.rank() as i64 * k, k);
        output.shallow_clone().copy_(&mine.reshape(output.size()));
        Ok(())
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        let k = check_split("all_gather", output, input, self.size())? as i64;
        let flat = if output.is_contiguous() {
            output.view([-1])
        } else {
            output.reshape([-1]).copy()
        };
        flat.narrow(0, self.rank() as i64 * k, k)
            .copy_(&input.reshape([-1]));
        let r = with_bytes("all_gather", &flat, |b, e| self.ring.all_gather(b, e));
        r.map_err(|e| self.report(e))?;
        if !output.is_contiguous() {
            output.shallow_clone().copy_(&flat.reshape(output.size()));
        }
        Ok(())
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(CommError::BadArgument {
                op: "broadcast",
                message: format!("root {root} is not a rank of this group of {}", self.size()),
            });
        }
        let r = with_bytes("broadcast", tensor, |b, _| self.ring.broadcast(b, root));
        r.map_err(|e| self.report(e))
    }

    fn all_to_all(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        const OP: &str = "all_to_all_single";
        let row = check_all_to_all(output, input, output_splits, input_splits, self.size())?;
        let input = staged(OP, input);
        let elem = Elem::from_kind(input.kind()).ok_or_else(|| CommError::BadArgument {
            op: OP,
            message: format!("unsupported dtype {:?}", input.kind()),
        })?;
        let bytes = |splits: &[usize]| -> Vec<usize> {
            splits
                .iter()
                .map(|&rows| rows * row * elem.size())
                .collect()
        };
        let (out_bytes, in_bytes) = (bytes(output_splits), bytes(input_splits));
        // SAFETY: a contiguous host tensor, alive for this call, only read.
        let input_bytes: &[u8] = unsafe { bytes_of(&input) };
        let r = with_bytes(OP, output, |out, _| {
            self.ring
                .all_to_all(out, &out_bytes, input_bytes, &in_bytes)
        });
        r.map_err(|e| self.report(e))
    }

    fn send_recv(&mut self, ops: &[P2pOp<'_>]) -> Result<(), CommError> {
        const OP: &str = "batch_isend_irecv";
        check_peers(ops, self.size())?;
        let staged: Vec<Tensor> = ops.iter().map(|op| staged(OP, op.tensor())).collect();
        let mut sends: Vec<(usize, &[u8])> = Vec::new();
        let mut recvs: Vec<(usize, &mut [u8])> = Vec::new();
        for (op, t) in ops.iter().zip(&staged) {
            // SAFETY: contiguous host tensors, alive for this call, each in one list only.
            let bytes = unsafe { bytes_of(t) };
            if op.is_send() {
                sends.push((op.peer(), bytes));
            } else {
                recvs.push((op.peer(), bytes));
            }
        }
        let r = self.ring.send_recv(&sends, &mut recvs);
        r.map_err(|e| self.report(e))?;
        for (op, t) in ops.iter().zip(&staged).filter(|(op, _)| !op.is_send()) {
            unstage(op.tensor(), t);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let t = Tensor::from_slice(&[self.global_rank() as i32]).to_kind(Kind::Int);
        self.all_reduce(&t, ReduceOp::Sum)
    }
}

/// A timeout names the peer this rank waited for, but in a ring that peer may itself be waiting
/// for the hung rank. Each timed-out rank records whom it waited for; after a short pause (the
/// others time out at about the same moment) the chain of waits is followed to the rank at its
/// end, which is named too.
fn follow_waits(store: &TcpStore, err: CommError) -> CommError {
    let CommError::PeerTimeout { rank, peer, .. } = err else {
        return err;
    };
    let key = |r: usize| format!("{FAILURE_KEY}/waits/{r}");
    if store.set(&key(rank), peer.to_string().as_bytes()).is_err() {
        return err;
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut end = peer;
    for _ in 0..64 {
        let next = match store.check(&[&key(end)]) {
            Ok(true) => store
                .get(&key(end))
                .ok()
                .and_then(|v| String::from_utf8_lossy(&v).parse::<usize>().ok()),
            _ => None,
        };
        match next {
            Some(n) if n != rank && n != end => end = n,
            _ => break,
        }
    }
    if end == peer {
        err
    } else {
        CommError::WaitChain {
            own: Box::new(err),
            end,
        }
    }
}
