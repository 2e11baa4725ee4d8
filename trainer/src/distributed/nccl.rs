//! The `nccl` backend: [`Collectives`] on CUDA tensors through NCCL, loaded at run time by
//! cudarc (so the default build and CI need no CUDA). The unique id travels through the store.
//!
//! Each collective runs on the group's own CUDA stream, ordered by events and never by a host
//! wait: the stream waits for an event recorded on the legacy default stream (where tch's kernels
//! run, so the inputs are ready), NCCL enqueues there, and then the default stream waits for the
//! collective's completion event before its next kernels (which may read the output or reuse the
//! inputs' memory): at once for the blocking calls (torch's `Work.wait()` of a synchronous op),
//! or only when the caller asks, for a queued one ([`Collectives::queue`], an [`NcclWork`]:
//! FSDP's prefetches and gradient reductions, the pipeline's transfers), so the default stream's
//! compute overlaps it. A watchdog thread polls the completion events and NCCL's async error state:
//! a collective that makes no progress within the timeout (a dead or hung peer) aborts the
//! communicator, posts the failure to the store and ends the process, as torch's NCCL watchdog
//! does. `barrier` alone waits on the host.

use std::collections::VecDeque;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::driver::sys as cuda;
use cudarc::nccl::{result as nccl, sys};
use tch::{Device, Kind, Tensor};

use super::comm::{
    CollectiveOp, Collectives, CommError, Issued, P2pOp, QueuedWork, ReduceOp, check_all_to_all,
    check_peers, check_split,
};
use super::failure::{FailureBoard, Posted};

/// A NCCL communicator over a group of ranks, each driving one GPU.
pub struct NcclGroup {
    watch: Arc<Watch>,
    /// The group's own stream (non-blocking with respect to the legacy default stream).
    stream: cuda::CUstream,
    rank: usize,
    size: usize,
    global_rank: usize,
    device: usize,
    timeout: Duration,
    watchdog: Option<std::thread::JoinHandle<()>>,
    // Keeps the primary context retained while the communicator lives.
    ctx: Arc<CudaContext>,
}

// SAFETY: a NCCL communicator and a CUDA stream may be used from any thread as long as calls are
// not concurrent; `&mut self` on every operation guarantees that (the watchdog only aborts, under
// the communicator's lock).
unsafe impl Send for NcclGroup {}

/// What the group and its watchdog share.
struct Watch {
    /// The communicator; null once aborted.
    comm: Mutex<sys::ncclComm_t>,
    /// Completion events of the enqueued collectives, oldest first.
    in_flight: Mutex<VecDeque<InFlight>>,
    /// Why the communicator was aborted.
    failure: Mutex<Option<String>>,
    stop: AtomicBool,
}

struct InFlight {
    done: cuda::CUevent,
    op: &'static str,
    since: Instant,
}

