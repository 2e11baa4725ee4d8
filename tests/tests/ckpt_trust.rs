//! titan-ckpt says what it did and refuses what would surprise (issue 27): `convert --to hf`
//! picks the adapter itself and says which, or says plainly that names are kept;
//! `consolidate` says what it included and has `--model-only`; `diff` reports only-in-A,
//! only-in-B and different values apart, and `--adapter` compares torchtitan with HF names;
//! a `.distcp` file or the wrong family get a hint; `verify` names the step it checked;
//! `convert` refuses an output folder that holds files unless `--force`.
//!
//! The fixture is a tiny torchtitan 0.3.0 llama3 training checkpoint (model weights and
//! AdamW state) written with titan-dcp, as torchtitan's `dcp.save` lays it out.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::json;
use titan_dcp::{DcpWriter, Dtype, FileKey, TensorChunk, WriteOptions};
use titan_tests::{output_text, titan_ckpt};

/// dim 16, 2 heads of 8, 1 layer, vocabulary 64, FFN 32.
const MODEL: &[(&str, &[u64])] = &[
    ("tok_embeddings.weight", &[64, 16]),
    ("layers.0.attention.qkv_linear.wq.weight", &[16, 16]),
    ("layers.0.attention.qkv_linear.wk.weight", &[16, 16]),
    ("layers.0.attention.qkv_linear.wv.weight", &[16, 16]),
    ("layers.0.attention.wo.weight", &[16, 16]),
    ("layers.0.feed_forward.w1.weight", &[32, 16]),
    ("layers.0.feed_forward.w2.weight", &[16, 32]),
    ("layers.0.feed_forward.w3.weight", &[32, 16]),
    ("layers.0.attention_norm.weight", &[16]),
    ("layers.0.ffn_norm.weight", &[16]),
    ("norm.weight", &[16]),
    ("lm_head.weight", &[64, 16]),
];

/// AdamW state of two of the weights: training state, not model weights.
const OPTIMIZER: &[(&str, &[u64])] = &[
    (
        "optimizer.state.layers.0.attention.wo.weight.exp_avg",
        &[16, 16],
    ),
    (
        "optimizer.state.layers.0.attention.wo.weight.exp_avg_sq",
        &[16, 16],
    ),
    ("optimizer.state.norm.weight.exp_avg", &[16]),
];

/// f32 values that differ per tensor and element (and are exact in bf16 too).
fn values(seed: usize, n: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (((i as usize * 7 + seed * 13) % 97) as f32 / 8.0 - 6.0).to_le_bytes())
        .collect()
}

/// A DCP checkpoint of `tensors` at `dir`, every tensor in one chunk of rank 0's file.
fn write_dcp(dir: &Path, tensors: &[(&str, &[u64])]) {
    let mut w = DcpWriter::create(
        dir,
        WriteOptions {
            zstd_level: None,
            fsync: false,
        },
    )
    .unwrap();
    for (i, (fqn, shape)) in tensors.iter().enumerate() {
        let data = values(i, shape.iter().product());
        let offsets = vec![0u64; shape.len()];
        w.add_tensor_chunk(
            FileKey { rank: 0, k: 0 },
            TensorChunk {
                fqn,
                dtype: Dtype::F32,
                global_shape: shape,
                offsets: &offsets,
                sizes: shape,
                data: &data,
            },
        )
        .unwrap();
    }
    w.finish().unwrap();
}

/// A run folder with `checkpoint/step-2` and `checkpoint/step-4`, each the model and its
/// optimizer state; returns the run folder.
fn training_run(tmp: &Path) -> PathBuf {
    let run = tmp.join("run");
    let all: Vec<(&str, &[u64])> = MODEL.iter().chain(OPTIMIZER).copied().collect();
    for step in [2, 4] {
        write_dcp(&run.join(format!("checkpoint/step-{step}")), &all);
    }
    run
}

fn step4(run: &Path) -> PathBuf {
    run.join("checkpoint/step-4")
}

