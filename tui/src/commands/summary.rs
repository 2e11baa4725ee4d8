//! `titan-obs summary RUN`: per-phase statistics, stragglers, tagged steps.

use std::fmt::Write;

use anyhow::Result;
use titan_obs_core::analysis::{
    PipelineSummary, StragglerOptions, Summary, summary, summary_of_figures,
};
use titan_obs_core::read::Columns;

use super::{RunArgs, exit_code, human_ns, load_run_with};

/// Where the time went, per phase across ranks and steps.
#[derive(clap::Args, Debug)]
pub struct SummaryArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Print JSON instead of tables (durations in ns).
    #[arg(long)]
    pub json: bool,
    /// A straggler is above the cross-rank median in at least this share of steps.
    #[arg(long, default_value_t = 0.75, value_name = "SHARE")]
    pub straggler_steps: f64,
    /// ...and its median time is at least this much above the cross-rank median (0.05 = 5%).
    #[arg(long, default_value_t = 0.05, value_name = "RATIO")]
    pub straggler_excess: f64,
    /// Decode every span instead of reading the per-part summaries (`part-<N>.summary`):
    /// p50/p95 exact rather than within 1%, at the cost of reading all the data.
    #[arg(long)]
    pub exact: bool,
    /// Read the nodes' figures (`obs/node-<host>.figures`: one file per node, merged as the
    /// ranks write) instead of every rank's summary: `auto` does from 1024 ranks up, where the
    /// rank summaries take seconds. Stragglers are then found from each rank's distribution
    /// of step times rather than step by step, and the slowest-in counts are not known; a live
    /// job's open journals are not read (the summary stops at each rank's last part, and says
    /// so); runs with several runs' records, damaged files or pipeline schedules are read from
    /// the rank summaries whatever this says.
    #[arg(long, value_enum, default_value_t = NodeFigures::Auto, value_name = "WHEN")]
    pub node_figures: NodeFigures,
    /// Show at most this many stragglers and tagged steps in the tables (JSON has all).
    #[arg(long, default_value_t = 20)]
    pub top: usize,
}

/// When `summary` reads node figures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFigures {
    /// From 1024 rank folders up (`AUTO_FIGURES_RANKS`).
    Auto,
    /// At any number of ranks.
    On,
    /// Never: the rank summaries, stragglers step by step.
    Off,
}

pub use titan_obs_core::digest::figures::AUTO_FIGURES_RANKS;

pub fn run(args: &SummaryArgs) -> Result<i32> {
    let opts = StragglerOptions {
        min_share_of_steps: args.straggler_steps,
        min_excess_ratio: args.straggler_excess,
        ..StragglerOptions::default()
    };
    if args.node_figures == NodeFigures::On
        && let Some(flag) = [
            (args.exact, "--exact (every span decoded)"),
            (
                args.run.no_clock_align,
                "--no-clock-align (the figures hold aligned times)",
            ),
            (
                args.run.run_id.is_some(),
                "--run ID (the figures hold the newest run)",
            ),
        ]
        .into_iter()
        .find_map(|(given, flag)| given.then_some(flag))
    {
        titan_obs::conventions::TITAN_OBS.error(format_args!(
            "--node-figures on cannot go with {flag}: drop one (or pass --node-figures auto)"
        ));
        return Ok(titan_obs::conventions::USAGE.as_i32());
    }
    if let Some(s) = from_figures(args, &opts) {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&s)?);
        } else {
            print!("{}", render(&s, args.top));
        }
        let incomplete = args.run.strict && !s.missing_ranks.is_empty();
        return Ok(if incomplete {
            titan_obs::conventions::INCOMPLETE.as_i32()
        } else {
            titan_obs::conventions::OK.as_i32()
        });
    }
    // Start times match collectives across ranks ("waiting on").
    let columns = Columns {
        start: true,
        // The errors' messages.
        messages: true,
        ..Columns::SUMMARY
    };
    let loaded = load_run_with(&args.run, columns, !args.exact)?;
    // The pipeline section too comes from the per-part summaries (their stages' passes and
    // windows), unless `--exact`.
    let s = summary(&loaded, &opts);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render(&s, args.top));
    }
    Ok(exit_code(&args.run, &loaded))
}

