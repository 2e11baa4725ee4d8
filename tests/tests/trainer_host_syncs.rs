//! Issue 35: a titan-train step that does not log reads nothing from the device to the host
//! (torchtitan's loop reads the loss and the grad norm only on the steps it logs; each read is
//! a wait for the GPU, and the host can no longer run ahead of it), and data loading is a small
//! part of a step on the training thread.
//!
//! On CPU runs, one process and several (FSDP2, pipeline), `titan-obs summary --json`'s
//! `host_syncs` (from the trainer's per-step `trainer/host_syncs` scalar) is checked against the
//! same figures computed from the raw Parquet records by `tests/python/host_syncs_by_hand.py`
//! (pyarrow, none of titan-obs's code): 0 on every step that did not log, at least the loss and
//! grad norm reads on every step that did.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use titan_tests::{SMALL_DETERMINISTIC_RUN, bin, output_text as text, run_ok};

/// Trains `steps` steps logging every `log_freq`-th (and the first and last), recording.
fn train(dump: &Path, steps: u32, log_freq: u32, extra: &[&str]) {
    run_ok(
        titan_tests::titan_train()
            .args(SMALL_DETERMINISTIC_RUN)
            // Later overrides win.
            .args(["--observability.enable", "--job.dump_folder"])
            .arg(dump)
            .args(["--training.steps", &steps.to_string()])
            .args(["--metrics.log_freq", &log_freq.to_string()])
            .args(extra),
    );
}

fn summary(dump: &Path, exact: bool) -> Value {
    let mut args = vec!["summary", "--json", dump.to_str().unwrap()];
    if exact {
        args.push("--exact");
    }
    let o = Command::new(bin("titan-obs")).args(&args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn by_hand(dump: &Path) -> Value {
    let o = run_ok(
        titan_tests::python_script("tests/python/host_syncs_by_hand.py")
            .arg(dump.to_str().unwrap()),
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Checks one recorded run: every step counted, none but the logging ones read anything, the
/// summary says what the records say, data loading stays small.
fn check(dump: &Path, steps: u64, log_steps: &[u64]) {
    let hand = by_hand(dump);
    let syncs = hand["syncs"].as_object().unwrap();
    assert_eq!(syncs.len() as u64, steps, "a count for every step: {hand}");
    let logged: Vec<u64> = hand["log_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert_eq!(logged, log_steps, "{hand}");
    for (step, n) in syncs {
        let step: u64 = step.parse().unwrap();
        if log_steps.contains(&step) {
            // At least the loss and the grad norm are read where they are logged.
            assert!(f(n) >= 2.0, "step {step} logged with {n} reads: {hand}");
        } else {
            assert_eq!(
                f(n),
                0.0,
                "step {step} did not log but read the device: {hand}"
            );
        }
    }
    let mut other: Vec<f64> = Vec::new();
    let mut at_log: Vec<f64> = Vec::new();
    for (step, n) in syncs {
        let step: u64 = step.parse().unwrap();
        if log_steps.contains(&step) {
            at_log.push(f(n))
        } else {
            other.push(f(n))
        }
    }
    let max = |v: &[f64]| v.iter().copied().fold(0.0f64, f64::max);
    for exact in [false, true] {
        let s = summary(dump, exact);
        let h = &s["host_syncs"];
        assert_eq!(h["steps"].as_u64(), Some(steps), "{exact}: {h}");
        assert_eq!(h["log_steps"].as_u64(), Some(log_steps.len() as u64), "{h}");
        assert_eq!(f(&h["other_steps_max"]), max(&other), "{exact}: {h}");
        assert_eq!(f(&h["log_steps_max"]), max(&at_log), "{exact}: {h}");
        assert_eq!(f(&h["max"]), max(&at_log).max(max(&other)), "{exact}: {h}");
    }
    // Packing a few documents is a sliver of a step; the median step allows a loaded machine's
    // outliers.
    let mut shares: Vec<f64> = hand["data_loading_share"]
        .as_object()
        .unwrap()
        .values()
        .map(f)
        .collect();
    shares.sort_by(f64::total_cmp);
    let median = shares[shares.len() / 2];
    assert!(
        median <= 0.05,
        "data loading takes {:.1}% of the median step: {hand}",
        median * 100.0
    );
}

#[test]
fn one_process_reads_the_device_only_on_steps_that_log() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("one");
    train(&dump, 7, 3, &[]);
    check(&dump, 7, &[1, 3, 6, 7]);
    // `metrics` lines stay the logged steps' only: the counter is the summary's.
    let o = Command::new(bin("titan-obs"))
        .args(["metrics", "--json", dump.to_str().unwrap()])
        .output()
        .unwrap();
    let lines: Value = serde_json::from_slice(&o.stdout).unwrap();
    let steps: Vec<u64> = lines
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 3, 6, 7], "{lines:#}");
}

#[test]
fn fsdp2_and_pipeline_ranks_read_the_device_only_on_steps_that_log() {
    let dir = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("fsdp2", &["--nproc-per-node", "2"][..]),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ][..],
        ),
    ] {
        let dump = dir.path().join(name);
        train(&dump, 5, 2, extra);
        check(&dump, 5, &[1, 2, 4, 5]);
    }
}
