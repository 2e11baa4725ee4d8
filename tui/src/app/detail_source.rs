//! `titan-obs RUN` on a large local titan run: the gantt from detail levels ([`DetailRun`],
//! on the UI thread, filled for what is on screen), and what needs the whole run — every
//! step, the phase table, stragglers and waits (from the per-part summaries), the collapsed
//! rows and the metrics — computed on a worker thread and swapped in as each arrives.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{self, Receiver};
use std::time::Instant;

use rayon::prelude::*;
use titan_obs_core::analysis::figured::analyse_figures;
use titan_obs_core::analysis::{RunShape, StragglerOptions, digested::analyse_digest};
use titan_obs_core::digest::figures::AUTO_FIGURES_RANKS;
use titan_obs_core::lod;
use titan_obs_core::part_files::PartFile;
use titan_obs_core::read::{Columns, PartsReader, ReadOptions};

use super::detail::{Appended, DetailRun};
use super::model::{MetricSeries, PhaseSpread, Timeline};
use super::terminal::{FOLLOW_INTERVAL, TimelineSource};
use super::view::View;

pub(super) use super::detail::WholeStep;

/// What the worker sends, in this order.
enum Whole {
    /// Every step, and the number of spans in the run.
    Steps(Vec<WholeStep>, u64),
    /// The analysis of the per-part summaries, and each (phase, step)'s spread across ranks.
    Analysis(
        Box<titan_obs_core::analysis::Analysis>,
        Vec<(String, u64, PhaseSpread)>,
    ),
    /// Each (phase, step)'s spread across ranks, after an analysis sent without them.
    Spread(Vec<(String, u64, PhaseSpread)>),
    Metrics(Vec<MetricSeries>),
    Failed(String),
}

pub struct DetailSource {
    run: String,
    title: String,
    /// `--run ID`: the run of the folder to show (default: the newest).
    run_id: Option<String>,
    detail: Option<DetailRun>,
    whole: Option<Receiver<Whole>>,
    /// Which whole-run results have arrived (for the status line).
    arrived: Vec<&'static str>,
    /// `--follow`: start the follow worker when the run is open.
    follow: bool,
    /// What the follow worker read, refresh after refresh.
    followed: Option<Receiver<Followed>>,
    /// The last refresh: spans appended, the worker's read and this thread's append (ms).
    last_follow: Option<(usize, f64, f64)>,
}

/// One refresh of the follow worker: what it read and how long the read took (ms).
type Followed = anyhow::Result<(Appended, f64)>;

impl DetailSource {
    pub fn new(run: &str, title: &str, follow: bool) -> Self {
        DetailSource {
            run: run.to_string(),
            title: title.to_string(),
            run_id: None,
            detail: None,
            whole: None,
            arrived: Vec::new(),
            follow,
            followed: None,
            last_follow: None,
        }
    }

    /// Shows run `id` of the folder (`--run ID`) instead of the newest.
    pub fn showing_run(mut self, id: Option<String>) -> Self {
        self.run_id = id;
        self
    }
}

