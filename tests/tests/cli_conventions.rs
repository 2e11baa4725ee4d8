//! The CLI conventions titan-train, titan-ckpt and titan-obs share (the titan-cli crate):
//! every `--help` lists that binary's exit codes and how logging works, errors read
//! `<binary>: error: ...`, `RUST_LOG` turns on debug logs, and titan-obs's `--strict` exit
//! code and `-q` hold for `gantt` as for the analysis commands.

use std::path::Path;
use std::process::{Command, Output};

use titan_tests::{bin, titan_ckpt, titan_train};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn titan_obs_core() -> Command {
    let mut c = Command::new(bin("titan-obs"));
    c.env_remove("RUST_LOG");
    c
}

/// A help text's exit-code table: `(code, meaning)` rows between the "Exit codes:" line and
/// the next blank line (a meaning wrapped onto more lines is joined).
fn exit_codes(help: &str) -> Vec<(u8, String)> {
    let lines = help
        .lines()
        .skip_while(|l| l.trim() != "Exit codes:")
        .skip(1);
    let mut rows: Vec<(u8, String)> = Vec::new();
    for l in lines.take_while(|l| !l.trim().is_empty()) {
        let (first, rest) = l.trim().split_once(' ').unwrap_or((l.trim(), ""));
        match (first.parse(), rows.last_mut()) {
            (Ok(code), _) => rows.push((code, rest.trim().to_string())),
            (Err(_), Some(row)) => {
                row.1.push(' ');
                row.1.push_str(l.trim());
            }
            (Err(_), None) => panic!("exit-code table starts with {l:?}"),
        }
    }
    rows
}

fn codes(help: &str) -> Vec<u8> {
    exit_codes(help).into_iter().map(|(c, _)| c).collect()
}

#[test]
fn every_help_lists_its_exit_codes_and_logging() {
    let obs = titan_obs_core().arg("--help").output().unwrap();
    assert!(obs.status.success());
    let ckpt = titan_ckpt().arg("--help").output().unwrap();
    assert!(ckpt.status.success());
    let train = titan_train().arg("--help").output().unwrap();
    assert!(train.status.success());

    let obs = stdout(&obs);
    assert_eq!(codes(&obs), [0, 1, 2, 3], "{obs}");
    assert!(exit_codes(&obs)[3].1.contains("--strict"), "{obs}");
    let ckpt = stdout(&ckpt);
    assert_eq!(codes(&ckpt), [0, 1, 2, 3], "{ckpt}");
    assert!(exit_codes(&ckpt)[1].1.contains("diff found differences"));
    assert!(exit_codes(&ckpt)[3].1.contains("verify --strict"), "{ckpt}");
    let train = stdout(&train);
    assert_eq!(codes(&train), [0, 1, 2, 130, 143], "{train}");
    assert!(
        exit_codes(&train)[1]
            .1
            .contains("first failing rank's code")
    );
    for help in [&obs, &ckpt, &train] {
        let words = help.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            words.contains("-v info, -vv debug, -q errors only"),
            "{help}"
        );
        assert!(words.contains("RUST_LOG"), "{help}");
    }
}

#[test]
fn errors_name_the_binary_and_usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let missing = missing.to_str().unwrap();

    let o = titan_obs_core()
        .args(["summary", missing])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("titan-obs: error: "),
        "{}",
        stderr(&o)
    );

    let o = titan_obs_core().args(["gantt", missing]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("titan-obs: error: gantt: nothing to write"),
        "{}",
        stderr(&o)
    );

    let o = titan_ckpt().args(["inspect", missing]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("titan-ckpt: error: "),
        "{}",
        stderr(&o)
    );

    let o = titan_train()
        .args(["--training.no_such_key", "1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.starts_with("titan-train: error: "), "{err}");
    assert!(err.contains("training.no_such_key"), "{err}");
    assert!(err.contains("run `titan-train --help`"), "{err}");

    // -v and -q contradict each other, in every binary.
    let o = titan_obs_core()
        .args(["-v", "-q", "summary", missing])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = titan_ckpt()
        .args(["-v", "-q", "inspect", missing])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = titan_train().args(["-v", "-q"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).starts_with("titan-train: error: -v and -q"));
}

/// A 4-rank synthetic run with the second part of rank 1 cut in half.
fn run_with_corrupt_part(dir: &Path) -> (String, String) {
    let run = dir.join("run");
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 4,
        steps: 12,
        spans_per_step: 6,
        steps_per_part: 4,
        ..Default::default()
    };
    titan_obs_core::synth::write_run(run.to_str().unwrap(), &cfg).unwrap();
    let bad = run.join("obs/rank-1/part-000001.parquet");
    let bytes = std::fs::read(&bad).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    (run.to_str().unwrap().to_string(), bad.display().to_string())
}

#[test]
fn gantt_strict_exits_3_on_a_corrupt_part_after_writing_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let (run, bad) = run_with_corrupt_part(dir.path());
    let svg = dir.path().join("g.svg");
    let svg_s = svg.to_str().unwrap();

    let o = titan_obs_core()
        .args(["gantt", &run, "--svg", svg_s, "--strict"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("titan-obs: warning: corrupt part {bad}")),
        "{err}"
    );
    assert!(err.contains("wrote "), "{err}");
    let image = std::fs::read_to_string(&svg).unwrap();
    assert!(
        image.starts_with("<svg") || image.starts_with("<?xml"),
        "{image:.80}"
    );

    // Without --strict the same run is a success; -q drops the `wrote` line, not the warning.
    std::fs::remove_file(&svg).unwrap();
    let o = titan_obs_core()
        .args(["gantt", &run, "--svg", svg_s, "-q"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("titan-obs: warning: corrupt part"), "{err}");
    assert!(!err.contains("wrote "), "{err}");
    assert!(svg.exists());

    // The analysis commands agree: --strict exits 3 after printing.
    let o = titan_obs_core()
        .args(["summary", &run, "--strict", "--quiet"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stdout(&o).contains("step"), "{}", stdout(&o));
}

#[test]
fn rust_log_turns_on_titan_obs_debug_logs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let cfg = titan_obs_core::synth::SynthConfig {
        ranks: 2,
        steps: 4,
        spans_per_step: 4,
        steps_per_part: 4,
        ..Default::default()
    };
    titan_obs_core::synth::write_run(run.to_str().unwrap(), &cfg).unwrap();
    let run = run.to_str().unwrap();

    let debug_line = "read ";
    let o = titan_obs_core()
        .env("RUST_LOG", "debug")
        .args(["summary", run])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let line = err
        .lines()
        .find(|l| l.contains("DEBUG") && l.contains(debug_line))
        .unwrap_or_else(|| panic!("no debug line in {err}"));
    assert!(line.contains("2 ranks"), "{line}");

    // The old variable is gone, and the default level hides debug lines; -vv shows them.
    let o = titan_obs_core()
        .env("TITAN_LOG", "debug")
        .args(["summary", run])
        .output()
        .unwrap();
    assert!(!stderr(&o).contains("DEBUG"), "{}", stderr(&o));
    let o = titan_obs_core()
        .args(["summary", run, "-vv"])
        .output()
        .unwrap();
    assert!(stderr(&o).contains("DEBUG"), "{}", stderr(&o));
}