/// The summary from the run's node figures, when they are to be read and can be: a titan
/// run (a local `obs/` folder or an object store's), its clocks aligned, no run id picked, not `--exact` (with
/// `--node-figures on`, those flags were refused before).
fn from_figures(args: &SummaryArgs, opts: &StragglerOptions) -> Option<Summary> {
    let min_ranks = match args.node_figures {
        NodeFigures::Off => return None,
        NodeFigures::On => 0,
        NodeFigures::Auto => AUTO_FIGURES_RANKS,
    };
    if args.exact || args.run.no_clock_align || args.run.run_id.is_some() {
        return None;
    }
    let started = std::time::Instant::now();
    let read = titan_obs_core::location::Location::parse(&args.run.run)
        .map_err(|e| titan_obs_core::digest::figures::NotUsable(format!("{e:#}")))
        .and_then(|l| titan_obs_core::digest::figures::read(&l, min_ranks, &Default::default()));
    match read {
        Ok(job) => {
            tracing::debug!(
                "read {}: {} node figures, {} ranks from their folders, in {:.3} s",
                args.run.run,
                job.nodes_read,
                job.ranks_recomputed,
                started.elapsed().as_secs_f64()
            );
            Some(summary_of_figures(&args.run.run, &job, opts))
        }
        Err(why) => {
            if args.node_figures == NodeFigures::On {
                titan_obs::conventions::TITAN_OBS.warning(format_args!(
                    "not read from node figures ({why}): reading the rank summaries"
                ));
            }
            None
        }
    }
}