/// `--follow`'s worker: every [`FOLLOW_INTERVAL`], reads what the journals (and the parts
/// after `skip`) gained and sends it; stops when the receiver is gone. `run_id`: the run on
/// screen, of a folder that may hold several: nothing is sent before the reader has read a
/// record of it (until then it shows the newest).
fn follow_worker(
    run: String,
    run_id: Option<String>,
    skip: BTreeMap<u32, u64>,
    tx: mpsc::Sender<Followed>,
) {
    let mut reader = match PartsReader::open(&run) {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    reader.skip_parts_through(&skip);
    // What `appended` draws: no span links, no error messages.
    let opts = ReadOptions::with_columns(Columns {
        links: false,
        messages: false,
        ..Columns::ALL
    });
    let mut shown = run_id.is_none();
    loop {
        let started = Instant::now();
        let mut from = reader.run().spans.len();
        // The refresh's `&Run` is let go: selecting the run needs the reader.
        let refreshed = reader.refresh_with(&opts, false).map(|_| ());
        let read = refreshed.map(|()| {
            if let (false, Some(id)) = (shown, &run_id) {
                shown = reader.select_run(id).is_ok();
                // Its tables hold every record of it read so far.
                from = 0;
            }
            shown.then(|| appended(reader.run(), from)).flatten()
        });
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let send = match read {
            Ok(Some(a)) => tx.send(Ok((a, ms))),
            Ok(None) => Ok(()),
            Err(e) => tx.send(Err(e)),
        };
        if send.is_err() {
            return;
        }
        std::thread::sleep(FOLLOW_INTERVAL);
    }
}

/// The spans of `run` from index `from` on, per rank and row; `None` when there are none.
fn appended(run: &titan_obs_core::Run, from: usize) -> Option<Appended> {
    let s = &run.spans;
    if s.len() <= from {
        return None;
    }
    let mut by_rank: BTreeMap<u32, BTreeMap<(u32, u16), lod::SpanRows>> = BTreeMap::new();
    let mut step_tags: BTreeMap<u32, HashMap<u64, u64>> = BTreeMap::new();
    for i in from..s.len() {
        let (rank, thread) = (s.rank[i], s.thread.get(i).copied().unwrap_or(0));
        let depth = s.depth.get(i).copied().unwrap_or(0);
        let row = by_rank
            .entry(rank)
            .or_default()
            .entry((thread, depth))
            .or_insert_with(|| lod::SpanRows {
                thread,
                depth,
                ..Default::default()
            });
        row.start.push(s.start_ns.get(i).copied().unwrap_or(0));
        row.dur.push(s.dur_ns[i].max(0));
        row.name.push(s.name[i]);
        row.step.push(s.step[i]);
        row.pipeline.push(s.pipeline.get(i).copied().flatten());
        if let Some(t) = run.step_tags.get(&(rank, s.step[i])) {
            step_tags.entry(rank).or_default().insert(s.step[i], t.0);
        }
    }
    let ranks = by_rank
        .into_iter()
        .map(|(rank, rows)| {
            let mut rows: Vec<lod::SpanRows> = rows.into_values().collect();
            for r in &mut rows {
                sort_row(r);
            }
            lod::PartSpans {
                rank,
                step_tags: step_tags.remove(&rank).unwrap_or_default(),
                rows,
                ..Default::default()
            }
        })
        .collect();
    Some(Appended {
        names: run.names.clone(),
        tags: run.tags.clone(),
        ranks,
    })
}

/// Sorts a row's spans by start (a journal holds them in the order they ended).
fn sort_row(r: &mut lod::SpanRows) {
    let mut order: Vec<usize> = (0..r.start.len()).collect();
    order.sort_by_key(|&i| r.start[i]);
    let take = |v: &Vec<i64>| order.iter().map(|&i| v[i]).collect::<Vec<_>>();
    r.start = take(&r.start);
    r.dur = take(&r.dur);
    r.name = order.iter().map(|&i| r.name[i]).collect();
    r.step = order.iter().map(|&i| r.step[i]).collect();
    r.pipeline = order.iter().map(|&i| r.pipeline[i]).collect();
}

impl TimelineSource for DetailSource {
    fn load(&mut self) -> anyhow::Result<Timeline> {
        let (d, t) = DetailRun::open(&self.run, &self.title, self.run_id.as_deref())?;
        let (tx, rx) = mpsc::channel();
        let (run, id, parts) = (self.run.clone(), d.run_id.clone(), d.parts_for_steps());
        let seen = d.last_parts();
        std::thread::spawn(move || {
            whole_run(&run, id.as_deref(), &parts, &seen, |w| tx.send(w).is_ok())
        });
        if self.follow {
            let (tx, rx) = mpsc::channel();
            let (run, id, skip) = (self.run.clone(), d.run_id.clone(), d.last_parts());
            std::thread::spawn(move || follow_worker(run, id, skip, tx));
            self.followed = Some(rx);
        }
        self.detail = Some(d);
        self.whole = Some(rx);
        Ok(t)
    }

    fn follow_in_place(&mut self, t: &mut Timeline) -> anyhow::Result<bool> {
        let (Some(rx), Some(d)) = (&self.followed, &mut self.detail) else {
            return Ok(false);
        };
        let mut changed = false;
        while let Ok(f) = rx.try_recv() {
            let (new, read_ms) = f?;
            let started = Instant::now();
            let n = new
                .ranks
                .iter()
                .flat_map(|p| &p.rows)
                .map(|r| r.start.len())
                .sum();
            d.append(t, new);
            let append_ms = started.elapsed().as_secs_f64() * 1e3;
            self.last_follow = Some((n, read_ms, append_ms));
            changed = true;
        }
        Ok(changed)
    }

    fn reload_if_changed(&mut self) -> anyhow::Result<Option<Timeline>> {
        Ok(None)
    }

    fn describe(&self) -> String {
        let mut s = "detail levels".to_string();
        if !self.arrived.is_empty() {
            s.push_str(&format!(", {}", self.arrived.join(", ")));
        }
        if let Some((n, read, append)) = self.last_follow {
            s.push_str(&format!(
                ", +{n} spans (read {read:.1} ms, appended {append:.1} ms)"
            ));
        }
        s
    }

    fn draws_on_demand(&self) -> bool {
        true
    }

    fn focus(&mut self, t: &mut Timeline, v: &View) -> bool {
        let Some(d) = &mut self.detail else {
            return false;
        };
        let mut lanes: Vec<usize> = v
            .visible_row_refs()
            .filter_map(|r| match r {
                super::view::RowRef::Span { lane, .. } => Some(lane as usize),
                super::view::RowRef::Phase(_) => None,
            })
            .collect();
        lanes.dedup();
        d.fill(t, v.window, v.cols, &lanes)
    }

    fn poll_whole(&mut self, t: &mut Timeline) -> bool {
        let (Some(rx), Some(d)) = (&self.whole, &mut self.detail) else {
            return false;
        };
        let mut changed = false;
        while let Ok(w) = rx.try_recv() {
            changed = true;
            if let Some(arrived) = apply(d, t, w) {
                self.arrived.push(arrived);
            }
        }
        changed
    }
}

/// Puts a whole-run result into the timeline; what arrived, for the status line.
fn apply(d: &mut DetailRun, t: &mut Timeline, w: Whole) -> Option<&'static str> {
    match w {
        Whole::Steps(steps, spans) => {
            d.set_whole_steps(t, steps, spans);
            Some("steps")
        }
        Whole::Analysis(a, spread) => {
            d.set_analysis(t, *a, spread);
            Some("summary")
        }
        Whole::Spread(spread) => {
            d.set_spread(t, spread);
            None
        }
        Whole::Metrics(m) => {
            t.set_metrics(m);
            Some("metrics")
        }
        Whole::Failed(e) => {
            t.warnings.push(e);
            None
        }
    }
}

