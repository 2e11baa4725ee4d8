//! titan-ckpt converts every torchtitan 0.3.0 LLM family it has a table for: tiny qwen3 (dense,
//! tied embeddings), qwen3 MoE, DeepSeek-V3 (MLA; with and without q-LoRA and MTP), gpt-oss,
//! kimi_k2_7 and qwen3_5 (torchtitan's debugmodels, vision encoders included) made by
//! torchtitan's own layer builders (tests/python/tt_ckpt_families.py, TITAN_TT_PYTHON), saved by
//! one process and by 2 gloo ranks with FSDP2 (experts split on the expert dim). `--to hf` must
//! equal the family adapter's `to_hf` bit for bit and give transformers the same logits;
//! `--to dcp` from HF must `dcp.load` into torchtitan's state dict exactly (minus what HF cannot
//! hold). gpt-oss, whose 0.3.0 adapter drops every expert tensor, is held to torchtitan's model
//! instead: experts equal to the model's, transformers' logits (4.57 and 5.23) within bf16
//! tolerance of torchtitan's forward. kimi_k2_7 (whose HF model is remote code) and qwen3_5 (whose
//! GatedDeltaNet wants flash-linear-attention) are held to torchtitan's `to_hf` tensors alone.
//!
//! Each flavor's fixture is made once per test binary and shared by the tests that read it.

use std::path::{Path, PathBuf};
use std::process::Command;

use titan_tests::{
    ckpt, fixture_made_once, output_text, python_script, run_ok, run_says_ok, tf4_python_script,
    tt_python_script,
};

const SCRIPT: &str = "tests/python/tt_ckpt_families.py";

/// The fixture folder of `flavor` (`make`'s outputs), made on first use.
fn fixture(flavor: &str) -> PathBuf {
    fixture_made_once(SCRIPT, flavor, tt_python_script)
}

/// Small output files, so tensors are split across several (and an index is written).
const SHARDED: &str = "--max-shard-size=200KB";

