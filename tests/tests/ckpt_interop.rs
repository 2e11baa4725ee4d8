//! titan-ckpt against real PyTorch: torch writes dcp-hf shards from 2 and 4 gloo ranks (DTensor
//! Shard(0), Shard(1), Replicate, uneven splits, bf16/f16/f32/int64); our consolidation must equal
//! the full tensors exactly and torch's own consolidate_safetensors_files output; our HF output
//! must load in safetensors and transformers.

use std::path::Path;

use titan_tests::{ckpt, python_script, run_ok};

fn write_dcp_hf(dir: &Path, world: u32, extra: &[&str]) {
    run_ok(
        python_script("tests/python/ckpt_write_dcp_hf.py")
            .arg(dir)
            .args(["--world-size", &world.to_string()])
            .args(extra),
    );
}

fn check_hf(out: &Path, expected: &Path, extra: &[&str]) -> String {
    let o = run_ok(
        python_script("tests/python/ckpt_check_hf.py")
            .arg(out)
            .arg(expected)
            .args(extra),
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn two_ranks_with_file_mapping_equal_full_tensors_and_torch() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    write_dcp_hf(d, 2, &["--mapping", "--torch-consolidate"]);
    let sharded = d.join("sharded");

    // inspect --json reports global shapes rebuilt from the shards.
    let o = run_ok(ckpt().arg("inspect").arg(&sharded).arg("--json"));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "dcp-hf");
    let t = |name: &str| {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing"))
            .clone()
    };
    assert_eq!(t("row.bf16")["shape"], serde_json::json!([13, 7]));
    assert_eq!(t("row.bf16")["chunks"], 2);
    assert_eq!(t("col3d.bf16")["shape"], serde_json::json!([2, 9, 3]));
    assert_eq!(t("rep.f16")["chunks"], 1);
    run_ok(ckpt().arg("verify").arg(&sharded));

    // The same fqn -> file mapping torch used, as an HF index.
    let mapping: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(d.join("mapping.json")).unwrap()).unwrap();
    let weight_map: serde_json::Map<String, serde_json::Value> = mapping
        .iter()
        .map(|(k, i)| {
            (
                k.clone(),
                format!("model-{:05}-of-00003.safetensors", i.as_u64().unwrap()).into(),
            )
        })
        .collect();
    let index = d.join("index.json");
    std::fs::write(
        &index,
        serde_json::to_vec(&serde_json::json!({ "weight_map": weight_map })).unwrap(),
    )
    .unwrap();
    let out = d.join("ours");
    run_ok(
        ckpt()
            .arg("consolidate")
            .arg(&sharded)
            .arg(&out)
            .arg("--index-from")
            .arg(&index),
    );
    for i in 1..=3 {
        assert!(
            out.join(format!("model-{i:05}-of-00003.safetensors"))
                .exists()
        );
    }
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(idx["weight_map"]["row.i64"], weight_map["row.i64"]);
    let torch_dir = d.join("torch");
    let report = check_hf(
        &out,
        &d.join("expected.safetensors"),
        &["--torch-dir", torch_dir.to_str().unwrap()],
    );
    assert!(report.contains("torch-compared 6"), "{report}");

    // diff across formats: sharded dcp-hf vs our hf output vs torch's full tensors.
    run_ok(ckpt().arg("diff").arg(&sharded).arg(&out));
    let o = ckpt()
        .arg("diff")
        .arg(&out)
        .arg(&torch_dir)
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "torch's output lacks the int tensors"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let only_a: Vec<&str> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["status"] == "only_in_a")
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(only_a, vec!["col.i64", "rep.i64", "row.i64"]);
}

