//! titan-train checkpoint/resume end to end on the real binary:
//! - 20 steps straight vs 10 steps + resume + 10 steps: bit-identical losses and grad norms;
//! - a save killed with SIGKILL before its commit never becomes a checkpoint: the next start
//!   resumes from the previous complete one and still reproduces the straight run;
//! - `keep_latest_k` purges old checkpoints; `load_step` picks one; bad keys are named;
//! - a checkpoint with the names titan-train wrote before torchtitan 0.3.0's (`attention.wq`,
//!   `output`; rewritten by torch's DCP) resumes and reproduces the straight run exactly.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use titan_tests::{output_text as text, small_run};

fn titan_train(dump: &Path, extra: &[&str]) -> Output {
    small_run(dump, extra).output().expect("run titan-train")
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "titan-train failed:\n{}", text(&o));
    o
}

/// (step, loss, grad_norm) of the `train` lines of metrics.jsonl, as written (shortest
/// round-trip decimals: equal strings are equal f64 bits).
fn losses(dump: &Path) -> Vec<(u64, String, String)> {
    let body = std::fs::read_to_string(dump.join("metrics.jsonl")).expect("metrics.jsonl");
    body.lines()
        .filter(|l| l.contains("\"kind\":\"train\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let field = |k: &str| {
                let key = format!("\"{k}\":");
                let start = l.find(&key).unwrap() + key.len();
                l[start..].split([',', '}']).next().unwrap().to_string()
            };
            (
                v["step"].as_u64().unwrap(),
                field("loss"),
                field("grad_norm"),
            )
        })
        .collect()
}

