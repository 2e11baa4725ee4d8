//! `titan-obs synth OUT`: write a synthetic multi-rank run (real part files) for demos,
//! benchmarks and trying the other commands.

use anyhow::{Result, bail};
use titan_obs_core::synth::{Straggler, SynthConfig, write_run};

/// Write a synthetic run with injected stragglers.
#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Output run location (directory or object store URL).
    pub out: String,
    #[arg(long, default_value_t = 8)]
    pub ranks: u32,
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Spans per rank per step (torchtitan's phases; microbatches fill the rest).
    #[arg(long, default_value_t = 40)]
    pub spans_per_step: usize,
    /// Steps per part file.
    #[arg(long, default_value_t = 100)]
    pub steps_per_part: u64,
    /// Inject a straggler: RANK:PHASE:FACTOR, e.g. 3:forward_backward:1.3 (repeatable).
    #[arg(long, value_name = "RANK:PHASE:FACTOR", value_parser = parse_straggler)]
    pub straggler: Vec<Straggler>,
    /// Tag every N-th step `checkpoint` (0 = never).
    #[arg(long, default_value_t = 10)]
    pub checkpoint_every: u64,
    /// Tag every N-th step `validation` (0 = never).
    #[arg(long, default_value_t = 5)]
    pub validation_every: u64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// The run id every part's footer carries (see `--run ID` of the other commands).
    #[arg(long, default_value = "synthetic")]
    pub run_id: String,
}

fn parse_straggler(s: &str) -> Result<Straggler, String> {
    let bad = || format!("expected RANK:PHASE:FACTOR like 3:forward_backward:1.3, got {s:?}");
    let mut it = s.splitn(3, ':');
    let (Some(r), Some(p), Some(f)) = (it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    let factor: f64 = f.parse().map_err(|_| bad())?;
    if factor.is_nan() || factor <= 0.0 {
        return Err(bad());
    }
    Ok(Straggler {
        rank: r.parse().map_err(|_| bad())?,
        phase: p.to_string(),
        factor,
    })
}

pub fn run(args: &SynthArgs) -> Result<i32> {
    if args.ranks == 0 || args.steps == 0 || args.spans_per_step == 0 || args.steps_per_part == 0 {
        bail!("--ranks, --steps, --spans-per-step and --steps-per-part must be at least 1");
    }
    let cfg = SynthConfig {
        run_id: args.run_id.clone(),
        ranks: args.ranks,
        steps: args.steps,
        spans_per_step: args.spans_per_step,
        steps_per_part: args.steps_per_part,
        stragglers: args.straggler.clone(),
        checkpoint_every: (args.checkpoint_every > 0).then_some(args.checkpoint_every),
        validation_every: (args.validation_every > 0).then_some(args.validation_every),
        seed: args.seed,
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let s = write_run(&args.out, &cfg)?;
    eprintln!(
        "wrote {}: {} ranks x {} steps, {} spans, {} records, {} parts, {:.1} MB in {:.1} s",
        args.out,
        args.ranks,
        args.steps,
        s.spans,
        s.records,
        s.parts,
        s.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    Ok(0)
}
