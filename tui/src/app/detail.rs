//! The gantt of a large local titan run, drawn from its detail levels (`part-<N>.lod`, see
//! [`titan_obs_core::lod`]) instead of from every span.
//!
//! Opening reads the first and last part's detail file of every rank (the run's extent and its
//! lanes); everything else is read for what is on screen: [`DetailRun::fill`] fills the rows
//! of the visible lanes for the window, from the finest level whose buckets are at least one
//! screen cell wide, or — zoomed in further, or where a row's spans are no more than its
//! buckets — from the spans of the parts overlapping the window, decoded then. Rows of lanes
//! off screen are emptied, and what was read is kept in bounded caches, so memory depends on
//! the screen, not on the run's length.
//!
//! A bucket is drawn as one entry of its row ([`FLAG_DETAIL`]): from the bucket's start, as
//! long as the time spans cover in it, in the phase covering most of it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use anyhow::Result;
use rayon::prelude::*;
use titan_obs_core::analysis::Analysis;
use titan_obs_core::location::Location;
use titan_obs_core::lod::{self, LEVEL_SHIFTS, Names, PartDetail, PartSpans};
use titan_obs_core::part_files::{self, PartFile};

use super::cells::Window;
use super::model::{Lane, Ns, PhaseId, PhaseSpread, SpanRow, StepMark, Timeline, collapsed_rows};

/// A step of the whole run: (step, first start, last end on rank 0's clock, tag names).
pub type WholeStep = (u64, i64, i64, Vec<String>);

/// Span flag: the entry is a bucket of a detail level, not one span.
pub const FLAG_DETAIL: u8 = 4;

/// Part detail files kept in memory (a few kB each).
const DETAIL_CACHE: usize = 8192;
/// Decoded parts kept in memory (their spans; tens of kB each).
const SPANS_CACHE: usize = 256;

/// One part of a rank: where it is and, once read, its time range on rank 0's clock.
struct PartRef {
    file: PartFile,
    range: Option<(i64, i64)>,
    /// Could not be read at all (named in the warnings once).
    unreadable: bool,
}

struct RankParts {
    rank: u32,
    parts: Vec<PartRef>,
    /// Every part's range is known.
    scanned: bool,
}

/// A small cache: the least recently used quarter goes when it is full.
struct Cache<T> {
    map: HashMap<(usize, usize), (u64, Arc<T>)>,
    clock: u64,
    cap: usize,
}

impl<T> Cache<T> {
    fn new(cap: usize) -> Self {
        Cache {
            map: HashMap::new(),
            clock: 0,
            cap,
        }
    }

    fn get(&mut self, k: (usize, usize)) -> Option<Arc<T>> {
        self.clock += 1;
        let clock = self.clock;
        self.map.get_mut(&k).map(|e| {
            e.0 = clock;
            e.1.clone()
        })
    }

    fn put(&mut self, k: (usize, usize), v: Arc<T>) {
        if self.map.len() >= self.cap {
            let mut ages: Vec<u64> = self.map.values().map(|e| e.0).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 4];
            self.map.retain(|_, e| e.0 > cut);
        }
        self.clock += 1;
        self.map.insert(k, (self.clock, v));
    }
}

/// What the gantt of a run drawn from detail levels needs between frames.
pub struct DetailRun {
    /// `RUN/obs/`: left out of the paths in warnings (the title bar is narrow).
    obs: String,
    /// The run shown, when the folder holds several (`--run ID`, else the newest).
    pub run_id: Option<String>,
    ranks: Vec<RankParts>,
    /// Run-wide phase and tag names (those of the timeline).
    names: Names,
    tags: Names,
    details: Cache<PartDetail>,
    spans: Cache<PartSpans>,
    /// Step -> (first start, last end) on rank 0's clock, and tag mask over `tags`, of the
    /// parts read so far.
    steps: BTreeMap<u64, (i64, i64, u64)>,
    /// The whole run's steps arrived from the background pass: parts read later add nothing.
    steps_final: bool,
    /// Lanes whose rows hold data.
    filled: Vec<usize>,
    /// Detail files or parts already named in the warnings.
    warned: HashSet<String>,
    pub origin: i64,
    pub end: i64,
    /// Spans in the run, from the rows' counts of the parts read.
    spans_seen: u64,
    /// What was last filled: (window, columns, lanes); an equal request is not redone.
    last: Option<(Window, usize, Vec<usize>)>,
    /// `--follow`: the spans appended since the run was opened (journals, later parts), by
    /// (rank, thread, depth), relative to the origin; drawn after the parts listed at open.
    tail: BTreeMap<(u32, u32, u16), SpanRow>,
}