fn complete_steps(dump: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dump.join("checkpoint"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().join(".metadata").is_file())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

const CKPT: &[&str] = &[
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
    "--checkpoint.last_save_model_only=false",
];

#[test]
fn resume_reproduces_the_straight_run_exactly() {
    let straight = tempfile::tempdir().unwrap();
    ok(titan_train(straight.path(), &["--training.steps", "20"]));
    let reference = losses(straight.path());
    assert_eq!(reference.len(), 20);

    let split = tempfile::tempdir().unwrap();
    ok(titan_train(
        split.path(),
        &[&["--training.steps", "10"], CKPT].concat(),
    ));
    assert_eq!(complete_steps(split.path()), vec![5, 10]);
    assert_eq!(losses(split.path())[..], reference[..10]);
    let o = ok(titan_train(
        split.path(),
        &[&["--training.steps", "20"], CKPT].concat(),
    ));
    assert!(text(&o).contains("resumed from checkpoint"), "{}", text(&o));
    // metrics.jsonl is appended: the resumed run's lines follow the first run's.
    let resumed = losses(split.path())[10..].to_vec();
    assert_eq!(losses(split.path()), reference);
    assert_eq!(
        resumed.first().map(|r| r.0),
        Some(11),
        "resume starts after step 10"
    );
    assert_eq!(
        resumed[..],
        reference[10..],
        "losses after resume differ from the straight run"
    );
    assert_eq!(complete_steps(split.path()), vec![5, 10, 15, 20]);

    // load_step picks an older checkpoint; keep_latest_k purges the rest after the next save.
    let before = losses(split.path()).len();
    let o = ok(titan_train(
        split.path(),
        &[
            &[
                "--training.steps",
                "20",
                "--checkpoint.load_step",
                "15",
                "--checkpoint.keep_latest_k",
                "2",
            ],
            CKPT,
        ]
        .concat(),
    ));
    assert!(text(&o).contains("step-15"), "{}", text(&o));
    assert_eq!(losses(split.path())[before..], reference[15..]);
    assert_eq!(complete_steps(split.path()), vec![15, 20]);

    let o = titan_train(
        split.path(),
        &[
            &["--training.steps", "20", "--checkpoint.load_step", "7"],
            CKPT,
        ]
        .concat(),
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("load_step 7"),
        "{}",
        text(&o)
    );
}

#[test]
fn kill_during_a_save_resumes_from_the_previous_checkpoint() {
    let straight = tempfile::tempdir().unwrap();
    ok(titan_train(straight.path(), &["--training.steps", "20"]));
    let reference = losses(straight.path());

    let dump = tempfile::tempdir().unwrap();
    ok(titan_train(
        dump.path(),
        &[&["--training.steps", "10"], CKPT].concat(),
    ));
    assert_eq!(complete_steps(dump.path()), vec![5, 10]);

    // The save of step 15 pauses after writing its data files; kill -9 it right there.
    let mut child = small_run(dump.path(), &["--training.steps", "20"])
        .args(CKPT)
        .env("TITAN_CKPT_PAUSE_BEFORE_COMMIT_MS", "60000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let partial = dump.path().join("checkpoint/.step-15.partial");
    let start = Instant::now();
    while !partial.join("__0_0.distcp").is_file() && !partial.join(".__0_0.distcp.tmp").is_file() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the save of step 15 never started"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "titan-train exited before the save"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(
        partial.exists(),
        "the interrupted save is left as a partial directory"
    );
    assert_eq!(
        complete_steps(dump.path()),
        vec![5, 10],
        "an interrupted save is never a checkpoint"
    );

    let before = losses(dump.path()).len();
    let o = ok(titan_train(
        dump.path(),
        &[&["--training.steps", "20"], CKPT].concat(),
    ));
    assert!(text(&o).contains("step-10"), "{}", text(&o));
    assert_eq!(losses(dump.path())[before..], reference[10..]);
    assert!(
        !partial.exists(),
        "the next save clears the interrupted one"
    );
    assert_eq!(complete_steps(dump.path()), vec![5, 10, 15, 20]);
}

#[test]
fn async_saves_resume_identically_and_bad_keys_are_named() {
    let straight = tempfile::tempdir().unwrap();
    ok(titan_train(straight.path(), &["--training.steps", "12"]));
    let reference = losses(straight.path());

    let dump = tempfile::tempdir().unwrap();
    let async_ckpt = [CKPT, &["--checkpoint.async_mode", "async"]].concat();
    let o = ok(titan_train(
        dump.path(),
        &[&["--training.steps", "6"], &async_ckpt[..]].concat(),
    ));
    assert!(text(&o).contains("checkpoint totals"), "{}", text(&o));
    assert_eq!(complete_steps(dump.path()), vec![5, 6]);
    ok(titan_train(
        dump.path(),
        &[&["--training.steps", "12"], &async_ckpt[..]].concat(),
    ));
    assert_eq!(losses(dump.path()), reference);

    let o = titan_train(
        dump.path(),
        &[
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "--checkpoint.async_mode",
            "sometimes",
        ],
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("checkpoint.async_mode"),
        "{}",
        text(&o)
    );
}

#[test]
fn checkpoint_with_the_older_names_resumes_exactly() {
    let straight = tempfile::tempdir().unwrap();
    ok(titan_train(straight.path(), &["--training.steps", "5"]));
    let reference = losses(straight.path());
    assert_eq!(reference.len(), 5);

    let first = tempfile::tempdir().unwrap();
    ok(titan_train(
        first.path(),
        &[
            &["--training.steps", "3", "--checkpoint.interval", "3"],
            CKPT,
        ]
        .concat(),
    ));
    let resumed = tempfile::tempdir().unwrap();
    let legacy = resumed.path().join("checkpoint/step-3");
    std::fs::create_dir_all(legacy.parent().unwrap()).unwrap();
    let out = titan_tests::run_ok(
        titan_tests::python_script("tests/python/trainckpt_legacy_names.py").args([
            first.path().join("checkpoint/step-3").to_str().unwrap(),
            legacy.to_str().unwrap(),
        ]),
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // 19 renamed parameters (6 layers x q/k/v, lm_head), each with its weight, 3 optimizer
    // state tensors and 12 param_group entries.
    assert_eq!(report["renamed"], 19 * 16, "{report}");

    ok(titan_train(
        resumed.path(),
        &["--training.steps", "5", "--checkpoint.enable"],
    ));
    assert_eq!(losses(resumed.path()), reference[3..].to_vec());
}
