//! Figures a user can check by hand (issue 39): on real titan-train runs, what `titan-obs
//! summary` and `titan-obs metrics` print is compared with the same figure computed from the
//! raw records by `tests/python/obs_step_figures.py` (pyarrow over the Parquet parts, none of
//! titan-obs's code) and with the trainer's own console line and `metrics.jsonl`.
//!
//! - the median step is the slowest rank's `step` span, not every top-level span of the step
//!   (FSDP2's background-thread collectives included, it read 826.6 ms against steps of
//!   469-743 ms); the `% step` of depth-0 phases adds up to 100% on the main thread;
//! - under TP2 the step's tokens are counted once (titan-obs said 1024 for 512), and tps is one
//!   number in the console, `metrics.jsonl` and titan-obs;
//! - a rank killed mid-run: the summary names the failure and the rank that ended early;
//! - a folder of Chrome traces from different runs is refused (exit 2), not merged.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use titan_tests::{SMALL_DETERMINISTIC_RUN, bin, output_text as text, run_ok};

fn train(dump: &Path, extra: &[&str]) -> Output {
    run_ok(
        titan_tests::titan_train()
            .args(SMALL_DETERMINISTIC_RUN)
            // Later overrides win: this run records.
            .args(["--observability.enable", "--job.dump_folder"])
            .arg(dump)
            .args(extra),
    )
}

fn titan_obs(args: &[&str]) -> Output {
    Command::new(bin("titan-obs")).args(args).output().unwrap()
}