/// Spans appended to a followed run, as the follow worker read them: run-wide names and
/// tags of the reader, and per rank its new spans (on rank 0's clock).
pub struct Appended {
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub ranks: Vec<PartSpans>,
}

/// The bytes of a titan run's parts (local or in an object store), to tell whether it is
/// large enough to be drawn from its detail levels; `None` when they cannot be listed.
pub fn run_bytes(run: &str) -> Option<u64> {
    let listed = part_files::list(&Location::parse(run).ok()?).ok()?;
    Some(
        listed
            .values()
            .flatten()
            .map(|p| p.byte_len().unwrap_or(0))
            .fold(0, u64::saturating_add),
    )
}

impl DetailRun {
    /// Lists the run's parts (local or in an object store; those of run `run_id`, else of
    /// the newest run) and reads the first and last part's detail file of every rank (in
    /// parallel): the run's extent and each rank's rows.
    pub fn open(run: &str, title: &str, run_id: Option<&str>) -> Result<(DetailRun, Timeline)> {
        let location = Location::parse(run)?;
        let mut listed = part_files::list(&location)?;
        let run_id = part_files::keep_run(run, &mut listed, run_id)?;
        let ranks: Vec<RankParts> = listed
            .into_iter()
            .map(|(rank, files)| RankParts {
                rank,
                parts: files
                    .into_iter()
                    .map(|file| PartRef {
                        file,
                        range: None,
                        unreadable: false,
                    })
                    .collect(),
                scanned: false,
            })
            .collect();
        let obs = match &location {
            Location::Local(p) => format!("{}/", p.join("obs").display()),
            Location::Object { url, .. } => format!("{url}/obs/"),
        };
        let mut d = DetailRun {
            obs,
            run_id,
            ranks,
            names: Names::default(),
            tags: Names::default(),
            details: Cache::new(DETAIL_CACHE),
            spans: Cache::new(SPANS_CACHE),
            steps: BTreeMap::new(),
            steps_final: false,
            filled: Vec::new(),
            warned: HashSet::new(),
            origin: 0,
            end: 0,
            spans_seen: 0,
            last: None,
            tail: BTreeMap::new(),
        };
        let ends: Vec<(usize, usize)> = d
            .ranks
            .iter()
            .enumerate()
            .flat_map(|(ri, r)| {
                let n = r.parts.len();
                [(ri, 0), (ri, n.saturating_sub(1))]
                    .into_iter()
                    .take(if n > 1 { 2 } else { n })
            })
            .collect();
        let mut t = Timeline {
            title: title.to_string(),
            ..Timeline::default()
        };
        t.tagsets.push(Vec::new());
        d.read_details(&ends, &mut t);
        let ranges = d
            .ranks
            .iter()
            .flat_map(|r| r.parts.iter().filter_map(|p| p.range));
        let (lo, hi) = ranges.fold((i64::MAX, i64::MIN), |(lo, hi), (a, z)| {
            (lo.min(a), hi.max(z))
        });
        if lo <= hi {
            (d.origin, d.end) = (lo, hi);
        }
        t.origin_ns = d.origin;
        t.end = d.end.saturating_sub(d.origin);
        t.ranks = d.ranks.iter().map(|r| r.rank).collect();
        // Lanes: the threads and depths of the parts read, per rank.
        let mut rows: BTreeMap<(u32, u32), BTreeSet<u16>> = BTreeMap::new();
        for &(ri, pi) in &ends {
            if let Some(det) = d.details.get((ri, pi)) {
                for r in &det.rows {
                    rows.entry((d.ranks[ri].rank, r.thread))
                        .or_default()
                        .insert(r.depth);
                }
            }
        }
        let mut thread_ix: HashMap<u32, u32> = HashMap::new();
        for ((rank, thread), depths) in rows {
            let ix = thread_ix.entry(rank).or_default();
            t.lanes.push(Lane {
                rank,
                thread: u64::from(thread),
                thread_ix: *ix,
                rows: depths.into_iter().map(empty_row).collect(),
            });
            *ix += 1;
        }
        d.publish(&mut t);
        Ok((d, t))
    }

