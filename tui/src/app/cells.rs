//! Turning a row of spans into screen cells for one time window.
//!
//! Work per frame is bounded by the number of cells, not spans: each cell finds its spans with a
//! binary search on the row's sorted ends/starts, and a cell covering many spans looks at a fixed
//! number of evenly spaced samples to pick its dominant phase. Shared by the terminal gantt and
//! the static SVG/PNG renderer.

use super::model::{CollapsedRow, FLAG_ERROR, FLAG_STRAGGLER, Ns, PhaseId, SpanRow};

/// At most this many spans are inspected per cell; more are sampled.
const MAX_SPANS_PER_CELL: usize = 8;

/// Visible time range, `t0 < t1`, in ns relative to the run origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub t0: Ns,
    pub t1: Ns,
}

impl Window {
    pub fn width(&self) -> Ns {
        self.t1 - self.t0
    }

    /// Left edge of cell `c` out of `ncols`.
    pub fn edge(&self, c: usize, ncols: usize) -> Ns {
        self.t0 + (self.width() as i128 * c as i128 / ncols.max(1) as i128) as Ns
    }

    /// The columns of `ncols` that span any time, in order: (column, left edge, right edge).
    /// (A window narrower than `ncols` ns has empty columns.)
    pub fn columns(&self, ncols: usize) -> impl Iterator<Item = (usize, Ns, Ns)> + '_ {
        (0..ncols)
            .map(move |c| (c, self.edge(c, ncols), self.edge(c + 1, ncols)))
            .filter(|&(_, a, b)| b > a)
    }

    /// Cell containing time `t` (may be out of `0..ncols`).
    pub fn col_of(&self, t: Ns, ncols: usize) -> i64 {
        ((t - self.t0) as i128 * ncols as i128).div_euclid(self.width().max(1) as i128) as i64
    }

    /// Time at the left edge of column `c`, plus half a cell (the cell's centre).
    pub fn time_at(&self, c: usize, ncols: usize) -> Ns {
        let a = self.edge(c, ncols);
        let b = self.edge(c + 1, ncols);
        a + (b - a) / 2
    }
}

/// What one cell of a span row shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cell {
    /// Phase with the largest share of the cell.
    pub phase: PhaseId,
    /// Fraction of the cell's time covered by spans (estimated when sampled).
    pub coverage: f32,
    pub straggler: bool,
    pub error: bool,
    /// The span filling the cell when exactly one span is in it, else `None`.
    pub span: Option<u32>,
    /// The step of a span of `phase` in the cell (its first one sampled).
    pub step: u64,
}

/// Fills `out` with one entry per column of `row` over `w`.
pub fn row_cells(row: &SpanRow, w: Window, ncols: usize, out: &mut Vec<Option<Cell>>) {
    out.clear();
    out.resize(ncols, None);
    let n = row.len();
    if n == 0 || ncols == 0 || w.width() <= 0 {
        return;
    }
    let mut j = row.first_ending_after(w.t0);
    for (c, a, b) in w.columns(ncols) {
        if j < n && row.end[j] <= a {
            j += row.end[j..].partition_point(|&e| e <= a);
        }
        if j >= n {
            break;
        }
        let k = j + row.start[j..].partition_point(|&s| s < b);
        if k > j {
            out[c] = Some(aggregate(row, j, k, a, b));
        }
    }
}

fn aggregate(row: &SpanRow, j: usize, k: usize, a: Ns, b: Ns) -> Cell {
    let count = k - j;
    // (phase, time in the cell, its first span's index)
    let mut acc: [(PhaseId, Ns, usize); MAX_SPANS_PER_CELL] = [(0, 0, 0); MAX_SPANS_PER_CELL];
    let mut used = 0;
    let mut covered: Ns = 0;
    let mut flags = 0u8;
    let samples = count.min(MAX_SPANS_PER_CELL);
    for s in 0..samples {
        // Evenly spaced over j..k; exact when count <= MAX_SPANS_PER_CELL.
        let i = j + s * count / samples;
        let overlap = row.end[i].min(b) - row.start[i].max(a);
        if overlap <= 0 {
            continue;
        }
        covered += overlap;
        flags |= row.flags[i];
        let p = row.phase[i];
        match acc[..used].iter_mut().find(|e| e.0 == p) {
            Some(e) => e.1 += overlap,
            None => {
                acc[used] = (p, overlap, i);
                used += 1;
            }
        }
    }
    let scale = count as f64 / samples as f64;
    let coverage = ((covered as f64 * scale) / (b - a) as f64).min(1.0) as f32;
    let (phase, first) = acc[..used]
        .iter()
        .max_by_key(|e| e.1)
        .map(|e| (e.0, e.2))
        .unwrap_or((row.phase[j], j));
    Cell {
        phase,
        step: row.step[first],
        coverage,
        straggler: flags & FLAG_STRAGGLER != 0,
        error: flags & FLAG_ERROR != 0,
        span: (count == 1).then_some(j as u32),
    }
}

