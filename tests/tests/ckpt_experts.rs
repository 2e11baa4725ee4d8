//! `titan-ckpt verify` on mixture-of-experts checkpoints written by torchtitan 0.3.0's own Trainer
//! under expert parallelism (tests/python/tt_ckpt_ep.py, TITAN_TT_PYTHON: qwen3_moe_debug and
//! deepseek_v3_debugmodel at EP 2 on 2 gloo ranks, qwen3 at EP 2 x efsdp 2 on 4), and on copies
//! of them edited the way bad saves go wrong:
//! - torchtitan's checkpoints pass: every expert of every layer exactly once, none bit-identical;
//! - rank 1's chunks of layer 1's experts dropped from `.metadata` (torch's `dcp.load` reads that
//!   without a word): verify fails naming every expert tensor of layer 1, model and optimizer
//!   state, and the experts no chunk holds;
//! - rank 0's local experts saved as if they were all (`[E/2, ...]`, tiling exactly): verify
//!   fails naming the router that routes to E;
//! - rank 1's expert bytes overwritten with rank 0's: verify warns naming tensor, layer and
//!   the experts that are copies (exit 0), and `--strict` exits 3;
//! - the same checks on HF's split experts (`mlp.experts.N.*`) after `convert --to hf`: a
//!   missing expert is a missing tensor.
//!
//! Each flavor's fixture is made once per test binary (about 15-25 s each on 2 cores).

use std::path::{Path, PathBuf};
use std::process::Output;

use titan_tests::{ckpt, fixture_made_once, output_text, python, run_ok, tt_python_script};

const SCRIPT: &str = "tests/python/tt_ckpt_ep.py";

/// Each flavor, and rank 1's experts of 8 (what `missing` loses and `copied` overwrites): EP
/// rank 1 holds experts 4..8; with efsdp 2 over 4 ranks, rank 1 is (efsdp 0, ep 1): experts 4..6
/// (torchtitan's sparse mesh `[efsdp, ep]`, ep fastest; read in the fixture's `.metadata`).
const FLAVORS: [(&str, &str, &str); 3] = [
    ("qwen3_ep2", "4..8", "0..4"),
    ("deepseek_v3_ep2", "4..8", "0..4"),
    ("qwen3_ep2_fsdp4", "4..6", "0..2"),
];

/// The layer `missing` and `halved` break (tt_ckpt_ep.py's LAYER).
const LAYER: u64 = 1;

fn fixture(flavor: &str) -> PathBuf {
    fixture_made_once(SCRIPT, flavor, tt_python_script)
}

/// The fixture's routed-expert model tensors (`info.json`).
fn expert_tensors(d: &Path) -> Vec<String> {
    let info: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("info.json")).unwrap()).unwrap();
    assert_eq!(info["experts"], 8);
    assert_eq!(info["layer"], LAYER);
    info["expert_tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

fn verify(path: &Path, extra: &[&str]) -> (Option<i32>, String, Output) {
    let o = ckpt().arg("verify").arg(path).args(extra).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    (o.status.code(), stdout, o)
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).expect("verify --json prints JSON")
}

#[test]
fn torchtitan_ep_checkpoints_hold_every_expert_once() {
    for (flavor, ..) in FLAVORS {
        let d = fixture(flavor);
        let (code, out, o) = verify(&d.join("good"), &["--strict"]);
        assert_eq!(code, Some(0), "{flavor}: {}", output_text(&o));
        assert!(
            out.contains("x 8 experts, each expert exactly once in")
                && out.contains("no two bit-identical"),
            "{flavor}: {out}"
        );
        let (_, out, _) = verify(&d.join("good"), &["--json"]);
        let v = json(&out);
        assert_eq!(v["warnings"], serde_json::json!([]), "{flavor}");
        let layers = if flavor.starts_with("deepseek") { 5 } else { 2 };
        assert_eq!(v["experts"]["layers"], layers, "{flavor}");
        assert_eq!(v["experts"]["experts_per_layer"], serde_json::json!([8]));
        // Model and AdamW's two moments of each expert tensor.
        assert_eq!(
            v["experts"]["tensors"],
            3 * expert_tensors(&d).len(),
            "{flavor}"
        );
    }
}

