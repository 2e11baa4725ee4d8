//! Mixture-of-experts load: which layer's experts are overloaded. From the
//! `moe/layer/<L>/expert/<E>/tokens` scalars titan-train records on the steps it logs
//! ([`crate::vocab::moe`]), summed over ranks: per layer, the tokens each expert got over the
//! run and how uneven that is (the largest expert over the mean, the coefficient of variation,
//! the hottest expert and its share), and the step where it was most uneven. `titan-obs
//! metrics` gets the per-step figure, the worst layer's largest expert over its mean
//! ([`max_over_mean_per_step`]).
//!
//! Under expert parallelism, also the ranks that host the hottest expert (from the
//! `moe/ep/rank/<R>/first_expert` scalars) and the wait the layer's experts caused: the
//! all-to-all that brings the experts' outputs back waits for the last rank to finish its
//! experts, and the waits analysis names the phase a late rank came from — the
//! `moe/layer/<L>/experts` span — so the wait others spent on a layer's experts is the waits
//! table's rows from that span.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::metrics::lines;
use super::waits::Wait;
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
    /// Under expert parallelism, the ranks that host the hottest expert (empty: every rank
    /// hosts every expert, or the run did not record where they live).
    pub hottest_hosts: Vec<u32>,
    /// Under expert parallelism: the time ranks spent in collectives waiting for a rank that
    /// came late from this layer's experts (summed over ranks, calls and steps), and the rank
    /// that caused most of it. 0 and `None` without expert parallelism.
    pub experts_wait_caused_ns: i64,
    pub experts_late_rank: Option<u32>,
}

/// Under expert parallelism, where the routed experts live: each recording rank's experts
/// `[first, first + count)`, in every MoE layer it holds.
#[derive(Debug, Clone, Default, PartialEq)]
struct Hosting {
    /// Rank to (first routed expert, how many).
    experts: BTreeMap<u32, (u32, u32)>,
    /// Rank to the MoE layers it holds, for the ranks that said (pipeline parallelism: a rank
    /// holds its stages' layers); a rank not here holds every layer.
    layers: BTreeMap<u32, BTreeSet<u32>>,
}

/// The hosting scalars of a run as they are read, for [`Hosting`].
#[derive(Default)]
struct HostingScalars {
    first: BTreeMap<u32, f64>,
    per_rank: f64,
    layers: BTreeMap<u32, BTreeSet<u32>>,
}

impl HostingScalars {
    /// Takes scalar `name`'s (largest) `value` if it is a hosting scalar; returns whether it was.
    fn read(&mut self, name: &str, value: f64) -> bool {
        if let Some(rank) = moe::parse_first_expert(name) {
            self.first.insert(rank, value);
        } else if name == moe::EXPERTS_PER_RANK {
            self.per_rank = self.per_rank.max(value);
        } else if let Some((rank, layer)) = moe::parse_held_layer(name) {
            self.layers.entry(rank).or_default().insert(layer);
        } else {
            return false;
        }
        true
    }

    /// Where the experts live (nothing hosted when fewer than one per rank was recorded: no
    /// expert parallelism).
    fn hosting(self) -> Hosting {
        if self.per_rank < 1.0 {
            return Hosting::default();
        }
        let per_rank = self.per_rank as u32;
        let experts = self
            .first
            .into_iter()
            .filter(|(_, f)| f.is_finite() && *f >= 0.0)
            .map(|(rank, f)| (rank, (f as u32, per_rank)))
            .collect();
        Hosting {
            experts,
            layers: self.layers,
        }
    }
}

impl Hosting {
    /// (rank, first, count) of every rank hosting experts of `layer`.
    fn of_layer(&self, layer: u32) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        self.experts
            .iter()
            .filter(move |(rank, _)| self.layers.get(rank).is_none_or(|l| l.contains(&layer)))
            .map(|(&rank, &(first, count))| (rank, first, count))
    }

    /// The ranks hosting `layer`'s `expert`.
    fn hosts_of(&self, expert: u32, layer: u32) -> Vec<u32> {
        self.of_layer(layer)
            .filter(|(_, first, n)| (*first..first + n).contains(&expert))
            .map(|(rank, ..)| rank)
            .collect()
    }
}

/// Under expert parallelism: where each rank that recorded it hosts its experts.
fn hosted_experts(lines: &Lines, names: &[String]) -> Hosting {
    let mut scalars = HostingScalars::default();
    for (_, accs) in lines.0.values() {
        for (&(name, reduce), acc) in accs {
            if reduce != Reduce::Max {
                continue;
            }
            let Some(n) = names.get(name as usize) else {
                continue;
            };
            scalars.read(n, acc.get(Reduce::Max));
        }
    }
    scalars.hosting()
}

