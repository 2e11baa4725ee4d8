//! Where the time went: per-phase statistics across ranks and steps, stragglers, and the
//! cost of checkpoint/validation steps.

use std::collections::HashMap;

use rayon::prelude::*;
use serde::Serialize;

use super::pipeline::{PipelineSummary, pipeline_summary};
use super::table::{RunShape, SpanTable};
use super::waits::{Wait, Waits, collective_waits, durations_without_waits};
use crate::record::NO_STEP;
use crate::roles::{StepRole, step_roles};
use crate::run::{BadLine, ClockAlignment, Damage, OpenSpan, Run, RunFormat};
use crate::runs::RunBrief;
use crate::stats::{DurationStats, median_f64, union_len};
use crate::tables::NameId;
use crate::vocab::{Clock, is_tag_phase, titan};

/// Straggler detection thresholds.
#[derive(Debug, Clone, Copy)]
pub struct StragglerOptions {
    /// A rank must be above the cross-rank median in at least this share of steps...
    pub min_share_of_steps: f64,
    /// ...and its median time / the cross-rank median must be at least 1 + this...
    pub min_excess_ratio: f64,
    /// ...and its median excess must be at least this share of the median step: a straggler
    /// costs the job something (rank 0's 100 µs of logging in a 1 s step does not).
    pub min_step_share: f64,
}

impl Default for StragglerOptions {
    fn default() -> Self {
        StragglerOptions {
            min_share_of_steps: 0.75,
            min_excess_ratio: 0.05,
            min_step_share: 0.005,
        }
    }
}

/// Statistics of one phase (span name) over all ranks and steps.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseStats {
    pub name: String,
    /// The clock its spans' times come from: `host`, or `gpu` for titan-train's CUDA-event
    /// twins (`gpu:<phase>`, [`crate::vocab::gpu`]).
    pub clock: Clock,
    /// Smallest nesting depth of the spans its `% step` counts (on the main thread, else on
    /// other threads), else the smallest it was seen at anywhere (0 = top level): the
    /// `optimizer` of a step is 1 deep, though the one built at init is top level.
    pub depth: u16,
    /// Count, total and order statistics of its spans' durations.
    #[serde(flatten)]
    pub stats: DurationStats,
    /// Share of the step time spent in this phase: its spans inside steps on the ranks'
    /// main threads, over the step time (the main threads' top-level spans of steps). At
    /// depth 0 these add up to 100%. None for phases outside steps (init, teardown) or when the run has no step
    /// time.
    pub share_of_step: Option<f64>,
    /// Its spans inside steps on the ranks' other threads (FSDP's and the pipeline's
    /// background collectives), over the same step time: concurrent with the step, so not
    /// part of the shares above (None when it never ran there).
    pub concurrent_share_of_step: Option<f64>,
}

impl PhaseStats {
    /// The `% step` cell: the main-thread share, then the share on other threads in
    /// parentheses (concurrent with the step, so not adding to it); `-` for neither.
    /// `unit` follows each number (`%`, or nothing under a `%` header).
    pub fn share_label(&self, unit: &str) -> String {
        let pct = |x: f64| format!("{:.1}{unit}", x * 100.0);
        match (self.share_of_step, self.concurrent_share_of_step) {
            (Some(m), Some(c)) => format!("{} ({})", pct(m), pct(c)),
            (Some(m), None) => pct(m),
            (None, Some(c)) => format!("({})", pct(c)),
            (None, None) => "-".to_string(),
        }
    }
}

/// A rank that is consistently slower than the others in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct Straggler {
    pub phase: String,
    pub rank: u32,
    /// Steps where this rank was the slowest of all ranks, out of `steps` (`None` from node
    /// figures, which do not hold each step's slowest rank).
    pub slowest_steps: Option<u64>,
    /// Steps where this rank was above the cross-rank median, out of `steps`.
    pub above_median_steps: u64,
    pub steps: u64,
    /// Median over steps of (this rank's time - the cross-rank median).
    pub median_excess_ns: f64,
    /// Median over steps of (this rank's time / the cross-rank median).
    pub median_ratio: f64,
}

/// A step tagged checkpoint/validation (or any tag) and what it cost.
#[derive(Debug, Clone, Serialize)]
pub struct TaggedStep {
    pub step: u64,
    pub tags: Vec<String>,
    /// Slowest rank's step time (as its main thread saw it: see [`Summary::median_step_ns`]).
    pub wall_ns: i64,
    /// `wall_ns` minus the median wall time of untagged steps.
    pub extra_ns: i64,
    /// Slowest rank's time in the tags' own spans: those named like a tag or `<tag>_...`
    /// (titan-train's `checkpoint_stage` and `checkpoint_save` in a `checkpoint` step,
    /// torchtitan's `checkpoint_save` span in a `checkpoint_save` step), nested or
    /// overlapping ones counted once.
    pub tagged_phase_ns: i64,
}

/// An error record (a span that failed, or a failure the trainer reported: a rank that
/// stopped answering, a collective that failed), with its message.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorRecord {
    pub rank: u32,
    pub step: Option<u64>,
    /// The span it was recorded in (or the name it was recorded under).
    pub name: String,
    pub message: String,
}

