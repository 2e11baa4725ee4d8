//! The process-global recorder: thread-local rings on the hot path, one writer thread that
//! drains them into the rank's journal (one record batch every `flush_interval`) and compacts
//! the journal into a Parquet part every `rotate_interval` and at [`finish`].
//!
//! Hot path cost (span enter + exit): two vDSO clock reads, a thread-local borrow, and one
//! ring slot write with a Release store. No lock, no allocation, no syscall. Locks exist only
//! on rare paths: a thread's first record (ring registration), `add_step_tag` (tag table),
//! `init`/`finish`.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::clock::{EpochAnchor, monotonic_ns};
use crate::footer::PartHeader;
use crate::journal::{JournalWriter, read_journal};
use crate::location::Location;
use crate::part::{PartBuilder, PartSink, Row, compact};
use crate::record::{NO_STEP, RawRecord};
use crate::ring::Ring;
use crate::schema::{Kind, PipelineSlot, Reduce, Source};

/// Where and as whom this process records.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Run location: a local directory or an object_store URL; parts go under `<run>/obs/`.
    pub run: String,
    pub source: Source,
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    /// Records are appended to the rank's journal at least this often (torchtitan-style
    /// `observability.flush_interval_s`): a kill -9 loses at most this much.
    pub flush_interval: Duration,
}

/// Less common recorder settings, for [`init_with`].
#[derive(Debug, Clone)]
pub struct Tuning {
    /// A journal batch is appended early once this many records are waiting (and no batch
    /// holds more).
    pub max_records_per_part: usize,
    /// The journal is compacted into one Parquet part this often (and at [`finish`]):
    /// `observability.rotate_interval_s`.
    pub rotate_interval: Duration,
    /// Where object-store runs keep their journal (default [`crate::part::default_spool_dir`]);
    /// local runs keep it in their rank folder.
    pub spool_dir: Option<PathBuf>,
    /// Records each thread's ring holds before the thread waits for the writer.
    pub ring_capacity: usize,
    /// The run id written into every record; default: the last component of the run location,
    /// so the processes of one job that name no run are one run. A caller that starts a new
    /// run in a location holding older ones passes a fresh id ([`crate::runs::new_run_id`]),
    /// as titan-train does for each launch.
    pub run_id: Option<String>,
    /// Free-form run metadata stored in every part's footer.
    pub run_metadata: serde_json::Map<String, serde_json::Value>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            max_records_per_part: 250_000,
            rotate_interval: Duration::from_secs(600),
            spool_dir: None,
            ring_capacity: 16 * 1024,
            run_id: None,
            run_metadata: Default::default(),
        }
    }
}

/// Set while a recorder is running; checked (Relaxed) at the top of every hot-path call.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Bumped by every `init`, so threads re-register their ring with a new recorder.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static STEP: AtomicU64 = AtomicU64::new(NO_STEP);
static STEP_TAGS: AtomicU64 = AtomicU64::new(0);
static CLOCK_OFFSET_NS: AtomicI64 = AtomicI64::new(0);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

/// Shared between the recording threads and the writer thread.
struct Shared {
    generation: u64,
    rings: Mutex<Vec<Arc<Ring>>>,
    next_thread: AtomicU64,
    ring_capacity: usize,
    /// Interned step tags; bit i of a record's tag mask = `tags[i]`.
    tags: Mutex<Vec<&'static str>>,
    wake: Condvar,
    wake_lock: Mutex<WriterSignal>,
}

#[derive(Default)]
struct WriterSignal {
    shutdown: bool,
    kick: bool,
}

struct Recorder {
    shared: Arc<Shared>,
    writer: JoinHandle<Result<WriterStats>>,
}

/// What the writer did, returned by [`finish`].
#[derive(Debug, Clone, Default)]
pub struct WriterStats {
    pub records: u64,
    /// Batches appended to journals.
    pub batches: u64,
    pub parts: u64,
    /// Where each part went, in order.
    pub part_paths: Vec<String>,
    /// Parts compacted at `init` from journals an earlier (killed) process left behind.
    pub recovered_parts: Vec<String>,
}

struct Local {
    generation: u64,
    ring: Option<Arc<Ring>>,
    shared: Option<Arc<Shared>>,
    seq: u64,
    depth: u16,
    parents: [u64; MAX_TRACKED_DEPTH],
}

