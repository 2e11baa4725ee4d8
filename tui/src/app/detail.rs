//! The gantt of a large local titan run, drawn from its detail levels (`part-<N>.lod`, see
//! [`titan_obs_core::lod`]) instead of from every span.
//!
//! Opening reads a local run's node timelines (`obs/node-<host>.timeline`: each rank's parts'
//! time ranges and lanes, each step's bounds), and the first and last part's detail file of
//! every rank they do not describe (the run's extent and its lanes); everything else is read
//! for what is on screen: [`DetailRun::fill`] fills the rows
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
use titan_obs_core::digest::timeline;
use titan_obs_core::location::{self, Location};
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

/// One part of a rank: its index and, once read (or from its node's timeline), its time
/// range on rank 0's clock.
struct PartRef {
    index: u64,
    range: Option<(i64, i64)>,
    /// Could not be read at all (named in the warnings once).
    unreadable: bool,
}

struct RankParts {
    rank: u32,
    parts: Vec<PartRef>,
    /// Where its parts are: listed (one file per part), or its folder of the run's location
    /// holding `part-<N>.parquet` for each part (a rank its node's timeline describes: no
    /// path is held per part, a day of 16 384 ranks is 2.4 M parts).
    files: RankFiles,
    /// Every part's range is known.
    scanned: bool,
}

enum RankFiles {
    Listed(Vec<PartFile>),
    /// The rank's folder of the run at this location.
    Described(Location),
}

impl RankParts {
    fn listed(rank: u32, files: Vec<PartFile>) -> RankParts {
        RankParts {
            rank,
            parts: files
                .iter()
                .map(|f| PartRef {
                    index: f.index,
                    range: None,
                    unreadable: false,
                })
                .collect(),
            files: RankFiles::Listed(files),
            scanned: false,
        }
    }

    /// Part `pi`'s file.
    fn file(&self, pi: usize) -> PartFile {
        match &self.files {
            RankFiles::Listed(f) => f[pi].clone(),
            RankFiles::Described(Location::Object { store, base, url }) => {
                PartFile::stored(store.clone(), base, url, self.rank, self.parts[pi].index)
            }
            RankFiles::Described(Location::Local(run)) => PartFile::local(
                location::rank_dir(run, self.rank)
                    .join(location::part_file_name(self.parts[pi].index)),
                self.rank,
            ),
        }
    }
}

/// What opening gives: the ranks, listed or from the node timelines ([`from_timelines`]).
struct Opened {
    ranks: Vec<RankParts>,
    run_id: Option<String>,
    /// (rank, thread) -> depths of the ranks they describe.
    lanes: BTreeMap<(u32, u32), BTreeSet<u16>>,
    /// The steps' bounds over the ranks described, with their tags.
    steps: Vec<(u64, i64, i64, Vec<String>)>,
    /// Every rank is described: those steps are the whole run's.
    steps_complete: bool,
    spans: u64,
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

/// Whether a titan run's parts (local or in an object store) hold at least `bytes`: large
/// enough to be drawn from its detail levels; false when they cannot be listed.
pub fn run_holds(run: &str, bytes: u64) -> bool {
    Location::parse(run).is_ok_and(|l| part_files::hold_at_least(&l, bytes).unwrap_or(false))
}

impl DetailRun {
    /// Opens the run's parts (local or in an object store; those of run `run_id`, else of
    /// the newest run): the run's extent, each rank's rows and (from node timelines) its
    /// steps. A local run's ranks come from its node timelines ([`from_timelines`]); the
    /// other ranks are listed and their first and last part's detail files read (in
    /// parallel).
    pub fn open(run: &str, title: &str, run_id: Option<&str>) -> Result<(DetailRun, Timeline)> {
        let location = Location::parse(run)?;
        let opened = match from_timelines(run, &location, run_id)? {
            Some(o) => o,
            None => {
                let mut listed = part_files::list(&location)?;
                let run_id = part_files::keep_run(run, &mut listed, run_id)?;
                Opened {
                    ranks: (listed.into_iter())
                        .map(|(rank, files)| RankParts::listed(rank, files))
                        .collect(),
                    run_id,
                    lanes: BTreeMap::new(),
                    steps: Vec::new(),
                    steps_complete: false,
                    spans: 0,
                }
            }
        };
        let mut rows = opened.lanes;
        let obs = match &location {
            Location::Local(p) => format!("{}/", p.join("obs").display()),
            Location::Object { url, .. } => format!("{url}/obs/"),
        };
        let mut d = DetailRun {
            obs,
            run_id: opened.run_id,
            ranks: opened.ranks,
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
            spans_seen: opened.spans,
            last: None,
            tail: BTreeMap::new(),
        };
        // The first and last part of each rank no timeline describes.
        let ends: Vec<(usize, usize)> = d
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.scanned)
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
        // The steps of the ranks the timelines describe.
        for (step, a, z, tags) in opened.steps {
            let mask = (tags.iter().map(|n| d.tags.id(n)))
                .filter(|&id| id < 64)
                .fold(0u64, |m, id| m | 1 << id);
            d.steps.insert(step, (a, z, mask));
        }
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
        // Lanes: those the timelines give, and the threads and depths of the parts read.
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
        // With every rank described, those are the whole run's steps: parts read later add
        // nothing.
        d.steps_final = opened.steps_complete;
        Ok((d, t))
    }

