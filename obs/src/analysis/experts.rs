//! Mixture-of-experts load: which layer's experts are overloaded. From the
//! `moe/layer/<L>/expert/<E>/tokens` scalars titan-train records on the steps it logs
//! ([`crate::vocab::moe`]), summed over ranks: per layer, the tokens each expert got over the
//! run and how uneven that is (the largest expert over the mean, the coefficient of variation,
//! the hottest expert and its share), and the step where it was most uneven. `titan-obs
//! metrics` gets the per-step figure, the worst layer's largest expert over its mean
//! ([`max_over_mean_per_step`]).

use std::collections::BTreeMap;

use serde::Serialize;

use super::metrics::lines;
use crate::metric_lines::Lines;
use crate::run::Run;
use crate::schema::Reduce;
use crate::vocab::moe;

/// One MoE layer's load over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerLoad {
    pub layer: u32,
    pub experts: u32,
    /// Steps with counts (titan-train records on the steps it logs, each step's counts those of
    /// the steps since the previous logged one).
    pub steps: u64,
    /// Routed tokens (a token counts once per expert it is sent to), over ranks and steps.
    pub tokens: f64,
    /// The mean and the largest expert's tokens.
    pub mean: f64,
    pub max: f64,
    /// `max / mean`: 1.0 when balanced, `experts` when one expert got everything.
    pub max_over_mean: f64,
    /// Coefficient of variation of the experts' tokens (standard deviation over mean).
    pub cv: f64,
    pub hottest_expert: u32,
    /// The hottest expert's share of the layer's routed tokens.
    pub hottest_share: f64,
    /// The step where this layer was most uneven, and its `max / mean` there.
    pub worst_step: u64,
    pub worst_step_max_over_mean: f64,
}

/// Tokens per (layer, step, expert), summed over ranks.
fn counts(lines: &Lines, names: &[String]) -> BTreeMap<u32, BTreeMap<u64, BTreeMap<u32, f64>>> {
    let ids: BTreeMap<u32, (u32, u32)> = names
        .iter()
        .enumerate()
        .filter_map(|(i, n)| Some((i as u32, moe::parse(n)?)))
        .collect();
    let mut out: BTreeMap<u32, BTreeMap<u64, BTreeMap<u32, f64>>> = BTreeMap::new();
    if ids.is_empty() {
        return out;
    }
    for (&(step, validation), (_, accs)) in &lines.0 {
        if validation {
            continue;
        }
        for (&(name, reduce), acc) in accs {
            if reduce != Reduce::Sum {
                continue;
            }
            if let Some(&(layer, expert)) = ids.get(&name) {
                *out.entry(layer)
                    .or_default()
                    .entry(step)
                    .or_default()
                    .entry(expert)
                    .or_default() += acc.get(Reduce::Sum);
            }
        }
    }
    out
}

/// `max / mean` of `v` (0 when empty or all zero).
fn max_over_mean(v: &[f64]) -> f64 {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let max = v.iter().copied().fold(0.0f64, f64::max);
    if mean > 0.0 { max / mean } else { 0.0 }
}

/// Every MoE layer's load over the run, in layer order (empty: no expert counts recorded).
pub fn layer_loads(run: &Run) -> Vec<LayerLoad> {
    // Most runs have no experts: their scalars are not gathered for nothing.
    if !run.names.iter().any(|n| moe::parse(n).is_some()) {
        return Vec::new();
    }
    counts(&lines(run), &run.names)
        .into_iter()
        .map(|(layer, steps)| {
            let experts = steps
                .values()
                .flat_map(|e| e.keys())
                .max()
                .map_or(0, |&m| m + 1);
            let mut total = vec![0.0f64; experts as usize];
            let (mut worst_step, mut worst) = (0u64, 0.0f64);
            for (&step, per_expert) in &steps {
                let mut v = vec![0.0f64; experts as usize];
                for (&e, &n) in per_expert {
                    v[e as usize] = n;
                    total[e as usize] += n;
                }
                let r = max_over_mean(&v);
                if r > worst {
                    (worst_step, worst) = (step, r);
                }
            }
            let tokens: f64 = total.iter().sum();
            let mean = tokens / experts.max(1) as f64;
            let (hottest, max) =
                total
                    .iter()
                    .copied()
                    .enumerate()
                    .fold(
                        (0usize, f64::MIN),
                        |b, (i, n)| if n > b.1 { (i, n) } else { b },
                    );
            let var = total.iter().map(|n| (n - mean).powi(2)).sum::<f64>() / experts.max(1) as f64;
            LayerLoad {
                layer,
                experts,
                steps: steps.len() as u64,
                tokens,
                mean,
                max,
                max_over_mean: max_over_mean(&total),
                cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
                hottest_expert: hottest as u32,
                hottest_share: if tokens > 0.0 { max / tokens } else { 0.0 },
                worst_step,
                worst_step_max_over_mean: worst,
            }
        })
        .collect()
}

/// Per step: the worst layer's largest expert over its mean expert ([`moe::MAX_OVER_MEAN`]),
/// from the metric `lines` of a run with `names`.
pub(super) fn max_over_mean_per_step(lines: &Lines, names: &[String]) -> BTreeMap<u64, f64> {
    let mut out: BTreeMap<u64, f64> = BTreeMap::new();
    for steps in counts(lines, names).values() {
        for (&step, per_expert) in steps {
            let v: Vec<f64> = per_expert.values().copied().collect();
            let r = max_over_mean(&v);
            let worst = out.entry(step).or_default();
            *worst = worst.max(r);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let n = moe::tokens_scalar(3, 17);
        assert_eq!(n, "moe/layer/3/expert/17/tokens");
        assert_eq!(moe::parse(n), Some((3, 17)));
        assert_eq!(moe::parse("moe/layer/3/tokens"), None);
        assert_eq!(moe::parse("training/loss"), None);
    }

    #[test]
    fn balance_figures() {
        assert_eq!(max_over_mean(&[2.0, 2.0, 2.0, 2.0]), 1.0);
        assert_eq!(max_over_mean(&[8.0, 0.0, 0.0, 0.0]), 4.0);
        assert_eq!(max_over_mean(&[0.0, 0.0]), 0.0);
    }
}
