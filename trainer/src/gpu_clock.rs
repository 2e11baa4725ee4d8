//! GPU time for titan-obs. On a GPU the host runs ahead: a host span around `forward` ends once
//! the forward's kernels are queued, and the GPU's time shows up in whatever blocks next. So
//! on CUDA the phases that run device work ([`span`], [`pipeline_span`]: forward, backward, the
//! optimizer, the pipeline's passes, NCCL collectives) are also timed with CUDA events, as
//! spans of their own: the phase's GPU twin `gpu:<phase>` (obs `vocab::gpu`), on a thread of
//! their own named `cuda:<index>` that titan-obs draws as the rank's GPU lane.
//!
//! The training thread only records two pooled events per span on its current stream and
//! sends the pair on (no wait, no read). The `cuda:<index>` thread polls them
//! (`cudaEventQuery`, never a blocking synchronize) and places them on the host's monotonic
//! clock through *anchors*: events it records every [`ANCHOR_EVERY`] on a stream nothing else
//! uses, which the device passes as soon as it sees them, so an anchor's device time is the
//! host time its record returned (to a few microseconds). A span's start is then the newest
//! anchor recorded before it plus `cudaEventElapsedTime` from that anchor (a float of
//! milliseconds: anchors a second apart keep it to a tenth of a microsecond), and its duration
//! the elapsed time between its own two events. [`finish`] waits for what is still queued
//! before titan-obs closes its parts.
//!
//! A twin covers the stream from reaching the phase's first work to finishing its last,
//! waiting included (a collective's twin also holds the wait for the slowest peer).

use std::collections::{BTreeMap, VecDeque};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use titan_obs_core::clock::monotonic_ns;
use titan_obs_core::vocab::gpu as twins;
use titan_obs_core::{PipelineSlot, SpanGuard, StepStamp, TimedSpan};

/// How often the resolving thread records a new anchor.
pub const ANCHOR_EVERY: Duration = Duration::from_secs(1);
/// How often it polls the oldest queued span while spans are queued.
const POLL: Duration = Duration::from_millis(2);
/// Spans queued and not yet passed by the device beyond which new spans get no twin (the
/// host is that far ahead only when something is wrong; a warning says so, once).
const MAX_IN_FLIGHT: usize = 1 << 16;
/// How long [`finish`] waits for the device to pass the spans still queued.
const FINISH_WAIT: Duration = Duration::from_secs(30);

/// What the GPU clock needs of a device's events; [`Cuda`] on a GPU, a fake in the tests.
pub(crate) trait EventApi: Send + Sync + 'static {
    type Event: Send + 'static;
    fn create(&self) -> Result<Self::Event, String>;
    /// Records `event` on the calling thread's current stream, or on the anchor stream.
    fn record(&self, event: &Self::Event, anchor: bool) -> Result<(), String>;
    /// Whether the device has passed `event` (no wait).
    fn reached(&self, event: &Self::Event) -> Result<bool, String>;
    /// Device milliseconds from `from` to `to`, both reached.
    fn elapsed_ms(&self, from: &Self::Event, to: &Self::Event) -> Result<f64, String>;
    /// Prepares the resolving thread (binds it to the device).
    fn bind_thread(&self) -> Result<(), String>;
}

/// One span's events on their way to the resolving thread.
struct Pair<E> {
    name: &'static str,
    seq: u64,
    parent: u64,
    depth: u16,
    pipeline: Option<PipelineSlot>,
    stamp: StepStamp,
    /// Host time just before the start event was recorded: only anchors recorded before it
    /// are behind it on the device.
    recorded_ns: u64,
    start: E,
    end: E,
}

enum Msg<E> {
    Span(Pair<E>),
    Finish,
}

