//! titan-train on several processes (cpu backend), end to end on the real binary:
//! - 1 rank vs 2 and 4 ranks on the same global batch give the same loss curve (10 steps, within
//!   1e-5 relative) for FSDP2, tensor parallelism (with and without sequence parallelism),
//!   FSDP2 x TP2 and HSDP; their grad norms agree within [`GRAD_NORM_RTOL`];
//! - pipeline parallelism (each schedule at PP=2, PP2 x DP2, PP2 x TP2) gives the same curve,
//!   and its checkpoint resumes on one process;
//! - torchrun-style launch by hand (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) works;
//! - killing one rank mid-run ends the job non-zero, quickly, with the dead rank named.
//!
//! The data makes "the same global batch" exact: a word-level tokenizer and documents of exactly
//! seq_len + 1 tokens (with BOS/EOS), so every document is one sample. dp rank r of W reads the
//! r-th contiguous shard (torchtitan's split), so each layout gets the documents in an order whose
//! shards put the single process's step-s samples on the W ranks' step s ([`write_dataset`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use titan_tests::{bin, output_text as text, run_ok, span_counts};

const SEQ_LEN: usize = 32;
const STEPS: usize = 10;
const GLOBAL_BATCH: usize = 4;
const WORDS: usize = 200;

/// A Hugging Face `tokenizer.json` (WordLevel over whitespace) with `<s>`/`</s>` and `WORDS` words.
fn write_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<s>", "</s>", "<unk>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for w in 0..WORDS {
        vocab.insert(format!("w{w}"), (w + 3).into());
    }
    let special = |id: usize, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<s>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

const DOCS: usize = 400;

/// Documents of SEQ_LEN - 1 words (a learnable pattern), one per line, laid out for `world` dp
/// ranks: line `r * DOCS/world + b*s + j` (rank r's shard, its step s, sample j of its local batch
/// b = GLOBAL_BATCH/world) holds document `GLOBAL_BATCH*s + b*r + j`, the sample one process reads
/// at step s. Every layout then trains on the same global batches.
fn write_dataset(path: &Path, world: usize) {
    let doc = |d: usize| -> String {
        let words: Vec<String> = (0..SEQ_LEN - 1)
            .map(|i| format!("w{}", (d * 7 + i * (1 + d % 3)) % WORDS))
            .collect();
        words.join(" ")
    };
    let (shard, local) = (DOCS / world, GLOBAL_BATCH / world);
    let mut lines = vec![String::new(); DOCS];
    for r in 0..world {
        for s in 0..shard / local {
            for j in 0..local {
                lines[r * shard + local * s + j] = doc(GLOBAL_BATCH * s + local * r + j);
            }
        }
    }
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        write_tokenizer(&root.join("tokenizer"));
        for world in [1, 2, 4] {
            write_dataset(&root.join(format!("docs_w{world}.txt")), world);
        }
        Fixture { _dir: dir, root }
    }

    /// The trainer flags of a run writing to `<root>/<name>` with `local_batch` per rank.
    fn args(&self, name: &str, local_batch: usize) -> Vec<String> {
        let s = |v: &str| v.to_string();
        vec![
            s("--job.dump_folder"),
            self.root.join(name).display().to_string(),
            s("--model.hf_assets_path"),
            self.root.join("tokenizer").display().to_string(),
            s("--training.dataset_path"),
            self.root
                .join(format!("docs_w{}.txt", GLOBAL_BATCH / local_batch))
                .display()
                .to_string(),
            s("--training.seq_len"),
            SEQ_LEN.to_string(),
            s("--training.local_batch_size"),
            local_batch.to_string(),
            s("--training.global_batch_size"),
            GLOBAL_BATCH.to_string(),
            s("--training.steps"),
            STEPS.to_string(),
            s("--metrics.log_freq"),
            s("1"),
            s("--validation.enable=false"),
            s("--debug.seed"),
            s("7"),
            s("--debug.deterministic"),
            s("--comm.train_timeout_seconds"),
            s("30"),
            // The curves are compared to 1e-5 across rank layouts: fp32 compute.
            s("--training.mixed_precision_param"),
            s("float32"),
        ]
        .into_iter()
        .chain(cuda_args())
        .collect()
    }

    fn losses(&self, name: &str) -> Vec<f64> {
        self.logged(name, "loss")
    }

    fn logged(&self, name: &str, field: &str) -> Vec<f64> {
        self.logged_kind(name, "train", field)
    }

    fn logged_kind(&self, name: &str, kind: &str, field: &str) -> Vec<f64> {
        let path = self.root.join(name).join("metrics.jsonl");
        let body =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        body.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["kind"] == kind)
            .map(|v| v[field].as_f64().expect("a number"))
            .collect()
    }
}

/// With `TITAN_TEST_CUDA=1` (a GPU machine, bench/trainer/cuda_checks.sh) every run trains on
/// CUDA tensors, its ranks sharing the GPU over the cpu backend: the same curves must come out.
fn cuda_args() -> Vec<String> {
    if std::env::var("TITAN_TEST_CUDA").is_ok_and(|v| v == "1") {
        ["--training.device", "cuda", "--comm.backend", "cpu"]
            .map(String::from)
            .to_vec()
    } else {
        Vec::new()
    }
}