const MAX_TRACKED_DEPTH: usize = 64;

thread_local! {
    static LOCAL: RefCell<Local> = const {
        RefCell::new(Local {
            generation: 0,
            ring: None,
            shared: None,
            seq: 0,
            depth: 0,
            parents: [0; MAX_TRACKED_DEPTH],
        })
    };
}

impl Local {
    /// Makes sure this thread has a ring registered with the current recorder.
    #[inline]
    fn ensure_ring(&mut self) -> bool {
        let generation = GENERATION.load(Ordering::Acquire);
        if self.generation == generation && self.ring.is_some() {
            return true;
        }
        self.register(generation)
    }

    #[cold]
    fn register(&mut self, generation: u64) -> bool {
        let guard = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rec) = guard.as_ref() else {
            return false;
        };
        if rec.shared.generation != generation {
            return false;
        }
        let shared = rec.shared.clone();
        drop(guard);
        let id = shared.next_thread.fetch_add(1, Ordering::Relaxed) as u32;
        let name = std::thread::current()
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("thread-{id}"));
        let ring = Arc::new(Ring::new(shared.ring_capacity, id, name));
        shared
            .rings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ring.clone());
        self.ring = Some(ring);
        self.shared = Some(shared);
        self.generation = generation;
        self.seq = 0;
        self.depth = 0;
        true
    }

    #[inline]
    fn push(&mut self, record: RawRecord) {
        let Some(ring) = self.ring.as_ref() else {
            return;
        };
        // SAFETY: this thread is the ring's only producer.
        let mut record = match unsafe { ring.try_push(record) } {
            Ok(()) => return,
            Err(r) => r,
        };
        // Full: wake the writer and wait for room. Never drop a record.
        let shared = self.shared.as_ref().expect("registered with a ring");
        loop {
            shared.kick();
            std::thread::yield_now();
            match unsafe { ring.try_push(record) } {
                Ok(()) => return,
                Err(r) => record = r,
            }
            if !ACTIVE.load(Ordering::Relaxed) {
                return;
            }
        }
    }
}

impl Shared {
    fn kick(&self) {
        let mut s = self.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
        s.kick = true;
        self.wake.notify_one();
    }
}

/// Starts recording for this process. Records made before `init` are dropped.
pub fn init(opts: InitOptions) -> Result<()> {
    init_with(opts, Tuning::default())
}

/// [`init`] with explicit tuning (part size, ring size, run id, run metadata).
pub fn init_with(opts: InitOptions, tuning: Tuning) -> Result<()> {
    if opts.world_size == 0 || opts.rank >= opts.world_size {
        bail!(
            "observability init: rank {} is outside world size {}",
            opts.rank,
            opts.world_size
        );
    }
    if opts.flush_interval.is_zero() {
        bail!("observability init: flush_interval must be > 0");
    }
    if tuning.rotate_interval.is_zero() {
        bail!("observability init: rotate_interval must be > 0");
    }
    let mut guard = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_some() {
        bail!("observability is already initialised in this process; call finish() first");
    }
    let location = Location::parse(&opts.run)?;
    let mut sink = PartSink::new(location, opts.rank)
        .with_context(|| format!("preparing the trace output of rank {}", opts.rank))?;
    if let Some(spool) = &tuning.spool_dir {
        sink = sink.with_spool(spool);
    }
    let recovered_parts = recover_journals(&sink);
    let first_part = sink.next_part_index()?;
    let run_id = tuning.run_id.clone().unwrap_or_else(|| {
        opts.run
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("run")
            .to_string()
    });
    let header = PartHeader {
        run_id,
        source: opts.source.as_str().to_string(),
        host: hostname(),
        rank: opts.rank,
        local_rank: opts.local_rank,
        world_size: opts.world_size,
        pid: std::process::id(),
        clock_offset_ns: CLOCK_OFFSET_NS.load(Ordering::Relaxed),
        threads: BTreeMap::new(),
        run_metadata: tuning.run_metadata.clone(),
    };
    let generation = GENERATION.load(Ordering::Relaxed) + 1;
    let shared = Arc::new(Shared {
        generation,
        rings: Mutex::new(Vec::new()),
        next_thread: AtomicU64::new(0),
        ring_capacity: tuning.ring_capacity,
        tags: Mutex::new(Vec::new()),
        wake: Condvar::new(),
        wake_lock: Mutex::new(WriterSignal::default()),
    });
    let writer = Writer {
        shared: shared.clone(),
        sink,
        header,
        anchor: EpochAnchor::now(),
        next_part: first_part,
        flush_interval: opts.flush_interval,
        rotate_interval: tuning.rotate_interval,
        max_records: tuning.max_records_per_part.max(1),
        builder: PartBuilder::new(),
        step_tags: HashMap::new(),
        stats: WriterStats {
            recovered_parts,
            ..Default::default()
        },
        first_error: None,
        journal: None,
        journal_opened: Instant::now(),
    };
    let handle = std::thread::Builder::new()
        .name("titan-obs-writer".into())
        .spawn(move || writer.run())
        .context("starting the trace writer thread")?;
    STEP.store(NO_STEP, Ordering::Relaxed);
    STEP_TAGS.store(0, Ordering::Relaxed);
    *guard = Some(Recorder {
        shared,
        writer: handle,
    });
    GENERATION.store(generation, Ordering::Release);
    ACTIVE.store(true, Ordering::Release);
    Ok(())
}