/// The human-readable report.
pub fn render(s: &Summary, top: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "run {} ({}): {} ranks (world size {}), {} steps, {} spans, {} errors, median step {}",
        s.run,
        s.format.describe(),
        s.ranks,
        s.world_size,
        s.steps,
        s.spans,
        s.errors,
        human_ns(s.median_step_ns as f64)
    );
    if let Some(f) = &s.node_figures {
        let _ = writeln!(
            o,
            "read from node figures: {} nodes' files, {} ranks from their folders (stragglers \
             from each rank's step times against all ranks'; `--node-figures off` compares \
             them step by step)",
            f.nodes, f.ranks_from_folders
        );
        if f.open_journals > 0 {
            let _ = writeln!(
                o,
                "live: the open journals of {} rank(s) not read (their records since their \
                 last part; `--node-figures off` reads them)",
                f.open_journals
            );
        }
    }
    if !s.missing_ranks.is_empty() {
        let _ = writeln!(o, "missing ranks: {:?}", s.missing_ranks);
    }
    for e in &s.ended_early {
        let _ = writeln!(
            o,
            "ended early: rank {}'s records end {}, the others' at step {} (it stopped, was \
             killed or lost its last records)",
            e.rank,
            e.last_step
                .map_or("before any step".to_string(), |l| format!("at step {l}")),
            e.run_last_step
        );
    }
    for e in s.error_records.iter().take(top) {
        let _ = writeln!(
            o,
            "error: rank {}{} in {}: {}",
            e.rank,
            e.step.map(|s| format!(" step {s}")).unwrap_or_default(),
            e.name,
            e.message
        );
    }
    if s.error_records.len() > top {
        let _ = writeln!(
            o,
            "  ... {} more errors (--top or --json)",
            s.error_records.len() - top
        );
    }
    for (p, e) in &s.corrupt_parts {
        let _ = writeln!(o, "corrupt part (skipped): {p}: {e}");
    }
    for d in &s.damage {
        let _ = writeln!(
            o,
            "damaged (skipped): {} at byte {}, {} bytes: {}; lost {}",
            d.file, d.offset, d.bytes, d.error, d.lost
        );
    }
    if s.malformed_lines > 0 {
        let named: Vec<String> = s
            .bad_lines
            .iter()
            .take(5)
            .map(|b| format!("{}:{}", b.file, b.line))
            .collect();
        let _ = writeln!(
            o,
            "malformed lines (skipped): {} ({}{})",
            s.malformed_lines,
            named.join(", "),
            if s.malformed_lines > named.len() as u64 {
                ", ..."
            } else {
                ""
            }
        );
    }
    for t in &s.truncated_tails {
        let _ = writeln!(o, "truncated last line (ignored): {t}");
    }
    for sp in &s.open_spans {
        let _ = writeln!(
            o,
            "open span (never ended): rank {} {}{}, shown {} until the process's last record",
            sp.rank,
            sp.name,
            sp.step.map(|s| format!(" step {s}")).unwrap_or_default(),
            human_ns(sp.shown_dur_ns as f64)
        );
    }
    if let Some(a) = &s.clock_alignment {
        let hosts: Vec<String> = a
            .hosts
            .iter()
            .map(|h| format!("{} {:+.3} ms", h.host, h.offset_ns as f64 / 1e6))
            .collect();
        let _ = writeln!(
            o,
            "clock: hosts aligned to {} on shared step starts ({})",
            a.reference_host,
            hosts.join(", ")
        );
    }
    // Sorted by total time, so a phase is not under its parent: nesting is a column of its
    // own rather than an indentation that would read as a tree (`forward` under
    // `all_reduce`).
    let _ = writeln!(
        o,
        "\nphases (all ranks, all steps; by total time; depth 0 = top level; % step: of the \
         step time, on the ranks' main threads; (in parentheses) on their other threads, \
         concurrent with the step; clock: host = the host's clock around the call, which on a \
         GPU returns once the work is queued; gpu = CUDA events on the device's stream)"
    );
    // The clock last: scripts that read the text table by position keep their columns.
    let header = [
        "phase", "depth", "count", "total", "mean", "p50", "p95", "max", "% step", "clock",
    ];
    let mut rows: Vec<[String; 10]> = Vec::new();
    for p in &s.phases {
        rows.push([
            p.name.clone(),
            p.depth.to_string(),
            p.stats.count.to_string(),
            human_ns(p.stats.total_ns as f64),
            human_ns(p.stats.mean_ns),
            human_ns(p.stats.p50_ns as f64),
            human_ns(p.stats.p95_ns as f64),
            human_ns(p.stats.max_ns as f64),
            p.share_label("%"),
            p.clock.label().to_string(),
        ]);
    }
    table(
        &mut o,
        &header,
        &rows,
        &[false, true, true, true, true, true, true, true, true, false],
    );

    let _ = writeln!(
        o,
        "\nstragglers (ranks consistently slower than the cross-rank median)"
    );
    if s.stragglers.is_empty() {
        let _ = writeln!(o, "  none");
    } else {
        let header = [
            "phase",
            "rank",
            "slowest in",
            "above median in",
            "median excess",
            "median ratio",
        ];
        let rows: Vec<[String; 6]> = s
            .stragglers
            .iter()
            .take(top)
            .map(|x| {
                [
                    x.phase.clone(),
                    x.rank.to_string(),
                    x.slowest_steps
                        .map_or_else(|| "-".to_string(), |n| format!("{n}/{} steps", x.steps)),
                    format!("{}/{} steps", x.above_median_steps, x.steps),
                    format!("+{}", human_ns(x.median_excess_ns)),
                    format!("x{:.2}", x.median_ratio),
                ]
            })
            .collect();
        table(
            &mut o,
            &header,
            &rows,
            &[false, true, true, true, true, true],
        );
        if s.stragglers.len() > top {
            let _ = writeln!(
                o,
                "  ... {} more (--top or --json)",
                s.stragglers.len() - top
            );
        }
    }

    let _ = writeln!(
        o,
        "\nwaiting on (the rank that arrived last at collectives, and the phase it came from)"
    );
    if s.waits.is_empty() {
        let _ = writeln!(o, "  none (no collectives recorded on two or more ranks)");
    } else {
        let header = ["rank", "late from", "steps last", "wait caused"];
        let rows: Vec<[String; 4]> = s
            .waits
            .iter()
            .take(top)
            .map(|w| {
                [
                    w.rank.to_string(),
                    w.phase.clone(),
                    format!("{}/{}", w.steps_last, s.steps),
                    human_ns(w.wait_caused_ns as f64),
                ]
            })
            .collect();
        table(&mut o, &header, &rows, &[true, false, true, true]);
        if s.waits.len() > top {
            let _ = writeln!(o, "  ... {} more (--top or --json)", s.waits.len() - top);
        }
    }

    let _ = writeln!(
        o,
        "\ntagged steps (cost vs the median untagged step {})",
        human_ns(s.median_step_ns as f64)
    );
    if s.tagged_steps.is_empty() {
        let _ = writeln!(o, "  none");
    } else {
        let mut by_tag: std::collections::BTreeMap<String, (u64, i64)> = Default::default();
        for t in &s.tagged_steps {
            let e = by_tag.entry(t.tags.join("+")).or_default();
            e.0 += 1;
            e.1 += t.extra_ns;
        }
        for (tag, (n, extra)) in &by_tag {
            let _ = writeln!(
                o,
                "  {tag}: {n} steps, {} extra in total, {} per step",
                human_ns(*extra as f64),
                human_ns(*extra as f64 / *n as f64)
            );
        }
        let header = ["step", "tags", "step time", "extra", "tagged phase"];
        let rows: Vec<[String; 5]> = s
            .tagged_steps
            .iter()
            .take(top)
            .map(|t| {
                [
                    t.step.to_string(),
                    t.tags.join(","),
                    human_ns(t.wall_ns as f64),
                    format!("{:+.2} ms", t.extra_ns as f64 / 1e6),
                    human_ns(t.tagged_phase_ns as f64),
                ]
            })
            .collect();
        table(&mut o, &header, &rows, &[true, false, true, true, true]);
        if s.tagged_steps.len() > top {
            let _ = writeln!(
                o,
                "  ... {} more (--top or --json)",
                s.tagged_steps.len() - top
            );
        }
    }
    if let Some(p) = &s.pipeline {
        render_pipeline(&mut o, p);
    }
    if !s.experts.is_empty() {
        render_experts(&mut o, &s.experts);
    }
    o
}