/// The whole-run results the TUI's worker computes, computed here and put into `t` (for a
/// `gantt` image): its steps (unless the gantt has them), analysis, spreads and metrics.
pub(super) fn whole_run_into(d: &mut DetailRun, t: &mut Timeline, run: &str) {
    let (parts, seen) = (d.parts_for_steps(), d.last_parts());
    let got = std::cell::RefCell::new(Vec::new());
    whole_run_here(
        run,
        d.run_id.as_deref(),
        &parts,
        &seen,
        AUTO_FIGURES_RANKS,
        |w| {
            got.borrow_mut().push(w);
            true
        },
    );
    for w in got.into_inner() {
        apply(d, t, w);
    }
}

/// The whole-run results, sent through `send` as each is ready (stops when it returns false),
/// on all cores but one: the UI thread keeps one for itself, so zooming and scrolling stay
/// fast while the worker reads the whole run.
fn whole_run(
    run: &str,
    run_id: Option<&str>,
    parts: &Option<Vec<PartFile>>,
    seen_last: &BTreeMap<u32, u64>,
    send: impl Fn(Whole) -> bool + Send,
) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let here = || whole_run_here(run, run_id, parts, seen_last, AUTO_FIGURES_RANKS, send);
    match rayon::ThreadPoolBuilder::new()
        .num_threads(cores.saturating_sub(1).max(1))
        .build()
    {
        Ok(pool) => pool.install(here),
        Err(_) => here(),
    }
}

