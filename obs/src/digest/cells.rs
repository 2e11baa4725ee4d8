//! Per (step, rank) durations of one phase, 4 bytes a cell and exact: a day-long 1024-rank
//! job has ~30 M (phase, step, rank) cells, which as i64 would be most of the summary's
//! memory. Each cell holds its difference from its rank's first value in the phase (a rank's
//! time in a phase varies by far less than the ±2.1 s an i32 of nanoseconds spans); the rare
//! cell that does not fit is kept whole on the side.

use rustc_hash::FxHashMap;

const ABSENT: i32 = i32::MIN;
const WIDE: i32 = i32::MIN + 1;

/// Cells by (step row, rank position); rows and positions are the caller's dense indices.
#[derive(Debug, Clone, Default)]
pub struct Cells {
    /// By step row: per rank position the difference from `base` (or a marker).
    rows: Vec<Vec<i32>>,
    /// Per rank position: the value the differences are from (its first cell).
    base: Vec<Option<i64>>,
    /// (row, position) -> cells whose difference does not fit an i32.
    wide: FxHashMap<(u32, u32), i64>,
}

impl Cells {
    /// The cell's value; `None` when nothing was recorded there.
    #[inline]
    pub fn get(&self, row: u32, pos: u32) -> Option<i64> {
        let d = *self.rows.get(row as usize)?.get(pos as usize)?;
        match d {
            ABSENT => None,
            WIDE => self.wide.get(&(row, pos)).copied(),
            d => Some(self.base[pos as usize]? + i64::from(d)),
        }
    }

    /// Whether step row `row` has any cell.
    pub fn has_row(&self, row: u32) -> bool {
        self.rows.get(row as usize).is_some_and(|r| !r.is_empty())
    }

    /// Adds `dur` to the cell (an absent cell becomes `dur`), saturating.
    #[inline]
    pub fn add(&mut self, row: u32, pos: u32, dur: i64) {
        let v = match self.get(row, pos) {
            Some(v) => v.saturating_add(dur),
            None => dur,
        };
        self.set(row, pos, v);
    }

    /// Sets the cell to `v`.
    pub fn set(&mut self, row: u32, pos: u32, v: i64) {
        let (r, p) = (row as usize, pos as usize);
        if self.base.len() <= p {
            self.base.resize(p + 1, None);
        }
        let base = *self.base[p].get_or_insert(v);
        if self.rows.len() <= r {
            self.rows.resize_with(r + 1, Vec::new);
        }
        let cells = &mut self.rows[r];
        if cells.len() <= p {
            cells.resize(p + 1, ABSENT);
        }
        match v.checked_sub(base).and_then(|d| i32::try_from(d).ok()) {
            Some(d) if d > WIDE => {
                cells[p] = d;
                self.wide.remove(&(row, pos));
            }
            _ => {
                cells[p] = WIDE;
                self.wide.insert((row, pos), v);
            }
        }
    }

    /// Every cell of step row `row` as (position, value).
    pub fn row(&self, row: u32) -> impl Iterator<Item = (u32, i64)> + '_ {
        self.rows
            .get(row as usize)
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|(_, d)| **d != ABSENT)
            .filter_map(move |(p, _)| Some((p as u32, self.get(row, p as u32)?)))
    }

    /// Bytes held (for the memory this structure is meant to bound).
    pub fn heap_bytes(&self) -> usize {
        self.rows.iter().map(|r| r.capacity() * 4).sum::<usize>()
            + self.base.capacity() * 16
            + self.wide.len() * 24
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_hold_exact_values_near_and_far_from_the_base() {
        let mut c = Cells::default();
        assert_eq!(c.get(0, 0), None);
        c.add(3, 2, 20_000_000_000);
        c.add(3, 2, 5);
        assert_eq!(c.get(3, 2), Some(20_000_000_005));
        // Far from rank 2's base (20 s): kept whole, and exact.
        c.add(4, 2, 7);
        assert_eq!(c.get(4, 2), Some(7));
        c.add(4, 2, i64::MAX);
        assert_eq!(c.get(4, 2), Some(i64::MAX));
        // Back within range: the wide value is dropped.
        c.set(4, 2, 20_000_000_001);
        assert_eq!(c.get(4, 2), Some(20_000_000_001));
        assert!(c.wide.is_empty());
        // Negative values (a damaged part) too.
        c.set(5, 0, -3);
        assert_eq!(c.get(5, 0), Some(-3));
        assert_eq!(c.get(5, 1), None);
        assert!(!c.has_row(0));
        assert!(c.has_row(5));
        let row: Vec<(u32, i64)> = c.row(3).collect();
        assert_eq!(row, vec![(2, 20_000_000_005)]);
    }
}