fn titan_train(args: &[String]) -> Command {
    let mut c = titan_tests::titan_train();
    c.args(args);
    c
}

fn assert_same_curve(want: &[f64], got: &[f64], what: &str) {
    assert_eq!(want.len(), STEPS, "reference logged every step: {want:?}");
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (step, (a, b)) in want.iter().zip(got).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= 1e-5,
            "{what}: step {} loss {b} vs single-process {a} (relative {rel:e})\n{want:?}\n{got:?}",
            step + 1
        );
    }
    // The curve is a training curve, not a constant.
    assert!(
        want[STEPS - 1] < want[0] - 0.5,
        "loss does not fall: {want:?}"
    );
}

/// How far a layout's grad norms may be from one process's: torch (and so torchtitan and titan)
/// sums each tensor's norm in fp32, over the local part of a sharded parameter, and that sum is
/// off the exact norm by up to ~1e-4 on these gradients; each layout matches torchtitan's own
/// value on that layout to 1e-5 (tt_parity.rs).
const GRAD_NORM_RTOL: f64 = 3e-4;

fn assert_close_grad_norms(want: &[f64], got: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (step, (a, b)) in want.iter().zip(got).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= GRAD_NORM_RTOL,
            "{what}: step {} grad norm {b} vs single-process {a} (relative {rel:e})",
            step + 1
        );
    }
}

