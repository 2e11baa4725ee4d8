//! Runs: every start of a recorder is a run of its own, named by a run id that every part's
//! footer carries (`titan.run_id`) and titan-train also writes into every `metrics.jsonl` line.
//! A folder can hold several runs (a second launch in the same dump folder, without a
//! checkpoint to resume from). The one rule, for every reader and writer: records of different
//! run ids are never mixed. A loaded [`Run`](crate::Run)'s tables hold one run, the newest
//! unless [`Run::select_run`](crate::Run::select_run) picks another, and [`Runs`] names them
//! all. This module holds the run ids and that bookkeeping; `run.rs` merges each part into
//! the tables of its run and selects the run shown.
//!
//! Newest means the run whose records the lowest rank wrote last: a rank numbers its parts in
//! the order it writes them, and every run has a rank 0.

use std::collections::{BTreeMap, HashMap};

use crate::digest::RunDigest;
use crate::record::NO_STEP;
use crate::tables::{Errors, Instants, RankInfo, Scalars, Spans, TagSet};

/// A fresh run id: the start time in UTC and 16 bits of entropy (`20261125-154958-3fa2`), so
/// ids sort by start and two launches in the same second still differ.
pub fn new_run_id() -> String {
    run_id_from_seed(draw_run_seed())
}

/// What a run id is made from: the start time in seconds (high bits) and 16 bits of entropy.
/// Processes that start one run together draw it once and share it (titan-train's rank 0
/// broadcasts it), then each formats it with [`run_id_from_seed`].
pub fn draw_run_seed() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let entropy = (now.subsec_nanos() as u64 ^ (std::process::id() as u64).rotate_left(7)) & 0xffff;
    (now.as_secs() << 16) | entropy
}

/// The run id of a seed from [`draw_run_seed`].
pub fn run_id_from_seed(seed: u64) -> String {
    let secs = seed >> 16;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}-{:04x}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        seed & 0xffff
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The record tables of one run (the fields of a loaded `Run` that hold records).
#[derive(Debug, Default, Clone)]
pub(crate) struct Tables {
    pub(crate) spans: Spans,
    pub(crate) instants: Instants,
    pub(crate) scalars: Scalars,
    pub(crate) errors: Errors,
    pub(crate) ranks: BTreeMap<u32, RankInfo>,
    pub(crate) step_tags: BTreeMap<(u32, u64), TagSet>,
    /// The run's part summaries, when read as summaries.
    pub(crate) digest: Option<RunDigest>,
}

/// One run of a location, for messages (and `summary --json`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RunBrief {
    pub id: String,
    pub ranks: usize,
    /// First and last step of its records that were read (`None`: none with a step was read:
    /// a summary read from the per-part summaries reads no other run's records).
    pub steps: Option<(u64, u64)>,
}

impl RunBrief {
    /// `20261125-154958-3fa2 (steps 1-5)`.
    pub fn describe(&self) -> String {
        let id = if self.id.is_empty() {
            "(no run id)"
        } else {
            &self.id
        };
        match self.steps {
            Some((a, b)) if a == b => format!("{id} (step {a})"),
            Some((a, b)) => format!("{id} (steps {a}-{b})"),
            None => id.to_string(),
        }
    }
}

/// The runs a location holds and which one a loaded `Run`'s tables show.
#[derive(Debug, Default, Clone)]
pub struct Runs {
    /// Every run id found, in the order the lowest rank wrote them (oldest first).
    pub(crate) ids: Vec<String>,
    /// The run the tables hold (`None` before the first record).
    pub(crate) current: Option<String>,
    /// The run asked for with `Run::select_run`; otherwise the newest is shown.
    pub(crate) pinned: Option<String>,
    /// The tables of the runs not shown.
    pub(crate) others: HashMap<String, Tables>,
    /// The lowest rank seen and the run of its last merged part: the newest run.
    pub(crate) latest: Option<(u32, String)>,
}