// SAFETY: the raw handles are only used under the mutexes above.
unsafe impl Send for Watch {}
// SAFETY: as above.
unsafe impl Sync for Watch {}

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
        failures: Option<Arc<FailureBoard>>,
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
                "comm.backend = \"nccl\" needs CUDA, but no CUDA device is available; set \
                 training.device = \"cpu\" (or comm.backend = \"cpu\")"
                    .into(),
            ));
        }
        // cudarc also panics when it finds no NCCL library; its names are libnccl.so and
        // libnccl.so.<CUDA major>, while pip's NCCL wheel (what torch installs) ships only
        // libnccl.so.2.
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(setup(
                "the NCCL library was not found: titan-train opens libnccl.so (or \
                 libnccl.so.13) from the library path, and pip's NCCL wheel ships only \
                 libnccl.so.2; link it under that name in a folder on LD_LIBRARY_PATH (ln -s \
                 <site-packages>/nvidia/nccl/lib/libnccl.so.2 <dir>/libnccl.so), or set \
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
        let store = failures.as_ref().map(|f| &f.store);
        let id_key = format!("{key}/nccl_unique_id");
        let id = if me == 0 {
            let id = nccl::get_uniqueid().map_err(|e| nccl_err(rank, "get unique id", e))?;
            if let Some(store) = store {
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
            let store =
                store.ok_or_else(|| setup("a multi-rank NCCL group needs a store".into()))?;
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
        let mut stream: cuda::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context bound above.
        let rc = unsafe {
            cuda::cuStreamCreate(
                &mut stream,
                cuda::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        if rc != cuda::CUresult::CUDA_SUCCESS {
            // SAFETY: the communicator was just created and is not used elsewhere.
            unsafe { sys::ncclCommDestroy(comm) };
            return Err(setup(format!("creating the NCCL stream: {rc:?}")));
        }
        let watch = Arc::new(Watch {
            comm: Mutex::new(comm),
            in_flight: Mutex::new(VecDeque::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let watchdog = {
            let (watch, ctx, group) = (watch.clone(), ctx.clone(), key.to_string());
            std::thread::Builder::new()
                .name(format!("titan-nccl-watchdog-{key}"))
                .spawn(move || watchdog(&watch, &ctx, failures.as_deref(), rank, &group, timeout))
                .map_err(|e| setup(format!("starting the NCCL watchdog: {e}")))?
        };
        Ok(NcclGroup {
            watch,
            stream,
            rank: me,
            size: members.len(),
            global_rank: rank,
            device,
            timeout,
            watchdog: Some(watchdog),
            ctx,
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

    /// Runs `enqueue(comm, stream)` (one NCCL call) on the group's stream, after the work already
    /// on the legacy default stream (and after `after`, a queued collective of another group),
    /// then either makes the default stream wait for it ([`Completion::Joined`]: the blocking
    /// calls) or returns an event of its completion for the caller to wait on later
    /// ([`Completion::Queued`]). Never a host wait.
    fn launch(
        &mut self,
        op: &'static str,
        completion: Completion,
        after: Option<&NcclWork>,
        enqueue: impl FnOnce(
            sys::ncclComm_t,
            cuda::CUstream,
        ) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<Option<NcclWork>, CommError> {
        let bound = self.ctx.bind_to_thread();
        bound.map_err(|e| self.error(format!("CUDA device {}: {e:?}", self.device)))?;
        let comm = self.live(op)?;
        let cu = |rc: cuda::CUresult, what: &str| cu_check(rc, op, what);
        let legacy: cuda::CUstream = std::ptr::null_mut();
        let result = (|| -> Result<(cuda::CUevent, Option<cuda::CUevent>), String> {
            let inputs_ready = new_event(op)?;
            // SAFETY: live events and streams of the bound context. An event destroyed after
            // it was recorded and waited on is released once it completes.
            unsafe {
                cu(cuda::cuEventRecord(inputs_ready, legacy), "event record")?;
                cu(
                    cuda::cuStreamWaitEvent(self.stream, inputs_ready, 0),
                    "stream wait",
                )?;
                cu(cuda::cuEventDestroy_v2(inputs_ready), "event destroy")?;
                if let Some(after) = after {
                    cu(
                        cuda::cuStreamWaitEvent(self.stream, after.done, 0),
                        "stream wait",
                    )?;
                }
            }
            enqueue(comm, self.stream).map_err(|e| {
                // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
                let msg = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
                format!("NCCL {op}: {} ({:?})", msg.to_string_lossy(), e.0)
            })?;
            // The watchdog's event, and the caller's when it waits later.
            let done = new_event(op)?;
            let queued = match completion {
                Completion::Joined => None,
                Completion::Queued => Some(new_event(op)?),
            };
            // SAFETY: as above.
            unsafe {
                cu(cuda::cuEventRecord(done, self.stream), "event record")?;
                match queued {
                    None => cu(cuda::cuStreamWaitEvent(legacy, done, 0), "stream wait")?,
                    Some(q) => cu(cuda::cuEventRecord(q, self.stream), "event record")?,
                }
            }
            Ok((done, queued))
        })();
        let (done, queued) = result.map_err(|m| self.error(m))?;
        self.watch
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(InFlight {
                done,
                op,
                since: Instant::now(),
            });
        Ok(queued.map(|done| NcclWork {
            done,
            op,
            rank: self.global_rank,
            waited: false,
            ctx: self.ctx.clone(),
        }))
    }

    /// Runs `op` (one collective) with `completion` (see [`NcclGroup::launch`]).
    fn collective(
        &mut self,
        op: CollectiveOp<'_>,
        completion: Completion,
        after: Option<&NcclWork>,
    ) -> Result<Option<NcclWork>, CommError> {
        let name = op.name();
        match op {
            CollectiveOp::AllReduce { tensor, op } => {
                self.check(name, tensor)?;
                let dt = self.dtype(name, tensor.kind())?;
                let (p, n) = (tensor.data_ptr(), tensor.numel());
                // SAFETY: in place on a contiguous CUDA tensor of n elements on our device.
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::all_reduce(
                        p as *const c_void,
                        p,
                        n,
                        dt,
                        Self::red_op(op),
                        comm,
                        stream.cast(),
                    )
                })
            }
            CollectiveOp::ReduceScatter { output, input, op } => {
                let k = check_split(name, input, output, self.size)?;
                self.check(name, input)?;
                self.check(name, output)?;
                let dt = self.dtype(name, input.kind())?;
                let (src, dst) = (input.data_ptr() as *const c_void, output.data_ptr());
                // SAFETY: input holds size * k elements, output k, both on our device.
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::reduce_scatter(src, dst, k, dt, Self::red_op(op), comm, stream.cast())
                })
            }
            CollectiveOp::AllGather { output, input } => {
                let k = check_split(name, output, input, self.size)?;
                self.check(name, input)?;
                self.check(name, output)?;
                let dt = self.dtype(name, input.kind())?;
                let (src, dst) = (input.data_ptr() as *const c_void, output.data_ptr());
                // SAFETY: input holds k elements, output size * k, both on our device.
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::all_gather(src, dst, k, dt, comm, stream.cast())
                })
            }
            CollectiveOp::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => {
                let row = check_all_to_all(output, input, output_splits, input_splits, self.size)?;
                self.check(name, input)?;
                self.check(name, output)?;
                let dt = self.dtype(name, input.kind())?;
                let elem = input.kind().elt_size_in_bytes();
                let (src, dst) = (input.data_ptr() as usize, output.data_ptr() as usize);
                let (ins, outs) = (input_splits.to_vec(), output_splits.to_vec());
                // One send and one receive per peer in one NCCL group, as torch's
                // ProcessGroupNCCL::alltoall_base: NCCL schedules them together, so no pair waits
                // on another.
                // SAFETY: the splits add up to each tensor's rows (checked), so every block is in
                // bounds of its contiguous CUDA tensor on our device.
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::group_start()?;
                    let issued = (|| {
                        let (mut sent, mut received) = (0usize, 0usize);
                        for peer in 0..ins.len() {
                            let (n_in, n_out) = (ins[peer] * row, outs[peer] * row);
                            if n_in > 0 {
                                let p = (src + sent * elem) as *const c_void;
                                nccl::send(p, n_in, dt, peer as i32, comm, stream.cast())?;
                            }
                            if n_out > 0 {
                                let p = (dst + received * elem) as *mut c_void;
                                nccl::recv(p, n_out, dt, peer as i32, comm, stream.cast())?;
                            }
                            sent += n_in;
                            received += n_out;
                        }
                        Ok(())
                    })();
                    // The group is closed even after a failed call, so NCCL's state stays sane.
                    let ended = nccl::group_end();
                    issued.and(ended)
                })
            }
            CollectiveOp::SendRecv { ops } => {
                check_peers(ops, self.size)?;
                // (is a send, pointer, elements, NCCL type, peer) of each transfer.
                let mut transfers = Vec::with_capacity(ops.len());
                for op in ops {
                    let t = op.tensor();
                    self.check(name, t)?;
                    let dt = self.dtype(name, t.kind())?;
                    transfers.push((
                        op.is_send(),
                        t.data_ptr() as usize,
                        t.numel(),
                        dt,
                        op.peer(),
                    ));
                }
                // One NCCL group, as torch's batch_isend_irecv (ProcessGroupNCCL's coalesced
                // point-to-point): NCCL runs the batch's sends and receives together, so no send
                // of the batch waits for a receive queued behind it.
                // SAFETY: every pointer is a contiguous CUDA tensor of our device with that many
                // elements (checked), alive until the work completes (the caller holds it).
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::group_start()?;
                    let issued = (|| {
                        for &(send, p, n, dt, peer) in &transfers {
                            if send {
                                nccl::send(
                                    p as *const c_void,
                                    n,
                                    dt,
                                    peer as i32,
                                    comm,
                                    stream.cast(),
                                )?;
                            } else {
                                nccl::recv(
                                    p as *mut c_void,
                                    n,
                                    dt,
                                    peer as i32,
                                    comm,
                                    stream.cast(),
                                )?;
                            }
                        }
                        Ok(())
                    })();
                    let ended = nccl::group_end();
                    issued.and(ended)
                })
            }
            CollectiveOp::Broadcast { tensor, root } => {
                self.check(name, tensor)?;
                if root >= self.size {
                    return Err(CommError::BadArgument {
                        op: name,
                        message: format!(
                            "root {root} is not a rank of this group of {}",
                            self.size
                        ),
                    });
                }
                let dt = self.dtype(name, tensor.kind())?;
                let (p, n) = (tensor.data_ptr(), tensor.numel());
                // SAFETY: in place on a contiguous CUDA tensor on our device.
                self.launch(name, completion, after, |comm, stream| unsafe {
                    nccl::broadcast(
                        p as *const c_void,
                        p,
                        n,
                        dt,
                        root as i32,
                        comm,
                        stream.cast(),
                    )
                })
            }
        }
    }

    /// Makes the group's stream wait until the int32 at `flag` (device memory) reads at least
    /// 1: what the tests hold a queued collective back with, to see that nothing waits for it.
    #[doc(hidden)]
    pub fn hold_stream_until(&self, flag: &Tensor) -> Result<(), CommError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.error(format!("CUDA device {}: {e:?}", self.device)))?;
        // SAFETY: live stream; the flag is device memory the caller keeps alive.
        let rc = unsafe {
            cuda::cuStreamWaitValue32_v2(
                self.stream,
                flag.data_ptr() as cuda::CUdeviceptr,
                1,
                0, // CU_STREAM_WAIT_VALUE_GEQ
            )
        };
        cu_check(rc, "hold", "stream wait value").map_err(|m| self.error(m))
    }

    /// Waits on the host until every collective enqueued so far completed (or the watchdog
    /// failed the group).
    fn wait_all(&mut self, op: &'static str) -> Result<(), CommError> {
        let start = Instant::now();
        loop {
            self.live(op)?;
            if self
                .watch
                .in_flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return Ok(());
            }
            if start.elapsed() > self.timeout + Duration::from_secs(1) {
                return Err(self.error(format!("{op} did not complete in {:?}", self.timeout)));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn error(&self, message: String) -> CommError {
        CommError::Setup {
            rank: self.global_rank,
            message,
        }
    }

    /// The communicator, or the reason the watchdog aborted it.
    fn live(&self, op: &'static str) -> Result<sys::ncclComm_t, CommError> {
        let comm = *self.watch.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.is_null() {
            let failure = self.watch.failure.lock().unwrap_or_else(|e| e.into_inner());
            return Err(CommError::BadArgument {
                op,
                message: format!(
                    "the NCCL communicator was aborted after an earlier failure{}",
                    failure
                        .as_deref()
                        .map_or(String::new(), |f| format!(": {f}"))
                ),
            });
        }
        Ok(comm)
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
        super::comm::NCCL_BACKEND
    }

    fn all_reduce(&mut self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        let op = CollectiveOp::AllReduce { tensor, op };
        self.collective(op, Completion::Joined, None).map(drop)
    }

    fn reduce_scatter(
        &mut self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let op = CollectiveOp::ReduceScatter { output, input, op };
        self.collective(op, Completion::Joined, None).map(drop)
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        let op = CollectiveOp::AllGather { output, input };
        self.collective(op, Completion::Joined, None).map(drop)
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        let op = CollectiveOp::Broadcast { tensor, root };
        self.collective(op, Completion::Joined, None).map(drop)
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
        self.collective(op, Completion::Joined, None).map(drop)
    }

    fn send_recv(&mut self, ops: &[P2pOp<'_>]) -> Result<(), CommError> {
        let op = CollectiveOp::SendRecv { ops };
        self.collective(op, Completion::Joined, None).map(drop)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let t = Tensor::zeros([1], (Kind::Int, Device::Cuda(self.device)));
        self.all_reduce(&t, ReduceOp::Sum)?;
        self.wait_all("barrier")
    }

    fn queues_on_device(&self) -> bool {
        true
    }

    fn queue(
        &mut self,
        op: CollectiveOp<'_>,
        after: Option<&dyn QueuedWork>,
    ) -> Result<Issued, CommError> {
        let after = match after {
            None => None,
            Some(w) => Some(w.as_any().downcast_ref::<NcclWork>().ok_or_else(|| {
                CommError::BadArgument {
                    op: op.name(),
                    message: "chained behind work of another backend than nccl".into(),
                }
            })?),
        };
        let work = self.collective(op, Completion::Queued, after)?;
        let work = work.expect("a queued launch returns its work");
        Ok(Issued::Queued(Box::new(work)))
    }
}

/// What [`NcclGroup::launch`] leaves the caller's stream with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Completion {
    /// The legacy default stream waits for the collective before its next kernels.
    Joined,
    /// Nothing waits yet: the returned [`NcclWork`] does, when asked.
    Queued,
}

fn cu_check(rc: cuda::CUresult, op: &str, what: &str) -> Result<(), String> {
    if rc == cuda::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("CUDA {what} during {op}: {rc:?}"))
    }
}