/// `parts`: every part, to read every step from; `None` when the gantt has them already.
/// `seen_last`: each rank's last part as the open found it (an object store's node figures
/// that end there are not checked again). `figures_from`: the rank folders from which a run's
/// analysis comes from its node figures (a local run's or an object store's).
fn whole_run_here(
    run: &str,
    run_id: Option<&str>,
    parts: &Option<Vec<PartFile>>,
    seen_last: &BTreeMap<u32, u64>,
    figures_from: usize,
    send: impl Fn(Whole) -> bool,
) {
    let sent = match parts.as_deref().map(steps) {
        Some(Ok((s, n))) => send(Whole::Steps(s, n)),
        Some(Err(e)) => send(Whole::Failed(format!("steps: {e:#}"))),
        None => true,
    };
    if !sent {
        return;
    }
    // From `figures_from` rank folders (`read_local` counts them): the node figures first,
    // as `summary` reads them at this size (only those of the run shown); then the spreads
    // and the metrics from the rank summaries, read one at a time.
    let location = titan_obs_core::location::Location::parse(run).ok();
    let figures = (location.as_ref())
        .and_then(|l| titan_obs_core::digest::figures::read(l, figures_from, seen_last).ok());
    if let (Some(location), Some(job)) = (&location, figures)
        && run_id.is_none_or(|id| id == job.figures.run_id)
    {
        let a = analyse_figures(&job.figures, &StragglerOptions::default());
        drop(job);
        if !send(Whole::Analysis(Box::new(a), Vec::new())) {
            return;
        }
        let streamed = titan_obs_core::analysis::streamed::read(location, run_id);
        match streamed {
            Ok(s) => {
                if let Some((file, error)) = s.damaged.first() {
                    let more = s.damaged.len() - 1;
                    let why = format!(
                        "summary: {file}: {error}{}: read without it",
                        if more > 0 {
                            format!(" (and {more} more)")
                        } else {
                            String::new()
                        }
                    );
                    if !send(Whole::Failed(why)) {
                        return;
                    }
                }
                if send(Whole::Spread(s.spreads)) {
                    send(Whole::Metrics(metric_series(&s.metrics, &s.names)));
                }
            }
            Err(e) => {
                send(Whole::Failed(format!("summary: {e:#}")));
            }
        }
        return;
    }
    match analysis(run, run_id) {
        Ok((a, spread, metrics)) => {
            if send(Whole::Analysis(Box::new(a), spread)) {
                send(Whole::Metrics(metrics));
            }
        }
        Err(e) => {
            send(Whole::Failed(format!("summary: {e:#}")));
        }
    }
}

type StepBounds = BTreeMap<u64, (i64, i64, Vec<String>)>;

/// Every step's bounds and tags from every part's detail file (built and cached where
/// missing), and the number of spans.
fn steps(parts: &[PartFile]) -> anyhow::Result<(Vec<WholeStep>, u64)> {
    let (merged, spans) = parts
        .par_iter()
        .fold(
            || (StepBounds::new(), 0u64),
            |(mut acc, mut n), p| {
                // Unreadable parts are named by the gantt when it reaches them.
                if let Ok(o) = lod::open(p) {
                    let d = o.detail;
                    let off = d.clock_offset_ns;
                    n = d.rows.iter().map(|r| r.spans).fold(n, u64::saturating_add);
                    let tags: HashMap<u64, u64> = d.step_tags.iter().copied().collect();
                    for &(step, a, z) in &d.steps {
                        let e = acc.entry(step).or_insert((i64::MAX, i64::MIN, Vec::new()));
                        e.0 = e.0.min(a.saturating_add(off));
                        e.1 = e.1.max(z.saturating_add(off));
                        let mask = tags.get(&step).copied().unwrap_or(0);
                        for (b, name) in d.tags.iter().enumerate().take(64) {
                            if mask & (1 << b) != 0 && !e.2.contains(name) {
                                e.2.push(name.clone());
                            }
                        }
                    }
                }
                (acc, n)
            },
        )
        .reduce(
            || (StepBounds::new(), 0),
            |(mut a, na), (b, nb)| {
                for (step, (s, e, tags)) in b {
                    let x = a.entry(step).or_insert((i64::MAX, i64::MIN, Vec::new()));
                    x.0 = x.0.min(s);
                    x.1 = x.1.max(e);
                    for t in tags {
                        if !x.2.contains(&t) {
                            x.2.push(t);
                        }
                    }
                }
                (a, na.saturating_add(nb))
            },
        );
    Ok((
        merged
            .into_iter()
            .map(|(s, (a, z, mut t))| {
                t.sort();
                (s, a, z, t)
            })
            .collect(),
        spans,
    ))
}