/// A device's GPU clock: the event pool and the way to the resolving thread.
pub(crate) struct Clock<A: EventApi> {
    api: Arc<A>,
    pool: Arc<Mutex<Vec<A::Event>>>,
    tx: Sender<Msg<A::Event>>,
    in_flight: Arc<AtomicUsize>,
    /// The twins opened and not yet taken up by the resolving thread (seq -> recorded_ns):
    /// the anchors behind them are kept (a forward that runs for seconds still has one).
    unresolved: Arc<Mutex<BTreeMap<u64, u64>>>,
    next_seq: AtomicU64,
    /// Set after the first failure of an event call: the clock stops timing (a warning said
    /// why) and training goes on.
    broken: AtomicBool,
    warned_full: AtomicBool,
}

/// A span opened on the GPU clock, closed by [`Clock::close`].
pub(crate) struct OpenTwin<E> {
    name: &'static str,
    seq: u64,
    parent: u64,
    depth: u16,
    pipeline: Option<PipelineSlot>,
    recorded_ns: u64,
    start: E,
}

thread_local! {
    /// The seqs of the GPU twins open on this host thread, innermost last: their nesting.
    static OPEN: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl<A: EventApi> Clock<A> {
    /// Starts the resolving thread, named `thread_name`, which records the twins on titan-obs
    /// and records an anchor every `anchor_every` ([`ANCHOR_EVERY`]).
    pub(crate) fn start(
        api: A,
        thread_name: String,
        anchor_every: Duration,
    ) -> Result<(Arc<Self>, JoinHandle<()>), String> {
        let api = Arc::new(api);
        let (tx, rx) = channel();
        let pool = Arc::new(Mutex::new(Vec::new()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let unresolved = Arc::new(Mutex::new(BTreeMap::new()));
        // The first anchor before any span can open, so every span has one behind it.
        let first = Anchor::record(&*api, api.create()?)?;
        let resolver = Resolver {
            api: api.clone(),
            pool: pool.clone(),
            in_flight: in_flight.clone(),
            unresolved: unresolved.clone(),
            anchor_every,
            anchors: VecDeque::from([first]),
            pending: VecDeque::new(),
        };
        let handle = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || resolver.run(rx))
            .map_err(|e| format!("starting the GPU clock's thread: {e}"))?;
        let clock = Arc::new(Clock {
            api,
            pool,
            tx,
            in_flight,
            unresolved,
            next_seq: AtomicU64::new(1),
            broken: AtomicBool::new(false),
            warned_full: AtomicBool::new(false),
        });
        Ok((clock, handle))
    }

    fn event(&self) -> Result<A::Event, String> {
        let pooled = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match pooled {
            Some(e) => Ok(e),
            None => self.api.create(),
        }
    }

    fn forget(&self, seq: u64) {
        self.unresolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&seq);
    }

    fn broke(&self, what: &str, e: String) {
        if !self.broken.swap(true, Ordering::Relaxed) {
            tracing::warn!("GPU timing stopped: {what}: {e}; the GPU lane ends here");
        }
    }

    /// Records the start event of `name`'s twin on the current stream; None when the clock
    /// is stopped or too far behind.
    pub(crate) fn open(
        &self,
        name: &'static str,
        pipeline: Option<PipelineSlot>,
    ) -> Option<OpenTwin<A::Event>> {
        if self.broken.load(Ordering::Relaxed) {
            return None;
        }
        if self.in_flight.load(Ordering::Relaxed) >= MAX_IN_FLIGHT {
            if !self.warned_full.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "GPU timing: {MAX_IN_FLIGHT} spans queued that the device has not finished; \
                     spans get no GPU twin until it catches up"
                );
            }
            return None;
        }
        let start = match self.event() {
            Ok(e) => e,
            Err(e) => {
                self.broke("creating a CUDA event", e);
                return None;
            }
        };
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // Taken under the lock the resolving thread prunes anchors under, before the record:
        // every anchor older than this stays until the twin is placed.
        let recorded_ns = {
            let mut unresolved = self.unresolved.lock().unwrap_or_else(|e| e.into_inner());
            let now = monotonic_ns();
            unresolved.insert(seq, now);
            now
        };
        if let Err(e) = self.api.record(&start, false) {
            self.forget(seq);
            self.broke("recording a CUDA event", e);
            return None;
        }
        let (parent, depth) = OPEN.with(|o| {
            let mut o = o.borrow_mut();
            let at = (o.last().copied().unwrap_or(0), o.len() as u16);
            o.push(seq);
            at
        });
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Some(OpenTwin {
            name,
            seq,
            parent,
            depth,
            pipeline,
            recorded_ns,
            start,
        })
    }

    /// Records the end event of `twin` and hands the pair to the resolving thread.
    pub(crate) fn close(&self, twin: OpenTwin<A::Event>) {
        OPEN.with(|o| {
            let mut o = o.borrow_mut();
            if let Some(at) = o.iter().rposition(|&s| s == twin.seq) {
                o.truncate(at);
            }
        });
        let end = match self.event() {
            Ok(e) => e,
            Err(e) => {
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                self.forget(twin.seq);
                return self.broke("creating a CUDA event", e);
            }
        };
        if let Err(e) = self.api.record(&end, false) {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            self.forget(twin.seq);
            return self.broke("recording a CUDA event", e);
        }
        let pair = Pair {
            name: twin.name,
            seq: twin.seq,
            parent: twin.parent,
            depth: twin.depth,
            pipeline: twin.pipeline,
            stamp: titan_obs_core::step_stamp(),
            recorded_ns: twin.recorded_ns,
            start: twin.start,
            end,
        };
        if self.tx.send(Msg::Span(pair)).is_err() {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            self.forget(twin.seq);
        }
    }

    /// Tells the resolving thread to record what is queued and stop.
    pub(crate) fn stop(&self) {
        let _ = self.tx.send(Msg::Finish);
    }
}