    /// Reads the detail files of `parts` (rank index, part index) not yet cached, in
    /// parallel; records their ranges, steps and names.
    fn read_details(&mut self, parts: &[(usize, usize)], t: &mut Timeline) {
        let wanted: Vec<(usize, usize, &PartFile)> = parts
            .iter()
            .filter(|&&k| !self.details.map.contains_key(&k))
            .filter(|&&(ri, pi)| !self.ranks[ri].parts[pi].unreadable)
            .map(|&(ri, pi)| (ri, pi, &self.ranks[ri].parts[pi].file))
            .collect();
        let opened: Vec<_> = wanted
            .into_par_iter()
            .map(|(ri, pi, file)| (ri, pi, lod::open(file), file.beside_shown("lod")))
            .collect();
        for (ri, pi, o, detail_file) in opened {
            match o {
                Ok(o) => {
                    if let Some(why) = o.damaged
                        && self.warned.insert(detail_file)
                    {
                        let why = why.replace(&self.obs, "");
                        t.warnings
                            .push(format!("{why}: drawn from its part's spans instead"));
                    }
                    let det = o.detail;
                    let off = det.clock_offset_ns;
                    let part = &mut self.ranks[ri].parts[pi];
                    let first_read = part.range.is_none();
                    part.range = Some((
                        det.start_ns.saturating_add(off),
                        det.end_ns.saturating_add(off),
                    ));
                    if first_read {
                        self.spans_seen = (det.rows.iter().map(|r| r.spans))
                            .fold(self.spans_seen, u64::saturating_add);
                    }
                    if first_read && !self.steps_final {
                        let tag_ids = self.tags.map(&det.tags);
                        let mask_of = |m: u64| {
                            (0..det.tags.len().min(64))
                                .filter(|&b| m & (1 << b) != 0)
                                .fold(0u64, |acc, b| acc | 1 << tag_ids[b].min(63))
                        };
                        let tags: HashMap<u64, u64> = det
                            .step_tags
                            .iter()
                            .map(|&(s, m)| (s, mask_of(m)))
                            .collect();
                        for &(step, a, z) in &det.steps {
                            let e = self.steps.entry(step).or_insert((i64::MAX, i64::MIN, 0));
                            *e = (
                                e.0.min(a.saturating_add(off)),
                                e.1.max(z.saturating_add(off)),
                                e.2 | tags.get(&step).copied().unwrap_or(0),
                            );
                        }
                    }
                    self.names.map(&det.names);
                    self.details.put((ri, pi), Arc::new(det));
                }
                Err(e) => self.unreadable(ri, pi, &e, t),
            }
        }
    }

    /// Copies names, tags and steps into the timeline.
    fn publish(&self, t: &mut Timeline) {
        if t.phases.len() != self.names.list.len() {
            t.phases.clone_from(&self.names.list);
            let have: HashSet<u16> = t.phase_order.iter().copied().collect();
            t.phase_order
                .extend((0..t.phases.len() as u16).filter(|p| !have.contains(p)));
        }
        if t.tag_names.len() != self.tags.list.len() {
            t.tag_names.clone_from(&self.tags.list);
        }
        if !self.steps_final {
            t.steps = self
                .steps
                .iter()
                .map(|(&step, &(start, end, mask))| StepMark {
                    step,
                    start: start.saturating_sub(self.origin),
                    end: end.saturating_sub(self.origin),
                    tags: (0..64u16).filter(|&b| mask & (1 << b) != 0).collect(),
                })
                .collect();
        }
        t.span_count = t.span_count.max(self.spans_seen as usize);
    }

    /// The timeline's id of tag `name` (added when new).
    pub fn tag_id(&mut self, name: &str, t: &mut Timeline) -> u16 {
        let id = self.tags.id(name) as u16;
        self.publish(t);
        id
    }

