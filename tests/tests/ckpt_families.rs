//! titan-ckpt converts every torchtitan 0.3.0 LLM family it has a table for: tiny qwen3 (dense,
//! tied embeddings), qwen3 MoE, DeepSeek-V3 (MLA; with and without q-LoRA and MTP) made by
//! torchtitan's own layer builders (tests/python/tt_ckpt_families.py, TITAN_TT_PYTHON), saved by
//! one process and by 2 gloo ranks with FSDP2 (experts split on the expert dim). `--to hf` must
//! equal the family adapter's `to_hf` bit for bit and give transformers the same logits; `--to
//! dcp` from HF must `dcp.load` into torchtitan's state dict exactly (minus what HF cannot hold).

use std::process::Command;

use titan_tests::{output_text, python_script, run_ok, titan_ckpt, tt_python_script};

const SCRIPT: &str = "tests/python/tt_ckpt_families.py";

fn ckpt() -> Command {
    let mut c = titan_ckpt();
    c.arg("--quiet");
    c
}

/// Makes `flavor`'s fixtures, converts both DCPs to HF and the expected HF back to DCP, and
/// checks each; returns titan's stderr of the 2-rank conversion.
fn round_trip(flavor: &str, family: &str, extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("fixture");
    run_ok(tt_python_script(SCRIPT).arg("make").arg(&d).arg(flavor));
    let cfg = d.join("hf_config.json");
    let mut stderr = String::new();
    for (src, adapter) in [("dcp1", family), ("dcp2", "auto")] {
        let out = tmp.path().join(format!("hf-{src}"));
        let o = run_ok(
            ckpt()
                .arg("convert")
                .arg(d.join(src))
                .arg(&out)
                .args([
                    "--to",
                    "hf",
                    "--adapter",
                    adapter,
                    "--max-shard-size",
                    "200KB",
                ])
                .arg("--hf-config")
                .arg(&cfg)
                .args(extra),
        );
        stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        let o = run_ok(python_script(SCRIPT).arg("check-hf").arg(&out).arg(&d));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("bit-equal, logits equal"),
            "{flavor} {src}: {}",
            output_text(&o)
        );
    }
    let dcp = tmp.path().join("dcp");
    run_ok(
        ckpt()
            .arg("convert")
            .arg(d.join("expected_hf.safetensors"))
            .arg(&dcp)
            .args(["--to", "dcp", "--adapter", family]),
    );
    let o = run_ok(
        tt_python_script(SCRIPT)
            .arg("check-dcp")
            .arg(&dcp)
            .arg(&d)
            .arg(flavor),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("ok"),
        "{}",
        output_text(&o)
    );
    stderr
}

#[test]
fn qwen3_dense_with_tied_embeddings() {
    let err = round_trip("qwen3", "qwen3", &[]);
    assert!(
        err.contains("picked qwen3") && err.contains("`lm_head.weight` left out"),
        "{err}"
    );
}

#[test]
fn qwen3_moe_experts_split_and_stacked() {
    let err = round_trip("qwen3_moe", "qwen3", &[]);
    assert!(err.contains("expert_bias_E` left out"), "{err}");
}

#[test]
fn deepseek_v3_mla_moe() {
    let err = round_trip("deepseek_v3", "deepseek_v3", &[]);
    assert!(err.contains("picked deepseek_v3"), "{err}");
}

#[test]
fn deepseek_v3_with_q_lora_and_mtp() {
    round_trip("deepseek_v3_qlora_mtp", "deepseek_v3", &[]);
}

#[test]
fn qwen3_moe_config_inferred_without_hf_config() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("fixture");
    run_ok(
        tt_python_script(SCRIPT)
            .arg("make")
            .arg(&d)
            .arg("qwen3_moe"),
    );
    let out = tmp.path().join("hf");
    // Top-k is not in a checkpoint: refused (exit 2) until given.
    let o = ckpt()
        .arg("convert")
        .arg(d.join("dcp1"))
        .arg(&out)
        .args(["--to", "hf", "--adapter", "qwen3"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--experts-per-token"));
    let out = tmp.path().join("hf2");
    run_ok(ckpt().arg("convert").arg(d.join("dcp1")).arg(&out).args([
        "--to",
        "hf",
        "--adapter",
        "qwen3",
        "--experts-per-token",
        "2",
    ]));
    let ours: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let theirs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("hf_config.json")).unwrap()).unwrap();
    for k in [
        "architectures",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
        "tie_word_embeddings",
    ] {
        assert_eq!(ours[k], theirs[k], "{k}");
    }
}
