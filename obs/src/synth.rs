//! Synthetic multi-rank runs written as real part files: for benchmarks, the TUI and tests.
//!
//! Every rank records the same step structure (titan-train's phases), with deterministic
//! jitter, injected stragglers (a rank whose phase takes `factor` times longer), step tags
//! for checkpoint/validation steps, and the usual per-step scalars.
//!
//! As in data-parallel training, every step has a gradient `all_reduce` right after
//! `forward_backward`: all ranks start a step together, each arrives at the all_reduce when
//! its own work is done, and all leave it together once the last rank has arrived, so the
//! other ranks wait there for a straggler. The generator first lays every rank's steps out
//! without waiting to find, per step, when the last rank arrives, then writes the run.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use rayon::prelude::*;

use crate::footer::PartHeader;
use crate::location::Location;
use crate::part::{PartBuilder, PartSink, Row, encode};
use crate::schema::{Kind, Reduce};
use crate::vocab;

/// A rank that is slow in one phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    pub rank: u32,
    /// Phase name (e.g. `forward_backward`); its whole subtree is slowed down.
    pub phase: String,
    /// Duration multiplier, e.g. 1.5 = 50% slower.
    pub factor: f64,
}

/// Shape of a synthetic run.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub run_id: String,
    pub ranks: u32,
    pub steps: u64,
    /// Spans per rank per step (at least 1); checkpoint/validation steps add one span each.
    pub spans_per_step: usize,
    /// Steps per part file (each rank writes ceil(steps / steps_per_part) parts).
    pub steps_per_part: u64,
    pub stragglers: Vec<Straggler>,
    /// Tag every n-th step `checkpoint` and add a `checkpoint` span (None = never).
    pub checkpoint_every: Option<u64>,
    /// Tag every n-th step `validation` and add a `validation` span and `validation/loss`.
    pub validation_every: Option<u64>,
    /// Write the per-step scalars (loss, grad_norm, tps, ...).
    pub scalars: bool,
    /// Relative random jitter of every duration (0.05 = +-5%).
    pub jitter: f64,
    pub seed: u64,
    /// Unix epoch ns of the first step's start.
    pub start_ns: i64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            run_id: "synthetic".into(),
            ranks: 4,
            steps: 20,
            spans_per_step: 40,
            steps_per_part: 100,
            stragglers: Vec::new(),
            checkpoint_every: Some(10),
            validation_every: Some(5),
            scalars: true,
            jitter: 0.05,
            seed: 42,
            start_ns: 1_750_000_000_000_000_000,
        }
    }
}

/// What [`write_run`] wrote.
#[derive(Debug, Clone, Default)]
pub struct SynthStats {
    pub spans: u64,
    pub records: u64,
    pub parts: u64,
    pub bytes: u64,
}

/// One node of the per-step phase tree.
#[derive(Debug, Clone)]
struct Phase {
    name: &'static str,
    /// Own time (leaf duration, or overhead on top of the children); for a collective, the
    /// transfer time after the last rank arrived.
    base_ns: i64,
    children: Vec<Phase>,
    collective: bool,
}

fn leaf(name: &'static str, base_ns: i64) -> Phase {
    Phase {
        name,
        base_ns,
        children: vec![],
        collective: false,
    }
}

/// Bytes of the synthetic gradient all_reduce (a ~130M-parameter model's fp32 gradients).
const ALL_REDUCE_BYTES: f64 = 524_288_000.0;

fn count(p: &Phase) -> usize {
    1 + p.children.iter().map(count).sum::<usize>()
}

