//! titan-train's activation checkpointing end to end: every `[activation_checkpoint]` mode trains
//! exactly as `mode = none` (bit-identical losses and gradient norms, in the default bf16 mixed
//! precision and in fp32, one process and 2-rank DDP) while it really recomputes (the forward of
//! each checkpointed block runs again in backward, counted from the titan-obs `recompute` spans
//! pyarrow reads from the run's parts), and bad values exit 2 naming the key.

use std::collections::BTreeMap;
use std::path::Path;

use titan_tests::{exit_2_naming, metrics, run_ok, small_run, span_counts};

/// The `field` values of `metrics.jsonl` train lines, as written (shortest round-trip decimal,
/// so equal strings mean equal f64 bits).
fn train_metric(dump: &Path, field: &str) -> Vec<String> {
    metrics(dump, "train")
        .iter()
        .map(|v| v[field].to_string())
        .collect()
}

/// Losses and gradient norms of a 4-step seeded run with `extra` flags.
fn run(dir: &Path, name: &str, extra: &[&str]) -> (Vec<String>, Vec<String>) {
    let dump = dir.join(name);
    run_ok(small_run(&dump, &["--training.steps", "4"]).args(extra));
    let losses = train_metric(&dump, "loss");
    assert_eq!(losses.len(), 4, "{name}: {losses:?}");
    (losses, train_metric(&dump, "grad_norm"))
}

/// Each mode recomputes the blocks it checkpoints, once per block and step (the debug model's
/// 6 layers; `selective 2` checkpoints layers 2, 4 and 6), and `none` recomputes nothing.
#[test]
fn checkpointed_blocks_are_recomputed_in_backward() {
    let dir = tempfile::tempdir().unwrap();
    let obs = ["--observability.enable=true"];
    for ((name, flags), per_step) in [("none", &[][..]), MODES[0], MODES[1], MODES[2]]
        .into_iter()
        .zip([0, 6, 6, 3])
    {
        let args: Vec<&str> = obs.iter().chain(flags.iter()).copied().collect();
        let dump = dir.path().join(name);
        run_ok(small_run(&dump, &["--training.steps", "4"]).args(&args));
        let counts = span_counts(&dump, 0, "recompute");
        let want: BTreeMap<u64, u64> = if per_step == 0 {
            BTreeMap::new()
        } else {
            (1..=4).map(|s| (s, per_step)).collect()
        };
        assert_eq!(counts, want, "{name}: recomputed blocks per step");
    }
}