/// An event on the anchor stream and the host time the device passed it.
struct Anchor<E> {
    event: E,
    /// Host time when its record returned: it was queued behind nothing.
    host_ns: u64,
}

impl<E> Anchor<E> {
    fn record<A: EventApi<Event = E>>(api: &A, event: E) -> Result<Self, String> {
        api.record(&event, true)?;
        Ok(Anchor {
            event,
            host_ns: monotonic_ns(),
        })
    }
}

/// The resolving thread's state.
struct Resolver<A: EventApi> {
    api: Arc<A>,
    pool: Arc<Mutex<Vec<A::Event>>>,
    in_flight: Arc<AtomicUsize>,
    unresolved: Arc<Mutex<BTreeMap<u64, u64>>>,
    anchor_every: Duration,
    /// Oldest first; the front one is the newest that a queued span still needs.
    anchors: VecDeque<Anchor<A::Event>>,
    pending: VecDeque<Pair<A::Event>>,
}

impl<A: EventApi> Resolver<A> {
    fn run(mut self, rx: Receiver<Msg<A::Event>>) {
        if let Err(e) = self.api.bind_thread() {
            tracing::warn!("GPU timing stopped: binding its thread to the device: {e}");
            return;
        }
        let mut last_anchor = Instant::now();
        let mut finishing: Option<Instant> = None;
        loop {
            let wait = if self.pending.is_empty() {
                self.anchor_every.min(Duration::from_millis(100))
            } else {
                POLL
            };
            match rx.recv_timeout(wait) {
                Ok(Msg::Span(p)) => self.take_up(p),
                Ok(Msg::Finish) | Err(RecvTimeoutError::Disconnected) => {
                    finishing.get_or_insert_with(Instant::now);
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            while let Ok(m) = rx.try_recv() {
                match m {
                    Msg::Span(p) => self.take_up(p),
                    Msg::Finish => {
                        finishing.get_or_insert_with(Instant::now);
                    }
                }
            }
            if last_anchor.elapsed() >= self.anchor_every && finishing.is_none() {
                last_anchor = Instant::now();
                if let Err(e) = self.add_anchor() {
                    tracing::warn!("GPU timing stopped: recording an anchor: {e}");
                    return;
                }
            }
            if let Err(e) = self.resolve_ready() {
                tracing::warn!("GPU timing stopped: reading CUDA events: {e}");
                return;
            }
            if let Some(since) = finishing {
                if self.pending.is_empty() {
                    return;
                }
                if since.elapsed() > FINISH_WAIT {
                    tracing::warn!(
                        "GPU timing: the device did not finish {} timed spans within {}s; \
                         they are left out",
                        self.pending.len(),
                        FINISH_WAIT.as_secs()
                    );
                    return;
                }
            }
        }
    }

    /// Queues a closed twin; from here the queue keeps its anchor.
    fn take_up(&mut self, p: Pair<A::Event>) {
        self.unresolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&p.seq);
        self.pending.push_back(p);
    }

    fn add_anchor(&mut self) -> Result<(), String> {
        let event = match self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(e) => e,
            None => self.api.create()?,
        };
        self.anchors.push_back(Anchor::record(&*self.api, event)?);
        Ok(())
    }

