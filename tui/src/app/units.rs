//! Human time units and "nice" axis tick spacing.

use super::model::Ns;

/// A duration with a unit and ~3 significant digits: `812ns`, `12.5µs`, `3.20ms`, `1.25s`, `2m05s`.
pub fn dur(ns: Ns) -> String {
    let neg = ns < 0;
    let a = ns.unsigned_abs() as f64;
    let s = if a < 1e3 {
        format!("{a:.0}ns")
    } else if a < 1e6 {
        sig3(a / 1e3, "µs")
    } else if a < 1e9 {
        sig3(a / 1e6, "ms")
    } else if a < 60e9 {
        sig3(a / 1e9, "s")
    } else {
        let secs = (a / 1e9).round() as u64;
        if secs < 3600 {
            format!("{}m{:02}s", secs / 60, secs % 60)
        } else {
            format!("{}h{:02}m", secs / 3600, (secs % 3600) / 60)
        }
    };
    if neg { format!("-{s}") } else { s }
}

fn sig3(v: f64, unit: &str) -> String {
    if v >= 100.0 {
        format!("{v:.0}{unit}")
    } else if v >= 10.0 {
        format!("{v:.1}{unit}")
    } else {
        format!("{v:.2}{unit}")
    }
}

/// Smallest 1/2/5 x 10^k nanoseconds that is >= `raw`.
pub fn nice_step(raw: f64) -> Ns {
    let raw = raw.max(1.0);
    let mut base: Ns = 1;
    loop {
        for m in [1, 2, 5] {
            let s = base.saturating_mul(m);
            if s as f64 >= raw {
                return s;
            }
        }
        if base > Ns::MAX / 100 {
            return base;
        }
        base *= 10;
    }
}

/// A tick label at time `t` on an axis whose ticks are `step` apart: just enough decimals.
pub fn tick_label(t: Ns, step: Ns) -> String {
    if t == 0 {
        return "0".to_string();
    }
    if step >= 60_000_000_000 && t.abs() >= 60_000_000_000 {
        return dur(t);
    }
    let (div, unit) = if step >= 100_000_000 {
        (1e9, "s")
    } else if step >= 100_000 {
        (1e6, "ms")
    } else if step >= 100 {
        (1e3, "µs")
    } else {
        (1.0, "ns")
    };
    // Enough decimals to tell neighbouring ticks apart.
    let ratio = div / step as f64;
    let decimals = if ratio <= 1.0 {
        0
    } else {
        ratio.log10().ceil() as usize
    };
    format!("{:.*}{unit}", decimals.min(9), t as f64 / div)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_have_units() {
        assert_eq!(dur(812), "812ns");
        assert_eq!(dur(12_500), "12.5µs");
        assert_eq!(dur(3_204_000), "3.20ms");
        assert_eq!(dur(1_250_000_000), "1.25s");
        assert_eq!(dur(125_000_000_000), "2m05s");
        assert_eq!(dur(-5_000), "-5.00µs");
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(0.3), 1);
        assert_eq!(nice_step(3.0), 5);
        assert_eq!(nice_step(1_100.0), 2_000);
        assert_eq!(nice_step(40_000_000.0), 50_000_000);
    }

    #[test]
    fn tick_labels_show_enough_digits() {
        assert_eq!(tick_label(0, 100_000_000), "0");
        assert_eq!(tick_label(1_500_000_000, 500_000_000), "1.5s");
        assert_eq!(tick_label(40_000_000, 20_000_000), "40ms");
        assert_eq!(tick_label(2_000_000_000, 1_000_000_000), "2s");
        assert_eq!(tick_label(250_000, 50_000), "250µs");
        assert_eq!(tick_label(12_200_000_000, 200_000_000), "12.2s");
    }
}