    /// Reads the detail files of `parts` (rank index, part index) not yet cached, in
    /// parallel; records their ranges, steps and names.
    fn read_details(&mut self, parts: &[(usize, usize)], t: &mut Timeline) {
        let wanted: Vec<(usize, usize, PartFile)> = parts
            .iter()
            .filter(|&&k| !self.details.map.contains_key(&k))
            .filter(|&&(ri, pi)| !self.ranks[ri].parts[pi].unreadable)
            .map(|&(ri, pi)| (ri, pi, self.ranks[ri].file(pi)))
            .collect();
        let opened: Vec<_> = wanted
            .into_par_iter()
            .map(|(ri, pi, file)| (ri, pi, lod::open(&file), file.beside_shown("lod")))
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
        t.analysis = analysis;
        self.set_spread(t, spread);
    }

    /// Each (phase, step)'s spread across ranks: the collapsed rows (with the analysis'
    /// stragglers marked).
    pub fn set_spread(&mut self, t: &mut Timeline, spread: Vec<(String, u64, PhaseSpread)>) {
        // A collapsed bar starts at its step's start (no start times in the summaries).
        t.phase_step = spread
            .into_iter()
            .map(|(name, step, mut s)| {
                s.median_start = t.step_index(step).map_or(0, |i| t.steps[i].start);
                ((self.phase_id(&name, t), step), s)
            })
            .collect();
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

    /// Every part of the run shown, rank by rank; `None` when the whole run's steps are
    /// known already (from the node timelines): the worker has no part to read then.
    pub fn parts_for_steps(&self) -> Option<Vec<PartFile>> {
        (!self.steps_final).then(|| {
            self.ranks
                .iter()
                .flat_map(|r| (0..r.parts.len()).map(|pi| r.file(pi)))
                .collect()
        })
    }

    /// The last part index of every rank listed at open (a follower reads only later ones).
    pub fn last_parts(&self) -> BTreeMap<u32, u64> {
        self.ranks
            .iter()
            .filter_map(|r| Some((r.rank, r.parts.last()?.index)))
            .collect()
    }

    /// A part that cannot be read: named once, never read again, the run incomplete.
    fn unreadable(&mut self, ri: usize, pi: usize, e: &anyhow::Error, t: &mut Timeline) {
        let shown = self.ranks[ri].file(pi).shown();
        self.ranks[ri].parts[pi].unreadable = true;
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
        match PartSpans::read(&self.ranks[ri].file(pi)) {
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

/// The run's ranks from its node timelines (`obs/node-<host>.timeline`, [`timeline::read`]):
/// each rank a timeline describes as its folder is comes with its parts' ranges and its
/// lanes, without its folder listed or a part read; the other rank folders are
/// listed and keep only parts of the run shown. `None` — the run is listed and read as
/// before — when there is no timeline, when the ranks described are of several runs or not
/// of `run_id`, or when the newest run cannot be told without reading parts (the lowest
/// rank is not described).
fn from_timelines(run: &str, location: &Location, run_id: Option<&str>) -> Result<Option<Opened>> {
    let Ok(timeline::JobTimeline {
        timeline: node_timeline,
        ranks: folders,
        damaged,
    }) = timeline::read(location)
    else {
        return Ok(None);
    };
    if node_timeline.ranks.is_empty() {
        return Ok(None);
    }
    for why in &damaged {
        tracing::warn!("{why}: its ranks' folders are read instead");
    }
    let entries: HashMap<u32, &timeline::RankTimeline> =
        node_timeline.ranks.iter().map(|r| (r.rank, r)).collect();
    let mut ids = (folders.iter())
        .filter(|(_, t)| *t)
        .map(|(rank, _)| entries[rank].run_id.as_str());
    let Some(id) = ids.next() else {
        return Ok(None);
    };
    if ids.any(|i| i != id) || run_id.is_some_and(|want| want != id) {
        return Ok(None);
    }
    if run_id.is_none() && !folders.first().is_some_and(|f| f.1) {
        // The newest run is the lowest rank's last part's: not described here.
        return Ok(None);
    }
    // Folders no timeline describes: listed, and only parts of this run kept.
    let untrusted: Vec<u32> = (folders.iter())
        .filter(|(_, t)| !*t)
        .map(|(r, _)| *r)
        .collect();
    let mut listed: BTreeMap<u32, Vec<PartFile>> = match location {
        Location::Local(p) => untrusted
            .par_iter()
            .map(|&rank| {
                let dir = location::rank_dir(p, rank);
                Ok((rank, part_files::list_local_rank(&dir, rank)?))
            })
            .collect::<Result<_>>()?,
        Location::Object { url, store, base } => {
            part_files::list_object_ranks(store, base, url, &untrusted)?
        }
    };
    if !listed.is_empty() && part_files::keep_run(run, &mut listed, Some(id)).is_err() {
        listed.clear();
    }
    listed.retain(|_, parts| !parts.is_empty());
    let mut lanes: BTreeMap<(u32, u32), BTreeSet<u16>> = BTreeMap::new();
    let mut spans = 0u64;
    let mut ranks = Vec::with_capacity(folders.len());
    for (rank, ok) in &folders {
        if !ok {
            if let Some(files) = listed.remove(rank) {
                ranks.push(RankParts::listed(*rank, files));
            }
            continue;
        }
        let e = entries[rank];
        spans = spans.saturating_add(e.spans);
        for &(thread, depth) in &e.lanes {
            lanes.entry((*rank, thread)).or_default().insert(depth);
        }
        ranks.push(RankParts {
            rank: *rank,
            parts: (e.parts.iter())
                .map(|p| PartRef {
                    index: p.index,
                    range: Some((p.start_ns, p.end_ns)),
                    unreadable: false,
                })
                .collect(),
            files: RankFiles::Described(location.clone()),
            scanned: true,
        });
    }
    let tags = &node_timeline.tags;
    let steps = (node_timeline.steps.iter())
        .map(|(&step, &(a, z, mask))| {
            let names = (0..tags.len().min(64))
                .filter(|&b| mask & (1 << b) != 0)
                .map(|b| tags[b].clone())
                .collect();
            (step, a, z, names)
        })
        .collect();
    Ok(Some(Opened {
        steps_complete: ranks.iter().all(|r| r.scanned),
        ranks,
        run_id: Some(id.to_string()),
        lanes,
        steps,
        spans,
    }))
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

#[cfg(test)]
mod tests {
    use super::*;
    use titan_obs_core::synth::{SynthConfig, write_run};

    /// What a gantt drawn from detail levels shows, names for ids: the ranks, each lane's
    /// (rank, thread, depths), the extent, the steps with their tags, the span count, and
    /// every lane's entries for `windows` (each the whole run's share `(from, to)` of it).
    type Drawn = (
        Vec<u32>,
        [Vec<(u32, u64, Vec<u8>)>; 2],
        (i64, i64),
        Vec<(u64, i64, i64, Vec<String>)>,
        usize,
        Vec<Vec<(i64, i64, String, u64)>>,
    );

    fn drawn(run: &str) -> (DetailRun, Drawn) {
        let (mut d, mut t) = DetailRun::open(run, "t", None).unwrap();
        let lanes_of = |t: &Timeline| -> Vec<(u32, u64, Vec<u8>)> {
            (t.lanes.iter())
                .map(|l| (l.rank, l.thread, l.rows.iter().map(|r| r.depth).collect()))
                .collect()
        };
        let at_open = lanes_of(&t);
        let lanes: Vec<usize> = (0..t.lanes.len()).collect();
        let mut rows = Vec::new();
        for (from, to) in [(0.0, 1.0), (0.4, 0.41)] {
            let w = Window {
                t0: (t.end as f64 * from) as i64,
                t1: (t.end as f64 * to) as i64,
            };
            d.fill(&mut t, w, 200, &lanes);
            for lane in &t.lanes {
                for r in &lane.rows {
                    rows.push(
                        (0..r.len())
                            .map(|i| {
                                (
                                    r.start[i],
                                    r.end[i],
                                    t.phases[r.phase[i] as usize].clone(),
                                    r.step[i],
                                )
                            })
                            .collect(),
                    );
                }
            }
        }
        let lanes = [at_open, lanes_of(&t)];
        let steps = t
            .steps
            .iter()
            .map(|s| {
                let mut tags: Vec<String> = s
                    .tags
                    .iter()
                    .map(|&i| t.tag_names[i as usize].clone())
                    .collect();
                tags.sort();
                (s.step, s.start, s.end, tags)
            })
            .collect();
        let shown = (
            t.ranks.clone(),
            lanes,
            (t.origin_ns, t.end),
            steps,
            t.span_count,
            rows,
        );
        (d, shown)
    }

    /// Which ranks were drawn from their node's timeline (no part listed or read at open).
    fn described(d: &DetailRun) -> Vec<u32> {
        (d.ranks.iter())
            .filter(|r| matches!(r.files, RankFiles::Described(_)))
            .map(|r| r.rank)
            .collect()
    }

    /// Issue 42: a run opened from its node timelines draws what the run listed and its
    /// parts read draw (the same lanes, extent, steps, spans and entries), a rank whose
    /// folder changed since is listed, and a damaged timeline is read from the folders.
    #[test]
    fn timelines_open_the_gantt_the_parts_draw() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let cfg = SynthConfig {
            ranks: 12,
            steps: 120,
            steps_per_part: 40,
            ..SynthConfig::default()
        };
        write_run(run.to_str().unwrap(), &cfg).unwrap();
        let run_s = run.to_str().unwrap();
        let obs = run.join("obs");
        let (d, from_timelines) = drawn(run_s);
        assert_eq!(described(&d), (0..12).collect::<Vec<_>>());
        assert!(
            d.parts_for_steps().is_none(),
            "the steps are the timelines'"
        );
        assert!(
            from_timelines.3.iter().any(|s| !s.3.is_empty()),
            "tagged steps"
        );

        // A live rank (its next journal open, kept from here on) is still described.
        std::fs::write(obs.join("rank-3/journal-000003.arrows"), "").unwrap();
        let (d, _) = drawn(run_s);
        assert_eq!(described(&d), (0..12).collect::<Vec<_>>());

        // Rank 5 is in no timeline (its node's file written before it joined): it is
        // listed, the others are not, and the gantt is the same.
        let path = obs.join("node-node-0.timeline");
        let mut t = timeline::decode(&std::fs::read(&path).unwrap()).unwrap();
        t.ranks.retain(|r| r.rank != 5);
        std::fs::write(&path, timeline::encode(&t)).unwrap();
        let (d, drawn_then) = drawn(run_s);
        let mut want: Vec<u32> = (0..12).collect();
        want.retain(|&r| r != 5);
        assert_eq!(described(&d), want);
        assert!(d.parts_for_steps().is_some());
        assert_eq!(drawn_then, from_timelines);

        // A part after the last one rank 6's entry records, or rank 7's folder changed
        // otherwise since (a file added): their folders are listed.
        std::fs::write(obs.join("rank-6/part-000003.parquet"), "").unwrap();
        std::fs::write(obs.join("rank-7/notes.txt"), "").unwrap();
        let (d, _) = drawn(run_s);
        assert_eq!(described(&d), [0, 1, 2, 3, 4, 8, 9, 10, 11]);
        // Removed again, rank 6's folder still differs from its entry: listed from here on.
        std::fs::remove_file(obs.join("rank-6/part-000003.parquet")).unwrap();

        // A damaged timeline: its node's ranks are listed.
        let path = obs.join("node-node-1.timeline");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let (d, drawn_then) = drawn(run_s);
        assert_eq!(described(&d), [0, 1, 2, 3, 4]);
        assert_eq!(drawn_then, from_timelines);

        // No timeline at all: every rank listed and its ends read, the same gantt.
        for e in std::fs::read_dir(&obs).unwrap().flatten() {
            if e.file_name().to_string_lossy().ends_with(".timeline") {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        let (d, listed) = drawn(run_s);
        assert!(described(&d).is_empty());
        assert_eq!(listed, from_timelines);
    }

    /// Issue 42 on object stores: the node timelines the writers publish open the gantt
    /// without a rank folder listed (a HEAD a rank instead), drawing what the same run
    /// written to a local folder draws; a rank with a part after its entry's last is listed;
    /// without timelines every rank is listed, the same gantt.
    #[test]
    fn stored_timelines_open_the_gantt_the_parts_draw() {
        use object_store::ObjectStoreExt as _;
        let dir = tempfile::tempdir().unwrap();
        let cfg = SynthConfig {
            ranks: 12,
            steps: 120,
            steps_per_part: 40,
            ..SynthConfig::default()
        };
        let local = dir.path().join("run");
        write_run(local.to_str().unwrap(), &cfg).unwrap();
        let url = "memory://detail-stored-timelines/run";
        let spool = dir.path().join("spool");
        titan_obs_core::synth::write_run_spooled(url, &cfg, Some(&spool)).unwrap();
        let stored = |d: &DetailRun| -> Vec<u32> {
            (d.ranks.iter())
                .filter(|r| matches!(r.files, RankFiles::Described(_)))
                .map(|r| r.rank)
                .collect()
        };
        let (d, from_timelines) = drawn(url);
        assert_eq!(stored(&d), (0..12).collect::<Vec<_>>());
        assert!(
            d.parts_for_steps().is_none(),
            "the steps are the timelines'"
        );
        let (_, drawn_locally) = drawn(local.to_str().unwrap());
        assert_eq!(from_timelines, drawn_locally);

        let Location::Object { store, base, .. } = Location::parse(url).unwrap() else {
            unreachable!()
        };
        let rt = titan_storage::runtime();
        let obs = base.clone().join("obs");
        // Rank 6's folder holds a part after its entry's last (a writer that died before
        // publishing): listed; the others are not.
        let extra = obs.clone().join("rank-6").join("part-000003.parquet");
        let part0 = obs.clone().join("rank-6").join("part-000000.parquet");
        let bytes = rt
            .block_on(async { store.get(&part0).await?.bytes().await })
            .unwrap();
        rt.block_on(store.put(&extra, bytes.into())).unwrap();
        let (d, _) = drawn(url);
        let mut want: Vec<u32> = (0..12).collect();
        want.retain(|&r| r != 6);
        assert_eq!(stored(&d), want);
        rt.block_on(store.delete(&extra)).unwrap();

        // No timeline on the store: every rank listed and its ends read, the same gantt.
        for node in 0..2 {
            let t = obs.clone().join(format!("node-node-{node}.timeline"));
            rt.block_on(store.delete(&t)).unwrap();
        }
        let (d, listed) = drawn(url);
        assert!(stored(&d).is_empty());
        assert_eq!(listed, from_timelines);
    }
}