/// A rank whose records end at an earlier step than the run's: it stopped, was killed or
/// lost its last records, while the others went on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndedEarly {
    pub rank: u32,
    /// Its last step with step time (None: it recorded no step at all).
    pub last_step: Option<u64>,
    /// The last step of the other ranks.
    pub run_last_step: u64,
}

/// The whole summary.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub run: String,
    pub ranks: u32,
    pub world_size: u32,
    pub steps: u64,
    pub spans: u64,
    pub errors: u64,
    /// The run's error records with their messages, by rank (the first
    /// [`crate::digest::NAMED_ERRORS`] of each part when read from the per-part summaries).
    pub error_records: Vec<ErrorRecord>,
    /// Ranks whose records end at an earlier step than the others'.
    pub ended_early: Vec<EndedEarly>,
    /// Median over untagged steps of the slowest rank's step time: its main thread's
    /// top-level spans of the step (its `step` span, in titan-train and torchtitan runs);
    /// spans on a rank's other threads are concurrent, not more step time.
    pub median_step_ns: i64,
    pub phases: Vec<PhaseStats>,
    pub stragglers: Vec<Straggler>,
    pub tagged_steps: Vec<TaggedStep>,
    /// Who made the others wait at collectives ("waiting on"), largest wait first.
    pub waits: Vec<Wait>,
    pub missing_ranks: Vec<u32>,
    pub corrupt_parts: Vec<(String, String)>,
    /// Damaged stretches of files skipped while the rest of each file was read.
    pub damage: Vec<Damage>,
    /// What the run was read from (`titan`, `torchtitan`, `chrome_trace`).
    pub format: RunFormat,
    /// Malformed lines of text logs (all counted; the first ones named in `bad_lines`).
    pub malformed_lines: u64,
    pub bad_lines: Vec<BadLine>,
    /// Files whose last line was cut short (a running or killed writer), skipped.
    pub truncated_tails: Vec<String>,
    /// Spans that never ended, shown up to their process's last record.
    pub open_spans: Vec<OpenSpan>,
    /// How ranks on different hosts were put on one clock (None: one host, or titan's
    /// measured offsets).
    pub clock_alignment: Option<ClockAlignment>,
    /// Pipeline-parallel runs: per stage, the measured bubble against the schedule's ideal.
    pub pipeline: Option<PipelineSummary>,
    /// The run id of the records summarised (titan runs; `None` for other formats).
    pub run_id: Option<String>,
    /// The location's other runs, not summarised (`--run ID` picks one), oldest first.
    pub other_runs: Vec<RunBrief>,
    /// titan-train runs: its reads from tensors to the host per step (None when not recorded).
    pub host_syncs: Option<super::metrics::HostSyncs>,
    /// Mixture-of-experts runs: each MoE layer's expert load (empty when none was recorded).
    pub experts: Vec<super::experts::LayerLoad>,
    /// Read from node figures (`None`: from the rank summaries or the spans): see
    /// [`super::figured`] for what differs.
    pub node_figures: Option<NodeFiguresRead>,
}

/// How a summary read from node figures was read.
#[derive(Debug, Clone, Serialize)]
pub struct NodeFiguresRead {
    /// Node figures files used as written.
    pub nodes: u64,
    /// Ranks summarised from their folders instead (their node's figures were stale).
    pub ranks_from_folders: u64,
    /// Ranks whose open journal (a live job) was not read: their records since their last
    /// part are not in the summary.
    pub open_journals: u64,
}

/// What the analysis finds in a span table: everything `titan-obs summary`, the TUI and
/// the gantt show about phases, stragglers, tagged steps and waits.
#[derive(Debug, Clone, Default)]
pub struct Analysis {
    pub ranks: u32,
    pub steps: u64,
    /// Median over untagged steps of the slowest rank's step time.
    pub median_step_ns: i64,
    pub phases: Vec<PhaseStats>,
    pub stragglers: Vec<Straggler>,
    pub tagged_steps: Vec<TaggedStep>,
    pub waits: Waits,
    pub ended_early: Vec<EndedEarly>,
}

impl Analysis {
    /// The ranks named stragglers in `phase`, in rank order.
    pub fn straggler_ranks(&self, phase: &str) -> Vec<u32> {
        let mut r: Vec<u32> = self
            .stragglers
            .iter()
            .filter(|s| s.phase == phase)
            .map(|s| s.rank)
            .collect();
        r.sort_unstable();
        r
    }

    /// The rank and phase that explain most of the run's waiting: the top row of the
    /// "waiting on" table, else the top straggler.
    pub fn headline(&self) -> Option<(u32, &str)> {
        self.waits
            .table
            .first()
            .map(|w| (w.rank, w.phase.as_str()))
            .or_else(|| self.stragglers.first().map(|s| (s.rank, s.phase.as_str())))
    }
}

