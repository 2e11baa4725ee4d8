//! titan-train on torchtitan 0.3.0's command line (`--module llama3 --config llama3_debugmodel` with
//! 0.3.0's key names), the parallelism degrees checked against the world on every launch path, and
//! settings whose prerequisite is off named in a warning. The real binary, end to end.

use std::path::{Path, PathBuf};
use std::process::Output;

use titan_tests::{output_text as text, workspace_root};

fn titan_train(args: &[&str]) -> Output {
    titan_tests::titan_train()
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("run titan-train")
}

/// A tokenizer folder and a `c4_test`-style data folder (JSON lines with `text`), as a torchtitan
/// user has them.
fn assets(dir: &Path) -> (PathBuf, PathBuf) {
    let src = workspace_root().join("trainer/assets");
    let (tok, data) = (dir.join("tokenizer"), dir.join("c4_test"));
    std::fs::create_dir_all(&tok).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    std::fs::copy(src.join("tokenizer.json"), tok.join("tokenizer.json")).unwrap();
    let docs: String = std::fs::read_to_string(src.join("default_train.jsonl"))
        .unwrap()
        .lines()
        .take(200)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(data.join("train.jsonl"), docs).unwrap();
    (tok, data)
}

fn logged_steps(dump: &Path) -> usize {
    std::fs::read_to_string(dump.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"kind\":\"train\""))
        .count()
}

#[test]
fn torchtitan_030_command_line_trains_llama3_debugmodel() {
    let dir = tempfile::tempdir().unwrap();
    let (tok, data) = assets(dir.path());
    let dump = dir.path().join("out");
    let o = titan_train(&[
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--hf_assets_path",
        tok.to_str().unwrap(),
        "--dataloader.dataset_path",
        data.to_str().unwrap(),
        "--dump_folder",
        dump.to_str().unwrap(),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "3",
        "--training.mixed_precision_param",
        "float32",
        "--validator.no-enable",
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "activation_checkpoint:full",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // llama3_debugmodel logs every step (metrics.log_freq 1 in its registry function).
    assert_eq!(logged_steps(&dump), 3, "{}", text(&o));
    let resolved = std::fs::read_to_string(dump.join("config.toml")).unwrap();
    for line in [
        "flavor = \"debugmodel\"",
        "warmup_steps = 2",
        "mode = \"full\"",
    ] {
        assert!(resolved.contains(line), "{line} not in\n{resolved}");
    }
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("parallelism.spmd_backend partial_dtensor has no effect"),
        "the accepted no-op key is named: {}",
        text(&o)
    );
}

#[test]
fn torchtitan_keys_titan_cannot_honour_are_refused_naming_them() {
    for args in [
        &["--dataloader.num_workers", "2"][..],
        &["--module", "llama3", "--config", "llama3_70b"][..],
        &["--module", "llama3", "--config", "llama3_1b"][..],
        &["--module", "llama3"][..],
        &["--loss.num_chunks", "4"][..],
        &["activation_checkpoint:memory-budget"][..],
    ] {
        let o = titan_train(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        let named = match args[0] {
            "--module" if args.len() == 2 => "--config is required",
            // TP 8 on one process: torchtitan's degree rule names it.
            "--module" if args[3] == "llama3_70b" => "tp(8)",
            "--module" => "llama3_1b",
            "activation_checkpoint:memory-budget" => "memory-budget",
            key => &key[2..],
        };
        assert!(
            err.contains(named),
            "{args:?} should name {named}: {}",
            text(&o)
        );
    }
}

#[test]
fn bad_degrees_exit_2_on_every_launch_path() {
    // One process: a replicate degree of 2 cannot be (it used to train, ignored).
    let o = titan_train(&["--parallelism.data_parallel_replicate_degree", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("invalid parallel dims") && err.contains("WORLD_SIZE(1)"),
        "{}",
        text(&o)
    );
    // The launcher checks before starting a rank.
    let o = titan_train(&[
        "--nproc-per-node",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("dp_shard(3)") && err.contains("WORLD_SIZE(2)"),
        "{}",
        text(&o)
    );
    // Under a launcher's variables (torchrun, srun): the same rule on each rank.
    let o = titan_tests::titan_train()
        .args(["--parallelism.data_parallel_replicate_degree", "0"])
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("data_parallel_replicate_degree is 0"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_setting_whose_prerequisite_is_off_warns_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("out");
    let o = titan_train(&[
        "--checkpoint.initial_load_path",
        "/nonexistent/step-0",
        "--training.steps",
        "1",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--validation.enable=false",
        "--observability.enable=false",
        "--job.dump_folder",
        dump.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("--checkpoint.initial_load_path has no effect")
            && out.contains("checkpoint.enable"),
        "{}",
        text(&o)
    );
}

#[test]
fn help_shows_both_command_lines_and_the_values_a_bare_run_uses() {
    let o = titan_train(&["--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let help = String::from_utf8_lossy(&o.stdout);
    // A bare run trains the embedded debug config: 50 steps of seq_len 256, warmup 2.
    for line in [
        "--training.steps 50\n",
        "--training.seq_len 256\n",
        "--lr_scheduler.warmup_steps 2\n",
        "--module llama3|qwen3 --config NAME",
        "llama3_debugmodel",
    ] {
        assert!(help.contains(line), "--help lacks {line:?}:\n{help}");
    }
    assert!(!help.contains("--training.steps 10000\n"), "{help}");
}
