//! The span columns every analysis reads: borrowed from a loaded [`Run`] by `titan-obs
//! summary`, or from the TUI's timeline, so both go through the same functions.

use std::collections::BTreeMap;

use crate::run::Run;
use crate::tables::NameId;

/// Columns of one span table (row i of every column is span i). `start_ns` and `depth`
/// may be empty when the source does not have them.
#[derive(Debug, Clone, Copy)]
pub struct SpanTable<'a> {
    pub rank: &'a [u32],
    /// [`crate::NO_STEP`] outside steps.
    pub step: &'a [u64],
    pub name: &'a [NameId],
    pub dur_ns: &'a [i64],
    /// On rank 0's clock (the reader adds each rank's clock offset).
    pub start_ns: &'a [i64],
    pub depth: &'a [u16],
    /// Process-local thread id; may be empty (then every span is taken for the rank's main
    /// thread).
    pub thread: &'a [u32],
    /// `names[name[i]]` is span i's phase.
    pub names: &'a [String],
}

impl<'a> SpanTable<'a> {
    /// The spans of a loaded run.
    pub fn of_run(run: &'a Run) -> Self {
        let s = &run.spans;
        SpanTable {
            rank: &s.rank,
            step: &s.step,
            name: &s.name,
            dur_ns: &s.dur_ns,
            start_ns: &s.start_ns,
            depth: &s.depth,
            thread: &s.thread,
            names: &run.names,
        }
    }

    pub fn len(&self) -> usize {
        self.rank.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rank.is_empty()
    }

    pub fn has_start(&self) -> bool {
        self.start_ns.len() == self.len()
    }

    pub fn has_depth(&self) -> bool {
        self.depth.len() == self.len()
    }

    pub fn has_thread(&self) -> bool {
        self.thread.len() == self.len()
    }

    pub fn name_id(&self, name: &str) -> Option<NameId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| i as NameId)
    }
}

/// Span columns owned by whoever builds them (the TUI's timeline, tests) rather than
/// borrowed from a loaded run; [`Self::table`] lends them as a [`SpanTable`].
#[derive(Debug, Clone, Default)]
pub struct OwnedSpans {
    pub rank: Vec<u32>,
    pub step: Vec<u64>,
    pub name: Vec<NameId>,
    pub dur_ns: Vec<i64>,
    pub start_ns: Vec<i64>,
    pub depth: Vec<u16>,
    /// Left empty by [`Self::push`]; [`Self::push_on`] fills it.
    pub thread: Vec<u32>,
}

impl OwnedSpans {
    /// Room for `n` spans.
    pub fn with_capacity(n: usize) -> Self {
        OwnedSpans {
            rank: Vec::with_capacity(n),
            step: Vec::with_capacity(n),
            name: Vec::with_capacity(n),
            dur_ns: Vec::with_capacity(n),
            start_ns: Vec::with_capacity(n),
            depth: Vec::with_capacity(n),
            thread: Vec::with_capacity(n),
        }
    }

    /// Appends one span.
    pub fn push(
        &mut self,
        rank: u32,
        step: u64,
        name: NameId,
        start_ns: i64,
        dur_ns: i64,
        depth: u16,
    ) {
        self.rank.push(rank);
        self.step.push(step);
        self.name.push(name);
        self.start_ns.push(start_ns);
        self.dur_ns.push(dur_ns);
        self.depth.push(depth);
    }

    /// Appends one span recorded on `thread` (use it for every span or for none).
    #[allow(clippy::too_many_arguments)]
    pub fn push_on(
        &mut self,
        rank: u32,
        thread: u32,
        step: u64,
        name: NameId,
        start_ns: i64,
        dur_ns: i64,
        depth: u16,
    ) {
        self.push(rank, step, name, start_ns, dur_ns, depth);
        self.thread.push(thread);
    }

    /// The columns as a table whose phases are `names`.
    pub fn table<'a>(&'a self, names: &'a [String]) -> SpanTable<'a> {
        SpanTable {
            rank: &self.rank,
            step: &self.step,
            name: &self.name,
            dur_ns: &self.dur_ns,
            start_ns: &self.start_ns,
            depth: &self.depth,
            thread: &self.thread,
            names,
        }
    }
}

/// Everything besides the spans the analysis needs: the ranks of the run (including ranks
/// that recorded no span) and each tagged step's tags.
#[derive(Debug, Clone, Default)]
pub struct RunShape {
    /// Sorted, distinct.
    pub ranks: Vec<u32>,
    pub step_tags: BTreeMap<u64, Vec<String>>,
}

impl RunShape {
    /// The ranks (from the footers, else from the spans) and step tags of a loaded run;
    /// a step's tags are the union over ranks, in the run's tag order.
    pub fn of_run(run: &Run) -> Self {
        let mut ranks: Vec<u32> = run.ranks.keys().copied().collect();
        if ranks.is_empty() {
            ranks = run.spans.rank.clone();
            ranks.sort_unstable();
            ranks.dedup();
        }
        let mut masks: BTreeMap<u64, u64> = BTreeMap::new();
        for (&(_, step), tags) in &run.step_tags {
            *masks.entry(step).or_default() |= tags.0;
        }
        let step_tags = masks
            .into_iter()
            .filter(|(_, m)| *m != 0)
            .map(|(step, mask)| {
                let tags = (0..run.tags.len().min(64))
                    .filter(|&i| mask & (1 << i) != 0)
                    .map(|i| run.tags[i].clone())
                    .collect();
                (step, tags)
            })
            .collect();
        RunShape { ranks, step_tags }
    }
}
