//! A later part's digest added to the digest of a rank's earlier parts (the same run id and
//! clock offset): what the rank's summary file holds (see [`super::rank`]). Merging the
//! result into a [`super::RunDigest`] gives what merging the parts one by one gives: sums,
//! counts, minima and maxima the same, sketches merged, per step lists combined by step, and
//! a collective without a phase before it in its own part takes the earlier parts' (as
//! [`super::RunDigest::merge`] does from the previous part).

use std::collections::HashMap;

use super::{PartDigest, PipelineDigest};
use crate::tables::NameId;

/// The latest steps whose last-ended span is kept for the next part (as the run merge does).
const LAST_ENDED_STEPS: usize = 64;

impl PartDigest {
    /// Adds `o`, a later part of this digest's rank and segment. Its damage is not added:
    /// the rank's summary file keeps each part's damage with the part.
    pub(crate) fn absorb(&mut self, o: &PartDigest) {
        let names = intern_all(&mut self.names, &o.names);
        let g = |n: NameId| names.get(n as usize).copied().unwrap_or(0);
        let tag_bits = self.tag_bits(&o.tags);

        self.info.threads.extend(o.info.threads.clone());
        self.info.world_size = self.info.world_size.max(o.info.world_size);
        self.info.parts = self.info.parts.saturating_add(o.info.parts);
        // Counts decoded from summary files: saturating, as a damaged one may hold anything.
        self.rows = self.rows.saturating_add(o.rows);
        self.spans = self.spans.saturating_add(o.spans);
        self.errors = self.errors.saturating_add(o.errors);
        self.pipeline_spans = self.pipeline_spans.saturating_add(o.pipeline_spans);

        for (n, p) in &o.phases {
            let id = g(*n);
            match self.phases.iter_mut().find(|(i, _)| *i == id) {
                Some((_, mine)) => mine.merge(p),
                None => self.phases.push((id, p.clone())),
            }
        }
        self.phases.sort_unstable_by_key(|(id, _)| *id);

        let mut cells: Vec<(u64, NameId, i64)> =
            o.cells.iter().map(|&(s, n, v)| (s, g(n), v)).collect();
        cells.sort_unstable_by_key(|&(s, n, _)| (s, n));
        merge_sorted(
            &mut self.cells,
            cells,
            |c| (c.0, c.1),
            |a, b| a.2 = a.2.saturating_add(b.2),
        );
        merge_sorted(
            &mut self.walls,
            o.walls.clone(),
            |w| w.0,
            |a, b| a.1 = a.1.saturating_add(b.1),
        );
        let masks = o
            .step_tags
            .iter()
            .map(|&(s, m)| (s, remap_mask(m, &tag_bits)));
        merge_sorted(
            &mut self.step_tags,
            masks.collect(),
            |t| t.0,
            |a, b| a.1 |= b.1,
        );
        self.tag_spans
            .extend(o.tag_spans.iter().map(|&(s, n, a, e)| (s, g(n), a, e)));
        let room = super::NAMED_ERRORS.saturating_sub(self.named_errors.len());
        self.named_errors.extend(
            o.named_errors
                .iter()
                .take(room)
                .map(|(s, n, m)| (*s, g(*n), m.clone())),
        );

        for c in &o.collectives {
            let mut c = c.clone();
            c.name = g(c.name);
            c.before = match c.before {
                Some((end, depth, n)) => Some((end, depth, g(n))),
                // Where the run merge would look: the earlier parts' last-ended span of the step.
                None => self
                    .last_ended
                    .iter()
                    .find(|&&(s, end, _, _)| s == c.step && end <= c.start_ns)
                    .map(|&(_, end, depth, n)| (end, depth, n)),
            };
            for n in &mut c.containers {
                *n = g(*n);
            }
            self.collectives.push(c);
        }
        let mut ended: Vec<_> = o
            .last_ended
            .iter()
            .map(|&(s, e, d, n)| (s, e, d, g(n)))
            .collect();
        ended.sort_unstable_by_key(|e| e.0);
        self.last_ended.sort_unstable_by_key(|e| e.0);
        merge_sorted(
            &mut self.last_ended,
            ended,
            |e| e.0,
            |a, b| {
                if (b.1, std::cmp::Reverse(b.2)) > (a.1, std::cmp::Reverse(a.2)) {
                    *a = *b;
                }
            },
        );
        let extra = self.last_ended.len().saturating_sub(LAST_ENDED_STEPS);
        self.last_ended.drain(..extra);

        if let Some(p) = &o.pipeline {
            absorb_pipeline(self.pipeline.get_or_insert_with(Default::default), p);
        }

        // Scalars keep first-recorded order; only keys at or after the part's first step
        // can already be here (parts come in time order), so only those are looked up.
        let first = o.scalars.iter().map(|s| s.0).min().unwrap_or(u64::MAX);
        let mut at: HashMap<(u64, NameId, crate::schema::Reduce), usize> = self
            .scalars
            .iter()
            .enumerate()
            .filter(|(_, s)| s.0 >= first)
            .map(|(i, s)| ((s.0, s.1, s.2), i))
            .collect();
        for &(step, n, reduce, acc) in &o.scalars {
            let key = (step, g(n), reduce);
            match at.get(&key) {
                Some(&i) => self.scalars[i].3.merge(&acc),
                None => {
                    at.insert(key, self.scalars.len());
                    self.scalars.push((key.0, key.1, key.2, acc));
                }
            }
        }
    }