/// A new event without timing, in the bound context.
fn new_event(op: &str) -> Result<cuda::CUevent, String> {
    let mut e: cuda::CUevent = std::ptr::null_mut();
    let flags = cuda::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: valid out-pointer; the caller bound the context.
    cu_check(
        unsafe { cuda::cuEventCreate(&mut e, flags) },
        op,
        "event create",
    )?;
    Ok(e)
}

/// A collective queued on the group's stream ([`QueuedWork`]): its completion event, which the
/// legacy default stream waits on in [`QueuedWork::wait`] (or when this drops unwaited).
pub struct NcclWork {
    done: cuda::CUevent,
    op: &'static str,
    rank: usize,
    waited: bool,
    ctx: Arc<CudaContext>,
}

// SAFETY: an event handle of a context that lives as long as `ctx`; CUDA's event calls are
// thread-safe.
unsafe impl Send for NcclWork {}

impl NcclWork {
    fn error(&self, message: String) -> CommError {
        CommError::Setup {
            rank: self.rank,
            message,
        }
    }
}

impl QueuedWork for NcclWork {
    fn wait(&mut self) -> Result<(), CommError> {
        if self.waited {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.error(format!("{}: CUDA context: {e:?}", self.op)))?;
        // SAFETY: a live event of the bound context; the legacy default stream.
        let rc = unsafe { cuda::cuStreamWaitEvent(std::ptr::null_mut(), self.done, 0) };
        cu_check(rc, self.op, "stream wait").map_err(|m| self.error(m))?;
        self.waited = true;
        Ok(())
    }

