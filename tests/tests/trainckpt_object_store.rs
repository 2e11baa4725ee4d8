//! titan-train checkpoints to an S3-compatible object store (a local moto server from `.venv`):
//! saves are uploaded with a commit marker, `keep_latest_k` purges remotely, and a restart
//! resumes from the store with the straight run's exact losses.

use std::path::Path;
use std::process::Output;

use titan_tests::{MotoServer, run_ok, small_run};

fn titan_train(dump: &Path, moto: Option<&MotoServer>, extra: &[&str]) -> Output {
    let mut c = small_run(dump, extra);
    if let Some(m) = moto {
        m.aws_env(&mut c);
    }
    run_ok(&mut c)
}

fn losses(dump: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dump.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| serde_json::json!([v["step"], v["loss"], v["grad_norm"]]))
        .collect()
}

#[test]
fn saves_to_s3_purge_there_and_resume_from_there() {
    let straight = tempfile::tempdir().unwrap();
    titan_train(straight.path(), None, &["--training.steps", "9"]);
    let reference = losses(straight.path());

    let moto = MotoServer::start("trainckpt");
    let dump = tempfile::tempdir().unwrap();
    let ckpt = [
        "--checkpoint.enable",
        "--checkpoint.folder",
        "s3://trainckpt/run/ckpt",
        "--checkpoint.interval",
        "3",
        "--checkpoint.last_save_model_only=false",
        "--checkpoint.keep_latest_k",
        "1",
    ];
    titan_train(
        dump.path(),
        Some(&moto),
        &[&["--training.steps", "6"], &ckpt[..]].concat(),
    );
    let listing = moto.s3(&["ls", "run/ckpt"]);
    let mut names: Vec<&str> = listing.lines().collect();
    names.sort_unstable();
    assert_eq!(
        names,
        vec![
            "step-6.committed",
            "step-6/.metadata",
            "step-6/__0_0.distcp",
            "step-6/titan_run_id"
        ],
        "{listing}"
    );

    let o = titan_train(
        dump.path(),
        Some(&moto),
        &[&["--training.steps", "9"], &ckpt[..]].concat(),
    );
    let log = String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    assert!(
        log.contains("resumed from checkpoint s3://trainckpt/run/ckpt/step-6"),
        "{log}"
    );
    // metrics.jsonl is appended: the resumed run's lines follow the first run's 6, under the
    // run id saved with the checkpoint.
    assert_eq!(losses(dump.path()), reference);
    let runs: std::collections::BTreeSet<String> =
        std::fs::read_to_string(dump.path().join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["run_id"].to_string())
            .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let listing = moto.s3(&["ls", "run/ckpt"]);
    assert!(
        listing.contains("step-9.committed") && !listing.contains("step-6"),
        "{listing}"
    );
}