#[test]
fn four_ranks_split_across_processes_and_dtype_conversion() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    write_dcp_hf(d, 4, &[]);
    let sharded = d.join("sharded");
    let expected = d.join("expected.safetensors");

    // Two processes share the output files; rank 0 writes the index after both are done.
    let out = d.join("ours");
    let spawn = |rank: u32| {
        ckpt()
            .arg("consolidate")
            .arg(&sharded)
            .arg(&out)
            .args([
                "--max-shard-size",
                "300B",
                "--world-size",
                "2",
                "--workers",
                "2",
            ])
            .args(["--rank", &rank.to_string(), "--wait-timeout", "120"])
            .spawn()
            .unwrap()
    };
    let (mut r0, mut r1) = (spawn(0), spawn(1));
    assert!(r0.wait().unwrap().success());
    assert!(r1.wait().unwrap().success());
    let files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(files.len() > 3, "several output files expected: {files:?}");
    assert!(
        files.iter().all(|f| !f.starts_with('.')),
        "temporary files left: {files:?}"
    );
    let report = check_hf(&out, &expected, &[]);
    assert!(report.contains("ok 9"), "{report}");

    // --dtype bf16 converts the float tensors while streaming; int64 stays exact.
    let out16 = d.join("bf16");
    run_ok(ckpt().arg("consolidate").arg(&sharded).arg(&out16).args([
        "--dtype",
        "bf16",
        "--workers",
        "1",
    ]));
    assert!(out16.join("model.safetensors").exists());
    check_hf(&out16, &expected, &["--dtype", "bfloat16"]);

    // Small windows force the column-sharded tensors through many row blocks.
    let small = d.join("small");
    run_ok(
        ckpt()
            .arg("consolidate")
            .arg(&sharded)
            .arg(&small)
            .args(["--window", "16B"]),
    );
    check_hf(&small, &expected, &[]);

    // diff notices the bf16 rounding unless atol allows it.
    let o = ckpt().arg("diff").arg(&out).arg(&out16).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stdout).contains("DIFFERENT"));
    run_ok(
        ckpt()
            .arg("diff")
            .arg(&out)
            .arg(&out16)
            .args(["--atol", "0.1"]),
    );
}

#[test]
fn llama3_to_hf_loads_in_transformers_and_converts_back() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    run_ok(
        python_script("tests/python/ckpt_llama.py")
            .arg("make")
            .arg(d),
    );
    let titan = d.join("titan");
    let hf = d.join("hf");
    run_ok(ckpt().arg("convert").arg(&titan).arg(&hf).args([
        "--to",
        "hf",
        "--adapter",
        "llama3",
        "--n-heads",
        "4",
        "--max-shard-size",
        "100KB",
    ]));
    assert!(hf.join("config.json").exists());
    assert!(hf.join("model.safetensors.index.json").exists());
    let o = run_ok(
        python_script("tests/python/ckpt_llama.py")
            .arg("check")
            .arg(&hf)
            .arg(d),
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok"));

    // Back to the fixture's (pre-0.3.0) torchtitan names as dcp-hf: identical to the original.
    let back = d.join("back");
    run_ok(ckpt().arg("convert").arg(&hf).arg(&back).args([
        "--to",
        "dcp-hf",
        "--adapter",
        "llama3",
        "--n-heads",
        "4",
        "--tt-names",
        "legacy",
    ]));
    let o = run_ok(ckpt().arg("inspect").arg(&back).arg("--json"));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "dcp-hf");
    run_ok(ckpt().arg("diff").arg(&titan).arg(&back));

    // Without the head count the permutation is impossible: a usage error.
    let o = ckpt()
        .arg("convert")
        .arg(&titan)
        .arg(d.join("nohead"))
        .args(["--to", "hf", "--adapter", "llama3"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--n-heads"));
    assert!(!d.join("nohead").exists());
}

#[test]
fn dcp_native_from_torch_with_and_without_zstd_round_trips_through_torch() {
    for zstd in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let ck = d.join("ck");
        let mut save = python_script("tests/python/ckpt_dcp_native.py");
        save.arg("save").arg(&ck).args(["--world-size", "2"]);
        if zstd {
            save.arg("--zstd");
        }
        run_ok(&mut save);
        let expected = d.join("expected.safetensors");
        let o = run_ok(ckpt().arg("inspect").arg(&ck).arg("--json"));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["format"], "dcp");
        assert_eq!(v["bytes_items"], serde_json::json!(["train_state.step"]));
        run_ok(ckpt().arg("verify").arg(&ck));

        // dcp -> hf consolidation equals the full tensors.
        let hf = d.join("hf");
        run_ok(ckpt().arg("consolidate").arg(&ck).arg(&hf));
        check_hf(&hf, &expected, &[]);

        // Our dcp output (re-chunked, with the bytes item, zstd or not) loads in torch dcp.load.
        let out = d.join("out");
        let mut conv = ckpt();
        conv.arg("convert")
            .arg(&ck)
            .arg(&out)
            .args(["--to", "dcp", "--window", "64B"]);
        if !zstd {
            conv.args(["--zstd-level", "3"]);
        }
        run_ok(&mut conv);
        let o = run_ok(
            python_script("tests/python/ckpt_dcp_native.py")
                .arg("load")
                .arg(&out)
                .arg(&expected),
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains("ok 9"));
        run_ok(ckpt().arg("diff").arg(&ck).arg(&out));
    }
}