    /// The timeline's id of phase `name` (added when new).
    pub fn phase_id(&mut self, name: &str, t: &mut Timeline) -> u16 {
        let id = self.names.id(name) as u16;
        self.publish(t);
        id
    }

    /// The whole run's steps (from the background pass): replace those of the parts read.
    pub fn set_steps(&mut self, t: &mut Timeline, steps: Vec<StepMark>) {
        self.steps_final = true;
        t.steps = steps;
        // Spans appended while the worker read (`--follow`) extend them again.
        for row in self.tail.values() {
            for i in 0..row.len() {
                if row.step[i] != titan_obs_core::NO_STEP {
                    extend_step(&mut t.steps, row.step[i], row.start[i], row.end[i]);
                }
            }
        }
    }

    /// The whole run's steps and span count (from every part's detail file, read off the
    /// UI thread): they replace those of the parts read so far.
    pub fn set_whole_steps(&mut self, t: &mut Timeline, steps: Vec<WholeStep>, spans: u64) {
        let marks = steps
            .into_iter()
            .map(|(step, a, z, tags)| StepMark {
                step,
                start: a.saturating_sub(self.origin),
                end: z.saturating_sub(self.origin),
                tags: tags.iter().map(|n| self.tag_id(n, t)).collect(),
            })
            .collect();
        self.set_steps(t, marks);
        t.span_count = spans as usize;
    }

    /// The whole run's analysis (from the per-part summaries) and each (phase, step)'s
    /// spread across ranks: the phase table, stragglers and the collapsed rows.
    pub fn set_analysis(
        &mut self,
        t: &mut Timeline,
        analysis: Analysis,
        spread: Vec<(String, u64, PhaseSpread)>,
    ) {
        // A collapsed bar starts at its step's start (no start times in the summaries).
        t.phase_step = spread
            .into_iter()
            .map(|(name, step, mut s)| {
                s.median_start = t.step_index(step).map_or(0, |i| t.steps[i].start);
                ((self.phase_id(&name, t), step), s)
            })
            .collect();
        t.analysis = analysis;
        let stragglers: HashSet<(PhaseId, u32)> = t
            .analysis
            .stragglers
            .clone()
            .into_iter()
            .map(|s| (self.phase_id(&s.phase, t), s.rank))
            .collect();
        t.collapsed = collapsed_rows(&t.phase_step, &stragglers, &t.phase_order, 0);
    }

    /// Reads every part's range of rank index `ri` (its detail files).
    fn scan(&mut self, ris: &[usize], t: &mut Timeline) {
        let todo: Vec<(usize, usize)> = ris
            .iter()
            .filter(|&&ri| !self.ranks[ri].scanned)
            .flat_map(|&ri| (0..self.ranks[ri].parts.len()).map(move |pi| (ri, pi)))
            .filter(|&(ri, pi)| self.ranks[ri].parts[pi].range.is_none())
            .collect();
        self.read_details(&todo, t);
        for &ri in ris {
            self.ranks[ri].scanned = true;
        }
    }