fn ckpt(args: &[&str], paths: &[&Path]) -> Output {
    titan_ckpt()
        .args(args.iter().take_while(|a| **a != "{}"))
        .args(paths)
        .args(args.iter().skip_while(|a| **a != "{}").skip(1))
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The tensor names in a safetensors file.
fn names_in(file: &Path) -> Vec<String> {
    let b = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut names: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

#[test]
fn convert_to_hf_without_adapter_picks_the_family_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let out = tmp.path().join("hf");
    let o = ckpt(
        &["convert", "{}", "--to", "hf", "--n-heads", "2"],
        &[&step4(&run), &out],
    );
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(err.contains("no --adapter: picked llama3"), "{err}");
    // HF names, a config.json transformers reads, no optimizer state.
    assert!(out.join("config.json").exists(), "{err}");
    let names = names_in(&out.join("model.safetensors"));
    assert!(
        names.contains(&"model.embed_tokens.weight".to_string()),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("optimizer")),
        "{names:?}"
    );

    // `--adapter none` keeps torchtitan's names, and says so.
    let kept = tmp.path().join("kept");
    let o = ckpt(
        &["convert", "{}", "--to", "hf", "--adapter", "none"],
        &[&step4(&run), &kept],
    );
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(
        stderr(&o).contains("tensor names kept as they are"),
        "{}",
        stderr(&o)
    );
    assert!(!kept.join("config.json").exists());
    assert!(names_in(&kept.join("model.safetensors")).contains(&"tok_embeddings.weight".into()));

    // Names of no known family: kept, with a warning that transformers will not load them.
    let plain = tmp.path().join("plain");
    write_dcp(&plain, &[("w", &[4, 4]), ("b", &[4])]);
    let plain_out = tmp.path().join("plain-hf");
    let o = ckpt(&["convert", "{}", "--to", "hf"], &[&plain, &plain_out]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("warning") && err.contains("tensor names kept as they are"),
        "{err}"
    );
}

#[test]
fn consolidate_says_what_it_included_and_model_only_leaves_training_state_out() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let all = tmp.path().join("all");
    let o = ckpt(&["consolidate"], &[&step4(&run), &all]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("15 tensors: 12 model, 3 training state") && err.contains("--model-only"),
        "{err}"
    );
    assert_eq!(names_in(&all.join("model.safetensors")).len(), 15);

    let model = tmp.path().join("model");
    let o = ckpt(
        &["consolidate", "{}", "--model-only", "--dtype", "bf16"],
        &[&step4(&run), &model],
    );
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("12 model tensors; 3 training-state tensors left out (--model-only)"),
        "{err}"
    );
    let names = names_in(&model.join("model.safetensors"));
    assert_eq!(names.len(), 12, "{names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("optimizer")),
        "{names:?}"
    );
}

/// A plain safetensors file of F32 tensors (name, values).
fn safetensors(path: &Path, tensors: &[(&str, &[f32])]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, v) in tensors {
        let start = data.len();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, out).unwrap();
}

#[test]
fn diff_reports_only_in_a_only_in_b_and_different_values_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a/model.safetensors");
    let b = tmp.path().join("b/model.safetensors");
    safetensors(
        &a,
        &[
            ("same", &[1.0, 2.0]),
            ("changed", &[1.0, 2.0]),
            ("a_only", &[0.0]),
        ],
    );
    safetensors(
        &b,
        &[
            ("same", &[1.0, 2.0]),
            ("changed", &[1.0, 2.5]),
            ("b_only", &[0.0]),
            ("b_only_too", &[0.0]),
        ],
    );
    let o = ckpt(&["diff"], &[&a, &b]);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let out = stdout(&o);
    assert!(
        out.contains(
            "2 tensors in both: 1 equal, 1 differ in value (atol 0); 1 only in A, 2 only in B"
        ),
        "{out}"
    );
    let o = ckpt(&["diff", "{}", "--json"], &[&a, &b]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (
            &v["compared"],
            &v["differing"],
            &v["only_in_a"],
            &v["only_in_b"]
        ),
        (&json!(2), &json!(1), &json!(1), &json!(2)),
        "{v}"
    );
}

