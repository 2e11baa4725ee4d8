//! The `nccl` backend: [`Collectives`] on CUDA tensors through NCCL, loaded at run time by
//! cudarc (so the default build and CI need no CUDA). The unique id travels through the store.
//!
//! Operations are enqueued on the legacy default stream, the one tch's kernels run on (tch
//! exposes no stream API), so they are ordered after the kernels that produced their inputs.
//! Every collective then waits for completion while polling NCCL's async error state, and aborts
//! the communicator when it makes no progress within the timeout: a dead or hung peer becomes an
//! error instead of a hang.

use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::driver::sys as cuda;
use cudarc::nccl::{result as nccl, sys};
use tch::{Device, Kind, Tensor};

use super::comm::{Collectives, CommError, ReduceOp, check_split};
use super::cpu::FAILURE_KEY;
use super::store::TcpStore;

/// A NCCL communicator over a group of ranks, each driving one GPU.
pub struct NcclGroup {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    global_rank: usize,
    device: usize,
    timeout: Duration,
    store: Option<Arc<TcpStore>>,
    // Keeps the primary context retained while the communicator lives.
    _ctx: Arc<CudaContext>,
}

// SAFETY: a NCCL communicator may be used from any thread as long as calls are not concurrent;
// `&mut self` on every operation guarantees that.
unsafe impl Send for NcclGroup {}

fn nccl_err(rank: usize, what: &str, e: nccl::NcclError) -> CommError {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
    let msg = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) }.to_string_lossy();
    CommError::Setup {
        rank,
        message: format!("NCCL {what}: {msg} ({:?})", e.0),
    }
}

