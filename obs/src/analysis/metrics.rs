//! torchtitan's aggregated per-step metrics from the recorded scalars.
//!
//! A scalar `training/loss` recorded with `Reduce::Mean` on every rank becomes the column
//! `training/loss_mean`: the mean over ranks (and over repeated records of one rank in a step).
//! Scalars named `validation/...` form separate `validate step:` lines.

use std::fmt::Write;

use serde::Serialize;

use crate::metric_lines::{Acc, Lines, is_validation};
use crate::record::NO_STEP;
use crate::run::Run;
use crate::schema::Reduce;

/// One aggregated line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsLine {
    pub step: u64,
    pub validation: bool,
    /// `(name_reduce, value)` in first-recorded order.
    pub values: Vec<(String, f64)>,
}

/// Aggregates the run's scalars per step (steps without a step number are skipped); a run
/// read as per-part summaries from their scalar cells (means summed part by part rather
/// than record by record: the same but for float rounding).
///
/// A mixture-of-experts run's per-expert counts (`moe/layer/<L>/expert/<E>/tokens`) are
/// `summary`'s experts section; a line gets their per-step figure instead, the worst layer's
/// largest expert over its mean ([`crate::vocab::moe::MAX_OVER_MEAN`]).
pub fn metrics(run: &Run) -> Vec<MetricsLine> {
    let lines = lines(run);
    let mut out = finish(&lines, &run.names);
    let imbalance = super::experts::max_over_mean_per_step(&lines, &run.names);
    for line in out.iter_mut().filter(|l| !l.validation) {
        if let Some(&r) = imbalance.get(&line.step) {
            line.values
                .push((crate::vocab::moe::MAX_OVER_MEAN.to_string(), r));
        }
    }
    out
}

/// The run's scalars per (step, name, reduce): the per-part summaries' cells, or gathered from
/// the decoded scalars.
pub(super) fn lines(run: &Run) -> std::borrow::Cow<'_, Lines> {
    if let Some(d) = &run.digest {
        return std::borrow::Cow::Borrowed(&d.metrics);
    }
    let sc = &run.scalars;
    let mut lines = Lines::default();
    for i in 0..sc.rank.len() {
        let step = sc.step[i];
        if step == NO_STEP || sc.value[i].is_nan() {
            continue;
        }
        let name = sc.name[i];
        let mut acc = Acc::default();
        acc.add(sc.value[i]);
        lines.add(
            step,
            is_validation(run.name(name)),
            name,
            sc.reduce[i],
            &acc,
        );
    }
    std::borrow::Cow::Owned(lines)
}

/// How often the trainer read a tensor's value to the host per step (each read a wait for
/// the GPU there): from its `trainer/host_syncs` scalar, the slowest rank's count per step.
/// torchtitan reads only on the steps it logs; so should titan-train.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostSyncs {
    /// Steps with a count.
    pub steps: u64,
    pub median: f64,
    pub max: f64,
    /// Steps that logged their metrics (they hold a `training/loss` scalar).
    pub log_steps: u64,
    pub log_steps_median: f64,
    pub log_steps_max: f64,
    /// The largest count of a step that did not log (0 when none read anything; a step that
    /// validated reads its validation loss).
    pub other_steps_max: f64,
}

/// The run's [`HostSyncs`], or `None` when it recorded none (runs of older titan-trains and
/// of other trainers).
pub fn host_syncs(run: &Run) -> Option<HostSyncs> {
    let lines = lines(run);
    let id = |name: &str| run.names.iter().position(|n| n == name).map(|i| i as u32);
    let syncs = id(crate::vocab::titan::HOST_SYNCS)?;
    let loss = id(crate::vocab::titan::LOSS);
    let (mut all, mut logged, mut other) = (Vec::new(), Vec::new(), Vec::new());
    for (&(_, validation), (_, accs)) in &lines.0 {
        if validation {
            continue;
        }
        let Some(acc) = accs.get(&(syncs, Reduce::Max)) else {
            continue;
        };
        let v = acc.get(Reduce::Max);
        all.push(v);
        let logs = loss.is_some_and(|l| accs.keys().any(|k| k.0 == l));
        if logs { &mut logged } else { &mut other }.push(v);
    }
    if all.is_empty() {
        return None;
    }
    let median = |v: &mut Vec<f64>| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    let max = |v: &[f64]| v.iter().copied().fold(0.0f64, f64::max);
    Some(HostSyncs {
        steps: all.len() as u64,
        max: max(&all),
        median: median(&mut all),
        log_steps: logged.len() as u64,
        log_steps_max: max(&logged),
        log_steps_median: median(&mut logged),
        other_steps_max: max(&other),
    })
}