/// The step tree with exactly `n` spans (torchtitan's phases; microbatches fill the rest).
fn step_template(n: usize) -> Phase {
    const MS: i64 = 1_000_000;
    use vocab::titan::*;
    let optimizer = Phase {
        children: vec![
            leaf(CLIP, MS),
            leaf(OPTIMIZER_STEP, 6 * MS),
            leaf(LR, MS / 10),
        ],
        ..leaf(OPTIMIZER, MS / 5)
    };
    let mut root = Phase {
        children: vec![
            leaf(DATA_LOADING, 3 * MS),
            leaf(FORWARD_BACKWARD, MS / 2),
            Phase {
                collective: true,
                ..leaf(vocab::collective::ALL_REDUCE, 2 * MS)
            },
            optimizer,
            leaf(COLLECT_DIST_METRICS, 2 * MS),
        ],
        ..leaf(vocab::STEP, MS / 2)
    };
    let mut spans = count(&root);
    let mut micro = 0;
    while spans + 3 <= n {
        root.children[1].children.push(Phase {
            children: vec![leaf(FORWARD, 10 * MS), leaf(BACKWARD, 20 * MS)],
            ..leaf(MICROBATCH, MS / 10)
        });
        spans += 3;
        micro += 1;
    }
    let extras = [GC, "allocator_cleanup"];
    for e in extras.iter().take(n.saturating_sub(spans)) {
        root.children.push(leaf(e, MS / 2));
    }
    let _ = micro;
    // Fewer spans than the fixed phases: prune from the end.
    while count(&root) > n.max(1) {
        prune_last(&mut root);
    }
    root
}

fn prune_last(p: &mut Phase) -> bool {
    if let Some(last) = p.children.last_mut() {
        if !prune_last(last) {
            p.children.pop();
        }
        true
    } else {
        false
    }
}

/// splitmix64: small, fast, deterministic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

struct SpanOut {
    name: &'static str,
    depth: u16,
    seq: u64,
    parent: u64,
    start: i64,
    dur: i64,
}

struct Emitter<'a> {
    rng: Rng,
    jitter: f64,
    factors: &'a BTreeMap<&'a str, f64>,
    seq: u64,
    out: Vec<SpanOut>,
    /// When the last rank arrives at this step's collective (None: do not wait).
    sync_at: Option<i64>,
    /// Where this rank arrived at a collective in the step being emitted: (time, span index).
    arrivals: Vec<(i64, usize)>,
}

impl Emitter<'_> {
    /// Lays out `p` starting at `start`; returns its duration.
    fn emit(&mut self, p: &Phase, start: i64, depth: u16, parent: u64, factor: f64) -> i64 {
        let factor = factor * self.factors.get(p.name).copied().unwrap_or(1.0);
        self.seq += 1;
        let seq = self.seq;
        let idx = self.out.len();
        self.out.push(SpanOut {
            name: p.name,
            depth,
            seq,
            parent,
            start,
            dur: 0,
        });
        if p.collective {
            // Everyone leaves together, once the last rank is in.
            self.arrivals.push((start, idx));
            let dur = self.sync_at.unwrap_or(start).max(start) - start + p.base_ns;
            self.out[idx].dur = dur;
            return dur;
        }
        let own = ((p.base_ns as f64) * (1.0 + self.jitter * self.rng.sym()) * factor) as i64;
        let mut t = start + own / 2;
        for c in &p.children {
            t += self.emit(c, t, depth + 1, seq, factor);
        }
        let dur = (t - start) + own - own / 2;
        self.out[idx].dur = dur;
        dur
    }
}

/// Writes a synthetic run to `run` (local dir or object store URL), ranks in parallel.
pub fn write_run(run: &str, cfg: &SynthConfig) -> Result<SynthStats> {
    write_run_spooled(run, cfg, None)
}

/// [`write_run`] with an object-store run's node files kept under `spool` (the writers'
/// spool folder, [`PartSink::with_spool`]) instead of the default one.
pub fn write_run_spooled(
    run: &str,
    cfg: &SynthConfig,
    spool: Option<&std::path::Path>,
) -> Result<SynthStats> {
    if cfg.ranks == 0 || cfg.steps_per_part == 0 {
        bail!("synthetic run needs at least one rank and steps_per_part >= 1");
    }
    let location = Location::parse(run)?;
    let stats = (
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    );
    let template = step_template(cfg.spans_per_step);
    let starts = step_starts(cfg, &template);
    (0..cfg.ranks)
        .into_par_iter()
        .try_for_each(|rank| -> Result<()> {
            let s = write_rank(&location, spool, cfg, &template, &starts, rank)?;
            stats.0.fetch_add(s.spans, Ordering::Relaxed);
            stats.1.fetch_add(s.records, Ordering::Relaxed);
            stats.2.fetch_add(s.parts, Ordering::Relaxed);
            stats.3.fetch_add(s.bytes, Ordering::Relaxed);
            Ok(())
        })?;
    Ok(SynthStats {
        spans: stats.0.into_inner(),
        records: stats.1.into_inner(),
        parts: stats.2.into_inner(),
        bytes: stats.3.into_inner(),
    })
}

