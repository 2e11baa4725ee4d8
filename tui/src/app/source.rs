//! Adapter from the `titan_obs_core` reader ([`titan_obs_core::read::Run`]) to the TUI's [`Timeline`],
//! and the run-directory source that `--follow` polls.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use titan_obs_core::ingest::{Detected, Follower, Refresh, detect};
use titan_obs_core::location::Location;
use titan_obs_core::read::{PartsReader, ReadOptions, Run};

use super::model::{PhaseId, Reduce, Timeline, TimelineBuilder};
use super::terminal::TimelineSource;

fn reduce(r: titan_obs_core::Reduce) -> Reduce {
    match r {
        titan_obs_core::Reduce::Mean => Reduce::Mean,
        titan_obs_core::Reduce::Max => Reduce::Max,
        titan_obs_core::Reduce::Min => Reduce::Min,
        titan_obs_core::Reduce::Sum => Reduce::Sum,
    }
}

/// Builds the timeline of a loaded run. Spans carry their (rank, step)'s tags; a span is
/// marked failed when an error record names it as parent.
pub fn timeline_from_run(run: &Run, title: &str) -> Timeline {
    let mut b = TimelineBuilder::new(title);
    for &rank in run.ranks.keys() {
        b.add_rank(rank);
    }
    for r in &run.report.missing_ranks {
        b.add_warning(format!("rank {r} has no readable part"));
    }
    for c in &run.report.corrupt_parts {
        b.add_warning(format!("corrupt part {}: {}", c.path, c.error));
    }
    for d in &run.report.damage {
        b.add_warning(format!(
            "damaged {} at byte {}: lost {}",
            d.file, d.offset, d.lost
        ));
    }
    let r = &run.report;
    if r.malformed_lines > 0 {
        let first = r
            .bad_lines
            .first()
            .map(|b| format!(", first {}:{}", b.file, b.line))
            .unwrap_or_default();
        b.add_warning(format!(
            "{} malformed lines skipped{first}",
            r.malformed_lines
        ));
    }
    for o in &r.open_spans {
        b.add_warning(format!(
            "open span: rank {} {}{} never ended (drawn to its process's last record)",
            o.rank,
            o.name,
            o.step.map(|s| format!(" step {s}")).unwrap_or_default()
        ));
    }
    if let Some(a) = &r.clock_alignment {
        b.add_warning(format!(
            "hosts have no shared clock: aligned to {} on shared step starts",
            a.reference_host
        ));
    }
    if let Some(note) = run.runs_note() {
        b.add_warning(format!("{note} (`--run ID` shows another)"));
    }

    let e = &run.errors;
    let failed: HashSet<(u32, u32, u64)> = (0..e.rank.len())
        .filter(|&i| e.parent.get(i).is_some_and(|&p| p != 0))
        .map(|i| {
            (
                e.rank[i],
                e.thread.get(i).copied().unwrap_or(0),
                e.parent[i],
            )
        })
        .collect();

    b.compare_within(titan_obs_core::analysis::stage_groups(run));
    let phase_of: Vec<PhaseId> = run.names.iter().map(|n| b.phase(n)).collect();
    let mut tagset_of: HashMap<u64, u16> = HashMap::new();
    let s = &run.spans;
    let has = |v: usize| v == s.len();
    let (has_start, has_thread, has_depth, has_seq) = (
        has(s.start_ns.len()),
        has(s.thread.len()),
        has(s.depth.len()),
        has(s.seq.len()),
    );
    let mut last_key = (u32::MAX, u64::MAX);
    let mut last_tagset = 0u16;
    for i in 0..s.len() {
        let rank = s.rank[i];
        let step = s.step[i];
        if (rank, step) != last_key {
            last_key = (rank, step);
            let bits = run.step_tags.get(&(rank, step)).map_or(0, |t| t.0);
            last_tagset = *tagset_of.entry(bits).or_insert_with(|| {
                let names: Vec<&str> = titan_obs_core::read::TagSet(bits)
                    .iter()
                    .filter_map(|t| run.tags.get(t as usize).map(String::as_str))
                    .collect();
                b.tagset(&names)
            });
        }
        let thread = if has_thread { s.thread[i] } else { 0 };
        let error = has_seq && !failed.is_empty() && failed.contains(&(rank, thread, s.seq[i]));
        b.add_span_ids(
            rank,
            thread as u64,
            phase_of[s.name[i] as usize],
            last_tagset,
            (step != titan_obs_core::NO_STEP).then_some(step),
            if has_start { s.start_ns[i] } else { 0 },
            s.dur_ns[i],
            if has_depth {
                s.depth[i].min(u8::MAX as u16) as u8
            } else {
                0
            },
            error,
            s.pipeline.get(i).copied().flatten(),
        );
    }
    for (&(_, step), tags) in &run.step_tags {
        for t in tags.iter() {
            if let Some(name) = run.tags.get(t as usize) {
                b.add_step_tag(step, name);
            }
        }
    }
    let sc = &run.scalars;
    for i in 0..sc.rank.len() {
        if sc.step[i] == titan_obs_core::NO_STEP {
            continue;
        }
        b.add_scalar(
            run.name(sc.name[i]),
            sc.step[i],
            sc.value[i],
            reduce(sc.reduce[i]),
        );
    }
    let mut timeline = b.finish();
    timeline.incomplete = !run.report.is_complete();
    timeline
}

