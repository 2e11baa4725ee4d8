//! titan-train's console on the real binary: piped, its lines fit in 100 columns and carry no
//! colour codes; on a terminal (a pty from `script`), a live step counter is drawn between the
//! log lines without breaking them, and under the launcher (`--nproc-per-node 2`) the launcher
//! draws rank 0's counter from the steps rank 0 reports.

use std::process::Command;

use titan_tests::{SMALL_DETERMINISTIC_RUN, bin, output_text as text};

const STEPS: &[&str] = &["--training.steps", "3", "--observability.enable"];

#[test]
fn piped_output_fits_100_columns_without_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let o = titan_tests::titan_train()
        .args(SMALL_DETERMINISTIC_RUN)
        .args(STEPS)
        .arg("--job.dump_folder")
        .arg(dir.path().join("run"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let all = text(&o);
    assert!(
        !all.contains("\x1b["),
        "colour codes in piped output:\n{all}"
    );
    for line in all.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.chars().count()
        );
    }
    // The metrics lines are wrapped, not cut: every value is still there.
    assert!(all.contains("INFO step:  3  training/loss_mean:"), "{all}");
    assert!(all.contains("trainer_throughput/mfu_pct_mean:"), "{all}");
    // No step counter without a terminal.
    assert!(!all.contains("step 1/3"), "{all}");
}

#[test]
fn a_terminal_shows_a_step_counter_between_intact_log_lines() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: `script` (util-linux) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let dump = dir.path().join("run");
    let command: Vec<String> = [bin("titan-train").to_str().unwrap()]
        .iter()
        .chain(SMALL_DETERMINISTIC_RUN)
        .chain(STEPS)
        .chain(&["--job.dump_folder", dump.to_str().unwrap()])
        .map(|a| quote(a))
        .collect();
    let on_a_terminal = |extra: &str| {
        let o = Command::new("script")
            .args([
                "-qec",
                &format!("{} {extra}", command.join(" ")),
                "/dev/null",
            ])
            .current_dir(titan_tests::workspace_root())
            .env("TERM", "xterm")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // -q: no progress bars, as in every titan tool.
    let quiet = on_a_terminal("-q");
    assert!(!quiet.contains("/3 ["), "{quiet}");
    let tty = on_a_terminal("");
    assert!(
        tty.contains("/3 [") && tty.contains(" step "),
        "no step counter on the terminal:\n{tty}"
    );
    // Under the launcher rank 0's stderr is a pipe: it reports its steps and the launcher,
    // on the terminal, draws the counter (the events themselves never show).
    let launched = on_a_terminal("--nproc-per-node 2");
    assert!(
        launched.contains("/3 [") && launched.contains(" step "),
        "no step counter under the launcher:\n{launched}"
    );
    assert!(!launched.contains("titan-steps"), "{launched}");
    assert!(launched.contains("[rank0]:"), "{launched}");
    // Log lines print whole above the counter: the counter's clearing never lands inside one.
    let logged = tty
        .split("\r\n")
        .filter(|l| l.contains("training/loss_mean:"))
        .count();
    assert!(logged >= 2, "{tty}");
    for line in tty.split("\r\n").filter(|l| l.contains("INFO")) {
        let from_info = &line[line.find("INFO").unwrap()..];
        assert!(
            !from_info.contains("\x1b[2K"),
            "a log line was broken: {line:?}"
        );
    }
}