#[test]
fn a_rank_s_missing_experts_fail_naming_tensor_layer_and_experts() {
    for (flavor, rank1, _) in FLAVORS {
        let d = fixture(flavor);
        let (code, out, o) = verify(&d.join("missing"), &[]);
        assert_eq!(code, Some(1), "{flavor}: {}", output_text(&o));
        let metadata = d.join("missing").join(".metadata");
        let layer = format!("layers.{LAYER}.");
        let broken: Vec<String> = expert_tensors(&d)
            .into_iter()
            .filter(|t| t.starts_with(&layer))
            .collect();
        assert_eq!(broken.len(), 3, "{flavor}: w1, w2, w3");
        for t in &broken {
            for name in [
                t.clone(),
                format!("optimizer.state.{t}.exp_avg"),
                format!("optimizer.state.{t}.exp_avg_sq"),
            ] {
                let want = format!(
                    "{}: tensor `{name}`: layer {LAYER}: experts {rank1} of 8 are in no chunk",
                    metadata.display()
                );
                assert!(out.contains(&want), "{flavor}: want {want} in:\n{out}");
            }
        }
        assert!(out.contains("FAILED (9 problems)"), "{flavor}: {out}");

        let (code, out, o) = verify(&d.join("halved"), &["--json"]);
        assert_eq!(code, Some(1), "{flavor}: {}", output_text(&o));
        let error = json(&out)["error"].as_str().unwrap().to_string();
        for t in &broken {
            let want = format!(
                "{t}: holds 4 experts but its router `layers.{LAYER}.moe.router.gate.weight` \
                 routes to 8: experts 4..8 are in no tensor"
            );
            assert!(error.contains(&want), "{flavor}: want {want} in:\n{error}");
        }
        assert_eq!(error.lines().count(), 9, "{flavor}: {error}");
    }
}

#[test]
fn experts_copied_from_another_rank_are_named_and_fail_under_strict() {
    for (flavor, rank1, rank0) in FLAVORS {
        let d = fixture(flavor);
        let copied = d.join("copied");
        let (code, out, o) = verify(&copied, &[]);
        assert_eq!(code, Some(0), "{flavor}: {}", output_text(&o));
        let tensors = expert_tensors(&d);
        for t in &tensors {
            let layer = t.split('.').nth(1).unwrap();
            let want = format!(
                "  warning: {t}: layer {layer}: experts {rank1} are bit-identical to experts \
                 {rank0}\n"
            );
            assert!(out.contains(&want), "{flavor}: want {want} in:\n{out}");
        }
        assert!(
            out.contains(&format!("{} WARNINGS", tensors.len())),
            "{flavor}: {out}"
        );
        let (code, out, _) = verify(&copied, &["--strict", "--json"]);
        assert_eq!(code, Some(3), "{flavor}: --strict fails on warnings");
        let v = json(&out);
        assert_eq!(v["ok"], true);
        assert_eq!(v["warnings"].as_array().unwrap().len(), tensors.len());
    }
}

/// `convert --to hf` of `src` into `out` (qwen3's split experts).
fn to_hf(src: &Path, out: &Path) {
    run_ok(ckpt().arg("convert").arg(src).arg(out).args([
        "--to",
        "hf",
        "--adapter",
        "qwen3",
        "--experts-per-token",
        "2",
    ]));
}

#[test]
fn hf_split_experts_missing_or_copied_are_named() {
    let d = fixture("qwen3_ep2");
    let tmp = tempfile::tempdir().unwrap();
    let (good, copied, missing) = (
        tmp.path().join("good"),
        tmp.path().join("copied"),
        tmp.path().join("missing"),
    );
    to_hf(&d.join("good"), &good);
    to_hf(&d.join("copied"), &copied);
    let (code, out, o) = verify(&good, &["--strict"]);
    assert_eq!(code, Some(0), "{}", output_text(&o));
    assert!(
        out.contains("2 MoE layers x 8 experts, each expert exactly once in 6 expert tensors"),
        "{out}"
    );

    let (code, out, o) = verify(&copied, &[]);
    assert_eq!(code, Some(0), "{}", output_text(&o));
    for l in 0..2 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let want = format!(
                "warning: model.layers.{l}.mlp.experts.{{E}}.{p}.weight: layer {l}: experts \
                 4..8 are bit-identical to experts 0..4"
            );
            assert!(out.contains(&want), "want {want} in:\n{out}");
        }
    }

    // Expert 5 of layer 1 left out (safetensors from .venv: no pickle).
    std::fs::create_dir(&missing).unwrap();
    run_ok(
        std::process::Command::new(python())
            .arg("-c")
            .arg(
                "import sys\nfrom safetensors.torch import load_file, save_file\n\
                 sd = load_file(sys.argv[1])\n\
                 save_file({k: v for k, v in sd.items() if '.layers.1.mlp.experts.5.' not in k}, \
                 sys.argv[2])",
            )
            .arg(good.join("model.safetensors"))
            .arg(missing.join("model.safetensors")),
    );
    let (code, out, o) = verify(&missing, &[]);
    assert_eq!(code, Some(1), "{}", output_text(&o));
    for p in ["gate_proj", "up_proj", "down_proj"] {
        let want = format!(
            "model.layers.1.mlp.experts.{{E}}.{p}.weight: layer 1: expert 5 of 8 is missing \
             (no such tensor)"
        );
        assert!(out.contains(&want), "want {want} in:\n{out}");
    }
    assert!(!out.contains("layers.0."), "{out}");
}