/// How much of the rank spread a collapsed cell shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Spread {
    /// Within the fastest rank's time: every rank is in this phase.
    AllRanks,
    /// Between the fastest and the median rank.
    ToMedian,
    /// Between the median and the slowest rank.
    ToMax,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollapsedCell {
    pub spread: Spread,
    /// The slowest rank is a straggler and this cell is in its tail.
    pub straggler: bool,
    /// Index of the bar providing the cell.
    pub bar: u32,
}

/// Fills `out` with one entry per column of a collapsed (per-phase) row.
pub fn collapsed_cells(
    row: &CollapsedRow,
    w: Window,
    ncols: usize,
    out: &mut Vec<Option<CollapsedCell>>,
) {
    out.clear();
    out.resize(ncols, None);
    if row.bars.is_empty() || ncols == 0 || w.width() <= 0 {
        return;
    }
    let bars = &row.bars;
    let mut lo = bars.partition_point(|x| x.start < w.t0 - row.max_len);
    for (c, a, b) in w.columns(ncols) {
        let from = a - row.max_len;
        if lo < bars.len() && bars[lo].start < from {
            lo += bars[lo..].partition_point(|x| x.start < from);
        }
        let hi = lo + bars[lo..].partition_point(|x| x.start < b);
        let count = hi - lo;
        let samples = count.min(4 * MAX_SPANS_PER_CELL);
        let mut best: Option<CollapsedCell> = None;
        for s in 0..samples {
            let i = lo + s * count / samples;
            let bar = &bars[i];
            let st = &bar.stats;
            let spread = if bar.start + st.min > a {
                Spread::AllRanks
            } else if bar.start + st.median > a {
                Spread::ToMedian
            } else if bar.start + st.max > a {
                Spread::ToMax
            } else {
                continue;
            };
            let cand = CollapsedCell {
                spread,
                straggler: spread == Spread::ToMax && bar.is_straggler(),
                bar: i as u32,
            };
            if best.is_none_or(|b| cand.spread < b.spread) {
                best = Some(cand);
            }
        }
        out[c] = best;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(spans: &[(Ns, Ns, PhaseId)]) -> SpanRow {
        let mut r = SpanRow::default();
        for &(s, e, p) in spans {
            r.start.push(s);
            r.end.push(e);
            r.phase.push(p);
            r.step.push(0);
            r.tagset.push(0);
            r.flags.push(0);
        }
        r
    }

    #[test]
    fn one_span_fills_exactly_its_cells() {
        let r = row(&[(10, 30, 1)]);
        let mut out = Vec::new();
        row_cells(&r, Window { t0: 0, t1: 40 }, 4, &mut out);
        let filled: Vec<bool> = out.iter().map(Option::is_some).collect();
        assert_eq!(filled, [false, true, true, false]);
        assert_eq!(out[1].unwrap().span, Some(0));
        assert_eq!(out[1].unwrap().coverage, 1.0);
    }

    #[test]
    fn dominant_phase_wins_a_shared_cell() {
        let r = row(&[(0, 3, 1), (3, 10, 2)]);
        let mut out = Vec::new();
        row_cells(&r, Window { t0: 0, t1: 10 }, 1, &mut out);
        let c = out[0].unwrap();
        assert_eq!(c.phase, 2);
        assert_eq!(c.span, None);
        assert_eq!(c.coverage, 1.0);
    }

    #[test]
    fn many_spans_per_cell_are_sampled_with_coverage_estimate() {
        // 1000 spans of length 1 every 2 ns: half covered.
        let spans: Vec<_> = (0..1000)
            .map(|i| (2 * i, 2 * i + 1, (i % 3) as PhaseId))
            .collect();
        let r = row(&spans);
        let mut out = Vec::new();
        row_cells(&r, Window { t0: 0, t1: 2000 }, 2, &mut out);
        for c in out {
            let c = c.unwrap();
            assert!((c.coverage - 0.5).abs() < 0.01, "{}", c.coverage);
        }
    }

    #[test]
    fn window_outside_the_row_is_empty() {
        let r = row(&[(100, 200, 0)]);
        let mut out = Vec::new();
        row_cells(&r, Window { t0: 300, t1: 400 }, 5, &mut out);
        assert!(out.iter().all(Option::is_none));
        row_cells(&r, Window { t0: 0, t1: 50 }, 5, &mut out);
        assert!(out.iter().all(Option::is_none));
    }
}