/// Computes the summary of a loaded run (loaded with at least [`crate::Columns::SUMMARY`];
/// without start times there are no waits).
///
/// A run read with [`crate::ReadOptions::digests`] is summarised from its parts' summaries
/// ([`super::digested`]); any other from its spans.
pub fn summary(run: &Run, opts: &StragglerOptions) -> Summary {
    let shape = RunShape::of_run(run);
    let pipeline = pipeline_summary(run);
    // Under pipeline parallelism ranks are compared with the ranks of their own stage.
    let groups = pipeline
        .as_ref()
        .map(PipelineSummary::stage_groups)
        .unwrap_or_default();
    let (a, spans, errors) = match &run.digest {
        Some(d) => (
            super::digested::analyse_digest(d, &run.names, &shape, &groups, opts),
            d.spans,
            d.errors,
        ),
        None => (
            analyse_grouped(&SpanTable::of_run(run), &shape, &groups, opts),
            run.spans.len() as u64,
            run.errors.rank.len() as u64,
        ),
    };
    let experts = super::experts::layer_loads(run, &a.waits.table);
    Summary {
        run: run.location.clone(),
        ranks: a.ranks,
        world_size: run.report.world_size,
        steps: a.steps,
        spans,
        errors,
        error_records: error_records(run),
        ended_early: a.ended_early,
        median_step_ns: a.median_step_ns,
        phases: a.phases,
        stragglers: a.stragglers,
        tagged_steps: a.tagged_steps,
        waits: a.waits.table,
        missing_ranks: run.report.missing_ranks.clone(),
        corrupt_parts: run
            .report
            .corrupt_parts
            .iter()
            .map(|c| (c.path.clone(), c.error.clone()))
            .collect(),
        damage: run.report.damage.clone(),
        format: run.report.format,
        malformed_lines: run.report.malformed_lines,
        bad_lines: run.report.bad_lines.clone(),
        truncated_tails: run.report.truncated_tails.clone(),
        open_spans: run.report.open_spans.clone(),
        clock_alignment: run.report.clock_alignment.clone(),
        pipeline,
        run_id: run.shown_run().map(|r| r.id).filter(|id| !id.is_empty()),
        other_runs: run.other_runs(),
        host_syncs: super::metrics::host_syncs(run),
        experts,
        node_figures: None,
    }
}

/// The error records of a loaded run with their messages, by rank then step.
fn error_records(run: &Run) -> Vec<ErrorRecord> {
    let name = |id: NameId| run.names.get(id as usize).cloned().unwrap_or_default();
    let mut out: Vec<ErrorRecord> = match &run.digest {
        Some(d) => d
            .named_errors
            .iter()
            .map(|(rank, step, n, m)| ErrorRecord {
                rank: *rank,
                step: (*step != NO_STEP).then_some(*step),
                name: name(*n),
                message: m.clone(),
            })
            .collect(),
        None => {
            let e = &run.errors;
            (0..e.rank.len())
                .map(|i| ErrorRecord {
                    rank: e.rank[i],
                    step: (e.step[i] != NO_STEP).then_some(e.step[i]),
                    name: name(e.name[i]),
                    message: e.message.get(i).cloned().unwrap_or_default(),
                })
                .collect()
        }
    };
    out.sort_by_key(|e| (e.rank, e.step));
    out
}

/// The analysis of a span table: per-phase statistics, stragglers, tagged steps, waits.
///
/// Straggler rule: a rank is a straggler in a phase when, over the steps where at least two
/// ranks ran it, its time is above the cross-rank median in at least
/// `opts.min_share_of_steps` of them and its median ratio to the median is at least
/// `1 + opts.min_excess_ratio` and its median excess at least `opts.min_step_share` of the
/// median untagged step. A rank's time in a phase here leaves out the time it spent
/// waiting in collectives inside that phase for ranks that arrived later (see [`waits`]):
/// a fast rank waiting in `all_reduce` for a slow one is not slow.
///
/// Under pipeline parallelism, where ranks run different stages by design, use
/// [`analyse_grouped`] with the stages' ranks; without them the stragglers in the passes,
/// window, step and collectives (which the stage split shapes) are left out.
pub fn analyse(t: &SpanTable, shape: &RunShape, opts: &StragglerOptions) -> Analysis {
    analyse_grouped(t, shape, &[], opts)
}