const MODES: &[(&str, &[&str])] = &[
    ("full", &["--activation_checkpoint.mode", "full"]),
    (
        "op",
        &[
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
    (
        "every2",
        &[
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    ),
];

fn every_mode_equals_none(precision: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let none = run(dir.path(), "none", precision);
    for (name, flags) in MODES {
        let args: Vec<&str> = precision.iter().chain(flags.iter()).copied().collect();
        let got = run(dir.path(), name, &args);
        assert_eq!(got.0, none.0, "{name}: losses differ from mode none");
        assert_eq!(
            got.1, none.1,
            "{name}: gradient norms differ from mode none"
        );
    }
}

#[test]
fn every_mode_trains_bit_identically_to_none_in_bf16() {
    every_mode_equals_none(&["--training.mixed_precision_param", "bfloat16"]);
}

#[test]
fn every_mode_trains_bit_identically_to_none_in_fp32() {
    every_mode_equals_none(&["--training.mixed_precision_param", "float32"]);
}

#[test]
fn two_rank_ddp_with_full_ac_equals_none() {
    let dir = tempfile::tempdir().unwrap();
    let ddp = [
        "--nproc-per-node",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ];
    let none = run(dir.path(), "ddp_none", &ddp);
    let full_args: Vec<&str> = ddp
        .iter()
        .copied()
        .chain(["--activation_checkpoint.mode", "full"])
        .collect();
    let full = run(dir.path(), "ddp_full", &full_args);
    assert_eq!(full, none, "2-rank DDP: full AC differs from none");
}

/// TP 2 with selective `op` AC trains as without, and its recompute communicates only what
/// torchtitan's policy recomputes: each recomputed block all-gathers its two regions' inputs
/// again, while the reduce-scatters leaving them are kept from the forward
/// (`reduce_scatter_tensor` is in torchtitan's save list).
#[test]
fn tp2_with_op_ac_recomputes_the_all_gathers_and_keeps_the_reduce_scatters() {
    let dir = tempfile::tempdir().unwrap();
    let tp = [
        "--nproc-per-node",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--observability.enable=true",
    ];
    let none = run(dir.path(), "tp_none", &tp);
    let op_args: Vec<&str> = tp.iter().chain(MODES[1].1).copied().collect();
    let op = run(dir.path(), "tp_op", &op_args);
    assert_eq!(op, none, "TP 2: selective op AC differs from none");
    let counts = |name: &str, span: &str| span_counts(&dir.path().join(name), 0, span);
    assert_eq!(
        counts("tp_op", "reduce_scatter"),
        counts("tp_none", "reduce_scatter"),
        "the recompute reduce-scatters again"
    );
    // The debug model's 6 blocks, each entering attention and the feed-forward.
    let again: BTreeMap<u64, u64> = counts("tp_none", "all_gather")
        .into_iter()
        .map(|(step, n)| (step, n + 12))
        .collect();
    assert_eq!(counts("tp_op", "all_gather"), again);
}

/// Rank 0's all-gathers of `step`, by the name of the thread that ran them (pyarrow reads the
/// run's parts): FSDP's prefetches run on the group's `titan-comm` thread, a gather nobody
/// prefetched on the thread that needs it.
fn all_gathers_by_thread(dump: &Path, step: u64) -> BTreeMap<String, u64> {
    let script = r#"
import glob, json, sys
import pyarrow.parquet as pq
counts = {}
for f in glob.glob(sys.argv[1] + "/obs/rank-0/*.parquet"):
    cols = ["kind", "name", "step", "thread_name"]
    for r in pq.read_table(f, columns=cols).to_pylist():
        if r["kind"] == "span" and r["name"] == "all_gather" and r["step"] == int(sys.argv[2]):
            counts[r["thread_name"]] = counts.get(r["thread_name"], 0) + 1
print(json.dumps(counts))
"#;
    let out = run_ok(
        std::process::Command::new(titan_tests::python())
            .args(["-c", script])
            .arg(dump)
            .arg(step.to_string()),
    );
    serde_json::from_slice(&out.stdout).expect("the script prints a JSON object")
}

/// FSDP2 with full checkpointing: the same run as without, and backward's recomputes gather
/// their blocks from prefetches (each block's recompute starts gathering the block before it,
/// as FSDP2's backward prefetch does), not synchronously on the thread that needs them.
#[test]
fn fsdp2_with_full_ac_prefetches_its_backward_gathers() {
    let dir = tempfile::tempdir().unwrap();
    let fsdp = ["--nproc-per-node", "2", "--observability.enable=true"];
    let none = run(dir.path(), "fsdp_none", &fsdp);
    let full_args: Vec<&str> = fsdp
        .iter()
        .copied()
        .chain(["--activation_checkpoint.mode", "full"])
        .collect();
    let full = run(dir.path(), "fsdp_full", &full_args);
    assert_eq!(full, none, "2-rank FSDP2: full AC differs from none");
    let by_thread = all_gathers_by_thread(&dir.path().join("fsdp_full"), 2);
    let total: u64 = by_thread.values().sum();
    let comm = by_thread.get("titan-comm").copied().unwrap_or(0);
    // The debug model's 8 units: the embeddings, 6 blocks, norm + output. Forward gathers the
    // 8 (7 prefetched); backward the 6 blocks and the embeddings again, all but the last
    // block prefetched by the recompute after it.
    assert_eq!(total, 15, "{by_thread:?}");
    assert_eq!(comm, 13, "gathers not prefetched: {by_thread:?}");
}

#[test]
fn bad_values_exit_2_naming_the_key() {
    exit_2_naming(
        &["--activation_checkpoint.mode", "partial"],
        "activation_checkpoint.mode",
    );
    for bad in ["x", "0"] {
        exit_2_naming(
            &[
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                bad,
            ],
            "activation_checkpoint.selective_ac_option",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad_ac.toml");
    std::fs::write(
        &file,
        "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = 0\n",
    )
    .unwrap();
    exit_2_naming(
        &["--job.config_file", file.to_str().unwrap()],
        "activation_checkpoint.selective_ac_option",
    );
}

/// `training.dtype = bfloat16` (torchtitan's full-bf16 training): torch reads the checkpoint's
/// weights and AdamW moments as bf16, and the run still learns.
#[test]
fn full_bf16_training_keeps_bf16_weights_and_optimizer_state() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("bf16");
    run_ok(&mut small_run(
        &dump,
        &[
            "--training.steps",
            "8",
            "--training.dtype",
            "bfloat16",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "8",
            "--checkpoint.last_save_model_only=false",
        ],
    ));
    let losses: Vec<f64> = train_metric(&dump, "loss")
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    assert!(
        losses[7] < losses[0] - 0.5,
        "bf16 training must learn: {losses:?}"
    );
    let o = run_ok(
        titan_tests::python_script("tests/python/trainer_dcp_dtypes.py")
            .arg(dump.join("checkpoint/step-8")),
    );
    let dtypes: std::collections::BTreeMap<String, String> =
        serde_json::from_slice(&o.stdout).expect("a JSON object");
    let of = |suffix: &str| {
        dtypes
            .iter()
            .filter(|(k, _)| k.ends_with(suffix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    for (suffix, count) in [
        ("wq.weight", 6),
        // q/k/v's AdamW state sits under torchtitan's fused name.
        ("wqkv.weight.exp_avg", 6),
        ("wqkv.weight.exp_avg_sq", 6),
        ("lm_head.weight", 1),
    ] {
        let found = of(suffix);
        assert!(found.len() >= count, "{suffix}: {dtypes:?}");
        assert!(
            found.iter().all(|(_, d)| d == "bfloat16"),
            "{suffix} must be bf16: {found:?}"
        );
    }
}