/// Per MoE layer: how unevenly its router spread the tokens over the experts; under expert
/// parallelism also where the hottest expert lives and the wait the layer's experts caused.
fn render_experts(o: &mut String, layers: &[titan_obs_core::analysis::LayerLoad]) {
    let expert_parallel = layers.iter().any(|l| !l.hottest_hosts.is_empty());
    let _ = writeln!(
        o,
        "\nexperts (tokens the routers sent to each expert, all ranks and logged steps; \
         max/mean 1.00 is balanced{})",
        if expert_parallel {
            "; under expert parallelism the ranks hosting the hottest expert, and the time \
             ranks waited in the collective after a rank's experts of the layer ran late"
        } else {
            "; every rank hosts every expert: no expert parallelism"
        }
    );
    let mut header = vec![
        "layer",
        "experts",
        "tokens",
        "mean",
        "max",
        "max/mean",
        "cv",
        "hottest",
        "its share",
        "worst step",
    ];
    let mut right = vec![true, true, true, true, true, true, true, false, true, false];
    if expert_parallel {
        header.extend(["hosted on", "experts wait", "late rank"]);
        right.extend([false, true, true]);
    }
    let rows: Vec<Vec<String>> = layers
        .iter()
        .map(|l| {
            let mut row = vec![
                l.layer.to_string(),
                l.experts.to_string(),
                format!("{:.0}", l.tokens),
                format!("{:.1}", l.mean),
                format!("{:.0}", l.max),
                format!("{:.2}", l.max_over_mean),
                format!("{:.3}", l.cv),
                format!("expert {}", l.hottest_expert),
                format!("{:.1}%", l.hottest_share * 100.0),
                format!("{} ({:.2})", l.worst_step, l.worst_step_max_over_mean),
            ];
            if expert_parallel {
                let ranks: Vec<String> = l.hottest_hosts.iter().map(u32::to_string).collect();
                row.push(if ranks.is_empty() {
                    "-".to_string()
                } else {
                    format!("rank {}", ranks.join(","))
                });
                row.push(human_ns(l.experts_wait_caused_ns as f64));
                row.push(
                    l.experts_late_rank
                        .map_or("-".to_string(), |r| r.to_string()),
                );
            }
            row
        })
        .collect();
    table(o, &header, &rows, &right);
}

