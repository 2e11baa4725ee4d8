//! A deterministic synthetic timeline built directly in memory, for the frame-time benchmark
//! and the snapshot tests (no files, no reader): the torchtitan phase structure per step,
//! with jitter, one slow rank, checkpoint/validation steps and loss/tps scalars.

use super::model::{Reduce, SpanInput, Timeline, TimelineBuilder};

/// Shape of a synthetic run.
#[derive(Debug, Clone, Copy)]
pub struct SynthSpec {
    pub ranks: u32,
    pub steps: u64,
    /// Microbatches per step; each is a span with forward and backward children.
    pub microbatches: u32,
    /// Rank whose forward_backward is much slower on every third step (a straggler).
    pub slow_rank: Option<u32>,
    /// Give every rank a second thread (a data prefetch worker).
    pub prefetch_thread: bool,
    pub seed: u64,
}

impl SynthSpec {
    /// 4 ranks x 4 steps: small enough to read a snapshot of.
    pub fn small() -> Self {
        Self {
            ranks: 4,
            steps: 4,
            microbatches: 2,
            slow_rank: Some(2),
            prefetch_thread: true,
            seed: 7,
        }
    }

    /// Spans generated per rank per step.
    pub fn spans_per_step(&self) -> u64 {
        // step, data_loading, forward_backward, optimizer, clip_grad, optimizer_step, lr_update,
        // collect_dist_metrics, 3 per microbatch, + 1 prefetch span.
        8 + 3 * self.microbatches as u64 + self.prefetch_thread as u64
    }

    /// The benchmark's 10-million-span run: 256 ranks x 1002 steps x 39 spans (+ init spans).
    pub fn ten_million() -> Self {
        Self {
            ranks: 256,
            steps: 1002,
            microbatches: 10,
            slow_rank: Some(77),
            prefetch_thread: true,
            seed: 1,
        }
    }
}

/// splitmix64: tiny, deterministic, good enough for jitter.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [1 - j, 1 + j).
    fn jitter(&mut self, j: f64) -> f64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        1.0 - j + 2.0 * j * u
    }
}

const ORIGIN_NS: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z
const MS: i64 = 1_000_000;

/// Builds the timeline of a synthetic run.
pub fn timeline(spec: &SynthSpec) -> Timeline {
    let mut b = TimelineBuilder::new(format!(
        "synthetic {} ranks x {} steps",
        spec.ranks, spec.steps
    ));
    let mut rng = Rng(spec.seed);
    // All ranks start each step together (the previous step ends with a collective).
    let mut step_start = ORIGIN_NS + 50 * MS;
    for rank in 0..spec.ranks {
        init_phases(&mut b, rank, &mut rng);
    }
    for step in 1..=spec.steps {
        let checkpoint = step % 10 == 0 || (spec.steps < 10 && step == spec.steps);
        let validation = step % 5 == 0 || (spec.steps < 10 && step == spec.steps - 1);
        if checkpoint {
            b.add_step_tag(step, "checkpoint");
        }
        if validation {
            b.add_step_tag(step, "validation");
        }
        let mut step_end = step_start;
        for rank in 0..spec.ranks {
            let end = one_step(
                &mut b, spec, rank, step, step_start, &mut rng, checkpoint, validation,
            );
            step_end = step_end.max(end);
        }
        let loss = 8.0 * (-(step as f64) / 300.0).exp() + 2.0 + 0.05 * rng.jitter(1.0);
        let tps = 52_000.0 * rng.jitter(0.03);
        for rank in 0..spec.ranks {
            b.add_scalar("loss", step, loss + 0.01 * rank as f64, Reduce::Mean);
            b.add_scalar("tps", step, tps, Reduce::Mean);
        }
        step_start = step_end + MS / 5;
    }
    b.finish()
}

fn init_phases(b: &mut TimelineBuilder, rank: u32, rng: &mut Rng) {
    let mut t = ORIGIN_NS;
    for (name, ms) in [("tokenizer", 4), ("model_build", 30), ("optimizer", 6)] {
        let dur = (ms as f64 * MS as f64 * rng.jitter(0.1)) as i64;
        b.add_span(&SpanInput {
            rank,
            thread: 1,
            name,
            step: None,
            start_ns: t,
            dur_ns: dur,
            depth: 0,
            tags: &[],
            error: false,
        });
        t += dur + MS / 10;
    }
}

#[allow(clippy::too_many_arguments)]
fn one_step(
    b: &mut TimelineBuilder,
    spec: &SynthSpec,
    rank: u32,
    step: u64,
    start: i64,
    rng: &mut Rng,
    checkpoint: bool,
    validation: bool,
) -> i64 {
    let tags: &[&str] = match (checkpoint, validation) {
        (true, true) => &["checkpoint", "validation"],
        (true, false) => &["checkpoint"],
        (false, true) => &["validation"],
        (false, false) => &[],
    };
    let mut span = |name: &str, depth: u8, s: i64, dur: i64, thread: u64| {
        b.add_span(&SpanInput {
            rank,
            thread,
            name,
            step: Some(step),
            start_ns: s,
            dur_ns: dur,
            depth,
            tags,
            error: false,
        });
    };
    let d = |ms: f64, rng: &mut Rng| (ms * MS as f64 * rng.jitter(0.08)) as i64;
    let mut t = start;
    let data = d(3.0, rng);
    let data_start = t;
    t += data;
    let slow = spec.slow_rank == Some(rank) && step % 3 == 1;
    let fb_start = t;
    for _ in 0..spec.microbatches {
        let f = d(if slow { 9.0 } else { 5.0 }, rng);
        let bw = d(if slow { 18.0 } else { 10.0 }, rng);
        span("microbatch", 2, t, f + bw, 1);
        span("forward", 3, t, f, 1);
        span("backward", 3, t + f, bw, 1);
        t += f + bw;
    }
    let fb = t - fb_start;
    let opt_start = t;
    let clip = d(1.0, rng);
    let ostep = d(4.0, rng);
    let lr = d(0.2, rng);
    span("clip_grad", 2, t, clip, 1);
    span("optimizer_step", 2, t + clip, ostep, 1);
    span("lr_update", 2, t + clip + ostep, lr, 1);
    t += clip + ostep + lr;
    let opt = t - opt_start;
    let metrics = d(0.8, rng);
    let metrics_start = t;
    t += metrics;
    if checkpoint {
        t += d(25.0, rng);
    }
    span("step", 0, start, t - start, 1);
    span("data_loading", 1, data_start, data, 1);
    span("forward_backward", 1, fb_start, fb, 1);
    span("optimizer", 1, opt_start, opt, 1);
    span("collect_dist_metrics", 1, metrics_start, metrics, 1);
    if spec.prefetch_thread {
        // The next batch is prefetched on a worker thread while this step computes.
        span("prefetch", 0, fb_start, d(2.5, rng), 2);
    }
    t
}