    /// Records every queued span the device has finished, oldest first, stopping at the first
    /// it has not (a stream runs in order), then lets go of the anchors no span needs.
    fn resolve_ready(&mut self) -> Result<(), String> {
        while let Some(p) = self.pending.front() {
            if !self.api.reached(&p.end)? || !self.api.reached(&p.start)? {
                break;
            }
            let Some(anchor) = self
                .anchors
                .iter()
                .rev()
                .find(|a| a.host_ns < p.recorded_ns)
            else {
                // No anchor behind it: cannot happen (the clock anchors before it opens and
                // keeps the anchors of unplaced twins), but never place a span on a guess.
                tracing::warn!("GPU timing: no clock anchor behind {}; left out", p.name);
                self.drop_front();
                continue;
            };
            if !self.api.reached(&anchor.event)? {
                break;
            }
            let from_anchor = self.api.elapsed_ms(&anchor.event, &p.start)?;
            let dur = self.api.elapsed_ms(&p.start, &p.end)?;
            let start_mono = anchor.host_ns as f64 + (from_anchor * 1e6).max(0.0);
            titan_obs_core::record_timed_span(TimedSpan {
                name: p.name,
                seq: p.seq,
                parent: p.parent,
                depth: p.depth,
                start_mono: start_mono.round() as u64,
                dur_ns: (dur * 1e6).max(0.0).round() as u64,
                stamp: p.stamp,
                pipeline: p.pipeline,
            });
            self.drop_front();
        }
        // Anchors older than the newest one behind the oldest twin still to place (queued
        // here, or open, or on its way) are not needed.
        let unresolved = self.unresolved.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = self
            .pending
            .iter()
            .map(|p| p.recorded_ns)
            .chain(unresolved.values().copied())
            .min()
            .unwrap_or(u64::MAX);
        while self.anchors.len() > 1 && self.anchors[1].host_ns < oldest {
            let a = self.anchors.pop_front().expect("two anchors");
            self.pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(a.event);
        }
        Ok(())
    }

    fn drop_front(&mut self) {
        if let Some(p) = self.pending.pop_front() {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            pool.push(p.start);
            pool.push(p.end);
        }
    }
}

