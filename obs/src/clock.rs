//! A cheap monotonic clock mapped to Unix epoch nanoseconds.
//!
//! The hot path reads `CLOCK_MONOTONIC` (served by the vDSO on Linux: no syscall, ~20 ns) and
//! stores raw monotonic nanoseconds; the writer thread maps them to the Unix epoch with one
//! anchor pair taken at [`crate::init`], so wall-clock jumps (NTP) during a run cannot make
//! spans overlap or go backwards.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds of the monotonic clock (arbitrary origin, never goes backwards).
#[inline(always)]
pub fn monotonic_ns() -> u64 {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on unix.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
    #[cfg(not(unix))]
    {
        use std::sync::LazyLock;
        use std::time::Instant;
        static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);
        ORIGIN.elapsed().as_nanos() as u64
    }
}

/// Nanoseconds since the Unix epoch from the wall clock.
pub fn epoch_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Maps monotonic readings to Unix epoch nanoseconds.
#[derive(Debug, Clone, Copy)]
pub struct EpochAnchor {
    monotonic: u64,
    epoch: i64,
}

impl EpochAnchor {
    /// Takes the anchor pair now; the monotonic reading is taken twice around the wall-clock
    /// reading and averaged, which bounds the pairing error by half the read time.
    pub fn now() -> Self {
        let a = monotonic_ns();
        let epoch = epoch_ns();
        let b = monotonic_ns();
        EpochAnchor {
            monotonic: a + (b - a) / 2,
            epoch,
        }
    }

    /// Converts a monotonic reading to Unix epoch nanoseconds.
    #[inline]
    pub fn to_epoch(&self, monotonic: u64) -> i64 {
        self.epoch + (monotonic as i64 - self.monotonic as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_never_goes_backwards_and_maps_close_to_wall_clock() {
        let anchor = EpochAnchor::now();
        let mut last = monotonic_ns();
        for _ in 0..1000 {
            let t = monotonic_ns();
            assert!(t >= last);
            last = t;
        }
        let mapped = anchor.to_epoch(monotonic_ns());
        let wall = epoch_ns();
        assert!((mapped - wall).abs() < 50_000_000, "{mapped} vs {wall}");
    }
}