/// Whether step `step` is a checkpoint step and a validation step.
fn step_kind(cfg: &SynthConfig, step: u64) -> (bool, bool) {
    (
        cfg.checkpoint_every
            .is_some_and(|e| e > 0 && step.is_multiple_of(e)),
        cfg.validation_every
            .is_some_and(|e| e > 0 && step.is_multiple_of(e)),
    )
}

impl Emitter<'_> {
    fn new<'a>(cfg: &SynthConfig, factors: &'a BTreeMap<&'a str, f64>, rank: u32) -> Emitter<'a> {
        Emitter {
            rng: Rng(cfg.seed ^ (rank as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)),
            jitter: cfg.jitter,
            factors,
            seq: 0,
            out: Vec::with_capacity(cfg.spans_per_step + 2),
            sync_at: None,
            arrivals: Vec::new(),
        }
    }

    /// Emits one step starting at `t` (the step tree, then validation and checkpoint);
    /// returns when this rank's step ends.
    fn step(&mut self, cfg: &SynthConfig, template: &Phase, step: u64, t: i64) -> i64 {
        let (ckpt, val) = step_kind(cfg, step);
        self.out.clear();
        self.arrivals.clear();
        let mut end = t + self.emit(template, t, 0, 0, 1.0);
        for (on, name, ms) in [
            (val, vocab::titan::VALIDATION, 40),
            (ckpt, vocab::titan::CHECKPOINT, 150),
        ] {
            if on {
                let phase = leaf(name, ms * 1_000_000);
                end += self.emit(&phase, end, 0, 0, 1.0);
            }
        }
        end
    }
}

fn rank_factors(cfg: &SynthConfig, rank: u32) -> BTreeMap<&str, f64> {
    cfg.stragglers
        .iter()
        .filter(|s| s.rank == rank)
        .map(|s| (s.phase.as_str(), s.factor))
        .collect()
}

/// Gap between the end of one step and the start of the next (data prefetch, logging).
const STEP_GAP_NS: i64 = 100_000;

/// Start time of each step and when its last rank arrives at the collective: lays every
/// rank's steps out without waiting (the same random draws as the real pass), then takes,
/// per step, the latest arrival and the longest remainder after the collective.
fn step_starts(cfg: &SynthConfig, template: &Phase) -> Vec<(i64, Option<i64>)> {
    let n = cfg.steps as usize;
    // Per step: (latest arrival, longest time from leaving the collective to the step's end,
    // longest step without a collective); offsets from the step's start.
    let per_step = (0..cfg.ranks)
        .into_par_iter()
        .map(|rank| {
            let factors = rank_factors(cfg, rank);
            let mut em = Emitter::new(cfg, &factors, rank);
            (1..=cfg.steps)
                .map(|step| {
                    let end = em.step(cfg, template, step, 0);
                    match em.arrivals.first() {
                        Some(&(arrive, idx)) => {
                            let leave = arrive + em.out[idx].dur;
                            (arrive, end - leave, end)
                        }
                        None => (i64::MIN, 0, end),
                    }
                })
                .collect::<Vec<_>>()
        })
        .reduce(
            || vec![(i64::MIN, 0, 0); n],
            |a, b| {
                a.iter()
                    .zip(&b)
                    .map(|(x, y)| (x.0.max(y.0), x.1.max(y.1), x.2.max(y.2)))
                    .collect()
            },
        );
    let transfer = template
        .children
        .iter()
        .find(|c| c.collective)
        .map_or(0, |c| c.base_ns);
    let mut t = cfg.start_ns;
    per_step
        .into_iter()
        .map(|(arrive, after, longest)| {
            let start = t;
            let (sync, len) = if arrive == i64::MIN {
                (None, longest)
            } else {
                (Some(start + arrive), arrive + transfer + after)
            };
            t = start + len + STEP_GAP_NS;
            (start, sync)
        })
        .collect()
}