/// `convert --to hf` of `src` (a fixture DCP or titan's own output) into `out`; titan's stderr.
fn to_hf(src: &Path, out: &Path, adapter: &str, extra: &[&str]) -> String {
    let o = run_ok(
        ckpt()
            .arg("convert")
            .arg(src)
            .arg(out)
            .args(["--to", "hf", "--adapter", adapter])
            .args(extra),
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `check-hf` of titan's HF outputs `outs` against the fixture `d` with `python` (plus
/// `extra` flags): each must report `want`.
fn check_hf(mut python: Command, d: &Path, outs: &[&Path], extra: &[&str], want: &str) {
    let o = run_ok(python.arg("check-hf").arg(d).args(outs).args(extra));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        stdout.matches(want).count(),
        outs.len(),
        "{}",
        output_text(&o)
    );
}

/// `convert --to dcp` of the HF checkpoint `hf`, then `dcp.load` must give torchtitan's state.
fn back_to_dcp(hf: &Path, tmp: &Path, flavor: &str, family: &str) {
    let d = fixture(flavor);
    let dcp = tmp.join("dcp");
    run_ok(
        ckpt()
            .arg("convert")
            .arg(hf)
            .arg(&dcp)
            .args(["--to", "dcp", "--adapter", family]),
    );
    run_says_ok(
        tt_python_script(SCRIPT)
            .arg("check-dcp")
            .arg(&dcp)
            .arg(&d)
            .arg(flavor),
    );
}

/// Converts both of `flavor`'s DCPs to HF (the 1-process one with `--adapter family`, the
/// 2-rank one with `auto`), checks each against torchtitan's `to_hf`, and torchtitan's `to_hf`
/// back to a DCP; returns titan's stderr of the 2-rank conversion.
fn round_trip(flavor: &str, family: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture(flavor);
    let cfg = format!("--hf-config={}", d.join("hf_config.json").display());
    let (hf1, hf2) = (tmp.path().join("hf-dcp1"), tmp.path().join("hf-dcp2"));
    to_hf(&d.join("dcp1"), &hf1, family, &[&cfg, SHARDED]);
    let stderr = to_hf(&d.join("dcp2"), &hf2, "auto", &[&cfg, SHARDED]);
    let want = match flavor {
        // Kimi's HF model is remote code; Qwen3.5's GatedDeltaNet wants flash-linear-attention.
        "kimi_k2_7" | "qwen3_5" | "qwen3_5_moe" => "tensors bit-equal (tensors only, no logits)",
        _ => "bit-equal, logits equal",
    };
    check_hf(python_script(SCRIPT), &d, &[&hf1, &hf2], &[], want);
    back_to_dcp(
        &d.join("expected_hf.safetensors"),
        tmp.path(),
        flavor,
        family,
    );
    stderr
}

#[test]
fn qwen3_dense_with_tied_embeddings() {
    let err = round_trip("qwen3", "qwen3");
    assert!(
        err.contains("picked qwen3") && err.contains("`lm_head.weight` left out"),
        "{err}"
    );
}

#[test]
fn qwen3_moe_experts_split_and_stacked() {
    let err = round_trip("qwen3_moe", "qwen3");
    assert!(err.contains("expert_bias_E` left out"), "{err}");
}

#[test]
fn deepseek_v3_mla_moe() {
    let err = round_trip("deepseek_v3", "deepseek_v3");
    assert!(err.contains("picked deepseek_v3"), "{err}");
}

#[test]
fn deepseek_v3_with_q_lora_and_mtp() {
    round_trip("deepseek_v3_qlora_mtp", "deepseek_v3");
}

/// Kimi K2.5/K2.7 (torchtitan's `kimi_k2_7` debugmodel): the DeepSeek-V3 text model under
/// `language_model.` and the MoonViT vision encoder (q/k/v fused into `wqkv`, the Linear patch
/// embedding as HF's Conv2d) bit-equal to torchtitan's `to_hf`, and back through `from_hf`'s
/// names into its model.
#[test]
fn kimi_k2_7_text_and_vision_encoder() {
    let err = round_trip("kimi_k2_7", "kimi_k2_7");
    assert!(err.contains("picked kimi_k2_7"), "{err}");
}

/// Qwen3.5 (torchtitan's `qwen3_5` debugmodel, its vocabulary cut to 2048): GatedDeltaNet layers
/// (HF's fused `in_proj_qkv` and `conv1d` split k, k, v by the layer's `in_proj_z`), full
/// attention layers, the vision encoder (fused qkv, Conv3d patch embedding) and merger,
/// bit-equal to torchtitan's `to_hf`, and back into its model.
#[test]
fn qwen3_5_deltanet_attention_and_vision_encoder() {
    let err = round_trip("qwen3_5", "qwen3_5");
    assert!(err.contains("picked qwen3_5"), "{err}");
}

/// Qwen3.5 MoE (torchtitan's `debugmodel_moe`): HF's fused `gate_up_proj` [E, D, 2F] is
/// torchtitan's w1 and w3 [E, F, D] transposed per expert side by side, `down_proj` w2
/// transposed per expert; shared expert and its gate.
#[test]
fn qwen3_5_moe_fused_gate_up_experts() {
    let err = round_trip("qwen3_5_moe", "qwen3_5");
    assert!(
        err.contains("picked qwen3_5") && err.contains("expert_bias_E` left out"),
        "{err}"
    );
}

#[test]
fn qwen3_moe_config_inferred_without_hf_config() {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture("qwen3_moe");
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
    assert_config_keys(
        &out,
        &d,
        &[
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
        ],
    );
}

/// Without --hf-config, DeepSeek-V3's config.json is read from the shapes (MLA ranks and head
/// dims, heads, dense layers, experts, shared experts, MTP layers); the routing a checkpoint does
/// not hold is given (top-k) or torchtitan's debugmodel's (logged); transformers loads it and
/// its logits equal those on torchtitan's `to_hf` with the flavor's own config.
#[test]
fn deepseek_v3_config_inferred_without_hf_config() {
    for flavor in ["deepseek_v3", "deepseek_v3_qlora_mtp"] {
        let tmp = tempfile::tempdir().unwrap();
        let d = fixture(flavor);
        let out = tmp.path().join("hf");
        // The tiny flavors route to 2 experts and use no YaRN.
        let flags = ["--experts-per-token", "2", "--no-rope-scaling", SHARDED];
        let err = to_hf(&d.join("dcp2"), &out, "deepseek_v3", &flags);
        assert!(err.contains("routed_scaling_factor = 1"), "{err}");
        assert_config_keys(
            &out,
            &d,
            &[
                "architectures",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "moe_intermediate_size",
                "n_routed_experts",
                "n_shared_experts",
                "num_experts_per_tok",
                "first_k_dense_replace",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "num_nextn_predict_layers",
                "norm_topk_prob",
                "vocab_size",
            ],
        );
        let want = "bit-equal, logits equal";
        check_hf(python_script(SCRIPT), &d, &[&out], &["--own-config"], want);
    }
}

/// titan's config.json in `out` has the fixture's values for `keys`.
fn assert_config_keys(out: &Path, d: &Path, keys: &[&str]) {
    let read = |p: PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let (ours, theirs) = (
        read(out.join("config.json")),
        read(d.join("hf_config.json")),
    );
    for k in keys {
        assert_eq!(ours[k], theirs[k], "{k}");
    }
}

const GPT_OSS_OK: &str = "expert tensors equal to the model's; logits within";

/// gpt-oss both ways: the non-expert tensors equal torchtitan's `to_hf` bit for bit, the expert
/// tensors (which that `to_hf` drops) equal the model's transposed per expert, transformers'
/// logits match torchtitan's forward, and titan's HF output goes back to torchtitan's state.
#[test]
fn gpt_oss_experts_transposed_both_ways() {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture("gpt_oss");
    let cfg = format!("--hf-config={}", d.join("hf_config.json").display());
    let (hf1, hf2) = (tmp.path().join("hf-dcp1"), tmp.path().join("hf-dcp2"));
    to_hf(&d.join("dcp1"), &hf1, "gpt_oss", &[&cfg, SHARDED]);
    let err = to_hf(&d.join("dcp2"), &hf2, "auto", &[&cfg, SHARDED]);
    assert!(
        err.contains("picked gpt_oss") && err.contains("expert_bias_E` left out"),
        "{err}"
    );
    check_hf(python_script(SCRIPT), &d, &[&hf1, &hf2], &[], GPT_OSS_OK);
    // torchtitan's to_hf has no experts to convert back: titan's own HF output is the source.
    back_to_dcp(&hf2, tmp.path(), "gpt_oss", "auto");
}

/// Without --hf-config, the GptOssForCausalLM config.json comes from the shapes plus
/// torchtitan's flavor defaults (each logged); transformers 5.23 and 4.57 load it and match.
#[test]
fn gpt_oss_config_inferred_loads_in_transformers_4_and_5() {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture("gpt_oss");
    let out = tmp.path().join("hf");
    let err = to_hf(&d.join("dcp2"), &out, "gpt_oss", &[SHARDED]);
    for logged in [
        "num_experts_per_tok = 4",
        "sliding_window = 128",
        "rope_scaling = yarn",
    ] {
        assert!(err.contains(logged), "{logged}: {err}");
    }
    assert_config_keys(
        &out,
        &d,
        &[
            "architectures",
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_local_experts",
            "num_experts_per_tok",
            "sliding_window",
            "layer_types",
            "attention_bias",
            "vocab_size",
            "tie_word_embeddings",
            "rope_theta",
            "rope_scaling",
        ],
    );
    for python in [python_script(SCRIPT), tf4_python_script(SCRIPT)] {
        check_hf(python, &d, &[&out], &["--own-config"], GPT_OSS_OK);
    }
}

/// MXFP4-quantized gpt-oss tensors (the released checkpoints' `*_blocks` / `*_scales`) are
/// refused naming the tensor, with a hint to dequantize; exit 2 and nothing written.
#[test]
fn gpt_oss_mxfp4_blocks_refused_with_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let d = fixture("gpt_oss");
    let hf = tmp.path().join("hf");
    to_hf(
        &d.join("dcp1"),
        &hf,
        "gpt_oss",
        &["--max-shard-size", "5GB"],
    );
    // One more file holding a quantized expert tensor as the hub checkpoints name it.
    let name = "model.layers.0.mlp.experts.gate_up_proj_blocks";
    let header =
        format!(r#"{{"{name}":{{"dtype":"U8","shape":[4,64,2,16],"data_offsets":[0,8192]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + 8192, 0);
    std::fs::write(hf.join("quantized.safetensors"), bytes).unwrap();
    let dcp = tmp.path().join("dcp");
    let o = ckpt()
        .arg("convert")
        .arg(&hf)
        .arg(&dcp)
        .args(["--to", "dcp", "--adapter", "gpt_oss"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(name) && err.contains("MXFP4") && err.contains("dequantize"),
        "{err}"
    );
    assert!(!dcp.join(".metadata").exists());
}