/// Compacts the journals a killed process of this rank left behind into their parts (a
/// journal whose part exists already was compacted but not yet deleted). Failures are
/// logged and the journal kept: recording must start regardless.
fn recover_journals(sink: &PartSink) -> Vec<String> {
    let mut done = Vec::new();
    let journals = match sink.leftover_journals() {
        Ok(j) => j,
        Err(e) => {
            tracing::warn!("{e:#}");
            return done;
        }
    };
    for (index, path) in journals {
        let result = (|| -> Result<Option<String>> {
            if sink.has_part(index)? {
                return Ok(None);
            }
            let contents = read_journal(&path)?;
            if contents.batches.is_empty() {
                return Ok(None);
            }
            for d in &contents.damage {
                tracing::warn!(
                    "{}: {} bytes at offset {} are damaged ({}) and were dropped: {}",
                    path.display(),
                    d.bytes,
                    d.offset,
                    d.reason,
                    d.lost
                );
            }
            if contents.torn_bytes > 0 {
                tracing::warn!(
                    "{}: {} bytes after the last complete batch (torn by a crash) dropped",
                    path.display(),
                    contents.torn_bytes
                );
            }
            Ok(Some(sink.put(index, compact(&contents, index)?)?))
        })();
        match result {
            Ok(part) => {
                if let Err(e) = crate::journal::remove(&path) {
                    tracing::warn!("removing {}: {e}", path.display());
                }
                sink.restamp_rollup();
                done.extend(part);
            }
            Err(e) => tracing::warn!("leftover journal {} kept: {e:#}", path.display()),
        }
    }
    done
}

/// Flushes every buffered record and compacts the journal into its part. Call before exit.
///
/// Returns an error naming the part that could not be written, if any could not.
pub fn finish() -> Result<()> {
    finish_with_stats().map(|_| ())
}

/// [`finish`], returning what was written.
pub fn finish_with_stats() -> Result<WriterStats> {
    let Some(rec) = RECORDER.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return Ok(WriterStats::default());
    };
    ACTIVE.store(false, Ordering::Release);
    {
        let mut s = rec
            .shared
            .wake_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        s.shutdown = true;
        rec.shared.wake.notify_one();
    }
    match rec.writer.join() {
        Ok(r) => r,
        Err(_) => bail!("the trace writer thread panicked"),
    }
}

/// Sets this rank's clock offset to rank 0 (ns to add to local times), e.g. measured by the
/// launcher over the process group. Applies to parts closed from now on.
pub fn set_clock_offset_ns(offset_ns: i64) {
    CLOCK_OFFSET_NS.store(offset_ns, Ordering::Relaxed);
}

/// A timed region; the span ends when the guard drops. Spans nest per thread.
#[must_use = "the span ends when this guard is dropped"]
pub struct SpanGuard {
    name: &'static str,
    start: u64,
    seq: u64,
    parent: u64,
    depth: u16,
    generation: u64,
    pipeline: Option<PipelineSlot>,
    // Spans belong to the thread that opened them (nesting is per thread).
    _not_send: PhantomData<*const ()>,
}

