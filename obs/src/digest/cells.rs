//! Per (step, rank) durations of one phase, 4 bytes a cell and exact: a day-long 1024-rank
//! job has ~30 M (phase, step, rank) cells, which as i64 would be most of the summary's
//! memory. Each cell holds its difference from its rank's first value in the phase (a rank's
//! time in a phase varies by far less than the ±2.1 s an i32 of nanoseconds spans); the rare
//! cell that does not fit is kept whole on the side.

use rustc_hash::FxHashMap;

const ABSENT: i32 = i32::MIN;
const WIDE: i32 = i32::MIN + 1;

/// Cells by (step row, rank position); rows and positions are the caller's dense indices.
/// Stored a position (rank) at a time: parts arrive rank by rank, so a part's cells are
/// written next to each other (stored a step at a time, every cell written was a cache miss).
#[derive(Debug, Clone, Default)]
pub struct Cells {
    /// By position: per step row the difference from `base` (or a marker).
    cols: Vec<Vec<i32>>,
    /// Per position: the value the differences are from (its first cell).
    base: Vec<Option<i64>>,
    /// (row, position) -> cells whose difference does not fit an i32.
    wide: FxHashMap<(u32, u32), i64>,
    /// The longest column so far: a column that grows is given that many rows at once (each
    /// rank has about every step), not doubled to the next power of two (up to 2x the cells).
    rows: usize,
}

impl Cells {
    /// The cell's value; `None` when nothing was recorded there.
    #[inline]
    pub fn get(&self, row: u32, pos: u32) -> Option<i64> {
        let d = *self.cols.get(pos as usize)?.get(row as usize)?;
        self.value(row, pos, d)
    }

    #[inline]
    fn value(&self, row: u32, pos: u32, d: i32) -> Option<i64> {
        match d {
            ABSENT => None,
            WIDE => self.wide.get(&(row, pos)).copied(),
            d => Some(self.base[pos as usize]? + i64::from(d)),
        }
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
            self.cols.resize_with(p + 1, Vec::new);
        }
        let base = *self.base[p].get_or_insert(v);
        let cells = &mut self.cols[p];
        if cells.len() <= r {
            if cells.capacity() <= r {
                // The longest column doubles, as a Vec would; the others take its length.
                let want = if self.rows > r {
                    self.rows
                } else {
                    (r + 1).max(cells.len() * 2)
                };
                cells.reserve_exact(want - cells.len());
            }
            cells.resize(r + 1, ABSENT);
            self.rows = self.rows.max(r + 1);
        }
        match v.checked_sub(base).and_then(|d| i32::try_from(d).ok()) {
            Some(d) if d > WIDE => {
                if cells[r] == WIDE {
                    self.wide.remove(&(row, pos));
                }
                cells[r] = d;
            }
            _ => {
                cells[r] = WIDE;
                self.wide.insert((row, pos), v);
            }
        }
    }

    /// Calls `f(row, position, value)` for every cell, eight positions at a time row by row:
    /// a caller writing a rows x positions matrix then fills a cache line per call group.
    pub fn each(&self, mut f: impl FnMut(u32, u32, i64)) {
        for (block, cols) in self.cols.chunks(8).enumerate() {
            let rows = cols.iter().map(Vec::len).max().unwrap_or(0);
            for r in 0..rows {
                for (i, col) in cols.iter().enumerate() {
                    let Some(&d) = col.get(r) else { continue };
                    if d == ABSENT {
                        continue;
                    }
                    let pos = (block * 8 + i) as u32;
                    if let Some(v) = self.value(r as u32, pos, d) {
                        f(r as u32, pos, v);
                    }
                }
            }
        }
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
        let mut all = Vec::new();
        c.each(|r, p, v| all.push((r, p, v)));
        all.sort_unstable();
        assert_eq!(
            all,
            vec![(3, 2, 20_000_000_005), (4, 2, 20_000_000_001), (5, 0, -3)]
        );
    }
}
