//! titan-ckpt reads FP8 block-quantized HF checkpoints (the DeepSeek-V3/R1, Kimi-K2 and Qwen3
//! -FP8 releases' layout) and writes dequantized ones, checked against real PyTorch: small
//! DeepSeek-V3- and Qwen3-MoE-shaped checkpoints made with transformers' own configs and torch's
//! float8 dtype (tests/python/ckpt_fp8.py), plus one weight holding every float8 byte.
//!
//! - `--to hf` gives torch's dequantization (`fp8.float() * scale_inv` over ragged blocks) bit
//!   for bit in fp32 and bf16, a config.json without quantization_config, and transformers loads
//!   it with the reference model's logits;
//! - `--to dcp --adapter auto` gives exactly what torchtitan 0.3.0's own `from_hf` makes of the
//!   dequantized weights, loaded by `dcp.load` into torchtitan's model, whose logits are within
//!   1e-4 of transformers' with its routed experts in fp32 (1% as shipped: they run in bf16);
//! - `inspect` shows the scales, and `verify` and `convert` name the tensor of a damaged scale.

use std::path::{Path, PathBuf};

use titan_tests::{
    ckpt, fixture_made_once, output_text, python_script, run_ok, run_says_ok, tt_python_script,
};

const SCRIPT: &str = "tests/python/ckpt_fp8.py";

/// The fixture folder of `flavor` (`make`'s outputs), made on first use.
fn fixture(flavor: &str) -> PathBuf {
    fixture_made_once(SCRIPT, flavor, python_script)
}

/// `convert` of `src` into `out` with `args`; titan's stderr.
fn convert(src: &Path, out: &Path, args: &[&str]) -> String {
    let o = run_ok(ckpt().arg("convert").arg(src).arg(out).args(args));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `check-hf` of titan's HF output `ours` against `d`'s expected tensors in `mode`.
fn check_hf(ours: &Path, d: &Path, mode: &str) -> String {
    run_says_ok(
        python_script(SCRIPT)
            .arg("check-hf")
            .arg(ours)
            .arg(d)
            .arg(mode),
    )
}

/// FP8 -> HF in bf16 (the default) and fp32, each bit-equal to torch's dequantization.
fn to_hf_both_dtypes(flavor: &str) {
    let d = fixture(flavor);
    let tmp = tempfile::tempdir().unwrap();
    let (bf16, f32) = (tmp.path().join("bf16"), tmp.path().join("f32"));
    let err = convert(
        &d.join("hf"),
        &bf16,
        &["--to", "hf", "--max-shard-size=100KB"],
    );
    assert!(
        err.contains("dequantizing") && err.contains("to bf16") && err.contains("_scale_inv"),
        "{err}"
    );
    assert!(err.contains("without its quantization_config"), "{err}");
    check_hf(&bf16, &d, "bf16");
    convert(&d.join("hf"), &f32, &["--to", "hf", "--dtype", "f32"]);
    check_hf(&f32, &d, "f32");
}

#[test]
fn every_float8_code_dequantizes_as_torch_does() {
    to_hf_both_dtypes("codes");
}

#[test]
fn deepseek_v3_fp8_to_hf() {
    to_hf_both_dtypes("deepseek_v3");
}

#[test]
fn qwen3_moe_fp8_to_hf() {
    to_hf_both_dtypes("qwen3_moe");
}

/// FP8 HF -> torchtitan DCP (fp32): `dcp.load` into torchtitan's model equals its own `from_hf`
/// of the dequantized weights, and the model's logits match transformers'.
fn to_dcp(flavor: &str, family: &str) -> String {
    let d = fixture(flavor);
    let tmp = tempfile::tempdir().unwrap();
    let dcp = tmp.path().join("dcp");
    let err = convert(
        &d.join("hf"),
        &dcp,
        &["--to", "dcp", "--adapter", "auto", "--dtype", "f32"],
    );
    assert!(err.contains(&format!("picked {family}")), "{err}");
    run_says_ok(
        tt_python_script(SCRIPT)
            .arg("check-dcp")
            .arg(&dcp)
            .arg(&d)
            .arg(flavor),
    );
    err
}

#[test]
fn deepseek_v3_fp8_to_torchtitan_dcp() {
    let err = to_dcp("deepseek_v3", "deepseek_v3");
    // The MTP layer's own embedding and head copies have no place in torchtitan's MTP layer.
    for dropped in [
        "`model.layers.3.embed_tokens.weight` left out",
        "`model.layers.3.shared_head.head.weight` left out",
    ] {
        assert!(err.contains(dropped), "{err}");
    }
}

#[test]
fn qwen3_moe_fp8_to_torchtitan_dcp() {
    to_dcp("qwen3_moe", "qwen3");
}

#[test]
fn inspect_and_verify_show_the_block_scales() {
    let d = fixture("qwen3_moe");
    let hf = d.join("hf");
    let o = run_ok(ckpt().arg("inspect").arg(&hf));
    let out = String::from_utf8_lossy(&o.stdout);
    // q_proj [192, 160] in 64x32 blocks: 3 x 5 scales.
    assert!(
        out.contains(
            "scales model.layers.0.self_attn.q_proj.weight_scale_inv F32 [3, 5], one per 64x32 block"
        ),
        "{out}"
    );
    let o = run_ok(ckpt().arg("verify").arg(&hf));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("OK") && out.contains("32 FP8 weights' block scales"),
        "{out}"
    );
}

/// A NaN, infinite or zero scale, or a scale tensor of the wrong shape: `verify` fails naming
/// the scale tensor (and the block), `convert` refuses naming it, nothing is written.
#[test]
fn damaged_scales_are_named() {
    let d = fixture("deepseek_v3");
    let tensor = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv";
    for (kind, says) in [
        ("nan", "block scale [1, 0] is NaN"),
        ("inf", "block scale [1, 0] is inf"),
        ("zero", "block scale [1, 0] is 0"),
        ("shape", "block scales have shape [1, 1]"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad");
        run_ok(
            python_script(SCRIPT)
                .arg("damage")
                .arg(&d)
                .arg(&bad)
                .arg(kind)
                .arg(tensor),
        );
        let o = ckpt().arg("verify").arg(&bad).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(1), "{kind}: {}", output_text(&o));
        assert!(
            out.contains("FAILED") && out.contains(tensor) && out.contains(says),
            "{kind}: {out}"
        );
        let out_dir = tmp.path().join("out");
        let o = ckpt()
            .arg("convert")
            .arg(&bad)
            .arg(&out_dir)
            .args(["--to", "dcp", "--adapter", "deepseek_v3"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{kind}: {}", output_text(&o));
        assert!(err.contains(tensor) && err.contains(says), "{kind}: {err}");
        assert!(
            !out_dir.join(".metadata").exists(),
            "{kind}: a DCP was written"
        );
        if kind == "shape" {
            let o = run_ok(ckpt().arg("inspect").arg(&bad));
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(
                out.contains("DOES NOT FIT") && out.contains(tensor),
                "{out}"
            );
        }
    }
}