impl SpanGuard {
    /// Marks the span as failed with `message` (recorded as an `error` record inside it).
    pub fn error(&self, message: &str) {
        if self.generation == 0 {
            return;
        }
        let inside = Some((self.seq, self.depth + 1));
        point(
            Kind::Error,
            self.name,
            0.0,
            Reduce::Mean,
            Some(message),
            inside,
        );
    }
}

impl Drop for SpanGuard {
    #[inline]
    fn drop(&mut self) {
        if self.generation == 0 {
            return;
        }
        let end = monotonic_ns();
        let step = STEP.load(Ordering::Relaxed);
        let tags = STEP_TAGS.load(Ordering::Relaxed);
        let _ = LOCAL.try_with(|l| {
            let mut l = l.borrow_mut();
            if l.generation != self.generation {
                return;
            }
            l.depth = self.depth;
            l.push(RawRecord {
                kind: Kind::Span,
                reduce: Reduce::Mean,
                depth: self.depth,
                name: self.name,
                seq: self.seq,
                parent: self.parent,
                step,
                tags,
                start_mono: self.start,
                dur_ns: end.saturating_sub(self.start),
                value: 0.0,
                message: None,
                pipeline: self.pipeline,
            });
        });
    }
}

/// Opens a span named `name` (a phase name such as `forward_backward`).
#[inline]
pub fn span(name: &'static str) -> SpanGuard {
    open_span(name, None)
}

/// Opens the span of one pass of a pipeline schedule (`forward`, `backward`, ...), tagged with
/// the microbatch it runs and the (virtual) stage that runs it.
#[inline]
pub fn pipeline_span(name: &'static str, slot: PipelineSlot) -> SpanGuard {
    open_span(name, Some(slot))
}

#[inline]
fn open_span(name: &'static str, pipeline: Option<PipelineSlot>) -> SpanGuard {
    let mut guard = SpanGuard {
        name,
        start: 0,
        seq: 0,
        parent: 0,
        depth: 0,
        generation: 0,
        pipeline,
        _not_send: PhantomData,
    };
    if !ACTIVE.load(Ordering::Relaxed) {
        return guard;
    }
    let _ = LOCAL.try_with(|l| {
        let mut l = l.borrow_mut();
        if !l.ensure_ring() {
            return;
        }
        l.seq += 1;
        let depth = l.depth;
        guard.seq = l.seq;
        guard.depth = depth;
        guard.parent = if depth == 0 {
            0
        } else {
            l.parents[(depth as usize - 1).min(MAX_TRACKED_DEPTH - 1)]
        };
        if (depth as usize) < MAX_TRACKED_DEPTH {
            l.parents[depth as usize] = guard.seq;
        }
        l.depth = depth.saturating_add(1);
        guard.generation = l.generation;
    });
    if guard.generation != 0 {
        guard.start = monotonic_ns();
    }
    guard
}

/// Records a point event (instant, scalar or error) at the current time and step, as a child
/// of the innermost span open on this thread, or with `inside`'s `(parent seq, depth)` (an
/// error a span guard reports about its own span).
#[inline]
fn point(
    kind: Kind,
    name: &'static str,
    value: f64,
    reduce: Reduce,
    message: Option<&str>,
    inside: Option<(u64, u16)>,
) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let now = monotonic_ns();
    let step = STEP.load(Ordering::Relaxed);
    let tags = STEP_TAGS.load(Ordering::Relaxed);
    let _ = LOCAL.try_with(|l| {
        let mut l = l.borrow_mut();
        if !l.ensure_ring() {
            return;
        }
        l.seq += 1;
        let (parent, depth) = inside.unwrap_or_else(|| {
            let depth = l.depth;
            let parent = if depth == 0 {
                0
            } else {
                l.parents[(depth as usize - 1).min(MAX_TRACKED_DEPTH - 1)]
            };
            (parent, depth)
        });
        let seq = l.seq;
        l.push(RawRecord {
            kind,
            reduce,
            depth,
            name,
            seq,
            parent,
            step,
            tags,
            start_mono: now,
            dur_ns: 0,
            value,
            message: message.map(Into::into),
            pipeline: None,
        });
    });
}

