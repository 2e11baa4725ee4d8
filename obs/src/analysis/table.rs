//! The span columns every analysis reads: borrowed from a loaded [`Run`] by `titan-obs
//! summary`, or from the TUI's timeline, so both go through the same functions.

use std::collections::BTreeMap;

use crate::run::{NameId, Run};

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

    pub fn name_id(&self, name: &str) -> Option<NameId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| i as NameId)
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