fn write_rank(
    location: &Location,
    spool: Option<&std::path::Path>,
    cfg: &SynthConfig,
    template: &Phase,
    starts: &[(i64, Option<i64>)],
    rank: u32,
) -> Result<SynthStats> {
    let mut sink = PartSink::new(location.clone(), rank)
        .with_context(|| format!("preparing rank {rank} of the synthetic run"))?
        .defer_rank_summary();
    if let Some(spool) = spool {
        sink = sink.with_spool(spool);
    }
    let header = PartHeader {
        run_id: cfg.run_id.clone(),
        source: "trainer".into(),
        host: format!("node-{}", rank / 8),
        rank,
        local_rank: rank % 8,
        world_size: cfg.ranks,
        pid: 10_000 + rank,
        clock_offset_ns: 0,
        threads: BTreeMap::from([(0, "main".to_string())]),
        run_metadata: serde_json::Map::from_iter([(
            "synthetic".to_string(),
            serde_json::Value::Bool(true),
        )]),
    };
    let factors = rank_factors(cfg, rank);
    let mut em = Emitter::new(cfg, &factors, rank);
    let mut stats = SynthStats::default();
    let mut builder = PartBuilder::new();
    let mut part = 0u64;
    const SCALARS: [(&str, Reduce); 6] = [
        ("training/loss", Reduce::Mean),
        ("training/grad_norm", Reduce::Max),
        ("trainer_memory/reserved_gib", Reduce::Max),
        ("trainer_throughput/tps", Reduce::Mean),
        ("trainer_throughput/tflops", Reduce::Mean),
        ("trainer_throughput/mfu_pct", Reduce::Mean),
    ];
    for (step, &(t, sync)) in (1..=cfg.steps).zip(starts) {
        let mut tags: Vec<&str> = Vec::new();
        let (ckpt, val) = step_kind(cfg, step);
        if ckpt {
            tags.push(vocab::titan::CHECKPOINT);
        }
        if val {
            tags.push(vocab::titan::VALIDATION);
        }
        em.sync_at = sync;
        let end = em.step(cfg, template, step, t);
        for s in &em.out {
            builder.push(&Row {
                thread: 0,
                seq: s.seq,
                kind: Kind::Span,
                name: s.name,
                step: Some(step),
                start_ns: s.start,
                dur_ns: Some(s.dur),
                value: None,
                reduce: None,
                depth: s.depth,
                parent: (s.parent != 0).then_some(s.parent),
                tags: &tags,
                message: None,
                pipeline: None,
            });
        }
        stats.spans += em.out.len() as u64;
        // Each collective's payload, recorded inside its span as titan-train does.
        for &(arrive, idx) in &em.arrivals {
            let s = &em.out[idx];
            em.seq += 1;
            builder.push(&Row {
                thread: 0,
                seq: em.seq,
                kind: Kind::Scalar,
                name: vocab::collective::bytes_scalar(s.name).unwrap_or(s.name),
                step: Some(step),
                start_ns: arrive,
                dur_ns: None,
                value: Some(ALL_REDUCE_BYTES),
                reduce: Some(Reduce::Sum),
                depth: s.depth + 1,
                parent: Some(s.seq),
                tags: &tags,
                message: None,
                pipeline: None,
            });
        }
        let mut point = |kind: Kind, name: &str, value: Option<f64>, reduce: Option<Reduce>| {
            em.seq += 1;
            builder.push(&Row {
                thread: 0,
                seq: em.seq,
                kind,
                name,
                step: Some(step),
                start_ns: end,
                dur_ns: None,
                value,
                reduce,
                depth: 0,
                parent: None,
                tags: &tags,
                message: None,
                pipeline: None,
            });
        };
        for tag in &tags {
            point(Kind::Instant, tag, None, None);
        }
        if cfg.scalars {
            let loss = 8.0 * (-(step as f64) / 200.0).exp() + 0.01 * rank as f64;
            let values = [
                loss,
                1.0 + rank as f64,
                0.19,
                361.4 - rank as f64,
                0.026,
                0.0026,
            ];
            for ((name, reduce), v) in SCALARS.iter().zip(values) {
                point(Kind::Scalar, name, Some(v), Some(*reduce));
            }
            if val {
                point(
                    Kind::Scalar,
                    "validation/loss",
                    Some(loss + 0.1),
                    Some(Reduce::Mean),
                );
            }
        }
        if step % cfg.steps_per_part == 0 || step == cfg.steps {
            stats.records += builder.len() as u64;
            let batch = builder.finish(&header)?;
            let bytes = encode(&batch, &header, part)?;
            stats.bytes += bytes.len() as u64;
            sink.put(part, bytes)?;
            part += 1;
            stats.parts += 1;
        }
    }
    sink.finish_rank_summary()?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_has_exactly_the_requested_span_count() {
        for n in [1, 3, 8, 9, 11, 40, 41, 100] {
            assert_eq!(count(&step_template(n)), n, "n = {n}");
        }
    }

    #[test]
    fn children_fit_inside_parents() {
        let factors = BTreeMap::new();
        let mut em = Emitter {
            rng: Rng(1),
            jitter: 0.1,
            factors: &factors,
            seq: 0,
            out: vec![],
            sync_at: None,
            arrivals: vec![],
        };
        em.emit(&step_template(40), 1000, 0, 0, 1.0);
        for s in &em.out {
            if s.parent != 0 {
                let p = em.out.iter().find(|p| p.seq == s.parent).unwrap();
                assert!(s.start >= p.start && s.start + s.dur <= p.start + p.dur);
                assert_eq!(s.depth, p.depth + 1);
            }
        }
    }

    #[test]
    fn others_wait_for_the_straggler_at_the_all_reduce() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let cfg = SynthConfig {
            ranks: 4,
            steps: 12,
            spans_per_step: 12,
            stragglers: vec![Straggler {
                rank: 3,
                phase: vocab::titan::FORWARD_BACKWARD.into(),
                factor: 1.3,
            }],
            ..Default::default()
        };
        write_run(run.to_str().unwrap(), &cfg).unwrap();
        let loaded = crate::load(run.to_str().unwrap(), &crate::ReadOptions::default()).unwrap();
        let s = crate::analysis::summary(&loaded, &Default::default());
        let top = &s.waits[0];
        assert_eq!((top.rank, top.phase.as_str()), (3, "forward_backward"));
        assert_eq!(top.steps_last, 12);
        // Three ranks wait ~30% of forward_backward (~9 ms with 2 microbatches... at least 5 ms)
        // per step.
        assert!(top.wait_caused_ns > 12 * 3 * 5_000_000, "{top:?}");
        // Only rank 3 is a straggler: the waiting ranks' all_reduce is not held against them.
        assert!(
            s.stragglers.iter().all(|x| x.rank == 3),
            "{:?}",
            s.stragglers
        );
        assert!(
            s.stragglers
                .iter()
                .any(|x| x.phase == "forward_backward" && x.rank == 3)
        );
        // All ranks leave the all_reduce together.
        let ar = loaded.name_id("all_reduce").unwrap();
        let sp = &loaded.spans;
        for step in 1..=12 {
            let ends: Vec<i64> = (0..sp.len())
                .filter(|&i| sp.name[i] == ar && sp.step[i] == step)
                .map(|i| sp.start_ns[i] + sp.dur_ns[i])
                .collect();
            assert_eq!(ends.len(), 4);
            assert!(ends.iter().all(|&e| e == ends[0]), "step {step}: {ends:?}");
        }
    }
}