/// Tensor parallelism (2 ranks, the single process's batch on both), with and without sequence
/// parallelism, and FSDP2 x TP2 on 4 ranks: the single process's losses, steps 1 to 10.
#[test]
fn tensor_parallel_loss_curves_match_one_rank() {
    let f = Fixture::new();
    run_ok(&mut titan_train(&f.args("single", GLOBAL_BATCH)));
    let reference = f.losses("single");
    let reference_norms = f.logged("single", "grad_norm");
    let layouts: [(&str, usize, &[&str]); 3] = [
        (
            "tp2",
            GLOBAL_BATCH,
            &[
                "--nproc-per-node",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        ),
        (
            "tp2_nosp",
            GLOBAL_BATCH,
            &[
                "--nproc-per-node",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_sequence_parallel=false",
            ],
        ),
        (
            "fsdp2_tp2",
            GLOBAL_BATCH / 2,
            &[
                "--nproc-per-node",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--activation_checkpoint.mode",
                "full",
            ],
        ),
    ];
    for (name, local_batch, extra) in layouts {
        let mut c = titan_train(&f.args(name, local_batch));
        c.args(extra);
        run_ok(&mut c);
        assert_same_curve(&reference, &f.losses(name), name);
        assert_close_grad_norms(&reference_norms, &f.logged(name, "grad_norm"), name);
    }
}

/// Pipeline parallelism: PP=2 with each schedule (4 microbatches of one sample; Interleaved1F1B
/// with 2 stages per rank), PP2 x DP2 (FSDP), PP2 x DDP2 and PP2 x TP2 on 4 ranks: the single
/// process's losses, steps 1 to 10. Then a PP=2 checkpoint resumes on one process (the same
/// microbatches as gradient accumulation) with the pipeline run's next losses.
#[test]
fn pipeline_parallel_loss_curves_match_one_rank() {
    let f = Fixture::new();
    // Validation runs forward through the stages; its loss is compared where the layout reads
    // the same validation samples (one dp rank).
    let validate = [
        "--validation.enable",
        "--validation.freq",
        "5",
        "--validation.steps",
        "2",
    ];
    run_ok(titan_train(&f.args("single", GLOBAL_BATCH)).args(validate));
    let reference = f.losses("single");
    let reference_norms = f.logged("single", "grad_norm");
    let reference_validation = f.logged_kind("single", "validation", "loss");
    assert_eq!(reference_validation.len(), 2, "{reference_validation:?}");
    let pp2 = [
        "--nproc-per-node",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
    ];
    let layouts: [(&str, usize, &[&str]); 10] = [
        ("pp2_1f1b", GLOBAL_BATCH, &[]),
        (
            "pp2_gpipe",
            GLOBAL_BATCH,
            &["--parallelism.pipeline_parallel_schedule", "GPipe"],
        ),
        (
            "pp2_interleaved",
            GLOBAL_BATCH,
            &[
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
            ],
        ),
        (
            "pp2_zero_bubble",
            GLOBAL_BATCH,
            &[
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
            ],
        ),
        (
            // The checkpointed blocks' recomputes defer their weight gradients too.
            "pp2_zero_bubble_full_ac",
            GLOBAL_BATCH,
            &[
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
                "--activation_checkpoint.mode",
                "full",
            ],
        ),
        (
            "pp2_tp2_zero_bubble",
            GLOBAL_BATCH,
            &[
                "--nproc-per-node",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
            ],
        ),
        ("pp2_dp2", GLOBAL_BATCH / 2, &["--nproc-per-node", "4"]),
        (
            // The weight passes' gradients join the stage's sums before the step's one
            // reduce-scatter.
            "pp2_dp2_zero_bubble",
            GLOBAL_BATCH / 2,
            &[
                "--nproc-per-node",
                "4",
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
            ],
        ),
        (
            // DDP's buckets, summed over the microbatches and all-reduced once a step.
            "pp2_ddp2",
            GLOBAL_BATCH / 2,
            &[
                "--nproc-per-node",
                "4",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
        ),
        (
            "pp2_tp2",
            GLOBAL_BATCH,
            &[
                "--nproc-per-node",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        ),
    ];
    for (name, local_batch, extra) in layouts {
        let mut c = titan_train(&f.args(name, local_batch));
        c.args(pp2).args(extra).args(validate);
        let out = run_ok(&mut c);
        assert!(
            text(&out).contains("pipeline parallelism"),
            "{name}: the run says it pipelines\n{}",
            text(&out)
        );
        assert_same_curve(&reference, &f.losses(name), name);
        assert_close_grad_norms(&reference_norms, &f.logged(name, "grad_norm"), name);
        if local_batch == GLOBAL_BATCH {
            let validation = f.logged_kind(name, "validation", "loss");
            assert_eq!(validation.len(), 2, "{name}: {validation:?}");
            for (a, b) in reference_validation.iter().zip(&validation) {
                assert!(
                    (a - b).abs() / a.abs() <= 1e-5,
                    "{name} validation: {validation:?} vs one process {reference_validation:?}"
                );
            }
        }
    }

    // PP x FSDP: a stage's units (stage 0: the embeddings and 3 blocks) are gathered once a
    // step and kept for its 2 microbatches, as FSDP2 under torch's schedules keeps them
    // (validation, at steps 5 and 10, gathers once more).
    let gathers = span_counts(&f.root.join("pp2_dp2"), 0, "all_gather");
    let want: std::collections::BTreeMap<u64, u64> = (1..=STEPS as u64)
        .map(|s| (s, if s % 5 == 0 { 8 } else { 4 }))
        .collect();
    assert_eq!(gathers, want, "all-gathers a step on rank 0");
    // ... and their gradients, summed over the step's microbatches, are reduce-scattered once
    // a step, after the last backward (torch's stage: gradient sync off, `perform_reduce_grad`).
    let reductions = span_counts(&f.root.join("pp2_dp2"), 0, "reduce_scatter");
    let want: std::collections::BTreeMap<u64, u64> = (1..=STEPS as u64).map(|s| (s, 4)).collect();
    assert_eq!(reductions, want, "reduce-scatters a step on rank 0");

    // A PP=2 checkpoint (each stage writes its own parameters under their global names)
    // resumes on one process, whose 4 microbatches of one sample accumulate as the stages did.
    let ckpt = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
        "--checkpoint.keep_latest_k",
        "0",
    ];
    let mut c = titan_train(&f.args("pp2_ckpt", GLOBAL_BATCH));
    c.args(pp2).args(ckpt);
    run_ok(&mut c);
    let straight = f.losses("pp2_ckpt");
    let resumed_dir = f.root.join("pp1_resumed/checkpoint");
    std::fs::create_dir_all(&resumed_dir).unwrap();
    let copy = Command::new("cp")
        .arg("-r")
        .arg(f.root.join("pp2_ckpt/checkpoint/step-5"))
        .arg(&resumed_dir)
        .status()
        .unwrap();
    assert!(copy.success());
    let mut c = titan_train(&f.args("pp1_resumed", 1));
    // One process reads the documents in order (the file `args` picks for 4 dp ranks is not).
    let in_order = f.root.join("docs_w1.txt").display().to_string();
    c.args(ckpt).args(["--training.dataset_path", &in_order]);
    run_ok(&mut c);
    let resumed = f.losses("pp1_resumed");
    assert_eq!(resumed.len(), 5, "steps 6..10: {resumed:?}");
    for (step, (a, b)) in straight[5..].iter().zip(&resumed).enumerate() {
        assert!(
            (a - b).abs() / a <= 1e-6,
            "step {}: {b} after resuming PP=2's checkpoint on one process vs {a}",
            step + 6
        );
    }
}

/// Pipeline settings torchtitan refuses, or titan-train does not run, exit 2 naming the key.
#[test]
fn bad_pipeline_settings_exit_2_naming_the_key() {
    let f = Fixture::new();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--parallelism.pipeline_parallel_schedule", "2F2B"],
            "unknown pipeline schedule",
        ),
        (
            &["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "not implemented",
        ),
        (
            &["--parallelism.pipeline_parallel_microbatch_size", "3"],
            "must be divisible by microbatch_size",
        ),
        (
            &["--parallelism.pipeline_parallel_layers_per_stage", "2"],
            "exactly 1 stage per rank",
        ),
        (
            &[
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
                "--float8.enable_float8_linear",
            ],
            "float8.enable_float8_linear",
        ),
    ];
    for (extra, message) in cases {
        let mut c = titan_train(&f.args("bad", GLOBAL_BATCH));
        c.args([
            "--nproc-per-node",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
        ])
        .args(extra);
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}\n{}", text(&out));
        assert!(text(&out).contains(message), "{extra:?}: {}", text(&out));
    }
}