    fn is_done(&self) -> Result<bool, CommError> {
        // SAFETY: a live event.
        match unsafe { cuda::cuEventQuery(self.done) } {
            cuda::CUresult::CUDA_SUCCESS => Ok(true),
            cuda::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(self.error(format!("CUDA error during NCCL {}: {other:?}", self.op))),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for NcclWork {
    fn drop(&mut self) {
        // Whatever reuses the collective's memory is queued on the default stream: behind it.
        if let Err(e) = self.wait() {
            tracing::warn!("{e}");
        }
        // SAFETY: created by launch, destroyed once (released by CUDA once it completes).
        unsafe { cuda::cuEventDestroy_v2(self.done) };
    }
}

/// The watchdog of one group: retires completed collectives, and when one makes no progress
/// within `timeout` or NCCL reports an async error, ends the process ([`fail`]).
fn watchdog(
    watch: &Watch,
    ctx: &CudaContext,
    failures: Option<&FailureBoard>,
    rank: usize,
    group: &str,
    timeout: Duration,
) {
    if ctx.bind_to_thread().is_err() {
        return;
    }
    while !watch.stop.load(Ordering::Relaxed) {
        let failure = {
            let mut in_flight = watch.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            let mut failure = None;
            while let Some(front) = in_flight.front() {
                // SAFETY: a live event of the bound context.
                match unsafe { cuda::cuEventQuery(front.done) } {
                    cuda::CUresult::CUDA_SUCCESS => {
                        // SAFETY: completed, destroyed once.
                        unsafe { cuda::cuEventDestroy_v2(front.done) };
                        in_flight.pop_front();
                    }
                    cuda::CUresult::CUDA_ERROR_NOT_READY => {
                        if front.since.elapsed() > timeout {
                            failure = Some(format!(
                                "NCCL {} made no progress for {timeout:?}: a peer is dead or hung \
                                 (see the launcher's report of which rank exited)",
                                front.op
                            ));
                        }
                        break;
                    }
                    other => {
                        failure = Some(format!("CUDA error during NCCL {}: {other:?}", front.op));
                        break;
                    }
                }
            }
            failure
        };
        let failure = failure.or_else(|| {
            let comm = *watch.comm.lock().unwrap_or_else(|e| e.into_inner());
            if comm.is_null() {
                return None;
            }
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut async_err) };
            (async_err != sys::ncclResult_t::ncclSuccess
                && async_err != sys::ncclResult_t::ncclInProgress)
                .then(|| format!("NCCL async error: {async_err:?}"))
        });
        if let Some(message) = failure {
            fail(
                watch,
                failures,
                &format!("rank {rank}: {message} (group {group})"),
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Ends the process for a failed collective, in the order that keeps the failure visible even
/// when the device is wedged: the message (naming rank, collective and group) goes to stderr,
/// the job's failure board and this rank's titan-obs journal first; then the communicator is
/// aborted (no later call uses it: [`NcclGroup::live`] sees it gone), with a deadline, since
/// NCCL's abort frees memory and can itself wait on a default stream blocked behind the
/// collective; then the process leaves with `_exit(1)`: exit handlers would tear CUDA down and
/// may wait on the same stream (torch's watchdog aborts the process for the same reason).
fn fail(watch: &Watch, failures: Option<&FailureBoard>, own: &str) -> ! {
    *watch.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(own.to_string());
    // What the board adds to this rank's own message (as the cpu backend's errors do).
    let context = match failures.map(|f| f.post(own)) {
        Some(Posted::After(first)) => format!("\n  first failure reported in the job: {first}"),
        Some(Posted::Unreachable(why)) => format!(
            "\n  the job's failure notices could not be read ({why}): the store's host has exited \
             or is unreachable; the other ranks' logs say which failed first"
        ),
        Some(Posted::First) | None => String::new(),
    };
    eprintln!("titan-train: error: {own}{context}");
    // The board's post put the failure in this rank's titan-obs records: flush them now, or the
    // journal would lose it with the last interval.
    let _ = titan_obs_core::finish();
    let comm = std::mem::replace(
        &mut *watch.comm.lock().unwrap_or_else(|e| e.into_inner()),
        std::ptr::null_mut(),
    );
    if !comm.is_null() {
        struct Aborting(sys::ncclComm_t);
        // SAFETY: the handle moves to the thread that aborts it; nothing else holds it now.
        unsafe impl Send for Aborting {}
        impl Aborting {
            // A method call moves the whole wrapper (and its Send) into the thread.
            fn into_inner(self) -> sys::ncclComm_t {
                self.0
            }
        }
        let aborting = Aborting(comm);
        let (done, aborted) = std::sync::mpsc::channel();
        let _ = std::thread::Builder::new()
            .name("titan-nccl-abort".into())
            .spawn(move || {
                let comm = aborting.into_inner();
                // SAFETY: a live communicator, aborted once; abort makes pending work return.
                unsafe { sys::ncclCommAbort(comm) };
                let _ = done.send(());
            });
        if aborted.recv_timeout(ABORT_DEADLINE).is_err() {
            eprintln!(
                "titan-train: the NCCL abort did not return within {ABORT_DEADLINE:?} (the device \
                 is wedged); leaving without it"
            );
        }
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: ends the process at once; everything that must survive was written above.
    unsafe { libc::_exit(1) }
}

/// How long [`fail`] waits for NCCL's abort before leaving without it.
const ABORT_DEADLINE: Duration = Duration::from_secs(10);

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.watch.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let _ = self.ctx.bind_to_thread();
        let comm = std::mem::replace(
            &mut *self.watch.comm.lock().unwrap_or_else(|e| e.into_inner()),
            std::ptr::null_mut(),
        );
        // SAFETY: the watchdog has stopped; each handle is released once.
        unsafe {
            if !comm.is_null() {
                sys::ncclCommDestroy(comm);
            }
            for f in self
                .watch
                .in_flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
            {
                cuda::cuEventDestroy_v2(f.done);
            }
            cuda::cuStreamDestroy_v2(self.stream);
        }
    }
}