/// Per layer: the wait caused by ranks late from its experts' span, and the rank that caused
/// most of it.
fn experts_waits(waits: &[Wait]) -> BTreeMap<u32, (i64, Option<u32>)> {
    let mut by_layer: BTreeMap<u32, BTreeMap<u32, i64>> = BTreeMap::new();
    for w in waits {
        if let Some(layer) = moe::parse_experts_span(&w.phase) {
            *by_layer
                .entry(layer)
                .or_default()
                .entry(w.rank)
                .or_default() += w.wait_caused_ns;
        }
    }
    by_layer
        .into_iter()
        .map(|(layer, ranks)| {
            let total = ranks.values().sum();
            let late = ranks
                .iter()
                .max_by_key(|(rank, caused)| (**caused, std::cmp::Reverse(**rank)))
                .map(|(&rank, _)| rank);
            (layer, (total, late))
        })
        .collect()
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

/// Every MoE layer's load over the run, in layer order (empty: no expert counts recorded),
/// with the run's `waits` table (what the layers' experts made other ranks wait).
pub fn layer_loads(run: &Run, waits: &[Wait]) -> Vec<LayerLoad> {
    // Most runs have no experts: their scalars are not gathered for nothing.
    if !run.names.iter().any(|n| moe::parse(n).is_some()) {
        return Vec::new();
    }
    let lines = lines(run);
    let hosted = hosted_experts(&lines, &run.names);
    let waited = experts_waits(waits);
    counts(&lines, &run.names)
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
                hottest_hosts: hosted.hosts_of(hottest as u32, layer),
                experts_wait_caused_ns: waited.get(&layer).map_or(0, |w| w.0),
                experts_late_rank: waited.get(&layer).and_then(|w| w.1),
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

/// Under expert parallelism, how loaded each rank's experts were: per (rank, layer) and logged
/// step, the tokens routed to the experts the rank hosts over an even share of the layer's
/// tokens (1.0: balanced; 2.0: twice its share). Built from per-step series reduced over
/// ranks as `titan-obs metrics` reduces them (the `moe/layer/<L>/expert/<E>/tokens` sums and
/// the `moe/ep/...` hosting scalars), for the TUI's load colouring of the experts spans.
///
/// Tokens are the job's: under expert parallelism with several ep groups (efsdp, replicas)
/// the ranks that share an ep index host the same experts and get the same figure.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostLoads {
    /// (rank, layer) to its logged steps in order, each with that step's [`HostLoad`].
    by_host: BTreeMap<(u32, u32), Vec<(u64, HostLoad)>>,
}

/// One rank's experts of one layer over the steps since the previous logged step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostLoad {
    /// The routed experts the rank hosts: `[first, first + count)`.
    pub first: u32,
    pub count: u32,
    /// Tokens routed to them, and to all the layer's `experts`.
    pub hosted_tokens: f64,
    pub layer_tokens: f64,
    pub experts: u32,
    /// `hosted_tokens` over an even share, `layer_tokens * count / experts` (0 when the layer
    /// got no tokens).
    pub factor: f64,
}

