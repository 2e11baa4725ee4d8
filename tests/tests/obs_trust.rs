//! titan-obs numbers a user can trust and no silent surprises (issue 27): straggler factors
//! read back as injected; a path that is not a run, a run's `obs/` folder and a misspelt
//! command are usage errors that say what to pass; the phase table does not indent phases it
//! does not sort as a tree.

use std::path::Path;
use std::process::Output;

use titan_tests::{bin, output_text};

fn titan_obs_core(args: &[&str]) -> Output {
    std::process::Command::new(bin("titan-obs"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// (rank, phase, factor) injected into a 16-rank run: two stragglers in the phase the
/// others wait for at the all_reduce, one in a phase after it.
const INJECTED: &[(u32, &str, f64)] = &[
    (3, "forward_backward", 1.4),
    (7, "forward_backward", 1.15),
    (9, "optimizer", 1.8),
];

fn synth(run: &Path, extra: &[String]) {
    let mut args: Vec<String> = [
        "synth",
        run.to_str().unwrap(),
        "--ranks",
        "16",
        "--steps",
        "40",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().cloned());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = titan_obs_core(&refs);
    assert!(o.status.success(), "{}", output_text(&o));
}

#[test]
fn straggler_ratio_and_excess_are_the_injected_factors() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("s");
    let flags: Vec<String> = INJECTED
        .iter()
        .flat_map(|(r, p, f)| ["--straggler".to_string(), format!("{r}:{p}:{f}")])
        .collect();
    synth(&run, &flags);
    let o = titan_obs_core(&["summary", run.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", output_text(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let p50 = |phase: &str| {
        s["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == phase)
            .unwrap()["p50_ns"]
            .as_f64()
            .unwrap()
    };
    for &(rank, phase, factor) in INJECTED {
        let x = s["stragglers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["rank"] == rank && x["phase"] == phase)
            .unwrap_or_else(|| panic!("rank {rank} {phase} not found: {}", s["stragglers"]));
        let ratio = x["median_ratio"].as_f64().unwrap();
        // +-5% jitter on every duration; the median over 40 steps is within 0.03.
        assert!(
            (ratio - factor).abs() < 0.03,
            "rank {rank} {phase}: median_ratio {ratio}, injected {factor}"
        );
        // The excess is the time above the median rank: (factor - 1) x the phase's median,
        // give or take the jitter (2% of the phase).
        let excess = x["median_excess_ns"].as_f64().unwrap();
        let want = (factor - 1.0) * p50(phase);
        assert!(
            (excess - want).abs() < 0.02 * p50(phase),
            "rank {rank} {phase}: median_excess {excess} ns, (factor - 1) x p50 = {want}"
        );
    }
    // The text report shows the same ratio.
    let o = titan_obs_core(&["summary", run.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("forward_backward") && l.contains(" 3 "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("x1.4") || line.contains("x1.39") || line.contains("x1.41"),
        "{line}"
    );
}

#[test]
fn not_a_run_is_a_usage_error_that_says_what_to_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let readme = tmp.path().join("README.md");
    std::fs::write(&readme, "# not a run\n").unwrap();
    let not_json = tmp.path().join("notes.json");
    std::fs::write(&not_json, "not json at all").unwrap();
    for path in [&readme, &not_json] {
        for cmd in [
            &["summary"][..],
            &["metrics"],
            &["export", "--chrome", "x.json"],
        ] {
            let mut args = cmd.to_vec();
            args.insert(1, path.to_str().unwrap());
            let o = titan_obs_core(&args);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {}", output_text(&o));
            let err = stderr(&o);
            assert!(
                err.contains(&path.display().to_string())
                    && err.contains("pass a titan run")
                    && err.contains("structured_logs/"),
                "{args:?}: {err}"
            );
            assert!(
                o.stdout.is_empty(),
                "{args:?}: printed a result for a non-run"
            );
        }
    }

    // A titan run's obs/ folder (or one rank's folder in it): pass the run itself.
    let run = tmp.path().join("demo");
    synth(&run, &[]);
    for inside in [run.join("obs"), run.join("obs/rank-3")] {
        let o = titan_obs_core(&["summary", inside.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
        let err = stderr(&o);
        assert!(
            err.contains(&format!(
                "is inside the titan run {}: pass the run folder itself",
                run.display()
            )),
            "{err}"
        );
    }
}

#[test]
fn a_misspelt_command_is_named_not_taken_for_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("demo");
    synth(&run, &[]);
    let o = titan_obs_core(&["summry", run.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("`summry` is not a command (did you mean `summary`?"),
        "{err}"
    );
    assert!(!err.contains("[RUN]"), "{err}");
    // The real command still works.
    let o = titan_obs_core(&["summary", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", output_text(&o));
}

#[test]
fn phase_table_is_not_indented_like_a_tree_it_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("demo");
    synth(&run, &[]);
    let o = titan_obs_core(&["summary", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", output_text(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let table: Vec<&str> = text
        .split("\nphases (")
        .nth(1)
        .unwrap()
        .lines()
        .skip(3)
        .take_while(|l| !l.is_empty())
        .collect();
    assert!(table.len() > 5, "{text}");
    let mut names = Vec::new();
    for row in &table {
        // Every row starts at the table's own two-space margin, the phase name right after.
        assert!(
            row.starts_with("  ") && !row[2..].starts_with(' '),
            "indented row: `{row}`\n{text}"
        );
        names.push(row.split_whitespace().next().unwrap());
    }
    // The nesting is still there, as a column: forward is 3 deep (step > forward_backward >
    // microbatch > forward).
    let forward = table
        .iter()
        .find(|r| r.split_whitespace().next() == Some("forward"))
        .unwrap();
    assert_eq!(forward.split_whitespace().nth(1), Some("3"), "{forward}");
    assert!(names.contains(&"all_reduce"), "{names:?}");
    // The last column says which clock timed each phase: the host's, in a run without GPU
    // twins.
    for row in &table {
        assert_eq!(row.split_whitespace().last(), Some("host"), "{row}");
    }
}