impl Runs {
    /// Every run id found, oldest first.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    /// The run the tables hold.
    pub fn current(&self) -> Option<&str> {
        self.current.as_deref()
    }

    /// The newest run (what is shown unless another was selected).
    pub fn newest(&self) -> Option<&str> {
        self.latest.as_ref().map(|(_, id)| id.as_str())
    }

    /// Whether the location holds more than one run.
    pub fn several(&self) -> bool {
        self.ids.len() > 1
    }

    /// The runs not shown, oldest first.
    pub fn others(&self) -> Vec<RunBrief> {
        self.ids
            .iter()
            .filter(|id| Some(id.as_str()) != self.current())
            .filter_map(|id| Some(brief(id, self.others.get(id)?)))
            .collect()
    }
}

fn brief(id: &str, t: &Tables) -> RunBrief {
    RunBrief {
        id: id.to_string(),
        ranks: t.ranks.len(),
        steps: step_range(&t.spans.step, &t.scalars.step),
    }
}

/// First and last step of the span and scalar records.
pub(crate) fn step_range(spans: &[u64], scalars: &[u64]) -> Option<(u64, u64)> {
    spans
        .iter()
        .chain(scalars)
        .copied()
        .filter(|&s| s != NO_STEP)
        .fold(None, |acc, s| match acc {
            None => Some((s, s)),
            Some((a, b)) => Some((a.min(s), b.max(s))),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_read_as_utc_start_times() {
        // 2026-11-25 15:49:58 UTC.
        let secs = 1_795_621_798u64;
        assert_eq!(
            run_id_from_seed((secs << 16) | 0x3fa2),
            "20261125-154958-3fa2"
        );
        assert_eq!(run_id_from_seed(0), "19700101-000000-0000");
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_ne!(new_run_id(), "");
    }

    /// Run `a` (2 ranks, 4 steps), then run `b` (1 rank, 2 steps) in the same folder: `b` is
    /// shown, with its own world size, until `a` is selected.
    #[test]
    fn the_newest_run_is_shown_and_another_can_be_selected() {
        use crate::synth::{SynthConfig, write_run};
        let dir = tempfile::tempdir().unwrap();
        let (run, later) = (dir.path().join("run"), dir.path().join("later"));
        let cfg = |run_id: &str, ranks, steps| SynthConfig {
            run_id: run_id.into(),
            ranks,
            steps,
            ..Default::default()
        };
        write_run(run.to_str().unwrap(), &cfg("a", 2, 4)).unwrap();
        write_run(later.to_str().unwrap(), &cfg("b", 1, 2)).unwrap();
        // The second launch's part follows the first's in the rank's folder.
        std::fs::rename(
            later.join("obs/rank-0/part-000000.parquet"),
            run.join("obs/rank-0/part-000001.parquet"),
        )
        .unwrap();
        let mut loaded = crate::load(run.to_str().unwrap(), &Default::default()).unwrap();
        assert_eq!(loaded.runs.ids(), ["a", "b"]);
        assert_eq!(loaded.runs.current(), Some("b"));
        assert_eq!(loaded.ranks.len(), 1);
        assert_eq!(loaded.report.world_size, 1);
        assert!(loaded.report.missing_ranks.is_empty());
        assert_eq!(loaded.shown_run().unwrap().steps, Some((1, 2)));
        let others = loaded.runs.others();
        assert_eq!(others.len(), 1);
        assert_eq!(others[0].describe(), "a (steps 1-4)");

        loaded.select_run("a").unwrap();
        assert_eq!(loaded.ranks.len(), 2);
        assert_eq!(loaded.report.world_size, 2);
        assert_eq!(loaded.shown_run().unwrap().steps, Some((1, 4)));
        let err = loaded.select_run("c").unwrap_err();
        assert!(crate::location::is_not_a_run(&err), "{err:#}");
        assert!(format!("{err}").contains("a, b"), "{err}");
    }
}
