//! The nccl backend on a real GPU: every collective titan-train uses, through NCCL on a 1-rank
//! communicator (a lent machine has one GPU, and NCCL will not put two ranks on one device),
//! ordered on the GPU by events and not by the host, queued collectives waited for only when
//! asked, and the watchdog's timeout path.
//!
//! Needs the `nccl` feature (on by default) and a CUDA device, so every test is ignored unless
//! asked for (`--ignored`: bench/trainer/cuda_checks.sh runs them on a GPU machine), and fails
//! without a device rather than passing having done nothing.
#![cfg(feature = "nccl")]

use std::process::Command;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use titan_train::distributed::comm::{CollectiveOp, Issued, QueuedWork};
use titan_train::distributed::nccl::NcclGroup;
use titan_train::distributed::{Collectives, P2pOp, ReduceOp};

fn gpu() -> Device {
    assert!(
        tch::Cuda::is_available(),
        "no CUDA device: this test needs a GPU (it is ignored unless asked for)"
    );
    Device::Cuda(0)
}

fn group(timeout: Duration) -> NcclGroup {
    NcclGroup::connect(None, "test", vec![0], 0, 0, timeout).expect("a 1-rank NCCL communicator")
}

fn host(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double).to_device(Device::Cpu).reshape([-1])).unwrap()
}