#[test]
fn multi_rank_loss_curves_match_one_rank() {
    let f = Fixture::new();
    run_ok(&mut titan_train(&f.args("single", GLOBAL_BATCH)));
    let reference = f.losses("single");
    let reference_norms = f.logged("single", "grad_norm");

    // FSDP2 (shard degree -1 takes both ranks), through the launcher.
    let mut c = titan_train(&f.args("shard2", GLOBAL_BATCH / 2));
    c.args(["--nproc-per-node", "2"]);
    let out = run_ok(&mut c);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("[rank0]:"),
        "launcher prefixes lines:\n{stdout}"
    );
    assert_same_curve(&reference, &f.losses("shard2"), "2 ranks, shard");
    assert_close_grad_norms(&reference_norms, &f.logged("shard2", "grad_norm"), "shard2");
    // Every rank recorded its own titan-obs timeline.
    for r in 0..2 {
        let dir = f.root.join(format!("shard2/obs/rank-{r}"));
        assert!(dir.is_dir(), "{} missing", dir.display());
    }

    // HSDP: 2 replicas x 2 shards on 4 ranks.
    let mut c = titan_train(&f.args("hsdp4", GLOBAL_BATCH / 4));
    c.args([
        "--nproc-per-node",
        "4",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--log-ranks",
        "0",
    ]);
    let out = run_ok(&mut c);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("[rank1]:"),
        "--log-ranks 0 hides rank 1:\n{stdout}"
    );
    assert_same_curve(&reference, &f.losses("hsdp4"), "4 ranks, 2x2 HSDP");
    assert_close_grad_norms(&reference_norms, &f.logged("hsdp4", "grad_norm"), "hsdp4");

    // Parameters kept gathered between forward and backward: the same curve.
    let mut c = titan_train(&f.args("shard2_keep", GLOBAL_BATCH / 2));
    c.args([
        "--nproc-per-node",
        "2",
        "--parallelism.fsdp_reshard_after_forward",
        "never",
    ]);
    run_ok(&mut c);
    assert_same_curve(
        &reference,
        &f.losses("shard2_keep"),
        "2 ranks, never reshard",
    );
    // ...while it really kept them: backward gathers none of them again. By default every unit
    // but the last (norm + lm_head, kept as torchtitan keeps it) is freed after forward and
    // gathered again for backward; the units are the embeddings, 6 blocks and the head.
    let units = 8;
    for r in 0..2 {
        let gathers = |name: &str| span_counts(&f.root.join(name), r, "all_gather");
        let (default, kept) = (gathers("shard2"), gathers("shard2_keep"));
        for step in 1..=STEPS as u64 {
            assert_eq!(
                kept.get(&step),
                Some(&units),
                "rank {r} step {step}: never reshard"
            );
            assert_eq!(
                default.get(&step),
                Some(&(2 * units - 1)),
                "rank {r} step {step}: the default reshards all but the last unit"
            );
        }
    }
}

/// How far a float8 layout's losses and grad norms may drift from one process's over the 10
/// steps. Step 1 multiplies the same float8 numbers on every layout and is held to the fp32
/// tolerance (1e-5); after it, a last-bit difference of an updated weight (fp32 sums in another
/// order, as every layout has) can move a value across a float8 rounding boundary, a 2⁻⁴ step, and
/// the runs drift apart: measured up to 1.7e-4 (losses) and 2.8e-4 (grad norms) over rowwise and
/// tensorwise on TP2 and FSDP2. titan against torchtitan on one layout
/// drifts as much (tt_parity.rs).
const FLOAT8_DRIFT: f64 = 1e-3;

fn assert_float8_curve(want: &[(f64, f64)], got: &[(f64, f64)], what: &str) {
    assert_eq!(got.len(), STEPS, "{what}: {got:?}");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    let (mut loss, mut norm) = (0.0f64, 0.0f64);
    for (step, (a, b)) in want.iter().zip(got).enumerate() {
        let (dl, dn) = (rel(a.0, b.0), rel(a.1, b.1));
        let limit = if step == 0 { 1e-5 } else { FLOAT8_DRIFT };
        assert!(
            dl <= limit && dn <= limit.max(GRAD_NORM_RTOL),
            "{what}: step {} loss {} grad norm {} vs single process {} {} ({dl:e}, {dn:e})",
            step + 1,
            b.0,
            b.1,
            a.0,
            a.1
        );
        (loss, norm) = (loss.max(dl), norm.max(dn));
    }
    assert!(
        want[STEPS - 1].0 < want[0].0 - 0.5,
        "loss does not fall: {want:?}"
    );
    println!(
        "{what}: worst relative difference from one process: losses {loss:.1e}, grad norms {norm:.1e}"
    );
}