#[test]
fn diff_with_adapter_compares_torchtitan_names_with_hf_names() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let hf = tmp.path().join("hf");
    let o = ckpt(
        &[
            "convert",
            "{}",
            "--to",
            "hf",
            "--adapter",
            "llama3",
            "--n-heads",
            "2",
        ],
        &[&step4(&run), &hf],
    );
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));

    // By name only `lm_head.weight` (the same in both name spaces) matches: the others are
    // on one side only, not "different", and a note says what to pass.
    let o = ckpt(&["diff"], &[&hf, &step4(&run)]);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let out = stdout(&o);
    assert!(
        out.contains(
            "1 tensors in both: 1 equal, 0 differ in value (atol 0); 11 only in A, 14 only in B"
        ),
        "{out}"
    );
    let err = stderr(&o);
    assert!(
        err.contains("A has HF names, B torchtitan names")
            && err.contains("--adapter auto compares them"),
        "{err}"
    );

    // Through the adapter (q/k permuted back), the model weights are bit-equal, whichever
    // side the torchtitan checkpoint is on.
    for (x, y) in [(&hf, &step4(&run)), (&step4(&run), &hf)] {
        let o = ckpt(
            &["diff", "{}", "--adapter", "auto", "--n-heads", "2"],
            &[x, y],
        );
        assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
        let out = stdout(&o);
        assert!(
            out.contains("12 tensors in both: 12 equal, 0 differ in value")
                && out.contains("EQUAL"),
            "{out}"
        );
        assert!(
            stderr(&o).contains("3 training-state tensors"),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn a_distcp_file_or_the_wrong_family_gets_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let shard = step4(&run).join("__0_0.distcp");
    assert!(shard.exists());
    for cmd in ["inspect", "verify"] {
        let o = ckpt(&[cmd], &[&shard]);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {}", output_text(&o));
        let err = stderr(&o);
        assert!(
            err.contains("is one file of a DCP checkpoint: pass its folder")
                && err.contains(&step4(&run).display().to_string()),
            "{cmd}: {err}"
        );
    }

    let o = ckpt(
        &["convert", "{}", "--to", "hf", "--adapter", "qwen3"],
        &[&step4(&run), &tmp.path().join("out")],
    );
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("look like a llama3 checkpoint") && err.contains("--adapter auto"),
        "{err}"
    );
}

#[test]
fn verify_of_a_folder_names_the_step_it_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let o = ckpt(&["verify"], &[&run]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let out = stdout(&o);
    assert!(
        out.contains("(checked ")
            && out.contains("step-4, the newest step whose save committed, only): OK"),
        "{out}"
    );
    let o = ckpt(&["verify", "{}", "--json"], &[&run]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["checked"].as_str().is_some_and(|s| s.ends_with("step-4")),
        "{v}"
    );
    // A step folder itself: nothing to resolve, no "checked".
    let o = ckpt(&["verify"], &[&step4(&run)]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(!stdout(&o).contains("checked"), "{}", stdout(&o));
}

#[test]
fn convert_refuses_an_output_folder_that_holds_files_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let run = training_run(tmp.path());
    let out = tmp.path().join("hf");
    let args = ["convert", "{}", "--to", "hf", "--n-heads", "2"];
    let o = ckpt(&args, &[&step4(&run), &out]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let before = std::fs::read(out.join("model.safetensors")).unwrap();

    let o = ckpt(&args, &[&step4(&run), &out]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("already holds") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );

    let mut forced = args.to_vec();
    forced.push("--force");
    let o = ckpt(&forced, &[&step4(&run), &out]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    // An empty folder is no output to lose.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = ckpt(&args, &[&step4(&run), &empty]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
}
