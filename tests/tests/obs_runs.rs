//! Two launches of titan-train in one dump folder are two runs, on the real binaries: every
//! metrics.jsonl line and every titan-obs record names its run; `titan-obs` shows the newest,
//! says which others there are and picks one with `--run ID`; a resume from a checkpoint
//! continues its run's id.

use std::path::Path;
use std::process::{Command, Output};

use titan_tests::{SMALL_DETERMINISTIC_RUN, bin, output_text as text};

fn titan_train(dump: &Path, extra: &[&str]) -> Output {
    let o = titan_tests::titan_train()
        .args(SMALL_DETERMINISTIC_RUN)
        // Later overrides win: this run records.
        .args(["--observability.enable", "--job.dump_folder"])
        .arg(dump)
        .args(extra)
        .output()
        .expect("run titan-train");
    assert!(o.status.success(), "titan-train failed:\n{}", text(&o));
    o
}

fn titan_obs_core(args: &[&str]) -> Output {
    Command::new(bin("titan-obs")).args(args).output().unwrap()
}

/// (step, run_id) of the `train` lines of metrics.jsonl.
fn metric_runs(dump: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(dump.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| {
            let id = v["run_id"].as_str().expect("every line names its run");
            (v["step"].as_u64().unwrap(), id.to_string())
        })
        .collect()
}

/// `titan-obs summary --json` of `dump` (with `extra` arguments): the JSON, and stderr.
fn summary_json(dump: &Path, extra: &[&str]) -> (serde_json::Value, String) {
    let o = titan_obs_core(&[&["summary", "--json", dump.to_str().unwrap()], extra].concat());
    assert!(o.status.success(), "{}", text(&o));
    (
        serde_json::from_slice(&o.stdout).unwrap(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `titan-obs summary --json` of `dump` (with `extra` arguments): steps, and stderr.
fn summary_steps(dump: &Path, extra: &[&str]) -> (u64, String) {
    let (s, err) = summary_json(dump, extra);
    (s["steps"].as_u64().unwrap(), err)
}

#[test]
fn two_launches_in_one_folder_are_two_runs() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("run");
    titan_train(&dump, &["--training.steps", "5"]);
    let o = titan_train(&dump, &["--training.steps", "3"]);

    let lines = metric_runs(&dump);
    assert_eq!(
        lines.iter().map(|l| l.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 1, 2, 3]
    );
    let (first, second) = (lines[0].1.clone(), lines[5].1.clone());
    assert_ne!(first, second, "each launch is a run of its own");
    assert!(lines[..5].iter().all(|l| l.1 == first), "{lines:?}");
    assert!(lines[5..].iter().all(|l| l.1 == second), "{lines:?}");
    assert!(
        text(&o).contains(&format!("(run {second})")),
        "{}",
        text(&o)
    );

    // The newest run by default, naming the other and the flag that picks it.
    let (steps, err) = summary_steps(&dump, &[]);
    assert_eq!(steps, 3, "{err}");
    assert!(
        err.contains(&second) && err.contains(&first) && err.contains("--run"),
        "{err}"
    );
    let (steps, _) = summary_steps(&dump, &["--run", &first]);
    assert_eq!(steps, 5);
    // Scripts read the same from the JSON: the run summarised and the others.
    let (s, _) = summary_json(&dump, &[]);
    assert_eq!(s["run_id"], second.as_str(), "{s:#}");
    let others = s["other_runs"].as_array().unwrap();
    assert_eq!(others.len(), 1, "{s:#}");
    assert_eq!(others[0]["id"], first.as_str(), "{s:#}");
    let o = titan_obs_core(&["metrics", "--json", dump.to_str().unwrap(), "--run", &first]);
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(m.as_array().unwrap().len(), 5, "{}", text(&o));

    // The gantt draws the newest run, or the one --run names.
    let svg = dir.path().join("g.svg");
    for (pick, steps) in [(None, 3), (Some(first.as_str()), 5)] {
        let mut args = vec![
            "gantt",
            dump.to_str().unwrap(),
            "--svg",
            svg.to_str().unwrap(),
        ];
        args.extend(pick.map(|id| ["--run", id]).into_iter().flatten());
        let o = titan_obs_core(&args);
        assert!(o.status.success(), "{}", text(&o));
        let image = std::fs::read_to_string(&svg).unwrap();
        assert!(
            image.contains(&format!("{steps} steps")),
            "{pick:?}: {}",
            &image[..400]
        );
    }
    let o = titan_obs_core(&[
        "gantt",
        dump.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--run",
        "nope",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    // An id the folder does not hold is a usage error naming the runs it does hold.
    let o = titan_obs_core(&["summary", dump.to_str().unwrap(), "--run", "nope"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&first) && err.contains(&second), "{err}");
}

#[test]
fn a_resumed_run_keeps_its_run_id() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("run");
    let ckpt = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only=false",
    ];
    titan_train(&dump, &[&["--training.steps", "4"], &ckpt[..]].concat());
    let o = titan_train(&dump, &[&["--training.steps", "6"], &ckpt[..]].concat());
    assert!(text(&o).contains("resumed from checkpoint"), "{}", text(&o));

    let lines = metric_runs(&dump);
    assert_eq!(
        lines.iter().map(|l| l.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    assert!(lines.iter().all(|l| l.1 == lines[0].1), "{lines:?}");
    // One run of 6 steps: nothing to choose between.
    let (steps, err) = summary_steps(&dump, &[]);
    assert_eq!(steps, 6, "{err}");
    assert!(!err.contains("--run"), "{err}");
}