/// float8 linears (rowwise emulated, tensorwise through torch._scaled_mm) train the same on FSDP2
/// and TP2 as on one process, within [`FLOAT8_DRIFT`]. Tensor parallelism splits no batch and
/// takes every amax over the whole tensor, so TP2 is compared with one process on the same batch;
/// data parallelism splits the batch and each rank's activations get their own scales (as
/// torchtitan's), so FSDP2 is compared with one process that runs the two halves as microbatches
/// (docs_w1's order puts rank r's samples in microbatch r). Rowwise through `_scaled_mm` rounds
/// each product to bf16 (the rowwise kernels have no f32 output, as in torchao), and under TP each
/// rank's partial sum of a row-wise linear is rounded before the ranks add them: there TP2 also
/// differs from one process by bf16 rounding, so the emulated rowwise path is the one compared.
/// PP2 (tensorwise) is compared with one process accumulating the same one-sample microbatches.
#[test]
fn float8_trains_the_same_on_fsdp2_tp2_and_pp2_as_on_one_process() {
    let f = Fixture::new();
    for (recipe, emulate) in [("rowwise", "true"), ("tensorwise", "false")] {
        let float8 = [
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            recipe,
            "--float8.emulate",
            emulate,
        ];
        let run = |name: &str, local_batch: usize, extra: &[&str]| {
            let mut c = titan_train(&f.args(name, local_batch));
            c.args(float8).args(extra);
            let out = run_ok(&mut c);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                stdout.contains(&format!("float8 training ({recipe}")),
                "{stdout}"
            );
            let (losses, norms) = (f.losses(name), f.logged(name, "grad_norm"));
            losses.into_iter().zip(norms).collect::<Vec<_>>()
        };
        let single = run(&format!("{recipe}_single"), GLOBAL_BATCH, &[]);
        let tp = [
            "--nproc-per-node",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ];
        let tp2 = run(&format!("{recipe}_tp2"), GLOBAL_BATCH, &tp);
        assert_float8_curve(&single, &tp2, &format!("float8 {recipe} TP2"));

        let halves = f.root.join("docs_w1.txt").display().to_string();
        let micro = run(
            &format!("{recipe}_micro"),
            GLOBAL_BATCH / 2,
            &["--training.dataset_path", &halves],
        );
        let fsdp2 = run(
            &format!("{recipe}_fsdp2"),
            GLOBAL_BATCH / 2,
            &["--nproc-per-node", "2"],
        );
        assert_float8_curve(&micro, &fsdp2, &format!("float8 {recipe} FSDP2"));

        // Pipeline parallelism runs microbatches of one sample (each with its own activation
        // scales): one process accumulating the same one-sample microbatches in order.
        if recipe == "tensorwise" {
            let singles = run(
                &format!("{recipe}_micro1"),
                1,
                &["--training.dataset_path", &halves],
            );
            let pp2 = run(
                &format!("{recipe}_pp2"),
                GLOBAL_BATCH,
                &[
                    "--nproc-per-node",
                    "2",
                    "--parallelism.pipeline_parallel_degree",
                    "2",
                ],
            );
            assert_float8_curve(&singles, &pp2, &format!("float8 {recipe} PP2"));
        }
    }
}

/// PP2 x HSDP (2 replicas x 2 shards) on 8 ranks: each stage's units reduce-scatter their
/// gradients over the shards and all-reduce them over the replicas once a step, after the last
/// backward; the losses and grad norms are one process's. (8 processes: the full matrix.)
#[test]
#[ignore = "full matrix: bash bench/full_matrix.sh"]
fn pipeline_parallel_over_hsdp_matches_one_rank() {
    let f = Fixture::new();
    run_ok(&mut titan_train(&f.args("single", GLOBAL_BATCH)));
    let mut c = titan_train(&f.args("pp2_hsdp", GLOBAL_BATCH / 4));
    c.args([
        "--nproc-per-node",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ]);
    run_ok(&mut c);
    assert_same_curve(&f.losses("single"), &f.losses("pp2_hsdp"), "pp2_hsdp");
    assert_close_grad_norms(
        &f.logged("single", "grad_norm"),
        &f.logged("pp2_hsdp", "grad_norm"),
        "pp2_hsdp",
    );
    let reductions = span_counts(&f.root.join("pp2_hsdp"), 0, "reduce_scatter");
    let want: std::collections::BTreeMap<u64, u64> = (1..=STEPS as u64).map(|s| (s, 4)).collect();
    assert_eq!(reductions, want, "reduce-scatters a step on rank 0");
}