/// [`analyse`], comparing each rank only with the ranks of its group (`groups`: the ranks of
/// each pipeline stage; ranks in none form one more group; empty: all ranks are one group).
pub fn analyse_grouped(
    t: &SpanTable,
    shape: &RunShape,
    groups: &[Vec<u32>],
    opts: &StragglerOptions,
) -> Analysis {
    let n = t.len();
    let n_names = t.names.len();

    // Group span indices by name (counting sort): one u32 per span.
    let mut counts = vec![0usize; n_names + 1];
    for &name in t.name {
        counts[name as usize + 1] += 1;
    }
    for i in 1..counts.len() {
        let prev = counts[i - 1];
        counts[i] += prev;
    }
    let offsets = counts.clone();
    let mut order = vec![0u32; n];
    {
        let mut next = counts;
        for (i, &name) in t.name.iter().enumerate() {
            let slot = &mut next[name as usize];
            order[*slot] = i as u32;
            *slot += 1;
        }
    }

    // Dense step and rank indices.
    let ranks: Vec<u32> = if shape.ranks.is_empty() {
        let mut r = t.rank.to_vec();
        r.sort_unstable();
        r.dedup();
        r
    } else {
        shape.ranks.clone()
    };
    let rank_index = DenseIndex::new(ranks.iter().map(|&r| u64::from(r)).collect());
    let mut steps: Vec<u64> = t.step.iter().copied().filter(|&s| s != NO_STEP).collect();
    // Spans of one step are mostly adjacent: dropping adjacent repeats first leaves ~1/40 of
    // the values to sort.
    steps.dedup();
    steps.sort_unstable();
    steps.dedup();
    let step_index = DenseIndex::new(steps.clone());
    // Each span's (step, rank) cell, looked up once here rather than hashed again per phase.
    let cell_of: Vec<u32> = t
        .step
        .iter()
        .zip(t.rank)
        .map(
            |(&s, &r)| match (step_index.get(s), rank_index.get(u64::from(r))) {
                (Some(si), Some(ri)) => cell_id(si * ranks.len() + ri),
                _ => NO_CELL,
            },
        )
        .collect();

    // Step time per (step, rank): the step as the rank's main thread saw it (`StepRole`).
    let n_ranks = ranks.len();
    let n_steps = steps.len();
    let mut wall = vec![0i64; n_steps * n_ranks];
    let step_name = t.name_id(crate::vocab::STEP);
    let roles = step_roles(t.rank, t.step, t.name, t.thread, t.depth, step_name);
    let mut step_total = 0i64;
    let mut last_step: Vec<Option<u64>> = vec![None; n_ranks];
    for (i, &cell) in cell_of.iter().enumerate() {
        if cell != NO_CELL && roles[i] == StepRole::Step {
            wall[cell as usize] += t.dur_ns[i];
            step_total += t.dur_ns[i];
            let l = &mut last_step[cell as usize % n_ranks];
            *l = (*l).max(Some(t.step[i]));
        }
    }
    let wall_max = row_maxima(&wall, n_ranks);
    drop(wall);

    let waits = collective_waits(t);
    let own = durations_without_waits(t, &waits);
    let own_dur: &[i64] = own.as_deref().unwrap_or(t.dur_ns);

    let per_phase: Vec<(PhaseStats, Vec<Straggler>)> = (0..n_names)
        .into_par_iter()
        .filter(|&id| offsets[id + 1] > offsets[id])
        .map(|id| {
            let idx = &order[offsets[id]..offsets[id + 1]];
            phase(
                t,
                id as NameId,
                idx,
                own_dur,
                &cell_of,
                &roles,
                n_steps,
                &ranks,
                step_total,
                groups,
                opts,
            )
        })
        .collect();
    let tagged_phase = tagged_phase_times(t, shape);
    assemble(
        Gathered {
            ranks: &ranks,
            steps: &steps,
            wall_max: &wall_max,
            per_phase,
            tagged_phase,
            waits,
            grouped: !groups.is_empty(),
            last_step: &last_step,
        },
        shape,
        opts,
    )
}

/// What an analysis gathered from spans (or from per-part summaries); [`assemble`] makes
/// the [`Analysis`] of it, the same way for both.
pub(crate) struct Gathered<'a> {
    /// Sorted, distinct.
    pub(crate) ranks: &'a [u32],
    /// Sorted, distinct: the steps that have spans.
    pub(crate) steps: &'a [u64],
    /// Per step: the slowest rank's step time ([`StepRole::Step`] spans).
    pub(crate) wall_max: &'a [i64],
    /// Per phase: its statistics and its stragglers (before the step-share rule).
    pub(crate) per_phase: Vec<(PhaseStats, Vec<Straggler>)>,
    /// (tagged step, rank) -> that rank's time in the step's tag phases.
    pub(crate) tagged_phase: HashMap<(u64, u32), i64>,
    pub(crate) waits: Waits,
    /// Stragglers were found among the ranks of each pipeline stage.
    pub(crate) grouped: bool,
    /// Per rank (as `ranks`): its last step with step time.
    pub(crate) last_step: &'a [Option<u64>],
}