fn json_of(args: &[&str]) -> Value {
    let o = titan_obs(args);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The figures computed from the parts with pyarrow.
fn by_hand(dump: &Path) -> Value {
    let o = run_ok(
        titan_tests::python_script("tests/python/obs_step_figures.py").arg(dump.to_str().unwrap()),
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The value of `key` in each `titan-obs metrics --json` line with a step, by step.
fn metric(lines: &Value, key: &str) -> Vec<(u64, f64)> {
    lines
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["validation"] == false)
        .filter_map(|l| Some((l["step"].as_u64()?, f(l["values"].get(key)?))))
        .collect()
}

#[test]
fn fsdp2_median_step_is_the_step_span_and_shares_stay_within_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("fsdp2");
    train(&dump, &["--training.steps", "6", "--nproc-per-node", "2"]);
    let hand = by_hand(&dump);
    // FSDP2 on 2 ranks runs collectives on background threads: the case that inflated it.
    assert!(f(&hand["background_ns"]) > 0.0, "{hand}");
    assert!((f(&hand["depth0_share"]) - 1.0).abs() < 1e-12, "{hand}");
    let d = dump.to_str().unwrap();
    for extra in [&[][..], &["--exact"][..]] {
        let s = json_of(&[&["summary", "--json", d], extra].concat());
        // Exact: sums of integer durations, from the summaries or from the spans.
        assert_eq!(
            f(&s["median_step_ns"]),
            f(&hand["median_step_ns"]).trunc(),
            "{extra:?}: {hand}"
        );
        let depth0: f64 = s["phases"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["depth"] == 0)
            .filter_map(|p| p["share_of_step"].as_f64())
            .sum();
        assert!(
            depth0 <= 1.0 + 1e-9,
            "{extra:?}: depth-0 shares add to {depth0}"
        );
        // The background threads' time is there, apart.
        assert!(
            s["phases"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["concurrent_share_of_step"]
                    .as_f64()
                    .is_some_and(|c| c > 0.0)),
            "{extra:?}: {s:#}"
        );
        assert_eq!(s["errors"], 0);
        assert!(s["ended_early"].as_array().unwrap().is_empty(), "{s:#}");
    }
}

#[test]
fn tp2_tokens_count_once_and_tps_is_one_number_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("tp2");
    let out = train(
        &dump,
        &[
            "--training.steps",
            "4",
            "--nproc-per-node",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    );
    let hand = by_hand(&dump);
    let jsonl = titan_tests::metrics(&dump, "train");
    let lines = json_of(&["metrics", "--json", dump.to_str().unwrap()]);
    let tokens = metric(&lines, "training/tokens_sum");
    let tps = metric(&lines, "trainer_throughput/tps_mean");
    assert_eq!(tokens.len(), jsonl.len(), "{lines:#}");
    // One data-parallel rank of local_batch_size 2 x seq_len 64: the labels of 128 inputs.
    for (line, ((step, t), (_, tps))) in jsonl.iter().zip(tokens.iter().zip(&tps)) {
        assert_eq!(line["step"].as_u64(), Some(*step));
        let trained = line["tokens"].as_f64().unwrap();
        assert!(trained > 0.0 && trained <= 128.0, "{line}");
        assert_eq!(
            *t, trained,
            "step {step}: titan-obs tokens_sum vs metrics.jsonl"
        );
        assert_eq!(
            *t,
            f(&hand["tokens"][step.to_string()]),
            "step {step}: by hand"
        );
        // tps: the mean over both ranks in the console/jsonl, the records and titan-obs.
        let recorded = f(&hand["tps"][step.to_string()]);
        let logged = line["tps"].as_f64().unwrap();
        assert!(
            (logged - recorded).abs() <= 1e-9 * recorded,
            "{logged} vs {recorded}"
        );
        assert!(
            (tps - recorded).abs() <= 1e-9 * recorded,
            "{tps} vs {recorded}"
        );
    }
    // The console line says the same (to its one decimal).
    let console =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    for line in &jsonl {
        let want = format!(
            "trainer_throughput/tps_mean: {:.1}",
            line["tps"].as_f64().unwrap()
        );
        assert!(console.contains(&want), "{want} not in:\n{console}");
    }
}

#[test]
fn a_killed_rank_is_named_in_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("killed");
    let mut launcher = titan_tests::titan_train()
        .args(SMALL_DETERMINISTIC_RUN)
        .args(["--observability.enable", "--job.dump_folder"])
        .arg(&dump)
        .args(["--training.steps", "100000", "--nproc-per-node", "2"])
        .args(["--observability.flush_interval_s", "0.2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a few logged steps, then SIGKILL rank 1.
    let rank1 = titan_tests::running_rank(&mut launcher, "1", Duration::from_secs(180), || {
        logged_steps(&dump) >= 3
    });
    assert!(
        Command::new("kill")
            .args(["-9", &rank1.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let out = launcher.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));

    let hand = by_hand(&dump);
    let s = json_of(&["summary", "--json", dump.to_str().unwrap()]);
    // Every error record is named with its message (a rank 0 whose collective failed
    // records a `job_failure`; under the launcher it is usually stopped first).
    let errors = s["error_records"].as_array().unwrap();
    let recorded: usize = hand["errors"]
        .as_object()
        .unwrap()
        .values()
        .map(|m| m.as_array().unwrap().len())
        .sum();
    assert_eq!(s["errors"].as_u64().unwrap() as usize, recorded, "{s:#}");
    assert_eq!(errors.len(), recorded, "{s:#}");
    // Whoever ended at an earlier step than the other is named, at the step the records say.
    let last: Vec<(u32, u64)> = hand["last_step"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(r, s)| (r.parse().unwrap(), s.as_u64().unwrap()))
        .collect();
    let run_last = last.iter().map(|l| l.1).max().unwrap();
    let early: Vec<(u32, u64)> = last.iter().copied().filter(|l| l.1 < run_last).collect();
    let said: Vec<(u32, u64)> = s["ended_early"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["rank"].as_u64().unwrap() as u32,
                e["last_step"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(said, early, "{s:#}");
    // Whether the killed rank's records end earlier depends on when its last flush was: when
    // they reach the step rank 0 is stuck in, nobody ended early, and the summary says so.
    if !early.is_empty() {
        let table = text(&titan_obs(&["summary", dump.to_str().unwrap()]));
        assert!(table.contains("ended early: rank"), "{table}");
    }
}

/// The logged steps in `dump/metrics.jsonl` so far.
fn logged_steps(dump: &Path) -> usize {
    std::fs::read_to_string(dump.join("metrics.jsonl"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn chrome_traces_of_two_runs_are_refused_not_merged() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces");
    std::fs::create_dir(&traces).unwrap();
    for (i, seed) in ["1", "2"].iter().enumerate() {
        let run = dir.path().join(format!("run{i}"));
        run_ok(Command::new(bin("titan-obs")).args([
            "synth",
            run.to_str().unwrap(),
            "--ranks",
            "2",
            "--steps",
            "3",
            "--seed",
            seed,
        ]));
        let trace = traces.join(format!("run{i}.json"));
        run_ok(Command::new(bin("titan-obs")).args([
            "export",
            run.to_str().unwrap(),
            "--chrome",
            trace.to_str().unwrap(),
        ]));
        // One trace alone is one 2-rank run.
        let s = json_of(&["summary", "--json", trace.to_str().unwrap()]);
        assert_eq!(s["ranks"], 2, "{s:#}");
    }
    let o = titan_obs(&["summary", traces.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("more than one run"), "{err}");
    assert!(
        err.contains("run0.json") && err.contains("run1.json"),
        "{err}"
    );
}
