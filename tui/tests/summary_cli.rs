//! `titan-obs summary` of a pipeline run: the pipeline section from the per-part summaries
//! (each stage's passes and windows) as `--exact` has it, and stragglers found among the
//! ranks of each stage.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::write_pipeline_run;

fn summary_json(run: &str, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(["summary", run, "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The pipeline section from the summaries against `--exact`'s: the same but for the
/// per-microbatch pass medians, which come from the sketches (within their 1%).
fn same_pipeline(fast: &serde_json::Value, exact: &serde_json::Value) {
    let (mut f, mut e) = (fast["pipeline"].clone(), exact["pipeline"].clone());
    assert!(f.is_object(), "{fast}");
    let stages = |v: &mut serde_json::Value| v["per_stage"].as_array_mut().unwrap().clone();
    for (a, b) in stages(&mut f).iter().zip(stages(&mut e).iter()) {
        for k in ["forward_ns", "backward_ns"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!((x - y).abs() <= 0.01 * y + 1.0, "{k}: {x} vs {y}");
        }
    }
    for v in [&mut f, &mut e] {
        for st in v["per_stage"].as_array_mut().unwrap() {
            st["forward_ns"] = serde_json::Value::Null;
            st["backward_ns"] = serde_json::Value::Null;
        }
    }
    assert_eq!(f, e);
}

#[test]
fn a_pipeline_run_has_the_same_pipeline_section_from_summaries() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Two pipeline ranks (stages 0 and 1), 4 steps; stage 1 is slower.
    write_pipeline_run(run_s, &[(0, 0, 1.0), (1, 1, 1.0)], 4);
    let fast = summary_json(run_s, &[]);
    let exact = summary_json(run_s, &["--exact"]);
    same_pipeline(&fast, &exact);
    assert_eq!(fast["spans"], exact["spans"]);
}

/// Under PP a rank is compared with the ranks of its own stage: the slow data-parallel
/// replica of stage 1 is named, stage 1 itself (twice stage 0's passes by design) is not.
#[test]
fn a_slow_replica_of_a_stage_is_a_straggler_and_a_slower_stage_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    // Stage 0 on ranks 0 and 1, stage 1 on ranks 2 and 3; rank 3's passes 1.5x.
    write_pipeline_run(
        run_s,
        &[(0, 0, 1.0), (1, 0, 1.0), (2, 1, 1.0), (3, 1, 1.5)],
        12,
    );
    for extra in [&[][..], &["--exact"][..]] {
        let s = summary_json(run_s, extra);
        let named: Vec<(String, u64)> = s["stragglers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x["phase"].as_str().unwrap().to_string(),
                    x["rank"].as_u64().unwrap(),
                )
            })
            .collect();
        assert!(
            named.contains(&("forward".into(), 3)),
            "{extra:?}: {named:?}"
        );
        assert!(
            named.contains(&("backward".into(), 3)),
            "{extra:?}: {named:?}"
        );
        assert!(named.iter().all(|(_, r)| *r == 3), "{extra:?}: {named:?}");
    }
    let fast = summary_json(run_s, &[]);
    let exact = summary_json(run_s, &["--exact"]);
    assert_eq!(fast["stragglers"], exact["stragglers"]);
    same_pipeline(&fast, &exact);
}

/// Issue 42: `--node-figures on` reads the nodes' figures files (2 for 16 ranks) and says so;
/// `auto` leaves a run this small to the rank summaries; a pipeline run is read from the rank
/// summaries whatever is asked, with a warning naming why.
#[test]
fn node_figures_are_read_when_asked_and_not_for_pipelines() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 16,
        steps: 12,
        spans_per_step: 12,
        steps_per_part: 5,
        ..Default::default()
    };
    titan_obs_core::synth::write_run(run_s, &cfg).unwrap();
    let on = summary_json(run_s, &["--node-figures", "on"]);
    assert_eq!(on["node_figures"]["nodes"], 2, "{}", on["node_figures"]);
    assert_eq!(on["node_figures"]["ranks_from_folders"], 0);
    let auto = summary_json(run_s, &[]);
    assert!(auto["node_figures"].is_null());
    for k in ["ranks", "steps", "spans", "median_step_ns", "waits"] {
        assert_eq!(on[k], auto[k], "{k}");
    }
    // A step's tags come in name order from the figures, in the run's order otherwise.
    let tagged = |v: &serde_json::Value| {
        let mut t = v["tagged_steps"].clone();
        for s in t.as_array_mut().unwrap() {
            s["tags"]
                .as_array_mut()
                .unwrap()
                .sort_by_key(|x| x.to_string());
        }
        t
    };
    assert_eq!(tagged(&on), tagged(&auto));
    let text = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(["summary", run_s, "--node-figures", "on"])
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("read from node figures: 2 nodes' files"),
        "{text}"
    );
    assert!(!text.contains("live:"), "{text}");
    // A live rank (its next journal open): still read from the figures, and said.
    let journal = run.join("obs/rank-3/journal-000003.arrows");
    std::fs::write(&journal, b"appended").unwrap();
    let live = summary_json(run_s, &["--node-figures", "on"]);
    assert_eq!(live["node_figures"]["nodes"], 2, "{}", live["node_figures"]);
    assert_eq!(live["node_figures"]["open_journals"], 1);
    let text = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(["summary", run_s, "--node-figures", "on"])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("live: the open journals of 1 rank(s) not read"),
        "{text}"
    );
    std::fs::remove_file(&journal).unwrap();

    // `on` with a flag the figures cannot honour is a usage error naming both.
    for flag in [
        &["--exact"][..],
        &["--no-clock-align"],
        &["--run", "synthetic"],
    ] {
        let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
            .args(["summary", run_s, "--node-figures", "on"])
            .args(flag)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--node-figures on cannot go with") && err.contains(flag[0]),
            "{err}"
        );
    }

    let pp = dir.path().join("pp");
    let pp_s = pp.to_str().unwrap();
    write_pipeline_run(pp_s, &[(0, 0, 1.0), (1, 1, 1.0)], 4);
    let out = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_titan-obs")))
        .args(["summary", pp_s, "--json", "--node-figures", "on"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["node_figures"].is_null() && v["pipeline"].is_object());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not read from node figures (damaged parts or pipeline schedules)"),
        "{err}"
    );
}