/// The analysis `titan-obs summary` computes from the summaries, every (phase, step)'s
/// spread across ranks of per-rank time, and the metrics (`titan-obs metrics`' values, from
/// the same summaries: no part is decoded). The summaries hold no start times: a collapsed
/// bar starts at its step's start ([`PhaseSpread::median_start`] is that).
#[allow(clippy::type_complexity)]
fn analysis(
    run: &str,
    run_id: Option<&str>,
) -> anyhow::Result<(
    titan_obs_core::analysis::Analysis,
    Vec<(String, u64, PhaseSpread)>,
    Vec<MetricSeries>,
)> {
    let opts = ReadOptions {
        columns: Columns {
            start: true,
            ..Columns::SUMMARY
        },
        digests: true,
        ..ReadOptions::default()
    };
    let mut loaded = titan_obs_core::load(run, &opts)?;
    if let Some(id) = run_id {
        loaded.select_run(id)?;
    }
    let shape = RunShape::of_run(&loaded);
    // Before the summaries are taken: under PP the stages come from their pipeline sections.
    let stages = titan_obs_core::analysis::stage_groups(&loaded);
    // Taken, not cloned: the merged summaries are most of what this worker holds.
    let digest = loaded.digest.take().unwrap_or_default();
    let a = analyse_digest(
        &digest,
        &loaded.names,
        &shape,
        &stages,
        &StragglerOptions::default(),
    );
    let metrics = metric_series(&digest.metrics, &loaded.names);
    let mut spread = Vec::new();
    for (name, cells) in digest.cells.iter().enumerate() {
        let Some(phase) = loaded.names.get(name) else {
            continue;
        };
        // Per step row: (time, rank) of every rank that ran the phase in it.
        let mut rows: std::collections::BTreeMap<u32, Vec<(i64, u32)>> = Default::default();
        cells.each(|row, pos, t| {
            if t >= 0
                && let Some(&rank) = digest.ranks.get(pos as usize)
            {
                rows.entry(row).or_default().push((t, rank));
            }
        });
        for (row, mut v) in rows {
            let Some(&step) = digest.steps.get(row as usize) else {
                continue;
            };
            v.sort_unstable();
            let median = v[titan_obs_core::stats::nearest_rank_index(v.len(), 0.5)].0;
            let (min, max) = (v[0], v[v.len() - 1]);
            spread.push((
                phase.clone(),
                step,
                PhaseSpread {
                    min: min.0,
                    median,
                    max: max.0,
                    min_rank: min.1,
                    max_rank: max.1,
                    ranks: v.len() as u32,
                    median_start: 0,
                },
            ));
        }
    }
    Ok((a, spread, metrics))
}