/// InterleavedZeroBubble with data parallelism (DDP), expert parallelism and context
/// parallelism (FSDP over the cp ranks, and the ring's K/V exchange in backward): its weight
/// passes bring each linear's gradient after the input pass, and the stage's sums take them in
/// before the step's one reduction, so its steps are Interleaved1F1B's bit for bit (the same
/// stages and microbatches; only when each weight gradient is computed differs). PP2 x FSDP2
/// with it is in `pipeline_parallel_loss_curves_match_one_rank`.
#[test]
#[ignore = "full matrix: bash bench/full_matrix.sh"]
fn zero_bubble_with_data_expert_and_context_parallelism_equals_interleaved_1f1b() {
    let f = Fixture::new();
    let ddp: &[&str] = &[
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ];
    let ep: &[&str] = &[
        "--module",
        "deepseek_v3",
        "--config",
        "deepseek_v3_debugmodel",
        "--activation_checkpoint.mode",
        "none",
        "--parallelism.expert_parallel_degree",
        "2",
    ];
    let cp: &[&str] = &["--parallelism.context_parallel_degree", "2"];
    for (layout, extra) in [("ddp2", ddp), ("ep2", ep), ("cp2", cp)] {
        let run = |schedule: &str| {
            let name = format!("{layout}_{schedule}");
            let mut c = titan_train(&f.args(&name, GLOBAL_BATCH / 2));
            c.args([
                "--nproc-per-node",
                "4",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            ])
            .args(extra);
            run_ok(&mut c);
            (f.losses(&name), f.logged(&name, "grad_norm"))
        };
        let zero_bubble = run("InterleavedZeroBubble");
        assert_eq!(zero_bubble.0.len(), STEPS, "{layout}");
        assert_eq!(zero_bubble, run("Interleaved1F1B"), "{layout}");
    }
}

/// The bytes every rank passed to all-gathers over the run (titan-obs's `comm/all_gather_bytes`).
fn all_gather_bytes(run: &Path) -> f64 {
    let o = run_ok(
        Command::new(bin("titan-obs"))
            .arg("metrics")
            .arg("--json")
            .arg(run),
    );
    let steps: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    steps
        .iter()
        .map(|s| {
            s["values"]["comm/all_gather_bytes_sum"]
                .as_f64()
                .unwrap_or(0.0)
        })
        .sum()
}

/// FSDP's float8 all-gather (tensorwise): the weights travel as float8 and the run is the run
/// without it, bit for bit in fp32 (the shards are cast with the whole weight's scale, so the
/// gathered float8 values are the ones the layer casts itself), with scales from each gather or
/// precomputed after the optimizer step, and under full activation checkpointing (which gathers
/// again in backward).
#[test]
fn fsdp_float8_all_gather_gathers_float8_and_trains_bit_identically() {
    let f = Fixture::new();
    // Two data-parallel ranks of `mp` ranks each (the tp or pp degree `extra` sets).
    let run = |name: &str, mp: usize, extra: &[&str]| {
        let mut c = titan_train(&f.args(name, GLOBAL_BATCH / 2));
        c.args([
            "--nproc-per-node",
            &(2 * mp).to_string(),
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            "tensorwise",
            "--float8.emulate",
        ])
        .args(extra);
        let out = run_ok(&mut c);
        let (losses, norms) = (f.losses(name), f.logged(name, "grad_norm"));
        assert_eq!(losses.len(), STEPS, "{name}");
        (losses, norms, out)
    };
    let (losses, norms, _) = run("f8_fsdp2", 1, &[]);
    let bytes = all_gather_bytes(&f.root.join("f8_fsdp2"));
    for (name, extra) in [
        ("f8_gather", &["--float8.enable_fsdp_float8_all_gather"][..]),
        (
            "f8_gather_precomputed",
            &[
                "--float8.enable_fsdp_float8_all_gather",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
            ],
        ),
        (
            "f8_gather_ac",
            &[
                "--float8.enable_fsdp_float8_all_gather",
                "--activation_checkpoint.mode",
                "full",
            ],
        ),
    ] {
        let (l, n, out) = run(name, 1, extra);
        assert!(
            text(&out).contains("FSDP gathers the float8 linears' weights in float8"),
            "{}",
            text(&out)
        );
        assert_eq!(l, losses, "{name}: losses differ from the fp32 all-gather");
        assert_eq!(
            n, norms,
            "{name}: grad norms differ from the fp32 all-gather"
        );
        // The debug model's float8 weights are 95% of its gathered bytes: fp32 -> float8 moves
        // 0.05 + 0.95 / 4 = 29% of them (measured 31.7% with the per-parameter padding).
        let ratio = all_gather_bytes(&f.root.join(name)) / bytes;
        assert!(
            (0.25..0.35).contains(&ratio),
            "{name}: all-gather bytes {ratio:.3} of the fp32 gather"
        );
    }
    // FSDP2 x TP2: a weight's amax spans its tp shards too, so the gathered float8 values are
    // still the ones the layer casts from the whole weight. PP2 x FSDP2: a unit's float8 gather
    // is kept for the step's 2 microbatches with the scales it was cast with.
    for (layout, flag) in [
        ("tp2", "--parallelism.tensor_parallel_degree"),
        ("pp2", "--parallelism.pipeline_parallel_degree"),
    ] {
        let (losses, norms, _) = run(&format!("f8_fsdp2_{layout}"), 2, &[flag, "2"]);
        let gather = [flag, "2", "--float8.enable_fsdp_float8_all_gather"];
        let (l, n, _) = run(&format!("f8_gather_{layout}"), 2, &gather);
        assert_eq!(
            l, losses,
            "{layout}: losses differ with the float8 all-gather"
        );
        assert_eq!(
            n, norms,
            "{layout}: grad norms differ with the float8 all-gather"
        );
    }
    // Under PP the amax all-reduce runs once a unit and step (stage 0 holds 3 blocks of float8
    // linears), not once a microbatch.
    let all_reduces = |name: &str| span_counts(&f.root.join(name), 0, "all_reduce");
    let plain = all_reduces("f8_fsdp2_pp2");
    let want: std::collections::BTreeMap<u64, u64> =
        plain.iter().map(|(&step, &n)| (step, n + 3)).collect();
    assert_eq!(
        all_reduces("f8_gather_pp2"),
        want,
        "amax all-reduces a step"
    );
}