    /// Fills the rows of `lanes` (indices into `t.lanes`) for `w` at `ncols` columns and
    /// empties the rows filled before that are not among them. Returns whether lanes or rows
    /// were added (the view must rebuild its row list).
    pub fn fill(&mut self, t: &mut Timeline, w: Window, ncols: usize, lanes: &[usize]) -> bool {
        if self
            .last
            .as_ref()
            .is_some_and(|(lw, lc, ll)| *lw == w && *lc == ncols && ll == lanes)
        {
            return false;
        }
        self.last = Some((w, ncols, lanes.to_vec()));
        for &l in &self.filled {
            if !lanes.contains(&l)
                && let Some(lane) = t.lanes.get_mut(l)
            {
                for r in &mut lane.rows {
                    *r = empty_row(u16::from(r.depth));
                }
            }
        }
        self.filled = lanes.to_vec();
        let rank_ix: HashMap<u32, usize> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| (r.rank, i))
            .collect();
        let mut ris: Vec<usize> = lanes
            .iter()
            .filter_map(|&l| t.lanes.get(l))
            .filter_map(|lane| rank_ix.get(&lane.rank).copied())
            .collect();
        ris.dedup();
        self.scan(&ris, t);
        let (a, z) = (w.t0 + self.origin, w.t1 + self.origin);
        // The finest level whose buckets fit in a cell; None: finer than every level.
        let cell = w.width() / ncols.max(1) as Ns;
        let shift = LEVEL_SHIFTS
            .iter()
            .rev()
            .find(|&&s| (1i64 << s) <= cell)
            .copied();
        // Parts overlapping the window, per visible rank.
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        for &ri in &ris {
            for (pi, p) in self.ranks[ri].parts.iter().enumerate() {
                if p.range.is_some_and(|(pa, pz)| pa < z && pz >= a) {
                    wanted.push((ri, pi));
                }
            }
        }
        self.read_details(&wanted, t);
        let mut reshaped = false;
        let mut tagsets = tagset_ids(t);
        for &l in lanes {
            let Some(lane) = t.lanes.get(l) else { continue };
            let (rank, thread) = (lane.rank, lane.thread as u32);
            let Some(&ri) = rank_ix.get(&rank) else {
                continue;
            };
            let mut rows: BTreeMap<u16, SpanRow> = BTreeMap::new();
            for &(wri, pi) in &wanted {
                if wri != ri {
                    continue;
                }
                let Some(det) = self.details.get((ri, pi)) else {
                    continue;
                };
                let names = self.names.map(&det.names);
                let tag_ids = self.tags.map(&det.tags);
                let off = det.clock_offset_ns;
                let mut raw = None;
                for dr in det.rows.iter().filter(|r| r.thread == thread) {
                    let row = rows.entry(dr.depth).or_insert_with(|| empty_row(dr.depth));
                    let level = shift
                        .filter(|&s| !dr.spans_are_smaller(s))
                        .and_then(|s| dr.level(s));
                    if let Some(level) = level {
                        let width = 1i64 << level.shift;
                        let lo = level.buckets.partition_point(|b| {
                            (b.index << level.shift).saturating_add(width.saturating_add(off)) <= a
                        });
                        for b in &level.buckets[lo..] {
                            let start = (b.index << level.shift).saturating_add(off);
                            if start >= z {
                                break;
                            }
                            let tagset = tagset_of(b.tags, &tag_ids, &mut tagsets, t);
                            let rel = start.saturating_sub(self.origin);
                            push(
                                row,
                                rel,
                                rel.saturating_add(b.covered_ns.clamp(1, width)),
                                names[b.phase as usize] as u16,
                                b.longest_step,
                                tagset,
                                FLAG_DETAIL,
                                None,
                            );
                        }
                        continue;
                    }
                    if raw.is_none() {
                        raw = Some(self.part_spans(ri, pi, t));
                    }
                    let Some(Some(sp)) = &raw else { continue };
                    let Some(sr) = sp
                        .rows
                        .iter()
                        .find(|r| r.thread == thread && r.depth == dr.depth)
                    else {
                        continue;
                    };
                    let sp_tags = self.tags.map(&sp.tags);
                    let sp_names = self.names.map(&sp.names);
                    // Spans of a row do not overlap: ends are sorted too.
                    let lo = first_ending_after(sr, a.saturating_sub(off));
                    for i in lo..sr.start.len() {
                        let start = sr.start[i].saturating_add(off);
                        if start >= z {
                            break;
                        }
                        if start.saturating_add(sr.dur[i]) < a {
                            continue;
                        }
                        let mask = sp.step_tags.get(&sr.step[i]).copied().unwrap_or(0);
                        let tagset = tagset_of(mask, &sp_tags, &mut tagsets, t);
                        push(
                            row,
                            start.saturating_sub(self.origin),
                            start.saturating_sub(self.origin).saturating_add(sr.dur[i]),
                            sp_names[sr.name[i] as usize] as u16,
                            sr.step[i],
                            tagset,
                            0,
                            sr.pipeline[i],
                        );
                    }
                }
            }
            for ((_, _, depth), tr) in self
                .tail
                .range((rank, thread, 0)..=(rank, thread, u16::MAX))
            {
                let row = rows.entry(*depth).or_insert_with(|| empty_row(*depth));
                for i in tr.first_ending_after(w.t0)..tr.len() {
                    if tr.start[i] >= w.t1 {
                        break;
                    }
                    push(
                        row,
                        tr.start[i],
                        tr.end[i],
                        tr.phase[i],
                        tr.step[i],
                        tr.tagset[i],
                        tr.flags[i],
                        tr.slot(i),
                    );
                }
            }
            let lane = &mut t.lanes[l];
            for r in &mut lane.rows {
                *r = rows
                    .remove(&u16::from(r.depth))
                    .unwrap_or_else(|| empty_row(u16::from(r.depth)));
            }
            if !rows.is_empty() {
                // Depths the first and last parts did not have.
                lane.rows.extend(rows.into_values());
                lane.rows.sort_by_key(|r| r.depth);
                reshaped = true;
            }
        }
        self.publish(t);
        reshaped
    }

    /// Appends spans read since the last refresh (`--follow`) to the tail: the run's end,
    /// steps and lanes grow, nothing already read is read or built again. Returns whether
    /// lanes or rows were added.
    pub fn append(&mut self, t: &mut Timeline, new: Appended) -> bool {
        let names = self.names.map(&new.names);
        let tag_ids = self.tags.map(&new.tags);
        let mut tagsets = tagset_ids(t);
        let mut reshaped = false;
        for part in new.ranks {
            let rank = part.rank;
            if let Err(at) = t.ranks.binary_search(&rank) {
                t.ranks.insert(at, rank);
            }
            for r in &part.rows {
                let key = (rank, r.thread, r.depth);
                let row = self.tail.entry(key).or_insert_with(|| empty_row(r.depth));
                for i in 0..r.start.len() {
                    let start = r.start[i].saturating_sub(self.origin);
                    let end = start.saturating_add(r.dur[i]);
                    let mask = part.step_tags.get(&r.step[i]).copied().unwrap_or(0);
                    let tagset = tagset_of(mask, &tag_ids, &mut tagsets, t);
                    push(
                        row,
                        start,
                        end,
                        names[r.name[i] as usize] as u16,
                        r.step[i],
                        tagset,
                        0,
                        r.pipeline[i],
                    );
                    t.end = t.end.max(end);
                    if r.step[i] != titan_obs_core::NO_STEP {
                        extend_step(&mut t.steps, r.step[i], start, end);
                    }
                }
                self.spans_seen += r.start.len() as u64;
                reshaped |= ensure_row(t, rank, r.thread, r.depth);
            }
        }
        if reshaped {
            // Lanes moved: empty every filled row, the next fill fills what is on screen.
            for lane in &mut t.lanes {
                for r in &mut lane.rows {
                    *r = empty_row(u16::from(r.depth));
                }
            }
            self.filled.clear();
        }
        self.last = None;
        self.publish(t);
        reshaped
    }

    /// Every part of the run shown, rank by rank.
    pub fn parts(&self) -> Vec<PartFile> {
        self.ranks
            .iter()
            .flat_map(|r| r.parts.iter().map(|p| p.file.clone()))
            .collect()
    }

    /// The last part index of every rank listed at open (a follower reads only later ones).
    pub fn last_parts(&self) -> BTreeMap<u32, u64> {
        self.ranks
            .iter()
            .filter_map(|r| {
                let last = r.parts.last()?;
                Some((r.rank, last.file.index))
            })
            .collect()
    }

    /// A part that cannot be read: named once, never read again, the run incomplete.
    fn unreadable(&mut self, ri: usize, pi: usize, e: &anyhow::Error, t: &mut Timeline) {
        let part = &mut self.ranks[ri].parts[pi];
        part.unreadable = true;
        let shown = part.file.shown();
        if self.warned.insert(shown.clone()) {
            let why = format!("corrupt part {shown}: {e:#}");
            t.warnings.push(why.replace(&self.obs, ""));
            t.incomplete = true;
        }
    }

    /// The decoded spans of a part (cached); `None` when it cannot be read (named once).
    fn part_spans(&mut self, ri: usize, pi: usize, t: &mut Timeline) -> Option<Arc<PartSpans>> {
        if let Some(s) = self.spans.get((ri, pi)) {
            return Some(s);
        }
        match PartSpans::read(&self.ranks[ri].parts[pi].file) {
            Ok(s) => {
                let s = Arc::new(s);
                self.spans.put((ri, pi), s.clone());
                Some(s)
            }
            Err(e) => {
                self.unreadable(ri, pi, &e, t);
                None
            }
        }
    }
}