/// Each collective on each dtype titan-train sends: the output holds the input (one rank),
/// written where the collective writes it (outputs start as NaN or -1, so a short count or a
/// wrong pointer shows).
#[test]
#[ignore = "needs a CUDA device: bench/trainer/cuda_checks.sh runs it (--ignored)"]
fn every_collective_on_a_one_rank_communicator() {
    let dev = gpu();
    let mut g = group(Duration::from_secs(60));
    assert_eq!((g.rank(), g.size(), g.backend()), (0, 1, "nccl"));
    for kind in [
        Kind::Float,
        Kind::BFloat16,
        Kind::Half,
        Kind::Double,
        Kind::Int64,
        Kind::Int,
        Kind::Uint8,
    ] {
        let x = Tensor::arange_start(1, 4097, (Kind::Int64, Device::Cpu))
            .remainder(200)
            .to_kind(kind)
            .to_device(dev);
        let want = host(&x);
        let filled = || Tensor::full([4096], -1, (kind, dev));
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let t = x.copy();
            g.all_reduce(&t, op).unwrap();
            assert_eq!(host(&t), want, "all_reduce {op:?} {kind:?}");
            let out = filled();
            g.reduce_scatter(&out, &x, op).unwrap();
            assert_eq!(host(&out), want, "reduce_scatter {op:?} {kind:?}");
        }
        let out = filled();
        g.all_gather(&out, &x).unwrap();
        assert_eq!(host(&out), want, "all_gather {kind:?}");
        let t = x.copy();
        g.broadcast(&t, 0).unwrap();
        assert_eq!(host(&t), want, "broadcast {kind:?}");
        // The pipeline's batch (ncclSend and ncclRecv in one group), to this rank itself.
        let out = filled();
        let batch = [
            P2pOp::Send {
                tensor: &x,
                peer: 0,
            },
            P2pOp::Recv {
                tensor: &out,
                peer: 0,
            },
        ];
        g.send_recv(&batch).unwrap();
        assert_eq!(host(&out), want, "batch_isend_irecv {kind:?}");
    }
    g.barrier().unwrap();
    // What NCCL cannot do is refused before it is asked, naming why.
    let x = Tensor::ones([8], (Kind::Float, dev));
    let err = g.broadcast(&x, 1).unwrap_err().to_string();
    assert!(err.contains("root 1"), "{err}");
    let err = g
        .all_reduce(
            &Tensor::ones([8], (Kind::Float, Device::Cpu)),
            ReduceOp::Sum,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs tensors on cuda:0"), "{err}");
    let strided = Tensor::ones([8, 8], (Kind::Float, dev)).tr();
    let err = g
        .all_reduce(&strided, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(err.contains("contiguous"), "{err}");
}

/// Holds the legacy default stream (where tch's kernels run) until [`StreamGate::open`]: a
/// stream-wait on a device flag, as a GPU busy with earlier work would hold it, but for as long
/// as the test needs. Opened from a non-blocking stream of its own.
struct StreamGate {
    _flag: Tensor,
    opener: GateOpener,
}

/// What opens a [`StreamGate`], from another thread.
#[derive(Clone)]
struct GateOpener {
    flag: u64,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl StreamGate {
    fn close(dev: Device) -> StreamGate {
        use cudarc::driver::sys as cuda;
        let flag = Tensor::zeros([1], (Kind::Int, dev));
        tch::Cuda::synchronize(0);
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        // SAFETY: live device memory of the primary context; waits until it reads >= 1.
        let rc = unsafe {
            cuda::cuStreamWaitValue32_v2(
                std::ptr::null_mut(),
                flag.data_ptr() as cuda::CUdeviceptr,
                1,
                0, // CU_STREAM_WAIT_VALUE_GEQ
            )
        };
        assert_eq!(rc, cuda::CUresult::CUDA_SUCCESS);
        let opener = GateOpener {
            flag: flag.data_ptr() as u64,
            ctx,
        };
        StreamGate {
            _flag: flag,
            opener,
        }
    }
}

impl GateOpener {
    /// Opens the gate.
    fn open(&self) {
        use cudarc::driver::sys as cuda;
        self.ctx.bind_to_thread().unwrap();
        let mut stream: cuda::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer and flag address; the stream does not wait on the legacy
        // stream, so it runs while that one is held.
        unsafe {
            let flags = cuda::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32;
            assert_eq!(
                cuda::cuStreamCreate(&mut stream, flags),
                cuda::CUresult::CUDA_SUCCESS
            );
            let addr = self.flag as cuda::CUdeviceptr;
            assert_eq!(
                cuda::cuStreamWriteValue32_v2(stream, addr, 1, 0),
                cuda::CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                cuda::cuStreamSynchronize(stream),
                cuda::CUresult::CUDA_SUCCESS
            );
            cuda::cuStreamDestroy_v2(stream);
        }
    }
}

/// Each collective, called while the stream that wrote its input is held: the call returns at
/// once (the host does not wait for the GPU), the collective runs after the kernels that wrote
/// its input, and the kernels after it see its output.
#[test]
#[ignore = "needs a CUDA device: bench/trainer/cuda_checks.sh runs it (--ignored)"]
fn collectives_are_ordered_on_the_gpu_without_a_host_wait() {
    let dev = gpu();
    let mut g = group(Duration::from_secs(60));
    let base = Tensor::arange_start(1, 1025, (Kind::Float, dev));
    // The first call of each collective sets NCCL's kernels up: not what is timed.
    let scratch = Tensor::empty([1024], (Kind::Float, dev));
    g.all_reduce(&scratch.copy(), ReduceOp::Sum).unwrap();
    g.all_gather(&scratch, &base).unwrap();
    g.reduce_scatter(&scratch, &base, ReduceOp::Sum).unwrap();
    g.broadcast(&scratch, 0).unwrap();
    g.all_to_all(&scratch, &base, &[1024], &[1024]).unwrap();
    tch::Cuda::synchronize(0);
    type Call = fn(&mut NcclGroup, &Tensor, &Tensor);
    let calls: [(&str, Call); 5] = [
        ("all_reduce", |g, out, input| {
            out.shallow_clone().copy_(input);
            g.all_reduce(out, ReduceOp::Sum).unwrap()
        }),
        ("all_gather", |g, out, input| {
            g.all_gather(out, input).unwrap()
        }),
        ("reduce_scatter", |g, out, input| {
            g.reduce_scatter(out, input, ReduceOp::Sum).unwrap()
        }),
        ("broadcast", |g, out, input| {
            out.shallow_clone().copy_(input);
            g.broadcast(out, 0).unwrap()
        }),
        // One rank's all-to-all is a send to itself and a receive from itself in one group.
        ("all_to_all_single", |g, out, input| {
            g.all_to_all(out, input, &[1024], &[1024]).unwrap()
        }),
    ];
    for (name, call) in calls {
        // The first pass launches every kernel the second uses: CUDA loads a kernel on its
        // first launch (lazy loading) and waits for the device to do so, which with the stream
        // held would wait forever, in the test and not in the collective.
        for held in [false, true] {
            let out = Tensor::full([1024], f64::NAN, (Kind::Float, dev));
            tch::Cuda::synchronize(0);
            let gate = held.then(|| StreamGate::close(dev));
            // Written on the held stream: only once the gate opens.
            let input = &base * 3.0;
            let (call_returned, gate_waits) = std::sync::mpsc::channel::<()>();
            let waited = std::thread::scope(|scope| {
                // Opens the gate when the call returns, or after 3 s if the call waits for it.
                if let Some(gate) = &gate {
                    let opener = gate.opener.clone();
                    scope.spawn(move || {
                        let _ = gate_waits.recv_timeout(Duration::from_secs(3));
                        opener.open();
                    });
                }
                let start = Instant::now();
                call(&mut g, &out, &input);
                let took = start.elapsed();
                let _ = call_returned.send(());
                took
            });
            let doubled = host(&(&out * 2.0));
            let want: Vec<f64> = host(&base).iter().map(|v| v * 6.0).collect();
            assert_eq!(
                doubled, want,
                "{name}: ran before its input was written, or was read before it ran"
            );
            if held {
                eprintln!("{name}: the call returned after {waited:?} with the stream held");
                assert!(
                    waited < Duration::from_secs(2),
                    "{name} waited on the host for the GPU ({waited:?})"
                );
            }
        }
    }
}

/// A device flag a collective's stream is held on (`NcclGroup::hold_stream_until`), opened from
/// another thread after `after` unless the test opens it first.
fn held_flag(dev: Device) -> (Tensor, GateOpener) {
    let flag = Tensor::zeros([1], (Kind::Int, dev));
    tch::Cuda::synchronize(0);
    let opener = GateOpener {
        flag: flag.data_ptr() as u64,
        ctx: cudarc::driver::CudaContext::new(0).unwrap(),
    };
    (flag, opener)
}

fn queued(issued: Issued) -> Box<dyn QueuedWork> {
    match issued {
        Issued::Queued(w) => w,
        Issued::Done => panic!("nccl runs a queued collective on the host"),
    }
}

/// Whether the legacy default stream (where tch's kernels run) gets past everything queued on
/// it so far within `within`: an event recorded there, polled from the host (never a blocking
/// read, which would hang the test if the stream waited for a held collective).
fn legacy_stream_passes(within: Duration) -> bool {
    use cudarc::driver::sys as cuda;
    let mut ev: cuda::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the caller's thread has the primary context bound (tch).
    unsafe {
        let flags = cuda::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        assert_eq!(
            cuda::cuEventCreate(&mut ev, flags),
            cuda::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            cuda::cuEventRecord(ev, std::ptr::null_mut()),
            cuda::CUresult::CUDA_SUCCESS
        );
    }
    let start = Instant::now();
    let passed = loop {
        // SAFETY: a live event.
        match unsafe { cuda::cuEventQuery(ev) } {
            cuda::CUresult::CUDA_SUCCESS => break true,
            cuda::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < within => {
                std::thread::sleep(Duration::from_millis(1))
            }
            cuda::CUresult::CUDA_ERROR_NOT_READY => break false,
            other => panic!("cuEventQuery: {other:?}"),
        }
    };
    // SAFETY: destroyed once (released by CUDA once it completes).
    unsafe { cuda::cuEventDestroy_v2(ev) };
    passed
}

/// A queued collective (`Collectives::queue`: FSDP's prefetches and reductions, the pipeline's
/// sends) holds nothing back until its work is waited for: with its stream held, the default
/// stream gets past the kernels queued after it; a collective chained behind it on another
/// group waits for it on the device; once it runs and is waited for, the kernels after the wait
/// see its output.
#[test]
#[ignore = "needs a CUDA device: bench/trainer/cuda_checks.sh runs it (--ignored)"]
fn a_queued_collective_is_waited_for_only_when_asked() {
    let dev = gpu();
    let t0 = Instant::now();
    let say = |what: &str| eprintln!("queued: {what} at {:?}", t0.elapsed());
    let mut g = group(Duration::from_secs(20));
    let mut g2 = NcclGroup::connect(None, "test2", vec![0], 0, 0, Duration::from_secs(20))
        .expect("a second 1-rank NCCL communicator");
    let base = Tensor::arange_start(1, 1025, (Kind::Float, dev));
    let scratch = Tensor::empty([1024], (Kind::Float, dev));
    // Kernels loaded before anything is held (CUDA loads a kernel at its first launch).
    g.all_gather(&scratch, &base).unwrap();
    g2.all_reduce(&scratch, ReduceOp::Sum).unwrap();
    let _ = host(&(&base * 2.0));
    let want: Vec<f64> = host(&base).iter().map(|v| v * 6.0).collect();

    // Not held: queued, waited for, read.
    let out = Tensor::full([1024], f64::NAN, (Kind::Float, dev));
    let input = &base * 3.0;
    let gather = CollectiveOp::AllGather {
        output: &out,
        input: &input,
    };
    let mut w = queued(g.queue(gather, None).unwrap());
    w.wait().unwrap();
    assert_eq!(host(&(&out * 2.0)), want, "a queued all_gather, waited for");
    drop(w);
    say("unheld queued all_gather read back");

    // Held on its stream.
    let (flag, opener) = held_flag(dev);
    g.hold_stream_until(&flag).unwrap();
    say("g's stream held");
    let out = Tensor::full([1024], f64::NAN, (Kind::Float, dev));
    let input = &base * 3.0;
    let gather = CollectiveOp::AllGather {
        output: &out,
        input: &input,
    };
    let mut first = queued(g.queue(gather, None).unwrap());
    say("all_gather queued");
    let chained = CollectiveOp::AllReduce {
        tensor: &out,
        op: ReduceOp::Sum,
    };
    let mut second = queued(g2.queue(chained, Some(first.as_ref())).unwrap());
    say("all_reduce chained");
    let later = &base * 2.0;
    let passed = legacy_stream_passes(Duration::from_secs(2));
    say(&format!("default stream passed: {passed}"));
    let first_ran = first.is_done().unwrap();
    let second_ran = second.is_done().unwrap();
    opener.open();
    say("gate opened");
    first.wait().unwrap();
    second.wait().unwrap();
    assert!(
        passed,
        "the default stream waited for a queued collective nobody waited for"
    );
    assert!(!first_ran, "the held collective ran");
    assert!(
        !second_ran,
        "the chained collective ran before the one it reads"
    );
    assert_eq!(
        host(&later),
        host(&base).iter().map(|v| v * 2.0).collect::<Vec<_>>()
    );
    assert_eq!(
        host(&(&out * 2.0)),
        want,
        "kernels after the wait see the output"
    );
    assert!(first.is_done().unwrap() && second.is_done().unwrap());
    say("done");
    drop(flag);
}

const CHILD: &str = "TITAN_NCCL_WATCHDOG_CHILD";

/// A collective that never completes (its stream waits on a flag nobody sets, as it would wait
/// on a dead peer) ends the process within the timeout, naming the rank and the collective.
#[test]
#[ignore = "needs a CUDA device: bench/trainer/cuda_checks.sh runs it (--ignored)"]
fn the_watchdog_ends_a_hung_collective_naming_it() {
    if std::env::var_os(CHILD).is_some() {
        return hang_forever();
    }
    gpu();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "the_watchdog_ends_a_hung_collective_naming_it",
            "--include-ignored",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(90) {
            child.kill().unwrap();
            panic!("the hung collective was not ended within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 0: NCCL all_reduce made no progress for 2s")
            && stderr.contains("(group test)"),
        "{stderr}"
    );
    eprintln!(
        "the hung child ended after {:?}:\n{stderr}",
        start.elapsed()
    );
}

fn hang_forever() {
    let dev = Device::Cuda(0);
    let mut g = group(Duration::from_secs(2));
    // Never opened: the collective waits for the held stream as it would for a dead peer.
    let _gate = StreamGate::close(dev);
    let x = Tensor::ones([1024], (Kind::Float, dev));
    g.all_reduce(&x, ReduceOp::Sum).unwrap();
    // The watchdog exits the process; reaching the end is the failure the parent reports.
    std::thread::sleep(Duration::from_secs(60));
    eprintln!("the watchdog did not end the process");
    std::process::exit(3);
}