/// Records a point event.
#[inline]
pub fn instant(name: &'static str) {
    point(Kind::Instant, name, 0.0, Reduce::Mean, None, None);
}

/// Records an error outside of any span guard (inside the innermost open span, if any).
pub fn error(name: &'static str, message: &str) {
    point(Kind::Error, name, 0.0, Reduce::Mean, Some(message), None);
}

/// Records a scalar metric for the current step, with its cross-rank reduction.
#[inline]
pub fn scalar(name: &'static str, value: f64, reduce: Reduce) {
    point(Kind::Scalar, name, value, reduce, None, None);
}

/// The step and step tags a record made now carries: taken when a span timed by another
/// clock ends on the host, and given to [`record_timed_span`] when its times are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStamp {
    step: u64,
    tags: u64,
}

/// The current step and step tags (see [`StepStamp`]).
#[inline]
pub fn step_stamp() -> StepStamp {
    StepStamp {
        step: STEP.load(Ordering::Relaxed),
        tags: STEP_TAGS.load(Ordering::Relaxed),
    }
}

/// A span timed by another clock than the host's (a GPU's CUDA events), recorded after the
/// fact by [`record_timed_span`]. Its times are already on this process's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct TimedSpan {
    pub name: &'static str,
    /// In the order the spans were opened, from 1, unique on the recording thread: the
    /// recording thread makes no other records (its `seq` would collide).
    pub seq: u64,
    /// `seq` of the enclosing timed span; 0 at top level.
    pub parent: u64,
    pub depth: u16,
    pub start_mono: u64,
    pub dur_ns: u64,
    pub stamp: StepStamp,
    pub pipeline: Option<PipelineSlot>,
}

/// Records a span whose times another clock gave (see [`TimedSpan`]) on the calling thread's
/// lane, which should be one that records nothing else (titan-train's `cuda:<index>` thread).
pub fn record_timed_span(span: TimedSpan) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let _ = LOCAL.try_with(|l| {
        let mut l = l.borrow_mut();
        if !l.ensure_ring() {
            return;
        }
        l.push(RawRecord {
            kind: Kind::Span,
            reduce: Reduce::Mean,
            depth: span.depth,
            name: span.name,
            seq: span.seq,
            parent: span.parent,
            step: span.stamp.step,
            tags: span.stamp.tags,
            start_mono: span.start_mono,
            dur_ns: span.dur_ns,
            value: 0.0,
            message: None,
            pipeline: span.pipeline,
        });
    });
}

/// Sets the current training step attached to subsequent records (process-wide, so data
/// loader threads see it too). A new step clears the step tags.
pub fn set_step(step: u64) {
    if STEP.swap(step, Ordering::Relaxed) != step {
        STEP_TAGS.store(0, Ordering::Relaxed);
    }
}

/// Tags the current step (e.g. `checkpoint`, `validation`): every record of this step made
/// from now on carries the tag, an `instant` named after the tag marks when it was added,
/// and readers apply it to the whole step. Up to 64 distinct tags per process.
pub fn add_step_tag(tag: &'static str) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let bit = {
        let guard = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rec) = guard.as_ref() else { return };
        let mut tags = rec.shared.tags.lock().unwrap_or_else(|e| e.into_inner());
        match tags.iter().position(|t| *t == tag) {
            Some(i) => i,
            None if tags.len() < 64 => {
                tags.push(tag);
                tags.len() - 1
            }
            None => {
                tracing::warn!("step tag `{tag}` dropped: more than 64 distinct tags");
                return;
            }
        }
    };
    STEP_TAGS.fetch_or(1 << bit, Ordering::Relaxed);
    instant(tag);
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The background writer: drains rings, closes parts on time or size.
struct Writer {
    shared: Arc<Shared>,
    sink: PartSink,
    header: PartHeader,
    anchor: EpochAnchor,
    next_part: u64,
    flush_interval: Duration,
    rotate_interval: Duration,
    max_records: usize,
    builder: PartBuilder,
    /// Union of tag masks seen per step, so records of a step drained before the tag was
    /// added still carry it when their part closes after it.
    step_tags: HashMap<u64, u64>,
    stats: WriterStats,
    first_error: Option<anyhow::Error>,
    /// The open journal (opened at the first batch after a rotation).
    journal: Option<JournalWriter>,
    journal_opened: Instant,
}