/// Orders phases and stragglers, applies the step-share rule to stragglers and costs the
/// tagged steps against the median untagged step.
pub(crate) fn assemble(g: Gathered<'_>, shape: &RunShape, opts: &StragglerOptions) -> Analysis {
    let mut phases = Vec::with_capacity(g.per_phase.len());
    let mut stragglers = Vec::new();
    for (p, s) in g.per_phase {
        phases.push(p);
        stragglers.extend(s);
    }
    sort_phases(&mut phases);
    stragglers.sort_by(|a, b| b.median_excess_ns.total_cmp(&a.median_excess_ns));
    // A pipeline run's ranks run different stages: a stage with more layers is not a
    // straggler in its passes, nor in the step and pipeline window its place in the schedule
    // shapes. Compared within their stage (`grouped`) they can be; without the stages, those
    // phases are left out (the pipeline section compares the stages; "waiting on" names late
    // ranks).
    if !g.grouped && phases.iter().any(|p| p.name == titan::PIPELINE_RECV) {
        stragglers.retain(|s| {
            let phase = s.phase.as_str();
            !titan::PIPELINE_PHASES.contains(&phase)
                && phase != titan::FORWARD_BACKWARD
                && phase != crate::vocab::STEP
                && !crate::vocab::collective::is_collective(phase)
        });
    }

    // Tagged steps and their cost relative to untagged steps.
    let wall_of = |si: usize| -> i64 { g.wall_max.get(si).copied().unwrap_or(0) };
    let mut untagged: Vec<f64> = g
        .steps
        .iter()
        .enumerate()
        .filter(|(_, s)| !shape.step_tags.contains_key(s))
        .map(|(si, _)| wall_of(si) as f64)
        .collect();
    let median_step = if untagged.is_empty() {
        0.0
    } else {
        median_f64(&mut untagged)
    };
    stragglers.retain(|s| s.median_excess_ns >= opts.min_step_share * median_step);
    let tagged_steps = shape
        .step_tags
        .iter()
        .filter(|(_, tags)| !tags.is_empty())
        .filter_map(|(&step, tags)| {
            let si = g.steps.binary_search(&step).ok()?;
            let w = wall_of(si);
            let phase_ns = g
                .ranks
                .iter()
                .map(|&r| g.tagged_phase.get(&(step, r)).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            Some(TaggedStep {
                step,
                tags: tags.clone(),
                wall_ns: w,
                extra_ns: w - median_step as i64,
                tagged_phase_ns: phase_ns,
            })
        })
        .collect();

    // A rank whose step times stop before the others' stopped early (killed, hung, or its
    // last records lost): the step counts alone do not show it (issue 39).
    let run_last = g.last_step.iter().copied().max().flatten();
    let ended_early = match run_last {
        Some(last) if g.ranks.len() > 1 => g
            .ranks
            .iter()
            .zip(g.last_step)
            .filter(|(_, l)| l.is_none_or(|l| l < last))
            .map(|(&rank, &l)| EndedEarly {
                rank,
                last_step: l,
                run_last_step: last,
            })
            .collect(),
        _ => Vec::new(),
    };
    Analysis {
        ranks: g.ranks.len() as u32,
        steps: g.steps.len() as u64,
        median_step_ns: median_step as i64,
        phases,
        stragglers,
        tagged_steps,
        waits: g.waits,
        ended_early,
    }
}

/// The largest value of each row of a row-major matrix `n` wide (0 for an empty row).
pub(crate) fn row_maxima(m: &[i64], n: usize) -> Vec<i64> {
    m.chunks_exact(n.max(1))
        .map(|row| row.iter().copied().max().unwrap_or(0))
        .collect()
}

/// The stragglers of phase `name` in its steps x ranks matrix of times (see
/// [`find_stragglers`]), each rank compared with the ranks of its group (see
/// [`analyse_grouped`]).
pub(crate) fn phase_stragglers(
    cell: &[i64],
    ranks: &[u32],
    name: &str,
    groups: &[Vec<u32>],
    opts: &StragglerOptions,
) -> Vec<Straggler> {
    let n_ranks = ranks.len();
    let found = |cell: &[i64], columns: &[usize]| -> Vec<Straggler> {
        find_stragglers(cell, columns.len(), opts)
            .into_iter()
            .map(|s| Straggler {
                phase: name.to_string(),
                rank: ranks[columns[s.rank_index]],
                slowest_steps: Some(s.slowest_steps),
                above_median_steps: s.above_median_steps,
                steps: s.steps,
                median_excess_ns: s.median_excess_ns,
                median_ratio: s.median_ratio,
            })
            .collect()
    };
    if groups.is_empty() || n_ranks == 0 {
        return found(cell, &(0..n_ranks).collect::<Vec<_>>());
    }
    let column: HashMap<u32, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let mut columns_of: Vec<Vec<usize>> = groups
        .iter()
        .map(|g| g.iter().filter_map(|r| column.get(r).copied()).collect())
        .collect();
    let mut grouped = vec![false; n_ranks];
    for &c in columns_of.iter().flatten() {
        grouped[c] = true;
    }
    columns_of.push((0..n_ranks).filter(|&c| !grouped[c]).collect());
    let mut out = Vec::new();
    let mut sub = Vec::new();
    for columns in columns_of.iter().filter(|c| c.len() >= 2) {
        sub.clear();
        for row in cell.chunks_exact(n_ranks) {
            sub.extend(columns.iter().map(|&c| row[c]));
        }
        out.extend(found(&sub, columns));
    }
    out
}

/// Per (tagged step, rank): the time that rank spent in its step's tag phases
/// ([`is_tag_phase`]). With start times it is the length of the union of their intervals,
/// so a `checkpoint` span around its own `checkpoint_save` (or a save on a background
/// thread overlapping the staging) is not counted twice; without them, the outermost ones
/// (smallest depth) are summed.
fn tagged_phase_times(t: &SpanTable, shape: &RunShape) -> HashMap<(u64, u32), i64> {
    let mut out = HashMap::new();
    if shape.step_tags.is_empty() {
        return out;
    }
    // Names that are some tag's phase at all: the one check most spans (forward, backward,
    // ...) need, before the lookup of their step's tags.
    let mut all_tags: Vec<&str> = shape
        .step_tags
        .values()
        .flatten()
        .map(String::as_str)
        .collect();
    all_tags.sort_unstable();
    all_tags.dedup();
    let candidate: Vec<bool> = t
        .names
        .iter()
        .map(|n| all_tags.iter().any(|tag| is_tag_phase(n, tag)))
        .collect();
    // Whether a name matches depends on its step's tags: decided once per (name, step).
    let mut spans: HashMap<(u64, u32), Vec<usize>> = HashMap::new();
    let mut matches: HashMap<(NameId, u64), bool> = HashMap::new();
    for i in 0..t.len() {
        // A name id outside the table (a damaged part) is no tag's phase.
        if !candidate.get(t.name[i] as usize).copied().unwrap_or(false) {
            continue;
        }
        let Some(tags) = shape.step_tags.get(&t.step[i]) else {
            continue;
        };
        let hit = *matches.entry((t.name[i], t.step[i])).or_insert_with(|| {
            let name = &t.names[t.name[i] as usize]; // in range: `candidate` checked it
            tags.iter().any(|tag| is_tag_phase(name, tag))
        });
        if hit {
            spans.entry((t.step[i], t.rank[i])).or_default().push(i);
        }
    }
    for (key, idx) in spans {
        let ns = if t.has_start() {
            let mut iv: Vec<(i64, i64)> = idx
                .iter()
                // Saturating: a damaged part's huge times must not overflow.
                .map(|&i| (t.start_ns[i], t.start_ns[i].saturating_add(t.dur_ns[i])))
                .collect();
            union_len(&mut iv)
        } else {
            let top = if t.has_depth() {
                idx.iter().map(|&i| t.depth[i]).min().unwrap_or(0)
            } else {
                0
            };
            idx.iter()
                .filter(|&&i| !t.has_depth() || t.depth[i] == top)
                .map(|&i| t.dur_ns[i])
                .fold(0i64, i64::saturating_add)
        };
        out.insert(key, ns);
    }
    out
}

/// Phases in the order the summary lists them: inside steps first, then by total time.
pub(crate) fn sort_phases(phases: &mut [PhaseStats]) {
    phases.sort_by(|a, b| {
        (
            a.share_of_step.is_none() && a.concurrent_share_of_step.is_none(),
            std::cmp::Reverse(a.stats.total_ns),
            &a.name,
        )
            .cmp(&(
                b.share_of_step.is_none() && b.concurrent_share_of_step.is_none(),
                std::cmp::Reverse(b.stats.total_ns),
                &b.name,
            ))
    });
}

#[allow(clippy::too_many_arguments)]
fn phase(
    t: &SpanTable,
    id: NameId,
    idx: &[u32],
    own_dur: &[i64],
    cell_of: &[u32],
    roles: &[StepRole],
    n_steps: usize,
    ranks: &[u32],
    step_total: i64,
    groups: &[Vec<u32>],
    opts: &StragglerOptions,
) -> (PhaseStats, Vec<Straggler>) {
    let spans = t;
    let has_depth = t.has_depth();
    let mut durs: Vec<i64> = idx.iter().map(|&i| spans.dur_ns[i as usize]).collect();
    // Its share of the step time counts its main-thread time inside steps; its time on the
    // ranks' other threads is concurrent with the step, a share of its own.
    let (mut in_step_total, mut concurrent_total) = (0i64, 0i64);
    let (mut any_in_step_time, mut any_concurrent) = (false, false);
    for &i in idx {
        let i = i as usize;
        if roles[i].in_step_time() {
            in_step_total += spans.dur_ns[i];
            any_in_step_time = true;
        } else if roles[i] == StepRole::Concurrent {
            concurrent_total += spans.dur_ns[i];
            any_concurrent = true;
        }
    }
    let any_in_step = idx.iter().any(|&i| spans.step[i as usize] != NO_STEP);
    // The depth shown beside `% step`: where it was counted.
    let depth_of = |keep: &dyn Fn(StepRole) -> bool| {
        idx.iter()
            .filter(|&&i| keep(roles[i as usize]))
            .map(|&i| spans.depth[i as usize])
            .min()
    };
    let depth = if has_depth {
        depth_of(&|r| r.in_step_time())
            .or_else(|| depth_of(&|r| r == StepRole::Concurrent))
            .or_else(|| depth_of(&|_| true))
            .unwrap_or(0)
    } else {
        0
    };
    let st = DurationStats::compute(&mut durs);
    drop(durs);
    let share =
        (any_in_step_time && step_total > 0).then(|| in_step_total as f64 / step_total as f64);
    let concurrent_share =
        (any_concurrent && step_total > 0).then(|| concurrent_total as f64 / step_total as f64);
    let name = t.names[id as usize].clone();
    let stats = PhaseStats {
        clock: Clock::of(&name),
        name: name.clone(),
        depth,
        stats: st,
        share_of_step: share,
        concurrent_share_of_step: concurrent_share,
    };
    if !any_in_step || ranks.len() < 2 {
        return (stats, Vec::new());
    }
    let n_ranks = ranks.len();
    // Time per (step, rank) in this phase; -1 = the rank did not run it in that step.
    let mut cell = vec![-1i64; n_steps * n_ranks];
    for &i in idx {
        let i = i as usize;
        if cell_of[i] == NO_CELL {
            continue;
        }
        let c = &mut cell[cell_of[i] as usize];
        *c = if *c < 0 { own_dur[i] } else { *c + own_dur[i] };
    }
    let stragglers = phase_stragglers(&cell, ranks, &name, groups, opts);
    (stats, stragglers)
}

/// Cell id of spans outside steps (or of a rank without footer info).
const NO_CELL: u32 = u32::MAX;

/// A (step, rank) cell id. The steps x ranks matrices hold an i64 per cell, so a run with
/// 2^32 cells (32 GB per matrix) cannot be summarised here anyway.
fn cell_id(cell: usize) -> u32 {
    u32::try_from(cell)
        .ok()
        .filter(|&c| c != NO_CELL)
        .expect("fewer than 2^32 (step, rank) cells")
}

/// Position of a key in a sorted, deduplicated key list: a direct table when the keys are
/// dense (steps and ranks usually are), a binary search otherwise. Replaces a hash lookup
/// per span.
struct DenseIndex {
    keys: Vec<u64>,
    /// `table[key - keys[0]]` = position + 1 (0 = absent), when the key range is small.
    table: Option<Vec<u32>>,
}

impl DenseIndex {
    fn new(keys: Vec<u64>) -> Self {
        let table = match (keys.first(), keys.last()) {
            (Some(&lo), Some(&hi)) if hi - lo < (4 * keys.len() as u64).max(1 << 16) => {
                let mut t = vec![0u32; (hi - lo + 1) as usize];
                for (pos, &k) in keys.iter().enumerate() {
                    t[(k - lo) as usize] = pos as u32 + 1;
                }
                Some(t)
            }
            _ => None,
        };
        DenseIndex { keys, table }
    }

    #[inline]
    fn get(&self, key: u64) -> Option<usize> {
        let lo = *self.keys.first()?;
        match &self.table {
            Some(t) => {
                let pos = *t.get(usize::try_from(key.checked_sub(lo)?).ok()?)?;
                (pos != 0).then(|| pos as usize - 1)
            }
            None => self.keys.binary_search(&key).ok(),
        }
    }
}

/// Straggler found in a steps x ranks matrix (by rank index).
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixStraggler {
    pub rank_index: usize,
    pub slowest_steps: u64,
    pub above_median_steps: u64,
    pub steps: u64,
    pub median_excess_ns: f64,
    pub median_ratio: f64,
}

/// Finds ranks that are consistently slow in a row-major steps x ranks matrix of times
/// (negative = absent). Only steps where at least two ranks ran the phase count.
pub fn find_stragglers(
    cell: &[i64],
    n_ranks: usize,
    opts: &StragglerOptions,
) -> Vec<MatrixStraggler> {
    if n_ranks < 2 {
        return Vec::new();
    }
    let mut slowest = vec![0u64; n_ranks];
    let mut above = vec![0u64; n_ranks];
    let mut present_steps = vec![0u64; n_ranks];
    // Per row: the cross-rank median, `None` where fewer than two ranks ran the phase.
    let mut medians: Vec<Option<f64>> = Vec::with_capacity(cell.len() / n_ranks);
    let mut row_vals: Vec<f64> = Vec::with_capacity(n_ranks);
    for row in cell.chunks_exact(n_ranks) {
        row_vals.clear();
        row_vals.extend(row.iter().filter(|&&v| v >= 0).map(|&v| v as f64));
        if row_vals.len() < 2 {
            medians.push(None);
            continue;
        }
        let med = median_f64(&mut row_vals);
        medians.push(Some(med));
        let (mut arg, mut best) = (usize::MAX, i64::MIN);
        for (r, &v) in row.iter().enumerate() {
            if v < 0 {
                continue;
            }
            present_steps[r] += 1;
            if v > best {
                best = v;
                arg = r;
            }
            if v as f64 > med {
                above[r] += 1;
            }
        }
        slowest[arg] += 1;
    }
    // Only ranks above the median often enough need their excess and ratio per step (a
    // second pass: holding them for every rank would be two f64 per cell).
    let mut out = Vec::new();
    let (mut excess, mut ratio) = (Vec::new(), Vec::new());
    for r in 0..n_ranks {
        let steps = present_steps[r];
        if steps == 0 || (above[r] as f64) < opts.min_share_of_steps * steps as f64 {
            continue;
        }
        excess.clear();
        ratio.clear();
        for (row, med) in cell.chunks_exact(n_ranks).zip(&medians) {
            let (Some(med), v) = (*med, row[r]) else {
                continue;
            };
            if v < 0 {
                continue;
            }
            excess.push(v as f64 - med);
            if med > 0.0 {
                ratio.push(v as f64 / med);
            }
        }
        let mr = median_f64(&mut ratio);
        if mr.is_nan() || mr < 1.0 + opts.min_excess_ratio {
            continue;
        }
        out.push(MatrixStraggler {
            rank_index: r,
            slowest_steps: slowest[r],
            above_median_steps: above[r],
            steps,
            median_excess_ns: median_f64(&mut excess),
            median_ratio: mr,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::table::OwnedSpans;

    #[test]
    fn finds_the_consistently_slow_rank() {
        // 4 ranks x 10 steps; rank 2 is 50% slower, others jitter a little.
        let mut cell = Vec::new();
        for s in 0..10i64 {
            for r in 0..4i64 {
                let base = 100 + (s * 7 + r * 3) % 5;
                cell.push(if r == 2 { base * 3 / 2 } else { base });
            }
        }
        let found = find_stragglers(&cell, 4, &StragglerOptions::default());
        assert_eq!(found.len(), 1);
        let s = &found[0];
        assert_eq!(s.rank_index, 2);
        assert_eq!(s.slowest_steps, 10);
        assert_eq!(s.steps, 10);
        assert!((s.median_ratio - 1.5).abs() < 0.05, "{}", s.median_ratio);
        assert!(s.median_excess_ns > 40.0 && s.median_excess_ns < 60.0);
    }

    /// One rank, steps 1..=3, step 2 tagged `checkpoint` with titan-train's spans: a 5 ns
    /// `checkpoint_stage`, then a `checkpoint_save` of 40 ns with a nested
    /// `checkpoint_save_shard` of 30 ns, and a `checkpointing_note` that is not the tag's.
    #[test]
    fn tagged_phase_counts_the_tags_own_spans_once() {
        let names: Vec<String> = [
            "step",
            "checkpoint_stage",
            "checkpoint_save",
            "checkpoint_save_shard",
            "checkpointing_note",
        ]
        .map(String::from)
        .to_vec();
        // (step, name, start, dur, depth)
        let rows: Vec<(u64, NameId, i64, i64, u16)> = vec![
            (1, 0, 0, 100, 0),
            (2, 0, 200, 100, 0),
            (2, 1, 300, 5, 0),
            (2, 2, 305, 40, 0),
            (2, 3, 310, 30, 1),
            (2, 4, 345, 7, 0),
            (3, 0, 400, 100, 0),
        ];
        let mut spans = OwnedSpans::default();
        for &(step, name, start, dur, depth) in &rows {
            spans.push(0, step, name, start, dur, depth);
        }
        let mut t = spans.table(&names);
        let shape = RunShape {
            ranks: vec![0],
            step_tags: [(2, vec!["checkpoint".to_string()])].into(),
        };
        let opts = StragglerOptions::default();
        let a = analyse(&t, &shape, &opts);
        assert_eq!(a.tagged_steps.len(), 1);
        assert_eq!(a.tagged_steps[0].tagged_phase_ns, 45);
        // Without start times: the outermost (depth 0) spans, summed.
        t.start_ns = &[];
        let a = analyse(&t, &shape, &opts);
        assert_eq!(a.tagged_steps[0].tagged_phase_ns, 45);
    }

    /// Two ranks x 3 steps, each a `step` span on the main thread (thread 0) with a nested
    /// `forward_backward`, and FSDP-style collectives on a background thread (thread 1) at
    /// depth 0 during the step, plus a checkpoint beside step 3's `step` span (as a synthetic
    /// run writes it): the step time is the main thread's top-level spans (issue 39: it summed
    /// every thread's) and the depth-0 shares add up to 100%, the background thread's apart.
    #[test]
    fn step_time_is_the_main_threads_step_span() {
        let names: Vec<String> = ["step", "forward_backward", "all_gather", "checkpoint"]
            .map(String::from)
            .to_vec();
        // (rank, thread, step, name, start, dur, depth)
        let mut rows: Vec<(u32, u32, u64, NameId, i64, i64, u16)> = Vec::new();
        let step_len = |rank: u32, step: u64| 100 + 10 * i64::from(rank) + step as i64;
        for rank in 0..2u32 {
            for step in 1..=3u64 {
                let t0 = step as i64 * 1000;
                let len = step_len(rank, step);
                rows.push((rank, 0, step, 0, t0, len, 0));
                rows.push((rank, 0, step, 1, t0 + 5, len - 10, 1));
                rows.push((rank, 1, step, 2, t0 + 10, 60, 0));
                rows.push((rank, 1, step, 2, t0 + 70, 50, 0));
            }
            rows.push((rank, 0, 3, 3, 4000, 500, 0));
        }
        let mut spans = OwnedSpans::default();
        for &(rank, thread, step, name, start, dur, depth) in &rows {
            spans.push_on(rank, thread, step, name, start, dur, depth);
        }
        let t = spans.table(&names);
        let shape = RunShape {
            ranks: vec![0, 1],
            step_tags: Default::default(),
        };
        let a = analyse(&t, &shape, &StragglerOptions::default());
        // By hand: the slowest rank (1) has steps of 111, 112, 113 + 500: median 112.
        assert_eq!(a.median_step_ns, 112);
        let step_total: i64 = (0..2)
            .flat_map(|r| (1..=3).map(move |s| step_len(r, s)))
            .sum::<i64>()
            + 2 * 500;
        let phase = |n: &str| a.phases.iter().find(|p| p.name == n).unwrap();
        let steps_only = (step_total - 1000) as f64 / step_total as f64;
        assert!((phase("step").share_of_step.unwrap() - steps_only).abs() < 1e-12);
        // The background collectives: 110 per rank-step, concurrent, not in `% step`.
        assert_eq!(phase("all_gather").share_of_step, None);
        let c = phase("all_gather").concurrent_share_of_step.unwrap();
        assert!((c - 6.0 * 110.0 / step_total as f64).abs() < 1e-12, "{c}");
        let depth0: f64 = a
            .phases
            .iter()
            .filter(|p| p.depth == 0)
            .filter_map(|p| p.share_of_step)
            .sum();
        assert!((depth0 - 1.0).abs() < 1e-12, "{depth0}");
    }

    #[test]
    fn jitter_alone_is_not_a_straggler() {
        let mut cell = Vec::new();
        for s in 0..50i64 {
            for r in 0..8i64 {
                cell.push(1000 + ((s * 31 + r * 17) % 23));
            }
        }
        assert!(find_stragglers(&cell, 8, &StragglerOptions::default()).is_empty());
    }

    #[test]
    fn absent_cells_are_ignored() {
        // Rank 1 only ran the phase in one step: it cannot be judged on one step alone with
        // the other ranks absent there.
        let cell = vec![10, -1, 10, -1, 10, 50];
        let found = find_stragglers(&cell, 2, &StragglerOptions::default());
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].rank_index, 1);
        assert_eq!(found[0].steps, 1);
    }
}