/// Per stage: pass times, the measured bubble and the schedule's ideal; the slowest stage.
fn render_pipeline(o: &mut String, p: &PipelineSummary) {
    let ideal = match p.ideal_bubble {
        Some(b) => format!("ideal bubble {:.1}% = (p-1)/(v*m+p-1)", b * 100.0),
        // The weight passes fill the bubble that formula counts.
        None => "zero-bubble schedule (backward split into input and weight passes): the \
                 ideal bubble (p-1)/(v*m+p-1) of GPipe/1F1B does not apply"
            .to_string(),
    };
    let _ = writeln!(
        o,
        "\npipeline: {} stages on {} pipeline ranks ({} per rank), {} microbatches; {ideal}",
        p.stages, p.pipeline_ranks, p.stages_per_rank, p.microbatches,
    );
    let header = [
        "stages",
        "ranks",
        "forward/mb",
        "backward/mb",
        "busy/step",
        "pipeline/step",
        "recv wait",
        "bubble",
        "most compute",
    ];
    let list = |v: Vec<String>| v.join(",");
    let rows: Vec<[String; 9]> = p
        .per_stage
        .iter()
        .enumerate()
        .map(|(i, st)| {
            [
                list(st.stages.iter().map(u16::to_string).collect()),
                list(st.ranks.iter().map(u32::to_string).collect()),
                human_ns(st.forward_ns),
                human_ns(st.backward_ns),
                human_ns(st.busy_ns),
                human_ns(st.window_ns),
                human_ns(st.recv_wait_ns),
                format!("{:.1}%", st.bubble * 100.0),
                if i == p.slowest {
                    "yes".into()
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    table(
        o,
        &header,
        &rows,
        &[false, false, true, true, true, true, true, true, false],
    );
    if p.split_backward {
        let _ = writeln!(
            o,
            "backward/mb: a microbatch's input and weight passes together"
        );
    }
    if let Some(st) = p.per_stage.get(p.slowest) {
        let stages: Vec<String> = st.stages.iter().map(u16::to_string).collect();
        let _ = writeln!(
            o,
            "slowest stage: {} (ranks {:?}): {} of passes per step",
            stages.join(","),
            st.ranks,
            human_ns(st.busy_ns)
        );
    }
}

/// A plain aligned table; `right[i]` right-aligns column i. Each row has a cell per header.
fn table<R: AsRef<[String]>>(o: &mut String, header: &[&str], rows: &[R], right: &[bool]) {
    let n = header.len();
    let w: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .map(|r| r.as_ref()[i].chars().count())
                .fold(header[i].chars().count(), usize::max)
        })
        .collect();
    let line = |o: &mut String, cells: &[&str]| {
        o.push_str("  ");
        for i in 0..n {
            let pad = w[i] - cells[i].chars().count();
            if right[i] {
                o.push_str(&" ".repeat(pad));
                o.push_str(cells[i]);
            } else {
                o.push_str(cells[i]);
                if i + 1 < n {
                    o.push_str(&" ".repeat(pad));
                }
            }
            if i + 1 < n {
                o.push_str("  ");
            }
        }
        o.push('\n');
    };
    line(o, header);
    let dashes: Vec<String> = w.iter().map(|&k| "-".repeat(k)).collect();
    let dash_refs: Vec<&str> = dashes.iter().map(String::as_str).collect();
    line(o, &dash_refs);
    for r in rows {
        let cells: Vec<&str> = r.as_ref().iter().map(String::as_str).collect();
        line(o, &cells);
    }
}