/// Records drained but not yet converted (conversion needs the step's final tag set).
struct Pending {
    thread: u32,
    record: RawRecord,
}

impl Writer {
    fn run(mut self) -> Result<WriterStats> {
        // Drain often enough that rings rarely fill and a part closes close to its deadline.
        let tick =
            (self.flush_interval / 8).clamp(Duration::from_millis(5), Duration::from_millis(100));
        let mut part_opened = Instant::now();
        let mut pending: Vec<Pending> = Vec::new();
        loop {
            let shutdown = {
                let mut s = self
                    .shared
                    .wake_lock
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if !s.shutdown && !s.kick {
                    s = self
                        .shared
                        .wake
                        .wait_timeout(s, tick)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                s.kick = false;
                s.shutdown
            };
            self.drain(&mut pending);
            let due = part_opened.elapsed() >= self.flush_interval;
            if shutdown || pending.len() >= self.max_records || (due && !pending.is_empty()) {
                while !pending.is_empty() {
                    let take = pending.len().min(self.max_records);
                    let rest = pending.split_off(take);
                    self.append_batch(std::mem::replace(&mut pending, rest));
                }
                part_opened = Instant::now();
            } else if due {
                part_opened = Instant::now();
            }
            if shutdown
                || (self.journal.is_some() && self.journal_opened.elapsed() >= self.rotate_interval)
            {
                self.rotate();
            }
            if shutdown {
                break;
            }
        }
        match self.first_error.take() {
            Some(e) => Err(e),
            None => Ok(self.stats),
        }
    }

    fn drain(&mut self, pending: &mut Vec<Pending>) {
        let rings = self
            .shared
            .rings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for ring in &rings {
            let thread = ring.thread;
            // SAFETY: the writer thread is every ring's only consumer.
            unsafe {
                ring.drain(|record| {
                    if record.step != NO_STEP && record.tags != 0 {
                        *self.step_tags.entry(record.step).or_default() |= record.tags;
                    }
                    pending.push(Pending { thread, record });
                })
            };
            self.header
                .threads
                .entry(thread)
                .or_insert_with(|| ring.thread_name.clone());
        }
        drop(rings);
        // Forget rings whose thread has exited (only the registry holds them) and are empty.
        self.shared
            .rings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|r| Arc::strong_count(r) > 1 || !r.is_empty());
    }

