//! `titan-train --memory_estimation.enable`: the per-rank memory estimate, printed without building
//! the model or starting ranks, on the real binary. Arithmetic only: nothing here depends on the
//! machine's memory or speed.

use std::process::Output;

use serde_json::Value;
use titan_tests::{output_text as text, titan_train};

fn run(args: &[&str]) -> Output {
    titan_train()
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("run titan-train")
}

/// The one JSON object on stdout (warnings may log other lines).
fn json(o: &Output) -> Value {
    assert!(o.status.success(), "{}", text(o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 1, "one JSON object expected:\n{}", text(o));
    serde_json::from_str(lines[0]).expect("the estimate is JSON")
}

fn field(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// The sums, checked to add up, the rows to add up to them, and the peak to be the largest
/// phase (returned).
fn check_sums(v: &Value) -> u64 {
    let terms = [
        ("params_bytes", "params"),
        ("grads_bytes", "grads"),
        ("optimizer_bytes", "optimizer"),
        ("activations_bytes", "activations"),
    ];
    let mut total = 0;
    for (key, term) in terms {
        let rows: u64 = v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["term"] == term)
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(rows, field(v, key), "{key}: {v}");
        total += field(v, key);
    }
    assert_eq!(field(v, "terms_bytes"), total, "the terms add up: {v}");
    // The peak is the largest phase, and no phase holds more than every item at its largest.
    let phases: Vec<u64> = v["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["bytes"].as_u64().unwrap())
        .collect();
    let peak = field(v, "peak_bytes");
    assert_eq!(Some(peak), phases.iter().copied().max(), "{v}");
    assert!(peak <= total, "a phase above the sum of the terms: {v}");
    peak
}

const GIB: u64 = 1 << 30;

/// llama3_8b's registry config, estimated as JSON, then `extra`.
fn llama3_8b_json(extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = vec![
        "--module",
        "llama3",
        "--config",
        "llama3_8b",
        "--memory_estimation.enable",
        "--memory_estimation.json",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn llama3_8b_on_8_fsdp_ranks_fits_an_80_gb_gpu() {
    let o = run(&llama3_8b_json(&[
        "--parallelism.data_parallel_shard_degree",
        "8",
        "--nproc-per-node",
        "8",
    ]));
    let v = json(&o);
    let peak = check_sums(&v);
    // 80 GB (decimal, the GPU's label) is below 80 GiB: the stricter bound.
    assert!(peak < 80_000_000_000, "{v}");
    assert_eq!(v["layout"]["dp_shard"], 8, "{v}");
    assert_eq!(v["layout"]["world_size"], 8, "{v}");
    // fp32 shards of 8,030,261,248 parameters over 8 ranks (every dim 0 divides by 8).
    let shards = v["rows"][0]["bytes"].as_u64().unwrap();
    assert_eq!(shards, 8_030_261_248 / 8 * 4, "{v}");
    assert_eq!(field(&v, "optimizer_bytes"), 2 * shards, "{v}");
    // Printed once, by the launcher: no rank ran (no rank's log lines, no outputs).
    assert!(!text(&o).contains("model built"), "{}", text(&o));
}

#[test]
fn llama3_70b_on_64_ranks_and_8b_with_tp() {
    // torchtitan's llama3_70b asks for TP 8: on 64 ranks that is TP 8 x FSDP 8.
    let v = json(&run(&[
        "--module",
        "llama3",
        "--config",
        "llama3_70b",
        "--memory_estimation.enabled",
        "--memory_estimation.json",
        "--nproc-per-node",
        "64",
    ]));
    check_sums(&v);
    assert_eq!(
        (v["layout"]["tp"].as_u64(), v["layout"]["dp_shard"].as_u64()),
        (Some(8), Some(8))
    );
    assert!(field(&v, "peak_bytes") < 80 * GIB, "{v}");
    // The same world given as torchrun does: WORLD_SIZE (rank 0 prints, any other rank stays quiet).
    let env_run = |rank: &str| {
        titan_train()
            .args(llama3_8b_json(&[
                "--parallelism.tensor_parallel_degree",
                "2",
            ]))
            .env("RANK", rank)
            .env("LOCAL_RANK", rank)
            .env("WORLD_SIZE", "8")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "29999")
            .output()
            .unwrap()
    };
    let v = json(&env_run("0"));
    check_sums(&v);
    assert_eq!(
        (v["layout"]["tp"].as_u64(), v["layout"]["dp_shard"].as_u64()),
        (Some(2), Some(4))
    );
    let quiet = env_run("3");
    assert!(quiet.status.success(), "{}", text(&quiet));
    assert!(
        !String::from_utf8_lossy(&quiet.stdout).contains("peak_bytes"),
        "{}",
        text(&quiet)
    );
}

#[test]
fn the_table_names_every_term_and_the_layout() {
    let o = run(&[
        "--memory_estimation.enable",
        "--training.mixed_precision_param",
        "float32",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "per rank",
        "world 1 = dp_replicate 1 x dp_shard 1",
        "parameter shards",
        "AdamW exp_avg + exp_avg_sq",
        "saved activations",
        "peak",
    ] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
    // Nothing trained, nothing written.
    assert!(!out.contains("steps done"), "{out}");
}

#[test]
fn bad_keys_and_layouts_exit_2() {
    for args in [
        &["--memory_estimation.enable", "--memory_estimation.jsn"][..],
        &[
            "--memory_estimation.enable",
            "--memory_estimation.disable_fake_mode",
        ][..],
        // dp_shard 3 x tp 2 is not a world of 8: torchtitan's ParallelDims rule.
        &[
            "--memory_estimation.enable",
            "--parallelism.data_parallel_shard_degree",
            "3",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--nproc-per-node",
            "8",
        ][..],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
    }
    let o = run(&[
        "--memory_estimation.enable",
        "--memory_estimation.disable_fake_mode",
    ]);
    assert!(
        text(&o).contains("memory_estimation.disable_fake_mode"),
        "{}",
        text(&o)
    );
}