/// A row at `depth` holding nothing (depths past 255 share the last row).
fn empty_row(depth: u16) -> SpanRow {
    SpanRow {
        depth: depth.min(u16::from(u8::MAX)) as u8,
        ..SpanRow::default()
    }
}

/// Extends step `step`'s mark to cover `start..end` (adds it when new).
fn extend_step(steps: &mut Vec<StepMark>, step: u64, start: Ns, end: Ns) {
    match steps.binary_search_by_key(&step, |s| s.step) {
        Ok(i) => {
            let s = &mut steps[i];
            s.start = s.start.min(start);
            s.end = s.end.max(end);
        }
        Err(i) => steps.insert(
            i,
            StepMark {
                step,
                start,
                end,
                tags: Vec::new(),
            },
        ),
    }
}

/// Adds the lane of (rank, thread) and its row at `depth` when missing; true when added.
fn ensure_row(t: &mut Timeline, rank: u32, thread: u32, depth: u16) -> bool {
    let depth = depth.min(u16::from(u8::MAX)) as u8;
    let at = t
        .lanes
        .partition_point(|l| (l.rank, l.thread) < (rank, u64::from(thread)));
    let lane_there = t
        .lanes
        .get(at)
        .is_some_and(|l| (l.rank, l.thread) == (rank, u64::from(thread)));
    if !lane_there {
        let thread_ix = t.lanes[..at].iter().filter(|l| l.rank == rank).count() as u32;
        t.lanes.insert(
            at,
            Lane {
                rank,
                thread: u64::from(thread),
                thread_ix,
                rows: Vec::new(),
            },
        );
    }
    let lane = &mut t.lanes[at];
    if lane.rows.iter().any(|r| r.depth == depth) {
        return !lane_there;
    }
    let pos = lane.rows.partition_point(|r| r.depth < depth);
    lane.rows.insert(pos, empty_row(u16::from(depth)));
    true
}