unsafe extern "C" {
    fn titan_cuda_event_new(out: *mut *mut c_void, err: *mut *mut std::ffi::c_char) -> i32;
    fn titan_cuda_event_free(event: *mut c_void);
    fn titan_cuda_use_device(index: i64, err: *mut *mut std::ffi::c_char) -> i32;
    fn titan_cuda_event_record(
        event: *mut c_void,
        index: i64,
        anchor: i32,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_cuda_event_query(
        event: *mut c_void,
        done: *mut i32,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_cuda_event_elapsed_ms(
        start: *mut c_void,
        end: *mut c_void,
        ms: *mut f64,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
}

/// A timing CUDA event (`cpp/event_shim.cpp`), freed on drop.
pub(crate) struct CudaEvent(NonNull<c_void>);

// SAFETY: a c10::Event on the heap, used by one thread at a time (the pool, the span, the
// resolving thread hand it on; it is never shared).
unsafe impl Send for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: made by titan_cuda_event_new, freed once.
        unsafe { titan_cuda_event_free(self.0.as_ptr()) }
    }
}

/// CUDA device `index`'s events.
pub(crate) struct Cuda {
    pub(crate) index: usize,
}

impl EventApi for Cuda {
    type Event = CudaEvent;

    fn create(&self) -> Result<CudaEvent, String> {
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: `out` receives the new event; `err` is the shim's error slot.
        crate::shim::call(|err| unsafe { titan_cuda_event_new(&mut out, err) })?;
        NonNull::new(out)
            .map(CudaEvent)
            .ok_or_else(|| "the CUDA event shim returned no event".to_string())
    }

    fn record(&self, event: &CudaEvent, anchor: bool) -> Result<(), String> {
        crate::shim::call(|err| {
            // SAFETY: a live event; `err` is the shim's error slot.
            unsafe {
                titan_cuda_event_record(event.0.as_ptr(), self.index as i64, anchor as i32, err)
            }
        })
    }

    fn reached(&self, event: &CudaEvent) -> Result<bool, String> {
        let mut done = 0i32;
        // SAFETY: a live event; `err` is the shim's error slot.
        crate::shim::call(|err| unsafe {
            titan_cuda_event_query(event.0.as_ptr(), &mut done, err)
        })?;
        Ok(done != 0)
    }

    fn elapsed_ms(&self, from: &CudaEvent, to: &CudaEvent) -> Result<f64, String> {
        let mut ms = 0f64;
        crate::shim::call(|err| {
            // SAFETY: live events; `err` is the shim's error slot.
            unsafe { titan_cuda_event_elapsed_ms(from.0.as_ptr(), to.0.as_ptr(), &mut ms, err) }
        })?;
        Ok(ms)
    }

    fn bind_thread(&self) -> Result<(), String> {
        // SAFETY: `err` is the shim's error slot.
        crate::shim::call(|err| unsafe { titan_cuda_use_device(self.index as i64, err) })
    }
}

/// A running clock and its resolving thread.
type Running = (Arc<Clock<Cuda>>, JoinHandle<()>);

/// The process's GPU clock while one runs (one device per process).
static RUNNING: Mutex<Option<Running>> = Mutex::new(None);
/// Whether one runs: what every span checks first, so a CPU run takes no lock per span.
static CLOCK_ON: AtomicBool = AtomicBool::new(false);

/// Starts timing the GPU work of CUDA device `index` (titan-obs recording must be on).
pub fn start(index: usize) -> Result<(), String> {
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    if running.is_some() {
        return Ok(());
    }
    let thread = format!("{}{index}", twins::THREAD_PREFIX);
    *running = Some(Clock::start(Cuda { index }, thread, ANCHOR_EVERY)?);
    CLOCK_ON.store(true, Ordering::Release);
    Ok(())
}

/// Stops the GPU clock, after recording the spans the device has still to finish (up to
/// [`FINISH_WAIT`]); call before titan-obs closes its parts. Nothing when none runs.
pub fn finish() {
    CLOCK_ON.store(false, Ordering::Release);
    let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some((clock, handle)) = running {
        clock.stop();
        drop(clock);
        if handle.join().is_err() {
            tracing::warn!("the GPU clock's thread panicked");
        }
    }
}

fn running() -> Option<Arc<Clock<Cuda>>> {
    if !CLOCK_ON.load(Ordering::Acquire) {
        return None;
    }
    RUNNING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|(c, _)| c.clone())
}

/// A host span and, while the GPU clock runs, its GPU twin; both end when this drops.
#[must_use = "the span ends when this guard is dropped"]
pub struct Span {
    // Dropped first: the end event is queued before the host span closes.
    gpu: Option<(Arc<Clock<Cuda>>, OpenTwin<CudaEvent>)>,
    _host: SpanGuard,
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((clock, twin)) = self.gpu.take() {
            clock.close(twin);
        }
    }
}