    /// For each of `tags`, its bit in this digest's masks (added to the tag list when new;
    /// `None` past the 64 a mask holds, as the run merge drops those too).
    fn tag_bits(&mut self, tags: &[String]) -> Vec<Option<u32>> {
        tags.iter()
            .map(|t| {
                let i = match self.tags.iter().position(|x| x == t) {
                    Some(i) => i,
                    None => {
                        self.tags.push(t.clone());
                        self.tags.len() - 1
                    }
                };
                (i < 64).then_some(i as u32)
            })
            .collect()
    }
}

/// The ids in `names` of each of `new` (added when absent).
fn intern_all(names: &mut Vec<String>, new: &[String]) -> Vec<NameId> {
    let mut ids: HashMap<String, NameId> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), i as NameId))
        .collect();
    new.iter()
        .map(|n| {
            *ids.entry(n.clone()).or_insert_with(|| {
                names.push(n.clone());
                (names.len() - 1) as NameId
            })
        })
        .collect()
}

fn remap_mask(mask: u64, bits: &[Option<u32>]) -> u64 {
    let mut out = 0u64;
    for (local, bit) in bits.iter().enumerate().take(64) {
        if let Some(b) = bit
            && mask & (1 << local) != 0
        {
            out |= 1 << b;
        }
    }
    out
}

fn absorb_pipeline(mine: &mut PipelineDigest, o: &PipelineDigest) {
    mine.stages.extend(o.stages.iter().copied());
    mine.stages.sort_unstable();
    mine.stages.dedup();
    mine.microbatches = mine.microbatches.max(o.microbatches);
    mine.forward.merge(&o.forward);
    mine.backward.merge(&o.backward);
    let mut steps = o.steps.clone();
    steps.sort_unstable_by_key(|s| s.step);
    mine.steps.sort_unstable_by_key(|s| s.step);
    merge_sorted(
        &mut mine.steps,
        steps,
        |s| s.step,
        |a, b| {
            a.window = a.window.saturating_add(b.window);
            a.profiler_step = a.profiler_step.saturating_add(b.profiler_step);
            a.busy = a.busy.saturating_add(b.busy);
            a.recv = a.recv.saturating_add(b.recv);
        },
    );
}

/// Merges `src` (sorted by `key`) into `dst` (sorted by `key`), combining entries of equal
/// keys with `combine`. Parts come in time order, so `src` overlaps only the end of `dst`:
/// only that tail is merged (a part costs its own size, not the rank's).
fn merge_sorted<T, K: Ord>(
    dst: &mut Vec<T>,
    src: Vec<T>,
    key: impl Fn(&T) -> K,
    combine: impl Fn(&mut T, &T),
) {
    let Some(first) = src.first() else { return };
    let from = dst.partition_point(|d| key(d) < key(first));
    let tail: Vec<T> = dst.drain(from..).collect();
    let (mut a, mut b) = (tail.into_iter().peekable(), src.into_iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) => match key(x).cmp(&key(y)) {
                std::cmp::Ordering::Less => a.next(),
                std::cmp::Ordering::Greater => b.next(),
                std::cmp::Ordering::Equal => {
                    let mut x = a.next().expect("peeked");
                    combine(&mut x, &b.next().expect("peeked"));
                    Some(x)
                }
            },
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => break,
        };
        match (next, dst.last_mut()) {
            // Equal keys within one list (a damaged file) combine too.
            (Some(n), Some(l)) if key(l) == key(&n) => combine(l, &n),
            (Some(n), _) => dst.push(n),
            (None, _) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_sorted_combines_the_overlap_only() {
        let mut dst = vec![(1, 1), (3, 1), (5, 1)];
        merge_sorted(
            &mut dst,
            vec![(3, 10), (4, 10), (6, 10)],
            |x| x.0,
            |a, b| a.1 += b.1,
        );
        assert_eq!(dst, vec![(1, 1), (3, 11), (4, 10), (5, 1), (6, 10)]);
        merge_sorted(&mut dst, vec![], |x| x.0, |a, b| a.1 += b.1);
        assert_eq!(dst.len(), 5);
    }

    #[test]
    fn masks_follow_their_tags() {
        assert_eq!(remap_mask(0b101, &[Some(2), Some(0), Some(1)]), 0b110);
        assert_eq!(remap_mask(0b11, &[None, Some(0)]), 0b1);
    }
}