/// Index of the first span of `r` that ends after `t`.
fn first_ending_after(r: &lod::SpanRows, t: i64) -> usize {
    let (mut lo, mut hi) = (0, r.start.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        if r.start[mid].saturating_add(r.dur[mid]) <= t {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The timeline's tag sets by their tags, for [`tagset_of`].
fn tagset_ids(t: &Timeline) -> HashMap<Vec<u16>, u16> {
    t.tagsets
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), i as u16))
        .collect()
}

/// The timeline's tag set id of a mask over a part's tags (`ids`: their run-wide ids).
fn tagset_of(
    mask: u64,
    ids: &[u32],
    tagsets: &mut HashMap<Vec<u16>, u16>,
    t: &mut Timeline,
) -> u16 {
    if mask == 0 {
        return 0;
    }
    let mut set: Vec<u16> = (0..ids.len().min(64))
        .filter(|&b| mask & (1 << b) != 0)
        .map(|b| ids[b] as u16)
        .collect();
    set.sort_unstable();
    *tagsets.entry(set.clone()).or_insert_with(|| {
        t.tagsets.push(set);
        (t.tagsets.len() - 1) as u16
    })
}

/// Appends an entry to a row, keeping starts and ends sorted: an entry overlapping the last
/// one (a bucket split across two parts, clocks adjusted) starts where that one ends.
#[allow(clippy::too_many_arguments)]
fn push(
    row: &mut SpanRow,
    start: Ns,
    end: Ns,
    phase: u16,
    step: u64,
    tagset: u16,
    flags: u8,
    slot: Option<titan_obs_core::PipelineSlot>,
) {
    let start = row.end.last().map_or(start, |&e| start.max(e));
    if end > start {
        row.push(start, end, phase, step, tagset, flags, slot);
    }
}