fn twin_of(
    name: &'static str,
    pipeline: Option<PipelineSlot>,
) -> Option<(Arc<Clock<Cuda>>, OpenTwin<CudaEvent>)> {
    let twin = twins::twin(name)?;
    let clock = running()?;
    let open = clock.open(twin, pipeline)?;
    Some((clock, open))
}

/// Opens the span of phase `name` (titan-obs's [`titan_obs_core::span`]), timed on the GPU
/// too when the clock runs and the phase has a twin (`vocab::gpu::twin`).
pub fn span(name: &'static str) -> Span {
    let host = titan_obs_core::span(name);
    Span {
        gpu: twin_of(name, None),
        _host: host,
    }
}

/// [`span`] for a pipeline pass ([`titan_obs_core::pipeline_span`]).
pub fn pipeline_span(name: &'static str, slot: PipelineSlot) -> Span {
    let host = titan_obs_core::pipeline_span(name, slot);
    Span {
        gpu: twin_of(name, Some(slot)),
        _host: host,
    }
}

/// [`titan_obs_core::span`] alone: for work the GPU does not run (a collective of the `cpu`
/// backend, which moves bytes on the host), where a twin would time nothing.
pub fn host_span(name: &'static str) -> Span {
    Span {
        gpu: None,
        _host: titan_obs_core::span(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Events whose device time the test sets: `record` stamps the fake device's clock,
    /// which the test advances, and `reached` holds until the test releases the event.
    #[derive(Default)]
    struct FakeDevice {
        /// Device time in ns at which the next recorded event is passed.
        now_ns: AtomicU64,
        /// Events numbered at or below this are passed.
        released: AtomicU64,
        next_id: AtomicU64,
        fail_records: AtomicBool,
    }

    struct FakeEvent {
        at_ns: AtomicU64,
        recorded_id: AtomicU64,
        anchor: AtomicBool,
    }

    impl EventApi for Arc<FakeDevice> {
        type Event = FakeEvent;
        fn create(&self) -> Result<FakeEvent, String> {
            Ok(FakeEvent {
                at_ns: AtomicU64::new(0),
                recorded_id: AtomicU64::new(0),
                anchor: AtomicBool::new(false),
            })
        }
        fn record(&self, e: &FakeEvent, anchor: bool) -> Result<(), String> {
            if self.fail_records.load(Ordering::Relaxed) {
                return Err("device lost".into());
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
            // An anchor is passed at once, at the host's time; stream events when the test
            // releases them, at the device time it set.
            let at = if anchor {
                monotonic_ns()
            } else {
                self.now_ns.load(Ordering::Relaxed)
            };
            e.at_ns.store(at, Ordering::Relaxed);
            e.recorded_id.store(id, Ordering::Relaxed);
            e.anchor.store(anchor, Ordering::Relaxed);
            Ok(())
        }
        fn reached(&self, e: &FakeEvent) -> Result<bool, String> {
            Ok(e.anchor.load(Ordering::Relaxed)
                || e.recorded_id.load(Ordering::Relaxed) <= self.released.load(Ordering::Relaxed))
        }
        fn elapsed_ms(&self, a: &FakeEvent, b: &FakeEvent) -> Result<f64, String> {
            let (a, b) = (
                a.at_ns.load(Ordering::Relaxed),
                b.at_ns.load(Ordering::Relaxed),
            );
            Ok((b as f64 - a as f64) / 1e6)
        }
        fn bind_thread(&self) -> Result<(), String> {
            Ok(())
        }
    }

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("titan-gpu-clock-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// The twins land on their own thread with the device's times placed on the host clock
    /// through the anchor, nested as opened, and only after the device passes them.
    #[test]
    fn twins_carry_device_times_on_the_host_clock() {
        let dir = temp_dir("times");
        titan_obs_core::init(titan_obs_core::InitOptions {
            run: dir.to_string_lossy().into_owned(),
            source: titan_obs_core::Source::Trainer,
            rank: 0,
            local_rank: 0,
            world_size: 1,
            flush_interval: Duration::from_millis(50),
        })
        .unwrap();
        titan_obs_core::set_step(3);
        let device = Arc::new(FakeDevice::default());
        // Anchors every 10 ms: the forward below stays open across several.
        let every = Duration::from_millis(10);
        let (clock, handle) = Clock::start(device.clone(), "cuda:0".into(), every).unwrap();
        // An anchor is passed at the host time of its record; the device runs 5 ms behind the
        // host from here (the probe span's start).
        let probe = titan_obs_core::span("probe");
        let behind = |ns: u64| monotonic_ns() + 5_000_000 + ns;
        let outer_at = behind(0);
        drop(probe);
        device.now_ns.store(outer_at, Ordering::Relaxed);
        let outer = clock.open(twins::FORWARD, None).unwrap();
        // Open for several anchor intervals (torchtitan's first forward compiles for seconds):
        // the anchor behind it must stay.
        std::thread::sleep(Duration::from_millis(50));
        let inner_at = behind(0);
        device.now_ns.store(inner_at, Ordering::Relaxed);
        let inner = clock.open(twins::ALL_GATHER, None).unwrap();
        device.now_ns.store(inner_at + 2_000_000, Ordering::Relaxed);
        clock.close(inner);
        device.now_ns.store(inner_at + 6_000_000, Ordering::Relaxed);
        clock.close(outer);
        // Not passed yet: nothing is recorded however long the thread polls.
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(clock.in_flight.load(Ordering::Relaxed), 2);
        device.released.store(u64::MAX, Ordering::Relaxed);
        clock.stop();
        handle.join().unwrap();
        assert_eq!(clock.in_flight.load(Ordering::Relaxed), 0);
        titan_obs_core::finish().unwrap();

        let run = titan_obs_core::load(&dir.to_string_lossy(), &Default::default()).unwrap();
        let s = &run.spans;
        let named = |n: &str| {
            (0..s.len())
                .find(|&i| run.names[s.name[i] as usize] == n)
                .unwrap_or_else(|| panic!("no span {n}"))
        };
        let (f, g, probe) = (
            named(twins::FORWARD),
            named(twins::ALL_GATHER),
            named("probe"),
        );
        // Durations are the device's own; starts are placed through two different anchors,
        // each to a few microseconds.
        assert_eq!(s.dur_ns[f] as u64, inner_at + 6_000_000 - outer_at);
        assert_eq!(s.dur_ns[g], 2_000_000);
        let apart = s.start_ns[g] - s.start_ns[f];
        let want = (inner_at - outer_at) as i64;
        assert!(
            (apart - want).abs() < 300_000,
            "{apart} ns apart, {want} on the device"
        );
        // Placed on the host clock: 5 ms after the probe began (to the anchor's few us).
        let late = s.start_ns[f] - s.start_ns[probe];
        assert!(
            (late - 5_000_000).abs() < 500_000,
            "forward twin {late} ns after the probe"
        );
        assert_eq!((s.depth[f], s.depth[g]), (0, 1));
        assert_eq!(s.parent[g], s.seq[f]);
        assert_eq!((s.step[f], s.step[g]), (3, 3));
        // On a lane of their own.
        assert_ne!(s.thread[f], s.thread[probe]);
        assert_eq!(s.thread[f], s.thread[g]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A device that stops answering ends the GPU lane with a warning, not the training.
    #[test]
    fn a_failing_device_stops_the_clock_not_the_caller() {
        let device = Arc::new(FakeDevice::default());
        let (clock, handle) = Clock::start(device.clone(), "cuda:9".into(), ANCHOR_EVERY).unwrap();
        let twin = clock.open(twins::BACKWARD, None).unwrap();
        device.fail_records.store(true, Ordering::Relaxed);
        clock.close(twin);
        assert!(clock.broken.load(Ordering::Relaxed));
        assert!(clock.open(twins::FORWARD, None).is_none());
        assert_eq!(clock.in_flight.load(Ordering::Relaxed), 0);
        clock.stop();
        handle.join().unwrap();
    }
}