impl NcclGroup {
    /// Creates the communicator of `members` (global ranks; this process is `members[me]`) on
    /// CUDA device `device`. Member 0 creates the unique id and publishes it under `key`.
    pub fn connect(
        store: Option<Arc<TcpStore>>,
        key: &str,
        members: Vec<usize>,
        me: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclGroup, CommError> {
        let rank = members[me];
        let setup = |message: String| CommError::Setup { rank, message };
        // cudarc panics on its first call when libcuda is missing: ask libtorch first.
        if !tch::Cuda::is_available() {
            return Err(setup(
                "comm.backend = \"nccl\" needs CUDA, but no CUDA device is available; use \
                 comm.backend = \"cpu\""
                    .into(),
            ));
        }
        let count = tch::Cuda::device_count() as usize;
        if device >= count {
            return Err(setup(format!(
                "local rank {device} has no GPU: this node has {count} (run at most {count} \
                 ranks per node)"
            )));
        }
        let ctx =
            CudaContext::new(device).map_err(|e| setup(format!("CUDA device {device}: {e:?}")))?;
        ctx.bind_to_thread()
            .map_err(|e| setup(format!("CUDA device {device}: {e:?}")))?;
        let id_key = format!("{key}/nccl_unique_id");
        let id = if me == 0 {
            let id = nccl::get_uniqueid().map_err(|e| nccl_err(rank, "get unique id", e))?;
            if let Some(store) = &store {
                // SAFETY: ncclUniqueId is 128 plain bytes.
                let bytes = unsafe {
                    std::slice::from_raw_parts((&id as *const sys::ncclUniqueId).cast::<u8>(), 128)
                };
                store
                    .set(&id_key, bytes)
                    .map_err(|source| CommError::Store { rank, source })?;
            }
            id
        } else {
            let store = store
                .as_ref()
                .ok_or_else(|| setup("a multi-rank NCCL group needs a store".into()))?;
            store
                .wait(&[&id_key], timeout)
                .map_err(|source| CommError::Store { rank, source })?;
            let bytes = store
                .get(&id_key)
                .map_err(|source| CommError::Store { rank, source })?;
            if bytes.len() != 128 {
                return Err(setup(format!(
                    "NCCL unique id in the store has {} bytes, expected 128",
                    bytes.len()
                )));
            }
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            for (d, s) in id.internal.iter_mut().zip(&bytes) {
                *d = *s as _;
            }
            id
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer; rank and size are in range.
        unsafe { nccl::comm_init_rank(&mut comm, members.len() as i32, id, me as i32) }
            .map_err(|e| nccl_err(rank, "init", e))?;
        Ok(NcclGroup {
            comm,
            rank: me,
            size: members.len(),
            global_rank: rank,
            device,
            timeout,
            store,
            _ctx: ctx,
        })
    }

    fn dtype(&self, op: &'static str, kind: Kind) -> Result<sys::ncclDataType_t, CommError> {
        use sys::ncclDataType_t::*;
        Ok(match kind {
            Kind::Float => ncclFloat32,
            Kind::Double => ncclFloat64,
            Kind::Half => ncclFloat16,
            Kind::BFloat16 => ncclBfloat16,
            Kind::Int => ncclInt32,
            Kind::Int64 => ncclInt64,
            Kind::Int8 => ncclInt8,
            Kind::Uint8 | Kind::Bool => ncclUint8,
            other => {
                return Err(CommError::BadArgument {
                    op,
                    message: format!("NCCL has no {other:?} type"),
                });
            }
        })
    }

    fn check(&self, op: &'static str, t: &Tensor) -> Result<(), CommError> {
        if t.device() != Device::Cuda(self.device) {
            return Err(CommError::BadArgument {
                op,
                message: format!(
                    "the nccl backend of rank {} needs tensors on cuda:{}, got {:?}",
                    self.global_rank,
                    self.device,
                    t.device()
                ),
            });
        }
        if !t.is_contiguous() {
            return Err(CommError::BadArgument {
                op,
                message: "the nccl backend needs contiguous tensors".into(),
            });
        }
        Ok(())
    }

    /// Waits for the enqueued operation, polling NCCL's async error; aborts on timeout.
    fn wait(&mut self, op: &'static str) -> Result<(), CommError> {
        let start = Instant::now();
        loop {
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            if async_err != sys::ncclResult_t::ncclSuccess
                && async_err != sys::ncclResult_t::ncclInProgress
            {
                return Err(self.fail(format!("NCCL {op} failed: {async_err:?}")));
            }
            // SAFETY: querying the legacy default stream of the bound context.
            match unsafe { cuda::cuStreamQuery(std::ptr::null_mut()) } {
                cuda::CUresult::CUDA_SUCCESS => return Ok(()),
                cuda::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.fail(format!("CUDA error during {op}: {other:?}"))),
            }
            if start.elapsed() > self.timeout {
                return Err(self.fail(format!(
                    "NCCL {op} made no progress for {:?}: a peer is dead or hung (see the \
                     launcher's report of which rank exited)",
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Aborts the communicator (it is unusable after a failure) and posts a failure notice.
    fn fail(&mut self, message: String) -> CommError {
        // SAFETY: live communicator; abort makes pending operations return.
        unsafe { sys::ncclCommAbort(self.comm) };
        self.comm = std::ptr::null_mut();
        let err = CommError::Setup {
            rank: self.global_rank,
            message,
        };
        if let Some(store) = &self.store {
            let own = err.to_string();
            if let Ok(first) = store.compare_set(FAILURE_KEY, b"", own.as_bytes())
                && first != own.as_bytes()
            {
                return CommError::AfterPeerFailure {
                    own: Box::new(err),
                    first: String::from_utf8_lossy(&first).into_owned(),
                };
            }
        }
        err
    }

    fn live(&self, op: &'static str) -> Result<(), CommError> {
        if self.comm.is_null() {
            return Err(CommError::BadArgument {
                op,
                message: "the NCCL communicator was aborted after an earlier failure".into(),
            });
        }
        Ok(())
    }

    fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
        match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        }
    }
}

impl Collectives for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&mut self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.live("all_reduce")?;
        self.check("all_reduce", tensor)?;
        let dt = self.dtype("all_reduce", tensor.kind())?;
        let p = tensor.data_ptr();
        // SAFETY: in-place on a contiguous CUDA tensor of numel elements on our device.
        unsafe {
            nccl::all_reduce(
                p as *const c_void,
                p,
                tensor.numel(),
                dt,
                Self::red_op(op),
                self.comm,
                std::ptr::null_mut(),
            )
        }
        .map_err(|e| nccl_err(self.global_rank, "all_reduce", e))?;
        self.wait("all_reduce")
    }

    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.live("reduce_scatter")?;
        let k = check_split("reduce_scatter", input, output, self.size)?;
        self.check("reduce_scatter", input)?;
        self.check("reduce_scatter", output)?;
        let dt = self.dtype("reduce_scatter", input.kind())?;
        // SAFETY: input holds size * k elements, output k, both on our device.
        unsafe {
            nccl::reduce_scatter(
                input.data_ptr() as *const c_void,
                output.data_ptr(),
                k,
                dt,
                Self::red_op(op),
                self.comm,
                std::ptr::null_mut(),
            )
        }
        .map_err(|e| nccl_err(self.global_rank, "reduce_scatter", e))?;
        self.wait("reduce_scatter")
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        self.live("all_gather")?;
        let k = check_split("all_gather", output, input, self.size)?;
        self.check("all_gather", input)?;
        self.check("all_gather", output)?;
        let dt = self.dtype("all_gather", input.kind())?;
        // SAFETY: input holds k elements, output size * k, both on our device.
        unsafe {
            nccl::all_gather(
                input.data_ptr() as *const c_void,
                output.data_ptr(),
                k,
                dt,
                self.comm,
                std::ptr::null_mut(),
            )
        }
        .map_err(|e| nccl_err(self.global_rank, "all_gather", e))?;
        self.wait("all_gather")
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        self.live("broadcast")?;
        self.check("broadcast", tensor)?;
        if root >= self.size {
            return Err(CommError::BadArgument {
                op: "broadcast",
                message: format!("root {root} is not a rank of this group of {}", self.size),
            });
        }
        let dt = self.dtype("broadcast", tensor.kind())?;
        let p = tensor.data_ptr();
        // SAFETY: in-place on a contiguous CUDA tensor on our device.
        unsafe {
            nccl::broadcast(
                p as *const c_void,
                p,
                tensor.numel(),
                dt,
                root as i32,
                self.comm,
                std::ptr::null_mut(),
            )
        }
        .map_err(|e| nccl_err(self.global_rank, "broadcast", e))?;
        self.wait("broadcast")
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let t = Tensor::zeros([1], (Kind::Int, Device::Cuda(self.device)));
        self.all_reduce(&t, ReduceOp::Sum)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: live communicator, destroyed once.
            unsafe { sys::ncclCommDestroy(self.comm) };
        }
    }
}