/// A run (titan parts, torchtitan structured logs or a Chrome trace; local or object
/// store) kept open: titan runs through [`PartsReader`] (new parts and the batches appended to
/// open journals, nothing decoded twice), torchtitan runs through [`Follower`] (only the
/// bytes appended since the last refresh, and new files), Chrome traces re-read on change.
pub struct RunSource {
    run: String,
    title: String,
    /// The writers may still be appending (`--follow`): wait for unfinished last lines.
    follow: bool,
    reader: Option<Reader>,
    /// `--run ID`: the run of the location to show (default: the newest).
    run_id: Option<String>,
    /// What the last load saw, to tell whether anything changed (titan runs).
    signature: Option<Signature>,
    parts: usize,
    last: Refresh,
    read_total: u64,
}

enum Reader {
    Titan(Box<PartsReader>),
    Other(Follower),
}

/// The set of part files (name and size) of a local run; `None` for object store URLs.
type Signature = Vec<(String, u64)>;

/// The title bar's name for a run: its folder's name.
pub fn title_of(run: &str) -> String {
    Path::new(run.trim_end_matches('/'))
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run.to_string())
}

impl RunSource {
    pub fn new(run: &str) -> Self {
        Self::with_follow(run, false)
    }

    pub fn with_follow(run: &str, follow: bool) -> Self {
        Self {
            run: run.to_string(),
            title: title_of(run),
            follow,
            reader: None,
            run_id: None,
            signature: None,
            parts: 0,
            last: Refresh::default(),
            read_total: 0,
        }
    }

    /// Shows run `id` of the location (`--run ID`) instead of the newest.
    pub fn showing_run(mut self, id: Option<String>) -> Self {
        self.run_id = id;
        self
    }

    fn local_signature(&self) -> Option<Signature> {
        if self.run.contains("://") {
            return None;
        }
        let obs = Path::new(&self.run).join("obs");
        let mut sig = Vec::new();
        for rank in std::fs::read_dir(&obs).ok()?.flatten() {
            for part in std::fs::read_dir(rank.path()).ok()?.flatten() {
                let name = part.file_name().to_string_lossy().into_owned();
                // Parts are renamed into place when complete: temporaries are not parts yet.
                // Open journals grow in place.
                if !(name.ends_with(".parquet") || name.ends_with(".arrows"))
                    || name.starts_with('.')
                {
                    continue;
                }
                let len = part.metadata().map(|m| m.len()).unwrap_or(0);
                sig.push((
                    format!("{}/{name}", rank.file_name().to_string_lossy()),
                    len,
                ));
            }
        }
        sig.sort();
        Some(sig)
    }

    /// Reads what is new since the last read and returns the run's timeline when anything
    /// was (or always, with `always`). Building the timeline costs in proportion to the
    /// whole run, so a `--follow` refresh that found nothing does not build one.
    fn read(&mut self, always: bool) -> anyhow::Result<Option<Timeline>> {
        let reader = match &mut self.reader {
            Some(r) => r,
            None => {
                let r = match detect(&Location::parse(&self.run)?)? {
                    Detected::Titan => Reader::Titan(Box::new(PartsReader::open(&self.run)?)),
                    _ => Reader::Other(Follower::open(&self.run)?),
                };
                self.reader.insert(r)
            }
        };
        let opts = ReadOptions::default();
        match reader {
            Reader::Titan(r) => {
                r.refresh_with(&opts, !self.follow)?;
                if let Some(id) = self.run_id.take() {
                    // Selected once: the reader keeps showing it after refreshes.
                    r.select_run(&id)?;
                }
                let last = r.last();
                self.parts = r.run().report.parts_read;
                self.last = Refresh {
                    new_files: last.parts_decoded as usize,
                    bytes: last.bytes,
                    lines: last.rows,
                };
                self.read_total += last.bytes;
                let changed = always || self.last.changed();
                Ok(changed.then(|| timeline_from_run(r.run(), &self.title)))
            }
            Reader::Other(f) => {
                let (mut run, stats) = f.refresh(&opts, !self.follow)?;
                if let Some(id) = &self.run_id {
                    // Other formats have no run ids: this names what to pass instead.
                    run.select_run(id)?;
                }
                self.parts = run.report.parts_read;
                self.last = stats;
                self.read_total += stats.bytes;
                let changed = always || self.last.changed();
                Ok(changed.then(|| timeline_from_run(&run, &self.title)))
            }
        }
    }

    fn incremental(&self) -> bool {
        match &self.reader {
            Some(Reader::Titan(_)) => true,
            Some(Reader::Other(f)) => f.is_incremental(),
            None => false,
        }
    }
}

impl TimelineSource for RunSource {
    fn load(&mut self) -> anyhow::Result<Timeline> {
        self.signature = self.local_signature();
        let timeline = self.read(true)?;
        Ok(timeline.unwrap_or_else(|| TimelineBuilder::new(&self.title).finish()))
    }

    fn reload_if_changed(&mut self) -> anyhow::Result<Option<Timeline>> {
        if self.incremental() {
            return self.read(false);
        }
        let sig = self.local_signature();
        if sig.is_some() && sig == self.signature {
            return Ok(None);
        }
        let before = self.parts;
        self.signature = sig;
        let t = self.read(true)?;
        // Object store runs cannot be listed cheaply here: reload and compare part counts.
        Ok(t.filter(|_| self.signature.is_some() || self.parts != before))
    }

    fn describe(&self) -> String {
        if self.incremental() {
            format!(
                "{} files, {} read, {} new",
                self.parts,
                human_bytes(self.read_total),
                human_bytes(self.last.bytes)
            )
        } else {
            format!("{} parts", self.parts)
        }
    }
}

fn human_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.1} MB", b as f64 / (1 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{:.1} kB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}
