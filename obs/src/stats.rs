//! Exact order statistics on compact arrays.
//!
//! Exact rather than sketched: 10 million i64 durations are 80 MB, and selection is O(n).

/// Count, total, mean, p50, p95 and max of a set of durations (ns).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct DurationStats {
    pub count: u64,
    pub total_ns: i64,
    pub mean_ns: f64,
    pub p50_ns: i64,
    pub p95_ns: i64,
    pub min_ns: i64,
    pub max_ns: i64,
}

impl DurationStats {
    /// Computes the statistics, reordering `values` in place (no copy).
    pub fn compute(values: &mut [i64]) -> DurationStats {
        if values.is_empty() {
            return DurationStats::default();
        }
        let count = values.len() as u64;
        let total: i64 = values.iter().sum();
        let max = *values.iter().max().expect("non-empty");
        let min = *values.iter().min().expect("non-empty");
        // Select the 95th first: everything left of it is then the i95 smallest values, so
        // the 50th (a smaller rank) can be selected within that prefix.
        let i95 = nearest_rank_index(values.len(), 0.95);
        let p95 = *values.select_nth_unstable(i95).1;
        let i50 = nearest_rank_index(values.len(), 0.5);
        let p50 = *values[..=i95].select_nth_unstable(i50).1;
        DurationStats {
            count,
            total_ns: total,
            mean_ns: total as f64 / count as f64,
            p50_ns: p50,
            p95_ns: p95,
            min_ns: min,
            max_ns: max,
        }
    }
}

/// Index of the q-quantile under the nearest-rank definition: the smallest value with at
/// least q of the data at or below it (`ceil(q * n) - 1`, clamped).
pub fn nearest_rank_index(n: usize, q: f64) -> usize {
    debug_assert!(n > 0);
    let rank = (q * n as f64).ceil() as usize;
    rank.clamp(1, n) - 1
}

/// The nearest-rank q-quantile of `values` (reorders them).
pub fn quantile_in_place(values: &mut [i64], q: f64) -> i64 {
    let i = nearest_rank_index(values.len(), q);
    *values.select_nth_unstable(i).1
}

/// Median of f64 values (mean of the two middle values for even counts); NaN when empty.
pub fn median_f64(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    let (_, &mut hi, _) = values.select_nth_unstable_by(n / 2, |a, b| a.total_cmp(b));
    if n % 2 == 1 {
        hi
    } else {
        let lo = values[..n / 2]
            .iter()
            .copied()
            .max_by(|a, b| a.total_cmp(b))
            .expect("n >= 2");
        (lo + hi) / 2.0
    }
}

/// The length of the union of `[start, end)` intervals (reorders them).
pub(crate) fn union_len(iv: &mut [(i64, i64)]) -> i64 {
    iv.sort_unstable();
    let (mut total, mut end) = (0i64, i64::MIN);
    for &(s, e) in iv.iter() {
        let s = s.max(end);
        if e > s {
            total = total.saturating_add(e.saturating_sub(s));
            end = e;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values() {
        let mut v: Vec<i64> = (1..=100).collect();
        let s = DurationStats::compute(&mut v);
        assert_eq!(s.count, 100);
        assert_eq!(s.total_ns, 5050);
        assert_eq!(s.mean_ns, 50.5);
        assert_eq!(s.p50_ns, 50);
        assert_eq!(s.p95_ns, 95);
        assert_eq!(s.max_ns, 100);
    }

    #[test]
    fn single_and_empty() {
        assert_eq!(DurationStats::compute(&mut []), DurationStats::default());
        let s = DurationStats::compute(&mut [7]);
        assert_eq!((s.p50_ns, s.p95_ns, s.max_ns, s.mean_ns), (7, 7, 7, 7.0));
    }

    #[test]
    fn median_even_and_odd() {
        assert_eq!(median_f64(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_f64(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median_f64(&mut []).is_nan());
    }

    proptest! {
        #[test]
        fn matches_sorting(mut v in proptest::collection::vec(-1_000_000i64..1_000_000, 1..400)) {
            let mut sorted = v.clone();
            sorted.sort();
            let n = v.len();
            let s = DurationStats::compute(&mut v);
            prop_assert_eq!(s.p50_ns, sorted[nearest_rank_index(n, 0.5)]);
            prop_assert_eq!(s.p95_ns, sorted[nearest_rank_index(n, 0.95)]);
            prop_assert_eq!(s.max_ns, sorted[n - 1]);
            prop_assert_eq!(s.total_ns, sorted.iter().sum::<i64>());
        }
    }
}