impl HostLoads {
    /// From `(name, [(step, value)])` series; empty when the run did not record where its
    /// experts live (no expert parallelism, or every rank hosts every expert).
    pub fn from_series<'a>(series: impl IntoIterator<Item = (&'a str, &'a [(u64, f64)])>) -> Self {
        let mut scalars = HostingScalars::default();
        let mut tokens: BTreeMap<u32, BTreeMap<u64, BTreeMap<u32, f64>>> = BTreeMap::new();
        for (name, points) in series {
            let largest = points.iter().map(|p| p.1).fold(f64::NAN, f64::max);
            if scalars.read(name, largest) {
                continue;
            }
            if let Some((layer, expert)) = moe::parse(name) {
                let steps = tokens.entry(layer).or_default();
                for &(step, n) in points {
                    steps.entry(step).or_default().insert(expert, n);
                }
            }
        }
        let mut by_host: BTreeMap<(u32, u32), Vec<(u64, HostLoad)>> = BTreeMap::new();
        let hosted = scalars.hosting();
        for (layer, steps) in &tokens {
            let experts = steps
                .values()
                .flat_map(|e| e.keys())
                .max()
                .map_or(0, |&m| m + 1);
            for (&step, per_expert) in steps {
                let layer_tokens: f64 = per_expert.values().sum();
                for (rank, first, count) in hosted.of_layer(*layer) {
                    let hosted_tokens: f64 =
                        per_expert.range(first..first + count).map(|e| e.1).sum();
                    let share = layer_tokens * f64::from(count) / f64::from(experts.max(1));
                    let load = HostLoad {
                        first,
                        count,
                        hosted_tokens,
                        layer_tokens,
                        experts,
                        factor: if share > 0.0 {
                            hosted_tokens / share
                        } else {
                            0.0
                        },
                    };
                    by_host
                        .entry((rank, *layer))
                        .or_default()
                        .push((step, load));
                }
            }
        }
        Self { by_host }
    }

    pub fn is_empty(&self) -> bool {
        self.by_host.is_empty()
    }

    /// `rank`'s experts of `layer` at `step`: the counts of the first logged step at or after
    /// it (a logged step's counts cover the steps since the previous one).
    pub fn at(&self, rank: u32, layer: u32, step: u64) -> Option<HostLoad> {
        let steps = self.by_host.get(&(rank, layer))?;
        let i = steps.partition_point(|(s, _)| *s < step);
        steps.get(i).map(|(_, load)| *load)
    }
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
    fn expert_parallel_names_round_trip() {
        assert_eq!(moe::experts_span(4), "moe/layer/4/experts");
        assert_eq!(moe::parse_experts_span(moe::experts_span(4)), Some(4));
        assert_eq!(moe::parse_experts_span("moe/layer/4/expert/1/tokens"), None);
        assert_eq!(moe::parse(moe::experts_span(4)), None);
        assert_eq!(moe::first_expert_scalar(3), "moe/ep/rank/3/first_expert");
        assert_eq!(
            moe::parse_first_expert(moe::first_expert_scalar(3)),
            Some(3)
        );
        assert_eq!(moe::held_layer_scalar(3, 12), "moe/ep/rank/3/layer/12");
        assert_eq!(
            moe::parse_held_layer(moe::held_layer_scalar(3, 12)),
            Some((3, 12))
        );
        assert_eq!(moe::parse_held_layer(moe::first_expert_scalar(3)), None);
        assert_eq!(moe::parse_first_expert(moe::held_layer_scalar(3, 12)), None);
        assert!(moe::is_recorded_load(moe::held_layer_scalar(0, 1)));
        assert!(moe::is_recorded_load(moe::EXPERTS_PER_RANK));
        assert!(!moe::is_recorded_load(moe::MAX_OVER_MEAN));
    }

    /// EP 2 x efsdp 2 on 4 ranks, 8 experts: ranks 0 and 2 host 0..4, ranks 1 and 3 host 4..8.
    #[test]
    fn hosts_are_the_ranks_whose_range_holds_the_expert() {
        let hosting = |first: &[(usize, f64)], per_rank| {
            let mut scalars = HostingScalars::default();
            for &(rank, f) in first {
                assert!(scalars.read(moe::first_expert_scalar(rank), f));
            }
            assert!(scalars.read(moe::EXPERTS_PER_RANK, per_rank));
            scalars.hosting()
        };
        let hosted = hosting(&[(0, 0.0), (1, 4.0), (2, 0.0), (3, 4.0)], 4.0);
        assert_eq!(hosted.hosts_of(5, 1), vec![1, 3]);
        assert_eq!(hosted.hosts_of(3, 7), vec![0, 2]);
        assert_eq!(hosted.hosts_of(8, 1), Vec::<u32>::new());
        assert_eq!(Hosting::default().hosts_of(0, 1), Vec::<u32>::new());
        // Fewer than one expert per rank recorded: no expert parallelism, no hosts.
        assert_eq!(hosting(&[(0, 0.0), (1, 4.0)], 0.0), Hosting::default());
    }

    /// PP 2 x EP 2 on 4 ranks, 8 experts: ranks 0 and 1 hold MoE layers 1 and 2 (stage 0),
    /// ranks 2 and 3 layers 3 to 5 (stage 1); ranks 1 and 3 host experts 4..8.
    #[test]
    fn under_pipeline_parallelism_hosts_are_ranks_holding_the_layer() {
        let mut scalars = HostingScalars::default();
        let mut read = |name: &str, v: f64| scalars.read(name, v);
        for (rank, expert) in [(0, 0.0), (1, 4.0), (2, 0.0), (3, 4.0)] {
            assert!(read(moe::first_expert_scalar(rank), expert));
            let held = if rank < 2 { 1..3 } else { 3..6 };
            for layer in held {
                assert!(read(moe::held_layer_scalar(rank, layer), 1.0));
            }
        }
        assert!(read(moe::EXPERTS_PER_RANK, 4.0));
        assert!(!read(moe::tokens_scalar(1, 5), 3.0));
        let hosted = scalars.hosting();
        assert_eq!(hosted.hosts_of(5, 1), vec![1]);
        assert_eq!(hosted.hosts_of(5, 4), vec![3]);
        assert_eq!(hosted.hosts_of(2, 3), vec![2]);
        assert_eq!(hosted.hosts_of(2, 0), Vec::<u32>::new(), "layer 0 is dense");
    }

    #[test]
    fn experts_waits_come_from_the_layers_experts_span() {
        let row = |rank, phase: &str, ns| Wait {
            rank,
            phase: phase.into(),
            steps_last: 1,
            wait_caused_ns: ns,
        };
        let waits = [
            row(1, "moe/layer/2/experts", 700),
            row(0, "moe/layer/2/experts", 200),
            row(1, "moe/layer/3/experts", 50),
            row(0, "forward", 10_000),
        ];
        let w = experts_waits(&waits);
        assert_eq!(w[&2], (900, Some(1)));
        assert_eq!(w[&3], (50, Some(1)));
        assert_eq!(w.len(), 2, "{w:?}");
    }

    /// EP 2 on 2 ranks, 4 experts: rank 1 hosts experts 2 and 3; expert 3 got most tokens.
    #[test]
    fn host_loads_are_the_hosted_experts_tokens_over_an_even_share() {
        let series: Vec<(String, Vec<(u64, f64)>)> = vec![
            (moe::first_expert_scalar(0).into(), vec![(2, 0.0), (4, 0.0)]),
            (moe::first_expert_scalar(1).into(), vec![(2, 2.0), (4, 2.0)]),
            (moe::EXPERTS_PER_RANK.into(), vec![(2, 2.0), (4, 2.0)]),
            (moe::tokens_scalar(1, 0).into(), vec![(2, 10.0), (4, 25.0)]),
            (moe::tokens_scalar(1, 1).into(), vec![(2, 10.0), (4, 25.0)]),
            (moe::tokens_scalar(1, 2).into(), vec![(2, 10.0), (4, 25.0)]),
            (moe::tokens_scalar(1, 3).into(), vec![(2, 50.0), (4, 25.0)]),
            ("training/loss".into(), vec![(2, 3.0)]),
        ];
        let loads = HostLoads::from_series(series.iter().map(|(n, p)| (n.as_str(), p.as_slice())));
        // Step 2: 80 tokens, an even share of two experts is 40; rank 1 got 60, rank 0 20.
        let r1 = loads.at(1, 1, 2).unwrap();
        assert_eq!((r1.first, r1.count, r1.experts), (2, 2, 4));
        assert_eq!(
            (r1.hosted_tokens, r1.layer_tokens, r1.factor),
            (60.0, 80.0, 1.5)
        );
        assert_eq!(loads.at(0, 1, 2).unwrap().factor, 0.5);
        // Steps 1 and 2 read step 2's counts, 3 and 4 step 4's (balanced); none after 4.
        assert_eq!(loads.at(1, 1, 1).unwrap().factor, 1.5);
        assert_eq!(loads.at(1, 1, 3).unwrap().factor, 1.0);
        assert_eq!(loads.at(1, 1, 5), None);
        assert_eq!(loads.at(1, 0, 2), None, "no layer 0");
        // Had rank 1 held only layer 2 (another pipeline stage), it has no load in layer 1.
        let mut staged = series.clone();
        staged.push((
            moe::held_layer_scalar(1, 2).into(),
            vec![(2, 1.0), (4, 1.0)],
        ));
        let loads = HostLoads::from_series(staged.iter().map(|(n, p)| (n.as_str(), p.as_slice())));
        assert_eq!(loads.at(1, 1, 2), None);
        assert_eq!(loads.at(0, 1, 2).unwrap().factor, 0.5);
        // Without hosting scalars (no expert parallelism) there is nothing to colour.
        let flat =
            HostLoads::from_series(series[3..].iter().map(|(n, p)| (n.as_str(), p.as_slice())));
        assert!(flat.is_empty());
    }

    #[test]
    fn balance_figures() {
        assert_eq!(max_over_mean(&[2.0, 2.0, 2.0, 2.0]), 1.0);
        assert_eq!(max_over_mean(&[8.0, 0.0, 0.0, 0.0]), 4.0);
        assert_eq!(max_over_mean(&[0.0, 0.0]), 0.0);
    }
}