/// The lines, with `names` the run's names.
fn finish(lines: &Lines, names: &[String]) -> Vec<MetricsLine> {
    // Collectives' payloads (`comm/...`, recorded inside their spans, often before the
    // step's training scalars) go after the training metrics, so lines read like torchtitan's.
    let name = |id: u32| names.get(id as usize).map_or("?", String::as_str);
    let is_comm = |id: u32| name(id).starts_with(crate::vocab::collective::BYTES_PREFIX);
    lines
        .0
        .iter()
        .filter_map(|(&(step, validation), (order, accs))| {
            // The trainer's per-step counters are `summary`'s ([`host_syncs`]), not metrics
            // torchtitan would log: a line made of nothing else is no line.
            let mut order: Vec<(u32, Reduce)> = order
                .iter()
                .copied()
                .filter(|k| {
                    let n = name(k.0);
                    n != crate::vocab::titan::HOST_SYNCS && !crate::vocab::moe::is_recorded_load(n)
                })
                .collect();
            if order.is_empty() {
                return None;
            }
            order.sort_by_key(|k| is_comm(k.0));
            Some(MetricsLine {
                step,
                validation,
                values: order
                    .into_iter()
                    .map(|k| (format!("{}_{}", name(k.0), k.1), accs[&k].get(k.1)))
                    .collect(),
            })
        })
        .collect()
}

/// Formats a value the way torchtitan's console does: about four significant digits,
/// one decimal for large values (`8.028`, `50810.5`, `0.19`, `0.0026`).
pub fn format_value(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let a = v.abs();
    if a >= 1000.0 {
        return format!("{v:.1}");
    }
    if a == 0.0 {
        return "0".into();
    }
    let digits = 4 - (a.log10().floor() as i32 + 1);
    let s = format!("{v:.*}", digits.max(0) as usize);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `step:  1  training/loss_mean: 8.028  ...` / `validate step:  5  validation/loss_mean: 4.78`.
pub fn format_line(line: &MetricsLine) -> String {
    let mut s = String::new();
    let prefix = if line.validation {
        "validate step:"
    } else {
        "step:"
    };
    let _ = write!(s, "{prefix} {:>2}", line.step);
    for (k, v) in &line.values {
        let _ = write!(s, "  {k}: {}", format_value(*v));
    }
    s
}

/// CSV with one row per line: `kind,step,<every column>` (empty where a line lacks it).
pub fn to_csv(lines: &[MetricsLine]) -> String {
    let mut cols: Vec<&str> = Vec::new();
    for l in lines {
        for (k, _) in &l.values {
            if !cols.contains(&k.as_str()) {
                cols.push(k);
            }
        }
    }
    let mut out = String::from("kind,step");
    for c in &cols {
        out.push(',');
        out.push_str(&csv_field(c));
    }
    out.push('\n');
    for l in lines {
        let _ = write!(
            out,
            "{},{}",
            if l.validation {
                "validation"
            } else {
                "training"
            },
            l.step
        );
        for c in &cols {
            out.push(',');
            if let Some((_, v)) = l.values.iter().find(|(k, _)| k == c) {
                let _ = write!(out, "{v}");
            }
        }
        out.push('\n');
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_torchtitan() {
        assert_eq!(format_value(8.02812), "8.028");
        assert_eq!(format_value(50810.53), "50810.5");
        assert_eq!(format_value(0.19), "0.19");
        assert_eq!(format_value(361.44), "361.4");
        assert_eq!(format_value(0.026), "0.026");
        assert_eq!(format_value(0.0026), "0.0026");
        assert_eq!(format_value(4.78), "4.78");
        assert_eq!(format_value(0.0), "0");
    }

    #[test]
    fn line_format() {
        let l = MetricsLine {
            step: 1,
            validation: false,
            values: vec![
                ("training/loss_mean".into(), 8.028),
                ("training/grad_norm_max".into(), 50810.5),
            ],
        };
        assert_eq!(
            format_line(&l),
            "step:  1  training/loss_mean: 8.028  training/grad_norm_max: 50810.5"
        );
        let v = MetricsLine {
            step: 5,
            validation: true,
            values: vec![("validation/loss_mean".into(), 4.78)],
        };
        assert_eq!(
            format_line(&v),
            "validate step:  5  validation/loss_mean: 4.78"
        );
    }

    #[test]
    fn reductions() {
        let mut a = Acc::default();
        for v in [1.0, 5.0, 3.0] {
            a.add(v);
        }
        assert_eq!(a.get(Reduce::Mean), 3.0);
        assert_eq!(a.get(Reduce::Sum), 9.0);
        assert_eq!(a.get(Reduce::Min), 1.0);
        assert_eq!(a.get(Reduce::Max), 5.0);
    }

    #[test]
    fn csv_has_union_of_columns() {
        let lines = vec![
            MetricsLine {
                step: 1,
                validation: false,
                values: vec![("a_mean".into(), 1.5)],
            },
            MetricsLine {
                step: 1,
                validation: true,
                values: vec![("b_max".into(), 2.0)],
            },
        ];
        assert_eq!(
            to_csv(&lines),
            "kind,step,a_mean,b_max\ntraining,1,1.5,\nvalidation,1,,2\n"
        );
    }
}