    /// Turns drained records into one batch and appends it to the journal.
    fn append_batch(&mut self, records: Vec<Pending>) {
        let tag_names: Vec<&'static str> = self
            .shared
            .tags
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut tag_buf: Vec<&str> = Vec::with_capacity(4);
        for p in &records {
            let r = &p.record;
            let step = (r.step != NO_STEP).then_some(r.step);
            let mask = r.tags
                | step
                    .and_then(|s| self.step_tags.get(&s).copied())
                    .unwrap_or(0);
            tag_buf.clear();
            for (i, t) in tag_names.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    tag_buf.push(t);
                }
            }
            self.builder.push(&Row {
                thread: p.thread,
                seq: r.seq,
                kind: r.kind,
                name: r.name,
                step,
                start_ns: self.anchor.to_epoch(r.start_mono),
                dur_ns: (r.kind == Kind::Span).then_some(r.dur_ns as i64),
                value: (r.kind == Kind::Scalar).then_some(r.value),
                reduce: (r.kind == Kind::Scalar).then_some(r.reduce),
                depth: r.depth,
                parent: (r.parent != 0).then_some(r.parent),
                tags: &tag_buf,
                message: r.message.as_deref(),
                pipeline: r.pipeline,
            });
        }
        // Old steps cannot gain tags any more; keep the map small.
        if let Some(&last) = self.step_tags.keys().max() {
            self.step_tags.retain(|&s, _| s + 2 >= last);
        }
        let offset = CLOCK_OFFSET_NS.load(Ordering::Relaxed);
        // The footer holds one clock offset: a new offset starts a new part.
        if self
            .journal
            .as_ref()
            .is_some_and(|j| j.clock_offset_ns() != offset)
        {
            self.rotate();
        }
        self.header.clock_offset_ns = offset;
        let n = records.len() as u64;
        let result = self.builder.finish(&self.header).and_then(|batch| {
            if self.journal.is_none() {
                let index = self.next_part;
                self.next_part += 1;
                self.journal = Some(JournalWriter::create(
                    self.sink.journal_dir(),
                    index,
                    &self.header,
                )?);
                self.journal_opened = Instant::now();
            }
            self.journal.as_mut().expect("opened above").append(&batch)
        });
        match result {
            Ok(()) => {
                self.stats.batches += 1;
                self.stats.records += n;
            }
            Err(e) => self.fail(e.context(format!(
                "journaling {n} records of rank {}",
                self.header.rank
            ))),
        }
    }

    /// Compacts the open journal into its part (renamed into place or uploaded) and removes
    /// it. On failure the journal stays on disk; the next process of this rank recovers it.
    fn rotate(&mut self) {
        let Some(journal) = self.journal.take() else {
            return;
        };
        let index = journal.index();
        let path = journal.path().to_path_buf();
        drop(journal);
        let result = read_journal(&path)
            .and_then(|contents| compact(&contents, index))
            .and_then(|bytes| self.sink.put(index, bytes));
        match result {
            Ok(part) => {
                if let Err(e) = crate::journal::remove(&path) {
                    tracing::warn!("removing the compacted journal {}: {e}", path.display());
                }
                self.sink.restamp_rollup();
                self.stats.parts += 1;
                self.stats.part_paths.push(part);
            }
            Err(e) => self.fail(e.context(format!(
                "compacting {} into part {index} of rank {}",
                path.display(),
                self.header.rank
            ))),
        }
    }

    fn fail(&mut self, e: anyhow::Error) {
        tracing::error!(
            "trace records of rank {} not written: {e:#}",
            self.header.rank
        );
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// Blocks until the writer has taken every record this thread has made so far (or `timeout`
/// passes); returns whether it did. For benchmarks and tests that must not time the writer.
pub fn wait_drained(timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let ring_and_shared = LOCAL
        .try_with(|l| {
            let l = l.borrow();
            Some((l.ring.clone()?, l.shared.clone()?))
        })
        .ok()
        .flatten();
    let Some((ring, shared)) = ring_and_shared else {
        return true;
    };
    while !ring.is_empty() {
        if Instant::now() >= deadline {
            return false;
        }
        shared.kick();
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only unit test that starts the (process-global) recorder.
    #[test]
    fn object_store_runs_journal_in_the_spool_and_upload_parts_and_the_rank_summary() {
        let dir = tempfile::tempdir().unwrap();
        let spool = dir.path().join("spool");
        let url = "memory://recorder-test/runs/a";
        init_with(
            InitOptions {
                run: url.into(),
                source: Source::Trainer,
                rank: 0,
                local_rank: 0,
                world_size: 1,
                flush_interval: Duration::from_millis(50),
            },
            Tuning {
                rotate_interval: Duration::from_millis(400),
                spool_dir: Some(spool.clone()),
                ..Default::default()
            },
        )
        .unwrap();
        let Location::Object { store, base, .. } = Location::parse(url).unwrap() else {
            unreachable!()
        };
        let objects = || -> Vec<String> {
            use futures::TryStreamExt;
            let metas: Vec<_> = titan_storage::runtime()
                .block_on(store.list(Some(&base)).try_collect())
                .unwrap();
            let mut v: Vec<String> = metas.iter().map(|m| m.location.to_string()).collect();
            v.sort();
            v
        };
        let spool_rank = crate::location::spool_rank_dir(&spool, url, 0);
        let node = crate::digest::node::file_name(&hostname(), 0);
        let node = node.strip_suffix(".summary").unwrap().to_string();
        let journals = || {
            std::fs::read_dir(&spool_rank)
                .map(|d| d.count())
                .unwrap_or(0)
        };
        let start = Instant::now();
        let mut saw_journal = false;
        let mut n = 0u64;
        while start.elapsed() < Duration::from_millis(1000) {
            set_step(n / 10);
            let s = span("step");
            n += 1;
            std::thread::sleep(Duration::from_millis(2));
            drop(s);
            if n.is_multiple_of(50) {
                saw_journal |= journals() > 0;
                let o = objects();
                assert!(
                    o.iter().all(|o| o.ends_with(".parquet")
                        || o.ends_with("/rank.summary")
                        || o.starts_with(&format!("runs/a/obs/{node}."))),
                    "{o:?}"
                );
            }
        }
        let stats = finish_with_stats().unwrap();
        assert!(saw_journal, "the journal lives in the spool folder");
        assert_eq!(journals(), 0, "compacted journals are removed");
        let all = objects();
        let with = |ext: &str| -> Vec<String> {
            all.iter().filter(|o| o.ends_with(ext)).cloned().collect()
        };
        let objects = with(".parquet");
        assert!(objects.len() >= 2, "{objects:?}");
        assert_eq!(objects.len() as u64, stats.parts);
        // Every part is one object: its summary and detail levels are in its footer; beside
        // them the rank summary, and beside the rank folders the node's figures and timeline,
        // published from the spool folder that keeps the node's files (issue 42).
        let mut want = vec![
            format!("runs/a/obs/{node}.figures"),
            format!("runs/a/obs/{node}.timeline"),
        ];
        want.extend(objects.iter().cloned());
        want.push("runs/a/obs/rank-0/rank.summary".into());
        assert_eq!(all, want, "{all:?}");
        let spooled = spool_rank.parent().unwrap();
        for ext in ["figures", "timeline"] {
            let key = base.clone().join("obs").join(format!("{node}.{ext}"));
            let published = titan_storage::runtime()
                .block_on(async { store.get(&key).await?.bytes().await })
                .unwrap();
            let kept = std::fs::read(spooled.join(format!("{node}.{ext}"))).unwrap();
            assert_eq!(published.to_vec(), kept, "{ext}");
        }
        let t = crate::digest::timeline::decode(
            &std::fs::read(spooled.join(format!("{node}.timeline"))).unwrap(),
        )
        .unwrap();
        assert_eq!(t.ranks.len(), 1);
        assert!(t.ranks[0].may_describe());
        assert_eq!(t.ranks[0].parts.len() as u64, stats.parts);
        assert!(
            objects
                .iter()
                .all(|o| o.starts_with("runs/a/obs/rank-0/part-"))
        );
        let loaded = crate::read::load(url, &Default::default()).unwrap();
        assert_eq!(loaded.spans.len() as u64, n);
        assert_eq!(stats.records, n);
        // `summary` reads the rank summary: one LIST page and one GET for the rank, not one
        // a part, no part read whole.
        let mut reader = crate::read::PartsReader::open(url).unwrap();
        let digests = crate::read::ReadOptions {
            digests: true,
            ..Default::default()
        };
        let run = reader.refresh_with(&digests, true).unwrap();
        let s = crate::analysis::summary::summary(run, &Default::default());
        let c = reader.last();
        assert_eq!((c.requests, c.bytes, c.parts_decoded), (2, 0, 0), "{c:?}");
        assert_eq!(s.spans, n);
        // One that no longer fits the parts listed (a part's size is not the one it
        // covered): the parts' own summaries are read instead, each once.
        use object_store::ObjectStoreExt as _;
        let summary = base.clone().join("obs").join("rank-0").join("rank.summary");
        let rt = titan_storage::runtime();
        let stored = rt
            .block_on(async { store.get(&summary).await.unwrap().bytes().await })
            .unwrap();
        let mut d = crate::digest::rank_file::decode(&stored).unwrap();
        d.segments[0].parts[0].len += 1;
        let bytes = crate::digest::rank_file::encode(&d).unwrap();
        rt.block_on(store.put(&summary, bytes.into())).unwrap();
        let mut reader = crate::read::PartsReader::open(url).unwrap();
        let run = reader.refresh_with(&digests, true).unwrap();
        let s = crate::analysis::summary::summary(run, &Default::default());
        let c = reader.last();
        assert_eq!((c.requests, c.bytes), (2 + stats.parts, 0), "{c:?}");
        assert_eq!(s.spans, n);
        // Without one (a run written before issue 42's rank summaries): one ranged GET a part.
        titan_storage::runtime()
            .block_on(store.delete(&summary))
            .unwrap();
        let mut reader = crate::read::PartsReader::open(url).unwrap();
        reader.refresh_with(&digests, true).unwrap();
        let c = reader.last();
        assert_eq!((c.requests, c.bytes), (1 + stats.parts, 0), "{c:?}");
    }
}