/// The metric lines of the summaries as one series per scalar name (NaN values and steps
/// without a number left out, as `titan-obs metrics` does).
fn metric_series(
    lines: &titan_obs_core::metric_lines::Lines,
    names: &[String],
) -> Vec<MetricSeries> {
    let mut series: BTreeMap<String, MetricSeries> = BTreeMap::new();
    for (step, name, reduce, value) in lines.values() {
        let Some(name) = names.get(name as usize) else {
            continue;
        };
        series
            .entry(name.clone())
            .or_insert_with(|| MetricSeries {
                name: name.clone(),
                reduce,
                points: Vec::new(),
            })
            .points
            .push((step, value));
    }
    series.into_values().collect()
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use titan_obs_core::synth::{Straggler, SynthConfig, write_run};

    use super::*;

    /// 12 ranks, rank 5 slower in `forward_backward`.
    fn config() -> SynthConfig {
        SynthConfig {
            ranks: 12,
            steps: 60,
            steps_per_part: 20,
            stragglers: vec![Straggler {
                rank: 5,
                phase: "forward_backward".into(),
                factor: 1.5,
            }],
            ..SynthConfig::default()
        }
    }

    /// A run of [`config`] in `dir`.
    fn run(dir: &std::path::Path) -> String {
        let run = dir.join("run");
        write_run(run.to_str().unwrap(), &config()).unwrap();
        run.to_str().unwrap().to_string()
    }

    /// Issue 42: the spreads and metrics read one rank summary at a time are those of the
    /// rank summaries merged (the median within the histogram's 1%), and a large run's
    /// worker sends the analysis of the node figures first, then them.
    #[test]
    fn spreads_and_metrics_read_rank_by_rank_are_the_merged_ones() {
        let dir = tempfile::tempdir().unwrap();
        let run = run(dir.path());
        let (_, mut merged, metrics) = analysis(&run, None).unwrap();
        let obs = std::path::Path::new(&run).join("obs");
        let s = titan_obs_core::analysis::streamed::read_local(&obs, None).unwrap();
        assert!(s.damaged.is_empty(), "{:?}", s.damaged);
        merged.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(s.spreads.len(), merged.len());
        assert!(merged.len() > 100);
        for ((n1, s1, a), (n2, s2, b)) in s.spreads.iter().zip(&merged) {
            assert_eq!((n1, s1), (n2, s2));
            let exact = |x: &PhaseSpread| (x.min, x.max, x.min_rank, x.max_rank, x.ranks);
            assert_eq!(exact(a), exact(b), "{n1} step {s1}");
            let within = (b.median as f64 * 0.01).max(1.0);
            assert!(
                (a.median - b.median).abs() as f64 <= within,
                "{n1} step {s1}: median {} against {}",
                a.median,
                b.median
            );
        }
        let series = |m: &[MetricSeries]| -> Vec<(String, Vec<(u64, f64)>)> {
            m.iter()
                .map(|s| (s.name.clone(), s.points.clone()))
                .collect()
        };
        let streamed = metric_series(&s.metrics, &s.names);
        assert!(!streamed.is_empty());
        assert_eq!(series(&streamed), series(&metrics));

        // The worker, with node figures from 1 rank: the figures' analysis (no spreads),
        // then the spreads, then the metrics.
        let got: RefCell<Vec<&'static str>> = RefCell::default();
        let stragglers = RefCell::new(Vec::new());
        whole_run_here(&run, None, &None, &BTreeMap::new(), 1, |w| {
            got.borrow_mut().push(match w {
                Whole::Analysis(a, spread) => {
                    assert!(spread.is_empty());
                    stragglers.replace(a.stragglers.iter().map(|s| s.rank).collect());
                    "analysis"
                }
                Whole::Spread(s) => {
                    assert_eq!(s.len(), merged.len());
                    "spread"
                }
                Whole::Metrics(_) => "metrics",
                Whole::Steps(..) => "steps",
                Whole::Failed(e) => panic!("{e}"),
            });
            true
        });
        assert_eq!(*got.borrow(), ["analysis", "spread", "metrics"]);
        assert!(
            stragglers.borrow().contains(&5),
            "{:?}",
            stragglers.borrow()
        );

        // A damaged rank summary: named once, its rank read from its parts' summaries, the
        // same spreads.
        let summary = obs.join("rank-2/rank.summary");
        let mut bytes = std::fs::read(&summary).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&summary, bytes).unwrap();
        let said = |run_id: Option<&str>| {
            let got: RefCell<Vec<String>> = RefCell::default();
            whole_run_here(&run, run_id, &None, &BTreeMap::new(), 1, |w| {
                got.borrow_mut().push(match w {
                    Whole::Failed(e) => e,
                    Whole::Spread(s) => format!("spread {}", s.len()),
                    Whole::Analysis(_, s) => format!("analysis {}", s.len()),
                    Whole::Metrics(_) => "metrics".into(),
                    Whole::Steps(..) => "steps".into(),
                });
                true
            });
            got.into_inner()
        };
        let got = said(None);
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(got[0], "analysis 0");
        assert!(
            got[1].contains("rank-2/rank.summary") && !got[1].contains("more"),
            "{got:?}"
        );
        assert_eq!(got[2], format!("spread {}", merged.len()));
        // Another run than the figures': they are not read (the rank summaries say there is
        // no such run).
        let got = said(Some("another"));
        assert!(
            got.len() == 1 && got[0].starts_with("summary:") && got[0].contains("another"),
            "{got:?}"
        );
    }

    /// Issue 42 on object stores: the worker reads a stored run's node figures (published by
    /// its writers) and its rank summaries one at a time, and sends what it sends for the same
    /// run in a local folder.
    #[test]
    fn a_stored_run_is_analysed_as_the_same_local_run_is() {
        let dir = tempfile::tempdir().unwrap();
        let local = run(dir.path());
        let url = "memory://detail-source-stored/run";
        let spool = dir.path().join("spool");
        titan_obs_core::synth::write_run_spooled(url, &config(), Some(&spool)).unwrap();
        let sent = |run: &str| -> Vec<String> {
            let got: RefCell<Vec<String>> = RefCell::default();
            whole_run_here(run, None, &None, &BTreeMap::new(), 1, |w| {
                got.borrow_mut().push(match w {
                    Whole::Analysis(a, spread) => format!("analysis {a:?} {spread:?}"),
                    Whole::Spread(s) => format!("spread {s:?}"),
                    Whole::Metrics(m) => format!("metrics {m:?}"),
                    Whole::Steps(..) => "steps".into(),
                    Whole::Failed(e) => format!("failed {e}"),
                });
                true
            });
            got.into_inner()
        };
        let (stored, local) = (sent(url), sent(&local));
        assert_eq!(stored.len(), 3, "{stored:?}");
        assert!(stored[0].starts_with("analysis") && stored[0].contains("rank: 5"));
        assert!(stored[1].starts_with("spread") && stored[2].starts_with("metrics"));
        assert_eq!(stored, local);
    }
}