#[test]
fn torchrun_style_environment_launch_with_ddp() {
    let f = Fixture::new();
    run_ok(&mut titan_train(&f.args("single", GLOBAL_BATCH)));
    let reference = f.losses("single");

    // DDP: replicate 2, shard 1; the two ranks started by hand as torchrun would.
    let port = titan_tests::free_port().to_string();
    let mut args = f.args("ddp2", GLOBAL_BATCH / 2);
    args.extend(
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ]
        .map(String::from),
    );
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            titan_train(&args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "rank {r} failed:\n{}", text(&o));
    }
    assert_same_curve(&reference, &f.losses("ddp2"), "2 ranks by env, replicate");
    // That DDP copies no parameter is held in tests/tests/trainer_memory_measured.rs (a DDP
    // rank's measured peak against one process's): a group of one rank records no collective,
    // so span counts here could not tell.
}

#[test]
fn killing_a_rank_ends_the_job_naming_it() {
    let f = Fixture::new();
    let mut args = f.args("killed", 1);
    args.extend(["--training.steps", "100000", "--nproc-per-node", "2"].map(String::from));
    let mut launcher = titan_train(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until training runs (rank 0 logged a step), then SIGKILL rank 1.
    let metrics = f.root.join("killed/metrics.jsonl");
    let rank1 = titan_tests::running_rank(&mut launcher, "1", Duration::from_secs(120), || {
        metrics.exists()
    });
    let killed_at = Instant::now();
    let kill = Command::new("kill")
        .args(["-9", &rank1.to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = launcher.wait_with_output().unwrap();
    let took = killed_at.elapsed();
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGKILL"),
        "the dead rank and its signal are named:\n{stderr}"
    );
    assert!(
        took < Duration::from_secs(30),
        "took {took:?} to stop the job"
    );
}

#[test]
fn multi_rank_checkpoint_resumes_identically_and_torch_reads_it() {
    let f = Fixture::new();
    let mut args = f.args("ckpt", GLOBAL_BATCH / 2);
    args.extend(
        [
            "--nproc-per-node",
            "2",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "5",
            "--checkpoint.keep_latest_k",
            "0",
        ]
        .map(String::from),
    );
    run_ok(&mut titan_train(&args));
    let straight = f.losses("ckpt");
    let ckpt = f.root.join("ckpt/checkpoint");

    // torch reads the 2-rank FSDP2 checkpoint: one data file per rank, AdamW rows from both.
    let out = titan_tests::python_script("tests/python/dist_ckpt_check.py")
        .arg(ckpt.join("step-10"))
        .arg("2")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["files"],
        serde_json::json!([".metadata", "__0_0.distcp", "__1_0.distcp", "titan_run_id"])
    );
    assert_eq!(report["step"], 10);
    assert_eq!(report["exp_avg_chunks"]["tok_embeddings.weight"], 2);
    // q/k/v under torchtitan's fused name: one chunk per head of each projection (16 + 16 + 16).
    assert_eq!(
        report["exp_avg_chunks"]["layers.0.attention.qkv_linear.wqkv.weight"],
        48
    );

    // Resume from step 5 (async saves this time) and replay steps 6..10 exactly.
    std::fs::remove_dir_all(ckpt.join("step-10")).unwrap();
    args.extend(["--checkpoint.async_mode", "async"].map(String::from));
    run_ok(&mut titan_train(&args));
    // metrics.jsonl is appended: the resumed run's lines follow the straight run's 10.
    let resumed = f.losses("ckpt")[straight.len()..].to_vec();
    assert_eq!(
        resumed,
        straight[5..],
        "steps 6..10 after resuming from step 5"
    );
    assert!(ckpt.join("step-10/.metadata").is_file());
    // The resume continues the run its checkpoint was saved by.
    let runs: std::collections::BTreeSet<String> =
        std::fs::read_to_string(f.root.join("ckpt/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["run_id"].to_string())
            .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
}

/// A checkpoint of FSDP2 x TP2 (4 ranks: each writes its 2-D blocks) is read by torch's
/// `dcp.load`, resumes on FSDP2 alone (2 ranks) with the straight run's next losses, and the two
/// layouts' final checkpoints hold the same weights and AdamW state.
#[test]
fn sharded_checkpoints_load_on_another_layout() {
    let f = Fixture::new();
    let ckpt_args = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
        "--checkpoint.keep_latest_k",
        "0",
    ];
    let mut args = f.args("mesh", GLOBAL_BATCH / 2);
    args.extend(ckpt_args.map(String::from));
    let mut c = titan_train(&args);
    c.args([
        "--nproc-per-node",
        "4",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]);
    run_ok(&mut c);
    let straight = f.losses("mesh");
    let ckpt = f.root.join("mesh/checkpoint");

    let out = titan_tests::python_script("tests/python/dist_ckpt_check.py")
        .arg(ckpt.join("step-10"))
        .arg("2")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let chunks = &report["exp_avg_chunks"];
    // Column-wise (tp splits rows) and row-wise (tp splits columns) weights: 2 x 2 blocks; a
    // norm is replicated over tp and written once per FSDP shard; q/k/v's state goes under
    // torchtitan's fused name, one run of rows per head and projection.
    assert_eq!(chunks["layers.0.feed_forward.w1.weight"], 4);
    assert_eq!(chunks["layers.0.attention.wo.weight"], 4);
    assert_eq!(chunks["layers.0.attention.qkv_linear.wqkv.weight"], 48);
    assert_eq!(chunks["layers.0.attention_norm.weight"], 2);
    assert_eq!(report["step"], 10);

    // Keep step 5 in a second run folder and resume it on FSDP2 alone (the same dp degree, so
    // the data position loads too).
    let resumed_dir = f.root.join("fsdp");
    std::fs::create_dir_all(resumed_dir.join("checkpoint")).unwrap();
    let copy = Command::new("cp")
        .arg("-r")
        .arg(ckpt.join("step-5"))
        .arg(resumed_dir.join("checkpoint"))
        .status()
        .unwrap();
    assert!(copy.success());
    let mut args = f.args("fsdp", GLOBAL_BATCH / 2);
    args.extend(ckpt_args.map(String::from));
    let mut c = titan_train(&args);
    c.args(["--nproc-per-node", "2"]);
    run_ok(&mut c);
    let resumed = f.losses("fsdp");
    assert_eq!(resumed.len(), 5, "steps 6..10: {resumed:?}");
    for (step, (a, b)) in straight[5..].iter().zip(&resumed).enumerate() {
        assert!(
            (a - b).abs() / a <= 1e-5,
            "step {}: {b} after resuming on FSDP2 vs {a} on FSDP2 x TP2",
            step + 6
        );
    }
    // Both layouts end with the same state (weights and AdamW moments), tensor by tensor; only
    // the RNG states of ranks 2 and 3 have no counterpart on 2 ranks.
    let out = Command::new(bin("titan-ckpt"))
        .arg("diff")
        .arg(ckpt.join("step-10"))
        .arg(resumed_dir.join("checkpoint/step-10"))
        .args(["--atol", "1e-5"])
        .output()
        .unwrap();
    let report = text(&out);
    assert!(
        report.contains(" 0 differ in value (atol 0.00001); 2 only in A, 0 only in B"),
        "{report}"
    );
    let rows = report
        .lines()
        .filter(|l| l.contains("only in A") && !l.contains("in both"));
    for line in rows {
        assert!(line.starts_with("rng_state.cpu.rank_"), "{report}");
    }
}

/// The last save in HF format from 2 ranks (weights written and consolidated by both) equals
/// titan-ckpt's conversion of the same run's DCP checkpoint.
#[test]
fn multi_rank_hf_export_matches_the_dcp_checkpoint() {
    let f = Fixture::new();
    let run = |name: &str, extra: &[&str]| {
        let mut args = f.args(name, GLOBAL_BATCH / 2);
        args.extend(
            [
                "--nproc-per-node",
                "2",
                "--training.steps",
                "3",
                "--checkpoint.enable",
                "--checkpoint.interval",
                "100",
            ]
            .map(String::from),
        );
        args.extend(extra.iter().map(|s| s.to_string()));
        run_ok(&mut titan_train(&args));
        f.root.join(name).join("checkpoint/step-3")
    };
    let hf = run("hf", &["--checkpoint.last_save_in_hf"]);
    let dcp = run("dcp", &[]);
    assert!(hf.join("model.safetensors").is_file(), "{}", hf.display());
    assert!(hf.join("config.json").is_file());
    assert!(!hf.join("sharded").exists());

    let converted = f.root.join("converted");
    let ckpt = |args: &[&std::ffi::OsStr]| run_ok(Command::new(bin("titan-ckpt")).args(args));
    ckpt(&[
        "convert".as_ref(),
        "--to".as_ref(),
        "hf".as_ref(),
        "--adapter".as_ref(),
        "llama3".as_ref(),
        "--model-only".as_ref(),
        "--quiet".as_ref(),
        dcp.as_os_str(),
        converted.as_os_str(),
    ]);
    let out = ckpt(&[
        "diff".as_ref(),
        "--json".as_ref(),
        "--quiet".as_ref(),
        hf.as_os_str(),
        converted.as_os_str(),
    ]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("q_proj"),
        "diff covers the model:\n{report}"
    );
}
